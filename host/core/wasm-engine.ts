/**
 * wasm-engine.ts — the engine (kvl_engine_*, kvl_session_*, the vision encoder kvl_vision_*)
 * inside one WebAssembly instance.
 *
 * Owns: reading the instance's layout tables (kvl_struct_layout) and, from them alone, writing
 * kvl_engine_options and reading kvl_engine_info and kvl_stats in its memory (no field is spelled
 * out here; test/boundary.test.ts holds the tables to the TypeScript types); the byte layout of
 * kvl_session_options; and copying tokens, media rows, logits, pixels, grids and image
 * embeddings through the instance's memory (malloc'd per call, freed after it; the core
 * allocates a vision call's working memory itself). The pack files are opened and read by the
 * instance's own threads through platform_wasm.c.
 * Does not own: the instance (wasm-backend.ts) or the engine interfaces (core-api.ts).
 */
import { type ConstantRow, type ConstantsId, type CoreEngine, CoreError, type CoreSession, type EngineInfo, type EngineOptions, type EngineStats, type FieldLayout, fieldKind, jsFieldName, KVL_STRUCTS, type StructId, type StructLayout, logitsModeCode, wholeRows, type LogitsMode, ROUTING_MODE_CODES, type RoutingHook, type SessionOptions, engineOptionCodes, sessionOptionCodes, checkGridsLength, checkPixelLength, visionShape } from "./core-api.js";
import { RoutingBinding, routingRowLength } from "./routing-binding.js";

/** The engine exports of the emscripten module (pointers are wasm32 addresses). */
export interface EmscriptenEngineExports {
  _malloc(bytes: number): number;
  _free(ptr: number): void;
  _kvl_engine_open(path: number, options: number, outEngine: number, err: number, errLen: number): number;
  _kvl_engine_free(engine: number): void;
  _kvl_engine_get_info(engine: number, out: number): number;
  _kvl_engine_get_stats(engine: number, out: number): number;
  _kvl_engine_reset_stats(engine: number): void;
  _kvl_engine_set_expert_slots(engine: number, slots: number, outActive: number): number;
  _kvl_engine_last_error(engine: number): number;
  _kvl_session_bytes(engine: number, options: number, outBytes: number): number;
  _kvl_session_new(engine: number, options: number, outSession: number): number;
  _kvl_session_free(session: number): void;
  _kvl_session_position(session: number): number;
  _kvl_session_truncate(session: number, n: number): number;
  _kvl_session_prefill(session: number, tokens: number, n: number, media: number, nMedia: number, mode: number, logits: number): number;
  _kvl_session_step(session: number, token: number, logits: number): number;
  _kvl_session_watch_cancel(session: number, flag: number): void;
  _kvl_session_set_routing(session: number, mode: number, seed: number, ids: number, weights: number, capacity: number): number;
  _kvl_session_forward(session: number, tokens: number, hiddenIn: number, n: number, media: number, nMedia: number,
    hiddenOut: number, mode: number, logits: number, decode: number): number;
  _kvl_vision_bytes(engine: number, grids: number, nImages: number, outBytes: number): number;
  _kvl_vision_encode(engine: number, pixelValues: number, grids: number, nImages: number, out: number): number;
  _kvl_struct_layout(which: number, outCount: number, outStructBytes: number): number;
  _kvl_constants(which: number, outCount: number): number;
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

/** kvl_field_desc in wasm32 (kvl_core.h; layout.c asserts it): name address, offset, bytes, kind. */
const FIELD_DESC_BYTES = 16;

/** The layouts read from each instance (the tables are static in it). */
const layouts = new WeakMap<EmscriptenEngineExports, Map<StructId, StructLayout>>();

/** kvl_struct_layout of this instance, with the JS names (jsFieldName). */
export function wasmStructLayout(core: EmscriptenEngineExports, memory: WebAssembly.Memory, which: StructId): StructLayout {
  let known = layouts.get(core);
  if (known === undefined) layouts.set(core, (known = new Map()));
  const cached = known.get(which);
  if (cached !== undefined) return cached;
  const layout = withScratch(core, (s) => {
    const out = s.alloc(8);
    const table = core._kvl_struct_layout(which, out, out + 4) >>> 0;
    const head = new DataView(memory.buffer, out, 8);
    const count = head.getInt32(0, true);
    const bytes = head.getUint32(4, true);
    if (table === 0) throw new RangeError(`the WebAssembly core describes no struct ${which}`);
    const rows = new DataView(memory.buffer, table, count * FIELD_DESC_BYTES);
    const fields: FieldLayout[] = [];
    for (let i = 0; i < count; i++) {
      const at = i * FIELD_DESC_BYTES;
      const cName = core.UTF8ToString(rows.getUint32(at, true));
      fields.push({
        name: jsFieldName(cName), cName, offset: rows.getUint32(at + 4, true), bytes: rows.getUint32(at + 8, true),
        kind: fieldKind(rows.getInt32(at + 12, true), cName),
      });
    }
    return { bytes, fields };
  });
  known.set(which, layout);
  return layout;
}

/** kvl_constants of this instance: kvl_const_desc rows {name, value} of 8 bytes (layout.c). */
export function wasmConstants(core: EmscriptenEngineExports, memory: WebAssembly.Memory, which: ConstantsId): ConstantRow[] {
  return withScratch(core, (s) => {
    const out = s.alloc(4);
    const table = core._kvl_constants(which, out) >>> 0;
    const count = new DataView(memory.buffer, out, 4).getInt32(0, true);
    if (table === 0) throw new RangeError(`the WebAssembly core has no list of codes ${which}`);
    const rows = new DataView(memory.buffer, table, count * 8);
    return Array.from({ length: count }, (_, i) => ({ name: core.UTF8ToString(rows.getUint32(i * 8, true)), value: rows.getInt32(i * 8 + 4, true) }));
  });
}

/** The struct at ptr as an object, one property per member of its layout. */
function readStruct(core: EmscriptenEngineExports, memory: WebAssembly.Memory, ptr: number, layout: StructLayout): Record<string, number | boolean | string> {
  const v = new DataView(memory.buffer, ptr, layout.bytes);
  const out: Record<string, number | boolean | string> = {};
  for (const f of layout.fields) {
    switch (f.kind) {
      case "i32": out[f.name] = v.getInt32(f.offset, true); break;
      case "bool32": out[f.name] = v.getInt32(f.offset, true) !== 0; break;
      case "i64": out[f.name] = Number(v.getBigInt64(f.offset, true)); break;
      case "u64": out[f.name] = Number(v.getBigUint64(f.offset, true)); break;
      case "chars": out[f.name] = core.UTF8ToString(ptr + f.offset, f.bytes); break;
    }
  }
  return out;
}

/** values (numbers by JS name; absent = 0, the core's default) into the struct at ptr, zeroed
 * first. Only numeric members: no struct the host writes has text. */
function writeStruct(memory: WebAssembly.Memory, ptr: number, layout: StructLayout, values: Readonly<Record<string, number | undefined>>): void {
  new Uint8Array(memory.buffer, ptr, layout.bytes).fill(0);
  const v = new DataView(memory.buffer, ptr, layout.bytes);
  for (const f of layout.fields) {
    const x = values[f.name];
    if (x === undefined) continue;
    switch (f.kind) {
      case "i32": case "bool32": v.setInt32(f.offset, x, true); break;
      case "i64": v.setBigInt64(f.offset, BigInt(x), true); break;
      case "u64": v.setBigUint64(f.offset, BigInt(x), true); break;
      case "chars": throw new Error(`kvl: struct member ${f.cName} is text, which the host never writes`);
    }
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
      const layout = wasmStructLayout(core, memory, KVL_STRUCTS.engineOptions);
      const opts = s.alloc(layout.bytes);
      writeStruct(memory, opts, layout, codes);
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

  /** kvl_engine_get_info or kvl_engine_get_stats into scratch, read by the instance's layout table. */
  #readStruct(which: StructId, get: (engine: number, out: number) => number): Record<string, number | boolean | string> {
    const layout = wasmStructLayout(this.core, this.memory, which);
    return withScratch(this.core, (s) => {
      const out = s.alloc(layout.bytes);
      this.check(get(this.#live, out));
      return readStruct(this.core, this.memory, out, layout);
    });
  }

  #readInfo(): EngineInfo {
    return this.#readStruct(KVL_STRUCTS.engineInfo, (e, out) => this.core._kvl_engine_get_info(e, out)) as unknown as EngineInfo;
  }

  info(): EngineInfo {
    return { ...this.#info };
  }

  stats(): EngineStats {
    return this.#readStruct(KVL_STRUCTS.stats, (e, out) => this.core._kvl_engine_get_stats(e, out)) as unknown as EngineStats;
  }

  resetStats(): void {
    this.core._kvl_engine_reset_stats(this.#live);
  }

  setExpertSlots(slots: number): number {
    if (!Number.isSafeInteger(slots) || slots < 0 || slots > 0x7fffffff) throw new RangeError(`expert slots must be a non-negative int32, got ${slots}`);
    return withScratch(this.core, (s) => {
      const out = s.alloc(4);
      this.check(this.core._kvl_engine_set_expert_slots(this.#live, slots, out));
      return new DataView(this.memory.buffer, out, 4).getInt32(0, true);
    });
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
  readonly #info: EngineInfo;
  /** A routing override's hook (kvl bench --routing) and its rows in the instance (ids, then
   * weights: one malloc, freed with the session or the next setRouting), else null / 0. */
  #routing: RoutingBinding | null = null;
  #routingRows = 0;

  constructor(private readonly engine: WasmEngine, ptr: number, private readonly onClose: () => void) {
    this.#ptr = ptr;
    const info = engine.info();
    this.#info = info;
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
      this.#routed(n, () => this.engine.check(core._kvl_session_forward(session, isHidden ? 0 : inPtr, isHidden ? inPtr : 0, n, mediaPtr, nMedia,
        lastRange ? 0 : out, mode, lastRange ? out : 0, decode ? 1 : 0)));
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
    this.#routed(1, () => this.engine.check(this.engine.core._kvl_session_step(session, token, this.#stepLogits)));
    return new Float32Array(this.engine.memory.buffer, this.#stepLogits, this.#vocab).slice();
  }

  truncate(n: number): void {
    this.engine.check(this.engine.core._kvl_session_truncate(this.#live, n));
  }

  /** One forward with the routing hook's fill() before and taken() after it. */
  #routed(n: number, call: () => void): void {
    RoutingBinding.around(this.#routing, () => this.position(), n, call);
  }

  setRouting(hook: RoutingHook | null): void {
    const session = this.#live;
    const core = this.engine.core;
    let ptr = 0;
    let length = 0;
    if (hook !== null) {
      length = routingRowLength(hook, this.#info.nLayers, this.#info.numExpertsPerTok);
      ptr = core._malloc(length * 8) >>> 0;
      if (ptr === 0) throw new CoreError(4, "out of WebAssembly memory for the routing rows");
      new Uint8Array(this.engine.memory.buffer, ptr, length * 8).fill(0);
    }
    const code = hook === null ? 0 : ROUTING_MODE_CODES[hook.mode];
    const status = core._kvl_session_set_routing(session, code, hook === null ? 0 : hook.seed >>> 0, ptr, ptr === 0 ? 0 : ptr + length * 4,
      hook === null ? 0 : hook.capacity);
    if (status !== 0 && ptr !== 0) core._free(ptr);
    this.engine.check(status);
    if (this.#routingRows !== 0) core._free(this.#routingRows);
    this.#routingRows = ptr;
    this.#routing = hook === null ? null : new RoutingBinding(hook, () => ({
      ids: new Int32Array(this.engine.memory.buffer, ptr, length),
      weights: new Float32Array(this.engine.memory.buffer, ptr + length * 4, length),
    }), this.#info.layerBegin, this.#info.layerEnd);
  }

  close(): void {
    if (this.#ptr === 0) return;
    this.engine.core._kvl_session_free(this.#ptr);
    if (this.#stepLogits !== 0) this.engine.core._free(this.#stepLogits);
    if (this.#cancelFlag !== 0) this.engine.core._free(this.#cancelFlag);
    if (this.#routingRows !== 0) this.engine.core._free(this.#routingRows);
    this.#ptr = 0;
    this.onClose();
  }
}
