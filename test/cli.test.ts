/** The `kvl` command as a user runs it (the compiled dist/cli/kvl.js, in a child process). */
import { spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");

function kvl(args: string[], env: Record<string, string> = {}) {
  const base = { ...process.env };
  delete base.KVL_BACKEND;
  const r = spawnSync(process.execPath, [KVL, ...args], { encoding: "utf8", env: { ...base, ...env }, timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe("kvl --help", () => {
  it("lists every command", () => {
    const r = kvl(["--help"]);
    expect(r.status).toBe(0);
    for (const c of ["doctor", "synth", "pack", "prepare", "chat", "serve", "bench"]) expect(r.stdout).toMatch(new RegExp(`^  ${c} `, "m"));
  });

  it("doctor --help shows its options", () => {
    const r = kvl(["doctor", "--help"]);
    expect(r.status).toBe(0);
    expect(r.stdout).toContain("Usage: kvl doctor [options] [model]");
    expect(r.stdout.replace(/\s+/g, " ")).toMatch(/--backend <name> .*\(choices: "auto", "native", "wasm"\)/);
  });

  it("an unknown command or backend is a one-line error, without the help", () => {
    const a = kvl(["frobnicate"]);
    expect(a.status).not.toBe(0);
    expect(a.stderr).toMatch(/unknown command 'frobnicate'/);
    const b = kvl(["doctor", "--backend", "gpu"]);
    expect(b.status).not.toBe(0);
    expect(b.stderr).toMatch(/Allowed choices are auto, native, wasm/);
    expect(b.stderr.trim().split("\n")).toHaveLength(1);
  });
});

describe("--act-dtype i16 (the removed two-term mode)", () => {
  it.each(["chat", "serve", "bench", "doctor"])("kvl %s refuses it in one line naming the modes there are, before looking at the model", (command) => {
    const r = kvl([command, join(tmpdir(), "kvl-no-such-model"), "--act-dtype", "i16"]);
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(`kvl ${command}: error: option '--act-dtype <dtype>' argument 'i16' is invalid. Allowed choices are auto, f32, bf16, i16x1, i8.\n`);
    expect(r.stdout).toBe("");
  });
});

describe("kvl doctor without a model", () => {
  it("reports both backends, self-tests every kernel set and ends with PASS", () => {
    const r = kvl(["doctor"]);
    expect(r.stderr).toBe("");
    expect(r.status).toBe(0);
    const lines = r.stdout.trim().split("\n");
    expect(lines.at(-1)).toBe("PASS");
    expect(r.stdout).toMatch(/^backend: native — auto: the native addon \((local build|prebuilt)\) loads and runs \S+ kernels$/m);
    expect(r.stdout).toMatch(/^native addon: \S+kvl_core\.node \((local build|prebuilt)\)$/m);
    expect(r.stdout).toMatch(/^ {2}wasm +simd128 +\d+ checks {2}ok$/m);
    expect(r.stdout).toMatch(/^ {2}native +avx2 +\d+ checks {2}ok$/m);
    expect(r.stdout).toMatch(/^ {2}wasm +scalar +\d+ checks {2}ok$/m);
    // Linux: what the transparent huge page mode means for each backend's direct reads
    const thpFile = "/sys/kernel/mm/transparent_hugepage/enabled";
    const mode = existsSync(thpFile) ? /\[(\w+)\]/.exec(readFileSync(thpFile, "utf8"))?.[1] : undefined;
    if (mode) {
      expect(r.stdout).toMatch(new RegExp(`^huge pages, native: .*"?${mode}"?`, "m"));
      expect(r.stdout).toMatch(mode === "always" ? /^huge pages, wasm: .*the WebAssembly memory gets them too$/m
        : /^huge pages, wasm: .*echo always \| sudo tee/m);
    } else {
      expect(r.stdout).not.toContain("huge pages");
    }
    // how each backend bypasses the page cache here (test/direct-io.test.ts has the other platforms)
    if (process.platform === "linux") {
      expect(r.stdout).toMatch(/^direct reads, native: O_DIRECT, /m);
      expect(r.stdout).toMatch(/^direct reads, wasm: O_DIRECT through Node's fs, /m);
    }
  });

  it("--json gives the backend record; KVL_BACKEND=wasm chooses WebAssembly", () => {
    const r = kvl(["doctor", "--json"], { KVL_BACKEND: "wasm" });
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as {
      pass: boolean; backend: { chosen: string; requestedBy: string; wasm: { features: { simd128: boolean } } };
      selfTests: { backend: string; set: string; table: string; failed: number }[];
    };
    expect(report.pass).toBe(true);
    expect(report.backend.chosen).toBe("wasm");
    expect(report.backend.requestedBy).toBe("KVL_BACKEND");
    expect(report.backend.wasm.features.simd128).toBe(true);
    for (const t of report.selfTests) expect(t.table).toBe(t.set);
    expect(report.selfTests.map((t) => `${t.backend}:${t.set}`)).toContain("wasm:simd128");
  });

  it("FAIL when an explicitly requested backend is missing", () => {
    const r = kvl(["doctor", "--backend", "native"], { KVL_ADDON: "/nonexistent/kvl_core.node" });
    expect(r.status).toBe(1);
    expect(r.stdout).toContain("/nonexistent/kvl_core.node");
    expect(r.stdout.trim().split("\n").at(-1)).toBe("FAIL");
  });
});

describe("kvl synth and kvl pack", () => {
  it("synthesize a tiny checkpoint and pack it, on the WebAssembly core", () => {
    const dir = mkdtempSync(join(tmpdir(), "kvl-cli-"));
    try {
      const synth = kvl(["synth", join(dir, "ckpt"), "--preset", "tiny", "--seed", "3"], { KVL_BACKEND: "wasm" });
      expect(synth.stderr).toBe("");
      expect(synth.status).toBe(0);
      expect(synth.stdout).toMatch(/^wrote tiny checkpoint \(seed 3, [\d.]+ MiB of tensors\) to .*--allow-revision\n$/);
      const pack = kvl(["pack", join(dir, "ckpt"), join(dir, "pack"), "--allow-revision", "--quiet"], { KVL_BACKEND: "wasm" });
      expect(pack.status, pack.stderr).toBe(0);
      for (const file of ["PACK_COMPLETE.json", "trunk.bin", "experts.bin", "vision.bin", "tiktoken.model"]) expect(existsSync(join(dir, "pack", file)), file).toBe(true);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("explain a mistake in one line with exit status 1, and write nothing", () => {
    const dir = mkdtempSync(join(tmpdir(), "kvl-cli-"));
    try {
      const r = kvl(["synth", join(dir, "ckpt"), "--n-group", "4"]);
      expect(r.status).toBe(1);
      expect(r.stderr).toBe("kvl synth: error: --n-group and --topk-group go together; pass both\n");
      expect(existsSync(join(dir, "ckpt"))).toBe(false);
      const p = kvl(["pack", join(dir, "missing"), join(dir, "pack")]);
      expect(p.status).toBe(1);
      expect(p.stderr).toMatch(/^kvl pack: error: .*missing/);
      expect(p.stderr.trim().split("\n")).toHaveLength(1);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
