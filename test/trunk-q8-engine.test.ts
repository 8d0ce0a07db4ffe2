/**
 * The text engine on a pack made with `kvl pack --trunk-dtype q8` (the trunk's Linear weights as
 * Q8_ROWS, docs/FORMAT.md), on both backends, against the independent float64 reference
 * evaluated on the DEQUANTISED Q8 trunk (TextReference q8Trunk: the Q8 round trip written from
 * FORMAT.md, as for the experts), so quantisation is not counted as error:
 *   - logits of every prompt position within 1e-3, and 32 greedy tokens equal to the reference's
 *     (each reference step's top-1 / top-2 margin asserted above twice the tolerance), on both
 *     tiny presets;
 *   - every kernel set of each backend that this CPU has, with FP32 activations and with the
 *     integer activation modes (act_dtype i16x1: matmul_q8_i16 on the Q8 trunk; i8:
 *     matmul_q8_i8; each within its own bound, actModeBound);
 *   - a partly streamed trunk (half the trunk cache), FP32, i16x1 and i8;
 *   - a forced split over 2 instances: the unsplit run's logits bit for bit, and its tokens;
 *   - BF16 activations (matmul_q8_xb) run and stay within BF16 rounding of the reference;
 *   - the engine's resident trunk bytes are the Q8 records' sizes, below the BF16 pack's.
 * What Q8 costs against the BF16 trunk is measured, not tested: bench/trunk-q8-accuracy.ts.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { openHostedEngine } from "../host/engine/engine-host.js";
import { PackReader } from "../host/pack/pack-format.js";
import { packCheckpoint } from "../packer/pack.js";
import {
  GREEDY_TOKENS, TOLERANCE, actModeBound, engineGreedy, expectGreedy, maxAbsDiff, openHalfTrunkEngine, prefillError, promptIds,
  referenceGreedy, type RoundedReferences,
} from "./support/engine-checks.js";
import { TextReference } from "./reference/text.js";
import { BACKENDS, BothBackends, KERNEL_SETS } from "./support/backends.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;
/** BF16 activations move logits by BF16 rounding (README "Numerics": about 0.1 on these models),
 * not by 1e-3: this bound only shows the Q8 x BF16-input product is wired, not garbage. */
const BF16_ACT_BOUND = 0.5;

interface Model {
  name: string;
  pack: string;
  bf16Pack: string;
  reference: TextReference;
  /** The same, with every Q8 product's input rounded as --act-dtype i16x1 and i8 do. */
  rounded: RoundedReferences;
}

let tmp: { dir: string; cleanup: () => void };
const backends = new BothBackends(THREADS);
const models: Model[] = [];

const ACTS = ["f32", "i16x1", "i8"] as const;
type Act = (typeof ACTS)[number];
const boundFor = (m: Model, act: Act, ids: number[]): number => actModeBound(act, m.reference, m.rounded, ids);

beforeAll(async () => {
  tmp = tempDir("trunk-q8-engine");
  await backends.open();
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), backends.native, seed, extra);
    const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q8`), { core: backends.native, allowRevision: true, trunkDtype: "q8" });
    const bf16Pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-bf16`), { core: backends.native, allowRevision: true });
    models.push({ name, pack, bf16Pack, reference: TextReference.load(ckpt, { q8Experts: true, q8Trunk: true }),
      rounded: {
        i16x1: TextReference.load(ckpt, { q8Experts: true, q8Trunk: true, intInputs: "i16x1" }),
        i8: TextReference.load(ckpt, { q8Experts: true, q8Trunk: true, intInputs: "i8" }),
      } });
  }
}, 300_000);

afterAll(() => {
  backends.close();
  tmp?.cleanup();
});

describe.each(BACKENDS)("a Q8 trunk on %s", (backend) => {
  describe.each(["tiny-seed0", "tiny-seed1-grouped"])("%s", (name) => {
    const model = (): Model => models.find((m) => m.name === name)!;

    it("gives the Q8-trunk reference's logits at every prompt position (max error <= 1e-3)", () => {
      const m = model();
      const engine = backends.openEngine(backend, m.pack);
      try {
        const err = prefillError(engine, m.reference, promptIds(7, 24, m.reference.cfg.vocab_size));
        console.log(`[q8 trunk ${backend}] ${name} prefill logits: max |diff| ${err.toExponential(2)}`);
        expect(err).toBeLessThanOrEqual(TOLERANCE);
      } finally {
        engine.close();
      }
    });

    it(`decodes the reference's ${GREEDY_TOKENS} greedy tokens`, () => {
      const m = model();
      const { ids, want } = referenceGreedy(m.reference);
      const engine = backends.openEngine(backend, m.pack);
      try {
        expect(engineGreedy(engine, ids)).toEqual(want);
      } finally {
        engine.close();
      }
    });
  });

  describe.each(KERNEL_SETS[backend])("on the %s kernel set", (set) => {
    const available = (): boolean => backends.core(backend).kernelSets().some((k) => k.name === set && k.supported);

    it.each(ACTS)("with %s activations: logits within the mode's bound and the greedy tokens", (act) => {
      if (!available()) {
        // reported, not passed: this CPU lacks the set (test/engine.test.ts checks it is refused)
        console.log(`[q8 trunk ${backend}] kernel set ${set}: not run (not available here)`);
        return;
      }
      const m = models[1]!;
      const engine = backends.openEngine(backend, m.pack, { kernels: set, actDtype: act });
      try {
        expect(engine.info().actDtype).toBe(act);
        const prompt = promptIds(7, 24, m.reference.cfg.vocab_size);
        const err = prefillError(engine, m.reference, prompt);
        const bound = boundFor(m, act, prompt);
        const greedy = expectGreedy(engine, m.reference, act, bound);
        console.log(`[q8 trunk ${backend}] ${set} ${act}: max |diff| ${err.toExponential(2)} (bound ${bound.toExponential(2)}), ` +
          `greedy ${greedy.agreed}/${GREEDY_TOKENS} (${greedy.clear} clear)`);
        expect(err).toBeLessThanOrEqual(bound);
      } finally {
        engine.close();
      }
    });
  });

  it.each(ACTS)("streams part of the Q8 trunk (%s activations): same bound and tokens", (act) => {
    const m = models[1]!;
    const engine = openHalfTrunkEngine((o) => backends.openEngine(backend, m.pack, o), act);
    try {
      const prompt = promptIds(7, 24, m.reference.cfg.vocab_size);
      const err = prefillError(engine, m.reference, prompt);
      console.log(`[q8 trunk ${backend}] partly streamed, ${act}: max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(boundFor(m, act, prompt));
      expectGreedy(engine, m.reference, act, boundFor(m, act, prompt));
      expect(engine.stats().trunkMisses).toBeGreaterThan(0);
    } finally {
      engine.close();
    }
  });

  it("split over 2 instances gives the unsplit run's logits bit for bit and the reference's tokens", async () => {
    const m = models[1]!;
    const ids = promptIds(5, 13, m.reference.cfg.vocab_size);
    const runs: Array<{ logits: Float32Array; tokens: number[] }> = [];
    for (const instances of [1, 2]) {
      const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, instances, instanceMemoryBytes: 256 * 2 ** 20 }));
      try {
        expect(hosted.ranges.length).toBe(instances);
        const session = hosted.engine.newSession({ maxContext: 128, maxBatch: 5 });
        let logits: Float32Array;
        try {
          logits = session.prefill(Int32Array.from(ids), null, "all")!;
        } finally {
          session.close();
        }
        const { ids: prompt, want } = referenceGreedy(m.reference);
        const tokens = engineGreedy(hosted.engine, prompt);
        expect(tokens).toEqual(want);
        runs.push({ logits, tokens });
      } finally {
        hosted.close();
      }
    }
    expect(maxAbsDiff(runs[1]!.logits, m.reference.logits(ids))).toBeLessThanOrEqual(TOLERANCE);
    expect(maxAbsDiff(runs[1]!.logits, runs[0]!.logits)).toBe(0);
  });

  it("runs BF16 activations on the Q8 trunk within BF16 rounding of the reference", () => {
    const m = models[0]!;
    const engine = backends.openEngine(backend, m.pack, { actDtype: "bf16" });
    try {
      expect(engine.info().actDtype).toBe("bf16");
      const err = prefillError(engine, m.reference, promptIds(7, 24, m.reference.cfg.vocab_size));
      console.log(`[q8 trunk ${backend}] bf16 activations: max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(BF16_ACT_BOUND);
    } finally {
      engine.close();
    }
  });

  it("keeps the Q8 records resident at their own size: the trunk cache is the sum of their pages", async () => {
    const m = models[0]!;
    const reader = await PackReader.open(m.pack);
    const trunk = reader.stores.get("trunk")!.records;
    // engine.c's trunk cache: every per-layer Linear weight (attention, dense/shared MLP), each
    // in whole pages; lm_head, norms and routers are the engine's globals, the embedding is read by row
    const perLayer = /\.layers\.\d+\.(self_attn\.(q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|mlp\.(shared_experts\.)?(gate|up|down)_proj)\.weight$/;
    const want = trunk.filter((r) => perLayer.test(r.name)).reduce((a, r) => a + Math.ceil(r.nbytes / 4096) * 4096, 0);
    // one engine at a time: a WebAssembly instance has threads for one engine's pool
    const infoOf = (pack: string) => {
      const engine = backends.openEngine(backend, pack);
      try {
        return engine.info();
      } finally {
        engine.close();
      }
    };
    const q8 = infoOf(m.pack);
    const plain = infoOf(m.bf16Pack);
    expect(q8.trunkCacheBytes).toBe(want);
    expect(q8.trunkCacheBytes).toBeLessThan(plain.trunkCacheBytes);
    // lm_head: Q8 [V, H] in whole pages (plus the f32 final norm), about half the BF16 engine's
    expect(q8.globalBytes).toBeLessThan(plain.globalBytes);
  });
});
