// vision-bench.mjs — image encode timing on the TypeScript host, native and WebAssembly in one run.
//
// Owns: timing only (asserts nothing). For each size, a random RGB image written as PNG, then as
// `kvl chat` does it: decode (sharp) + official preprocessing (host/image/image-preprocess.ts), and
// MoonViT + projector (encodeImages) on an engine opened from the RAM plan (--ram-mib) — the
// vision weights are streamed from vision.bin on every call. Per backend: preprocess time, encode
// time of each repetition, vision bytes read, peak RSS over the phase's baseline (Linux VmHWM
// after `echo 5 > /proc/self/clear_refs`) against the plan's vision figure, and the largest
// difference between the backends' embeddings relative to their largest value.
//
// Usage: node bench/vision-bench.mjs PACK [--sizes 448,1024] [--threads 2] [--reps 2]
//        [--backends native,wasm] [--ram-mib 8192] [--json OUT]
// (over the compiled dist/: npx tsc -p . first)
import { readFileSync, writeFileSync } from "node:fs";
import { parseArgs } from "node:util";

import sharp from "sharp";

import { openHostedEngine } from "../dist/host/engine/engine-host.js";
import { decodeImage } from "../dist/host/image/image-decode.js";
import { loadPreprocessorConfig, preprocessImage } from "../dist/host/image/image-preprocess.js";
import { plan } from "../dist/host/plan/planner.js";

const MIB = 2 ** 20;
const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    sizes: { type: "string", default: "448,1024" },
    threads: { type: "string", default: "2" },
    reps: { type: "string", default: "2" },
    backends: { type: "string", default: "native,wasm" },
    "ram-mib": { type: "string", default: "8192" },
    json: { type: "string" },
  },
});
const pack = positionals[0];
if (!pack) throw new Error("usage: node bench/vision-bench.mjs PACK [--sizes 448,1024] ...");
const sizes = values.sizes.split(",").map(Number);
const threads = Number(values.threads);
const reps = Number(values.reps);

function status(key) {
  const line = readFileSync("/proc/self/status", "latin1").split("\n").find((l) => l.startsWith(`${key}:`));
  return line ? Number(line.split(/\s+/)[1]) * 1024 : 0;
}
function resetPeak() {
  try {
    writeFileSync("/proc/self/clear_refs", "5\n");
  } catch {
    /* older kernels: the phase peak includes earlier ones */
  }
  return status("VmRSS");
}

async function randomPng(side, seed) {
  let s = seed >>> 0;
  const data = new Uint8Array(side * side * 3);
  for (let i = 0; i < data.length; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    data[i] = s >>> 24;
  }
  return sharp(data, { raw: { width: side, height: side, channels: 3 } }).png().toBuffer();
}

const config = JSON.parse(readFileSync(`${pack}/config.json`, "utf8"));
const merge = config.vision_config.merge_kernel_size;
const pre = loadPreprocessorConfig(pack, [merge[0], merge[1]]);
const images = [];
for (const side of sizes) images.push({ side, png: await randomPng(side, side) });

const results = [];
const embeddings = new Map();
for (const backend of values.backends.split(",")) {
  const ramPlan = await plan(pack, { backend, ramMib: Number(values["ram-mib"]), threads, loadVision: true, check: true });
  const hosted = await openHostedEngine(backend, pack, { nThreads: ramPlan.nThreads, planned: ramPlan.instances });
  try {
    for (const { side, png } of images) {
      const base = resetPeak();
      let t = performance.now();
      const decoded = await decodeImage(png);
      const { pixelValues, grid } = preprocessImage(decoded, pre);
      const preprocessS = (performance.now() - t) / 1000;
      const encodeS = [];
      let rows;
      const before = hosted.engine.stats().visionBytesRead;
      for (let r = 0; r < reps; r++) {
        t = performance.now();
        rows = hosted.engine.encodeImages(pixelValues, Int32Array.from(grid));
        encodeS.push((performance.now() - t) / 1000);
      }
      const readBytes = (hosted.engine.stats().visionBytesRead - before) / reps;
      const peakOver = status("VmHWM") - base;
      const tokens = rows.length / hosted.engine.info().hiddenSize;
      const key = `${side}`;
      let relDiff = null;
      if (embeddings.has(key)) {
        const other = embeddings.get(key);
        let m = 0;
        let d = 0;
        for (let i = 0; i < rows.length; i++) {
          m = Math.max(m, Math.abs(other[i]));
          d = Math.max(d, Math.abs(other[i] - rows[i]));
        }
        relDiff = d / m;
      } else {
        embeddings.set(key, rows);
      }
      const record = {
        backend, side, grid, media_tokens: tokens, preprocess_s: preprocessS, encode_s: encodeS, encode_best_s: Math.min(...encodeS),
        vision_bytes_read: readBytes, peak_over_baseline_bytes: peakOver, plan_vision_bytes: ramPlan.components.vision,
        kernels: hosted.engine.info().kernels, instances: hosted.ranges.length, rel_diff_to_first_backend: relDiff,
      };
      results.push(record);
      console.log(`${backend.padEnd(6)} ${side}x${side} grid ${grid.join("x")} (${tokens} tokens): preprocess ${preprocessS.toFixed(2)} s, ` +
        `encode ${encodeS.map((x) => x.toFixed(2)).join(" / ")} s, read ${(readBytes / MIB).toFixed(0)} MiB, ` +
        `peak +${(peakOver / MIB).toFixed(0)} MiB (plan vision ${(ramPlan.components.vision / MIB).toFixed(0)} MiB), kernels ${record.kernels}` +
        (relDiff === null ? "" : `, max rel diff to ${results[0].backend} ${relDiff.toExponential(2)}`));
    }
  } finally {
    hosted.close();
  }
}
for (const side of sizes) {
  const byBackend = Object.fromEntries(results.filter((r) => r.side === side).map((r) => [r.backend, r.encode_best_s]));
  if (byBackend.native && byBackend.wasm) console.log(`${side}x${side}: wasm / native encode time ${(byBackend.wasm / byBackend.native).toFixed(2)}x`);
}
if (values.json) writeFileSync(values.json, `${JSON.stringify({ threads, reps, results }, null, 2)}\n`);
