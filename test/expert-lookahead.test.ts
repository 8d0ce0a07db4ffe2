/**
 * Reading the next layer's experts ahead (engine option expertLookahead; model.c predict_next,
 * expert_cache.c kvl_expert_cache_lookahead), on both backends, on a Q8 pack (tiny-seed1-grouped)
 * and a Q4 pack (tiny-seed0, `kvl pack --expert-dtype q4`), with an expert cache of a few extents
 * so that every layer misses:
 *   - the logits of every prompt position and of 32 greedy steps, and the tokens, are the same
 *     bit for bit with the lookahead on (auto) and off, unsplit and over a forced split into two
 *     engines (each reading ahead only within its own layer range and cache), and the split
 *     equals the unsplit run;
 *   - the engine says whether it reads ahead (info expertLookahead: on with a small cache, off
 *     when asked, and off when the cache holds every extent);
 *   - the counters add up: issued = used + wasted + cancelled + pending, the lookahead's reads
 *     are used, and none are issued with it off.
 * What it gains in speed is measured, not tested (`kvl bench --expert-lookahead auto|off`).
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreEngine, EngineStats, ExpertLookahead } from "../host/core/core-api.js";
import { openHostedEngine } from "../host/engine/engine-host.js";
import { packCheckpoint } from "../packer/pack.js";
import { GREEDY_TOKENS, promptIds } from "./support/engine-checks.js";
import { BACKENDS, BothBackends } from "./support/backends.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;
/** Extents the unsplit cache holds (of 3 MoE layers x 8 experts; top-2 routing): a layer's own
 * two and two more, so that each layer misses and a guess has somewhere to go. */
const CACHE_EXTENTS = 4;

interface Pack {
  label: string;
  dir: string;
  extent: number;
}

let tmp: { dir: string; cleanup: () => void };
const backends = new BothBackends(THREADS, 256 * 2 ** 20);
const packs: Pack[] = [];

beforeAll(async () => {
  tmp = tempDir("expert-lookahead");
  await backends.open();
  for (const [label, model, expertDtype] of [["q8", TINY_MODELS[1]!, "q8"], ["q4", TINY_MODELS[0]!, "q4"]] as const) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${model.name}-ckpt`), backends.native, model.seed, model.extra);
    const dir = await packCheckpoint(ckpt, join(tmp.dir, `${model.name}-${label}`), { core: backends.native, allowRevision: true, expertDtype });
    const probe = backends.native.openEngine(dir, { nThreads: THREADS });
    const extent = probe.info().expertExtentBytes;
    probe.close();
    packs.push({ label: `${label} (${model.name})`, dir, extent });
  }
}, 300_000);

afterAll(() => {
  backends.close();
  tmp?.cleanup();
});

interface Run {
  /** prefill logits of every position, then each greedy step's, end to end */
  logits: Float32Array[];
  tokens: number[];
  stats: EngineStats;
}

/** A 13-token prompt (logits at every position, in chunks of 5), then GREEDY_TOKENS greedy steps. */
function run(engine: CoreEngine, vocab: number): Run {
  const session = engine.newSession({ maxContext: 128, maxBatch: 5 });
  try {
    const logits = [session.prefill(Int32Array.from(promptIds(3, 13, vocab)), null, "all")!];
    const tokens: number[] = [];
    let last = logits[0]!.subarray(logits[0]!.length - vocab);
    for (let step = 0; step < GREEDY_TOKENS; step++) {
      let best = 0;
      for (let i = 1; i < vocab; i++) if (last[i]! > last[best]!) best = i;
      tokens.push(best);
      last = session.step(best);
      logits.push(last);
    }
    return { logits, tokens, stats: engine.stats() };
  } finally {
    session.close();
  }
}

function bytesOf(r: Run): Buffer {
  return Buffer.concat(r.logits.map((l) => Buffer.from(l.buffer, l.byteOffset, l.byteLength)));
}

function expectIdentity(s: EngineStats, label: string): void {
  expect(s.expertLookaheadIssued, label).toBe(s.expertLookaheadUsed + s.expertLookaheadWasted + s.expertLookaheadCancelled + s.expertLookaheadPending);
}

describe.each(BACKENDS)("reading ahead on %s", (backend) => {
  describe.each([0, 1])("pack %i", (p) => {
    const pack = (): Pack => packs[p]!;

    it("changes no logit and no token, and its counters add up", () => {
      const { dir, extent, label } = pack();
      const act = backends.autoAct(backend);
      const runs = {} as Record<ExpertLookahead, Run>;
      let vocab = 0;
      for (const mode of ["auto", "off"] as const) {
        const engine = backends.core(backend).openEngine(dir, { nThreads: THREADS, actDtype: act, expertCacheBytes: CACHE_EXTENTS * extent, expertLookahead: mode });
        try {
          const info = engine.info();
          vocab = info.vocabSize;
          expect(info.expertLookahead).toBe(mode === "auto");
          runs[mode] = run(engine, vocab);
        } finally {
          engine.close();
        }
      }
      const on = runs.auto.stats;
      const off = runs.off.stats;
      console.log(`[lookahead ${backend}] ${label} ${act}: issued ${on.expertLookaheadIssued}, used ${on.expertLookaheadUsed}, ` +
        `wasted ${on.expertLookaheadWasted}, cancelled ${on.expertLookaheadCancelled}, pending ${on.expertLookaheadPending}; ` +
        `misses ${on.expertMisses} (off: ${off.expertMisses})`);
      expect(runs.auto.tokens).toEqual(runs.off.tokens);
      expect(bytesOf(runs.auto).equals(bytesOf(runs.off))).toBe(true);
      expect(on.expertLookaheadIssued).toBeGreaterThan(0);
      expect(on.expertLookaheadUsed).toBeGreaterThan(0);
      expectIdentity(on, "on");
      expect(on.expertHits + on.expertMisses).toBe(off.expertHits + off.expertMisses);
      expect([off.expertLookaheadIssued, off.expertLookaheadUsed, off.expertLookaheadWasted, off.expertLookaheadCancelled,
        off.expertLookaheadPending]).toEqual([0, 0, 0, 0, 0]);
    });

    it("split over two engines, each reading ahead in its own range: the unsplit logits bit for bit, on and off", async () => {
      const { dir, extent } = pack();
      const act = backends.autoAct(backend);
      const unsplit = backends.core(backend).openEngine(dir, { nThreads: THREADS, actDtype: act, expertCacheBytes: CACHE_EXTENTS * extent, expertLookahead: "off" });
      let want: Run;
      try {
        want = run(unsplit, unsplit.info().vocabSize);
      } finally {
        unsplit.close();
      }
      for (const mode of ["auto", "off"] as const) {
        // the budget is shared by layers: 4 layers, so each range of 2 gets CACHE_EXTENTS extents
        const hosted = await openHostedEngine(backend, dir, evenSplit(dir, { nThreads: THREADS, actDtype: act, instances: 2, instanceMemoryBytes: 256 * 2 ** 20,
          expertCacheBytes: 2 * CACHE_EXTENTS * extent, expertLookahead: mode }));
        try {
          expect(hosted.ranges.length).toBe(2);
          expect(hosted.engine.parts.map((e) => e.info().expertLookahead)).toEqual([mode === "auto", mode === "auto"]);
          const got = run(hosted.engine, hosted.engine.info().vocabSize);
          expect(got.tokens).toEqual(want.tokens);
          expect(bytesOf(got).equals(bytesOf(want))).toBe(true);
          for (const part of hosted.engine.parts) expectIdentity(part.stats(), `${mode} range ${part.info().layerBegin}`);
          if (mode === "auto") {
            // the second range reads layer 3's guesses during layer 2 (the first range's cache
            // holds only layer 1, whose extents a guess for layer 1 never evicts)
            expect(hosted.engine.parts[1]!.stats().expertLookaheadIssued).toBeGreaterThan(0);
          } else {
            expect(got.stats.expertLookaheadIssued).toBe(0);
          }
        } finally {
          hosted.close();
        }
      }
    });
  });

  it("does not read ahead when the cache holds every extent", () => {
    const engine = backends.core(backend).openEngine(packs[0]!.dir, { nThreads: THREADS, expertCacheBytes: 24 * packs[0]!.extent });
    try {
      expect(engine.info().expertLookahead).toBe(false);
      run(engine, engine.info().vocabSize);
      expect(engine.stats().expertLookaheadIssued).toBe(0);
    } finally {
      engine.close();
    }
  });
});
