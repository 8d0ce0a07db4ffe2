/**
 * instances.ts — how many instances a model is split over and which decoder layers each runs:
 * the rule the plan counts with and the engine host opens by.
 *
 * Owns: the instance count asked for (--instances, KVL_INSTANCES) and the contiguous layer ranges
 * of a split. Does not own: choosing the count from memory (planner.ts) or running the ranges
 * (engine/split-engine.ts, engine/engine-host.ts).
 */
import { envPositiveInt } from "../system/env.js";
import { UserError } from "../system/user-error.js";

/** The instance count asked for: the option, else KVL_INSTANCES, else 1. */
export function requestedInstances(option: number | undefined, env: NodeJS.ProcessEnv = process.env): number {
  const n = option ?? envPositiveInt("KVL_INSTANCES", env) ?? 1;
  if (!Number.isInteger(n) || n < 1) throw new UserError(`--instances must be a positive integer, got ${JSON.stringify(option)}`);
  return n;
}

/** n contiguous ranges covering [0, nLayers), as equal as whole layers allow (earlier ones larger). */
export function layerRanges(nLayers: number, n: number): Array<[number, number]> {
  if (!Number.isInteger(n) || n < 1) throw new RangeError(`instances must be a positive integer, got ${n}`);
  if (n > nLayers) throw new RangeError(`cannot split ${nLayers} decoder layers over ${n} instances`);
  const ranges: Array<[number, number]> = [];
  let begin = 0;
  for (let i = 0; i < n; i++) {
    const size = Math.floor(nLayers / n) + (i < nLayers % n ? 1 : 0);
    ranges.push([begin, begin + size]);
    begin += size;
  }
  return ranges;
}
