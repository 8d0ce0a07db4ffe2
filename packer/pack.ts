/**
 * pack.ts — `kvl pack`: checkpoint -> kvl runtime directory (docs/FORMAT.md), bounded-memory
 * and resumable; a BF16-trunk pack is byte for byte what the former Python packer wrote
 * (test/fixtures/python-packer-sha256.json).
 *
 * Owns: validating a source before anything is written, the deterministic layout of all three
 * stores, the crash-safe work loop (preallocated .bin files, fixed item order,
 * fsync-then-journal), shard release after durable consumption, the final atomic
 * index/asset/completion writes, and a rerun over a finished pack: nothing to do when it is this
 * source's, a refusal when it is another's (finishedPackRefusal).
 * Does not own: the byte format (host/pack/pack-format.ts), the expected inventory and hparams
 * (host/pack/model-spec.ts), quantisation (the core's packExpert, packExpertQ4 and packQ8Rows, on either backend), reading
 * checkpoints (tensor-source.ts, safetensors.ts), downloads (prepare.ts).
 *
 * Crash safety: the full layout (every record's offset) is computed from the source inventory
 * before any byte is written and stored in DST/.pack-journal/layout.json. Output .bin files are
 * created at their final size. Items (one tensor or one expert extent) are written at fixed
 * offsets; a batch of items is appended to DST/.pack-journal/done.log only after the .bin files
 * are fsynced. A rerun with the same source skips journaled items and rewrites the rest, so any
 * SIGKILL followed by a rerun yields byte-identical output. Indexes, assets and
 * PACK_COMPLETE.json are written last via temp file + fsync + rename; PACK_COMPLETE.json is the
 * very last. Memory: one item at a time (the largest is one tensor, e.g. the 640 MiB embedding)
 * plus the journal batch's bookkeeping (keys and CRCs, not data).
 */
import { createHash } from "node:crypto";
import { closeSync, constants, fsyncSync, openSync, readFileSync, readdirSync, statSync, statfsSync, truncateSync, writeSync } from "node:fs";
import { type FileHandle, open, rm, unlink } from "node:fs/promises";
import { join } from "node:path";

import type { PackingCore } from "../host/core/core-api.js";
import { type TensorInfo, checkSource, checkSupported, formatShape, hparams as configHparams, isTrunkLinear, textDims } from "../host/pack/model-spec.js";
import {
  ASSET_FILES, BIN_ALIGN, COMPLETE_FILE, DTYPE_BF16, DTYPE_F32, DTYPE_Q4_EXPERT, DTYPE_Q8_EXPERT, DTYPE_Q8_ROWS, type ExpertDtype,
  JOURNAL_DIR, Q4_GROUP, SOURCE_REVISION_FILE, STORES, STORE_KINDS, type StoreName, type TensorRecord, type TrunkDtype, alignUp, bf16BitsToF32,
  type CompleteMarker, PackReader, crc32, encodeCompleteMarker, encodeIndex, expertRecordName, formatVersionOf, q8RowsLayout,
  recordNbytes,
} from "../host/pack/pack-format.js";
import { JsonTextError, decodeUtf8Strict, isJsonObject, parseJson } from "../host/system/json-file.js";
import { UserError } from "../host/system/user-error.js";
import { fsyncDir, writeAllAt, writeAtomic } from "./durable-io.js";
import { PINNED_REPO, PINNED_REVISION } from "./hub.js";
import { type Progress, silentProgress } from "./progress.js";
import { DTYPE_SIZES, INDEX_NAME, findRevision, readIndex } from "./safetensors.js";
import { CheckpointSource, type InventoryEntry, InventorySource, type ShardHooks, type TensorSource, readAssets } from "./tensor-source.js";
import { isDir, isFile, pathExists, requireFolder } from "../host/pack/file-kind.js";
import { checkOutputDir, makeOutputDir } from "../host/system/output-path.js";
import { envPositiveInt } from "../host/system/env.js";

const EXPERT_RE = /^language_model\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$/;
const ROUTER_BIAS_SUFFIX = ".mlp.gate.e_score_correction_bias";
const JOURNAL_LAYOUT = "layout.json";
const JOURNAL_DONE = "done.log";
/** Digests of the source's shard files when the pack began (see TensorSource.shardDigest). */
const JOURNAL_SHARDS = "shards.json";
/** Journal a batch once this many output bytes (or KVL_PACK_FLUSH_ITEMS items, default 256) are
 * pending: bounds the fsync count and the work lost to a crash. */
const FLUSH_BYTES = 256 << 20;
/** The largest item read ahead while the previous one is processed, or written behind while the
 * next one is (so memory stays at about one large tensor plus one small item). */
const PREFETCH_BYTES = 256 << 20;
/** BF16 input bytes per kvl_pack_q8_rows call (buildItem). */
const Q8_ROWS_CHUNK_BYTES = 8 << 20;
/** Names in DST that are not ours but may legitimately exist before packing (kvl prepare's scratch). */
const FOREIGN_OK = new Set([".download"]);

interface PackOptions {
  /** The core that quantises the experts (either backend; the bytes are the same). */
  core: PackingCore;
  /** Pack a source whose revision is not the pinned one (or is unknown). */
  allowRevision?: boolean;
  /** What the trunk's Linear weights (model-spec.ts isTrunkLinear) are stored as: "bf16" (the
   * default; byte-identical to packs made before the option existed) or "q8" (row-wise Q8 as the
   * experts, format version 2: half the bytes a token reads from the trunk). */
  trunkDtype?: TrunkDtype;
  /** What the routed experts are stored as: "q8" (the default; Q8_EXPERT, byte-identical to packs
   * made before the option existed) or "q4" (Q4_EXPERT, groups of 32 with BF16 scales, format
   * version 3: about half the expert bytes; hidden_size and moe_intermediate_size multiples of 32). */
  expertDtype?: ExpertDtype;
  /** Delete each source shard once everything taken from it is durably packed (directory sources only). */
  deleteConsumedShards?: boolean;
  /** Byte progress of the item loop. Default: none. */
  progress?: Progress;
  /** Shard hooks; default: the source's own (source.shardHooks), or shard deletion with deleteConsumedShards. */
  shardHooks?: ShardHooks;
  /** Status lines ("resuming the pack in DST: N items already written", "packed into DST"). Default: none. */
  log?: (line: string) => void;
}

// ---------------------------------------------------------------------------------------------
// Layout

/** One unit of work: a trunk/vision tensor or a (layer, expert) extent. */
interface Item {
  /** record name in the index */
  readonly key: string;
  readonly store: StoreName;
  /** pack-format dtype of the record */
  readonly dtype: number;
  readonly shape: readonly number[];
  readonly offset: number;
  readonly nbytes: number;
  /** source tensor names */
  readonly inputs: readonly string[];
}

interface Layout {
  /** in work order */
  readonly items: readonly Item[];
  readonly binSizes: ReadonlyMap<StoreName, number>;
  /** per store, in offset order */
  readonly records: ReadonlyMap<StoreName, readonly Item[]>;
  readonly hparams: ReadonlyMap<string, number>;
  readonly configText: string;
  readonly revision: string | null;
  /** format_version of every index and of PACK_COMPLETE.json (formatVersionOf the records) */
  readonly formatVersion: number;
  readonly trunkDtype: TrunkDtype;
  readonly expertDtype: ExpertDtype;
  /** source tensor -> shard */
  readonly shards: ReadonlyMap<string, string | null>;
}

function storeOf(name: string): StoreName | null {
  if (EXPERT_RE.test(name)) return "experts";
  if (name.startsWith("vision_tower.") || name.startsWith("multi_modal_projector.")) return "vision";
  if (name.startsWith("language_model.")) return "trunk";
  return null;
}

/** Every reason not to pack this source (empty = fine). */
async function validateSource(source: TensorSource, allowRevision: boolean): Promise<string[]> {
  const problems: string[] = [];
  const revision = source.revision();
  if (revision !== PINNED_REVISION && !allowRevision) {
    const found = revision ? revision : "unknown (no revision recorded)";
    problems.push(`source revision is ${found}, but kvl is pinned to ${PINNED_REPO} at ${PINNED_REVISION}; ` +
      "pass --allow-revision to pack it anyway");
  }
  let config: unknown;
  try {
    config = source.config();
  } catch (err) {
    if (err instanceof UserError) return [...problems, err.message];
    throw err;
  }
  problems.push(...checkSupported(config));
  problems.push(...checkSource(source));
  for (const name of source.tensorNames()) {
    if (storeOf(name) === null) problems.push(`${name}: not a text, vision or projector tensor; kvl cannot place it`);
  }
  if (!(await source.assetFiles()).has("config.json")) problems.push("config.json is missing from the source");
  return problems;
}

interface Entry {
  key: string;
  dtype: number;
  shape: readonly number[];
  inputs: readonly string[];
}

/** Why `--expert-dtype q4` cannot store this (validated) config's experts, in one line, or null. */
function q4Refusal(config: unknown): string | null {
  const { hidden_size: h, moe_intermediate_size: i } = textDims(config);
  if (h % Q4_GROUP === 0 && i % Q4_GROUP === 0) return null;
  return `--expert-dtype q4 needs hidden_size and moe_intermediate_size to be multiples of ${Q4_GROUP} ` +
    `(this config: ${h} and ${i}); pack with --expert-dtype q8`;
}

async function computeLayout(source: TensorSource, trunkDtype: TrunkDtype = "bf16", expertDtype: ExpertDtype = "q8"): Promise<Layout> {
  const config = source.config();
  const assets = await source.assetFiles();
  const configText = decodeUtf8Strict(assets.get("config.json")!);
  const names = source.tensorNames();
  const infos = new Map(names.map((n) => [n, source.tensorInfo(n)]));
  const shards = new Map(names.map((n) => [n, source.shardOf(n)]));
  const perStore = new Map<StoreName, Entry[]>([["trunk", []], ["experts", []], ["vision", []]]);
  const experts = new Map<string, { layer: number; expert: number; parts: Map<string, string> }>();
  for (const name of names) {
    const m = EXPERT_RE.exec(name);
    if (m) {
      const [layer, expert] = [Number(m[1]), Number(m[2])];
      const id = `${layer}.${expert}`;
      if (!experts.has(id)) experts.set(id, { layer, expert, parts: new Map() });
      experts.get(id)!.parts.set(m[3]!, name);
      continue;
    }
    const dtype = name.endsWith(ROUTER_BIAS_SUFFIX) ? DTYPE_F32
      : trunkDtype === "q8" && isTrunkLinear(name) ? DTYPE_Q8_ROWS : DTYPE_BF16;
    perStore.get(storeOf(name)!)!.push({ key: name, dtype, shape: infos.get(name)!.shape, inputs: [name] });
  }
  const ordered = [...experts.values()].sort((a, b) => a.layer - b.layer || a.expert - b.expert);
  for (const { layer, expert, parts } of ordered) {
    const [gate, up, down] = ["gate_proj", "up_proj", "down_proj"].map((p) => parts.get(p)!) as [string, string, string];
    const [inter, hidden] = infos.get(gate)!.shape as [number, number];
    perStore.get("experts")!.push({
      key: expertRecordName(layer, expert), dtype: expertDtype === "q4" ? DTYPE_Q4_EXPERT : DTYPE_Q8_EXPERT,
      shape: [layer, expert, inter, hidden], inputs: [gate, up, down],
    });
  }
  const records = new Map<StoreName, Item[]>();
  const binSizes = new Map<StoreName, number>();
  for (const [store, entries] of perStore) {
    let cursor = 0;
    const items: Item[] = [];
    for (const { key, dtype, shape, inputs } of entries) {
      const nbytes = recordNbytes(dtype, shape);
      items.push({ key, store, dtype, shape, offset: cursor, nbytes, inputs });
      cursor = alignUp(cursor + nbytes, BIN_ALIGN);
    }
    records.set(store, items);
    binSizes.set(store, cursor);
  }
  // Work order: shard by shard (an item belongs to the last shard it needs), so a shard's
  // tensors are all consumed before the next shard is needed.
  const shardNames = [...new Set([...shards.values()].filter((s): s is string => s !== null))].sort();
  const rank = new Map(shardNames.map((s, i) => [s, i]));
  const storeRank: Record<StoreName, number> = { trunk: 0, vision: 1, experts: 2 };
  const last = (it: Item): number => Math.max(-1, ...it.inputs.map((n) => rank.get(shards.get(n) ?? "") ?? -1));
  const work = [...records.values()].flat().map((it) => ({ it, k: [last(it), storeRank[it.store], it.offset] as const }));
  work.sort((a, b) => a.k[0] - b.k[0] || a.k[1] - b.k[1] || a.k[2] - b.k[2]);
  return {
    items: work.map((w) => w.it), binSizes, records, hparams: configHparams(config), configText,
    revision: source.revision(), shards, formatVersion: formatVersionOf([...records.values()].flat()), trunkDtype, expertDtype,
  };
}

/** The journal's record of what is being packed: a rerun must match it exactly to resume. */
function fingerprint(layout: Layout, inventory: ReadonlyMap<string, TensorInfo>): string {
  return JSON.stringify({
    format_version: layout.formatVersion,
    // only when not the default, so a BF16 pack's journal is what it was before the option
    ...(layout.trunkDtype !== "bf16" ? { trunk_dtype: layout.trunkDtype } : {}),
    ...(layout.expertDtype !== "q8" ? { expert_dtype: layout.expertDtype } : {}),
    revision: layout.revision,
    config_sha256: createHash("sha256").update(layout.configText, "utf8").digest("hex"),
    bin_sizes: Object.fromEntries(layout.binSizes),
    items: layout.items.map((it) => [it.key, it.store, it.offset, it.nbytes]),
    // an array, not an object: tensor order must survive (JSON objects reorder integer-like keys)
    inventory: [...inventory].map(([name, { dtype, shape }]) => [name, dtype, [...shape], layout.shards.get(name) ?? null]),
  });
}

// ---------------------------------------------------------------------------------------------
// Item data

function u16(bytes: Uint8Array): Uint16Array {
  const aligned = bytes.byteOffset % 2 === 0 ? bytes : bytes.slice();
  return new Uint16Array(aligned.buffer, aligned.byteOffset, aligned.byteLength / 2);
}

/** The item's source tensors, read one after the other (sources need not allow concurrent reads). */
async function readInputs(source: TensorSource, item: Item): Promise<Uint8Array[]> {
  const out: Uint8Array[] = [];
  for (const name of item.inputs) {
    const { dtype, shape } = source.tensorInfo(name);
    const data = await source.read(name);
    const want = shape.reduce((a, b) => a * b, 1) * (DTYPE_SIZES[dtype] ?? NaN);
    if (data.byteLength !== want) {
      throw new UserError(`${name}: the source returned ${data.byteLength} bytes, its header says ${dtype} ${formatShape(shape)} ` +
        `(${want} bytes) — the checkpoint is corrupt`);
    }
    out.push(data);
  }
  return out;
}

/** The item's exact output bytes from its source tensors' bytes. */
function buildItem(source: TensorSource, item: Item, inputs: readonly Uint8Array[], core: PackingCore): Uint8Array {
  if (item.dtype === DTYPE_Q8_EXPERT || item.dtype === DTYPE_Q4_EXPERT) {
    const [gate, up, down] = inputs.map(u16) as [Uint16Array, Uint16Array, Uint16Array];
    try {
      return item.dtype === DTYPE_Q4_EXPERT
        ? core.packExpertQ4(gate, up, down, item.shape[2]!, item.shape[3]!)
        : core.packExpert(gate, up, down, item.shape[2]!, item.shape[3]!);
    } catch (err) {
      throw new UserError(`${item.inputs.join(", ")}: ${(err as Error).message}`);
    }
  }
  const data = inputs[0]!;
  if (item.dtype === DTYPE_Q8_ROWS) {
    // Row blocks of at most Q8_ROWS_CHUNK_BYTES of input: a WebAssembly core packs in its own
    // small memory (64 MiB unless told otherwise), and lm_head alone is 640 MiB of BF16. Rows
    // are quantised independently, so the blocks give the bytes of one call.
    // The int8 rows are written over the BF16 input they came from (row r's output ends at byte
    // (r+1)*cols, its unread input starts at 2*(r+1)*cols): lm_head then costs its 640 MiB of
    // input and no second 320 MiB buffer, which kept the full-size pack at 1.09 GiB peak RSS.
    const [rows, cols] = [item.shape[0]!, item.shape[1]!];
    const w = u16(data);
    const whole = q8RowsLayout(rows, cols);
    const out = data.byteLength >= whole.nbytes ? data.subarray(0, whole.nbytes) : new Uint8Array(whole.nbytes);
    const scales = new Uint8Array(4 * rows);
    const step = Math.max(1, Math.floor(Q8_ROWS_CHUNK_BYTES / (2 * cols)));
    for (let r = 0; r < rows; r += step) {
      const n = Math.min(step, rows - r);
      let part: Uint8Array;
      try {
        part = core.packQ8Rows(w.subarray(r * cols, (r + n) * cols), n, cols); // a copy: the input block may be overwritten now
      } catch (err) {
        throw new UserError(`${item.inputs[0]}: ${(err as Error).message}`);
      }
      const scale = q8RowsLayout(n, cols).scale;
      out.set(part.subarray(0, n * cols), r * cols);
      scales.set(part.subarray(scale, scale + 4 * n), 4 * r);
    }
    out.fill(0, rows * cols, whole.scale); // the alignment gap, as the core writes it
    out.set(scales, whole.scale);
    return out;
  }
  if (item.dtype === DTYPE_F32 && source.tensorInfo(item.inputs[0]!).dtype === "BF16") {
    const f32 = bf16BitsToF32(u16(data));
    return new Uint8Array(f32.buffer, f32.byteOffset, f32.byteLength);
  }
  return data;
}

/** The item's exact output bytes. */
async function itemBytes(source: TensorSource, item: Item, core: PackingCore): Promise<Uint8Array> {
  return buildItem(source, item, await readInputs(source, item), core);
}

/** Test hook: KVL_PACK_TEST_KILL_AT=<point> SIGKILLs this process at that exact point (the
 * crash-safety tests crash at deterministic places: item:N, flush:N, final:start,
 * final:<store>.idx, final:complete). */
function testKillPoint(point: string): void {
  if (process.env.KVL_PACK_TEST_KILL_AT === point) process.kill(process.pid, "SIGKILL");
}

// ---------------------------------------------------------------------------------------------
// Packing

/** --delete-consumed-shards for a checkpoint directory. */
function deleteShardsHooks(directory: string): ShardHooks {
  return {
    acquire() {},
    async release(shard: string) {
      try {
        await unlink(join(directory, shard));
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === "ENOENT") return;
        throw err;
      }
      await fsyncDir(directory);
    },
  };
}

/** The inventory rows of a journal's layout.json (fingerprint: [name, dtype, shape, shard]), or
 * null when they are not that. */
function journalInventory(rows: unknown): Map<string, InventoryEntry> | null {
  if (!Array.isArray(rows)) return null;
  const inventory = new Map<string, InventoryEntry>();
  for (const row of rows) {
    if (!Array.isArray(row) || row.length !== 4) return null;
    const [name, dtype, shape, shard] = row as unknown[];
    if (typeof name !== "string" || typeof dtype !== "string" || (shard !== null && typeof shard !== "string") ||
        !Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && (d as number) >= 0)) return null;
    inventory.set(name, { dtype, shape: shape as number[], shard });
  }
  return inventory;
}

/**
 * A TensorSource for a checkpoint directory. If an unfinished pack in DST recorded the inventory
 * and some shards were already deleted by --delete-consumed-shards, read from the journal's
 * inventory instead (the deleted shards' tensors are already packed).
 */
async function openSource(src: string, dst: string): Promise<TensorSource> {
  const layoutPath = join(dst, JOURNAL_DIR, JOURNAL_LAYOUT);
  const indexPath = join(src, INDEX_NAME);
  if (isFile(layoutPath) && isFile(indexPath)) {
    let recorded: unknown = null;
    let weightMap: unknown = null;
    try {
      recorded = JSON.parse(readFileSync(layoutPath, "utf8"));
      weightMap = (JSON.parse(readFileSync(indexPath, "utf8")) as { weight_map?: unknown } | null)?.weight_map;
    } catch {
      // not the journal's or the index's JSON: the checkpoint itself is opened below
    }
    const inventory = isJsonObject(recorded) ? journalInventory(recorded.inventory) : null;
    const shards = new Set(isJsonObject(weightMap) ? Object.values(weightMap).filter((s): s is string => typeof s === "string") : []);
    if (inventory !== null && isJsonObject(recorded) && [...shards].some((s) => !pathExists(join(src, s)))) {
      const assets = readAssets(src);
      const config = assets.get("config.json");
      if (config === undefined) throw new UserError(`${src} has no config.json; download it with the checkpoint`);
      const revision = typeof recorded.revision === "string" ? recorded.revision : null;
      return new InventorySource(src, decodeUtf8Strict(config), assets, inventory, revision);
    }
  }
  return CheckpointSource.open(src);
}

/**
 * Packs `src` (a checkpoint directory or a TensorSource) into the runtime directory `dst`;
 * returns `dst`. Resumable: rerunning after any interruption continues from the journal in
 * DST/.pack-journal and gives byte-identical output. Throws UserError for every problem a user
 * can fix (all of a source's problems at once, before anything is written).
 */
export async function packCheckpoint(src: string | TensorSource, dst: string, options: PackOptions): Promise<string> {
  const log = options.log ?? (() => {});
  let source: TensorSource;
  let hooks = options.shardHooks;
  let owned = false;
  if (!isFile(join(dst, COMPLETE_FILE))) checkOutputDir(dst, "DST");
  if (typeof src === "string") {
    requireFolder(src, "checkpoint directory", "pass the folder that holds config.json and the .safetensors files");
    if (isFile(join(dst, COMPLETE_FILE)) && !pathExists(join(dst, JOURNAL_DIR)) && shardsDeleted(src)) {
      // --delete-consumed-shards took the source's tensors: its config and revision are all
      // that is left to compare with the finished pack.
      const packed = await PackReader.open(dst);
      const config = isFile(join(src, "config.json")) ? readFileSync(join(src, "config.json"), "utf8") : null;
      if (config !== packed.configText || findRevision(src) !== packed.revision) {
        throw new UserError(finishedElsewhere(dst, "another config.json or source revision"));
      }
      log(`${dst} already holds a complete pack; nothing to do`);
      return dst;
    }
    source = await openSource(src, dst);
    owned = true;
    if (options.deleteConsumedShards && hooks === undefined) hooks = deleteShardsHooks(src);
  } else {
    source = src;
    if (options.deleteConsumedShards) throw new UserError("--delete-consumed-shards needs a checkpoint directory as the source");
    hooks ??= src.shardHooks;
  }
  try {
    return await pack(source, dst, options, hooks, log);
  } finally {
    if (owned) await source.close?.();
  }
}

/** Whether the checkpoint directory's index lists a shard that is gone (deleted by
 * --delete-consumed-shards once packed). */
function shardsDeleted(src: string): boolean {
  const indexPath = join(src, INDEX_NAME);
  if (!isFile(indexPath)) return false;
  try {
    return [...new Set(readIndex(indexPath).values())].some((shard) => !pathExists(join(src, shard)));
  } catch {
    return false; // a broken index: opening the source says what is wrong with it
  }
}

/** The refusal to pack over a finished pack made with another --trunk-dtype or --expert-dtype. */
function finishedDtype(dst: string, { flag, was, now }: DtypeChange): string {
  return `${dst} is a finished pack made with ${flag} ${was}, not ${now}; choose another destination, or remove ${dst} to repack it`;
}

/** The refusal to pack over a finished pack of something else. */
function finishedElsewhere(dst: string, why: string): string {
  return `${dst} is a finished pack of another source (${why}); choose another destination, or remove ${dst} to pack this source there`;
}

/**
 * Why packing `source` with this layout must not accept the finished pack in `dst` as done (one
 * line, with advice), or null when the pack is this source's: the indexes must hold the same revision, config.json and
 * records (names, dtypes, shapes, offsets, sizes), and the smallest item of each store and shard
 * must pack to the CRC the index recorded (a few small reads: a different checkpoint with the same
 * layout, such as another seed or a fine-tune, differs in every tensor).
 */
async function finishedPackRefusal(source: TensorSource, dst: string, layout: Layout, core: PackingCore): Promise<string | null> {
  let packed: PackReader;
  try {
    packed = await PackReader.open(dst);
  } catch (err) {
    if (!(err instanceof UserError)) throw err;
    return `${dst} has ${COMPLETE_FILE} but does not read back as a pack (${err.message.split("\n")[0]}); remove ${dst} and pack again`;
  }
  if (packed.trunkDtype !== layout.trunkDtype) return finishedDtype(dst, { flag: "--trunk-dtype", was: packed.trunkDtype, now: layout.trunkDtype });
  if (packed.expertDtype !== layout.expertDtype) return finishedDtype(dst, { flag: "--expert-dtype", was: packed.expertDtype, now: layout.expertDtype });
  if (packed.revision !== layout.revision) {
    return finishedElsewhere(dst, `source revision ${packed.revision ?? "unknown"}; this source's is ${layout.revision ?? "unknown"}`);
  }
  if (packed.configText !== layout.configText) return finishedElsewhere(dst, "another config.json");
  for (const store of STORES) {
    const records = packed.stores.get(store)!.records;
    const items = layout.records.get(store)!;
    const same = records.length === items.length && items.every((it, i) => {
      const rec = records[i]!;
      return rec.name === it.key && rec.dtype === it.dtype && rec.offset === it.offset && rec.nbytes === it.nbytes &&
        rec.shape.length === it.shape.length && rec.shape.every((d, k) => d === it.shape[k]);
    });
    if (!same) return finishedElsewhere(dst, `other ${store} tensors`);
  }
  const sample = new Map<string, Item>();
  for (const it of layout.items) {
    const key = `${it.store} ${it.inputs.map((n) => layout.shards.get(n) ?? "").join(" ")}`;
    const best = sample.get(key);
    if (best === undefined || it.nbytes < best.nbytes) sample.set(key, it);
  }
  for (const it of sample.values()) {
    if (crc32(await itemBytes(source, it, core)) !== packed.record(it.key).crc32) return finishedElsewhere(dst, `other data in ${it.key}`);
  }
  return null;
}

/** The --trunk-dtype and --expert-dtype a journal's fingerprint records (null when it does not parse). */
function dtypesOf(print: string): { trunk: string; expert: string } | null {
  try {
    const parsed = JSON.parse(print) as { trunk_dtype?: unknown; expert_dtype?: unknown };
    return { trunk: String(parsed.trunk_dtype ?? "bf16"), expert: String(parsed.expert_dtype ?? "q8") };
  } catch {
    return null;
  }
}

/** The journal's shards.json: [shard, digest] pairs; a one-line UserError when it is not that. */
function journalDigests(path: string): Array<[string, string]> {
  let pairs: unknown = null;
  try {
    pairs = parseJson(readFileSync(path));
  } catch (err) {
    if (!(err instanceof JsonTextError)) throw err;
  }
  if (!Array.isArray(pairs) || !pairs.every((p) => Array.isArray(p) && p.length === 2 && p.every((s) => typeof s === "string"))) {
    throw new UserError(`${path}: not a list of [shard, digest] pairs, so the unfinished pack cannot be resumed; ` +
      "delete its directory and pack again");
  }
  return pairs as Array<[string, string]>;
}

/** A dtype option the journal's fingerprint records, with the value it was made with and the
 * one asked for now. */
interface DtypeChange {
  readonly flag: "--trunk-dtype" | "--expert-dtype";
  readonly was: string;
  readonly now: string;
}

/**
 * Whether the journal in `journal` records this pack: null when its fingerprint is `print` and
 * every shard still present has the digest it had when the pack began; else what differs
 * (option: the --trunk-dtype or --expert-dtype it was made with, when the two differ in it;
 * null: the source).
 */
function journalMismatch(journal: string, print: string, digests: ReadonlyMap<string, string>): { option: DtypeChange | null } | null {
  const recordedLayout = readFileSync(join(journal, JOURNAL_LAYOUT), "utf8");
  if (recordedLayout !== print) {
    const [was, now] = [dtypesOf(recordedLayout), dtypesOf(print)];
    if (was === null || now === null) return { option: null };
    if (was.trunk !== now.trunk) return { option: { flag: "--trunk-dtype", was: was.trunk, now: now.trunk } };
    if (was.expert !== now.expert) return { option: { flag: "--expert-dtype", was: was.expert, now: now.expert } };
    return { option: null };
  }
  // Same layout; the same data? Compare the shards still present with their digests at the start.
  const shardsPath = join(journal, JOURNAL_SHARDS);
  const recorded = isFile(shardsPath) ? journalDigests(shardsPath) : [];
  for (const [shard, digest] of recorded) {
    const now = digests.get(shard);
    if (now !== undefined && now !== digest) return { option: null };
  }
  return null;
}

/** Creates or resumes DST; returns the keys of journaled (durably written) items. */
async function prepareDst(dst: string, print: string, digests: ReadonlyMap<string, string>,
  log: (line: string) => void): Promise<Set<string>> {
  const journal = join(dst, JOURNAL_DIR);
  const layoutPath = join(journal, JOURNAL_LAYOUT);
  const shardsPath = join(journal, JOURNAL_SHARDS);
  makeOutputDir(dst, "DST");
  if (isFile(layoutPath)) {
    const mismatch = journalMismatch(journal, print, digests);
    if (mismatch?.option) {
      const { flag, was, now } = mismatch.option;
      throw new UserError(`${dst}: holds an unfinished pack made with ${flag} ${was}, not ${now}; ` +
        `rerun with ${flag} ${was} to finish it, or delete the directory`);
    }
    if (mismatch) {
      throw new UserError(`${dst}: holds an unfinished pack of a different source or kvl version; ` +
        "delete the directory or choose another destination");
    }
    const donePath = join(journal, JOURNAL_DONE);
    if (isFile(donePath)) {
      const raw = readFileSync(donePath);
      if (raw.length > 0 && raw[raw.length - 1] !== 0x0a) {
        // A crash mid-append left a torn last line: drop it (its item is simply redone).
        truncateSync(donePath, raw.lastIndexOf(0x0a) + 1);
        const fd = openSync(donePath, "r+");
        try {
          fsyncSync(fd);
        } finally {
          closeSync(fd);
        }
      }
    }
    const done = new Set(readDoneCrcs(dst).keys());
    log(`resuming the pack in ${dst}: ${done.size} items already written`);
    return done;
  }
  if (isDir(dst)) {
    const foreign = readdirSync(dst).filter((n) => !FOREIGN_OK.has(n) && n !== JOURNAL_DIR);
    if (foreign.length > 0) {
      throw new UserError(`${dst}: is not empty (${foreign.sort().slice(0, 5).join(", ")}) and holds no unfinished pack; ` +
        "choose an empty or new destination");
    }
  }
  makeOutputDir(journal, "DST");
  await writeAtomic(shardsPath, Buffer.from(JSON.stringify([...digests]), "utf8"));
  // The layout is fixed before any .bin byte exists, so every rerun writes the same bytes.
  await writeAtomic(layoutPath, Buffer.from(print, "utf8"));
  return new Set();
}

/** Room for what is not in the .bin files: the indexes, the tokenizer and template files, the
 * journal (a few MiB for the full model). */
const SMALL_FILES_BYTES = 4 * 2 ** 20;

function sizeText(bytes: number): string {
  return bytes >= 2 ** 30 ? `${(bytes / 2 ** 30).toFixed(1)} GiB` : `${Math.ceil(bytes / 2 ** 20)} MiB`;
}

/**
 * Refuses, before any .bin byte is written, a destination whose disk has less free space than
 * what the pack still needs (its .bin files, less the items an earlier run wrote, and the small
 * files), naming both sizes: otherwise the progress bar runs to 100 % and the write fails with
 * ENOSPC at the end. The .bin files are sparse until written, so what they hold already is what
 * the journal says is done.
 */
function checkFreeSpace(dst: string, layout: Layout, done: ReadonlySet<string>): void {
  let total = SMALL_FILES_BYTES;
  for (const size of layout.binSizes.values()) total += size;
  let written = 0;
  for (const it of layout.items) if (done.has(it.key)) written += it.nbytes;
  const need = total - written;
  const fs = statfsSync(dst);
  const free = fs.bavail * fs.bsize;
  if (free < need) {
    const more = written > 0 ? ` more (${sizeText(total)} in all; an earlier run wrote ${sizeText(written)})` : "";
    throw new UserError(`${dst}: the pack needs ${sizeText(need)}${more} but its disk has ${sizeText(free)} free; ` +
      "free some space or choose a destination on another disk (an interrupted pack resumes where it stopped)");
  }
}

/** Journaled items and their CRCs; a torn (newline-less) last line is ignored. */
function readDoneCrcs(dst: string): Map<string, number> {
  const crcs = new Map<string, number>();
  const path = join(dst, JOURNAL_DIR, JOURNAL_DONE);
  if (isFile(path)) {
    const lines = readFileSync(path, "latin1").split("\n").slice(0, -1);
    for (const line of lines) {
      const parts = line.split(" ");
      if (parts.length === 2 && /^[0-9a-f]{8}$/.test(parts[1]!)) crcs.set(parts[0]!, parseInt(parts[1]!, 16));
    }
  }
  return crcs;
}

async function pack(source: TensorSource, dst: string, options: PackOptions, hooks: ShardHooks | undefined,
  log: (line: string) => void): Promise<string> {
  const journal = join(dst, JOURNAL_DIR);
  const finished = isFile(join(dst, COMPLETE_FILE));
  // A finished pack is checked against this source whatever its revision (the pack records it).
  const problems = await validateSource(source, finished || (options.allowRevision ?? false));
  if (problems.length > 0) {
    throw new UserError(`cannot pack this source (${problems.length} problem(s)):\n  - ${problems.join("\n  - ")}`);
  }
  const expertDtype = options.expertDtype ?? "q8";
  const q4 = expertDtype === "q4" ? q4Refusal(source.config()) : null;
  if (q4 !== null) throw new UserError(q4);
  const layout = await computeLayout(source, options.trunkDtype ?? "bf16", expertDtype);
  const inventory = new Map(source.tensorNames().map((n) => [n, source.tensorInfo(n)]));
  const print = fingerprint(layout, inventory);
  const digests = new Map<string, string>();
  for (const shard of new Set(layout.shards.values())) {
    const digest = shard === null ? null : ((await source.shardDigest?.(shard)) ?? null);
    if (shard !== null && digest !== null) digests.set(shard, digest);
  }
  if (finished) {
    if (isFile(join(journal, JOURNAL_LAYOUT))) {
      // Killed after the completion marker was written but before the journal was removed: the
      // journal still says what was packed (the source's shards may be gone by now).
      const mismatch = journalMismatch(journal, print, digests);
      if (mismatch?.option) throw new UserError(finishedDtype(dst, mismatch.option));
      if (mismatch) throw new UserError(finishedElsewhere(dst, "its journal records another source"));
    } else {
      const refusal = await finishedPackRefusal(source, dst, layout, options.core);
      if (refusal !== null) throw new UserError(refusal);
      log(`${dst} already holds a complete pack; nothing to do`);
      return dst;
    }
    await rm(journal, { recursive: true, force: true });
    await fsyncDir(dst);
    return dst;
  }
  const done = await prepareDst(dst, print, digests, log);

  for (const [store, size] of layout.binSizes) {
    const binPath = join(dst, `${store}.bin`);
    if (done.size > 0 && (!isFile(binPath) || statSync(binPath).size !== size)) {
      // The journal outlived its .bin file (deleted or replaced): its items must be redone.
      log(`${store}.bin is missing or resized; rewriting its items`);
      for (const it of layout.records.get(store)!) done.delete(it.key);
    }
  }
  checkFreeSpace(dst, layout, done);
  const handles = new Map<StoreName, FileHandle>();
  try {
    for (const [store, size] of layout.binSizes) {
      const handle = await open(join(dst, `${store}.bin`), constants.O_RDWR | constants.O_CREAT, 0o644);
      handles.set(store, handle);
      // sparse: padding reads as zero and is never written
      if ((await handle.stat()).size !== size) await handle.truncate(size);
    }
    await runItems(source, dst, layout, done, handles, options, hooks);
    for (const handle of handles.values()) await handle.sync();
  } finally {
    for (const handle of handles.values()) await handle.close();
  }

  const crcs = readDoneCrcs(dst);
  testKillPoint("final:start");
  const assets = await source.assetFiles();
  for (const name of ASSET_FILES) {
    const data = assets.get(name);
    if (data !== undefined) await writeAtomic(join(dst, name), data);
  }
  await writeAtomic(join(dst, SOURCE_REVISION_FILE), Buffer.from(`${layout.revision ?? "unknown"}\n`, "ascii"));
  const files: CompleteMarker["files"] = {};
  for (const store of STORES) {
    const records: TensorRecord[] = layout.records.get(store)!.map((it) => {
      const crc = crcs.get(it.key);
      if (crc === undefined) throw new Error(`internal: ${it.key} was not journaled`);
      return { name: it.key, dtype: it.dtype, shape: it.shape, offset: it.offset, nbytes: it.nbytes, crc32: crc };
    });
    const data = encodeIndex(STORE_KINDS[store], layout.binSizes.get(store)!, layout.hparams, records, layout.configText,
      layout.revision, layout.formatVersion);
    await writeAtomic(join(dst, `${store}.idx`), data);
    files[`${store}.bin`] = { size: layout.binSizes.get(store)! };
    files[`${store}.idx`] = { size: data.length, crc32: crc32(data) };
    testKillPoint(`final:${store}.idx`);
  }
  // leftovers of a crash inside an earlier run's writeAtomic
  const ours = new Set<string>([...Object.keys(files), ...ASSET_FILES, SOURCE_REVISION_FILE, COMPLETE_FILE]);
  for (const name of readdirSync(dst)) {
    if (name.endsWith(".tmp") && ours.has(name.slice(0, -4))) await unlink(join(dst, name));
  }
  const complete: CompleteMarker = {
    format_version: layout.formatVersion, source_revision: layout.revision, files,
    // only a Q8 trunk and Q4 experts say so: other markers stay byte-identical to earlier packs
    ...(layout.trunkDtype !== "bf16" ? { trunk_dtype: layout.trunkDtype } : {}),
    ...(layout.expertDtype !== "q8" ? { expert_dtype: layout.expertDtype } : {}),
  };
  await writeAtomic(join(dst, COMPLETE_FILE), Buffer.from(encodeCompleteMarker(complete), "utf8"));
  testKillPoint("final:complete");
  await rm(journal, { recursive: true, force: true });
  await fsyncDir(dst);
  log(`packed into ${dst}`);
  return dst;
}

async function runItems(source: TensorSource, dst: string, layout: Layout, done: Set<string>,
  handles: ReadonlyMap<StoreName, FileHandle>, options: PackOptions, hooks: ShardHooks | undefined): Promise<void> {
  const journalPath = join(dst, JOURNAL_DIR, JOURNAL_DONE);
  const flushItems = envPositiveInt("KVL_PACK_FLUSH_ITEMS") ?? 256;
  // Shard bookkeeping: a shard is released once every item reading from it is journaled.
  const pendingByShard = new Map<string, Set<string>>();
  for (const it of layout.items) {
    for (const name of it.inputs) {
      const shard = layout.shards.get(name);
      if (shard != null && !done.has(it.key)) {
        if (!pendingByShard.has(shard)) pendingByShard.set(shard, new Set());
        pendingByShard.get(shard)!.add(it.key);
      }
    }
  }
  const allShards = [...new Set([...layout.shards.values()].filter((s): s is string => s !== null))].sort();
  const released = new Set<string>();
  const acquired = new Set<string>();

  const releaseFinished = async (): Promise<void> => {
    if (hooks === undefined) return;
    for (const shard of allShards) {
      if (!released.has(shard) && !pendingByShard.get(shard)?.size) {
        await source.releaseShard?.(shard);
        await hooks.release(shard);
        released.add(shard);
      }
    }
  };
  await releaseFinished(); // shards fully consumed by an earlier, interrupted run

  const progress = options.progress ?? silentProgress;
  const total = layout.items.reduce((a, it) => a + it.nbytes, 0);
  const initial = layout.items.reduce((a, it) => a + (done.has(it.key) ? it.nbytes : 0), 0);
  progress.start("packing", total, initial);
  const pending: Array<[Item, number]> = [];
  let pendingBytes = 0;
  const touched = new Set<StoreName>();
  let written = 0;
  let flushes = 0;

  // Write-behind: one item's write may still be in flight while the next item is computed; it
  // is awaited before the next write, before a flush fsyncs, and at the end.
  let writing: Promise<void> | undefined;
  const settleWrite = async (): Promise<void> => {
    const w = writing;
    writing = undefined;
    await w;
  };

  const flush = async (): Promise<void> => {
    await settleWrite();
    if (pending.length === 0) return;
    for (const store of touched) await handles.get(store)!.sync();
    touched.clear();
    const fd = openSync(journalPath, "a");
    try {
      const text = pending.map(([it, crc]) => `${it.key} ${crc.toString(16).padStart(8, "0")}\n`).join("");
      writeSync(fd, Buffer.from(text, "latin1"));
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
    for (const [it] of pending) {
      for (const name of it.inputs) {
        const shard = layout.shards.get(name);
        if (shard != null) pendingByShard.get(shard)?.delete(it.key);
      }
    }
    pending.length = 0;
    pendingBytes = 0;
    flushes++;
    testKillPoint(`flush:${flushes}`);
    await releaseFinished();
  };

  // Read-ahead: the next item's inputs are read while this one is quantised and written (one
  // read chain at a time; only items of at most PREFETCH_BYTES whose shards are already here, so
  // memory stays at about one large tensor plus one small item).
  let ahead: { item: Item; inputs: Promise<Uint8Array[]> } | undefined;
  const inputBytes = (it: Item): number =>
    it.inputs.reduce((a, n) => a + source.tensorInfo(n).shape.reduce((x, y) => x * y, 1) * (DTYPE_SIZES[source.tensorInfo(n).dtype] ?? 0), 0);
  const readAhead = (from: number): void => {
    const next = layout.items.slice(from).find((it) => !done.has(it.key));
    if (next === undefined || inputBytes(next) > PREFETCH_BYTES) return;
    if (hooks !== undefined && next.inputs.some((n) => { const s = layout.shards.get(n); return s != null && !acquired.has(s); })) return;
    const inputs = readInputs(source, next);
    inputs.catch(() => {}); // an error surfaces when the item is reached (or not at all if the run stops first)
    ahead = { item: next, inputs };
  };

  try {
    for (const [index, it] of layout.items.entries()) {
      if (done.has(it.key)) continue;
      if (hooks !== undefined) {
        for (const name of it.inputs) {
          const shard = layout.shards.get(name);
          if (shard != null && !acquired.has(shard)) {
            // Everything from earlier shards is durable before the next shard arrives (keeps
            // kvl prepare's scratch space at about one shard).
            await flush();
            await hooks.acquire(shard);
            acquired.add(shard);
          }
        }
      }
      const inputs = await (ahead?.item === it ? ahead.inputs : readInputs(source, it));
      ahead = undefined;
      readAhead(index + 1);
      const data = buildItem(source, it, inputs, options.core);
      inputs.length = 0;
      if (data.byteLength !== it.nbytes) {
        throw new UserError(`${it.key}: produced ${data.byteLength} bytes, layout expects ${it.nbytes}`);
      }
      await settleWrite();
      const write = writeAllAt(handles.get(it.store)!, data, it.offset);
      if (data.byteLength <= PREFETCH_BYTES) {
        writing = write;
        write.catch(() => {}); // awaited (and its error thrown) by settleWrite
      } else {
        await write;
      }
      touched.add(it.store);
      pending.push([it, crc32(data)]);
      pendingBytes += data.byteLength;
      written++;
      testKillPoint(`item:${written}`);
      progress.add(data.byteLength);
      if (pendingBytes >= FLUSH_BYTES || pending.length >= flushItems) await flush();
    }
    await flush();
  } finally {
    await writing?.catch(() => {}); // nothing may write after the handles close
    progress.stop();
  }
}
