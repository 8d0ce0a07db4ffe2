/**
 * The text engine of the core, on both backends, against the independent float64 reference
 * (test/reference/text.ts, which reads the checkpoint itself, never the pack or the core).
 *
 * What is compared, per backend, on two tiny synthesized checkpoints (seed 0; seed 1 with
 * group-limited routing) packed by `kvl pack`:
 *   - logits of every prompt position: max |engine - reference| <= 1e-3 (the engine's FP32
 *     arithmetic against float64; the reference uses the pack's Q8 round trip of the experts, so
 *     quantisation is not counted as error);
 *   - 32 greedy tokens from step(): equal to the reference's, whose every step has a top-1 /
 *     top-2 margin above twice the tolerance (asserted, so a near-tie fails loudly instead of
 *     flaking);
 *   - media rows in place of <|media_pad|> tokens; a prefill split over several chunks;
 *   - the WebAssembly instance reads the same engine facts (struct layouts) as the addon;
 *   - a missing or truncated pack file is a CoreError naming the file;
 *   - forced splits over 2 and 3 instances (layer ranges, hidden states passed between them)
 *     give the unsplit run's logits and tokens, and a failure in a later range leaves every
 *     range at the same position;
 *   - the integer-activation modes (act_dtype i16x1: Linear inputs quantised to 16-bit integers;
 *     i8: the routed experts' 8-bit), on every kernel set of each backend, unsplit, split over 3
 *     instances and with a partly streamed trunk: within 1e-3 plus twice what each mode's input
 *     rounding moves the float64 reference (actModeBound), and the reference's 32 greedy tokens;
 *   - the core refuses act_dtype 3 (the removed two-term mode i16) with a message naming i16x1
 *     and f32.
 */
import { readFileSync, rmSync, truncateSync, cpSync, statSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import {
  type CoreEngine, type EngineInfo, type EngineOptionCodes, CoreError, KVL_STRUCTS, engineOptionCodes,
} from "../host/core/core-api.js";
import { openHostedEngine } from "../host/engine/engine-host.js";
import { SplitEngine } from "../host/engine/split-engine.js";
import { layerRanges } from "../host/plan/instances.js";
import { loadNativeAddon } from "../host/core/native-backend.js";
import { type WasmEngine, wasmStructLayout } from "../host/core/wasm-engine.js";
import { packCheckpoint } from "../packer/pack.js";
import { argmax } from "./reference/math.js";
import {
  GREEDY_TOKENS, TOLERANCE, actModeBound, engineGreedy, expectGreedy, maxAbsDiff, openHalfTrunkEngine, prefillError, promptIds,
  referenceGreedy, type RoundedReferences,
} from "./support/engine-checks.js";
import { TextReference } from "./reference/text.js";
import { BACKENDS, type BackendName, BothBackends, KERNEL_SETS } from "./support/backends.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;

interface Model {
  name: string;
  pack: string;
  reference: TextReference;
  /** The same, with the integer products' inputs rounded as --act-dtype i16x1 and i8 do. */
  rounded: RoundedReferences;
  mediaTokenId: number;
}

let tmp: { dir: string; cleanup: () => void };
const backends = new BothBackends(THREADS);
const models: Model[] = [];

beforeAll(async () => {
  tmp = tempDir("engine");
  await backends.open();
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), backends.native, seed, extra);
    const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-pack`), { core: backends.native, allowRevision: true });
    const config = JSON.parse(readFileSync(join(ckpt, "config.json"), "utf8")) as { media_placeholder_token_id: number };
    models.push({
      name, pack, reference: TextReference.load(ckpt, { q8Experts: true }),
      rounded: {
        i16x1: TextReference.load(ckpt, { q8Experts: true, intInputs: "i16x1" }),
        i8: TextReference.load(ckpt, { q8Experts: true, intInputs: "i8" }),
      },
      mediaTokenId: config.media_placeholder_token_id,
    });
  }
}, 300_000);

afterAll(() => {
  backends.close();
  tmp?.cleanup();
});

describe.each(BACKENDS)("the text engine on %s", (backend) => {
  it("reads the same engine facts on both backends (struct layouts), with its own kernels", () => {
    const facts = (b: BackendName): EngineInfo => {
      const engine = backends.openEngine(b, models[0]!.pack);
      try {
        return engine.info();
      } finally {
        engine.close();
      }
    };
    const mine = facts(backend);
    const other = facts(backend === "wasm" ? "native" : "wasm");
    const shape = (i: EngineInfo) => ({ ...i, kernels: "", trunkDirectIo: false, expertDirectIo: false, visionDirectIo: false });
    expect(shape(mine)).toEqual(shape(other));
    expect(mine.nLayers).toBe(models[0]!.reference.cfg.num_hidden_layers);
    expect(mine.vocabSize).toBe(models[0]!.reference.cfg.vocab_size);
    expect(mine.kernels).toBe(backend === "wasm" ? "simd128" : backends.native.defaultKernelSet());
  });

  describe.each(["tiny-seed0", "tiny-seed1-grouped"])("%s", (name) => {
    const model = (): Model => models.find((m) => m.name === name)!;

    it("gives the reference's logits at every prompt position (max error <= 1e-3)", () => {
      const m = model();
      const V = m.reference.cfg.vocab_size;
      const ids = promptIds(7, 24, V);
      const want = m.reference.logits(ids);
      const engine = backends.openEngine(backend, m.pack);
      const session = engine.newSession({ maxContext: 128 });
      try {
        const got = session.prefill(Int32Array.from(ids), null, "all")!;
        const err = maxAbsDiff(got, want);
        console.log(`[engine ${backend}] ${name} prefill logits: max |diff| ${err.toExponential(2)}`);
        expect(err).toBeLessThanOrEqual(TOLERANCE);
        expect(session.position()).toBe(ids.length);
      } finally {
        session.close();
        engine.close();
      }
    });

    it(`decodes the reference's ${GREEDY_TOKENS} greedy tokens`, () => {
      const m = model();
      const { ids, want } = referenceGreedy(m.reference);
      const engine = backends.openEngine(backend, m.pack);
      try {
        expect(engineGreedy(engine, ids)).toEqual(want);
        const stats = engine.stats();
        expect(stats.tokensPrefilled).toBe(ids.length);
        expect(stats.tokensDecoded).toBe(GREEDY_TOKENS - 1);
      } finally {
        engine.close();
      }
    });

    it.each(["f32", "auto"] as const)("puts media rows in place of <|media_pad|> tokens, and a chunked prefill equals one chunk (%s activation mode)", (mode) => {
      const m = model();
      const V = m.reference.cfg.vocab_size;
      const H = m.reference.cfg.hidden_size;
      const ids = promptIds(3, 20, V);
      for (const at of [4, 5, 6, 13]) ids[at] = m.mediaTokenId;
      const media = new Float32Array(4 * H);
      let s = 12345;
      for (let i = 0; i < media.length; i++) {
        s = (Math.imul(s, 1103515245) + 12345) >>> 0;
        media[i] = ((s >>> 8) / 2 ** 24 - 0.5) * 0.2;
      }
      const want = m.reference.logits(ids, Float64Array.from(media));
      const act = mode === "auto" ? backends.autoAct(backend) : mode;
      const bound = actModeBound(act, m.reference, m.rounded, ids, Float64Array.from(media));
      const engine = backends.openEngine(backend, m.pack, { actDtype: act });
      const whole = engine.newSession({ maxContext: 64 });
      const chunked = engine.newSession({ maxContext: 64, maxBatch: 3 });
      try {
        expect(engine.info().actDtype).toBe(act);
        const a = whole.prefill(Int32Array.from(ids), media, "all")!;
        console.log(`[engine ${backend}] media rows, ${mode} (${act}): max |diff| ${maxAbsDiff(a, want).toExponential(2)} (bound ${bound.toExponential(2)})`);
        expect(maxAbsDiff(a, want)).toBeLessThanOrEqual(bound);
        const b = chunked.prefill(Int32Array.from(ids), media, "all")!;
        expect(maxAbsDiff(b, want)).toBeLessThanOrEqual(bound);
        // the wrong number of media rows is the caller's error, and changes nothing
        expect(() => whole.prefill(Int32Array.from([m.mediaTokenId]), null, "none")).toThrow(CoreError);
        expect(whole.position()).toBe(ids.length);
      } finally {
        whole.close();
        chunked.close();
        engine.close();
      }
    });
  });

  it.each(["scalar", "simd128", "avx2", "avx512"] as const)("runs on the %s kernel set where this backend and CPU have it", (set) => {
    const core = backends.core(backend);
    const available = core.kernelSets().some((k) => k.name === set && k.supported);
    if (!available) {
      // reported, not passed: the set is absent from this backend or this CPU
      console.log(`[engine ${backend}] kernel set ${set}: not run (not available here)`);
      expect(() => core.openEngine(models[0]!.pack, { nThreads: THREADS, kernels: set })).toThrow(CoreError);
      return;
    }
    const m = models[0]!;
    const ids = promptIds(9, 12, m.reference.cfg.vocab_size);
    const engine = core.openEngine(m.pack, { nThreads: THREADS, kernels: set });
    const session = engine.newSession({ maxContext: 32 });
    try {
      // avx512 runs as the avx512-bf16 table on CPUs with AVX512_BF16 (the same FP32 products)
      expect(engine.info().kernels).toMatch(set === "avx512" ? /^avx512(-bf16)?$/ : new RegExp(`^${set}$`));
      const err = maxAbsDiff(session.prefill(Int32Array.from(ids), null, "all")!, m.reference.logits(ids));
      console.log(`[engine ${backend}] kernel set ${set}: max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(TOLERANCE);
    } finally {
      session.close();
      engine.close();
    }
  });

  it("names the missing or truncated pack file in its error", () => {
    const src = models[0]!.pack;
    const broken = join(tmp.dir, `broken-${backend}`);
    cpSync(src, broken, { recursive: true });
    try {
      rmSync(join(broken, "trunk.idx"));
      expect(() => backends.openEngine(backend, broken)).toThrow(/trunk\.idx/);
      cpSync(join(src, "trunk.idx"), join(broken, "trunk.idx"));
      truncateSync(join(broken, "experts.bin"), statSync(join(broken, "experts.bin")).size - 4096);
      let error: unknown;
      try {
        backends.openEngine(backend, broken).close();
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(CoreError);
      expect(String(error)).toMatch(/experts\.bin/);
    } finally {
      rmSync(broken, { recursive: true, force: true });
    }
  });
});

/** A stand-in engine of one layer range whose forward can be made to fail (the rollback rule). */
function stubEngine(begin: number, end: number, nLayers: number, failAt: { calls: number }): CoreEngine {
  const info = { layerBegin: begin, layerEnd: end, nLayers, vocabSize: 3, hiddenSize: 2, mediaPlaceholderTokenId: 99 } as EngineInfo;
  return {
    info: () => ({ ...info }),
    stats: () => ({ tokensPrefilled: 0 }) as never,
    resetStats: () => undefined,
    setExpertSlots: () => 0,
    sessionBytes: () => 0,
    visionBytes: () => 0,
    encodeImages: () => new Float32Array(0),
    close: () => undefined,
    newSession: () => {
      let position = 0;
      const session = {
        position: () => position,
        truncate: (n: number) => { position = n; },
        close: () => undefined,
        prefill: () => null,
        step: () => new Float32Array(3),
        cancelFlags: () => [],
        setRouting: () => undefined,
        forward: (input: Int32Array | Float32Array, _media: Float32Array | null, logits: string) => {
          const n = input instanceof Int32Array ? input.length : input.length / 2;
          if (--failAt.calls === 0) throw new CoreError(1, `range [${begin}, ${end}) failed`);
          position += n;
          return end === nLayers ? (logits === "none" ? null : new Float32Array(logits === "all" ? 3 * n : 3)) : new Float32Array(2 * n);
        },
      };
      return session;
    },
  };
}

describe("layer ranges", () => {
  it("roll every range back when a later one fails mid-prompt", () => {
    // 3 ranges, chunks of 2 tokens: calls go (r0, r1, r2) per chunk; the 5th call is range 1 of chunk 2
    const fail = { calls: 5 };
    const split = new SplitEngine([stubEngine(0, 1, 3, fail), stubEngine(1, 2, 3, fail), stubEngine(2, 3, 3, fail)]);
    const session = split.newSession({ maxBatch: 2 });
    expect(() => session.prefill(Int32Array.of(1, 2, 3, 4, 5), null, "last")).toThrow(/range \[1, 2\) failed/);
    expect(session.position()).toBe(0);
    fail.calls = 0; // never fails again
    expect(session.prefill(Int32Array.of(1, 2, 3, 4, 5), null, "all")!.length).toBe(15);
    expect(session.position()).toBe(5);
  });

  it("refuse engines that do not cover the model in order", () => {
    const never = { calls: 0 };
    expect(() => new SplitEngine([stubEngine(0, 2, 4, never), stubEngine(3, 4, 4, never)])).toThrow(/starting at 2/);
    expect(() => new SplitEngine([stubEngine(0, 2, 4, never)])).toThrow(/cover layers \[0, 2\) of 4/);
  });

  it("are contiguous, cover every layer once, and refuse more instances than layers", () => {
    expect(layerRanges(4, 1)).toEqual([[0, 4]]);
    expect(layerRanges(4, 3)).toEqual([[0, 2], [2, 3], [3, 4]]);
    expect(layerRanges(27, 2)).toEqual([[0, 14], [14, 27]]);
    expect(() => layerRanges(4, 5)).toThrow(/4 decoder layers over 5/);
    expect(() => layerRanges(4, 0)).toThrow(RangeError);
  });
});

describe.each(BACKENDS)("a model split over instances on %s", (backend) => {
  const INSTANCE_BYTES = 256 * 2 ** 20;

  it("gives the unsplit run's logits and greedy tokens with 1, 2 and 3 instances", async () => {
    const m = models[1]!; // group-limited routing, dense layer 0 and MoE layers
    const ids = Int32Array.from(promptIds(5, 13, m.reference.cfg.vocab_size));
    const runs: Array<{ logits: Float32Array; tokens: number[]; ranges: ReadonlyArray<[number, number]> }> = [];
    for (const instances of [1, 2, 3]) {
      const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, instances, instanceMemoryBytes: INSTANCE_BYTES }));
      const session = hosted.engine.newSession({ maxContext: 64, maxBatch: 5 });
      try {
        const logits = session.prefill(ids, null, "all")!;
        const tokens: number[] = [];
        let last = logits.subarray(logits.length - m.reference.cfg.vocab_size);
        for (let i = 0; i < 8; i++) {
          tokens.push(argmax(last));
          last = session.step(tokens.at(-1)!);
        }
        expect(session.position()).toBe(ids.length + 8);
        expect(hosted.engine.stats().tokensDecoded).toBe(8);
        runs.push({ logits, tokens, ranges: hosted.ranges });
      } finally {
        session.close();
        hosted.close();
      }
    }
    expect(runs.map((r) => r.ranges)).toEqual([[[0, 4]], [[0, 2], [2, 4]], [[0, 2], [2, 3], [3, 4]]]);
    const want = m.reference.logits([...ids]);
    for (const run of runs) {
      expect(maxAbsDiff(run.logits, want)).toBeLessThanOrEqual(TOLERANCE);
      // the same kernels on the same rows in the same order: the split changes no bit
      expect(maxAbsDiff(run.logits, runs[0]!.logits)).toBe(0);
      expect(run.tokens).toEqual(runs[0]!.tokens);
    }
  });

  it("refuses what the first range cannot take without moving any range", async () => {
    const m = models[0]!;
    const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, instances: 2, instanceMemoryBytes: INSTANCE_BYTES }));
    const session = hosted.engine.newSession({ maxContext: 16 });
    try {
      session.prefill(Int32Array.from(promptIds(1, 10, m.reference.cfg.vocab_size)), null, "none");
      // 10 + 8 > 16: the first range refuses before computing anything
      expect(() => session.prefill(Int32Array.from(promptIds(2, 8, m.reference.cfg.vocab_size)), null, "last")).toThrow(/context is full/);
      expect(session.position()).toBe(10);
      // a media row count that does not match the placeholders is refused, nothing is kept
      expect(() => session.prefill(Int32Array.of(m.mediaTokenId, m.mediaTokenId), new Float32Array(m.reference.cfg.hidden_size), "last")).toThrow();
      expect(session.position()).toBe(10);
      const a = session.step(42);
      session.truncate(10);
      expect(maxAbsDiff(session.step(42), a)).toBe(0);
    } finally {
      session.close();
      hosted.close();
    }
  });

  it("refuses a layer range outside the model, naming it", () => {
    const engineOf = () => backends.openEngine(backend, models[0]!.pack, { layerBegin: 3, layerEnd: 9 });
    expect(engineOf).toThrow(/layer range \[3, 9\) is not a non-empty range within the model's 4 layers/);
  });
});

/** The integer modes, each checked within its own bound (actModeBound); both keep an int16 KV cache
 * and run attention on integers. */
const INT_MODES = ["i16x1", "i8"] as const;
const intModeBound = (m: Model, mode: (typeof INT_MODES)[number], ids: number[]): number =>
  actModeBound(mode, m.reference, m.rounded, ids);

/**
 * kvl_engine_open with these option codes as they are, past the host's own check (engineOptionCodes
 * takes only the names it knows, so a code the host no longer sends reaches the core only so):
 * the status and the core's message.
 */
function openWithCodes(backend: BackendName, pack: string, codes: Partial<EngineOptionCodes>): { status: number; error: string } {
  const all: EngineOptionCodes = { ...engineOptionCodes({ nThreads: THREADS }), ...codes };
  if (backend === "native") {
    const addon = loadNativeAddon();
    const { status, error, engine } = addon.engineOpen(pack, all);
    if (engine) addon.engineFree(engine);
    return { status, error };
  }
  // the instance's exports, from an engine opened (and closed) the ordinary way
  const probe = backends.wasm.openEngine(pack, { nThreads: THREADS }) as WasmEngine;
  const { core, memory } = probe;
  probe.close();
  const layout = wasmStructLayout(core, memory, KVL_STRUCTS.engineOptions);
  const ERR_BYTES = 8192;
  const pathBytes = core.lengthBytesUTF8(pack) + 1;
  const [opts, path, out, err] = [layout.bytes, pathBytes, 8, ERR_BYTES].map((n) => core._malloc(n) >>> 0) as [number, number, number, number];
  try {
    const v = new DataView(memory.buffer, opts, layout.bytes);
    new Uint8Array(memory.buffer, opts, layout.bytes).fill(0);
    for (const f of layout.fields) {
      const x = all[f.name as keyof EngineOptionCodes];
      if (f.bytes === 8) v.setBigInt64(f.offset, BigInt(x), true);
      else v.setInt32(f.offset, x, true);
    }
    core.stringToUTF8(pack, path, pathBytes);
    const status = core._kvl_engine_open(path, opts, out, err, ERR_BYTES);
    if (status === 0) core._kvl_engine_free(new DataView(memory.buffer, out, 4).getUint32(0, true));
    return { status, error: core.UTF8ToString(err) };
  } finally {
    for (const p of [opts, path, out, err]) core._free(p);
  }
}

describe.each(BACKENDS)("the integer-activation modes (act_dtype i16x1, i8) on %s", (backend) => {
  describe.each(KERNEL_SETS[backend])("on the %s kernel set", (set) => {
    const available = (): boolean => backends.core(backend).kernelSets().some((k) => k.name === set && k.supported);

    describe.each(INT_MODES)("%s", (mode) => {
      it.each(["tiny-seed0", "tiny-seed1-grouped"])("gives the reference's logits within the mode's bound and its greedy tokens (%s)", (name) => {
        if (!available()) {
          // reported, not passed: the set is absent from this CPU (the f32 test above checks it is refused)
          console.log(`[engine ${backend} ${mode}] kernel set ${set}: not run (not available here)`);
          return;
        }
        const m = models.find((x) => x.name === name)!;
        const ids = promptIds(7, 24, m.reference.cfg.vocab_size);
        const engine = backends.openEngine(backend, m.pack, { kernels: set, actDtype: mode });
        try {
          expect(engine.info().actDtype).toBe(mode);
          const err = prefillError(engine, m.reference, ids);
          const bound = intModeBound(m, mode, ids);
          const greedy = expectGreedy(engine, m.reference, mode, bound);
          console.log(`[engine ${backend} ${mode}] ${set} ${name} prefill logits: max |diff| ${err.toExponential(2)} (bound ${bound.toExponential(2)}), ` +
            `greedy ${greedy.agreed}/${GREEDY_TOKENS} (${greedy.clear} clear)`);
          expect(err).toBeLessThanOrEqual(bound);
        } finally {
          engine.close();
        }
      });
    });
  });

  it.each(INT_MODES)("keeps the FP32 product for streamed trunk tensors (a partial trunk cache, %s): same bound and tokens", (mode) => {
    const m = models[1]!;
    const ids = promptIds(7, 24, m.reference.cfg.vocab_size);
    // about half the trunk cached: the first layers' weights resident (int16), the rest streamed (BF16)
    const engine = openHalfTrunkEngine((o) => backends.openEngine(backend, m.pack, o), mode);
    try {
      const err = prefillError(engine, m.reference, ids);
      console.log(`[engine ${backend} ${mode}] partly streamed trunk: max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(intModeBound(m, mode, ids));
      expectGreedy(engine, m.reference, mode, intModeBound(m, mode, ids));
      expect(engine.stats().trunkMisses).toBeGreaterThan(0);
    } finally {
      engine.close();
    }
  });

  it.each(INT_MODES)("split over 3 instances gives the unsplit run's logits and tokens (%s), within the mode's bound of the reference", async (mode) => {
    const m = models[1]!; // group-limited routing, dense layer 0 and MoE layers
    const ids = promptIds(5, 13, m.reference.cfg.vocab_size);
    const runs: Array<{ logits: Float32Array; tokens: number[] }> = [];
    for (const instances of [1, 3]) {
      const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, instances, instanceMemoryBytes: 256 * 2 ** 20, actDtype: mode }));
      try {
        expect(hosted.engine.parts.map((p) => p.info().actDtype)).toEqual(Array(instances).fill(mode));
        const session = hosted.engine.newSession({ maxContext: 128, maxBatch: 5 });
        try {
          runs.push({ logits: session.prefill(Int32Array.from(ids), null, "all")!, tokens: [] });
        } finally {
          session.close();
        }
        runs.at(-1)!.tokens = engineGreedy(hosted.engine, referenceGreedy(m.reference).ids);
        expectGreedy(hosted.engine, m.reference, mode, intModeBound(m, mode, ids));
      } finally {
        hosted.close();
      }
    }
    const err = maxAbsDiff(runs[1]!.logits, m.reference.logits(ids));
    console.log(`[engine ${backend} ${mode}] 3 instances, chunks of 5: max |diff| ${err.toExponential(2)}`);
    expect(err).toBeLessThanOrEqual(intModeBound(m, mode, ids));
    // the same kernels on the same rows with the same quantised inputs: the split changes no bit
    expect(maxAbsDiff(runs[1]!.logits, runs[0]!.logits)).toBe(0);
    expect(runs[1]!.tokens).toEqual(runs[0]!.tokens);
  });

  it("i16x1 runs a long prompt's attention on integers: 300 tokens in chunks of 120, within the mode's bound of the reference, and the same over 3 instances", async () => {
    const m = models[0]!;
    const ids = promptIds(13, 300, m.reference.cfg.vocab_size);
    // chunks at positions 0, 120 and 240: three tiles of the int16 latents, the last one partial.
    // (With a BF16 KV cache a 300-token prompt flips one position's expert choice on this random
    // model whatever the attention does, so only the FP32 cache is checked against the reference.)
    const runs: Float32Array[] = [];
    for (const instances of [1, 3]) {
      const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, instances, instanceMemoryBytes: 256 * 2 ** 20, actDtype: "i16x1" }));
      try {
        expect(hosted.engine.parts.map((p) => p.info().actDtype)).toEqual(Array(instances).fill("i16x1"));
        const session = hosted.engine.newSession({ maxContext: 320, maxBatch: 120 });
        try {
          runs.push(session.prefill(Int32Array.from(ids), null, "all")!);
        } finally {
          session.close();
        }
      } finally {
        hosted.close();
      }
    }
    const err = maxAbsDiff(runs[0]!, m.reference.logits(ids));
    const bound = intModeBound(m, "i16x1", ids);
    console.log(`[engine ${backend} i16x1] 300 tokens, chunks of 120: max |diff| ${err.toExponential(2)} (bound ${bound.toExponential(2)})`);
    expect(err).toBeLessThanOrEqual(bound);
    // each instance rebuilds its own layers' integer rows: the split changes no bit
    expect(maxAbsDiff(runs[1]!, runs[0]!)).toBe(0);
  });

  it.each(INT_MODES)("%s decodes on integers from its int16 KV cache: token by token across a tile edge, within the mode's bound of the reference, the same after a truncate and over 3 instances", async (mode) => {
    const m = models[1]!;
    const ids = promptIds(17, 140, m.reference.cfg.vocab_size);
    const prompt = 100; // then 40 single-token steps, positions 100..139: the first tile fills at 128
    const runs: Float32Array[][] = [];
    for (const instances of [1, 3]) {
      const hosted = await openHostedEngine(backend, m.pack, evenSplit(m.pack, { nThreads: THREADS, instances, instanceMemoryBytes: 256 * 2 ** 20, actDtype: mode }));
      try {
        expect(hosted.engine.parts.map((p) => p.info().kvDtype)).toEqual(Array(instances).fill("i16"));
        const session = hosted.engine.newSession({ maxContext: 160, maxBatch: 64 });
        try {
          const steps = [session.prefill(Int32Array.from(ids.slice(0, prompt)), null, "last")!];
          for (const id of ids.slice(prompt, -1)) steps.push(session.step(id));
          runs.push(steps);
          // back to position 120 (inside the first tile) and the same tokens again: the rows and
          // tile columns are rewritten, what lies past the position is never read
          session.truncate(120);
          for (let p = 120; p < ids.length - 1; p++) expect(maxAbsDiff(session.step(ids[p]!), steps[p - prompt + 1]!)).toBe(0);
        } finally {
          session.close();
        }
      } finally {
        hosted.close();
      }
    }
    const V = m.reference.cfg.vocab_size;
    const want = m.reference.logits(ids);
    let err = 0;
    runs[0]!.forEach((got, i) => {
      err = Math.max(err, maxAbsDiff(got, want.subarray((prompt - 1 + i) * V, (prompt + i) * V)));
    });
    const bound = intModeBound(m, mode, ids);
    console.log(`[engine ${backend} ${mode}] 100-token prompt, 40 steps: max |diff| ${err.toExponential(2)} (bound ${bound.toExponential(2)})`);
    expect(err).toBeLessThanOrEqual(bound);
    runs[1]!.forEach((got, i) => expect(maxAbsDiff(got, runs[0]![i]!)).toBe(0));
  });

  it("keeps an int16 KV cache with act_dtype i16x1 or i8 and only with them, refusing the other pairings by name", () => {
    for (const actDtype of INT_MODES) {
      const engine = backends.openEngine(backend, models[0]!.pack, { actDtype });
      try {
        expect(engine.info().kvDtype).toBe("i16");
      } finally {
        engine.close();
      }
    }
    expect(() => backends.openEngine(backend, models[0]!.pack, { kvDtype: "i16" })).toThrow(/act_dtype i16x1 and i8 keep the KV cache as int16 rows, and only they do/);
    expect(() => backends.openEngine(backend, models[0]!.pack, { kvDtype: "bf16", actDtype: "i8" })).toThrow(/use kv_dtype i16 with act_dtype i16x1 or i8/);
  });

  it("refuses an act_dtype the host does not know, the removed i16 among them", () => {
    for (const actDtype of ["i4", "i16"]) {
      expect(() => backends.openEngine(backend, models[0]!.pack, { actDtype: actDtype as never })).toThrow(RangeError);
    }
  });

  it("the core refuses act_dtype 3 (the removed two-term mode i16) as an invalid argument, naming i16x1 and f32", () => {
    const refused = openWithCodes(backend, models[0]!.pack, { actDtype: 3 });
    expect(refused.status).toBe(5); // KVL_ERR_INVALID_ARG
    expect(refused.error).toBe("act_dtype = 3 (i16, two integer terms per input) was removed: use i16x1 (4), faster on every " +
      "kernel set, or f32 (1), the exact mode");
    // the codes on either side still open
    for (const actDtype of [2, 4]) expect(openWithCodes(backend, models[0]!.pack, { actDtype }).status).toBe(0);
  });
});
