/**
 * image-room.ts — when the RAM plan's image lines are in use: while an image is decoded,
 * preprocessed or encoded, and not otherwise.
 *
 * Owns: counting the image work in flight in this process (a chat's attach and encode, a server's
 * checks of several requests), taking the room back from the expert caches when the first starts
 * (and waiting until their pages are returned), and lending it again when the last ends, after a
 * full collection (collect-garbage.ts), so that the pixels it left behind are freed before the
 * cache refills into their place. Does not own what is lent (planner.ts expertLoans), how a cache
 * gives it back (kvl_engine_set_expert_slots), or decoding (image-decode.ts).
 */
import { setImmediate as nextTurn } from "node:timers/promises";

import { collectGarbage } from "../system/collect-garbage.js";

export class ImageRoom {
  #working = 0;
  #taken: Promise<void> | null = null;

  /** setLent: EngineClient.setImageRoomLent (or a stand-in in tests). */
  constructor(private readonly setLent: (lent: boolean) => Promise<void>) {}

  /** Image work in flight now. */
  get working(): number {
    return this.#working;
  }

  /** Runs `work` (a decode, a preprocess, an encode) with the image lines' RAM free for it. */
  async hold<T>(work: () => Promise<T>): Promise<T> {
    this.#working++;
    try {
      this.#taken ??= this.setLent(false);
      await this.#taken;
      return await work();
    } finally {
      if (--this.#working === 0) {
        this.#taken = null;
        await this.#lend();
      }
    }
  }

  async #lend(): Promise<void> {
    collectGarbage();
    // native finalizers of external buffers (sharp's pixels) may run on the next turn
    await nextTurn();
    if (this.#working === 0) await this.setLent(true);
  }
}
