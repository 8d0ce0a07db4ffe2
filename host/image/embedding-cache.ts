/**
 * embedding-cache.ts — images' media embeddings kept by content across conversations and server
 * requests, least recently used first out, bounded in bytes, so a client that resends a history
 * with the same image never has it encoded again.
 *
 * Owns: the content key of an image as the vision tower sees it (imageContentKey: a sha256 over
 * the preprocessed pixel values — the decoded pixels after the resize and padding the token
 * limit chose — and the patch grid), the map from a file's digest and token limit to that key
 * (so identical bytes are not even decoded again), and the LRU by bytes. The cache belongs to
 * one loaded model (ChatModel), so the model is part of every key by construction.
 * Does not own: encoding (chat-model.ts Conversation, through the engine), the preprocessing
 * (image-preprocess.ts), the byte budget's size (chat-model.ts: the plan's "image embeddings"
 * line, which is sized for a full context of media rows — every image one prompt shows always
 * fits, the rest of the line holds images no longer shown).
 */
import { createHash } from "node:crypto";

/** The sha256 (hex) of preprocessed pixel values and their patch grid: equal for equal vision input. */
export function imageContentKey(pixelValues: Float32Array, grid: readonly [number, number]): string {
  const hash = createHash("sha256");
  hash.update(Int32Array.from(grid));
  hash.update(new Uint8Array(pixelValues.buffer, pixelValues.byteOffset, pixelValues.byteLength));
  return hash.digest("hex");
}

/** File digests remembered with their content key (a few dozen bytes each). */
const FILE_KEYS_KEPT = 1024;

export class EmbeddingCache {
  /** Content key → embeddings, least recently used first (a Map keeps insertion order). */
  readonly #rows = new Map<string, Float32Array>();
  /** `${file sha256}@${token limit}` → content key. */
  readonly #fileKeys = new Map<string, string>();
  #bytes = 0;
  #hits = 0;
  #misses = 0;

  /** @param capacityBytes the most bytes of embeddings held; an entry larger than it is not kept */
  constructor(readonly capacityBytes: number) {}

  get bytes(): number {
    return this.#bytes;
  }

  get size(): number {
    return this.#rows.size;
  }

  /** Lookups that found embeddings, and that did not. */
  get counts(): { hits: number; misses: number } {
    return { hits: this.#hits, misses: this.#misses };
  }

  /** The content key a file (sha256 of its bytes) gave under this token limit, if remembered. */
  keyOfFile(fileDigest: string, inTokenLimit: number): string | undefined {
    return this.#fileKeys.get(`${fileDigest}@${inTokenLimit}`);
  }

  rememberFile(fileDigest: string, inTokenLimit: number, contentKey: string): void {
    const name = `${fileDigest}@${inTokenLimit}`;
    this.#fileKeys.delete(name);
    this.#fileKeys.set(name, contentKey);
    if (this.#fileKeys.size > FILE_KEYS_KEPT) this.#fileKeys.delete(this.#fileKeys.keys().next().value!);
  }

  /** The embeddings of a content key (now the most recently used), or undefined; counted. */
  get(contentKey: string): Float32Array | undefined {
    const rows = this.#rows.get(contentKey);
    if (rows === undefined) {
      this.#misses++;
      return undefined;
    }
    this.#hits++;
    this.#rows.delete(contentKey);
    this.#rows.set(contentKey, rows);
    return rows;
  }

  /** Marks an entry most recently used without counting a lookup (a prompt's images before the
   * turn encodes others, so they are the last to go). */
  touch(contentKey: string): void {
    const rows = this.#rows.get(contentKey);
    if (rows === undefined) return;
    this.#rows.delete(contentKey);
    this.#rows.set(contentKey, rows);
  }

  /** Keeps embeddings, evicting the least recently used until they fit. */
  set(contentKey: string, rows: Float32Array): void {
    const old = this.#rows.get(contentKey);
    if (old !== undefined) {
      this.#rows.delete(contentKey);
      this.#bytes -= old.byteLength;
    }
    if (rows.byteLength > this.capacityBytes) return;
    while (this.#bytes + rows.byteLength > this.capacityBytes) {
      const [key, oldest] = this.#rows.entries().next().value!;
      this.#rows.delete(key);
      this.#bytes -= oldest.byteLength;
    }
    this.#rows.set(contentKey, rows);
    this.#bytes += rows.byteLength;
  }

  clear(): void {
    this.#rows.clear();
    this.#fileKeys.clear();
    this.#bytes = 0;
  }
}
