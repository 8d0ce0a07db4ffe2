/**
 * py-json.ts — JSON with the semantics of Python's `json` module, where the packer's behaviour
 * (ported from the Python front end) depends on them, plus Python's repr() for error messages.
 *
 * Owns: a json.loads-compatible parser that remembers what JSON.parse forgets — whether a number
 * was written as an integer (`2048`) or a float (`2048.0`, `1e3`: Python's `isinstance(v, int)`
 * rejects those), the order of object keys (JSON.parse moves integer-like keys first), NaN and
 * Infinity literals (Python accepts them), a nesting limit (Python's RecursionError) — and
 * json.dumps-compatible output (ensure_ascii, separators, indent) for files whose bytes must
 * match the Python packer's; and a value spelt as JSON spells it (null, true, "text", 64.0) for
 * messages about a JSON file the user may edit (jsonRepr). Does not own: what the JSON means
 * (model-spec.ts, the packer).
 */

/** A JSON object as parsed here: a plain object (keys in file order via orderedKeys). */
export type JsonObject = { [key: string]: unknown };

/** Python's json.JSONDecodeError, with its message format ("Expecting value: line 1 column 2 (char 1)"). */
export class JsonSyntaxError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "JsonSyntaxError";
  }
}

/** Nesting depth at which Python's decoder hits its recursion limit (about 1000 frames). */
const MAX_DEPTH = 1000;

// Facts about parsed containers that JSON values cannot carry themselves.
const floatMembers = new WeakMap<object, Set<string>>();
const keyOrders = new WeakMap<object, string[]>();

export function isJsonObject(value: unknown): value is JsonObject {
  return typeof value === "object" && value !== null && !Array.isArray(value) && !ArrayBuffer.isView(value) && !(value instanceof Map);
}

/** Object keys in the order the text had them (insertion order for objects not parsed here). */
export function orderedKeys(obj: object): string[] {
  return keyOrders.get(obj) ?? Object.keys(obj);
}

/** The member was written as a float literal (has a fraction or exponent, or is NaN/Infinity). */
export function isFloatMember(container: object, key: string | number): boolean {
  return floatMembers.get(container)?.has(String(key)) ?? false;
}

/** Python's `isinstance(v, int) and not isinstance(v, bool)` for container[key]. */
export function isIntMember(container: object, key: string | number): boolean {
  const value = (container as Record<string, unknown>)[String(key)];
  return typeof value === "number" && Number.isInteger(value) && !isFloatMember(container, key);
}

/** Python's json.loads(text): throws JsonSyntaxError with Python's message format. */
export function loadsPy(text: string): unknown {
  const parser = new Parser(text);
  if (text.startsWith("\ufeff")) parser.fail("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0);
  parser.ws();
  const value = parser.value(0);
  parser.ws();
  if (parser.pos !== text.length) parser.fail("Extra data");
  return value;
}

/** UTF-8 bytes to text the way Python's bytes.decode("utf-8") does (strict; a BOM is kept). */
export function decodeUtf8Strict(bytes: Uint8Array): string {
  return new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(bytes);
}

class Parser {
  pos = 0;
  /** Set by value(): the number just parsed was a float literal. */
  lastWasFloat = false;

  constructor(readonly s: string) {}

  fail(message: string, at: number = this.pos): never {
    const before = this.s.slice(0, at);
    const line = (before.match(/\n/g)?.length ?? 0) + 1;
    const col = at - before.lastIndexOf("\n");
    throw new JsonSyntaxError(`${message}: line ${line} column ${col} (char ${at})`);
  }

  ws(): void {
    const s = this.s;
    let p = this.pos;
    for (;;) {
      const c = s.charCodeAt(p);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) p++;
      else break;
    }
    this.pos = p;
  }

  value(depth: number): unknown {
    this.lastWasFloat = false;
    const s = this.s;
    const c = s[this.pos];
    if (c === '"') return this.string();
    if (c === "{" || c === "[") {
      if (depth >= MAX_DEPTH) {
        throw new JsonSyntaxError(`maximum recursion depth exceeded while decoding a JSON ${c === "{" ? "object" : "array"} from a unicode string`);
      }
      return c === "{" ? this.object(depth + 1) : this.array(depth + 1);
    }
    for (const [word, val, isFloat] of LITERALS) {
      if (s.startsWith(word, this.pos)) {
        this.pos += word.length;
        this.lastWasFloat = isFloat;
        return val;
      }
    }
    NUMBER_RE.lastIndex = this.pos;
    const m = NUMBER_RE.exec(s);
    if (m) {
      this.pos += m[0].length;
      this.lastWasFloat = m[2] !== undefined || m[3] !== undefined;
      return Number(m[0]);
    }
    this.fail("Expecting value");
  }

  string(): string {
    const s = this.s;
    const start = this.pos;
    let p = start + 1;
    let out = "";
    for (;;) {
      let q = p;
      for (;;) {
        const c = s.charCodeAt(q);
        if (Number.isNaN(c) || c === 0x22 || c === 0x5c || c < 0x20) break;
        q++;
      }
      out += s.slice(p, q);
      if (q >= s.length) this.fail("Unterminated string starting at", start);
      const c = s.charCodeAt(q);
      if (c === 0x22) {
        this.pos = q + 1;
        return out;
      }
      if (c < 0x20) this.fail("Invalid control character at", q);
      // backslash escape
      const e = s[q + 1];
      if (e === undefined) this.fail("Unterminated string starting at", start);
      const simple = ESCAPES[e];
      if (simple !== undefined) {
        out += simple;
        p = q + 2;
      } else if (e === "u") {
        const hex = s.slice(q + 2, q + 6);
        if (!/^[0-9a-fA-F]{4}$/.test(hex)) this.fail("Invalid \\uXXXX escape", q + 1);
        out += String.fromCharCode(parseInt(hex, 16));
        p = q + 6;
      } else {
        this.fail("Invalid \\escape", q);
      }
    }
  }

  object(depth: number): JsonObject {
    const s = this.s;
    const obj: JsonObject = {};
    const order: string[] = [];
    const floats = new Set<string>();
    this.pos++;
    this.ws();
    if (s[this.pos] === "}") {
      this.pos++;
      return obj;
    }
    for (;;) {
      if (s[this.pos] !== '"') this.fail("Expecting property name enclosed in double quotes");
      const key = this.string();
      this.ws();
      if (s[this.pos] !== ":") this.fail("Expecting ':' delimiter");
      this.pos++;
      this.ws();
      const value = this.value(depth);
      if (!Object.prototype.hasOwnProperty.call(obj, key)) order.push(key);
      if (key === "__proto__") Object.defineProperty(obj, key, { value, enumerable: true, writable: true, configurable: true });
      else obj[key] = value;
      if (typeof value === "number" && this.lastWasFloat) floats.add(key);
      else floats.delete(key);
      this.ws();
      const c = s[this.pos];
      this.pos++;
      if (c === "}") break;
      if (c !== ",") this.fail("Expecting ',' delimiter", this.pos - 1);
      this.ws();
    }
    keyOrders.set(obj, order);
    if (floats.size > 0) floatMembers.set(obj, floats);
    this.lastWasFloat = false;
    return obj;
  }

  array(depth: number): unknown[] {
    const s = this.s;
    const arr: unknown[] = [];
    const floats = new Set<string>();
    this.pos++;
    this.ws();
    if (s[this.pos] === "]") {
      this.pos++;
      return arr;
    }
    for (;;) {
      const value = this.value(depth);
      if (typeof value === "number" && this.lastWasFloat) floats.add(String(arr.length));
      arr.push(value);
      this.ws();
      const c = s[this.pos];
      this.pos++;
      if (c === "]") break;
      if (c !== ",") this.fail("Expecting ',' delimiter", this.pos - 1);
      this.ws();
    }
    if (floats.size > 0) floatMembers.set(arr, floats);
    this.lastWasFloat = false;
    return arr;
  }
}

const LITERALS: ReadonlyArray<readonly [string, unknown, boolean]> = [
  ["null", null, false], ["true", true, false], ["false", false, false],
  ["NaN", NaN, true], ["Infinity", Infinity, true], ["-Infinity", -Infinity, true],
];
/** Python's json NUMBER_RE; sticky, so it matches at lastIndex without slicing the text. */
const NUMBER_RE = /(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?/y;
const ESCAPES: Readonly<Record<string, string>> = {
  '"': '"', "\\": "\\", "/": "/", b: "\b", f: "\f", n: "\n", r: "\r", t: "\t",
};

// ---------------------------------------------------------------------------------------------
// Python repr() and str() of JSON values, for error messages that quote them as Python did.

/** Python's repr() of a float. */
export function pyFloatRepr(value: number): string {
  if (Number.isNaN(value)) return "nan";
  if (!Number.isFinite(value)) return value > 0 ? "inf" : "-inf";
  if (value === 0) return Object.is(value, -0) ? "-0.0" : "0.0";
  const [mantissa, expText] = value.toExponential().split("e") as [string, string];
  const exp = Number(expText);
  const negative = mantissa.startsWith("-");
  const digits = mantissa.replace("-", "").replace(".", "");
  let text: string;
  if (exp < -4 || exp >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    text = `${m}e${exp < 0 ? "-" : "+"}${String(Math.abs(exp)).padStart(2, "0")}`;
  } else if (exp < 0) {
    text = `0.${"0".repeat(-exp - 1)}${digits}`;
  } else if (digits.length <= exp + 1) {
    text = `${digits}${"0".repeat(exp + 1 - digits.length)}.0`;
  } else {
    text = `${digits.slice(0, exp + 1)}.${digits.slice(exp + 1)}`;
  }
  return negative ? `-${text}` : text;
}

function intText(value: number): string {
  return Math.abs(value) < 1e21 ? String(value) : BigInt(value).toString();
}

function quoteRepr(text: string, isBytes: boolean): string {
  const quote = text.includes("'") && !text.includes('"') ? '"' : "'";
  let out = "";
  for (const ch of text) {
    const c = ch.codePointAt(0)!;
    if (ch === quote || ch === "\\") out += `\\${ch}`;
    else if (ch === "\n") out += "\\n";
    else if (ch === "\r") out += "\\r";
    else if (ch === "\t") out += "\\t";
    else if (c < 0x20 || c === 0x7f || (c >= 0x80 && (isBytes || c < 0xa0))) out += `\\x${c.toString(16).padStart(2, "0")}`;
    else out += ch;
  }
  return `${isBytes ? "b" : ""}${quote}${out}${quote}`;
}

/** Python's repr() of bytes (b'KVLIDX01'). */
export function pyBytesRepr(bytes: Uint8Array): string {
  return quoteRepr(String.fromCharCode(...bytes), true);
}

/** Python's repr() of a parsed JSON value (`floatHint`: a number that was written as a float). */
export function pyRepr(value: unknown, floatHint = false): string {
  if (value === null || value === undefined) return "None";
  if (typeof value === "boolean") return value ? "True" : "False";
  if (typeof value === "number") return floatHint || !Number.isInteger(value) ? pyFloatRepr(value) : intText(value);
  if (typeof value === "string") return quoteRepr(value, false);
  if (value instanceof Uint8Array) return pyBytesRepr(value);
  if (Array.isArray(value)) return `[${value.map((v, i) => pyRepr(v, isFloatMember(value, i))).join(", ")}]`;
  if (typeof value === "object") {
    const obj = value as JsonObject;
    return `{${orderedKeys(obj).map((k) => `${pyRepr(k)}: ${pyRepr(obj[k], isFloatMember(obj, k))}`).join(", ")}}`;
  }
  return String(value);
}

/**
 * A parsed JSON value as the file spells it, for a message to someone who edits the file: null,
 * true / false, "text", 64.0 for a number written as a float (`floatHint`), NaN / Infinity,
 * [1, 2], {"a": 1} (keys in file order).
 */
export function jsonRepr(value: unknown, floatHint = false): string {
  if (value === null || value === undefined) return "null";
  if (typeof value === "boolean") return value ? "true" : "false";
  if (typeof value === "number") {
    if (Number.isNaN(value)) return "NaN";
    if (!Number.isFinite(value)) return value > 0 ? "Infinity" : "-Infinity";
    return floatHint || !Number.isInteger(value) ? pyFloatRepr(value) : intText(value);
  }
  if (typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) return `[${value.map((v, i) => jsonRepr(v, isFloatMember(value, i))).join(", ")}]`;
  if (typeof value === "object") {
    const obj = value as JsonObject;
    return `{${orderedKeys(obj).map((k) => `${JSON.stringify(k)}: ${jsonRepr(obj[k], isFloatMember(obj, k))}`).join(", ")}}`;
  }
  return String(value);
}

/** jsonRepr of container[key] (knows whether a number was written as a float). */
export function jsonReprMember(container: object, key: string | number): string {
  return jsonRepr((container as Record<string, unknown>)[String(key)], isFloatMember(container, key));
}

/** Python's repr() of container[key] (knows whether a number was written as a float). */
export function pyReprMember(container: object, key: string | number): string {
  return pyRepr((container as Record<string, unknown>)[String(key)], isFloatMember(container, key));
}

/** Python's truth value (empty containers and 0 are false, NaN is true). */
export function pyTruthy(value: unknown): boolean {
  if (value === null || value === undefined || value === false) return false;
  if (typeof value === "number") return value !== 0;
  if (typeof value === "string" || Array.isArray(value)) return value.length > 0;
  if (typeof value === "object") return Object.keys(value).length > 0;
  return true;
}

/** Python's `a == n` for a number n (True == 1 and 1.0 == 1 in Python). */
export function pyEqualsNumber(value: unknown, n: number): boolean {
  if (typeof value === "boolean") return (value ? 1 : 0) === n;
  return typeof value === "number" && value === n;
}

// ---------------------------------------------------------------------------------------------
// json.dumps

/**
 * A number to be written as a Python float (`800000.0`, `1e-05`): a JS number does not say
 * whether it was a float, and the synthesized config files must be the official bytes.
 */
export class PyFloat {
  constructor(readonly value: number) {}
}

export interface DumpsOptions {
  /** json.dumps(indent=...); absent: one line. */
  indent?: number;
  /** json.dumps(separators=...); the default is Python's for the indent. */
  separators?: readonly [string, string];
  /** json.dumps(ensure_ascii=...), default true: every non-ASCII character as \uXXXX. */
  ensureAscii?: boolean;
}

/**
 * Python's json.dumps(value, ...). Dicts are Maps or plain objects (keys in orderedKeys order);
 * a number is written as an integer when it is one, unless wrapped in PyFloat.
 */
export function dumpsPy(value: unknown, options: DumpsOptions = {}): string {
  const indent = options.indent;
  const [itemSep, keySep] = options.separators ?? (indent === undefined ? [", ", ": "] : [",", ": "]);
  const ensureAscii = options.ensureAscii ?? true;
  const str = (text: string): string => {
    const json = JSON.stringify(text);
    return ensureAscii ? json.replace(/[\u007f-\uffff]/g, (ch) => `\\u${ch.charCodeAt(0).toString(16).padStart(4, "0")}`) : json;
  };
  const walk = (v: unknown, level: number): string => {
    if (v === null || v === undefined) return "null";
    if (typeof v === "boolean") return v ? "true" : "false";
    if (typeof v === "number") {
      if (Number.isNaN(v)) return "NaN";
      if (!Number.isFinite(v)) return v > 0 ? "Infinity" : "-Infinity";
      return Number.isInteger(v) && !Object.is(v, -0) ? intText(v) : pyFloatRepr(v);
    }
    if (typeof v === "string") return str(v);
    if (v instanceof PyFloat) return Number.isFinite(v.value) ? pyFloatRepr(v.value) : walk(v.value, level);
    let entries: Array<[string | null, unknown]>;
    let open: string;
    let close: string;
    if (Array.isArray(v)) {
      entries = v.map((item) => [null, item]);
      [open, close] = ["[", "]"];
    } else if (v instanceof Map) {
      entries = [...(v as Map<string, unknown>).entries()];
      [open, close] = ["{", "}"];
    } else if (typeof v === "object") {
      const obj = v as JsonObject;
      entries = orderedKeys(obj).map((k) => [k, obj[k]]);
      [open, close] = ["{", "}"];
    } else {
      throw new TypeError(`Object of type ${typeof v} is not JSON serializable`);
    }
    if (entries.length === 0) return open + close;
    const inner = indent === undefined ? "" : `\n${" ".repeat(indent * (level + 1))}`;
    const outer = indent === undefined ? "" : `\n${" ".repeat(indent * level)}`;
    const parts = entries.map(([k, item]) => (k === null ? "" : str(k) + keySep) + walk(item, level + 1));
    return open + inner + parts.join(itemSep + inner) + outer + close;
  };
  return walk(value, 0);
}

/** A JSON file as the official scripts write it: json.dumps(value, indent=2, ensure_ascii=False) + "\n". */
export function dumpsPyFile(value: unknown): string {
  return `${dumpsPy(value, { indent: 2, ensureAscii: false })}\n`;
}
