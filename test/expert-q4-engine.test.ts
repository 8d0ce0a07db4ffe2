/**
 * The text engine on a pack made with `kvl pack --expert-dtype q4` (the routed experts as
 * Q4_EXPERT extents, docs/FORMAT.md), on both backends, against the independent float64 reference
 * evaluated on the DEQUANTISED Q4 experts (TextReference q4Experts: the group round trip written
 * from FORMAT.md, q * ds), so quantisation is not counted as error:
 *   - in the default activation mode (--act-dtype auto: i16x1 on the vector kernel sets) and in
 *     f32: logits of every prompt position within the mode's bound (TOLERANCE = 1e-3 for f32, as
 *     for the Q8 tests; actModeBound for the integer modes) and 32 greedy tokens equal to the
 *     reference's, on both tiny presets;
 *   - every kernel set of each backend that this CPU has, with f32, i16x1 and i8 activations
 *     (matmul_q4, matmul_q4_i16, matmul_q4_i8), each within its own bound (i8 on tiny-seed0: on
 *     tiny-seed1-grouped its 8-bit inputs to the Q4 experts flip a grouped routing decision, which
 *     moves the float64 reference's own logits by 11.6, so no greedy step there is clear of it
 *     and expectGreedy would check nothing);
 *   - BF16 activations (matmul_q4_xb) run and stay within BF16 rounding of the reference;
 *   - a forced split over 2 and 3 instances: the unsplit run's logits bit for bit, and its tokens;
 *   - Q4 experts with a Q8 trunk (--trunk-dtype q8 too) against the reference with both round trips;
 *   - the engine's expert extent is the Q4 record's size in pages, under the Q8 pack's.
 * What Q4 costs against Q8 experts is measured, not tested: bench/expert-q4-accuracy.ts.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { openHostedEngine } from "../host/engine/engine-host.js";
import { PackReader } from "../host/pack/pack-format.js";
import { packCheckpoint } from "../packer/pack.js";
import {
  GREEDY_TOKENS, TOLERANCE, actModeBound, engineGreedy, expectGreedy, maxAbsDiff, prefillError, promptIds,
  referenceGreedy, type RoundedReferences,
} from "./support/engine-checks.js";
import { TextReference } from "./reference/text.js";
import { BACKENDS, BothBackends, KERNEL_SETS } from "./support/backends.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;
/** BF16 activations move logits by BF16 rounding (README "Numerics": about 0.1 on these models),
 * not by 1e-3: this bound only shows the Q4 x BF16-input product is wired, not garbage (as
 * test/trunk-q8-engine.test.ts's). */
const BF16_ACT_BOUND = 0.5;

interface Model {
  name: string;
  pack: string;
  q8Pack: string;
  reference: TextReference;
  /** The same, with every integer product's input rounded as --act-dtype i16x1 and i8 do. */
  rounded: RoundedReferences;
}

let tmp: { dir: string; cleanup: () => void };
const backends = new BothBackends(THREADS);
const models: Model[] = [];
/** tiny-seed0 packed with --expert-dtype q4 --trunk-dtype q8, and its reference. */
let bothPack: string;
let bothReference: TextReference;

const ACTS = ["f32", "i16x1", "i8"] as const;

beforeAll(async () => {
  tmp = tempDir("expert-q4-engine");
  await backends.open();
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), backends.native, seed, extra);
    const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q4`), { core: backends.native, allowRevision: true, expertDtype: "q4" });
    const q8Pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q8`), { core: backends.native, allowRevision: true });
    models.push({ name, pack, q8Pack, reference: TextReference.load(ckpt, { q4Experts: true }),
      rounded: {
        i16x1: TextReference.load(ckpt, { q4Experts: true, intInputs: "i16x1" }),
        i8: TextReference.load(ckpt, { q4Experts: true, intInputs: "i8" }),
      } });
    if (seed === 0) {
      bothPack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q4-trunk-q8`), { core: backends.native, allowRevision: true, expertDtype: "q4", trunkDtype: "q8" });
      bothReference = TextReference.load(ckpt, { q4Experts: true, q8Trunk: true });
    }
  }
}, 300_000);

afterAll(() => {
  backends.close();
  tmp?.cleanup();
});

describe.each(BACKENDS)("Q4 experts on %s", (backend) => {
  describe.each(["tiny-seed0", "tiny-seed1-grouped"])("%s", (name) => {
    const model = (): Model => models.find((m) => m.name === name)!;

    it.each(["auto", "f32"] as const)("in the %s activation mode: the Q4 reference's logits at every prompt position and its greedy tokens", (mode) => {
      const m = model();
      const act = mode === "auto" ? backends.autoAct(backend) : mode;
      const engine = backends.openEngine(backend, m.pack, { actDtype: act });
      try {
        expect(engine.info().actDtype).toBe(act);
        const prompt = promptIds(7, 24, m.reference.cfg.vocab_size);
        const err = prefillError(engine, m.reference, prompt);
        const bound = actModeBound(act, m.reference, m.rounded, prompt);
        console.log(`[q4 experts ${backend}] ${name} ${mode} (${act}): prefill max |diff| ${err.toExponential(2)} (bound ${bound.toExponential(2)})`);
        expect(err).toBeLessThanOrEqual(bound);
        const { ids, want } = referenceGreedy(m.reference);
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
        console.log(`[q4 experts ${backend}] kernel set ${set}: not run (not available here)`);
        return;
      }
      const m = models[act === "i8" ? 0 : 1]!;
      const engine = backends.openEngine(backend, m.pack, { kernels: set, actDtype: act });
      try {
        expect(engine.info().actDtype).toBe(act);
        const prompt = promptIds(7, 24, m.reference.cfg.vocab_size);
        const err = prefillError(engine, m.reference, prompt);
        const bound = actModeBound(act, m.reference, m.rounded, prompt);
        const greedy = expectGreedy(engine, m.reference, act, bound);
        console.log(`[q4 experts ${backend}] ${set} ${act}: max |diff| ${err.toExponential(2)} (bound ${bound.toExponential(2)}), ` +
          `greedy ${greedy.agreed}/${GREEDY_TOKENS} (${greedy.clear} clear)`);
        expect(err).toBeLessThanOrEqual(bound);
      } finally {
        engine.close();
      }
    });
  });

  it("runs BF16 activations on the Q4 experts within BF16 rounding of the reference", () => {
    const m = models[0]!;
    const engine = backends.openEngine(backend, m.pack, { actDtype: "bf16" });
    try {
      expect(engine.info().actDtype).toBe("bf16");
      const err = prefillError(engine, m.reference, promptIds(7, 24, m.reference.cfg.vocab_size));
      console.log(`[q4 experts ${backend}] bf16 activations: max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(BF16_ACT_BOUND);
    } finally {
      engine.close();
    }
  });

  it("split over 2 and 3 instances (the auto mode) gives the unsplit run's logits bit for bit and the reference's tokens", async () => {
    const m = models[1]!;
    const act = backends.autoAct(backend);
    const ids = promptIds(5, 13, m.reference.cfg.vocab_size);
    const { ids: prompt, want } = referenceGreedy(m.reference);
    const runs: Float32Array[] = [];
    for (const instances of [1, 2, 3]) {
      const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, actDtype: act, instances, instanceMemoryBytes: 256 * 2 ** 20 }));
      try {
        expect(hosted.ranges.length).toBe(instances);
        const session = hosted.engine.newSession({ maxContext: 128, maxBatch: 5 });
        try {
          runs.push(session.prefill(Int32Array.from(ids), null, "all")!);
        } finally {
          session.close();
        }
        expect(hosted.engine.parts.every((e) => e.info().actDtype === act)).toBe(true);
        expect(engineGreedy(hosted.engine, prompt)).toEqual(want);
      } finally {
        hosted.close();
      }
    }
    const bound = actModeBound(act, m.reference, m.rounded, ids);
    expect(maxAbsDiff(runs[0]!, m.reference.logits(ids))).toBeLessThanOrEqual(bound);
    expect(maxAbsDiff(runs[1]!, runs[0]!)).toBe(0);
    expect(maxAbsDiff(runs[2]!, runs[0]!)).toBe(0);
  });

  it("runs Q4 experts with a Q8 trunk: the reference with both round trips (f32, max error <= 1e-3) and its tokens", () => {
    const engine = backends.openEngine(backend, bothPack, { actDtype: "f32" });
    try {
      const err = prefillError(engine, bothReference, promptIds(7, 24, bothReference.cfg.vocab_size));
      console.log(`[q4 experts ${backend}] with a Q8 trunk, f32: max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(TOLERANCE);
      const { ids, want } = referenceGreedy(bothReference);
      expect(engineGreedy(engine, ids)).toEqual(want);
    } finally {
      engine.close();
    }
  });

  it("caches Q4 extents at their own size: the Q4 record's pages, under the Q8 pack's", async () => {
    const m = models[0]!;
    const rec = (await PackReader.open(m.pack)).stores.get("experts")!.records[0]!;
    const extentOf = (pack: string): number => {
      const engine = backends.openEngine(backend, pack);
      try {
        return engine.info().expertExtentBytes;
      } finally {
        engine.close();
      }
    };
    const q4 = extentOf(m.pack);
    expect(q4).toBe(Math.ceil(rec.nbytes / 4096) * 4096);
    expect(q4).toBeLessThanOrEqual(extentOf(m.q8Pack));
  });
});
