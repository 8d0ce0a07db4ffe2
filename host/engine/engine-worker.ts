/**
 * engine-worker.ts — the engine's thread: a worker_threads worker that owns one hosted engine
 * (engine-host.ts) and its sessions and runs every core call, so the main thread (CLI, HTTP, SSE)
 * never blocks on a prefill or a step.
 *
 * Owns: the worker side of the protocol in engine-protocol.ts — one request at a time, in
 * arrival order; replies carry the request id; errors carry what the main thread needs to
 * rebuild them (CoreError status, UserError). Logits, hidden states and image embeddings travel
 * as transferred buffers, never copied twice. Cancellation never goes through this thread's message queue (it
 * is busy in the core): the main thread writes the sessions' shared cancel flags directly.
 */
import { parentPort } from "node:worker_threads";

import { CoreError } from "../core/core-api.js";
import { type HostedEngine, openHostedEngine } from "./engine-host.js";
import { GenerationSession } from "./generation.js";
import { GrammarEngine } from "../text/grammar/token-mask.js";
import type { EngineReply, EngineRequest, SerializedError } from "./engine-protocol.js";
import { UserError, fsUserError } from "../system/user-error.js";

if (!parentPort) throw new Error("engine-worker.ts runs as a worker_threads worker");
const port = parentPort;

let hosted: HostedEngine | undefined;
/** The open request's imageRoom flags (engine-protocol.ts). */
let imageRoom: Int32Array<ArrayBufferLike> = new Int32Array(2).fill(1);
/** Constrained decoding for every session of the engine (the vocabulary is loaded on first use). */
let grammars: GrammarEngine | null = null;
const sessions = new Map<number, GenerationSession>();
let nextSession = 1;

function serialize(err: unknown): SerializedError {
  if (err instanceof CoreError) return { kind: "core", status: err.status, message: err.message };
  if (err instanceof UserError) return { kind: "user", message: err.message };
  const fsError = fsUserError(err); // a file the pack's reads need: missing, unreadable, ...
  if (fsError !== null) return { kind: "user", message: fsError.message };
  if (err instanceof RangeError || err instanceof TypeError) return { kind: "argument", message: err.message };
  const e = err instanceof Error ? err : new Error(String(err));
  return { kind: "internal", message: e.message, ...(e.stack !== undefined ? { stack: e.stack } : {}) };
}

/** Lends or takes back the image lines' room as the main thread last asked, if it changed; then
 * wakes whoever waits for it. Between core calls only: from a request, or between two tokens. */
function applyImageRoom(): void {
  const want = Atomics.load(imageRoom, 0);
  if (!hosted || want === Atomics.load(imageRoom, 1)) return;
  hosted.lendImageRoom(want === 1);
  Atomics.store(imageRoom, 1, want);
  Atomics.notify(imageRoom, 1);
}

function generation(id: number): GenerationSession {
  const s = sessions.get(id);
  if (!s) throw new RangeError(`no session ${id} in the engine worker`);
  return s;
}

function session(id: number) {
  return generation(id).raw;
}

function engine(): HostedEngine {
  if (!hosted) throw new RangeError("the engine worker has no engine open");
  return hosted;
}

async function handle(req: EngineRequest): Promise<{ reply: EngineReply; transfer: ArrayBuffer[] }> {
  switch (req.type) {
    case "open": {
      if (hosted) throw new RangeError("the engine worker already has an engine open");
      hosted = await openHostedEngine(req.backend, req.packDir, req.options);
      imageRoom = req.imageRoom;
      grammars = new GrammarEngine(req.packDir, hosted.engine.info().vocabSize);
      return { reply: { id: req.id, type: "opened", info: hosted.engine.info(), ranges: [...hosted.ranges], lendsImageRoom: hosted.lendsImageRoom },
        transfer: [] };
    }
    case "newSession": {
      const h = engine();
      const s = h.engine.newSession(req.options);
      const info = h.engine.info();
      const stopFlag = new Int32Array(new SharedArrayBuffer(4));
      const sessionId = nextSession++;
      sessions.set(sessionId, new GenerationSession(s, h.sampler, info.mediaPlaceholderTokenId, info.hiddenSize, stopFlag, grammars, applyImageRoom));
      return { reply: { id: req.id, type: "session", sessionId, cancelFlags: s.cancelFlags(), stopFlag }, transfer: [] };
    }
    case "prefill": {
      const logits = session(req.sessionId).prefill(req.tokens, req.media, req.logits);
      return { reply: { id: req.id, type: "logits", logits }, transfer: logits ? [logits.buffer as ArrayBuffer] : [] };
    }
    case "step": {
      const logits = session(req.sessionId).step(req.token);
      return { reply: { id: req.id, type: "logits", logits }, transfer: [logits.buffer as ArrayBuffer] };
    }
    case "generate": {
      const result = await generation(req.sessionId).generate(req.request, (token) => port.postMessage({ id: req.id, type: "token", token }));
      return { reply: { id: req.id, type: "generated", result }, transfer: [] };
    }
    case "reset": {
      generation(req.sessionId).reset();
      return { reply: { id: req.id, type: "position", position: 0 }, transfer: [] };
    }
    case "truncate": {
      const s = session(req.sessionId);
      s.truncate(req.n);
      return { reply: { id: req.id, type: "position", position: s.position() }, transfer: [] };
    }
    case "position":
      return { reply: { id: req.id, type: "position", position: generation(req.sessionId).session.position() }, transfer: [] };
    case "closeSession": {
      session(req.sessionId).close();
      sessions.delete(req.sessionId);
      return { reply: { id: req.id, type: "done" }, transfer: [] };
    }
    case "stats":
      return { reply: { id: req.id, type: "stats", stats: engine().engine.stats() }, transfer: [] };
    case "imageRoom":
      applyImageRoom();
      return { reply: { id: req.id, type: "done" }, transfer: [] };
    case "encodeImages": {
      const rows = engine().engine.encodeImages(req.pixelValues, req.grids);
      return { reply: { id: req.id, type: "embeddings", rows }, transfer: [rows.buffer as ArrayBuffer] };
    }
    case "visionBytes":
      return { reply: { id: req.id, type: "bytes", bytes: engine().engine.visionBytes(req.grids) }, transfer: [] };
    case "close": {
      for (const s of sessions.values()) s.close();
      sessions.clear();
      hosted?.close();
      hosted = undefined;
      grammars = null;
      return { reply: { id: req.id, type: "done" }, transfer: [] };
    }
  }
}

// One request at a time: the core is single-driver, and arrival order is the caller's order.
let queue: Promise<void> = Promise.resolve();
port.on("message", (req: EngineRequest) => {
  queue = queue.then(async () => {
    try {
      const { reply, transfer } = await handle(req);
      port.postMessage(reply, transfer);
    } catch (err) {
      port.postMessage({ id: req.id, type: "error", error: serialize(err) } satisfies EngineReply);
    }
  });
});
