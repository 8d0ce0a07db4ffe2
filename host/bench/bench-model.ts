/**
 * bench-model.ts — the byte accounting of `kvl bench`: what one token must move through RAM and
 * read from the SSD, from the pack's own index, and the lower bounds (time = bytes / bandwidth)
 * each measurement is compared with.
 *
 * Owns: PackBytes (packBytes reads it from trunk.idx, experts.idx and the hparams), and the bound
 * arithmetic that fills the measured records (promptBounds, decodeBounds, adjacentBounds). Does
 * not own: measuring anything (bench-run.ts times, bench-limits.ts measures bandwidth).
 *
 * Per decoded token, context T:
 *   RAM = every trunk tensor except embed_tokens (lm_head, attention, norms, dense MLP, routers,
 *         shared experts; stored bytes) + one embed_tokens row + num_experts_per_tok routed
 *         expert extents per MoE layer (data bytes, not the 4 KiB padding) + the KV history read
 *         by attention (n_layers x T x (kv_lora_rank + qk_rope_head_dim) x KV element bytes).
 *   SSD = measured: the engine's expert_bytes_read + trunk_bytes_read deltas over the decode.
 *   decode bound = max(SSD/token / direct-read BW, RAM/token / DRAM BW); the sum is shown too.
 * First token (prefill of the prompt + picking its first output token), cold engine caches:
 *   SSD = trunk tensors the plan streams + distinct routed experts the prompt routes to x padded
 *         extent; distinct experts = the expert-cache misses of the cold prefill done in one
 *         chunk (the engine reads each (layer, expert) at most once per chunk).
 *   RAM = every trunk tensor except embed_tokens once + distinct experts x extent data bytes +
 *         prompt embedding rows (+ the KV written).
 *   first-token bound = SSD / direct-read BW + RAM / DRAM BW. The FLOP floor (2 x active weights
 *   x prompt tokens / measured FMA peak) goes beside it: long prompts are compute-bound.
 */
import { PackReader } from "../pack/pack-format.js";
import { UserError } from "../system/user-error.js";

export const PAGE = 4096;
const EMBED = "language_model.model.embed_tokens.weight";
const LM_HEAD = "language_model.lm_head.weight";
/** Bytes of one position's cached row in one layer by the engine's kv_dtype (info.kvDtype): f32
 * and bf16 rows; i16 (kvl_core.h KVL_KV_I16) the int16 row, its f32 scale and the latents' int16
 * copy in the transposed tiles. */
export function kvRowBytes(pb: PackBytes, kvDtype: string): number {
  if (kvDtype === "i16") return 2 * pb.kv_row_elems + 4 + 2 * pb.kv_latent_elems;
  return pb.kv_row_elems * (kvDtype === "bf16" ? 2 : 4);
}

/** The pack's byte facts (--json's pack_bytes, snake_case like every --json field). */
export interface PackBytes {
  /** every trunk tensor except embed_tokens (stored bytes) */
  trunk_used: number;
  lm_head: number;
  embed_row: number;
  /** one routed expert's data bytes */
  extent_data: number;
  /** the same padded to 4 KiB (one direct read) */
  extent_padded: number;
  n_moe_layers: number;
  /** the MoE layers, ascending (the official DeepseekV3DecoderLayer rule) */
  moe_layers: number[];
  /** routed experts per MoE layer */
  n_routed: number;
  top_k: number;
  n_layers: number;
  /** kv_lora_rank + qk_rope_head_dim */
  kv_row_elems: number;
  /** kv_lora_rank */
  kv_latent_elems: number;
  n_extents: number;
  /** weights a token multiplies (no embed, no lm_head), for FLOPs */
  active_weight_elems: number;
  hidden: number;
  vocab: number;
}

function decodeRam(pb: PackBytes, context: number, kvRow: number): number {
  const kv = pb.n_layers * context * kvRow;
  return pb.trunk_used + pb.embed_row + pb.n_moe_layers * pb.top_k * pb.extent_data + kv;
}

function prefillRam(pb: PackBytes, tokens: number, distinct: number, kvRow: number): number {
  const kv = pb.n_layers * tokens * kvRow;
  return pb.trunk_used + tokens * pb.embed_row + distinct * pb.extent_data + kv;
}

function prefillFlops(pb: PackBytes, tokens: number): number {
  return 2.0 * tokens * pb.active_weight_elems + 2.0 * pb.hidden * pb.vocab;
}

/** MoonViT's shape, as the pack's hparams give it (vision.*), for visionFlops. */
export interface VisionShape {
  hidden: number;
  intermediate: number;
  layers: number;
  patch: number;
  merge: [number, number];
  textHidden: number;
}

/**
 * Multiply-adds x 2 of one image's encode (wasm-core/src/vision.c): the patch embedding, per
 * block the QKV, output and MLP products plus attention's two products over the image's own
 * patches (scores and values: 2 x 2 x patches^2 x hidden), and the projector's two products per
 * merged token. The small ops (norms, GELU, softmax, RoPE) are not counted.
 */
export function visionFlops(v: VisionShape, grid: readonly [number, number]): number {
  const n = grid[0] * grid[1];
  const d = v.hidden;
  const width = d * v.merge[0] * v.merge[1];
  const merged = n / (v.merge[0] * v.merge[1]);
  const embed = 2 * n * d * 3 * v.patch * v.patch;
  const block = 2 * n * (4 * d * d + 2 * d * v.intermediate) + 4 * n * n * d;
  const projector = 2 * merged * (width * width + v.textHidden * width);
  return embed + v.layers * block + projector;
}

/** Reads the pack's indexes (validated by pack-format.ts) into PackBytes. */
export async function packBytes(model: string): Promise<PackBytes> {
  const reader = await PackReader.open(model);
  const hp = reader.hparams;
  const g = (key: string): number => {
    const v = hp.get(`text.${key}`);
    if (v === undefined) throw new UserError(`${model}: the pack's hparams lack 'text.${key}'; rerun kvl pack`);
    return v;
  };
  const trunk = reader.stores.get("trunk")!.records;
  const experts = reader.stores.get("experts")!.records;
  if (experts.length === 0) throw new UserError(`${model}/experts.idx holds no experts; rerun kvl pack`);
  const byName = new Map(trunk.map((r) => [r.name, r]));
  const embed = byName.get(EMBED);
  const lmHead = byName.get(LM_HEAD);
  if (!embed || !lmHead) throw new UserError(`${model}/trunk.idx lacks ${EMBED} or ${LM_HEAD}; rerun kvl pack`);
  const used = trunk.reduce((t, r) => (r.name === EMBED ? t : t + r.nbytes), 0);
  const nLayers = g("num_hidden_layers");
  const moeLayers: number[] = [];
  for (let layer = 0; layer < nLayers; layer++) {
    if (g("n_routed_experts") > 0 && layer >= g("first_k_dense_replace") && layer % Math.max(g("moe_layer_freq"), 1) === 0) moeLayers.push(layer);
  }
  const nMoe = moeLayers.length;
  const elems = (shape: readonly number[]): number => shape.reduce((a, b) => a * b, 1);
  // weights multiplied per token: 2-D trunk matrices except embed/lm_head, routed experts
  const trunkElems = trunk.reduce((t, r) => (r.shape.length === 2 && r.name !== EMBED && r.name !== LM_HEAD ? t + elems(r.shape) : t), 0);
  const expertElems = 3 * g("moe_intermediate_size") * g("hidden_size");
  const ext = experts[0]!;
  return {
    trunk_used: used,
    lm_head: lmHead.nbytes,
    embed_row: Math.floor(embed.nbytes / g("vocab_size")),
    extent_data: ext.nbytes,
    extent_padded: Math.ceil(ext.nbytes / PAGE) * PAGE,
    n_moe_layers: nMoe,
    moe_layers: moeLayers,
    n_routed: g("n_routed_experts"),
    top_k: g("num_experts_per_tok"),
    n_layers: nLayers,
    kv_row_elems: g("kv_lora_rank") + g("qk_rope_head_dim"),
    kv_latent_elems: g("kv_lora_rank"),
    n_extents: experts.length,
    active_weight_elems: trunkElems + nMoe * g("num_experts_per_tok") * expertElems,
    hidden: g("hidden_size"),
    vocab: g("vocab_size"),
  };
}

/** The bandwidths a bound divides by (bench-limits.ts Limits, or adjacent probes). */
interface Bandwidths {
  dram_bytes_per_s: number;
  ssd_bytes_per_s: number;
  fma_flops_per_s?: number | null;
}

/** A timed prompt (bench-run.ts), filled in by promptBounds. */
export interface PromptRecord {
  tokens: number;
  prefill_s: number;
  first_token_s: number;
  prefill_tokens_per_s: number;
  first_token: number;
  ssd_bytes: number;
  expert_misses: number;
  expert_hits: number;
  expert_stall_s: number;
  trunk_bytes_read: number;
  expert_bytes_read: number;
  /** CRC checks of data read for the first time (thread time, summed over threads) and their bytes */
  verify_s: number;
  verify_bytes: number;
  distinct_experts?: number;
  bound_ssd_bytes?: number;
  bound_ram_bytes?: number;
  bound_s?: number;
  ratio?: number;
  flops?: number;
  flop_floor_s?: number;
  ratio_to_max_bound?: number;
}

/** A probe of DRAM and direct-read bandwidth taken next to a decode. */
export interface Probe {
  dram_bytes_per_s: number;
  ssd_bytes_per_s: number;
}

interface AdjacentRecord {
  before: Probe;
  after: Probe;
  dram_bytes_per_s: number;
  ssd_bytes_per_s: number;
  bound_s: number;
  ratio: number;
  ratio_median: number;
}

/** A timed greedy decode (bench-run.ts), filled in by decodeBounds / adjacentBounds. */
export interface LookaheadRecord {
  issued: number;
  used: number;
  wasted: number;
  cancelled: number;
  pending: number;
  hit_rate: number | null;
}

export interface DecodeRecord {
  tokens: number;
  /** the greedy tokens decoded, in order (under --routing uniform or a trace, not the model's) */
  token_ids: number[];
  context_start: number;
  s_per_token_mean: number;
  s_per_token_median: number;
  s_per_token_min: number;
  /** 1 / s_per_token_mean */
  tokens_per_s: number;
  ssd_bytes_per_token: number;
  expert_hit_rate: number | null;
  expert_stall_s_per_token: number;
  /** expert_stall_s_per_token / s_per_token_mean: the share of the step spent waiting for expert reads */
  expert_stall_share: number;
  /** the next layer's predicted experts read ahead during the decode (engine stats deltas,
   * kvl_stats expert_lookahead_*: issued = used + wasted + cancelled + the change in pending),
   * and hit_rate = used / issued (null when none was issued) */
  expert_lookahead: LookaheadRecord;
  trunk_stall_s_per_token: number;
  expert_bytes_read: number;
  trunk_bytes_read: number;
  /** CRC checks of data read for the first time: thread time per token (summed over the threads
   * that checked), its share of the decode step (verify / s_per_token_mean; thread time, so on
   * several threads it can exceed what the step actually lost), and bytes per token */
  verify_s_per_token: number;
  verify_share: number;
  verify_bytes_per_token: number;
  ram_bytes_per_token?: number;
  bound_ssd_s?: number;
  bound_ram_s?: number;
  bound_s?: number;
  bound_sum_s?: number;
  ratio?: number;
  ratio_to_sum?: number;
  adjacent?: AdjacentRecord;
}

/** First-token bound of a timed prompt; cold: every distinct expert comes from the SSD, warm:
 * only the prompt's expert-cache misses do. */
export function promptBounds(p: PromptRecord, pb: PackBytes, lim: Bandwidths, streamedTrunk: number, distinct: number,
  kvRow: number, cold: boolean): void {
  const expertsFromSsd = cold ? distinct : p.expert_misses;
  const ssd = streamedTrunk + expertsFromSsd * pb.extent_padded;
  const ram = prefillRam(pb, p.tokens, distinct, kvRow);
  const bound = ssd / lim.ssd_bytes_per_s + ram / lim.dram_bytes_per_s;
  Object.assign(p, { distinct_experts: distinct, bound_ssd_bytes: ssd, bound_ram_bytes: ram, bound_s: bound, ratio: p.first_token_s / bound });
  if (lim.fma_flops_per_s) {
    const flops = prefillFlops(pb, p.tokens);
    const floor = flops / lim.fma_flops_per_s;
    Object.assign(p, { flops, flop_floor_s: floor, ratio_to_max_bound: p.first_token_s / Math.max(bound, floor) });
  }
}

/** Decode bound at the decode's mean context. */
export function decodeBounds(d: DecodeRecord, pb: PackBytes, lim: Bandwidths, kvRow: number): void {
  const context = d.context_start + (d.tokens + 1) / 2.0;
  const ram = decodeRam(pb, context, kvRow);
  const ssdT = d.ssd_bytes_per_token / lim.ssd_bytes_per_s;
  const ramT = ram / lim.dram_bytes_per_s;
  Object.assign(d, {
    ram_bytes_per_token: ram, bound_ssd_s: ssdT, bound_ram_s: ramT, bound_s: Math.max(ssdT, ramT), bound_sum_s: ssdT + ramT,
    ratio: d.s_per_token_mean / Math.max(ssdT, ramT), ratio_to_sum: d.s_per_token_mean / (ssdT + ramT),
  });
}

/** The decode's ratio against the mean of the probes taken just before and after it (after
 * decodeBounds, which sets ram_bytes_per_token). */
export function adjacentBounds(d: DecodeRecord, before: Probe, after: Probe): void {
  const dram = (before.dram_bytes_per_s + after.dram_bytes_per_s) / 2;
  const ssd = (before.ssd_bytes_per_s + after.ssd_bytes_per_s) / 2;
  const bound = Math.max(d.ssd_bytes_per_token / ssd, d.ram_bytes_per_token! / dram);
  d.adjacent = { before, after, dram_bytes_per_s: dram, ssd_bytes_per_s: ssd, bound_s: bound,
    ratio: d.s_per_token_mean / bound, ratio_median: d.s_per_token_median / bound };
}
