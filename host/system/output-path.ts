/**
 * output-path.ts — where a command writes (kvl pack's DST, kvl synth's OUT, kvl prepare's DST,
 * kvl bench --out): refused up front with one clear line when it cannot be written, and a folder
 * created without Node's recursive mkdir.
 *
 * Owns: checkOutputDir (nothing is created: the path, or its first existing ancestor, must be a
 * folder this process may write in, on a disk rather than a kernel file system such as /proc or
 * /sys), checkOutputFile (the same for a file such as kvl bench --out: its folder must exist) and
 * makeOutputDir (creates the missing folders one level at a time). Node's
 * `mkdir(path, { recursive: true })` never returns for a path under /proc (the kernel answers
 * ENOENT for a child of a folder that exists, and Node retries the parent forever), so no
 * command creates its output folder with it.
 * Does not own: what goes into the folder, or whether its contents may be reused (the packer).
 */
import { accessSync, constants, mkdirSync, statSync, statfsSync, type Stats } from "node:fs";
import { dirname } from "node:path";

import { UserError, fsUserError } from "./user-error.js";

/** Linux kernel file systems (statfs f_type) that hold no files of ours. */
const KERNEL_FILE_SYSTEMS: ReadonlyMap<number, string> = new Map([
  [0x9fa0, "proc"], [0x62656572, "sysfs"], [0x27e0eb, "cgroup"], [0x63677270, "cgroup2"], [0x64626720, "debugfs"],
  [0x74726163, "tracefs"], [0x73636673, "securityfs"], [0x1cd1, "devpts"], [0xcafe4a11, "bpf"], [0x6165676c, "pstore"],
  [0x62656570, "configfs"], [0xde5e81e1, "efivarfs"], [0x65735543, "fusectl"],
]);

/** stat, or null where nothing is (also for a path through a file: ENOTDIR); other errors as UserError. */
function statOrNull(path: string): Stats | null {
  try {
    return statSync(path, { throwIfNoEntry: false }) ?? null;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOTDIR") return null;
    throw fsUserError(err) ?? err;
  }
}

/** The path's first existing ancestor (the path itself when it exists), spelt as the path is. */
function firstExisting(path: string): { dir: string; stats: Stats } {
  let dir = path;
  for (;;) {
    const stats = statOrNull(dir);
    if (stats !== null) return { dir, stats };
    const parent = dirname(dir);
    if (parent === dir) throw new UserError(`${path}: no folder of this path exists; check the path`);
    dir = parent;
  }
}

/** An existing folder `dir` this process may create files in, on a disk: else a UserError
 * starting with `label` (the option and the path the user gave). */
function checkWritableFolder(dir: string, label: string): void {
  if (process.platform === "linux") {
    let type: number | undefined;
    try {
      type = statfsSync(dir).type;
    } catch {
      type = undefined; // an unusual file system: the writes report what goes wrong
    }
    const kernel = type === undefined ? undefined : KERNEL_FILE_SYSTEMS.get(type);
    if (kernel !== undefined) {
      throw new UserError(`${label} is on ${dir}, a ${kernel} kernel file system that holds no files; choose a folder on a disk`);
    }
  }
  try {
    accessSync(dir, constants.W_OK | constants.X_OK);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "EROFS") throw new UserError(`${label}: ${dir} is on a read-only file system; choose a folder on a writable disk`);
    if (code === "EACCES" || code === "EPERM") throw new UserError(`${label}: no permission to write in ${dir}; choose a folder you can write to`);
    throw fsUserError(err) ?? err;
  }
}

/**
 * Throws a one-line UserError unless `path` is, or can be created as, a folder this process may
 * write in; creates nothing. `what` names the path in the message ("DST", "OUT").
 */
export function checkOutputDir(path: string, what: string): void {
  const label = `${what} ${path}`;
  const { dir, stats } = firstExisting(path);
  if (!stats.isDirectory()) {
    throw new UserError(dir === path
      ? `${label} is a file, not a folder; choose a folder (a new one, or one kvl wrote)`
      : `${label}: ${dir} is a file, not a folder; choose another path`);
  }
  checkWritableFolder(dir, label);
}

/**
 * Throws a one-line UserError unless `path` can be written as a file (e.g. `--out FILE`): not a
 * folder, in an existing folder this process may write in; creates nothing.
 */
export function checkOutputFile(path: string, what: string): void {
  const label = `${what} ${path}`;
  if (statOrNull(path)?.isDirectory()) throw new UserError(`${label} is a folder; give the path of a file`);
  const parent = dirname(path);
  const { dir, stats } = firstExisting(parent);
  if (!stats.isDirectory()) throw new UserError(`${label}: ${dir} is a file, not a folder; choose another path`);
  if (dir !== parent) throw new UserError(`${label}: the folder ${parent} does not exist; create it or choose another path`);
  checkWritableFolder(dir, label);
}

/**
 * Creates `path` and its missing parents one level at a time, after checkOutputDir; every
 * failure is a one-line UserError naming the folder (never a hang, never a stack).
 */
export function makeOutputDir(path: string, what: string): void {
  checkOutputDir(path, what);
  const missing: string[] = [];
  for (let dir = path; statOrNull(dir) === null; dir = dirname(dir)) missing.unshift(dir);
  for (const dir of missing) {
    try {
      mkdirSync(dir);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === "EEXIST" && statOrNull(dir)?.isDirectory()) continue; // made by someone else meanwhile
      if (code === "ENOENT") {
        throw new UserError(`cannot create the folder ${dir}: its file system refuses new folders; choose a folder on a disk`);
      }
      throw fsUserError(err) ?? err;
    }
  }
}
