#!/usr/bin/env node
// quickstart.mjs — one command from a fresh machine to a chat, the same steps on every OS
// (scripts/quickstart on Linux/macOS and scripts\quickstart.ps1 on Windows only find Node and run
// this; `node scripts/quickstart.mjs` works everywhere too):
//
//   node scripts/quickstart.mjs [MODEL_DIR]          install kvl (npm ci: TypeScript; the native
//                                                    addon comes prebuilt, or is built where a C
//                                                    compiler and CMake exist; skipped when
//                                                    node_modules is current: install-state.mjs),
//                                                    run the doctor, download + pack the pinned
//                                                    Kimi-VL-A3B-Instruct (~33 GB download, ~17 GB
//                                                    packed; bounded scratch), run the doctor on
//                                                    it, open an interactive chat
//   node scripts/quickstart.mjs --demo [MODEL_DIR]   the very same path on a small synthesized
//                                                    random-weight model (no download):
//                                                    synth -> pack -> doctor -> chat
//
// MODEL_DIR defaults to kvl's cache folder (host/system/sea-assets.ts kvlCacheDir: $XDG_CACHE_HOME or
// ~/.cache, %LOCALAPPDATA% on Windows) + kvl/kimi-vl-a3b-instruct or kvl/demo-tiny; a relative one
// is taken from the folder the command runs in. Plain JavaScript with Node's built-ins: it runs
// before `npm ci` has installed anything. Any failed step stops it with that step's exit status.
import { spawnSync } from "node:child_process";
import { existsSync, writeSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

import { installOutdated } from "./install-state.mjs";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const KVL = join(ROOT, "dist", "cli", "kvl.js");

/** A step's heading, written at once (not queued behind a child's output). */
function say(text) {
  writeSync(1, `== ${text}\n`);
}

function fail(message, status = 1) {
  writeSync(2, `quickstart: ${message}\n`);
  process.exit(status);
}

/** Runs a step with this terminal; stops the quickstart when it fails. */
function step(command, args, what, options = {}) {
  const r = spawnSync(command, args, { stdio: "inherit", ...options });
  if (r.error) fail(`${what}: ${r.error.message}`);
  if (r.status !== 0) fail(`${what} failed (exit status ${r.status ?? r.signal})`, r.status || 1);
}

const kvl = (args, what) => step(process.execPath, [KVL, ...args], what);

const major = Number(process.versions.node.split(".")[0]);
if (major < 20) fail(`kvl needs Node 20 or newer; this is Node ${process.versions.node} (https://nodejs.org/en/download)`);
const args = process.argv.slice(2);
const demo = args[0] === "--demo";
if (demo) args.shift();
if (args.length > 1 || args[0]?.startsWith("-")) fail("usage: quickstart [--demo] [MODEL_DIR]");

const outdated = installOutdated(ROOT);
if (outdated === null) {
  say("kvl is installed and node_modules matches package-lock.json: npm ci skipped (delete node_modules to reinstall)");
} else {
  say(`installing kvl (${outdated}): npm ci (TypeScript; the native addon is prebuilt, or built where a C compiler and CMake exist)`);
  // npm is npm.cmd on Windows, which only a shell runs
  step("npm", ["ci", "--no-audit", "--no-fund"], "npm ci", { cwd: ROOT, shell: process.platform === "win32" });
}

const { kvlCacheDir } = await import(pathToFileURL(join(ROOT, "dist", "host", "system", "sea-assets.js")).href);
const modelDir = args[0] !== undefined ? resolve(args[0]) : join(kvlCacheDir(), demo ? "demo-tiny" : "kimi-vl-a3b-instruct");

say("doctor: backends and kernel self-test");
kvl(["doctor"], "kvl doctor");

if (demo) {
  say("demo: synthesizing a tiny random-weight checkpoint in the official layout");
  const src = `${modelDir}.src`;
  if (!existsSync(join(src, "config.json"))) kvl(["synth", src, "--preset", "tiny", "--seed", "0"], "kvl synth");
  say(`packing it into ${modelDir}`);
  kvl(["pack", src, modelDir, "--allow-revision"], "kvl pack");
} else {
  say(`downloading and packing the pinned checkpoint into ${modelDir}`);
  kvl(["prepare", modelDir], "kvl prepare");
}

say("doctor");
kvl(["doctor", modelDir], "kvl doctor MODEL");

say(`chat (type /quit to leave${demo ? "; the demo model has random weights, so its replies are noise" : ""})`);
const chat = spawnSync(process.execPath, [KVL, "chat", modelDir], { stdio: "inherit" });
process.exitCode = chat.status ?? 1;
