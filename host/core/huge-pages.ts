/**
 * huge-pages.ts — Linux transparent huge pages (THP), as they bear on the model's direct reads.
 *
 * Owns: reading the system's THP mode (Linux only: none elsewhere, even where that file can be
 * read) and what it means for a backend. Direct reads land in the
 * expert cache's memory; into 4 KiB pages they ran 1.3-1.6x slower than into 2 MiB pages on the
 * virtio disk where this was measured (bench/RESULTS.md "Idle workers, huge pages and prefill
 * products", 2026-12-04), and a WebAssembly decode at a 4 GiB plan varied more. The native core
 * asks for huge pages on its caches itself (madvise, wasm-core/src/platform.h), so it has them
 * unless THP is off. A WebAssembly memory is mapped by V8 and nothing in JavaScript can madvise
 * it: it gets huge pages only when the mode is "always".
 */
import { readFileSync } from "node:fs";

import type { BackendName } from "./core-api.js";

export type ThpMode = "always" | "madvise" | "never";

const THP_ENABLED_PATH = "/sys/kernel/mm/transparent_hugepage/enabled";

const ENABLE_ALWAYS = `echo always | sudo tee ${THP_ENABLED_PATH}`;

/** The selected mode of a THP "enabled" file ("always [madvise] never" -> "madvise"), or null. */
export function parseThpMode(text: string): ThpMode | null {
  const selected = /\[(\w+)\]/.exec(text)?.[1];
  return selected === "always" || selected === "madvise" || selected === "never" ? selected : null;
}

/** This system's THP mode; null where there is none to read (not Linux, or no THP support). The
 * platform is checked first: under Wine a Windows process reads Linux's own file at that path. */
export function readThpMode(path: string = THP_ENABLED_PATH, platform: NodeJS.Platform = process.platform): ThpMode | null {
  if (platform !== "linux") return null;
  try {
    return parseThpMode(readFileSync(path, "utf8"));
  } catch {
    return null;
  }
}

interface HugePageAdvice {
  readonly status: "OK" | "WARN";
  readonly detail: string;
}

/** What `mode` means for the direct reads of `backend`; null where the OS has no THP setting. */
export function hugePageAdvice(backend: BackendName, mode: ThpMode | null): HugePageAdvice | null {
  if (mode === null) return null;
  if (mode === "never") {
    return { status: "WARN", detail: `transparent huge pages are off ("never"): direct reads land in 4 KiB pages, ` +
      `1.3-1.6x slower than in huge pages where measured; to turn them on: ${ENABLE_ALWAYS}` };
  }
  if (backend === "native") {
    return { status: "OK", detail: `transparent huge pages "${mode}": the native core asks for them on its caches` };
  }
  if (mode === "always") {
    return { status: "OK", detail: "transparent huge pages \"always\": the WebAssembly memory gets them too" };
  }
  return { status: "WARN", detail: `transparent huge pages "madvise": the WebAssembly memory gets none (JavaScript cannot ` +
    `ask for them), so expert reads land in 4 KiB pages, 1.3-1.6x slower where measured; for faster reads when the ` +
    `model does not fit in RAM: ${ENABLE_ALWAYS}` };
}
