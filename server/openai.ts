/**
 * openai.ts — the OpenAI Chat Completions dialect: request JSON → messages and ReplyParams, a
 * ReplyReport → chat.completion JSON or chat.completion.chunk SSE.
 *
 * Owns: validating a /v1/chat/completions body (roles, content parts, images as data URLs,
 * sampling fields, what is refused: n > 1, tools, functions, tool calls, logprobs, audio and file
 * parts), the chat.completion and chat.completion.chunk shapes (the usage-only final chunk of
 * stream_options.include_usage), the keep-alive comment, and the model list.
 * Does not own: HTTP, auth, queueing (app.ts, queue.ts) or generation (host/chat-model.ts).
 */
import { randomUUID } from "node:crypto";

import type { ReplyReport } from "../host/chat-model.js";
import { type ReplyParams, defaultReplyParams } from "../host/text/reply-params.js";
import { type ApiError, invalid, openaiErrorBody } from "./errors.js";
import { type JsonObject, getBool, getInt, getNumber, getSeed, getStr, jsonType, maxTokensValue, requireObject, stopList } from "./fields.js";
import { type ImageData, type RequestMessage, decodeDataUrl } from "./images.js";

/** "developer" is the newer OpenAI name for the system role. */
const ROLE_MAP: Record<string, string> = { system: "system", developer: "system", user: "user", assistant: "assistant", tool: "tool" };
const UNSUPPORTED_PARTS: Record<string, string> = { input_audio: "audio input", file: "file input", refusal: "refusal parts" };

interface ChatRequest {
  model: string;
  messages: RequestMessage[];
  params: ReplyParams;
  stream: boolean;
  includeUsage: boolean;
}

function parseImageUrl(part: JsonObject, where: string): ImageData {
  const spec = part.image_url;
  const url = typeof spec === "string" ? spec : typeof spec === "object" && spec !== null && !Array.isArray(spec) ? (spec as JsonObject).url : undefined;
  if (typeof url !== "string") throw invalid(`${where}.image_url must be an object with a string 'url'`, where);
  return decodeDataUrl(url, where);
}

function parseContent(content: unknown, role: string, where: string): Array<string | ImageData> {
  if (typeof content === "string") return [content];
  if (content === undefined || content === null) {
    throw invalid(`${where}.content is required (tool calls are not supported by this server)`, `${where}.content`);
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

function parseMessages(raw: unknown): RequestMessage[] {
  if (!Array.isArray(raw)) throw invalid(`'messages' must be an array, got ${jsonType(raw)}`, "messages");
  if (raw.length === 0) throw invalid("'messages' must contain at least one message", "messages");
  return raw.map((item, n) => {
    const where = `messages[${n}]`;
    const message = requireObject(item, where);
    const role = message.role;
    if (typeof role !== "string" || !Object.hasOwn(ROLE_MAP, role)) {
      throw invalid(`${where}.role is ${JSON.stringify(role ?? null)}; use one of ${Object.keys(ROLE_MAP).join(", ")}`, `${where}.role`);
    }
    const calls = message.tool_calls;
    if (calls !== undefined && calls !== null && !(Array.isArray(calls) && calls.length === 0)) {
      throw invalid(`${where}: tool calls are not supported by this server`, `${where}.tool_calls`);
    }
    return { role: ROLE_MAP[role]!, parts: parseContent(message.content, role, where) };
  });
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
  for (const key of ["tools", "functions"]) {
    if (truthy(obj[key])) throw invalid(`'${key}' is not supported: this server has no tool calling`, key);
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
  const stream = getBool(obj, "stream", "stream");
  let includeUsage = false;
  if (obj.stream_options !== undefined && obj.stream_options !== null) {
    includeUsage = getBool(requireObject(obj.stream_options, "stream_options"), "include_usage", "stream_options.include_usage");
  }
  return { model, messages, params, stream, includeUsage };
}

// -- responses ------------------------------------------------------------------------------

export function finishReason(report: ReplyReport): "stop" | "length" {
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

export function completionBody(id: string, created: number, model: string, report: ReplyReport): Record<string, unknown> {
  return {
    id, object: "chat.completion", created, model, system_fingerprint: null,
    choices: [{ index: 0, message: { role: "assistant", content: report.reply, refusal: null }, logprobs: null, finish_reason: finishReason(report) }],
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

  constructor(readonly model: string, readonly includeUsage: boolean, id?: string, created?: number) {
    this.id = id ?? newCompletionId();
    this.created = created ?? Math.floor(Date.now() / 1000);
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
    return text ? this.#chunk({ content: text }, null) : "";
  }

  finish(report: ReplyReport): string {
    let out = this.#chunk({}, finishReason(report));
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
    capabilities: { vision: m.vision, chat_completions: true, messages: true, streaming: true, tools: false },
  };
}

export function modelsBody(m: ModelFacts): Record<string, unknown> {
  return { object: "list", data: [modelCard(m)] };
}
