/**
 * split-engine.ts — one model over several engines, each running a contiguous range of decoder
 * layers (kvl_engine_options.layer_begin/layer_end), with only hidden states passed between them.
 *
 * Owns: choosing the ranges (layerRanges), checking that engines cover the model exactly once,
 * and running a session through the chain chunk by chunk (so no instance holds more than one
 * chunk of hidden states) with one rollback rule: when a later range fails, the earlier ones are
 * truncated back, so every range's KV timeline always has the same length. Images go to the
 * one range that loaded the vision tower (the first: engine-host.ts and the planner load it
 * there only); without one they are refused as a UserError. Does not own where the engines live
 * (one WebAssembly instance each, or one native process: engine-host.ts) or how much memory
 * each gets (the planner).
 */
import type { CoreEngine, CoreSession, EngineInfo, EngineStats, LogitsMode, RoutingHook, SessionOptions } from "../core/core-api.js";
import { DEFAULT_MAX_BATCH } from "../plan/defaults.js";
import { UserError } from "../system/user-error.js";

export const NO_VISION_MESSAGE = "this model was opened without vision; images are not accepted";

/** The expert cache slots an engine was opened with (its slab over its extent; 0 without one). */
export function expertSlotsOpened(engine: CoreEngine): number {
  const { expertCacheBytes, expertExtentBytes } = engine.info();
  return expertExtentBytes > 0 ? Math.floor(expertCacheBytes / expertExtentBytes) : 0;
}

export class SplitEngine implements CoreEngine {
  readonly #parts: CoreEngine[];
  readonly #info: EngineInfo;

  /** Takes ownership of the engines (closed with this one); they must cover the model in order. */
  /** The part that loaded the vision tower (the first range, when any did). */
  readonly #visionPart: CoreEngine | null;

  /** @param visionLoaded whether the first part was opened with loadVision */
  constructor(parts: CoreEngine[], visionLoaded = false) {
    if (parts.length === 0) throw new RangeError("a split engine needs at least one engine");
    this.#visionPart = visionLoaded ? parts[0]! : null;
    const infos = parts.map((p) => p.info());
    let expected = 0;
    for (const info of infos) {
      if (info.layerBegin !== expected) {
        throw new RangeError(`engines must cover the layers in order: expected a range starting at ${expected}, got [${info.layerBegin}, ${info.layerEnd})`);
      }
      expected = info.layerEnd;
    }
    const last = infos.at(-1)!;
    if (expected !== last.nLayers) throw new RangeError(`the engines cover layers [0, ${expected}) of ${last.nLayers}`);
    this.#parts = parts;
    const sum = (key: "globalBytes" | "trunkCacheBytes" | "expertCacheBytes" | "engineWorkspaceBytes"): number =>
      infos.reduce((total, info) => total + info[key], 0);
    this.#info = {
      ...last,
      layerBegin: 0,
      trunkDirectIo: infos.every((i) => i.trunkDirectIo),
      expertDirectIo: infos.every((i) => i.expertDirectIo),
      // each range decides for its own cache: the model reads ahead where any range does
      expertLookahead: infos.some((i) => i.expertLookahead),
      globalBytes: sum("globalBytes"),
      trunkCacheBytes: sum("trunkCacheBytes"),
      expertCacheBytes: sum("expertCacheBytes"),
      engineWorkspaceBytes: sum("engineWorkspaceBytes"),
    };
  }

  /** The engines, first range first. */
  get parts(): readonly CoreEngine[] {
    return this.#parts;
  }

  info(): EngineInfo {
    return { ...this.#info };
  }

  stats(): EngineStats {
    const all = this.#parts.map((p) => p.stats());
    const total = { ...all[0]! };
    for (const s of all.slice(1)) {
      for (const key of Object.keys(total) as Array<keyof EngineStats>) {
        // every range sees every token: counting them once is the model's token count
        if (key !== "tokensPrefilled" && key !== "tokensDecoded") total[key] += s[key];
      }
    }
    return total;
  }

  resetStats(): void {
    for (const p of this.#parts) p.resetStats();
  }

  /** `slots` over the ranges' caches in proportion to the extents each was opened with (earlier
   * ranges take the remainder); each clamps as CoreEngine.setExpertSlots says. The sum in use. */
  setExpertSlots(slots: number): number {
    const created = this.#parts.map(expertSlotsOpened);
    const all = created.reduce((a, b) => a + b, 0);
    if (all === 0) return 0;
    const share = created.map((n) => Math.floor((slots * n) / all));
    let left = slots - share.reduce((a, b) => a + b, 0);
    for (let i = 0; left > 0 && i < share.length; i++) {
      if (created[i]! > share[i]!) {
        share[i]!++;
        left--;
      }
    }
    return this.#parts.reduce((sum, p, i) => sum + (created[i]! > 0 ? p.setExpertSlots(share[i]!) : 0), 0);
  }

  sessionBytes(options: SessionOptions = {}): number {
    return this.#parts.reduce((total, p) => total + p.sessionBytes(options), 0);
  }

  #vision(): CoreEngine {
    if (this.#visionPart === null) throw new UserError(NO_VISION_MESSAGE);
    return this.#visionPart;
  }

  visionBytes(grids: Int32Array): number {
    return this.#vision().visionBytes(grids);
  }

  encodeImages(pixelValues: Float32Array, grids: Int32Array): Float32Array {
    return this.#vision().encodeImages(pixelValues, grids);
  }

  newSession(options: SessionOptions = {}): CoreSession {
    const sessions: CoreSession[] = [];
    try {
      for (const p of this.#parts) sessions.push(p.newSession(options));
    } catch (err) {
      for (const s of sessions) s.close();
      throw err;
    }
    return new SplitSession(sessions, options.maxBatch || DEFAULT_MAX_BATCH, this.#info);
  }

  close(): void {
    let first: unknown;
    for (const p of this.#parts) {
      try {
        p.close();
      } catch (err) {
        first ??= err;
      }
    }
    if (first !== undefined) throw first;
  }
}

class SplitSession implements CoreSession {
  constructor(private readonly parts: CoreSession[], private readonly maxBatch: number, private readonly info: EngineInfo) {}

  position(): number {
    return this.parts[0]!.position();
  }

  prefill(tokens: Int32Array, media: Float32Array | null, logits: LogitsMode): Float32Array | null {
    return this.forward(tokens, media, logits, false);
  }

  step(token: number): Float32Array {
    return this.forward(Int32Array.of(token), null, "last", true)!;
  }

  forward(input: Int32Array | Float32Array, media: Float32Array | null, logits: LogitsMode, decode: boolean): Float32Array | null {
    if (!(input instanceof Int32Array)) throw new TypeError("a split session takes token ids; hidden states stay inside it");
    const { vocabSize: V, hiddenSize: H, mediaPlaceholderTokenId: mediaId } = this.info;
    const n = input.length;
    const start = this.position();
    const out = logits === "all" ? new Float32Array(n * V) : null;
    let last: Float32Array | null = null;
    let mediaRow = 0;
    try {
      for (let at = 0; at < n; at += this.maxBatch) {
        const chunk = input.subarray(at, Math.min(n, at + this.maxBatch));
        let rows = 0;
        if (media !== null) for (const id of chunk) if (id === mediaId) rows++;
        const chunkMedia = media !== null ? media.subarray(mediaRow * H, (mediaRow + rows) * H) : null;
        mediaRow += rows;
        const isLastChunk = at + chunk.length >= n;
        const mode: LogitsMode = logits === "all" ? "all" : logits === "last" && isLastChunk ? "last" : "none";
        let x: Int32Array | Float32Array = chunk;
        for (let i = 0; i < this.parts.length; i++) {
          const isLast = i === this.parts.length - 1;
          const y = this.parts[i]!.forward(x, i === 0 ? chunkMedia : null, isLast ? mode : "none", decode);
          if (!isLast) x = y!;
          else if (mode === "all") out!.set(y!, at * V);
          else if (mode === "last") last = y;
        }
      }
    } catch (err) {
      // a failed range rolled itself back; bring every range to the same position
      for (const p of this.parts) if (p.position() > start) p.truncate(start);
      throw err;
    }
    if (media !== null && mediaRow * H !== media.length) {
      // the first range checked placeholders against rows per chunk; rows left over are an error too
      for (const p of this.parts) p.truncate(start);
      throw new RangeError(`${mediaRow} media placeholder tokens but ${media.length / H} media rows`);
    }
    return logits === "all" ? out : logits === "last" ? last : null;
  }

  truncate(n: number): void {
    for (const p of this.parts) p.truncate(n);
  }

  cancelFlags(): Int32Array[] {
    return this.parts.flatMap((p) => p.cancelFlags());
  }

  /** Every range gets the hook: each reads and reports its own layers of the same rows, for the
   * same positions (the ranges run one chunk of at most maxBatch tokens at a time). */
  setRouting(hook: RoutingHook | null): void {
    const part = hook === null ? null : { ...hook, capacity: Math.min(hook.capacity, this.maxBatch) };
    for (const p of this.parts) p.setRouting(part);
  }

  close(): void {
    for (const p of this.parts) p.close();
  }
}
