/**
 * even-split.ts — the plan an engine test opens a model with when the test is about the engine,
 * not the planner: equal layer ranges (instances.ts layerRanges, the planner's rule), the expert
 * budget shared by layers, equal memories, the vision tower (if asked for) in the first range only.
 *
 * Owns: turning a test's "split over N instances of M bytes each" into the plan openHostedEngine
 * and EngineClient.open require (the product always opens with the planner's plan: planner.ts).
 * Does not own: the ranges' rule (instances.ts) or how an engine opens them (engine-host.ts).
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

import type { HostedEngineOptions, PlannedInstance } from "../../host/engine/engine-host.js";
import { MAX_INSTANCE_BYTES } from "../../host/core/wasm-backend.js";
import { textDims } from "../../host/pack/model-spec.js";
import { layerRanges, requestedInstances } from "../../host/plan/instances.js";

export interface EvenSplitOptions extends Omit<HostedEngineOptions, "planned"> {
  /** Instances the layers are split over; absent: KVL_INSTANCES, else 1 (instances.ts). */
  instances?: number;
  /** WebAssembly: the memory of each instance in bytes (a multiple of 64 KiB); absent: the largest. */
  instanceMemoryBytes?: number;
}

/** The pack's decoder layers (its config.json). */
export function packLayers(packDir: string): number {
  return textDims(JSON.parse(readFileSync(join(packDir, "config.json"), "utf8"))).num_hidden_layers;
}

/** The caller's options with an even plan over `packDir`'s layers in place of instances and memory. */
export function evenSplit(packDir: string, options: EvenSplitOptions): HostedEngineOptions {
  const { instances, instanceMemoryBytes, ...hosted } = options;
  const nLayers = packLayers(packDir);
  const planned = layerRanges(nLayers, requestedInstances(instances)).map(([begin, end]): PlannedInstance => {
    const budget = hosted.expertCacheBytes ? Math.floor((hosted.expertCacheBytes * (end - begin)) / nLayers) : 0;
    return {
      engineOptions: { ...(budget ? { expertCacheBytes: budget } : {}), loadVision: begin === 0 && hosted.loadVision === true, layerBegin: begin, layerEnd: end },
      memoryBytes: instanceMemoryBytes ?? MAX_INSTANCE_BYTES,
    };
  });
  return { ...hosted, planned };
}
