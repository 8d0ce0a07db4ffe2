// full-pack.mjs — the full-size packer run: packs the full preset straight from its generator
// (SynthSource, no 33 GB checkpoint on disk), then checks the pack against the sha256 the Python
// packer recorded (test/fixtures/python-packer-sha256.json, "full-seed0") and the packer's peak
// RSS against the 2 GiB bound. About 5 minutes and 18.5 GB of disk; too big for the test suite,
// so it is a bench step (bench/run_all.sh) and its figures go into bench/RESULTS.md.
//   node bench/full-pack.mjs DST [native|wasm]     (needs dist/: npx tsc -p .)
//   prints the pack's wall time and peak RSS, then PASS or FAIL; exit status 0 on PASS.
import { createHash } from "node:crypto";
import { createReadStream, readdirSync, readFileSync } from "node:fs";
import { join, relative } from "node:path";

import { NativeBackend } from "../dist/host/core/native-backend.js";
import { WasmBackend } from "../dist/host/core/wasm-backend.js";
import { packCheckpoint } from "../dist/packer/pack.js";
import { SynthSource } from "../dist/packer/synth.js";

const RSS_BOUND = 2 * 2 ** 30;
const [dst, backend = "native"] = process.argv.slice(2);
if (!dst) {
  console.error("usage: node bench/full-pack.mjs DST [native|wasm]");
  process.exit(2);
}
const recorded = JSON.parse(readFileSync(new URL("../test/fixtures/python-packer-sha256.json", import.meta.url), "utf8"))["full-seed0"];
const seed = Number(/--seed (\d+)/.exec(recorded.synth_args)[1]);

const core = backend === "wasm" ? await WasmBackend.create() : new NativeBackend();
const started = Date.now();
try {
  await packCheckpoint(new SynthSource({ preset: "full", seed, core }), dst, { core, allowRevision: true });
} finally {
  core.close();
}
const seconds = (Date.now() - started) / 1000;
const maxRss = process.resourceUsage().maxRSS * 1024; // maxRSS is in KiB
console.log(`pack of the full preset (seed ${seed}) on ${backend}: ${seconds.toFixed(0)} s, peak RSS ${(maxRss / 2 ** 20).toFixed(0)} MiB (bound ${RSS_BOUND / 2 ** 20} MiB)`);

function* files(dir) {
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) yield* files(path);
    else yield path;
  }
}
async function sha256(path) {
  const hash = createHash("sha256");
  for await (const chunk of createReadStream(path)) hash.update(chunk);
  return hash.digest("hex");
}
const got = {};
for (const path of files(dst)) got[relative(dst, path)] = await sha256(path);
const problems = [];
for (const [name, want] of Object.entries(recorded.pack)) {
  if (!(name in got)) problems.push(`missing ${name}`);
  else if (got[name] !== want) problems.push(`${name}: sha256 ${got[name]}, the Python packer's ${want}`);
}
for (const name of Object.keys(got)) if (!(name in recorded.pack)) problems.push(`unexpected file ${name}`);
if (maxRss >= RSS_BOUND) problems.push(`peak RSS ${maxRss} bytes is over the bound`);
for (const p of problems) console.log(`  ${p}`);
console.log(problems.length === 0 ? `PASS: ${Object.keys(got).length} files equal the Python packer's` : "FAIL");
process.exit(problems.length === 0 ? 0 : 1);
