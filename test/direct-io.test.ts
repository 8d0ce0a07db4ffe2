/** host/core/direct-io.ts and `kvl doctor`'s lines from it: what each backend does about the page cache
 * on each platform (injected), and advice that is right for that platform. */
import { describe, expect, it } from "vitest";

import { type DoctorReport, directReadsHere, renderDoctor } from "../cli/doctor.js";
import type { BackendRecord } from "../host/core/backend.js";
import { type IoPlatform, bufferedReadAdvice, directReadSupport } from "../host/core/direct-io.js";

const LINUX: IoPlatform = { platform: "linux", nodeHasODirect: true };
const WINDOWS: IoPlatform = { platform: "win32", nodeHasODirect: false };
const MACOS: IoPlatform = { platform: "darwin", nodeHasODirect: false };

describe("direct reads per platform and backend", () => {
  it("Linux: O_DIRECT on both backends, the WebAssembly one through Node's fs", () => {
    expect(directReadSupport("native", LINUX)).toEqual({ supported: true, detail: expect.stringMatching(/^O_DIRECT, 4096-aligned/) });
    expect(directReadSupport("wasm", LINUX)).toEqual({ supported: true, detail: expect.stringMatching(/^O_DIRECT through Node's fs/) });
  });

  it("Windows: FILE_FLAG_NO_BUFFERING on both backends, the WebAssembly one through libuv's UV_FS_O_DIRECT", () => {
    const native = directReadSupport("native", WINDOWS);
    expect(native.supported).toBe(true);
    expect(native.detail).toMatch(/^FILE_FLAG_NO_BUFFERING, .*the volume's sector size/);
    const wasm = directReadSupport("wasm", WINDOWS);
    expect(wasm.supported).toBe(true);
    expect(wasm.detail).toMatch(/^FILE_FLAG_NO_BUFFERING through libuv's UV_FS_O_DIRECT/);
  });

  it("macOS: F_NOCACHE natively; WebAssembly cannot ask (Node has no O_DIRECT there) and says so", () => {
    expect(directReadSupport("native", MACOS).detail).toMatch(/^F_NOCACHE/);
    const wasm = directReadSupport("wasm", MACOS);
    expect(wasm.supported).toBe(false);
    expect(wasm.detail).toMatch(/^none: Node's fs has no page-cache bypass on darwin/);
  });

  it("this process's answer follows from its own platform", () => {
    const here = directReadsHere();
    expect(here.native.supported).toBe(true);
    if (process.platform === "linux") expect(here.wasm.detail).toMatch(/^O_DIRECT through Node's fs/);
  });
});

describe("advice when a model's reads came out buffered", () => {
  it("Linux names Linux filesystems", () => {
    for (const backend of ["native", "wasm"] as const) {
      const advice = bufferedReadAdvice(backend, "/m", LINUX);
      expect(advice).toMatch(/^the filesystem of \/m refuses O_DIRECT/);
      expect(advice).toContain("ext4 or xfs");
    }
  });

  it("Windows names a local NTFS disk, never a Linux filesystem", () => {
    for (const backend of ["native", "wasm"] as const) {
      const advice = bufferedReadAdvice(backend, "C:\\m", WINDOWS);
      expect(advice).toMatch(/^the volume of C:\\m refuses unbuffered reads/);
      expect(advice).toContain("local NTFS disk");
      expect(advice).not.toMatch(/ext4|xfs|O_DIRECT/);
    }
  });

  it("where the backend cannot ask at all, moving the model would not help: it says to use the native backend", () => {
    const advice = bufferedReadAdvice("wasm", "/m", MACOS);
    expect(advice).toMatch(/use --backend native for a hard cap$/);
    expect(advice).not.toMatch(/move the model/);
  });
});

describe("kvl doctor's text on each platform", () => {
  const record = {
    chosen: "native", requested: "auto", requestedBy: "default", reason: "auto: test",
    native: { path: "kvl_core.node", origin: "local build", skipped: [], present: true, loads: true, error: null, kernelSets: [{ name: "avx2", supported: true }], defaultKernelSet: "avx2" },
    wasm: { dist: "dist", present: true, features: { simd128: true, threads: true, relaxedSimd: true }, usable: true, error: null },
    cpu: { model: "test CPU", cores: 2, flags: ["avx2"] }, node: "v20.0.0", platform: "win32 x64",
  } as unknown as BackendRecord;
  const report = (io: IoPlatform, thp: DoctorReport["thp"]): DoctorReport =>
    ({ backend: record, backendError: null, selfTests: [], thp, directReads: directReadsHere(io), pass: true });

  it("Windows: a direct-read line per backend, no huge pages line", () => {
    const text = renderDoctor(report(WINDOWS, null));
    expect(text).toMatch(/^direct reads, native: FILE_FLAG_NO_BUFFERING/m);
    expect(text).toMatch(/^direct reads, wasm: FILE_FLAG_NO_BUFFERING through libuv's UV_FS_O_DIRECT/m);
    expect(text).not.toContain("huge pages");
  });

  it("Linux: O_DIRECT lines, and the huge pages lines", () => {
    const text = renderDoctor(report(LINUX, "madvise"));
    expect(text).toMatch(/^direct reads, native: O_DIRECT/m);
    expect(text).toMatch(/^direct reads, wasm: O_DIRECT through Node's fs/m);
    expect(text).toMatch(/^huge pages, wasm: /m);
  });
});
