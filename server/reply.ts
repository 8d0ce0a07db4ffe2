/**
 * reply.ts — one queued reply delivered over HTTP: collected into one JSON answer, or streamed
 * (SSE or NDJSON) as the model writes it; either way a client that disconnects cancels its job.
 *
 * Owns: submitting the Job, the streamed response (its headers, the head written as soon as the
 * request is queued, each text delta, keep-alives while nothing else goes out — a long prefill,
 * a wait in the queue — progress while an image encodes (imageProgress), and the ending: the API's final events, an error event, or nothing for a
 * client that left), watching the connection (a 'close' before the answer is complete cancels the
 * Job: skipped while it waits, stopped while it runs), and recording the reply in the request's
 * log line. Does not own: the event shapes (openai.ts, anthropic.ts, ollama.ts), the queue
 * (queue.ts), routing (app.ts).
 */
import type { ServerResponse } from "node:http";

import type { ImageEvent, ReplyReport } from "../host/chat-model.js";
import type { Message } from "../host/text/conversation.js";
import type { ReplyParams } from "../host/text/reply-params.js";
import { ClientGone } from "./body.js";
import { ApiError } from "./errors.js";
import { type EngineQueue, JobCancelled } from "./queue.js";

/** One request's line on stderr: `kvl serve: POST /v1/messages 200 prompt=812 reused=790 images=0 completion=64 3.214s`. */
export class RequestLog {
  readonly started = performance.now();
  status = 0;
  promptTokens: number | null = null;
  reused: number | null = null;
  images: number | null = null;
  completion: number | null = null;
  note = "";

  constructor(readonly method: string, readonly path: string) {}

  record(report: ReplyReport): void {
    this.promptTokens = report.usage.promptTokens;
    this.reused = report.usage.reusedPromptTokens;
    this.images = report.usage.imagesEncoded;
    this.completion = report.usage.completionTokens;
    if (report.finishReason === "cancelled") this.note = "cancelled";
  }

  get seconds(): number {
    return (performance.now() - this.started) / 1000;
  }

  line(): string {
    const show = (v: number | null): string => (v === null ? "-" : String(v));
    const text = `kvl serve: ${this.method} ${this.path} ${this.status} prompt=${show(this.promptTokens)} reused=${show(this.reused)} ` +
      `images=${show(this.images)} completion=${show(this.completion)} ${this.seconds.toFixed(3)}s`;
    return this.note ? `${text} (${this.note})` : text;
  }
}

/** How one API streams a reply. */
export interface StreamShape {
  contentType: string;
  /** Written as soon as the request is queued. */
  head: string;
  delta(text: string): string;
  finish(report: ReplyReport): string;
  error(error: ApiError): string;
  /** Written after keepaliveMs without any other write, or null for none. */
  keepalive: string | null;
}

export const SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8";
export const NDJSON_CONTENT_TYPE = "application/x-ndjson";

/**
 * What a stream writes while an image of its reply encodes (the engine's "encoding" events, about
 * every second once an encode has run for one): where the API's keep-alive is an SSE comment
 * (OpenAI) a comment saying which image and for how long, e.g. `: kvl: encoding image 1/2 (1024
 * media tokens), 3 s`; where it is an event (Anthropic's `event: ping`) that event, the one thing
 * its clients accept between events; where there is none (Ollama's NDJSON: every line is a reply
 * object its clients parse, and Ollama itself sends nothing while it processes an image) nothing.
 */
export function imageProgress(shape: StreamShape, e: ImageEvent): string | null {
  if (e.phase !== "encoding" || shape.keepalive === null) return null;
  if (!shape.keepalive.startsWith(":")) return shape.keepalive;
  return `: kvl: encoding image ${e.index + 1}/${e.count} (${e.mediaTokens} media tokens), ${Math.floor(e.elapsedS)} s\n\n`;
}

/** The client closed the connection (perhaps before we listened for it: while images loaded). */
function gone(res: ServerResponse): boolean {
  return res.destroyed || res.req.socket.destroyed;
}

function shuttingDown(): ApiError {
  return new ApiError("unavailable", "the server is shutting down; retry against a running one");
}

/** Runs the reply and returns its report; ClientGone if the client left, 503 if the server stops. */
export async function collectReply(queue: EngineQueue, res: ServerResponse, log: RequestLog, messages: Message[], params: ReplyParams): Promise<ReplyReport> {
  const job = queue.submit(messages, params, () => undefined);
  const onClose = (): void => {
    if (!res.writableEnded) job.cancel();
  };
  res.on("close", onClose);
  if (gone(res)) job.cancel();
  let report: ReplyReport;
  try {
    report = await job.result;
  } catch (err) {
    if (err instanceof JobCancelled) throw new ClientGone();
    throw err;
  } finally {
    res.off("close", onClose);
  }
  log.record(report);
  if (report.finishReason === "cancelled") {
    if (job.cancelled) throw new ClientGone();
    throw shuttingDown();
  }
  return report;
}

/**
 * Streams the reply on `res` (the caller has set koa's ctx.respond = false once this returns a
 * promise: the response is ours). Errors before the first byte (429, 503) are thrown, so they
 * get a plain status; after it they become the API's error event.
 */
export async function streamReply(queue: EngineQueue, res: ServerResponse, log: RequestLog, messages: Message[], params: ReplyParams,
  shape: StreamShape, keepaliveMs: number): Promise<void> {
  let timer: NodeJS.Timeout | null = null;
  const write = (text: string): void => {
    if (!text || res.writableEnded || res.destroyed) return;
    res.write(text);
    timer?.refresh();
  };
  let headed = false; // the job starts at once: progress before the head is not written
  const job = queue.submit(messages, params, (text) => write(shape.delta(text)), {
    onImage: (e) => {
      const text = imageProgress(shape, e);
      if (text !== null && headed) write(text);
    },
  });
  res.on("error", () => undefined);
  res.writeHead(200, { "content-type": shape.contentType, "cache-control": "no-cache", "x-accel-buffering": "no", connection: "keep-alive" });
  log.status = 200;
  let finished = false;
  const onClose = (): void => {
    if (!finished) job.cancel();
  };
  res.on("close", onClose);
  if (gone(res)) job.cancel();
  write(shape.head);
  headed = true;
  const keepalive = shape.keepalive;
  if (keepalive) timer = setInterval(() => write(keepalive), keepaliveMs); // every write restarts its count
  try {
    const report = await job.result;
    finished = true;
    log.record(report);
    if (report.finishReason !== "cancelled") {
      write(shape.finish(report));
    } else if (job.cancelled) {
      log.status = 499;
      log.note = "client disconnected";
    } else {
      write(shape.error(shuttingDown()));
    }
  } catch (err) {
    finished = true;
    if (err instanceof JobCancelled) {
      log.status = 499;
      log.note = "client disconnected";
    } else {
      const error = err instanceof ApiError ? err : new ApiError("server", `internal error: ${(err as Error).message}`);
      if (!(err instanceof ApiError)) process.stderr.write(`kvl serve: ${(err as Error).stack ?? String(err)}\n`);
      log.note = `error: ${error.message}`;
      write(shape.error(error));
    }
  } finally {
    if (timer) clearInterval(timer);
    res.off("close", onClose);
    if (!res.writableEnded && !res.destroyed) res.end();
  }
}
