/**
 * The kernel conformance table on every kernel set of both backends: every table entry against
 * the scalar reference, run by the core itself (kvl_kernels_conformance), and which table ran.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { expectedNativeKernelSet, readCpuInfo } from "../host/core/cpu.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";

const ENTRIES = ["matmul_bf16", "matmul_q8", "matmul_f32", "matmul_bf16_xb", "matmul_q8_xb",
  "quantize_i16_act", "matmul_q8_i16", "matmul_q8_i8", "matmul_i16_i16", "dot_f32", "axpy_f32", "axpy_rows_f32", "bf16_to_f32", "q8_to_f32",
  "f32_to_bf16", "softmax", "gelu_tanh"];

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
    const report = core.conformance(set);
    expect(report.set).toBe(set);
    expect(report.table).toBe(set); // the functions that ran are that set's
    expect(new Set(report.checks.map((c) => c.kernel))).toEqual(new Set(ENTRIES));
    const failures = report.checks.filter((c) => !c.ok);
    expect(failures).toEqual([]);
    expect(report.failed).toBe(0);
    // bit-exact entries really are exact
    for (const c of report.checks.filter((c) => ["quantize_i16_act", "matmul_q8_i16", "matmul_q8_i8", "f32_to_bf16", "bf16_to_f32", "q8_to_f32"].includes(c.kernel))) {
      expect(c.max_err).toBe(0);
    }
  });

  it("refuses a kernel set it does not have", () => {
    expect(() => core.conformance(name === "wasm" ? "avx2" : "simd128")).toThrow(/not available/);
    expect(() => core.conformance("no-such-set")).toThrow(/not available/);
  });

  it("abi version", () => {
    expect(core.abiVersion()).toBe(1);
  });
});
