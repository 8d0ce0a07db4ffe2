/**
 * collect-garbage.ts — one full V8 collection of this thread's heap, on demand.
 *
 * Owns: exposing V8's gc() once (v8.setFlagsFromString, then a fresh context's gc); a Node that
 * refuses it makes collectGarbage a no-op. Large buffers (a request body's copies, an image's
 * pixels) are garbage once used, but V8 collects them when its own heap limits say so; the RAM
 * plan counts them for the moment they are needed, not until V8 notices. Callers: server/body.ts
 * after a large body's answer, image-room.ts before an image's RAM goes back to the expert cache.
 */
import v8 from "node:v8";
import { runInNewContext } from "node:vm";

let gcFunction: (() => void) | null | undefined;

export function collectGarbage(): void {
  if (gcFunction === undefined) {
    try {
      v8.setFlagsFromString("--expose-gc");
      gcFunction = runInNewContext("gc") as () => void;
    } catch {
      gcFunction = null;
    }
  }
  gcFunction?.();
}
