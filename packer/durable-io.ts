/**
 * durable-io.ts — file writes that survive a crash: atomic replacement (temp file + fsync +
 * rename + directory fsync), directory fsync, and positional writes of a whole buffer.
 *
 * Owns: the durability primitives the packer's journal relies on. Does not own: what is written
 * or when (pack.ts).
 */
import { type FileHandle, open, rename } from "node:fs/promises";
import { basename, dirname, join } from "node:path";

/** Positional writes move at most this much per call (Node caps one call near 2 GiB). */
const IO_CHUNK = 1 << 30;

/** fsync a directory, so a rename or unlink in it is durable (a no-op on Windows, where
 * directories cannot be opened for fsync). */
export async function fsyncDir(path: string): Promise<void> {
  if (process.platform === "win32") return;
  const handle = await open(path, "r");
  try {
    await handle.sync();
  } finally {
    await handle.close();
  }
}

/** Writes via PATH.tmp + fsync + rename, so a crash leaves either the old or the new file. */
export async function writeAtomic(path: string, data: Uint8Array): Promise<void> {
  const tmp = join(dirname(path), `${basename(path)}.tmp`);
  const handle = await open(tmp, "w");
  try {
    await writeAllAt(handle, data, 0);
    await handle.sync();
  } finally {
    await handle.close();
  }
  await rename(tmp, path);
  await fsyncDir(dirname(path));
}

/** Writes all of `data` at `offset` (positional; the file position is not used). */
export async function writeAllAt(handle: FileHandle, data: Uint8Array, offset: number): Promise<void> {
  let done = 0;
  while (done < data.length) {
    const { bytesWritten } = await handle.write(data, done, Math.min(data.length - done, IO_CHUNK), offset + done);
    done += bytesWritten;
  }
}
