/**
 * generation.ts — the token loop of one reply, in the engine worker: prefix reuse against what
 * the session's KV already holds, prefill of the rest, then sample / step until a stop id,
 * max_new_tokens, the caller's stop flag, or a cancel.
 *
 * Owns: the session's keys (what each KV position holds: a token id, or for a media
 * placeholder the identity of its embedding row, so a changed image is never reused), the
 * reuse rule (longest common prefix, always at least the last prompt token prefilled so its
 * logits exist), the tokens the sampler may never pick (set to -inf), the two ways to stop —
 * the stop flag (read between tokens; what was generated stays in the KV) and the core's cancel
 * flags (interrupt a running prefill or step, which rolls back) — and the reply's timings.
 * The KV ends at the last token whose successor was needed: the last sampled token (or a stop
 * id) is never stepped. Text, stop strings and the chat template are the main thread's
 * (stop strings are matched there; it raises the stop flag, and a token stepped past one is
 * dropped by the next turn's prefix reuse). A reply under a grammar (GrammarRequest.grammar) gets its
 * mask (grammar/token-mask.ts) applied before every sample, after the banned ids, and feeds each
 * sampled token back to it; the mask never allows an id the grammar cannot continue with, so a
 * reply that ends on a stop id is complete, and one cut by max_new_tokens ends "length".
 */
import { type CoreBackend, type SamplerParams, CoreError, type CoreSession, KVL_ERR_CANCELLED } from "../core/core-api.js";
import type { GrammarSpec } from "../text/grammar/grammar-spec.js";
import type { GrammarEngine, TokenMask } from "../text/grammar/token-mask.js";

export interface GenerationRequest {
  /** The whole conversation's prompt, generation prompt included. */
  prompt: Int32Array;
  /** One key per media placeholder in prompt order (e.g. image digest and row). */
  mediaKeys: string[];
  /** The embedding rows of every placeholder in prompt order (rows x hidden floats), or null. */
  media: Float32Array | null;
  sampler: SamplerParams;
  /** 64-bit seed of the sampler's generator. */
  seed: bigint;
  maxNewTokens: number;
  /** Ids that end the reply (not emitted, not stepped). */
  stopIds: Int32Array;
  /** Ids the sampler must never pick (media placeholders, specials that are not stops). */
  bannedIds: Int32Array;
  /** What the reply must be (JSON under a schema, text with tagged calls); absent = free text. */
  grammar?: GrammarSpec | null;
}

type FinishReason = "stop" | "length" | "stopped" | "cancelled";

export interface GenerationResult {
  finishReason: FinishReason;
  /** The stop id that ended the reply, if one did. */
  stopId: number | null;
  /** Sampled tokens (stop id excluded), in order. */
  tokens: number[];
  promptTokens: number;
  reusedPromptTokens: number;
  timings: { prefillS: number; firstTokenS: number; decodeSPerToken: number };
}


function commonPrefix(a: readonly string[], b: readonly string[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}

/** A session with the memory of what its KV holds. */
export class GenerationSession {
  /** What each KV position holds (a token id as text, or "m:" + media key). */
  #keys: string[] = [];

  /** betweenSteps: called after each decoded token, between two core calls (the worker applies
   * a change of the image lines' loan there: engine-worker.ts). */
  constructor(readonly session: CoreSession, readonly sampler: CoreBackend, readonly mediaTokenId: number,
    readonly hidden: number, readonly stopFlag: Int32Array, readonly grammars: GrammarEngine | null = null,
    readonly betweenSteps: () => void = () => undefined) {}

  get position(): number {
    return this.#keys.length;
  }

  /** The core session for calls outside generate (tests, bench): the keys are forgotten, so
   * the next reply prefills its whole prompt. */
  get raw(): CoreSession {
    this.#keys = [];
    return this.session;
  }

  reset(): void {
    this.session.truncate(0);
    this.#keys = [];
  }

  close(): void {
    this.session.close();
  }

  #promptKeys(prompt: Int32Array, mediaKeys: string[]): string[] {
    let m = 0;
    const keys = Array.from(prompt, (id) => (id === this.mediaTokenId ? `m:${mediaKeys[m++] ?? ""}` : String(id)));
    if (m !== mediaKeys.length) {
      throw new RangeError(`the prompt holds ${m} media placeholders but ${mediaKeys.length} media keys were given`);
    }
    return keys;
  }

  /** Runs one reply; onToken sees each sampled token as soon as it exists. */
  async generate(req: GenerationRequest, onToken: (token: number) => void): Promise<GenerationResult> {
    const started = performance.now();
    const keys = this.#promptKeys(req.prompt, req.mediaKeys);
    if (req.prompt.length === 0) throw new RangeError("an empty prompt cannot be continued");
    if (req.media !== null && req.media.length !== req.mediaKeys.length * this.hidden) {
      throw new RangeError(`${req.mediaKeys.length} media rows need ${req.mediaKeys.length * this.hidden} floats, got ${req.media.length}`);
    }
    const reused = Math.min(commonPrefix(this.#keys, keys), keys.length - 1);
    const timings = { prefillS: 0, firstTokenS: 0, decodeSPerToken: 0 };
    const tokens: number[] = [];
    const result = (finishReason: FinishReason, stopId: number | null = null): GenerationResult => ({
      finishReason, stopId, tokens, promptTokens: req.prompt.length, reusedPromptTokens: reused, timings,
    });
    let mask: TokenMask | null = null;
    try {
      if (req.grammar) {
        if (!this.grammars) throw new RangeError("this engine worker has no grammar engine, so a constrained reply cannot run");
        mask = await this.grammars.constrain(req.grammar, Array.from(req.stopIds));
      }
      if (this.session.position() !== reused) this.session.truncate(reused);
      this.#keys = this.#keys.slice(0, reused);
      const suffix = req.prompt.subarray(reused);
      let mediaBefore = 0;
      for (let i = 0; i < reused; i++) if (req.prompt[i] === this.mediaTokenId) mediaBefore++;
      const media = req.media === null ? null : req.media.subarray(mediaBefore * this.hidden);
      const prefillStart = performance.now();
      let logits: Float32Array;
      try {
        logits = this.session.prefill(suffix, media !== null && media.length > 0 ? media : null, "last")!;
      } catch (err) {
        timings.prefillS = (performance.now() - prefillStart) / 1000;
        if (err instanceof CoreError && err.status === KVL_ERR_CANCELLED) return result("cancelled");
        throw err;
      }
      timings.prefillS = (performance.now() - prefillStart) / 1000;
      this.#keys = keys;

      const rng = this.sampler.seedSampler(req.seed);
      const stops = new Set(req.stopIds);
      let stepSeconds = 0;
      let steps = 0;
      for (;;) {
        if (Atomics.load(this.stopFlag, 0) !== 0) return result("stopped");
        for (const id of req.bannedIds) if (id >= 0 && id < logits.length) logits[id] = -Infinity;
        if (mask) await mask.apply(logits);
        const token = this.sampler.sampleToken(logits, req.sampler, rng);
        if (stops.has(token)) return result("stop", token);
        mask?.accept(token);
        tokens.push(token);
        if (tokens.length === 1) timings.firstTokenS = (performance.now() - started) / 1000;
        onToken(token);
        if (tokens.length >= req.maxNewTokens) return result("length");
        if (Atomics.load(this.stopFlag, 0) !== 0) return result("stopped");
        this.betweenSteps();
        const stepStart = performance.now();
        try {
          logits = this.session.step(token);
        } catch (err) {
          if (err instanceof CoreError && err.status === KVL_ERR_CANCELLED) return result("cancelled");
          throw err;
        }
        stepSeconds += (performance.now() - stepStart) / 1000;
        timings.decodeSPerToken = stepSeconds / ++steps;
        this.#keys.push(String(token));
      }
    } catch (err) {
      // unknown KV state after an error: the next turn starts from scratch
      this.#keys = [];
      try {
        this.session.truncate(0);
      } catch {
        // the original error matters more
      }
      throw err;
    } finally {
      mask?.dispose();
      if (this.session.position() !== this.#keys.length) {
        this.#keys = [];
        this.session.truncate(0);
      }
    }
  }
}
