/**
 * file-kind.ts — what a path names, without throwing: a file, a directory, or nothing (a missing
 * path, or one this process may not stat). For checks that turn into clear messages; code that
 * then opens the file still handles its errors.
 */
import { statSync } from "node:fs";

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
