/**
 * text.ts — the float64 reference of the Kimi-VL text decoder (DeepSeek-V3 style), written from
 * /work/shared/kimi-vl-spec.md §4.
 *
 * Owns: embeddings with media rows replacing <|media_pad|> positions in order, RMSNorm, MLA with
 * q_lora_rank null in its naive (not absorbed) form, RoPE in the official de-interleaved layout,
 * dense SwiGLU, the sigmoid noaux_tc router (correction bias for selection only, group-limited
 * selection, norm_topk_prob, routed_scaling_factor), shared experts, final norm, lm_head; a
 * full-prefix forward returning logits for every position and a greedy loop that recomputes the
 * whole prefix each step. Optionally the routed experts' Q8 or Q4 round trip (the runtime's storage).
 * Does not own: caching, batching, or anything of the runtime — it imports nothing from host/,
 * packer/ or wasm-core/, so a bug there cannot leak into the oracle.
 */
import { isQ8TrunkWeight, loadConfig, loadTensors, need, q8RoundtripRows, ROUTED_EXPERT_WEIGHT } from "./checkpoint.js";
import { argmax, linear, rmsNorm, sigmoid, silu, softmaxInPlace, type Tensor, topkIndices } from "./math.js";

const PREFIX = "language_model.";
/** The official module builds kv_a_layernorm without passing rms_norm_eps: class default 1e-6 (spec §4.2). */
export const KV_A_LAYERNORM_EPS = 1e-6;

export interface TextConfig {
  vocab_size: number;
  hidden_size: number;
  intermediate_size: number;
  moe_intermediate_size: number;
  num_hidden_layers: number;
  num_attention_heads: number;
  n_routed_experts: number;
  n_shared_experts: number;
  num_experts_per_tok: number;
  first_k_dense_replace: number;
  n_group: number;
  topk_group: number;
  norm_topk_prob: boolean;
  routed_scaling_factor: number;
  kv_lora_rank: number;
  qk_nope_head_dim: number;
  qk_rope_head_dim: number;
  v_head_dim: number;
  rope_theta: number;
  rms_norm_eps: number;
}

export interface TextOptions {
  /** Replace every routed expert matrix by its row-wise Q8 round trip (docs/FORMAT.md). */
  q8Experts?: boolean;
  /** Replace every routed expert matrix by its 4-bit group round trip, q * ds (docs/FORMAT.md
   * "Q4_EXPERT extents"), as `kvl pack --expert-dtype q4` stores them. Not with q8Experts. The
   * integer modes round their inputs as for Q8 experts (intInputs). */
  q4Experts?: boolean;
  /** Replace every trunk Linear weight (attention projections, dense and shared MLPs, lm_head;
   * not the embedding, norms or router) by its row-wise Q8 round trip, as `kvl pack
   * --trunk-dtype q8` stores them (docs/FORMAT.md "Q8_ROWS"). */
  q8Trunk?: boolean;
  /**
   * How RoPE angles are formed. "f32" (default): inv_freq = 1/theta^(2j/d) and angle = t*inv_freq
   * rounded to FP32 as the official code computes them (spec §4.5: the FP32 angle drifts from the
   * exact one by up to 7.6e-3 rad at long context, and that drift is part of the model's
   * behaviour); cos/sin are then evaluated in float64. "f64": the exact angles.
   */
  ropeAngles?: "f32" | "f64";
  /**
   * The inputs of every Linear the runtime runs as an integer product quantised by `--act-dtype
   * i16x1`'s or `i8`'s rule (README "Numerics", the core's kernels.h quantize_i16_act): where the
   * weight is Q8 or Q4 (the routed experts; with q8Trunk the trunk's too) one 16-bit term per I16_BLOCK
   * columns (i8: the routed experts' inputs one 8-bit term, I8_MAX);
   * where it is a BF16 trunk weight (converted to int16 rows, all resident) one 15-bit term per
   * vector. Not kv_b_proj (attention applies it to FP32 values; with q8Trunk W_uv takes the
   * quantised context, below) or the router. And attention's
   * two products as the runtime runs them in prefill and decode (the core's model.c attn_i16,
   * over its int16 KV cache): the cached rows [latent | roped key] quantised per row (ATTN_I16_ROW_MAX), the absorbed queries [W_uk^T q_nope
   * | roped q] per vector (I16_MAX), and the probabilities times their rows' scales per vector
   * and tile of ATTN_I16_TILE positions (I16_MAX). The weights stay exact: this measures what the
   * input rounding alone moves, in float64.
   */
  intInputs?: "i16x1" | "i8";
}

/** The core's kernels.h: KVL_I16_BLOCK, KVL_I16_Q8_MAX (Q8 weights), KVL_I16_MAX (int16 weights). */
export const I16_BLOCK = 64;
export const I16_Q8_MAX = 32767;
/** kernels.h KVL_I8_MAX: the Q8 products' activation range with --act-dtype i8. */
export const I8_MAX = 127;
export const I16_MAX = 16383;
/** The core's model.c ATTN_I16_TILE and ATTN_I16_ROW_MAX (attention on integers, i16 KV cache). */
export const ATTN_I16_TILE = 128;
export const ATTN_I16_ROW_MAX = 32767;

/** rint: to nearest, ties to even (C's rintf in the default rounding mode). */
function rintEven(v: number): number {
  const r = Math.round(v);
  return r - v === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/**
 * x [rows, cols] quantised as the core's quantize_i16_act does it: the FP32 inputs, per block of
 * `block` columns amax = max|x|, inv = fl(lim / amax), q = clamp(rint(fl(x * inv)), -lim, lim),
 * scale fl(amax / lim) (fl: rounded to FP32). The integers q [rows, cols] and the scales
 * [rows, ceil(cols / block)].
 */
export function quantizeI16Parts(x: Float64Array, rows: number, cols: number, block: number, lim: number): { q: Float64Array; scales: Float64Array } {
  const f = Math.fround;
  const nb = Math.ceil(cols / block);
  const q = new Float64Array(rows * cols);
  const scales = new Float64Array(rows * nb);
  for (let r = 0; r < rows; r++) {
    for (let b = 0; b < nb; b++) {
      const c0 = b * block;
      const c1 = Math.min(cols, c0 + block);
      let amax = 0;
      for (let c = c0; c < c1; c++) amax = Math.max(amax, Math.abs(f(x[r * cols + c]!)));
      const inv = amax > 0 ? f(lim / amax) : 0;
      scales[r * nb + b] = f(amax / lim);
      for (let c = c0; c < c1; c++) q[r * cols + c] = Math.min(lim, Math.max(-lim, rintEven(f(f(x[r * cols + c]!) * inv))));
    }
  }
  return { q, scales };
}

/** x [rows, cols] as the core's quantize_i16_act leaves it, back in float64 (q * scale). */
export function quantizeI16Blocks(x: Float64Array, rows: number, cols: number, block: number, lim: number): Float64Array {
  const { q, scales } = quantizeI16Parts(x, rows, cols, block, lim);
  const nb = Math.ceil(cols / block);
  const out = new Float64Array(x.length);
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) out[r * cols + c] = q[r * cols + c]! * scales[r * nb + Math.floor(c / block)]!;
  return out;
}

function num(obj: Record<string, unknown>, key: string, fallback?: number): number {
  const v = obj[key] ?? fallback;
  if (typeof v !== "number") throw new Error(`text_config.${key} must be a number, got ${JSON.stringify(v)}`);
  return v;
}

export function parseTextConfig(config: Record<string, unknown>): TextConfig {
  const c = (config.text_config ?? config) as Record<string, unknown>;
  if (c.q_lora_rank !== null && c.q_lora_rank !== undefined) {
    throw new Error("reference supports q_lora_rank = null only (plain q_proj), as in Kimi-VL");
  }
  if (c.rope_scaling !== null && c.rope_scaling !== undefined) {
    throw new Error("reference supports rope_scaling = null only (no YaRN), as in Kimi-VL");
  }
  return {
    vocab_size: num(c, "vocab_size"),
    hidden_size: num(c, "hidden_size"),
    intermediate_size: num(c, "intermediate_size"),
    moe_intermediate_size: num(c, "moe_intermediate_size"),
    num_hidden_layers: num(c, "num_hidden_layers"),
    num_attention_heads: num(c, "num_attention_heads"),
    n_routed_experts: num(c, "n_routed_experts"),
    n_shared_experts: num(c, "n_shared_experts", 0),
    num_experts_per_tok: num(c, "num_experts_per_tok"),
    first_k_dense_replace: num(c, "first_k_dense_replace", 0),
    n_group: (c.n_group as number | null | undefined) ?? 1,
    topk_group: (c.topk_group as number | null | undefined) ?? 1,
    norm_topk_prob: c.norm_topk_prob === true,
    routed_scaling_factor: num(c, "routed_scaling_factor", 1),
    kv_lora_rank: num(c, "kv_lora_rank"),
    qk_nope_head_dim: num(c, "qk_nope_head_dim"),
    qk_rope_head_dim: num(c, "qk_rope_head_dim"),
    v_head_dim: num(c, "v_head_dim"),
    rope_theta: num(c, "rope_theta"),
    rms_norm_eps: num(c, "rms_norm_eps"),
  };
}

/** RoPE angle of (position t, frequency j) for a rotary dimension d, as TextOptions.ropeAngles. */
export function ropeAngle(t: number, j: number, d: number, theta: number, mode: "f32" | "f64"): number {
  if (mode === "f64") return t * theta ** (-(2 * j) / d);
  const invFreq = Math.fround(1 / Math.fround(theta ** Math.fround((2 * j) / d)));
  return Math.fround(t * invFreq);
}

/**
 * Spec §4.5, the official layout: the rope vector x (d values at x[off..off+d)) is de-interleaved
 * to [x0, x2, ..., x1, x3, ...] and rotated half-wise with cat(angles, angles):
 *   out[j] = x[2j] cos - x[2j+1] sin,  out[d/2 + j] = x[2j+1] cos + x[2j] sin.
 * Writes the result to out[outOff..outOff+d).
 */
export function ropeOfficialLayout(x: Float64Array, off: number, d: number, t: number, theta: number,
  mode: "f32" | "f64", out: Float64Array, outOff: number): void {
  const half = d / 2;
  for (let j = 0; j < half; j++) {
    const a = ropeAngle(t, j, d, theta, mode);
    const c = Math.cos(a);
    const s = Math.sin(a);
    const even = x[off + 2 * j]!;
    const odd = x[off + 2 * j + 1]!;
    out[outOff + j] = even * c - odd * s;
    out[outOff + half + j] = odd * c + even * s;
  }
}

export interface Routing {
  /** [rows, k] chosen experts, in the order of their biased score (largest first). */
  indices: Int32Array;
  /** [rows, k] weights: unbiased sigmoid scores, normalised, times routed_scaling_factor. */
  weights: Float64Array;
}

export class TextReference {
  readonly cfg: TextConfig;
  readonly mediaTokenId: number | undefined;
  private readonly ropeMode: "f32" | "f64";
  /** How the input of a Linear weight (name without the language_model. prefix) is quantised:
   * null for exact inputs. */
  private readonly inputRule: (name: string, cols: number) => { block: number; lim: number } | null;
  /** intInputs: attention's products quantised as the runtime runs them (attentionInt). */
  private readonly intAttention: boolean;
  /** intInputs with q8Trunk: W_uv's input (the context) quantised as any Q8 product's is. */
  private readonly intWuv: boolean;

  private constructor(cfg: TextConfig, mediaTokenId: number | undefined,
    private readonly w: Map<string, Tensor>, options: TextOptions) {
    this.cfg = cfg;
    this.mediaTokenId = mediaTokenId;
    this.ropeMode = options.ropeAngles ?? "f32";
    this.intAttention = options.intInputs !== undefined;
    const q8Trunk = options.q8Trunk === true;
    this.intWuv = this.intAttention && q8Trunk;
    this.inputRule = options.intInputs === undefined ? () => null : (name, cols) => {
      if (ROUTED_EXPERT_WEIGHT.test(name)) return { block: I16_BLOCK, lim: options.intInputs === "i8" ? I8_MAX : I16_Q8_MAX };
      if (name.endsWith(".kv_b_proj.weight") || !isQ8TrunkWeight(PREFIX + name)) return null; // the trunk's Linear weights
      return q8Trunk ? { block: I16_BLOCK, lim: I16_Q8_MAX } : { block: cols, lim: I16_MAX };
    };
  }

  static load(dir: string, options: TextOptions = {}): TextReference {
    return TextReference.fromTensors(loadConfig(dir), loadTensors(dir, PREFIX, {
      q8Experts: options.q8Experts === true, q4Experts: options.q4Experts === true, q8Trunk: options.q8Trunk === true,
    }), options);
  }

  /**
   * From a parsed config.json and checkpoint-named tensors (`language_model.` prefix; others are
   * ignored) — for hand-built cases. q8Experts, q4Experts and q8Trunk are applied by load() only.
   */
  static fromTensors(config: Record<string, unknown>, tensors: Map<string, Tensor>, options: TextOptions = {}): TextReference {
    const cfg = parseTextConfig(config);
    const w = new Map<string, Tensor>();
    for (const [name, t] of tensors) if (name.startsWith(PREFIX)) w.set(name.slice(PREFIX.length), t);
    const media = config.media_placeholder_token_id;
    return new TextReference(cfg, typeof media === "number" ? media : undefined, w, options);
  }

  /** The same weights with every routed expert matrix replaced by its Q8 round trip. */
  withQ8Experts(): TextReference {
    const w = new Map<string, Tensor>();
    for (const [name, t] of this.w) w.set(name, ROUTED_EXPERT_WEIGHT.test(name) ? q8RoundtripRows(t) : t);
    return new TextReference(this.cfg, this.mediaTokenId, w, { ropeAngles: this.ropeMode });
  }

  weight(name: string, shape?: readonly number[]): Tensor {
    return need(this.w, name, shape);
  }

  /** linear() with the weight `name` [out, in], its input quantised where intInputs says so. */
  private linearOf(x: Float64Array, n: number, name: string, shape: readonly number[]): Float64Array {
    const rule = this.inputRule(name, shape[1]!);
    const input = rule ? quantizeI16Blocks(x, n, shape[1]!, rule.block, rule.lim) : x;
    return linear(input, n, this.weight(name, shape));
  }

  // -- blocks -----------------------------------------------------------------------------------

  /** The MLA dimensions of the config (spec §4.4). */
  private mlaDims(): { heads: number; nope: number; rope: number; vDim: number; latent: number; qk: number } {
    const c = this.cfg;
    const nope = c.qk_nope_head_dim;
    const rope = c.qk_rope_head_dim;
    return { heads: c.num_attention_heads, nope, rope, vDim: c.v_head_dim, latent: c.kv_lora_rank, qk: nope + rope };
  }

  /** Naive MLA (spec §4.4) over n rows of normalised input x [n, H], causal, positions 0..n-1. */
  private attention(layer: number, x: Float64Array, n: number): Float64Array {
    const c = this.cfg;
    const p = `model.layers.${layer}.self_attn.`;
    const H = c.hidden_size;
    const { heads, nope, rope, vDim, latent, qk } = this.mlaDims();

    const q = this.linearOf(x, n, p + "q_proj.weight", [heads * qk, H]); // [n, heads, nope+rope]
    const a = this.linearOf(x, n, p + "kv_a_proj_with_mqa.weight", [latent + rope, H]); // [n, latent+rope]
    const cRaw = new Float64Array(n * latent);
    for (let t = 0; t < n; t++) cRaw.set(a.subarray(t * (latent + rope), t * (latent + rope) + latent), t * latent);
    const cKv = rmsNorm(cRaw, n, this.weight(p + "kv_a_layernorm.weight", [latent]), KV_A_LAYERNORM_EPS);

    // RoPE'd rope parts: per head for q, one shared vector per position for k.
    const qRope = new Float64Array(n * heads * rope);
    const kRope = new Float64Array(n * rope);
    for (let t = 0; t < n; t++) {
      for (let h = 0; h < heads; h++) {
        ropeOfficialLayout(q, (t * heads + h) * qk + nope, rope, t, c.rope_theta, this.ropeMode, qRope, (t * heads + h) * rope);
      }
      ropeOfficialLayout(a, t * (latent + rope) + latent, rope, t, c.rope_theta, this.ropeMode, kRope, t * rope);
    }

    const out = this.intAttention ? this.attentionInt(layer, q, cKv, qRope, kRope, n) : this.attentionExact(layer, q, cKv, qRope, kRope, n);
    return this.linearOf(out, n, p + "o_proj.weight", [H, heads * vDim]);
  }

  /** attention()'s scores, softmax and values in float64, keys and values expanded per head
   * through kv_b_proj. Returns [n, heads * v] (input index h*v + d of o_proj). */
  private attentionExact(layer: number, q: Float64Array, cKv: Float64Array, qRope: Float64Array, kRope: Float64Array, n: number): Float64Array {
    const { heads, nope, rope, vDim, latent, qk } = this.mlaDims();
    const kv = linear(cKv, n, this.weight(`model.layers.${layer}.self_attn.kv_b_proj.weight`, [heads * (nope + vDim), latent])); // [n, heads, nope+v]
    const scale = 1 / Math.sqrt(qk);
    const out = new Float64Array(n * heads * vDim);
    const scores = new Float64Array(n);
    for (let h = 0; h < heads; h++) {
      for (let s = 0; s < n; s++) {
        const qOff = (s * heads + h) * qk;
        const qrOff = (s * heads + h) * rope;
        for (let t = 0; t <= s; t++) { // causal: keys t <= s only
          const kOff = (t * heads + h) * (nope + vDim);
          let dot = 0;
          for (let i = 0; i < nope; i++) dot += q[qOff + i]! * kv[kOff + i]!;
          for (let i = 0; i < rope; i++) dot += qRope[qrOff + i]! * kRope[t * rope + i]!;
          scores[t] = dot * scale;
        }
        softmaxInPlace(scores, 0, s + 1);
        const oOff = (s * heads + h) * vDim;
        for (let t = 0; t <= s; t++) {
          const vOff = (t * heads + h) * (nope + vDim) + nope;
          const pr = scores[t]!;
          for (let i = 0; i < vDim; i++) out[oOff + i] = out[oOff + i]! + pr * kv[vOff + i]!;
        }
      }
    }
    return out;
  }

  /**
   * The attention of n positions 0..n-1 in the absorbed form, on the integers the runtime uses
   * with `--act-dtype i16x1` (the core's model.c attn_block_i16; TextOptions.intInputs):
   * score(s, t) = Q(W_uk^T q_nope | q_rope)_s . Q_row(c_kv | k_rope)_t / sqrt(qk); the context
   * sum_t Q_tile(p_t * rowscale_t) * int_row_t over tiles of ATTN_I16_TILE positions; out = W_uv
   * context (with q8Trunk the context quantised per I16_BLOCK columns first, as the runtime's Q8
   * products quantise their inputs: model.c attn_wuv_int). Returns [n, heads * v] like attention()'s.
   */
  private attentionInt(layer: number, q: Float64Array, cKv: Float64Array, qRope: Float64Array, kRope: Float64Array, n: number): Float64Array {
    const { heads, nope, rope, vDim, latent: lat, qk } = this.mlaDims();
    const row = lat + rope;
    const kvb = this.weight(`model.layers.${layer}.self_attn.kv_b_proj.weight`, [heads * (nope + vDim), lat]).data;
    const keys = new Float64Array(n * row);
    for (let t = 0; t < n; t++) {
      keys.set(cKv.subarray(t * lat, (t + 1) * lat), t * row);
      keys.set(kRope.subarray(t * rope, (t + 1) * rope), t * row + lat);
    }
    const K = quantizeI16Parts(keys, n, row, row, ATTN_I16_ROW_MAX);
    const scale = 1 / Math.sqrt(qk);
    const out = new Float64Array(n * heads * vDim);
    const query = new Float64Array(row);
    const probs = new Float64Array(n);
    const context = new Float64Array(lat);
    for (let h = 0; h < heads; h++) {
      const base = h * (nope + vDim) * lat; // W_uk: rows base + d*lat, W_uv: rows after them
      for (let s = 0; s < n; s++) {
        query.fill(0);
        for (let d = 0; d < nope; d++) {
          const qd = q[(s * heads + h) * qk + d]!;
          for (let i = 0; i < lat; i++) query[i] = query[i]! + qd * kvb[base + d * lat + i]!;
        }
        query.set(qRope.subarray((s * heads + h) * rope, (s * heads + h + 1) * rope), lat);
        const Q = quantizeI16Parts(query, 1, row, row, I16_MAX);
        for (let t = 0; t <= s; t++) {
          let dot = 0;
          for (let i = 0; i < row; i++) dot += Q.q[i]! * K.q[t * row + i]!;
          probs[t] = dot * K.scales[t]! * Q.scales[0]! * scale;
        }
        softmaxInPlace(probs, 0, s + 1);
        for (let t = 0; t <= s; t++) probs[t] = probs[t]! * K.scales[t]!;
        context.fill(0);
        for (let t0 = 0; t0 <= s; t0 += ATTN_I16_TILE) {
          const w = Math.min(ATTN_I16_TILE, s + 1 - t0);
          const A = quantizeI16Parts(probs.subarray(t0, t0 + w), 1, w, w, I16_MAX);
          for (let t = 0; t < w; t++) {
            const a = A.q[t]! * A.scales[0]!;
            for (let i = 0; i < lat; i++) context[i] = context[i]! + a * K.q[(t0 + t) * row + i]!;
          }
        }
        const o = (s * heads + h) * vDim;
        const c = this.intWuv ? quantizeI16Blocks(context, 1, lat, I16_BLOCK, I16_Q8_MAX) : context;
        for (let d = 0; d < vDim; d++) {
          let sum = 0;
          for (let i = 0; i < lat; i++) sum += kvb[base + (nope + d) * lat + i]! * c[i]!;
          out[o + d] = sum;
        }
      }
    }
    return out;
  }

  /** y = W_down (SiLU(W_gate x) * (W_up x)) (spec §4.7). */
  private swiglu(x: Float64Array, n: number, prefix: string, width: number): Float64Array {
    const H = this.cfg.hidden_size;
    const g = this.linearOf(x, n, prefix + "gate_proj.weight", [width, H]);
    const u = this.linearOf(x, n, prefix + "up_proj.weight", [width, H]);
    for (let i = 0; i < g.length; i++) g[i] = silu(g[i]!) * u[i]!;
    return this.linearOf(g, n, prefix + "down_proj.weight", [H, width]);
  }

  /**
   * Spec §4.8 for every row of x [n, H]. `groups` overrides the config's n_group/topk_group (to
   * show that group-limited selection changes choices).
   */
  route(layer: number, x: Float64Array, n: number,
    groups: { nGroup: number; topkGroup: number } = { nGroup: this.cfg.n_group, topkGroup: this.cfg.topk_group }): Routing {
    const c = this.cfg;
    const p = `model.layers.${layer}.mlp.gate.`;
    const E = c.n_routed_experts;
    const k = c.num_experts_per_tok;
    const nGroup = groups.nGroup;
    const perGroup = E / nGroup;
    if (!Number.isInteger(perGroup)) throw new Error(`n_routed_experts ${E} is not divisible by n_group ${nGroup}`);
    const logits = linear(x, n, this.weight(p + "weight", [E, c.hidden_size]));
    const bias = this.weight(p + "e_score_correction_bias", [E]).data;
    const indices = new Int32Array(n * k);
    const weights = new Float64Array(n * k);
    for (let r = 0; r < n; r++) {
      const scores = Array.from({ length: E }, (_, e) => sigmoid(logits[r * E + e]!));
      const biased = scores.map((s, e) => s + bias[e]!); // the bias only chooses, never weighs
      // Group-limited selection: a group's score is the sum of its top-2 biased scores; experts
      // outside the topk_group best groups are set to 0.0 — not -inf — as the official MoEGate
      // and transformers do, so a masked expert can still beat negative biased scores.
      const groupScore = Array.from({ length: nGroup }, (_, g) => {
        const members = biased.slice(g * perGroup, (g + 1) * perGroup);
        return topkIndices(members, Math.min(2, perGroup)).reduce((acc, i) => acc + members[i]!, 0);
      });
      const kept = new Set(topkIndices(groupScore, groups.topkGroup));
      const masked = biased.map((b, e) => (kept.has(Math.floor(e / perGroup)) ? b : 0.0));
      const chosen = topkIndices(masked, k);
      let sum = 0;
      for (const e of chosen) sum += scores[e]!;
      // The official gate normalises only when top_k > 1 as well (transformers: norm_topk_prob only).
      const norm = c.norm_topk_prob && k > 1 ? sum + 1e-20 : 1;
      chosen.forEach((e, slot) => {
        indices[r * k + slot] = e;
        weights[r * k + slot] = (scores[e]! / norm) * c.routed_scaling_factor;
      });
    }
    return { indices, weights };
  }

  private moe(layer: number, x: Float64Array, n: number): Float64Array {
    const c = this.cfg;
    const H = c.hidden_size;
    const p = `model.layers.${layer}.mlp.`;
    const { indices, weights } = this.route(layer, x, n);
    const k = c.num_experts_per_tok;
    const out = this.swiglu(x, n, p + "shared_experts.", c.n_shared_experts * c.moe_intermediate_size);
    for (let r = 0; r < n; r++) {
      const row = x.subarray(r * H, (r + 1) * H);
      for (let slot = 0; slot < k; slot++) {
        const e = indices[r * k + slot]!;
        const y = this.swiglu(row, 1, `${p}experts.${e}.`, c.moe_intermediate_size);
        const wgt = weights[r * k + slot]!;
        for (let i = 0; i < H; i++) out[r * H + i] = out[r * H + i]! + wgt * y[i]!;
      }
    }
    return out;
  }

  private ffn(layer: number, x: Float64Array, n: number): Float64Array {
    if (layer < this.cfg.first_k_dense_replace) {
      return this.swiglu(x, n, `model.layers.${layer}.mlp.`, this.cfg.intermediate_size);
    }
    return this.moe(layer, x, n);
  }

  // -- public API -------------------------------------------------------------------------------

  /**
   * Input embeddings [n, H] (spec §4.1): embed_tokens rows, with the rows of `media` ([m, H],
   * row-major) replacing the <|media_pad|> positions in order; m must equal their count.
   */
  embed(ids: readonly number[], media?: Float64Array): Float64Array {
    const H = this.cfg.hidden_size;
    const table = this.weight("model.embed_tokens.weight", [this.cfg.vocab_size, H]);
    const x = new Float64Array(ids.length * H);
    const mediaRows = ids.flatMap((id, i) => (id === this.mediaTokenId ? [i] : []));
    const nMedia = media ? media.length / H : 0;
    if (!Number.isInteger(nMedia)) throw new Error(`media embeddings: ${media!.length} values is not a multiple of ${H}`);
    if (nMedia !== mediaRows.length) {
      throw new Error(`${mediaRows.length} media placeholder tokens but ${nMedia} media embedding rows`);
    }
    ids.forEach((id, i) => {
      if (!Number.isInteger(id) || id < 0 || id >= this.cfg.vocab_size) throw new Error(`token id ${id} outside the vocabulary`);
      x.set(table.data.subarray(id * H, (id + 1) * H), i * H);
    });
    mediaRows.forEach((pos, j) => x.set(media!.subarray(j * H, (j + 1) * H), pos * H));
    return x;
  }

  /** Final-norm hidden states [n, H] for every position of the prompt. */
  hiddenStates(ids: readonly number[], media?: Float64Array): Float64Array {
    const c = this.cfg;
    const H = c.hidden_size;
    const n = ids.length;
    const eps = c.rms_norm_eps;
    const x = this.embed(ids, media);
    for (let layer = 0; layer < c.num_hidden_layers; layer++) {
      const p = `model.layers.${layer}.`;
      const attn = this.attention(layer, rmsNorm(x, n, this.weight(p + "input_layernorm.weight", [H]), eps), n);
      for (let i = 0; i < x.length; i++) x[i] = x[i]! + attn[i]!;
      const ffn = this.ffn(layer, rmsNorm(x, n, this.weight(p + "post_attention_layernorm.weight", [H]), eps), n);
      for (let i = 0; i < x.length; i++) x[i] = x[i]! + ffn[i]!;
    }
    return rmsNorm(x, n, this.weight("model.norm.weight", [H]), eps);
  }

  /** lm_head over final-norm hidden states [n, H] -> logits [n, vocab]. */
  logitsFromHidden(hidden: Float64Array, n: number): Float64Array {
    return this.linearOf(hidden, n, "lm_head.weight", [this.cfg.vocab_size, this.cfg.hidden_size]);
  }

  /** Logits [n, vocab] for every position. */
  logits(ids: readonly number[], media?: Float64Array): Float64Array {
    return this.logitsFromHidden(this.hiddenStates(ids, media), ids.length);
  }

  /** nNew argmax tokens (no stop ids); the whole prefix is recomputed each step. */
  greedy(ids: readonly number[], nNew: number, media?: Float64Array): number[] {
    const H = this.cfg.hidden_size;
    const seq = [...ids];
    const out: number[] = [];
    for (let step = 0; step < nNew; step++) {
      const hidden = this.hiddenStates(seq, media);
      const last = this.logitsFromHidden(hidden.subarray((seq.length - 1) * H), 1);
      const token = argmax(last);
      seq.push(token);
      out.push(token);
    }
    return out;
  }
}
