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

/** An engine handle of the addon (an opaque external; see addon.c). */
interface NativeEngineHandle {
  readonly __kvlNativeHandle: "engine";
}

/** A session handle of the addon (an opaque external; it keeps its engine's handle alive). */
interface NativeSessionHandle {
  readonly __kvlNativeHandle: "session";
}

/** What wasm-core/native/addon.c exports. Engine and session calls return a kvl_status as a
 * number (0 = ok) and throw only for a caller mistake or a closed handle; the vision calls,
 * which return a result, throw a failed status (an Error with a numeric `status`). */
interface NativeAddon {
  abiVersion(): number;
  kernelSets(): KernelSet[];
  defaultKernelSet(): string;
  conformance(set: string): { failed: number; report: string };
  expertExtentBytes(intermediate: number, hidden: number): number;
  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number, out: Uint8Array): number;
  packQ8Rows(w: Uint16Array, rows: number, cols: number, out: Uint8Array): number;
  expertQ4ExtentBytes(intermediate: number, hidden: number): number;
  packExpertQ4(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number, out: Uint8Array): number;
  pcg64Seed(words: BigUint64Array, state: BigUint64Array): void;
  synthUniform(state: BigUint64Array, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void;
  sampleToken(logits: Float32Array, temperature: number, topK: number, topP: number, rng: BigUint64Array, workspace: Int32Array): number;
  samplerSeed(rng: BigUint64Array): void;
  /** kvl_struct_layout with each member's JS name; kind the KVL_FIELD_* number. */
  structLayout(which: StructId): { bytes: number; fields: Array<Omit<FieldLayout, "kind"> & { kind: number }> };
  /** kvl_constants(which) as {name, value} rows. */
  constants(which: ConstantsId): ConstantRow[];
  engineOpen(packDir: string, codes: EngineOptionCodes): { status: number; error: string; engine: NativeEngineHandle | null };
  engineFree(engine: NativeEngineHandle): void;
  /** The struct as an object converted from the core's layout table (KVL_STRUCT_ENGINE_INFO). */
  engineInfo(engine: NativeEngineHandle): EngineInfo;
  /** The same for kvl_stats. */
  engineStats(engine: NativeEngineHandle): EngineStats;
  engineResetStats(engine: NativeEngineHandle): void;
  engineLastError(engine: NativeEngineHandle): string;
  sessionBytes(engine: NativeEngineHandle, maxContext: number, maxBatch: number): { status: number; bytes: number };
  sessionNew(engine: NativeEngineHandle, maxContext: number, maxBatch: number): { status: number; session: NativeSessionHandle | null };
  sessionFree(session: NativeSessionHandle): void;
  sessionPosition(session: NativeSessionHandle): number;
  sessionTruncate(session: NativeSessionHandle, n: number): number;
  sessionPrefill(
    session: NativeSessionHandle, tokens: Int32Array, media: Float32Array | null, nMedia: number, logitsMode: number,
    logits: Float32Array | null,
  ): number;
  sessionForward(
    session: NativeSessionHandle, tokens: Int32Array | null, hiddenIn: Float32Array | null, media: Float32Array | null,
    nMedia: number, hiddenOut: Float32Array | null, logitsMode: number, logits: Float32Array | null, decode: boolean,
  ): number;
  sessionStep(session: NativeSessionHandle, token: number, logits: Float32Array): number;
  sessionWatchCancel(session: NativeSessionHandle, flag: Int32Array | null): void;
  sessionSetRouting(session: NativeSessionHandle, mode: number, seed: number, ids: Int32Array | null, weights: Float32Array | null): number;
  visionBytes(engine: NativeEngineHandle, grids: Int32Array): number;
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

  /** On an engine of every layer this is kvl_session_prefill; on the first range of a split
   * model it returns the range's hidden states, as forward does (the same as the wasm engine). */
  prefill(tokens: Int32Array, media: Float32Array | null, logits: LogitsMode): Float32Array | null {
    if (!this.#lastRange) return this.forward(tokens, media, logits, false);
    const session = this.#live;
    const mode = logitsModeCode(logits);
    const nMedia = wholeRows("media rows", media, this.#hidden);
    const out = mode === 0 ? null : new Float32Array(mode === 1 ? this.#vocab : tokens.length * this.#vocab);
    this.#routed(tokens.length, () => this.engine.check(this.engine.addon.sessionPrefill(session, tokens, media, nMedia, mode, out)));
    return out;
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
