/**
 * The routing override (kvl_session_set_routing; `kvl bench --routing`), on both backends and
 * over a split into two engines, on a tiny Q8 pack (tiny-seed1-grouped: 3 MoE layers of 8
 * experts, top-2, grouped routing) with an expert cache smaller than its 24 extents:
 *   - recording the model's own routing changes no logit, and replaying the recording (given
 *     rows) gives the same logits bit for bit, unsplit and split; the split records the same rows;
 *   - uniform draws are the same on both backends and over a split (a pure function of seed,
 *     position and layer), replaying them reproduces uniform's logits bit for bit, and they are
 *     not the model's;
 *   - a given row with an expert outside [0, n_routed) or named twice fails the forward with
 *     KVL_ERR_INVALID_ARG and rolls it back;
 *   - results do not depend on what is cached: under uniform and under a replayed trace, every
 *     cache size, the read-ahead on or off and (native) plain LRU instead of the default policy
 *     give the same logits bit for bit;
 *   - uniform's hit rate over a long decode is the resident fraction within a tolerance stated
 *     below (no policy can beat it, and it must not fall far under it);
 *   - the read-ahead, which guesses from the hidden state, keeps reading under the model's
 *     routing and mostly stops under uniform routing, where its guesses are chance
 *     (model.c lookahead_worth_it).
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { packBytes } from "../host/bench/bench-model.js";
import { type CachePolicy, type CoreEngine, CoreError, type RoutingHook, type RoutingRows } from "../host/core/core-api.js";
import { openHostedEngine } from "../host/engine/engine-host.js";
import { promptIds } from "./support/engine-checks.js";
import { BACKENDS, type BackendName, BothBackends } from "./support/backends.js";
import { tempDir, TINY_MODELS, tinyPack } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;
const PROMPT = 13;
const STEPS = 24;
/** Cache extents of the unsplit engine (of 24): every layer misses. */
const CACHE_EXTENTS = 6;

let tmp: { dir: string; cleanup: () => void };
let pack = "";
let extent = 0;
let moeLayers: number[] = [];
let L = 0;
let K = 0;
let E = 0;
const backends = new BothBackends(THREADS, 256 * 2 ** 20);

beforeAll(async () => {
  tmp = tempDir("routing-override");
  await backends.open();
  const model = TINY_MODELS[1]!;
  pack = (await tinyPack(join(tmp.dir, model.name), model.seed, model.extra)).pack;
  const pb = await packBytes(pack);
  moeLayers = pb.moe_layers;
  L = pb.n_layers;
  K = pb.top_k;
  E = pb.n_routed;
  const probe = backends.native.openEngine(pack, { nThreads: THREADS });
  extent = probe.info().expertExtentBytes;
  probe.close();
}, 300_000);

afterAll(() => {
  backends.close();
  tmp?.cleanup();
});

/** Routing rows by position: ids and weights [n_layers][topk] (the MoE layers filled). */
type Store = Map<number, { ids: Int32Array; weights: Float32Array }>;

function recordInto(store: Store, mode: "model" | "uniform", seed = 0): RoutingHook {
  return {
    mode, seed, capacity: PROMPT,
    taken(pos0: number, n: number, rows: RoutingRows, lb: number, le: number) {
      for (let i = 0; i < n; i++) {
        let row = store.get(pos0 + i);
        if (!row) store.set(pos0 + i, (row = { ids: new Int32Array(L * K).fill(-1), weights: new Float32Array(L * K) }));
        for (const l of moeLayers) {
          if (l < lb || l >= le) continue;
          row.ids.set(rows.ids.subarray((i * L + l) * K, (i * L + l + 1) * K), l * K);
          row.weights.set(rows.weights.subarray((i * L + l) * K, (i * L + l + 1) * K), l * K);
        }
      }
    },
  };
}

function replay(store: Store, edit: (pos: number, ids: Int32Array) => void = () => undefined): RoutingHook {
  return {
    mode: "given", seed: 0, capacity: PROMPT,
    fill(pos0: number, n: number, rows: RoutingRows) {
      for (let i = 0; i < n; i++) {
        const row = store.get(pos0 + i)!;
        rows.ids.set(row.ids, i * L * K);
        rows.weights.set(row.weights, i * L * K);
        edit(pos0 + i, rows.ids.subarray(i * L * K, (i + 1) * L * K));
      }
    },
  };
}

interface Run {
  logits: Float32Array[];
  tokens: number[];
}

/** A 13-token prompt (logits at every position) in one forward, then STEPS greedy steps. */
function run(engine: CoreEngine, hook: RoutingHook | null, steps = STEPS, prompt = PROMPT): Run {
  const vocab = engine.info().vocabSize;
  const session = engine.newSession({ maxContext: 1024, maxBatch: 5 });
  try {
    if (hook) session.setRouting(hook);
    const logits = [session.prefill(Int32Array.from(promptIds(3, prompt, vocab)), null, "all")!];
    const tokens: number[] = [];
    let last = logits[0]!.subarray(logits[0]!.length - vocab);
    for (let step = 0; step < steps; step++) {
      let best = 0;
      for (let i = 1; i < vocab; i++) if (last[i]! > last[best]!) best = i;
      tokens.push(best);
      last = session.step(best);
      logits.push(last);
    }
    return { logits, tokens };
  } finally {
    session.close();
  }
}

const bytesOf = (r: Run): Buffer => Buffer.concat(r.logits.map((l) => Buffer.from(l.buffer, l.byteOffset, l.byteLength)));

function storeBytes(s: Store): Buffer {
  const keys = [...s.keys()].sort((a, b) => a - b);
  expect(keys).toEqual(Array.from({ length: PROMPT + STEPS }, (_, i) => i));
  return Buffer.concat(keys.flatMap((k) => [Buffer.from(s.get(k)!.ids.buffer), Buffer.from(s.get(k)!.weights.buffer)]));
}

function open(backend: BackendName, cacheExtents = CACHE_EXTENTS, lookahead: "auto" | "off" = "auto", policy?: CachePolicy): CoreEngine {
  return backends.openEngine(backend, pack, { actDtype: backends.autoAct(backend), expertCacheBytes: cacheExtents * extent, expertLookahead: lookahead,
    ...(policy !== undefined ? { expertCachePolicy: policy } : {}) });
}

async function withSplit<T>(backend: BackendName, f: (engine: CoreEngine) => T): Promise<T> {
  const hosted = await openHostedEngine(backend, pack, evenSplit(pack, { nThreads: THREADS, actDtype: backends.autoAct(backend), instances: 2,
    instanceMemoryBytes: 256 * 2 ** 20, expertCacheBytes: 2 * CACHE_EXTENTS * extent }));
  try {
    expect(hosted.ranges.length).toBe(2);
    return f(hosted.engine);
  } finally {
    hosted.close();
  }
}

function withEngine<T>(engine: CoreEngine, f: (engine: CoreEngine) => T): T {
  try {
    return f(engine);
  } finally {
    engine.close();
  }
}

async function withEngineAsync(engine: CoreEngine, f: (engine: CoreEngine) => Promise<void>): Promise<void> {
  try {
    await f(engine);
  } finally {
    engine.close();
  }
}

/** Lets the test worker answer vitest between stretches of synchronous decoding (its RPC timed out
 * on a busy machine during a long synchronous loop). */
const breathe = (): Promise<void> => new Promise((resolve) => setImmediate(resolve));

/** Uniform rows recorded per backend, to compare them across backends. */
const uniformRows = new Map<string, Buffer>();

describe.each(BACKENDS)("routing override on %s", (backend) => {
  it("recording the model's routing changes nothing; replaying it gives the same logits bit for bit, unsplit and split", async () => {
    const rec: Store = new Map();
    const { plain, recorded, replayed } = withEngine(open(backend), (engine) => ({
      plain: run(engine, null), recorded: run(engine, recordInto(rec, "model")), replayed: run(engine, replay(rec)),
    }));
    expect(bytesOf(recorded).equals(bytesOf(plain))).toBe(true);
    expect(bytesOf(replayed).equals(bytesOf(plain))).toBe(true);
    expect(replayed.tokens).toEqual(plain.tokens);
    // every MoE layer of every token was recorded, with K distinct experts
    for (const row of rec.values()) {
      for (const l of moeLayers) expect(new Set(row.ids.subarray(l * K, (l + 1) * K)).size).toBe(K);
    }
    const splitRec: Store = new Map();
    await withSplit(backend, (engine) => {
      const r1 = run(engine, recordInto(splitRec, "model"));
      expect(bytesOf(r1).equals(bytesOf(plain))).toBe(true);
      const r2 = run(engine, replay(rec));
      expect(bytesOf(r2).equals(bytesOf(plain))).toBe(true);
    });
    expect(storeBytes(splitRec).equals(storeBytes(rec))).toBe(true);
  });

  it("uniform: the same draws unsplit and split, replayable bit for bit, and not the model's", async () => {
    const rec: Store = new Map();
    const { plain, uniform, replayed } = withEngine(open(backend), (engine) => ({
      plain: run(engine, null), uniform: run(engine, recordInto(rec, "uniform", 7)), replayed: run(engine, replay(rec)),
    }));
    expect(bytesOf(replayed).equals(bytesOf(uniform))).toBe(true);
    expect(bytesOf(uniform).equals(bytesOf(plain))).toBe(false);
    const splitRec: Store = new Map();
    await withSplit(backend, (engine) => {
      expect(bytesOf(run(engine, recordInto(splitRec, "uniform", 7))).equals(bytesOf(uniform))).toBe(true);
    });
    expect(storeBytes(splitRec).equals(storeBytes(rec))).toBe(true);
    // another seed draws other experts
    const other: Store = new Map();
    withEngine(open(backend), (engine) => run(engine, recordInto(other, "uniform", 8), 0));
    expect([...other.keys()].some((p) => !Buffer.from(other.get(p)!.ids.buffer).equals(Buffer.from(rec.get(p)!.ids.buffer)))).toBe(true);
    // the ids alone, across backends (weights are the router's scores, which the backends compute in their own kernels)
    const ids = Buffer.concat([...rec.keys()].sort((a, b) => a - b).map((k) => Buffer.from(rec.get(k)!.ids.buffer)));
    uniformRows.set(backend, ids);
    if (uniformRows.size === 2) expect(uniformRows.get("wasm")!.equals(uniformRows.get("native")!)).toBe(true);
  });

  it("a given row naming an expert outside [0, n_routed) or twice fails the forward and rolls it back", () => {
    const rec: Store = new Map();
    withEngine(open(backend), (engine) => {
      run(engine, recordInto(rec, "model"));
      for (const bad of [E, -1, "twice"] as const) {
        const session = engine.newSession({ maxContext: 64, maxBatch: 5 });
        try {
          session.setRouting(replay(rec, (pos, ids) => {
            if (pos !== 3) return;
            const at = moeLayers.at(-1)! * K;
            ids[at + 1] = bad === "twice" ? ids[at]! : bad;
          }));
          session.prefill(Int32Array.from(promptIds(3, 2, engine.info().vocabSize)), null, "none");
          let error: unknown;
          try {
            session.prefill(Int32Array.from(promptIds(5, 4, engine.info().vocabSize)), null, "last");
          } catch (err) {
            error = err;
          }
          expect(error).toBeInstanceOf(CoreError);
          expect((error as CoreError).status).toBe(5);
          expect((error as CoreError).message).toMatch(bad === "twice" ? /chosen twice/ : /outside \[0, n_routed\)/);
          expect(session.position()).toBe(2);
        } finally {
          session.close();
        }
      }
    });
  });

  it("results do not depend on what is cached: cache sizes, read-ahead, policy", () => {
    const rec: Store = new Map();
    const want = { uniform: null as Buffer | null, trace: null as Buffer | null };
    withEngine(open(backend, 24), (engine) => {
      want.uniform = bytesOf(run(engine, recordInto(rec, "uniform", 11)));
      // a trace that differs from both: uniform's rows with each id moved to the next expert
      want.trace = bytesOf(run(engine, replay(rec, (_pos, ids) => {
        for (const l of moeLayers) for (let k = 0; k < K; k++) ids[l * K + k] = (ids[l * K + k]! + 1) % E;
      })));
    });
    const settings: Array<{ extents: number; lookahead: "auto" | "off"; policy?: CachePolicy }> = [
      { extents: K, lookahead: "off" }, { extents: CACHE_EXTENTS, lookahead: "auto" },
      { extents: CACHE_EXTENTS, lookahead: "off" }, { extents: 17, lookahead: "auto" },
      { extents: CACHE_EXTENTS, lookahead: "auto", policy: "lru" }, { extents: CACHE_EXTENTS, lookahead: "auto", policy: "frequency" },
      { extents: 17, lookahead: "off", policy: "adaptive" },
    ];
    for (const s of settings) {
      withEngine(open(backend, s.extents, s.lookahead, s.policy), (engine) => {
        expect(engine.info().expertCachePolicy).toBe(s.policy ?? "adaptive");
        const fresh: Store = new Map();
        expect(bytesOf(run(engine, recordInto(fresh, "uniform", 11))).equals(want.uniform!), JSON.stringify(s)).toBe(true);
        expect(bytesOf(run(engine, replay(rec, (_pos, ids) => {
          for (const l of moeLayers) for (let k = 0; k < K; k++) ids[l * K + k] = (ids[l * K + k]! + 1) % E;
        }))).equals(want.trace!), JSON.stringify(s)).toBe(true);
      });
    }
  });

  it("the read-ahead stops reading where its guesses are not routed to (uniform), and keeps reading under the model's routing", async () => {
    const perToken: Record<string, { issued: number; used: number }> = {};
    for (const mode of ["model", "uniform"] as const) {
      await withEngineAsync(open(backend, CACHE_EXTENTS, "auto"), async (engine) => {
        const session = engine.newSession({ maxContext: 1024, maxBatch: 5 });
        try {
          if (mode === "uniform") session.setRouting({ mode: "uniform", seed: 5, capacity: 1 });
          session.prefill(Int32Array.of(1), null, "none");
          const before = engine.stats();
          const steps = 400;
          let token = 1;
          for (let i = 0; i < steps; i++) {
            if (i % 50 === 0) await breathe();
            const logits = session.step(token);
            token = 0;
            for (let v = 1; v < logits.length; v++) if (logits[v]! > logits[token]!) token = v;
          }
          const after = engine.stats();
          perToken[mode] = { issued: (after.expertLookaheadIssued - before.expertLookaheadIssued) / steps,
            used: (after.expertLookaheadUsed - before.expertLookaheadUsed) / steps };
        } finally {
          session.close();
        }
      });
    }
    console.log(`[read-ahead ${backend}] per token: model ${JSON.stringify(perToken.model)}, uniform ${JSON.stringify(perToken.uniform)}`);
    // the model's routing follows the hidden state its router guesses from: most of what is read ahead is used
    expect(perToken.model!.used).toBeGreaterThan(0.5 * perToken.model!.issued);
    // uniform picks are independent of the guesses: the read-ahead reads a fraction of what it did
    expect(perToken.uniform!.issued).toBeLessThan(0.5 * perToken.model!.issued);
  });

  it("uniform: the hit rate of a long decode is the resident fraction, within the tolerance", async () => {
    const nExtents = moeLayers.length * E;
    for (const extents of [6, 12, 18]) {
      await withEngineAsync(open(backend, extents, "off"), async (engine) => {
        const session = engine.newSession({ maxContext: 1024, maxBatch: 5 });
        try {
          session.setRouting({ mode: "uniform", seed: 3, capacity: 1 });
          session.prefill(Int32Array.of(1), null, "none");
          const before = engine.stats();
          const steps = 800;
          for (let i = 0; i < steps; i++) {
            if (i % 50 === 0) await breathe();
            session.step(1 + (i % 7));
          }
          const after = engine.stats();
          const hits = after.expertHits - before.expertHits;
          const n = hits + after.expertMisses - before.expertMisses;
          expect(n).toBe(steps * moeLayers.length * K);
          const rate = hits / n;
          const p = extents / nExtents;
          // No policy beats the resident fraction p when every pick is uniform and independent of
          // the past. From below: the slot a miss fills is the next victim, and a layer's K picks
          // are pinned while it computes, so up to K slots of the cache turn over instead of
          // holding extents: at worst (extents - K) / nExtents. Plus three standard deviations of
          // n Bernoulli draws either way.
          const sd = Math.sqrt((p * (1 - p)) / n);
          console.log(`[uniform ${backend}] ${extents}/${nExtents} resident (${(100 * p).toFixed(1)}%): hit rate ${(100 * rate).toFixed(1)}% over ${n} picks`);
          expect(rate).toBeLessThanOrEqual(p + 3 * sd);
          expect(rate).toBeGreaterThanOrEqual((extents - K) / nExtents - 3 * sd);
        } finally {
          session.close();
        }
      });
    }
  });
});
