/**
 * host/pack/model-spec.ts: the tensor inventory of a config (the tiny preset's against the shards the
 * synthesizer wrote in the official layout, the full preset's against the real checkpoint's
 * shapes), config validation with kvl/modelspec.py's messages (recorded from it; values now
 * spelt as JSON.stringify spells them), the source check, and the hparam table of docs/FORMAT.md.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import {
  type Inventory, type InventoryView, checkSource, checkSupported, countParams, expectedTensors, hparams, modelDims, textDims,
} from "../host/pack/model-spec.js";
import { UserError } from "../host/system/user-error.js";
import { presetConfigText } from "../packer/synth.js";
import { CheckpointSource } from "../packer/tensor-source.js";
import { anyCore, tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

type Json = Record<string, unknown>;
const tiny = (): Json => JSON.parse(presetConfigText("tiny")) as Json;
const full = (): Json => JSON.parse(presetConfigText("full")) as Json;

/** The tiny config edited, as config.json text parsed again. */
function edited(edit: (c: Json, t: Json, v: Json) => void): unknown {
  const c = tiny();
  edit(c, c.text_config as Json, c.vision_config as Json);
  return JSON.parse(JSON.stringify(c));
}

describe("expected tensors", () => {
  let core: CoreBackend;
  let tmp: { dir: string; cleanup: () => void };
  beforeAll(async () => {
    core = await anyCore();
    tmp = tempDir("model-spec");
  });
  afterAll(() => {
    core.close();
    tmp.cleanup();
  });

  it("are the tiny checkpoint's tensors, in its order, with its dtypes and shapes", async () => {
    const ckpt = await tinyCheckpoint(join(tmp.dir, "tiny"), core);
    const src = await CheckpointSource.open(ckpt);
    try {
      const inv = expectedTensors(src.config());
      expect([...inv.keys()]).toEqual(src.tensorNames());
      for (const name of src.tensorNames()) expect(inv.get(name)).toEqual(src.tensorInfo(name));
      // 3 + 12 per vision block + 2, 6 projector, 1 + 7 per layer + 3 dense + (2 + 3*8 + 3) per MoE layer + 2
      expect(inv.size).toBe(3 + 12 * 3 + 2 + 6 + 1 + 7 * 4 + 3 + 29 * 3 + 2);
      expect(checkSource(src)).toEqual([]);
    } finally {
      await src.close();
    }
  });

  it("have the real Kimi-VL-A3B shapes for the real config", () => {
    const inv = expectedTensors(full());
    const shape = (n: string): readonly number[] | undefined => inv.get(n)?.shape;
    const L = "language_model.model.layers.";
    expect(shape("language_model.model.embed_tokens.weight")).toEqual([163840, 2048]);
    expect(shape("language_model.lm_head.weight")).toEqual([163840, 2048]);
    expect(shape(`${L}0.self_attn.q_proj.weight`)).toEqual([16 * 192, 2048]);
    expect(shape(`${L}0.self_attn.kv_a_proj_with_mqa.weight`)).toEqual([576, 2048]);
    expect(shape(`${L}0.self_attn.kv_a_layernorm.weight`)).toEqual([512]);
    expect(shape(`${L}0.self_attn.kv_b_proj.weight`)).toEqual([16 * 256, 512]);
    expect(shape(`${L}0.self_attn.o_proj.weight`)).toEqual([2048, 2048]);
    expect(shape(`${L}0.mlp.gate_proj.weight`)).toEqual([11264, 2048]);
    expect(shape(`${L}0.mlp.gate.weight`)).toBeUndefined();
    expect(shape(`${L}26.mlp.experts.63.down_proj.weight`)).toEqual([2048, 1408]);
    expect(shape(`${L}1.mlp.shared_experts.gate_proj.weight`)).toEqual([2816, 2048]);
    expect(inv.get(`${L}1.mlp.gate.e_score_correction_bias`)).toEqual({ dtype: "BF16", shape: [64] });
    expect(shape("vision_tower.patch_embed.proj.weight")).toEqual([1152, 3, 14, 14]);
    expect(shape("vision_tower.patch_embed.pos_emb.weight")).toEqual([64, 64, 1152]);
    expect(shape("vision_tower.encoder.blocks.26.wqkv.weight")).toEqual([3456, 1152]);
    expect(shape("vision_tower.encoder.blocks.0.mlp.fc0.weight")).toEqual([4304, 1152]);
    expect(shape("multi_modal_projector.linear_1.weight")).toEqual([4608, 4608]);
    expect(shape("multi_modal_projector.linear_2.weight")).toEqual([2048, 4608]);
    expect([...inv.keys()].filter((n) => n.includes(".mlp.experts.")).length).toBe(26 * 64 * 3);
    expect(countParams(inv)).toBe(16407656048); // Kimi-VL-A3B: 16.4B parameters in all
    expect(expectedTensors(full(), "f32").get(`${L}1.mlp.gate.e_score_correction_bias`)?.dtype).toBe("F32");
    expect(() => expectedTensors(full(), "fp8")).toThrow(new UserError("router bias dtype 'fp8' must be bf16 or f32"));
  });
});

describe("config validation (kvl/modelspec.py's messages)", () => {
  it("accepts both presets", () => {
    expect(checkSupported(tiny())).toEqual([]);
    expect(checkSupported(full())).toEqual([]);
    expect(modelDims(tiny()).media_placeholder_token_id).toBe(163605);
  });

  const cases: Array<[string, (c: Json, t: Json, v: Json) => void, string]> = [
    ["q_lora", (_c, t) => { t.q_lora_rank = 64; }, "text_config.q_lora_rank = 64: low-rank query projection is not supported (Kimi-VL uses null)"],
    ["rope_scaling", (_c, t) => { t.rope_scaling = { type: "yarn", factor: 4 }; },
      'text_config.rope_scaling = {"type":"yarn","factor":4}: RoPE scaling (YaRN etc.) is not supported (Kimi-VL uses null)'],
    ["scoring", (_c, t) => { t.scoring_func = "softmax"; }, 'text_config.scoring_func = "softmax": only \'sigmoid\' router scoring is supported'],
    ["topk_method", (_c, t) => { t.topk_method = "greedy"; }, 'text_config.topk_method = "greedy": only \'noaux_tc\' expert selection is supported'],
    ["hidden_act", (_c, t) => { t.hidden_act = "gelu"; }, 'text_config.hidden_act = "gelu": only \'silu\' is supported'],
    ["attn_bias", (_c, t) => { t.attention_bias = true; }, "text_config.attention_bias = true: attention biases are not supported"],
    ["attn_bias_int", (_c, t) => { t.attention_bias = 1; },
      "config.json: text_config.attention_bias = 1 is not true or false; fix or re-download config.json"],
    ["tie", (c) => { c.tie_word_embeddings = true; }, "tie_word_embeddings = true: a tied lm_head is not supported (Kimi-VL has a separate lm_head)"],
    ["tie_str", (c) => { c.tie_word_embeddings = "no"; }, 'config.json: tie_word_embeddings = "no" is not true or false; fix or re-download config.json'],
    ["odd_rope", (_c, t) => { t.qk_rope_head_dim = 15; }, "text_config.qk_rope_head_dim = 15 is odd; RoPE needs an even dimension"],
    ["no_experts", (_c, t) => { t.n_routed_experts = 0; }, "text_config.n_routed_experts = 0: a model without routed experts is not supported"],
    ["indivisible", (_c, t) => { t.n_group = 3; }, "text_config.n_routed_experts = 8 is not divisible by n_group = 3"],
    ["topk_group", (_c, t) => { t.n_group = 2; t.topk_group = 4; }, "text_config.topk_group = 4 exceeds n_group = 2"],
    ["per_tok", (_c, t) => { t.num_experts_per_tok = 9; }, "text_config.num_experts_per_tok = 9 exceeds n_routed_experts = 8"],
    ["selected", (_c, t) => { t.n_group = 4; t.topk_group = 1; t.num_experts_per_tok = 3; },
      "text_config.num_experts_per_tok = 3 exceeds the 2 experts of the selected groups (topk_group 1 x 2 experts per group)"],
    ["per_group", (_c, t) => { t.n_group = 8; t.topk_group = 8; },
      "text_config.n_group = 8 leaves fewer than 2 experts per group; group scores (sum of the top 2) are undefined"],
    ["dense", (_c, t) => { t.first_k_dense_replace = 5; }, "text_config.first_k_dense_replace = 5 is outside 0..4"],
    ["vheads", (_c, _t, v) => { v.num_attention_heads = 3; }, "vision_config.hidden_size = 64 is not divisible by num_attention_heads = 3"],
    ["vhead4", (_c, _t, v) => { v.num_attention_heads = 32; }, "vision head_dim = 2 is not divisible by 4 (2D RoPE splits it into x/y pairs)"],
    ["merge", (_c, _t, v) => { v.merge_kernel_size = [3, 3]; }, "vision_config.merge_kernel_size = [3, 3]: only [2, 2] patch merging is supported"],
    ["media", (c) => { c.media_placeholder_token_id = 163840; }, "media_placeholder_token_id = 163840 is not a token id below vocab_size 163840"],
    ["media_bool", (c) => { c.media_placeholder_token_id = true; }, "media_placeholder_token_id = true is not a token id below vocab_size 163840"],
    ["media_none", (c) => { delete c.media_placeholder_token_id; }, "media_placeholder_token_id is missing; it must be a token id below vocab_size 163840"],
    ["vact", (_c, _t, v) => { v.hidden_act = "relu"; }, 'vision_config.hidden_act = "relu": only the GELU-tanh vision MLP is supported'],
    ["missing", (_c, t) => { delete t.hidden_size; }, "config.json: text_config.hidden_size is missing; re-download config.json"],
    ["str_int", (_c, t) => { t.hidden_size = "64"; }, 'config.json: text_config.hidden_size = "64" is not an integer; fix or re-download config.json'],
    ["bool_int", (_c, t) => { t.hidden_size = true; }, "config.json: text_config.hidden_size = true is not an integer; fix or re-download config.json"],
    ["float_int", (_c, t) => { t.hidden_size = 64.5; }, "config.json: text_config.hidden_size = 64.5 is not an integer; fix or re-download config.json"],
    ["zero", (_c, t) => { t.vocab_size = 0; }, "config.json: text_config.vocab_size = 0 must be positive"],
    ["qlora_str", (_c, t) => { t.q_lora_rank = "x"; }, 'config.json: text_config.q_lora_rank = "x" must be null or an integer'],
    ["neg_routed", (_c, t) => { t.n_routed_experts = -1; }, "config.json: text_config.n_routed_experts = -1 must not be negative"],
    ["merge_bad", (_c, _t, v) => { v.merge_kernel_size = [2]; }, "config.json: vision_config.merge_kernel_size = [2] must be two positive integers"],
    ["no_text", (c) => { delete c.text_config; },
      "config.json has no 'text_config' object; this is not a Kimi-VL config (re-download config.json from the model repository)"],
    ["bool_float", (_c, t) => { t.rope_theta = false; }, "config.json: text_config.rope_theta = false is not a number; fix or re-download config.json"],
    ["norm_int", (_c, t) => { t.norm_topk_prob = 1; }, "config.json: text_config.norm_topk_prob = 1 is not true or false; fix or re-download config.json"],
  ];
  it.each(cases)("%s", (_name, edit, message) => {
    expect(checkSupported(edited(edit))).toEqual([message]);
  });

  it("reads an integer field written with a fraction or an exponent (JSON has one number type)", () => {
    const text = presetConfigText("tiny").replace('"hidden_size": 64,', '"hidden_size": 64.0,').replace('"vocab_size": 163840,', '"vocab_size": 1.6384e5,');
    expect(text).toContain('"hidden_size": 64.0,');
    expect(text).toContain('"vocab_size": 1.6384e5,');
    expect(checkSupported(JSON.parse(text))).toEqual([]);
    expect(textDims(JSON.parse(text))).toMatchObject({ hidden_size: 64, vocab_size: 163840 });
  });

  it("refuses a config that is not an object", () => {
    expect(checkSupported([1])).toEqual(["config.json is not a JSON object; re-download config.json"]);
    expect(() => textDims(null)).toThrow(UserError);
  });
});

describe("source check", () => {
  function fake(config: unknown, inventory: Inventory): InventoryView {
    return { config: () => config, tensorNames: () => [...inventory.keys()], tensorInfo: (n) => inventory.get(n)! };
  }

  it("lists missing, unexpected, wrong-shape and wrong-dtype tensors; the router bias may be F32", () => {
    const config = tiny();
    const inv = expectedTensors(config);
    const names = [...inv.keys()];
    const drop = names.filter((n) => n.includes("layers.2.mlp.experts.3."));
    for (const n of drop) inv.delete(n);
    inv.set("language_model.model.extra.weight", { dtype: "BF16", shape: [1] });
    inv.set("language_model.model.layers.0.self_attn.q_proj.weight", { dtype: "BF16", shape: [64, 128] });
    inv.set("language_model.model.norm.weight", { dtype: "F16", shape: [64] });
    inv.set("language_model.model.layers.1.mlp.gate.e_score_correction_bias", { dtype: "F32", shape: [8] });
    expect(checkSource(fake(config, inv))).toEqual([
      `3 tensor(s) missing from the checkpoint, e.g. ${drop.join(", ")}`,
      ...drop.map((n) => `missing tensor ${n}`),
      "unexpected tensor language_model.model.extra.weight (not part of this config's layout)",
      "language_model.model.layers.0.self_attn.q_proj.weight: wrong shape: expected [128, 64] found [64, 128]",
      "language_model.model.norm.weight: wrong dtype: expected BF16 found F16",
    ]);
    expect(checkSource(fake([1], inv))).toEqual(["config.json is not a JSON object; re-download config.json"]);
  });
});

describe("hparams", () => {
  it("are docs/FORMAT.md's keys, in its order, with the config's values and the fixed ones", () => {
    const hp = hparams(tiny());
    expect([...hp]).toEqual([
      ["text.vocab_size", 163840], ["text.hidden_size", 64], ["text.intermediate_size", 128],
      ["text.moe_intermediate_size", 32], ["text.num_hidden_layers", 4], ["text.num_attention_heads", 4],
      ["text.n_routed_experts", 8], ["text.n_shared_experts", 2], ["text.num_experts_per_tok", 2],
      ["text.first_k_dense_replace", 1], ["text.moe_layer_freq", 1], ["text.kv_lora_rank", 32],
      ["text.q_lora_rank", 0], ["text.qk_nope_head_dim", 16], ["text.qk_rope_head_dim", 16], ["text.v_head_dim", 16],
      ["text.routed_scaling_factor", 2.446], ["text.n_group", 1], ["text.topk_group", 1], ["text.norm_topk_prob", 1],
      ["text.rope_theta", 800000], ["text.rms_norm_eps", 1e-5], ["text.kv_a_layernorm_eps", 1e-6],
      ["text.max_position_embeddings", 8192],
      ["vision.hidden_size", 64], ["vision.num_hidden_layers", 3], ["vision.num_attention_heads", 4],
      ["vision.intermediate_size", 100], ["vision.patch_size", 14], ["vision.init_pos_emb_height", 8],
      ["vision.init_pos_emb_width", 8], ["vision.merge_kernel_h", 2], ["vision.merge_kernel_w", 2],
      ["vision.rope_theta", 10000], ["vision.layer_norm_eps", 1e-5], ["media_placeholder_token_id", 163605],
    ]);
    expect(hparams(edited((_c, t) => { t.norm_topk_prob = false; })).get("text.norm_topk_prob")).toBe(0);
  });
});
