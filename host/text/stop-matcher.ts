/**
 * stop-matcher.ts — stop strings in streamed text: a stop string is never emitted, so text that
 * could still become the start of one is held back until it cannot.
 *
 * Owns: the hold-back rule only (the earliest complete stop string wins; the longest held tail
 * is the longest suffix that is a proper prefix of some stop string). Used by the chat layer on
 * the main thread, which raises the engine's stop flag when a stop string completes.
 */
export class StopMatcher {
  readonly #stops: string[];
  #held = "";

  constructor(stops: readonly string[]) {
    this.#stops = stops.filter((s) => s.length > 0);
  }

  /** Adds text; returns what is safe to emit and the stop string if one completed (the text after
   * it is dropped, and the matcher is empty again). */
  push(text: string): { text: string; stop: string | null } {
    this.#held += text;
    if (this.#stops.length === 0) return { text: this.flush(), stop: null };
    let first: { at: number; stop: string } | null = null;
    for (const stop of this.#stops) {
      const at = this.#held.indexOf(stop);
      if (at >= 0 && (first === null || at < first.at)) first = { at, stop };
    }
    if (first !== null) {
      const out = this.#held.slice(0, first.at);
      this.#held = "";
      return { text: out, stop: first.stop };
    }
    let keep = 0;
    for (const stop of this.#stops) {
      for (let k = Math.min(stop.length - 1, this.#held.length); k > keep; k--) {
        if (this.#held.endsWith(stop.slice(0, k))) {
          keep = k;
          break;
        }
      }
    }
    const out = this.#held.slice(0, this.#held.length - keep);
    this.#held = this.#held.slice(this.#held.length - keep);
    return { text: out, stop: null };
  }

  /** Whatever is held (the reply ended without completing a stop string). */
  flush(): string {
    const out = this.#held;
    this.#held = "";
    return out;
  }
}
