/**
 * json-file.ts — the text files of packs and checkpoints (docs/FORMAT.md "JSON files"): decoded
 * as strict UTF-8 and parsed with the platform's JSON.parse.
 *
 * Owns: strict UTF-8 decoding (a byte sequence that is not UTF-8 is an error, not U+FFFD; a BOM
 * is kept, so JSON.parse refuses it), parsing with a one-line reason for text that is not JSON
 * (V8's message with the text's line breaks escaped and, where V8 gives a position, its line and
 * column), the JSON-object test, and a value as JSON spells it, for messages. Does not own what a
 * file holds: the module that owns each file validates its fields with one-line UserErrors that
 * name the file and the field.
 */

/** A parsed JSON object. */
export type JsonObject = { [key: string]: unknown };

/** Bytes that are not UTF-8, or text that is not JSON; the message is one line: why. */
export class JsonTextError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "JsonTextError";
  }
}

export function isJsonObject(value: unknown): value is JsonObject {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

const strictUtf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/** UTF-8 bytes as text; throws TypeError where they are not UTF-8. */
export function decodeUtf8Strict(bytes: Uint8Array): string {
  return strictUtf8.decode(bytes);
}

/** JSON.parse of the text (or of UTF-8 bytes); throws JsonTextError saying in one line why not. */
export function parseJson(data: string | Uint8Array): unknown {
  let text: string;
  if (typeof data === "string") {
    text = data;
  } else {
    try {
      text = decodeUtf8Strict(data);
    } catch {
      throw new JsonTextError("not UTF-8 text");
    }
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new JsonTextError(syntaxReason(text, (err as Error).message));
  }
}

/** V8's JSON.parse message on one line, with the line and column of its position (Node 22
 * adds them itself; Node 20 gives only the offset). */
function syntaxReason(text: string, message: string): string {
  let reason = message.replace(/\r/g, "\\r").replace(/\n/g, "\\n");
  const at = /at position (\d+)$/.exec(reason);
  if (at) {
    const before = text.slice(0, Number(at[1]));
    const line = before.split("\n").length;
    reason += ` (line ${line} column ${before.length - before.lastIndexOf("\n")})`;
  }
  return reason;
}

/** A parsed JSON value in a message, as JSON spells it ("text", 64, [2, 2] as [2,2], null). */
export function jsonText(value: unknown): string {
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return "(a value nested too deeply to show)";
  }
}
