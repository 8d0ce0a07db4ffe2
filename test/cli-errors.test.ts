/**
 * Every `kvl` command fed each kind of bad path and each bad KVL_* value, as a user runs it (the
 * compiled dist/cli/kvl.js in a child process): exit status 1 and one line naming the path or the
 * variable, never a stack trace or "internal error", and never a hang (Node's recursive mkdir
 * loops forever under /proc: the child has a timeout). Paths that refuse even root (the tests
 * run as root, so a chmod 000 folder would not): /proc and /sys, a symlink loop, a too-long name.
 */
import { spawn, spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, readdirSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");

let tmp: { dir: string; cleanup: () => void };
let ckpt: string;
let pack: string;
let limits: string;

interface Run {
  status: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
}

/** `kvl ARGS` in a child (asynchronously: a blocked test worker stops answering vitest), killed
 * after 60 s. */
function kvl(args: string[], env: Record<string, string> = {}): Promise<Run> {
  const base = { ...process.env };
  for (const name of ["KVL_BACKEND", "KVL_INSTANCES", "KVL_PACK_FLUSH_ITEMS", "KVL_API_KEY"]) delete base[name];
  // HF_ENDPOINT: a kvl prepare that got past its checks must not reach the network
  const child = spawn(process.execPath, [KVL, ...args], {
    env: { ...base, HF_ENDPOINT: "http://127.0.0.1:9", ...env }, timeout: 60_000, killSignal: "SIGKILL", cwd: tmp.dir,
  });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (s: string) => (stdout += s));
  child.stderr.setEncoding("utf8").on("data", (s: string) => (stderr += s));
  return new Promise((resolve, reject) => {
    child.on("error", reject);
    child.on("close", (status, signal) => resolve({ status, signal, stdout, stderr }));
  });
}

/** The one-line refusal: status 1, one stderr line naming `needle`, no stack. */
function expectOneLine(r: Run, needle: string): void {
  expect(r.signal, `killed (hung?): ${r.stderr}`).toBeNull();
  expect(r.status, r.stderr).toBe(1);
  expect(r.stderr).not.toMatch(/internal error|\n {4}at |Error:/);
  expect(r.stderr.endsWith("\n") && r.stderr.trimEnd().split("\n").length === 1, r.stderr).toBe(true);
  expect(r.stderr).toMatch(/^kvl( \w+)?: error: /);
  expect(r.stderr).toContain(needle);
}

beforeAll(async () => {
  tmp = tempDir("cli-errors");
  ({ ckpt, pack } = await tinyPack(tmp.dir));
  writeFileSync(join(tmp.dir, "FILE"), "not a folder\n");
  symlinkSync("loop", join(tmp.dir, "loop")); // a link to itself
  limits = join(tmp.dir, "limits.jsonl");
  writeFileSync(limits, `${JSON.stringify({ mode: "dram", best_bytes_per_s: 10e9 })}\n${JSON.stringify({ mode: "ssd", bytes_per_s: 1e9 })}\n`);
  mkdirSync(join(tmp.dir, "a-folder"));
}, 300_000);

afterAll(() => tmp?.cleanup());

/** Bad places to write a folder into (relative to the test's folder, the child's cwd). */
const BAD_OUTPUT_DIRS = ["FILE", "FILE/x", "/sys/nope", "/proc/nope", "/proc/nope/deeper", "/proc", "loop", `long-${"n".repeat(300)}`];
/** Bad folders to read a model or checkpoint from. */
const BAD_INPUT_DIRS = ["missing", "FILE", "FILE/x", "/sys/nope", "/proc/nope", "loop", `long-${"n".repeat(300)}`];

/** How a path shows in the message (a long name by its start). */
const shown = (path: string): string => path.slice(0, 40);

describe("a bad output path is one line naming it", () => {
  const cases: Array<[string, (p: string) => string[]]> = [
    ["pack SRC DST", (p) => ["pack", ckpt, p, "--allow-revision", "--quiet", "--backend", "wasm"]],
    ["pack --synth-preset tiny DST", (p) => ["pack", "--synth-preset", "tiny", p, "--quiet", "--backend", "wasm"]],
    ["synth OUT", (p) => ["synth", p, "--backend", "wasm"]],
    ["prepare DST", (p) => ["prepare", p, "--backend", "wasm", "--quiet"]],
  ];
  for (const [name, args] of cases) {
    it.each(BAD_OUTPUT_DIRS)(`${name} with %s`, async (path) => {
      expectOneLine(await kvl(args(path)), shown(path));
    });
  }

  // (an existing file is fine: --out replaces it)
  it.each([...BAD_OUTPUT_DIRS.filter((p) => p !== "FILE"), "a-folder", "missing-folder/out.json"])("bench --out %s", async (path) => {
    expectOneLine(await kvl(["bench", pack, "--limits", limits, "--prompt-lens", "4", "--decode-tokens", "1", "--out", path]), shown(path));
  });
});

describe("a bad model or checkpoint path is one line naming it", () => {
  const cases: Array<[string, (p: string) => string[]]> = [
    ["pack SRC DST", (p) => ["pack", p, join(tmp.dir, "unused-dst"), "--allow-revision", "--backend", "wasm"]],
    ["chat MODEL", (p) => ["chat", p, "hello", "--backend", "wasm"]],
    ["bench MODEL", (p) => ["bench", p, "--limits", limits]],
    ["serve MODEL", (p) => ["serve", p, "--port", "0", "--backend", "wasm"]],
  ];
  for (const [name, args] of cases) {
    it.each(BAD_INPUT_DIRS)(`${name} with %s`, async (path) => {
      expectOneLine(await kvl(args(path)), shown(path));
    });
  }

  it.each(BAD_INPUT_DIRS)("doctor MODEL with %s: a FAIL line naming it, no stack", async (path) => {
    const r = await kvl(["doctor", path, "--quiet", "--backend", "wasm"]);
    expect(r.signal).toBeNull();
    expect(r.status, r.stderr).toBe(1);
    expect(r.stderr).toBe("");
    expect(`${r.stdout}`).not.toMatch(/internal error|\n {4}at |Error:/);
    expect(r.stdout).toMatch(new RegExp(`^FAIL {2}pack: .*${shown(path).replace(/[/.]/g, "\\$&")}`, "m"));
  });

  it("doctor says a model path that is a file is a file", async () => {
    const r = await kvl(["doctor", "FILE", "--quiet"]);
    expect(r.stdout).toContain(`FAIL  pack: ${join(tmp.dir, "FILE")} is a file, not a model directory; create one with kvl pack or kvl prepare\n`);
  });
});

describe("a bad KVL_* value is one line naming the variable and the valid values", () => {
  const values: Array<[Record<string, string>, RegExp]> = [
    [{ KVL_BACKEND: "bogus" }, /KVL_BACKEND="bogus" is not valid: expected one of auto, native, wasm; fix or unset the variable/],
    [{ KVL_INSTANCES: "abc" }, /KVL_INSTANCES="abc" is not valid: expected a whole number of at least 1/],
    [{ KVL_INSTANCES: "0" }, /KVL_INSTANCES="0" is not valid: expected a whole number of at least 1/],
    [{ KVL_PACK_FLUSH_ITEMS: "-3" }, /KVL_PACK_FLUSH_ITEMS="-3" is not valid: expected a whole number of at least 1/],
  ];
  const commands: Array<[string, () => string[]]> = [
    ["doctor", () => ["doctor"]],
    ["doctor MODEL", () => ["doctor", pack, "--quick", "--quiet"]],
    ["chat", () => ["chat", pack, "hello", "--max-new", "1"]],
    ["bench", () => ["bench", pack, "--limits", limits, "--prompt-lens", "4", "--decode-tokens", "1"]],
    ["serve", () => ["serve", pack, "--port", "0"]],
    ["synth", () => ["synth", join(tmp.dir, "env-synth")]],
    ["pack", () => ["pack", ckpt, join(tmp.dir, "env-pack"), "--allow-revision", "--quiet"]],
    ["prepare", () => ["prepare", join(tmp.dir, "env-prepare"), "--quiet"]],
  ];
  for (const [env, message] of values) {
    it.each(commands)(`${Object.entries(env)[0]!.join("=")}: kvl %s`, async (_name, args) => {
      const r = await kvl(args(), env);
      expectOneLine(r, Object.keys(env)[0]!);
      expect(r.stderr).toMatch(message);
    });
  }
});

describe("kvl --version and a bad option value", () => {
  it("--version names the build: package.json's version, the commit, this Node and the backend", async () => {
    const r = await kvl(["--version"]);
    expect(r.status).toBe(0);
    const version = (JSON.parse(readFileSync(join(packageRoot, "package.json"), "utf8")) as { version: string }).version;
    const head = spawnSync("git", ["-C", packageRoot, "rev-parse", "--short=12", "HEAD"], { encoding: "utf8" }).stdout.trim();
    expect(r.stdout).toMatch(new RegExp(`^kvl ${version.replace(/\./g, "\\.")} \\(commit ${head}[^;]*; Node ${process.version} linux-x64; ` +
      "backend (native (scalar|avx2|avx512|avx512-bf16) \\((local build|prebuilt|KVL_ADDON) addon\\)|wasm \\(.+\\))\\)\n$"));
  });

  it("--backend bogus is one line with the valid choices, not the whole help", async () => {
    const r = await kvl(["doctor", "--backend", "bogus"]);
    expect(r.status).toBe(1);
    expect(r.stderr).toBe("kvl doctor: error: option '--backend <name>' argument 'bogus' is invalid. Allowed choices are auto, native, wasm.\n");
    expect(r.stdout).toBe("");
  });

  it("commander's own errors carry the `kvl CMD: error:` prefix as every other error does", async () => {
    const cases: Array<[string[], string]> = [
      [["chat", "--bogus"], "kvl chat: error: unknown option '--bogus'\n"],
      [["chat", pack, "hi", "--max-new"], "kvl chat: error: option '--max-new <n>' argument missing\n"],
      [["serve"], "kvl serve: error: missing required argument 'model'\n"],
      [["synth", "a", "b"], "kvl synth: error: too many arguments for 'synth'. Expected 1 argument but got 2.\n"],
      [["frob"], "kvl: error: unknown command 'frob'\n"],
    ];
    for (const [args, line] of cases) {
      const r = await kvl(args);
      expect(r.status, args.join(" ")).toBe(1);
      expect(r.stderr, args.join(" ")).toBe(line);
    }
  });
});

describe("a bad count is one wording whatever is wrong with it", () => {
  it.each(["0", "-1", "1e9", "1.5", "abc"])("kvl chat --max-new %s", async (value) => {
    const r = await kvl(["chat", pack, "hi", "--max-new", value]);
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(`kvl chat: error: option '--max-new <n>' argument '${value}' is invalid. expected a whole number of 1 or more, in digits (e.g. 256)\n`);
  });
});

describe("kvl serve: an empty key and an address it cannot bind", () => {
  it("an empty KVL_API_KEY is refused as --api-key '' is, before anything listens", async () => {
    const env = await kvl(["serve", pack, "--port", "0"], { KVL_API_KEY: "" });
    expectOneLine(env, "KVL_API_KEY");
    expect(env.stderr).toBe("kvl serve: error: KVL_API_KEY is set but empty; set it to the key, or unset it (unset KVL_API_KEY) to serve without one\n");
    const option = await kvl(["serve", pack, "--port", "0", "--api-key", ""]);
    expectOneLine(option, "--api-key must not be empty");
  });

  it.each([
    ["999.1.1.1", "('999.1.1.1' is not a valid IP address, nor a name that resolves to one)"],
    ["192.0.2.1", "(192.0.2.1 is not an address of this machine)"], // TEST-NET-1: never assigned
  ])("--host %s names what is wrong with the address, not the port", async (host, why) => {
    const r = await kvl(["serve", pack, "--port", "0", "--host", host, "--api-key", "k"]);
    expectOneLine(r, why);
    expect(r.stderr).toBe(`kvl serve: error: cannot listen on ${host}:0 ${why}; give --host an address of this machine ` +
      "(127.0.0.1, the default; 0.0.0.0 for all of its interfaces)\n");
  });
});

describe("kvl synth --help", () => {
  it("gives tiny's real size, and no wording of the machine it was written on", async () => {
    const r = await kvl(["synth", "--help"]);
    expect(r.status).toBe(0);
    const help = r.stdout.replace(/\s+/g, " ");
    let bytes = 0;
    for (const name of readdirSync(ckpt)) bytes += statSync(join(ckpt, name)).size; // tiny, seed 0, as kvl synth writes it
    expect(help).toContain(`tiny (about ${Math.round(bytes / 2 ** 20)} MiB,`);
    expect(help).not.toMatch(/a few MB|\bhere\b/);
  });
});

describe("kvl pack checks the destination's free space before it writes", () => {
  it("a 20 MiB disk for a 41 MiB pack: one line naming both sizes, no .bin written", async () => {
    const disk = join(tmp.dir, "small-disk");
    mkdirSync(disk);
    // a real small file system (the tests run as root, as they do for /proc and /sys above)
    const mounted = spawnSync("mount", ["-t", "tmpfs", "-o", "size=20m", "tmpfs", disk], { encoding: "utf8" });
    expect(mounted.status, `mount a 20 MiB tmpfs: ${mounted.stderr}`).toBe(0);
    try {
      const r = await kvl(["pack", ckpt, join(disk, "p"), "--allow-revision"]);
      expectOneLine(r, join(disk, "p"));
      const m = /: the pack needs (\d+) MiB but its disk has (\d+) MiB free; free some space or choose a destination on another disk/.exec(r.stderr);
      expect(m, r.stderr).not.toBeNull();
      let packBytes = 0;
      for (const name of readdirSync(pack)) packBytes += statSync(join(pack, name)).size;
      expect(Number(m![1])).toBeGreaterThanOrEqual(Math.floor(packBytes / 2 ** 20));
      expect(Number(m![1])).toBeLessThanOrEqual(Math.ceil(packBytes / 2 ** 20) + 4);
      expect(Number(m![2])).toBe(20);
      expect(readdirSync(join(disk, "p")).filter((f) => f.endsWith(".bin"))).toEqual([]);
    } finally {
      spawnSync("umount", [disk]);
    }
  });
});

/** `kvl` run by /bin/sh, so its arguments can hold bytes that are not UTF-8 (Node's spawn takes
 * only strings): `script` sees $KVL, $NODE, $PACK and $CKPT and runs in the test's folder. */
function kvlShell(script: string): Promise<Run> {
  const base = { ...process.env };
  for (const name of ["KVL_BACKEND", "KVL_INSTANCES", "KVL_API_KEY"]) delete base[name];
  const child = spawn("/bin/sh", ["-c", script], {
    env: { ...base, KVL, NODE: process.execPath, PACK: pack, CKPT: ckpt }, timeout: 60_000, killSignal: "SIGKILL", cwd: tmp.dir,
  });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (t: string) => (stdout += t));
  child.stderr.setEncoding("utf8").on("data", (t: string) => (stderr += t));
  return new Promise((resolve, reject) => {
    child.on("error", reject);
    child.on("close", (status, signal) => resolve({ status, signal, stdout, stderr }));
  });
}

describe("an argument that is not UTF-8 is refused in one line before anything is written", () => {
  const why = "is not valid UTF-8 text: Node.js reads command-line arguments as UTF-8, so kvl can neither open nor create a file of that name; " +
    "rename the file or folder to a UTF-8 name (or pass a link that has one) and run the command again\n";

  it("kvl pack into a folder named with bytes 0xff 0xfe: refused, nothing created", async () => {
    const before = readdirSync(tmp.dir).sort();
    const r = await kvlShell(`exec "$NODE" "$KVL" pack "$CKPT" "$(printf 'pack-\\377\\376')" --allow-revision`);
    expectOneLine(r, "pack-\\xff\\xfe");
    expect(r.stderr).toBe(`kvl pack: error: the argument 'pack-\\xff\\xfe' ${why}`);
    expect(readdirSync(tmp.dir).sort()).toEqual(before);
  });

  it("kvl chat --image with a file that exists under such a name: refused as such, not 'not found'", async () => {
    const r = await kvlShell(`f="$(printf 'img-\\377.png')"; cp "$PACK/config.json" "$f" && "$NODE" "$KVL" chat "$PACK" Hi --image "$f"; s=$?; rm -f "$f"; exit $s`);
    expectOneLine(r, "img-\\xff.png");
    expect(r.stderr).toBe(`kvl chat: error: the argument 'img-\\xff.png' ${why}`);
  });
});
