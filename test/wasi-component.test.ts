/**
 * The kernel library built without emscripten (wasm-core/wasi/, issue 14): wasm32-wasi with
 * clang + wasi-libc, made a component of the kvl:kernels world with jco, transpiled with
 * `jco transpile`, and the kernel conformance table run through it from Node (SIMD128, one thread).
 */
import { spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

const ENTRIES = ["matmul_bf16", "matmul_q8", "matmul_f32", "matmul_bf16_xb", "matmul_q8_xb",
  "quantize_i16_act", "matmul_q8_i16", "matmul_q8_i8", "matmul_i16_i16",
  "matmul_q4", "matmul_q4_xb", "matmul_q4_i16", "matmul_q4_i8", "dot_f32", "axpy_f32", "axpy_rows_f32", "bf16_to_f32", "q8_to_f32",
  "f32_to_bf16", "softmax", "gelu_tanh", "gemm_bf16", "gemm_bf16_xb", "gemm_tile_bf16", "gemm_bf16_amx", "attention_bf16_amx"];

/** The exports of kernels.wit as jco transpiles them (result<string, string>: err throws). */
interface KernelsComponent {
  kernelSets(): string[];
  defaultKernelSet(): string;
  conformance(set: string): string;
}

interface Report {
  set: string;
  table: string;
  checks: { kernel: string; ok: boolean; max_err: number }[];
  failed: number;
}

const root = fileURLToPath(new URL("..", import.meta.url));

describe("kernels as a WASI component (jco)", () => {
  let out = "";
  let kernels: KernelsComponent;

  beforeAll(async () => {
    // Under build/ (git-ignored) so the transpiled JS resolves @bytecodealliance/preview2-shim
    // from this project's node_modules.
    mkdirSync(join(root, "build"), { recursive: true });
    out = mkdtempSync(join(root, "build", "wasi-test-"));
    const build = spawnSync("bash", [join(root, "wasm-core/wasi/build.sh"), out], {
      cwd: root, encoding: "utf8",
    });
    if (build.status !== 0) throw new Error(`wasi/build.sh failed:\n${build.stdout}\n${build.stderr}`);
    // The guest's environment: empty, so KVL_KERNELS of this process cannot cap the default.
    const cli = (await import("@bytecodealliance/preview2-shim/cli")) as unknown as {
      _setEnv(env: Record<string, string>): void;
    };
    cli._setEnv({});
    kernels = (await import(pathToFileURL(join(out, "js", "kernels.js")).href)) as KernelsComponent;
  });
  afterAll(() => {
    if (out) rmSync(out, { recursive: true, force: true });
  });

  it("is a plain WASI module: nothing imported from emscripten's runtime", () => {
    const core = new WebAssembly.Module(readFileSync(join(out, "kernels.core.wasm")));
    const modules = new Set(WebAssembly.Module.imports(core).map((i) => i.module));
    expect(modules.has("env")).toBe(false);
    expect([...modules]).toEqual(["wasi_snapshot_preview1"]);
    const exports = WebAssembly.Module.exports(core).map((e) => e.name);
    expect(exports).toEqual(expect.arrayContaining(["kernel-sets", "default-kernel-set", "conformance",
      "cabi_realloc"]));
  });

  it("offers scalar and simd128, and picks simd128", () => {
    expect(kernels.kernelSets()).toEqual(["scalar", "simd128"]);
    expect(kernels.defaultKernelSet()).toBe("simd128");
  });

  it.each(["simd128", "scalar"])("kernel set %s conforms to the scalar reference", (set) => {
    const report = JSON.parse(kernels.conformance(set)) as Report;
    expect(report.set).toBe(set);
    expect(report.table).toBe(set);
    expect(new Set(report.checks.map((c) => c.kernel))).toEqual(new Set(ENTRIES));
    expect(report.checks.filter((c) => !c.ok)).toEqual([]);
    expect(report.failed).toBe(0);
    for (const c of report.checks.filter((c) => ["quantize_i16_act", "matmul_q8_i16", "matmul_q8_i8", "matmul_q4_i16", "matmul_q4_i8", "f32_to_bf16",
      "bf16_to_f32", "q8_to_f32"].includes(c.kernel))) {
      expect(c.max_err).toBe(0);
    }
  });

  it("refuses a kernel set it does not have", () => {
    expect(() => kernels.conformance("avx2")).toThrow(/not available/);
    expect(() => kernels.conformance("no-such-set")).toThrow(/not available/);
    expect(() => kernels.conformance("")).toThrow(/not available/);
  });
});
