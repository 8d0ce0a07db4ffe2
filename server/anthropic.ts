/**
 * anthropic.ts — the Anthropic Messages dialect: request JSON → messages and ReplyParams, a
 * ReplyReport → the message object or the named-event SSE stream.
 *
 * Owns: validating /v1/messages and /v1/messages/count_tokens bodies (system as a string or text
 * blocks, text and base64 image blocks, tools with input_schema and tool_choice auto / any /
 * tool / none, tool_use blocks in assistant turns and tool_result blocks — text and images — in
 * user turns, each matched to an earlier tool_use id; URL sources, document, thinking blocks and
 * server tools refused; metadata, thinking and cache_control accepted and ignored), the message
 * object (a tool_use block and stop_reason "tool_use" when the reply calls a tool), the event
 * stream (message_start, content_block_start, ping, content_block_delta…, content_block_stop,
 * message_delta, message_stop; under tools each block starts when its first piece exists, a
 * call as content_block_start of a tool_use block and input_json_delta events) and usage in
 * Anthropic's split: input_tokens are the prompt tokens computed now, cache_read_input_tokens
 * those reused from the KV of earlier turns.
 * Does not own: HTTP, auth, queueing (app.ts, queue.ts) or generation (host/chat-model.ts).
 */
import { randomUUID } from "node:crypto";

import type { ReplyReport } from "../host/chat-model.js";
import { type ReplyParams, defaultReplyParams } from "../host/text/reply-params.js";
import {
  TOOL_RESULT_CLOSE, type ToolChoice, ToolCallParser, type ToolDef, checkChoice, checkTools, toolCallText, toolGrammar, toolResultOpen,
} from "../host/text/tool-format.js";
import { type ApiError, anthropicErrorBody, invalid } from "./errors.js";
import { type JsonObject, getBool, getInt, getNumber, getStr, isObject, jsonType, maxTokensValue, requireObject, stopList } from "./fields.js";
import { IMAGE_MEDIA_TYPES, ImageData, MAX_IMAGE_TOKENS_FIELD, type RequestMessage, decodeImageBase64, withImageBudget } from "./images.js";
import { type ToolRequest, asApiError, callId, replyCall, toolsActive, withToolsSystem } from "./tools.js";

const ROLES = ["user", "assistant"];
const UNSUPPORTED_BLOCKS: Record<string, string> = {
  server_tool_use: "server tool use", web_search_tool_result: "server tool results", document: "documents",
  search_result: "search results", thinking: "thinking blocks", redacted_thinking: "thinking blocks", audio: "audio", file: "files",
};

interface MessagesRequest {
  model: string;
  messages: RequestMessage[];
  params: ReplyParams;
  stream: boolean;
  tools: ToolRequest | null;
}

function parseImageBlock(block: JsonObject, where: string): ImageData {
  const source = requireObject(block.source, `${where}.source`);
  const kind = source.type;
  if (kind === "url") {
    throw invalid(`${where}: this server never fetches URLs; send the image as a base64 source ({"type": "base64", "media_type": ..., "data": ...})`, where);
  }
  if (kind !== "base64") throw invalid(`${where}.source.type must be 'base64', got ${JSON.stringify(kind ?? null)}`, `${where}.source`);
  const mediaType = getStr(source, "media_type", `${where}.source.media_type`, { required: true })!;
  if (!(IMAGE_MEDIA_TYPES as readonly string[]).includes(mediaType.toLowerCase())) {
    throw invalid(`${where}.source.media_type '${mediaType}' is not supported; use one of ${IMAGE_MEDIA_TYPES.join(", ")}`, `${where}.source.media_type`);
  }
  const data = getStr(source, "data", `${where}.source.data`, { required: true })!;
  return decodeImageBase64(data, `${where}.source.data`);
}

/** tool_use id -> tool name, from the assistant turns so far. */
type CallIds = Map<string, string>;

function parseToolUse(block: JsonObject, where: string, ids: CallIds): string {
  const id = getStr(block, "id", `${where}.id`, { required: true, allowEmpty: false })!;
  const name = getStr(block, "name", `${where}.name`, { required: true, allowEmpty: false })!;
  const input = block.input ?? {};
  if (!isObject(input)) throw invalid(`${where}.input must be a JSON object, got ${jsonType(input)}`, `${where}.input`);
  if (ids.has(id)) throw invalid(`${where}.id '${id}' is used by an earlier tool_use block`, `${where}.id`);
  ids.set(id, name);
  return toolCallText(name, input);
}

function parseToolResult(block: JsonObject, where: string, ids: CallIds): Array<string | ImageData> {
  const id = getStr(block, "tool_use_id", `${where}.tool_use_id`, { required: true, allowEmpty: false })!;
  const name = ids.get(id);
  if (name === undefined) throw invalid(`${where}.tool_use_id '${id}' does not match any tool_use block of an earlier assistant turn`, `${where}.tool_use_id`);
  const isError = getBool(block, "is_error", `${where}.is_error`);
  const content = block.content ?? "";
  const inner: Array<string | ImageData> = [];
  if (typeof content === "string") {
    inner.push(content);
  } else if (Array.isArray(content)) {
    content.forEach((raw, n) => {
      const at = `${where}.content[${n}]`;
      const item = requireObject(raw, at);
      if (item.type === "text") inner.push(getStr(item, "text", `${at}.text`, { required: true }) ?? "");
      else if (item.type === "image") inner.push(parseImageBlock(item, at));
      else throw invalid(`${at}: a tool_result holds 'text' and 'image' blocks, got ${JSON.stringify(item.type ?? null)}`, at);
    });
  } else {
    throw invalid(`${where}.content must be a string or an array of blocks, got ${jsonType(content)}`, `${where}.content`);
  }
  return [toolResultOpen(id, name, isError), ...inner, TOOL_RESULT_CLOSE];
}

function parseBlocks(content: unknown, role: string, where: string, ids: CallIds = new Map()): Array<string | ImageData> {
  if (typeof content === "string") return [content];
  if (!Array.isArray(content)) throw invalid(`${where} must be a string or an array of content blocks, got ${jsonType(content)}`, where);
  return content.flatMap((raw, n): Array<string | ImageData> => {
    const blockWhere = `${where}[${n}]`;
    const block = requireObject(raw, blockWhere);
    const kind = block.type;
    if (kind === "text") return [getStr(block, "text", `${blockWhere}.text`, { required: true }) ?? ""];
    if (kind === "image") {
      if (role !== "user") throw invalid(`${blockWhere}: images are only accepted in user messages`, blockWhere);
      return [parseImageBlock(block, blockWhere)];
    }
    if (kind === "tool_use") {
      if (role !== "assistant") throw invalid(`${blockWhere}: tool_use blocks belong in assistant messages`, blockWhere);
      return [parseToolUse(block, blockWhere, ids)];
    }
    if (kind === "tool_result") {
      if (role !== "user") throw invalid(`${blockWhere}: tool_result blocks belong in user messages`, blockWhere);
      return parseToolResult(block, blockWhere, ids);
    }
    if (typeof kind === "string" && Object.hasOwn(UNSUPPORTED_BLOCKS, kind)) {
      throw invalid(`${blockWhere}: ${UNSUPPORTED_BLOCKS[kind]} ('${kind}' blocks) are not supported by this server; it reads text, images and tool blocks`, blockWhere);
    }
    throw invalid(`${blockWhere}: unsupported content block type ${JSON.stringify(kind ?? null)}; use 'text', 'image', 'tool_use' or 'tool_result'`, blockWhere);
  });
}

function parseConversation(body: JsonObject): RequestMessage[] {
  const messages: RequestMessage[] = [];
  if (body.system !== undefined && body.system !== null) {
    const parts = parseBlocks(body.system, "system", "system");
    if (parts.some((p) => p instanceof ImageData)) throw invalid("system accepts text blocks only", "system");
    messages.push({ role: "system", parts });
  }
  const raw = body.messages;
  if (!Array.isArray(raw)) throw invalid(`'messages' is required and must be an array, got ${jsonType(raw)}`, "messages");
  if (raw.length === 0) throw invalid("'messages' must contain at least one message", "messages");
  const ids: CallIds = new Map();
  raw.forEach((item, n) => {
    const where = `messages[${n}]`;
    const message = requireObject(item, where);
    const role = message.role;
    if (typeof role !== "string" || !ROLES.includes(role)) {
      const hint = role === "system" ? " (put system text in the top-level 'system' field)" : "";
      throw invalid(`${where}.role is ${JSON.stringify(role ?? null)}; use 'user' or 'assistant'${hint}`, `${where}.role`);
    }
    if (!Object.hasOwn(message, "content")) throw invalid(`${where}.content is required`, `${where}.content`);
    messages.push({ role, parts: parseBlocks(message.content, role, `${where}.content`, ids) });
  });
  return messages;
}

function parseTools(body: JsonObject): ToolRequest | null {
  const raw = body.tools;
  if (raw === undefined || raw === null) {
    if (body.tool_choice !== undefined && body.tool_choice !== null) parseChoice(body.tool_choice, []);
    return null;
  }
  if (!Array.isArray(raw)) throw invalid(`'tools' must be an array, got ${jsonType(raw)}`, "tools");
  const tools = raw.map((item, n): ToolDef => {
    const at = `tools[${n}]`;
    const tool = requireObject(item, at);
    if (tool.type !== undefined && tool.type !== null && tool.type !== "custom") {
      throw invalid(`${at}: server tools ('${String(tool.type)}') are not supported; declare client tools with name, description and input_schema`, `${at}.type`);
    }
    const name = getStr(tool, "name", `${at}.name`, { required: true })!;
    const description = getStr(tool, "description", `${at}.description`) ?? "";
    const parameters = requireObject(tool.input_schema, `${at}.input_schema`);
    return { name, description, parameters };
  });
  try {
    checkTools(tools, (i) => `tools[${i}]`, "input_schema");
  } catch (err) {
    throw asApiError(err);
  }
  return tools.length ? { tools, choice: parseChoice(body.tool_choice, tools) } : null;
}

function parseChoice(raw: unknown, tools: ToolDef[]): ToolChoice {
  if (raw === undefined || raw === null) return { kind: "auto" };
  const obj = requireObject(raw, "tool_choice");
  getBool(obj, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use"); // a reply makes at most one call anyway
  let choice: ToolChoice;
  switch (obj.type) {
    case "auto":
      choice = { kind: "auto" };
      break;
    case "any":
      choice = { kind: "required" };
      break;
    case "none":
      choice = { kind: "none" };
      break;
    case "tool":
      choice = { kind: "named", name: getStr(obj, "name", "tool_choice.name", { required: true })! };
      break;
    default:
      throw invalid(`'tool_choice.type' must be 'auto', 'any', 'tool' or 'none', got ${JSON.stringify(obj.type ?? null)}`, "tool_choice.type");
  }
  try {
    checkChoice(tools, choice, "tool_choice");
  } catch (err) {
    throw asApiError(err);
  }
  return choice;
}

function parseModel(body: JsonObject): string {
  return getStr(body, "model", "model", { required: true, allowEmpty: false })!;
}

export function parseMessagesRequest(body: unknown, maxContext: number): MessagesRequest {
  const obj = requireObject(body, "request body");
  const model = parseModel(obj);
  const messages = parseConversation(obj);
  if (obj.max_tokens === undefined || obj.max_tokens === null) throw invalid("'max_tokens' is required", "max_tokens");
  const params = defaultReplyParams();
  params.maxNewTokens = maxTokensValue(obj, "max_tokens", maxContext)!;
  params.temperature = getNumber(obj, "temperature", "temperature", 0, 1) ?? params.temperature;
  params.topP = getNumber(obj, "top_p", "top_p", 0, 1, false) ?? params.topP;
  params.topK = getInt(obj, "top_k", "top_k", 0, 2 ** 30) ?? params.topK;
  params.stop = stopList(obj.stop_sequences, "stop_sequences", false);
  const tools = parseTools(obj);
  params.grammar = tools ? toolGrammar(tools.tools, tools.choice) : null;
  const stream = getBool(obj, "stream", "stream");
  const budget = getInt(obj, MAX_IMAGE_TOKENS_FIELD, MAX_IMAGE_TOKENS_FIELD, 1, 2 ** 30); // an extension (kvl)
  return { model, messages: withImageBudget(withToolsSystem(messages, tools), budget), params, stream, tools };
}

/** The prompt count_tokens measures: the messages with the tools' description, as a reply sees them. */
export function parseCountTokensRequest(body: unknown): { model: string; messages: RequestMessage[] } {
  const obj = requireObject(body, "request body");
  const model = parseModel(obj);
  const messages = parseConversation(obj);
  const budget = getInt(obj, MAX_IMAGE_TOKENS_FIELD, MAX_IMAGE_TOKENS_FIELD, 1, 2 ** 30); // an extension (kvl)
  return { model, messages: withImageBudget(withToolsSystem(messages, parseTools(obj)), budget) };
}

// -- responses ------------------------------------------------------------------------------

export function stopReason(report: ReplyReport, called = false): "end_turn" | "max_tokens" | "stop_sequence" | "tool_use" {
  if (called) return "tool_use";
  if (report.finishReason === "length") return "max_tokens";
  if (report.stopSequence !== null) return "stop_sequence";
  return "end_turn";
}

function usageBody(report: ReplyReport): Record<string, number> {
  const u = report.usage;
  return {
    input_tokens: u.promptTokens - u.reusedPromptTokens, output_tokens: u.completionTokens,
    cache_creation_input_tokens: 0, cache_read_input_tokens: u.reusedPromptTokens,
  };
}

export function newMessageId(): string {
  return `msg_${randomUUID().replaceAll("-", "")}`;
}

/** The input of a call: its arguments, which the grammar made a JSON object. */
function callInput(args: string): unknown {
  return JSON.parse(args) as unknown;
}

export function messageBody(id: string, model: string, report: ReplyReport, tools: ToolRequest | null = null): Record<string, unknown> {
  const { text, call } = replyCall(report, tools);
  const content: unknown[] = call && !text ? [] : [{ type: "text", text }];
  if (call) content.push({ type: "tool_use", id: callId("toolu_"), name: call.name, input: callInput(call.arguments) });
  return {
    id, type: "message", role: "assistant", model, content,
    stop_reason: stopReason(report, call !== null), stop_sequence: report.stopSequence, usage: usageBody(report),
  };
}

function event(name: string, obj: unknown): string {
  return `event: ${name}\ndata: ${JSON.stringify(obj)}\n\n`;
}

export const PING = event("ping", { type: "ping" });

/** The named-event sequence of one streamed message: one text block; under tools, a text block
 * and a tool_use block, each started when its first piece exists. */
export class MessageStream {
  readonly id: string;
  readonly #parser: ToolCallParser | null;
  /** Under tools: the open block's index and kind, and the next index. */
  #open: { index: number; kind: "text" | "tool_use" } | null = null;
  #next = 0;

  constructor(readonly model: string, id?: string, tools: ToolRequest | null = null) {
    this.id = id ?? newMessageId();
    this.#parser = toolsActive(tools) ? new ToolCallParser() : null;
  }

  #startBlock(kind: "text" | "tool_use", block: Record<string, unknown>): string {
    const out = this.#stopBlock();
    this.#open = { index: this.#next++, kind };
    return out + event("content_block_start", { type: "content_block_start", index: this.#open.index, content_block: block });
  }

  #stopBlock(): string {
    if (!this.#open) return "";
    const out = event("content_block_stop", { type: "content_block_stop", index: this.#open.index });
    this.#open = null;
    return out;
  }

  #textDelta(index: number, text: string): string {
    return event("content_block_delta", { type: "content_block_delta", index, delta: { type: "text_delta", text } });
  }

  /** Reuse is known only after prefill; message_delta carries the final split. */
  start(promptTokens: number): string {
    const message = {
      id: this.id, type: "message", role: "assistant", model: this.model, content: [], stop_reason: null, stop_sequence: null,
      usage: { input_tokens: promptTokens, output_tokens: 0, cache_creation_input_tokens: 0, cache_read_input_tokens: 0 },
    };
    if (this.#parser) return event("message_start", { type: "message_start", message }) + PING;
    return event("message_start", { type: "message_start", message })
      + event("content_block_start", { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } })
      + PING;
  }

  delta(text: string): string {
    if (!text) return "";
    if (!this.#parser) return this.#textDelta(0, text);
    return this.#parser.push(text).map((e) => this.#toolEvent(e)).join("");
  }

  #toolEvent(e: ReturnType<ToolCallParser["push"]>[number]): string {
    switch (e.type) {
      case "text": {
        const start = this.#open?.kind === "text" ? "" : this.#startBlock("text", { type: "text", text: "" });
        return start + this.#textDelta(this.#open!.index, e.text);
      }
      case "call":
        return this.#startBlock("tool_use", { type: "tool_use", id: callId("toolu_"), name: e.name, input: {} });
      case "arguments":
        return event("content_block_delta", { type: "content_block_delta", index: this.#open!.index, delta: { type: "input_json_delta", partial_json: e.text } });
      case "end":
        return this.#stopBlock();
    }
  }

  finish(report: ReplyReport): string {
    let out: string;
    let called = false;
    if (this.#parser) {
      out = this.#parser.finish().map((e) => this.#toolEvent(e)).join("") + this.#stopBlock();
      called = this.#parser.complete;
    } else {
      out = event("content_block_stop", { type: "content_block_stop", index: 0 });
    }
    return out
      + event("message_delta", { type: "message_delta", delta: { stop_reason: stopReason(report, called), stop_sequence: report.stopSequence }, usage: usageBody(report) })
      + event("message_stop", { type: "message_stop" });
  }

  error(error: ApiError): string {
    return event("error", anthropicErrorBody(error));
  }
}
