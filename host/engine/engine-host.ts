/**
 * engine-host.ts — opens a packed model as a text engine on one backend, split into instances.
 *
 * Owns: where each layer range runs — WebAssembly: one instance per range, each with its own
 * memory (at most 4 GiB) and thread pool; native: every range in this process (one range unless
 * a split is forced, for parity tests). Every open follows a plan (planner.ts): each range is
 * opened with exactly the plan's options and, on WebAssembly, memory. Only the first range (layer
 * 0 on) loads the vision tower, when loadVision asks for it: images are encoded there, and a copy
 * in every range would only waste memory. Every WebAssembly instance of a model runs the same
 * build, the one --kernels picks (wasm-relaxed.ts). Does not own how many ranges there are or how
 * big each memory must be (the planner) or the chaining of sessions (split-engine.ts).
 */
import type { BackendName, CoreBackend, CoreEngine, EngineOptions } from "../core/core-api.js";
import { NativeBackend, loadNativeAddon } from "../core/native-backend.js";
import { nativeAddonPath } from "../system/paths.js";
import { SplitEngine, expertSlotsOpened } from "./split-engine.js";
import { WasmBackend } from "../core/wasm-backend.js";
import { wasmBuildFor } from "../core/wasm-relaxed.js";

/** One planned instance (planner.ts InstancePlan, as plain data so it can cross to the worker). */
export interface PlannedInstance {
  engineOptions: EngineOptions & { layerBegin: number; layerEnd: number };
  memoryBytes: number;
  /** Bytes of the expert cache (within engineOptions.expertCacheBytes) that the image lines lend
   * while no image is in flight (planner.ts InstancePlan.expertLoan); absent or 0: none. */
  expertLoan?: number;
}

export interface HostedEngineOptions extends Omit<EngineOptions, "layerBegin" | "layerEnd"> {
  /** Compute threads per instance (one instance computes at a time, so threads = cores). */
  nThreads: number;
  /** The plan's instances (ranges, per-range engine options, memories), at least one; a range's
   * options override these. */
  planned: PlannedInstance[];
  /** Native: the addon backend.ts chose (its record's native.path); absent: paths.ts nativeAddonPath. */
  nativeAddon?: string;
}

/** A model opened over one or more engines, and the backends that own their memory. */
export interface HostedEngine {
  readonly engine: SplitEngine;
  readonly backend: BackendName;
  /** Layer ranges, one per instance. */
  readonly ranges: ReadonlyArray<[number, number]>;
  /** The core that samples tokens (kvl_sample): the native addon, or the last instance. */
  readonly sampler: CoreBackend;
  /** Whether the plan lends the image lines to the expert caches (lendImageRoom does something). */
  readonly lendsImageRoom: boolean;
  /**
   * lent: every range's cache uses its whole slab, the image lines' loan included (as opened);
   * not lent: each gives its loan back (its extents dropped, their pages returned to the OS)
   * before an image is decoded or encoded. Between engine calls only.
   */
  lendImageRoom(lent: boolean): void;
  /** Closes the engine, then the instances. */
  close(): void;
}

/** One range's engine options: the caller's, then the range's; vision in the first range only. */
function rangeOptions(engineOptions: EngineOptions, spec: PlannedInstance): EngineOptions {
  const options = { ...engineOptions, ...spec.engineOptions };
  return { ...options, loadVision: spec.engineOptions.layerBegin === 0 && options.loadVision === true };
}

export async function openHostedEngine(backend: BackendName, packDir: string, options: HostedEngineOptions): Promise<HostedEngine> {
  const { planned: specs, nativeAddon, ...engineOptions } = options;
  if (specs.length === 0) throw new RangeError("openHostedEngine needs a plan of at least one instance");
  const ranges = specs.map((s): [number, number] => [s.engineOptions.layerBegin, s.engineOptions.layerEnd]);
  const parts: CoreEngine[] = [];
  const owners: CoreBackend[] = [];
  try {
    if (backend === "native") {
      const native = new NativeBackend(loadNativeAddon(nativeAddon ?? nativeAddonPath()));
      owners.push(native);
      for (const spec of specs) parts.push(native.openEngine(packDir, rangeOptions(engineOptions, spec)));
    } else {
      const build = await wasmBuildFor(engineOptions.kernels);
      for (const spec of specs) {
        const wasm = await WasmBackend.create({ build, memoryBytes: spec.memoryBytes, pthreads: WasmBackend.pthreadsForEngine(options.nThreads) });
        owners.push(wasm);
        parts.push(wasm.openEngine(packDir, rangeOptions(engineOptions, spec)));
      }
    }
  } catch (err) {
    for (const p of parts) p.close();
    for (const o of owners) o.close();
    throw err;
  }
  const engine = new SplitEngine(parts, rangeOptions(engineOptions, specs[0]!).loadVision === true);
  const loans = parts.map((p, i) => {
    const extent = p.info().expertExtentBytes;
    return { created: expertSlotsOpened(p), lent: extent > 0 ? Math.floor((specs[i]!.expertLoan ?? 0) / extent) : 0 };
  });
  return {
    engine, backend, ranges, sampler: owners.at(-1)!,
    lendsImageRoom: loans.some((l) => l.lent > 0),
    lendImageRoom(lent: boolean) {
      parts.forEach((p, i) => {
        const loan = loans[i]!;
        if (loan.lent > 0) p.setExpertSlots(lent ? loan.created : loan.created - loan.lent);
      });
    },
    close() {
      try {
        engine.close();
      } finally {
        for (const o of owners) o.close();
      }
    },
  };
}
