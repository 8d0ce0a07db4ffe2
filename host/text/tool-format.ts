/**
 * tool-format.ts — kvl's tool-calling format for Kimi-VL, whose chat template has none: how
 * declared tools, the model's calls and the tools' results are written into the conversation,
 * the grammar that makes every call well formed, and how a call is read back out of a reply.
 * The OpenAI, Anthropic and Ollama APIs (server/) and nothing else speak it; docs/SERVER.md
 * "Tool calls" describes it for people.
 *
 * Owns: the system text describing the tools (appended to the conversation's system message),
 * a call as text (`<tool_call>{"name":"NAME","arguments":{…}}</tool_call>`, compact JSON, the
 * same bytes the model is constrained to write, so a resent history reuses the KV), a result as
 * text (`<tool_result id="…" name="…">` … `</tool_result>`, in a `tool` turn), tool checks
 * (names, clashes, schemas), the tool grammar per tool choice (auto: free text or one call;
 * required: one call of any tool; named: one call of that tool; none: no grammar), and
 * ToolCallParser, which splits a streamed reply into text and the call, piece by piece.
 * Does not own: the API shapes (server/openai.ts, anthropic.ts, ollama.ts), constrained decoding
 * (grammar/).
 */
import type { GrammarSpec } from "./grammar/grammar-spec.js";
import { SchemaError, checkSchema } from "./grammar/schema-check.js";
import { UserError } from "../system/user-error.js";

export const TOOL_CALL_OPEN = "<tool_call>";
export const TOOL_CALL_CLOSE = "</tool_call>";
const CALL_HEAD = '{"name":';
const ARGS_KEY = ',"arguments":';
/** Tool names as OpenAI and Anthropic allow them; no quoting is ever needed inside the format. */
const NAME_RE = /^[A-Za-z0-9_-]{1,64}$/;

export interface ToolDef {
  name: string;
  description: string;
  /** A JSON schema of the arguments object. */
  parameters: Record<string, unknown>;
}

export type ToolChoice = { kind: "auto" } | { kind: "none" } | { kind: "required" } | { kind: "named"; name: string };

/** A tool problem found in a request: the message and the request field (`tools[1].function.name`). */
export class ToolError extends UserError {
  constructor(message: string, readonly param: string) {
    super(message);
    this.name = "ToolError";
  }
}

/**
 * Checks declared tools: names as the APIs allow them, each once, each schema one that
 * constrained decoding enforces (an object schema; a missing `type` means object). `where(i)`
 * names tool i's field in the API's terms; `schemaField` the schema's key there.
 */
export function checkTools(tools: readonly ToolDef[], where: (i: number) => string, schemaField: string): void {
  const seen = new Map<string, number>();
  tools.forEach((tool, i) => {
    if (!NAME_RE.test(tool.name)) {
      throw new ToolError(`${where(i)}.name ${JSON.stringify(tool.name)} must be 1 to 64 letters, digits, '_' or '-'`, `${where(i)}.name`);
    }
    const first = seen.get(tool.name);
    if (first !== undefined) throw new ToolError(`tool name '${tool.name}' is declared twice (${where(first)} and ${where(i)})`, `${where(i)}.name`);
    seen.set(tool.name, i);
    const type = tool.parameters.type;
    if (type !== undefined && type !== "object") {
      throw new ToolError(`${where(i)}.${schemaField} must describe an object (type "object"), got type ${JSON.stringify(type)}`, `${where(i)}.${schemaField}`);
    }
    try {
      checkSchema(tool.parameters);
    } catch (err) {
      if (err instanceof SchemaError) throw new ToolError(`${where(i)}.${schemaField}: ${err.message}`, `${where(i)}.${schemaField}${err.path}`);
      throw err;
    }
  });
}

/** A choice naming a tool must name a declared one. */
export function checkChoice(tools: readonly ToolDef[], choice: ToolChoice, param: string): void {
  if (choice.kind === "named" && !tools.some((t) => t.name === choice.name)) {
    throw new ToolError(`${param} names tool '${choice.name}', which is not among the declared tools (${tools.map((t) => t.name).join(", ") || "none"})`, param);
  }
  if ((choice.kind === "required" || choice.kind === "named") && tools.length === 0) {
    throw new ToolError(`${param} asks for a tool call but no tools are declared`, param);
  }
}

function objectSchema(tool: ToolDef): Record<string, unknown> {
  return tool.parameters.type === undefined ? { type: "object", ...tool.parameters } : tool.parameters;
}

/** The system text that tells the model its tools (appended to the system message). */
export function toolsPrompt(tools: readonly ToolDef[], choice: ToolChoice): string {
  const lines = [
    "# Tools",
    "",
    "You can call the tools below. To call one, reply with exactly",
    `${TOOL_CALL_OPEN}{"name":"TOOL_NAME","arguments":{...}}${TOOL_CALL_CLOSE}`,
    "where the arguments are a JSON object that follows the tool's schema. A tool's result comes back",
    "in a tool message that starts with <tool_result.",
  ];
  if (choice.kind === "required") lines.push("", "Call one of the tools now.");
  if (choice.kind === "named") lines.push("", `Call the tool ${choice.name} now.`);
  if (choice.kind === "none") lines.push("", "Do not call a tool now; answer in text.");
  for (const tool of tools) {
    lines.push("", `## ${tool.name}`);
    if (tool.description) lines.push(tool.description);
    lines.push(`Arguments schema: ${JSON.stringify(objectSchema(tool))}`);
  }
  return lines.join("\n");
}

/** Arguments in the format's compact JSON (what the grammar makes the model write). */
export function compactArguments(args: unknown): string {
  return JSON.stringify(args ?? {});
}

/** A call as the model writes it. */
export function toolCallText(name: string, args: unknown): string {
  return `${TOOL_CALL_OPEN}${CALL_HEAD}${JSON.stringify(name)}${ARGS_KEY}${compactArguments(args)}}${TOOL_CALL_CLOSE}`;
}

const attr = (v: string): string => v.replaceAll("&", "&amp;").replaceAll('"', "&quot;").replaceAll("<", "&lt;");

/** The opening and closing lines around a tool's result (its text, or text and images, between). */
export function toolResultOpen(id: string | null, name: string | null, isError = false): string {
  return `<tool_result${id ? ` id="${attr(id)}"` : ""}${name ? ` name="${attr(name)}"` : ""}${isError ? ' error="true"' : ""}>\n`;
}
export const TOOL_RESULT_CLOSE = "\n</tool_result>";

/** The grammar a tool choice puts on the reply, or null (free text). */
export function toolGrammar(tools: readonly ToolDef[], choice: ToolChoice): GrammarSpec | null {
  if (tools.length === 0 || choice.kind === "none") return null;
  const chosen = choice.kind === "named" ? tools.filter((t) => t.name === choice.name) : tools;
  return {
    kind: "tagged", trigger: TOOL_CALL_OPEN, required: choice.kind !== "auto",
    tags: chosen.map((t) => ({ begin: `${TOOL_CALL_OPEN}${CALL_HEAD}${JSON.stringify(t.name)}${ARGS_KEY}`, schema: JSON.stringify(objectSchema(t)), end: `}${TOOL_CALL_CLOSE}` })),
  };
}

/** What ToolCallParser reports, in order. */
export type ToolEvent =
  | { type: "text"; text: string }
  | { type: "call"; name: string }
  | { type: "arguments"; text: string }
  | { type: "end" };

/**
 * Splits a reply (streamed in pieces) into text and at most one call: text is passed on at once
 * except for an ending that could be the start of `<tool_call>`; a call's name is known once its
 * head is complete, its arguments pass on as they come, and the call ends where its JSON object
 * closes (found by counting braces outside strings; the grammar made the JSON valid).
 */
export class ToolCallParser {
  #state: "text" | "head" | "arguments" | "tail" | "after" = "text";
  #pending = "";
  #depth = 0;
  #inString = false;
  #escaped = false;
  name: string | null = null;
  arguments = "";
  text = "";

  /** A call began and its arguments object closed. */
  get complete(): boolean {
    return this.#state === "tail" || this.#state === "after";
  }

  /** A call began. */
  get called(): boolean {
    return this.#state !== "text";
  }

  push(piece: string): ToolEvent[] {
    const events: ToolEvent[] = [];
    let s = this.#pending + piece;
    this.#pending = "";
    while (s.length > 0) {
      if (this.#state === "text") {
        const at = s.indexOf(TOOL_CALL_OPEN);
        if (at >= 0) {
          this.#emitText(events, s.slice(0, at));
          s = s.slice(at + TOOL_CALL_OPEN.length);
          this.#state = "head";
          continue;
        }
        // hold back an ending that may grow into <tool_call>
        let keep = 0;
        for (let k = Math.min(TOOL_CALL_OPEN.length - 1, s.length); k > 0; k--) {
          if (TOOL_CALL_OPEN.startsWith(s.slice(s.length - k))) {
            keep = k;
            break;
          }
        }
        this.#emitText(events, s.slice(0, s.length - keep));
        this.#pending = s.slice(s.length - keep);
        return events;
      }
      if (this.#state === "head") {
        const head = s;
        const end = head.indexOf(ARGS_KEY);
        if (end < 0) {
          this.#pending = head;
          return events;
        }
        const nameJson = head.slice(CALL_HEAD.length, end);
        try {
          this.name = JSON.parse(nameJson) as string;
        } catch {
          this.name = nameJson;
        }
        events.push({ type: "call", name: this.name });
        s = head.slice(end + ARGS_KEY.length);
        this.#state = "arguments";
        continue;
      }
      if (this.#state === "arguments") {
        let i = 0;
        for (; i < s.length; i++) {
          const c = s[i]!;
          if (this.#inString) {
            if (this.#escaped) this.#escaped = false;
            else if (c === "\\") this.#escaped = true;
            else if (c === '"') this.#inString = false;
          } else if (c === '"') {
            this.#inString = true;
          } else if (c === "{" || c === "[") {
            this.#depth++;
          } else if (c === "}" || c === "]") {
            this.#depth--;
            if (this.#depth === 0) {
              i++;
              break;
            }
          }
        }
        const part = s.slice(0, i);
        this.arguments += part;
        if (part) events.push({ type: "arguments", text: part });
        s = s.slice(i);
        if (this.#depth === 0 && this.arguments.length > 0) {
          this.#state = "tail";
          events.push({ type: "end" });
        }
        continue;
      }
      // tail (the call's closing text) and anything after it: not part of the answer
      if (this.#state === "tail") this.#state = "after";
      return events;
    }
    return events;
  }

  /** The end of the reply: held-back text that never became a call is text after all. */
  finish(): ToolEvent[] {
    const events: ToolEvent[] = [];
    if (this.#state === "text" && this.#pending) this.#emitText(events, this.#pending);
    this.#pending = "";
    return events;
  }

  #emitText(events: ToolEvent[], text: string): void {
    if (!text) return;
    this.text += text;
    events.push({ type: "text", text });
  }
}

/** A whole reply split: its text, and the call if one was completed. */
export function parseReply(reply: string): { text: string; call: { name: string; arguments: string } | null; started: boolean } {
  const parser = new ToolCallParser();
  parser.push(reply);
  parser.finish();
  return {
    text: parser.text,
    call: parser.complete && parser.name !== null ? { name: parser.name, arguments: parser.arguments } : null,
    started: parser.called,
  };
}
