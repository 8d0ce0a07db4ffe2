/**
 * argv-text.ts — command-line arguments that are not UTF-8, found before any command runs.
 *
 * Why: Node decodes every argument as UTF-8 and turns bytes that are not into U+FFFD, so a file
 * named with such bytes (an old Latin-1 name, a damaged one) can be neither opened ("not found")
 * nor created (kvl would write into a folder whose name has U+FFFD in it). Where the raw bytes
 * can be read (Linux: /proc/self/cmdline) the check is exact; elsewhere (macOS; Windows, where
 * arguments are UTF-16 and a lone surrogate, unholdable too, also arrives as U+FFFD) an argument
 * holding U+FFFD is taken for one that was not.
 * Does not own: the message's prefix or the exit status (cli/program.ts).
 */
import { readFileSync } from "node:fs";

import { UserError } from "./user-error.js";

/** The raw bytes of the last `count` arguments of this process, or null where the OS does not
 * show them. */
function rawArguments(count: number): Buffer[] | null {
  if (process.platform !== "linux") return null;
  let cmdline: Buffer;
  try {
    cmdline = readFileSync("/proc/self/cmdline");
  } catch {
    return null;
  }
  const parts: Buffer[] = [];
  let start = 0;
  for (let i = 0; i < cmdline.length; i++) {
    if (cmdline[i] === 0) {
      parts.push(cmdline.subarray(start, i));
      start = i + 1;
    }
  }
  if (start < cmdline.length) parts.push(cmdline.subarray(start));
  // the user's arguments are the tail: before them node, its own options and the script (or a
  // single executable's path alone)
  return parts.length >= count ? parts.slice(parts.length - count) : null;
}

const UTF8 = new TextDecoder("utf-8", { fatal: true });

function isUtf8(bytes: Buffer): boolean {
  try {
    UTF8.decode(bytes);
    return true;
  } catch {
    return false;
  }
}

/** Bytes shown as text, each byte that is not part of valid UTF-8 as \xNN. */
function shown(bytes: Buffer): string {
  let out = "";
  let i = 0;
  while (i < bytes.length) {
    // the longest valid UTF-8 sequence starting here (1 to 4 bytes)
    let taken = 0;
    for (let n = 1; n <= 4 && i + n <= bytes.length; n++) {
      if (isUtf8(bytes.subarray(i, i + n))) {
        taken = n;
        break;
      }
    }
    if (taken === 0) {
      out += `\\x${bytes[i]!.toString(16).padStart(2, "0")}`;
      i++;
    } else {
      const text = bytes.subarray(i, i + taken).toString("utf8");
      out += /[\u0000-\u001f\u007f]/.test(text) ? `\\x${bytes[i]!.toString(16).padStart(2, "0")}` : text;
      i += taken;
    }
  }
  return out;
}

/**
 * A UserError for the first of `args` (process.argv.slice(2)) that is not UTF-8, naming it
 * (its bad bytes as \xNN where they are known) and saying why and what to do; null when all are.
 */
export function nonUtf8Argument(args: readonly string[]): UserError | null {
  const raw = rawArguments(args.length);
  for (let i = 0; i < args.length; i++) {
    const bytes = raw?.[i];
    const bad = bytes !== undefined ? !isUtf8(bytes) : args[i]!.includes("\uFFFD");
    if (!bad) continue;
    const todo = "rename the file or folder to a UTF-8 name (or pass a link that has one) and run the command again";
    if (bytes === undefined) {
      // the bytes are not known here, only that the OS or Node replaced some by U+FFFD
      return new UserError(`the argument '${args[i]!}' holds characters that are not valid text (shown as \uFFFD): Node.js cannot ` +
        `hold such a name, so kvl can neither open nor create a file of that name; ${todo}`);
    }
    return new UserError(`the argument '${shown(bytes)}' is not valid UTF-8 text: Node.js reads command-line arguments as UTF-8, ` +
      `so kvl can neither open nor create a file of that name; ${todo}`);
  }
  return null;
}
