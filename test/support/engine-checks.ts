/**
 * engine-checks.ts — what the engine test files check an engine with, defined once: deterministic
 * prompts, the largest logit difference, the float64 reference's greedy run (each step's top-1 /
 * top-2 margin asserted above twice the tolerance, so a tie cannot decide a token) and an
 * engine's greedy run from the same prompt.
 */
import { expect } from "vitest";

import type { ActDtype, CoreEngine, EngineOptions } from "../../host/core/core-api.js";
import { argmax } from "../reference/math.js";
import type { TextReference } from "../reference/text.js";
import { promptIds } from "./prompt-ids.js";

/** Logits must stay this close to the float64 reference (absolute). */
export const TOLERANCE = 1e-3;
/** Greedy tokens an engine must share with the reference. */
export const GREEDY_TOKENS = 32;

export { promptIds };

export function maxAbsDiff(got: ArrayLike<number>, want: ArrayLike<number>): number {
  expect(got.length).toBe(want.length);
  let m = 0;
  for (let i = 0; i < got.length; i++) m = Math.max(m, Math.abs(got[i]! - want[i]!));
  return m;
}

/** A reference greedy run: the prompt, the tokens, and each step's top-1 / top-2 logit margin. */
interface GreedyRun {
  ids: number[];
  want: number[];
  margins: number[];
}
const greedyRuns = new WeakMap<TextReference, GreedyRun>();

/** The float64 reference with its integer products' inputs rounded as each integer mode rounds
 * them (TextOptions.intInputs). */
export type RoundedReferences = Record<"i16x1" | "i8", TextReference>;

/**
 * How far an activation mode's logits may be from the reference: TOLERANCE, as for every mode,
 * and for i16x1 and i8 (Linear inputs rounded to integers, coarser by definition) TOLERANCE plus
 * twice what the mode's input rounding alone moves the float64 reference's logits
 * (`roundedBy[act]` against `exact`). The engine rounds its own FP32 inputs, which differ from the
 * reference's in the last bits, so where a value sits near a rounding edge its draw differs: it
 * lands about that far from the exact reference; a wrong scale or block would be orders of
 * magnitude out. Computed once per reference pair and prompt; `media`: the rows that stand for the
 * prompt's media placeholders (computed each time).
 */
export function actModeBound(act: ActDtype, exact: TextReference, roundedBy: RoundedReferences, ids: number[], media?: Float64Array): number {
  if (act !== "i16x1" && act !== "i8") return TOLERANCE;
  const rounded = roundedBy[act];
  if (media) return TOLERANCE + 2 * maxAbsDiff(rounded.logits(ids, media), exact.logits(ids, media));
  const byPrompt = roundingEffects.get(rounded) ?? new Map<string, number>();
  roundingEffects.set(rounded, byPrompt);
  const key = ids.join(",");
  if (!byPrompt.has(key)) byPrompt.set(key, maxAbsDiff(rounded.logits(ids), exact.logits(ids)));
  return TOLERANCE + 2 * byPrompt.get(key)!;
}
const roundingEffects = new WeakMap<TextReference, Map<string, number>>();

/** An engine whose trunk cache holds about half the trunk (the rest streamed per token), with
 * that checked: `open` opens the pack with the given options. */
export function openHalfTrunkEngine(open: (options: Omit<EngineOptions, "nThreads">) => CoreEngine, actDtype: ActDtype): CoreEngine {
  const probe = open({ actDtype });
  const all = probe.info().trunkCacheBytes;
  probe.close();
  const engine = open({ actDtype, trunkCacheBytes: Math.floor(all / 2) });
  const info = engine.info();
  expect(info.trunkCacheBytes).toBeGreaterThan(0);
  expect(info.trunkCacheBytes).toBeLessThan(all);
  expect(info.engineWorkspaceBytes).toBeGreaterThan(0);
  return engine;
}

/** The largest |difference| between a fresh session's prefill logits (every position) and the reference's. */
export function prefillError(engine: CoreEngine, reference: TextReference, ids: number[]): number {
  const session = engine.newSession({ maxContext: 128 });
  try {
    return maxAbsDiff(session.prefill(Int32Array.from(ids), null, "all")!, reference.logits(ids));
  } finally {
    session.close();
  }
}

/** The reference's GREEDY_TOKENS greedy tokens after a fixed 6-token prompt (computed once per reference). */
export function referenceGreedy(reference: TextReference): GreedyRun {
  const cached = greedyRuns.get(reference);
  if (cached) return cached;
  const V = reference.cfg.vocab_size;
  const H = reference.cfg.hidden_size;
  const ids = promptIds(11, 6, V);
  const want: number[] = [];
  const margins: number[] = [];
  const seq = [...ids];
  for (let step = 0; step < GREEDY_TOKENS; step++) {
    const last = reference.logitsFromHidden(reference.hiddenStates(seq).subarray((seq.length - 1) * H), 1);
    const top = argmax(last);
    let second = -Infinity;
    for (let i = 0; i < V; i++) if (i !== top && last[i]! > second) second = last[i]!;
    expect(last[top]! - second, `reference step ${step} is a near-tie`).toBeGreaterThan(2 * TOLERANCE);
    want.push(top);
    margins.push(last[top]! - second);
    seq.push(top);
  }
  const run = { ids, want, margins };
  greedyRuns.set(reference, run);
  return run;
}

/**
 * The greedy check of an activation mode. Exact modes (every one but i8): the reference's
 * GREEDY_TOKENS greedy tokens, all of them. i8 moves logits by several tenths on the tiny models
 * (its 8-bit rounding of an FP32 input is an independent draw from the reference's, README
 * "Numerics"), more than many steps' top-1 / top-2 margin, so a free run may leave the
 * reference's path at a near-tie and never return. It is fed the reference's tokens instead
 * (step(), the decode kernels), and at every step whose reference margin is over twice the
 * mode's logit bound its top token must be the reference's; at least 4 steps must be that
 * clear, so the check is never empty. Returns the steps that agreed and the clear ones.
 */
export function expectGreedy(engine: CoreEngine, reference: TextReference, act: ActDtype, bound: number): { agreed: number; clear: number } {
  const { ids, want, margins } = referenceGreedy(reference);
  if (act !== "i8") {
    expect(engineGreedy(engine, ids)).toEqual(want);
    return { agreed: want.length, clear: want.length };
  }
  const session = engine.newSession({ maxContext: 128 });
  try {
    let logits = session.prefill(Int32Array.from(ids), null, "last")!;
    let agreed = 0;
    let clear = 0;
    for (let step = 0; step < want.length; step++) {
      const top = argmax(logits);
      if (top === want[step]) agreed++;
      if (margins[step]! > 2 * bound) {
        clear++;
        expect(top, `step ${step}: reference margin ${margins[step]!.toFixed(3)} over twice the bound ${bound.toFixed(3)}`).toBe(want[step]);
      }
      if (step + 1 < want.length) logits = session.step(want[step]!);
    }
    expect(clear).toBeGreaterThanOrEqual(4);
    return { agreed, clear };
  } finally {
    session.close();
  }
}

/** GREEDY_TOKENS greedy tokens of an engine after prefilling ids (one session, closed after). */
export function engineGreedy(engine: CoreEngine, ids: number[]): number[] {
  const session = engine.newSession({ maxContext: 128 });
  try {
    let logits = session.prefill(Int32Array.from(ids), null, "last")!;
    const got: number[] = [];
    for (let step = 0; step < GREEDY_TOKENS; step++) {
      got.push(argmax(logits));
      if (step + 1 < GREEDY_TOKENS) logits = session.step(got.at(-1)!);
    }
    return got;
  } finally {
    session.close();
  }
}
