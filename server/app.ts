/**
 * app.ts — the koa app: routes, per-route API dialect, auth, and one log line per request.
 *
 * Owns: the routing table (/ and its assets: the web chat page, web.ts; /healthz; OpenAI /v1/models, /v1/models/{id}, /v1/chat/completions;
 * Anthropic /v1/messages, /v1/messages/count_tokens; Ollama /api/chat, /api/generate, /api/tags,
 * /api/show, /api/version), the order every request goes through (Host and Origin, then a body
 * slot, both before the app: guard.ts, body.ts; then key → body → the dialect's parse → model id →
 * ready → images, each decoded whole → prompt size → queue → answer: everything that can be checked
 * is checked before a stream's 200 goes out), rendering any error in the
 * route's dialect (an unknown path or method too), a 500 for a bug that keeps the server serving,
 * and the log line.
 * Does not own: body reading (body.ts), the dialects (openai.ts, anthropic.ts, ollama.ts), images
 * (images.ts), the queue (queue.ts), streaming (reply.ts), binding and signals (serve.ts).
 */
import type { ExpertDtype, TrunkDtype } from "../host/pack/pack-format.js";
import Router from "@koa/router";
import Koa from "koa";

import type { Message } from "../host/text/conversation.js";
import type { ReplyParams } from "../host/text/reply-params.js";
import { validateReplyParams } from "../host/text/reply-params.js";
import { UserError } from "../host/system/user-error.js";
import * as anthropic from "./anthropic.js";
import { KeyCheck } from "./auth.js";
import { ClientGone, DEFAULT_READ_DEADLINES, type ReadDeadlines, mayCloseAfterRefusal, readJsonBody } from "./body.js";
import { ApiError, type Dialect, dialectOfPath, errorBody, invalid } from "./errors.js";
import { type RequestMessage, loadImages } from "./images.js";
import type { ServedModel } from "./model.js";
import * as ollama from "./ollama.js";
import * as openai from "./openai.js";
import type { EngineQueue } from "./queue.js";
import { NDJSON_CONTENT_TYPE, RequestLog, SSE_CONTENT_TYPE, type StreamShape, collectReply, streamReply } from "./reply.js";
import { checkGrammarBeforeReply } from "./tools.js";
import { WebPage } from "./web.js";

export const DEFAULT_MODEL_ID = "kimi-vl-a3b-instruct-q8";

/** The id served when --model-id is not given: it names what the routed experts are stored as
 * (most of the weights), so a Q4 pack never calls itself Q8. */
export function defaultModelId(expertDtype: ExpertDtype): string {
  return `kimi-vl-a3b-instruct-${expertDtype}`;
}
/** A silent stream (a long prefill, a wait in the queue) still shows the client it is alive. */
const KEEPALIVE_MS = 5000;

export interface ServerConfig {
  modelId: string;
  apiKey: string | null;
  maxContext: number;
  maxBodyBytes: number;
  vision: boolean;
  /** What /api/tags says of the pack. */
  pack: { sizeBytes: number; digest: string; modifiedAt: string; expertDtype?: ExpertDtype; trunkDtype?: TrunkDtype };
  keepaliveMs?: number;
  /** How long headers and bodies may take to arrive (body.ts; default DEFAULT_READ_DEADLINES). */
  deadlines?: ReadDeadlines;
  /** Where log lines go (default stderr). */
  log?: (line: string) => void;
}

type Handler = (ctx: Koa.Context, log: RequestLog) => Promise<void>;

export function createApp(queue: EngineQueue, config: ServerConfig): Koa {
  const created = Math.floor(Date.now() / 1000);
  const keys = new KeyCheck(config.apiKey);
  const keepaliveMs = config.keepaliveMs ?? KEEPALIVE_MS;
  const deadlines = config.deadlines ?? DEFAULT_READ_DEADLINES;
  const body = (ctx: Koa.Context): Promise<unknown> => readJsonBody(ctx.req, config.maxBodyBytes, deadlines);
  const emit = config.log ?? ((line: string) => process.stderr.write(`${line}\n`));
  const facts: ollama.OllamaModelFacts = {
    modelId: config.modelId, created, maxContext: config.maxContext, vision: config.vision, ...config.pack,
  };

  const sendError = (ctx: Koa.Context, dialect: Dialect, error: ApiError): void => {
    ctx.status = error.status;
    ctx.set(error.headers());
    // the rest of a refused body (drained, or never coming) must not be read as the next request;
    // but a body still arriving past the drain's bound keeps its connection until it has been
    // read and dropped (closing now would reset the connection under the unread answer)
    if ((error.kind === "too_large" || error.kind === "request_timeout") && mayCloseAfterRefusal(ctx.req)) ctx.set("connection", "close");
    ctx.body = errorBody(dialect, error);
  };

  const checkModel = (dialect: Dialect, model: string): void => {
    if (dialect === "ollama") {
      if (!ollama.isServedModel(model, config.modelId)) {
        throw new ApiError("model_not_found", `model '${model}' not found; this server serves '${ollama.ollamaName(config.modelId)}'`, "model");
      }
    } else if (model !== config.modelId) {
      throw new ApiError("model_not_found", `model '${model}' does not exist; this server serves '${config.modelId}'`, "model");
    }
  };

  const validateParams = (params: ReplyParams): void => {
    try {
      validateReplyParams(params);
    } catch (err) {
      if (err instanceof UserError) throw invalid(err.message);
      throw err;
    }
  };

  /** Exact prompt tokens; 400 for messages the model refuses or a prompt over the context. */
  const promptSize = (model: ServedModel, messages: Message[], enforce: boolean): number => {
    let tokens: number;
    try {
      tokens = model.countTokens(messages);
    } catch (err) {
      if (err instanceof UserError) throw invalid(err.message, "messages");
      throw err;
    }
    if (enforce && tokens >= config.maxContext) {
      throw invalid(`the conversation is ${tokens} tokens but the context holds ${config.maxContext}; shorten it or restart the server ` +
        "with a larger --max-context", "messages");
    }
    return tokens;
  };

  /** Ready model, images loaded, prompt measured. */
  const prepare = async (requested: RequestMessage[], enforceContext = true): Promise<{ model: ServedModel; messages: Message[]; promptTokens: number }> => {
    const model = queue.requireReady();
    const messages = await loadImages(requested, model);
    return { model, messages, promptTokens: promptSize(model, messages, enforceContext) };
  };

  const endpoint = (dialect: Dialect, handler: Handler, options: { auth?: boolean } = {}) => async (ctx: Koa.Context): Promise<void> => {
    const log = new RequestLog(ctx.method, ctx.path);
    try {
      if (options.auth ?? true) keys.check(ctx.headers);
      await handler(ctx, log);
      if (ctx.respond !== false) log.status = ctx.status;
    } catch (err) {
      if (err instanceof ClientGone) {
        log.status = 499;
        log.note = "client disconnected";
        ctx.respond = false;
        if (!ctx.res.headersSent) ctx.res.destroy();
      } else if (ctx.respond === false || ctx.res.headersSent) {
        // a stream that failed after its head: nothing more can be said to this client
        emit(`kvl serve: ${(err as Error).stack ?? String(err)}`);
        log.status = 500;
        if (!ctx.res.writableEnded) ctx.res.end();
      } else if (err instanceof ApiError) {
        sendError(ctx, dialect, err);
        log.status = err.status;
        log.note = err.message;
      } else {
        emit(`kvl serve: internal error (the server goes on):\n${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
        const error = new ApiError("server", `internal error: ${err instanceof Error ? `${err.name}: ${err.message}` : String(err)}`);
        sendError(ctx, dialect, error);
        log.status = 500;
        log.note = error.message;
      }
    }
    if (ctx.path !== "/healthz") emit(log.line());
  };

  /** Streams (koa hands the response to us) or collects one reply. */
  const reply = async (ctx: Koa.Context, log: RequestLog, messages: Message[], params: ReplyParams, shape: StreamShape | null) => {
    if (shape) {
      ctx.respond = false;
      try {
        await streamReply(queue, ctx.res, log, messages, params, shape, keepaliveMs);
      } catch (err) {
        ctx.respond = true; // thrown before the head went out (429, 503): an ordinary error answer
        throw err;
      }
      return null;
    }
    return collectReply(queue, ctx.res, log, messages, params);
  };

  const router = new Router();

  // -- the web chat page: public (it holds no secret; it asks for the key the API needs); not
  // logged, the log is of API requests -------------------------------------------------------
  const page = new WebPage();
  for (const path of page.paths()) {
    router.get(path, async (ctx) => page.serve(ctx));
  }

  router.get("/healthz", endpoint("openai", async (ctx) => {
    const body: Record<string, unknown> = { status: queue.status };
    if (queue.error) body.error = queue.error;
    ctx.status = queue.status === "failed" ? 503 : 200;
    ctx.body = body;
  }, { auth: false }));

  // -- OpenAI ------------------------------------------------------------------------------
  router.get("/v1/models", endpoint("openai", async (ctx) => {
    ctx.body = openai.modelsBody(facts);
  }));

  router.get("/v1/models/*id", endpoint("openai", async (ctx) => {
    const raw = (ctx.params as Record<string, unknown>).id;
    const id = Array.isArray(raw) ? raw.join("/") : String(raw);
    checkModel("openai", id);
    ctx.body = openai.modelCard(facts);
  }));

  router.post("/v1/chat/completions", endpoint("openai", async (ctx, log) => {
    const req = openai.parseChatRequest(await body(ctx), config.maxContext);
    checkModel("openai", req.model);
    validateParams(req.params);
    await checkGrammarBeforeReply(req.params, "response_format");
    const { messages } = await prepare(req.messages);
    const chunks = new openai.ChunkStream(config.modelId, req.includeUsage, undefined, undefined, req.tools);
    const shape: StreamShape | null = req.stream
      ? { contentType: SSE_CONTENT_TYPE, head: chunks.start(), delta: (t) => chunks.delta(t), finish: (r) => chunks.finish(r), error: (e) => chunks.error(e), keepalive: openai.KEEPALIVE }
      : null;
    const report = await reply(ctx, log, messages, req.params, shape);
    if (report) ctx.body = openai.completionBody(openai.newCompletionId(), Math.floor(Date.now() / 1000), config.modelId, report, req.tools);
  }));

  // -- Anthropic ---------------------------------------------------------------------------
  router.post("/v1/messages", endpoint("anthropic", async (ctx, log) => {
    const req = anthropic.parseMessagesRequest(await body(ctx), config.maxContext);
    checkModel("anthropic", req.model);
    validateParams(req.params);
    await checkGrammarBeforeReply(req.params, "tools");
    const { messages, promptTokens } = await prepare(req.messages);
    const stream = new anthropic.MessageStream(config.modelId, undefined, req.tools);
    const shape: StreamShape | null = req.stream
      ? { contentType: SSE_CONTENT_TYPE, head: stream.start(promptTokens), delta: (t) => stream.delta(t), finish: (r) => stream.finish(r), error: (e) => stream.error(e), keepalive: anthropic.PING }
      : null;
    const report = await reply(ctx, log, messages, req.params, shape);
    if (report) ctx.body = anthropic.messageBody(anthropic.newMessageId(), config.modelId, report, req.tools);
  }));

  router.post("/v1/messages/count_tokens", endpoint("anthropic", async (ctx, log) => {
    const req = anthropic.parseCountTokensRequest(await body(ctx));
    checkModel("anthropic", req.model);
    const { promptTokens } = await prepare(req.messages, false);
    log.promptTokens = promptTokens;
    ctx.body = { input_tokens: promptTokens };
  }));

  // -- Ollama ------------------------------------------------------------------------------
  const ollamaReply = (endpointName: ollama.OllamaEndpoint, parse: typeof ollama.parseChatRequest) => endpoint("ollama", async (ctx, log) => {
    const req = parse(await body(ctx), config.maxContext);
    checkModel("ollama", req.model);
    if (req.load) {
      queue.requireReady();
      ctx.body = ollama.loadBody(endpointName, req.model, req.load);
      return;
    }
    validateParams(req.params);
    await checkGrammarBeforeReply(req.params, "format");
    const { messages } = await prepare(req.messages);
    const lines = new ollama.LineStream(endpointName, req.model, req.tools);
    const shape: StreamShape | null = req.stream
      ? { contentType: NDJSON_CONTENT_TYPE, head: "", delta: (t) => lines.delta(t), finish: (r) => lines.finish(r, log.seconds), error: (e) => lines.error(e), keepalive: null }
      : null;
    const report = await reply(ctx, log, messages, req.params, shape);
    if (report) ctx.body = ollama.replyBody(endpointName, req.model, report, log.seconds, req.tools);
  });

  router.post("/api/chat", ollamaReply("chat", ollama.parseChatRequest));
  router.post("/api/generate", ollamaReply("generate", ollama.parseGenerateRequest));

  router.get("/api/tags", endpoint("ollama", async (ctx) => {
    ctx.body = ollama.tagsBody(facts);
  }));

  router.post("/api/show", endpoint("ollama", async (ctx) => {
    const json = await body(ctx);
    const obj = json !== null && typeof json === "object" && !Array.isArray(json) ? (json as Record<string, unknown>) : null;
    const model = obj?.model ?? obj?.name;
    if (typeof model !== "string" || !model) throw invalid("model is required", "model");
    checkModel("ollama", model);
    ctx.body = ollama.showBody(facts);
  }));

  router.get("/api/version", endpoint("ollama", async (ctx) => {
    ctx.body = { version: ollama.OLLAMA_VERSION };
  }));

  const app = new Koa();
  app.silent = true; // every error is answered and logged by endpoint(); koa's printer would repeat socket errors
  app.use(router.routes());
  app.use(async (ctx) => {
    // no route took the request: 405 when the path exists with another method, else 404
    const dialect = dialectOfPath(ctx.path);
    const log = new RequestLog(ctx.method, ctx.path);
    const known = (ctx as { matched?: unknown[] }).matched?.length ?? 0;
    const error = known
      ? new ApiError("method_not_allowed", `method ${ctx.method} is not allowed on ${ctx.path}`)
      : new ApiError("not_found", `no route ${ctx.method} ${ctx.path}`);
    sendError(ctx, dialect, error);
    log.status = error.status;
    emit(log.line());
  });
  return app;
}
