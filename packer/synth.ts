/**
 * synth.ts — `kvl synth`: random-weight checkpoints in the official Kimi-VL layout.
 *
 * Owns: the tiny/full preset configs, the per-tensor weight statistics, the deterministic shard
 * plan, and writing a complete checkpoint directory (config, shards + index, processor and
 * tokenizer assets). Weights come from the core's generator (numpy's PCG64, seeded per tensor from
 * sha256("kvl-synth/{seed}/{name}")), so any tensor, in any order, on either backend, is the same
 * bytes the earlier Python synthesizer wrote (test/fixtures/python-packer-sha256.json).
 * Does not own: names and shapes (host/pack/model-spec.ts), the safetensors format
 * (packer/safetensors.ts), tokenizer assets (synth-tokenizer.ts).
 *
 * Weights are uniform with the std a sensible init would use: activations stay O(1) through every
 * layer (residual-branch outputs damped), router bias non-zero, logits spread (std ~5) so greedy
 * decoding is not decided by near-ties. A full-size (16.4e9 parameter) checkpoint streams to disk
 * tensor by tensor in 4 Mi-element chunks: memory stays at one chunk.
 */
import { createHash } from "node:crypto";
import { rmSync, statfsSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import type { PackingCore, Pcg64State } from "../host/core/core-api.js";
import { type Inventory, type TensorInfo, checkSupported, expectedTensors, LM_HEAD, ROUTER_BIAS_SUFFIX, textDims } from "../host/pack/model-spec.js";
import { makeOutputDir } from "../host/system/output-path.js";
import { UserError } from "../host/system/user-error.js";
import { silentProgress, type Progress } from "./progress.js";
import { seedSequenceState } from "../host/core/seed-sequence.js";
import { INDEX_NAME, SafetensorsWriter, writeIndex } from "./safetensors.js";
import { tokenizerAssets } from "./synth-tokenizer.js";
import type { TensorSource } from "./tensor-source.js";

export type Preset = "tiny" | "full";
export const PRESETS: readonly Preset[] = ["tiny", "full"];

const LITERAL_MARK = "kvl-synth-number:";
/**
 * A number spelt as the official config.json spells it where JSON.stringify would spell it
 * otherwise (`800000.0`, `1e-05`, `0.0`; JSON.stringify writes 800000, 0.00001, 0). Every pack
 * embeds config.json verbatim in its indexes, so the synthesized text is kept the official
 * file's: the packs' .idx bytes stay those recorded in test/fixtures/python-packer-sha256.json.
 */
class NumberLiteral {
  constructor(readonly text: string) {}
  toJSON(): string {
    return `${LITERAL_MARK}${this.text}`;
  }
}
const literal = (text: string): NumberLiteral => new NumberLiteral(text);

/** A synthesized checkpoint's JSON file: JSON.stringify with a two-space indent (the official
 * files' layout), NumberLiterals as spelt, then a line feed. */
function checkpointJson(value: unknown): string {
  return `${JSON.stringify(value, null, 2).replace(new RegExp(`"${LITERAL_MARK}([^"]*)"`, "g"), "$1")}\n`;
}

const FULL_TEXT = {
  vocab_size: 163840, hidden_size: 2048, intermediate_size: 11264,
  moe_intermediate_size: 1408, num_hidden_layers: 27, num_attention_heads: 16,
  num_key_value_heads: 16, n_routed_experts: 64, n_shared_experts: 2,
  num_experts_per_tok: 6, first_k_dense_replace: 1, moe_layer_freq: 1, ep_size: 1,
  kv_lora_rank: 512, q_lora_rank: null, qk_nope_head_dim: 128, qk_rope_head_dim: 64,
  v_head_dim: 128, topk_method: "noaux_tc", scoring_func: "sigmoid",
  routed_scaling_factor: 2.446, n_group: 1, topk_group: 1, norm_topk_prob: true,
  aux_loss_alpha: 0.001, seq_aux: true, max_position_embeddings: 131072,
  rope_theta: literal("800000.0"), rope_scaling: null, rms_norm_eps: literal("1e-05"), hidden_act: "silu",
  attention_bias: false, attention_dropout: literal("0.0"), tie_word_embeddings: false,
  bos_token_id: 163584, eos_token_id: 163585, pad_token_id: 163839,
  initializer_range: 0.02, use_cache: true, model_type: "deepseek_v3",
  torch_dtype: "bfloat16",
};
const FULL_VISION = {
  model_type: "moonvit", patch_size: 14, init_pos_emb_height: 64,
  init_pos_emb_width: 64, num_attention_heads: 16, num_hidden_layers: 27,
  hidden_size: 1152, intermediate_size: 4304, merge_kernel_size: [2, 2],
  torch_dtype: "bfloat16",
};
/** Every structural feature of the real model at a few MB: dense layer 0 + 3 MoE layers, shared
 * experts, the real vocabulary size (so the tokenizer ids fit), a pos-emb table small enough that
 * every test image needs resampling. */
const TINY_TEXT = {
  ...FULL_TEXT, hidden_size: 64, intermediate_size: 128, moe_intermediate_size: 32,
  num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4,
  n_routed_experts: 8, n_shared_experts: 2, num_experts_per_tok: 2,
  kv_lora_rank: 32, qk_nope_head_dim: 16, qk_rope_head_dim: 16, v_head_dim: 16,
  max_position_embeddings: 8192,
};
const TINY_VISION = {
  ...FULL_VISION, init_pos_emb_height: 8, init_pos_emb_width: 8,
  num_attention_heads: 4, num_hidden_layers: 3, hidden_size: 64, intermediate_size: 100,
};
const PRESET_PARTS: Record<Preset, { text: typeof FULL_TEXT; vision: typeof FULL_VISION; shards: number }> = {
  tiny: { text: TINY_TEXT, vision: TINY_VISION, shards: 3 },
  full: { text: FULL_TEXT, vision: FULL_VISION, shards: 7 },
};

const PREPROCESSOR_CONFIG = {
  auto_map: {
    AutoImageProcessor: "image_processing_kimi_vl.KimiVLImageProcessor",
    AutoProcessor: "processing_kimi_vl.KimiVLProcessor",
  },
  image_processor_type: "KimiVLImageProcessor",
  processor_class: "KimiVLProcessor",
  patch_size: 14,
  in_token_limit: 4096,
  merge_kernel_size: [2, 2],
  num_pooled_tokens: 1024,
  pad_input: true,
  image_mean: [0.5, 0.5, 0.5],
  image_std: [0.5, 0.5, 0.5],
};

const RESIDUAL_DAMPING = 0.5; // branch outputs (o_proj, down_proj, wo, fc1) add O(0.5) per layer
const LOGIT_STD = 5.0; // lm_head std * sqrt(hidden): greedy picks are not near-ties
const ROUTER_BIAS_STD = 0.3;
const POS_EMB_STD = 1.0;
const SMALL_BIAS_STD = 0.02;
const NORM_HALF_WIDTH = 0.1; // norm weights uniform in 1 +- 0.1
const SQRT3 = Math.sqrt(3.0);
/** Elements generated per step: bounded memory; even, so a tensor's stream never skips a value. */
const CHUNK = 1 << 22;

interface SynthOptions {
  preset: Preset;
  seed: number;
  biasDtype?: "bf16" | "f32";
  nGroup?: number;
  topkGroup?: number;
  core: PackingCore;
  progress?: Progress;
}

/** The complete config.json text of a preset, with optional group-limited routing. */
export function presetConfigText(preset: Preset, nGroup?: number, topkGroup?: number): string {
  const parts = PRESET_PARTS[preset];
  if (!parts) throw new UserError(`unknown preset ${JSON.stringify(preset)}; choose from ${PRESETS.join(", ")}`);
  if ((nGroup === undefined) !== (topkGroup === undefined)) {
    throw new UserError("--n-group and --topk-group go together; pass both");
  }
  const text = nGroup !== undefined && topkGroup !== undefined ? { ...parts.text, n_group: nGroup, topk_group: topkGroup } : parts.text;
  const config = {
    architectures: ["KimiVLForConditionalGeneration"],
    auto_map: {
      AutoConfig: "configuration_kimi_vl.KimiVLConfig",
      AutoModel: "modeling_kimi_vl.KimiVLForConditionalGeneration",
      AutoModelForCausalLM: "modeling_kimi_vl.KimiVLForConditionalGeneration",
    },
    model_type: "kimi_vl",
    media_placeholder_token_id: 163605,
    ignore_index: -100,
    pad_token_id: 0,
    torch_dtype: "bfloat16",
    transformers_version: "4.50.3",
    text_config: text,
    vision_config: parts.vision,
  };
  const configText = checkpointJson(config);
  const problems = checkSupported(JSON.parse(configText) as Record<string, unknown>);
  if (problems.length > 0) throw new UserError(`the requested synthetic config is not runnable: ${problems.join("; ")}`);
  return configText;
}

/** (mean, std) of a tensor's uniform distribution. */
function initStats(name: string, shape: readonly number[], hidden: number): { mean: number; std: number } {
  if (name === LM_HEAD) return { mean: 0, std: LOGIT_STD / Math.sqrt(hidden) };
  if (name.endsWith("embed_tokens.weight")) return { mean: 0, std: 1 };
  if (name.endsWith(ROUTER_BIAS_SUFFIX)) return { mean: 0, std: ROUTER_BIAS_STD };
  if (name.endsWith("pos_emb.weight")) return { mean: 0, std: POS_EMB_STD };
  if (shape.length === 1) {
    const parts = name.split(".");
    if ((parts.at(-2) ?? "").includes("norm") && name.endsWith(".weight")) return { mean: 1, std: NORM_HALF_WIDTH / SQRT3 };
    return { mean: 0, std: SMALL_BIAS_STD };
  }
  const fanIn = shape.slice(1).reduce((a, b) => a * b, 1);
  let std = 1.0 / Math.sqrt(fanIn);
  if (["o_proj.weight", "down_proj.weight", ".wo.weight", "fc1.weight"].some((s) => name.endsWith(s))) std *= RESIDUAL_DAMPING;
  return { mean: 0, std };
}

/** The generator state of one tensor: sha256("kvl-synth/{seed}/{name}")[:16] little-endian as
 * numpy SeedSequence entropy. */
function tensorStream(core: PackingCore, seed: number, name: string): Pcg64State {
  const digest = createHash("sha256").update(`kvl-synth/${seed}/${name}`, "utf8").digest();
  let entropy = 0n;
  for (let i = 15; i >= 0; i--) entropy = (entropy << 8n) | BigInt(digest[i]!);
  return core.pcg64Seed(seedSequenceState(entropy));
}

function tensorBytes(dtype: string, shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1) * (dtype === "F32" ? 4 : 2);
}

/** Splits the inventory (in order) into n contiguous, non-empty, roughly equal-byte groups; the
 * vision tower and projector always land in the first shard, like the real checkpoint. */
export function shardPlan(inventory: Inventory, nShards: number): string[][] {
  const names = [...inventory.keys()];
  if (names.length < nShards) throw new Error("fewer tensors than shards");
  const sizes = names.map((n) => tensorBytes(inventory.get(n)!.dtype, inventory.get(n)!.shape));
  const starts: number[] = [];
  let total = 0;
  for (const s of sizes) {
    starts.push(total);
    total += s;
  }
  const nVision = names.filter((n) => n.startsWith("vision_tower.") || n.startsWith("multi_modal_projector.")).length;
  const bounds = [0];
  for (let k = 1; k < nShards; k++) {
    const target = (total * k) / nShards;
    let i = starts.findIndex((s) => s >= target);
    if (i < 0) i = names.length;
    const lo = Math.max(bounds.at(-1)! + 1, k === 1 ? nVision : 0);
    bounds.push(Math.min(Math.max(i, lo), names.length - (nShards - k)));
  }
  bounds.push(names.length);
  return Array.from({ length: nShards }, (_, k) => names.slice(bounds[k], bounds[k + 1]));
}

/** The non-tensor files of a synthesized checkpoint, by file name. */
function assetFiles(configText: string): Map<string, Uint8Array> {
  return new Map<string, Uint8Array>([
    ["config.json", Buffer.from(configText, "utf8")],
    ["preprocessor_config.json", Buffer.from(checkpointJson(PREPROCESSOR_CONFIG), "utf8")],
    ...tokenizerAssets(),
  ]);
}

/** Generates one tensor's values chunk by chunk: each chunk is passed to `sink` (reused buffer). */
function generate(core: PackingCore, seed: number, name: string, info: TensorInfo, hidden: number,
  buffers: { bf16: Uint16Array; f32: Float32Array }, sink: (bytes: Uint8Array) => void): void {
  const { mean, std } = initStats(name, info.shape, hidden);
  const half = Math.fround(std * SQRT3);
  const state = tensorStream(core, seed, name);
  const count = info.shape.reduce((a, b) => a * b, 1);
  const buf = info.dtype === "F32" ? buffers.f32 : buffers.bf16;
  for (let start = 0; start < count; start += CHUNK) {
    const n = Math.min(CHUNK, count - start);
    core.synthUniform(state, n, mean, half, buf);
    sink(new Uint8Array(buf.buffer, 0, n * buf.BYTES_PER_ELEMENT));
  }
}

function chunkBuffers(): { bf16: Uint16Array; f32: Float32Array } {
  return { bf16: new Uint16Array(CHUNK), f32: new Float32Array(CHUNK) };
}

/**
 * A TensorSource over generated weights: nothing is stored, each read regenerates the tensor (the
 * same bytes a synthesized checkpoint directory holds). `kvl pack --synth-preset` packs from it
 * without writing the 33 GB checkpoint first.
 */
export class SynthSource implements TensorSource {
  readonly #configText: string;
  readonly #inventory: Inventory;
  readonly #hidden: number;
  readonly #buffers = chunkBuffers();

  constructor(readonly options: Omit<SynthOptions, "progress">) {
    this.#configText = presetConfigText(options.preset, options.nGroup, options.topkGroup);
    const config = JSON.parse(this.#configText) as unknown;
    this.#inventory = expectedTensors(config, (options.biasDtype ?? "bf16").toUpperCase());
    this.#hidden = textDims(config).hidden_size;
  }

  config(): unknown {
    return JSON.parse(this.#configText);
  }

  async assetFiles(): Promise<ReadonlyMap<string, Uint8Array>> {
    return assetFiles(this.#configText);
  }

  revision(): string | null {
    return null;
  }

  tensorNames(): string[] {
    return [...this.#inventory.keys()];
  }

  tensorInfo(name: string): TensorInfo {
    const info = this.#inventory.get(name);
    if (!info) throw new UserError(`tensor ${name} is not part of this synthetic model`);
    return info;
  }

  shardOf(): string | null {
    return null;
  }

  async read(name: string): Promise<Uint8Array> {
    const info = this.tensorInfo(name);
    const out = new Uint8Array(info.shape.reduce((a, b) => a * b, 1) * (info.dtype === "F32" ? 4 : 2));
    let at = 0;
    generate(this.options.core, this.options.seed, name, info, this.#hidden, this.#buffers, (bytes) => {
      out.set(bytes, at);
      at += bytes.length;
    });
    return out;
  }
}

/** Writes a complete random checkpoint directory and returns its path. */
export async function synthesize(outDir: string, options: SynthOptions): Promise<string> {
  const { preset, seed, core } = options;
  const biasDtype = options.biasDtype ?? "bf16";
  if (biasDtype !== "bf16" && biasDtype !== "f32") throw new UserError(`--bias-dtype ${String(biasDtype)}: choose bf16 or f32`);
  if (!Number.isSafeInteger(seed) || seed < 0) throw new UserError(`--seed must be a non-negative integer, got ${seed}`);
  const configText = presetConfigText(preset, options.nGroup, options.topkGroup);
  const config = JSON.parse(configText) as Record<string, unknown>;
  const inventory = expectedTensors(config, biasDtype.toUpperCase());
  const hidden = textDims(config).hidden_size;
  const nShards = PRESET_PARTS[preset].shards;
  const plan = shardPlan(inventory, nShards);
  let total = 0;
  for (const { dtype, shape } of inventory.values()) total += tensorBytes(dtype, shape);

  makeOutputDir(outDir, "OUT");
  // A stale index would make a half-rewritten directory look complete.
  rmSync(join(outDir, INDEX_NAME), { force: true });
  const fs = statfsSync(outDir);
  const free = fs.bavail * fs.bsize;
  if (free < total + 64 * 2 ** 20) {
    throw new UserError(`${outDir} has ${(free / 2 ** 30).toFixed(1)} GiB free but the ${preset} checkpoint ` +
      `needs ${(total / 2 ** 30).toFixed(1)} GiB; choose another folder`);
  }
  const progress = options.progress ?? silentProgress;
  progress.start(`kvl synth ${preset}`, total);
  const buffers = chunkBuffers();
  const weightMap = new Map<string, string>();
  try {
    for (let k = 0; k < plan.length; k++) {
      const names = plan[k]!;
      const file = `model-${String(k + 1).padStart(5, "0")}-of-${String(nShards).padStart(5, "0")}.safetensors`;
      const writer = new SafetensorsWriter(join(outDir, file), names.map((n) => ({ name: n, ...inventory.get(n)! })));
      try {
        for (const name of names) {
          writer.begin(name);
          generate(core, seed, name, inventory.get(name)!, hidden, buffers, (bytes) => {
            writer.append(bytes);
            progress.add(bytes.length);
          });
        }
        writer.close();
      } catch (err) {
        writer.abort();
        throw err;
      }
      for (const n of names) weightMap.set(n, file);
    }
  } finally {
    progress.stop();
  }
  for (const [file, data] of assetFiles(configText)) writeFileSync(join(outDir, file), data);
  // Index last: a directory with an index has all its shards.
  writeIndex(outDir, new Map([...inventory.keys()].map((n) => [n, weightMap.get(n)!])), total);
  return outDir;
}
