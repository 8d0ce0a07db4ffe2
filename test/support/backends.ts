/**
 * backends.ts — the two core builds every engine test file runs on, defined once: the native
 * addon and a WebAssembly instance with a pthread per engine thread, opened in beforeAll and
 * closed in afterAll; the kernel sets each backend is tested on; an engine opened with the file's
 * thread count; and the mode `--act-dtype auto` runs on a backend's default kernel set.
 */
import type { ActDtype, CoreEngine, EngineOptions, KernelChoice } from "../../host/core/core-api.js";
import { NativeBackend } from "../../host/core/native-backend.js";
import { WasmBackend } from "../../host/core/wasm-backend.js";
import { resolveActMode } from "../../host/plan/act-mode.js";

export type BackendName = "wasm" | "native";
export const BACKENDS: readonly BackendName[] = ["wasm", "native"];
/** Every kernel set of each backend (a test skips, with its reason, the ones this CPU lacks). */
export const KERNEL_SETS: Readonly<Record<BackendName, readonly KernelChoice[]>> = {
  wasm: ["scalar", "simd128"],
  native: ["scalar", "avx2", "avx512"],
};

export class BothBackends {
  #wasm: WasmBackend | null = null;
  #native: NativeBackend | null = null;

  /** threads: each engine's nThreads; wasmMemoryBytes: the WebAssembly instance's memory. */
  constructor(readonly threads: number, private readonly wasmMemoryBytes = 512 * 2 ** 20) {}

  async open(): Promise<void> {
    this.#native = new NativeBackend();
    this.#wasm = await WasmBackend.create({ memoryBytes: this.wasmMemoryBytes, pthreads: WasmBackend.pthreadsForEngine(this.threads) });
  }

  close(): void {
    this.#wasm?.close();
    this.#native?.close();
  }

  get wasm(): WasmBackend {
    if (!this.#wasm) throw new Error("BothBackends: open() first");
    return this.#wasm;
  }

  get native(): NativeBackend {
    if (!this.#native) throw new Error("BothBackends: open() first");
    return this.#native;
  }

  core(backend: BackendName): WasmBackend | NativeBackend {
    return backend === "wasm" ? this.wasm : this.native;
  }

  openEngine(backend: BackendName, pack: string, options: Omit<EngineOptions, "nThreads"> = {}): CoreEngine {
    return this.core(backend).openEngine(pack, { nThreads: this.threads, ...options });
  }

  /** The mode `--act-dtype auto` runs on this backend's default kernel set (host/plan/act-mode.ts). */
  autoAct(backend: BackendName): ActDtype {
    return resolveActMode("auto", backend, this.core(backend).defaultKernelSet()).actDtype;
  }
}
