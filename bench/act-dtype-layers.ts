/**
 * act-dtype-layers.ts — the Linear-input modes (--act-dtype) on real-size layers, compute only:
 * one engine of layers [25, 27) of a full-size pack (27 layers) (two MoE layers and lm_head; 2 threads), the
 * trunk resident and every expert those inputs route to cached by a first pass, then the same
 * P hidden-state rows prefilled again from position 0 and D single-row decode steps, timed.
 * Nothing is read from the disk while timed (the expert misses printed say so).
 *
 *   npx vite-node bench/act-dtype-layers.ts PACK wasm|native f32|bf16|i16x1|i8 [P=256] [DIST_DIR]
 *
 * KVL_BENCH_LAYERS=B,E runs layers [B, E) instead; a range that ends before the last layer has no
 * lm_head, so its decode step is the layers alone (lm_head alone is most of a two-layer step).
 * KVL_BENCH_KERNELS=avx2 (or any kernel set) picks the kernels; default the best the CPU has.
 * KVL_BENCH_STEPS=N times N decode steps (default 8): more for a steadier median on a shared machine.
 *
 * PACK: `kvl pack --synth-preset full --seed 0 PACK`. DIST_DIR: another WebAssembly build of the
 * core (wasm-core/build-wasm.sh OUT_DIR) to compare a variant.
 */
import type { ActDtype, KernelChoice } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";

const pack = process.argv[2] ?? "/tmp/kvl-full-pack";
const backend = process.argv[3] ?? "wasm";
const act = (process.argv[4] ?? "f32") as ActDtype;
const P = Number(process.argv[5] ?? 256);
const distDir = process.argv[6];
const D = Number(process.env.KVL_BENCH_STEPS ?? 8); // decode steps timed
const core = backend === "wasm"
  ? await WasmBackend.create({ memoryBytes: 4 * 2 ** 30 - 65536, pthreads: WasmBackend.pthreadsForEngine(2), ...(distDir ? { distDir } : {}) })
  : new NativeBackend();
const extent = 9 * 2 ** 20; // >= one extent; the core rounds down to whole extents
const t0 = performance.now();
const [layerBegin, layerEnd] = (process.env.KVL_BENCH_LAYERS ?? "25,27").split(",").map(Number) as [number, number];
const kernels = (process.env.KVL_BENCH_KERNELS ?? "auto") as KernelChoice;
const engine = core.openEngine(pack, { nThreads: 2, layerBegin, layerEnd, kernels, trunkCacheBytes: 0, expertCacheBytes: (layerEnd - layerBegin) * 64 * extent, actDtype: act });
const info = engine.info();
const logits = layerEnd < info.nLayers ? "none" : "last"; // not the last range: hidden states out
const H = info.hiddenSize;
console.log(`${backend} ${act}: open ${((performance.now() - t0) / 1000).toFixed(1)} s, kernels ${info.kernels}, act ${info.actDtype}, globals ${info.globalBytes}, trunk ${info.trunkCacheBytes}, experts ${info.expertCacheBytes}`);
const session = engine.newSession({ maxContext: P + D, maxBatch: P });
let s = 1;
const rand = (n: number): Float32Array => Float32Array.from({ length: n }, () => { s = (Math.imul(s, 1103515245) + 12345) >>> 0; return ((s >>> 8) / 2 ** 24 - 0.5) * 2; });
// warm-up: the timed inputs themselves once (every expert they route to is then cached), then
// the same again from position 0, timed
const X = rand(P * H);
const steps = Array.from({ length: D }, () => rand(H));
session.forward(X, null, logits, false);
for (const x of steps) session.forward(x, null, logits, true);
session.truncate(0);
const st0 = engine.stats();
let t = performance.now();
session.forward(X, null, logits, false);
const prefill = (performance.now() - t) / 1000;
const times: number[] = [];
for (const x of steps) {
  t = performance.now();
  session.forward(x, null, logits, true);
  times.push((performance.now() - t) / 1000);
}
const st1 = engine.stats();
times.sort((a, b) => a - b);
console.log(`${backend} ${act}: warm prefill ${P} rows ${prefill.toFixed(2)} s (${(P / prefill).toFixed(1)} rows/s), decode median ${(times[D >> 1]! * 1000).toFixed(1)} ms/token (min ${(times[0]! * 1000).toFixed(1)}), expert misses during timing ${st1.expertMisses - st0.expertMisses}`);
session.close();
engine.close();
(core as { close(): void }).close();
