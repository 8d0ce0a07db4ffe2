/**
 * file-kind.ts — what a path names, without throwing: a file, a directory, or nothing (a missing
 * path, or one this process may not stat). For checks that turn into clear messages; code that
 * then opens the file still handles its errors. requireFolder is the one-line refusal of a path
 * that should name an existing folder (a pack, a checkpoint).
 */
import { statSync } from "node:fs";

import { UserError, fsUserError } from "../system/user-error.js";

export function pathExists(path: string): boolean {
  try {
    return statSync(path, { throwIfNoEntry: false }) !== undefined;
  } catch {
    return false;
  }
}

export function isFile(path: string): boolean {
  try {
    return statSync(path, { throwIfNoEntry: false })?.isFile() ?? false;
  } catch {
    return false;
  }
}

export function isDir(path: string): boolean {
  try {
    return statSync(path, { throwIfNoEntry: false })?.isDirectory() ?? false;
  } catch {
    return false;
  }
}

/**
 * Throws a one-line UserError unless `path` is an existing folder: `what` names what it should be
 * ("model directory"), `hint` says where one comes from; a path this process cannot look at
 * (a symlink loop, a file in the middle, ...) says why.
 */
export function requireFolder(path: string, what: string, hint: string): void {
  let stats;
  try {
    stats = statSync(path);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") throw new UserError(`${path}: no such ${what}; ${hint}`);
    throw fsUserError(err) ?? err;
  }
  if (!stats.isDirectory()) throw new UserError(`${path} is a file, not a ${what}; ${hint}`);
}
