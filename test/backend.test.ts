import { copyFileSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { describe, expect, it } from "vitest";

import { BackendError, chooseBackend, testLoadNativeAddon } from "../host/core/backend.js";
import { expectedNativeKernelSet, readCpuInfo } from "../host/core/cpu.js";
import { nativeAddonPath } from "../host/system/paths.js";
import { probeWasmFeatures } from "../host/core/wasm-features.js";

const env = (extra: Record<string, string>): NodeJS.ProcessEnv => {
  const base = { ...process.env };
  delete base.KVL_BACKEND;
  delete base.KVL_ADDON;
  delete base.KVL_KERNELS;
  return { ...base, ...extra };
};

describe("WebAssembly feature probes", () => {
  it("finds SIMD128 and threads in this Node", () => {
    const f = probeWasmFeatures();
    expect(f.simd128).toBe(true);
    expect(f.threads).toBe(true);
  });

  it("rejects what this Node cannot validate (the probes are real modules)", () => {
    // The SIMD probe with an unknown SIMD opcode must not validate.
    const bad = new Uint8Array([0, 0x61, 0x73, 0x6d, 1, 0, 0, 0, 1, 5, 1, 0x60, 0, 1, 0x7b, 3, 2, 1, 0,
      0x0a, 6, 1, 4, 0, 0xfd, 0x7f, 0x0b]);
    expect(WebAssembly.validate(bad)).toBe(false);
  });
});

describe("backend choice", () => {
  it("auto picks the native addon when it loads with vector kernels, and says why", () => {
    const record = chooseBackend({ env: env({}) });
    expect(record.native.loads).toBe(true);
    const flags = readCpuInfo().flags;
    expect(flags).not.toBeNull();
    const expected = expectedNativeKernelSet(flags ?? []);
    expect(record.native.defaultKernelSet).toBe(expected);
    expect(record.chosen).toBe(expected === "scalar" ? "wasm" : "native");
    expect(record.reason).toMatch(/^auto: /);
    expect(record.requestedBy).toBe("default");
    expect(Object.isFrozen(record) && Object.isFrozen(record.native)).toBe(true);
  });

  it("KVL_BACKEND and --backend choose, the option winning", () => {
    expect(chooseBackend({ env: env({ KVL_BACKEND: "wasm" }) })).toMatchObject({ chosen: "wasm", requestedBy: "KVL_BACKEND" });
    expect(chooseBackend({ option: "native", env: env({ KVL_BACKEND: "wasm" }) })).toMatchObject({ chosen: "native", requestedBy: "option" });
    expect(() => chooseBackend({ option: "gpu", env: env({}) })).toThrow(/--backend: expected one of auto, native, wasm, got "gpu"/);
    expect(() => chooseBackend({ env: env({ KVL_BACKEND: "fast" }) })).toThrow(/KVL_BACKEND/);
  });

  it("KVL_KERNELS lowers the native kernel set the core picks, never raises it", () => {
    expect(chooseBackend({ env: env({ KVL_KERNELS: "avx2" }) }).native.defaultKernelSet).toBe("avx2");
    expect(chooseBackend({ env: env({ KVL_KERNELS: "scalar" }) })).toMatchObject({
      chosen: "wasm", native: { defaultKernelSet: "scalar" } });
  });

  it("a missing addon: auto falls back to WebAssembly, --backend native fails naming the path", (ctx) => {
    const dir = mkdtempSync(join(tmpdir(), "kvl-addon-"));
    ctx.onTestFinished(() => rmSync(dir, { recursive: true, force: true }));
    const missing = join(dir, "nope.node");
    const record = chooseBackend({ env: env({ KVL_ADDON: missing }) });
    expect(record.chosen).toBe("wasm");
    expect(record.native).toMatchObject({ present: false, loads: false });
    expect(record.reason).toContain(missing);
    let caught: unknown;
    try {
      chooseBackend({ option: "native", env: env({ KVL_ADDON: missing }) });
    } catch (err) {
      caught = err;
    }
    expect(caught).toBeInstanceOf(BackendError);
    expect(String(caught)).toContain(missing);
  });

  it("an addon that cannot load is found out in a child process, not in this one", (ctx) => {
    const dir = mkdtempSync(join(tmpdir(), "kvl-addon-"));
    ctx.onTestFinished(() => rmSync(dir, { recursive: true, force: true }));
    const garbage = join(dir, "kvl_core.node");
    writeFileSync(garbage, Buffer.from("this is not a shared library"));
    const status = testLoadNativeAddon(garbage);
    expect(status).toMatchObject({ present: true, loads: false });
    expect(status.error).toMatch(/does not load/);
    // A real addon copied elsewhere still loads: the check is of the file, not of the name.
    const copy = join(dir, "copy.node");
    copyFileSync(nativeAddonPath(), copy);
    expect(testLoadNativeAddon(copy).loads).toBe(true);
    const record = chooseBackend({ env: env({ KVL_ADDON: garbage }) });
    expect(record.chosen).toBe("wasm");
    expect(record.reason).toMatch(/does not load/);
  });
});
