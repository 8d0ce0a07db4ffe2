/**
 * routes.ts — the API's routes as one table: method, path, API dialect (the shape of its errors),
 * whether it needs the key, and its handler over the shared request steps (steps.ts). Adding an
 * endpoint is one row here plus its handler; the dialect module (openai.ts, anthropic.ts,
 * ollama.ts) parses its request and shapes its answer.
 *
 * Owns: the list of endpoints (/healthz; OpenAI /v1/models, /v1/models/{id}, /v1/chat/completions;
 * Anthropic /v1/messages, /v1/messages/count_tokens; Ollama /api/chat, /api/generate, /api/tags,
 * /api/show, /api/version) and what each handler does between the shared steps. Does not own:
 * the steps (steps.ts), the web chat page's paths (web.ts), the koa app (app.ts).
 */
import * as anthropic from "./anthropic.js";
import { invalid } from "./errors.js";
import * as ollama from "./ollama.js";
import * as openai from "./openai.js";
import { NDJSON_CONTENT_TYPE, SSE_CONTENT_TYPE, type StreamShape } from "./reply.js";
import type { RouteHandler, RouteSettings } from "./steps.js";
import { checkGrammarBeforeReply } from "./tools.js";

export interface Route extends RouteSettings {
  readonly method: "GET" | "POST";
  /** a @koa/router path ("*id": the rest of the path, slashes included) */
  readonly path: string;
  readonly handle: RouteHandler;
}

// -- handlers, in table order ------------------------------------------------------------------

const health: RouteHandler = async (ctx, _log, { queue }) => {
  const body: Record<string, unknown> = { status: queue.status };
  if (queue.error) body.error = queue.error;
  ctx.status = queue.status === "failed" ? 503 : 200;
  ctx.body = body;
};

const openaiModels: RouteHandler = async (ctx, _log, steps) => {
  ctx.body = openai.modelsBody(steps.facts);
};

const openaiModel: RouteHandler = async (ctx, _log, steps) => {
  const raw = (ctx.params as Record<string, unknown>).id;
  const id = Array.isArray(raw) ? raw.join("/") : String(raw);
  steps.checkModel("openai", id);
  ctx.body = openai.modelCard(steps.facts);
};

const openaiChat: RouteHandler = async (ctx, log, steps) => {
  const { modelId, maxContext } = steps.config;
  const req = openai.parseChatRequest(await steps.body(ctx), maxContext);
  steps.checkModel("openai", req.model);
  steps.validateParams(req.params);
  await checkGrammarBeforeReply(req.params, "response_format");
  const { messages } = await steps.prepare(req.messages);
  const chunks = new openai.ChunkStream(modelId, req.includeUsage, undefined, undefined, req.tools);
  const shape: StreamShape | null = req.stream
    ? { contentType: SSE_CONTENT_TYPE, head: chunks.start(), delta: (t) => chunks.delta(t), finish: (r) => chunks.finish(r), error: (e) => chunks.error(e), keepalive: openai.KEEPALIVE }
    : null;
  const report = await steps.reply(ctx, log, messages, req.params, shape);
  if (report) ctx.body = openai.completionBody(openai.newCompletionId(), Math.floor(Date.now() / 1000), modelId, report, req.tools);
};

const anthropicMessages: RouteHandler = async (ctx, log, steps) => {
  const { modelId, maxContext } = steps.config;
  const req = anthropic.parseMessagesRequest(await steps.body(ctx), maxContext);
  steps.checkModel("anthropic", req.model);
  steps.validateParams(req.params);
  await checkGrammarBeforeReply(req.params, "tools");
  const { messages, promptTokens } = await steps.prepare(req.messages);
  const stream = new anthropic.MessageStream(modelId, undefined, req.tools);
  const shape: StreamShape | null = req.stream
    ? { contentType: SSE_CONTENT_TYPE, head: stream.start(promptTokens), delta: (t) => stream.delta(t), finish: (r) => stream.finish(r), error: (e) => stream.error(e), keepalive: anthropic.PING }
    : null;
  const report = await steps.reply(ctx, log, messages, req.params, shape);
  if (report) ctx.body = anthropic.messageBody(anthropic.newMessageId(), modelId, report, req.tools);
};

const anthropicCountTokens: RouteHandler = async (ctx, log, steps) => {
  const req = anthropic.parseCountTokensRequest(await steps.body(ctx));
  steps.checkModel("anthropic", req.model);
  const { promptTokens } = await steps.prepare(req.messages, false);
  log.promptTokens = promptTokens;
  ctx.body = { input_tokens: promptTokens };
};

/** /api/chat and /api/generate: one handler, the endpoint's parser and answer names apart. */
const ollamaReply = (endpointName: ollama.OllamaEndpoint, parse: typeof ollama.parseChatRequest): RouteHandler => async (ctx, log, steps) => {
  const req = parse(await steps.body(ctx), steps.config.maxContext);
  steps.checkModel("ollama", req.model);
  if (req.load) {
    steps.queue.requireReady();
    ctx.body = ollama.loadBody(endpointName, req.model, req.load);
    return;
  }
  steps.validateParams(req.params);
  await checkGrammarBeforeReply(req.params, "format");
  const { messages } = await steps.prepare(req.messages);
  const lines = new ollama.LineStream(endpointName, req.model, req.tools);
  const shape: StreamShape | null = req.stream
    ? { contentType: NDJSON_CONTENT_TYPE, head: "", delta: (t) => lines.delta(t), finish: (r) => lines.finish(r, log.seconds), error: (e) => lines.error(e), keepalive: null }
    : null;
  const report = await steps.reply(ctx, log, messages, req.params, shape);
  if (report) ctx.body = ollama.replyBody(endpointName, req.model, report, log.seconds, req.tools);
};

const ollamaTags: RouteHandler = async (ctx, _log, steps) => {
  ctx.body = ollama.tagsBody(steps.facts);
};

const ollamaShow: RouteHandler = async (ctx, _log, steps) => {
  const json = await steps.body(ctx);
  const obj = json !== null && typeof json === "object" && !Array.isArray(json) ? (json as Record<string, unknown>) : null;
  const model = obj?.model ?? obj?.name;
  if (typeof model !== "string" || !model) throw invalid("model is required", "model");
  steps.checkModel("ollama", model);
  ctx.body = ollama.showBody(steps.facts);
};

const ollamaVersion: RouteHandler = async (ctx) => {
  ctx.body = { version: ollama.OLLAMA_VERSION };
};

// -- the table ---------------------------------------------------------------------------------

export const ROUTES: readonly Route[] = [
  { method: "GET", path: "/healthz", dialect: "openai", auth: false, handle: health },
  { method: "GET", path: "/v1/models", dialect: "openai", handle: openaiModels },
  { method: "GET", path: "/v1/models/*id", dialect: "openai", handle: openaiModel },
  { method: "POST", path: "/v1/chat/completions", dialect: "openai", handle: openaiChat },
  { method: "POST", path: "/v1/messages", dialect: "anthropic", handle: anthropicMessages },
  { method: "POST", path: "/v1/messages/count_tokens", dialect: "anthropic", handle: anthropicCountTokens },
  { method: "POST", path: "/api/chat", dialect: "ollama", handle: ollamaReply("chat", ollama.parseChatRequest) },
  { method: "POST", path: "/api/generate", dialect: "ollama", handle: ollamaReply("generate", ollama.parseGenerateRequest) },
  { method: "GET", path: "/api/tags", dialect: "ollama", handle: ollamaTags },
  { method: "POST", path: "/api/show", dialect: "ollama", handle: ollamaShow },
  { method: "GET", path: "/api/version", dialect: "ollama", handle: ollamaVersion },
];
