/**
 * pack-fixtures.ts — shared by the packer's vitest files: temp dirs, a tiny synthesized
 * checkpoint, whole-tree snapshots of a directory, and `kvl pack` in a child process
 * (test/support/pack-child.mjs over the compiled dist/, so a test can SIGKILL it).
 */
import { type SpawnSyncReturns, spawn, spawnSync } from "node:child_process";
import { cpSync, existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";

import type { PackingCore } from "../../host/core/core-api.js";
import { packageRoot } from "../../host/system/paths.js";
import { synthesize } from "../../packer/synth.js";

export const PACK_CHILD = join(packageRoot, "test", "support", "pack-child.mjs");

/** A fresh temp directory; removed by the returned cleanup. */
export function tempDir(prefix: string): { dir: string; cleanup: () => void } {
  const dir = mkdtempSync(join(tmpdir(), `kvl-${prefix}-`));
  return { dir, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

/** The tiny preset, as `kvl synth --preset tiny --seed N [...]` writes it. */
export async function tinyCheckpoint(dir: string, core: PackingCore, seed = 0, extra: { biasDtype?: "bf16" | "f32"; nGroup?: number; topkGroup?: number } = {}): Promise<string> {
  return synthesize(dir, { preset: "tiny", seed, core, ...extra });
}

/** The two tiny test models, by their goldens' names: plain routing, and grouped routing. */
export const TINY_MODELS: ReadonlyArray<{ name: string; seed: number; extra: { nGroup?: number; topkGroup?: number } }> = [
  { name: "tiny-seed0", seed: 0, extra: {} },
  { name: "tiny-seed1-grouped", seed: 1, extra: { nGroup: 4, topkGroup: 2 } },
];

/** Every file under `dir` (recursively) with its bytes, by relative path. */
export function treeBytes(dir: string): Map<string, Buffer> {
  const out = new Map<string, Buffer>();
  const walk = (d: string): void => {
    for (const entry of readdirSync(d, { withFileTypes: true }).sort((a, b) => (a.name < b.name ? -1 : 1))) {
      const path = join(d, entry.name);
      if (entry.isDirectory()) walk(path);
      else out.set(relative(dir, path), readFileSync(path));
    }
  };
  walk(dir);
  return out;
}

/** Asserts-free comparison that names the first difference (for readable failures). */
export function treeDiff(a: Map<string, Buffer>, b: Map<string, Buffer>): string | null {
  const names = [...new Set([...a.keys(), ...b.keys()])].sort();
  for (const n of names) {
    const x = a.get(n);
    const y = b.get(n);
    if (!x || !y) return `${n}: only in ${x ? "the first" : "the second"} tree`;
    if (!x.equals(y)) return `${n}: contents differ`;
  }
  return null;
}

export function copyDir(src: string, dst: string): string {
  cpSync(src, dst, { recursive: true });
  return dst;
}

function childEnv(env: Record<string, string>): NodeJS.ProcessEnv {
  const base = { ...process.env };
  delete base.KVL_BACKEND;
  delete base.KVL_PACK_TEST_KILL_AT;
  delete base.KVL_PACK_FLUSH_ITEMS;
  return { ...base, ...env };
}

function requireDist(): void {
  if (!existsSync(join(packageRoot, "dist", "cli", "program.js"))) {
    throw new Error("dist/cli/program.js is missing: compile first (npx tsc -p .)");
  }
}

/** `kvl pack ARGS` in a child process; waits for it. */
export function runPack(args: string[], env: Record<string, string> = {}): SpawnSyncReturns<string> {
  requireDist();
  return spawnSync(process.execPath, [PACK_CHILD, "pack", ...args], { encoding: "utf8", env: childEnv(env), timeout: 300_000 });
}

/**
 * `kvl pack ARGS` in a child process, SIGKILLed from outside once `when()` is true (polled every
 * few ms) or after `maxMs`; resolves with how it ended.
 */
export function runPackKilledWhen(args: string[], env: Record<string, string>, when: () => boolean, maxMs: number):
  Promise<{ code: number | null; signal: NodeJS.Signals | null; killed: boolean }> {
  requireDist();
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [PACK_CHILD, "pack", ...args], { env: childEnv(env), stdio: "ignore" });
    const started = Date.now();
    let killed = false;
    const timer = setInterval(() => {
      if (!killed && (when() || Date.now() - started >= maxMs)) {
        killed = child.kill("SIGKILL");
      }
    }, 2);
    child.on("error", (err) => {
      clearInterval(timer);
      reject(err);
    });
    child.on("exit", (code, signal) => {
      clearInterval(timer);
      resolve({ code, signal, killed: signal === "SIGKILL" });
    });
  });
}

/** A core for tests that do not care which: the native addon where it is built, else WebAssembly
 * (the bytes are the same; test/pack-resume.test.ts compares them). */
export async function anyCore(): Promise<import("../../host/core/core-api.js").CoreBackend> {
  const { nativeBuilt } = await import("../helpers.js");
  if (nativeBuilt) return new (await import("../../host/core/native-backend.js")).NativeBackend();
  return (await import("../../host/core/wasm-backend.js")).WasmBackend.create();
}

/** A tiny checkpoint and its pack under dir (`ckpt/`, `pack/`), made on any core. */
export async function tinyPack(dir: string, seed = 0, extra: { biasDtype?: "bf16" | "f32"; nGroup?: number; topkGroup?: number } = {}): Promise<{ ckpt: string; pack: string }> {
  const { packCheckpoint } = await import("../../packer/pack.js");
  const core = await anyCore();
  try {
    const ckpt = await tinyCheckpoint(join(dir, "ckpt"), core, seed, extra);
    const pack = await packCheckpoint(ckpt, join(dir, "pack"), { core, allowRevision: true });
    return { ckpt, pack };
  } finally {
    core.close();
  }
}
