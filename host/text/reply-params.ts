/**
 * reply-params.ts — what a caller may ask of one reply (sampling, length, stop strings), with
 * the checks every front end (CLI, HTTP APIs) applies before anything runs.
 *
 * Owns: ReplyParams, their defaults, validation into UserErrors, and the sampler seed (given, or
 * 64 random bits).
 */
import { randomBytes } from "node:crypto";

import type { GrammarSpec } from "./grammar/grammar-spec.js";
import { UserError } from "../system/user-error.js";

/** The model card's recommendation for the Instruct model. */
export const DEFAULT_TEMPERATURE = 0.2;
export const DEFAULT_MAX_NEW_TOKENS = 512;

export interface ReplyParams {
  /** 0 = greedy. */
  temperature: number;
  /** 0 or 1 = off. */
  topP: number;
  /** 0 = off. */
  topK: number;
  /** null = a fresh random seed per reply. */
  seed: number | bigint | null;
  maxNewTokens: number;
  /** Strings that end the reply; never emitted. */
  stop: string[];
  /** What the reply must be (a JSON schema, tool calls); null = free text. */
  grammar: GrammarSpec | null;
}

export function defaultReplyParams(): ReplyParams {
  return { temperature: DEFAULT_TEMPERATURE, topP: 1, topK: 0, seed: null, maxNewTokens: DEFAULT_MAX_NEW_TOKENS, stop: [], grammar: null };
}

/** Throws a UserError naming the first bad field. */
export function validateReplyParams(p: ReplyParams): void {
  const finite = (name: string, v: number): void => {
    if (typeof v !== "number" || !Number.isFinite(v)) throw new UserError(`${name} must be a finite number (got ${String(v)})`);
  };
  finite("temperature", p.temperature);
  if (p.temperature < 0) throw new UserError(`temperature must be >= 0 (got ${p.temperature})`);
  finite("top_p", p.topP);
  if (p.topP < 0 || p.topP > 1) throw new UserError(`top_p must be in [0, 1] (0 or 1 = off) (got ${p.topP})`);
  if (!Number.isSafeInteger(p.topK) || p.topK < 0) throw new UserError(`top_k must be an integer >= 0 (got ${p.topK})`);
  if (!Number.isSafeInteger(p.maxNewTokens) || p.maxNewTokens < 1) {
    throw new UserError(`max_new_tokens must be an integer >= 1 (got ${p.maxNewTokens})`);
  }
  if (p.seed !== null && !(typeof p.seed === "bigint" ? p.seed >= 0n : Number.isSafeInteger(p.seed) && p.seed >= 0)) {
    throw new UserError(`seed must be a non-negative integer (got ${String(p.seed)})`);
  }
  if (p.stop.some((s) => typeof s !== "string" || s.length === 0)) throw new UserError("stop strings must be non-empty strings");
  // a stop string could cut the JSON a schema guarantees, and the reply would claim to be
  // complete (a call cut short is simply not a call: tool-format.ts reports complete ones only)
  if (p.stop.length > 0 && p.grammar?.kind === "json_schema") throw new UserError("stop strings cannot be combined with a JSON schema or JSON output");
}

/** The sampler's 64-bit seed: the given one (mod 2^64), else 64 random bits. */
export function seedOrRandom(seed: number | bigint | null): bigint {
  if (seed === null) return randomBytes(8).readBigUInt64LE();
  return BigInt.asUintN(64, BigInt(seed));
}
