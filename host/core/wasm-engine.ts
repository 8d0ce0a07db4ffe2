/**
 * wasm-engine.ts — the engine (kvl_engine_*, kvl_session_*, the vision encoder kvl_vision_*)
 * inside one WebAssembly instance.
 *
 * Owns: the byte layouts of kvl_engine_options, kvl_engine_info, kvl_stats and
 * kvl_session_options in wasm32 (checked against the native addon's field access by the engine
 * tests), and copying tokens, media rows, logits, pixels, grids and image embeddings through the
 * instance's memory (malloc'd per call, freed after it; the core allocates a vision call's
 * working memory itself). The pack files are opened and read by the instance's own threads
 * through host_io_wasm.c.
 * Does not own: the instance (wasm-backend.ts) or the engine interfaces (core-api.ts).
 */
import { type CoreEngine, CoreError, type CoreSession, type EngineInfo, type EngineOptions, type EngineStats, logitsModeCode, wholeRows, type LogitsMode, type SessionOptions, engineOptionCodes, sessionOptionCodes, checkGridsLength, checkPixelLength, visionShape } from "./core-api.js";

/** The engine exports of the emscripten module (pointers are wasm32 addresses). */
export interface EmscriptenEngineExports {
  _malloc(bytes: number): number;
  _free(ptr: number): void;
  _kvl_engine_open(path: number, options: number, outEngine: number, err: number, errLen: number): number;
  _kvl_engine_free(engine: number): void;
  _kvl_engine_get_info(engine: number, out: number): number;
  _kvl_engine_get_stats(engine: number, out: number): number;
  _kvl_engine_reset_stats(engine: number): void;
  _kvl_engine_last_error(engine: number): number;
  _kvl_session_bytes(engine: number, options: number, outBytes: number): number;
  _kvl_session_new(engine: number, options: number, outSession: number): number;
  _kvl_session_free(session: number): void;
  _kvl_session_position(session: number): number;
  _kvl_session_truncate(session: number, n: number): number;
  _kvl_session_prefill(session: number, tokens: number, n: number, media: number, nMedia: number, mode: number, logits: number): number;
  _kvl_session_step(session: number, token: number, logits: number): number;
  _kvl_session_watch_cancel(session: number, flag: number): void;
  _kvl_session_forward(session: number, tokens: number, hiddenIn: number, n: number, media: number, nMedia: number,
    hiddenOut: number, mode: number, logits: number, decode: number): number;
  _kvl_vision_bytes(engine: number, grids: number, nImages: number, outBytes: number): number;
  _kvl_vision_encode(engine: number, pixelValues: number, grids: number, nImages: number, out: number): number;
  UTF8ToString(ptr: number, maxBytes?: number): string;
  stringToUTF8(str: string, ptr: number, maxBytes: number): void;
  lengthBytesUTF8(str: string): number;
}

/**
 * Free bytes of an instance's heap: the largest blocks malloc gives, summed, then freed (1 KiB
 * resolution). A diagnostic for the planner's tests and bench/node-overhead.mjs; never on a
 * running engine's hot path.
 */
export function freeHeapBytes(core: Pick<EmscriptenEngineExports, "_malloc" | "_free">): number {
  const held: number[] = [];
  let total = 0;
  for (;;) {
    let lo = 0;
    let hi = 2 ** 32 - 65536;
    while (hi - lo > 1024) {
      const mid = Math.floor((lo + hi) / 2);
      const ptr = core._malloc(mid) >>> 0;
      if (ptr) {
        core._free(ptr);
        lo = mid;
      } else {
        hi = mid;
      }
    }
    if (lo < 1024) break;
    const ptr = core._malloc(lo) >>> 0;
    if (!ptr) break;
    held.push(ptr);
    total += lo;
  }
  for (const ptr of held) core._free(ptr);
  return total;
}

const OPTIONS_BYTES = 56;
const INFO_BYTES = 152;
const STATS_BYTES = 104;
const ERR_BYTES = 8192; // messages quote paths of up to 4 KiB

/** Scratch in the instance: malloc'd for one call, freed after it. */
class Scratch {
  readonly #ptrs: number[] = [];
  constructor(private readonly core: EmscriptenEngineExports) {}
  alloc(bytes: number): number {
    const ptr = this.core._malloc(Math.max(bytes, 8)) >>> 0;
    if (ptr === 0) throw new CoreError(4, `out of WebAssembly memory (${bytes} bytes wanted in the instance)`);
    this.#ptrs.push(ptr);
    return ptr;
  }
  free(): void {
    for (const p of this.#ptrs) this.core._free(p);
    this.#ptrs.length = 0;
  }
}

function withScratch<T>(core: EmscriptenEngineExports, use: (s: Scratch) => T): T {
  const s = new Scratch(core);
  try {
    return use(s);
  } finally {
    s.free();
  }
}

export class WasmEngine implements CoreEngine {
  #ptr: number;
  readonly #info: EngineInfo;
  readonly #sessions = new Set<WasmSession>();

  private constructor(readonly core: EmscriptenEngineExports, readonly memory: WebAssembly.Memory, ptr: number) {
    this.#ptr = ptr;
    this.#info = this.#readInfo();
  }

  static open(core: EmscriptenEngineExports, memory: WebAssembly.Memory, packDir: string, options: EngineOptions = {}): WasmEngine {
    const codes = engineOptionCodes(options);
    const ptr = withScratch(core, (s) => {
      const opts = s.alloc(OPTIONS_BYTES);
      const view = new DataView(memory.buffer, opts, OPTIONS_BYTES);
      view.setInt32(0, codes.nThreads, true);
      view.setBigUint64(8, BigInt(codes.expertCacheBytes), true);
      view.setBigInt64(16, BigInt(codes.trunkCacheBytes), true);
      view.setInt32(24, codes.ioMode, true);
      view.setInt32(28, codes.kernels, true);
      view.setInt32(32, codes.kvDtype, true);
      view.setInt32(36, codes.loadVision, true);
      view.setInt32(40, codes.actDtype, true);
      view.setInt32(44, codes.layerBegin, true);
      view.setInt32(48, codes.layerEnd, true);
      const pathBytes = core.lengthBytesUTF8(packDir) + 1;
      const path = s.alloc(pathBytes);
      core.stringToUTF8(packDir, path, pathBytes);
      const out = s.alloc(8);
      new DataView(memory.buffer, out, 4).setUint32(0, 0, true);
      const err = s.alloc(ERR_BYTES);
      new Uint8Array(memory.buffer, err, 1)[0] = 0;
      const status = core._kvl_engine_open(path, opts, out, err, ERR_BYTES);
      if (status !== 0) throw new CoreError(status, core.UTF8ToString(err));
      return new DataView(memory.buffer, out, 4).getUint32(0, true);
    });
    return new WasmEngine(core, memory, ptr);
  }

  get #live(): number {
    if (this.#ptr === 0) throw new Error("kvl: the engine was closed");
    return this.#ptr;
  }

  /** Throws CoreError for a failed status, with the engine's detail message. */
  check(status: number): void {
    if (status !== 0) throw new CoreError(status, this.core.UTF8ToString(this.core._kvl_engine_last_error(this.#live)));
  }

  #readInfo(): EngineInfo {
    return withScratch(this.core, (s) => {
      const out = s.alloc(INFO_BYTES);
      this.check(this.core._kvl_engine_get_info(this.#live, out));
      const v = new DataView(this.memory.buffer, out, INFO_BYTES);
      const i32 = (k: number): number => v.getInt32(4 * k, true);
      const u64 = (at: number): number => Number(v.getBigUint64(at, true));
      const text = (at: number, len: number): string => this.core.UTF8ToString(out + at, len);
      return {
        vocabSize: i32(0), hiddenSize: i32(1), nLayers: i32(2), nHeads: i32(3), kvLoraRank: i32(4), qkRopeHeadDim: i32(5),
        nRoutedExperts: i32(6), numExpertsPerTok: i32(7), maxPositionEmbeddings: i32(8), visionHiddenSize: i32(9),
        visionMergeH: i32(10), visionMergeW: i32(11), visionPatchSize: i32(12), mediaPlaceholderTokenId: i32(13),
        nThreads: i32(14), trunkDirectIo: i32(15) === 1, expertDirectIo: i32(16) === 1, visionDirectIo: i32(17) === 1,
        kernels: text(72, 16), kvDtype: text(88, 8),
        globalBytes: u64(96), trunkCacheBytes: u64(104), expertCacheBytes: u64(112), engineWorkspaceBytes: u64(120),
        expertExtentBytes: u64(128), actDtype: text(136, 8), layerBegin: v.getInt32(144, true), layerEnd: v.getInt32(148, true),
      };
    });
  }

  info(): EngineInfo {
    return { ...this.#info };
  }

  stats(): EngineStats {
    return withScratch(this.core, (s) => {
      const out = s.alloc(STATS_BYTES);
      this.check(this.core._kvl_engine_get_stats(this.#live, out));
      const v = new DataView(this.memory.buffer, out, STATS_BYTES);
      const u = (k: number): number => Number(v.getBigUint64(8 * k, true));
      return {
        expertHits: u(0), expertMisses: u(1), expertBytesRead: u(2), expertStallNs: u(3), trunkHits: u(4), trunkMisses: u(5),
        trunkBytesRead: u(6), trunkStallNs: u(7), visionBytesRead: u(8), tokensPrefilled: u(9), tokensDecoded: u(10),
        verifyNs: u(11), verifyBytes: u(12),
      };
    });
  }

  resetStats(): void {
    this.core._kvl_engine_reset_stats(this.#live);
  }

  #sessionOptions(s: Scratch, options: SessionOptions): number {
    const [maxContext, maxBatch] = sessionOptionCodes(options);
    const ptr = s.alloc(8);
    const v = new DataView(this.memory.buffer, ptr, 8);
    v.setInt32(0, maxContext, true);
    v.setInt32(4, maxBatch, true);
    return ptr;
  }

  sessionBytes(options: SessionOptions = {}): number {
    return withScratch(this.core, (s) => {
      const opts = this.#sessionOptions(s, options);
      const out = s.alloc(8);
      this.check(this.core._kvl_session_bytes(this.#live, opts, out));
      return Number(new DataView(this.memory.buffer, out, 8).getBigUint64(0, true));
    });
  }

  newSession(options: SessionOptions = {}): CoreSession {
    const ptr = withScratch(this.core, (s) => {
      const opts = this.#sessionOptions(s, options);
      const out = s.alloc(8);
      this.check(this.core._kvl_session_new(this.#live, opts, out));
      return new DataView(this.memory.buffer, out, 4).getUint32(0, true);
    });
    const session = new WasmSession(this, ptr, () => this.#sessions.delete(session));
    this.#sessions.add(session);
    return session;
  }

  /** grids copied into the instance; kvl_vision_bytes run on them (the core's checks). */
  #visionBytesIn(s: Scratch, grids: Int32Array): { gridsPtr: number; bytes: number } {
    checkGridsLength(grids);
    const gridsPtr = s.alloc(grids.byteLength);
    new Int32Array(this.memory.buffer, gridsPtr, grids.length).set(grids);
    const out = s.alloc(8);
    this.check(this.core._kvl_vision_bytes(this.#live, gridsPtr, grids.length / 2, out));
    return { gridsPtr, bytes: Number(new DataView(this.memory.buffer, out, 8).getBigUint64(0, true)) };
  }

  visionBytes(grids: Int32Array): number {
    return withScratch(this.core, (s) => this.#visionBytesIn(s, grids).bytes);
  }

  encodeImages(pixelValues: Float32Array, grids: Int32Array): Float32Array {
    return withScratch(this.core, (s) => {
      const { gridsPtr } = this.#visionBytesIn(s, grids);
      const shape = visionShape(this.#info, grids);
      checkPixelLength(pixelValues, shape, this.#info.visionPatchSize);
      const count = shape.rows * this.#info.hiddenSize;
      const pixels = s.alloc(pixelValues.byteLength);
      new Float32Array(this.memory.buffer, pixels, pixelValues.length).set(pixelValues);
      const out = s.alloc(count * 4);
      this.check(this.core._kvl_vision_encode(this.#live, pixels, gridsPtr, shape.nImages, out));
      return new Float32Array(this.memory.buffer, out, count).slice();
    });
  }

  close(): void {
    if (this.#ptr === 0) return;
    if (this.#sessions.size > 0) throw new Error("kvl: close the engine's sessions before the engine");
    this.core._kvl_engine_free(this.#ptr);
    this.#ptr = 0;
  }
}

class WasmSession implements CoreSession {
  #ptr: number;
  /** vocab floats in the instance for step() (the last range only: the others go through
   * forward), allocated once: decoding allocates nothing. */
  #stepLogits = 0;
  /** Address of the flag the core watches, 0 until cancelFlags() is first called. */
  #cancelFlag = 0;
  readonly #vocab: number;
  readonly #hidden: number;
  readonly #layerEnd: number;
  readonly #nLayers: number;

  constructor(private readonly engine: WasmEngine, ptr: number, private readonly onClose: () => void) {
    this.#ptr = ptr;
    const info = engine.info();
    this.#vocab = info.vocabSize;
    this.#hidden = info.hiddenSize;
    this.#layerEnd = info.layerEnd;
    this.#nLayers = info.nLayers;
    if (this.#layerEnd === this.#nLayers) {
      this.#stepLogits = engine.core._malloc(this.#vocab * 4) >>> 0;
      if (this.#stepLogits === 0) {
        engine.core._kvl_session_free(ptr);
        throw new CoreError(4, "out of WebAssembly memory for the session's logits");
      }
    }
  }

  get #live(): number {
    if (this.#ptr === 0) throw new Error("kvl: the session was closed");
    return this.#ptr;
  }

  position(): number {
    return this.engine.core._kvl_session_position(this.#live);
  }

  prefill(tokens: Int32Array, media: Float32Array | null, logits: LogitsMode): Float32Array | null {
    return this.forward(tokens, media, logits, false);
  }

  forward(input: Int32Array | Float32Array, media: Float32Array | null, logits: LogitsMode, decode: boolean): Float32Array | null {
    const session = this.#live;
    const H = this.#hidden;
    const isHidden = input instanceof Float32Array;
    if (isHidden && input.length % H !== 0) throw new RangeError(`hidden states must be whole rows of hidden_size ${H} floats, got ${input.length}`);
    const n = isHidden ? input.length / H : input.length;
    const mode = logitsModeCode(logits);
    const nMedia = wholeRows("media rows", media, H);
    const lastRange = this.#layerEnd === this.#nLayers;
    const core = this.engine.core;
    return withScratch(core, (s) => {
      const buffer = this.engine.memory.buffer;
      const inPtr = s.alloc(input.byteLength);
      if (isHidden) new Float32Array(buffer, inPtr, input.length).set(input);
      else new Int32Array(buffer, inPtr, input.length).set(input);
      let mediaPtr = 0;
      if (media !== null && nMedia > 0) {
        mediaPtr = s.alloc(media.byteLength);
        new Float32Array(buffer, mediaPtr, media.length).set(media);
      }
      const count = !lastRange ? n * H : mode === 0 ? 0 : mode === 1 ? this.#vocab : n * this.#vocab;
      const out = count > 0 ? s.alloc(count * 4) : 0;
      this.engine.check(core._kvl_session_forward(session, isHidden ? 0 : inPtr, isHidden ? inPtr : 0, n, mediaPtr, nMedia,
        lastRange ? 0 : out, mode, lastRange ? out : 0, decode ? 1 : 0));
      return count > 0 ? new Float32Array(buffer, out, count).slice() : null;
    });
  }

  cancelFlags(): Int32Array[] {
    const session = this.#live;
    if (this.#cancelFlag === 0) {
      // 4 bytes of the instance's (shared) memory, freed with the session
      this.#cancelFlag = this.engine.core._malloc(8) >>> 0;
      if (this.#cancelFlag === 0) throw new CoreError(4, "out of WebAssembly memory for the cancel flag");
      new Int32Array(this.engine.memory.buffer, this.#cancelFlag, 1)[0] = 0;
      this.engine.core._kvl_session_watch_cancel(session, this.#cancelFlag);
    }
    return [new Int32Array(this.engine.memory.buffer, this.#cancelFlag, 1)];
  }

  step(token: number): Float32Array {
    const session = this.#live;
    if (this.#stepLogits === 0) throw new RangeError("step() runs on the engine of the last layers; use forward() on the others");
    this.engine.check(this.engine.core._kvl_session_step(session, token, this.#stepLogits));
    return new Float32Array(this.engine.memory.buffer, this.#stepLogits, this.#vocab).slice();
  }

  truncate(n: number): void {
    this.engine.check(this.engine.core._kvl_session_truncate(this.#live, n));
  }

  close(): void {
    if (this.#ptr === 0) return;
    this.engine.core._kvl_session_free(this.#ptr);
    if (this.#stepLogits !== 0) this.engine.core._free(this.#stepLogits);
    if (this.#cancelFlag !== 0) this.engine.core._free(this.#cancelFlag);
    this.#ptr = 0;
    this.onClose();
  }
}
