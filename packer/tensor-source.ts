/**
 * tensor-source.ts — where the packer gets checkpoint tensors from.
 *
 * Owns: the TensorSource interface, the ShardHooks interface a downloader implements, and two
 * sources: CheckpointSource (a checkpoint directory: sharded with model.safetensors.index.json,
 * or one model.safetensors; every shard header validated when opened) and InventorySource
 * (shard files in a directory whose inventory is known in advance — from the hub's headers or
 * from a pack journal — where a shard may be absent until its tensors are read).
 * Does not own: the file format (safetensors.ts), which tensors a model needs
 * (host/pack/model-spec.ts), packing (pack.ts).
 *
 * Tensor data is raw little-endian bytes: BF16 as its 16-bit patterns, F32 as IEEE floats.
 */
import { createHash } from "node:crypto";
import { readFileSync, statSync } from "node:fs";
import { open } from "node:fs/promises";
import { join } from "node:path";

import { type TensorInfo, formatShape } from "../host/pack/model-spec.js";
import { JsonTextError, isJsonObject, parseJson } from "../host/system/json-file.js";
import { UserError } from "../host/system/user-error.js";
import { ASSET_NAMES, INDEX_NAME, SINGLE_NAME, SafetensorsFile, findRevision, readIndex } from "./safetensors.js";
import { isDir, isFile } from "../host/pack/file-kind.js";

export type { TensorInfo };

/**
 * Shard life cycle around a pack, for a source whose shards come and go (kvl prepare downloads
 * each shard just before its tensors are read and deletes it once they are durably packed).
 * The packer asks for shards in a fixed order (sorted names: the order its work follows), calls
 * acquire(shard) before it reads the first tensor of a shard that is not yet acquired in this
 * run — after everything read so far is durable, so about one shard is on disk at a time — and
 * release(shard) once every item that reads from the shard is fsynced and journaled (including,
 * at the start of a resumed run, shards an earlier run already consumed and may have deleted).
 * Before release it calls the source's releaseShard(shard), which closes any handle on the file.
 */
export interface ShardHooks {
  /** Make the shard readable (e.g. download it into the source's directory). */
  acquire(shard: string): Promise<void> | void;
  /** Every tensor of the shard is durably packed; it may be deleted. */
  release(shard: string): Promise<void> | void;
}

/** What the packer reads: a checkpoint's config, assets and tensors. */
export interface TensorSource {
  /** The parsed config.json; throws UserError when it is missing or unreadable. */
  config(): unknown;
  /** Non-tensor files to copy into the pack, by file name: config.json, generation_config.json,
   * tokenizer_config.json, tiktoken.model, chat_template.jinja, preprocessor_config.json
   * (whichever exist). */
  assetFiles(): Promise<ReadonlyMap<string, Uint8Array>>;
  /** Recorded source revision (40 lowercase hex characters) or null when unknown. */
  revision(): string | null;
  /** Every tensor name, in the checkpoint's index order. */
  tensorNames(): string[];
  /** dtype ("BF16", "F32" or another safetensors dtype string) and shape. */
  tensorInfo(name: string): TensorInfo;
  /** Shard file name holding the tensor, or null for sources without shards. */
  shardOf(name: string): string | null;
  /** The tensor's raw little-endian bytes (exactly prod(shape) * itemsize). */
  read(name: string): Promise<Uint8Array>;
  /** Hooks the packer drives around this source's shards (see ShardHooks). */
  readonly shardHooks?: ShardHooks | undefined;
  /** Close any open handle on the shard (it is about to be released, maybe deleted). */
  releaseShard?(shard: string): Promise<void>;
  /** A digest of the shard file's first and last MiB (header and data), or null while the file
   * is absent. The journal records it, so a rerun into an unfinished pack notices a different
   * checkpoint with the same layout (e.g. another seed or fine-tune). */
  shardDigest?(shard: string): Promise<string | null>;
  /** Close every open handle. */
  close?(): Promise<void>;
}

/** config.json parsed (strict UTF-8, JSON.parse) as a source returns it: a JSON object; model-spec.ts
 * validates its fields. */
function parseConfig(read: () => Uint8Array, missing: () => string): unknown {
  let bytes: Uint8Array;
  try {
    bytes = read();
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") throw new UserError(missing());
    throw new UserError(`config.json is unreadable (${(err as Error).message}); re-download it`);
  }
  let config: unknown;
  try {
    config = parseJson(bytes);
  } catch (err) {
    if (!(err instanceof JsonTextError)) throw err;
    throw new UserError(`config.json is unreadable (${err.message}); re-download it`);
  }
  if (!isJsonObject(config)) throw new UserError("config.json is not a JSON object; re-download it");
  return config;
}

const DIGEST_SPAN = 1 << 20;

/** sha256 of a file's size, first MiB and last MiB; null when there is no such file. */
async function fileDigest(path: string): Promise<string | null> {
  if (!isFile(path)) return null;
  const handle = await open(path, "r");
  try {
    const size = (await handle.stat()).size;
    const hash = createHash("sha256").update(String(size));
    const spans = size <= 2 * DIGEST_SPAN ? [[0, size]] : [[0, DIGEST_SPAN], [size - DIGEST_SPAN, DIGEST_SPAN]];
    for (const [at, length] of spans as Array<[number, number]>) {
      const buf = new Uint8Array(length);
      const { bytesRead } = await handle.read(buf, 0, length, at);
      hash.update(buf.subarray(0, bytesRead));
    }
    return hash.digest("hex");
  } finally {
    await handle.close();
  }
}

/** The asset files present in a directory. */
export function readAssets(directory: string): Map<string, Uint8Array> {
  const out = new Map<string, Uint8Array>();
  for (const name of ASSET_NAMES) {
    const path = join(directory, name);
    if (isFile(path)) out.set(name, readFileSync(path));
  }
  return out;
}

/** A checkpoint directory (sharded with an index, or one model.safetensors) as a TensorSource. */
export class CheckpointSource implements TensorSource {
  #config: unknown;
  readonly #shards = new Map<string, SafetensorsFile>();
  /** tensor name -> shard file name, in index order */
  readonly #where = new Map<string, string>();

  private constructor(readonly dir: string) {}

  /** Opens the directory and validates the index and every shard's header. */
  static async open(directory: string): Promise<CheckpointSource> {
    if (!isDir(directory)) {
      throw new UserError(`checkpoint directory ${directory} does not exist; pass the folder that holds config.json and the .safetensors files`);
    }
    const src = new CheckpointSource(directory);
    const index = join(directory, INDEX_NAME);
    try {
      if (statExists(index)) {
        const weightMap = readIndex(index);
        for (const file of new Set(weightMap.values())) {
          const path = join(directory, file);
          if (!isFile(path)) throw new UserError(`${file} is listed in ${INDEX_NAME} but missing from ${directory}; download it`);
          src.#shards.set(file, await SafetensorsFile.open(path));
        }
        for (const [name, file] of weightMap) {
          if (!src.#shards.get(file)!.tensors.has(name)) {
            throw new UserError(`${file} does not contain tensor ${name} that ${INDEX_NAME} puts there; re-download the shard and the index`);
          }
          src.#where.set(name, file);
        }
      } else if (isFile(join(directory, SINGLE_NAME))) {
        const shard = await SafetensorsFile.open(join(directory, SINGLE_NAME));
        src.#shards.set(SINGLE_NAME, shard);
        for (const name of shard.tensors.keys()) src.#where.set(name, SINGLE_NAME);
      } else {
        throw new UserError(`${directory} holds neither ${INDEX_NAME} nor ${SINGLE_NAME}; pass a checkpoint directory (download the model files first)`);
      }
    } catch (err) {
      await src.close();
      throw err;
    }
    return src;
  }

  config(): unknown {
    this.#config ??= parseConfig(() => readFileSync(join(this.dir, "config.json")),
      () => `${this.dir} has no config.json; download it with the checkpoint`);
    return this.#config;
  }

  async assetFiles(): Promise<ReadonlyMap<string, Uint8Array>> {
    return readAssets(this.dir);
  }

  revision(): string | null {
    return findRevision(this.dir);
  }

  tensorNames(): string[] {
    return [...this.#where.keys()];
  }

  #shard(name: string): SafetensorsFile {
    const file = this.#where.get(name);
    const shard = file === undefined ? undefined : this.#shards.get(file);
    if (shard === undefined) throw new UserError(`tensor ${name} is not in the checkpoint at ${this.dir}`);
    return shard;
  }

  tensorInfo(name: string): TensorInfo {
    const { dtype, shape } = this.#shard(name).tensors.get(name)!;
    return { dtype, shape };
  }

  shardOf(name: string): string | null {
    this.#shard(name);
    return this.#where.get(name)!;
  }

  read(name: string): Promise<Uint8Array> {
    return this.#shard(name).read(name);
  }

  async releaseShard(shard: string): Promise<void> {
    await this.#shards.get(shard)?.close();
  }

  shardDigest(shard: string): Promise<string | null> {
    return fileDigest(join(this.dir, shard));
  }

  async close(): Promise<void> {
    for (const shard of this.#shards.values()) await shard.close();
  }
}

function statExists(path: string): boolean {
  try {
    statSync(path);
    return true;
  } catch {
    return false;
  }
}

/** One tensor of an InventorySource: dtype, shape and the shard file that holds it. */
export interface InventoryEntry extends TensorInfo {
  readonly shard: string | null;
}

/**
 * A TensorSource over shard files in a directory whose inventory is known in advance (from the
 * shards' headers fetched by range, or from a pack journal); shards may be absent until `read`
 * needs them (the hooks' acquire brings them). Reading a shard validates its header and checks
 * that it holds the tensor with the dtype and shape the inventory says.
 */
export class InventorySource implements TensorSource {
  readonly shardHooks: ShardHooks | undefined;
  #open: SafetensorsFile | undefined;

  constructor(
    readonly directory: string,
    private readonly configText: string,
    private readonly assets: ReadonlyMap<string, Uint8Array>,
    private readonly inventory: ReadonlyMap<string, InventoryEntry>,
    private readonly sourceRevision: string | null,
    shardHooks?: ShardHooks,
  ) {
    this.shardHooks = shardHooks;
  }

  config(): unknown {
    return parseConfig(() => Buffer.from(this.configText, "utf8"), () => "config.json is missing from the source");
  }

  async assetFiles(): Promise<ReadonlyMap<string, Uint8Array>> {
    return new Map(this.assets);
  }

  revision(): string | null {
    return this.sourceRevision;
  }

  tensorNames(): string[] {
    return [...this.inventory.keys()];
  }

  #entry(name: string): InventoryEntry {
    const entry = this.inventory.get(name);
    if (entry === undefined) throw new UserError(`tensor ${name} is not in the checkpoint at ${this.directory}`);
    return entry;
  }

  tensorInfo(name: string): TensorInfo {
    const { dtype, shape } = this.#entry(name);
    return { dtype, shape };
  }

  shardOf(name: string): string | null {
    return this.#entry(name).shard;
  }

  async read(name: string): Promise<Uint8Array> {
    const want = this.#entry(name);
    const path = join(this.directory, String(want.shard));
    if (this.#open === undefined || this.#open.path !== path) {
      if (!isFile(path)) {
        throw new UserError(`${path}: shard needed for ${name} is missing; restore the checkpoint ` +
          "(it was deleted before the tensors in it were packed)");
      }
      await this.#open?.close();
      this.#open = undefined;
      this.#open = await SafetensorsFile.open(path);
    }
    const got = this.#open.tensors.get(name);
    if (got === undefined) {
      throw new UserError(`${this.#open.name}: does not contain ${name}; the shard does not match the checkpoint index`);
    }
    if (got.dtype !== want.dtype || formatShape(got.shape) !== formatShape(want.shape)) {
      throw new UserError(`${name}: the source returned ${got.dtype} ${formatShape(got.shape)}, its header says ` +
        `${want.dtype} ${formatShape(want.shape)} — the checkpoint is corrupt`);
    }
    return this.#open.read(name);
  }

  shardDigest(shard: string): Promise<string | null> {
    return fileDigest(join(this.directory, shard));
  }

  async releaseShard(shard: string): Promise<void> {
    if (this.#open !== undefined && this.#open.name === shard) {
      const open = this.#open;
      this.#open = undefined;
      await open.close();
    }
  }

  async close(): Promise<void> {
    const open = this.#open;
    this.#open = undefined;
    await open?.close();
  }
}
