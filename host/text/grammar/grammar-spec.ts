/**
 * grammar-spec.ts — what a reply is constrained to, as data that crosses from the main thread to
 * the engine worker, and how it becomes xgrammar's input on either side.
 *
 * Owns: GrammarSpec (a JSON schema, or text with tagged JSON parts such as tool calls), its cache
 * key, and the translation to xgrammar: every schema through xgrammar's converter in compact form
 * (no whitespace outside strings, "," and ":" alone as separators, strict: no properties or
 * items the schema does not name), so a weak model cannot spend its tokens inside the structure
 * and every reply is one line of JSON; string bodies are cut to what JSON allows (the converter's
 * bounded-length strings let raw control characters through, which JSON.parse refuses).
 * Does not own: checking schemas (schema-check.ts), masks (token-mask.ts), tool prompts
 * (host/text/tool-format.ts).
 */
import { checkSchema } from "./schema-check.js";
import { type XGrammar, guarded, xgrammar } from "./xgrammar.js";

export type GrammarSpec =
  /** The whole reply is one JSON value valid under `schema` (JSON text). */
  | { kind: "json_schema"; schema: string }
  /**
   * Free text until `trigger` appears; then one of `tags`: its `begin`, a JSON value valid under
   * its `schema`, its `end`, and the reply ends. `required`: the reply is one tag from its first
   * token.
   */
  | { kind: "tagged"; trigger: string; tags: Array<{ begin: string; schema: string; end: string }>; required: boolean };

/** Equal specs give equal keys (compiled grammars are cached by it). */
export function grammarKey(spec: GrammarSpec): string {
  return JSON.stringify(spec);
}

/** xgrammar's input for a spec: an EBNF grammar (root rule "root") or a structural tag. */
export type GrammarSource = { ebnf: string } | { structuralTag: Record<string, unknown> };

/**
 * The converter's string-body classes, and the same with raw control characters taken out: its
 * length-bounded strings let them through, and JSON.parse refuses them. (Byte sequences that are
 * not UTF-8, which xgrammar's classes also let through, are token-mask.ts's utf8 mask's job.)
 */
const STRING_CLASSES: ReadonlyArray<[string, string]> = [[String.raw`[^"\\\r\n]`, String.raw`[^"\\\0-\x1f]`]];

async function schemaEbnf(xg: XGrammar, schema: string): Promise<string> {
  let ebnf = await guarded(() => xg.Testings._jsonSchemaToEBNF(schema, false, -1, [",", ":"], true));
  for (const [loose, strict] of STRING_CLASSES) ebnf = ebnf.replaceAll(loose, strict);
  return ebnf;
}

export async function grammarSource(xg: XGrammar, spec: GrammarSpec): Promise<GrammarSource> {
  if (spec.kind === "json_schema") return { ebnf: await schemaEbnf(xg, spec.schema) };
  const tags = [];
  for (const tag of spec.tags) {
    tags.push({ type: "tag", begin: tag.begin, content: { type: "grammar", grammar: await schemaEbnf(xg, tag.schema) }, end: tag.end });
  }
  return {
    structuralTag: {
      type: "structural_tag",
      format: { type: "triggered_tags", triggers: [spec.trigger], tags, at_least_one: spec.required, stop_after_first: true },
    },
  };
}

/** Keys of specs that built, most recent last (a client resends the same schema). */
const checked = new Set<string>();
const CHECKED_KEPT = 256;

/**
 * Builds the grammar without a vocabulary (cheap: no token tables), so a spec xgrammar refuses
 * is found on the main thread before a reply starts; GrammarEngineError names xgrammar's reason.
 */
export async function checkGrammar(spec: GrammarSpec): Promise<void> {
  const key = grammarKey(spec);
  if (checked.has(key)) return;
  const xg = await xgrammar();
  const source = await grammarSource(xg, spec);
  const grammar = await guarded(() => ("ebnf" in source ? xg.Grammar.fromEBNF(source.ebnf, "root") : xg.Grammar.fromStructuralTag(source.structuralTag)));
  grammar.dispose();
  checked.add(key);
  if (checked.size > CHECKED_KEPT) checked.delete(checked.values().next().value!);
}

/** Any JSON object (OpenAI's json_object, Ollama's "json"): additionalProperties spelled out,
 * since the compact converter is strict and would otherwise allow only {}. */
export const ANY_OBJECT_SCHEMA: Readonly<Record<string, unknown>> = Object.freeze({ type: "object", additionalProperties: true });

/** A reply that is one JSON value under `schema`; SchemaError when kvl cannot enforce it. */
export function jsonSchemaGrammar(schema: unknown): GrammarSpec {
  checkSchema(schema);
  return { kind: "json_schema", schema: JSON.stringify(schema) };
}
