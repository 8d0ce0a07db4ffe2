/**
 * The kernel conformance table on every kernel set of both backends: every table entry against
 * the scalar reference, run by the core itself (kvl_kernels_conformance), and which table ran.
 * The WebAssembly relaxed build (simd128-relaxed) where this Node has relaxed SIMD (Node >= 22,
 * Node 20 with --experimental-wasm-relaxed-simd); elsewhere, that it does not load and auto keeps
 * simd128.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { expectedNativeKernelSet, readCpuInfo } from "../host/core/cpu.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { probeWasmFeatures } from "../host/core/wasm-features.js";
import { wasmBuildFor } from "../host/core/wasm-relaxed.js";
import { UserError } from "../host/system/user-error.js";

const ENTRIES = ["matmul_bf16", "matmul_q8", "matmul_f32", "matmul_bf16_xb", "matmul_q8_xb",
  "quantize_i16_act", "matmul_q8_i16", "matmul_q8_i8", "matmul_i16_i16",
  "matmul_q4", "matmul_q4_xb", "matmul_q4_i16", "matmul_q4_i8", "dot_f32", "axpy_f32", "axpy_rows_f32", "bf16_to_f32", "q8_to_f32",
  "f32_to_bf16", "softmax", "gelu_tanh", "gemm_bf16", "gemm_bf16_xb", "gemm_tile_bf16", "gemm_bf16_amx", "attention_bf16_amx"];

const EXACT = ["quantize_i16_act", "matmul_q8_i16", "matmul_q8_i8", "matmul_q4_i16", "matmul_q4_i8",
  "f32_to_bf16", "bf16_to_f32", "q8_to_f32"];

/** Every entry of one set checked, none failed, the bit-exact ones exact, and that set's table ran. */
function expectConforms(core: CoreBackend, set: string): void {
  const report = core.conformance(set);
  expect(report.set).toBe(set);
  expect(report.table).toBe(set); // the functions that ran are that set's
  expect(new Set(report.checks.map((c) => c.kernel))).toEqual(new Set(ENTRIES));
  const failures = report.checks.filter((c) => !c.ok);
  expect(failures).toEqual([]);
  expect(report.failed).toBe(0);
  for (const c of report.checks.filter((c) => EXACT.includes(c.kernel))) expect(c.max_err).toBe(0);
}

const flags = readCpuInfo().flags ?? [];
const nativeExpected = expectedNativeKernelSet(flags);
/** The sets each backend must offer on this CPU, from the OS's flags (not from the core). */
const expectedSets = {
  wasm: ["scalar", "simd128"],
  native: ["scalar", ...(nativeExpected === "scalar" ? [] : ["avx2"]),
    ...(nativeExpected.startsWith("avx512") ? ["avx512"] : []),
    ...(nativeExpected === "avx512-bf16" ? ["avx512-bf16"] : [])],
};

describe.each(["wasm", "native"] as const)("%s backend", (name) => {
  let core: CoreBackend;
  beforeAll(async () => {
    core = name === "wasm" ? await WasmBackend.create() : new NativeBackend();
  });
  afterAll(() => core.close());

  it("offers the kernel sets this CPU supports, and picks the best", () => {
    const supported = core.kernelSets().filter((s) => s.supported).map((s) => s.name);
    expect(supported).toEqual(expectedSets[name]);
    expect(core.defaultKernelSet()).toBe(name === "wasm" ? "simd128" : nativeExpected);
  });

  it.each(expectedSets[name])("kernel set %s conforms to the scalar reference", (set) => {
    expectConforms(core, set);
  });

  it("refuses a kernel set it does not have", () => {
    expect(() => core.conformance(name === "wasm" ? "avx2" : "simd128")).toThrow(/not available/);
    expect(() => core.conformance("no-such-set")).toThrow(/not available/);
  });

  it("abi version", () => {
    expect(core.abiVersion()).toBe(1);
  });
});

describe("wasm relaxed build", () => {
  const relaxed = probeWasmFeatures().relaxedSimd;
  it(relaxed
    ? "has scalar, simd128 and simd128-relaxed, runs simd128-relaxed by default, every set conforms, and auto picks it"
    : "does not load in this Node (no relaxed SIMD): auto keeps simd128 and asking for simd128-relaxed is a user error", async () => {
    if (relaxed) {
      const core = await WasmBackend.create({ build: "simd128-relaxed" });
      try {
        expect(core.kernelSets().filter((s) => s.supported).map((s) => s.name)).toEqual(["scalar", "simd128", "simd128-relaxed"]);
        expect(core.defaultKernelSet()).toBe("simd128-relaxed");
        for (const set of ["scalar", "simd128", "simd128-relaxed"]) expectConforms(core, set);
      } finally {
        core.close();
      }
      expect(await wasmBuildFor("auto")).toBe("simd128-relaxed");
    } else {
      await expect(WasmBackend.create({ build: "simd128-relaxed" })).rejects.toThrow(/CompileError/);
      expect(await wasmBuildFor("auto")).toBe("simd128");
      await expect(wasmBuildFor("simd128-relaxed")).rejects.toThrow(UserError);
    }
    expect(await wasmBuildFor("simd128")).toBe("simd128");
  });
});
