/**
 * anthropic.ts — the Anthropic Messages dialect: request JSON → messages and ReplyParams, a
 * ReplyReport → the message object or the named-event SSE stream.
 *
 * Owns: validating /v1/messages and /v1/messages/count_tokens bodies (system as a string or text
 * blocks, text and base64 image blocks; URL sources, tool_use, tool_result, document, thinking
 * blocks refused; tools, tool_choice, metadata, thinking and cache_control accepted and ignored,
 * so agents that always send them get plain-text answers), the message object, the event stream
 * (message_start, content_block_start, ping, content_block_delta…, content_block_stop,
 * message_delta, message_stop) and usage in Anthropic's split: input_tokens are the prompt tokens
 * computed now, cache_read_input_tokens those reused from the KV of earlier turns.
 * Does not own: HTTP, auth, queueing (app.ts, queue.ts) or generation (host/chat-model.ts).
 */
import { randomUUID } from "node:crypto";

import type { ReplyReport } from "../host/chat-model.js";
import { type ReplyParams, defaultReplyParams } from "../host/text/reply-params.js";
import { type ApiError, anthropicErrorBody, invalid } from "./errors.js";
import { type JsonObject, getBool, getInt, getNumber, getStr, jsonType, maxTokensValue, requireObject, stopList } from "./fields.js";
import { IMAGE_MEDIA_TYPES, ImageData, type RequestMessage, decodeImageBase64 } from "./images.js";

const ROLES = ["user", "assistant"];
const UNSUPPORTED_BLOCKS: Record<string, string> = {
  tool_use: "tool use", tool_result: "tool results", server_tool_use: "tool use", document: "documents",
  search_result: "search results", thinking: "thinking blocks", redacted_thinking: "thinking blocks", audio: "audio", file: "files",
};

interface MessagesRequest {
  model: string;
  messages: RequestMessage[];
  params: ReplyParams;
  stream: boolean;
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

function parseBlocks(content: unknown, role: string, where: string): Array<string | ImageData> {
  if (typeof content === "string") return [content];
  if (!Array.isArray(content)) throw invalid(`${where} must be a string or an array of content blocks, got ${jsonType(content)}`, where);
  return content.map((raw, n) => {
    const blockWhere = `${where}[${n}]`;
    const block = requireObject(raw, blockWhere);
    const kind = block.type;
    if (kind === "text") return getStr(block, "text", `${blockWhere}.text`, { required: true }) ?? "";
    if (kind === "image") {
      if (role !== "user") throw invalid(`${blockWhere}: images are only accepted in user messages`, blockWhere);
      return parseImageBlock(block, blockWhere);
    }
    if (typeof kind === "string" && Object.hasOwn(UNSUPPORTED_BLOCKS, kind)) {
      throw invalid(`${blockWhere}: ${UNSUPPORTED_BLOCKS[kind]} ('${kind}' blocks) are not supported by this server; it reads text and images`, blockWhere);
    }
    throw invalid(`${blockWhere}: unsupported content block type ${JSON.stringify(kind ?? null)}; use 'text' or 'image'`, blockWhere);
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
  raw.forEach((item, n) => {
    const where = `messages[${n}]`;
    const message = requireObject(item, where);
    const role = message.role;
    if (typeof role !== "string" || !ROLES.includes(role)) {
      const hint = role === "system" ? " (put system text in the top-level 'system' field)" : "";
      throw invalid(`${where}.role is ${JSON.stringify(role ?? null)}; use 'user' or 'assistant'${hint}`, `${where}.role`);
    }
    if (!Object.hasOwn(message, "content")) throw invalid(`${where}.content is required`, `${where}.content`);
    messages.push({ role, parts: parseBlocks(message.content, role, `${where}.content`) });
  });
  return messages;
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
  const stream = getBool(obj, "stream", "stream");
  return { model, messages, params, stream };
}

export function parseCountTokensRequest(body: unknown): { model: string; messages: RequestMessage[] } {
  const obj = requireObject(body, "request body");
  return { model: parseModel(obj), messages: parseConversation(obj) };
}

// -- responses ------------------------------------------------------------------------------

export function stopReason(report: ReplyReport): "end_turn" | "max_tokens" | "stop_sequence" {
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

export function messageBody(id: string, model: string, report: ReplyReport): Record<string, unknown> {
  return {
    id, type: "message", role: "assistant", model, content: [{ type: "text", text: report.reply }],
    stop_reason: stopReason(report), stop_sequence: report.stopSequence, usage: usageBody(report),
  };
}

function event(name: string, obj: unknown): string {
  return `event: ${name}\ndata: ${JSON.stringify(obj)}\n\n`;
}

export const PING = event("ping", { type: "ping" });

/** The named-event sequence of one streamed message (a single text content block). */
export class MessageStream {
  readonly id: string;

  constructor(readonly model: string, id?: string) {
    this.id = id ?? newMessageId();
  }

  /** Reuse is known only after prefill; message_delta carries the final split. */
  start(promptTokens: number): string {
    const message = {
      id: this.id, type: "message", role: "assistant", model: this.model, content: [], stop_reason: null, stop_sequence: null,
      usage: { input_tokens: promptTokens, output_tokens: 0, cache_creation_input_tokens: 0, cache_read_input_tokens: 0 },
    };
    return event("message_start", { type: "message_start", message })
      + event("content_block_start", { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } })
      + PING;
  }

  delta(text: string): string {
    return text ? event("content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "text_delta", text } }) : "";
  }

  finish(report: ReplyReport): string {
    return event("content_block_stop", { type: "content_block_stop", index: 0 })
      + event("message_delta", { type: "message_delta", delta: { stop_reason: stopReason(report), stop_sequence: report.stopSequence }, usage: usageBody(report) })
      + event("message_stop", { type: "message_stop" });
  }

  error(error: ApiError): string {
    return event("error", anthropicErrorBody(error));
  }
}
