/**
 * core-bytes.ts — the mirror of the C core's byte rules: what one engine (one layer range) and,
 * on WebAssembly, its instance allocate, derived from the pack before anything is allocated.
 * Kept in step with wasm-core/src: engine.c (load_text: the global block, the forward-order trunk
 * walk with its double-buffered stream, the expert cache and its readers; i16_slot_bytes),
 * model.c (kvl_session_layout_compute, per activation mode: the integer modes' int16 trunk rows
 * with per-row scales, the quantised-input workspace, the int16 KV cache), expert_cache.c (its blocks), store.c (large blocks' alignment), vision.c (a vision
 * call's working memory), and model_state.h (the session struct); test/planner.test.ts proves
 * the mirror exact against what engines report on both backends for 1, 2 and 3 ranges.
 *
 * Owns: what the planner reads of a pack (PackFacts) and the model as the byte rules see it;
 * per range its globals, trunk slots, streaming buffers, expert cache, session arena and KV,
 * threads, and on WebAssembly the instance's runtime (static data, thread stacks, alignment,
 * indexes), the host's per-call buffers in it, and its memory (64 KiB pages, the module's
 * minimum); the vision call's working memory for the largest image preprocessing lets through
 * (largestGrid).
 * Does not own: the process around the engines, how ranges share the caches, or choosing any
 * figure (planner.ts).
 *
 * Measured inside a WebAssembly instance (node 20.20.2, linux-x64, emscripten 3.1.6; the
 * "instance" scenario of bench/node-overhead.mjs, probing malloc): a fresh instance's heap starts
 * at 1,071,080 bytes (static data + the 1 MiB main stack of -sTOTAL_STACK=1MB):
 * WASM_STATIC_BYTES 1.125 MiB. Every thread an engine starts (pool workers, 4 expert readers,
 * the trunk stream thread) takes a 2 MiB stack from the heap (emscripten's
 * DEFAULT_PTHREAD_STACK_SIZE, not TOTAL_STACK) plus about 1.3 KiB: measured 2.0 MiB per thread,
 * so PTHREAD_STACK_BYTES + PTHREAD_EXTRA_BYTES. Beyond its threads an engine took 29 KiB
 * (indexes, tables). Its large blocks (globals, trunk cache, the expert cache's blocks of at most
 * 1 GiB) are aligned to 4 KiB on WebAssembly (store.c kvl_large_alloc: no huge pages there): up
 * to that much each can be left in fragments (LARGE_ALIGN_BYTES each).
 */
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";

import { type ActDtype, type BackendName, type KvDtype, isIntegerAct } from "../core/core-api.js";
import { ROPE_GRID_LIMIT } from "../image/image-budget.js";
import { DTYPE_BF16, PackReader } from "../pack/pack-format.js";
import { UserError } from "../system/user-error.js";

export const MIB = 2 ** 20;
const KIB = 1024;
const PAGE = 4096;
export const WASM_PAGE = 65536;
const ARENA_ALIGN = 64; // model.c

const WASM_STATIC_BYTES = 1152 * KIB;
const PTHREAD_STACK_BYTES = 2 * MIB;
const PTHREAD_EXTRA_BYTES = 16 * KIB;
const LARGE_ALIGN_BYTES = 4 * KIB;
/** wasm-core/src/expert_cache.c KVL_CACHE_BLOCK_BYTES: the expert cache's largest block. */
const EXPERT_BLOCK_BYTES = 2 ** 30;
/**
 * The smallest memory an instance links with: build-wasm.sh's -sINITIAL_MEMORY=64MB is the
 * module's declared initial size, and an imported memory below it fails to instantiate
 * ("memory import is smaller than initial"), whatever WasmBackend.create accepts.
 */
export const WASM_MIN_INSTANCE_BYTES = 64 * MIB;
/** Malloc headers and the engine's small structs (hparams, layer tables, cache bookkeeping). */
const ALLOCATOR_SLACK_BYTES = 256 * KIB;
/** The expert cache's readers (engine.c load_text) and the trunk stream thread. */
const EXPERT_READER_THREADS = 4;
/**
 * sizeof(struct kvl_session) (model_state.h), which kvl_session_bytes adds to the arena:
 * wasm32 has 4-byte pointers and size_t, x86-64 (Linux and Windows) 8-byte ones. The tests
 * compare these with sessionBytes on both backends.
 */
const SESSION_STRUCT_BYTES: Readonly<Record<BackendName, number>> = { wasm: 168, native: 288 };

/** One layer's KV cache for C positions (model.c kvl_session_layout_compute, kv_i16_layer_bytes). */
function kvLayerBytes(kvDtype: KvDtype, C: number, lat: number, rope: number): number {
  if (kvDtype === "i16") {
    return alignTo(C * (lat + rope) * 2, ARENA_ALIGN) + alignTo(C * 4, ARENA_ALIGN) + alignTo(Math.ceil(C / ATTN_I16_TILE) * ATTN_I16_TILE * lat * 2, ARENA_ALIGN);
  }
  return C * (lat + rope) * (kvDtype === "bf16" ? 2 : 4);
}

const LAYER = (l: number): string => `language_model.model.layers.${l}.`;
const ATTENTION = ["self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"];
const MLP = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"];

const alignTo = (n: number, a: number): number => Math.ceil(n / a) * a;
const alignPage = (n: number): number => alignTo(n, PAGE);
/** engine.c i16_slot_bytes: a resident Linear weight with an integer --act-dtype (int16 rows, then
 * a 4-byte scale per row, in one page-aligned slot). */
const i16Slot = (nbytes: number, rows: number): number => alignPage(alignTo(nbytes, 64) + 4 * rows);
/** model.c MM_MAX_SEGS: products per pool run. */
const MM_MAX_SEGS = 50;
/** model.c MM_MAX_SEGS * XQ_ALIGN: the act_i16 workspace's alignment allowance. */
const I16_WORKSPACE_SLACK = MM_MAX_SEGS * 32;
/** kernels.h KVL_I16_BLOCK: columns per activation scale of the Q8 integer product. */
const I16_BLOCK = 64;
/** model.c ATTN_I16_TILE: positions per tile of an i16 KV cache's transposed int16 latents
 * (--act-dtype i16x1 and i8, attn_i16). */
const ATTN_I16_TILE = 128;

/** MiB with one decimal and thousands separators ("1,234.5"). */
export function mib(n: number): string {
  return (n / MIB).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
}

// ---------------------------------------------------------------------------------------------
// Pack facts

/** What the planner reads of a pack: nothing is allocated from it. */
export interface PackFacts {
  readonly packDir: string;
  readonly hparams: ReadonlyMap<string, number>;
  /** Trunk records by name (nbytes; for the integer --act-dtype modes the dtype and rows shape[0] too). */
  readonly trunk: ReadonlyMap<string, { readonly nbytes: number; readonly shape: readonly number[]; readonly dtype: number }>;
  readonly expertRecords: number;
  /** nbytes of the first expert record (all have one size and dtype; the engine checks): the
   * expert cache's slot is its pages, a Q8_EXPERT or Q4_EXPERT extent as packed (engine.c reads
   * extents unconverted whatever the activation mode). */
  readonly expertNbytes: number;
  /** The experts' record dtype (pack-format.ts DTYPE_Q8_EXPERT or DTYPE_Q4_EXPERT), 0 without experts. */
  readonly expertDtype: number;
  readonly tokenizerFileBytes: number;
  /** .idx file sizes: the engines parse them into their own memory. */
  readonly indexBytes: Readonly<Record<"trunk" | "experts" | "vision", number>>;
  /** preprocessor_config.json parsed, or the reason it could not be read. */
  readonly preprocessorConfig: { ok: true; value: unknown } | { ok: false; error: string };
}

/** Reads and validates the pack (pack-format.ts's reader) and the files the plan sizes. */
export async function readPackFacts(packDir: string): Promise<PackFacts> {
  const reader = await PackReader.open(packDir);
  const trunk = reader.stores.get("trunk")!;
  const experts = reader.stores.get("experts")!;
  const idx = (name: string): number => statSync(join(packDir, `${name}.idx`)).size;
  let tokenizerFileBytes: number;
  try {
    tokenizerFileBytes = statSync(join(packDir, "tiktoken.model")).size;
  } catch (err) {
    throw new UserError(`${join(packDir, "tiktoken.model")} is missing (${(err as Error).message}); rerun kvl pack`);
  }
  let preprocessorConfig: PackFacts["preprocessorConfig"];
  const prePath = join(packDir, "preprocessor_config.json");
  try {
    preprocessorConfig = { ok: true, value: JSON.parse(readFileSync(prePath, "utf8")) };
  } catch (err) {
    preprocessorConfig = { ok: false, error: `${prePath} unreadable (${(err as Error).message}); rerun kvl pack` };
  }
  return {
    packDir, hparams: reader.hparams, trunk: trunk.byName,
    expertRecords: experts.records.length, expertNbytes: experts.records[0]?.nbytes ?? 0, expertDtype: experts.records[0]?.dtype ?? 0,
    tokenizerFileBytes, indexBytes: { trunk: idx("trunk"), experts: idx("experts"), vision: idx("vision") },
    preprocessorConfig,
  };
}

// Divisors among the hparams: zero would mean a corrupt pack, not an empty model.
const POSITIVE = new Set(["vision.num_attention_heads", "vision.patch_size", "vision.merge_kernel_h", "vision.merge_kernel_w",
  "text.num_attention_heads", "text.num_hidden_layers", "text.hidden_size", "text.vocab_size", "text.moe_layer_freq"]);

/** An integer hparam, in the range the engine accepts (a whole number in 0..2^24). */
function hparam(hp: ReadonlyMap<string, number>, key: string): number {
  const value = hp.get(key);
  if (value === undefined) throw new UserError(`the pack's hparams lack '${key}'; repack with this kvl version`);
  const low = POSITIVE.has(key) ? 1 : 0;
  if (!(value >= low && value <= 2 ** 24) || !Number.isInteger(value)) {
    throw new UserError(`the pack's hparam '${key}' = ${value} is out of range; the pack is corrupt: rerun kvl pack`);
  }
  return value;
}

/** The model as the byte rules see it, derived once per PackFacts. */
export interface Model {
  vocab: number; hidden: number; nLayers: number; heads: number; kvLora: number; rope: number; nope: number; vDim: number;
  nRouted: number; topK: number; nGroup: number; moeInter: number; maxPositions: number;
  moe: boolean[];
  /** intermediate (dense) or n_shared * moe_intermediate (MoE): engine.c's mlp_rows. */
  mlpRows: number[];
  lmHeadPadded: number;
  /** lm_head's slot with an integer --act-dtype (int16 rows and their scales). */
  lmHeadI16: number;
  /** Global bytes of layer l (norms, and on MoE layers the router and its bias). */
  layerGlobals: number[];
  /** Trunk tensors in forward order: padded (a read, a BF16 residency slot) and, with
   * an integer --act-dtype, the residency slot (int16 rows and scales; kv_b_proj stays BF16). */
  order: Array<{ padded: number; i16: number }>;
  /** Index into order of each layer's first tensor; firstOf[nLayers] = order.length. */
  firstOf: number[];
  extent: number;
}

const modelCache = new WeakMap<PackFacts, Model>();

export function modelOf(facts: PackFacts): Model {
  const cached = modelCache.get(facts);
  if (cached) return cached;
  const hp = facts.hparams;
  const g = (k: string): number => hparam(hp, `text.${k}`);
  const m: Model = {
    vocab: g("vocab_size"), hidden: g("hidden_size"), nLayers: g("num_hidden_layers"), heads: g("num_attention_heads"),
    kvLora: g("kv_lora_rank"), rope: g("qk_rope_head_dim"), nope: g("qk_nope_head_dim"), vDim: g("v_head_dim"),
    nRouted: g("n_routed_experts"), topK: g("num_experts_per_tok"), nGroup: g("n_group"), moeInter: g("moe_intermediate_size"),
    maxPositions: g("max_position_embeddings"), moe: [], mlpRows: [], lmHeadPadded: 0, lmHeadI16: 0, layerGlobals: [], order: [], firstOf: [],
    extent: 0,
  };
  const firstDense = g("first_k_dense_replace");
  const freq = g("moe_layer_freq");
  const nShared = g("n_shared_experts");
  const inter = g("intermediate_size");
  const need = (name: string): { nbytes: number; shape: readonly number[]; dtype: number } => {
    const rec = facts.trunk.get(name);
    if (rec === undefined) throw new UserError(`trunk.idx lacks ${name}; rerun kvl pack`);
    return rec;
  };
  const head = need("language_model.lm_head.weight");
  m.lmHeadPadded = alignPage(head.nbytes);
  // engine.c converts BF16 weights only (a Q8 weight runs on the integer product as packed)
  m.lmHeadI16 = head.dtype === DTYPE_BF16 ? i16Slot(head.nbytes, head.shape[0]!) : m.lmHeadPadded;
  const entry = (name: string, linear: boolean): { padded: number; i16: number } => {
    const rec = need(name);
    const padded = alignPage(rec.nbytes);
    return { padded, i16: linear && rec.dtype === DTYPE_BF16 ? i16Slot(rec.nbytes, rec.shape[0]!) : padded };
  };
  const norm = alignTo(m.hidden * 4, 64);
  for (let l = 0; l < m.nLayers; l++) {
    const moe = m.nRouted > 0 && l >= firstDense && l % freq === 0;
    m.moe.push(moe);
    const rows = moe ? nShared * m.moeInter : inter;
    m.mlpRows.push(rows);
    let globals = 2 * norm + alignTo(m.kvLora * 4, 64);
    if (moe) globals += alignPage(need(`${LAYER(l)}mlp.gate.weight`).nbytes) + alignTo(m.nRouted * 4, 64);
    m.layerGlobals.push(globals);
    m.firstOf.push(m.order.length);
    for (const suffix of ATTENTION) m.order.push(entry(LAYER(l) + suffix, suffix !== "self_attn.kv_b_proj.weight"));
    // engine.c reads the MLP tensors only when the layer has MLP rows
    if (rows > 0) for (const s of MLP) m.order.push(entry(`${LAYER(l)}${moe ? "mlp.shared_experts." : "mlp."}${s}`, true));
  }
  m.firstOf.push(m.order.length);
  if (m.moe.some(Boolean)) {
    if (facts.expertRecords === 0) throw new UserError(`${facts.packDir}/experts.idx holds no experts; rerun kvl pack`);
    m.extent = alignPage(facts.expertNbytes);
  }
  modelCache.set(facts, m);
  return m;
}

/** What a resident trunk tensor takes with this activation mode (engine.c's tt->slot). */
export const slotOf = (t: { padded: number; i16: number }, actDtype: ActDtype): number => (isIntegerAct(actDtype) ? t.i16 : t.padded);

/** The cacheable trunk tensors' resident sizes in the engine's forward order (engine.c's walk). */
export function trunkTensorBytes(facts: PackFacts, actDtype: ActDtype = "f32"): number[] {
  return modelOf(facts).order.map((t) => slotOf(t, actDtype));
}

/** The session arena of a range as model.c's kvl_session_layout_compute lays it out (KV first). */
export function sessionLayoutBytes(m: Model, range: readonly [number, number], maxContext: number, maxBatch: number, kvDtype: KvDtype,
  nThreads: number, actDtype: ActDtype): { total: number; kv: number } {
  const [begin, end] = range;
  const B = Math.min(maxBatch, maxContext);
  const C = maxContext;
  const { hidden: H, heads: nh, kvLora: lat, rope: r } = m;
  const kvRow = lat + r;
  let width = 1;
  for (let l = begin; l < end; l++) width = Math.max(width, m.mlpRows[l]! + (m.moe[l] ? m.moeInter : 0));
  const i16Width = Math.max(2 * H, nh * m.vDim, width, lat);
  const scores = nh * C;
  const routing = 3 * m.nRouted + m.nGroup + 4;
  const tiled = lat * nh + Math.floor((lat * m.nope + 1) / 2);
  // attn_i16 (an i16 cache): a block's quantised queries and one tile's probabilities, with their scales
  const attnI16 = kvDtype === "i16";
  const i16Attn = attnI16 ? alignTo(Math.floor((nh * kvRow + 1) / 2), 4) + 2 * alignTo(nh, 4) + nh * ATTN_I16_TILE / 2 : 0;
  const perThread = alignTo(Math.max(scores, routing) + 2 * kvRow + r + tiled + i16Attn, 16);
  const kv = (end - begin) * kvLayerBytes(kvDtype, C, lat, r);
  const sizes = [
    kv,
    B * H * 4, B * H * 4, // x, xn
    B * nh * (m.nope + r) * 4, B * kvRow * 4, // q, a
    B * nh * kvRow * 4, B * nh * lat * 4, // q absorbed + rope, context
    B * nh * m.vDim * 4, // o
    B * width * 4, B * width * 4, // gate, up
    B * m.nRouted * 4, B * m.topK * 4, // router logits, weights
    B * H * 4, B * H * 4, B * H * 4, // moe out, xg, yg
    nThreads * perThread * 4, // per-thread scratch
    B * m.topK * 4, (m.nRouted + 1) * 4, B * m.topK * 4, m.nRouted * 4, // expert lists
    H * 2, // one embedding row
    attnI16 ? 0 : lat * C * 4, // latents transposed
    // an integer --act-dtype (model.c act_workspace): one pool run's quantised inputs (int16)
    // and their scales (one per I16_BLOCK columns for Q8 weights, one per vector for int16 ones)
    isIntegerAct(actDtype) ? 2 * (B * i16Width + I16_WORKSPACE_SLACK) : 0,
    isIntegerAct(actDtype) ? 4 * (B * (Math.ceil(i16Width / I16_BLOCK) + 2) + MM_MAX_SEGS) : 0,
    attnI16 ? lat * 4 : 0, // the latent tiles' row scales (ones)
  ];
  return { total: sizes.reduce((t, s) => t + alignTo(s || 1, ARENA_ALIGN), 0), kv };
}

// ---------------------------------------------------------------------------------------------
// Vision

export function configInt(config: Record<string, unknown>, key: string): number {
  const value = config[key];
  if (typeof value !== "number" || !Number.isInteger(value) || value <= 0) {
    throw new UserError(`preprocessor_config.json: '${key}' must be a positive integer, got ${JSON.stringify(value)}; ` +
      "the pack's preprocessor_config.json looks damaged");
  }
  return value;
}

const gridCache = new Map<string, [number, number]>();

/**
 * The patch grid (rows, cols) with the most patches that preprocessing lets through for one image
 * (an exhaustive search over the sizes preprocessing can produce): vision working memory grows
 * with the patch count, and thin images gain the most padding after the downscale (for the
 * official config 12 x 446 = 5352 patches, against 66 x 66 for 1024 x 1024). Cached per config.
 */
export function largestGrid(preprocessorConfig: unknown, merge: readonly [number, number]): [number, number] {
  if (typeof preprocessorConfig !== "object" || preprocessorConfig === null || Array.isArray(preprocessorConfig)) {
    throw new UserError("preprocessor_config.json is not a JSON object; rerun kvl pack");
  }
  const config = preprocessorConfig as Record<string, unknown>;
  const patch = configInt(config, "patch_size");
  const limit = configInt(config, "in_token_limit");
  const pad = Boolean(config.pad_input ?? false);
  const [mh, mw] = merge;
  const key = `${patch}/${limit}/${pad}/${mh}/${mw}`;
  const hit = gridCache.get(key);
  if (hit) return [...hit];
  const unitW = patch * mw;
  const unitH = patch * mh;
  // Sizes past ~ROPE_GRID_LIMIT * patch * 1.25 per side either exceed the RoPE bound or are
  // downscaled to shapes smaller sizes reach (resizing keeps the aspect ratio).
  const top = Math.floor((ROPE_GRID_LIMIT * patch * 5) / 4);
  let best = 0;
  let bestGrid: [number, number] = [mh, mw];
  const gridOf = (n: number, unit: number, merge: number): number =>
    pad ? Math.ceil(n / unit) * merge : Math.floor(Math.floor(n / patch) / merge) * merge;
  for (let height = 1; height <= top; height++) {
    const rows = Math.floor(height / patch);
    // widths in blocks of equal floor(width / patch): one patch count, so one scale and one
    // scaled height per block, and the grid's width grows with the width inside a block, so the
    // block's best is its widest valid width (the same grid as its first width with that many
    // cells, which a search over every width in ascending order keeps)
    for (let block = 0; block * patch <= top; block++) {
      const patches = block * rows;
      const scale = patches > limit ? Math.sqrt(limit / Math.max(patches, 1)) : 1;
      const newH = patches > limit ? Math.trunc(height * scale) : height;
      if (newH <= 0) continue;
      const gridH = gridOf(newH, unitH, mh);
      if (gridH >= ROPE_GRID_LIMIT) continue;
      const lo = Math.max(block * patch, 1);
      for (let width = Math.min(block * patch + patch - 1, top); width >= lo; width--) {
        const newW = patches > limit ? Math.trunc(width * scale) : width;
        if (newW <= 0) break;
        const gridW = gridOf(newW, unitW, mw);
        if (gridW >= ROPE_GRID_LIMIT) continue;
        if (gridW * gridH > best) {
          best = gridW * gridH;
          bestGrid = [gridH, gridW];
        }
        break;
      }
    }
  }
  gridCache.set(key, bestGrid);
  return [...bestGrid];
}

/** KVL_GEMM_WORK_FLOATS of wasm-core/src/kernels/kernels.h: the larger of the FP32 tiles' panels
 * (KC x NC + MC x KC + the largest tile) and kvl_gemm_bf16_amx's blocks. */
const GEMM_WORK_FLOATS = Math.max(128 * 1536 + 96 * 128 + 512, 512 * 768 + 32 * 768 + 1024);
/** The largest gemm_mr x gemm_nr tile of any kernel table (avx512's 12 x 32): vision.c sizes
 * attention's panels with the running table's, so the largest is the estimate's. */
const GEMM_MR_MAX = 12;
const GEMM_NR_MAX = 32;

/**
 * vision.c make_plan's scratch_floats_per_thread for an image of `len` tokens and heads of `hd`:
 * the larger of its FP32 attention (a head's keys and values as panels, a work item's
 * ATTN_QUERIES = 96 queries, one panel's scores and probabilities for ATTN_KEYS = 256 keys, the
 * outputs and softmax state), the AMX attention's (kernels_gemm.c kvl_attn_amx_kv_words +
 * kvl_attn_amx_work_floats: KVL_ATTN_AMX_QUERIES = 96, KVL_ATTN_AMX_KEYS = 512) and the products'
 * work buffer.
 */
function visionScratchFloats(len: number, hd: number): number {
  const hdv = alignTo(hd, GEMM_NR_MAX);
  const fp32 = alignTo(len, GEMM_NR_MAX) * hd + len * hdv + 96 * hd + 2 * GEMM_MR_MAX * 256 + 96 * hdv + 2 * 96;
  const hp = alignTo(hd, 32);
  const amx = alignTo(len, 32) * hp + 96 * (hp / 2 + hp + 2) + (32 * 512 * 3) / 2;
  return Math.max(fp32, amx, GEMM_WORK_FLOATS);
}

/**
 * Working memory of one vision call (largest weight phase + FP32 activations), the shape of
 * wasm-core/src/vision.c's layout; the engine's
 * kvl_vision_bytes replaces it once open.
 */
function visionCallEstimate(hp: ReadonlyMap<string, number>, patches: number, nThreads: number): number {
  const g = (k: string): number => hparam(hp, `vision.${k}`);
  const d = g("hidden_size");
  const inter = g("intermediate_size");
  const p = g("patch_size");
  const width = d * g("merge_kernel_h") * g("merge_kernel_w");
  const textHidden = hparam(hp, "text.hidden_size");
  const bf16 = (n: number): number => alignPage(2 * n);
  const embed = bf16(d * 3 * p * p) + bf16(d) + bf16(g("init_pos_emb_height") * g("init_pos_emb_width") * d);
  const block = 6 * bf16(d) + bf16(3 * d * d) + bf16(3 * d) + bf16(d * d) + bf16(inter * d) + bf16(inter) + bf16(d * inter);
  const proj = Math.max(4 * bf16(d) + bf16(width * width) + bf16(width), bf16(textHidden * width));
  const headDim = Math.floor(d / g("num_attention_heads"));
  // + each thread's scratch: attention's panels or the blocked GEMM's (visionScratchFloats)
  const activations = 4 * (2 * patches * d + patches * Math.max(3 * d, inter) + patches * headDim + nThreads * visionScratchFloats(patches, headDim) + 9 * d + inter + width);
  return Math.max(embed, block, proj) + activations;
}

/**
 * The largest image's vision bytes with vision loaded: its patch grid; what the host holds in JS
 * around the call (the pixels and one image's embeddings); and what the call takes where the
 * engine runs (on WebAssembly its page-aligned working memory plus the host's pixels and
 * embeddings copied into the instance; natively the working memory, the addon reading the
 * host's arrays).
 */
export function visionBytes(facts: PackFacts, backend: BackendName, nThreads: number): { grid: [number, number]; host: number; inInstance: number } {
  if (!facts.preprocessorConfig.ok) throw new UserError(facts.preprocessorConfig.error);
  const merge: [number, number] = [hparam(facts.hparams, "vision.merge_kernel_h"), hparam(facts.hparams, "vision.merge_kernel_w")];
  const grid = largestGrid(facts.preprocessorConfig.value, merge);
  const patches = grid[0] * grid[1];
  const patch = hparam(facts.hparams, "vision.patch_size");
  const host = 4 * (patches * 3 * patch * patch + Math.floor(patches / (merge[0] * merge[1])) * hparam(facts.hparams, "text.hidden_size"));
  return { grid, host, inInstance: visionInInstanceBytes(backend, visionCallEstimate(facts.hparams, patches, nThreads), host) };
}

/** A vision call's bytes where the engine runs, from its working memory (the estimate, or the
 * engine's kvl_vision_bytes) and the host's copies (see visionBytes). */
export function visionInInstanceBytes(backend: BackendName, callBytes: number, hostBytes: number): number {
  return backend === "wasm" ? alignPage(callBytes) + PAGE + hostBytes : callBytes;
}

// ---------------------------------------------------------------------------------------------
// One range's engine and instance

/** What one range's engine (and on WebAssembly its instance) is planned with. */
interface RangeSpec {
  readonly backend: BackendName;
  readonly range: readonly [number, number];
  /** Resident trunk tensors: the forward-order prefix of the model's order this long. */
  readonly prefix: number;
  /** Expert cache slots (whole extents) of this range. */
  readonly expertSlots: number;
  /** sessionLayoutBytes of this range. */
  readonly layout: { readonly total: number; readonly kv: number };
  readonly threads: number;
  readonly actDtype: ActDtype;
  readonly loadVision: boolean;
  readonly maxBatch: number;
  readonly maxContext: number;
  /** The vision call's bytes in this range's instance (visionBytes inInstance; 0 but on the first range). */
  readonly vision: number;
}

/** One range's bytes by the core's rules (planner.ts InstancePlan's figures). */
interface RangeBytes {
  globals: number;
  trunkCache: number;
  trunkCacheable: number;
  expertCache: number;
  engineWorkspace: number;
  kv: number;
  sessionArena: number;
  runtime: number;
  scratch: number;
  vision: number;
  expertExtent: number;
  threads: number;
  memoryBytes: number;
  padding: number;
}

export function rangeBytes(facts: PackFacts, m: Model, a: RangeSpec): RangeBytes {
  const wasm = a.backend === "wasm";
  const B = Math.min(a.maxBatch, a.maxContext);
  const H = m.hidden;
  const V = m.vocab;
  const [begin, end] = a.range;
  const first = begin === 0;
  const last = end === m.nLayers;
  let globals = last ? (isIntegerAct(a.actDtype) ? m.lmHeadI16 : m.lmHeadPadded) + alignTo(H * 4, 64) : 0;
  for (let l = begin; l < end; l++) globals += m.layerGlobals[l]!;
  const lo = m.firstOf[begin]!;
  const hi = m.firstOf[end]!;
  let resident = 0;
  let cacheable = 0;
  let maxStreamed = 0;
  for (let i = lo; i < hi; i++) {
    const t = m.order[i]!;
    const slot = slotOf(t, a.actDtype);
    cacheable += slot;
    if (i < a.prefix) resident += slot;
    else maxStreamed = Math.max(maxStreamed, t.padded); // streamed as read: BF16
  }
  const workspace = 2 * maxStreamed;
  const expertCache = a.expertSlots * m.extent;
  const hasMoe = m.moe.slice(begin, end).some(Boolean);
  const { total: arena, kv } = a.layout;
  const sessionBytes = arena + SESSION_STRUCT_BYTES[a.backend];
  const threads = a.threads - 1 + (hasMoe ? EXPERT_READER_THREADS : 0) + (maxStreamed > 0 ? 1 : 0);
  const indexes = 2 * (facts.indexBytes.trunk + facts.indexBytes.experts + (first && a.loadVision ? facts.indexBytes.vision : 0));
  const bookkeeping = indexes + 16 * m.nLayers * Math.max(m.nRouted, 1) + ALLOCATOR_SLACK_BYTES;
  let runtime = bookkeeping;
  let scratch = 0;
  if (wasm) {
    // expert_cache.c allocates its slots in blocks of at most EXPERT_BLOCK_BYTES (whole slots)
    const slotsPerBlock = hasMoe ? Math.max(1, Math.floor(EXPERT_BLOCK_BYTES / m.extent)) : 1;
    const expertBlocks = expertCache > 0 ? Math.ceil(Math.round(expertCache / m.extent) / slotsPerBlock) : 0;
    const large = 1 + (resident > 0 ? 1 : 0) + expertBlocks;
    runtime += WASM_STATIC_BYTES + threads * (PTHREAD_STACK_BYTES + PTHREAD_EXTRA_BYTES) + large * LARGE_ALIGN_BYTES +
      (maxStreamed > 0 ? 2 * PAGE : 0);
    // wasm-engine.ts: the session's step logits (last range) and cancel flag stay allocated;
    // one call copies its input (tokens on the first range, else hidden states), media rows
    // (first range) and its output (hidden states, or on the last range one token's logits)
    // through the instance; the sampler (the last instance's) takes 32 + 8 x vocab bytes
    const input = first ? B * 4 : B * H * 4;
    const media = first && a.loadVision ? B * H * 4 : 0;
    const output = last ? V * 4 : B * H * 4;
    const call = Math.max(input + media + output, last ? 32 + 8 * V : 0);
    scratch = (last ? V * 4 : 0) + 8 + call;
  }
  const parts = globals + resident + expertCache + workspace + sessionBytes + runtime + scratch + a.vision;
  const memoryBytes = wasm ? Math.max(alignTo(parts, WASM_PAGE), WASM_MIN_INSTANCE_BYTES) : parts;
  const padding = memoryBytes - parts;
  runtime += padding;
  return {
    globals, trunkCache: resident, trunkCacheable: cacheable, expertCache, engineWorkspace: workspace, kv, sessionArena: sessionBytes - kv,
    runtime, scratch, vision: a.vision, expertExtent: hasMoe ? m.extent : 0, threads, memoryBytes, padding,
  };
}
