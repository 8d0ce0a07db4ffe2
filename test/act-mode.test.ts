/**
 * `--act-dtype auto` (host/plan/act-mode.ts): the table of backend + kernel set -> mode, written
 * out here as README "Numerics" and bench/RESULTS.md state it (vector kernels: i16x1; scalar:
 * f32, the exact mode), an explicit --act-dtype winning over it, the KV dtype following the
 * resolved mode, and the kernel set auto resolves for before an engine is opened (WebAssembly:
 * what an instance of the build wasm-relaxed.ts chooses reports as its default — simd128-relaxed
 * where its self-test passed — whatever KVL_KERNELS says).
 */
import { describe, expect, it } from "vitest";

import { WasmBackend } from "../host/core/wasm-backend.js";
import { wasmBuildFor } from "../host/core/wasm-relaxed.js";
import { actModeFor, expectedKernelSet, resolveActMode } from "../host/plan/act-mode.js";

const record = (defaultKernelSet: string | null) => ({ native: { defaultKernelSet } }) as Parameters<typeof expectedKernelSet>[0];

describe("--act-dtype auto", () => {
  it.each([
    ["native", "avx2", "i16x1", "i16"],
    ["native", "avx512", "i16x1", "i16"],
    ["native", "avx512-bf16", "i16x1", "i16"],
    ["wasm", "simd128", "i16x1", "i16"],
    ["wasm", "simd128-relaxed", "i16x1", "i16"],
    ["native", "scalar", "f32", "f32"],
    ["wasm", "scalar", "f32", "f32"],
  ] as const)("%s with %s kernels runs %s (KV cache %s)", (backend, kernels, act, kv) => {
    const mode = resolveActMode("auto", backend, kernels);
    expect(mode).toMatchObject({ actDtype: act, kvDtype: kv, chosenBy: "auto", kernels });
    expect(mode.reason.length).toBeGreaterThan(0);
  });

  it("keeps the exact mode for a kernel set the table does not list, and for a set on the other backend", () => {
    expect(resolveActMode("auto", "native", "neon").actDtype).toBe("f32");
    expect(resolveActMode("auto", "wasm", "avx2").actDtype).toBe("f32");
    expect(resolveActMode("auto", "native", "simd128").actDtype).toBe("f32");
  });

  it("an explicit --act-dtype wins, on every kernel set; its KV dtype is the one that goes with it", () => {
    expect(resolveActMode("f32", "native", "avx2")).toMatchObject({ actDtype: "f32", kvDtype: "f32", chosenBy: "option", reason: "--act-dtype" });
    expect(resolveActMode("f32", "wasm", "simd128")).toMatchObject({ actDtype: "f32", chosenBy: "option" });
    expect(resolveActMode("bf16", "native", "avx512-bf16")).toMatchObject({ actDtype: "bf16", kvDtype: "f32", chosenBy: "option" });
    expect(resolveActMode("bf16", "wasm", "simd128")).toMatchObject({ actDtype: "bf16", kvDtype: "f32", chosenBy: "option" });
    expect(resolveActMode("i8", "native", "scalar")).toMatchObject({ actDtype: "i8", kvDtype: "i16", chosenBy: "option" });
    expect(resolveActMode("i16x1", "wasm", "scalar")).toMatchObject({ actDtype: "i16x1", kvDtype: "i16", chosenBy: "option" });
  });

  it("resolves for the kernel set the engine will run: --kernels when given, else the backend's default", async () => {
    expect(expectedKernelSet(record("avx512-bf16"), "native", "auto", "simd128")).toBe("avx512-bf16");
    expect(expectedKernelSet(record("avx512-bf16"), "native", "scalar", "simd128")).toBe("scalar");
    expect(expectedKernelSet(record("avx2"), "wasm", "auto", "simd128")).toBe("simd128");
    expect(expectedKernelSet(record("avx2"), "wasm", "scalar", "simd128-relaxed")).toBe("scalar");
    expect(await actModeFor("auto", record("avx2"), "native", "auto")).toMatchObject({ actDtype: "i16x1", kernels: "avx2" });
    expect(await actModeFor("auto", record("avx2"), "native", "scalar")).toMatchObject({ actDtype: "f32", kernels: "scalar" });
    expect(await actModeFor("auto", record(null), "wasm", "scalar")).toMatchObject({ actDtype: "f32", kernels: "scalar" });
  });

  it("names simd128-relaxed, not simd128, where the relaxed build is the one WebAssembly runs", async () => {
    expect(expectedKernelSet(record(null), "wasm", "auto", "simd128-relaxed")).toBe("simd128-relaxed");
    expect(resolveActMode("auto", "wasm", expectedKernelSet(record(null), "wasm", "auto", "simd128-relaxed")))
      .toMatchObject({ actDtype: "i16x1", kernels: "simd128-relaxed" });
    // in this Node: the build wasm-relaxed.ts chooses
    expect(await actModeFor("auto", record(null), "wasm", "auto")).toMatchObject({ actDtype: "i16x1", kernels: await wasmBuildFor("auto") });
  });

  it("the WebAssembly default it assumes is what an instance reports, also under KVL_KERNELS=scalar", async () => {
    const saved = process.env.KVL_KERNELS;
    process.env.KVL_KERNELS = "scalar";
    const wasm = await WasmBackend.create({ build: await wasmBuildFor("auto") });
    try {
      expect(wasm.defaultKernelSet()).toBe((await actModeFor("auto", record(null), "wasm", "auto")).kernels);
    } finally {
      wasm.close();
      if (saved === undefined) delete process.env.KVL_KERNELS;
      else process.env.KVL_KERNELS = saved;
    }
  });
});
