/**
 * engine-host.ts — opens a packed model as a text engine on one backend, split into instances.
 *
 * Owns: where each layer range runs — WebAssembly: one instance per range, each with its own
 * memory (at most 4 GiB) and thread pool; native: every range in this process (one range unless
 * a split is forced, for parity tests) — and sharing the expert-cache budget between ranges in
 * proportion to their layers, when no plan is given. With a plan (planner.ts), each range is
 * opened with exactly the plan's options and, on WebAssembly, memory. Without one, the number of
 * instances comes from the caller (`--instances`, KVL_INSTANCES) or is 1. Either way only the
 * first range (layer 0 on) loads the vision tower, when loadVision asks for it: images are encoded
 * there, and a copy in every range would only waste memory. Every WebAssembly instance of a model
 * runs the same build, the one --kernels picks (wasm-relaxed.ts). Does not own how big each memory
 * must be (the planner) or the chaining of sessions (split-engine.ts).
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

import type { BackendName, CoreBackend, CoreEngine, EngineOptions } from "../core/core-api.js";
import { parseJson } from "../system/json-file.js";
import { textDims } from "../pack/model-spec.js";
import { NativeBackend, loadNativeAddon } from "../core/native-backend.js";
import { nativeAddonPath } from "../system/paths.js";
import { SplitEngine } from "./split-engine.js";
import { layerRanges, requestedInstances } from "../plan/instances.js";
import { UserError } from "../system/user-error.js";
import { MAX_INSTANCE_BYTES, WasmBackend } from "../core/wasm-backend.js";
import { wasmBuildFor } from "../core/wasm-relaxed.js";

/** One planned instance (planner.ts InstancePlan, as plain data so it can cross to the worker). */
interface PlannedInstance {
  engineOptions: EngineOptions & { layerBegin: number; layerEnd: number };
  memoryBytes: number;
}

export interface HostedEngineOptions extends Omit<EngineOptions, "layerBegin" | "layerEnd"> {
  /** Compute threads per instance (one instance computes at a time, so threads = cores). */
  nThreads: number;
  /** The plan's instances (ranges, per-range engine options, memories); overrides instances,
   * instanceMemoryBytes and the cache options. */
  planned?: PlannedInstance[];
  /** Instances the layers are split over; absent: KVL_INSTANCES, else 1. */
  instances?: number;
  /** WebAssembly: the memory of each instance in bytes (a multiple of 64 KiB, at most 4 GiB). */
  instanceMemoryBytes?: number;
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
  /** Closes the engine, then the instances. */
  close(): void;
}

function packLayers(packDir: string): number {
  let config: unknown;
  try {
    config = parseJson(readFileSync(join(packDir, "config.json")));
  } catch (err) {
    throw new UserError(`${join(packDir, "config.json")}: cannot read the pack's config (${(err as Error).message}); is ${packDir} a pack made by kvl pack?`);
  }
  return textDims(config).num_hidden_layers;
}

/** Without a plan: equal layer ranges, the expert budget shared by layers, equal memories, the
 * vision tower (if asked for) in the first range only. */
function evenSplit(packDir: string, instances: number | undefined, engineOptions: EngineOptions, memoryBytes: number): PlannedInstance[] {
  const nLayers = packLayers(packDir);
  return layerRanges(nLayers, requestedInstances(instances)).map(([begin, end]) => {
    const budget = engineOptions.expertCacheBytes ? Math.floor((engineOptions.expertCacheBytes * (end - begin)) / nLayers) : 0;
    return {
      engineOptions: { ...(budget ? { expertCacheBytes: budget } : {}), loadVision: begin === 0 && engineOptions.loadVision === true, layerBegin: begin, layerEnd: end },
      memoryBytes,
    };
  });
}

/** One range's engine options: the caller's, then the range's; vision in the first range only. */
function rangeOptions(engineOptions: EngineOptions, spec: PlannedInstance): EngineOptions {
  const options = { ...engineOptions, ...spec.engineOptions };
  return { ...options, loadVision: spec.engineOptions.layerBegin === 0 && options.loadVision === true };
}

export async function openHostedEngine(backend: BackendName, packDir: string, options: HostedEngineOptions): Promise<HostedEngine> {
  const { instances: _i, instanceMemoryBytes, planned, nativeAddon, ...engineOptions } = options;
  const specs = planned ?? evenSplit(packDir, options.instances, engineOptions, instanceMemoryBytes ?? MAX_INSTANCE_BYTES);
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
  return {
    engine, backend, ranges, sampler: owners.at(-1)!,
    close() {
      try {
        engine.close();
      } finally {
        for (const o of owners) o.close();
      }
    },
  };
}
