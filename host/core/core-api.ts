/**
 * core-api.ts — what the host sees of the C core (wasm-core/include/kvl_core.h), the same on
 * both backends: kernel sets, packing, sampling, and the engine (kvl_engine_*, kvl_session_*
 * and the vision encoder kvl_vision_*).
 *
 * Owns: the TypeScript types of the core's public API as the host uses it (engine options, info
 * and stats; the CoreBackend / CoreEngine / CoreSession interfaces each backend implements), the
 * JS form of the core's struct layout tables (StructLayout, and jsFieldName: a C member's JS
 * property name), the
 * parsing of the conformance report, the translation of options to the C enums, CoreError (a
 * failed kvl_status with the core's detail message) and CorruptPackError (the main thread's form
 * of KVL_ERR_CORRUPT), the shape arithmetic of a vision call (visionShape) and roundToBf16 (media
 * rows as the official model feeds them). Does not own: loading either backend (wasm-backend.ts,
 * native-backend.ts), choosing between them (backend.ts), or marshalling (each backend does its
 * own: the addon takes typed arrays, the wasm instance copies through its memory).
 */
import { UserError } from "../system/user-error.js";

export type BackendName = "wasm" | "native";

/** A kernel set is one dispatch table of the core ("scalar", "simd128", "avx2", ...). */
export interface KernelSet {
  readonly name: string;
  /** This CPU and OS can run it (and it is compiled into this backend). */
  readonly supported: boolean;
}

interface ConformanceCheck {
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
  /** Bytes of one Q4_EXPERT extent (docs/FORMAT.md); throws unless I and H are positive
   * multiples of 32. */
  expertQ4ExtentBytes(intermediate: number, hidden: number): number;
  /** One Q4_EXPERT extent (groups of 32 with a BF16 scale) from the BF16 bits of gate [I, H],
   * up [I, H], down [H, I]; throws unless I and H are positive multiples of 32, and when a
   * weight is NaN or infinite. */
  packExpertQ4(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array;
  /** A generator state from the 4 seed words numpy's SeedSequence gives. */
  pcg64Seed(seedWords: BigUint64Array): Pcg64State;
  /** Fills out[0, count) with uniform values (kvl_synth_uniform), advancing state: BF16 bits
   * into a Uint16Array, FP32 into a Float32Array. Every call of a stream but the last takes an
   * even count. */
  synthUniform(state: Pcg64State, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void;
}

/** kvl_status codes and their texts (kvl_core.h KVL_STATUS_ROWS, kvl_strerror): needed before any
 * core is loaded, so spelled here, and test/boundary.test.ts fails where they differ from the
 * core's table (kvl_constants) on either backend. */
export const KVL_STATUS_NAMES: Readonly<Record<number, string>> = {
  0: "ok", 1: "I/O error", 2: "corrupt or unsupported pack file", 3: "pack configuration mismatch", 4: "out of memory",
  5: "invalid argument", 6: "context full", 7: "cancelled", 8: "unsupported", 9: "internal error",
  10: "pack data does not match its CRC (corrupt file)",
};
/** kvl_session_cancel interrupted the call (kvl_core.h KVL_ERR_CANCELLED). */
export const KVL_ERR_CANCELLED = 7;
const KVL_ERR_FORMAT = 2;
/** Pack data read at run time does not match its CRC-32 (kvl_core.h KVL_ERR_CORRUPT). */
export const KVL_ERR_CORRUPT = 10;
/** A read or open failed (kvl_core.h KVL_ERR_IO): a short read, EIO, a file or disk gone. */
export const KVL_ERR_IO = 1;

/** The kernel-set, packing and text-engine API of kvl_core.h. */
export interface CoreBackend extends PackingCore {
  readonly backend: BackendName;
  abiVersion(): number;
  kernelSets(): KernelSet[];
  /** The set KVL_KERNELS_AUTO picks on this machine. */
  defaultKernelSet(): string;
  /** Runs kvl_kernels_conformance; throws for a set this backend cannot run. */
  conformance(set: string): ConformanceReport;
  /** Opens a pack as a text engine (CoreEngine below); throws CoreError naming what is wrong. */
  openEngine(packDir: string, options?: EngineOptions): CoreEngine;
  /** kvl_struct_layout: the layout of a boundary struct in this core, with the JS names. */
  structLayout(which: StructId): StructLayout;
  /** kvl_constants: one list of the core's codes (KVL_CONSTANTS), {name, value} in C order. */
  constants(which: ConstantsId): ConstantRow[];
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

/** Validates packExpert's (or packExpertQ4's: fn) arguments the same way on both backends. */
export function checkPackExpertArgs(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number, fn = "packExpert"): void {
  const n = intermediate * hidden;
  if (!Number.isInteger(n) || n <= 0 || gate.length !== n || up.length !== n || down.length !== n) {
    throw new RangeError(`${fn}: gate, up and down must each hold I x H = ${intermediate} x ${hidden} BF16 values`);
  }
}

/** Q4 experts need I and H to be whole groups of 32 columns (docs/FORMAT.md Q4_EXPERT). */
export function checkQ4ExpertDims(intermediate: number, hidden: number, fn: string): void {
  const ok = (v: number): boolean => Number.isSafeInteger(v) && v > 0 && v % 32 === 0;
  if (!ok(intermediate) || !ok(hidden)) {
    throw new RangeError(`${fn}: Q4 experts need moe_intermediate_size (${intermediate}) and hidden_size (${hidden}) to be positive multiples of 32; use Q8 experts for this model`);
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

/** Throws for a failed kvl_pack_expert (or kvl_pack_expert_q4: fn). */
export function packExpertStatus(status: number, fn = "kvl_pack_expert"): void {
  if (status === KVL_ERR_FORMAT) {
    throw new Error("an expert weight is NaN or infinite: the checkpoint is corrupt; re-download it");
  }
  if (status !== 0) throw new Error(`${fn} failed: ${KVL_STATUS_NAMES[status] ?? `status ${status}`}`);
}


type IoMode = "auto" | "direct" | "buffered";
/** kvl_core.h KVL_LOOKAHEAD_*: auto reads the next layer's predicted experts ahead whenever the
 * expert cache cannot hold every extent; off never does (results are the same either way). */
export type ExpertLookahead = "auto" | "off";
/** kvl_core.h KVL_CACHE_POLICY_*: what the expert cache evicts by (expert_cache.c pick_victim):
 * adaptive (the default) follows whichever of lru and frequency its key-only shadows show hitting
 * more lately. A measurement choice (kvl bench --cache-policy): results are the same under each. */
export type CachePolicy = "adaptive" | "frequency" | "lru";
export const CACHE_POLICIES: readonly CachePolicy[] = ["adaptive", "frequency", "lru"];
/** --kernels: simd128 and simd128-relaxed also pick the WebAssembly build (wasm-relaxed.ts). */
export type KernelChoice = "auto" | "scalar" | "avx2" | "avx512" | "simd128" | "simd128-relaxed";
export const KERNEL_CHOICES: readonly KernelChoice[] = ["auto", "scalar", "avx2", "avx512", "simd128", "simd128-relaxed"];
type NumericDtype = "f32" | "bf16";
/** Inputs of the Linear layers (kvl_core.h KVL_ACT_*): f32 exact, bf16 rounded, i16x1 and i8
 * the integer modes (i8: i16x1 with the routed experts' inputs 8-bit; README "Numerics"). The
 * core's code 3, the former two-term mode i16, is reserved and refused. */
export type ActDtype = NumericDtype | "i16x1" | "i8";
export const ACT_DTYPE_NAMES: readonly ActDtype[] = ["f32", "bf16", "i16x1", "i8"];

/** The integer modes: resident BF16 trunk weights become int16 rows, a workspace holds the
 * quantised inputs (the RAM plan counts both), and the KV cache is int16, so that attention runs
 * on integers too. */
export const isIntegerAct = (a: ActDtype): boolean => a === "i16x1" || a === "i8";

/** The KV cache's rows (kvl_core.h KVL_KV_*): f32, bf16, or i16 (int16 rows with a scale each
 * and the latents in transposed tiles), which goes with act dtype i16x1 or i8 and only with them. */
export type KvDtype = NumericDtype | "i16";
export const KV_DTYPE_NAMES: readonly KvDtype[] = ["f32", "bf16", "i16"];
/** The core's default (KVL_KV_DEFAULT): i16 with act dtype i16x1 or i8, else f32. */
export const defaultKvDtype = (act: ActDtype): KvDtype => (isIntegerAct(act) ? "i16" : "f32");

/**
 * The structs that cross the boundary (kvl_core.h KVL_STRUCT_*): kvl_engine_options,
 * kvl_engine_info and kvl_stats. Neither backend spells out their fields: both convert them from
 * the core's own layout table (kvl_struct_layout), the addon in C and the WebAssembly engine in
 * its memory (wasm-engine.ts). EngineOptions, EngineInfo and EngineStats below are their
 * TypeScript types, one property per member named by jsFieldName (test/boundary.test.ts holds the
 * two to each other): adding a member is its row in kvl_core.h and its property here.
 */
export const KVL_STRUCTS = { engineOptions: 1, engineInfo: 2, stats: 3 } as const;
export type StructId = (typeof KVL_STRUCTS)[keyof typeof KVL_STRUCTS];

/** Which list of codes kvl_constants returns (kvl_core.h KVL_CONST_*). */
export const KVL_CONSTANTS = { status: 1, kernelLevels: 2, kernelSets: 3, act: 4, io: 5, kv: 6, lookahead: 7, logits: 8, routing: 9, cachePolicy: 10, dtype: 11 } as const;
export type ConstantsId = (typeof KVL_CONSTANTS)[keyof typeof KVL_CONSTANTS];
/** One code of a kvl_constants list: its name (a status's text) and value. */
export interface ConstantRow {
  readonly name: string;
  readonly value: number;
}

/** A member's kind (kvl_core.h KVL_FIELD_*) and its JS form: i32, i64 and u64 a number (64-bit
 * ones exact below 2^53), bool32 a boolean, chars a string. */
export type FieldKind = "i32" | "bool32" | "i64" | "u64" | "chars";
const FIELD_KINDS: Readonly<Record<number, FieldKind>> = { 1: "i32", 2: "bool32", 3: "i64", 4: "u64", 5: "chars" };

/** A KVL_FIELD_* number as a FieldKind; Error for a kind this host does not know. */
export function fieldKind(code: number, cName: string): FieldKind {
  const kind = FIELD_KINDS[code];
  if (kind === undefined) throw new Error(`kvl: the core's struct member ${cName} has kind ${code}, which this host does not know; rebuild the core and the host together`);
  return kind;
}

/** One member of a boundary struct, as kvl_struct_layout describes it. */
export interface FieldLayout {
  /** The JS property: jsFieldName(cName). */
  name: string;
  cName: string;
  offset: number;
  bytes: number;
  kind: FieldKind;
}

export interface StructLayout {
  /** sizeof the struct */
  bytes: number;
  /** Its members in declaration order. */
  fields: FieldLayout[];
}

/**
 * A member's JS property: its C name in camelCase, each "_" dropped and the character after it
 * upper-cased (vocab_size -> vocabSize), with no exceptions. The addon applies the same rule in C
 * (addon_convert.c js_field_name).
 */
export function jsFieldName(cName: string): string {
  return cName.replace(/_(.)/g, (_all, c: string) => c.toUpperCase());
}

/** The C member name of a JS property name (jsFieldName's inverse): kvl_stats' names as
 * `kvl chat --json` prints them. */
export function cFieldName(jsName: string): string {
  return jsName.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
}

export interface EngineOptions {
  /** Worker threads of the engine's pool; 0 or absent = every core. */
  nThreads?: number;
  /** Expert cache budget in bytes; 0 or absent = 512 MiB (the core rounds down to whole extents). */
  expertCacheBytes?: number;
  /** -1 streams every non-global trunk tensor, 0 keeps all resident, > 0 is a byte budget. */
  trunkCacheBytes?: number;
  ioMode?: IoMode;
  kernels?: KernelChoice;
  kvDtype?: KvDtype;
  loadVision?: boolean;
  actDtype?: ActDtype;
  /** Decoder layers this engine runs, [layerBegin, layerEnd); absent = every layer. */
  layerBegin?: number;
  layerEnd?: number;
  /** Absent = auto. */
  expertLookahead?: ExpertLookahead;
  /** Absent = adaptive. */
  expertCachePolicy?: CachePolicy;
}

/** kvl_engine_info, camel-cased; byte counts as numbers (exact below 2^53). */
export interface EngineInfo {
  vocabSize: number;
  hiddenSize: number;
  nLayers: number;
  nHeads: number;
  kvLoraRank: number;
  qkRopeHeadDim: number;
  nRoutedExperts: number;
  numExpertsPerTok: number;
  maxPositionEmbeddings: number;
  visionHiddenSize: number;
  visionMergeH: number;
  visionMergeW: number;
  visionPatchSize: number;
  mediaPlaceholderTokenId: number;
  nThreads: number;
  trunkDirectIo: boolean;
  expertDirectIo: boolean;
  visionDirectIo: boolean;
  kernels: string;
  kvDtype: string;
  actDtype: string;
  globalBytes: number;
  trunkCacheBytes: number;
  expertCacheBytes: number;
  engineWorkspaceBytes: number;
  expertExtentBytes: number;
  /** The decoder layers this engine runs: [layerBegin, layerEnd). */
  layerBegin: number;
  layerEnd: number;
  /** Whether the next layer's predicted experts are read ahead (expertLookahead auto and a cache
   * smaller than every extent of the engine's layers). */
  expertLookahead: boolean;
  /** What the expert cache evicts by: "adaptive", "frequency" or "lru". */
  expertCachePolicy: string;
}

/** kvl_stats, camel-cased. */
export interface EngineStats {
  expertHits: number;
  expertMisses: number;
  expertBytesRead: number;
  expertStallNs: number;
  trunkHits: number;
  trunkMisses: number;
  trunkBytesRead: number;
  trunkStallNs: number;
  visionBytesRead: number;
  tokensPrefilled: number;
  tokensDecoded: number;
  /** Time the CRC-32 checks of pack data on first read took (summed over the expert readers and
   * the trunk streamer that made them, plus the wall time of the pool runs that made those at
   * open and for vision), and the bytes they covered (docs/FORMAT.md "Checks at run time"). */
  verifyNs: number;
  verifyBytes: number;
  /** The next layer's predicted experts read ahead: reads queued; of them, acquired before being
   * evicted (counted as misses too), read and evicted (or failed) unused, cancelled before any
   * byte was read, and resident or in flight and not yet used at the time of the call:
   * issued = used + wasted + cancelled + pending. */
  expertLookaheadIssued: number;
  expertLookaheadUsed: number;
  expertLookaheadWasted: number;
  expertLookaheadCancelled: number;
  expertLookaheadPending: number;
}

export interface SessionOptions {
  /** Tokens; 0 or absent = 4096. */
  maxContext?: number;
  /** Prefill chunk in tokens; 0 or absent = 256. */
  maxBatch?: number;
}

export type LogitsMode = "none" | "last" | "all";

/**
 * kvl_session_set_routing, for measurement only (`kvl bench --routing`; chat and serve never set
 * it): which experts each MoE layer takes. model: the router's; uniform: topk distinct experts
 * uniformly at random, a pure function of (seed, position, layer); given: the rows fill() writes.
 */
export type RoutingMode = "model" | "uniform" | "given";
export const ROUTING_MODE_CODES: Readonly<Record<RoutingMode, number>> = { model: 0, uniform: 1, given: 2 };

/** Routing rows [capacity][nLayers][topk], by absolute layer (views valid during the callback only). */
export interface RoutingRows {
  ids: Int32Array;
  weights: Float32Array;
}

export interface RoutingHook {
  mode: RoutingMode;
  /** uniform: the draws' seed (uint32) */
  seed: number;
  /** the most tokens one forward (prefill, step) takes */
  capacity: number;
  /** given: before a forward, write row i for the token at position pos0 + i (i < n); a weight
   * row starting with NaN takes the router's scores of the given ids */
  fill?(pos0: number, n: number, rows: RoutingRows): void;
  /** model / uniform: after a forward, the routing its tokens took in layers [layerBegin, layerEnd) */
  taken?(pos0: number, n: number, rows: RoutingRows, layerBegin: number, layerEnd: number): void;
}

export interface CoreSession {
  /** Tokens in the KV timeline. */
  position(): number;
  /**
   * Appends tokens. Each media placeholder token takes the next row of media (n_media rows x
   * hidden_size floats). Returns the logits asked for: null for "none", vocab floats for
   * "last", n_tokens x vocab for "all".
   */
  prefill(tokens: Int32Array, media: Float32Array | null, logits: LogitsMode): Float32Array | null;
  /** Appends one token; returns its logits (vocab floats, a fresh array). */
  step(token: number): Float32Array;
  /**
   * kvl_session_forward, for engines of a layer range: tokens (Int32Array, the first range) or
   * the previous range's hidden states (Float32Array, n x hidden_size) in; out the logits asked
   * for on the last range (as prefill), else this range's hidden states (n x hidden_size).
   * decode counts the tokens as decoded in the stats.
   */
  forward(input: Int32Array | Float32Array, media: Float32Array | null, logits: LogitsMode, decode: boolean): Float32Array | null;
  /** Keeps the first n tokens. */
  truncate(n: number): void;
  /**
   * One-element Int32Arrays in shared memory that the core reads before each layer: storing a
   * non-zero value in all of them (Atomics.store, from any thread) stops the running call with
   * KVL_ERR_CANCELLED and the session rolls back. The core never writes them: whoever sends the
   * calls clears them (0) before each call. They can be posted to another thread.
   */
  cancelFlags(): Int32Array[];
  /** Replaces the routing of every later forward (null: the model's again, nothing recorded). */
  setRouting(hook: RoutingHook | null): void;
  close(): void;
}

export interface CoreEngine {
  info(): EngineInfo;
  stats(): EngineStats;
  resetStats(): void;
  /**
   * kvl_engine_set_expert_slots: the expert cache's slots in use, clamped to [one layer's top-k,
   * the extents it was opened with]; fewer drop their extents and give their memory back to the
   * OS (natively; a WebAssembly memory never shrinks). Returns the slots in use after the call
   * (0 without an expert cache). Between calls only (CoreError while one runs).
   */
  setExpertSlots(slots: number): number;
  /** Bytes a session with these options allocates (KV + arena), for the planner. */
  sessionBytes(options?: SessionOptions): number;
  newSession(options?: SessionOptions): CoreSession;
  /**
   * kvl_vision_bytes: working memory of one encodeImages call for these images (grids: n_images
   * x (rows, columns) of patches; 0 images = 0). CoreError when the engine has no vision or a
   * grid is not a positive multiple of the merge kernel.
   */
  visionBytes(grids: Int32Array): number;
  /**
   * kvl_vision_encode: pixelValues (sum(gh*gw) patches x 3 x patch x patch floats, every image's
   * patches in order) -> media embeddings, sum((gh/merge_h)*(gw/merge_w)) rows x hiddenSize FP32
   * floats in text space, not rounded (roundToBf16 them before prefill). CoreError for what the
   * core refuses (no vision, a bad grid), RangeError for buffer lengths that do not match the grids.
   */
  encodeImages(pixelValues: Float32Array, grids: Int32Array): Float32Array;
  /** Frees the engine; its sessions must be closed first. */
  close(): void;
}

/** A kvl_status other than KVL_OK, with the core's detail message. */
export class CoreError extends Error {
  constructor(readonly status: number, detail: string) {
    super(detail || (KVL_STATUS_NAMES[status] ?? `kvl status ${status}`));
    this.name = "CoreError";
  }
  get statusName(): string {
    return KVL_STATUS_NAMES[this.status] ?? `status ${this.status}`;
  }
}

/**
 * Pack data that did not match its CRC-32 when the engine read it (KVL_ERR_CORRUPT): a damaged
 * trunk.bin, experts.bin or vision.bin. The message is the core's: the file, the tensor (its
 * layer, expert or vision block) and the `kvl doctor` command to run. A UserError (the user
 * repairs the pack; no stack trace); the engine stays usable. What the main thread gets for a
 * CoreError with that status (engine-client.ts).
 */
export class CorruptPackError extends UserError {
  constructor(message: string) {
    super(message);
    this.name = "CorruptPackError";
  }
}

/**
 * Pack data the engine could not read (KVL_ERR_IO): the file shrank, was removed or replaced, or
 * its disk failed or went away while kvl ran. The message is the core's one line: the file's
 * path, what was being read, the bytes and offset, the OS's reason and what to do (reconnect the
 * disk or put the pack back, `kvl doctor`). A UserError (no stack trace): the turn is rolled back
 * and the engine stays usable, so the user can retry once the disk is back. Also what
 * ChatModel's check before each turn throws when a pack file is no longer the one opened
 * (host/pack/pack-files.ts). What the main thread gets for a CoreError with that status.
 */
export class PackReadError extends UserError {
  constructor(message: string) {
    super(message);
    this.name = "PackReadError";
  }
}

/** EngineOptions as kvl_engine_options holds them: every member a number (the C enum codes;
 * loadVision 0 or 1). */
export type EngineOptionCodes = { [K in keyof EngineOptions]-?: number };

const IO_MODES: Record<IoMode, number> = { auto: 0, direct: 1, buffered: 2 };
/** simd128-relaxed is level 4 of the relaxed build, as simd128 is of the plain one (kernels.h). */
const KERNELS: Record<KernelChoice, number> = { auto: 0, scalar: 1, avx2: 2, avx512: 3, simd128: 4, "simd128-relaxed": 4 };
const KV_DTYPES: Record<KvDtype, number> = { f32: 1, bf16: 2, i16: 3 };
/** 3 was i16 (two integer terms per input), which the core refuses now. */
const ACT_DTYPES: Record<ActDtype, number> = { f32: 1, bf16: 2, i16x1: 4, i8: 5 };
const LOOKAHEADS: Record<ExpertLookahead, number> = { auto: 0, off: 1 };
const CACHE_POLICY_CODES: Record<CachePolicy, number> = { adaptive: 1, frequency: 2, lru: 3 };
/** The option codes as spelled here, by kvl_constants list (test/boundary.test.ts compares each
 * with the core's rows: a name here has the core's value, and the core has no other name). */
export const OPTION_CODES = {
  io: IO_MODES, kernelLevels: KERNELS, kv: KV_DTYPES, act: ACT_DTYPES, lookahead: LOOKAHEADS, cachePolicy: CACHE_POLICY_CODES,
} as const;

function nonNegativeInteger(name: string, value: number | undefined, min = 0): number {
  const v = value ?? 0;
  if (!Number.isSafeInteger(v) || v < min) throw new RangeError(`engine option ${name} must be an integer >= ${min}, got ${value}`);
  return v;
}

/** EngineOptions -> the C enum codes; throws RangeError for a value the core would refuse. */
export function engineOptionCodes(options: EngineOptions = {}): EngineOptionCodes {
  const pick = <K extends string>(name: string, table: Record<K, number>, value: K | undefined, absent: number): number => {
    if (value === undefined) return absent;
    const code = table[value];
    if (code === undefined) throw new RangeError(`engine option ${name}: unknown value ${JSON.stringify(value)}`);
    return code;
  };
  return {
    nThreads: nonNegativeInteger("nThreads", options.nThreads),
    expertCacheBytes: nonNegativeInteger("expertCacheBytes", options.expertCacheBytes),
    trunkCacheBytes: nonNegativeInteger("trunkCacheBytes", options.trunkCacheBytes, -1),
    ioMode: pick("ioMode", IO_MODES, options.ioMode, 0),
    kernels: pick("kernels", KERNELS, options.kernels, 0),
    kvDtype: pick("kvDtype", KV_DTYPES, options.kvDtype, 0),
    loadVision: options.loadVision ? 1 : 0,
    actDtype: pick("actDtype", ACT_DTYPES, options.actDtype, 0),
    layerBegin: nonNegativeInteger("layerBegin", options.layerBegin),
    layerEnd: nonNegativeInteger("layerEnd", options.layerEnd),
    expertLookahead: pick("expertLookahead", LOOKAHEADS, options.expertLookahead, 0),
    expertCachePolicy: pick("expertCachePolicy", CACHE_POLICY_CODES, options.expertCachePolicy, 0),
  };
}

/** kvl_core.h KVL_LOGITS_ROWS (checked in test/boundary.test.ts). */
export const LOGITS_MODES: Readonly<Record<LogitsMode, number>> = { none: 0, last: 1, all: 2 };

/** A logits mode's C code; RangeError for anything else. */
export function logitsModeCode(logits: LogitsMode): number {
  const mode = Object.hasOwn(LOGITS_MODES, logits) ? LOGITS_MODES[logits] : undefined;
  if (mode === undefined) throw new RangeError(`logits mode must be none, last or all, got ${String(logits)}`);
  return mode;
}

/** Rows in an array of hidden_size-float rows (media embeddings); RangeError for a partial row. */
export function wholeRows(what: string, rows: Float32Array | null, hidden: number): number {
  if (rows !== null && rows.length % hidden !== 0) {
    throw new RangeError(`${what} must be whole rows of hidden_size ${hidden} floats, got ${rows.length} floats`);
  }
  return rows === null ? 0 : rows.length / hidden;
}

/** Session options -> [max_context, max_batch] (0 = the core's default). */
export function sessionOptionCodes(options: SessionOptions = {}): [number, number] {
  return [nonNegativeInteger("maxContext", options.maxContext), nonNegativeInteger("maxBatch", options.maxBatch)];
}

/** Images, patches and embedding rows of one vision call; RangeError for an odd grids length. */
interface VisionShape {
  nImages: number;
  patches: number;
  /** sum(gh*gw) x 3 x patch x patch */
  pixelFloats: number;
  /** merged rows: sum((gh/merge_h)*(gw/merge_w)) */
  rows: number;
}

/**
 * The shape of a vision call on an engine with this info. The grids must already have passed the
 * core's check (visionBytes): positive multiples of the merge kernel.
 */
export function visionShape(info: Pick<EngineInfo, "visionPatchSize" | "visionMergeH" | "visionMergeW">, grids: Int32Array): VisionShape {
  checkGridsLength(grids);
  const { visionPatchSize: p, visionMergeH: mh, visionMergeW: mw } = info;
  let patches = 0;
  let rows = 0;
  for (let i = 0; i < grids.length; i += 2) {
    const gh = grids[i]!;
    const gw = grids[i + 1]!;
    patches += gh * gw;
    rows += Math.floor(gh / mh) * Math.floor(gw / mw);
  }
  return { nImages: grids.length / 2, patches, pixelFloats: patches * 3 * p * p, rows };
}

/** RangeError unless grids is n_images x (rows, columns). */
export function checkGridsLength(grids: Int32Array): void {
  if (!(grids instanceof Int32Array)) throw new TypeError("grids must be an Int32Array of n_images x (rows, columns) of patches");
  if (grids.length % 2 !== 0) {
    throw new RangeError(`grids holds ${grids.length} int32s; want n_images x 2 (rows, columns of patches per image)`);
  }
}

/** RangeError unless pixelValues holds exactly the floats the grids need (after visionShape). */
export function checkPixelLength(pixelValues: Float32Array, shape: VisionShape, patchSize: number): void {
  if (!(pixelValues instanceof Float32Array)) throw new TypeError("pixelValues must be a Float32Array");
  if (pixelValues.length !== shape.pixelFloats) {
    throw new RangeError(`pixelValues holds ${pixelValues.length} floats; the grids' ${shape.patches} patches need ${shape.pixelFloats} (patches x 3 x ${patchSize} x ${patchSize})`);
  }
}

/**
 * FP32 -> nearest-even BF16 -> FP32 (bits + 0x7FFF + the lowest kept bit, modulo 2^32, low 16
 * bits cleared; NaNs are not special-cased). A new
 * array: the official model feeds the text decoder BF16 image embeddings, so the host rounds the
 * media rows of encodeImages before prefill.
 */
export function roundToBf16(values: Float32Array): Float32Array {
  const out = new Float32Array(values.length);
  const src = new Uint32Array(values.buffer, values.byteOffset, values.length);
  const dst = new Uint32Array(out.buffer);
  for (let i = 0; i < src.length; i++) {
    const bits = src[i]!;
    dst[i] = (bits + 0x7fff + ((bits >>> 16) & 1)) & 0xffff0000;
  }
  return out;
}
