/**
 * native-backend.ts — the core as a Node-API addon (build/addon/kvl_core.node), with the
 * AVX2 / AVX-512 kernel sets chosen inside the core by CPUID.
 *
 * Owns: loading the addon in this process (only after backend.ts has test-loaded it in a child
 * process) and adapting it to CoreBackend, and the engine over the addon (NativeEngine,
 * NativeSession: CoreEngine / CoreSession of core-api.ts: the text engine and the vision
 * encoder). Does not own: building it (scripts/build-addon.mjs).
 */
import { type ConformanceReport, type ConstantRow, type ConstantsId, type CoreBackend, type KernelSet, type Pcg64State, type SamplerParams, checkPackExpertArgs, checkPackQ8RowsArgs, checkQ4ExpertDims, packExpertStatus, packQ8RowsStatus, parseConformanceReport, type CoreEngine, CoreError, type CoreSession, type EngineInfo, type EngineOptionCodes, type EngineOptions, type EngineStats, type FieldLayout, fieldKind, type StructId, type StructLayout, logitsModeCode, wholeRows, type LogitsMode, ROUTING_MODE_CODES, type RoutingHook, type SessionOptions, engineOptionCodes, sessionOptionCodes, checkGridsLength, visionShape } from "./core-api.js";
import { RoutingBinding, routingRowLength } from "./routing-binding.js";
import { q8RowsLayout } from "../pack/pack-format.js";
import { nativeAddonPath, requireFile } from "../system/paths.js";

/** An engine handle of the addon (an opaque external; see addon_handles.c). */
interface NativeEngineHandle {
  readonly __kvlNativeHandle: "engine";
}

/** A session handle of the addon (an opaque external; it keeps its engine's handle alive). */
interface NativeSessionHandle {
  readonly __kvlNativeHandle: "session";
}

/** What the addon (wasm-core/native/addon*.c; addon.c holds the module table) exports: the one
 * description of each export, which the C side points to.
 *
 * Errors: engine and session calls return a failed kvl_status as a number (0 = ok; the detail from
 * engineLastError) and throw only for a caller mistake (wrong type or typed-array length, a handle
 * of the wrong kind: TypeError / RangeError naming the export and argument) or a freed handle (an
 * Error "... engine closed" / "... session closed", code ERR_KVL_CLOSED); the vision calls, which
 * return a result, throw a failed status (an Error with code ERR_KVL_STATUS, a numeric `status` and
 * the core's detail as its message); a failed napi call throws an Error naming it. Integers are JS
 * numbers; uint64 results are exact below 2^53. Every call runs to completion on the calling thread.
 * Engines and sessions are opaque handles (type-tagged externals); a session keeps its engine's
 * handle alive, and engineFree first frees the engine's open sessions. */
interface NativeAddon {
  /** "native" */
  readonly backend: "native";
  /** kvl_abi_version() */
  abiVersion(): number;
  /** Every kernel set compiled in, and whether this CPU runs it. */
  kernelSets(): KernelSet[];
  /** The set KVL_KERNELS_AUTO picks on this machine. */
  defaultKernelSet(): string;
  /** kvl_kernels_conformance: the count of failed checks and the JSON report; failed -1 and
   * report "" when the set is unknown or unsupported here. */
  conformance(set: string): { failed: number; report: string };
  /** kvl_expert_extent_bytes */
  expertExtentBytes(intermediate: number, hidden: number): number;
  /** kvl_pack_expert into out; the kvl_status as a number (0 = ok). Each matrix holds I x H. */
  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number, out: Uint8Array): number;
  /** kvl_pack_q8_rows into out; the kvl_status as a number. w holds rows x cols. */
  packQ8Rows(w: Uint16Array, rows: number, cols: number, out: Uint8Array): number;
  /** kvl_expert_q4_extent_bytes (0 when I or H is not a multiple of 32) */
  expertQ4ExtentBytes(intermediate: number, hidden: number): number;
  /** kvl_pack_expert_q4 into out; the kvl_status as a number. */
  packExpertQ4(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number, out: Uint8Array): number;
  /** kvl_pcg64_seed: both arrays hold 4 words. */
  pcg64Seed(words: BigUint64Array, state: BigUint64Array): void;
  /** kvl_synth_uniform of count values into out (Uint16Array: BF16 bits, Float32Array: FP32, at
   * least count long); advances state (4 words). */
  synthUniform(state: BigUint64Array, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void;
  /** kvl_sample -> the token id. logits (non-empty) are used as scratch; rng (1 word) is the
   * sampler state, advanced in place; workspace holds at least logits.length ints. */
  sampleToken(logits: Float32Array, temperature: number, topK: number, topP: number, rng: BigUint64Array, workspace: Int32Array): number;
  /** rng[0] becomes kvl_sampler_seed's state for the seed rng[0]. */
  samplerSeed(rng: BigUint64Array): void;
  /** kvl_struct_layout(which), each member's JS name (name: its C name cName in camelCase) beside
   * it; kind the KVL_FIELD_* number. RangeError for a `which` the core does not describe. */
  structLayout(which: StructId): { bytes: number; fields: Array<Omit<FieldLayout, "kind"> & { kind: number }> };
  /** kvl_constants(which) as {name, value} rows, in the core's order. RangeError for a `which`
   * the core has no list for. */
  constants(which: ConstantsId): ConstantRow[];
  /** kvl_engine_open -> error: the core's message ("" on success), engine a handle or null.
   * codes: the kvl_engine_options members by JS name, each optional (absent = 0; a BOOL32 member
   * may be a boolean), converted from the core's layout table. */
  engineOpen(packDir: string, codes: EngineOptionCodes): { status: number; error: string; engine: NativeEngineHandle | null };
  /** kvl_engine_free, after freeing the engine's open sessions; a second free does nothing. */
  engineFree(engine: NativeEngineHandle): void;
  /** kvl_engine_get_info as an object converted from the core's layout table (KVL_STRUCT_ENGINE_INFO). */
  engineInfo(engine: NativeEngineHandle): EngineInfo;
  /** The same for kvl_stats. */
  engineStats(engine: NativeEngineHandle): EngineStats;
  /** kvl_engine_reset_stats */
  engineResetStats(engine: NativeEngineHandle): void;
  /** kvl_engine_set_expert_slots -> status and the slots in use after the call. */
  engineSetExpertSlots(engine: NativeEngineHandle, slots: number): { status: number; active: number };
  /** kvl_engine_last_error: the detail of the last failed call on the engine or its sessions. */
  engineLastError(engine: NativeEngineHandle): string;
  /** kvl_session_bytes */
  sessionBytes(engine: NativeEngineHandle, maxContext: number, maxBatch: number): { status: number; bytes: number };
  /** kvl_session_new: session a handle or null. */
  sessionNew(engine: NativeEngineHandle, maxContext: number, maxBatch: number): { status: number; session: NativeSessionHandle | null };
  /** kvl_session_free; a second free does nothing. */
  sessionFree(session: NativeSessionHandle): void;
  /** kvl_session_position */
  sessionPosition(session: NativeSessionHandle): number;
  /** kvl_session_truncate -> status */
  sessionTruncate(session: NativeSessionHandle, n: number): number;
  /** kvl_session_forward -> status; a prefill is this with hiddenIn and hiddenOut null and decode
   * false (kvl_session_prefill is exactly that). Exactly one of tokens (n_tokens = its length)
   * and hiddenIn (n_tokens x hidden_size) is non-null; media: null or nMedia x hidden_size floats;
   * hiddenOut: null or n_tokens x hidden_size; logitsMode 0 none, 1 last, 2 all; logits: null, or
   * vocab_size floats (last) or n_tokens x vocab_size (all). Which buffers a layer range takes is
   * the core's check (a status); the addon checks types, lengths and that no output shares
   * memory with an input or the other output. */
  sessionForward(
    session: NativeSessionHandle, tokens: Int32Array | null, hiddenIn: Float32Array | null, media: Float32Array | null,
    nMedia: number, hiddenOut: Float32Array | null, logitsMode: number, logits: Float32Array | null, decode: boolean,
  ): number;
  /** kvl_session_step -> status; logits holds vocab_size floats. */
  sessionStep(session: NativeSessionHandle, token: number, logits: Float32Array): number;
  /** kvl_session_watch_cancel on flag[0] (an Int32Array over a SharedArrayBuffer, or null): another
   * thread stops a running call by setting it. The array is kept alive until replaced or freed. */
  sessionWatchCancel(session: NativeSessionHandle, flag: Int32Array | null): void;
  /** kvl_session_set_routing -> status (kvl bench --routing only): ids and weights both null, or
   * both capacity x n_layers x topk long; kept alive until replaced or the session is freed. */
  sessionSetRouting(session: NativeSessionHandle, mode: number, seed: number, ids: Int32Array | null, weights: Float32Array | null): number;
  /** kvl_vision_bytes: one encode's working memory for grids (n_images x (gh, gw)); throws a
   * failed status (vision not loaded, bad grids). */
  visionBytes(engine: NativeEngineHandle, grids: Int32Array): number;
  /** kvl_vision_encode into out (sum((gh/merge_h)*(gw/merge_w)) x hidden_size floats, FP32, sharing
   * no memory with the inputs); pixelValues holds sum(gh*gw) x 3 x patch x patch floats; grids as
   * visionBytes (checked by the core first). Throws a failed status. */
  visionEncode(engine: NativeEngineHandle, pixelValues: Float32Array, grids: Int32Array, out: Float32Array): void;
}

/** The addon's thrown kvl_status (code ERR_KVL_STATUS) as a CoreError; anything else as it is. */
function coreErrorOf(err: unknown): unknown {
  if (err instanceof Error && (err as { code?: unknown }).code === "ERR_KVL_STATUS" && typeof (err as { status?: unknown }).status === "number") {
    return new CoreError((err as unknown as { status: number }).status, err.message);
  }
  return err;
}

export function loadNativeAddon(path: string = nativeAddonPath()): NativeAddon {
  return requireFile(path) as NativeAddon;
}

export class NativeBackend implements CoreBackend {
  readonly backend = "native" as const;
  readonly #addon: NativeAddon;

  constructor(addon: NativeAddon = loadNativeAddon()) {
    this.#addon = addon;
  }

  abiVersion(): number {
    return this.#addon.abiVersion();
  }

  kernelSets(): KernelSet[] {
    return this.#addon.kernelSets();
  }

  defaultKernelSet(): string {
    return this.#addon.defaultKernelSet();
  }

  conformance(set: string): ConformanceReport {
    const { failed, report } = this.#addon.conformance(set);
    if (failed === -1) throw new Error(`kernel set ${set} is not available on the native backend here`);
    return parseConformanceReport(report, set);
  }

  expertExtentBytes(intermediate: number, hidden: number): number {
    return this.#addon.expertExtentBytes(intermediate, hidden);
  }

  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array {
    checkPackExpertArgs(gate, up, down, intermediate, hidden);
    const out = new Uint8Array(this.expertExtentBytes(intermediate, hidden));
    packExpertStatus(this.#addon.packExpert(gate, up, down, intermediate, hidden, out));
    return out;
  }

  packQ8Rows(w: Uint16Array, rows: number, cols: number): Uint8Array {
    checkPackQ8RowsArgs(w, rows, cols);
    const out = new Uint8Array(q8RowsLayout(rows, cols).nbytes);
    packQ8RowsStatus(this.#addon.packQ8Rows(w, rows, cols, out));
    return out;
  }

  expertQ4ExtentBytes(intermediate: number, hidden: number): number {
    checkQ4ExpertDims(intermediate, hidden, "expertQ4ExtentBytes");
    return this.#addon.expertQ4ExtentBytes(intermediate, hidden);
  }

  packExpertQ4(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array {
    checkQ4ExpertDims(intermediate, hidden, "packExpertQ4");
    checkPackExpertArgs(gate, up, down, intermediate, hidden, "packExpertQ4");
    const out = new Uint8Array(this.expertQ4ExtentBytes(intermediate, hidden));
    packExpertStatus(this.#addon.packExpertQ4(gate, up, down, intermediate, hidden, out), "kvl_pack_expert_q4");
    return out;
  }

  pcg64Seed(seedWords: BigUint64Array): Pcg64State {
    const state = new BigUint64Array(4);
    this.#addon.pcg64Seed(seedWords, state);
    return state;
  }

  #workspace = new Int32Array(0);

  sampleToken(logits: Float32Array, params: SamplerParams, rng: BigUint64Array): number {
    if (this.#workspace.length < logits.length) this.#workspace = new Int32Array(logits.length);
    return this.#addon.sampleToken(logits, params.temperature, params.topK, params.topP, rng, this.#workspace);
  }

  seedSampler(seed: bigint): BigUint64Array {
    const rng = BigUint64Array.of(BigInt.asUintN(64, seed));
    this.#addon.samplerSeed(rng);
    return rng;
  }

  synthUniform(state: Pcg64State, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void {
    this.#addon.synthUniform(state, count, center, halfWidth, out);
  }

  /** Opens the pack in packDir; throws CoreError (the core's message) when it cannot. */
  openEngine(packDir: string, options: EngineOptions = {}): CoreEngine {
    return NativeEngine.open(this.#addon, packDir, options);
  }

  constants(which: ConstantsId): ConstantRow[] {
    return this.#addon.constants(which);
  }

  structLayout(which: StructId): StructLayout {
    const { bytes, fields } = this.#addon.structLayout(which);
    return { bytes, fields: fields.map((f) => ({ ...f, kind: fieldKind(f.kind, f.cName) })) };
  }

  close(): void {
    /* The addon's memory belongs to the process; nothing to release yet. */
  }
}

/** The text engine on the addon. The addon makes a closed handle unusable by itself; the checks
 * here give the same errors as the WebAssembly engine (wasm-engine.ts). */
class NativeEngine implements CoreEngine {
  #handle: NativeEngineHandle | null;
  readonly #info: EngineInfo;
  readonly #sessions = new Set<NativeSession>();

  private constructor(readonly addon: NativeAddon, handle: NativeEngineHandle) {
    this.#handle = handle;
    this.#info = addon.engineInfo(handle);
  }

  static open(addon: NativeAddon, packDir: string, options: EngineOptions = {}): NativeEngine {
    const { status, error, engine } = addon.engineOpen(packDir, engineOptionCodes(options));
    if (status !== 0 || engine === null) throw new CoreError(status !== 0 ? status : 9, error);
    try {
      return new NativeEngine(addon, engine);
    } catch (err) {
      addon.engineFree(engine);
      throw err;
    }
  }

  get #live(): NativeEngineHandle {
    if (this.#handle === null) throw new Error("kvl: the engine was closed");
    return this.#handle;
  }

  /** Throws CoreError for a failed status, with the engine's detail message. */
  check(status: number): void {
    if (status !== 0) throw new CoreError(status, this.addon.engineLastError(this.#live));
  }

  info(): EngineInfo {
    return { ...this.#info };
  }

  stats(): EngineStats {
    return this.addon.engineStats(this.#live);
  }

  resetStats(): void {
    this.addon.engineResetStats(this.#live);
  }

  setExpertSlots(slots: number): number {
    if (!Number.isSafeInteger(slots) || slots < 0 || slots > 0x7fffffff) throw new RangeError(`expert slots must be a non-negative int32, got ${slots}`);
    const { status, active } = this.addon.engineSetExpertSlots(this.#live, slots);
    this.check(status);
    return active;
  }

  sessionBytes(options: SessionOptions = {}): number {
    const [maxContext, maxBatch] = sessionOptionCodes(options);
    const { status, bytes } = this.addon.sessionBytes(this.#live, maxContext, maxBatch);
    this.check(status);
    return bytes;
  }

  newSession(options: SessionOptions = {}): CoreSession {
    const [maxContext, maxBatch] = sessionOptionCodes(options);
    const { status, session: handle } = this.addon.sessionNew(this.#live, maxContext, maxBatch);
    this.check(status);
    if (handle === null) throw new CoreError(9, "kvl_session_new returned no session");
    const session = new NativeSession(this, handle, this.#info, () => this.#sessions.delete(session));
    this.#sessions.add(session);
    return session;
  }

  visionBytes(grids: Int32Array): number {
    checkGridsLength(grids);
    try {
      return this.addon.visionBytes(this.#live, grids);
    } catch (err) {
      throw coreErrorOf(err);
    }
  }

  encodeImages(pixelValues: Float32Array, grids: Int32Array): Float32Array {
    // the core's checks of the engine and the grids first (so the shape below is sound); the
    // addon checks the buffer lengths, with the wasm engine's words
    this.visionBytes(grids);
    const shape = visionShape(this.#info, grids);
    const out = new Float32Array(shape.rows * this.#info.hiddenSize);
    try {
      this.addon.visionEncode(this.#live, pixelValues, grids, out);
    } catch (err) {
      throw coreErrorOf(err);
    }
    return out;
  }

  close(): void {
    if (this.#handle === null) return;
    if (this.#sessions.size > 0) throw new Error("kvl: close the engine's sessions before the engine");
    this.addon.engineFree(this.#handle);
    this.#handle = null;
  }
}

class NativeSession implements CoreSession {
  #handle: NativeSessionHandle | null;
  readonly #vocab: number;
  readonly #hidden: number;
  /** This engine runs the model's last layers: it ends in logits, not hidden states. */
  readonly #lastRange: boolean;
  /** The shared flag the core watches (made on first use). */
  #cancelFlag: Int32Array | null = null;
  /** A routing override's hook and rows (kvl bench --routing), else null. */
  #routing: RoutingBinding | null = null;
  readonly #info: EngineInfo;

  constructor(private readonly engine: NativeEngine, handle: NativeSessionHandle, info: EngineInfo, private readonly onClose: () => void) {
    this.#handle = handle;
    this.#info = info;
    this.#vocab = info.vocabSize;
    this.#hidden = info.hiddenSize;
    this.#lastRange = info.layerEnd === info.nLayers;
  }

  get #live(): NativeSessionHandle {
    if (this.#handle === null) throw new Error("kvl: the session was closed");
    return this.#handle;
  }

  position(): number {
    return this.engine.addon.sessionPosition(this.#live);
  }

  /** kvl_session_prefill is forward without hidden states, so the addon has forward only; on the
   * first range of a split model this returns the range's hidden states (as the wasm engine). */
  prefill(tokens: Int32Array, media: Float32Array | null, logits: LogitsMode): Float32Array | null {
    return this.forward(tokens, media, logits, false);
  }

  /** One forward with the routing hook's fill() before and taken() after it. */
  #routed(n: number, call: () => void): void {
    RoutingBinding.around(this.#routing, () => this.position(), n, call);
  }

  setRouting(hook: RoutingHook | null): void {
    const session = this.#live;
    if (hook === null) {
      this.engine.check(this.engine.addon.sessionSetRouting(session, 0, 0, null, null));
      this.#routing = null;
      return;
    }
    const length = routingRowLength(hook, this.#info.nLayers, this.#info.numExpertsPerTok);
    const rows = { ids: new Int32Array(length), weights: new Float32Array(length) };
    this.engine.check(this.engine.addon.sessionSetRouting(session, ROUTING_MODE_CODES[hook.mode], hook.seed >>> 0, rows.ids, rows.weights));
    this.#routing = new RoutingBinding(hook, () => rows, this.#info.layerBegin, this.#info.layerEnd);
  }

  forward(input: Int32Array | Float32Array, media: Float32Array | null, logits: LogitsMode, decode: boolean): Float32Array | null {
    const session = this.#live;
    const H = this.#hidden;
    const isHidden = input instanceof Float32Array;
    if (isHidden && input.length % H !== 0) throw new RangeError(`hidden states must be whole rows of hidden_size ${H} floats, got ${input.length}`);
    const n = isHidden ? input.length / H : input.length;
    const mode = logitsModeCode(logits);
    const nMedia = wholeRows("media rows", media, this.#hidden);
    /* The last range writes the logits asked for, an earlier one its hidden states (both as
     * zero-length arrays for zero tokens, so that the core, not the addon, reports the misuse). */
    const out = this.#lastRange ? (mode === 0 ? null : new Float32Array(mode === 1 ? this.#vocab : n * this.#vocab)) : new Float32Array(n * H);
    this.#routed(n, () => this.engine.check(this.engine.addon.sessionForward(session, isHidden ? null : input, isHidden ? input : null, media, nMedia,
      this.#lastRange ? null : out, mode, this.#lastRange ? out : null, decode)));
    return out !== null && out.length > 0 ? out : null;
  }

  step(token: number): Float32Array {
    const out = new Float32Array(this.#vocab);
    const session = this.#live;
    this.#routed(1, () => this.engine.check(this.engine.addon.sessionStep(session, token, out)));
    return out;
  }

  truncate(n: number): void {
    this.engine.check(this.engine.addon.sessionTruncate(this.#live, n));
  }

  cancelFlags(): Int32Array[] {
    if (this.#cancelFlag === null) {
      this.#cancelFlag = new Int32Array(new SharedArrayBuffer(4));
      this.engine.addon.sessionWatchCancel(this.#live, this.#cancelFlag);
    }
    return [this.#cancelFlag];
  }

  close(): void {
    if (this.#handle === null) return;
    this.engine.addon.sessionFree(this.#handle);
    this.#handle = null;
    this.onClose();
  }
}
