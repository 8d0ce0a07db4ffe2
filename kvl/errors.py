"""Errors that reach the user as one clear line (what is wrong, what to do)."""


class UserError(Exception):
    """A problem the user can fix: bad input, a missing or corrupt file, a plan over budget."""
