/**
 * model-spec.ts — config.json -> typed model dimensions, the expected tensor inventory,
 * validation messages (values spelt as JSON spells them), and the pack's hparam table.
 *
 * Owns: reading the Kimi-VL config (text_config = DeepSeek-V3 decoder, vision_config =
 * MoonViT), deriving every tensor name/dtype/shape of the official checkpoint layout from those
 * dims, checking a tensor inventory against it, listing config features the runtime cannot run
 * exactly, and the hparams of docs/FORMAT.md ("hparam keys").
 * Does not own: reading files (packer/safetensors.ts), packing (packer/pack.ts), the math (core).
 *
 * Nothing here is model-size specific: every dimension comes from the config. The only fixed
 * facts are the ones the official code hard-codes rather than stores in config.json.
 * config.json is parsed with JSON.parse (json-file.ts), which has one number type: an integer field
 * takes any integral number (`2048.0` is 2048), a number field any number; a boolean is neither.
 */
import { type JsonObject, isJsonObject, jsonText } from "../system/json-file.js";
import { UserError } from "../system/user-error.js";

// Fixed by the official modelling code, not present in config.json.
const KV_A_LAYERNORM_EPS = 1e-6; // DeepseekV3RMSNorm built without rms_norm_eps -> class default
const VISION_ROPE_THETA = 10000.0;
const VISION_LAYER_NORM_EPS = 1e-5;

const DTYPE = "BF16";
export const ROUTER_BIAS_SUFFIX = "mlp.gate.e_score_correction_bias";
const ROUTER_BIAS_DTYPES: readonly string[] = ["BF16", "F32"];

const TEXT_PREFIX = "language_model.model.";
export const LM_HEAD = "language_model.lm_head.weight";
/** The trunk's Linear weights that `kvl pack --trunk-dtype q8` stores as row-wise Q8 (Q8_ROWS):
 * attention projections, the dense layer-0 MLP, the shared experts and lm_head. Not the
 * embedding (read row by row), the norms, nor the MoE router and its bias (the checkpoint's code
 * runs the router in FP32; it decides which experts run). */
const TRUNK_LINEAR_RE =
  /^language_model\.(?:lm_head\.weight|model\.layers\.\d+\.(?:self_attn\.(?:q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|mlp\.(?:shared_experts\.)?(?:gate_proj|up_proj|down_proj))\.weight)$/;

export function isTrunkLinear(name: string): boolean {
  return TRUNK_LINEAR_RE.test(name);
}

/** text_config, field names as in config.json (and the hparam keys). */
interface TextDims {
  readonly vocab_size: number;
  readonly hidden_size: number;
  readonly intermediate_size: number;
  readonly moe_intermediate_size: number;
  readonly num_hidden_layers: number;
  readonly num_attention_heads: number;
  readonly n_routed_experts: number;
  readonly n_shared_experts: number;
  readonly num_experts_per_tok: number;
  readonly first_k_dense_replace: number;
  readonly moe_layer_freq: number;
  readonly kv_lora_rank: number;
  readonly q_lora_rank: number | null;
  readonly qk_nope_head_dim: number;
  readonly qk_rope_head_dim: number;
  readonly v_head_dim: number;
  readonly routed_scaling_factor: number;
  readonly n_group: number;
  readonly topk_group: number;
  readonly norm_topk_prob: boolean;
  readonly rope_theta: number;
  readonly rms_norm_eps: number;
  readonly max_position_embeddings: number;
  readonly kv_a_layernorm_eps: number;
  /** qk_nope_head_dim + qk_rope_head_dim */
  readonly q_head_dim: number;
}

interface VisionDims {
  readonly hidden_size: number;
  readonly num_hidden_layers: number;
  readonly num_attention_heads: number;
  readonly intermediate_size: number;
  readonly patch_size: number;
  readonly init_pos_emb_height: number;
  readonly init_pos_emb_width: number;
  readonly merge_kernel_h: number;
  readonly merge_kernel_w: number;
  readonly rope_theta: number;
  readonly layer_norm_eps: number;
  /** hidden_size / num_attention_heads (floor) */
  readonly head_dim: number;
  /** hidden_size * merge_kernel_h * merge_kernel_w: the projector's input width */
  readonly projector_width: number;
}

interface ModelDims {
  readonly text: TextDims;
  readonly vision: VisionDims;
  readonly media_placeholder_token_id: number;
}

/** One tensor of a checkpoint: safetensors dtype string ("BF16", "F32", ...) and shape. */
export interface TensorInfo {
  readonly dtype: string;
  readonly shape: readonly number[];
}

/** name -> dtype/shape, in checkpoint order. */
export type Inventory = Map<string, TensorInfo>;

/** What checkSource needs of a tensor source (packer/tensor-source.ts's TensorSource has it). */
export interface InventoryView {
  config(): unknown;
  tensorNames(): string[];
  tensorInfo(name: string): TensorInfo;
}

/** Same rule as the official DeepseekV3DecoderLayer. */
function isMoeLayer(t: TextDims, layer: number): boolean {
  return t.n_routed_experts > 0 && layer >= t.first_k_dense_replace && layer % t.moe_layer_freq === 0;
}

function section(config: unknown, key: string): JsonObject {
  if (!isJsonObject(config)) throw new UserError("config.json is not a JSON object; re-download config.json");
  const value = config[key];
  if (!isJsonObject(value)) {
    throw new UserError(`config.json has no '${key}' object; this is not a Kimi-VL config ` +
      "(re-download config.json from the model repository)");
  }
  return value;
}

type Kind = "int" | "float" | "bool" | "list";
const KIND_WORDS: Readonly<Record<Kind, string>> = { int: "an integer", float: "a number", bool: "true or false", list: "a list" };

function get(sec: JsonObject, where: string, key: string, kind: "int" | "float"): number;
function get(sec: JsonObject, where: string, key: string, kind: "bool"): boolean;
function get(sec: JsonObject, where: string, key: string, kind: "list"): unknown[];
function get(sec: JsonObject, where: string, key: string, kind: Kind): unknown {
  if (!Object.prototype.hasOwnProperty.call(sec, key)) {
    throw new UserError(`config.json: ${where}.${key} is missing; re-download config.json`);
  }
  const value = sec[key];
  const ok =
    kind === "float" ? typeof value === "number"
      : kind === "int" ? isInt(value)
        : kind === "bool" ? typeof value === "boolean"
          : Array.isArray(value);
  if (!ok) {
    throw new UserError(`config.json: ${where}.${key} = ${jsonText(value)} is not ${KIND_WORDS[kind]}; ` +
      "fix or re-download config.json");
  }
  return value;
}

function positive(where: string, key: string, value: number): number {
  if (value <= 0) throw new UserError(`config.json: ${where}.${key} = ${value} must be positive`);
  return value;
}

function isInt(value: unknown): value is number {
  return typeof value === "number" && Number.isInteger(value);
}

/** The member's value when present (null too), else the fallback. */
function valueOr(sec: JsonObject, key: string, fallback: unknown): unknown {
  return Object.hasOwn(sec, key) ? sec[key] : fallback;
}

/** A member that is true or false where present (absent or null: false); anything else is a
 * problem, added to `problems`. */
function flag(sec: JsonObject, where: string, key: string, problems: string[]): boolean {
  const value = valueOr(sec, key, null);
  if (value === null || typeof value === "boolean") return value === true;
  problems.push(`config.json: ${where}${key} = ${jsonText(value)} is not true or false; fix or re-download config.json`);
  return false;
}

export function textDims(config: unknown): TextDims {
  const t = section(config, "text_config");
  const w = "text_config";
  const pos = (key: string): number => positive(w, key, get(t, w, key, "int"));
  const qLora = valueOr(t, "q_lora_rank", null);
  if (qLora !== null && !isInt(qLora)) {
    throw new UserError(`config.json: text_config.q_lora_rank = ${jsonText(qLora)} must be null or an integer`);
  }
  const nRouted = get(t, w, "n_routed_experts", "int");
  if (nRouted < 0) throw new UserError(`config.json: text_config.n_routed_experts = ${nRouted} must not be negative`);
  // Checked in one fixed order (TextDims's), so which problem is reported first does not depend on
  // the order of config.json's members.
  const vocab_size = pos("vocab_size");
  const hidden_size = pos("hidden_size");
  const intermediate_size = pos("intermediate_size");
  const moe_intermediate_size = pos("moe_intermediate_size");
  const num_hidden_layers = pos("num_hidden_layers");
  const num_attention_heads = pos("num_attention_heads");
  const n_shared_experts = valueOr(t, "n_shared_experts", null) !== null ? get(t, w, "n_shared_experts", "int") : 0;
  const num_experts_per_tok = pos("num_experts_per_tok");
  const first_k_dense_replace = get(t, w, "first_k_dense_replace", "int");
  const moe_layer_freq = pos("moe_layer_freq");
  const kv_lora_rank = pos("kv_lora_rank");
  const qk_nope_head_dim = pos("qk_nope_head_dim");
  const qk_rope_head_dim = pos("qk_rope_head_dim");
  const v_head_dim = pos("v_head_dim");
  const routed_scaling_factor = get(t, w, "routed_scaling_factor", "float");
  const n_group = pos("n_group");
  const topk_group = pos("topk_group");
  const norm_topk_prob = get(t, w, "norm_topk_prob", "bool");
  const rope_theta = get(t, w, "rope_theta", "float");
  const rms_norm_eps = get(t, w, "rms_norm_eps", "float");
  const max_position_embeddings = pos("max_position_embeddings");
  return {
    vocab_size, hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers, num_attention_heads,
    n_routed_experts: nRouted, n_shared_experts, num_experts_per_tok, first_k_dense_replace, moe_layer_freq,
    kv_lora_rank, q_lora_rank: qLora as number | null, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
    routed_scaling_factor, n_group, topk_group, norm_topk_prob, rope_theta, rms_norm_eps, max_position_embeddings,
    kv_a_layernorm_eps: KV_A_LAYERNORM_EPS, q_head_dim: qk_nope_head_dim + qk_rope_head_dim,
  };
}

function visionDims(config: unknown): VisionDims {
  const v = section(config, "vision_config");
  const w = "vision_config";
  const pos = (key: string): number => positive(w, key, get(v, w, key, "int"));
  const merge = get(v, w, "merge_kernel_size", "list");
  if (merge.length !== 2 || !merge.every((m) => isInt(m) && m > 0)) {
    throw new UserError(`config.json: vision_config.merge_kernel_size = ${jsonText(merge)} must be two positive integers`);
  }
  const hidden_size = pos("hidden_size");
  const num_hidden_layers = pos("num_hidden_layers");
  const num_attention_heads = pos("num_attention_heads");
  const intermediate_size = pos("intermediate_size");
  const patch_size = pos("patch_size");
  const init_pos_emb_height = pos("init_pos_emb_height");
  const init_pos_emb_width = pos("init_pos_emb_width");
  const [merge_kernel_h, merge_kernel_w] = merge as [number, number];
  return {
    hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, patch_size, init_pos_emb_height,
    init_pos_emb_width, merge_kernel_h, merge_kernel_w, rope_theta: VISION_ROPE_THETA,
    layer_norm_eps: VISION_LAYER_NORM_EPS, head_dim: Math.floor(hidden_size / num_attention_heads),
    projector_width: hidden_size * merge_kernel_h * merge_kernel_w,
  };
}

export function modelDims(config: unknown): ModelDims {
  const text = textDims(config);
  const vision = visionDims(config);
  const top = config as JsonObject;
  return { text, vision, media_placeholder_token_id: get(top, "top level", "media_placeholder_token_id", "int") };
}

/**
 * The official checkpoint inventory: name -> dtype/shape, in shard order (vision and projector
 * first, then the text decoder). biasDtype ("BF16"/"F32", case-insensitive) fixes the router-bias
 * dtype; absent reports BF16 (checkSource accepts either).
 */
export function expectedTensors(config: unknown, biasDtype?: string | null): Inventory {
  const t = textDims(config);
  const v = visionDims(config);
  const biasDt = (biasDtype || "BF16").toUpperCase();
  if (!ROUTER_BIAS_DTYPES.includes(biasDt)) {
    throw new UserError(`router bias dtype '${biasDtype}' must be bf16 or f32`);
  }
  const out: Inventory = new Map();
  const add = (name: string, shape: number[], dtype: string = DTYPE): void => {
    out.set(name, { dtype, shape });
  };

  // Vision tower (MoonViT).
  const vh = v.hidden_size;
  const vi = v.intermediate_size;
  add("vision_tower.patch_embed.proj.weight", [vh, 3, v.patch_size, v.patch_size]);
  add("vision_tower.patch_embed.proj.bias", [vh]);
  add("vision_tower.patch_embed.pos_emb.weight", [v.init_pos_emb_height, v.init_pos_emb_width, vh]);
  for (let b = 0; b < v.num_hidden_layers; b++) {
    const p = `vision_tower.encoder.blocks.${b}.`;
    add(`${p}norm0.weight`, [vh]);
    add(`${p}norm0.bias`, [vh]);
    add(`${p}wqkv.weight`, [3 * vh, vh]);
    add(`${p}wqkv.bias`, [3 * vh]);
    add(`${p}wo.weight`, [vh, vh]);
    add(`${p}wo.bias`, [vh]);
    add(`${p}norm1.weight`, [vh]);
    add(`${p}norm1.bias`, [vh]);
    add(`${p}mlp.fc0.weight`, [vi, vh]);
    add(`${p}mlp.fc0.bias`, [vi]);
    add(`${p}mlp.fc1.weight`, [vh, vi]);
    add(`${p}mlp.fc1.bias`, [vh]);
  }
  add("vision_tower.encoder.final_layernorm.weight", [vh]);
  add("vision_tower.encoder.final_layernorm.bias", [vh]);

  // Projector: per-patch LN, then the merged (kh*kw patches) vector through two linears.
  const pw = v.projector_width;
  add("multi_modal_projector.pre_norm.weight", [vh]);
  add("multi_modal_projector.pre_norm.bias", [vh]);
  add("multi_modal_projector.linear_1.weight", [pw, pw]);
  add("multi_modal_projector.linear_1.bias", [pw]);
  add("multi_modal_projector.linear_2.weight", [t.hidden_size, pw]);
  add("multi_modal_projector.linear_2.bias", [t.hidden_size]);

  // Text decoder.
  const h = t.hidden_size;
  add(`${TEXT_PREFIX}embed_tokens.weight`, [t.vocab_size, h]);
  for (let layer = 0; layer < t.num_hidden_layers; layer++) {
    const p = `${TEXT_PREFIX}layers.${layer}.`;
    add(`${p}input_layernorm.weight`, [h]);
    add(`${p}self_attn.q_proj.weight`, [t.num_attention_heads * t.q_head_dim, h]);
    add(`${p}self_attn.kv_a_proj_with_mqa.weight`, [t.kv_lora_rank + t.qk_rope_head_dim, h]);
    add(`${p}self_attn.kv_a_layernorm.weight`, [t.kv_lora_rank]);
    add(`${p}self_attn.kv_b_proj.weight`, [t.num_attention_heads * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank]);
    add(`${p}self_attn.o_proj.weight`, [h, t.num_attention_heads * t.v_head_dim]);
    add(`${p}post_attention_layernorm.weight`, [h]);
    if (isMoeLayer(t, layer)) {
      const mi = t.moe_intermediate_size;
      add(`${p}mlp.gate.weight`, [t.n_routed_experts, h]);
      add(p + ROUTER_BIAS_SUFFIX, [t.n_routed_experts], biasDt);
      for (let e = 0; e < t.n_routed_experts; e++) {
        const q = `${p}mlp.experts.${e}.`;
        add(`${q}gate_proj.weight`, [mi, h]);
        add(`${q}up_proj.weight`, [mi, h]);
        add(`${q}down_proj.weight`, [h, mi]);
      }
      if (t.n_shared_experts > 0) {
        const si = t.n_shared_experts * mi;
        add(`${p}mlp.shared_experts.gate_proj.weight`, [si, h]);
        add(`${p}mlp.shared_experts.up_proj.weight`, [si, h]);
        add(`${p}mlp.shared_experts.down_proj.weight`, [h, si]);
      }
    } else {
      add(`${p}mlp.gate_proj.weight`, [t.intermediate_size, h]);
      add(`${p}mlp.up_proj.weight`, [t.intermediate_size, h]);
      add(`${p}mlp.down_proj.weight`, [h, t.intermediate_size]);
    }
  }
  add(`${TEXT_PREFIX}norm.weight`, [h]);
  add(LM_HEAD, [t.vocab_size, h]);
  return out;
}

export function countParams(inventory: Inventory): number {
  let n = 0;
  for (const { shape } of inventory.values()) n += shape.reduce((a, b) => a * b, 1);
  return n;
}

export function formatShape(shape: readonly number[]): string {
  return `[${shape.join(", ")}]`;
}

/** Every difference between a source's tensors and the inventory its config implies. */
export function checkSource(source: InventoryView): string[] {
  const problems: string[] = [];
  let expected: Inventory;
  try {
    expected = expectedTensors(source.config());
  } catch (err) {
    if (err instanceof UserError) return [err.message];
    throw err;
  }
  const present = source.tensorNames();
  const presentSet = new Set(present);
  const missing = [...expected.keys()].filter((n) => !presentSet.has(n));
  const unexpected = present.filter((n) => !expected.has(n));
  if (missing.length > 0) {
    problems.push(`${missing.length} tensor(s) missing from the checkpoint, e.g. ${missing.slice(0, 5).join(", ")}`);
    for (const n of missing) problems.push(`missing tensor ${n}`);
  }
  for (const n of unexpected) problems.push(`unexpected tensor ${n} (not part of this config's layout)`);
  for (const name of present) {
    const want = expected.get(name);
    if (want === undefined) continue;
    const { dtype, shape } = source.tensorInfo(name);
    if (shape.length !== want.shape.length || shape.some((d, i) => d !== want.shape[i])) {
      problems.push(`${name}: wrong shape: expected ${formatShape(want.shape)} found ${formatShape(shape)}`);
    }
    const allowed = name.endsWith(ROUTER_BIAS_SUFFIX) ? ROUTER_BIAS_DTYPES : [want.dtype];
    if (!allowed.includes(dtype)) {
      problems.push(`${name}: wrong dtype: expected ${allowed.join(" or ")} found ${dtype}`);
    }
  }
  return problems;
}

/** Config features the runtime cannot run exactly, one message each (empty = supported). */
export function checkSupported(config: unknown): string[] {
  const problems: string[] = [];
  let t: TextDims;
  let v: VisionDims;
  try {
    t = textDims(config);
    v = visionDims(config);
  } catch (err) {
    if (err instanceof UserError) return [err.message];
    throw err;
  }
  const top = config as JsonObject;
  const tc = top.text_config as JsonObject;
  const vc = top.vision_config as JsonObject;
  const tcText = (key: string): string => jsonText(valueOr(tc, key, null));
  if (t.q_lora_rank !== null) {
    problems.push(`text_config.q_lora_rank = ${t.q_lora_rank}: low-rank query projection is not supported (Kimi-VL uses null)`);
  }
  if (valueOr(tc, "rope_scaling", null) !== null) {
    problems.push(`text_config.rope_scaling = ${tcText("rope_scaling")}: RoPE scaling (YaRN etc.) is not supported (Kimi-VL uses null)`);
  }
  if (valueOr(tc, "scoring_func", "sigmoid") !== "sigmoid") {
    problems.push(`text_config.scoring_func = ${tcText("scoring_func")}: only 'sigmoid' router scoring is supported`);
  }
  if (valueOr(tc, "topk_method", "noaux_tc") !== "noaux_tc") {
    problems.push(`text_config.topk_method = ${tcText("topk_method")}: only 'noaux_tc' expert selection is supported`);
  }
  if (valueOr(tc, "hidden_act", "silu") !== "silu") {
    problems.push(`text_config.hidden_act = ${tcText("hidden_act")}: only 'silu' is supported`);
  }
  if (flag(tc, "text_config.", "attention_bias", problems)) {
    problems.push("text_config.attention_bias = true: attention biases are not supported");
  }
  // both are evaluated, so that each one that is not true or false is reported
  if ([flag(tc, "text_config.", "tie_word_embeddings", problems), flag(top, "", "tie_word_embeddings", problems)].includes(true)) {
    problems.push("tie_word_embeddings = true: a tied lm_head is not supported (Kimi-VL has a separate lm_head)");
  }
  if (t.qk_rope_head_dim % 2) {
    problems.push(`text_config.qk_rope_head_dim = ${t.qk_rope_head_dim} is odd; RoPE needs an even dimension`);
  }
  if (t.n_routed_experts === 0) {
    problems.push("text_config.n_routed_experts = 0: a model without routed experts is not supported");
  } else {
    if (t.n_routed_experts % t.n_group) {
      problems.push(`text_config.n_routed_experts = ${t.n_routed_experts} is not divisible by n_group = ${t.n_group}`);
    }
    if (t.topk_group > t.n_group) {
      problems.push(`text_config.topk_group = ${t.topk_group} exceeds n_group = ${t.n_group}`);
    }
    if (t.num_experts_per_tok > t.n_routed_experts) {
      problems.push(`text_config.num_experts_per_tok = ${t.num_experts_per_tok} exceeds n_routed_experts = ${t.n_routed_experts}`);
    } else if (t.n_routed_experts % t.n_group === 0 && t.topk_group <= t.n_group) {
      const perGroup = Math.floor(t.n_routed_experts / t.n_group);
      if (t.num_experts_per_tok > t.topk_group * perGroup) {
        problems.push(`text_config.num_experts_per_tok = ${t.num_experts_per_tok} exceeds the ${t.topk_group * perGroup} ` +
          `experts of the selected groups (topk_group ${t.topk_group} x ${perGroup} experts per group)`);
      }
      if (t.n_group > 1 && perGroup < 2) {
        problems.push(`text_config.n_group = ${t.n_group} leaves fewer than 2 experts per group; ` +
          "group scores (sum of the top 2) are undefined");
      }
    }
  }
  if (t.first_k_dense_replace < 0 || t.first_k_dense_replace > t.num_hidden_layers) {
    problems.push(`text_config.first_k_dense_replace = ${t.first_k_dense_replace} is outside 0..${t.num_hidden_layers}`);
  }
  if (v.hidden_size % v.num_attention_heads) {
    problems.push(`vision_config.hidden_size = ${v.hidden_size} is not divisible by num_attention_heads = ${v.num_attention_heads}`);
  } else if (v.head_dim % 4) {
    problems.push(`vision head_dim = ${v.head_dim} is not divisible by 4 (2D RoPE splits it into x/y pairs)`);
  }
  if (v.merge_kernel_h !== 2 || v.merge_kernel_w !== 2) {
    problems.push(`vision_config.merge_kernel_size = [${v.merge_kernel_h}, ${v.merge_kernel_w}]: only [2, 2] patch merging is supported`);
  }
  const media = valueOr(top, "media_placeholder_token_id", null);
  if (!(isInt(media) && media >= 0 && media < t.vocab_size)) {
    problems.push(Object.hasOwn(top, "media_placeholder_token_id")
      ? `media_placeholder_token_id = ${jsonText(media)} is not a token id below vocab_size ${t.vocab_size}`
      : `media_placeholder_token_id is missing; it must be a token id below vocab_size ${t.vocab_size}`);
  }
  const visionAct = valueOr(vc, "hidden_act", "gelu_pytorch_tanh");
  if (visionAct !== "gelu_pytorch_tanh") {
    problems.push(`vision_config.hidden_act = ${jsonText(visionAct)}: only the GELU-tanh vision MLP is supported`);
  }
  return problems;
}

const HPARAM_TEXT_KEYS = [
  "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
  "num_hidden_layers", "num_attention_heads", "n_routed_experts", "n_shared_experts",
  "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank",
  "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "routed_scaling_factor",
  "n_group", "topk_group", "norm_topk_prob", "rope_theta", "rms_norm_eps",
  "kv_a_layernorm_eps", "max_position_embeddings",
] as const satisfies ReadonlyArray<keyof TextDims>;
const HPARAM_VISION_KEYS = [
  "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
  "init_pos_emb_height", "init_pos_emb_width", "merge_kernel_h", "merge_kernel_w",
  "rope_theta", "layer_norm_eps",
] as const satisfies ReadonlyArray<keyof VisionDims>;

/** The pack's hparam table (docs/FORMAT.md), in the order the index stores it. */
export function hparams(config: unknown): Map<string, number> {
  const dims = modelDims(config);
  const out = new Map<string, number>();
  for (const key of HPARAM_TEXT_KEYS) {
    const value = dims.text[key];
    out.set(`text.${key}`, value === null ? 0 : Number(value));
  }
  for (const key of HPARAM_VISION_KEYS) out.set(`vision.${key}`, dims.vision[key]);
  out.set("media_placeholder_token_id", dims.media_placeholder_token_id);
  return out;
}
