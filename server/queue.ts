/**
 * queue.ts — the one owner of the engine: loads the model in the background, then runs replies
 * one at a time in arrival order, with a bounded number waiting.
 *
 * Owns: the status (loading → ready | failed, with the reason), the bounded wait list (full →
 * 429 with Retry-After; loading → 503 with Retry-After; failed or shutting down → 503), running
 * one Job at a time on the model's single conversation (so its KV carries over and the next
 * request reuses the longest common prefix), cancelling a Job whose client left (a waiting one is
 * skipped, a running one stops at the next token or inside prefill), turning what generation
 * throws into ApiErrors (a UserError is the client's 400; corrupt pack data, CorruptPackError,
 * is a logged 500 naming the file and tensor, as the server's fault, not the client's and not
 * transient; a pack read that failed, PackReadError, is the same 500 naming the file, the read
 * and the OS's reason; anything else a logged 500 — the queue goes on either way), and shutdown (the
 * running reply stops, waiting ones get 503).
 * Does not own: HTTP or the API dialects (app.ts and the dialect modules), the model itself
 * (model.ts / host/chat-model.ts).
 */
import type { ReplyHooks, ReplyReport } from "../host/chat-model.js";
import type { Message } from "../host/text/conversation.js";
import { CorruptPackError, PackReadError } from "../host/core/core-api.js";
import type { ReplyParams } from "../host/text/reply-params.js";
import { UserError } from "../host/system/user-error.js";
import { ApiError, RETRY_AFTER_S } from "./errors.js";
import type { ServedModel } from "./model.js";

type EngineStatus = "loading" | "ready" | "failed";

/** A Job that ended because its client left before it ran. */
export class JobCancelled extends Error {
  constructor() {
    super("the request was cancelled");
    this.name = "JobCancelled";
  }
}

/** One reply: waiting, then running, then done. */
class Job {
  #state: "waiting" | "running" | "done" = "waiting";
  #cancelled = false;
  readonly result: Promise<ReplyReport>;
  #resolve!: (report: ReplyReport) => void;
  #reject!: (err: Error) => void;

  constructor(readonly queue: EngineQueue, readonly messages: Message[], readonly params: ReplyParams, readonly onText: (text: string) => void,
    readonly hooks: ReplyHooks = {}) {
    this.result = new Promise<ReplyReport>((resolve, reject) => {
      this.#resolve = resolve;
      this.#reject = reject;
    });
    this.result.catch(() => undefined); // a caller that stopped listening must not crash the process
  }

  get state(): "waiting" | "running" | "done" {
    return this.#state;
  }

  get cancelled(): boolean {
    return this.#cancelled;
  }

  /** The client left: skip the job if it waits, stop it if it runs. Idempotent. */
  cancel(): void {
    if (this.#cancelled || this.#state === "done") return;
    this.#cancelled = true;
    this.queue.cancelJob(this);
  }

  /** @internal */
  markRunning(): void {
    this.#state = "running";
  }

  /** @internal */
  settle(outcome: { report: ReplyReport } | { error: Error }): void {
    if (this.#state === "done") return;
    this.#state = "done";
    if ("report" in outcome) this.#resolve(outcome.report);
    else this.#reject(outcome.error);
  }
}

export class EngineQueue {
  #status: EngineStatus = "loading";
  #error: string | null = null;
  #model: ServedModel | null = null;
  #stopping = false;
  readonly #waiting: Job[] = [];
  #current: Job | null = null;

  constructor(readonly maxQueue: number, readonly log: (line: string) => void = (line) => process.stderr.write(`${line}\n`)) {
    if (!Number.isSafeInteger(maxQueue) || maxQueue < 1) throw new UserError(`--max-queue must be at least 1 (got ${maxQueue})`);
  }

  get status(): EngineStatus {
    return this.#status;
  }

  /** Why loading failed (failed only). */
  get error(): string | null {
    return this.#error;
  }

  get stopping(): boolean {
    return this.#stopping;
  }

  /** Requests waiting (not counting the running one). */
  get waiting(): number {
    return this.#waiting.length;
  }

  get running(): boolean {
    return this.#current !== null;
  }

  /** Loads the model; never throws (a failure sets status "failed" and the reason, and is returned). */
  async start(open: () => Promise<ServedModel>): Promise<Error | null> {
    try {
      const model = await open();
      if (this.#stopping) {
        await model.close();
        return null;
      }
      this.#model = model;
      this.#status = "ready";
      return null;
    } catch (err) {
      this.#status = "failed";
      this.#error = err instanceof Error ? err.message : String(err);
      return err instanceof Error ? err : new Error(String(err));
    }
  }

  /** The model, once ready; else the 503 a request gets. */
  requireReady(): ServedModel {
    if (this.#status === "loading") {
      throw new ApiError("unavailable", "the model is still loading; retry when GET /healthz says ready", null, RETRY_AFTER_S);
    }
    if (this.#status === "failed" || !this.#model) throw new ApiError("unavailable", `the model could not be loaded: ${this.#error}`);
    if (this.#stopping) throw new ApiError("unavailable", "the server is shutting down");
    return this.#model;
  }

  /** Queues a reply; 503 while not ready, 429 when maxQueue requests already wait. */
  submit(messages: Message[], params: ReplyParams, onText: (text: string) => void, hooks: ReplyHooks = {}): Job {
    this.requireReady();
    if (this.#waiting.length >= this.maxQueue) {
      throw new ApiError("rate_limit", `the server is busy: ${this.#waiting.length} request(s) are already waiting; retry shortly (see Retry-After)`,
        null, RETRY_AFTER_S);
    }
    const job = new Job(this, messages, params, onText, hooks);
    this.#waiting.push(job);
    this.#pump();
    return job;
  }

  /** @internal (Job.cancel) */
  cancelJob(job: Job): void {
    const at = this.#waiting.indexOf(job);
    if (at >= 0) {
      this.#waiting.splice(at, 1);
      this.log("kvl serve: skipped a queued request whose client disconnected");
      job.settle({ error: new JobCancelled() });
      return;
    }
    if (job === this.#current) this.#model?.cancel();
  }

  #pump(): void {
    if (this.#current || this.#waiting.length === 0) return;
    const job = this.#waiting.shift()!;
    this.#current = job;
    void this.#run(job);
  }

  async #run(job: Job): Promise<void> {
    try {
      if (this.#stopping) {
        job.settle({ error: new ApiError("unavailable", "the server is shutting down") });
        return;
      }
      job.markRunning();
      const model = this.#model!;
      const generation = model.generate(job.messages, job.params, (text) => {
        if (!job.cancelled) job.onText(text);
      }, job.hooks);
      // a cancel that came while the reply was being set up (generate runs synchronously up to
      // its first await, so the model now knows it is running)
      if (job.cancelled || this.#stopping) model.cancel();
      const report = await generation;
      if (report.finishReason === "cancelled") {
        const why = this.#stopping && !job.cancelled ? "the server is stopping" : "the client disconnected";
        this.log(`kvl serve: generation cancelled after ${report.usage.completionTokens} token(s): ${why}`);
      }
      job.settle({ report });
    } catch (err) {
      if (job.cancelled) {
        job.settle({ error: new JobCancelled() }); // whatever broke, nobody is waiting for it
      } else if (this.#stopping) {
        job.settle({ error: new ApiError("unavailable", "the server is shutting down") });
      } else if (err instanceof CorruptPackError || err instanceof PackReadError) {
        // before UserError: the pack is damaged, or its files changed or its disk failed under
        // the engine, which the client cannot fix; the engine stays up (the turn was rolled back)
        this.log(`kvl serve: ${err.message}`);
        job.settle({ error: new ApiError("server", err.message) });
      } else if (err instanceof UserError) {
        job.settle({ error: new ApiError("invalid_request", err.message) });
      } else if (err instanceof ApiError) {
        job.settle({ error: err });
      } else {
        this.log(`kvl serve: generation failed (the server goes on):\n${err instanceof Error ? (err.stack ?? err.message) : String(err)}`);
        job.settle({ error: new ApiError("server", `generation failed: ${err instanceof Error ? err.message : String(err)}`) });
      }
    } finally {
      this.#current = null;
      this.#pump();
    }
  }

  /** Stops the running reply and answers every waiting request 503, so open streams end now. */
  beginShutdown(): void {
    if (this.#stopping) return;
    this.#stopping = true;
    if (this.#current) this.#model?.cancel();
    for (const job of this.#waiting.splice(0)) job.settle({ error: new ApiError("unavailable", "the server is shutting down") });
  }

  /** Shuts down and closes the model once the running reply has stopped. */
  async close(): Promise<void> {
    this.beginShutdown();
    await this.#current?.result.catch(() => undefined);
    const model = this.#model;
    this.#model = null;
    await model?.close();
  }
}
