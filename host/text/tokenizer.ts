/**
 * tokenizer.ts — the model's tokenizer: tiktoken (the npm `tiktoken` package, its Rust core as
 * WebAssembly) over a pack's `tiktoken.model`, special tokens from its `tokenizer_config.json`.
 * test/fixtures/goldens/tokenizer.json holds the official tokenizer's ids (tiktoken, as
 * tokenization_moonshot.py builds it), equal there to those of the independent Python reference
 * (test/fixtures/reference/tokenizer.py).
 *
 * Owns: reading and validating the two files (UserErrors that name the file and say to rerun
 * kvl pack), the special-id rule of spec §8 (the 256 + 2 ids after the base vocabulary, named
 * from added_tokens_decoder, else `<|reserved_token_ID|>`), encode with special-token strings
 * allowed, the official pre-split of long texts (chunks of 400,000 and runs of at most 25,000
 * space / non-space characters, counted in code points, space meaning Python's str.isspace),
 * encodeOrdinary, decode (specials as their literal names, invalid UTF-8 as U+FFFD), a streaming
 * decoder that never emits half a UTF-8 character, the ids the runtime needs by name, the stop
 * ids (spec §9) and the ids the sampler must never emit.
 * Does not own: the chat template or media expansion (chat-template.ts), turning messages into a
 * prompt (conversation.ts), the pre-tokenizer pattern itself (tokenizer-pattern.ts).
 */
import { Buffer } from "node:buffer";
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";

import type { Tiktoken } from "tiktoken";

import { requireDependency } from "../system/paths.js";
import { isJsonObject, jsonText, parseJson } from "../system/json-file.js";
import { PATTERN } from "./tokenizer-pattern.js";
import { UserError } from "../system/user-error.js";

/** The official tokenizer reserves this many special ids after the base vocabulary (+2). */
const NUM_RESERVED_SPECIAL = 256;
/** Official pre-split limits (spec §8), in code points: tiktoken's matcher degrades (and its
 * backtracking limit can be hit) on very long inputs and runs. */
export const MAX_CHUNK_CHARS = 400_000;
export const MAX_RUN_CHARS = 25_000;

/**
 * Python's str.isspace() for one code point: bidirectional class WS, B or S, or category Zs.
 * Not JavaScript's \s, which lacks U+001C..U+001F and U+0085 and has U+FEFF; nor the
 * pattern's \s (Unicode White_Space), which lacks U+001C..U+001F. Only the pre-split uses it.
 */
export function isPySpace(cp: number): boolean {
  if (cp <= 0x20) return (cp >= 0x09 && cp <= 0x0d) || cp >= 0x1c;
  if (cp < 0x85) return false;
  return cp === 0x85 || cp === 0xa0 || cp === 0x1680 || (cp >= 0x2000 && cp <= 0x200a) ||
    cp === 0x2028 || cp === 0x2029 || cp === 0x202f || cp === 0x205f || cp === 0x3000;
}

/** The text has more than `limit` code points (Python's len(text) > limit). */
function longerThan(text: string, limit: number): boolean {
  if (text.length <= limit) return false;
  let count = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    // a high surrogate followed by a low one is one code point
    if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
      const d = text.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) i++;
    }
    if (++count > limit) return true;
  }
  return false;
}

/**
 * Cuts text into pieces with no run of more than MAX_RUN_CHARS space or non-space code points,
 * within chunks of MAX_CHUNK_CHARS code points, as the official tokenizer (tokenization_moonshot.py)
 * cuts them, so huge inputs tokenize identically. Yields UTF-16 slices of text.
 */
export function* splitRuns(text: string): Generator<string> {
  const n = text.length;
  let pieceStart = 0;
  let chunkCount = 0;
  let runLen = 0;
  let runIsSpace = false;
  for (let i = 0; i < n;) {
    const cp = text.codePointAt(i)!;
    const width = cp > 0xffff ? 2 : 1;
    if (chunkCount === MAX_CHUNK_CHARS) {
      yield text.slice(pieceStart, i);
      pieceStart = i;
      chunkCount = 0;
    }
    const isSpace = isPySpace(cp);
    if (chunkCount === 0) {
      runIsSpace = isSpace;
      runLen = 0;
    }
    if (isSpace !== runIsSpace) {
      runIsSpace = isSpace;
      runLen = 1;
    } else if (++runLen > MAX_RUN_CHARS) {
      yield text.slice(pieceStart, i);
      pieceStart = i;
      runLen = 1;
    }
    chunkCount++;
    i += width;
  }
  if (n > 0) yield text.slice(pieceStart);
}

const B64_RE = /^[A-Za-z0-9+/]*={0,2}$/;
const RANK_RE = /^[+-]?[0-9]+(?:_[0-9]+)*$/;
const B64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/** Python's bytes.strip() / bytes.split() whitespace (ASCII only). */
function isAsciiSpace(c: number): boolean {
  return c === 0x20 || (c >= 0x09 && c <= 0x0d);
}

/**
 * Python's base64.b64decode(s, validate=True) on one token (3.11 rules), returning the canonical
 * base64 of the decoded bytes (the same bytes always give the same string); throws its message.
 */
function canonicalBase64(s: string): string {
  if (!B64_RE.test(s)) throw new Error("Non-base64 digit found");
  let data = s.length;
  while (data > 0 && s.charCodeAt(data - 1) === 0x3d) data--;
  const pad = s.length - data;
  if (data === 0 && pad > 0) throw new Error("Leading padding not allowed");
  const rest = data % 4;
  if (rest === 1) {
    throw new Error(`Invalid base64-encoded string: number of data characters (${data}) cannot be 1 more than a multiple of 4`);
  }
  if ((rest === 2 && pad < 2) || (rest === 3 && pad < 1)) throw new Error("Incorrect padding");
  // canonical: padding exactly to a multiple of 4 and zero bits after the last byte
  const wantPad = rest === 0 ? 0 : 4 - rest;
  const lastBits = rest === 0 ? 0 : B64_ALPHABET.indexOf(s[data - 1]!) & (rest === 2 ? 0x0f : 0x03);
  if (pad === wantPad && lastBits === 0) return s;
  return Buffer.from(s.slice(0, data), "base64").toString("base64");
}

function isFile(path: string): boolean {
  try {
    return statSync(path).isFile();
  } catch {
    return false;
  }
}

/**
 * Parses `base64 rank` lines (tiktoken's model file) into the canonical base64 of each token's
 * bytes, by rank. Stricter than tiktoken's own loader in one way: the ranks must be exactly
 * 0..N-1 (a duplicate rank made Python's tiktoken panic; a gap would let a base id collide
 * with a special id).
 */
export function readTiktokenModel(path: string): string[] {
  if (!isFile(path)) {
    throw new UserError(`${path} is missing; the model directory needs the tokenizer file tiktoken.model (rerun kvl pack)`);
  }
  // latin1: one char per byte, so the text is the bytes (a valid file is ASCII)
  const text = readFileSync(path).toString("latin1");
  const byToken = new Map<string, number>(); // token (canonical base64) -> rank; a later line wins, as in a dict
  let lineNo = 0;
  for (let pos = 0; pos < text.length;) {
    let end = text.indexOf("\n", pos);
    if (end < 0) end = text.length;
    lineNo++;
    const fields: string[] = [];
    for (let i = pos; i < end;) {
      while (i < end && isAsciiSpace(text.charCodeAt(i))) i++;
      const start = i;
      while (i < end && !isAsciiSpace(text.charCodeAt(i))) i++;
      if (i > start) fields.push(text.slice(start, i));
    }
    pos = end + 1;
    if (fields.length === 0) continue;
    try {
      if (fields.length !== 2) {
        throw new Error(`${fields.length} field${fields.length === 1 ? "" : "s"}, not 2`);
      }
      const token = canonicalBase64(fields[0]!);
      if (!RANK_RE.test(fields[1]!)) throw new Error(`the rank '${fields[1]}' is not a whole number`);
      byToken.set(token, Number(fields[1]!.replaceAll("_", "")));
    } catch (err) {
      throw new UserError(`${path}:${lineNo} is not 'base64 rank' (${(err as Error).message}); the tokenizer file is corrupt, rerun kvl pack`);
    }
  }
  if (byToken.size === 0) throw new UserError(`${path} is empty; rerun kvl pack`);
  const byRank = new Array<string>(byToken.size);
  for (const [token, rank] of byToken) {
    if (!(rank >= 0 && rank < byToken.size) || byRank[rank] !== undefined) {
      const what = byRank[rank] !== undefined ? "is used twice" : `is outside 0..${byToken.size - 1}`;
      throw new UserError(`${path}: rank ${rank} ${what}, so the tokenizer file is corrupt (the ranks must be 0..N-1, once each); rerun kvl pack`);
    }
    byRank[rank] = token;
  }
  return byRank;
}

/** tokenizer_config.json parsed; UserError when missing or not JSON. */
function readTokenizerConfig(path: string): unknown {
  if (!isFile(path)) throw new UserError(`${path} is missing; rerun kvl pack`);
  try {
    return parseJson(readFileSync(path));
  } catch (err) {
    throw new UserError(`${path} is not valid JSON (${(err as Error).message}); rerun kvl pack`);
  }
}

const utf8 = new TextEncoder();

/** The model's tokenizer, built from a pack (or checkpoint) directory. Call close() when done:
 * the vocabulary lives in the tiktoken WebAssembly instance's memory. */
export class Tokenizer {
  /** Number of base (byte-pair) tokens; the first special id. */
  readonly numBaseTokens: number;
  /** Special token name -> id, for the whole reserved range. */
  readonly specialTokens: ReadonlyMap<string, number>;
  /** Special id -> name. */
  readonly specialIds: ReadonlyMap<number, string>;
  readonly imEnd: number;
  readonly eos: number;
  readonly mediaPad: number;
  readonly mediaStart: number;
  readonly mediaEnd: number;

  private readonly encoding: Tiktoken;
  private readonly specialRe: RegExp;
  private readonly specialBytes = new Map<number, Uint8Array>();
  private readonly stops: ReadonlySet<number>;
  private closed = false;

  constructor(modelDir: string) {
    const byRank = readTiktokenModel(join(modelDir, "tiktoken.model"));
    const configPath = join(modelDir, "tokenizer_config.json");
    const config = readTokenizerConfig(configPath);
    const decoder = isJsonObject(config) ? config.added_tokens_decoder : undefined;
    if (!isJsonObject(decoder)) {
      throw new UserError(`${configPath} has no added_tokens_decoder object, so the special token ids are unknown; rerun kvl pack`);
    }
    const named = new Map<number, string>();
    for (const key of Object.keys(decoder)) {
      const entry = decoder[key];
      const content = isJsonObject(entry) ? entry.content : undefined;
      // Python's key.isdigit() also takes non-ASCII digits; no tokenizer writes those
      if (typeof content !== "string" || !/^[0-9]+$/.test(key)) {
        throw new UserError(`${configPath}: bad added_tokens_decoder entry ${jsonText(key)}; rerun kvl pack`);
      }
      named.set(Number(key), content);
    }
    this.numBaseTokens = byRank.length;
    const specials = new Map<string, number>();
    const first = this.numBaseTokens;
    for (let id = first; id < first + NUM_RESERVED_SPECIAL + 2; id++) {
      specials.set(named.get(id) ?? `<|reserved_token_${id}|>`, id);
    }
    this.specialTokens = specials;
    this.specialIds = new Map([...specials].map(([name, id]) => [id, name]));
    for (const [id, name] of this.specialIds) this.specialBytes.set(id, utf8.encode(name));

    const longestFirst = [...specials.keys()].sort((a, b) => b.length - a.length);
    this.specialRe = new RegExp(`(${longestFirst.map((s) => s.replace(/[\\^$.*+?()[\]{}|/-]/g, "\\$&")).join("|")})`);

    // Names are resolved before the WebAssembly instance is allocated, so a UserError leaks nothing.
    this.imEnd = this.idOf("<|im_end|>");
    this.eos = this.configTokenId(config as Record<string, unknown>, "eos_token", "[EOS]");
    this.mediaPad = this.idOf("<|media_pad|>");
    this.mediaStart = this.idOf("<|media_start|>");
    this.mediaEnd = this.idOf("<|media_end|>");
    this.stops = new Set([this.imEnd, this.eos]);

    // tiktoken's own parser panics (a WebAssembly trap) on anything unexpected, so it gets the
    // validated ranks re-encoded, one canonical `base64 rank` line each.
    const bfe = byRank.map((token, rank) => `${token} ${rank}`).join("\n");
    // loaded at run time where paths.ts says (a single executable's asset folder too): tiktoken
    // reads its WebAssembly file from beside its own script
    const tiktoken = requireDependency("tiktoken") as typeof import("tiktoken");
    this.encoding = new tiktoken.Tiktoken(bfe, Object.fromEntries(specials), PATTERN);
  }

  private configTokenId(config: Record<string, unknown>, key: string, fallback: string): number {
    let value = key in config ? config[key] : fallback;
    if (isJsonObject(value)) value = "content" in value ? value.content : fallback; // HF AddedToken
    // a token named by a non-string is looked up as JSON spells it (and so not found)
    return this.idOf(typeof value === "string" ? value : jsonText(value));
  }

  /** Id of a special token by name; a clear error when the tokenizer lacks it. */
  idOf(special: string): number {
    const id = this.specialTokens.get(special);
    if (id === undefined) {
      throw new UserError(`tokenizer_config.json has no special token ${jsonText(special)}; the model directory is not a Kimi-VL pack`);
    }
    return id;
  }

  /** Ids that end an assistant turn (spec §9): <|im_end|> and the config's eos. */
  get stopIds(): ReadonlySet<number> {
    return this.stops;
  }

  /** One more than the largest id (base vocabulary + the reserved special range). */
  get nVocab(): number {
    return this.numBaseTokens + NUM_RESERVED_SPECIAL + 2;
  }

  /**
   * Ids generation must never emit: every id of the special range except the stop ids (media
   * placeholders, role markers, reserved slots), ascending. Ids at or above the model's vocab
   * size are included; a sampler masks only those it has logits for.
   */
  unsampleableIds(): Int32Array {
    const out: number[] = [];
    for (let id = this.numBaseTokens; id < this.nVocab; id++) {
      if (!this.stops.has(id)) out.push(id);
    }
    return Int32Array.from(out);
  }

  private live(): Tiktoken {
    if (this.closed) throw new Error("the tokenizer is closed");
    return this.encoding;
  }

  /**
   * Token ids of text; literal special-token strings become their special ids. Long texts have
   * their special strings split off first, then each plain segment is pre-split (spec §8 order),
   * so huge inputs tokenize exactly as the official tokenizer does.
   */
  encode(text: string): number[] {
    if (!longerThan(text, MAX_RUN_CHARS)) return Array.from(this.live().encode(text, "all"));
    const ids: number[] = [];
    for (const segment of text.split(this.specialRe)) {
      if (!segment) continue;
      const special = this.specialTokens.get(segment);
      if (special !== undefined) ids.push(special);
      else for (const id of this.encodeOrdinary(segment)) ids.push(id);
    }
    return ids;
  }

  /**
   * Token ids of a rendered chat template in which `marked` text (a user's or a request's, put in
   * by the render as markers) is only ever text: a special-token string typed in it (`<|im_end|>`,
   * `[EOS]`) is encoded as the characters it is, so no message, system prompt or tool result can
   * forge the template's turn markers; only the template's own text yields special ids. Around
   * the marked text the ids are those of encode(): the text between two special tokens is one run
   * of ordinary text whichever side of a marker its characters came from (as tiktoken encodes
   * the text between specials), so text without special strings tokenizes as before.
   * @param rendered the template's output, each marked text replaced by `marker(i)`
   * @param marker the marker of the i-th text; `markerRe` matches every marker, capturing i
   */
  encodeRendered(rendered: string, marked: readonly string[], markerRe: RegExp): number[] {
    const ids: number[] = [];
    let run = "";
    const flush = (): void => {
      if (run) for (const id of this.encodeOrdinary(run)) ids.push(id);
      run = "";
    };
    const template = (text: string): void => {
      for (const segment of text.split(this.specialRe)) {
        if (!segment) continue;
        const special = this.specialTokens.get(segment);
        if (special !== undefined) {
          flush();
          ids.push(special);
        } else {
          run += segment;
        }
      }
    };
    const re = new RegExp(markerRe.source, "g");
    let at = 0;
    const seen = new Set<number>();
    for (let m = re.exec(rendered); m !== null; m = re.exec(rendered)) {
      template(rendered.slice(at, m.index));
      const i = Number(m[1]);
      if (!(i >= 0 && i < marked.length) || seen.has(i)) throw new Error(`the chat template repeated or invented marked text ${m[0]}`);
      seen.add(i);
      run += marked[i]!;
      at = m.index + m[0].length;
    }
    template(rendered.slice(at));
    flush();
    return ids;
  }

  /** Token ids of text with special-token strings treated as plain text. */
  encodeOrdinary(text: string): number[] {
    const encoding = this.live();
    const ids: number[] = [];
    for (const piece of splitRuns(text)) {
      for (const id of encoding.encode_ordinary(piece)) ids.push(id);
    }
    return ids;
  }

  private isKnown(id: number): boolean {
    return this.specialIds.has(id) || (Number.isInteger(id) && id >= 0 && id < this.numBaseTokens);
  }

  /** The bytes of one token (a special's literal name in UTF-8). */
  tokenBytes(id: number): Uint8Array {
    const special = this.specialBytes.get(id);
    if (special) return special.slice();
    if (!this.isKnown(id)) throw new UserError(`token id ${id} is not in the vocabulary`);
    return this.live().decode_single_token_bytes(id);
  }

  /** The bytes of ids, concatenated. */
  decodeBytes(ids: Iterable<number>): Uint8Array {
    const list = Array.from(ids);
    for (const id of list) {
      if (!this.isKnown(id)) throw new UserError(`token id ${id} is not in the vocabulary`);
    }
    return this.live().decode(Uint32Array.from(list));
  }

  /** Text of ids; special ids as their literal names, invalid UTF-8 replaced by U+FFFD. */
  decode(ids: Iterable<number>): string {
    return new TextDecoder("utf-8", { ignoreBOM: true }).decode(this.decodeBytes(ids));
  }

  streamDecoder(): StreamDecoder {
    return new StreamDecoder(this);
  }

  /** Frees the vocabulary's WebAssembly memory; the tokenizer is unusable afterwards. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.encoding.free();
  }
}

/** Turns ids into text incrementally; holds back an incomplete UTF-8 sequence. */
export class StreamDecoder {
  private readonly utf8 = new TextDecoder("utf-8", { ignoreBOM: true });

  constructor(private readonly tokenizer: Tokenizer) {}

  push(id: number): string {
    return this.utf8.decode(this.tokenizer.tokenBytes(id), { stream: true });
  }

  /** Whatever is still held (an unfinished character becomes U+FFFD). */
  flush(): string {
    return this.utf8.decode();
  }
}
