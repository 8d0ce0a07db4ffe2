/**
 * steps.ts — the steps every API request shares, in the order it goes through them: key → body →
 * (the dialect's parse, in the route's handler) → model id → reply parameters → ready → images,
 * each decoded whole → prompt size → queue → answer; everything that can be checked is checked
 * before a stream's 200 goes out. Also the wrapper each route runs in (key check, rendering any
 * error in the route's dialect, a 500 for a bug that keeps the server serving, one log line) and
 * the answer for a request no route takes (404, or 405 for a known path).
 *
 * Owns: ServerConfig and RequestSteps. Does not own: which routes there are (routes.ts), the koa
 * app (app.ts), body reading (body.ts), the dialects (openai.ts, anthropic.ts, ollama.ts), images
 * (images.ts), the queue (queue.ts), streaming (reply.ts).
 */
import type Koa from "koa";

import type { ExpertDtype, TrunkDtype } from "../host/pack/pack-format.js";
import type { Message } from "../host/text/conversation.js";
import type { ReplyParams } from "../host/text/reply-params.js";
import { validateReplyParams } from "../host/text/reply-params.js";
import { UserError } from "../host/system/user-error.js";
import { KeyCheck } from "./auth.js";
import { ClientGone, DEFAULT_READ_DEADLINES, type ReadDeadlines, mayCloseAfterRefusal, readJsonBody } from "./body.js";
import { ApiError, type Dialect, dialectOfPath, errorBody, invalid } from "./errors.js";
import { type RequestMessage, loadImages } from "./images.js";
import type { ServedModel } from "./model.js";
import * as ollama from "./ollama.js";
import type { EngineQueue } from "./queue.js";
import { RequestLog, type StreamShape, collectReply, streamReply } from "./reply.js";

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

/** What a route needs to run besides its handler. */
export interface RouteSettings {
  readonly dialect: Dialect;
  /** false: answered without the API key (/healthz) */
  readonly auth?: boolean;
}

export type RouteHandler = (ctx: Koa.Context, log: RequestLog, steps: RequestSteps) => Promise<void>;

/** The shared steps over one server's queue and configuration. */
export class RequestSteps {
  readonly queue: EngineQueue;
  readonly config: ServerConfig;
  /** What the model-listing routes say of the served model. */
  readonly facts: ollama.OllamaModelFacts;
  readonly #keys: KeyCheck;
  readonly #keepaliveMs: number;
  readonly #deadlines: ReadDeadlines;
  readonly #emit: (line: string) => void;

  constructor(queue: EngineQueue, config: ServerConfig) {
    this.queue = queue;
    this.config = config;
    this.facts = {
      modelId: config.modelId, created: Math.floor(Date.now() / 1000), maxContext: config.maxContext, vision: config.vision, ...config.pack,
    };
    this.#keys = new KeyCheck(config.apiKey);
    this.#keepaliveMs = config.keepaliveMs ?? KEEPALIVE_MS;
    this.#deadlines = config.deadlines ?? DEFAULT_READ_DEADLINES;
    this.#emit = config.log ?? ((line: string) => process.stderr.write(`${line}\n`));
  }

  /** The request's JSON body (body.ts: size bound, deadlines, one clear 400). */
  body(ctx: Koa.Context): Promise<unknown> {
    return readJsonBody(ctx.req, this.config.maxBodyBytes, this.#deadlines);
  }

  /** 404 in the dialect's words unless `model` names the served model. */
  checkModel(dialect: Dialect, model: string): void {
    const served = this.config.modelId;
    if (dialect === "ollama") {
      if (!ollama.isServedModel(model, served)) {
        throw new ApiError("model_not_found", `model '${model}' not found; this server serves '${ollama.ollamaName(served)}'`, "model");
      }
    } else if (model !== served) {
      throw new ApiError("model_not_found", `model '${model}' does not exist; this server serves '${served}'`, "model");
    }
  }

  /** 400 for reply parameters the engine would refuse. */
  validateParams(params: ReplyParams): void {
    try {
      validateReplyParams(params);
    } catch (err) {
      if (err instanceof UserError) throw invalid(err.message);
      throw err;
    }
  }

  /** Ready model, images loaded, prompt measured (400 over the context when `enforceContext`). */
  async prepare(requested: RequestMessage[], enforceContext = true): Promise<{ model: ServedModel; messages: Message[]; promptTokens: number }> {
    const model = this.queue.requireReady();
    const messages = await loadImages(requested, model);
    return { model, messages, promptTokens: this.#promptSize(model, messages, enforceContext) };
  }

  /** Streams (koa hands the response to us; null back) or collects one reply. */
  async reply(ctx: Koa.Context, log: RequestLog, messages: Message[], params: ReplyParams, shape: StreamShape | null) {
    if (shape) {
      ctx.respond = false;
      try {
        await streamReply(this.queue, ctx.res, log, messages, params, shape, this.#keepaliveMs);
      } catch (err) {
        ctx.respond = true; // thrown before the head went out (429, 503): an ordinary error answer
        throw err;
      }
      return null;
    }
    return collectReply(this.queue, ctx.res, log, messages, params);
  }

  /** Runs one route's handler: key, handler, any error in the route's dialect, the log line. */
  async run(route: RouteSettings, handle: RouteHandler, ctx: Koa.Context): Promise<void> {
    const log = new RequestLog(ctx.method, ctx.path);
    try {
      if (route.auth ?? true) this.#keys.check(ctx.headers);
      await handle(ctx, log, this);
      if (ctx.respond !== false) log.status = ctx.status;
    } catch (err) {
      if (err instanceof ClientGone) {
        log.status = 499;
        log.note = "client disconnected";
        ctx.respond = false;
        if (!ctx.res.headersSent) ctx.res.destroy();
      } else if (ctx.respond === false || ctx.res.headersSent) {
        // a stream that failed after its head: nothing more can be said to this client
        this.#emit(`kvl serve: ${(err as Error).stack ?? String(err)}`);
        log.status = 500;
        if (!ctx.res.writableEnded) ctx.res.end();
      } else if (err instanceof ApiError) {
        this.#sendError(ctx, route.dialect, err);
        log.status = err.status;
        log.note = err.message;
      } else {
        this.#emit(`kvl serve: internal error (the server goes on):\n${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
        const error = new ApiError("server", `internal error: ${err instanceof Error ? `${err.name}: ${err.message}` : String(err)}`);
        this.#sendError(ctx, route.dialect, error);
        log.status = 500;
        log.note = error.message;
      }
    }
    if (ctx.path !== "/healthz") this.#emit(log.line());
  }

  /** No route took the request: 405 when the path exists with another method, else 404. */
  refuseUnrouted(ctx: Koa.Context): void {
    const log = new RequestLog(ctx.method, ctx.path);
    const known = (ctx as { matched?: unknown[] }).matched?.length ?? 0;
    const error = known
      ? new ApiError("method_not_allowed", `method ${ctx.method} is not allowed on ${ctx.path}`)
      : new ApiError("not_found", `no route ${ctx.method} ${ctx.path}`);
    this.#sendError(ctx, dialectOfPath(ctx.path), error);
    log.status = error.status;
    this.#emit(log.line());
  }

  /** Exact prompt tokens; 400 for messages the model refuses or a prompt over the context. */
  #promptSize(model: ServedModel, messages: Message[], enforce: boolean): number {
    let tokens: number;
    try {
      tokens = model.countTokens(messages);
    } catch (err) {
      if (err instanceof UserError) throw invalid(err.message, "messages");
      throw err;
    }
    if (enforce && tokens >= this.config.maxContext) {
      throw invalid(`the conversation is ${tokens} tokens but the context holds ${this.config.maxContext}; shorten it or restart the server ` +
        "with a larger --max-context", "messages");
    }
    return tokens;
  }

  #sendError(ctx: Koa.Context, dialect: Dialect, error: ApiError): void {
    ctx.status = error.status;
    ctx.set(error.headers());
    // the rest of a refused body (drained, or never coming) must not be read as the next request;
    // but a body still arriving past the drain's bound keeps its connection until it has been
    // read and dropped (closing now would reset the connection under the unread answer)
    if ((error.kind === "too_large" || error.kind === "request_timeout") && mayCloseAfterRefusal(ctx.req)) ctx.set("connection", "close");
    ctx.body = errorBody(dialect, error);
  }
}
