/**
 * tools.ts — what the three API dialects share about structured output and tool calls, on top of
 * host/text/tool-format.ts (the format itself) and host/text/grammar/ (the constraint).
 *
 * Owns: turning the host's tool and schema refusals into 400s naming the request field
 * (`asApiError`), the grammar's build check before a reply's 200 (`checkGrammarBeforeReply`),
 * putting the tools' description into a request's system message (`withToolsSystem`), ids of the
 * calls a reply makes (`callId`), splitting a finished reply into text and its call
 * (`replyCall`), and reading the `tools` array OpenAI and Ollama share (`parseFunctionTools`).
 * The dialects keep their own field names and shapes (a call's id, type and arguments differ).
 * Does not own: any API's JSON (openai.ts, anthropic.ts, ollama.ts).
 */
import { randomBytes } from "node:crypto";

import type { ReplyReport } from "../host/chat-model.js";
import { checkReplyGrammar } from "../host/chat-model.js";
import { type GrammarSpec, jsonSchemaGrammar } from "../host/text/grammar/grammar-spec.js";
import { SchemaError } from "../host/text/grammar/schema-check.js";
import type { ReplyParams } from "../host/text/reply-params.js";
import { type ToolChoice, type ToolDef, ToolError, checkTools, parseReply, toolsPrompt } from "../host/text/tool-format.js";
import { UserError } from "../host/system/user-error.js";
import { invalid } from "./errors.js";
import { getBool, getStr, jsonType, requireObject } from "./fields.js";
import type { RequestMessage } from "./images.js";

/** Declared tools and the choice among them, as a request gives them. */
export interface ToolRequest {
  tools: ToolDef[];
  choice: ToolChoice;
}

/**
 * The `tools` field of an OpenAI or Ollama request ({type: "function", function: {name,
 * description, parameters}}), each checked (checkTools); none: []. OpenAI requires `type` and
 * accepts `function.strict` (always enforced: the grammar is strict); Ollama may leave `type` out.
 */
export function parseFunctionTools(raw: unknown, dialect: "openai" | "ollama"): ToolDef[] {
  if (raw === undefined || raw === null) return [];
  if (!Array.isArray(raw)) throw invalid(`'tools' must be an array, got ${jsonType(raw)}`, "tools");
  const tools = raw.map((item, n): ToolDef => {
    const at = `tools[${n}]`;
    const tool = requireObject(item, at);
    if (tool.type !== "function" && (dialect === "openai" || tool.type !== undefined)) {
      throw invalid(`${at}.type must be 'function' (got ${JSON.stringify(tool.type ?? null)})`, `${at}.type`);
    }
    const fn = requireObject(tool.function, `${at}.function`);
    const name = getStr(fn, "name", `${at}.function.name`, { required: true })!;
    const description = getStr(fn, "description", `${at}.function.description`) ?? "";
    if (dialect === "openai") getBool(fn, "strict", `${at}.function.strict`);
    const parameters = fn.parameters === undefined || fn.parameters === null ? { type: "object", properties: {} } : requireObject(fn.parameters, `${at}.function.parameters`);
    return { name, description, parameters };
  });
  try {
    checkTools(tools, (i) => `tools[${i}].function`, "parameters");
  } catch (err) {
    throw asApiError(err);
  }
  return tools;
}

/** A JSON schema from field `param` as a grammar; 400 naming the keyword and its path. */
export function schemaGrammar(schema: unknown, param: string): GrammarSpec {
  try {
    return jsonSchemaGrammar(schema);
  } catch (err) {
    if (err instanceof SchemaError) throw invalid(`${param}: ${err.message}`, `${param}${err.path ? `.${err.path.slice(1).replaceAll("/", ".")}` : ""}`);
    throw err;
  }
}

/** A tool check's refusal as a 400 naming the field; anything else unchanged. */
export function asApiError(err: unknown): unknown {
  if (err instanceof ToolError) return invalid(err.message, err.param);
  return err;
}

/** Builds the reply's grammar once now (cached by spec), so a schema the grammar engine refuses is
 * a 400 before any 200 of a stream; it names `tools`, or the API's field for formats. */
export async function checkGrammarBeforeReply(params: ReplyParams, formatField: string): Promise<void> {
  try {
    await checkReplyGrammar(params);
  } catch (err) {
    if (err instanceof UserError) throw invalid(err.message, params.grammar?.kind === "tagged" ? "tools" : formatField);
    throw err;
  }
}

/** The request's messages with the tools described at the end of its system message (a system
 * message of its own first when it has none). */
export function withToolsSystem(messages: RequestMessage[], tools: ToolRequest | null): RequestMessage[] {
  if (!tools || tools.tools.length === 0) return messages;
  const text = toolsPrompt(tools.tools, tools.choice);
  const first = messages[0];
  if (first?.role === "system") return [{ role: "system", parts: [...first.parts, `\n\n${text}`] }, ...messages.slice(1)];
  return [{ role: "system", parts: [text] }, ...messages];
}

/** A new call id with the API's prefix (call_, toolu_). */
export function callId(prefix: string): string {
  return `${prefix}${randomBytes(12).toString("hex")}`;
}

/** A finished reply under tools: its text and its call, when a complete one was made. */
export function replyCall(report: ReplyReport, tools: ToolRequest | null): { text: string; call: { name: string; arguments: string } | null } {
  if (!tools || tools.choice.kind === "none" || tools.tools.length === 0) return { text: report.reply, call: null };
  const { text, call } = parseReply(report.reply);
  return { text, call };
}

/** Whether a reply runs under the tool grammar (and so is parsed for calls). */
export function toolsActive(tools: ToolRequest | null): tools is ToolRequest {
  return tools !== null && tools.tools.length > 0 && tools.choice.kind !== "none";
}

