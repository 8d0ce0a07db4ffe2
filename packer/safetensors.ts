/**
 * safetensors.ts — safetensors files: a validating reader, a streaming writer,
 * model.safetensors.index.json read/write, and the source revision of a checkpoint directory
 * (headers and indexes written with JSON.stringify: for ASCII tensor names the bytes the former
 * Python synthesizer wrote, test/fixtures/python-packer-sha256.json).
 *
 * Owns: header parsing and validation of a shard at open time (so later reads cannot run past the
 * file), positional tensor reads, the writer (header first, then tensors in a fixed order; the
 * file appears under its final name only when complete) and the index writer.
 * Does not own: which tensors a model needs (host/pack/model-spec.ts), checkpoint directories as tensor
 * sources (tensor-source.ts), what the packer does with the bytes (pack.ts).
 *
 * Tensor data is raw little-endian bytes everywhere (BF16 is its 16-bit pattern).
 */
import { closeSync, fsyncSync, openSync, readFileSync, readdirSync, renameSync, rmSync, writeSync } from "node:fs";
import { type FileHandle, open, stat } from "node:fs/promises";
import { basename, join, resolve, sep } from "node:path";

import { JsonTextError, isJsonObject, jsonText, parseJson } from "../host/system/json-file.js";
import { UserError } from "../host/system/user-error.js";
import { isDir, isFile } from "../host/pack/file-kind.js";

export const INDEX_NAME = "model.safetensors.index.json";
export const SINGLE_NAME = "model.safetensors";
/** Non-tensor files a checkpoint carries into the pack (those that exist). */
export const ASSET_NAMES = [
  "config.json", "generation_config.json", "tokenizer_config.json",
  "tiktoken.model", "chat_template.jinja", "preprocessor_config.json",
] as const;
const REVISION_FILES = ["SOURCE_REVISION.txt", ".kvl_revision"] as const;
/** The official limit; a larger header length means a corrupt file. */
export const MAX_HEADER_BYTES = 100 * 1024 * 1024;

/** Bytes per element of every safetensors dtype. */
export const DTYPE_SIZES: Readonly<Record<string, number>> = {
  BF16: 2, F16: 2, F32: 4, F64: 8, I8: 1, U8: 1, I16: 2, U16: 2, I32: 4, U32: 4, I64: 8, U64: 8,
  BOOL: 1, F8_E4M3: 1, F8_E5M2: 1,
};
const HEX40 = /^[0-9a-f]{40}$/;
/** Positional reads and writes move at most this much per call (Node caps one call near 2 GiB). */
const IO_CHUNK = 1 << 30;

function itemsize(dtype: string): number {
  const size = DTYPE_SIZES[dtype];
  if (size === undefined) throw new Error(`unknown safetensors dtype ${dtype}`);
  return size;
}

interface TensorEntry {
  readonly dtype: string;
  readonly shape: readonly number[];
  /** Byte range in the data section (after the header). */
  readonly begin: number;
  readonly end: number;
}

/** An I/O error in words without Node's code and path: "permission denied", not "EACCES: ..., open '/x'". */
function errnoText(err: unknown): string {
  const e = err as NodeJS.ErrnoException;
  if (e && typeof e.code === "string") return e.message.replace(/^[A-Z]+: /, "").replace(/, \w+ '.*'$/, "");
  return err instanceof Error ? err.message : String(err);
}

/** One validated safetensors file: its tensor table and a lazily opened handle for positional reads. */
export class SafetensorsFile {
  readonly name: string;
  /** name -> entry, in header order. */
  readonly tensors = new Map<string, TensorEntry>();
  dataStart = 0;
  #handle: FileHandle | undefined;

  private constructor(readonly path: string) {
    this.name = basename(path);
  }

  /** Opens and validates the header (every tensor's range inside the file, none overlapping). */
  static async open(path: string): Promise<SafetensorsFile> {
    const file = new SafetensorsFile(path);
    await file.#parse();
    return file;
  }

  #fail(what: string, todo = "re-download it"): UserError {
    return new UserError(`${this.name} ${what}; ${todo}`);
  }

  async #parse(): Promise<void> {
    let size: number;
    let raw: Uint8Array;
    let n: bigint;
    try {
      size = (await stat(this.path)).size;
      const handle = await open(this.path, "r");
      try {
        const head = new Uint8Array(8);
        const got = (await handle.read(head, 0, 8, 0)).bytesRead;
        if (got < 8) throw this.#fail(`is truncated: ${size} bytes, too short for a safetensors header length`);
        n = new DataView(head.buffer).getBigUint64(0, true);
        if (n > BigInt(MAX_HEADER_BYTES) || 8n + n > BigInt(size)) {
          throw this.#fail(`has a corrupt header: header length field says ${n} bytes, file has ${size} bytes`);
        }
        raw = new Uint8Array(Number(n));
        let done = 0;
        while (done < raw.length) {
          const r = (await handle.read(raw, done, raw.length - done, 8 + done)).bytesRead;
          if (r === 0) break;
          done += r;
        }
        raw = raw.subarray(0, done);
      } finally {
        await handle.close();
      }
    } catch (err) {
      if (err instanceof UserError) throw err;
      throw new UserError(`cannot read ${this.path}: ${errnoText(err)}; check the path and permissions`);
    }
    let header: unknown;
    try {
      header = parseJson(raw);
    } catch (err) {
      if (!(err instanceof JsonTextError)) throw err;
      throw this.#fail(`has a corrupt header: not valid JSON (${err.message})`);
    }
    if (!isJsonObject(header)) throw this.#fail("has a corrupt header: the JSON header is not an object");
    this.dataStart = 8 + Number(n);
    const dataSize = size - this.dataStart;
    let maxEnd = 0;
    const spans: Array<[number, number, string]> = [];
    for (const key of Object.keys(header)) {
      if (key === "__metadata__") continue;
      const entry = header[key];
      if (!isJsonObject(entry) || typeof entry.dtype !== "string" || !Array.isArray(entry.shape) || !Array.isArray(entry.data_offsets)) {
        throw this.#fail(`has a corrupt header: entry ${jsonText(key)} lacks dtype/shape/data_offsets`);
      }
      const dtype = entry.dtype;
      if (DTYPE_SIZES[dtype] === undefined) {
        throw this.#fail(`has tensor ${key} with unknown dtype ${jsonText(dtype)}`, "this checkpoint format is not supported; re-download it");
      }
      const shape = entry.shape;
      const offs = entry.data_offsets;
      if (!shape.every((d) => Number.isInteger(d) && (d as number) >= 0) || offs.length !== 2 || !offs.every((o) => Number.isInteger(o))) {
        throw this.#fail(`has a corrupt header: tensor ${key} has shape ${jsonText(shape)} and data_offsets ${jsonText(offs)}`);
      }
      const [begin, end] = offs as [number, number];
      if (begin < 0 || end < begin) {
        throw this.#fail(`has a corrupt header: tensor ${key} has data_offsets [${begin}, ${end}]`);
      }
      // Exact products: a hostile shape must not wrap or round into a plausible size.
      const want = (shape as number[]).reduce((a, d) => a * BigInt(d), 1n) * BigInt(itemsize(dtype));
      const span = BigInt(end) - BigInt(begin);
      if (span !== want) {
        throw this.#fail(`has a corrupt header: tensor ${key} (${dtype} [${shape.join(", ")}]) needs ${want} bytes but ` +
          `data_offsets [${begin}, ${end}] span ${span}`);
      }
      maxEnd = Math.max(maxEnd, end);
      spans.push([begin, end, key]);
      this.tensors.set(key, { dtype, shape: shape as number[], begin, end });
    }
    if (maxEnd > dataSize) {
      throw this.#fail(`is truncated: header says ${maxEnd} bytes of data, file has ${dataSize}`);
    }
    spans.sort((a, b) => a[0] - b[0] || a[1] - b[1] || (a[2] < b[2] ? -1 : a[2] > b[2] ? 1 : 0));
    for (let i = 1; i < spans.length; i++) {
      const [, e0, k0] = spans[i - 1]!;
      const [b1, , k1] = spans[i]!;
      if (b1 < e0) throw this.#fail(`has a corrupt header: tensors ${k0} and ${k1} overlap`);
    }
  }

  /** The tensor's raw bytes, read with positional reads into a fresh buffer (nothing mapped, so
   * nothing of the shard stays resident). */
  async read(key: string): Promise<Uint8Array> {
    const entry = this.tensors.get(key);
    if (entry === undefined) throw new Error(`${this.name}: no tensor ${key}`);
    const nbytes = entry.end - entry.begin;
    // not zero-filled (every byte is read below); a plain Uint8Array over its own ArrayBuffer
    const buf = Buffer.allocUnsafeSlow(nbytes);
    const out = new Uint8Array(buf.buffer, buf.byteOffset, nbytes);
    if (nbytes === 0) return out;
    // kept open across read() calls; closed in close()
    this.#handle ??= await open(this.path, "r");
    let done = 0;
    while (done < nbytes) {
      const want = Math.min(nbytes - done, IO_CHUNK);
      const { bytesRead } = await this.#handle.read(out, done, want, this.dataStart + entry.begin + done);
      if (bytesRead === 0) throw this.#fail("shrank after it was opened");
      done += bytesRead;
    }
    return out;
  }

  async close(): Promise<void> {
    const handle = this.#handle;
    this.#handle = undefined;
    await handle?.close();
  }
}

/** model.safetensors.index.json's weight_map (tensor -> shard file), in file order, validated. */
export function readIndex(indexPath: string): Map<string, string> {
  let data: unknown;
  try {
    data = parseJson(readFileSync(indexPath));
  } catch (err) {
    throw new UserError(`${INDEX_NAME} is unreadable (${err instanceof JsonTextError ? err.message : errnoText(err)}); re-download it`);
  }
  const weightMap = isJsonObject(data) ? data.weight_map : undefined;
  const keys = isJsonObject(weightMap) ? Object.keys(weightMap) : [];
  if (!isJsonObject(weightMap) || keys.length === 0 || !keys.every((k) => typeof weightMap[k] === "string")) {
    throw new UserError(`${INDEX_NAME} has no valid weight_map; re-download it`);
  }
  const out = new Map<string, string>();
  for (const k of keys) {
    const file = weightMap[k] as string;
    if (basename(file) !== file || file === "." || file.includes("/") || file.includes(sep)) {
      throw new UserError(`${INDEX_NAME} names shard ${jsonText(file)} outside the checkpoint directory; re-download the index`);
    }
    out.set(k, file);
  }
  return out;
}

/** Writes model.safetensors.index.json — JSON.stringify with a two-space indent, then a line
 * feed — via a .partial file renamed into place. weight_map keeps the given order (a JSON object
 * would move integer-like names first; checkpoint tensor names never are). */
export function writeIndex(directory: string, weightMap: ReadonlyMap<string, string>, totalSize: number): string {
  const path = join(directory, INDEX_NAME);
  const data = { metadata: { total_size: totalSize }, weight_map: Object.fromEntries(weightMap) };
  const tmp = `${path}.partial`;
  const fd = openSync(tmp, "w");
  try {
    writeAll(fd, Buffer.from(`${JSON.stringify(data, null, 2)}\n`, "utf8"));
  } finally {
    closeSync(fd);
  }
  renameSync(tmp, path);
  return path;
}

function checkRevision(value: string, where: string): string {
  const v = value.trim().toLowerCase();
  if (!HEX40.test(v)) {
    throw new UserError(`${where} holds ${jsonText([...v].slice(0, 60).join(""))}, not a 40-hex-digit commit hash; fix or delete it`);
  }
  return v;
}

function filesUnder(dir: string, suffix: string): string[] {
  const out: string[] = [];
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) out.push(...filesUnder(path, suffix));
    else if (entry.name.endsWith(suffix)) out.push(path);
  }
  return out.sort();
}

const LINE_BREAK = /\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]/;

/**
 * The checkpoint's source commit: an explicit revision file (SOURCE_REVISION.txt, .kvl_revision),
 * huggingface_hub local_dir download metadata, or a `snapshots/<40-hex>` path component; null
 * if none says.
 */
export function findRevision(directory: string): string | null {
  const lenient = new TextDecoder("utf-8");
  for (const file of REVISION_FILES) {
    const path = join(directory, file);
    if (isFile(path)) return checkRevision(lenient.decode(readFileSync(path)), path);
  }
  const metaDir = join(directory, ".cache", "huggingface", "download");
  if (isDir(metaDir)) {
    const distinct = new Set<string>();
    for (const meta of filesUnder(metaDir, ".metadata")) {
      const first = lenient.decode(readFileSync(meta)).split(LINE_BREAK)[0];
      if (first !== undefined && first !== "" && HEX40.test(first.trim().toLowerCase())) distinct.add(first.trim().toLowerCase());
    }
    if (distinct.size > 1) {
      throw new UserError(`files in ${directory} come from different revisions (${[...distinct].sort().join(", ")}); ` +
        "re-download them at one revision");
    }
    const [only] = distinct;
    if (only !== undefined) return only;
  }
  const parts = resolve(directory).split(sep).reverse();
  return parts.find((p) => HEX40.test(p)) ?? null;
}

// ---------------------------------------------------------------------------------------------
// Writer

interface WriterEntry {
  readonly name: string;
  readonly dtype: string;
  readonly shape: readonly number[];
}

function writeAll(fd: number, data: Uint8Array): void {
  let done = 0;
  while (done < data.length) {
    done += writeSync(fd, data, done, Math.min(data.length - done, IO_CHUNK));
  }
}

/**
 * Streams one safetensors file: the tensor list is fixed up front, the header is written first,
 * then the tensors in that order, each whole (write) or in pieces (begin + append), so memory
 * stays at one tensor or one piece. The file appears under its final name only after the last
 * tensor (close), so a crash never leaves a valid-looking shard. Mistakes by the caller (wrong
 * order, wrong size) throw plain Errors: they are bugs, not user errors.
 */
export class SafetensorsWriter {
  readonly path: string;
  readonly dataBytes: number;
  readonly #order: Array<{ name: string; dtype: string; shape: readonly number[]; nbytes: number }> = [];
  readonly #tmp: string;
  #fd: number | undefined;
  #next = 0;
  /** The tensor being appended and its bytes so far. */
  #open: { index: number; written: number } | undefined;

  constructor(path: string, tensors: Iterable<WriterEntry>, metadata: Readonly<Record<string, string>> = { format: "pt" }) {
    this.path = path;
    // compact JSON, members in insertion order (tensor names are never integer-like); no
    // prototype, so that every name, "__proto__" too, is an ordinary member
    const header: Record<string, unknown> = Object.create(null) as Record<string, unknown>;
    header.__metadata__ = { ...metadata };
    let offset = 0;
    for (const { name, dtype, shape } of tensors) {
      if (DTYPE_SIZES[dtype] === undefined) throw new Error(`unknown safetensors dtype ${jsonText(dtype)} for ${name}`);
      if (Object.hasOwn(header, name)) throw new Error(`duplicate tensor name ${name}`);
      const nbytes = shape.reduce((a, b) => a * b, 1) * itemsize(dtype);
      header[name] = { dtype, shape: [...shape], data_offsets: [offset, offset + nbytes] };
      this.#order.push({ name, dtype, shape: [...shape], nbytes });
      offset += nbytes;
    }
    this.dataBytes = offset;
    let raw = Buffer.from(JSON.stringify(header), "utf8");
    // keep the data 8-byte aligned, as the reference writer does
    raw = Buffer.concat([raw, Buffer.alloc((8 - (raw.length % 8)) % 8, 0x20)]);
    this.#tmp = `${path}.partial`;
    this.#fd = openSync(this.#tmp, "w");
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(raw.length));
    writeAll(this.#fd, len);
    writeAll(this.#fd, raw);
  }

  get #file(): string {
    return basename(this.path);
  }

  #liveFd(): number {
    if (this.#fd === undefined) throw new Error(`${this.#file}: the writer is closed`);
    return this.#fd;
  }

  /** Checks that `name` is the next tensor (and the previous one is complete); returns its index. */
  #expect(name: string): number {
    this.#liveFd();
    if (this.#open !== undefined) {
      const cur = this.#order[this.#open.index]!;
      throw new Error(`${this.#file}: tensor ${cur.name} is incomplete (${this.#open.written} of ${cur.nbytes} bytes) before ${name}`);
    }
    if (this.#next >= this.#order.length) throw new Error(`${this.#file}: all tensors already written, got ${name}`);
    const want = this.#order[this.#next]!;
    if (name !== want.name) throw new Error(`${this.#file}: expected tensor ${want.name} next, got ${name}`);
    return this.#next;
  }

  /** Writes the next tensor whole: raw little-endian bytes of exactly its size. */
  write(name: string, data: ArrayBufferView): void {
    const index = this.#expect(name);
    const want = this.#order[index]!;
    if (data.byteLength !== want.nbytes) {
      throw new Error(`${name}: expected ${want.dtype} [${want.shape.join(", ")}] (${want.nbytes} bytes), got ${data.byteLength} bytes`);
    }
    writeAll(this.#liveFd(), new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
    this.#next++;
  }

  /** Starts the next tensor; its bytes follow in append() calls. */
  begin(name: string): void {
    const index = this.#expect(name);
    this.#next++;
    this.#open = { index, written: 0 };
    if (this.#order[index]!.nbytes === 0) this.#open = undefined;
  }

  append(data: ArrayBufferView): void {
    const open = this.#open;
    if (open === undefined) throw new Error(`${this.#file}: append() without begin()`);
    const want = this.#order[open.index]!;
    if (open.written + data.byteLength > want.nbytes) {
      throw new Error(`${want.name}: ${open.written + data.byteLength} bytes appended, the tensor has ${want.nbytes}`);
    }
    writeAll(this.#liveFd(), new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
    open.written += data.byteLength;
    if (open.written === want.nbytes) this.#open = undefined;
  }

  /** fsync, close and rename into place; throws when a tensor is missing (the file stays .partial). */
  close(): void {
    if (this.#fd === undefined) return;
    const fd = this.#fd;
    const missing = this.#open !== undefined ? this.#order[this.#open.index]!.name : this.#order[this.#next]?.name;
    if (missing !== undefined) {
      this.#fd = undefined;
      closeSync(fd);
      throw new Error(`${this.#file}: closed before tensor ${missing} was written`);
    }
    fsyncSync(fd);
    this.#fd = undefined;
    closeSync(fd);
    renameSync(this.#tmp, this.path);
  }

  /** Closes and deletes the unfinished file. */
  abort(): void {
    if (this.#fd !== undefined) closeSync(this.#fd);
    this.#fd = undefined;
    rmSync(this.#tmp, { force: true });
  }
}
