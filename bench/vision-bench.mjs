// vision-bench.mjs — image encode timing on the TypeScript host, native and WebAssembly in one run.
//
// Owns: timing only (asserts nothing). For each size (SIDE or WxH: a 4032x3024 photo is scaled
// by the official rule), a random RGB image written as PNG, then as `kvl chat` does it: decode
// (sharp) + official preprocessing (host/image/image-preprocess.ts), and MoonViT + projector
// (encodeImages) on an engine opened from the RAM plan (--ram-mib) — the vision weights are
// streamed from vision.bin on every call. Per backend and size: preprocess time, encode time of
// each repetition (wall) and its CPU-seconds (process.cpuUsage: the addon's and the wasm
// workers' threads run in this process), GFLOP/s (bench-model.ts visionFlops) and its ratio to
// the FP32 FMA peak measured by bench/membw.c (AMX BF16 products can exceed 1), vision bytes
// read, peak RSS over the phase's baseline (Linux VmHWM after `echo 5 > /proc/self/clear_refs`)
// against the plan's vision figure, the largest difference of the --act-dtype mode's embeddings
// (default i16x1, what auto picks with vector kernels: BF16 vision products on AMX) from
// the exact mode's (act_dtype f32: FP32 products; --no-exact skips it) and from the first
// backend's, relative to their largest value. The embeddings' bound against the float64
// reference is measured on the test models (test/vision-engine.test.ts, README "Numerics"): a
// full-size float64 encode is out of reach.
//
// Usage: node bench/vision-bench.mjs PACK [--sizes 448,1024,4032x3024] [--threads 2] [--reps 2]
//        [--backends native,wasm] [--ram-mib 8192] [--act-dtype i16x1] [--no-exact] [--json OUT]
//        [--before ROOT]   also run ROOT's build (a checkout with dist/, wasm-core/dist and its
//                          addon built: e.g. `git worktree add /tmp/kvl-before REF`, then there
//                          `npx tsc -p . && npm run build:native`) and print both side by side
//        [--root ROOT]     run ROOT's build (used by --before)
// (over the compiled dist/: npx tsc -p . first). KVL_NO_AMX=1 in the environment runs the native
// BF16 mode without AMX (i.e. the FP32 products) for A/B runs.
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import sharp from "sharp";

const MIB = 2 ** 20;
const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    sizes: { type: "string", default: "448,1024,4032x3024" },
    threads: { type: "string", default: "2" },
    reps: { type: "string", default: "2" },
    backends: { type: "string", default: "native,wasm" },
    "ram-mib": { type: "string", default: "8192" },
    "no-exact": { type: "boolean", default: false },
    // what `--act-dtype auto` picks with vector kernels on both backends (host/plan/act-mode.ts)
    "act-dtype": { type: "string", default: "i16x1" },
    json: { type: "string" },
    before: { type: "string" },
    root: { type: "string" },
  },
});
const pack = positionals[0];
if (!pack) throw new Error("usage: node bench/vision-bench.mjs PACK [--sizes 448,1024,4032x3024] ...");
const here = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const root = resolve(values.root ?? here);
const { openHostedEngine } = await import(join(root, "dist/host/engine/engine-host.js"));
const { decodeImage } = await import(join(root, "dist/host/image/image-decode.js"));
const { loadPreprocessorConfig, preprocessImage } = await import(join(root, "dist/host/image/image-preprocess.js"));
const { plan } = await import(join(root, "dist/host/plan/planner.js"));
// the FLOP count and the FMA probe from this checkout, so both builds are measured alike
const { visionFlops } = await import(join(here, "dist/host/bench/bench-model.js"));
const { membwBinary, runMembw } = await import(join(here, "dist/host/bench/bench-limits.js"));

const sizes = values.sizes.split(",").map((v) => {
  const [w, h] = v.split("x").map(Number);
  return { w, h: h ?? w, label: v };
});
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

async function randomPng(w, h, seed) {
  let s = seed >>> 0;
  const data = new Uint8Array(w * h * 3);
  for (let i = 0; i < data.length; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    data[i] = s >>> 24;
  }
  return sharp(data, { raw: { width: w, height: h, channels: 3 } }).png().toBuffer();
}

function maxRelDiff(a, b) {
  let m = 0;
  let d = 0;
  for (let i = 0; i < a.length; i++) {
    m = Math.max(m, Math.abs(a[i]));
    d = Math.max(d, Math.abs(a[i] - b[i]));
  }
  return d / m;
}

function cpuSeconds() {
  const u = process.cpuUsage();
  return (u.user + u.system) / 1e6;
}

let fmaPeak = null;
{
  const dir = mkdtempSync(join(tmpdir(), "kvl-vision-bench-"));
  try {
    const bin = membwBinary(dir);
    if (!("error" in bin)) {
      const r = runMembw(bin.path, ["fma", String(threads), "1"]);
      if (!("error" in r)) fmaPeak = Math.max(...r.rows.filter((x) => x.mode === "fma").map((x) => Number(x.flops_per_s)));
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
console.log(`build ${root}; FP32 FMA peak (bench/membw.c, ${threads} threads): ${fmaPeak ? (fmaPeak / 1e9).toFixed(0) + " GFLOP/s" : "not measured"}`);

const config = JSON.parse(readFileSync(`${pack}/config.json`, "utf8"));
const merge = config.vision_config.merge_kernel_size;
const pre = loadPreprocessorConfig(pack, [merge[0], merge[1]]);
const vc = config.vision_config;
const shape = { hidden: vc.hidden_size, intermediate: vc.intermediate_size, layers: vc.num_hidden_layers, patch: vc.patch_size,
  merge, textHidden: config.text_config.hidden_size };
const images = [];
for (const { w, h, label } of sizes) images.push({ side: label, png: await randomPng(w, h, w * 7919 + h) });

const results = [];
const embeddings = new Map();
for (const backend of values.backends.split(",")) {
  const ramPlan = await plan(pack, { backend, ramMib: Number(values["ram-mib"]), threads, loadVision: true, check: true, actDtype: values["act-dtype"] });
  const hosted = await openHostedEngine(backend, pack, { nThreads: ramPlan.nThreads, planned: ramPlan.instances });
  // the plan's per-instance engine options win over openHostedEngine's, so the exact mode has a plan of its own
  const exactPlan = values["no-exact"] ? null
    : await plan(pack, { backend, ramMib: Number(values["ram-mib"]), threads, loadVision: true, check: true, actDtype: "f32" });
  const exact = exactPlan ? await openHostedEngine(backend, pack, { nThreads: exactPlan.nThreads, planned: exactPlan.instances }) : null;
  try {
    for (const { side, png } of images) {
      const base = resetPeak();
      let t = performance.now();
      const decoded = await decodeImage(png);
      const { pixelValues, grid } = preprocessImage(decoded, pre);
      const preprocessS = (performance.now() - t) / 1000;
      const encodeS = [];
      const cpuS = [];
      let rows;
      const before = hosted.engine.stats().visionBytesRead;
      for (let r = 0; r < reps; r++) {
        t = performance.now();
        const c = cpuSeconds();
        rows = hosted.engine.encodeImages(pixelValues, Int32Array.from(grid));
        cpuS.push(cpuSeconds() - c);
        encodeS.push((performance.now() - t) / 1000);
      }
      const flops = visionFlops(shape, grid);
      const best = Math.min(...encodeS);
      let exactDiff = null;
      let exactCpuS = null;
      if (exact) {
        const c = cpuSeconds();
        const exactRows = exact.engine.encodeImages(pixelValues, Int32Array.from(grid));
        exactCpuS = cpuSeconds() - c;
        exactDiff = maxRelDiff(exactRows, rows);
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
        backend, side, grid, media_tokens: tokens, preprocess_s: preprocessS, encode_s: encodeS, encode_best_s: best,
        encode_cpu_s: cpuS, flops, gflops_per_s: flops / best / 1e9, ratio_to_fma_peak: fmaPeak ? flops / best / fmaPeak : null,
        rel_diff_to_exact_mode: exactDiff, exact_mode_cpu_s: exactCpuS,
        vision_bytes_read: readBytes, peak_over_baseline_bytes: peakOver, plan_vision_bytes: ramPlan.components.vision,
        kernels: hosted.engine.info().kernels, instances: hosted.ranges.length, rel_diff_to_first_backend: relDiff,
      };
      results.push(record);
      console.log(`${backend.padEnd(6)} ${side} grid ${grid.join("x")} (${tokens} tokens): preprocess ${preprocessS.toFixed(2)} s, ` +
        `encode ${encodeS.map((x) => x.toFixed(2)).join(" / ")} s (CPU ${cpuS.map((x) => x.toFixed(1)).join(" / ")} s), ` +
        `${record.gflops_per_s.toFixed(0)} GFLOP/s` + (fmaPeak ? ` (${record.ratio_to_fma_peak.toFixed(2)}x FMA peak)` : "") +
        (exactDiff === null ? "" : `, max rel diff to the f32 mode ${exactDiff.toExponential(2)} (f32 mode: CPU ${exactCpuS.toFixed(1)} s)`) + `, read ${(readBytes / MIB).toFixed(0)} MiB, ` +
        `peak +${(peakOver / MIB).toFixed(0)} MiB (plan vision ${(ramPlan.components.vision / MIB).toFixed(0)} MiB), kernels ${record.kernels}` +
        (relDiff === null ? "" : `, max rel diff to ${results[0].backend} ${relDiff.toExponential(2)}`));
    }
  } finally {
    hosted.close();
    exact?.close();
  }
}
for (const { label } of sizes) {
  const byBackend = Object.fromEntries(results.filter((r) => r.side === label).map((r) => [r.backend, r.encode_best_s]));
  if (byBackend.native && byBackend.wasm) console.log(`${label}: wasm / native encode time ${(byBackend.wasm / byBackend.native).toFixed(2)}x`);
}
const out = { root, threads, reps, fma_peak_flops_per_s: fmaPeak, results };
if (values.json) writeFileSync(values.json, `${JSON.stringify(out, null, 2)}\n`);
if (values.before) {
  const dir = mkdtempSync(join(tmpdir(), "kvl-vision-before-"));
  try {
    const json = join(dir, "before.json");
    const argv = [fileURLToPath(import.meta.url), pack, "--root", resolve(values.before), "--json", json, "--sizes", values.sizes,
      "--threads", values.threads, "--reps", values.reps, "--backends", values.backends, "--ram-mib", values["ram-mib"], "--act-dtype", values["act-dtype"],
      ...(values["no-exact"] ? ["--no-exact"] : [])];
    console.log(`\n--- before: ${resolve(values.before)} ---`);
    const r = spawnSync(process.execPath, argv, { stdio: ["ignore", "inherit", "inherit"] });
    if (r.status !== 0) throw new Error(`the --before run failed (exit ${r.status})`);
    const old = JSON.parse(readFileSync(json, "utf8")).results;
    console.log("\nbackend size       before s (CPU s)      after s (CPU s)       speed-up");
    for (const a of results) {
      const b = old.find((x) => x.backend === a.backend && x.side === a.side);
      if (!b) continue;
      const cpu = (x) => (x.encode_cpu_s ? Math.min(...x.encode_cpu_s).toFixed(1) : "?");
      console.log(`${a.backend.padEnd(7)} ${a.side.padEnd(10)} ${b.encode_best_s.toFixed(2).padStart(8)} (${cpu(b).padStart(6)})` +
        `    ${a.encode_best_s.toFixed(2).padStart(8)} (${cpu(a).padStart(6)})    ${(b.encode_best_s / a.encode_best_s).toFixed(2)}x`);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
