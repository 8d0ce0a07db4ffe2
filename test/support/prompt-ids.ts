/**
 * prompt-ids.ts — deterministic prompts for the engine tests and the accuracy benches. Owns only
 * this (no vitest import, so bench scripts run under plain vite-node can use it).
 */

/** Deterministic token ids in [16, vocab): a small LCG, so prompts need no fixture. */
export function promptIds(seed: number, n: number, vocab: number): number[] {
  let s = seed >>> 0;
  return Array.from({ length: n }, () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return 16 + (s % (vocab - 16));
  });
}
