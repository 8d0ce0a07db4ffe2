/**
 * schema-check.ts — whether a JSON schema is one constrained decoding can enforce, checked before
 * a reply starts, with a reason a client can act on (the keyword and where it is).
 *
 * Owns: the keywords kvl enforces (what xgrammar's converter turns into grammar and was tried
 * here) and the annotations it accepts and ignores; refusing everything else by name, rather
 * than letting a keyword pass unenforced; local `$ref`s only (`#`, `#/$defs/…`,
 * `#/definitions/…`), each resolving, none in a cycle (a recursive schema would let a reply
 * nest without bound); the unsatisfiable cases a check can see (min above max, an empty enum, a
 * required property that additionalProperties: false forbids). SchemaError carries the path.
 * Does not own: compiling (grammar-spec.ts; xgrammar's own refusals surface there).
 */

export class SchemaError extends Error {
  /** @param path JSON-pointer-like place of the problem inside the schema ("" = its root) */
  constructor(message: string, readonly path: string) {
    super(message);
    this.name = "SchemaError";
  }
}

/** Keywords whose meaning the grammar enforces. */
const ENFORCED = new Set([
  "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "enum", "const",
  "anyOf", "oneOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "minimum", "maximum",
  "exclusiveMinimum", "exclusiveMaximum",
]);
/** Keywords that say nothing about valid values (documentation, identity). */
const ANNOTATIONS = new Set(["title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly", "strict"]);
const TYPES = new Set(["object", "array", "string", "number", "integer", "boolean", "null"]);
const MAX_DEPTH = 32;

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === "object" && v !== null && !Array.isArray(v);
const at = (path: string, key: string | number): string => `${path}/${String(key).replaceAll("~", "~0").replaceAll("/", "~1")}`;
const show = (path: string): string => (path === "" ? "the schema's root" : `'${path}'`);

function resolve(root: Obj, ref: string, path: string): { node: unknown; target: string } {
  if (ref === "#") return { node: root, target: "" };
  const m = /^#\/(\$defs|definitions)\/([^/]+)$/.exec(ref);
  if (!m) throw new SchemaError(`$ref '${ref}' at ${show(path)} is not supported: only local references (#, #/$defs/NAME, #/definitions/NAME)`, path);
  const defs = root[m[1]!];
  const name = m[2]!.replaceAll("~1", "/").replaceAll("~0", "~");
  if (!isObj(defs) || !Object.hasOwn(defs, name)) throw new SchemaError(`$ref '${ref}' at ${show(path)} names nothing in the schema`, path);
  return { node: defs[name], target: `/${m[1]}/${m[2]}` };
}

function checkBounds(node: Obj, path: string, low: string, high: string): void {
  const lo = node[low];
  const hi = node[high];
  for (const [k, v] of [[low, lo], [high, hi]] as const) {
    if (v !== undefined && (typeof v !== "number" || !Number.isFinite(v))) throw new SchemaError(`'${k}' at ${show(path)} must be a number`, at(path, k));
  }
  if (typeof lo === "number" && typeof hi === "number" && lo > hi) {
    throw new SchemaError(`'${low}' ${lo} is above '${high}' ${hi} at ${show(path)}: no value satisfies the schema`, at(path, low));
  }
}

function checkCount(node: Obj, path: string, key: string): void {
  const v = node[key];
  if (v !== undefined && !(Number.isSafeInteger(v) && (v as number) >= 0)) throw new SchemaError(`'${key}' at ${show(path)} must be an integer >= 0`, at(path, key));
}

/** Throws SchemaError for the first thing kvl cannot enforce or no value can satisfy. */
export function checkSchema(schema: unknown): void {
  if (!isObj(schema)) throw new SchemaError("a schema must be a JSON object", "");
  const root = schema;
  /** refs being followed (their targets), to find cycles */
  const following: string[] = [];

  const walk = (node: unknown, path: string, depth: number): void => {
    if (depth > MAX_DEPTH) throw new SchemaError(`the schema nests deeper than ${MAX_DEPTH} levels at ${show(path)}`, path);
    if (node === true) return;
    if (!isObj(node)) throw new SchemaError(`${show(path)} must be a schema (a JSON object), got ${node === false ? "false (nothing is valid)" : JSON.stringify(node)}`, path);
    for (const key of Object.keys(node)) {
      if (!ENFORCED.has(key) && !ANNOTATIONS.has(key)) {
        throw new SchemaError(`keyword '${key}' at ${show(path)} is not supported: constrained decoding cannot enforce it`, at(path, key));
      }
    }
    if (node.$ref !== undefined) {
      if (typeof node.$ref !== "string") throw new SchemaError(`$ref at ${show(path)} must be a string`, at(path, "$ref"));
      const { node: target, target: where } = resolve(root, node.$ref, at(path, "$ref"));
      if (following.includes(where)) throw new SchemaError(`$ref '${node.$ref}' at ${show(path)} is a cycle (a schema that contains itself)`, at(path, "$ref"));
      following.push(where);
      walk(target, where, depth + 1);
      following.pop();
    }
    const type = node.type;
    if (type !== undefined) {
      const types = Array.isArray(type) ? type : [type];
      if (types.length === 0 || types.some((t) => typeof t !== "string" || !TYPES.has(t))) {
        throw new SchemaError(`'type' at ${show(path)} must be one of ${[...TYPES].join(", ")} (or a list of them)`, at(path, "type"));
      }
    }
    if (node.enum !== undefined && (!Array.isArray(node.enum) || node.enum.length === 0)) {
      throw new SchemaError(`'enum' at ${show(path)} must be a non-empty array`, at(path, "enum"));
    }
    for (const k of ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]) {
      // xgrammar 0.1.27 writes decimal ranges as a grammar that lets values outside through
      // (tried: minimum 0.5 allowed "0x5", maximum 3 allowed 3.5); integer ranges are exact
      if (node[k] !== undefined && node.type !== "integer") {
        throw new SchemaError(`keyword '${k}' at ${show(path)} is supported on "type": "integer" only: decimal ranges cannot be enforced exactly`, at(path, k));
      }
    }
    checkBounds(node, path, "minimum", "maximum");
    checkBounds(node, path, "exclusiveMinimum", "exclusiveMaximum");
    for (const k of ["minLength", "maxLength", "minItems", "maxItems"]) checkCount(node, path, k);
    checkBounds(node, path, "minLength", "maxLength");
    checkBounds(node, path, "minItems", "maxItems");
    if (node.pattern !== undefined) {
      if (typeof node.pattern !== "string") throw new SchemaError(`'pattern' at ${show(path)} must be a string`, at(path, "pattern"));
      try {
        new RegExp(node.pattern, "u");
      } catch {
        throw new SchemaError(`'pattern' at ${show(path)} is not a valid regular expression`, at(path, "pattern"));
      }
    }
    const props = node.properties;
    if (props !== undefined) {
      if (!isObj(props)) throw new SchemaError(`'properties' at ${show(path)} must be an object`, at(path, "properties"));
      for (const [k, v] of Object.entries(props)) walk(v, at(at(path, "properties"), k), depth + 1);
    }
    if (node.required !== undefined) {
      if (!Array.isArray(node.required) || node.required.some((r) => typeof r !== "string")) {
        throw new SchemaError(`'required' at ${show(path)} must be an array of property names`, at(path, "required"));
      }
      if (node.additionalProperties === false) {
        const missing = (node.required as string[]).find((r) => !isObj(props) || !Object.hasOwn(props, r));
        if (missing !== undefined) {
          throw new SchemaError(`'required' at ${show(path)} names '${missing}', which additionalProperties: false forbids: no value satisfies the schema`, at(path, "required"));
        }
      }
    }
    if (node.additionalProperties !== undefined && typeof node.additionalProperties !== "boolean") walk(node.additionalProperties, at(path, "additionalProperties"), depth + 1);
    if (node.items !== undefined && typeof node.items !== "boolean") walk(node.items, at(path, "items"), depth + 1);
    for (const k of ["prefixItems", "anyOf", "oneOf"]) {
      const list = node[k];
      if (list === undefined) continue;
      if (!Array.isArray(list) || list.length === 0) throw new SchemaError(`'${k}' at ${show(path)} must be a non-empty array of schemas`, at(path, k));
      list.forEach((s, i) => walk(s, at(at(path, k), i), depth + 1));
    }
    for (const k of ["$defs", "definitions"]) {
      const defs = node[k];
      if (defs !== undefined && !isObj(defs)) throw new SchemaError(`'${k}' at ${show(path)} must be an object`, at(path, k));
    }
  };
  walk(root, "", 0);
  // definitions nobody references are still compiled by the converter: check them too
  for (const k of ["$defs", "definitions"] as const) {
    const defs = root[k];
    if (isObj(defs)) {
      for (const [name, s] of Object.entries(defs)) {
        following.push(`/${k}/${name}`);
        walk(s, `/${k}/${name}`, 1);
        following.pop();
      }
    }
  }
}
