/**
 * pack-format.ts — the kvl runtime-directory ("pack") format of docs/FORMAT.md: constants, index
 * (.idx) encoding and fully validating decoding, the completion marker (PACK_COMPLETE.json) and
 * its validation, the expert-extent layouts (Q8 and Q4), record sizes, CRC-32, and a reader of whole packs
 * with `verify` (the structure always, every data CRC when asked: `kvl prepare`'s last step).
 *
 * Owns: the on-disk constants and byte layouts, and the rules a pack must follow to be read (the
 * same rules wasm-core/src/store.c enforces). Does not own: deciding what goes into a pack or in
 * which order (packer/pack.ts), quantising (the core's kvl_pack_expert,
 * kvl_pack_expert_q4 and kvl_pack_q8_rows), the C reader.
 *
 * u64 fields are validated as bigint (hostile values must not wrap or round); the decoded index
 * carries them as numbers, exact for every size a real file can have.
 */
import { readFileSync, statSync } from "node:fs";
import { open } from "node:fs/promises";
import { join } from "node:path";
import { crc32 as zlibCrc32 } from "node:zlib";

import { type JsonObject, decodeUtf8Strict, isJsonObject, jsonText, parseJson } from "../system/json-file.js";
import { requireFolder } from "./file-kind.js";
import { UserError } from "../system/user-error.js";

const IDX_MAGIC = "KVLIDX01";
const HEADER_BYTES = 128;
const HPARAM_RECORD_BYTES = 64;
const TENSOR_RECORD_BYTES = 192;
const HPARAM_KEY_BYTES = 56;
const TENSOR_NAME_BYTES = 128;
export const BIN_ALIGN = 4096;
const MAX_NDIM = 4;
/** Largest matrix dimension of a Q8_ROWS record and of a Q4_EXPERT extent (store.c's MAX_EXPERT_DIM). */
const MAX_QUANT_DIM = 2n ** 24n;

export type StoreName = "trunk" | "experts" | "vision";
export const STORE_TRUNK = 1;
export const STORE_VISION = 3;
const STORE_NAMES: Readonly<Record<number, StoreName>> = { 1: "trunk", 2: "experts", 3: "vision" };
export const STORE_KINDS: Readonly<Record<StoreName, number>> = { trunk: 1, experts: 2, vision: 3 };
/** Stores in kind order (the order PACK_COMPLETE.json lists them and readers check them). */
export const STORES: readonly StoreName[] = ["trunk", "experts", "vision"];

export const DTYPE_BF16 = 1;
export const DTYPE_F32 = 2;
export const DTYPE_Q8_EXPERT = 3;
/** One row-wise Q8 matrix [rows, cols] (a trunk Linear weight; format version 2): see q8RowsLayout. */
export const DTYPE_Q8_ROWS = 4;
/** One routed expert's extent in 4 bits, groups of 32 with BF16 scales (format version 3): see q4ExpertLayout. */
export const DTYPE_Q4_EXPERT = 5;
/** What `kvl pack --trunk-dtype` stores the trunk's Linear weights as. */
export type TrunkDtype = "bf16" | "q8";
export const TRUNK_DTYPES: readonly TrunkDtype[] = ["bf16", "q8"];
/** What `kvl pack --expert-dtype` stores the routed experts as: row-wise Q8 (Q8_EXPERT) or 4-bit groups (Q4_EXPERT). */
export type ExpertDtype = "q8" | "q4";
export const EXPERT_DTYPES: readonly ExpertDtype[] = ["q8", "q4"];
/** Q4_EXPERT: columns per scale group; I and H must be multiples of it. */
export const Q4_GROUP = 32;

/** Files copied verbatim from the source checkpoint (those that exist), in this order. */
export const ASSET_FILES = [
  "config.json", "generation_config.json", "tokenizer_config.json", "tiktoken.model",
  "chat_template.jinja", "preprocessor_config.json",
] as const;
export const SOURCE_REVISION_FILE = "SOURCE_REVISION.txt";
export const COMPLETE_FILE = "PACK_COMPLETE.json";
export const JOURNAL_DIR = ".pack-journal";
const INCOMPLETE_HINT = "the pack is incomplete; rerun kvl pack";

const CRC_FIELD_OFFSET = 36;

export function alignUp(value: number, alignment: number): number {
  return Math.ceil(value / alignment) * alignment;
}

/** zlib's CRC-32 (continuing from `previous`), unsigned, as the .idx crc32 fields hold it. */
export function crc32(data: Uint8Array, previous = 0): number {
  return zlibCrc32(data, previous) >>> 0;
}

function hex8(n: number): string {
  return n.toString(16).padStart(8, "0");
}

// ---------------------------------------------------------------------------------------------
// Expert extents

/** Byte offsets of the sub-blocks inside one (layer, expert) extent, relative to its start. */
interface ExpertLayout {
  readonly intermediate: number;
  readonly hidden: number;
  readonly gate_q: number;
  readonly up_q: number;
  readonly down_q: number;
  readonly gate_s: number;
  readonly up_s: number;
  readonly down_s: number;
  readonly nbytes: number;
}

function expertLayoutBig(i: bigint, h: bigint): { [K in keyof ExpertLayout]: bigint } {
  const a64 = (x: bigint): bigint => ((x + 63n) / 64n) * 64n;
  const gate_q = 0n;
  const up_q = a64(gate_q + i * h);
  const down_q = a64(up_q + i * h);
  const gate_s = a64(down_q + h * i);
  const up_s = a64(gate_s + 4n * i);
  const down_s = a64(up_s + 4n * i);
  return { intermediate: i, hidden: h, gate_q, up_q, down_q, gate_s, up_s, down_s, nbytes: down_s + 4n * h };
}

/** docs/FORMAT.md "Expert extents" (the core's kvl_expert_extent_bytes gives the same nbytes). */
function expertLayout(intermediate: number, hidden: number): ExpertLayout {
  const big = expertLayoutBig(BigInt(intermediate), BigInt(hidden));
  return Object.fromEntries(Object.entries(big).map(([k, v]) => [k, Number(v)])) as unknown as ExpertLayout;
}

/** docs/FORMAT.md "Q4_EXPERT extents": nibbles [rows, cols/2] per matrix, then BF16 scales
 * [rows, cols/32] per matrix, each sub-block 64-byte aligned (the same field names as the Q8
 * layout; the core's kvl_expert_q4_extent_bytes gives the same nbytes). I, H multiples of 32
 * (decodeIndex refuses others before asking). */
function q4ExpertLayoutBig(i: bigint, h: bigint): { [K in keyof ExpertLayout]: bigint } {
  const a64 = (x: bigint): bigint => ((x + 63n) / 64n) * 64n;
  const g = BigInt(Q4_GROUP);
  const gate_q = 0n;
  const up_q = a64(gate_q + (i * h) / 2n);
  const down_q = a64(up_q + (i * h) / 2n);
  const gate_s = a64(down_q + (h * i) / 2n);
  const up_s = a64(gate_s + 2n * ((i * h) / g));
  const down_s = a64(up_s + 2n * ((i * h) / g));
  return { intermediate: i, hidden: h, gate_q, up_q, down_q, gate_s, up_s, down_s, nbytes: down_s + 2n * ((h * i) / g) };
}

export function q4ExpertLayout(intermediate: number, hidden: number): ExpertLayout {
  const big = q4ExpertLayoutBig(BigInt(intermediate), BigInt(hidden));
  return Object.fromEntries(Object.entries(big).map(([k, v]) => [k, Number(v)])) as unknown as ExpertLayout;
}

/** docs/FORMAT.md "Q8_ROWS": int8 q [rows, cols] at 0, f32 scale [rows] at align64(rows*cols) —
 * the sub-block rule of the expert extents, with the same row quantisation. */
function q8RowsLayoutBig(rows: bigint, cols: bigint): { scale: bigint; nbytes: bigint } {
  const scale = ((rows * cols + 63n) / 64n) * 64n;
  return { scale, nbytes: scale + 4n * rows };
}

export function q8RowsLayout(rows: number, cols: number): { scale: number; nbytes: number } {
  const big = q8RowsLayoutBig(BigInt(rows), BigInt(cols));
  return { scale: Number(big.scale), nbytes: Number(big.nbytes) };
}

// ---------------------------------------------------------------------------------------------
// Record dtypes

/** One row per record dtype: everything decodeIndex checks that depends on the dtype. A new
 * dtype is one row here, one in wasm-core/src/store.c dtype_rows, and its section of
 * docs/FORMAT.md. */
interface DtypeRow {
  /** as FORMAT.md and the messages spell it */
  readonly name: string;
  /** the lowest format_version whose index may hold it (packs holding it say at least this) */
  readonly minVersion: number;
  /** the stores the packer writes it to (the engine checks which tensors may have it; the index
   * readers accept any store) */
  readonly stores: readonly StoreName[];
  /** What is wrong with this shape for the dtype (the message after the record's label), or
   * undefined; shape has ndim (1..4) entries. */
  readonly shapeProblem: (shape: readonly bigint[]) => string | undefined;
  /** data bytes of a record of this shape (one shapeProblem accepts) */
  readonly nbytes: (shape: readonly bigint[]) => bigint;
}

const shapeText = (shape: readonly bigint[]): string => `[${shape.join(", ")}]`;
const zeroDimension = (shape: readonly bigint[]): string | undefined =>
  shape.some((d) => d === 0n) ? ` has a zero dimension in shape ${shapeText(shape)}` : undefined;
const denseBytes = (itemsize: number) => (shape: readonly bigint[]): bigint => BigInt(itemsize) * shape.reduce((a, d) => a * d, 1n);

const DTYPE_ROWS: Readonly<Record<number, DtypeRow>> = {
  [DTYPE_BF16]: { name: "BF16", minVersion: 1, stores: ["trunk", "vision"], shapeProblem: zeroDimension, nbytes: denseBytes(2) },
  [DTYPE_F32]: { name: "F32", minVersion: 1, stores: ["trunk"], shapeProblem: zeroDimension, nbytes: denseBytes(4) },
  [DTYPE_Q8_EXPERT]: {
    name: "Q8_EXPERT", minVersion: 1, stores: ["experts"],
    shapeProblem: (shape) => shape.length !== 4 || shape[2] === 0n || shape[3] === 0n
      ? `: Q8 expert records need shape [layer, expert, I, H] with I, H > 0, found ${shapeText(shape)}` : undefined,
    nbytes: (shape) => expertLayoutBig(shape[2]!, shape[3]!).nbytes,
  },
  [DTYPE_Q8_ROWS]: {
    name: "Q8_ROWS", minVersion: 2, stores: ["trunk"],
    // store.c's bound: keeps rows * cols far from u64 overflow in both readers
    shapeProblem: (shape) => zeroDimension(shape) ?? (shape.length !== 2 || shape[0]! > MAX_QUANT_DIM || shape[1]! > MAX_QUANT_DIM
      ? `: Q8_ROWS records need shape [rows, cols] with 1 <= rows, cols <= ${MAX_QUANT_DIM}, found ${shapeText(shape)}` : undefined),
    nbytes: (shape) => q8RowsLayoutBig(shape[0]!, shape[1]!).nbytes,
  },
  [DTYPE_Q4_EXPERT]: {
    name: "Q4_EXPERT", minVersion: 3, stores: ["experts"],
    // store.c's bounds: whole groups of 32, I and H at most MAX_EXPERT_DIM
    shapeProblem: (shape) => shape.length !== 4 || shape[2] === 0n || shape[3] === 0n || shape[2]! % BigInt(Q4_GROUP) !== 0n ||
        shape[3]! % BigInt(Q4_GROUP) !== 0n || shape[2]! > MAX_QUANT_DIM || shape[3]! > MAX_QUANT_DIM
      ? `: Q4 expert records need shape [layer, expert, I, H] with I, H positive multiples of ${Q4_GROUP} ` +
        `up to ${MAX_QUANT_DIM}, found ${shapeText(shape)}` : undefined,
    nbytes: (shape) => q4ExpertLayoutBig(shape[2]!, shape[3]!).nbytes,
  },
};

export const DTYPE_NAMES: Readonly<Record<number, string>> =
  Object.fromEntries(Object.entries(DTYPE_ROWS).map(([dtype, row]) => [dtype, row.name]));
/** The format versions this reader reads: 1 up to the newest a dtype needs. */
const FORMAT_VERSIONS: readonly number[] = Array.from(
  { length: Math.max(...Object.values(DTYPE_ROWS).map((row) => row.minVersion)) }, (_, i) => i + 1);
/** "1, 2 and 3": the versions this reader reads, as its refusals list them. */
const VERSIONS_TEXT = FORMAT_VERSIONS.length === 1 ? "1" : `${FORMAT_VERSIONS.slice(0, -1).join(", ")} and ${FORMAT_VERSIONS.at(-1)}`;

export function expertRecordName(layer: number, expert: number): string {
  return `language_model.model.layers.${layer}.mlp.experts.${expert}`;
}

// ---------------------------------------------------------------------------------------------
// Numerics (for readers; the packer's quantisation is the core's)

/** Raw BF16 bits -> float32, exactly. */
export function bf16BitsToF32(bits: Uint16Array): Float32Array {
  const out = new Uint32Array(bits.length);
  for (let i = 0; i < bits.length; i++) out[i] = bits[i]! << 16;
  return new Float32Array(out.buffer);
}

/** q * scale[row] in FP32, for a row-major [rows, cols] Q8 matrix. */
function dequantizeRowsQ8(q: Int8Array, scale: Float32Array, rows: number, cols: number): Float32Array {
  const out = new Float32Array(rows * cols);
  for (let r = 0; r < rows; r++) {
    const s = scale[r]!;
    for (let c = 0; c < cols; c++) out[r * cols + c] = Math.fround(q[r * cols + c]! * s);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Index encoding

export interface TensorRecord {
  readonly name: string;
  readonly dtype: number;
  readonly shape: readonly number[];
  readonly offset: number;
  readonly nbytes: number;
  readonly crc32: number;
}

interface StoreIndex {
  readonly kind: number;
  /** format_version of the header (FORMAT_VERSIONS) */
  readonly version: number;
  readonly binSize: number;
  /** key -> value, in index order */
  readonly hparams: ReadonlyMap<string, number>;
  /** in offset order */
  readonly records: readonly TensorRecord[];
  readonly byName: ReadonlyMap<string, TensorRecord>;
  readonly configText: string;
  /** 40 hex characters, or null when the source revision is unknown */
  readonly revision: string | null;
}

function recordNbytesBig(dtype: number, shape: readonly bigint[]): bigint {
  const row = DTYPE_ROWS[dtype];
  if (row === undefined) throw new Error(`unknown dtype ${dtype}`);
  return row.nbytes(shape);
}

/** Exact data bytes of a record of this dtype and shape. */
export function recordNbytes(dtype: number, shape: readonly number[]): number {
  return Number(recordNbytesBig(dtype, shape.map((d) => BigInt(d))));
}

function asciiBytes(text: string, what: string): Uint8Array {
  if (!/^[\x00-\x7f]*$/.test(text)) throw new Error(`${what} is not ASCII: ${text}`);
  return Buffer.from(text, "latin1");
}

/** The format version of a pack holding these records: the highest minVersion of their dtypes
 * (3 as soon as one is Q4_EXPERT, else 2 as soon as one is Q8_ROWS, else 1), so a pack without
 * a newer dtype stays byte-identical to one written before it existed. */
export function formatVersionOf(records: Iterable<{ readonly dtype: number }>): number {
  let version = 1;
  for (const rec of records) version = Math.max(version, DTYPE_ROWS[rec.dtype]?.minVersion ?? 1);
  return version;
}

/** The complete .idx file bytes, CRC included (format_version as given: the pack's, formatVersionOf). */
export function encodeIndex(kind: number, binSize: number, hparams: Iterable<readonly [string, number]>,
  records: readonly TensorRecord[], configText: string, revision: string | null, version = 1): Uint8Array {
  const config = Buffer.from(configText, "utf8");
  const rev = asciiBytes(revision ?? "", "source revision");
  if (rev.length && rev.length !== 40) throw new Error(`source revision must be 40 hex characters, got ${jsonText(revision)}`);
  const hp = [...hparams];
  const data = new Uint8Array(HEADER_BYTES + HPARAM_RECORD_BYTES * hp.length + TENSOR_RECORD_BYTES * records.length + config.length);
  const view = new DataView(data.buffer);
  data.set(Buffer.from(IDX_MAGIC, "latin1"), 0);
  view.setUint32(8, version, true);
  view.setUint32(12, kind, true);
  view.setBigUint64(16, BigInt(binSize), true);
  view.setUint32(24, hp.length, true);
  view.setUint32(28, records.length, true);
  view.setUint32(32, config.length, true);
  data.set(rev, 40);
  let pos = HEADER_BYTES;
  for (const [key, value] of hp) {
    const raw = asciiBytes(key, "hparam key");
    if (raw.length >= HPARAM_KEY_BYTES) throw new Error(`hparam key too long: ${key}`);
    data.set(raw, pos);
    view.setFloat64(pos + HPARAM_KEY_BYTES, value, true);
    pos += HPARAM_RECORD_BYTES;
  }
  for (const rec of records) {
    const raw = asciiBytes(rec.name, "tensor name");
    if (raw.length >= TENSOR_NAME_BYTES) throw new Error(`tensor name too long for the index: ${rec.name}`);
    data.set(raw, pos);
    view.setUint32(pos + 128, rec.dtype, true);
    view.setUint32(pos + 132, rec.shape.length, true);
    rec.shape.forEach((d, i) => view.setBigUint64(pos + 136 + 8 * i, BigInt(d), true));
    view.setBigUint64(pos + 168, BigInt(rec.offset), true);
    view.setBigUint64(pos + 176, BigInt(rec.nbytes), true);
    view.setUint32(pos + 184, rec.crc32 >>> 0, true);
    view.setUint32(pos + 188, 0, true);
    pos += TENSOR_RECORD_BYTES;
  }
  data.set(config, pos);
  view.setUint32(CRC_FIELD_OFFSET, crc32(data), true);
  return data;
}

/** A NUL-terminated ASCII field. */
function cstr(raw: Uint8Array, what: string, where: string): string {
  const end = raw.indexOf(0);
  if (end < 0) throw new UserError(`${where}: ${what} is not NUL-terminated — the index is corrupt; rerun kvl pack`);
  const bytes = raw.subarray(0, end);
  if (bytes.some((b) => b >= 0x80)) throw new UserError(`${where}: ${what} is not ASCII — the index is corrupt; rerun kvl pack`);
  return Buffer.from(bytes).toString("latin1");
}

/** Parse and fully validate .idx bytes; `where` names the file in error messages. */
export function decodeIndex(data: Uint8Array, where: string, expectedKind?: number): StoreIndex {
  const corrupt = "the index is corrupt; rerun kvl pack";
  if (data.length < HEADER_BYTES) {
    throw new UserError(`${where}: ${data.length} bytes is shorter than the ${HEADER_BYTES}-byte header — ${corrupt}`);
  }
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  const magic = data.subarray(0, 8);
  const version = view.getUint32(8, true);
  const kind = view.getUint32(12, true);
  const binSize = view.getBigUint64(16, true);
  const nHparams = view.getUint32(24, true);
  const nTensors = view.getUint32(28, true);
  const configBytes = view.getUint32(32, true);
  const crc = view.getUint32(CRC_FIELD_OFFSET, true);
  const revRaw = data.subarray(40, 80);
  const reserved = data.subarray(80, 128);
  if (Buffer.from(magic).toString("latin1") !== IDX_MAGIC) {
    throw new UserError(`${where}: bad magic ${jsonText(Buffer.from(magic).toString("latin1"))} (expected ${jsonText(IDX_MAGIC)}) — ` +
      "not a kvl index; rerun kvl pack");
  }
  if (!FORMAT_VERSIONS.includes(version)) {
    throw new UserError(`${where}: format version ${version}, this kvl reads versions ${VERSIONS_TEXT}; repack with this kvl version`);
  }
  const kindName = STORE_NAMES[kind];
  if (kindName === undefined) throw new UserError(`${where}: unknown store kind ${kind} — ${corrupt}`);
  if (expectedKind !== undefined && kind !== expectedKind) {
    throw new UserError(`${where}: store kind ${kindName}, expected ${STORE_NAMES[expectedKind]} — ${corrupt}`);
  }
  const expectedSize = HEADER_BYTES + HPARAM_RECORD_BYTES * nHparams + TENSOR_RECORD_BYTES * nTensors + configBytes;
  if (data.length !== expectedSize) {
    throw new UserError(`${where}: expected ${expectedSize} bytes from its header, found ${data.length} — ${corrupt}`);
  }
  const check = Uint8Array.from(data);
  check.fill(0, CRC_FIELD_OFFSET, CRC_FIELD_OFFSET + 4);
  const actual = crc32(check);
  if (actual !== crc) throw new UserError(`${where}: CRC mismatch (stored ${hex8(crc)}, computed ${hex8(actual)}) — ${corrupt}`);
  if (binSize % BigInt(BIN_ALIGN)) {
    throw new UserError(`${where}: bin_size ${binSize} is not a multiple of ${BIN_ALIGN} — ${corrupt}`);
  }
  // The checks below mirror store.c's, so both readers accept exactly the same indexes.
  if (reserved.some((b) => b !== 0)) {
    throw new UserError(`${where}: reserved header bytes are not zero — written by an incompatible packer; rerun kvl pack`);
  }
  let revision: string | null = null;
  if (revRaw.some((b) => b !== 0)) {
    if (!revRaw.every((b) => b >= 0x21 && b <= 0x7e)) {
      throw new UserError(`${where}: source revision is not 40 printable ASCII characters — ${corrupt}`);
    }
    revision = Buffer.from(revRaw).toString("latin1");
  }
  let pos = HEADER_BYTES;
  const hparams = new Map<string, number>();
  for (let i = 0; i < nHparams; i++) {
    const key = cstr(data.subarray(pos, pos + HPARAM_KEY_BYTES), `hparam record ${i} key`, where);
    const value = view.getFloat64(pos + HPARAM_KEY_BYTES, true);
    pos += HPARAM_RECORD_BYTES;
    if (!key) throw new UserError(`${where}: hparam record ${i} has an empty key — ${corrupt}`);
    if (hparams.has(key)) throw new UserError(`${where}: hparam '${key}' appears twice — ${corrupt}`);
    // the packer writes config numbers only; inf/NaN broke readers
    if (!Number.isFinite(value)) {
      throw new UserError(`${where}: hparam '${key}' = ${value} is not a finite number — ${corrupt}`);
    }
    hparams.set(key, value);
  }
  const records: TensorRecord[] = [];
  const byName = new Map<string, TensorRecord>();
  let prevEnd = 0n;
  for (let i = 0; i < nTensors; i++) {
    const name = cstr(data.subarray(pos, pos + TENSOR_NAME_BYTES), `tensor record ${i} name`, where);
    const dtype = view.getUint32(pos + 128, true);
    const ndim = view.getUint32(pos + 132, true);
    const dims = [0, 1, 2, 3].map((k) => view.getBigUint64(pos + 136 + 8 * k, true));
    const offset = view.getBigUint64(pos + 168, true);
    const nbytes = view.getBigUint64(pos + 176, true);
    const recCrc = view.getUint32(pos + 184, true);
    const flags = view.getUint32(pos + 188, true);
    pos += TENSOR_RECORD_BYTES;
    if (!name) throw new UserError(`${where}: tensor record ${i} has an empty name — ${corrupt}`);
    // names quoted as the C reader's messages quote them (cstr: ASCII, no NUL)
    const label = `${where}: tensor '${name}'`;
    if (byName.has(name)) throw new UserError(`${label} appears twice — ${corrupt}`);
    const row = DTYPE_ROWS[dtype];
    if (row === undefined) throw new UserError(`${label} has unknown dtype ${dtype} — ${corrupt}`);
    if (version < row.minVersion) {
      throw new UserError(`${label} is ${row.name}, which needs format version ${row.minVersion} (the index says ${version}) — ${corrupt}`);
    }
    if (!(ndim >= 1 && ndim <= MAX_NDIM) || dims.slice(ndim).some((d) => d !== 0n)) {
      throw new UserError(`${label} has an invalid shape (ndim ${ndim}, dims [${dims.join(", ")}]) — ${corrupt}`);
    }
    const shape = dims.slice(0, ndim);
    const shapeProblem = row.shapeProblem(shape);
    if (shapeProblem !== undefined) throw new UserError(`${label}${shapeProblem} — ${corrupt}`);
    if (flags !== 0) throw new UserError(`${label} has nonzero flags ${flags} — ${corrupt}`);
    if (offset % BigInt(BIN_ALIGN)) throw new UserError(`${label} offset ${offset} is not a multiple of ${BIN_ALIGN} — ${corrupt}`);
    const want = row.nbytes(shape);
    if (nbytes !== want) throw new UserError(`${label} is ${nbytes} bytes but its dtype and shape need ${want} — ${corrupt}`);
    if (offset < prevEnd) {
      throw new UserError(`${label} at offset ${offset} overlaps or precedes the previous record (which ends at ${prevEnd}) — ${corrupt}`);
    }
    if (offset + nbytes > binSize) {
      throw new UserError(`${label} ends at ${offset + nbytes}, past bin_size ${binSize} — ${corrupt}`);
    }
    prevEnd = offset + nbytes;
    const rec: TensorRecord = {
      name, dtype, shape: shape.map(Number), offset: Number(offset), nbytes: Number(nbytes), crc32: recCrc,
    };
    records.push(rec);
    byName.set(name, rec);
  }
  let configText: string;
  try {
    configText = decodeUtf8Strict(data.subarray(pos, pos + configBytes));
  } catch {
    throw new UserError(`${where}: embedded config.json is not UTF-8 — ${corrupt}`);
  }
  return { kind, version, binSize: Number(binSize), hparams, records, byName, configText, revision };
}

// ---------------------------------------------------------------------------------------------
// Reader

/** Throws a one-line UserError unless `dir` is a folder (a pack's, or to be checked as one). */
export function checkPackFolder(dir: string): void {
  requireFolder(dir, "model directory", "create one with kvl pack or kvl prepare");
}

/** PACK_COMPLETE.json as the packer writes it (docs/FORMAT.md "Completion marker"). */
export interface CompleteMarker {
  format_version: number;
  source_revision: string | null;
  /** `NAME.bin`: {size}; `NAME.idx`: {size, crc32}; for the three stores, trunk first */
  files: Record<string, { size: number; crc32?: number }>;
  /** only in a pack with a Q8_ROWS trunk ("q8") */
  trunk_dtype?: TrunkDtype;
  /** only in a pack with Q4_EXPERT experts ("q4"; format version 3), after trunk_dtype */
  expert_dtype?: ExpertDtype;
}

/** The marker's text: JSON.stringify with a one-space indent, then a line feed. */
export function encodeCompleteMarker(marker: CompleteMarker): string {
  return `${JSON.stringify(marker, null, 1)}\n`;
}

/** What a reader takes from PACK_COMPLETE.json: a format version this kvl reads and the file
 * entries (objects; PackReader.open compares their sizes and CRCs with the files). The other
 * members are not read: the indexes hold the revision, and their records the trunk and expert dtypes. */
type CompleteMarkerRead = JsonObject & { format_version: number; files: Record<string, JsonObject> };

/** Reads and validates PACK_COMPLETE.json; a one-line UserError naming the file says what is wrong. */
function readCompleteMarker(path: string): CompleteMarkerRead {
  let marker: unknown;
  try {
    marker = parseJson(readFileSync(path));
  } catch (err) {
    throw new UserError(`${path}: unreadable (${(err as Error).message}) — ${INCOMPLETE_HINT}`); // JsonTextError's, or the file system's
  }
  if (!isJsonObject(marker)) throw new UserError(`${path}: unreadable (the marker is not a JSON object) — ${INCOMPLETE_HINT}`);
  for (const key of ["files", "format_version"]) {
    if (!Object.hasOwn(marker, key)) throw new UserError(`${path}: unreadable (${jsonText(key)} is missing) — ${INCOMPLETE_HINT}`);
  }
  const files = marker.files;
  // what PackReader.open reads must have its type: a mangled marker is a UserError, not a TypeError
  if (!isJsonObject(files) || !Object.values(files).every(isJsonObject)) {
    throw new UserError(`${path}: "files" is not a table of file entries — ${INCOMPLETE_HINT}`);
  }
  const version = marker.format_version;
  if (typeof version !== "number" || !FORMAT_VERSIONS.includes(version)) {
    throw new UserError(`${path}: format version ${jsonText(version)}, this kvl reads ` +
      `versions ${VERSIONS_TEXT}; repack with this kvl version`);
  }
  return marker as CompleteMarkerRead;
}

function isFile(path: string): boolean {
  try {
    return statSync(path).isFile();
  } catch {
    return false;
  }
}

function mapsEqual(a: ReadonlyMap<string, number>, b: ReadonlyMap<string, number>): boolean {
  if (a.size !== b.size) return false;
  for (const [k, v] of a) if (b.get(k) !== v) return false;
  return true;
}

/** Reads `nbytes` at `offset` of the open file, in pieces of at most `chunk`. */
async function readExact(path: string, offset: number, nbytes: number, where: string,
  use?: (piece: Uint8Array) => void): Promise<Uint8Array> {
  const chunk = use ? 64 << 20 : Math.max(nbytes, 1);
  const handle = await open(path, "r");
  try {
    const out = new Uint8Array(use ? Math.min(chunk, nbytes) : nbytes);
    let done = 0;
    while (done < nbytes) {
      const n = Math.min(nbytes - done, chunk);
      let got = 0;
      while (got < n) {
        const at = use ? got : done + got;
        const { bytesRead } = await handle.read(out, at, Math.min(n - got, 1 << 30), offset + done + got);
        if (bytesRead === 0) throw new UserError(`${where}: short read at offset ${offset + done + got} — ${INCOMPLETE_HINT}`);
        got += bytesRead;
      }
      if (use) use(out.subarray(0, n));
      done += n;
    }
    return out;
  } finally {
    await handle.close();
  }
}

interface ExpertQuantized {
  readonly intermediate: number;
  readonly hidden: number;
  /** int8 [I, H] */
  readonly gate_q: Int8Array;
  /** int8 [I, H] */
  readonly up_q: Int8Array;
  /** int8 [H, I] */
  readonly down_q: Int8Array;
  /** f32 [I] */
  readonly gate_s: Float32Array;
  /** f32 [I] */
  readonly up_s: Float32Array;
  /** f32 [H] */
  readonly down_s: Float32Array;
}

/** One Q4_EXPERT extent's parts (docs/FORMAT.md "Q4_EXPERT extents"), as stored. */
interface ExpertQ4 {
  readonly intermediate: number;
  readonly hidden: number;
  /** nibbles [I, H/2]: byte j of group g of a row holds columns 32g+j (low) and 32g+16+j (high), each q + 8 */
  readonly gate_q: Uint8Array;
  readonly up_q: Uint8Array;
  /** nibbles [H, I/2] */
  readonly down_q: Uint8Array;
  /** BF16 scale bits [I, H/32] */
  readonly gate_s: Uint16Array;
  readonly up_s: Uint16Array;
  /** BF16 scale bits [H, I/32] */
  readonly down_s: Uint16Array;
}

/** (nibble - 8) * bf16(scale of its group of 32) in FP32 (exact), for a row-major Q4 matrix [rows, cols]. */
function dequantizeQ4(q: Uint8Array, s: Uint16Array, rows: number, cols: number): Float32Array {
  const scale = bf16BitsToF32(s);
  const out = new Float32Array(rows * cols);
  const groups = cols / Q4_GROUP;
  for (let r = 0; r < rows; r++) {
    for (let g = 0; g < groups; g++) {
      const ds = scale[r * groups + g]!;
      const at = r * cols + g * Q4_GROUP;
      for (let j = 0; j < Q4_GROUP / 2; j++) {
        const byte = q[r * (cols / 2) + g * (Q4_GROUP / 2) + j]!;
        out[at + j] = Math.fround(((byte & 15) - 8) * ds);
        out[at + Q4_GROUP / 2 + j] = Math.fround(((byte >> 4) - 8) * ds);
      }
    }
  }
  return out;
}

interface PackTensor {
  readonly dtype: "BF16" | "F32";
  readonly shape: readonly number[];
  /** raw BF16 bits (Uint16Array) or float32 values */
  readonly data: Uint16Array | Float32Array;
}

/** Opens and validates a pack directory (structure, sizes, index CRCs); reads tensors for tests,
 * `kvl doctor` and the engine's host side. */
export class PackReader {
  readonly complete: CompleteMarkerRead;
  readonly stores: ReadonlyMap<StoreName, StoreIndex>;
  readonly hparams: ReadonlyMap<string, number>;
  readonly configText: string;
  readonly revision: string | null;

  private constructor(readonly dir: string, complete: CompleteMarkerRead, stores: Map<StoreName, StoreIndex>) {
    this.complete = complete;
    this.stores = stores;
    const first = stores.get("trunk")!;
    this.hparams = first.hparams;
    this.configText = first.configText;
    this.revision = first.revision;
  }

  /** Validates the pack's structure; throws UserError saying what is wrong and what to do. */
  static async open(directory: string): Promise<PackReader> {
    const dir = directory;
    checkPackFolder(dir);
    const completePath = join(dir, COMPLETE_FILE);
    if (!isFile(completePath)) throw new UserError(`${dir}: ${COMPLETE_FILE} is missing — ${INCOMPLETE_HINT}`);
    const complete = readCompleteMarker(completePath);
    const { files, format_version: version } = complete;
    const entry = (name: string): JsonObject => files[name] ?? {};
    const stores = new Map<StoreName, StoreIndex>();
    for (const name of STORES) {
      const idxName = `${name}.idx`;
      const binName = `${name}.bin`;
      const idxPath = join(dir, idxName);
      if (!isFile(idxPath)) throw new UserError(`${idxName}: missing from ${dir} — ${INCOMPLETE_HINT}`);
      const data = readFileSync(idxPath);
      const meta = entry(idxName);
      if (meta.size !== data.length || meta.crc32 !== crc32(data)) {
        throw new UserError(`${idxName}: does not match ${COMPLETE_FILE} (size/CRC differ) — the pack was modified or is corrupt; rerun kvl pack`);
      }
      const index = decodeIndex(data, idxName, STORE_KINDS[name]);
      if (index.version !== version) {
        throw new UserError(`${idxName}: format version ${index.version} differs from ${COMPLETE_FILE}'s ${version} — ` +
          "the stores come from different packs; rerun kvl pack");
      }
      const binPath = join(dir, binName);
      if (!isFile(binPath)) throw new UserError(`${binName}: missing from ${dir} — ${INCOMPLETE_HINT}`);
      const found = statSync(binPath).size;
      if (found !== index.binSize) throw new UserError(`${binName}: expected ${index.binSize} bytes, found ${found} — ${INCOMPLETE_HINT}`);
      if (entry(binName).size !== found) {
        throw new UserError(`${binName}: size ${found} differs from ${COMPLETE_FILE} — ${INCOMPLETE_HINT}`);
      }
      stores.set(name, index);
    }
    const first = stores.get("trunk")!;
    for (const [name, index] of stores) {
      if (!mapsEqual(index.hparams, first.hparams) || index.configText !== first.configText) {
        throw new UserError(`${name}.idx: hparams/config differ from trunk.idx — the stores come from different packs; rerun kvl pack`);
      }
      if (index.revision !== first.revision) {
        throw new UserError(`${name}.idx: source revision ${index.revision ?? "unknown"} differs from trunk.idx (${first.revision ?? "unknown"}); rerun kvl pack`);
      }
    }
    return new PackReader(dir, complete, stores);
  }

  /** What the trunk's Linear weights are stored as: "q8" when any trunk record is Q8_ROWS
   * (`kvl pack --trunk-dtype q8`), else "bf16". */
  get trunkDtype(): TrunkDtype {
    return this.stores.get("trunk")!.records.some((r) => r.dtype === DTYPE_Q8_ROWS) ? "q8" : "bf16";
  }

  /** What the routed experts are stored as: "q4" when the extents are Q4_EXPERT (`kvl pack
   * --expert-dtype q4`), else "q8". */
  get expertDtype(): ExpertDtype {
    return this.stores.get("experts")!.records.some((r) => r.dtype === DTYPE_Q4_EXPERT) ? "q4" : "q8";
  }

  /** The embedded config.json, parsed. */
  get config(): unknown {
    return JSON.parse(this.configText);
  }

  #find(name: string): [StoreName, TensorRecord] {
    for (const [store, index] of this.stores) {
      const rec = index.byName.get(name);
      if (rec !== undefined) return [store, rec];
    }
    throw new Error(`no tensor ${name} in the pack at ${this.dir}`);
  }

  record(name: string): TensorRecord {
    return this.#find(name)[1];
  }

  storeOf(name: string): StoreName {
    return this.#find(name)[0];
  }

  /** A record's exact data bytes. */
  async raw(store: StoreName, rec: TensorRecord): Promise<Uint8Array> {
    return readExact(join(this.dir, `${store}.bin`), rec.offset, rec.nbytes, `${store}.bin`);
  }

  /** A trunk/vision tensor: raw BF16 bits or float32 values, in the checkpoint's shape. */
  async tensor(name: string): Promise<PackTensor> {
    const [store, rec] = this.#find(name);
    if (rec.dtype === DTYPE_Q8_EXPERT || rec.dtype === DTYPE_Q4_EXPERT) throw new Error(`${name} is an expert extent; use expert()`);
    if (rec.dtype === DTYPE_Q8_ROWS) throw new Error(`${name} is a Q8_ROWS matrix; use q8Rows() or tensorF32()`);
    const bytes = await this.raw(store, rec);
    return rec.dtype === DTYPE_BF16
      ? { dtype: "BF16", shape: rec.shape, data: new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.length / 2) }
      : { dtype: "F32", shape: rec.shape, data: new Float32Array(bytes.buffer, bytes.byteOffset, bytes.length / 4) };
  }

  /** A trunk/vision tensor as float32 values (a Q8_ROWS matrix dequantized: q * scale[row]). */
  async tensorF32(name: string): Promise<Float32Array> {
    if (this.record(name).dtype === DTYPE_Q8_ROWS) {
      const m = await this.q8Rows(name);
      return dequantizeRowsQ8(m.q, m.scale, m.rows, m.cols);
    }
    const t = await this.tensor(name);
    return t.data instanceof Uint16Array ? bf16BitsToF32(t.data) : t.data;
  }

  /** The int8 rows and float32 row scales of one Q8_ROWS record. */
  async q8Rows(name: string): Promise<{ rows: number; cols: number; q: Int8Array; scale: Float32Array }> {
    const [store, rec] = this.#find(name);
    if (rec.dtype !== DTYPE_Q8_ROWS) throw new Error(`${name} is ${DTYPE_NAMES[rec.dtype]}, not Q8_ROWS`);
    const [rows, cols] = rec.shape as [number, number];
    const buf = await this.raw(store, rec);
    const lay = q8RowsLayout(rows, cols);
    return {
      rows, cols, q: new Int8Array(buf.buffer, buf.byteOffset, rows * cols),
      scale: new Float32Array(buf.buffer, buf.byteOffset + lay.scale, rows),
    };
  }

  #expertRecord(layer: number, expert: number): TensorRecord {
    const rec = this.stores.get("experts")!.byName.get(expertRecordName(layer, expert));
    if (rec === undefined) throw new Error(`no expert ${layer}.${expert} in the pack at ${this.dir}`);
    return rec;
  }

  /** The int8 matrices and float32 row scales of one routed expert's Q8_EXPERT extent. */
  async expertQuantized(layer: number, expert: number): Promise<ExpertQuantized> {
    const rec = this.#expertRecord(layer, expert);
    if (rec.dtype !== DTYPE_Q8_EXPERT) throw new Error(`${rec.name} is ${DTYPE_NAMES[rec.dtype]}, not Q8_EXPERT; use expertQ4()`);
    const [inter, hidden] = [rec.shape[2]!, rec.shape[3]!];
    const lay = expertLayout(inter, hidden);
    const buf = await this.raw("experts", rec);
    const q = (off: number, n: number): Int8Array => new Int8Array(buf.buffer, buf.byteOffset + off, n);
    const s = (off: number, n: number): Float32Array => new Float32Array(buf.buffer, buf.byteOffset + off, n);
    return {
      intermediate: inter, hidden,
      gate_q: q(lay.gate_q, inter * hidden), up_q: q(lay.up_q, inter * hidden), down_q: q(lay.down_q, hidden * inter),
      gate_s: s(lay.gate_s, inter), up_s: s(lay.up_s, inter), down_s: s(lay.down_s, hidden),
    };
  }

  /** The nibbles and BF16 scale bits of one routed expert's Q4_EXPERT extent. */
  async expertQ4(layer: number, expert: number): Promise<ExpertQ4> {
    const rec = this.#expertRecord(layer, expert);
    if (rec.dtype !== DTYPE_Q4_EXPERT) throw new Error(`${rec.name} is ${DTYPE_NAMES[rec.dtype]}, not Q4_EXPERT; use expertQuantized()`);
    const [inter, hidden] = [rec.shape[2]!, rec.shape[3]!];
    const lay = q4ExpertLayout(inter, hidden);
    const buf = await this.raw("experts", rec); // a fresh buffer: its offsets are the extent's (all even)
    const q = (off: number, n: number): Uint8Array => buf.subarray(off, off + n);
    const s = (off: number, n: number): Uint16Array => new Uint16Array(buf.buffer, buf.byteOffset + off, n);
    const [nq, ns] = [(inter * hidden) / 2, (inter * hidden) / Q4_GROUP];
    return {
      intermediate: inter, hidden,
      gate_q: q(lay.gate_q, nq), up_q: q(lay.up_q, nq), down_q: q(lay.down_q, nq),
      gate_s: s(lay.gate_s, ns), up_s: s(lay.up_s, ns), down_s: s(lay.down_s, ns),
    };
  }

  /** Dequantized float32 gate_proj [I, H], up_proj [I, H], down_proj [H, I] of one routed expert
   * (either expert dtype). */
  async expert(layer: number, expert: number): Promise<{ gate_proj: Float32Array; up_proj: Float32Array; down_proj: Float32Array }> {
    if (this.#expertRecord(layer, expert).dtype === DTYPE_Q4_EXPERT) {
      const p = await this.expertQ4(layer, expert);
      const [i, h] = [p.intermediate, p.hidden];
      return {
        gate_proj: dequantizeQ4(p.gate_q, p.gate_s, i, h),
        up_proj: dequantizeQ4(p.up_q, p.up_s, i, h),
        down_proj: dequantizeQ4(p.down_q, p.down_s, h, i),
      };
    }
    const p = await this.expertQuantized(layer, expert);
    const [i, h] = [p.intermediate, p.hidden];
    return {
      gate_proj: dequantizeRowsQ8(p.gate_q, p.gate_s, i, h),
      up_proj: dequantizeRowsQ8(p.up_q, p.up_s, i, h),
      down_proj: dequantizeRowsQ8(p.down_q, p.down_s, h, i),
    };
  }

  /** Bytes checkDataCrcs / corruptData read: every record's data. */
  get dataBytes(): number {
    let n = 0;
    for (const index of this.stores.values()) for (const rec of index.records) n += rec.nbytes;
    return n;
  }

  /**
   * Reads every record (64 MiB at a time) and returns those whose CRC-32 differs from the index,
   * each as `STORE.bin: data of 'NAME' is corrupt (...)`; onBytes sees every piece read (progress).
   */
  async corruptData(onBytes?: (bytes: number) => void): Promise<Array<{ store: StoreName; record: TensorRecord; message: string }>> {
    const out: Array<{ store: StoreName; record: TensorRecord; message: string }> = [];
    for (const [store, index] of this.stores) {
      const path = join(this.dir, `${store}.bin`);
      for (const rec of index.records) {
        let crc = 0;
        await readExact(path, rec.offset, rec.nbytes, `${store}.bin`, (piece) => {
          crc = crc32(piece, crc);
          onBytes?.(piece.length);
        });
        if (crc !== rec.crc32) {
          out.push({ store, record: rec,
            message: `${store}.bin: data of '${rec.name}' is corrupt (CRC ${hex8(crc)}, index says ${hex8(rec.crc32)})` });
        }
      }
    }
    return out;
  }

  /** Reads every record and compares its CRC-32 with the index; throws UserError at the first difference. */
  async checkDataCrcs(onBytes?: (bytes: number) => void): Promise<void> {
    const bad = await this.corruptData(onBytes);
    if (bad.length) throw new UserError(`${bad[0]!.message}; rerun kvl pack`);
  }
}

/** Validates a pack (structure always; every data CRC when asked). Throws UserError. */
export async function verify(directory: string, options: { checkDataCrc?: boolean } = {}): Promise<PackReader> {
  const reader = await PackReader.open(directory);
  if (options.checkDataCrc) await reader.checkDataCrcs();
  return reader;
}
