/**
 * engine-protocol.ts — the messages between the main thread (engine-client.ts) and the engine
 * worker (engine-worker.ts). Types only; both sides import them, so the protocol has one
 * definition.
 */
import type { BackendName, EngineInfo, EngineStats, LogitsMode, SessionOptions } from "../core/core-api.js";
import type { HostedEngineOptions } from "./engine-host.js";
import type { GenerationRequest, GenerationResult } from "./generation.js";

export type EngineRequest =
  /** imageRoom: [0] what the main thread wants (1: the image lines lent to the expert caches, 0:
   * kept for an image), [1] what the engine has; both start at 1 (engine-host.ts lendImageRoom). */
  | { id: number; type: "open"; backend: BackendName; packDir: string; options: HostedEngineOptions; imageRoom: Int32Array }
  | { id: number; type: "newSession"; options: SessionOptions }
  | { id: number; type: "prefill"; sessionId: number; tokens: Int32Array; media: Float32Array | null; logits: LogitsMode }
  | { id: number; type: "step"; sessionId: number; token: number }
  | { id: number; type: "generate"; sessionId: number; request: GenerationRequest }
  | { id: number; type: "reset"; sessionId: number }
  | { id: number; type: "truncate"; sessionId: number; n: number }
  | { id: number; type: "position"; sessionId: number }
  | { id: number; type: "closeSession"; sessionId: number }
  | { id: number; type: "stats" }
  /** Applies imageRoom[0] now if the worker is idle (a running generate applies it between tokens). */
  | { id: number; type: "imageRoom" }
  /** Media embeddings of images (CoreEngine.encodeImages: FP32, not rounded). */
  | { id: number; type: "encodeImages"; pixelValues: Float32Array; grids: Int32Array }
  | { id: number; type: "visionBytes"; grids: Int32Array }
  | { id: number; type: "close" };

/** An error as it crosses threads: enough to rebuild the same class on the main thread. */
export type SerializedError =
  | { kind: "core"; status: number; message: string }
  | { kind: "user"; message: string }
  | { kind: "argument"; message: string }
  | { kind: "internal"; message: string; stack?: string };

export type EngineReply =
  | { id: number; type: "opened"; info: EngineInfo; ranges: Array<[number, number]>; lendsImageRoom: boolean }
  | { id: number; type: "session"; sessionId: number; cancelFlags: Int32Array[]; stopFlag: Int32Array }
  /** One sampled token of a running generate (more replies with the same id follow). */
  | { id: number; type: "token"; token: number }
  | { id: number; type: "generated"; result: GenerationResult }
  | { id: number; type: "logits"; logits: Float32Array | null }
  | { id: number; type: "position"; position: number }
  | { id: number; type: "stats"; stats: EngineStats }
  /** encodeImages' rows x hidden_size floats (a transferred buffer). */
  | { id: number; type: "embeddings"; rows: Float32Array }
  | { id: number; type: "bytes"; bytes: number }
  | { id: number; type: "done" }
  | { id: number; type: "error"; error: SerializedError };
