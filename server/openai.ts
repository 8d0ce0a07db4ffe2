/**
 * openai.ts — the OpenAI Chat Completions dialect: request JSON → messages and ReplyParams, a
 * ReplyReport → chat.completion JSON or chat.completion.chunk SSE.
 *
 * Owns: validating a /v1/chat/completions body (roles, content parts, images as data URLs,
 * sampling fields, response_format json_object / json_schema, tools and tool_choice, assistant
 * tool_calls and tool messages in the history, each tool message's tool_call_id matched to an
 * earlier call; what is refused: n > 1, the legacy functions, logprobs, audio and file parts),
 * the chat.completion and chat.completion.chunk shapes (message.tool_calls and
 * finish_reason "tool_calls"; streamed calls as delta.tool_calls[] with index 0, the name first,
 * then the arguments in pieces; the usage-only final chunk of stream_options.include_usage), the
 * keep-alive comment, and the model list.
 * Does not own: HTTP, auth, queueing (app.ts, queue.ts) or generation (host/chat-model.ts).
 */
import { randomUUID } from "node:crypto";

import type { ReplyReport } from "../host/chat-model.js";
import { ANY_OBJECT_SCHEMA } from "../host/text/grammar/grammar-spec.js";
import { type ReplyParams, defaultReplyParams } from "../host/text/reply-params.js";
import {
  TOOL_RESULT_CLOSE, type ToolChoice, ToolCallParser, type ToolDef, checkChoice, toolCallText, toolGrammar, toolResultOpen,
} from "../host/text/tool-format.js";
import { type ApiError, invalid, openaiErrorBody } from "./errors.js";
import { type JsonObject, getBool, getInt, getNumber, getSeed, getStr, isObject, jsonType, maxTokensValue, requireObject, stopList } from "./fields.js";
import { type ImageData, MAX_IMAGE_TOKENS_FIELD, type RequestMessage, decodeDataUrl, withImageBudget } from "./images.js";
import { type ToolRequest, asApiError, callId, parseFunctionTools, replyCall, schemaGrammar, toolsActive, withToolsSystem } from "./tools.js";

/** "developer" is the newer OpenAI name for the system role. */
const ROLE_MAP: Record<string, string> = { system: "system", developer: "system", user: "user", assistant: "assistant", tool: "tool" };
const UNSUPPORTED_PARTS: Record<string, string> = { input_audio: "audio input", file: "file input", refusal: "refusal parts" };

interface ChatRequest {
  model: string;
  messages: RequestMessage[];
  params: ReplyParams;
  stream: boolean;
  includeUsage: boolean;
  tools: ToolRequest | null;
}

function parseImageUrl(part: JsonObject, where: string): ImageData {
  const spec = part.image_url;
  const url = typeof spec === "string" ? spec : typeof spec === "object" && spec !== null && !Array.isArray(spec) ? (spec as JsonObject).url : undefined;
  if (typeof url !== "string") throw invalid(`${where}.image_url must be an object with a string 'url'`, where);
  return decodeDataUrl(url, where);
}

function parseContent(content: unknown, role: string, where: string, optional = false): Array<string | ImageData> {
  if (typeof content === "string") return [content];
  if (content === undefined || content === null) {
    if (optional) return [];
    throw invalid(`${where}.content is required`, `${where}.content`);
  }
  if (!Array.isArray(content)) {
    throw invalid(`${where}.content must be a string or an array of content parts, got ${jsonType(content)}`, `${where}.content`);
  }
  const parts: Array<string | ImageData> = [];
  content.forEach((raw, n) => {
    const partWhere = `${where}.content[${n}]`;
    const part = requireObject(raw, partWhere);
    const kind = part.type;
    if (kind === "text") {
      parts.push(getStr(part, "text", `${partWhere}.text`, { required: true }) ?? "");
    } else if (kind === "image_url") {
      if (role !== "user" && role !== "system") throw invalid(`${partWhere}: images are only accepted in user messages`, partWhere);
      parts.push(parseImageUrl(part, partWhere));
    } else if (typeof kind === "string" && Object.hasOwn(UNSUPPORTED_PARTS, kind)) {
      throw invalid(`${partWhere}: ${UNSUPPORTED_PARTS[kind]} is not supported; this model reads text and images`, partWhere);
    } else {
      throw invalid(`${partWhere}: unsupported content part type ${JSON.stringify(kind ?? null)}; use 'text' or 'image_url'`, partWhere);
    }
  });
  return parts;
}

/** An assistant message's tool_calls as the format's text; records each id's tool name. */
function parseToolCalls(raw: unknown, where: string, ids: Map<string, string>): string[] {
  if (!Array.isArray(raw)) throw invalid(`${where}.tool_calls must be an array, got ${jsonType(raw)}`, `${where}.tool_calls`);
  return raw.map((item, n) => {
    const at = `${where}.tool_calls[${n}]`;
    const call = requireObject(item, at);
    if (call.type !== undefined && call.type !== "function") throw invalid(`${at}.type must be 'function'`, `${at}.type`);
    const id = getStr(call, "id", `${at}.id`, { required: true, allowEmpty: false })!;
    const fn = requireObject(call.function, `${at}.function`);
    const name = getStr(fn, "name", `${at}.function.name`, { required: true, allowEmpty: false })!;
    const args = getStr(fn, "arguments", `${at}.function.arguments`) ?? "{}";
    let parsed: unknown;
    try {
      parsed = JSON.parse(args);
    } catch {
      throw invalid(`${at}.function.arguments must be a JSON object in a string`, `${at}.function.arguments`);
    }
    if (!isObject(parsed)) throw invalid(`${at}.function.arguments must be a JSON object in a string`, `${at}.function.arguments`);
    if (ids.has(id)) throw invalid(`${at}.id '${id}' is used by an earlier tool call`, `${at}.id`);
    ids.set(id, name);
    return toolCallText(name, parsed);
  });
}

function parseMessages(raw: unknown): RequestMessage[] {
  if (!Array.isArray(raw)) throw invalid(`'messages' must be an array, got ${jsonType(raw)}`, "messages");
  if (raw.length === 0) throw invalid("'messages' must contain at least one message", "messages");
  /** tool call id -> tool name, from the assistant messages so far */
  const ids = new Map<string, string>();
  return raw.map((item, n) => {
    const where = `messages[${n}]`;
    const message = requireObject(item, where);
    const role = message.role;
    if (typeof role !== "string" || !Object.hasOwn(ROLE_MAP, role)) {
      throw invalid(`${where}.role is ${JSON.stringify(role ?? null)}; use one of ${Object.keys(ROLE_MAP).join(", ")}`, `${where}.role`);
    }
    const calls = message.tool_calls;
    const hasCalls = calls !== undefined && calls !== null && !(Array.isArray(calls) && calls.length === 0);
    if (hasCalls && role !== "assistant") throw invalid(`${where}: only assistant messages carry tool_calls`, `${where}.tool_calls`);
    if (hasCalls) {
      const parts = parseContent(message.content, role, where, true);
      return { role: "assistant", parts: [...parts, ...parseToolCalls(calls, where, ids)] };
    }
    if (role === "tool") {
      const id = getStr(message, "tool_call_id", `${where}.tool_call_id`, { required: true, allowEmpty: false })!;
      const name = ids.get(id);
      if (name === undefined) {
        throw invalid(`${where}.tool_call_id '${id}' does not match any tool call of an earlier assistant message`, `${where}.tool_call_id`);
      }
      return { role: "tool", parts: [toolResultOpen(id, name), ...parseContent(message.content, role, where), TOOL_RESULT_CLOSE] };
    }
    return { role: ROLE_MAP[role]!, parts: parseContent(message.content, role, where) };
  });
}

function parseToolChoice(raw: unknown, tools: ToolDef[]): ToolChoice {
  let choice: ToolChoice;
  if (raw === undefined || raw === null || raw === "auto") choice = { kind: "auto" };
  else if (raw === "none") choice = { kind: "none" };
  else if (raw === "required") choice = { kind: "required" };
  else if (isObject(raw) && raw.type === "function" && isObject(raw.function) && typeof raw.function.name === "string") choice = { kind: "named", name: raw.function.name };
  else throw invalid(`'tool_choice' must be 'none', 'auto', 'required' or {"type": "function", "function": {"name": ...}}, got ${JSON.stringify(raw)}`, "tool_choice");
  try {
    checkChoice(tools, choice, "tool_choice");
  } catch (err) {
    throw asApiError(err);
  }
  return choice;
}

/** response_format → the reply's grammar (null for text). */
function parseResponseFormat(raw: unknown): ReplyParams["grammar"] {
  if (raw === undefined || raw === null) return null;
  const format = requireObject(raw, "response_format");
  switch (format.type) {
    case "text":
      return null;
    case "json_object":
      return schemaGrammar(ANY_OBJECT_SCHEMA, "response_format");
    case "json_schema": {
      const spec = requireObject(format.json_schema, "response_format.json_schema");
      getStr(spec, "name", "response_format.json_schema.name");
      getBool(spec, "strict", "response_format.json_schema.strict"); // always enforced: the grammar is strict
      const schema = spec.schema === undefined || spec.schema === null ? ANY_OBJECT_SCHEMA : spec.schema;
      return schemaGrammar(schema, "response_format.json_schema.schema");
    }
    default:
      throw invalid(`'response_format.type' must be 'text', 'json_object' or 'json_schema', got ${JSON.stringify(format.type ?? null)}`, "response_format.type");
  }
}

function truthy(value: unknown): boolean {
  if (Array.isArray(value)) return value.length > 0;
  if (typeof value === "object" && value !== null) return Object.keys(value).length > 0;
  return Boolean(value);
}

export function parseChatRequest(body: unknown, maxContext: number): ChatRequest {
  const obj = requireObject(body, "request body");
  const model = getStr(obj, "model", "model", { required: true, allowEmpty: false })!;
  const messages = parseMessages(obj.messages);
  const n = getInt(obj, "n", "n", 1, 2 ** 30);
  if (n !== null && n !== 1) throw invalid("'n' must be 1: this server generates one choice per request", "n");
  for (const key of ["functions", "function_call"]) {
    if (truthy(obj[key])) throw invalid(`'${key}' (the legacy function calling) is not supported; declare them in 'tools'`, key);
  }
  const toolDefs = parseFunctionTools(obj.tools, "openai");
  const choice = parseToolChoice(obj.tool_choice, toolDefs);
  getBool(obj, "parallel_tool_calls", "parallel_tool_calls", true); // accepted: a reply makes at most one call
  const tools: ToolRequest | null = toolDefs.length ? { tools: toolDefs, choice } : null;
  const format = parseResponseFormat(obj.response_format);
  if (format && toolsActive(tools)) {
    throw invalid("'response_format' cannot be combined with tools the model may call; use tool_choice 'none', or drop one of them", "response_format");
  }
  if (truthy(obj.logprobs)) throw invalid("'logprobs' is not supported by this server", "logprobs");
  const maxTokens = maxTokensValue(obj, "max_completion_tokens", maxContext) ?? maxTokensValue(obj, "max_tokens", maxContext);
  const params = defaultReplyParams();
  params.temperature = getNumber(obj, "temperature", "temperature", 0, 2) ?? params.temperature;
  params.topP = getNumber(obj, "top_p", "top_p", 0, 1, false) ?? params.topP;
  params.topK = getInt(obj, "top_k", "top_k", 0, 2 ** 30) ?? params.topK; // an extension (as vLLM / llama.cpp)
  params.seed = getSeed(obj, "seed", "seed");
  // Without a limit the reply may fill the context; generation caps it at what is left.
  params.maxNewTokens = maxTokens ?? maxContext;
  params.stop = stopList(obj.stop, "stop");
  // a stop string inside a call leaves the call incomplete, and so no call is reported; inside a
  // JSON reply it would leave text that claims to be complete JSON: refused
  if (format && params.stop.length) throw invalid("'stop' cannot be combined with response_format: a stop string could cut the JSON", "stop");
  params.grammar = format ?? (tools ? toolGrammar(tools.tools, tools.choice) : null);
  const stream = getBool(obj, "stream", "stream");
  let includeUsage = false;
  if (obj.stream_options !== undefined && obj.stream_options !== null) {
    includeUsage = getBool(requireObject(obj.stream_options, "stream_options"), "include_usage", "stream_options.include_usage");
  }
  const budget = getInt(obj, MAX_IMAGE_TOKENS_FIELD, MAX_IMAGE_TOKENS_FIELD, 1, 2 ** 30); // an extension (kvl)
  return { model, messages: withImageBudget(withToolsSystem(messages, tools), budget), params, stream, includeUsage, tools };
}

// -- responses ------------------------------------------------------------------------------

export function finishReason(report: ReplyReport, called = false): "stop" | "length" | "tool_calls" {
  if (called) return "tool_calls";
  return report.finishReason === "length" ? "length" : "stop";
}

function usageBody(report: ReplyReport): Record<string, unknown> {
  const u = report.usage;
  return {
    prompt_tokens: u.promptTokens, completion_tokens: u.completionTokens, total_tokens: u.promptTokens + u.completionTokens,
    prompt_tokens_details: { cached_tokens: u.reusedPromptTokens },
    completion_tokens_details: { reasoning_tokens: 0 },
  };
}

export function newCompletionId(): string {
  return `chatcmpl-${randomUUID().replaceAll("-", "")}`;
}

export function completionBody(id: string, created: number, model: string, report: ReplyReport, tools: ToolRequest | null = null): Record<string, unknown> {
  const { text, call } = replyCall(report, tools);
  const message: Record<string, unknown> = { role: "assistant", content: call && !text ? null : text, refusal: null };
  if (call) message.tool_calls = [{ id: callId("call_"), type: "function", function: { name: call.name, arguments: call.arguments } }];
  return {
    id, object: "chat.completion", created, model, system_fingerprint: null,
    choices: [{ index: 0, message, logprobs: null, finish_reason: finishReason(report, call !== null) }],
    usage: usageBody(report),
  };
}

function sse(obj: unknown): string {
  return `data: ${JSON.stringify(obj)}\n\n`;
}

const DONE_MARKER = "data: [DONE]\n\n";
/** An SSE comment: clients ignore it, a dead socket fails it. */
export const KEEPALIVE = ": keep-alive\n\n";

/** The chat.completion.chunk sequence of one streamed completion. */
export class ChunkStream {
  readonly id: string;
  readonly created: number;
  /** Splits the text into content and a call, when tools may be called. */
  readonly #parser: ToolCallParser | null;

  constructor(readonly model: string, readonly includeUsage: boolean, id?: string, created?: number, tools: ToolRequest | null = null) {
    this.id = id ?? newCompletionId();
    this.created = created ?? Math.floor(Date.now() / 1000);
    this.#parser = toolsActive(tools) ? new ToolCallParser() : null;
  }

  #chunk(delta: Record<string, unknown>, reason: string | null): string {
    const chunk: Record<string, unknown> = {
      id: this.id, object: "chat.completion.chunk", created: this.created, model: this.model, system_fingerprint: null,
      choices: [{ index: 0, delta, logprobs: null, finish_reason: reason }],
    };
    if (this.includeUsage) chunk.usage = null;
    return sse(chunk);
  }

  start(): string {
    return this.#chunk({ role: "assistant", content: "" }, null);
  }

  delta(text: string): string {
    if (!text) return "";
    if (!this.#parser) return this.#chunk({ content: text }, null);
    return this.#parser.push(text).map((event) => {
      switch (event.type) {
        case "text":
          return this.#chunk({ content: event.text }, null);
        case "call":
          return this.#chunk({ tool_calls: [{ index: 0, id: callId("call_"), type: "function", function: { name: event.name, arguments: "" } }] }, null);
        case "arguments":
          return this.#chunk({ tool_calls: [{ index: 0, function: { arguments: event.text } }] }, null);
        case "end":
          return "";
      }
    }).join("");
  }

  finish(report: ReplyReport): string {
    let out = this.#parser ? this.#parser.finish().map((e) => (e.type === "text" ? this.#chunk({ content: e.text }, null) : "")).join("") : "";
    out += this.#chunk({}, finishReason(report, this.#parser?.complete ?? false));
    if (this.includeUsage) {
      out += sse({ id: this.id, object: "chat.completion.chunk", created: this.created, model: this.model, system_fingerprint: null, choices: [], usage: usageBody(report) });
    }
    return out + DONE_MARKER;
  }

  error(error: ApiError): string {
    return sse(openaiErrorBody(error)) + DONE_MARKER;
  }
}

export interface ModelFacts {
  modelId: string;
  created: number;
  maxContext: number;
  vision: boolean;
}

export function modelCard(m: ModelFacts): Record<string, unknown> {
  return {
    id: m.modelId, object: "model", created: m.created, owned_by: "kvl", context_length: m.maxContext,
    capabilities: { vision: m.vision, chat_completions: true, messages: true, streaming: true, tools: true, structured_outputs: true },
  };
}

export function modelsBody(m: ModelFacts): Record<string, unknown> {
  return { object: "list", data: [modelCard(m)] };
}
