/**
 * user-error.ts — the error a user can fix: bad input, a missing or corrupt file, a refused
 * option. Its message is one clear line or paragraph (what is wrong, what to do); the CLI prints
 * it without a stack trace. Every other exception is a bug.
 */
export class UserError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "UserError";
  }
}
