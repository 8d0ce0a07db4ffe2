/**
 * The choice of the WebAssembly build (host/core/wasm-relaxed.ts): the relaxed build's self-test
 * rejects a build whose relaxed product gives wrong sums (the real self-test, on a copy of the
 * build with its 8-bit dot products replaced by an add), kvl doctor says so and still passes (simd128
 * runs), and --kernels simd128-relaxed where it cannot run is one clear error.
 */
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, describe, expect, it } from "vitest";

import { type DoctorReport, renderDoctor, selfTestsPass } from "../cli/doctor.js";
import type { BackendRecord } from "../host/core/backend.js";
import { wasmDistDir } from "../host/system/paths.js";
import { UserError } from "../host/system/user-error.js";
import { type RelaxedVerdict, buildForChoice, judgeRelaxed } from "../host/core/wasm-relaxed.js";

/** [start, end) of the code section's contents. */
function codeSection(bytes: Uint8Array): [number, number] {
  let p = 8;
  while (p < bytes.length) {
    const id = bytes[p++]!;
    let size = 0;
    for (let shift = 0; ; shift += 7) {
      const b = bytes[p++]!;
      size += (b & 0x7f) * 2 ** shift;
      if (!(b & 0x80)) break;
    }
    if (id === 10) return [p, p + size];
    p += size;
  }
  throw new Error("no code section");
}

/** Every i16x8.relaxed_dot_i8x16_i7x16_s (0xfd 0x112: the only relaxed opcode the build holds,
 * build-wasm.sh checks) replaced by i16x8.add (0xfd 0x8e), the same length and type: the module
 * still validates, without any relaxed instruction, and its 8-bit products are wrong. */
function breakRelaxedDot(bytes: Uint8Array): number {
  const [start, end] = codeSection(bytes);
  let n = 0;
  for (let i = start; i + 2 < end; i++) {
    if (bytes[i] === 0xfd && bytes[i + 1] === 0x92 && bytes[i + 2] === 0x02) {
      bytes[i + 1] = 0x8e;
      bytes[i + 2] = 0x01;
      n++;
    }
  }
  return n;
}

const work = mkdtempSync(join(tmpdir(), "kvl-relaxed-"));
afterAll(() => rmSync(work, { recursive: true, force: true }));

describe("the relaxed build's self-test", () => {
  it("rejects a relaxed build whose 8-bit dot product gives wrong sums: only the 8-bit products fail, auto runs simd128", async () => {
    const dist = join(work, "faulty");
    cpSync(wasmDistDir, dist, { recursive: true });
    const file = join(dist, "kvl_core_relaxed.wasm");
    const bytes = new Uint8Array(readFileSync(file));
    expect(breakRelaxedDot(bytes)).toBeGreaterThan(0);
    expect(WebAssembly.validate(bytes)).toBe(true);
    writeFileSync(file, bytes);

    const verdict = await judgeRelaxed(dist, true);
    expect(verdict.available).toBe(true);
    expect(verdict.autoSet).toBe("simd128");
    expect(verdict.report?.table).toBe("simd128-relaxed");
    const failed = new Set(verdict.report?.checks.filter((c) => !c.ok).map((c) => c.kernel));
    expect(failed).toEqual(new Set(["matmul_q8_i8", "matmul_q4_i8"]));
    expect(verdict.why).toMatch(/^its self-test failed: matmul_q8_i8 \(/);
    expect(buildForChoice("auto", verdict)).toBe("simd128");
    expect(() => buildForChoice("simd128-relaxed", verdict)).toThrow(/^--kernels simd128-relaxed: its self-test failed: matmul_q8_i8/);
  });

  it("kvl doctor: a rejected simd128-relaxed is reported with why and that simd128 runs, and is no FAIL; a failed simd128 is", () => {
    const row = (set: string, failed: number, error: string | null, optional: boolean): DoctorReport["selfTests"][number] =>
      ({ backend: "wasm", set, table: set, checks: 120, failed, error, optional });
    const why = "its self-test failed: matmul_q8_i8 (rows=12 cols=213 n=1 |w|=|x|=127): 2.15 > 0";
    const rejected = [row("simd128", 0, null, false), row("simd128-relaxed", 1, why, true)];
    expect(selfTestsPass(rejected)).toBe(true);
    expect(selfTestsPass([row("simd128", 1, "softmax (n=3): 1 > 2e-06", false), row("simd128-relaxed", 0, null, true)])).toBe(false);
    const record = {
      chosen: "wasm", requested: "auto", requestedBy: "default", reason: "auto: test",
      native: { path: "kvl_core.node", origin: null, skipped: [], present: false, loads: false, error: "no addon", kernelSets: [], defaultKernelSet: null },
      wasm: { dist: "dist", present: true, features: { simd128: true, threads: true, relaxedSimd: true }, usable: true, error: null },
      cpu: { model: "test CPU", cores: 2, flags: [] }, node: "v26.0.0", platform: "linux x64",
    } as unknown as BackendRecord;
    const report: DoctorReport = { backend: record, backendError: null, selfTests: rejected, thp: null,
      directReads: { native: { detail: "-" }, wasm: { detail: "-" } } as unknown as DoctorReport["directReads"], pass: true };
    const text = renderDoctor(report);
    expect(text).toMatch(/^ {2}wasm +simd128 +120 checks {2}ok$/m);
    expect(text).toContain(`  wasm   simd128-relaxed  120 checks  not used (--kernels auto runs simd128): ${why}`);
    expect(text.trim().split("\n").at(-1)).toBe("PASS");
  });

  it("does not run where relaxed SIMD does not validate, or where the build is missing", async () => {
    const none = await judgeRelaxed(wasmDistDir, false);
    expect(none).toEqual({ autoSet: "simd128", available: false, report: null, why: expect.stringMatching(/has no relaxed SIMD/) });
    const empty = join(work, "empty");
    cpSync(wasmDistDir, empty, { recursive: true, filter: (src) => !src.includes("kvl_core_relaxed") });
    const missing = await judgeRelaxed(empty, true);
    expect(missing.available).toBe(false);
    expect(missing.why).toMatch(/^no relaxed build in .*npm run build:wasm/);
  });
});

describe("the build for --kernels", () => {
  const passed: RelaxedVerdict = { autoSet: "simd128-relaxed", available: true, report: null, why: null };
  const absent: RelaxedVerdict = { autoSet: "simd128", available: false, report: null, why: "this Node's WebAssembly has no relaxed SIMD (...)" };

  it("auto runs the relaxed build only where it passed; simd128 and the other sets always the plain one", () => {
    expect(buildForChoice("auto", passed)).toBe("simd128-relaxed");
    expect(buildForChoice(undefined, passed)).toBe("simd128-relaxed");
    expect(buildForChoice("auto", absent)).toBe("simd128");
    for (const k of ["simd128", "scalar", "avx2", "avx512"] as const) expect(buildForChoice(k, passed)).toBe("simd128");
    expect(buildForChoice("simd128-relaxed", passed)).toBe("simd128-relaxed");
  });

  it("simd128-relaxed where this Node has no relaxed SIMD is one line saying why and what to use", () => {
    let err: unknown;
    try {
      buildForChoice("simd128-relaxed", absent);
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(UserError);
    expect((err as Error).message).toBe("--kernels simd128-relaxed: this Node's WebAssembly has no relaxed SIMD (...); use --kernels auto or simd128");
  });
});
