/**
 * ollama.ts — the Ollama dialect: /api/chat and /api/generate request JSON → messages and
 * ReplyParams, a ReplyReport → Ollama's JSON or NDJSON lines; /api/tags, /api/show and
 * /api/version bodies.
 *
 * Owns: validating Ollama bodies (messages with base64 `images`, `options` — num_predict,
 * temperature, top_p, top_k, seed, stop; other options are ignored as Ollama ignores unknown
 * ones), Ollama's defaults (stream true; num_predict -1 or -2 = until the context is full),
 * `format` ("json" or a JSON schema) and, on /api/chat, `tools` (assistant tool_calls and `tool`
 * messages in the history; a reply's call as message.tool_calls, streamed as one line when the
 * call is complete), what is refused with 400 as Ollama does for a model without the feature
 * (think, raw prompts, templates, suffixes, the old `context` array, tools on /api/generate), the
 * "load" answer to an empty request (Ollama's way to preload a model), model names with or without
 * the ":latest" tag, and the shapes: streamed lines {model, created_at, message|response,
 * done:false}, the final line with done_reason and durations in nanoseconds, errors as
 * {"error": "..."}; capabilities (completion, vision, tools) in /api/show and /api/tags.
 * Does not own: HTTP, auth, queueing (app.ts, queue.ts) or generation (host/chat-model.ts).
 */
import type { ReplyReport } from "../host/chat-model.js";
import { ANY_OBJECT_SCHEMA } from "../host/text/grammar/grammar-spec.js";
import { type ReplyParams, defaultReplyParams } from "../host/text/reply-params.js";
import { TOOL_RESULT_CLOSE, ToolCallParser, toolCallText, toolGrammar, toolResultOpen } from "../host/text/tool-format.js";
import { type ApiError, invalid, ollamaErrorBody } from "./errors.js";
import { type JsonObject, getBool, getInt, getNumber, getStr, isObject, jsonType, requireObject, stopList } from "./fields.js";
import { type ImageData, MAX_IMAGE_TOKENS_FIELD, type RequestMessage, decodeDataUrl, decodeImageBase64, withImageBudget } from "./images.js";
import type { ExpertDtype, TrunkDtype } from "../host/pack/pack-format.js";
import type { ModelFacts } from "./openai.js";
import { type ToolRequest, parseFunctionTools, replyCall, schemaGrammar, toolsActive, withToolsSystem } from "./tools.js";

const ROLES = ["system", "user", "assistant", "tool"];
export const OLLAMA_VERSION = "0.6.0";

interface OllamaRequest {
  model: string;
  messages: RequestMessage[];
  params: ReplyParams;
  stream: boolean;
  /** An empty request: Ollama loads (or with keep_alive 0 unloads) the model and answers at once. */
  load: "load" | "unload" | null;
  tools: ToolRequest | null;
}

/** Whether a requested name is the served model (Ollama names carry a tag; ":latest" is the default one). */
export function isServedModel(name: string, modelId: string): boolean {
  return name === modelId || name === `${modelId}:latest`;
}

export function ollamaName(modelId: string): string {
  return modelId.includes(":") ? modelId : `${modelId}:latest`;
}

function refuseFeatures(obj: JsonObject): void {
  if (obj.think !== undefined && obj.think !== null && obj.think !== false) throw invalid("this model does not support thinking ('think')", "think");
}

/** `format`: "json" (any object) or a JSON schema; absent or "" = free text. */
function parseFormat(raw: unknown): ReplyParams["grammar"] {
  if (raw === undefined || raw === null || raw === "") return null;
  if (raw === "json") return schemaGrammar(ANY_OBJECT_SCHEMA, "format");
  if (isObject(raw)) return schemaGrammar(raw, "format");
  throw invalid(`'format' must be "json" or a JSON schema object, got ${JSON.stringify(raw)}`, "format");
}

function parseTools(raw: unknown): ToolRequest | null {
  const tools = parseFunctionTools(raw, "ollama");
  return tools.length ? { tools, choice: { kind: "auto" } } : null;
}

/** An assistant message's tool_calls ({function: {name, arguments}}, arguments an object) as the format's text. */
function parseToolCalls(raw: unknown, where: string): string[] {
  if (!Array.isArray(raw)) throw invalid(`${where}.tool_calls must be an array, got ${jsonType(raw)}`, `${where}.tool_calls`);
  return raw.map((item, n) => {
    const at = `${where}.tool_calls[${n}]`;
    const fn = requireObject(requireObject(item, at).function, `${at}.function`);
    const name = getStr(fn, "name", `${at}.function.name`, { required: true, allowEmpty: false })!;
    const args = fn.arguments ?? {};
    if (!isObject(args)) throw invalid(`${at}.function.arguments must be a JSON object, got ${jsonType(args)}`, `${at}.function.arguments`);
    return toolCallText(name, args);
  });
}

function parseImages(raw: unknown, where: string): ImageData[] {
  if (raw === undefined || raw === null) return [];
  if (!Array.isArray(raw)) throw invalid(`'${where}' must be an array of base64 strings, got ${jsonType(raw)}`, where);
  return raw.map((item, n) => {
    const at = `${where}[${n}]`;
    if (typeof item !== "string") throw invalid(`'${at}' must be a base64 string, got ${jsonType(item)}`, at);
    return item.startsWith("data:") ? decodeDataUrl(item, at) : decodeImageBase64(item, at);
  });
}

/** `options` → ReplyParams; unknown options are ignored (as Ollama does). */
function parseOptions(raw: unknown, maxContext: number): ReplyParams {
  const params = defaultReplyParams();
  params.maxNewTokens = maxContext;
  if (raw === undefined || raw === null) return params;
  const options = requireObject(raw, "options");
  const numPredict = getInt(options, "num_predict", "options.num_predict", -2, maxContext,
    ` (-1 or -2: until the context is full; the server's context is ${maxContext} tokens)`);
  if (numPredict === 0) throw invalid("'options.num_predict' must be at least 1 (or -1 / -2: until the context is full)", "options.num_predict");
  if (numPredict !== null && numPredict > 0) params.maxNewTokens = numPredict;
  params.temperature = getNumber(options, "temperature", "options.temperature", 0, 2) ?? params.temperature;
  params.topP = getNumber(options, "top_p", "options.top_p", 0, 1) ?? params.topP;
  params.topK = getInt(options, "top_k", "options.top_k", 0, 2 ** 30) ?? params.topK;
  const seed = getInt(options, "seed", "options.seed", -(2 ** 63), 2 ** 64 - 1);
  params.seed = seed === null || seed < 0 ? null : BigInt.asUintN(64, BigInt(seed)); // Ollama: -1 = random
  params.stop = stopList(options.stop, "options.stop");
  return params;
}

function loadAnswer(obj: JsonObject): "load" | "unload" {
  const keep = obj.keep_alive;
  return keep === 0 || keep === "0" || keep === "0s" ? "unload" : "load";
}

function parseModel(obj: JsonObject): string {
  const model = obj.model ?? obj.name; // "name" is the older spelling
  if (model === undefined || model === null || model === "") throw invalid("model is required", "model");
  if (typeof model !== "string") throw invalid(`'model' must be a string, got ${jsonType(model)}`, "model");
  return model;
}

/** max_image_tokens (an extension, kvl): top level, or among the options as Ollama's runtime settings are. */
function imageBudget(obj: JsonObject): number | null {
  const top = getInt(obj, MAX_IMAGE_TOKENS_FIELD, MAX_IMAGE_TOKENS_FIELD, 1, 2 ** 30);
  const options = isObject(obj.options) ? obj.options : {};
  const inOptions = getInt(options, MAX_IMAGE_TOKENS_FIELD, `options.${MAX_IMAGE_TOKENS_FIELD}`, 1, 2 ** 30);
  if (top !== null && inOptions !== null && top !== inOptions) {
    throw invalid(`'${MAX_IMAGE_TOKENS_FIELD}' is ${top} but 'options.${MAX_IMAGE_TOKENS_FIELD}' is ${inOptions}; give one`, MAX_IMAGE_TOKENS_FIELD);
  }
  return top ?? inOptions;
}

export function parseChatRequest(body: unknown, maxContext: number): OllamaRequest {
  const obj = requireObject(body, "request body");
  const model = parseModel(obj);
  refuseFeatures(obj);
  const raw = obj.messages ?? [];
  if (!Array.isArray(raw)) throw invalid(`'messages' must be an array, got ${jsonType(raw)}`, "messages");
  const messages = raw.map((item, n): RequestMessage => {
    const where = `messages[${n}]`;
    const message = requireObject(item, where);
    const role = message.role;
    if (typeof role !== "string" || !ROLES.includes(role)) {
      throw invalid(`${where}.role is ${JSON.stringify(role ?? null)}; use one of ${ROLES.join(", ")}`, `${where}.role`);
    }
    const calls = message.tool_calls;
    const hasCalls = Array.isArray(calls) ? calls.length > 0 : calls !== undefined && calls !== null;
    if (hasCalls && role !== "assistant") throw invalid(`${where}: only assistant messages carry tool_calls`, `${where}.tool_calls`);
    const content = getStr(message, "content", `${where}.content`) ?? "";
    const images = parseImages(message.images, `${where}.images`);
    if (images.length && role !== "user" && role !== "system") throw invalid(`${where}: images are only accepted in user messages`, `${where}.images`);
    if (hasCalls) return { role, parts: [content, ...parseToolCalls(calls, where)] };
    if (role === "tool") return { role, parts: [toolResultOpen(null, getStr(message, "tool_name", `${where}.tool_name`)), content, TOOL_RESULT_CLOSE] };
    return { role, parts: images.length ? [...images, content] : [content] };
  });
  const params = parseOptions(obj.options, maxContext);
  const tools = parseTools(obj.tools);
  const format = parseFormat(obj.format);
  if (format && tools) throw invalid("'format' cannot be combined with 'tools'; drop one of them", "format");
  if (format && params.stop.length) throw invalid("'options.stop' cannot be combined with format: a stop string could cut the JSON", "options.stop");
  params.grammar = format ?? (tools ? toolGrammar(tools.tools, tools.choice) : null);
  const stream = getBool(obj, "stream", "stream", true);
  return { model, messages: withImageBudget(withToolsSystem(messages, tools), imageBudget(obj)), params, stream,
    load: messages.length === 0 ? loadAnswer(obj) : null, tools };
}

export function parseGenerateRequest(body: unknown, maxContext: number): OllamaRequest {
  const obj = requireObject(body, "request body");
  const model = parseModel(obj);
  refuseFeatures(obj);
  if (Array.isArray(obj.tools) ? obj.tools.length > 0 : obj.tools !== undefined && obj.tools !== null) {
    throw invalid("'tools' are for /api/chat; /api/generate takes a prompt", "tools");
  }
  if (obj.raw === true) throw invalid("'raw' prompts are not supported; send the prompt without raw (the chat template is applied)", "raw");
  if (getStr(obj, "template", "template")) throw invalid("'template' is not supported: the model's own chat template is used", "template");
  if (getStr(obj, "suffix", "suffix")) throw invalid("'suffix' (fill-in-the-middle) is not supported by this model", "suffix");
  if (Array.isArray(obj.context) ? obj.context.length > 0 : obj.context !== undefined && obj.context !== null) {
    throw invalid("'context' is not supported; use /api/chat and send the conversation's messages", "context");
  }
  const prompt = getStr(obj, "prompt", "prompt") ?? "";
  const system = getStr(obj, "system", "system");
  const images = parseImages(obj.images, "images");
  const params = parseOptions(obj.options, maxContext);
  params.grammar = parseFormat(obj.format);
  if (params.grammar && params.stop.length) throw invalid("'options.stop' cannot be combined with format: a stop string could cut the structure", "options.stop");
  const stream = getBool(obj, "stream", "stream", true);
  if (!prompt && images.length === 0) return { model, messages: [], params, stream, load: loadAnswer(obj), tools: null };
  const messages: RequestMessage[] = [];
  if (system) messages.push({ role: "system", parts: [system] });
  messages.push({ role: "user", parts: images.length ? [...images, prompt] : [prompt] });
  return { model, messages: withImageBudget(messages, imageBudget(obj)), params, stream, load: null, tools: null };
}

// -- responses ------------------------------------------------------------------------------

export type OllamaEndpoint = "chat" | "generate";

function head(model: string): JsonObject {
  return { model, created_at: new Date().toISOString() };
}

function textField(endpoint: OllamaEndpoint, text: string, call: { name: string; arguments: string } | null = null): JsonObject {
  if (endpoint !== "chat") return { response: text };
  const message: JsonObject = { role: "assistant", content: text };
  if (call) message.tool_calls = [{ function: { name: call.name, arguments: JSON.parse(call.arguments) as unknown } }];
  return { message };
}

function doneReason(report: ReplyReport): "stop" | "length" {
  return report.finishReason === "length" ? "length" : "stop";
}

/** Durations in nanoseconds, counts in tokens (prompt_eval_count: the whole prompt). */
function stats(report: ReplyReport, totalS: number): JsonObject {
  const ns = (s: number): number => Math.max(0, Math.round(s * 1e9));
  const t = report.timings;
  return {
    total_duration: ns(totalS), load_duration: 0,
    prompt_eval_count: report.usage.promptTokens, prompt_eval_duration: ns(t.visionS + t.prefillS),
    eval_count: report.usage.completionTokens, eval_duration: ns(t.decodeSPerToken * report.usage.completionTokens),
  };
}

/** The whole reply as one object (stream: false). */
export function replyBody(endpoint: OllamaEndpoint, model: string, report: ReplyReport, totalS: number, tools: ToolRequest | null = null): JsonObject {
  const { text, call } = replyCall(report, tools);
  return { ...head(model), ...textField(endpoint, text, call), done: true, done_reason: doneReason(report), ...stats(report, totalS) };
}

/** The answer to an empty request. */
export function loadBody(endpoint: OllamaEndpoint, model: string, reason: "load" | "unload"): JsonObject {
  return { ...head(model), ...textField(endpoint, ""), done: true, done_reason: reason };
}

function line(obj: unknown): string {
  return `${JSON.stringify(obj)}\n`;
}

/** The NDJSON lines of one streamed reply. */
export class LineStream {
  readonly #parser: ToolCallParser | null;

  constructor(readonly endpoint: OllamaEndpoint, readonly model: string, tools: ToolRequest | null = null) {
    this.#parser = toolsActive(tools) ? new ToolCallParser() : null;
  }

  #text(text: string): string {
    return text ? line({ ...head(this.model), ...textField(this.endpoint, text), done: false }) : "";
  }

  delta(text: string): string {
    if (!this.#parser) return this.#text(text);
    // as Ollama streams calls: text as it comes, a call in one line once it is complete
    return this.#parser.push(text).map((e) => {
      if (e.type === "text") return this.#text(e.text);
      if (e.type !== "end") return "";
      const call = { name: this.#parser!.name!, arguments: this.#parser!.arguments };
      return line({ ...head(this.model), ...textField(this.endpoint, "", call), done: false });
    }).join("");
  }

  finish(report: ReplyReport, totalS: number): string {
    const rest = this.#parser ? this.#parser.finish().map((e) => (e.type === "text" ? this.#text(e.text) : "")).join("") : "";
    return rest + line({ ...head(this.model), ...textField(this.endpoint, ""), done: true, done_reason: doneReason(report), ...stats(report, totalS) });
  }

  error(error: ApiError): string {
    return line(ollamaErrorBody(error));
  }
}

export interface OllamaModelFacts extends ModelFacts {
  /** Bytes of the pack on disk. */
  sizeBytes: number;
  /** sha256 (hex) identifying the pack. */
  digest: string;
  /** When the pack was completed (ISO 8601). */
  modifiedAt: string;
  /** What the routed experts and the trunk's Linear weights are stored as (default q8, bf16). */
  expertDtype?: ExpertDtype;
  trunkDtype?: TrunkDtype;
}

/** Ollama's quantization_level for what the pack holds: its routed experts, most of the weights
 * (Q8 rows, or Q4 in groups of 32 with a scale each, as GGML's Q4_0 is). */
const QUANTIZATION_LEVEL: Readonly<Record<ExpertDtype, string>> = { q8: "Q8_0", q4: "Q4_0" };

function details(m: OllamaModelFacts): JsonObject {
  return { parent_model: "", format: "kvl", family: "kimi-vl", families: ["kimi-vl", "deepseek2"], parameter_size: "",
    quantization_level: QUANTIZATION_LEVEL[m.expertDtype ?? "q8"] };
}

/** What the model can do, as Ollama names it (an editor turns tools off when "tools" is missing). */
function capabilities(m: OllamaModelFacts): string[] {
  return m.vision ? ["completion", "vision", "tools"] : ["completion", "tools"];
}

export function tagsBody(m: OllamaModelFacts): JsonObject {
  const name = ollamaName(m.modelId);
  return {
    models: [{ name, model: name, modified_at: m.modifiedAt, size: m.sizeBytes, digest: m.digest, details: details(m), capabilities: capabilities(m), context_length: m.maxContext }],
  };
}

export function showBody(m: OllamaModelFacts): JsonObject {
  return {
    modelfile: "", parameters: "", template: "", details: details(m),
    model_info: { "general.architecture": "kimi-vl", "kimi-vl.context_length": m.maxContext,
      "kvl.expert_dtype": m.expertDtype ?? "q8", "kvl.trunk_dtype": m.trunkDtype ?? "bf16" },
    capabilities: capabilities(m),
    modified_at: m.modifiedAt,
  };
}
