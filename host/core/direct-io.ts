/**
 * direct-io.ts — how each backend reads the model past the OS's page cache on a platform, and what
 * to do where a model's reads came out buffered: what `kvl doctor` says about direct reads.
 *
 * Owns: those per-platform, per-backend facts and advice. Does not own: the reads themselves (the
 * native core's platform.h; the WebAssembly read port, wasm-core/src/platform_wasm.c, whose choice
 * of open flag this mirrors) or whether a given pack's filesystem allowed them (the engine's info
 * says, per store, after its probe read at open).
 */
import { constants as fsConstants } from "node:fs";

import type { BackendName } from "./core-api.js";

/** The platform facts the answers depend on (process's by default; tests pass others). */
export interface IoPlatform {
  readonly platform: NodeJS.Platform;
  /** Node's fs.constants.O_DIRECT exists (Linux, not Windows or macOS). */
  readonly nodeHasODirect: boolean;
}

export const THIS_PLATFORM: IoPlatform = { platform: process.platform, nodeHasODirect: fsConstants.O_DIRECT !== undefined };

export interface DirectReadSupport {
  /** The backend asks the OS to bypass its page cache here. */
  readonly supported: boolean;
  /** How (or why not), in a few words. */
  readonly detail: string;
}

/** How `backend` bypasses the page cache on `io`'s platform, or why it cannot. */
export function directReadSupport(backend: BackendName, io: IoPlatform = THIS_PLATFORM): DirectReadSupport {
  const win = io.platform === "win32";
  if (backend === "native") {
    if (win) {
      return { supported: true, detail: "FILE_FLAG_NO_BUFFERING, 4096-aligned reads checked against the volume's " +
        "sector size (buffered on a volume that needs more, or refuses them)" };
    }
    if (io.platform === "darwin") return { supported: true, detail: "F_NOCACHE (reads kept out of the unified buffer cache)" };
    return { supported: true, detail: "O_DIRECT, 4096-aligned reads (buffered where the filesystem refuses it)" };
  }
  if (win) {
    return { supported: true, detail: "FILE_FLAG_NO_BUFFERING through libuv's UV_FS_O_DIRECT open flag, 4096-aligned " +
      "reads (buffered where the volume refuses them)" };
  }
  if (io.nodeHasODirect) return { supported: true, detail: "O_DIRECT through Node's fs, 4096-aligned reads (buffered where the filesystem refuses it)" };
  return { supported: false, detail: `none: Node's fs has no page-cache bypass on ${io.platform}, so reads are buffered ` +
    "(the native backend bypasses it)" };
}

/** What to do when `backend`'s reads of the model in `where` came out buffered. */
export function bufferedReadAdvice(backend: BackendName, where: string, io: IoPlatform = THIS_PLATFORM): string {
  const support = directReadSupport(backend, io);
  if (!support.supported) return `${support.detail}; use --backend native for a hard cap`;
  if (io.platform === "win32") {
    return `the volume of ${where} refuses unbuffered reads (a network share, or sectors larger than 4096 bytes), so ` +
      "Windows' file cache holds model data outside the RAM plan; move the model to a local NTFS disk for a hard cap";
  }
  if (io.platform === "darwin") {
    return `the filesystem of ${where} refuses F_NOCACHE, so the buffer cache holds model data outside the RAM plan; ` +
      "move the model to an internal APFS disk for a hard cap";
  }
  return `the filesystem of ${where} refuses O_DIRECT (tmpfs, overlayfs and some network filesystems do), so the ` +
    "page cache holds model data outside the RAM plan; move the model to ext4 or xfs for a hard cap";
}
