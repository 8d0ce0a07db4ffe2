/**
 * pack-files.ts — what a pack's data files (trunk.bin, experts.bin, vision.bin) were when an
 * engine opened them, and whether the paths still name those files unchanged.
 *
 * Why: the engine keeps the files open and reads them for as long as it runs (experts on every
 * cache miss). A file truncated, rewritten or replaced under it either fails a read (the core's
 * KVL_ERR_IO, a PackReadError) or, worse, feeds data the CRC checks no longer cover (each tensor
 * is checked on its first read only). So ChatModel compares before each turn: same file (device
 * and inode), same size, same modification time. A file replaced by rename keeps the engine on
 * the old one, which still reads; it is refused too, because the user meant another pack.
 * Does not own: reading the files (the core), the error class (core-api.ts's PackReadError).
 */
import { statSync, type Stats } from "node:fs";
import { join } from "node:path";

export const PACK_DATA_FILES = ["trunk.bin", "experts.bin", "vision.bin"] as const;

interface FileIdentity {
  readonly path: string;
  readonly dev: number;
  readonly ino: number;
  readonly size: number;
  readonly mtimeMs: number;
}

/** The data files of packDir as they are now; a file that is missing is left out (vision.bin
 * of a pack opened without vision is never read). */
export function packFileIdentities(packDir: string): FileIdentity[] {
  const out: FileIdentity[] = [];
  for (const name of PACK_DATA_FILES) {
    const path = join(packDir, name);
    const st = statSync(path, { throwIfNoEntry: false });
    if (st) out.push(identity(path, st));
  }
  return out;
}

function identity(path: string, st: Stats): FileIdentity {
  return { path, dev: st.dev, ino: st.ino, size: st.size, mtimeMs: st.mtimeMs };
}

/**
 * The first file of `opened` that changed since, as a phrase ("PATH is 4096 bytes, it was
 * 196608 when kvl opened it"), or null when every one is as it was.
 */
export function packFileChange(opened: readonly FileIdentity[]): string | null {
  for (const was of opened) {
    let st: Stats | undefined;
    try {
      st = statSync(was.path, { throwIfNoEntry: false });
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code ?? "";
      return `${was.path} cannot be read any more (${code || (err as Error).message})`;
    }
    if (!st) return `${was.path} is gone (no such file)`;
    if (st.ino !== was.ino || st.dev !== was.dev) return `${was.path} was replaced by another file`;
    if (st.size !== was.size) return `${was.path} is ${st.size} bytes, it was ${was.size} when kvl opened it`;
    if (st.mtimeMs !== was.mtimeMs) return `${was.path} was modified (at ${st.mtime.toISOString()})`;
  }
  return null;
}
