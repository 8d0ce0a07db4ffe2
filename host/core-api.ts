/**
 * core-api.ts — what the host sees of the C core (wasm-core/include/kvl_core.h), the same on
 * both backends.
 *
 * Owns: the TypeScript types of the core's public API as the host uses it, and the parsing of
 * the conformance report. Does not own: loading either backend (wasm-backend.ts,
 * native-backend.ts) or choosing between them (backend.ts).
 */

import type { CoreEngine, EngineOptions } from "./engine-api.js";

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

/** kvl_sampler's parameters (its generator state travels separately). */
export interface SamplerParams {
  temperature: number;
  topK: number;
  topP: number;
}

/** 4 words: state_hi, state_lo, inc_hi, inc_lo of a kvl_pcg64 (numpy's PCG64). */
export type Pcg64State = BigUint64Array;

/** The packing API of kvl_core.h: the packer's arithmetic, the same bytes on every backend. */
export interface PackingCore {
  /** Bytes of one Q8_EXPERT extent (docs/FORMAT.md) for moe_intermediate I and hidden H. */
  expertExtentBytes(intermediate: number, hidden: number): number;
  /** One Q8_EXPERT extent from the BF16 bits of gate [I, H], up [I, H], down [H, I]; throws
   * when a weight is NaN or infinite. */
  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array;
  /** One Q8_ROWS record (docs/FORMAT.md; q8RowsLayout(rows, cols).nbytes bytes) from the BF16
   * bits of a [rows, cols] matrix, quantised as the experts are; throws when a weight is NaN or
   * infinite. */
  packQ8Rows(w: Uint16Array, rows: number, cols: number): Uint8Array;
  /** A generator state from the 4 seed words numpy's SeedSequence gives. */
  pcg64Seed(seedWords: BigUint64Array): Pcg64State;
  /** Fills out[0, count) with uniform values (kvl_synth_uniform), advancing state: BF16 bits
   * into a Uint16Array, FP32 into a Float32Array. Every call of a stream but the last takes an
   * even count. */
  synthUniform(state: Pcg64State, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void;
}

/** kvl_status codes (kvl_core.h). */
export const KVL_STATUS_NAMES: Readonly<Record<number, string>> = {
  0: "ok", 1: "I/O error", 2: "format error", 3: "config error", 4: "out of memory",
  5: "invalid argument", 6: "context full", 7: "cancelled", 8: "unsupported", 9: "internal error",
  10: "corrupt pack data",
};
export const KVL_ERR_FORMAT = 2;
/** Pack data read at run time does not match its CRC-32 (kvl_core.h KVL_ERR_CORRUPT). */
export const KVL_ERR_CORRUPT = 10;

/** The kernel-set, packing and text-engine API of kvl_core.h. */
export interface CoreBackend extends PackingCore {
  readonly backend: BackendName;
  abiVersion(): number;
  kernelSets(): KernelSet[];
  /** The set KVL_KERNELS_AUTO picks on this machine. */
  defaultKernelSet(): string;
  /** Runs kvl_kernels_conformance; throws for a set this backend cannot run. */
  conformance(set: string): ConformanceReport;
  /** Opens a pack as a text engine (engine-api.ts); throws CoreError naming what is wrong. */
  openEngine(packDir: string, options?: EngineOptions): CoreEngine;
  /**
   * kvl_sample: one token from logits (used as scratch: they are overwritten). Greedy when
   * temperature <= 0 (lowest index on ties); else temperature, top-k (0 = off), softmax, top-p
   * (0 or >= 1 = off), one draw from the generator state rng[0], advanced in place.
   */
  sampleToken(logits: Float32Array, params: SamplerParams, rng: BigUint64Array): number;
  /** The generator state kvl_sampler_seed makes of a 64-bit seed (BigUint64Array(1)). */
  seedSampler(seed: bigint): BigUint64Array;
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

/** Validates packExpert's arguments the same way on both backends. */
export function checkPackExpertArgs(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): void {
  const n = intermediate * hidden;
  if (!Number.isInteger(n) || n <= 0 || gate.length !== n || up.length !== n || down.length !== n) {
    throw new RangeError(`packExpert: gate, up and down must each hold I x H = ${intermediate} x ${hidden} BF16 values`);
  }
}

/** Validates packQ8Rows's arguments the same way on both backends. */
export function checkPackQ8RowsArgs(w: Uint16Array, rows: number, cols: number): void {
  const n = rows * cols;
  if (!Number.isInteger(n) || n <= 0 || w.length !== n) {
    throw new RangeError(`packQ8Rows: the matrix must hold rows x cols = ${rows} x ${cols} BF16 values`);
  }
}

/** Throws for a failed kvl_pack_q8_rows. */
export function packQ8RowsStatus(status: number): void {
  if (status === KVL_ERR_FORMAT) throw new Error("a weight is NaN or infinite: the checkpoint is corrupt; re-download it");
  if (status !== 0) throw new Error(`kvl_pack_q8_rows failed: ${KVL_STATUS_NAMES[status] ?? `status ${status}`}`);
}

/** Throws for a failed kvl_pack_expert. */
export function packExpertStatus(status: number): void {
  if (status === KVL_ERR_FORMAT) {
    throw new Error("an expert weight is NaN or infinite: the checkpoint is corrupt; re-download it");
  }
  if (status !== 0) throw new Error(`kvl_pack_expert failed: ${KVL_STATUS_NAMES[status] ?? `status ${status}`}`);
}
