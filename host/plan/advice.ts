/**
 * advice.ts — the search over a plan's settings for what fits: what to change when a plan does
 * not fit (adviceFor: every figure checked by planning again with it alone changed), and the
 * same search picking the auto limits (resolveAutoLimits: the request bodies, the image limit
 * and the expert cache, each the largest that fits).
 *
 * Owns: the ways a plan does not fit, told apart (over the budget; an instance over its limit,
 * InstanceLimitError; an expert cache below its floor, ExpertFloorError; settings that are
 * invalid), the bisections, the advice's wording, and the order the auto limits are resolved in.
 * Does not own: building a plan (planner.ts build, passed in as BuildPlan so this file stays below
 * the plan that quotes its advice) or any byte rule (core-bytes.ts, input-lines.ts).
 */
import { UserError } from "../system/user-error.js";
import { MIB, type PackFacts, mib, modelOf, slotOf } from "./core-bytes.js";
import { BODY_BYTES_FLOOR, DEFAULT_BODY_BYTES } from "./input-lines.js";
import { IMAGE_PIXELS_FLOOR, IMAGE_PIXELS_MAX } from "../image/image-budget.js";
import type { PlanSettings } from "./settings.js";

/** Builds the plan of these settings (planner.ts build); throws the errors below, or a UserError. */
type BuildPlan = (facts: PackFacts, s: PlanSettings) => { readonly total: number; readonly components: { readonly trunkCache: number } };

/** An expert cache below one layer's top-k extents in some range with MoE layers. */
export class ExpertFloorError extends UserError {}

/** A plan that no split into WebAssembly instances of at most maxInstanceBytes can hold. */
export class InstanceLimitError extends UserError {
  constructor(readonly largest: number, readonly limit: number, readonly nInstances: number) {
    super(`one WebAssembly instance would need ${mib(largest)} MiB even split into ${nInstances} instances, over the ` +
      `${mib(limit)} MiB an instance can hold`);
  }
}

type Fit = "fits" | "over" | "instance" | "floor" | "invalid";

/** Plans with these settings and says whether (and why not) the plan fits. */
function fitOf(build: BuildPlan, facts: PackFacts, s: PlanSettings): Fit {
  try {
    return build(facts, s).total <= Math.floor(s.ramMib * MIB) ? "fits" : "over";
  } catch (err) {
    if (err instanceof InstanceLimitError) return "instance";
    if (err instanceof ExpertFloorError) return "floor";
    if (err instanceof UserError) return "invalid";
    throw err;
  }
}

function fits(build: BuildPlan, facts: PackFacts, s: PlanSettings): boolean {
  return fitOf(build, facts, s) === "fits";
}

/** The smallest integer in [lo, hi] where ok holds, given ok is false up to some point and true
 * after (hi when it holds nowhere below hi). */
function smallestTrue(lo: number, hi: number, ok: (v: number) => boolean): number {
  while (lo < hi) {
    const mid = Math.floor((lo + hi) / 2);
    if (ok(mid)) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/** The largest integer in [lo, hi] where ok holds, given ok is true up to some point and false after. */
function largestTrue(lo: number, hi: number, ok: (v: number) => boolean): number | null {
  if (hi < lo || !ok(lo)) return null;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (ok(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/**
 * What to lower (or raise) and to what, each figure checked by planning again with it alone
 * changed: the plan then fits the budget (and, on WebAssembly, every instance its limit).
 */
export function adviceFor(build: BuildPlan, facts: PackFacts, s: PlanSettings): string[] {
  const m = modelOf(facts);
  const hints: string[] = [];
  const fmt = (v: number): string => (Number.isInteger(v) ? String(v) : v.toFixed(2).replace(/\.?0+$/, ""));
  const lower = (flag: string, current: number, to: number): string => `lower ${flag} to ${to} (by ${fmt(current - to)})`;
  // expert cache: fits is monotone in the cache (extents are handed out one at a time)
  // above its floor (top-k extents per range with MoE layers); whole MiB below the current value
  const cacheTop = Math.ceil(s.cacheMib) - 1;
  const cacheFloor = smallestTrue(0, cacheTop, (c) => fitOf(build, facts, { ...s, cacheMib: c }) !== "floor");
  const cache = largestTrue(cacheFloor, cacheTop, (c) => fits(build, facts, { ...s, cacheMib: c }));
  if (cache !== null) hints.push(lower("--cache-mib", s.cacheMib, cache));
  if (s.trunkCacheMib !== null) {
    // not monotone (a streamed tensor costs a double buffer): try every distinct prefix, largest first
    const candidates = new Set<number>([0]);
    let sum = 0;
    for (const t of m.order) {
      sum += slotOf(t, s.actDtype);
      candidates.add(Math.ceil(sum / MIB));
    }
    const below = [...candidates].filter((t) => t < s.trunkCacheMib!).sort((a, b) => b - a);
    const trunk = below.find((t) => fits(build, facts, { ...s, trunkCacheMib: t }));
    if (trunk !== undefined) hints.push(lower("--trunk-cache-mib", s.trunkCacheMib, trunk));
  }
  const context = largestTrue(1, s.maxContext - 1, (c) => fits(build, facts, { ...s, maxContext: c }));
  if (context !== null) hints.push(lower("--max-context", s.maxContext, context));
  if (s.loadVision && fits(build, facts, { ...s, loadVision: false })) hints.push("run without vision");
  // RAM: fits is monotone in the budget (the auto trunk cache only takes what is left)
  // (a budget cannot make an instance fit its limit: then there is no such figure)
  let hi = Math.floor(s.ramMib) + 1;
  let fit = fitOf(build, facts, { ...s, ramMib: hi });
  for (let probes = 0; fit === "over" && probes < 60; probes++) fit = fitOf(build, facts, { ...s, ramMib: (hi *= 2) });
  if (fit === "fits") hints.push(`raise --ram-mib to ${smallestTrue(Math.floor(s.ramMib) + 1, hi, (r) => fits(build, facts, { ...s, ramMib: r }))}`);
  hints.push(...requestAdvice(s, (t) => fits(build, facts, t)));
  if (s.backend === "wasm" && hints.length === 0 && fits(build, facts, { ...s, backend: "native", instances: 1 })) {
    hints.push("use the native backend (--backend native)");
  }
  return hints;
}

/**
 * The auto expert cache's range, in extents: from the fewest every range with MoE layers accepts
 * (top-k each) to every extent of the model; and the cache (MiB) of k extents. null without MoE.
 */
function autoCacheBounds(build: BuildPlan, facts: PackFacts, s: PlanSettings): { floor: number; top: number; mibOf: (k: number) => number } | null {
  const m = modelOf(facts);
  if (m.extent === 0) return null;
  // half a byte over k extents, so that build's floor(cacheMib * MIB) is k extents whatever the
  // rounding of the division
  const mibOf = (k: number): number => (k * m.extent + 0.5) / MIB;
  const top = m.moe.filter(Boolean).length * m.nRouted;
  const floor = smallestTrue(0, top, (k) => fitOf(build, facts, { ...s, cacheMib: mibOf(k) }) !== "floor");
  return { floor, top, mibOf };
}

/** Whether settings plan within the budget with the trunk cache at least `trunk` bytes. */
function fitsKeepingTrunk(build: BuildPlan, facts: PackFacts, s: PlanSettings, trunk: number): boolean {
  try {
    const p = build(facts, s);
    return p.total <= Math.floor(s.ramMib * MIB) && p.components.trunkCache >= trunk;
  } catch (err) {
    if (err instanceof UserError) return false;
    throw err;
  }
}

/**
 * Settings with the auto limits (null) replaced by the largest that fit (their floors when none
 * do). The request bodies and the image limit, which have ceilings, go first (planned with the
 * smallest expert cache); the auto expert cache then takes what is left without shrinking the
 * resident trunk: the larger the cache, the more of each token's routed experts it already holds.
 */
export function resolveAutoLimits(build: BuildPlan, facts: PackFacts, s: PlanSettings): PlanSettings {
  let t = s;
  const bounds = t.cacheAuto ? autoCacheBounds(build, facts, t) : null;
  if (t.cacheAuto) t = { ...t, cacheMib: bounds ? bounds.mibOf(bounds.floor) : 0 };
  if (t.requests && t.requests.bodyBytes === null) {
    const requests = t.requests;
    const best = largestTrue(BODY_BYTES_FLOOR / MIB, DEFAULT_BODY_BYTES / MIB,
      (k) => fits(build, facts, { ...t, requests: { ...requests, bodyBytes: k * MIB } }));
    t = { ...t, requests: { ...requests, bodyBytes: (best ?? BODY_BYTES_FLOOR / MIB) * MIB } };
  }
  if (t.loadVision && t.imagePixels === null) {
    const step = 100_000;
    const best = largestTrue(IMAGE_PIXELS_FLOOR / step, IMAGE_PIXELS_MAX / step, (k) => fits(build, facts, { ...t, imagePixels: k * step }));
    t = { ...t, imagePixels: (best ?? IMAGE_PIXELS_FLOOR / step) * step };
  }
  if (bounds && fits(build, facts, t)) {
    // the trunk is read on every token, an expert extent only when routed to: the auto cache
    // takes nothing from the resident trunk
    const keep = build(facts, t).components.trunkCache;
    const mibOf = bounds.mibOf;
    const k = largestTrue(bounds.floor, bounds.top, (n) => fitsKeepingTrunk(build, facts, { ...t, cacheMib: mibOf(n) }, keep));
    if (k !== null) t = { ...t, cacheMib: mibOf(k) };
  }
  return t;
}

/** Lower body limit or queue that makes the plan fit (each checked by planning again with it). */
function requestAdvice(s: PlanSettings, fits: (t: PlanSettings) => boolean): string[] {
  const r = s.requests;
  if (!r) return [];
  const hints: string[] = [];
  const bodyMib = Math.ceil((r.bodyBytes ?? BODY_BYTES_FLOOR) / MIB);
  const body = largestTrue(1, bodyMib - 1, (k) => fits({ ...s, requests: { ...r, bodyBytes: k * MIB } }));
  if (body !== null) hints.push(`lower --max-body-mib to ${body}`);
  const queue = largestTrue(1, r.maxQueue - 1, (q) => fits({ ...s, requests: { ...r, maxQueue: q } }));
  if (queue !== null) hints.push(`lower --max-queue to ${queue}`);
  return hints;
}
