/**
 * wasm-backend.ts — the core as WebAssembly (SIMD128 + pthreads), from wasm-core/dist/.
 *
 * Owns: instantiating the emscripten module (its loader is CommonJS, its bytes are passed in as
 * wasmBinary because the loader would fetch() them) of either build — kvl_core (kernel sets
 * scalar, simd128) or kvl_core_relaxed (also simd128-relaxed, which it runs by default; it
 * validates only where relaxed SIMD does) — and marshalling the kernel-set API across the
 * instance's memory. Does not own: choosing the backend (backend.ts) or the build (wasm-relaxed.ts).
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { type ConformanceReport, type CoreBackend, type KernelSet, type Pcg64State, type SamplerParams, checkPackExpertArgs, checkPackQ8RowsArgs, checkQ4ExpertDims, packExpertStatus, packQ8RowsStatus, parseConformanceReport, type CoreEngine, type EngineOptions, type StructId, type StructLayout, type ConstantRow, type ConstantsId } from "./core-api.js";
import { q8RowsLayout } from "../pack/pack-format.js";
import { requireFile, wasmDistDir } from "../system/paths.js";
import { type EmscriptenEngineExports, WasmEngine, wasmConstants, wasmStructLayout } from "./wasm-engine.js";

/** The parts of the emscripten module object the host uses. */
interface EmscriptenCore extends EmscriptenEngineExports {
  _malloc(bytes: number): number;
  _free(ptr: number): void;
  _kvl_abi_version(): number;
  _kvl_kernel_set_count(): number;
  _kvl_kernel_set_name(index: number): number;
  _kvl_kernel_set_supported(namePtr: number): number;
  _kvl_kernel_set_default(): number;
  _kvl_kernels_conformance(namePtr: number, out: number, outLen: number): number;
  _kvl_expert_extent_bytes(intermediate: number, hidden: number): number;
  _kvl_pack_expert(gate: number, up: number, down: number, intermediate: number, hidden: number, out: number, outBytes: number): number;
  _kvl_pack_q8_rows(w: number, rows: number, cols: number, out: number, outBytes: number): number;
  _kvl_expert_q4_extent_bytes(intermediate: number, hidden: number): number;
  _kvl_pack_expert_q4(gate: number, up: number, down: number, intermediate: number, hidden: number, out: number, outBytes: number): number;
  _kvl_pcg64_seed(rng: number, words: number): void;
  _kvl_synth_uniform(rng: number, count: number, center: number, halfWidth: number, bf16: number, out: number): void;
  _kvl_sample(sampler: number, logits: number, vocab: number, workspace: number): number;
  /** uint64 seed legalized to two i32 halves (no BigInt integration in this emscripten build). */
  _kvl_sampler_seed(sampler: number, seedLo: number, seedHi: number): void;
  UTF8ToString(ptr: number): string;
  stringToUTF8(str: string, ptr: number, maxBytes: number): void;
  lengthBytesUTF8(str: string): number;
  PThread?: { terminateAllThreads(): void };
}

type CoreFactory = (overrides: { wasmBinary: Uint8Array; wasmMemory: WebAssembly.Memory; kvlPthreads: number }) => Promise<EmscriptenCore>;

/** The two builds of the core in wasm-core/dist/ (wasm-core/build-wasm.sh), by the kernel set
 * each runs by default, and the name of each one's files (NAME.cjs, NAME.worker.js, NAME.wasm). */
export type WasmBuild = "simd128" | "simd128-relaxed";
export const WASM_BUILD_FILES: Readonly<Record<WasmBuild, string>> = { simd128: "kvl_core", "simd128-relaxed": "kvl_core_relaxed" };

const PAGE = 65536;
/** A wasm32 memory addresses 4 GiB, but emscripten 3.1.6's heap size is a 32-bit value: with a
 * full 4 GiB it wraps to 0 and malloc fails (seen here), so an instance holds one page less. */
export const MAX_INSTANCE_BYTES = 4 * 1024 * 1024 * 1024 - PAGE;
/** Memory of an instance when the caller plans none (the kernel self-test needs little). */
export const DEFAULT_INSTANCE_BYTES = 64 * 1024 * 1024;
/**
 * Threads an engine starts besides its compute pool (n_threads - 1 workers): the expert cache's
 * readers (4) and the trunk stream thread, plus one spare. emscripten must have a worker ready
 * for each before the call that starts it: one created later would only start once the calling
 * thread returns to its event loop, which a blocking kvl_engine_open never does.
 */
const ENGINE_EXTRA_THREADS = 6;
/** Pre-started pthread workers when the caller plans no engine (the kernel self-test). */
const DEFAULT_PTHREADS = 4;

const REPORT_BYTES = [1 << 20, 8 << 20];

export class WasmBackend implements CoreBackend {
  readonly backend = "wasm" as const;
  #core: EmscriptenCore | undefined;

  private constructor(core: EmscriptenCore) {
    this.#core = core;
  }

  /**
   * One instance: its own thread pool and its own shared memory of exactly memoryBytes (a
   * multiple of 64 KiB, at most MAX_INSTANCE_BYTES), fixed at creation: it never grows while threads run.
   */
  static async create(options: { distDir?: string; memoryBytes?: number; pthreads?: number; build?: WasmBuild } = {}): Promise<WasmBackend> {
    const distDir = options.distDir ?? wasmDistDir;
    const build = options.build ?? "simd128";
    const pthreads = options.pthreads ?? DEFAULT_PTHREADS;
    if (!Number.isInteger(pthreads) || pthreads < 1 || pthreads > 256) throw new RangeError(`pthreads must be 1..256, got ${pthreads}`);
    const bytes = options.memoryBytes ?? DEFAULT_INSTANCE_BYTES;
    if (!Number.isInteger(bytes) || bytes % PAGE !== 0 || bytes < DEFAULT_INSTANCE_BYTES || bytes > MAX_INSTANCE_BYTES) {
      // below 64 MiB the module does not link (-sINITIAL_MEMORY=64MB in build-wasm.sh)
      throw new RangeError(`wasm instance memory must be a multiple of 64 KiB between 64 MiB and 4 GiB - 64 KiB, got ${bytes}`);
    }
    const wasmMemory = new WebAssembly.Memory({ initial: bytes / PAGE, maximum: bytes / PAGE, shared: true });
    const factory = requireFile(join(distDir, `${WASM_BUILD_FILES[build]}.cjs`)) as CoreFactory;
    const wasmBinary = readFileSync(join(distDir, `${WASM_BUILD_FILES[build]}.wasm`));
    const backend = new WasmBackend(await factory({ wasmBinary, wasmMemory, kvlPthreads: pthreads }));
    backend.memory = wasmMemory;
    backend.pthreads = pthreads;
    backend.build = build;
    return backend;
  }

  /** Which build this instance runs. */
  build: WasmBuild = "simd128";

  /** The instance's memory (for the file bridge and the tests). */
  memory: WebAssembly.Memory | undefined;
  /** pthread workers started with the instance. */
  pthreads = DEFAULT_PTHREADS;

  /** The pthread workers an engine with nThreads compute threads needs (see ENGINE_EXTRA_THREADS). */
  static pthreadsForEngine(nThreads: number): number {
    return nThreads + ENGINE_EXTRA_THREADS;
  }

  /**
   * Opens the pack as a text engine inside this instance; its caches and workspaces live in the
   * instance's memory. nThreads must be given (the pthread workers were started for it).
   */
  openEngine(packDir: string, options: EngineOptions = {}): CoreEngine {
    const nThreads = options.nThreads ?? 0;
    if (nThreads < 1 || WasmBackend.pthreadsForEngine(nThreads) > this.pthreads) {
      throw new RangeError(`a wasm engine with ${nThreads} threads needs an instance created with ` +
        `pthreads >= ${WasmBackend.pthreadsForEngine(Math.max(nThreads, 1))} (this one has ${this.pthreads}); pass nThreads >= 1`);
    }
    return WasmEngine.open(this.#live, this.memory!, packDir, options);
  }

  structLayout(which: StructId): StructLayout {
    return wasmStructLayout(this.#live, this.memory!, which);
  }

  constants(which: ConstantsId): ConstantRow[] {
    return wasmConstants(this.#live, this.memory!, which);
  }

  get #live(): EmscriptenCore {
    if (!this.#core) throw new Error("kvl: the WebAssembly core was closed");
    return this.#core;
  }

  #withString<T>(text: string, use: (ptr: number) => T): T {
    const core = this.#live;
    const bytes = core.lengthBytesUTF8(text) + 1;
    const ptr = core._malloc(bytes);
    if (ptr === 0) throw new Error("kvl: out of WebAssembly memory");
    try {
      core.stringToUTF8(text, ptr, bytes);
      return use(ptr);
    } finally {
      core._free(ptr);
    }
  }

  abiVersion(): number {
    return this.#live._kvl_abi_version();
  }

  kernelSets(): KernelSet[] {
    const core = this.#live;
    const sets: KernelSet[] = [];
    const count = core._kvl_kernel_set_count();
    for (let i = 0; i < count; i++) {
      const name = core.UTF8ToString(core._kvl_kernel_set_name(i));
      sets.push({ name, supported: this.#withString(name, (p) => core._kvl_kernel_set_supported(p)) !== 0 });
    }
    return sets;
  }

  defaultKernelSet(): string {
    const core = this.#live;
    return core.UTF8ToString(core._kvl_kernel_set_default());
  }

  conformance(set: string): ConformanceReport {
    const core = this.#live;
    for (const size of REPORT_BYTES) {
      const out = core._malloc(size);
      if (out === 0) throw new Error("kvl: out of WebAssembly memory");
      try {
        const failed = this.#withString(set, (p) => core._kvl_kernels_conformance(p, out, size));
        if (failed === -1) throw new Error(`kernel set ${set} is not available on the wasm backend here`);
        if (failed === -2) continue;
        return parseConformanceReport(core.UTF8ToString(out >>> 0), set);
      } finally {
        core._free(out);
      }
    }
    throw new Error(`kernel set ${set}: conformance report larger than ${REPORT_BYTES.at(-1)} bytes`);
  }

  /** malloc(bytes) in the instance, use(ptr), free; throws when the instance is out of memory. */
  #withBuffer<T>(bytes: number, use: (ptr: number) => T): T {
    const core = this.#live;
    const ptr = core._malloc(Math.max(bytes, 1));
    if (ptr === 0) throw new Error(`kvl: out of WebAssembly memory (${bytes} bytes wanted)`);
    try {
      return use(ptr >>> 0);
    } finally {
      core._free(ptr);
    }
  }

  #bytes(ptr: number, length: number): Uint8Array {
    return new Uint8Array(this.memory!.buffer, ptr, length);
  }

  #copyIn(ptr: number, data: ArrayBufferView): void {
    this.#bytes(ptr, data.byteLength).set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
  }

  expertExtentBytes(intermediate: number, hidden: number): number {
    return this.#live._kvl_expert_extent_bytes(intermediate, hidden) >>> 0;
  }

  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array {
    checkPackExpertArgs(gate, up, down, intermediate, hidden);
    const matrix = gate.byteLength;
    const extent = this.expertExtentBytes(intermediate, hidden);
    const outOffset = Math.ceil((3 * matrix) / 8) * 8; // the extent's FP32 scales stay aligned
    return this.#withBuffer(outOffset + extent, (base) => {
      this.#copyIn(base, gate);
      this.#copyIn(base + matrix, up);
      this.#copyIn(base + 2 * matrix, down);
      const out = base + outOffset;
      packExpertStatus(this.#live._kvl_pack_expert(base, base + matrix, base + 2 * matrix, intermediate, hidden, out, extent));
      return this.#bytes(out, extent).slice();
    });
  }

  expertQ4ExtentBytes(intermediate: number, hidden: number): number {
    checkQ4ExpertDims(intermediate, hidden, "expertQ4ExtentBytes");
    return this.#live._kvl_expert_q4_extent_bytes(intermediate, hidden) >>> 0;
  }

  packExpertQ4(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array {
    checkQ4ExpertDims(intermediate, hidden, "packExpertQ4");
    checkPackExpertArgs(gate, up, down, intermediate, hidden, "packExpertQ4");
    const matrix = gate.byteLength;
    const extent = this.expertQ4ExtentBytes(intermediate, hidden);
    const outOffset = Math.ceil((3 * matrix) / 8) * 8;
    return this.#withBuffer(outOffset + extent, (base) => {
      this.#copyIn(base, gate);
      this.#copyIn(base + matrix, up);
      this.#copyIn(base + 2 * matrix, down);
      const out = base + outOffset;
      packExpertStatus(this.#live._kvl_pack_expert_q4(base, base + matrix, base + 2 * matrix, intermediate, hidden, out, extent), "kvl_pack_expert_q4");
      return this.#bytes(out, extent).slice();
    });
  }

  packQ8Rows(w: Uint16Array, rows: number, cols: number): Uint8Array {
    checkPackQ8RowsArgs(w, rows, cols);
    const matrix = w.byteLength;
    const nbytes = q8RowsLayout(rows, cols).nbytes;
    const outOffset = Math.ceil(matrix / 8) * 8; // the record's FP32 scales stay aligned
    return this.#withBuffer(outOffset + nbytes, (base) => {
      this.#copyIn(base, w);
      packQ8RowsStatus(this.#live._kvl_pack_q8_rows(base, rows, cols, base + outOffset, nbytes));
      return this.#bytes(base + outOffset, nbytes).slice();
    });
  }

  pcg64Seed(seedWords: BigUint64Array): Pcg64State {
    return this.#withBuffer(64, (ptr) => {
      this.#copyIn(ptr, seedWords);
      this.#live._kvl_pcg64_seed(ptr + 32, ptr);
      return new BigUint64Array(this.#bytes(ptr + 32, 32).slice().buffer);
    });
  }

  synthUniform(state: Pcg64State, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void {
    if (state.length !== 4 || count > out.length) throw new RangeError("synthUniform: state is 4 words, out holds >= count values");
    const bytes = count * out.BYTES_PER_ELEMENT;
    this.#withBuffer(32 + bytes, (ptr) => {
      this.#copyIn(ptr, state);
      this.#live._kvl_synth_uniform(ptr, count, center, halfWidth, out instanceof Uint16Array ? 1 : 0, ptr + 32);
      state.set(new BigUint64Array(this.#bytes(ptr, 32).slice().buffer));
      new Uint8Array(out.buffer, out.byteOffset, bytes).set(this.#bytes(ptr + 32, bytes));
    });
  }

  /** kvl_sampler struct (24 bytes: temperature f32, top_k i32, top_p f32, pad, rng_state u64). */
  sampleToken(logits: Float32Array, params: SamplerParams, rng: BigUint64Array): number {
    const n = logits.length;
    return this.#withBuffer(32 + 8 * n, (ptr) => {
      const view = new DataView(this.memory!.buffer, ptr, 24);
      view.setFloat32(0, params.temperature, true);
      view.setInt32(4, params.topK, true);
      view.setFloat32(8, params.topP, true);
      view.setBigUint64(16, rng[0]!, true);
      this.#copyIn(ptr + 32, logits);
      const token = this.#live._kvl_sample(ptr, ptr + 32, n, ptr + 32 + 4 * n);
      rng[0] = new DataView(this.memory!.buffer, ptr, 24).getBigUint64(16, true);
      logits.set(new Float32Array(this.memory!.buffer, ptr + 32, n));
      return token;
    });
  }

  seedSampler(seed: bigint): BigUint64Array {
    const s = BigInt.asUintN(64, seed);
    return this.#withBuffer(24, (ptr) => {
      this.#live._kvl_sampler_seed(ptr, Number(s & 0xffffffffn) | 0, Number(s >> 32n) | 0);
      return BigUint64Array.of(new DataView(this.memory!.buffer, ptr, 24).getBigUint64(16, true));
    });
  }

  close(): void {
    this.#core?.PThread?.terminateAllThreads();
    this.#core = undefined;
  }
}
