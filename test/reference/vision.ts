/**
 * vision.ts — the float64 reference of MoonViT and the multimodal projector, written from
 * /work/shared/kimi-vl-spec.md §5.
 *
 * Owns: the patch embedding as one dense map of (channel, ky, kx)-ordered patches, the learned
 * position table resampled to each image's grid with PyTorch's bicubic (A = -0.75,
 * align_corners=False, no antialias — what the official code calls), 2-D RoPE with the
 * column/row pair layout, pre-LN blocks with bidirectional attention restricted to each image
 * (block-diagonal), GELU-tanh MLP, final LayerNorm, the 2x2 patch merge order and the projector
 * (LayerNorm per member, concatenation, exact-erf GELU). Does not own: preprocessing
 * (preprocess.ts). Imports nothing from the runtime.
 */
import { loadConfig, loadTensors, need } from "./checkpoint.js";
import { geluErf, geluTanh, layerNorm, linear, softmaxInPlace, type Tensor } from "./math.js";

/** Not in config.json; fixed by the official modeling code (spec §2.3). */
export const LAYER_NORM_EPS = 1e-5;
export const ROPE_THETA = 10000;
/** PyTorch's cubic convolution constant (Pillow's is -0.5; see preprocess.ts). */
export const TORCH_BICUBIC_A = -0.75;

export type Grid = readonly [number, number]; // [rows, cols] of patches

export interface VisionConfig {
  patch_size: number;
  init_pos_emb_height: number;
  init_pos_emb_width: number;
  num_attention_heads: number;
  num_hidden_layers: number;
  hidden_size: number;
  intermediate_size: number;
  merge_kernel_size: [number, number];
}

export interface VisionOptions {
  /** As TextOptions.ropeAngles: "f32" (default) forms the 2-D RoPE angles in FP32 as the official
   * code does (frequencies and column/row x frequency products), cos/sin in float64. */
  ropeAngles?: "f32" | "f64";
  /** "bf16": the inputs of every Linear layer (patch embedding, wqkv, wo, the MLP, the projector)
   * rounded to BF16 first, as the core's BF16 vision products take them (kernels.h
   * kvl_bf16_round_daz: to FP32, then nearest-even, subnormals to zero); "exact" (default). */
  linearInputs?: "exact" | "bf16";
  /** "bf16": attention rounded as the core's AMX attention rounds it (kernels.h
   * kvl_attention_bf16_amx): Q and K after RoPE, and V, rounded by bf16RoundDaz; each query's
   * probabilities formed as p = e^(s - m) (m: the row's maximum score), set to 0 below 2^-100
   * (vision.c's ATTN_PROB_FLOOR) and otherwise rounded by bf16RoundDaz before their product with
   * V; the normaliser is the sum of the unrounded p, as the core's L. (The core rounds
   * e^(s - M) with M the running maximum of the key blocks seen so far: the same number where
   * the first block holds the row's maximum, otherwise one with the same relative rounding (at most 2^-8)
   * at other points.) "exact" (default). */
  attention?: "exact" | "bf16";
}

/** v as the core's kvl_bf16_round_daz leaves it (written here from its definition). */
export function bf16RoundDaz(v: number): number {
  const f = new Float32Array(1);
  const u = new Uint32Array(f.buffer);
  f[0] = v;
  const bits = u[0]!;
  if ((bits & 0x7f800000) === 0) return bits >>> 31 ? -0 : 0;
  if (Number.isNaN(f[0])) return f[0];
  u[0] = ((bits + 0x7fff + ((bits >>> 16) & 1)) & 0xffff0000) >>> 0;
  return f[0];
}

/** PyTorch's cubic convolution kernel (spec §5.2). */
export function cubicWeight(x: number, a = TORCH_BICUBIC_A): number {
  x = Math.abs(x);
  if (x <= 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0;
}

/**
 * [nOut, nIn] resampling matrix of one axis, torch F.interpolate(mode="bicubic",
 * align_corners=False): source = (dst + 0.5) * nIn/nOut - 0.5 (not clamped), i0 = floor, t = frac,
 * taps i0-1..i0+2 clamped to the border, weights w(1+t), w(t), w(1-t), w(2-t); no antialias.
 */
export function bicubicMatrix(nIn: number, nOut: number): Float64Array {
  const m = new Float64Array(nOut * nIn);
  const ratio = nIn / nOut;
  for (let dst = 0; dst < nOut; dst++) {
    const src = (dst + 0.5) * ratio - 0.5;
    const i0 = Math.floor(src);
    const t = src - i0;
    const taps = [cubicWeight(1 + t), cubicWeight(t), cubicWeight(1 - t), cubicWeight(2 - t)];
    taps.forEach((w, k) => {
      const i = Math.min(Math.max(i0 + k - 1, 0), nIn - 1);
      m[dst * nIn + i] = m[dst * nIn + i]! + w;
    });
  }
  return m;
}

/** table [H, W, C] resampled to [outH, outW, C] (separable bicubic, spec §5.2). */
export function resamplePosEmb(table: Tensor, outH: number, outW: number): Float64Array {
  const [h, w, ch] = table.shape as [number, number, number];
  const rows = bicubicMatrix(h, outH);
  const cols = bicubicMatrix(w, outW);
  // columns first: tmp [h, outW, C]
  const tmp = new Float64Array(h * outW * ch);
  for (let i = 0; i < h; i++) {
    for (let c = 0; c < outW; c++) {
      for (let j = 0; j < w; j++) {
        const wt = cols[c * w + j]!;
        if (wt === 0) continue;
        const src = (i * w + j) * ch;
        const dst = (i * outW + c) * ch;
        for (let k = 0; k < ch; k++) tmp[dst + k] = tmp[dst + k]! + wt * table.data[src + k]!;
      }
    }
  }
  const out = new Float64Array(outH * outW * ch);
  for (let r = 0; r < outH; r++) {
    for (let i = 0; i < h; i++) {
      const wt = rows[r * h + i]!;
      if (wt === 0) continue;
      for (let c = 0; c < outW; c++) {
        const src = (i * outW + c) * ch;
        const dst = (r * outW + c) * ch;
        for (let k = 0; k < ch; k++) out[dst + k] = out[dst + k]! + wt * tmp[src + k]!;
      }
    }
  }
  return out;
}

/**
 * [gh*gw, headDim/2] angles of the 2-D RoPE (spec §5.3): pair 2i turns by column * freq_i,
 * pair 2i+1 by row * freq_i, freq_i = theta^(-4i/headDim), patches row-major.
 */
export function rope2dAngles(gh: number, gw: number, headDim: number, mode: "f32" | "f64" = "f32"): Float64Array {
  const quarter = headDim / 4;
  const pairs = headDim / 2;
  const freqs = Array.from({ length: quarter }, (_, i) =>
    mode === "f32"
      ? Math.fround(1 / Math.fround(ROPE_THETA ** Math.fround((4 * i) / headDim)))
      : ROPE_THETA ** (-(4 * i) / headDim));
  const out = new Float64Array(gh * gw * pairs);
  for (let n = 0; n < gh * gw; n++) {
    const col = n % gw;
    const row = Math.floor(n / gw);
    for (let i = 0; i < quarter; i++) {
      const byCol = col * freqs[i]!;
      const byRow = row * freqs[i]!;
      out[n * pairs + 2 * i] = mode === "f32" ? Math.fround(byCol) : byCol;
      out[n * pairs + 2 * i + 1] = mode === "f32" ? Math.fround(byRow) : byRow;
    }
  }
  return out;
}

/** Rotates pairs (2p, 2p+1) of x[off..off+headDim) as complex numbers by angles[aOff + p]. */
function rope2dInPlace(x: Float64Array, off: number, headDim: number, angles: Float64Array, aOff: number): void {
  for (let p = 0; p < headDim / 2; p++) {
    const phi = angles[aOff + p]!;
    const c = Math.cos(phi);
    const s = Math.sin(phi);
    const a = x[off + 2 * p]!;
    const b = x[off + 2 * p + 1]!;
    x[off + 2 * p] = a * c - b * s;
    x[off + 2 * p + 1] = a * s + b * c;
  }
}

/**
 * [gh*gw, D] -> [(gh/kh)*(gw/kw), kh*kw, D]: merged tokens row-major over the merged grid,
 * members row-major inside each kernel window — (2R,2C), (2R,2C+1), (2R+1,2C), (2R+1,2C+1)
 * for a 2x2 kernel (spec §5.6).
 */
export function mergePatches(tokens: Float64Array, grid: Grid, kernel: readonly [number, number], d: number): Float64Array {
  const [gh, gw] = grid;
  const [kh, kw] = kernel;
  const out = new Float64Array(gh * gw * d);
  let o = 0;
  for (let R = 0; R < gh / kh; R++) {
    for (let C = 0; C < gw / kw; C++) {
      for (let i = 0; i < kh; i++) {
        for (let j = 0; j < kw; j++) {
          const n = (R * kh + i) * gw + (C * kw + j);
          out.set(tokens.subarray(n * d, (n + 1) * d), o);
          o += d;
        }
      }
    }
  }
  return out;
}

export function parseVisionConfig(config: Record<string, unknown>): VisionConfig {
  const v = config.vision_config as Record<string, unknown> | undefined;
  if (!v) throw new Error("config.json has no vision_config");
  const n = (key: string): number => {
    if (typeof v[key] !== "number") throw new Error(`vision_config.${key} must be a number`);
    return v[key] as number;
  };
  const merge = (v.merge_kernel_size ?? [2, 2]) as [number, number];
  return {
    patch_size: n("patch_size"),
    init_pos_emb_height: n("init_pos_emb_height"),
    init_pos_emb_width: n("init_pos_emb_width"),
    num_attention_heads: n("num_attention_heads"),
    num_hidden_layers: n("num_hidden_layers"),
    hidden_size: n("hidden_size"),
    intermediate_size: n("intermediate_size"),
    merge_kernel_size: [merge[0], merge[1]],
  };
}

/** Smallest probability the core keeps (vision.c ATTN_PROB_FLOOR, 2^-100). */
const ATTN_PROB_FLOOR = 2 ** -100;

/** Scores -> the probabilities the AMX attention multiplies V by, over the unrounded sum
 * (VisionOptions.attention "bf16"). */
function roundedProbabilities(v: Float64Array): void {
  let max = -Infinity;
  for (let i = 0; i < v.length; i++) max = Math.max(max, v[i]!);
  let sum = 0;
  for (let i = 0; i < v.length; i++) {
    const e = Math.exp(v[i]! - max);
    sum += e;
    v[i] = e < ATTN_PROB_FLOOR ? 0 : bf16RoundDaz(e);
  }
  for (let i = 0; i < v.length; i++) v[i]! /= sum;
}

export class VisionReference {
  readonly cfg: VisionConfig;
  readonly textHidden: number;
  private readonly ropeMode: "f32" | "f64";
  private readonly bf16Inputs: boolean;
  private readonly bf16Attention: boolean;

  private constructor(cfg: VisionConfig, textHidden: number, private readonly w: Map<string, Tensor>, options: VisionOptions) {
    this.cfg = cfg;
    this.textHidden = textHidden;
    this.ropeMode = options.ropeAngles ?? "f32";
    this.bf16Inputs = options.linearInputs === "bf16";
    this.bf16Attention = options.attention === "bf16";
  }

  /** A Linear layer, its inputs rounded first in the bf16 mode. */
  private lin(x: Float64Array, rows: number, w: Tensor, bias?: Tensor): Float64Array {
    return linear(this.bf16Inputs ? x.map(bf16RoundDaz) : x, rows, w, bias);
  }

  static load(dir: string, options: VisionOptions = {}): VisionReference {
    const config = loadConfig(dir);
    const cfg = parseVisionConfig(config);
    const textHidden = (config.text_config as { hidden_size: number }).hidden_size;
    const w = loadTensors(dir, "vision_tower.");
    for (const [name, t] of loadTensors(dir, "multi_modal_projector.")) w.set(name, t);
    return new VisionReference(cfg, textHidden, w, options);
  }

  private weight(name: string, shape?: readonly number[]): Tensor {
    return need(this.w, name, shape);
  }

  private ln(x: Float64Array, rows: number, prefix: string): Float64Array {
    const d = this.cfg.hidden_size;
    return layerNorm(x, rows, this.weight(prefix + ".weight", [d]), this.weight(prefix + ".bias", [d]), LAYER_NORM_EPS);
  }

  /** The 14x14 stride-14 conv as one dense map: pixelValues [N, 3*p*p] -> [N, D] (spec §5.1). */
  patchEmbed(pixelValues: Float64Array, n: number): Float64Array {
    const p = this.cfg.patch_size;
    const d = this.cfg.hidden_size;
    const proj = this.weight("vision_tower.patch_embed.proj.weight", [d, 3, p, p]);
    const flat: Tensor = { shape: [d, 3 * p * p], data: proj.data };
    return this.lin(pixelValues, n, flat, this.weight("vision_tower.patch_embed.proj.bias", [d]));
  }

  /** Pre-norm attention of one block with per-image (block-diagonal) bidirectional attention. */
  private attention(block: string, x: Float64Array, grids: readonly Grid[]): Float64Array {
    const d = this.cfg.hidden_size;
    const heads = this.cfg.num_attention_heads;
    const hd = d / heads;
    const n = x.length / d;
    const qkv = this.lin(x, n, this.weight(block + "wqkv.weight", [3 * d, d]), this.weight(block + "wqkv.bias", [3 * d]));
    // qkv row t: [Q (heads x hd) | K | V]
    const out = new Float64Array(n * d);
    const scale = 1 / Math.sqrt(hd);
    let start = 0;
    for (const [gh, gw] of grids) {
      const len = gh * gw;
      const angles = rope2dAngles(gh, gw, hd, this.ropeMode);
      for (let t = 0; t < len; t++) {
        for (let h = 0; h < heads; h++) {
          rope2dInPlace(qkv, (start + t) * 3 * d + h * hd, hd, angles, t * (hd / 2)); // Q
          rope2dInPlace(qkv, (start + t) * 3 * d + d + h * hd, hd, angles, t * (hd / 2)); // K
        }
      }
      if (this.bf16Attention) {
        for (let t = 0; t < len; t++) {
          const off = (start + t) * 3 * d;
          for (let i = 0; i < 3 * d; i++) qkv[off + i] = bf16RoundDaz(qkv[off + i]!);
        }
      }
      const scores = new Float64Array(len);
      for (let h = 0; h < heads; h++) {
        for (let s = 0; s < len; s++) {
          const qOff = (start + s) * 3 * d + h * hd;
          for (let t = 0; t < len; t++) { // every token of the same image, none of the others
            const kOff = (start + t) * 3 * d + d + h * hd;
            let dot = 0;
            for (let i = 0; i < hd; i++) dot += qkv[qOff + i]! * qkv[kOff + i]!;
            scores[t] = dot * scale;
          }
          if (this.bf16Attention) roundedProbabilities(scores);
          else softmaxInPlace(scores);
          const oOff = (start + s) * d + h * hd;
          for (let t = 0; t < len; t++) {
            const vOff = (start + t) * 3 * d + 2 * d + h * hd;
            for (let i = 0; i < hd; i++) out[oOff + i] = out[oOff + i]! + scores[t]! * qkv[vOff + i]!;
          }
        }
      }
      start += len;
    }
    return this.lin(out, n, this.weight(block + "wo.weight", [d, d]), this.weight(block + "wo.bias", [d]));
  }

  /** Final-LN patch features [sum gh*gw, D] before merging (spec §5.1-5.5). */
  tower(pixelValues: Float64Array, grids: readonly Grid[]): Float64Array {
    const c = this.cfg;
    const d = c.hidden_size;
    const n = this.checkInput(pixelValues, grids);
    const x = this.patchEmbed(pixelValues, n);
    const table = this.weight("vision_tower.patch_embed.pos_emb.weight", [c.init_pos_emb_height, c.init_pos_emb_width, d]);
    let row = 0;
    for (const [gh, gw] of grids) {
      const pos = resamplePosEmb(table, gh, gw); // row-major over the grid, like the patches
      for (let i = 0; i < pos.length; i++) x[row * d + i] = x[row * d + i]! + pos[i]!;
      row += gh * gw;
    }
    for (let b = 0; b < c.num_hidden_layers; b++) {
      const block = `vision_tower.encoder.blocks.${b}.`;
      const attn = this.attention(block, this.ln(x, n, block + "norm0"), grids);
      for (let i = 0; i < x.length; i++) x[i] = x[i]! + attn[i]!;
      const h = this.lin(this.ln(x, n, block + "norm1"), n, this.weight(block + "mlp.fc0.weight", [c.intermediate_size, d]),
        this.weight(block + "mlp.fc0.bias", [c.intermediate_size]));
      for (let i = 0; i < h.length; i++) h[i] = geluTanh(h[i]!);
      const mlp = this.lin(h, n, this.weight(block + "mlp.fc1.weight", [d, c.intermediate_size]), this.weight(block + "mlp.fc1.bias", [d]));
      for (let i = 0; i < x.length; i++) x[i] = x[i]! + mlp[i]!;
    }
    return this.ln(x, n, "vision_tower.encoder.final_layernorm");
  }

  /** merged [m, members, D] -> [m, text hidden]: LN per member, concat, linear, erf GELU, linear (spec §5.8). */
  project(merged: Float64Array, m: number): Float64Array {
    const d = this.cfg.hidden_size;
    const members = this.cfg.merge_kernel_size[0] * this.cfg.merge_kernel_size[1];
    const u = layerNorm(merged, m * members, this.weight("multi_modal_projector.pre_norm.weight", [d]),
      this.weight("multi_modal_projector.pre_norm.bias", [d]), LAYER_NORM_EPS);
    const wide = d * members;
    const h = this.lin(u, m, this.weight("multi_modal_projector.linear_1.weight", [wide, wide]),
      this.weight("multi_modal_projector.linear_1.bias", [wide]));
    for (let i = 0; i < h.length; i++) h[i] = geluErf(h[i]!);
    return this.lin(h, m, this.weight("multi_modal_projector.linear_2.weight", [this.textHidden, wide]),
      this.weight("multi_modal_projector.linear_2.bias", [this.textHidden]));
  }

  /** pixelValues [N, 3, p, p] of all images' patches, in order -> media embeddings [tokens, text hidden]. */
  encode(pixelValues: Float64Array, grids: readonly Grid[]): Float64Array {
    const d = this.cfg.hidden_size;
    const kernel = this.cfg.merge_kernel_size;
    const features = this.tower(pixelValues, grids);
    const parts: Float64Array[] = [];
    let start = 0;
    for (const grid of grids) {
      const len = grid[0] * grid[1];
      const merged = mergePatches(features.subarray(start * d, (start + len) * d), grid, kernel, d);
      parts.push(this.project(merged, len / (kernel[0] * kernel[1])));
      start += len;
    }
    const out = new Float64Array(parts.reduce((a, p) => a + p.length, 0));
    let o = 0;
    for (const p of parts) {
      out.set(p, o);
      o += p.length;
    }
    return out;
  }

  private checkInput(pixelValues: Float64Array, grids: readonly Grid[]): number {
    const p = this.cfg.patch_size;
    const [kh, kw] = this.cfg.merge_kernel_size;
    const n = grids.reduce((a, [gh, gw]) => a + gh * gw, 0);
    if (pixelValues.length !== n * 3 * p * p) {
      throw new Error(`pixel values hold ${pixelValues.length / (3 * p * p)} patches but the grids need ${n}`);
    }
    for (const [gh, gw] of grids) {
      if (gh % kh || gw % kw) throw new Error(`grid ${gh}x${gw} is not a multiple of the merge kernel ${kh}x${kw}`);
    }
    return n;
  }
}
