/**
 * user-error.ts — the error a user can fix: bad input, a missing or corrupt file, a refused
 * option. Its message is one clear line or paragraph (what is wrong, what to do); the CLI prints
 * it without a stack trace. Every other exception is a bug.
 *
 * Also owns turning an operating system's file error (ENOENT, EACCES, ENOSPC, ...) into such a
 * line (fsUserError): the CLI's error handler applies it to whatever a command throws.
 */
export class UserError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "UserError";
  }
}

/** What an operating-system error means to a user and what to do about it, by errno code. */
const FS_ERRORS: Readonly<Record<string, { what: string; todo: string }>> = {
  ENOENT: { what: "no such file or folder", todo: "check the path" },
  ENOTDIR: { what: "a part of the path is a file, not a folder", todo: "check the path" },
  EISDIR: { what: "it is a folder, not a file", todo: "give the path of a file" },
  EACCES: { what: "permission denied", todo: "choose a place you have access to, or fix its permissions" },
  EPERM: { what: "operation not permitted", todo: "choose a folder on a disk you can write to" },
  EROFS: { what: "the file system is read-only", todo: "choose a folder on a writable disk" },
  ENOSPC: { what: "no space left on the device", todo: "free some space or choose another disk" },
  EDQUOT: { what: "disk quota exceeded", todo: "free some space or choose another disk" },
  EEXIST: { what: "it already exists", todo: "remove it or choose another path" },
  ELOOP: { what: "too many levels of symbolic links (a link loop?)", todo: "fix the link or choose another path" },
  ENAMETOOLONG: { what: "the name is too long", todo: "choose a shorter path" },
};

/** The failed system call, as a phrase ("cannot create the folder PATH"). */
const SYSCALL_VERBS: Readonly<Record<string, string>> = {
  mkdir: "cannot create the folder", open: "cannot open", read: "cannot read", write: "cannot write",
  rename: "cannot rename", unlink: "cannot delete", rmdir: "cannot remove the folder", rm: "cannot remove",
  scandir: "cannot list the folder", opendir: "cannot list the folder", access: "cannot use",
  stat: "cannot read", lstat: "cannot read", statfs: "cannot read", copyfile: "cannot copy", mkdtemp: "cannot create a folder in",
  ftruncate: "cannot resize", fsync: "cannot flush", readlink: "cannot read the link", symlink: "cannot create the link",
};

/**
 * A file-system error the user can fix (a path that is missing, a file where a folder is needed,
 * no permission, a full or read-only disk, ...) as a UserError naming the path, what is wrong and
 * what to do; null for any other error (a bug keeps its stack).
 */
export function fsUserError(err: unknown): UserError | null {
  if (!(err instanceof Error)) return null;
  const { code, syscall, path, dest } = err as NodeJS.ErrnoException & { dest?: string };
  if (typeof code !== "string" || typeof syscall !== "string" || !Object.hasOwn(FS_ERRORS, code)) return null;
  const { what, todo } = FS_ERRORS[code]!;
  const verb = SYSCALL_VERBS[syscall] ?? `${syscall} failed on`;
  const target = path === undefined ? "" : ` ${path}${dest === undefined ? "" : ` to ${dest}`}`;
  return new UserError(`${verb}${target || " a file"}: ${what} (${code}); ${todo}`);
}
