/**
 * engine-checks.ts — what the engine test files check an engine with, defined once: deterministic
 * prompts, the largest logit difference, the float64 reference's greedy run (each step's top-1 /
 * top-2 margin asserted above twice the tolerance, so a tie cannot decide a token) and an
 * engine's greedy run from the same prompt.
 */
import { expect } from "vitest";

import type { ActDtype, CoreEngine, EngineOptions } from "../../host/engine-api.js";
import { argmax } from "../reference/math.js";
import type { TextReference } from "../reference/text.js";

/** Logits must stay this close to the float64 reference (absolute). */
export const TOLERANCE = 1e-3;
/** Greedy tokens an engine must share with the reference. */
export const GREEDY_TOKENS = 32;

/** Deterministic token ids in [16, vocab): a small LCG, so prompts need no fixture. */
export function promptIds(seed: number, n: number, vocab: number): number[] {
  let s = seed >>> 0;
  return Array.from({ length: n }, () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return 16 + (s % (vocab - 16));
  });
}

export function maxAbsDiff(got: ArrayLike<number>, want: ArrayLike<number>): number {
  expect(got.length).toBe(want.length);
  let m = 0;
  for (let i = 0; i < got.length; i++) m = Math.max(m, Math.abs(got[i]! - want[i]!));
  return m;
}

const greedyRuns = new WeakMap<TextReference, { ids: number[]; want: number[] }>();

/**
 * How far an activation mode's logits may be from the reference: TOLERANCE, as for every mode,
 * and for i16x1 (one integer term per Linear input, coarser by definition) TOLERANCE plus twice
 * what its input rounding alone moves the float64 reference's logits (`rounded`: the reference
 * with i16x1Inputs, against `exact`). The engine's rounding is an independent draw of the same
 * size, so it lands about that far from the exact reference; a wrong scale or block would be
 * orders of magnitude out. Computed once per reference pair and prompt.
 */
export function actModeBound(act: ActDtype, exact: TextReference, rounded: TextReference, ids: number[]): number {
  if (act !== "i16x1") return TOLERANCE;
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
export function referenceGreedy(reference: TextReference): { ids: number[]; want: number[] } {
  const cached = greedyRuns.get(reference);
  if (cached) return cached;
  const V = reference.cfg.vocab_size;
  const H = reference.cfg.hidden_size;
  const ids = promptIds(11, 6, V);
  const want: number[] = [];
  const seq = [...ids];
  for (let step = 0; step < GREEDY_TOKENS; step++) {
    const last = reference.logitsFromHidden(reference.hiddenStates(seq).subarray((seq.length - 1) * H), 1);
    const top = argmax(last);
    let second = -Infinity;
    for (let i = 0; i < V; i++) if (i !== top && last[i]! > second) second = last[i]!;
    expect(last[top]! - second, `reference step ${step} is a near-tie`).toBeGreaterThan(2 * TOLERANCE);
    want.push(top);
    seq.push(top);
  }
  const run = { ids, want };
  greedyRuns.set(reference, run);
  return run;
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
