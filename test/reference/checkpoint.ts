/**
 * checkpoint.ts — a checkpoint directory (config.json + sharded safetensors) as float64 tensors,
 * read by the reference's own small safetensors parser, and the row-wise Q8 round trip of routed
 * expert weights and, optionally, the trunk's Linear weights (docs/FORMAT.md) for comparisons
 * with a runtime that stores them as Q8; and the 4-bit routed experts of `kvl pack --expert-dtype
 * q4` (docs/FORMAT.md "Q4_EXPERT extents", written out here from that page): the extent's bytes
 * (q4ExpertExtent, which the packer's must equal) and the dequantised weights (q4RoundtripGroups).
 *
 * Owns: the safetensors layout (u64-LE header length, JSON header of name -> dtype, shape,
 * data_offsets relative to the end of the header, then little-endian data; spec §11) and
 * BF16/F16/F32/F64 -> float64 conversion. Does not own: any model math. Deliberately shares no
 * code with packer/ or host/ (their readers are what this reference checks, indirectly).
 */
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";

import { type Tensor, numel } from "./math.js";

export const INDEX_NAME = "model.safetensors.index.json";

/** Routed expert matrices only: shared experts and the router stay unquantized in the runtime. */
export const ROUTED_EXPERT_WEIGHT = /\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$/;

/** The trunk Linear weights a pack made with `--trunk-dtype q8` stores as Q8 (docs/FORMAT.md
 * "Q8_ROWS", written out here from that page, not imported from the packer): q/kv_a/kv_b/o
 * projections, the dense MLP, the shared experts and lm_head. Not the router (mlp.gate), the
 * routed experts (ROUTED_EXPERT_WEIGHT), norms or the embedding. */
export function isQ8TrunkWeight(name: string): boolean {
  if (name === "language_model.lm_head.weight") return true;
  const m = /^language_model\.model\.layers\.\d+\.(.+)\.weight$/.exec(name);
  if (!m) return false;
  const attn = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"].map((p) => `self_attn.${p}`);
  const mlp = ["gate_proj", "up_proj", "down_proj"].flatMap((p) => [`mlp.${p}`, `mlp.shared_experts.${p}`]);
  return attn.includes(m[1]!) || mlp.includes(m[1]!);
}

export function readJson(path: string): unknown {
  return JSON.parse(readFileSync(path, "utf8"));
}

/** config.json of a checkpoint directory. */
export function loadConfig(dir: string): Record<string, unknown> {
  const path = join(dir, "config.json");
  if (!existsSync(path)) throw new Error(`${path} not found: point the reference at a checkpoint directory`);
  return readJson(path) as Record<string, unknown>;
}

/** Shards named by the index, in sorted order, or the single model.safetensors. */
export function shardFiles(dir: string): string[] {
  const index = join(dir, INDEX_NAME);
  if (existsSync(index)) {
    const weightMap = (readJson(index) as { weight_map: Record<string, string> }).weight_map;
    return [...new Set(Object.values(weightMap))].sort().map((f) => join(dir, f));
  }
  const single = join(dir, "model.safetensors");
  if (existsSync(single)) return [single];
  throw new Error(`${dir} has neither ${INDEX_NAME} nor model.safetensors`);
}

interface HeaderEntry {
  dtype: string;
  shape: number[];
  data_offsets: [number, number];
}

function halfToFloat(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

function decode(bytes: Uint8Array, dtype: string, count: number, name: string): Float64Array {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float64Array(count);
  const scratch = new DataView(new ArrayBuffer(4));
  switch (dtype) {
    case "BF16":
      for (let i = 0; i < count; i++) {
        // BF16 is the top half of an FP32: widen by appending 16 zero bits.
        scratch.setUint32(0, view.getUint16(2 * i, true) << 16);
        out[i] = scratch.getFloat32(0);
      }
      return out;
    case "F16":
      for (let i = 0; i < count; i++) out[i] = halfToFloat(view.getUint16(2 * i, true));
      return out;
    case "F32":
      for (let i = 0; i < count; i++) out[i] = view.getFloat32(4 * i, true);
      return out;
    case "F64":
      for (let i = 0; i < count; i++) out[i] = view.getFloat64(8 * i, true);
      return out;
    default:
      throw new Error(`${name}: dtype ${dtype} is not a float type the reference reads`);
  }
}

const BYTES: Record<string, number> = { BF16: 2, F16: 2, F32: 4, F64: 8 };

/** Every tensor of one safetensors file whose name passes `keep`, as float64. */
export function readSafetensors(path: string, keep: (name: string) => boolean = () => true): Map<string, Tensor> {
  const file = readFileSync(path);
  if (file.length < 8) throw new Error(`${path}: too short for a safetensors header`);
  const headerLen = Number(file.readBigUInt64LE(0));
  if (8 + headerLen > file.length) throw new Error(`${path}: header length ${headerLen} exceeds the file`);
  const header = JSON.parse(file.subarray(8, 8 + headerLen).toString("utf8")) as Record<string, HeaderEntry | unknown>;
  const base = 8 + headerLen;
  const out = new Map<string, Tensor>();
  for (const [name, raw] of Object.entries(header)) {
    if (name === "__metadata__" || !keep(name)) continue;
    const entry = raw as HeaderEntry;
    const count = numel(entry.shape);
    const [begin, end] = entry.data_offsets;
    const width = BYTES[entry.dtype];
    if (width !== undefined && end - begin !== count * width) {
      throw new Error(`${path}: ${name} has ${end - begin} bytes for ${entry.dtype} [${entry.shape.join(", ")}]`);
    }
    if (base + end > file.length) throw new Error(`${path}: ${name} ends past the end of the file`);
    const data = decode(file.subarray(base + begin, base + end), entry.dtype, count, name);
    out.set(name, { shape: [...entry.shape], data });
  }
  return out;
}

/**
 * Row-wise symmetric Q8 quantize + dequantize in FP32 arithmetic, the docs/FORMAT.md rule:
 * scale[r] = max|W[r]| / 127 (0 for an all-zero row), q = clip(round_half_even(W / scale), -127, 127),
 * value = q * scale. Math.fround after each operation gives exactly the FP32 result (a double
 * operation rounded once more to FP32 equals the FP32 operation for + - * /), so this is the
 * runtime's packer value for value, not an approximation of it.
 */
export function q8RoundtripRows(w: Tensor): Tensor {
  if (w.shape.length !== 2) throw new Error("q8RoundtripRows: expects a 2-D weight");
  const [rows, cols] = w.shape as [number, number];
  const out = new Float64Array(rows * cols);
  for (let r = 0; r < rows; r++) {
    let max = 0;
    for (let c = 0; c < cols; c++) max = Math.max(max, Math.abs(Math.fround(w.data[r * cols + c]!)));
    const scale = Math.fround(max / 127);
    if (scale === 0) continue; // q = 0 for an all-zero row
    for (let c = 0; c < cols; c++) {
      const ratio = Math.fround(Math.fround(w.data[r * cols + c]!) / scale);
      const q = Math.min(127, Math.max(-127, roundHalfEven(ratio)));
      out[r * cols + c] = Math.fround(q * scale);
    }
  }
  return { shape: [rows, cols], data: out };
}

function roundHalfEven(x: number): number {
  const f = Math.floor(x);
  const d = x - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

// ---------------------------------------------------------------------------------------------
// Q4_EXPERT (docs/FORMAT.md "Q4_EXPERT extents")

/** Columns per scale group. */
const Q4_GROUP = 32;
const f32Bits = new DataView(new ArrayBuffer(4));

/** The BF16 nearest an FP32 value (ties to even), as its 16 bits. */
function bf16Bits(x: number): number {
  f32Bits.setFloat32(0, x);
  const b = f32Bits.getUint32(0);
  return Math.floor((b + 0x7fff + (Math.floor(b / 65536) & 1)) / 65536) & 0xffff;
}

function bf16Value(bits: number): number {
  f32Bits.setUint32(0, bits * 65536);
  return f32Bits.getFloat32(0);
}

/**
 * One matrix W [rows, cols] (FP32 values; cols a multiple of 32) by the page's group rule: per
 * row and group of 32 columns, m = the value of largest |w| (first on a tie), d = BF16(fl(m / -8)),
 * ds = its value; q = 0 when ds is 0, else clamp(rint(fl(w / ds)), -8, 7). Returns the integers q
 * [rows, cols] and the scale bits [rows, cols / 32].
 */
function quantizeQ4(w: ArrayLike<number>, rows: number, cols: number, what: string): { q: Int8Array; bits: Uint16Array } {
  if (cols % Q4_GROUP !== 0) throw new Error(`${what}: ${cols} columns is not a multiple of ${Q4_GROUP}`);
  const f = Math.fround;
  const groups = cols / Q4_GROUP;
  const q = new Int8Array(rows * cols);
  const bits = new Uint16Array(rows * groups);
  for (let r = 0; r < rows; r++) {
    for (let g = 0; g < groups; g++) {
      const at = r * cols + g * Q4_GROUP;
      let m = f(w[at]!); // the first of the largest |w| (an all-zero group: its first zero, with its sign)
      for (let j = 0; j < Q4_GROUP; j++) {
        const v = f(w[at + j]!);
        if (!Number.isFinite(v)) throw new Error(`${what}: a NaN or infinite weight`);
        if (Math.abs(v) > Math.abs(m)) m = v;
      }
      const d = bf16Bits(f(m / -8));
      bits[r * groups + g] = d;
      const ds = bf16Value(d);
      if (ds === 0) continue;
      for (let j = 0; j < Q4_GROUP; j++) q[at + j] = Math.min(7, Math.max(-8, roundHalfEven(f(f(w[at + j]!) / ds))));
    }
  }
  return { q, bits };
}

/** A matrix's quantised values back in float64 (q * ds, exact in FP32). */
export function q4RoundtripGroups(w: Tensor): Tensor {
  if (w.shape.length !== 2) throw new Error("q4RoundtripGroups: expects a 2-D weight");
  const [rows, cols] = w.shape as [number, number];
  const { q, bits } = quantizeQ4(w.data, rows, cols, "q4RoundtripGroups");
  const out = new Float64Array(rows * cols);
  const groups = cols / Q4_GROUP;
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) out[r * cols + c] = q[r * cols + c]! * bf16Value(bits[r * groups + Math.floor(c / Q4_GROUP)]!);
  }
  return { shape: [rows, cols], data: out };
}

/**
 * One Q4_EXPERT extent's bytes from the BF16 bits of gate_proj [I, H], up_proj [I, H] and
 * down_proj [H, I]: the nibbles of each matrix (byte 16g + j of a row holds q[32g+j] + 8 low and
 * q[32g+16+j] + 8 high), then the scale bits of each, every sub-block at a 64-byte-aligned offset,
 * zero between them.
 */
export function q4ExpertExtent(gate: Uint16Array, up: Uint16Array, down: Uint16Array, inter: number, hidden: number): Uint8Array {
  const a64 = (x: number): number => Math.ceil(x / 64) * 64;
  const half = (inter * hidden) / 2;
  const nScales = (inter * hidden) / Q4_GROUP;
  const qOff = [0, a64(half), 0];
  qOff[2] = a64(qOff[1]! + half);
  const sOff = [a64(qOff[2] + half), 0, 0];
  sOff[1] = a64(sOff[0]! + 2 * nScales);
  sOff[2] = a64(sOff[1] + 2 * nScales);
  const out = new Uint8Array(sOff[2] + 2 * nScales);
  const view = new DataView(out.buffer);
  const mats: Array<[Uint16Array, number, number, string]> = [[gate, inter, hidden, "gate_proj"], [up, inter, hidden, "up_proj"], [down, hidden, inter, "down_proj"]];
  mats.forEach(([m, rows, cols, what], k) => {
    const values = Array.from(m, bf16Value);
    const { q, bits } = quantizeQ4(values, rows, cols, what);
    for (let r = 0; r < rows; r++) {
      for (let g = 0; g < cols / Q4_GROUP; g++) {
        for (let j = 0; j < Q4_GROUP / 2; j++) {
          const c = r * cols + g * Q4_GROUP + j;
          out[qOff[k]! + r * (cols / 2) + g * (Q4_GROUP / 2) + j] = (q[c]! + 8) | ((q[c + Q4_GROUP / 2]! + 8) << 4);
        }
      }
    }
    bits.forEach((b, i) => view.setUint16(sOff[k]! + 2 * i, b, true));
  });
  return out;
}

/** Every tensor whose name starts with `prefix`, from all shards, as float64; the routed experts
 * (and with q8Trunk the trunk's Linear weights) replaced by what a pack stores: their Q8 round
 * trip (q8Experts) or 4-bit one (q4Experts). */
export function loadTensors(dir: string, prefix = "", options: { q8Experts?: boolean; q4Experts?: boolean; q8Trunk?: boolean } = {}): Map<string, Tensor> {
  if (options.q8Experts && options.q4Experts) throw new Error("loadTensors: q8Experts or q4Experts, not both");
  const out = new Map<string, Tensor>();
  for (const shard of shardFiles(dir)) {
    for (const [name, t] of readSafetensors(shard, (n) => n.startsWith(prefix))) {
      const expert = ROUTED_EXPERT_WEIGHT.test(name);
      if (options.q4Experts && expert) {
        out.set(name, q4RoundtripGroups(t));
        continue;
      }
      const q8 = (options.q8Experts && expert) || (options.q8Trunk && isQ8TrunkWeight(name));
      out.set(name, q8 ? q8RoundtripRows(t) : t);
    }
  }
  if (out.size === 0) throw new Error(`no tensors with prefix ${JSON.stringify(prefix)} in ${dir}`);
  return out;
}

/** A tensor that must exist, with its expected shape checked. */
export function need(tensors: Map<string, Tensor>, name: string, shape?: readonly number[]): Tensor {
  const t = tensors.get(name);
  if (!t) throw new Error(`tensor ${name} is missing from the checkpoint`);
  if (shape && (t.shape.length !== shape.length || t.shape.some((d, i) => d !== shape[i]))) {
    throw new Error(`tensor ${name}: shape [${t.shape.join(", ")}], expected [${shape.join(", ")}]`);
  }
  return t;
}
