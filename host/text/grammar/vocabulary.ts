/**
 * vocabulary.ts — the model's vocabulary as xgrammar reads it: every id's bytes, written the
 * byte-level way (GPT-2's byte-to-unicode table, vocab type "byte_level"), since tiktoken tokens
 * are bytes that need not be whole UTF-8 characters.
 *
 * Owns: the byte-to-unicode table and the encoded vocabulary of a pack: base ids from
 * tiktoken.model by rank; every other id (the special range, padding up to the logits' size) the
 * empty string, which xgrammar treats as a special token its masks never allow, so only the stop
 * ids it is given can end a constrained reply.
 * Does not own: tokenizing (tokenizer.ts), masks (token-mask.ts).
 */
import { join } from "node:path";

import { readTiktokenModel } from "../tokenizer.js";

/** GPT-2's printable stand-in for each byte (bytes_to_unicode). */
function byteToUnicode(): string[] {
  const printable: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) printable.push(b);
  for (let b = 0xa1; b <= 0xac; b++) printable.push(b);
  for (let b = 0xae; b <= 0xff; b++) printable.push(b);
  const table = new Array<string>(256);
  for (const b of printable) table[b] = String.fromCodePoint(b);
  let extra = 0;
  for (let b = 0; b < 256; b++) if (table[b] === undefined) table[b] = String.fromCodePoint(256 + extra++);
  return table;
}

const BYTE_CHARS = byteToUnicode();

/** One token's bytes in byte-level form. */
export function byteLevel(bytes: Uint8Array): string {
  let out = "";
  for (const b of bytes) out += BYTE_CHARS[b];
  return out;
}

const EMPTY = new Uint8Array(0);

/** Every id's bytes, `vocabSize` ids (the logits' length), from a pack's tiktoken.model; empty
 * for the special range and padding. */
export function vocabularyBytes(modelDir: string, vocabSize: number): Uint8Array[] {
  const ranks = readTiktokenModel(join(modelDir, "tiktoken.model"));
  const out = new Array<Uint8Array>(vocabSize).fill(EMPTY);
  const n = Math.min(ranks.length, vocabSize);
  for (let id = 0; id < n; id++) out[id] = Buffer.from(ranks[id]!, "base64");
  return out;
}

/** The vocabulary as xgrammar's byte_level type reads it. */
export function byteLevelVocabulary(tokens: readonly Uint8Array[]): string[] {
  return tokens.map(byteLevel);
}
