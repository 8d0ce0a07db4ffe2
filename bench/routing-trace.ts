/**
 * routing-trace.ts — routing a trained MoE model would produce, modelled (the real Kimi-VL
 * weights cannot be downloaded here), and the statistics of any routing trace. The command is
 * bench/routing-trace-cli.ts; the trace format is host/bench/bench-routing.ts's.
 *
 * Owns: the generator (seeded, parameterised, defaults calibrated below) and the statistics:
 * reuse at distance 1 and within 8 tokens, the top-1/8 popularity share, and the hit rate of
 * cache policies simulated on the trace against the resident fraction (plain LRU over every
 * (layer, expert) extent, and the expert cache's default frequency policy, expert_cache.c
 * pick_victim: fewest recent acquisitions, counts halved every 8 x extents acquisitions, then
 * least recently used). The simulation has no pins, prefetch or read-ahead: it is the policy alone.
 *
 * Published figures the defaults are set to (the issue 38 sources, design.md "Low RAM"):
 *   [R1] kekzl/imp PR 1359 (Qwen3-30B-A3B, 128 experts, top-8): 45 % of a token's expert picks
 *        repeat at the next token, 80 % within 8 tokens.
 *   [R2] kekzl/imp PRs 1374, 2061: plain LRU at low residency hits ~2-3x the resident fraction
 *        (Qwen3-30B-A3B 19 % resident -> 36.6 %; a 512-expert model 18 / 36 / 73 % -> 43.5 / 62 /
 *        78.9 %); frequency pinning lost to LRU at every size.
 *   [R3] arXiv 2505.16056 (local routing consistency of MoE models): DeepSeek-style layouts with
 *        shared experts are *less* locally consistent than Qwen-style ones, and most models need
 *        about 2x the active experts cached to do well.
 *   [R4] design.md: the top 1/8 of experts carry ~40 % of a layer's picks (a Zipf draw with
 *        s = 0.7 does; after the K distinct picks per token and the other terms below it takes
 *        s = 1.05 for the picks to show it).
 *   Cross-layer correlation (a token that took expert x at layer l tends to take a fixed partner
 *   of x at layer l + 1) is reported for trained MoE models (inter-layer expert affinity, arXiv
 *   2401.08383); no Kimi-VL figure is published, so its default (cross = 0.15) is a parameter,
 *   not a calibration.
 *
 * The process, per token and MoE layer (K picks of E experts):
 *   1. each of the previous token's K experts at this layer is kept with probability `keep`;
 *   2. each remaining slot draws: with probability `recall` an expert this layer took in the
 *      `window` tokens before (uniform over those picks), else with probability `cross` the
 *      partner (a fixed random bijection per layer pair) of one of this token's experts at the
 *      layer before, else from the layer's Zipf(`zipf`) popularity over a random ranking; a
 *      duplicate redraws.
 * With keep = recall = cross = zipf = 0 it is i.i.d. uniform: the worst case (kvl bench
 * --routing uniform draws the same way in the core).
 * Calibration (fitted by hand on 1500 tokens of the Kimi shape, seed 0, targets [R1] and [R4]):
 * DEFAULT_PARAMS measure reuse at distance 1 0.449, within 8 tokens 0.805, top-1/8 share 0.405.
 * KIMI_LOW_PARAMS (keep 0.12, recall 0.35, zipf 1.0) is the less consistent side [R3] reports for
 * DeepSeek-style layouts, which gives no figure for Kimi-VL: 0.33 / 0.76 / 0.41, a bracket, not a
 * fit. `bench/routing-trace-cli.ts profiles` prints them with the simulated policy curves
 * (bench/RESULTS.md "Routing a trained model would produce").
 */

export interface TraceShape {
  /** decoder layers (the header's n_layers) */
  nLayers: number;
  moeLayers: number[];
  nRouted: number;
  topk: number;
}

export interface GeneratorParams {
  tokens: number;
  seed: number;
  /** Zipf exponent of each layer's popularity (0 = uniform) */
  zipf: number;
  /** probability of keeping each of the previous token's experts */
  keep: number;
  /** probability that a fresh slot recalls an expert of the previous `window` tokens */
  recall: number;
  window: number;
  /** probability that a fresh slot takes the partner of an expert of the layer before */
  cross: number;
}

/** Calibrated to [R1] and [R4] (see the header); kimiLow lowers local consistency as [R3] says. */
export const DEFAULT_PARAMS: Readonly<GeneratorParams> = { tokens: 4000, seed: 0, zipf: 1.05, keep: 0.27, recall: 0.42, window: 8, cross: 0.15 };
export const KIMI_LOW_PARAMS: Readonly<GeneratorParams> = { ...DEFAULT_PARAMS, zipf: 1.0, keep: 0.12, recall: 0.35 };
export const UNIFORM_PARAMS: Readonly<GeneratorParams> = { ...DEFAULT_PARAMS, zipf: 0, keep: 0, recall: 0, cross: 0 };

/** The full-size Kimi-VL-A3B text decoder: 27 layers, layer 0 dense, 64 experts, top-6. */
export const KIMI_SHAPE: Readonly<TraceShape> = { nLayers: 27, moeLayers: Array.from({ length: 26 }, (_, i) => i + 1), nRouted: 64, topk: 6 };

/** mulberry32: a small seeded generator, uniform in [0, 1). */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function permutation(n: number, rand: () => number): Int32Array {
  const p = Int32Array.from({ length: n }, (_, i) => i);
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [p[i], p[j]] = [p[j]!, p[i]!];
  }
  return p;
}

/** Generated ids [tokens][moe layers][topk]. */
export function generateTrace(shape: TraceShape, p: GeneratorParams): Int32Array {
  const { nRouted: E, topk: K } = shape;
  const M = shape.moeLayers.length;
  if (K > E) throw new RangeError(`topk ${K} > experts ${E}`);
  const rand = rng(p.seed);
  // per layer: a popularity ranking and its cumulative Zipf weights; a partner map to the next layer
  const rank = Array.from({ length: M }, () => permutation(E, rand));
  const partner = Array.from({ length: M }, () => permutation(E, rand));
  const cdf = new Float64Array(E);
  let total = 0;
  for (let r = 0; r < E; r++) cdf[r] = total += 1 / Math.pow(r + 1, p.zipf);
  for (let r = 0; r < E; r++) cdf[r]! /= total;
  const zipfDraw = (m: number): number => {
    const u = rand();
    let lo = 0;
    let hi = E - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (cdf[mid]! < u) lo = mid + 1;
      else hi = mid;
    }
    return rank[m]![lo]!;
  };
  const ids = new Int32Array(p.tokens * M * K);
  const chosen = new Uint8Array(E);
  for (let t = 0; t < p.tokens; t++) {
    for (let m = 0; m < M; m++) {
      const at = (t * M + m) * K;
      let n = 0;
      chosen.fill(0);
      const add = (x: number): void => {
        if (!chosen[x]) {
          chosen[x] = 1;
          ids[at + n++] = x;
        }
      };
      if (t > 0) {
        const prev = ((t - 1) * M + m) * K;
        for (let k = 0; k < K; k++) if (rand() < p.keep) add(ids[prev + k]!);
      }
      const span = Math.min(t, p.window);
      while (n < K) {
        const u = rand();
        if (u < p.recall && span > 0) {
          const back = 1 + Math.floor(rand() * span);
          add(ids[((t - back) * M + m) * K + Math.floor(rand() * K)]!);
        } else if (u < p.recall + p.cross && m > 0) {
          add(partner[m]![ids[(t * M + m - 1) * K + Math.floor(rand() * K)]!]!);
        } else {
          add(zipfDraw(m));
        }
      }
    }
  }
  return ids;
}

/**
 * Cache policies simulated: plain LRU; the frequency rule (fewest recent uses, then least
 * recently used); `adaptive`, the expert cache's default (expert_cache.c duel_record): two
 * key-only shadows of the same capacity, one by each rule, and evictions by whichever shadow hit
 * more lately (hits halved every (layers x experts) acquisitions); and candidates that mix the
 * two rules, `mix:L`: the victim is the smallest last use + L x (recent uses) x (picks of one
 * token), so each recent use buys L tokens of recency (L = 0 is LRU; a large L is frequency).
 */
export type Policy = "lru" | "frequency" | "adaptive" | `mix:${number}`;

export interface PolicyCurve {
  policy: Policy;
  /** resident extents / all extents of the MoE layers */
  resident: number[];
  hit: number[];
}

export interface TraceStats {
  tokens: number;
  /** share of a token's picks that its previous token took at the same layer */
  reuse1: number;
  /** share of a token's picks that one of its previous 8 tokens took at the same layer */
  reuse8: number;
  /** share of picks on each layer's 1/8 most picked experts (averaged over layers) */
  top8th: number;
  curves: PolicyCurve[];
}

export const RESIDENT_FRACTIONS = [0.06, 0.12, 0.18, 0.25, 0.36, 0.5, 0.73];

/** A set of at most `capacity` keys (a cache's directory: no data). */
class Directory {
  readonly resident: Int32Array;
  readonly slotOf: Int32Array;
  used = 0;
  constructor(readonly capacity: number, keys: number) {
    this.resident = new Int32Array(capacity).fill(-1);
    this.slotOf = new Int32Array(keys).fill(-1);
  }

  has(key: number): boolean {
    return this.slotOf[key]! >= 0;
  }

  /** Takes key in (it is not in): a free place, else the coldest unpinned key's; none: not kept. */
  insert(key: number, pinned: Uint8Array, colder: (a: number, b: number) => boolean): void {
    let slot: number;
    if (this.used < this.capacity) slot = this.used++;
    else {
      slot = -1;
      for (let s = 0; s < this.capacity; s++) {
        const v = this.resident[s]!;
        if (pinned[v]) continue;
        if (slot < 0 || colder(v, this.resident[slot]!)) slot = s;
      }
      if (slot < 0) return; // every place holds this layer's picks: read, not kept
      this.slotOf[this.resident[slot]!] = -1;
    }
    this.resident[slot] = key;
    this.slotOf[key] = slot;
  }
}

/**
 * Hit rate of one policy with `capacity` extents over the trace, accesses in decode order (token
 * by token, MoE layer by layer, a layer's K picks), the first `warm` tokens not counted.
 */
export function simulatePolicy(ids: Int32Array, M: number, E: number, K: number, capacity: number, policy: Policy, warm: number): number {
  const mix = policy.startsWith("mix:") ? Number(policy.slice(4)) * M * K : -1;
  const tokens = ids.length / (M * K);
  const keys = M * E;
  const lastUse = new Float64Array(keys).fill(-1);
  const uses = new Uint32Array(keys);
  const pinned = new Uint8Array(keys);
  const lru = (a: number, b: number): boolean => lastUse[a]! < lastUse[b]!;
  const frequency = (a: number, b: number): boolean => (uses[a] !== uses[b] ? uses[a]! < uses[b]! : lastUse[a]! < lastUse[b]!);
  const mixed = (a: number, b: number): boolean => lastUse[a]! + mix * uses[a]! < lastUse[b]! + mix * uses[b]!;
  const cache = new Directory(capacity, keys);
  // adaptive: the two shadows and their recent hits
  const shadows = policy === "adaptive" ? [new Directory(capacity, keys), new Directory(capacity, keys)] : [];
  const shadowHits = [0, 0];
  let sinceHalving = 0;
  let clock = 0;
  let sinceAging = 0;
  let hits = 0;
  let counted = 0;
  for (let t = 0; t < tokens; t++) {
    for (let m = 0; m < M; m++) {
      const at = (t * M + m) * K;
      for (let k = 0; k < K; k++) pinned[m * E + ids[at + k]!] = 1; // a layer never evicts its own picks
      for (let k = 0; k < K; k++) {
        const key = m * E + ids[at + k]!;
        const hit = cache.has(key);
        if (t >= warm) {
          counted++;
          if (hit) hits++;
        }
        if (policy !== "lru") {
          if (uses[key]! < 0xffffffff) uses[key]!++;
          if (++sinceAging >= 8 * keys) {
            for (let i = 0; i < keys; i++) uses[i] = uses[i]! >>> 1;
            sinceAging = 0;
          }
        }
        shadows.forEach((shadow, i) => {
          if (shadow.has(key)) shadowHits[i]!++;
          else shadow.insert(key, pinned, i === 0 ? lru : frequency);
        });
        if (shadows.length && ++sinceHalving >= keys) {
          shadowHits[0] = shadowHits[0]! >>> 1;
          shadowHits[1] = shadowHits[1]! >>> 1;
          sinceHalving = 0;
        }
        if (!hit) {
          const colder = policy === "lru" ? lru : policy === "frequency" ? frequency : mix >= 0 ? mixed
            : shadowHits[1]! >= shadowHits[0]! ? frequency : lru;
          cache.insert(key, pinned, colder);
        }
        lastUse[key] = ++clock;
      }
      for (let k = 0; k < K; k++) pinned[m * E + ids[at + k]!] = 0;
    }
  }
  return counted ? hits / counted : 0;
}

export function traceStats(ids: Int32Array, M: number, E: number, K: number, fractions: readonly number[] = RESIDENT_FRACTIONS): TraceStats {
  const tokens = ids.length / (M * K);
  let r1 = 0;
  let r8 = 0;
  let n1 = 0;
  let n8 = 0;
  for (let t = 1; t < tokens; t++) {
    for (let m = 0; m < M; m++) {
      for (let k = 0; k < K; k++) {
        const x = ids[(t * M + m) * K + k]!;
        let d1 = false;
        let d8 = false;
        for (let back = 1; back <= Math.min(8, t); back++) {
          const at = ((t - back) * M + m) * K;
          for (let j = 0; j < K; j++) {
            if (ids[at + j] === x) {
              d8 = true;
              if (back === 1) d1 = true;
            }
          }
        }
        n1++;
        if (d1) r1++;
        if (t >= 8) {
          n8++;
          if (d8) r8++;
        }
      }
    }
  }
  let top = 0;
  const per = Math.max(1, Math.round(E / 8));
  for (let m = 0; m < M; m++) {
    const count = new Float64Array(E);
    for (let t = 0; t < tokens; t++) for (let k = 0; k < K; k++) count[ids[(t * M + m) * K + k]!]!++;
    const sorted = [...count].sort((a, b) => b - a);
    top += sorted.slice(0, per).reduce((a, b) => a + b, 0) / (tokens * K);
  }
  const warm = Math.min(64, Math.floor(tokens / 10));
  const curves: PolicyCurve[] = (["lru", "frequency", "adaptive"] as const).map((policy) => ({
    policy, resident: [...fractions],
    hit: fractions.map((f) => simulatePolicy(ids, M, E, K, Math.max(K, Math.round(f * M * E)), policy, warm)),
  }));
  return { tokens, reuse1: n1 ? r1 / n1 : 0, reuse8: n8 ? r8 / n8 : 0, top8th: top / M, curves };
}

/** The default policy's hit rate on the calibrated trace (1000 tokens of the Kimi shape, seed 0,
 * 64 tokens warm-up) at 0, 5, ..., 100 % resident: host/plan/routing-outlook.ts's table. */
export function calibratedOutlookTable(tokens = 1000): number[] {
  const M = KIMI_SHAPE.moeLayers.length, E = KIMI_SHAPE.nRouted, K = KIMI_SHAPE.topk;
  const ids = generateTrace(KIMI_SHAPE, { ...DEFAULT_PARAMS, tokens });
  const out: number[] = [];
  for (let f = 0; f <= 20; f++) out.push(Number(simulatePolicy(ids, M, E, K, Math.round((f / 20) * M * E), "adaptive", 64).toFixed(3)));
  return out;
}
