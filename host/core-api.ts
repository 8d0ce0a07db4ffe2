/**
 * core-api.ts — what the host sees of the C core (wasm-core/include/kvl_core.h), the same on
 * both backends.
 *
 * Owns: the TypeScript types of the core's public API as the host uses it, and the parsing of
 * the conformance report. Does not own: loading either backend (wasm-backend.ts,
 * native-backend.ts) or choosing between them (backend.ts).
 */

export type BackendName = "wasm" | "native";

/** A kernel set is one dispatch table of the core ("scalar", "simd128", "avx2", ...). */
export interface KernelSet {
  readonly name: string;
  /** This CPU and OS can run it (and it is compiled into this backend). */
  readonly supported: boolean;
}

export interface ConformanceCheck {
  readonly kernel: string;
  readonly shape: string;
  /** null when the kernel produced a non-finite result. */
  readonly max_err: number | null;
  readonly bound: number;
  readonly ok: boolean;
}

export interface ConformanceReport {
  /** The set that was asked for. */
  readonly set: string;
  /** The name of the table whose functions actually ran. */
  readonly table: string;
  readonly checks: readonly ConformanceCheck[];
  readonly failed: number;
}

/** The kernel-set API of kvl_core.h; the engine API joins it with the text engine. */
export interface CoreBackend {
  readonly backend: BackendName;
  abiVersion(): number;
  kernelSets(): KernelSet[];
  /** The set KVL_KERNELS_AUTO picks on this machine. */
  defaultKernelSet(): string;
  /** Runs kvl_kernels_conformance; throws for a set this backend cannot run. */
  conformance(set: string): ConformanceReport;
  /** Releases threads and memory; the backend is unusable afterwards. */
  close(): void;
}

export function parseConformanceReport(json: string, set: string): ConformanceReport {
  let parsed: unknown;
  try {
    parsed = JSON.parse(json);
  } catch (err) {
    throw new Error(`kernel set ${set}: the core's conformance report is not JSON (${String(err)})`);
  }
  const r = parsed as Partial<ConformanceReport>;
  if (typeof r.table !== "string" || !Array.isArray(r.checks) || typeof r.failed !== "number") {
    throw new Error(`kernel set ${set}: the core's conformance report lacks table/checks/failed`);
  }
  return r as ConformanceReport;
}
