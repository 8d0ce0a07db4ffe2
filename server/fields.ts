/**
 * fields.ts — typed checks of JSON request fields, shared by the API translators (openai.ts,
 * anthropic.ts, ollama.ts).
 *
 * Owns: "is this field what it must be" for parsed JSON — objects, strings, booleans, finite
 * numbers in a range, integers in a range, max_tokens against the context, stop lists — each
 * failure a 400 (ApiError) naming the field and what it got. A JSON `true` never passes as a
 * number; NaN and ±Infinity (JSON.parse gives Infinity for 1e999) never pass as numbers.
 * Does not own: the shapes of any one API, images (images.ts).
 */
import { invalid } from "./errors.js";

export type JsonObject = Record<string, unknown>;

export function jsonType(value: unknown): string {
  if (value === null || value === undefined) return "null";
  if (Array.isArray(value)) return "array";
  switch (typeof value) {
    case "boolean":
      return "boolean";
    case "number":
      return Number.isFinite(value) ? "number" : `${value} (not a finite number)`;
    case "string":
      return "string";
    case "object":
      return "object";
    default:
      return typeof value;
  }
}

export function isObject(value: unknown): value is JsonObject {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

export function requireObject(value: unknown, where: string): JsonObject {
  if (!isObject(value)) throw invalid(`${where} must be a JSON object, got ${jsonType(value)}`, where);
  return value;
}

/** A present field's value; null and absent are the same (undefined). */
function field(obj: JsonObject, key: string): unknown {
  return Object.hasOwn(obj, key) ? obj[key] : undefined;
}

export function getStr(obj: JsonObject, key: string, where: string, options: { required?: boolean; allowEmpty?: boolean } = {}): string | null {
  const value = field(obj, key);
  if (value === undefined || value === null) {
    if (options.required) throw invalid(`'${where}' is required`, where);
    return null;
  }
  if (typeof value !== "string") throw invalid(`'${where}' must be a string, got ${jsonType(value)}`, where);
  if (options.allowEmpty === false && value.length === 0) throw invalid(`'${where}' must not be empty`, where);
  return value;
}

export function getBool(obj: JsonObject, key: string, where: string, fallback = false): boolean {
  const value = field(obj, key);
  if (value === undefined || value === null) return fallback;
  if (typeof value !== "boolean") throw invalid(`'${where}' must be true or false, got ${jsonType(value)}`, where);
  return value;
}

function show(n: number): string {
  return String(n);
}

/** A finite number in [low, high] (or (low, high] when lowInclusive is false), or null when absent. */
export function getNumber(obj: JsonObject, key: string, where: string, low: number, high: number, lowInclusive = true): number | null {
  const value = field(obj, key);
  if (value === undefined || value === null) return null;
  if (typeof value !== "number") throw invalid(`'${where}' must be a number, got ${jsonType(value)}`, where);
  if (!Number.isFinite(value)) throw invalid(`'${where}' must be a finite number, got ${value}`, where);
  const tooLow = lowInclusive ? value < low : value <= low;
  if (tooLow || value > high) throw invalid(`'${where}' must be in ${lowInclusive ? "[" : "("}${show(low)}, ${show(high)}], got ${value}`, where);
  return value;
}

/** An integer in [low, high], or null when absent. */
export function getInt(obj: JsonObject, key: string, where: string, low: number, high: number, hint = ""): number | null {
  const value = field(obj, key);
  if (value === undefined || value === null) return null;
  if (typeof value !== "number" || !Number.isInteger(value)) {
    const got = typeof value === "number" && Number.isFinite(value) ? String(value) : jsonType(value);
    throw invalid(`'${where}' must be an integer, got ${got}`, where);
  }
  if (value < low || value > high) throw invalid(`'${where}' must be between ${low} and ${high}, got ${value}${hint}`, where);
  return value;
}

export function maxTokensValue(obj: JsonObject, key: string, maxContext: number): number | null {
  return getInt(obj, key, key, 1, maxContext,
    ` (the server's context is ${maxContext} tokens; start it with a larger --max-context for longer replies)`);
}

/** A stop string or a list of them. */
export function stopList(value: unknown, where: string, allowString = true): string[] {
  if (value === undefined || value === null) return [];
  const items = typeof value === "string" && allowString ? [value] : value;
  if (!Array.isArray(items)) {
    throw invalid(`'${where}' must be ${allowString ? "a string or " : ""}an array of strings, got ${jsonType(value)}`, where);
  }
  items.forEach((item, n) => {
    if (typeof item !== "string" || item.length === 0) throw invalid(`'${where}[${n}]' must be a non-empty string`, where);
  });
  return [...(items as string[])];
}

/** A seed as the sampler takes it: any JSON integer, reduced mod 2^64 (negative seeds as OpenAI
 * allows them wrap around), or null when absent. */
export function getSeed(obj: JsonObject, key: string, where: string): bigint | null {
  const value = getInt(obj, key, where, -(2 ** 63), 2 ** 64 - 1);
  return value === null ? null : BigInt.asUintN(64, BigInt(value));
}
