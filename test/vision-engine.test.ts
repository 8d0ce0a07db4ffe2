/**
 * The vision encoder of the core (kvl_vision_bytes / kvl_vision_encode) as the host uses it:
 * CoreEngine.encodeImages / visionBytes on both backends, on one engine and on a model split over
 * two instances (SplitEngine: only the first range loads the tower), and through the engine
 * worker (EngineClient), against the independent float64 reference (test/reference/vision.ts and
 * text.ts, which read the checkpoint, never the pack or the core).
 *
 * On the tiny synthesized checkpoint (seed 0) packed by `kvl pack`, per backend and layout:
 *   (a) embeddings of two images with different grids (4x6 and 6x4 patches, pixels in [-1, 1]
 *       from a seeded generator), in one call: max |engine - reference| / max |reference|
 *       <= 1e-3 (the engine's FP32 against float64; the tower's BF16 weights are exact in both);
 *   (b) 8 greedy tokens of a prompt with media placeholders, the media rows being
 *       roundToBf16(encodeImages(...)), equal the reference's greedy tokens, the reference
 *       running its own vision encode rounded the same way (each reference step's top-1 / top-2
 *       margin is asserted above the error the whole chain may carry, so a near-tie fails loudly);
 *       the engine's logits with those rows are within 1e-3 of the reference's with the same rows;
 *       in f32 and in the auto mode (i16x1 on the vector sets: within its bound, actModeBound's rule);
 *   (c) a grid that is not a multiple of the merge kernel, an odd grid array and wrong buffer
 *       lengths throw clear errors (the addon's own checks too), and the engine works afterwards,
 *       giving the same bits as before;
 *   (d) visionBytes grows with the patch count;
 *   (e) through the engine worker, encodeImages gives the direct call's bits; errors come back as
 *       the same classes; a model opened without vision refuses images with one clear UserError;
 *   (f) on one engine: grids at the position table's own size (bicubic = identity), with fewer
 *       rows and more columns, with many more rows, and with 612 patches (several blocks of
 *       attention keys and query tiles), within 1e-3 of the reference; an image's
 *       rows are bit-identical whatever image precedes or follows it in the call; 4x3, 2x0,
 *       512x2 and 2x512 grids are refused naming the grid; every vision tensor is read from the
 *       store exactly once per call (the bytes of vision.idx's records); a vision index that
 *       lacks a tensor is refused naming it.
 */
import { cpSync, existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { ENGINE_WORKER_PATH, EngineClient } from "../host/engine/engine-client.js";
import { type ActDtype, type CoreEngine, CoreError, engineOptionCodes, roundToBf16 } from "../host/core/core-api.js";
import { type HostedEngine, openHostedEngine } from "../host/engine/engine-host.js";
import { NativeBackend, loadNativeAddon } from "../host/core/native-backend.js";
import { crc32, decodeIndex, encodeIndex } from "../host/pack/pack-format.js";
import { NO_VISION_MESSAGE, SplitEngine } from "../host/engine/split-engine.js";
import { UserError } from "../host/system/user-error.js";
import { resolveActMode } from "../host/plan/act-mode.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { argmax } from "./reference/math.js";
import { TextReference } from "./reference/text.js";
import { VisionReference } from "./reference/vision.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";
import { promptIds } from "./support/prompt-ids.js";
import { evenSplit } from "./support/even-split.js";

const TOLERANCE = 1e-3;
const GREEDY_TOKENS = 8;
const THREADS = 2;
const INSTANCE_BYTES = 256 * 2 ** 20;
const GRIDS = Int32Array.of(4, 6, 6, 4);
const NOT_MERGEABLE = /image 0 has patch grid 3x4; each side must be a positive multiple of the 2x2 merge kernel/;

type BackendName = "wasm" | "native";
const BACKENDS: BackendName[] = ["wasm", "native"];
type Layout = "one engine" | "split over 2 instances";
const LAYOUTS: Layout[] = ["one engine", "split over 2 instances"];

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let text: TextReference;
/** text with the integer products' inputs rounded as --act-dtype i16x1 does (auto's mode on the vector kernel sets) */
let textI16: TextReference;
let vision: VisionReference;
/** the reference with every Linear layer's inputs rounded to BF16, as the BF16 vision products take them */
let visionBf16: VisionReference;
/** visionBf16 with attention rounded as the AMX attention rounds it too (Q, K, V, probabilities) */
let visionBf16Attn: VisionReference;
let mediaTokenId: number;
let patchValues: number;
let pixels: Float32Array;
let wasm: WasmBackend;
let native: NativeBackend;

/** n values in [-1, 1) from a seeded LCG (no fixture). */
function seededPixels(seed: number, n: number): Float32Array {
  let s = seed >>> 0;
  return Float32Array.from({ length: n }, () => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 31 - 1;
  });
}

function maxAbs(values: ArrayLike<number>): number {
  let m = 0;
  for (let i = 0; i < values.length; i++) m = Math.max(m, Math.abs(values[i]!));
  return m;
}

function maxAbsDiff(got: ArrayLike<number>, want: ArrayLike<number>): number {
  expect(got.length).toBe(want.length);
  let m = 0;
  for (let i = 0; i < got.length; i++) m = Math.max(m, Math.abs(got[i]! - want[i]!));
  return m;
}

/** How many values differ bit for bit (a count: a failing toEqual on long arrays is slow). */
function differingValues(a: Float32Array, b: Float32Array): number {
  expect(a.length).toBe(b.length);
  let n = 0;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) n++;
  return n;
}

/** The reference's media rows for these pixels and grids (float64 encode, rounded as the host does). */
function referenceRows(px: Float32Array, grids: Int32Array): Float64Array {
  const list: Array<[number, number]> = [];
  for (let i = 0; i < grids.length; i += 2) list.push([grids[i]!, grids[i + 1]!]);
  return Float64Array.from(vision.encode(Float64Array.from(px), list));
}

function errorOf(f: () => unknown): unknown {
  try {
    f();
  } catch (e) {
    return e;
  }
  return undefined;
}

/** One engine opened straight on a backend (loadVision by default). */
function openEngine(backend: BackendName, options: { loadVision?: boolean; actDtype?: ActDtype } = {}): CoreEngine {
  return (backend === "wasm" ? wasm : native).openEngine(pack, { nThreads: THREADS, loadVision: options.loadVision ?? true, actDtype: options.actDtype ?? "f32" });
}

/** An engine of the given layout; close() releases everything it opened. */
async function openLayout(backend: BackendName, layout: Layout, loadVision = true, actDtype: ActDtype = "f32"): Promise<{ engine: CoreEngine; hosted?: HostedEngine; close: () => void }> {
  if (layout === "one engine") {
    const engine = openEngine(backend, { loadVision, actDtype });
    return { engine, close: () => engine.close() };
  }
  const hosted = await openHostedEngine(backend, pack, evenSplit(pack, { nThreads: THREADS, instances: 2, instanceMemoryBytes: INSTANCE_BYTES, loadVision, actDtype }));
  return { engine: hosted.engine, hosted, close: () => hosted.close() };
}

beforeAll(async () => {
  tmp = tempDir("vision-engine");
  const made = await tinyPack(tmp.dir);
  pack = made.pack;
  text = TextReference.load(made.ckpt, { q8Experts: true });
  textI16 = TextReference.load(made.ckpt, { q8Experts: true, intInputs: "i16x1" });
  vision = VisionReference.load(made.ckpt);
  visionBf16 = VisionReference.load(made.ckpt, { linearInputs: "bf16" });
  visionBf16Attn = VisionReference.load(made.ckpt, { linearInputs: "bf16", attention: "bf16" });
  const config = JSON.parse(readFileSync(join(made.ckpt, "config.json"), "utf8")) as { media_placeholder_token_id: number };
  mediaTokenId = config.media_placeholder_token_id;
  patchValues = 3 * vision.cfg.patch_size * vision.cfg.patch_size;
  pixels = seededPixels(2024, (4 * 6 + 6 * 4) * patchValues);
  native = new NativeBackend();
  wasm = await WasmBackend.create({ memoryBytes: 512 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) });
}, 300_000);

afterAll(() => {
  wasm?.close();
  native?.close();
  tmp?.cleanup();
});

describe("roundToBf16", () => {
  it("rounds FP32 to the nearest BF16, ties to even", () => {
    const bits = Uint32Array.of(
      0x3f800000, // 1: exact
      0x3f808000, // 1 + 2^-8 (a tie, kept bit 0): down to 1
      0x3f818000, // 1 + 3 * 2^-8 (a tie, kept bit 1): up to 1 + 2^-6
      0x3f808001, // just above the tie: up
      0x3f807fff, // just below the tie: down
      0xbf80c000, // -(1 + 2^-8 + 2^-9): away from zero in magnitude
      0x7f7fffff, // the largest float rounds to +inf, as in numpy's uint32 arithmetic
      0x7fc00000, // the default NaN stays that NaN
      0x00000001, // the smallest subnormal rounds to +0
      0x80000000, // -0 stays -0
    );
    const want = Uint32Array.of(0x3f800000, 0x3f800000, 0x3f820000, 0x3f810000, 0x3f800000, 0xbf810000, 0x7f800000, 0x7fc00000, 0, 0x80000000);
    const input = new Float32Array(bits.buffer);
    const out = roundToBf16(input);
    expect(out).not.toBe(input);
    expect(Array.from(new Uint32Array(out.buffer), (b) => b.toString(16))).toEqual(Array.from(want, (b) => b.toString(16)));
    expect(Array.from(new Uint32Array(input.buffer))).toEqual(Array.from(bits)); // the input is untouched
    // a view into a larger buffer is read at its offset
    const backing = new Float32Array(4);
    backing.set([3, 1.00390625, 1.01171875, 5]);
    expect(Array.from(roundToBf16(backing.subarray(1, 3)))).toEqual([1, 1.015625]);
  });
});

describe.each(BACKENDS)("the vision encoder on %s", (backend) => {
  /** The unsplit engine's rows for GRIDS: what every layout must give bit for bit. */
  let direct: Float32Array;
  beforeAll(() => {
    const engine = openEngine(backend);
    try {
      direct = engine.encodeImages(pixels, GRIDS);
    } finally {
      engine.close();
    }
  });

  describe.each(LAYOUTS)("%s", (layout) => {
    it("(a) encodes two images of different grids in one call as the float64 reference does", async () => {
      const { engine, hosted, close } = await openLayout(backend, layout);
      try {
        const H = engine.info().hiddenSize;
        const rows = engine.encodeImages(pixels, GRIDS);
        expect(rows.length).toBe((6 + 6) * H);
        const want = referenceRows(pixels, GRIDS);
        const scale = maxAbs(want);
        const err = maxAbsDiff(rows, want) / scale;
        console.log(`[vision ${backend}, ${layout}] embeddings: max |diff| / max |ref| ${err.toExponential(2)} (max |ref| ${scale.toFixed(3)})`);
        expect(scale).toBeGreaterThan(0.1);
        expect(err).toBeLessThanOrEqual(TOLERANCE);
        // the second image alone gives its rows of the two-image call (attention stays per image)
        const alone = engine.encodeImages(pixels.subarray(24 * patchValues), GRIDS.subarray(2));
        expect(maxAbsDiff(alone, rows.subarray(6 * H)) / scale).toBeLessThanOrEqual(TOLERANCE);
        // the same kernels and threads: the layout changes no bit
        expect(differingValues(rows, direct)).toBe(0);
        if (hosted) {
          // only the first range loaded the tower
          const parts = (hosted.engine as SplitEngine).parts;
          expect(parts.length).toBe(2);
          expect(parts[0]!.visionBytes(new Int32Array(0))).toBe(0);
          expect(() => parts[1]!.visionBytes(new Int32Array(0))).toThrow(/vision weights are not loaded/);
        }
      } finally {
        close();
      }
    });

    it("(a') in the auto mode: BF16 products and attention where AMX runs (Linux, avx512-bf16, amx_bf16), within TOLERANCE plus twice what their BF16 roundings move the reference; elsewhere the f32 mode's bits", async () => {
      const act = resolveActMode("auto", backend, (backend === "wasm" ? wasm : native).defaultKernelSet()).actDtype;
      const amx = backend === "native" && process.platform === "linux" && native.defaultKernelSet() === "avx512-bf16" &&
        /^flags\s*:.*\bamx_bf16\b/m.test(readFileSync("/proc/cpuinfo", "utf8")) && !process.env.KVL_NO_AMX;
      const { engine, close } = await openLayout(backend, layout, true, act);
      try {
        const rows = engine.encodeImages(pixels, GRIDS);
        if (!amx) {
          expect(differingValues(rows, direct)).toBe(0);
          return;
        }
        // the two test images, then 18x34 = 612 patches: two blocks of the AMX attention's keys
        // (KVL_ATTN_AMX_KEYS, 512, the last partial) and seven query tiles (the last partial)
        const cases: Array<{ px: Float32Array; grids: Int32Array; rows: Float32Array }> = [{ px: pixels, grids: GRIDS, rows }];
        const big = seededPixels(2025, 18 * 34 * patchValues);
        cases.push({ px: big, grids: Int32Array.of(18, 34), rows: engine.encodeImages(big, Int32Array.of(18, 34)) });
        for (const c of cases) {
          const want = referenceRows(c.px, c.grids);
          const scale = maxAbs(want);
          const err = maxAbsDiff(c.rows, want) / scale;
          const list: Array<[number, number]> = [];
          for (let i = 0; i < c.grids.length; i += 2) list.push([c.grids[i]!, c.grids[i + 1]!]);
          const linearOnly = Float64Array.from(visionBf16.encode(Float64Array.from(c.px), list));
          const rounded = Float64Array.from(visionBf16Attn.encode(Float64Array.from(c.px), list));
          // the bound: what every rounding of the BF16 mode (the Linear inputs; attention's Q, K,
          // V and probabilities) moves the float64 reference, twice, plus the FP32 mode's 1e-3
          const bound = TOLERANCE + 2 * maxAbsDiff(rounded, want) / scale;
          console.log(`[vision ${backend}, ${layout}] ${list.map(([h, w]) => `${h}x${w}`).join(" + ")} patches, BF16 products and attention (${act}): ` +
            `max |diff| / max |ref| ${err.toExponential(2)} (bound ${bound.toExponential(2)}); the roundings move the reference by ` +
            `${(maxAbsDiff(rounded, want) / scale).toExponential(2)} (the Linear inputs' alone ${(maxAbsDiff(linearOnly, want) / scale).toExponential(2)}); ` +
            `engine against the rounded reference ${(maxAbsDiff(c.rows, rounded) / scale).toExponential(2)}`);
          // the BF16 path ran (an FP32 encode is within 1e-6 here), and within its bound. (The
          // engine is not much closer to the rounded reference than to the exact one: FP32 noise
          // flips BF16 roundings at their boundaries, and flips carry through 27 layers.)
          if (c.rows === rows) expect(differingValues(rows, direct)).toBeGreaterThan(0);
          expect(err).toBeLessThanOrEqual(bound);
        }
      } finally {
        close();
      }
    });

    it.each(["f32", "auto"] as const)(`(b) decodes the reference's ${GREEDY_TOKENS} greedy tokens after a prompt with two images (%s activation mode)`, async (mode) => {
      const V = text.cfg.vocab_size;
      const H = text.cfg.hidden_size;
      const media = (n: number): number[] => Array.from({ length: n }, () => mediaTokenId);
      const ids = [...promptIds(1, 5, V), ...media(6), ...promptIds(2, 3, V), ...media(6), ...promptIds(3, 2, V)];
      // the reference, from its own vision encode rounded as the host rounds
      const refRows = Float64Array.from(roundToBf16(Float32Array.from(referenceRows(pixels, GRIDS))));
      const want: number[] = [];
      const margins: number[] = [];
      const seq = [...ids];
      for (let step = 0; step < GREEDY_TOKENS; step++) {
        const last = text.logitsFromHidden(text.hiddenStates(seq, refRows).subarray((seq.length - 1) * H), 1);
        const top = argmax(last);
        let second = -Infinity;
        for (let i = 0; i < V; i++) if (i !== top && last[i]! > second) second = last[i]!;
        margins.push(last[top]! - second);
        want.push(top);
        seq.push(top);
      }
      const act = mode === "auto" ? resolveActMode("auto", backend, (backend === "wasm" ? wasm : native).defaultKernelSet()).actDtype : mode;
      const { engine, close } = await openLayout(backend, layout, true, act);
      const session = engine.newSession({ maxContext: 64, maxBatch: 7 });
      try {
        const rows = roundToBf16(engine.encodeImages(pixels, GRIDS));
        // the rounded rows of engine and reference differ at most where FP32 noise crossed a
        // BF16 rounding boundary: one BF16 step (2^-8 relative) there
        const rowsMoved = maxAbsDiff(rows, refRows) / maxAbs(refRows);
        let logits = session.prefill(Int32Array.from(ids), rows, "last")!;
        // the text path on identical rows: the reference's logits with the engine's rows
        const exactLast = text.logits(ids, Float64Array.from(rows)).subarray((ids.length - 1) * V);
        const textErr = maxAbsDiff(logits, exactLast);
        // i16x1's bound as actModeBound's: TOLERANCE plus twice what its input rounding moves the reference, with these rows
        const bound = act === "i16x1"
          ? TOLERANCE + 2 * maxAbsDiff(textI16.logits(ids, Float64Array.from(rows)).subarray((ids.length - 1) * V), exactLast)
          : TOLERANCE;
        // what the rows' difference moves the reference's logits by (the margins must exceed it)
        const refLast = text.logits(ids, refRows).subarray((ids.length - 1) * V);
        const rowsErr = maxAbsDiff(logits, refLast);
        console.log(`[vision ${backend}, ${layout}] media rows after BF16 rounding: max rel diff ${rowsMoved.toExponential(2)}; ` +
          `prompt logits vs reference with the same rows ${textErr.toExponential(2)}, with its own rows ${rowsErr.toExponential(2)}; ` +
          `smallest greedy margin ${Math.min(...margins).toExponential(2)}`);
        expect(engine.info().actDtype).toBe(act);
        expect(textErr, `${act} bound ${bound.toExponential(2)}`).toBeLessThanOrEqual(bound);
        for (const [step, m] of margins.entries()) {
          expect(m, `reference step ${step} is a near-tie`).toBeGreaterThan(2 * Math.max(bound, rowsErr));
        }
        const got: number[] = [];
        for (let step = 0; step < GREEDY_TOKENS; step++) {
          got.push(argmax(logits));
          if (step + 1 < GREEDY_TOKENS) logits = session.step(got.at(-1)!);
        }
        expect(got).toEqual(want);
        expect(session.position()).toBe(ids.length + GREEDY_TOKENS - 1);
      } finally {
        session.close();
        close();
      }
    });

    it("(c) refuses a grid off the merge kernel and wrong buffer lengths clearly, then still works", async () => {
      const { engine, close } = await openLayout(backend, layout);
      try {
        const bad = errorOf(() => engine.encodeImages(pixels.subarray(0, 12 * patchValues), Int32Array.of(3, 4)));
        expect(bad).toBeInstanceOf(CoreError);
        expect((bad as CoreError).statusName).toBe("invalid argument");
        expect(String(bad)).toMatch(NOT_MERGEABLE);
        expect(() => engine.visionBytes(Int32Array.of(4, 6, 3, 4))).toThrow(/image 1 has patch grid 3x4/);
        expect(() => engine.encodeImages(pixels.subarray(1), GRIDS)).toThrow(
          new RegExp(`pixelValues holds ${pixels.length - 1} floats; the grids' 48 patches need ${pixels.length} \\(patches x 3 x 14 x 14\\)`));
        expect(() => engine.encodeImages(pixels, GRIDS.subarray(0, 3))).toThrow(/grids holds 3 int32s; want n_images x 2/);
        expect(() => engine.visionBytes(Int32Array.of(4))).toThrow(RangeError);
        // the engine is unharmed: the same bits, and text still runs
        expect(differingValues(engine.encodeImages(pixels, GRIDS), direct)).toBe(0);
        const session = engine.newSession({ maxContext: 16 });
        try {
          expect(session.prefill(Int32Array.of(20, 21, 22), null, "last")!.length).toBe(engine.info().vocabSize);
        } finally {
          session.close();
        }
        // no images: no rows, no working memory
        expect(engine.encodeImages(new Float32Array(0), new Int32Array(0)).length).toBe(0);
      } finally {
        close();
      }
    });

    it("(d) visionBytes grows with the patch count", async () => {
      const { engine, close } = await openLayout(backend, layout);
      try {
        const grids = [[], [2, 2], [4, 6], [4, 6, 6, 4], [8, 8, 8, 8], [16, 16]];
        const bytes = grids.map((g) => engine.visionBytes(Int32Array.from(g)));
        console.log(`[vision ${backend}, ${layout}] visionBytes for 0/4/24/48/128/256 patches: ${bytes.join(", ")}`);
        expect(bytes[0]).toBe(0);
        for (let i = 1; i < bytes.length; i++) expect(bytes[i]!).toBeGreaterThan(bytes[i - 1]!);
      } finally {
        close();
      }
    });

    it("refuses images with one clear error when opened without vision", async () => {
      const { engine, close } = await openLayout(backend, layout, false);
      try {
        if (layout === "one engine") {
          // a bare engine: the core's words
          expect(() => engine.encodeImages(pixels, GRIDS)).toThrow(/vision weights are not loaded/);
          expect(() => engine.visionBytes(GRIDS)).toThrow(CoreError);
        } else {
          const error = errorOf(() => engine.encodeImages(pixels, GRIDS));
          expect(error).toBeInstanceOf(UserError);
          expect((error as Error).message).toBe(NO_VISION_MESSAGE);
          expect(() => engine.visionBytes(GRIDS)).toThrow(UserError);
        }
      } finally {
        close();
      }
    });
  });

  it("a hosted model opened without a split refuses images as a UserError too", async () => {
    const hosted = await openHostedEngine(backend, pack, evenSplit(pack, { nThreads: THREADS, instances: 1, instanceMemoryBytes: INSTANCE_BYTES }));
    try {
      expect(() => hosted.engine.encodeImages(pixels, GRIDS)).toThrow(NO_VISION_MESSAGE);
    } finally {
      hosted.close();
    }
  });
});

describe("the addon's own checks (visionBytes / visionEncode)", () => {
  it("throws a failed status with the core's words, and RangeErrors for wrong lengths", () => {
    const addon = loadNativeAddon();
    const { status, engine } = addon.engineOpen(pack, engineOptionCodes({ nThreads: THREADS, loadVision: true }));
    expect(status).toBe(0);
    try {
      const H = addon.engineInfo(engine!).hiddenSize;
      const out = new Float32Array(12 * H);
      const failed = errorOf(() => addon.visionEncode(engine!, pixels.subarray(0, 12 * patchValues), Int32Array.of(3, 4), new Float32Array(3 * H)));
      expect((failed as { code?: string }).code).toBe("ERR_KVL_STATUS");
      expect((failed as { status?: number }).status).toBe(5);
      expect(String(failed)).toMatch(NOT_MERGEABLE);
      expect(() => addon.visionBytes(engine!, Int32Array.of(3, 4))).toThrow(NOT_MERGEABLE);
      expect(() => addon.visionEncode(engine!, pixels, GRIDS, new Float32Array(12 * H - 1))).toThrow(
        new RegExp(`kvl addon: visionEncode: out holds ${12 * H - 1} floats; the grids' 12 merged rows need ${12 * H}`));
      expect(() => addon.visionEncode(engine!, pixels.subarray(1), GRIDS, out)).toThrow(/kvl addon: visionEncode: pixelValues holds/);
      expect(() => addon.visionEncode(engine!, pixels, Int32Array.of(4, 6, 6), out)).toThrow(/grids holds 3 int32s/);
      expect(() => addon.visionEncode(engine!, pixels, new Float32Array(4) as unknown as Int32Array, out)).toThrow(TypeError);
      // out may not share memory with the pixels
      const shared = new Float32Array(pixels.length + out.length);
      shared.set(pixels);
      expect(() => addon.visionEncode(engine!, shared.subarray(0, pixels.length), GRIDS, shared.subarray(pixels.length - 1, pixels.length - 1 + out.length)))
        .toThrow(/shares memory/);
      expect(addon.visionEncode(engine!, pixels, GRIDS, out)).toBeUndefined();
      expect(addon.visionBytes(engine!, GRIDS)).toBeGreaterThan(0);
      // after all that, the same bits as the NativeEngine's call
      const again = native.openEngine(pack, { nThreads: THREADS, loadVision: true });
      try {
        expect(differingValues(out, again.encodeImages(pixels, GRIDS))).toBe(0);
      } finally {
        again.close();
      }
    } finally {
      addon.engineFree(engine!);
    }
    expect(() => addon.visionBytes(engine!, GRIDS)).toThrow(/engine closed/);
  });
});

describe.each(BACKENDS)("images through the engine worker on %s", (backend) => {
  let client: EngineClient;
  beforeAll(async () => {
    expect(existsSync(ENGINE_WORKER_PATH), "compile first: npx tsc -p .").toBe(true);
    // the direct engine's options (openEngine: the exact mode), so the two must agree bit for bit
    client = await EngineClient.open(backend, pack, evenSplit(pack, { nThreads: THREADS, instanceMemoryBytes: 512 * 2 ** 20, loadVision: true, actDtype: "f32" }));
  });
  afterAll(async () => {
    await client?.close();
  });

  it("(e) encodeImages equals the direct call bit for bit; errors come back as the same classes", async () => {
    const engine = openEngine(backend);
    try {
      const rows = await client.encodeImages(pixels, GRIDS);
      expect(rows).toBeInstanceOf(Float32Array);
      expect(differingValues(rows, engine.encodeImages(pixels, GRIDS))).toBe(0);
      expect(await client.visionBytes(GRIDS)).toBe(engine.visionBytes(GRIDS));
      const bad = await client.encodeImages(pixels.subarray(0, 12 * patchValues), Int32Array.of(3, 4)).then(() => undefined, (e: unknown) => e);
      expect(bad).toBeInstanceOf(CoreError);
      expect(String(bad)).toMatch(NOT_MERGEABLE);
      const short = await client.encodeImages(pixels.subarray(1), GRIDS).then(() => undefined, (e: unknown) => e);
      expect(short).toBeInstanceOf(RangeError);
      expect(String(short)).toMatch(/pixelValues holds/);
      // still serving, and the media rows prefill in the worker as they do here
      const session = await client.newSession({ maxContext: 32 });
      const local = engine.newSession({ maxContext: 32 });
      try {
        const ids = Int32Array.from([30, 31, ...Array.from({ length: 12 }, () => mediaTokenId), 32]);
        const media = roundToBf16(rows);
        const a = await session.prefill(ids, media, "last");
        expect(differingValues(a!, local.prefill(ids, media, "last")!)).toBe(0);
      } finally {
        await session.close();
        local.close();
      }
    } finally {
      engine.close();
    }
  });

  it("a worker's model opened without vision refuses images with a UserError", async () => {
    const plain = await EngineClient.open(backend, pack, evenSplit(pack, { nThreads: THREADS, instanceMemoryBytes: 256 * 2 ** 20 }));
    try {
      const error = await plain.encodeImages(pixels, GRIDS).then(() => undefined, (e: unknown) => e);
      expect(error).toBeInstanceOf(UserError);
      expect((error as Error).message).toBe(NO_VISION_MESSAGE);
      expect((await plain.stats()).tokensPrefilled).toBe(0);
    } finally {
      await plain.close();
    }
  });
});

describe.each(BACKENDS)("more of the vision encoder's contract on %s", (backend) => {
  /** Seeded patches for one image of this grid, and the grid array. */
  const image = (rows: number, cols: number, seed: number): { px: Float32Array; grid: Int32Array } =>
    ({ px: seededPixels(seed, rows * cols * patchValues), grid: Int32Array.of(rows, cols) });

  it("matches the reference where the position table is used as is, shrunk and stretched", () => {
    const { init_pos_emb_height: th, init_pos_emb_width: tw } = vision.cfg;
    const [mh, mw] = vision.cfg.merge_kernel_size;
    // bicubic at the table's own size is the identity; fewer rows and more columns; many more rows;
    // 18x34 = 612 patches: attention over three blocks of keys (vision.c's ATTN_KEYS, 256, the
    // last one partial) and seven tiles of queries (ATTN_QUERIES, 96, the last one partial), so
    // the online softmax's rescaling across blocks is checked against the reference
    const grids: Array<[number, number]> = [[th, tw], [Math.max(mh, Math.floor(th / 2 / mh) * mh), tw + 2 * mw], [th + 4 * mh, mw], [18, 34]];
    const engine = openEngine(backend);
    try {
      grids.forEach(([rows, cols], k) => {
        const { px, grid } = image(rows, cols, 40 + k);
        const want = referenceRows(px, grid);
        const err = maxAbsDiff(engine.encodeImages(px, grid), want) / maxAbs(want);
        console.log(`[vision ${backend}] ${rows}x${cols} patches (table ${th}x${tw}): max |diff| / max |ref| ${err.toExponential(2)}`);
        expect(err, `${rows}x${cols}`).toBeLessThanOrEqual(TOLERANCE);
      });
    } finally {
      engine.close();
    }
  });

  it("gives an image's rows bit for bit whatever images share the call, before or after it", () => {
    const a = image(4, 6, 50);
    const b = image(4, 4, 51);
    const engine = openEngine(backend);
    try {
      const H = engine.info().hiddenSize;
      const aRows = 6 * H;
      const alone = engine.encodeImages(a.px, a.grid);
      const cat = (x: Float32Array, y: Float32Array): Float32Array => { const o = new Float32Array(x.length + y.length); o.set(x); o.set(y, x.length); return o; };
      const before = engine.encodeImages(cat(a.px, b.px), Int32Array.of(4, 6, 4, 4));
      const after = engine.encodeImages(cat(b.px, a.px), Int32Array.of(4, 4, 4, 6));
      expect(alone.length).toBe(aRows);
      expect(differingValues(before.subarray(0, aRows), alone)).toBe(0);
      expect(differingValues(after.subarray(after.length - aRows), alone)).toBe(0);
      // the neighbour is really another image (the checks above are not vacuous)
      expect(differingValues(after.subarray(0, H), alone.subarray(0, H))).toBeGreaterThan(0);
    } finally {
      engine.close();
    }
  });

  it.each([[4, 3], [2, 0], [512, 2], [2, 512]])("refuses a %ix%i grid, naming the grid", (rows, cols) => {
    const engine = openEngine(backend);
    try {
      const px = new Float32Array(rows * cols * patchValues);
      const error = errorOf(() => engine.encodeImages(px, Int32Array.of(rows, cols)));
      expect(error).toBeInstanceOf(CoreError);
      expect(String(error)).toMatch(/grid/);
    } finally {
      engine.close();
    }
  });

  it("reads every vision tensor from the store exactly once per call", () => {
    const index = decodeIndex(readFileSync(join(pack, "vision.idx")), "vision.idx");
    const stored = index.records.reduce((sum, r) => sum + r.nbytes, 0);
    const engine = openEngine(backend);
    try {
      const { px, grid } = image(4, 4, 60);
      for (let call = 0; call < 2; call++) {
        const before = engine.stats().visionBytesRead;
        engine.encodeImages(px, grid);
        expect(engine.stats().visionBytesRead - before, `call ${call}`).toBe(stored);
      }
    } finally {
      engine.close();
    }
  });

  it("refuses a pack whose vision index lacks a tensor, naming it", () => {
    const broken = join(tmp.dir, `no-vision-tensor-${backend}`);
    cpSync(pack, broken, { recursive: true });
    try {
      const index = decodeIndex(readFileSync(join(pack, "vision.idx")), "vision.idx");
      const victim = "multi_modal_projector.linear_2.bias";
      expect(index.byName.has(victim)).toBe(true);
      const records = index.records.map((r) => (r.name === victim ? { ...r, name: r.name.replace("bias", "bixs") } : r));
      const idx = encodeIndex(index.kind, index.binSize, index.hparams, records, index.configText, index.revision, index.version);
      writeFileSync(join(broken, "vision.idx"), idx);
      // a consistent pack otherwise: the completion record names the new index
      const completePath = join(broken, "PACK_COMPLETE.json");
      const complete = JSON.parse(readFileSync(completePath, "utf8")) as { files: Record<string, { size: number; crc32?: number }> };
      complete.files["vision.idx"] = { size: idx.length, crc32: crc32(idx) };
      writeFileSync(completePath, JSON.stringify(complete));
      const error = errorOf(() => {
        const engine = (backend === "wasm" ? wasm : native).openEngine(broken, { nThreads: THREADS, loadVision: true });
        try {
          const { px, grid } = image(2, 2, 61);
          engine.encodeImages(px, grid);
        } finally {
          engine.close();
        }
      });
      expect(error).toBeInstanceOf(CoreError);
      expect(String(error)).toMatch(/linear_2\.bias/);
    } finally {
      rmSync(broken, { recursive: true, force: true });
    }
  });
});
