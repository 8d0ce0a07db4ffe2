/**
 * engine-client.ts — the main thread's handle on the engine worker: the same engine and session
 * operations as core-api.ts's CoreEngine, as promises, with cancellation.
 *
 * Owns: starting and stopping the worker (the compiled dist/host/engine/engine-worker.js), matching
 * replies to requests (image encoding among them), rebuilding errors (CoreError, UserError, and
 * CorruptPackError for KVL_ERR_CORRUPT, PackReadError for KVL_ERR_IO) from the worker's, and cancellation: a session's cancel() stores 1 in its shared cancel flags, which
 * the core reads before each layer while the worker is busy inside it; every call clears them
 * first. The worker exiting fails every pending call with one clear error.
 */
import { join } from "node:path";
import { Worker } from "node:worker_threads";

import { type BackendName, KVL_ERR_CORRUPT, KVL_ERR_IO, CoreError, CorruptPackError, PackReadError, type EngineInfo, type EngineStats, type LogitsMode, type SessionOptions } from "../core/core-api.js";
import type { HostedEngineOptions } from "./engine-host.js";
import type { EngineReply, EngineRequest, SerializedError } from "./engine-protocol.js";
import type { GenerationRequest, GenerationResult } from "./generation.js";
import { packageRoot } from "../system/paths.js";
import { UserError } from "../system/user-error.js";

/** The compiled worker; the TypeScript sources cannot run in a worker without a loader. */
export const ENGINE_WORKER_PATH = join(packageRoot, "dist", "host", "engine", "engine-worker.js");

/** Atomics.waitAsync (every supported Node has it; this TypeScript lib does not declare it). */
interface AtomicsWaitAsync {
  waitAsync(array: Int32Array, index: number, value: number): { async: false; value: string } | { async: true; value: Promise<string> };
}

/** Distributive Omit over the request union. */
type RequestBody = EngineRequest extends infer R ? (R extends EngineRequest ? Omit<R, "id"> : never) : never;

function rebuild(error: SerializedError): Error {
  switch (error.kind) {
    case "core":
      // corrupt pack data is the user's to repair (kvl doctor), not a bug: a one-line error
      if (error.status === KVL_ERR_CORRUPT) return new CorruptPackError(error.message);
      // a read that failed (the file shrank or went away, the disk failed): the user's to fix too
      if (error.status === KVL_ERR_IO) return new PackReadError(error.message);
      return new CoreError(error.status, error.message);
    case "user":
      return new UserError(error.message);
    case "argument":
      return new RangeError(error.message);
    case "internal": {
      const e = new Error(`engine worker: ${error.message}`);
      if (error.stack) e.stack = `${e.message}\n(worker stack)\n${error.stack}`;
      return e;
    }
  }
}

export class EngineClient {
  readonly #worker: Worker;
  readonly #pending = new Map<number, { resolve: (r: EngineReply) => void; reject: (e: Error) => void; onToken?: (token: number) => void }>();
  #nextId = 1;
  #exited: Error | undefined;
  info!: EngineInfo;
  ranges!: Array<[number, number]>;
  /** Whether the plan lends the image lines to the expert caches (setImageRoomLent does something). */
  lendsImageRoom = false;
  /** engine-protocol.ts's imageRoom flags, shared with the worker. */
  readonly #imageRoom = new Int32Array(new SharedArrayBuffer(8)).fill(1);

  private constructor(worker: Worker) {
    this.#worker = worker;
    worker.on("message", (reply: EngineReply) => {
      const p = this.#pending.get(reply.id);
      if (!p) return;
      if (reply.type === "token") {
        p.onToken?.(reply.token);
        return;
      }
      this.#pending.delete(reply.id);
      if (reply.type === "error") p.reject(rebuild(reply.error));
      else p.resolve(reply);
    });
    const fail = (err: Error): void => {
      this.#exited ??= err;
      for (const p of this.#pending.values()) p.reject(this.#exited);
      this.#pending.clear();
    };
    worker.on("error", (err) => fail(new Error(`the engine worker failed: ${err.message}`)));
    worker.on("exit", (code) => fail(new Error(`the engine worker exited (code ${code})`)));
  }

  /** Starts a worker and opens the pack in it. */
  static async open(backend: BackendName, packDir: string, options: HostedEngineOptions, workerPath = ENGINE_WORKER_PATH): Promise<EngineClient> {
    // execArgv: [] keeps a parent's loader flags (a test runner's) out of the engine's thread
    const client = new EngineClient(new Worker(workerPath, { execArgv: [] }));
    try {
      const reply = await client.request({ type: "open", backend, packDir, options, imageRoom: client.#imageRoom });
      if (reply.type !== "opened") throw new Error(`engine worker: unexpected reply ${reply.type} to open`);
      client.info = reply.info;
      client.ranges = reply.ranges;
      client.lendsImageRoom = reply.lendsImageRoom;
      return client;
    } catch (err) {
      await client.#worker.terminate();
      throw err;
    }
  }

  request(body: RequestBody, transfer: ArrayBuffer[] = [], onToken?: (token: number) => void): Promise<EngineReply> {
    if (this.#exited) return Promise.reject(this.#exited);
    const id = this.#nextId++;
    return new Promise((resolve, reject) => {
      this.#pending.set(id, { resolve, reject, ...(onToken ? { onToken } : {}) });
      this.#worker.postMessage({ ...body, id }, transfer);
    });
  }

  async newSession(options: SessionOptions = {}): Promise<ClientSession> {
    const reply = await this.request({ type: "newSession", options });
    if (reply.type !== "session") throw new Error(`engine worker: unexpected reply ${reply.type} to newSession`);
    return new ClientSession(this, reply.sessionId, reply.cancelFlags, reply.stopFlag, this.info.vocabSize);
  }

  async stats(): Promise<EngineStats> {
    const reply = await this.request({ type: "stats" });
    if (reply.type !== "stats") throw new Error(`engine worker: unexpected reply ${reply.type} to stats`);
    return reply.stats;
  }

  /**
   * Media embeddings of images (CoreEngine.encodeImages): rows x hidden_size FP32 floats, not
   * rounded. The worker copies pixelValues and grids (structured clone); the rows come back as a
   * transferred buffer. CoreError / RangeError / UserError (no vision) as the engine throws them.
   */
  async encodeImages(pixelValues: Float32Array, grids: Int32Array): Promise<Float32Array> {
    const reply = await this.request({ type: "encodeImages", pixelValues, grids });
    if (reply.type !== "embeddings") throw new Error(`engine worker: unexpected reply ${reply.type} to encodeImages`);
    return reply.rows;
  }

  /**
   * Lends the image lines' RAM to the expert caches (true) or takes it back for an image (false:
   * resolves once the caches have given it back, their pages returned to the OS). An idle worker
   * applies it at once; one inside a generate between two tokens, so an image's decode never
   * waits for a whole reply (engine-host.ts lendImageRoom). Nothing when the plan lends nothing.
   */
  async setImageRoomLent(lent: boolean): Promise<void> {
    if (!this.lendsImageRoom) return;
    const want = lent ? 1 : 0;
    Atomics.store(this.#imageRoom, 0, want);
    const applied = this.request({ type: "imageRoom" });
    for (;;) {
      const have = Atomics.load(this.#imageRoom, 1);
      if (have === want) break;
      const waiting = (Atomics as unknown as AtomicsWaitAsync).waitAsync(this.#imageRoom, 1, have);
      // the worker's reply settles it too (idle worker; or a failure, which it rethrows)
      await Promise.race([applied, waiting.async ? waiting.value : Promise.resolve()]);
      if (Atomics.load(this.#imageRoom, 0) !== want) break; // asked otherwise meanwhile
    }
    applied.catch(() => undefined); // a later failure is the next call's to report
  }

  /** Working memory of one encodeImages call for these grids (CoreEngine.visionBytes). */
  async visionBytes(grids: Int32Array): Promise<number> {
    const reply = await this.request({ type: "visionBytes", grids });
    if (reply.type !== "bytes") throw new Error(`engine worker: unexpected reply ${reply.type} to visionBytes`);
    return reply.bytes;
  }

  /** Closes the engine and stops the worker. */
  async close(): Promise<void> {
    if (!this.#exited) await this.request({ type: "close" });
    await this.#worker.terminate();
  }
}

export class ClientSession {
  constructor(private readonly client: EngineClient, readonly id: number, private readonly flags: Int32Array[],
    private readonly stopFlag: Int32Array, private readonly vocab: number) {}

  #clear(): void {
    for (const f of this.flags) Atomics.store(f, 0, 0);
    Atomics.store(this.stopFlag, 0, 0);
  }

  /**
   * Stops the running call at once: a prefill or step rejects with CoreError "cancelled" (the
   * session rolls back); a generate ends with finishReason "cancelled", keeping what it made.
   */
  cancel(): void {
    Atomics.store(this.stopFlag, 0, 1);
    for (const f of this.flags) Atomics.store(f, 0, 1);
  }

  /** Ends a running generate after its current token (finishReason "stopped"): for stop strings. */
  stop(): void {
    Atomics.store(this.stopFlag, 0, 1);
  }

  /** One reply (generation.ts); onToken sees each sampled token as the worker makes it. */
  async generate(request: GenerationRequest, onToken: (token: number) => void): Promise<GenerationResult> {
    this.#clear();
    const reply = await this.client.request({ type: "generate", sessionId: this.id, request }, [], onToken);
    if (reply.type !== "generated") throw new Error(`engine worker: unexpected reply ${reply.type} to generate`);
    return reply.result;
  }

  /** Forgets the conversation (KV and keys). */
  async reset(): Promise<void> {
    await this.client.request({ type: "reset", sessionId: this.id });
  }

  async prefill(tokens: Int32Array, media: Float32Array | null, logits: LogitsMode): Promise<Float32Array | null> {
    this.#clear();
    const reply = await this.client.request({ type: "prefill", sessionId: this.id, tokens, media, logits });
    if (reply.type !== "logits") throw new Error(`engine worker: unexpected reply ${reply.type} to prefill`);
    return reply.logits;
  }

  async step(token: number): Promise<Float32Array> {
    this.#clear();
    const reply = await this.client.request({ type: "step", sessionId: this.id, token });
    if (reply.type !== "logits" || !reply.logits || reply.logits.length !== this.vocab) throw new Error("engine worker: bad reply to step");
    return reply.logits;
  }

  async truncate(n: number): Promise<number> {
    const reply = await this.client.request({ type: "truncate", sessionId: this.id, n });
    if (reply.type !== "position") throw new Error(`engine worker: unexpected reply ${reply.type} to truncate`);
    return reply.position;
  }

  async position(): Promise<number> {
    const reply = await this.client.request({ type: "position", sessionId: this.id });
    if (reply.type !== "position") throw new Error(`engine worker: unexpected reply ${reply.type} to position`);
    return reply.position;
  }

  async close(): Promise<void> {
    await this.client.request({ type: "closeSession", sessionId: this.id });
  }
}
