/**
 * routing-binding.ts — one backend session's side of a routing override (kvl_session_set_routing,
 * `kvl bench --routing` only): calls the hook's fill() before and taken() after each forward, on
 * the rows the backend keeps where the core reads and writes them.
 *
 * Owns: the order of those calls and the rows' shape. Does not own the rows' memory (the addon
 * takes JS arrays; a WebAssembly session keeps them in its instance: each backend's session) or
 * what the rows hold (host/bench/bench-routing.ts).
 */
import type { RoutingHook, RoutingRows } from "./core-api.js";

export class RoutingBinding {
  /** @param rows fresh views of the rows (a WebAssembly memory's buffer changes when it grows) */
  constructor(readonly hook: RoutingHook, private readonly rows: () => RoutingRows, private readonly layerBegin: number,
    private readonly layerEnd: number) {}

  /** Whether the rows hold n tokens; a forward past that is the core's KVL_ERR_INVALID_ARG. */
  before(pos0: number, n: number): void {
    if (this.hook.fill && n <= this.hook.capacity) this.hook.fill(pos0, n, this.rows());
  }

  after(pos0: number, n: number): void {
    this.hook.taken?.(pos0, n, this.rows(), this.layerBegin, this.layerEnd);
  }

  /** One forward of n tokens from pos0 with fill() before and taken() after it; without a
   * binding, the forward alone (what both backends' sessions run every forward through). */
  static around(binding: RoutingBinding | null, pos0: () => number, n: number, call: () => void): void {
    if (binding === null) return call();
    const start = pos0();
    binding.before(start, n);
    call();
    binding.after(start, n);
  }
}

/** Values in the rows of one hook: capacity x nLayers x topk. */
export function routingRowLength(hook: RoutingHook, nLayers: number, topk: number): number {
  if (!Number.isInteger(hook.capacity) || hook.capacity < 1) throw new RangeError(`routing capacity ${hook.capacity}: a positive integer`);
  return hook.capacity * nLayers * topk;
}
