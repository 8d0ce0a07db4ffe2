/**
 * planner.ts — the RAM plan: every resident byte of a running kvl, decided before anything is
 * allocated, and its split into instances (port of kvl/planner.py, extended for the TypeScript
 * host).
 *
 * Owns: the RamPlan (one line per resident component, and per instance its layer range, the
 * options its engine is opened with and, on WebAssembly, its memory size); how many instances
 * (WebAssembly: the fewest, at least the requested --instances, whose memories each fit
 * maxInstanceBytes; native: the requested count); how the expert cache and the trunk cache are
 * shared between the ranges; the automatic trunk cache (whatever the budget leaves, capped at
 * what the trunk can use); refusing a plan over --ram-mib with advice whose every figure was
 * checked by planning again with it; reconciling the plan with what the engines report; the
 * input lines — decoding the largest admitted image, and kvl serve's request bodies — with their
 * limits chosen to fit (section "Image decode and request bodies").
 * Does not own: allocation or opening engines (engine-host.ts), the layer ranges' rule
 * (split-engine.ts layerRanges, used as is), the pack format (pack-format.ts).
 *
 * The byte rules mirrored here are wasm-core/src/engine.c's (load_text: the global block, the
 * forward-order trunk walk with its double-buffered stream, the expert cache) and model.c's
 * (kvl_session_layout_compute), per layer range and activation mode (--act-dtype i16: int16
 * trunk rows with per-row scales, the quantised-input workspace); test/planner.test.ts proves
 * the mirror exact against what engines report on both backends for 1, 2 and 3 ranges.
 *
 * Sharing between ranges: the trunk cache keeps the model's forward-order prefix under the
 * budget (the same tensors a single engine would keep), so each range gets the part of that
 * prefix inside it; the expert cache's whole extents go to ranges in proportion to their MoE
 * layers (at least one layer's top-k each; a dense-only range gets none), handed out one at a
 * time so more budget never takes an extent from any range.
 *
 * Measured constants (node 20.20.2, linux-x64, emscripten 3.1.6), by
 *   node bench/node-overhead.mjs PACK      (after npx tsc -p tsconfig.json)
 * on the tiny pack of `kvl synth --preset tiny` + `kvl pack`: every scenario in fresh processes,
 * five runs each, the largest peak RSS (getrusage maxRSS) kept, since the plan bounds peaks:
 * - NODE_WASM_BYTES: Node with every host module loaded on the main thread (tokenizer and chat
 *   template modules included) and an engine worker_threads worker that loaded what
 *   engine-worker.js imports and created one WebAssembly instance with one pthread worker:
 *   88.6 MiB (a bare Node 20 is 43.9 MiB); 96 MiB.
 * - NODE_NATIVE_BYTES: the same with the native addon loaded instead of an instance: 79.6 MiB;
 *   88 MiB. The addon's threads are native (8 MiB stacks, mostly untouched: an engine with 1 or
 *   33 threads measured the same RSS within 0.3 MiB), so there is no per-thread figure.
 * - PTHREAD_WORKER_BYTES: every emscripten pthread worker is a Node worker with its own isolate:
 *   7.9 MiB each (17 against 1 worker; 8.6 MiB in a separate run of 33 against 1); 9 MiB. An
 *   instance starts WasmBackend.pthreadsForEngine(threads) of them.
 * - INSTANCE_JS_BYTES: an extra instance costs its pthread workers plus 0.8 MiB (three instances
 *   of one worker each against one: 8.7 MiB per instance); 2 MiB.
 * - TOKENIZER_BYTES_PER_FILE_BYTE: the host's Tokenizer (host/text/tokenizer.ts: the tiktoken npm
 *   package, its Rust core in a WebAssembly memory that never shrinks, plus the JS parse of the
 *   file) over the tiny pack's tiktoken.model (163,584 tokens, the real vocabulary size, 2,131,414
 *   bytes): +113.7 to +119.6 MiB peak over bare Node (55.9 to 58.8 bytes per file byte; about 92
 *   MiB once settled); the same ranks with tokens about twice as long (3,775,730 bytes): 53.9 to
 *   54.7 per file byte. 64. (The Python front end measured 19.1, resident.) Engine and tokenizer
 *   in one process peaked at 160.1 MiB, under the 226 MiB these constants give.
 * - The whole: the same bench opens the tiny pack through EngineClient as this planner plans it
 *   (512 tokens, 2 threads, no vision), prefills 200 tokens and steps 32: peak RSS 271.4 to
 *   274.9 MiB on WebAssembly, plan 419.0 MiB (355.0 without the margin); 209.0 to 212.2 MiB on
 *   native, plan 306.3 MiB (242.3 without the margin).
 * - Inside a WebAssembly instance (the bench's "instance" scenario, probing malloc): a fresh
 *   instance's heap starts at 1,071,080 bytes (static data + the 1 MiB main stack of
 *   -sTOTAL_STACK=1MB): WASM_STATIC_BYTES 1.125 MiB. Every thread an engine starts (pool
 *   workers, 4 expert readers, the trunk stream thread) takes a 2 MiB stack from the heap
 *   (emscripten's DEFAULT_PTHREAD_STACK_SIZE, not TOTAL_STACK) plus about 1.3 KiB: measured
 *   2.0 MiB per thread, so PTHREAD_STACK_BYTES + PTHREAD_EXTRA_BYTES. Beyond its threads an engine
 *   took 29 KiB (indexes, tables). Its large blocks (globals, trunk cache, the expert cache's
 *   blocks of at most 1 GiB) are aligned to 4 KiB on WebAssembly (store.c kvl_large_alloc: no
 *   huge pages there): up to that much each can be left in fragments (LARGE_ALIGN_BYTES each).
 * - MARGIN_BYTES: allocator fragmentation, page tables, transient copies (as in Python).
 */
import { availableParallelism } from "node:os";
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";

import { type BackendName, ACT_DTYPE_NAMES, KV_DTYPE_NAMES, defaultKvDtype, hasIntegerKv, isIntegerAct, type ActDtype, type EngineInfo, type KvDtype } from "../core/core-api.js";
import { layerRanges, requestedInstances } from "./instances.js";
import { DTYPE_BF16, PackReader } from "../pack/pack-format.js";
import { UserError } from "../system/user-error.js";
import { MAX_INSTANCE_BYTES, WasmBackend } from "../core/wasm-backend.js";
import { IMAGE_PIXELS_FLOOR, IMAGE_PIXELS_MAX, type ResizeShape, imageDecodeBudget, imageLimitsText } from "../image/image-budget.js";

export const MIB = 2 ** 20;
const KIB = 1024;
const PAGE = 4096;
const WASM_PAGE = 65536;
const ARENA_ALIGN = 64; // model.c

export const NODE_WASM_BYTES = 96 * MIB;
export const NODE_NATIVE_BYTES = 88 * MIB;
export const PTHREAD_WORKER_BYTES = 9 * MIB;
export const INSTANCE_JS_BYTES = 2 * MIB;
export const TOKENIZER_BYTES_PER_FILE_BYTE = 64;
export const MARGIN_BYTES = 64 * MIB;
export const WASM_STATIC_BYTES = 1152 * KIB;
export const PTHREAD_STACK_BYTES = 2 * MIB;
export const PTHREAD_EXTRA_BYTES = 16 * KIB;
export const LARGE_ALIGN_BYTES = 4 * KIB;
/** wasm-core/src/expert_cache.c KVL_CACHE_BLOCK_BYTES: the expert cache's largest block. */
export const EXPERT_BLOCK_BYTES = 2 ** 30;
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
 * sizeof(struct kvl_session) (engine_internal.h), which kvl_session_bytes adds to the arena:
 * wasm32 has 4-byte pointers and size_t, x86-64 (Linux and Windows) 8-byte ones. The tests
 * compare these with sessionBytes on both backends.
 */
export const SESSION_STRUCT_BYTES: Readonly<Record<BackendName, number>> = { wasm: 152, native: 264 };

/** One layer's KV cache for C positions (model.c kvl_session_layout_compute, kv_i16_layer_bytes). */
function kvLayerBytes(kvDtype: KvDtype, C: number, lat: number, rope: number): number {
  if (kvDtype === "i16") {
    return alignTo(C * (lat + rope) * 2, ARENA_ALIGN) + alignTo(C * 4, ARENA_ALIGN) + alignTo(Math.ceil(C / ATTN_I16_TILE) * ATTN_I16_TILE * lat * 2, ARENA_ALIGN);
  }
  return C * (lat + rope) * (kvDtype === "bf16" ? 2 : 4);
}
export const DEFAULT_MAX_BATCH = 256;
/** The official processor rejects grids with >= 512 patches per side (kvl/image.py). */
const ROPE_GRID_LIMIT = 512;

const LAYER = (l: number): string => `language_model.model.layers.${l}.`;
const ATTENTION = ["self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"];
const MLP = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"];

const alignTo = (n: number, a: number): number => Math.ceil(n / a) * a;
const alignPage = (n: number): number => alignTo(n, PAGE);
/** engine.c i16_slot_bytes: a resident Linear weight with --act-dtype i16 (int16 rows, then a
 * 4-byte scale per row, in one page-aligned slot). */
const i16Slot = (nbytes: number, rows: number): number => alignPage(alignTo(nbytes, 64) + 4 * rows);
/** model.c MM_MAX_SEGS: products per pool run. */
const MM_MAX_SEGS = 50;
/** model.c MM_MAX_SEGS * XQ_ALIGN: the act_i16 workspace's alignment allowance. */
const I16_WORKSPACE_SLACK = MM_MAX_SEGS * 32;
/** kernels.h KVL_I16_BLOCK: columns per activation scale of the Q8 integer product. */
const I16_BLOCK = 64;
/** model.c I16_SUB: rows per integer kernel call. */
const I16_SUB_ROWS = 64;
/** model.c ATTN_I16_TILE: positions per tile of an i16 KV cache's transposed int16 latents
 * (--act-dtype i16x1, attn_i16). */
const ATTN_I16_TILE = 128;

/** MiB with one decimal and thousands separators, as Python's f"{n / MIB:,.1f}". */
export function mib(n: number): string {
  return (n / MIB).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
}

// ---------------------------------------------------------------------------------------------
// Pack facts

/** What the planner reads of a pack: nothing is allocated from it. */
export interface PackFacts {
  readonly packDir: string;
  readonly hparams: ReadonlyMap<string, number>;
  /** Trunk records by name (nbytes; for --act-dtype i16 the dtype and rows shape[0] too). */
  readonly trunk: ReadonlyMap<string, { readonly nbytes: number; readonly shape: readonly number[]; readonly dtype: number }>;
  readonly expertRecords: number;
  /** nbytes of the first expert record (all have one size; the engine checks). */
  readonly expertNbytes: number;
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
    expertRecords: experts.records.length, expertNbytes: experts.records[0]?.nbytes ?? 0,
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
interface Model {
  vocab: number; hidden: number; nLayers: number; heads: number; kvLora: number; rope: number; nope: number; vDim: number;
  nRouted: number; topK: number; nGroup: number; moeInter: number; maxPositions: number;
  moe: boolean[];
  /** intermediate (dense) or n_shared * moe_intermediate (MoE): engine.c's mlp_rows. */
  mlpRows: number[];
  lmHeadPadded: number;
  /** lm_head's slot with --act-dtype i16 (int16 rows and their scales). */
  lmHeadI16: number;
  /** Global bytes of layer l (norms, and on MoE layers the router and its bias). */
  layerGlobals: number[];
  /** Trunk tensors in forward order: padded (a read, a BF16 residency slot) and, with
   * --act-dtype i16, the residency slot (int16 rows and scales; kv_b_proj stays BF16). */
  order: Array<{ padded: number; i16: number }>;
  /** Index into order of each layer's first tensor; firstOf[nLayers] = order.length. */
  firstOf: number[];
  extent: number;
}

const modelCache = new WeakMap<PackFacts, Model>();

function modelOf(facts: PackFacts): Model {
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
const slotOf = (t: { padded: number; i16: number }, actDtype: ActDtype): number => (isIntegerAct(actDtype) ? t.i16 : t.padded);

/** The cacheable trunk tensors' resident sizes in the engine's forward order (engine.c's walk). */
export function trunkTensorBytes(facts: PackFacts, actDtype: ActDtype = "f32"): number[] {
  return modelOf(facts).order.map((t) => slotOf(t, actDtype));
}

/** The session arena of a range as model.c's kvl_session_layout_compute lays it out (KV first). */
function sessionLayoutBytes(m: Model, range: readonly [number, number], maxContext: number, maxBatch: number, kvDtype: KvDtype,
  nThreads: number, actDtype: ActDtype): { total: number; kv: number } {
  const [begin, end] = range;
  const B = Math.min(maxBatch, maxContext);
  const C = maxContext;
  const { hidden: H, heads: nh, kvLora: lat, rope: r } = m;
  const kvRow = lat + r;
  let width = 1;
  for (let l = begin; l < end; l++) width = Math.max(width, m.mlpRows[l]! + (m.moe[l] ? m.moeInter : 0));
  const i16Width = Math.max(2 * H, nh * m.vDim, width);
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
    // --act-dtype i16 (model.c act_workspace): one pool run's quantised inputs (int16; two terms
    // per vector for int16 trunk weights), their scales (one per I16_BLOCK columns for Q8
    // weights), and per thread both terms' products of I16_SUB rows
    isIntegerAct(actDtype) ? 2 * (2 * B * i16Width + I16_WORKSPACE_SLACK) : 0,
    isIntegerAct(actDtype) ? 4 * (2 * B * (Math.ceil(i16Width / I16_BLOCK) + 2) + MM_MAX_SEGS) : 0,
    isIntegerAct(actDtype) ? nThreads * 4 * 2 * B * I16_SUB_ROWS : 0,
    attnI16 ? lat * 4 : 0, // the latent tiles' row scales (ones)
  ];
  return { total: sizes.reduce((t, s) => t + alignTo(s || 1, ARENA_ALIGN), 0), kv };
}

// ---------------------------------------------------------------------------------------------
// Vision

function configInt(config: Record<string, unknown>, key: string): number {
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
 * (kvl/image.py largest_grid, same exhaustive search): vision working memory grows with the
 * patch count, and thin images gain the most padding after the downscale (for the official
 * config 12 x 446 = 5352 patches, against 66 x 66 for 1024 x 1024). Cached per config.
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
    // cells, which is what the ascending search of kvl/image.py keeps)
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

/**
 * Working memory of one vision call (largest weight phase + FP32 activations), the shape of
 * wasm-core/src/vision.c's layout (kvl/planner.py vision_call_estimate); the engine's
 * kvl_vision_bytes replaces it once open.
 */
export function visionCallEstimate(hp: ReadonlyMap<string, number>, patches: number, nThreads: number): number {
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
  const activations = 4 * (2 * patches * d + patches * Math.max(3 * d, inter) + patches * headDim + nThreads * patches + 9 * d + inter + width);
  return Math.max(embed, block, proj) + activations;
}

// ---------------------------------------------------------------------------------------------
// The plan

export interface PlanOptions {
  /** Which backend runs the engines (decides instances, memories and the Node figures). */
  backend: BackendName;
  /** The budget, MiB; default 4096. */
  ramMib?: number;
  /** Expert cache over all ranges, MiB (whole extents); null or absent = auto: what the budget
   * leaves once the trunk cache has what it can hold (see resolveAutoLimits). */
  cacheMib?: number | null;
  /** Trunk cache over all ranges, MiB; null or absent = auto (whatever the budget leaves). */
  trunkCacheMib?: number | null;
  /** Tokens; default 4096; 1..max_position_embeddings. */
  maxContext?: number;
  /** Whether the first range's engine loads the vision tower; default true. */
  loadVision?: boolean;
  /** Prefill chunk in tokens; default 256. */
  maxBatch?: number;
  kvDtype?: KvDtype;
  /** Inputs of the Linear layers (README "Numerics"); i16 changes the resident trunk's and the
   * session's bytes. Default f32. */
  actDtype?: ActDtype;
  /** Compute threads per engine; 0 or absent = every core. */
  threads?: number;
  /** At least this many instances; absent: KVL_INSTANCES, else 1 (engine-host's rule). */
  instances?: number;
  /** WebAssembly: the largest memory of one instance; default MAX_INSTANCE_BYTES (tests force less). */
  maxInstanceBytes?: number;
  /** Refuse (UserError) a plan over ramMib; default true. */
  check?: boolean;
  /** Vision: the largest image (pixels, decoded in strips) the plan reserves decode memory for;
   * absent = auto: the most that fits, in IMAGE_PIXELS_FLOOR..IMAGE_PIXELS_MAX (see "Image decode
   * and request bodies" below). */
  imageMaxPixels?: number;
  /** kvl serve: request bodies the plan holds (absent: no server, no line). */
  requests?: RequestPlanOptions;
}

/** The options with their defaults applied and checked. */
export interface PlanSettings {
  backend: BackendName;
  ramMib: number;
  /** Always a number in a plan; while cacheAuto, resolveAutoLimits picks it. */
  cacheMib: number;
  cacheAuto: boolean;
  trunkCacheMib: number | null;
  maxContext: number;
  loadVision: boolean;
  maxBatch: number;
  kvDtype: KvDtype;
  actDtype: ActDtype;
  threads: number;
  instances: number;
  maxInstanceBytes: number;
  /** null = auto (resolved by resolveAutoLimits before the plan is built). */
  imagePixels: number | null;
  requests: { maxQueue: number; bodyBytes: number | null } | null;
}

/** What engine-host should open one range's engine with. */
export interface RangeEngineOptions {
  layerBegin: number;
  layerEnd: number;
  /** Whole extents; absent on a range without MoE layers (it has no expert cache). */
  expertCacheBytes?: number;
  /** -1 streams every tensor of the range, > 0 is the resident prefix's exact bytes. */
  trunkCacheBytes: number;
  loadVision: boolean;
  nThreads: number;
  kvDtype: KvDtype;
  actDtype: ActDtype;
}

/** One instance: a layer range, its engine's bytes, and (WebAssembly) its memory. */
export interface InstancePlan {
  readonly index: number;
  readonly range: [number, number];
  readonly engineOptions: RangeEngineOptions;
  globals: number;
  trunkCache: number;
  readonly trunkCacheable: number;
  expertCache: number;
  engineWorkspace: number;
  readonly kv: number;
  /** The session's arena without its KV, plus the session struct. */
  sessionArena: number;
  /** WebAssembly: static data, thread stacks, alignment, store indexes, allocator slack, rounding. */
  runtime: number;
  /** Per-call buffers the host allocates in the instance (one chunk, a step's logits, the sampler). */
  readonly scratch: number;
  /** Vision working memory inside this instance (WebAssembly, first range). */
  vision: number;
  /** Expert extent bytes as the engine reports it (0 when the range has no MoE layer). */
  readonly expertExtent: number;
  /** Threads the engine starts in the instance (each takes a stack there on WebAssembly). */
  readonly threads: number;
  /** WebAssembly: the memory to create the instance with (64 KiB multiple); native: the sum. */
  memoryBytes: number;
  /** WebAssembly: the part of runtime that rounds the memory up (64 KiB pages, the module's minimum). */
  padding: number;
}

export const COMPONENTS = ["node", "tokenizer", "globals", "trunkCache", "expertCache", "kv", "sessionArena", "engineWorkspace",
  "runtime", "scratch", "vision", "mediaCache", "imageDecode", "requests", "logits", "margin"] as const;
export type Component = (typeof COMPONENTS)[number];

const LABELS: Record<Component, string> = {
  node: "Node + kvl host (measured)",
  tokenizer: "tokenizer vocabulary",
  globals: "resident trunk (lm_head, norms, routers)",
  trunkCache: "trunk cache",
  expertCache: "expert cache (whole extents)",
  kv: "KV cache",
  sessionArena: "session arena",
  engineWorkspace: "trunk streaming buffers",
  runtime: "instance runtime (stacks, static data, indexes)",
  scratch: "per-call buffers in the instances",
  vision: "vision working memory (largest image)",
  mediaCache: "image embeddings of the conversation",
  logits: "logits, sampler and hidden-state buffers",
  margin: "margin (fragmentation, transient copies)",
  imageDecode: "image decode (file, pixels, resize passes)",
  requests: "request bodies (raw and parsed)",
};

interface Evaluated {
  instances: InstancePlan[];
  components: Record<Component, number>;
  total: number;
  largest: number;
  /** resident trunk tensors (forward-order prefix length) */
  prefix: number;
}

/** An expert cache below one layer's top-k extents in some range with MoE layers. */
class ExpertFloorError extends UserError {}

/** A plan that no split into WebAssembly instances of at most maxInstanceBytes can hold. */
class InstanceLimitError extends UserError {
  constructor(readonly largest: number, readonly limit: number, readonly nInstances: number) {
    super(`one WebAssembly instance would need ${mib(largest)} MiB even split into ${nInstances} instances, over the ` +
      `${mib(limit)} MiB an instance can hold`);
  }
}

export class RamPlan {
  /** Components confirmed by the engines (reconcile). */
  readonly exact = new Set<string>();

  constructor(
    private readonly facts: PackFacts,
    readonly settings: Readonly<PlanSettings>,
    readonly components: Record<Component, number>,
    readonly instances: InstancePlan[],
    readonly trunkCacheable: number,
    readonly trunkAuto: boolean,
    /** Pixels + one image's embeddings the host holds in JS around a vision call (in `vision`). */
    readonly visionHost: number,
    /** The image grid the vision figure is for, or null without vision. */
    readonly visionGrid: [number, number] | null,
  ) {}

  get backend(): BackendName {
    return this.settings.backend;
  }
  get ramBytes(): number {
    return Math.floor(this.settings.ramMib * MIB);
  }
  get maxContext(): number {
    return this.settings.maxContext;
  }
  get maxBatch(): number {
    return this.settings.maxBatch;
  }
  get kvDtype(): KvDtype {
    return this.settings.kvDtype;
  }
  get nThreads(): number {
    return this.settings.threads;
  }
  /** What every range's session is created with (the arenas were planned for it). */
  get sessionOptions(): { maxContext: number; maxBatch: number } {
    return { maxContext: this.maxContext, maxBatch: this.maxBatch };
  }
  get total(): number {
    return COMPONENTS.reduce((t, c) => t + this.components[c], 0);
  }
  /** The ranges, one per instance, in order. */
  get ranges(): Array<[number, number]> {
    return this.instances.map((i) => [...i.range] as [number, number]);
  }
  /** pthread workers all instances start (WebAssembly), 0 on native. */
  /** Vision: the decode budget images are checked against (image-decode.ts DecodeLimits.budget). */
  get imageBudget(): ImageBudget | null {
    return imageBudgetOf(this.facts, this.settings);
  }
  /** kvl serve: the body limit and how many bodies the server may hold at once. */
  get requestBodies(): RequestBodies | null {
    return requestBodiesOf(this.settings);
  }
  get pthreadWorkers(): number {
    return this.backend === "wasm" ? this.instances.length * WasmBackend.pthreadsForEngine(this.nThreads) : 0;
  }

  describe(): string {
    const rows: Array<[string, string, string]> = [["component", "MiB", ""]];
    const expertSlots = this.instances.reduce((n, i) => n + (i.expertExtent ? i.expertCache / i.expertExtent : 0), 0);
    for (const c of COMPONENTS) {
      if (c === "requests" && !this.requestBodies) continue; // not a server
      let note = "";
      if (c === "node") {
        note = this.backend === "wasm"
          ? `${this.instances.length} instance${this.instances.length === 1 ? "" : "s"}, ${this.pthreadWorkers} pthread workers`
          : "native addon";
      } else if (c === "kv") {
        note = `${this.maxContext} tokens, ${this.kvDtype}`;
      } else if (c === "trunkCache") {
        note = `${this.trunkAuto ? "auto, " : ""}${((100 * this.components.trunkCache) / Math.max(this.trunkCacheable, 1)).toFixed(0)}% of ${mib(this.trunkCacheable)} MiB`;
      } else if (c === "expertCache" && expertSlots) {
        note = `${this.settings.cacheAuto ? "auto, " : ""}${expertSlots} extents`;
      } else if (c === "tokenizer") {
        note = "tiktoken";
      } else if (c === "vision" && this.visionGrid) {
        note = `${this.visionGrid[0]}x${this.visionGrid[1]} patches`;
      } else if (c === "imageDecode" && this.imageBudget) {
        note = imageDecodeNote(this.imageBudget);
      } else if (c === "requests" && this.requestBodies) {
        note = requestBodiesNote(this.requestBodies);
      } else if (c === "scratch" && this.components.scratch) {
        note = `one ${Math.min(this.maxBatch, this.maxContext)}-token chunk`;
      }
      if (this.exact.has(c)) note = (note ? `${note}, ` : "") + "engine-reported";
      const label = c === "runtime" && this.backend === "native" ? "engine bookkeeping (store indexes, allocator)" : LABELS[c];
      rows.push([label, mib(this.components[c]), note]);
    }
    rows.push(["total", mib(this.total), `budget ${mib(this.ramBytes)} MiB`]);
    const width = Math.max(...rows.map((r) => r[0].length));
    const lines = rows.map((r) => `${r[0].padEnd(width)}  ${r[1].padStart(10)}  ${r[2]}`.trimEnd());
    const rule = "-".repeat(lines[0]!.length);
    lines.splice(1, 0, rule);
    lines.splice(lines.length - 1, 0, rule);
    if (this.backend === "wasm") {
      lines.push(`WebAssembly instances (one memory each, at most ${mib(this.settings.maxInstanceBytes)} MiB):`);
    } else {
      lines.push(`engines in this process (native)${this.instances.length > 1 ? ", split as forced" : ""}:`);
    }
    for (const i of this.instances) {
      const range = `layers [${i.range[0]}, ${i.range[1]})`;
      lines.push(`  ${String(i.index + 1).padStart(2)}  ${range.padEnd(18)} ${mib(i.memoryBytes).padStart(10)} MiB`);
    }
    return lines.join("\n");
  }

  /** Throws UserError when the plan is over the budget, with advice that fits when followed. */
  checkBudget(): void {
    const over = this.total - this.ramBytes;
    if (over <= 0) return;
    const hints = adviceFor(this.facts, this.settings);
    throw new UserError(`the RAM plan needs ${mib(this.total)} MiB, ${mib(over)} MiB over --ram-mib ${mib(this.ramBytes)}; ` +
      `${hints.join(" or ")}\n${this.describe()}`);
  }

  /**
   * Adopts the engines' exact figures (one entry per range, in order: its info and its
   * sessionBytes for this plan's maxContext / maxBatch; visionBytes: kvl_vision_bytes of the
   * largest grid on the first range, when vision is loaded). Returns what differed. On
   * WebAssembly an instance's memory was fixed at creation: a difference moves bytes between the
   * engine's components and the instance's unplanned rest (its padding), and an instance whose
   * engine needs more than its memory holds is a UserError. Throws UserError when the exact plan
   * no longer fits the budget.
   */
  reconcile(engines: ReadonlyArray<{ info: EngineInfo; sessionBytes: number }>, visionBytes: number | null = null): string[] {
    if (engines.length !== this.instances.length) {
      throw new RangeError(`the plan has ${this.instances.length} ranges, ${engines.length} engines were given`);
    }
    const wasm = this.backend === "wasm";
    const changed: string[] = [];
    const move = (inst: InstancePlan, field: "globals" | "expertCache" | "engineWorkspace" | "trunkCache" | "sessionArena" | "vision",
      value: number, what: string): void => {
      const delta = value - inst[field];
      if (delta === 0) return;
      changed.push(`${what}: planned ${inst[field]}, engine ${value}`);
      inst[field] = value;
      this.components[field] += delta;
      if (wasm) {
        inst.padding -= delta;
        inst.runtime -= delta;
        this.components.runtime -= delta;
      } else {
        inst.memoryBytes += delta;
      }
    };
    engines.forEach(({ info, sessionBytes }, k) => {
      const inst = this.instances[k]!;
      if (info.layerBegin !== inst.range[0] || info.layerEnd !== inst.range[1]) {
        throw new RangeError(`engine ${k} runs layers [${info.layerBegin}, ${info.layerEnd}), the plan's range is [${inst.range[0]}, ${inst.range[1]})`);
      }
      move(inst, "globals", info.globalBytes, `instance ${k + 1} globals`);
      move(inst, "expertCache", info.expertCacheBytes, `instance ${k + 1} expertCache`);
      move(inst, "engineWorkspace", info.engineWorkspaceBytes, `instance ${k + 1} engineWorkspace`);
      move(inst, "trunkCache", info.trunkCacheBytes, `instance ${k + 1} trunkCache`);
      if (sessionBytes < inst.kv) changed.push(`instance ${k + 1} session: engine reports ${sessionBytes} bytes < KV ${inst.kv}`);
      move(inst, "sessionArena", Math.max(sessionBytes - inst.kv, 0), `instance ${k + 1} sessionArena`);
    });
    for (const c of ["globals", "expertCache", "engineWorkspace", "trunkCache", "sessionArena"]) this.exact.add(c);
    if (visionBytes !== null && this.settings.loadVision) {
      // in the first instance on WebAssembly: the call's page-aligned working memory and the
      // pixels and embeddings copied in; the host's own copies (visionHost) stay as planned
      const first = this.instances[0]!;
      move(first, "vision", wasm ? alignPage(visionBytes) + PAGE + this.visionHost : visionBytes, "vision");
      this.exact.add("vision");
    }
    for (const inst of this.instances) {
      if (wasm && inst.padding < 0) {
        throw new UserError(`instance ${inst.index + 1} (layers [${inst.range[0]}, ${inst.range[1]})) needs ${mib(inst.memoryBytes - inst.padding)} MiB ` +
          `by its engine's figures, more than its ${mib(inst.memoryBytes)} MiB memory; this is a planner bug, please report it\n${this.describe()}`);
      }
    }
    this.checkBudget();
    return changed;
  }
}

function settingsOf(facts: PackFacts, options: PlanOptions): PlanSettings {
  const m = modelOf(facts);
  const s: PlanSettings = {
    backend: options.backend,
    ramMib: options.ramMib ?? 4096,
    cacheMib: options.cacheMib ?? 0,
    cacheAuto: options.cacheMib === undefined || options.cacheMib === null,
    trunkCacheMib: options.trunkCacheMib ?? null,
    maxContext: options.maxContext ?? 4096,
    loadVision: options.loadVision ?? true,
    maxBatch: options.maxBatch ?? DEFAULT_MAX_BATCH,
    kvDtype: options.kvDtype ?? defaultKvDtype(options.actDtype ?? "f32"),
    actDtype: options.actDtype ?? "f32",
    threads: options.threads === undefined || options.threads === 0 ? availableParallelism() : options.threads,
    instances: requestedInstances(options.instances),
    maxInstanceBytes: options.maxInstanceBytes ?? MAX_INSTANCE_BYTES,
    imagePixels: imagePixelsSetting(options.imageMaxPixels),
    requests: requestSettings(options.requests),
  };
  if (s.backend !== "wasm" && s.backend !== "native") throw new UserError(`backend must be wasm or native, got ${JSON.stringify(s.backend)}`);
  if (!KV_DTYPE_NAMES.includes(s.kvDtype)) throw new UserError(`kv dtype '${s.kvDtype}' unknown; use one of ${KV_DTYPE_NAMES.join(", ")}`);
  if (!ACT_DTYPE_NAMES.includes(s.actDtype)) throw new UserError(`act dtype '${s.actDtype}' unknown; use one of ${ACT_DTYPE_NAMES.join(", ")}`);
  if ((s.kvDtype === "i16") !== hasIntegerKv(s.actDtype)) {
    throw new UserError(`kv dtype ${s.kvDtype} does not go with act dtype ${s.actDtype}: act dtypes i16x1 and i8 keep the KV cache as ` +
      "int16 rows (kv dtype i16), and only they do; leave the kv dtype out to get the one that goes with the act dtype");
  }
  if (!Number.isInteger(s.maxContext) || s.maxContext < 1 || s.maxContext > m.maxPositions) {
    throw new UserError(`--max-context ${s.maxContext} is outside 1..${m.maxPositions} (the model's max_position_embeddings)`);
  }
  const finite = (v: number): boolean => typeof v === "number" && Number.isFinite(v);
  if (!finite(s.ramMib) || s.ramMib <= 0 || !finite(s.cacheMib) || s.cacheMib < 0 || (s.trunkCacheMib !== null && (!finite(s.trunkCacheMib) || s.trunkCacheMib < 0))) {
    throw new UserError("--ram-mib must be positive and cache sizes non-negative");
  }
  if (!Number.isInteger(s.maxBatch) || s.maxBatch < 1) throw new UserError(`max batch must be a positive integer, got ${s.maxBatch}`);
  if (!Number.isInteger(s.threads) || s.threads < 1 || s.threads > 1024) throw new UserError(`--threads must be an integer in 0..1024 (0: every core), got ${options.threads}`);
  if (s.instances > m.nLayers) throw new UserError(`--instances ${s.instances}: the model has only ${m.nLayers} decoder layers to split`);
  if (!Number.isInteger(s.maxInstanceBytes) || s.maxInstanceBytes % WASM_PAGE !== 0 || s.maxInstanceBytes < WASM_MIN_INSTANCE_BYTES ||
    s.maxInstanceBytes > MAX_INSTANCE_BYTES) {
    throw new UserError(`the instance memory limit must be a multiple of 64 KiB in ${WASM_MIN_INSTANCE_BYTES}..${MAX_INSTANCE_BYTES}, got ${s.maxInstanceBytes}`);
  }
  return s;
}

/** Expert slots per range: at least top-k on ranges with MoE layers, the rest one at a time to
 * the range with the most MoE layers per slot it holds (never more than its extents). */
function expertSlots(m: Model, ranges: ReadonlyArray<[number, number]>, cacheBytes: number, cacheMib: number): number[] {
  const moeLayers = ranges.map(([b, e]) => m.moe.slice(b, e).filter(Boolean).length);
  const caps = moeLayers.map((n) => n * m.nRouted);
  if (m.extent === 0) return ranges.map(() => 0);
  const total = Math.min(Math.floor(cacheBytes / m.extent), caps.reduce((a, b) => a + b, 0));
  const moeRanges = moeLayers.filter((n) => n > 0).length;
  if (total < m.topK * moeRanges) {
    const need = Math.ceil((m.topK * moeRanges * m.extent) / MIB);
    throw new ExpertFloorError(`--cache-mib ${cacheMib} holds ${total} expert extents; one layer needs ${m.topK}` +
      `${moeRanges > 1 ? ` in each of the ${moeRanges} instances with MoE layers` : ""} (${need} MiB): raise --cache-mib to at least ${need}`);
  }
  const slots = moeLayers.map((n) => (n > 0 ? m.topK : 0));
  let left = total - m.topK * moeRanges;
  if (ranges.length === 1) {
    slots[0]! += left;
    return slots;
  }
  for (; left > 0; left--) {
    // D'Hondt: the range with the largest moeLayers / (slots + 1) that has room; earlier on ties
    let pick = -1;
    for (let i = 0; i < slots.length; i++) {
      if (slots[i]! >= caps[i]!) continue;
      if (pick < 0 || moeLayers[i]! * (slots[pick]! + 1) > moeLayers[pick]! * (slots[i]! + 1)) pick = i;
    }
    slots[pick]! += 1; // total <= the sum of caps, so some range has room
  }
  return slots;
}

function evaluate(facts: PackFacts, s: PlanSettings, m: Model, ranges: ReadonlyArray<[number, number]>, slots: number[],
  layouts: ReadonlyArray<{ total: number; kv: number }>, prefix: number, visionInInstance: number, visionHost: number, mediaCache: number): Evaluated {
  const wasm = s.backend === "wasm";
  const B = Math.min(s.maxBatch, s.maxContext);
  const H = m.hidden;
  const V = m.vocab;
  const instances: InstancePlan[] = ranges.map(([begin, end], index) => {
    const first = index === 0;
    const last = end === m.nLayers;
    let globals = last ? (isIntegerAct(s.actDtype) ? m.lmHeadI16 : m.lmHeadPadded) + alignTo(H * 4, 64) : 0;
    for (let l = begin; l < end; l++) globals += m.layerGlobals[l]!;
    const lo = m.firstOf[begin]!;
    const hi = m.firstOf[end]!;
    let resident = 0;
    let cacheable = 0;
    let maxStreamed = 0;
    for (let i = lo; i < hi; i++) {
      const t = m.order[i]!;
      const slot = slotOf(t, s.actDtype);
      cacheable += slot;
      if (i < prefix) resident += slot;
      else maxStreamed = Math.max(maxStreamed, t.padded); // streamed as read: BF16
    }
    const workspace = 2 * maxStreamed;
    const expertCache = slots[index]! * m.extent;
    const hasMoe = m.moe.slice(begin, end).some(Boolean);
    const { total: arena, kv } = layouts[index]!;
    const sessionBytes = arena + SESSION_STRUCT_BYTES[s.backend];
    const threads = s.threads - 1 + (hasMoe ? EXPERT_READER_THREADS : 0) + (maxStreamed > 0 ? 1 : 0);
    const vision = first ? visionInInstance : 0;
    const indexes = 2 * (facts.indexBytes.trunk + facts.indexBytes.experts + (first && s.loadVision ? facts.indexBytes.vision : 0));
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
      const media = first && s.loadVision ? B * H * 4 : 0;
      const output = last ? V * 4 : B * H * 4;
      const call = Math.max(input + media + output, last ? 32 + 8 * V : 0);
      scratch = (last ? V * 4 : 0) + 8 + call;
    }
    const parts = globals + resident + expertCache + workspace + sessionBytes + runtime + scratch + vision;
    const memoryBytes = wasm ? Math.max(alignTo(parts, WASM_PAGE), WASM_MIN_INSTANCE_BYTES) : parts;
    const padding = memoryBytes - parts;
    runtime += padding;
    const engineOptions: RangeEngineOptions = {
      layerBegin: begin, layerEnd: end, trunkCacheBytes: resident > 0 ? resident : -1, loadVision: first && s.loadVision, nThreads: s.threads,
      kvDtype: s.kvDtype, actDtype: s.actDtype,
      ...(expertCache > 0 ? { expertCacheBytes: expertCache } : {}),
    };
    return {
      index, range: [begin, end], engineOptions, globals, trunkCache: resident, trunkCacheable: cacheable, expertCache,
      engineWorkspace: workspace, kv, sessionArena: sessionBytes - kv, runtime, scratch, vision, expertExtent: hasMoe ? m.extent : 0,
      threads, memoryBytes, padding,
    };
  });
  const sum = (f: (i: InstancePlan) => number): number => instances.reduce((t, i) => t + f(i), 0);
  const n = instances.length;
  const node = wasm
    ? NODE_WASM_BYTES + (n - 1) * INSTANCE_JS_BYTES + (n * WasmBackend.pthreadsForEngine(s.threads) - 1) * PTHREAD_WORKER_BYTES
    : NODE_NATIVE_BYTES;
  // JS: a step's logits, the copy the sampler masks, its workspace; hidden states between ranges
  const logits = 3 * 4 * V + (n > 1 ? 2 * B * H * 4 : 0);
  const components: Record<Component, number> = {
    node, tokenizer: TOKENIZER_BYTES_PER_FILE_BYTE * facts.tokenizerFileBytes,
    globals: sum((i) => i.globals), trunkCache: sum((i) => i.trunkCache), expertCache: sum((i) => i.expertCache), kv: sum((i) => i.kv),
    sessionArena: sum((i) => i.sessionArena), engineWorkspace: sum((i) => i.engineWorkspace), runtime: sum((i) => i.runtime),
    scratch: sum((i) => i.scratch), vision: sum((i) => i.vision) + visionHost, mediaCache, logits, margin: MARGIN_BYTES,
    imageDecode: imageDecodeLine(facts, s), requests: requestBodiesLine(s),
  };
  const total = COMPONENTS.reduce((t, c) => t + components[c], 0);
  return { instances, components, total, largest: Math.max(...instances.map((i) => i.memoryBytes)), prefix };
}

function build(facts: PackFacts, s: PlanSettings): RamPlan {
  const m = modelOf(facts);
  const cacheBytes = Math.floor(s.cacheMib * MIB);
  const H = m.hidden;
  // vision: the largest image's working memory, in the first range's instance on WebAssembly,
  // plus the pixels and one image's embeddings the host holds around the call (copied into the
  // instance too on WebAssembly; the addon reads the host's arrays)
  let visionInInstance = 0;
  let visionHost = 0;
  let grid: [number, number] | null = null;
  let mediaCache = 0;
  if (s.loadVision) {
    if (!facts.preprocessorConfig.ok) throw new UserError(facts.preprocessorConfig.error);
    const merge: [number, number] = [hparam(facts.hparams, "vision.merge_kernel_h"), hparam(facts.hparams, "vision.merge_kernel_w")];
    grid = largestGrid(facts.preprocessorConfig.value, merge);
    const patches = grid[0] * grid[1];
    const patch = hparam(facts.hparams, "vision.patch_size");
    visionHost = 4 * (patches * 3 * patch * patch + Math.floor(patches / (merge[0] * merge[1])) * H);
    const call = visionCallEstimate(facts.hparams, patches, s.threads);
    visionInInstance = s.backend === "wasm" ? alignPage(call) + PAGE + visionHost : call;
    mediaCache = 4 * s.maxContext * H;
  }
  const ramBytes = Math.floor(s.ramMib * MIB);
  const order = m.order;
  const cumulative = [0];
  for (const t of order) cumulative.push(cumulative.at(-1)! + slotOf(t, s.actDtype));
  const cacheable = cumulative.at(-1)!;
  let explicitPrefix = -1;
  if (s.trunkCacheMib !== null) {
    const budget = Math.floor(s.trunkCacheMib * MIB);
    explicitPrefix = 0;
    while (explicitPrefix < order.length && cumulative[explicitPrefix + 1]! <= budget) explicitPrefix++;
  }
  const wasm = s.backend === "wasm";
  const lastN = wasm ? m.nLayers : s.instances;
  let smallest: Evaluated | undefined;
  // WebAssembly: the fewest instances that hold a plan, unless more instances keep more of the
  // trunk resident within the budget (instances full of expert cache would otherwise stream the
  // trunk on every token): the longest resident prefix wins, then the fewest instances.
  let best: Evaluated | undefined;
  for (let n = s.instances; n <= lastN; n++) {
    const ranges = layerRanges(m.nLayers, n);
    const slots = expertSlots(m, ranges, cacheBytes, s.cacheMib);
    const layouts = ranges.map((r) => sessionLayoutBytes(m, r, s.maxContext, s.maxBatch, s.kvDtype, s.threads, s.actDtype));
    const candidates = explicitPrefix >= 0 ? [explicitPrefix] : Array.from({ length: order.length + 1 }, (_, i) => i);
    let chosen: Evaluated | undefined;
    let cheapest: Evaluated | undefined;
    for (const prefix of candidates) {
      const e = evaluate(facts, s, m, ranges, slots, layouts, prefix, visionInInstance, visionHost, mediaCache);
      if (!smallest || e.largest < smallest.largest) smallest = e;
      if (wasm && e.largest > s.maxInstanceBytes) continue;
      if (!cheapest || e.total < cheapest.total) cheapest = e;
      // auto: the longest prefix that fits the budget (candidates ascend)
      if (e.total <= ramBytes) chosen = e;
    }
    const pick = chosen ?? cheapest;
    if (!pick) continue; // no split into n instances holds it: try more
    if (best && !(chosen && chosen.prefix > best.prefix)) break; // one more instance gains nothing
    best = pick;
    if (!wasm || explicitPrefix >= 0 || !chosen || pick.prefix === order.length) break;
  }
  if (best) return new RamPlan(facts, s, best.components, best.instances, cacheable, s.trunkCacheMib === null, visionHost, grid);
  throw new InstanceLimitError(smallest!.largest, s.maxInstanceBytes, lastN);
}

type Fit = "fits" | "over" | "instance" | "floor" | "invalid";

/** Plans with these settings and says whether (and why not) the plan fits. */
function fitOf(facts: PackFacts, s: PlanSettings): Fit {
  try {
    return build(facts, s).total <= Math.floor(s.ramMib * MIB) ? "fits" : "over";
  } catch (err) {
    if (err instanceof InstanceLimitError) return "instance";
    if (err instanceof ExpertFloorError) return "floor";
    if (err instanceof UserError) return "invalid";
    throw err;
  }
}

function fits(facts: PackFacts, s: PlanSettings): boolean {
  return fitOf(facts, s) === "fits";
}

/** The smallest integer in [lo, hi] where ok holds, given ok is false up to some point and true
 * after (hi when it holds nowhere below hi). */
function smallestTrue(lo: number, hi: number, ok: (v: number) => boolean): number {
  while (lo < hi) {
    const mid = Math.floor((lo + hi) / 2);
    if (ok(mid)) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/** The largest integer in [lo, hi] where ok holds, given ok is true up to some point and false after. */
function largestTrue(lo: number, hi: number, ok: (v: number) => boolean): number | null {
  if (hi < lo || !ok(lo)) return null;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (ok(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/**
 * What to lower (or raise) and to what, each figure checked by planning again with it alone
 * changed: the plan then fits the budget (and, on WebAssembly, every instance its limit).
 */
function adviceFor(facts: PackFacts, s: PlanSettings): string[] {
  const m = modelOf(facts);
  const hints: string[] = [];
  const fmt = (v: number): string => (Number.isInteger(v) ? String(v) : v.toFixed(2).replace(/\.?0+$/, ""));
  const lower = (flag: string, current: number, to: number): string => `lower ${flag} to ${to} (by ${fmt(current - to)})`;
  // expert cache: fits is monotone in the cache (extents are handed out one at a time)
  // above its floor (top-k extents per range with MoE layers); whole MiB below the current value
  const cacheTop = Math.ceil(s.cacheMib) - 1;
  const cacheFloor = smallestTrue(0, cacheTop, (c) => fitOf(facts, { ...s, cacheMib: c }) !== "floor");
  const cache = largestTrue(cacheFloor, cacheTop, (c) => fits(facts, { ...s, cacheMib: c }));
  if (cache !== null) hints.push(lower("--cache-mib", s.cacheMib, cache));
  if (s.trunkCacheMib !== null) {
    // not monotone (a streamed tensor costs a double buffer): try every distinct prefix, largest first
    const candidates = new Set<number>([0]);
    let sum = 0;
    for (const t of m.order) {
      sum += slotOf(t, s.actDtype);
      candidates.add(Math.ceil(sum / MIB));
    }
    const below = [...candidates].filter((t) => t < s.trunkCacheMib!).sort((a, b) => b - a);
    const trunk = below.find((t) => fits(facts, { ...s, trunkCacheMib: t }));
    if (trunk !== undefined) hints.push(lower("--trunk-cache-mib", s.trunkCacheMib, trunk));
  }
  const context = largestTrue(1, s.maxContext - 1, (c) => fits(facts, { ...s, maxContext: c }));
  if (context !== null) hints.push(lower("--max-context", s.maxContext, context));
  if (s.loadVision && fits(facts, { ...s, loadVision: false })) hints.push("run without vision");
  // RAM: fits is monotone in the budget (the auto trunk cache only takes what is left)
  // (a budget cannot make an instance fit its limit: then there is no such figure)
  let hi = Math.floor(s.ramMib) + 1;
  let fit = fitOf(facts, { ...s, ramMib: hi });
  for (let probes = 0; fit === "over" && probes < 60; probes++) fit = fitOf(facts, { ...s, ramMib: (hi *= 2) });
  if (fit === "fits") hints.push(`raise --ram-mib to ${smallestTrue(Math.floor(s.ramMib) + 1, hi, (r) => fits(facts, { ...s, ramMib: r }))}`);
  hints.push(...requestAdvice(s, (t) => fits(facts, t)));
  if (s.backend === "wasm" && hints.length === 0 && fits(facts, { ...s, backend: "native", instances: 1 })) {
    hints.push("use the native backend (--backend native)");
  }
  return hints;
}

/** Plans a run of a pack already read (no I/O); refuses (UserError) a plan over the budget when check is set. */
export function planFromFacts(facts: PackFacts, options: PlanOptions): RamPlan {
  const s = resolveAutoLimits(facts, settingsOf(facts, options));
  let result: RamPlan;
  try {
    result = build(facts, s);
  } catch (err) {
    if (err instanceof InstanceLimitError) {
      const hints = adviceFor(facts, s);
      throw new UserError(hints.length ? `${err.message}; ${hints.join(" or ")}` : err.message);
    }
    throw err;
  }
  if (options.check ?? true) result.checkBudget();
  return result;
}

/** Plans a run of the pack in packDir (read with pack-format.ts); see planFromFacts. */
export async function plan(packDir: string, options: PlanOptions): Promise<RamPlan> {
  return planFromFacts(await readPackFacts(packDir), options);
}

// ---------------------------------------------------------------------------------------------
// Image decode and request bodies
//
// Two lines of the plan that depend on input rather than on the model: decoding the largest
// image the plan admits (chat and serve), and the request bodies a server holds at once (serve).
// Their limits are chosen to fit: when --max-body-mib is not given the body limit is the largest
// whole MiB up to DEFAULT_BODY_BYTES that fits, then the image limit the largest 0.1 MP step up to
// IMAGE_PIXELS_MAX; each takes its floor when nothing fits, and the plan then refuses with advice.
// The limits come before the auto trunk cache, which takes what is left (inputs work; a smaller
// trunk cache only costs speed).

/** kvl serve's request options that size the bodies line. */
export interface RequestPlanOptions {
  /** --max-queue: requests that may wait while one runs. */
  maxQueue: number;
  /** --max-body-mib in bytes; absent or null = auto (the most that fits, up to DEFAULT_BODY_BYTES). */
  maxBodyBytes?: number | null;
}

/** The auto body limit's ceiling (the former fixed --max-body-mib default) and floor. */
export const DEFAULT_BODY_BYTES = 20 * MIB;
export const BODY_BYTES_FLOOR = 1 * MIB;
/** Bodies being read or parsed besides the queue's (server/body.ts BodyGate admits this many more). */
export const IN_FLIGHT_BODIES = 1;
/**
 * Resident bytes per body byte while a request holds its body: the raw bytes, the decoded text
 * and the parsed object (strings copied once more by JSON.parse; base64 image data decoded to
 * bytes), and the V8 garbage of those copies until the next major GC. Measured by
 * test/server-api.test.ts "request bodies" on a real server (see docs/SERVER.md).
 */
export const REQUEST_BODY_FACTOR = 2.5;

/** Bodies a server may hold at once: every waiting request, the running one, and those in flight. */
export function bodySlots(maxQueue: number): number {
  return maxQueue + 1 + IN_FLIGHT_BODIES;
}

export interface ImageBudget {
  /** Pixels of the largest image decoded in strips (JPEG, PNG) that the plan reserves for; what
   * is admitted, per format, is image-budget.ts imagePixelLimit (for JPEG and PNG: these pixels). */
  pixels: number;
  /** Bytes reserved (the imageDecode line). */
  bytes: number;
  /** The preprocessing's patch side and token limit (resize working memory). */
  shape: ResizeShape;
}

export interface RequestBodies {
  /** The largest accepted body (413 above). */
  bodyBytes: number;
  /** Bodies held at once at most (server/body.ts BodyGate's capacity). */
  slots: number;
  /** Bytes reserved (the requests line). */
  bytes: number;
}

function requestSettings(options: RequestPlanOptions | undefined): PlanSettings["requests"] {
  if (!options) return null;
  const { maxQueue } = options;
  const bodyBytes = options.maxBodyBytes ?? null;
  if (!Number.isSafeInteger(maxQueue) || maxQueue < 1) throw new UserError(`--max-queue must be a positive integer, got ${maxQueue}`);
  if (bodyBytes !== null && (!Number.isSafeInteger(bodyBytes) || bodyBytes < 1)) {
    throw new UserError(`the body limit must be a positive number of bytes, got ${bodyBytes}`);
  }
  return { maxQueue, bodyBytes };
}

function imagePixelsSetting(pixels: number | undefined): number | null {
  if (pixels === undefined) return null;
  if (!Number.isSafeInteger(pixels) || pixels < 1 || pixels > IMAGE_PIXELS_MAX) {
    throw new UserError(`the image limit must be a whole number of pixels in 1..${IMAGE_PIXELS_MAX}, got ${pixels}`);
  }
  return pixels;
}

function resizeShapeOf(facts: PackFacts): ResizeShape {
  if (!facts.preprocessorConfig.ok) throw new UserError(facts.preprocessorConfig.error);
  const config = facts.preprocessorConfig.value as Record<string, unknown>;
  return { patchSize: configInt(config, "patch_size"), inTokenLimit: configInt(config, "in_token_limit") };
}

function imageBudgetOf(facts: PackFacts, s: PlanSettings): ImageBudget | null {
  if (!s.loadVision) return null;
  const pixels = s.imagePixels ?? IMAGE_PIXELS_FLOOR;
  const shape = resizeShapeOf(facts);
  return { pixels, bytes: imageDecodeBudget(pixels, shape), shape };
}

function requestBodiesOf(s: PlanSettings): RequestBodies | null {
  if (!s.requests) return null;
  const bodyBytes = s.requests.bodyBytes ?? BODY_BYTES_FLOOR;
  const slots = bodySlots(s.requests.maxQueue);
  return { bodyBytes, slots, bytes: slots * Math.ceil(REQUEST_BODY_FACTOR * bodyBytes) };
}

function imageDecodeLine(facts: PackFacts, s: PlanSettings): number {
  return imageBudgetOf(facts, s)?.bytes ?? 0;
}

function requestBodiesLine(s: PlanSettings): number {
  return requestBodiesOf(s)?.bytes ?? 0;
}

function imageDecodeNote(b: ImageBudget): string {
  return `images ${imageLimitsText(b)}`;
}

function requestBodiesNote(r: RequestBodies): string {
  return `${r.slots} bodies of up to ${mib(r.bodyBytes)} MiB`;
}

/**
 * The auto expert cache's range, in extents: from the fewest every range with MoE layers accepts
 * (top-k each) to every extent of the model; and the cache (MiB) of k extents. null without MoE.
 */
function autoCacheBounds(facts: PackFacts, s: PlanSettings): { floor: number; top: number; mibOf: (k: number) => number } | null {
  const m = modelOf(facts);
  if (m.extent === 0) return null;
  // half a byte over k extents, so that build's floor(cacheMib * MIB) is k extents whatever the
  // rounding of the division
  const mibOf = (k: number): number => (k * m.extent + 0.5) / MIB;
  const top = m.moe.filter(Boolean).length * m.nRouted;
  const floor = smallestTrue(0, top, (k) => fitOf(facts, { ...s, cacheMib: mibOf(k) }) !== "floor");
  return { floor, top, mibOf };
}

/** Whether settings plan within the budget with the trunk cache at least `trunk` bytes. */
function fitsKeepingTrunk(facts: PackFacts, s: PlanSettings, trunk: number): boolean {
  try {
    const p = build(facts, s);
    return p.total <= Math.floor(s.ramMib * MIB) && p.components.trunkCache >= trunk;
  } catch (err) {
    if (err instanceof UserError) return false;
    throw err;
  }
}

/**
 * Settings with the auto limits (null) replaced by the largest that fit (their floors when none
 * do). The request bodies and the image limit, which have ceilings, go first (planned with the
 * smallest expert cache); the auto expert cache then takes what is left without shrinking the
 * resident trunk: the larger the cache, the more of each token's routed experts it already holds.
 */
function resolveAutoLimits(facts: PackFacts, s: PlanSettings): PlanSettings {
  let t = s;
  const bounds = t.cacheAuto ? autoCacheBounds(facts, t) : null;
  if (t.cacheAuto) t = { ...t, cacheMib: bounds ? bounds.mibOf(bounds.floor) : 0 };
  if (t.requests && t.requests.bodyBytes === null) {
    const requests = t.requests;
    const best = largestTrue(BODY_BYTES_FLOOR / MIB, DEFAULT_BODY_BYTES / MIB,
      (k) => fits(facts, { ...t, requests: { ...requests, bodyBytes: k * MIB } }));
    t = { ...t, requests: { ...requests, bodyBytes: (best ?? BODY_BYTES_FLOOR / MIB) * MIB } };
  }
  if (t.loadVision && t.imagePixels === null) {
    const step = 100_000;
    const best = largestTrue(IMAGE_PIXELS_FLOOR / step, IMAGE_PIXELS_MAX / step, (k) => fits(facts, { ...t, imagePixels: k * step }));
    t = { ...t, imagePixels: (best ?? IMAGE_PIXELS_FLOOR / step) * step };
  }
  if (bounds && fits(facts, t)) {
    // the trunk is read on every token, an expert extent only when routed to: the auto cache
    // takes nothing from the resident trunk
    const keep = build(facts, t).components.trunkCache;
    const mibOf = bounds.mibOf;
    const k = largestTrue(bounds.floor, bounds.top, (n) => fitsKeepingTrunk(facts, { ...t, cacheMib: mibOf(n) }, keep));
    if (k !== null) t = { ...t, cacheMib: mibOf(k) };
  }
  return t;
}

/** Lower body limit or queue that makes the plan fit (each checked by planning again with it). */
function requestAdvice(s: PlanSettings, fits: (t: PlanSettings) => boolean): string[] {
  const r = s.requests;
  if (!r) return [];
  const hints: string[] = [];
  const bodyMib = Math.ceil((r.bodyBytes ?? BODY_BYTES_FLOOR) / MIB);
  const body = largestTrue(1, bodyMib - 1, (k) => fits({ ...s, requests: { ...r, bodyBytes: k * MIB } }));
  if (body !== null) hints.push(`lower --max-body-mib to ${body}`);
  const queue = largestTrue(1, r.maxQueue - 1, (q) => fits({ ...s, requests: { ...r, maxQueue: q } }));
  if (queue !== null) hints.push(`lower --max-queue to ${queue}`);
  return hints;
}
