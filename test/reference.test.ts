/**
 * The float64 TypeScript reference (test/reference/) against golden outputs of the official-side
 * implementations (test/fixtures/goldens/, made by test/fixtures/make-goldens.py): the FP32
 * PyTorch reference in test/fixtures/reference (text decoder, MoonViT + projector, preprocessing) and
 * transformers' DeepseekV3ForCausalLM (text decoder), on the tiny synthesized checkpoints.
 *
 * The checkpoints are made here by the TypeScript synthesizer (packer/synth.ts) and checked to be
 * byte-identical to the ones the goldens were computed on (their sha256 are in the fixtures).
 * Every expected value comes from the fixtures or from the spec, never from the code under test.
 *
 * Tolerances. The goldens were computed in FP32 (unit roundoff u = 2^-24 = 6e-8); the reference
 * computes in float64 (its own error ~1e-16, negligible), so the differences measure the oracle's
 * FP32 rounding. Forward-error bounds of FP32 dot products are ~n*u relative to sum|x_i y_i|
 * (n <= 256 in the tiny model: ~1.5e-5, a worst case rarely approached), compounded over 4 decoder
 * layers / 3 vision blocks with normalisation in between; measured differences are smaller (see
 * the logged maxima: logits <= 5e-6 relative, hidden states <= 2e-6, vision <= 1.1e-6).
 *   - logits: |d| <= 1e-4 * max(1, |logit|) — the 1e-4 of make-goldens.py's LOGIT_TOLERANCE,
 *     which bounds reference-vs-transformers there;
 *   - final-norm hidden states and media embeddings (O(1) values): 2e-5 absolute;
 *   - greedy ids: exact. Valid because every golden greedy step has a top-1 / top-2 margin far
 *     above the logit tolerance (asserted below, from the fixture), so FP32 rounding cannot flip it;
 *   - preprocessing: 2e-6 on the normalised pixels (the issue's bound for "same decoded pixels")
 *     and bit-identical resized pixels (sha256), since Pillow's resampler is fixed point.
 */
import { createHash } from "node:crypto";
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { WasmBackend } from "../host/core/wasm-backend.js";
import { synthesize } from "../packer/synth.js";
import { loadTensors, q8RoundtripRows } from "./reference/checkpoint.js";
import { topkIndices } from "./reference/math.js";
import {
  loadPreprocessorConfig,
  numMediaTokens,
  preprocessOne,
  type PreprocessorConfig,
  type RgbImage,
} from "./reference/preprocess.js";
import { TextReference } from "./reference/text.js";
import { type Grid, VisionReference } from "./reference/vision.js";

const GOLDENS = join(dirname(fileURLToPath(import.meta.url)), "fixtures", "goldens");

const LOGIT_REL_TOL = 1e-4;
const HIDDEN_TOL = 2e-5;
const EMBED_TOL = 2e-5;
const PIXEL_TOL = 2e-6;

// -- fixture shapes ------------------------------------------------------------------------------

interface TextGolden {
  hidden?: number[];
  top_index: number[][];
  top_value: number[][];
  last_strided: number[];
  greedy: number[];
  greedy_margin: number[];
}
interface PromptGolden {
  ids: number[];
  media: "embeds_AB" | null;
  reference: TextGolden;
  transformers: TextGolden;
  reference_q8_experts?: TextGolden;
}
interface CheckpointGolden {
  provenance: Record<string, unknown>;
  checkpoint: {
    name: string;
    synth: { preset: "tiny" | "full"; seed: number; n_group?: number; topk_group?: number };
    sha256: Record<string, string>;
  };
  text_config: { hidden_size: number; vocab_size: number; n_group: number; topk_group: number; num_experts_per_tok: number };
  formats: Record<string, string>;
  vision: {
    images: string[];
    grids: [number, number][];
    tower_A: number[];
    embeds_A: number[];
    embeds_B: number[];
    embeds_AB: number[];
  };
  prompts: Record<string, PromptGolden>;
}
interface ImageGolden {
  width: number;
  height: number;
  rgb_base64?: string;
  formula?: string;
  resized_width?: number;
  resized_height?: number;
  resized_rgb_sha256?: string;
  grid: [number, number];
  n_media_tokens: number;
  shape: number[];
  sum: number;
  sum_sq: number;
  stride: number;
  strided: number[];
}
interface PreprocessGolden {
  provenance: Record<string, unknown>;
  preprocessor_config: PreprocessorConfig;
  images: Record<string, ImageGolden>;
}

function golden<T>(file: string): T {
  return JSON.parse(readFileSync(join(GOLDENS, file), "utf8")) as T;
}

// -- helpers -------------------------------------------------------------------------------------

function maxAbsDiff(got: ArrayLike<number>, want: ArrayLike<number>): number {
  expect(got.length).toBe(want.length);
  let m = 0;
  for (let i = 0; i < want.length; i++) m = Math.max(m, Math.abs(got[i]! - want[i]!));
  return m;
}

/** max over i of |got - want| / max(1, |want|) */
function maxRelDiff(got: ArrayLike<number>, want: ArrayLike<number>): number {
  expect(got.length).toBe(want.length);
  let m = 0;
  for (let i = 0; i < want.length; i++) m = Math.max(m, Math.abs(got[i]! - want[i]!) / Math.max(1, Math.abs(want[i]!)));
  return m;
}

/** The explicit images of the fixture (base64 of raw [h, w, 3] uint8). */
function fixtureImage(g: ImageGolden): RgbImage {
  const data = new Uint8Array(Buffer.from(g.rgb_base64!, "base64"));
  expect(data.length).toBe(g.width * g.height * 3);
  return { width: g.width, height: g.height, data };
}

/** make-goldens.py's closed form: v(x, y, c) = ((x*x + 3*y*y + 7*x*y + 64*c) >> 2) & 255. */
function formulaImage(width: number, height: number): RgbImage {
  const data = new Uint8Array(width * height * 3);
  for (let y = 0; y < height; y++) {
    for (let x = 0; x < width; x++) {
      for (let c = 0; c < 3; c++) data[(y * width + x) * 3 + c] = Math.floor((x * x + 3 * y * y + 7 * x * y + 64 * c) / 4) & 255;
    }
  }
  return { width, height, data };
}

function solid(width: number, height: number): RgbImage {
  const data = new Uint8Array(width * height * 3);
  for (let i = 0; i < data.length; i += 3) data.set([200, 30, 90], i);
  return { width, height, data };
}

const log = (msg: string): void => console.log(`[reference] ${msg}`);

/** The core the TypeScript synthesizer draws its weights with; scratch directories of this file. */
let core: WasmBackend;
const scratch: string[] = [];
beforeAll(async () => {
  core = await WasmBackend.create();
});
afterAll(() => {
  core?.close();
  for (const dir of scratch) rmSync(dir, { recursive: true, force: true });
});

// -- preprocessing -------------------------------------------------------------------------------

describe("image preprocessing vs test/fixtures/reference/preprocess.py (Pillow)", () => {
  const pre = golden<PreprocessGolden>("preprocess.json");
  const config = pre.preprocessor_config;

  it.each(Object.keys(pre.images))("image %s: grid, token count, normalised pixels", (name) => {
    const g = pre.images[name]!;
    const img = g.rgb_base64 ? fixtureImage(g) : formulaImage(g.width, g.height);
    expect(g.formula === undefined || g.formula.startsWith("v(x, y, c) = ((x*x + 3*y*y + 7*x*y + 64*c) >> 2) & 255")).toBe(true);
    const out = preprocessOne(img, config);
    expect(out.grid).toEqual(g.grid);
    expect(numMediaTokens(out.grid, config.merge_kernel_size)).toBe(g.n_media_tokens);
    expect(out.pixelValues.length).toBe(g.shape.reduce((a, b) => a * b, 1));
    if (g.resized_rgb_sha256) {
      // Pillow's BICUBIC resize is fixed point: the reference must give the same bytes.
      expect([out.resized.width, out.resized.height]).toEqual([g.resized_width, g.resized_height]);
      expect(createHash("sha256").update(out.resized.data).digest("hex")).toBe(g.resized_rgb_sha256);
    }
    const strided = out.pixelValues.filter((_, i) => i % g.stride === 0);
    const err = maxAbsDiff(strided, g.strided);
    let sum = 0;
    let sumSq = 0;
    for (const v of out.pixelValues) {
      sum += v;
      sumSq += v * v;
    }
    log(`preprocess ${name} (${g.width}x${g.height} -> grid ${out.grid.join("x")}): max |pixel diff| ${err.toExponential(2)} over ${strided.length} values`);
    expect(err).toBeLessThanOrEqual(PIXEL_TOL);
    const n = out.pixelValues.length;
    expect(Math.abs(sum - g.sum)).toBeLessThanOrEqual(PIXEL_TOL * n);
    expect(Math.abs(sumSq - g.sum_sq)).toBeLessThanOrEqual(2 * PIXEL_TOL * n);
  });

  it("the spec's worked token counts (§6)", () => {
    // [width, height] -> grid [rows, cols], tokens: kimi-vl-spec.md §6, "Token-count examples".
    const cases: [number, number, [number, number], number][] = [
      [196, 196, [14, 14], 49], [224, 224, [16, 16], 64], [28, 28, [2, 2], 1], [10, 10, [2, 2], 1],
      [100, 50, [4, 8], 8], [640, 480, [36, 46], 414], [1024, 1024, [66, 66], 1089], [1920, 1080, [48, 86], 1032],
    ];
    for (const [w, h, grid, tokens] of cases) {
      const out = preprocessOne(solid(w, h), config);
      expect(out.grid, `${w}x${h}`).toEqual(grid);
      expect(numMediaTokens(out.grid, config.merge_kernel_size)).toBe(tokens);
      expect(out.pixelValues.length).toBe(grid[0] * grid[1] * 3 * 14 * 14);
    }
  });

  it("refuses a grid past the 512x512 position table", () => {
    expect(() => preprocessOne(solid(14 * 520, 28), { ...config, in_token_limit: 1e9 })).toThrow(/Exceed pos emb/);
  });
});

// -- independence ------------------------------------------------------------------------------------

describe("test/reference stays independent of the runtime", () => {
  it("imports only its own modules and node: built-ins", () => {
    const dir = join(dirname(fileURLToPath(import.meta.url)), "reference");
    const files = readdirSync(dir).filter((f) => f.endsWith(".ts"));
    expect(files.length).toBeGreaterThanOrEqual(5);
    for (const f of files) {
      const specs = [...readFileSync(join(dir, f), "utf8").matchAll(/(?:from|import)\s*\(?\s*"([^"]+)"/g)].map((m) => m[1]!);
      for (const spec of specs) expect(spec.startsWith("./") || spec.startsWith("node:"), `${f} imports ${spec}`).toBe(true);
    }
  });
});

// -- checkpoint reading and the Q8 rule, on hand-made bytes ---------------------------------------------

describe("checkpoint reader and Q8 round trip", () => {
  it("reads BF16, F16, F32 and F64 tensors of a hand-written safetensors file", () => {
    const dir = mkdtempSync(join(tmpdir(), "kvl-reference-st-"));
    scratch.push(dir);
    // data: bf16 [1.5, -2] (0x3fc0, 0xc000), f16 [0.5, -3] (0x3800, 0xc200), f32 [0.1], f64 [1/3]
    const data = Buffer.alloc(4 + 4 + 4 + 8);
    data.writeUInt16LE(0x3fc0, 0);
    data.writeUInt16LE(0xc000, 2);
    data.writeUInt16LE(0x3800, 4);
    data.writeUInt16LE(0xc200, 6);
    data.writeFloatLE(0.1, 8);
    data.writeDoubleLE(1 / 3, 12);
    const header = JSON.stringify({
      __metadata__: { format: "pt" },
      "a.bf16": { dtype: "BF16", shape: [2], data_offsets: [0, 4] },
      "a.f16": { dtype: "F16", shape: [1, 2], data_offsets: [4, 8] },
      "a.f32": { dtype: "F32", shape: [1], data_offsets: [8, 12] },
      "b.f64": { dtype: "F64", shape: [], data_offsets: [12, 20] },
    });
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(header.length));
    writeFileSync(join(dir, "model.safetensors"), Buffer.concat([len, Buffer.from(header), data]));
    const t = loadTensors(dir, "a.");
    expect([...t.keys()].sort()).toEqual(["a.bf16", "a.f16", "a.f32"]);
    expect([...t.get("a.bf16")!.data]).toEqual([1.5, -2]);
    expect(t.get("a.f16")!.shape).toEqual([1, 2]);
    expect([...t.get("a.f16")!.data]).toEqual([0.5, -3]);
    expect(t.get("a.f32")!.data[0]).toBe(Math.fround(0.1));
    expect(loadTensors(dir, "b.").get("b.f64")!.data[0]).toBe(1 / 3);
  });

  it("Q8 rows: scale = max|w|/127, half-to-even, zero rows stay zero (docs/FORMAT.md)", () => {
    const w = { shape: [3, 4], data: Float64Array.from([127, 2.5, 3.5, -2.5, 0, 0, 0, 0, 1, -4, 0.5, 2]) };
    const q = q8RoundtripRows(w);
    expect([...q.data.subarray(0, 4)]).toEqual([127, 2, 4, -2]); // scale 1: 2.5 -> 2, 3.5 -> 4
    expect([...q.data.subarray(4, 8)]).toEqual([0, 0, 0, 0]);
    // Row 3's extreme is negative; w/scale in FP32 = 31.75, -127, 15.875, 63.5 (63.5 -> 64, even).
    const s = Math.fround(4 / 127);
    expect([...q.data.subarray(8, 12)]).toEqual([32, -127, 16, 64].map((v) => Math.fround(v * s)));
  });
});

// -- router semantics on a hand-built gate -------------------------------------------------------------

describe("router on a hand-built gate (spec §4.8)", () => {
  // 8 experts in 4 groups of 2, keep 2 groups, top-2. Gate rows give logits [ln 3, 0, ..., 0] for
  // x = [1, 0], so sigmoid scores s = [0.75, 0.5, ..., 0.5]. The biases make every biased score but
  // expert 0's negative: biased = [0.85, -0.4, -0.3, -0.4, -0.45, -0.45, -0.49, -0.49]; group
  // scores (sum of both members) [0.45, -0.7, -0.9, -0.98] keep groups 0 and 1. Masking the other
  // groups with 0.0 (official MoEGate, transformers) makes a masked expert (4..7, tied at 0.0)
  // beat expert 2 (-0.3); masking with -inf (vLLM's grouped_topk) would pick expert 2. Weights are
  // the unbiased scores: normalised 0.75/1.25 and 0.5/1.25, times 2.446.
  const bias = [0.1, -0.9, -0.8, -0.9, -0.95, -0.95, -0.99, -0.99];
  const gate = new Float64Array(16);
  gate[0] = Math.log(3);
  function router(normTopkProb: boolean): TextReference {
    const text_config = {
      vocab_size: 4, hidden_size: 2, intermediate_size: 2, moe_intermediate_size: 2, num_hidden_layers: 2,
      num_attention_heads: 1, n_routed_experts: 8, n_shared_experts: 1, num_experts_per_tok: 2,
      first_k_dense_replace: 1, n_group: 4, topk_group: 2, norm_topk_prob: normTopkProb,
      routed_scaling_factor: 2.446, kv_lora_rank: 2, qk_nope_head_dim: 2, qk_rope_head_dim: 2, v_head_dim: 2,
      rope_theta: 10000, rms_norm_eps: 1e-5, q_lora_rank: null, rope_scaling: null,
    };
    const tensors = new Map([
      ["language_model.model.layers.1.mlp.gate.weight", { shape: [8, 2], data: gate }],
      ["language_model.model.layers.1.mlp.gate.e_score_correction_bias", { shape: [8], data: Float64Array.from(bias) }],
    ]);
    return TextReference.fromTensors({ text_config }, tensors);
  }

  it("masks groups with 0.0, chooses by biased score, weighs by normalised unbiased score", () => {
    const { indices, weights } = router(true).route(1, Float64Array.from([1, 0]), 1);
    expect(indices[0]).toBe(0);
    expect([4, 5, 6, 7]).toContain(indices[1]);
    expect(weights[0]).toBeCloseTo((0.75 / 1.25) * 2.446, 12);
    expect(weights[1]).toBeCloseTo((0.5 / 1.25) * 2.446, 12);
  });

  it("norm_topk_prob false: the raw scores times routed_scaling_factor", () => {
    const { weights } = router(false).route(1, Float64Array.from([1, 0]), 1);
    expect(weights[0]).toBeCloseTo(0.75 * 2.446, 12);
    expect(weights[1]).toBeCloseTo(0.5 * 2.446, 12);
  });
});

// -- per checkpoint --------------------------------------------------------------------------------

describe.each(["tiny-seed0", "tiny-seed1-grouped"])("%s vs the PyTorch reference and transformers", (name) => {
  const g = golden<CheckpointGolden>(`${name}.json`);
  const pre = golden<PreprocessGolden>("preprocess.json");
  let dir = "";
  let text: TextReference;
  let vision: VisionReference;
  const results = new Map<string, { hidden: Float64Array; logits: Float64Array; greedy: number[] }>();
  const H = g.text_config.hidden_size;
  const V = g.text_config.vocab_size;
  const mediaRows = new Float64Array(g.vision.embeds_AB);

  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), `kvl-reference-${name}-`));
    scratch.push(dir);
    const s = g.checkpoint.synth;
    await synthesize(dir, {
      preset: s.preset, seed: s.seed, core,
      ...(s.n_group !== undefined && s.topk_group !== undefined ? { nGroup: s.n_group, topkGroup: s.topk_group } : {}),
    });
    text = TextReference.load(dir);
    vision = VisionReference.load(dir);
  });
  afterAll(() => {
    results.clear();
  });

  /** The reference's outputs for one prompt (computed once, compared with both oracles). */
  function run(key: string, ref: () => TextReference = () => text): { hidden: Float64Array; logits: Float64Array; greedy: number[] } {
    const cached = results.get(key);
    if (cached) return cached;
    const p = g.prompts[key.replace(/:q8$/, "")]!;
    const media = p.media ? mediaRows : undefined;
    const model = ref();
    const hidden = model.hiddenStates(p.ids, media);
    const logits = model.logitsFromHidden(hidden, p.ids.length);
    const greedy = model.greedy(p.ids, p.reference.greedy.length, media);
    const r = { hidden, logits, greedy };
    results.set(key, r);
    return r;
  }

  function compareText(label: string, got: { hidden: Float64Array; logits: Float64Array; greedy: number[] }, want: TextGolden, n: number): void {
    if (want.hidden) {
      const err = maxAbsDiff(got.hidden, want.hidden);
      log(`${label}: final-norm hidden max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(HIDDEN_TOL);
    }
    let worst = 0;
    for (let t = 0; t < n; t++) {
      const row = got.logits.subarray(t * V, (t + 1) * V);
      const idx = want.top_index[t]!;
      worst = Math.max(worst, maxRelDiff(idx.map((i) => row[i]!), want.top_value[t]!));
      // The golden top-32 must be the reference's top-32, up to ties at the boundary.
      const mine = topkIndices(row, idx.length + 1);
      const cut = row[mine[idx.length]!]!; // the 33rd largest
      const floor = want.top_value[t]![idx.length - 1]!;
      expect(floor, `${label} position ${t}: golden 32nd largest vs reference 33rd`).toBeGreaterThanOrEqual(cut - LOGIT_REL_TOL * Math.max(1, Math.abs(cut)));
      expect(mine[0], `${label} position ${t}: argmax`).toBe(idx[0]);
    }
    const last = got.logits.subarray((n - 1) * V, n * V);
    const strided = last.filter((_, i) => i % 641 === 0);
    const stridedErr = maxRelDiff(strided, want.last_strided);
    log(`${label}: logits max rel diff ${worst.toExponential(2)} (top-32, all positions), ${stridedErr.toExponential(2)} (last position, strided)`);
    expect(worst).toBeLessThanOrEqual(LOGIT_REL_TOL);
    expect(stridedErr).toBeLessThanOrEqual(LOGIT_REL_TOL);
    // Exact greedy ids are a fair demand only if the oracle's choices were not near-ties: each
    // step's top-1 / top-2 margin must exceed twice the largest tolerated logit error.
    const scale = Math.max(1, ...want.top_value.map((row) => Math.abs(row[0]!)));
    expect(Math.min(...want.greedy_margin)).toBeGreaterThan(2 * LOGIT_REL_TOL * scale);
    expect(got.greedy).toEqual(want.greedy);
  }

  it("the TypeScript synthesizer made the checkpoint the goldens were computed on", () => {
    for (const [file, sha] of Object.entries(g.checkpoint.sha256)) {
      expect(createHash("sha256").update(readFileSync(join(dir, file))).digest("hex"), file).toBe(sha);
    }
    expect(loadPreprocessorConfig(dir)).toEqual(pre.preprocessor_config);
    expect(text.cfg.n_group).toBe(g.text_config.n_group);
    expect(text.cfg.topk_group).toBe(g.text_config.topk_group);
  });

  describe("text decoder", () => {
    for (const key of Object.keys(g.prompts)) {
      for (const source of ["reference", "transformers"] as const) {
        it(`prompt "${key}" vs ${source === "reference" ? "test/fixtures/reference (PyTorch FP32)" : "transformers DeepseekV3ForCausalLM"}`, () => {
          const p = g.prompts[key]!;
          compareText(`${name} ${key} vs ${source}`, run(key), p[source], p.ids.length);
        });
      }
    }

    it("with routed experts as their Q8 round trip vs test/fixtures/reference q8_experts=True", () => {
      const p = g.prompts.random!;
      const want = p.reference_q8_experts!;
      const q8 = text.withQ8Experts();
      const got = run("random:q8", () => q8);
      compareText(`${name} random, Q8 experts`, got, want, p.ids.length);
      // The check means something only if Q8 moved the logits well past the tolerance.
      const plain = run("random");
      const moved = maxAbsDiff(got.logits.subarray(0, V * p.ids.length), plain.logits.subarray(0, V * p.ids.length));
      log(`${name}: Q8 experts move logits by up to ${moved.toExponential(2)}`);
      expect(moved).toBeGreaterThan(100 * LOGIT_REL_TOL);
    });

    it("media rows replace the placeholders in order, and only as many as there are", () => {
      const p = g.prompts.media!;
      expect(p.ids.filter((id) => id === text.mediaTokenId).length).toBe(mediaRows.length / H);
      expect(() => text.embed(p.ids, mediaRows.subarray(0, mediaRows.length - H))).toThrow(/media/);
      const x = text.embed(p.ids, mediaRows);
      const first = p.ids.indexOf(text.mediaTokenId!);
      expect(Array.from(x.subarray(first * H, (first + 1) * H))).toEqual(g.vision.embeds_AB.slice(0, H));
    });

    it("routing: weights sum to routed_scaling_factor; group limits change choices where configured", () => {
      const c = text.cfg;
      // deterministic pseudo-random router inputs
      let s = 12345;
      const rand = (): number => ((s = (Math.imul(s, 1103515245) + 12345) >>> 0) / 2 ** 32) * 2 - 1;
      const n = 256;
      const x = Float64Array.from({ length: n * H }, rand);
      const layer = c.first_k_dense_replace;
      const { indices, weights } = text.route(layer, x, n);
      const k = c.num_experts_per_tok;
      for (let r = 0; r < n; r++) {
        const sum = weights.subarray(r * k, (r + 1) * k).reduce((a, b) => a + b, 0);
        expect(sum).toBeCloseTo(c.routed_scaling_factor, 12);
        expect(new Set(indices.subarray(r * k, (r + 1) * k)).size).toBe(k);
      }
      if (c.n_group > c.topk_group) {
        // Dropping the group limit must change some choice, or the grouped goldens prove little.
        const ungrouped = text.route(layer, x, n, { nGroup: 1, topkGroup: 1 });
        let changed = 0;
        for (let r = 0; r < n; r++) {
          const a = new Set(indices.subarray(r * k, (r + 1) * k));
          if (!ungrouped.indices.subarray(r * k, (r + 1) * k).every((e) => a.has(e))) changed++;
        }
        log(`${name}: group limit changed the experts of ${changed}/${n} random rows`);
        expect(changed).toBeGreaterThan(0);
      }
    });
  });

  describe("MoonViT + projector", () => {
    const images = Object.fromEntries(g.vision.images.map((k) => [k, preprocessOne(fixtureImage(pre.images[k]!), pre.preprocessor_config)]));

    it("grids of the fixture images", () => {
      expect(g.vision.images.map((k) => images[k]!.grid)).toEqual(g.vision.grids);
    });

    it("final-LN tower features and projector output of each image alone", () => {
      const a = images.A!;
      const b = images.B!;
      const tower = vision.tower(a.pixelValues, [a.grid]);
      const towerErr = maxAbsDiff(tower, g.vision.tower_A);
      const embA = maxAbsDiff(vision.encode(a.pixelValues, [a.grid]), g.vision.embeds_A);
      const embB = maxAbsDiff(vision.encode(b.pixelValues, [b.grid]), g.vision.embeds_B);
      log(`${name}: vision tower A max |diff| ${towerErr.toExponential(2)}; projector A ${embA.toExponential(2)}, B ${embB.toExponential(2)}`);
      expect(towerErr).toBeLessThanOrEqual(EMBED_TOL);
      expect(embA).toBeLessThanOrEqual(EMBED_TOL);
      expect(embB).toBeLessThanOrEqual(EMBED_TOL);
    });

    it("two images in one call: block-diagonal attention", () => {
      const a = images.A!;
      const b = images.B!;
      const both = new Float64Array(a.pixelValues.length + b.pixelValues.length);
      both.set(a.pixelValues);
      both.set(b.pixelValues, a.pixelValues.length);
      const grids: Grid[] = [a.grid, b.grid];
      const err = maxAbsDiff(vision.encode(both, grids), g.vision.embeds_AB);
      log(`${name}: projector A+B in one call max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(EMBED_TOL);
    });

    it("end to end: preprocess -> vision -> text matches transformers' hidden states and next id", () => {
      const a = images.A!;
      const b = images.B!;
      const both = new Float64Array(a.pixelValues.length + b.pixelValues.length);
      both.set(a.pixelValues);
      both.set(b.pixelValues, a.pixelValues.length);
      const media = vision.encode(both, [a.grid, b.grid]);
      const p = g.prompts.media!;
      expect(media.length / H).toBe(numMediaTokens(a.grid, [2, 2]) + numMediaTokens(b.grid, [2, 2]));
      const hidden = text.hiddenStates(p.ids, media);
      const err = maxAbsDiff(hidden, p.transformers.hidden!);
      log(`${name}: image -> hidden end to end vs transformers max |diff| ${err.toExponential(2)}`);
      expect(err).toBeLessThanOrEqual(HIDDEN_TOL);
      const last = text.logitsFromHidden(hidden.subarray((p.ids.length - 1) * H), 1);
      expect(topkIndices(last, 1)[0]).toBe(p.transformers.greedy[0]);
    });
  });
});

