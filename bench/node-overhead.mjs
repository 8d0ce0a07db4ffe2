// node-overhead.mjs — the Node process's own memory, for the RAM planner's constants
// (host/plan/planner.ts header): what a kvl process holds besides the engines' planned bytes.
//   node bench/node-overhead.mjs [PACK]          (needs dist/: npx tsc -p tsconfig.json)
// PACK is a pack directory whose tiktoken.model and tokenizer_config.json are used; without one
// the synthesized vocabulary (`kvl synth`'s, 163,584 base tokens like the real one) is written to
// a temp dir. Every scenario runs in a fresh child process (this script with --child), five
// times; the figure kept is the largest peak RSS (getrusage maxRSS) of the five, so the planner's
// constants bound peaks, not settled values. Prints one JSON object per scenario, then the
// derived figures. About two minutes; never run by the tests.
//
// Scenarios (fresh processes; the engine ones build no vocabulary, so the two rules are measured
// apart and the noise of one does not hide the other; "all" checks that the parts bound the whole):
//   bare        an empty Node 20 process
//   tokenizer   bare + the host's Tokenizer (dist/host/text/tokenizer.js: the tiktoken npm package
//               over tiktoken.model and tokenizer_config.json, one encode) — the tokenizer rule
//   tokenizer2  as tokenizer, on the same ranks with every multi-byte token about twice as long
//               (a second point: is the rule per file byte or per token?)
//   engine      every dist/host module loaded on the main thread (engine-worker.js and planner.js
//               excepted: the CLI's and server's side, tokenizer and chat template modules
//               included) and an engine worker_threads worker that has loaded what
//               dist/host/engine/engine-worker.js imports and created one WebAssembly instance (64 MiB
//               memory, untouched beyond its runtime) with 1 pthread worker
//   pthreads17  engine, the instance with 17 pthread workers: (pthreads17 - engine) / 16 per worker
//   instances3  engine, three instances with 1 pthread worker each: (instances3 - engine) / 2 per
//               extra instance (its runtime and its one pthread worker)
//   native      engine, with the native addon (NativeBackend) loaded instead of an instance
//   all         engine + tokenizer, the whole fixed part of a WebAssembly run
//   run-wasm,   (only with PACK) a whole run against its plan: host modules, the tokenizer, the
//   run-native  engine worker (dist/host/engine/engine-worker.js through EngineClient) opening the pack
//               as host/plan/planner.ts planned it (512 tokens, 2 threads, no vision), a 200-token
//               prefill and 32 steps; prints the peak RSS beside the plan's total
//   instance    (only with PACK) inside one WebAssembly instance, by probing malloc: where the
//               heap of a fresh instance starts (static data + the main stack), and how much
//               heap an engine over the pack takes beyond the bytes it reports (global, trunk,
//               expert cache, workspace) with 1 and with 5 compute threads: the stacks of the
//               threads it starts (4 expert readers, the pool's workers) and its bookkeeping
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { readdir } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { Worker } from "node:worker_threads";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const dist = join(root, "dist", "host");
const MIB = 2 ** 20;
const RUNS = 5;

async function settle() {
  await new Promise((r) => setTimeout(r, 1000));
  globalThis.gc?.();
  await new Promise((r) => setTimeout(r, 200));
}

function measure() {
  return { rssBytes: process.memoryUsage().rss, maxRssBytes: process.resourceUsage().maxRSS * 1024 };
}

/**
 * The host's tokenizer (dist/host/text/tokenizer.js: tiktoken over the pack's files, as kvl runs it)
 * over modelPath, or over a copy whose multi-byte tokens are about twice as long (stretch): the
 * same ranks, each such token written twice and followed by its rank (so all stay unique), single
 * bytes kept (the encoder needs every byte).
 */
async function loadTokenizer(modelPath, configPath, stretch) {
  const { Tokenizer } = await import(pathToFileURL(join(dist, "text", "tokenizer.js")).href);
  let dir = dirname(modelPath);
  let fileBytes = readFileSync(modelPath).length;
  if (stretch) {
    const text = readFileSync(modelPath, "latin1").split("\n").filter(Boolean).map((line) => {
      const [b64, rank] = line.split(" ");
      const raw = Buffer.from(b64, "base64");
      if (raw.length < 2) return line;
      const tag = Buffer.alloc(4);
      tag.writeUInt32BE(Number(rank));
      return `${Buffer.concat([raw, raw, tag]).toString("base64")} ${rank}`;
    }).join("\n") + "\n";
    dir = mkdtempSync(join(tmpdir(), "kvl-node-overhead-stretched-"));
    writeFileSync(join(dir, "tiktoken.model"), text, "latin1");
    writeFileSync(join(dir, "tokenizer_config.json"), readFileSync(configPath));
    fileBytes = Buffer.byteLength(text, "latin1");
  }
  try {
    const tokenizer = new Tokenizer(dir);
    tokenizer.encode("Hello, who are you? 你好 <|im_end|>");
    return { tokenizer, fileBytes };
  } finally {
    if (stretch) rmSync(dir, { recursive: true, force: true });
  }
}

async function loadHostModules() {
  const modules = [];
  for (const name of (await readdir(dist, { recursive: true })).sort()) {
    if (!name.endsWith(".js") || name.endsWith("engine-worker.js") || name.endsWith("planner.js")) continue;
    modules.push(await import(pathToFileURL(join(dist, name)).href));
  }
  return modules;
}

/** The engine thread: host modules, then `instances` wasm instances with `pthreads` each, or the addon. */
const WORKER_SOURCE = `
const { parentPort, workerData } = require("node:worker_threads");
const { readFileSync } = require("node:fs");
const { join } = require("node:path");
const { pathToFileURL } = require("node:url");
(async () => {
  const kept = [];
  // what the real engine worker (dist/host/engine/engine-worker.js) imports, and what those import
  const engineDir = join(workerData.dist, "engine");
  const source = readFileSync(join(engineDir, "engine-worker.js"), "utf8");
  for (const [, name] of source.matchAll(new RegExp('^import [^;]*from "([.][.]?[/][^"]+)";', "gm"))) {
    kept.push(await import(pathToFileURL(join(engineDir, name)).href));
  }
  if (workerData.backend === "native") {
    const { NativeBackend } = await import(pathToFileURL(join(workerData.dist, "core", "native-backend.js")).href);
    kept.push(new NativeBackend());
  } else {
    const { WasmBackend } = await import(pathToFileURL(join(workerData.dist, "core", "wasm-backend.js")).href);
    for (let i = 0; i < workerData.instances; i++) {
      const wasm = await WasmBackend.create({ memoryBytes: 64 * 1024 * 1024, pthreads: workerData.pthreads });
      wasm.defaultKernelSet();
      kept.push(wasm);
    }
  }
  globalThis.kept = kept;
  parentPort.postMessage("ready");
})().catch((err) => { console.error(err); process.exit(1); });
`;


async function instanceChild(packDir) {
  const { createRequire } = await import("node:module");
  const { WasmEngine, freeHeapBytes: freeHeap } = await import(pathToFileURL(join(dist, "core", "wasm-engine.js")).href);
  const require = createRequire(import.meta.url);
  const wasmDir = join(root, "wasm-core", "dist");
  const factory = require(join(wasmDir, "kvl_core.cjs"));
  const bytes = 256 * MIB;
  const out = { scenario: "instance" };
  for (const threads of [1, 5]) {
    const memory = new WebAssembly.Memory({ initial: bytes / 65536, maximum: bytes / 65536, shared: true });
    const core = await factory({ wasmBinary: readFileSync(join(wasmDir, "kvl_core.wasm")), wasmMemory: memory, kvlPthreads: threads + 6 });
    const first = core._malloc(16) >>> 0;
    core._free(first);
    const before = freeHeap(core);
    const engine = WasmEngine.open(core, memory, packDir, { nThreads: threads, expertCacheBytes: MIB, trunkCacheBytes: 0 });
    const info = engine.info();
    const reported = info.globalBytes + info.trunkCacheBytes + info.expertCacheBytes + info.engineWorkspaceBytes;
    out[`heapStartBytes`] = first;
    out[`engineExtraBytesThreads${threads}`] = before - freeHeap(core) - reported;
    engine.close();
    core.PThread?.terminateAllThreads();
  }
  process.stdout.write(JSON.stringify(out) + "\n");
  process.exit(0);
}

async function wholeRun(backend, packDir, configPath) {
  const { plan } = await import(pathToFileURL(join(dist, "plan", "planner.js")).href);
  const { EngineClient } = await import(pathToFileURL(join(dist, "engine", "engine-client.js")).href);
  const kept = [await loadHostModules()];
  const { tokenizer } = await loadTokenizer(join(packDir, "tiktoken.model"), configPath, false);
  const p = await plan(packDir, { backend, ramMib: 65536, cacheMib: 1, maxContext: 512, threads: 2, instances: 1, loadVision: false });
  const client = await EngineClient.open(backend, packDir, { nThreads: p.nThreads, planned: p.instances, loadVision: false });
  const session = await client.newSession(p.sessionOptions);
  let ids = [];
  while (ids.length < 200) ids = ids.concat(tokenizer.encode("Hello, who are you? Tell me about the weather in Paris. "));
  let logits = await session.prefill(Int32Array.from(ids.slice(0, 200)), null, "last");
  for (let i = 0; i < 32; i++) {
    let best = 0;
    for (let k = 1; k < logits.length; k++) if (logits[k] > logits[best]) best = k;
    logits = await session.step(best);
  }
  await settle();
  const out = { scenario: `run-${backend}`, ...measure(), planBytes: p.total, planWithoutMarginBytes: p.total - p.components.margin };
  kept.push(client, session);
  process.stdout.write(JSON.stringify(out) + "\n");
  process.exit(0);
}

async function child(scenario, modelPath, configPath) {
  if (scenario === "instance") return instanceChild(dirname(modelPath));
  if (scenario.startsWith("run-")) return wholeRun(scenario.slice(4), dirname(modelPath), configPath);
  const kept = [];
  if (scenario === "tokenizer" || scenario === "tokenizer2" || scenario === "all") {
    kept.push(await loadTokenizer(modelPath, configPath, scenario === "tokenizer2"));
  }
  let worker;
  if (!["bare", "tokenizer", "tokenizer2"].includes(scenario)) {
    kept.push(await loadHostModules());
    const data = { dist, backend: scenario === "native" ? "native" : "wasm", instances: scenario === "instances3" ? 3 : 1,
      pthreads: scenario === "pthreads17" ? 17 : 1 };
    worker = new Worker(WORKER_SOURCE, { eval: true, workerData: data });
    await new Promise((resolve, reject) => {
      worker.once("message", resolve);
      worker.once("error", reject);
      worker.once("exit", (code) => reject(new Error(`engine worker exited with ${code}`)));
    });
  }
  await settle();
  const out = { scenario, ...measure() };
  if (kept[0]?.fileBytes) out.vocabularyFileBytes = kept[0].fileBytes;
  process.stdout.write(JSON.stringify(out) + "\n");
  process.exit(0); // workers and pthreads need no orderly shutdown for a measurement
}

function runChild(scenario, modelPath, configPath) {
  let best;
  for (let i = 0; i < RUNS; i++) {
    const r = spawnSync(process.execPath, ["--expose-gc", fileURLToPath(import.meta.url), "--child", scenario, modelPath, configPath],
      { encoding: "utf8", cwd: root, timeout: 120_000 });
    if (r.status !== 0) throw new Error(`scenario ${scenario} failed (${r.status}): ${r.stderr}`);
    const got = JSON.parse(r.stdout.trim().split("\n").at(-1));
    if (!best || got.maxRssBytes > best.maxRssBytes) best = got;
  }
  return best;
}

async function main() {
  const args = process.argv.slice(2);
  if (args[0] === "--child") return child(args[1], args[2], args[3]);
  let modelPath;
  let configPath;
  let cleanup = () => {};
  if (args[0]) {
    modelPath = join(args[0], "tiktoken.model");
    configPath = join(args[0], "tokenizer_config.json");
  } else {
    const tmp = mkdtempSync(join(tmpdir(), "kvl-node-overhead-"));
    cleanup = () => rmSync(tmp, { recursive: true, force: true });
    const { tokenizerAssets } = await import(pathToFileURL(join(root, "dist", "packer", "synth-tokenizer.js")).href);
    for (const [name, bytes] of tokenizerAssets()) writeFileSync(join(tmp, name), bytes);
    modelPath = join(tmp, "tiktoken.model");
    configPath = join(tmp, "tokenizer_config.json");
  }
  try {
    const r = {};
    for (const s of ["bare", "tokenizer", "tokenizer2", "engine", "pthreads17", "instances3", "native", "all"]) {
      r[s] = runChild(s, modelPath, configPath);
      console.log(JSON.stringify(r[s]));
    }
    const mib = (n) => (n / MIB).toFixed(1);
    const peak = (s) => r[s].maxRssBytes;
    const tok = peak("tokenizer") - peak("bare");
    const tok2 = peak("tokenizer2") - peak("bare");
    const bytes = r.tokenizer.vocabularyFileBytes;
    const bytes2 = r.tokenizer2.vocabularyFileBytes;
    const perPthread = (peak("pthreads17") - peak("engine")) / 16;
    const perInstance = (peak("instances3") - peak("engine")) / 2;
    console.log(`Node ${process.version}, ${process.platform}-${process.arch}; largest peak RSS of ${RUNS} runs each`);
    console.log(`bare Node: ${mib(peak("bare"))} MiB`);
    console.log(`tokenizer: +${mib(tok)} MiB for a ${bytes}-byte vocabulary (${(tok / bytes).toFixed(1)} bytes per file byte); ` +
      `+${mib(tok2)} MiB for ${bytes2} bytes (${(tok2 / bytes2).toFixed(1)} per file byte)`);
    console.log(`engine (host modules, engine worker, one wasm instance's runtime, 1 pthread worker): ${mib(peak("engine"))} MiB`);
    console.log(`per pthread worker: ${mib(perPthread)} MiB`);
    console.log(`per extra instance (with its one pthread worker): ${mib(perInstance)} MiB`);
    console.log(`native (host modules, engine worker, the addon): ${mib(peak("native"))} MiB`);
    console.log(`all (engine + tokenizer): ${mib(peak("all"))} MiB; engine + tokenizer measured apart: ${mib(peak("engine") + tok)} MiB`);
    if (args[0]) {
      for (const s of ["run-wasm", "run-native"]) {
        r[s] = runChild(s, modelPath, configPath);
        console.log(JSON.stringify(r[s]));
        console.log(`${s}: peak RSS ${mib(peak(s))} MiB, the plan ${mib(r[s].planBytes)} MiB (${mib(r[s].planWithoutMarginBytes)} MiB without its margin)`);
      }
      const probe = spawnSync(process.execPath, [fileURLToPath(import.meta.url), "--child", "instance", modelPath, configPath],
        { encoding: "utf8", cwd: root, timeout: 120_000 });
      if (probe.status !== 0) throw new Error(`scenario instance failed (${probe.status}): ${probe.stderr.slice(-2000)}`);
      const inst = JSON.parse(probe.stdout.trim().split("\n").at(-1));
      console.log(JSON.stringify(inst));
      console.log(`in an instance: the heap starts at ${inst.heapStartBytes} bytes; an engine takes ${mib(inst.engineExtraBytesThreads1)} MiB ` +
        `beyond its reported bytes with 1 thread (4 expert readers), ${mib(inst.engineExtraBytesThreads5)} MiB with 5 (4 more pool ` +
        `workers): ${mib((inst.engineExtraBytesThreads5 - inst.engineExtraBytesThreads1) / 4)} MiB per thread`);
    }
  } finally {
    cleanup();
  }
}

await main();
