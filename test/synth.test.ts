/**
 * kvl synth (packer/synth.ts, packer/synth-tokenizer.ts): the checkpoint layout, weight
 * statistics, determinism on both backends, the full preset against the real model's published
 * dims, and the tokenizer assets through the real tiktoken and a real Jinja renderer. Expected
 * values are the model description's (real dims, counts, special ids, prompt strings), written
 * here as literals, never taken from the code under test. Byte equality with the earlier Python
 * synthesizer is test/packer-python-hashes.test.ts's.
 */
import { createHash } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { Template } from "@huggingface/jinja";
import { Tiktoken } from "tiktoken";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { expectedTensors } from "../host/pack/model-spec.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { PATTERN } from "../host/text/tokenizer-pattern.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { SafetensorsFile } from "../packer/safetensors.js";
import { presetConfigText, shardPlan, synthesize } from "../packer/synth.js";

/** The real Kimi-VL-A3B-Instruct text dims (spec §2), independent of packer/synth.ts. */
const REAL_TEXT: Record<string, unknown> = {
  vocab_size: 163840, hidden_size: 2048, intermediate_size: 11264, moe_intermediate_size: 1408,
  num_hidden_layers: 27, num_attention_heads: 16, num_key_value_heads: 16, n_routed_experts: 64,
  n_shared_experts: 2, num_experts_per_tok: 6, first_k_dense_replace: 1, moe_layer_freq: 1,
  ep_size: 1, kv_lora_rank: 512, q_lora_rank: null, qk_nope_head_dim: 128, qk_rope_head_dim: 64,
  v_head_dim: 128, topk_method: "noaux_tc", scoring_func: "sigmoid", routed_scaling_factor: 2.446,
  n_group: 1, topk_group: 1, norm_topk_prob: true, aux_loss_alpha: 0.001, seq_aux: true,
  max_position_embeddings: 131072, rope_theta: 800000.0, rope_scaling: null, rms_norm_eps: 1e-5,
  hidden_act: "silu", attention_bias: false, attention_dropout: 0.0, tie_word_embeddings: false,
  bos_token_id: 163584, eos_token_id: 163585, pad_token_id: 163839, model_type: "deepseek_v3",
};
const REAL_VISION: Record<string, unknown> = {
  model_type: "moonvit", patch_size: 14, init_pos_emb_height: 64, init_pos_emb_width: 64,
  num_attention_heads: 16, num_hidden_layers: 27, hidden_size: 1152, intermediate_size: 4304,
  merge_kernel_size: [2, 2],
};
const SHARDS = [1, 2, 3].map((k) => `model-0000${k}-of-00003.safetensors`);

const bf16ToF32 = (bits: Uint16Array): Float32Array => {
  const u = new Uint32Array(bits.length);
  for (let i = 0; i < bits.length; i++) u[i] = bits[i]! << 16;
  return new Float32Array(u.buffer);
};

function digest(dir: string): Record<string, string> {
  return Object.fromEntries(readdirSync(dir).sort().map((f) => [f, createHash("sha256").update(readFileSync(join(dir, f))).digest("hex")]));
}

/** Every tensor of a checkpoint directory: name -> raw bytes (tiny checkpoints only). */
async function readAll(dir: string): Promise<Map<string, { dtype: string; shape: number[]; data: Uint8Array }>> {
  const out = new Map<string, { dtype: string; shape: number[]; data: Uint8Array }>();
  for (const shard of SHARDS) {
    const file = await SafetensorsFile.open(join(dir, shard));
    try {
      for (const [name, t] of file.tensors) out.set(name, { dtype: t.dtype, shape: [...t.shape], data: await file.read(name) });
    } finally {
      await file.close();
    }
  }
  return out;
}

let work: string;
let wasm: CoreBackend;
let native: CoreBackend;
let tiny: string;

beforeAll(async () => {
  work = mkdtempSync(join(tmpdir(), "kvl-synth-"));
  wasm = await WasmBackend.create();
  native = new NativeBackend();
  tiny = await synthesize(join(work, "tiny"), { preset: "tiny", seed: 0, core: wasm });
});
afterAll(() => {
  wasm.close();
  native.close();
  rmSync(work, { recursive: true, force: true });
});

describe("the full preset", () => {
  const config = JSON.parse(presetConfigText("full")) as { text_config: Record<string, unknown>; vision_config: Record<string, unknown>; media_placeholder_token_id: number; model_type: string };

  it("is the real model's config", () => {
    for (const [key, value] of Object.entries(REAL_TEXT)) expect(config.text_config[key], key).toEqual(value);
    for (const [key, value] of Object.entries(REAL_VISION)) expect(config.vision_config[key], key).toEqual(value);
    expect(config.media_placeholder_token_id).toBe(163605);
    expect(config.model_type).toBe("kimi_vl");
  });

  it("writes its floats as Python did (rope_theta 800000.0, rms_norm_eps 1e-05)", () => {
    const text = presetConfigText("full");
    expect(text).toContain('"rope_theta": 800000.0,');
    expect(text).toContain('"rms_norm_eps": 1e-05,');
    expect(text).toContain('"attention_dropout": 0.0,');
  });

  it("has the real inventory and shards like the real checkpoint", () => {
    const inv = expectedTensors(config);
    expect(inv.size).toBe(5652);
    let params = 0;
    for (const t of inv.values()) params += t.shape.reduce((a, b) => a * b, 1);
    expect(params).toBe(16_407_656_048);
    const plan = shardPlan(inv, 7);
    expect(plan).toHaveLength(7);
    expect(plan.flat()).toHaveLength(5652);
    const sizes = plan.map((names) => names.reduce((s, n) => s + 2 * inv.get(n)!.shape.reduce((a, b) => a * b, 1), 0));
    for (const s of sizes.slice(0, -1)) expect(s > 3.5e9 && s < 5.5e9, `shard of ${s} bytes`).toBe(true);
    const vision = [...inv.keys()].filter((n) => n.startsWith("vision_tower.") || n.startsWith("multi_modal_projector."));
    expect(vision).toHaveLength(335);
    for (const n of vision) expect(plan[0]).toContain(n);
  });
});

describe("a tiny checkpoint", () => {
  it("has the official layout and nothing half-written", async () => {
    const files = readdirSync(tiny);
    for (const f of [...SHARDS, "model.safetensors.index.json", "config.json", "generation_config.json",
      "preprocessor_config.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja"]) {
      expect(files, f).toContain(f);
    }
    expect(files.filter((f) => f.endsWith(".partial"))).toEqual([]);
    expect(files).not.toContain("SOURCE_REVISION.txt"); // synthetic: no revision
    const index = JSON.parse(readFileSync(join(tiny, "model.safetensors.index.json"), "utf8")) as { metadata: { total_size: number }; weight_map: Record<string, string> };
    const tensors = await readAll(tiny);
    const config = JSON.parse(readFileSync(join(tiny, "config.json"), "utf8")) as unknown;
    expect(new Set(Object.keys(index.weight_map))).toEqual(new Set(expectedTensors(config).keys()));
    expect(new Set(tensors.keys())).toEqual(new Set(Object.keys(index.weight_map)));
    let total = 0;
    for (const t of tensors.values()) total += t.data.length;
    expect(index.metadata.total_size).toBe(total);
    for (const [name, shard] of Object.entries(index.weight_map)) {
      if (name.startsWith("vision_tower.") || name.startsWith("multi_modal_projector.")) expect(shard).toBe(SHARDS[0]);
    }
  });

  it("has sensible weights: non-zero router bias, norms near 1, everything finite", async () => {
    const tensors = await readAll(tiny);
    const L = "language_model.model.layers.";
    const bias = bf16ToF32(new Uint16Array(tensors.get(`${L}1.mlp.gate.e_score_correction_bias`)!.data.slice().buffer));
    expect(bias.every((v) => v !== 0)).toBe(true);
    const mean = bias.reduce((a, b) => a + b, 0) / bias.length;
    const std = Math.sqrt(bias.reduce((a, b) => a + (b - mean) ** 2, 0) / bias.length);
    expect(std > 0.1 && std < 0.6).toBe(true);
    const norm = bf16ToF32(new Uint16Array(tensors.get(`${L}2.input_layernorm.weight`)!.data.slice().buffer));
    expect(Math.min(...norm)).toBeGreaterThan(0.85);
    expect(Math.max(...norm)).toBeLessThan(1.15);
    for (const [name, t] of tensors) {
      const values = t.dtype === "F32" ? new Float32Array(t.data.slice().buffer) : bf16ToF32(new Uint16Array(t.data.slice().buffer));
      expect(values.every(Number.isFinite), name).toBe(true);
    }
  });

  it("is the same bytes on the native core, and depends on the seed", async () => {
    const again = await synthesize(join(work, "again"), { preset: "tiny", seed: 0, core: native });
    expect(digest(again)).toEqual(digest(tiny));
    const other = await synthesize(join(work, "other"), { preset: "tiny", seed: 7, core: native });
    const a = digest(tiny);
    const b = digest(other);
    expect(a["config.json"]).toBe(b["config.json"]);
    for (const f of SHARDS) expect(a[f]).not.toBe(b[f]);
  });

  it("refuses a group-limited config the model cannot run, and writes no index", async () => {
    await expect(synthesize(join(work, "bad"), { preset: "tiny", seed: 0, nGroup: 3, topkGroup: 1, core: wasm }))
      .rejects.toThrow(/not divisible by n_group = 3/);
    expect(existsSync(join(work, "bad", "model.safetensors.index.json"))).toBe(false);
    await expect(synthesize(join(work, "bad"), { preset: "tiny", seed: 0, nGroup: 2, core: wasm }))
      .rejects.toThrow(/go together/);
  });
});

describe("the tokenizer assets", () => {
  function ranks(): Map<string, number> {
    const out = new Map<string, number>();
    const duplicates: string[] = [];
    for (const line of readFileSync(join(tiny, "tiktoken.model"), "latin1").split("\n")) {
      if (!line) continue;
      const [token, rank] = line.split(" ") as [string, string];
      const raw = Buffer.from(token, "base64").toString("latin1");
      if (out.has(raw)) duplicates.push(raw);
      out.set(raw, Number(rank));
    }
    expect(duplicates).toEqual([]);
    return out;
  }

  it("hold 163584 distinct ranks, single bytes first in GPT-2 order", () => {
    const r = ranks();
    expect(r.size).toBe(163_584);
    const byRank = new Map([...r].map(([t, k]) => [k, t]));
    expect([...byRank.keys()].sort((a, b) => a - b)).toEqual(Array.from({ length: 163_584 }, (_, i) => i));
    expect(byRank.get(0)).toBe("!");
    expect(byRank.get(93)).toBe("~");
    expect(byRank.get(188)).toBe("\u0000"); // the first non-printable byte follows the 188 printable ones
    expect(new Set(Array.from({ length: 256 }, (_, i) => byRank.get(i)))).toEqual(new Set(Array.from({ length: 256 }, (_, b) => String.fromCharCode(b))));
  });

  it("round-trip text through the real tiktoken with the official pattern, with multi-byte merges", () => {
    const config = JSON.parse(readFileSync(join(tiny, "tokenizer_config.json"), "utf8")) as { added_tokens_decoder: Record<string, { content: string }> };
    const specials = Object.fromEntries(Object.entries(config.added_tokens_decoder).map(([id, v]) => [v.content, Number(id)]));
    const enc = new Tiktoken(readFileSync(join(tiny, "tiktoken.model"), "latin1"), specials, PATTERN);
    try {
      const decoder = new TextDecoder();
      for (const text of ["Xin chào! Hôm nay trời đẹp quá, Việt Nam.", "你好！今天天气很好。中国的首都是北京。",
        "The quick brown fox jumps over the lazy dog.", "def main(x):\n    return x + 1\n", "emoji 🙂 and tabs\t\tand  spaces"]) {
        const ids = enc.encode(text);
        expect(decoder.decode(enc.decode(ids))).toBe(text);
        expect(Math.max(...ids)).toBeLessThan(163_584);
        if (!text.startsWith("emoji") && !text.startsWith("def")) {
          expect(ids.length, text).toBeLessThan(Buffer.byteLength(text) * 0.6);
        }
      }
      expect([...enc.encode("<|im_end|>", "all")]).toEqual([163586]);
      expect([...enc.encode("<|media_pad|>", "all")]).toEqual([163605]);
    } finally {
      enc.free();
    }
  });

  it("name the official special ids", () => {
    const cfg = JSON.parse(readFileSync(join(tiny, "tokenizer_config.json"), "utf8")) as Record<string, unknown> & { added_tokens_decoder: Record<string, { content: string }> };
    const dec = new Map(Object.entries(cfg.added_tokens_decoder).map(([k, v]) => [Number(k), v.content]));
    expect([...dec.keys()].sort((a, b) => a - b)).toEqual(Array.from({ length: 256 }, (_, i) => 163584 + i));
    const expected: Record<number, string> = {
      163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>", 163588: "<|im_assistant|>",
      163590: "<|start_header_id|>", 163591: "<|end_header_id|>", 163593: "[EOT]", 163594: "<|im_system|>",
      163601: "<|im_middle|>", 163602: "<|media_start|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
      163605: "<|media_pad|>", 163838: "[UNK]", 163839: "[PAD]",
    };
    for (const [id, name] of Object.entries(expected)) expect(dec.get(Number(id))).toBe(name);
    expect(dec.get(163589)).toBe("<|reserved_token_163589|>");
    expect(new Set(dec.values()).size).toBe(256);
    expect([cfg.bos_token, cfg.eos_token, cfg.pad_token, cfg.unk_token]).toEqual(["[BOS]", "[EOS]", "[PAD]", "[UNK]"]);
    const gen = JSON.parse(readFileSync(join(tiny, "generation_config.json"), "utf8")) as { eos_token_id: number[]; temperature: number };
    expect(gen.eos_token_id).toEqual([163586, 163585]);
    expect(gen.temperature).toBe(0.2);
    const pre = JSON.parse(readFileSync(join(tiny, "preprocessor_config.json"), "utf8")) as Record<string, unknown>;
    expect([pre.patch_size, pre.in_token_limit, pre.merge_kernel_size, pre.image_mean]).toEqual([14, 4096, [2, 2], [0.5, 0.5, 0.5]]);
  });

  it("render the official prompt strings through a Jinja renderer", () => {
    const template = new Template(readFileSync(join(tiny, "chat_template.jinja"), "utf8"));
    const sys = "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>";
    expect(template.render({ messages: [{ role: "user", content: "Hi there" }], add_generation_prompt: true }))
      .toBe(`${sys}<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>`);
    const media = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>";
    const got = template.render({
      add_generation_prompt: false,
      messages: [
        { role: "system", content: "Be brief." },
        { role: "user", content: [{ type: "image", image: "a.png" }, { type: "text", text: "What is this?" }] },
        { role: "assistant", content: "A cat." },
        { role: "tool", content: "42" },
        { role: "user", content: [{ type: "image_url", image_url: { url: "x" } }, { type: "text", text: "and" }, { type: "image", image: "b.png" }] },
      ],
    });
    expect(got).toBe("<|im_system|>system<|im_middle|>Be brief.<|im_end|>" +
      `<|im_user|>user<|im_middle|>${media}What is this?<|im_end|>` +
      "<|im_assistant|>assistant<|im_middle|>A cat.<|im_end|>" +
      "tool<|im_middle|>42<|im_end|>" +
      `<|im_user|>user<|im_middle|>${media}and${media}<|im_end|>`);
  });
});
