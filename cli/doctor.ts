/**
 * doctor.ts — `kvl doctor` without a model: every backend, whether it loads and why not, the
 * kernel sets the CPU and each backend offer, and the kernel self-test on each backend; ends
 * with one line PASS or FAIL.
 *
 * Also says how each backend reads a model past the page cache on this platform (direct-io.ts)
 * and, on Linux only, what the huge page mode means for those reads (huge-pages.ts).
 *
 * On WebAssembly the relaxed build's simd128-relaxed is listed too where this Node has relaxed
 * SIMD: its self-test is the one that decides whether --kernels auto runs it (wasm-relaxed.ts), so
 * a failure there is reported (and simd128 runs), not a FAIL of kvl itself.
 *
 * Owns: running the self-tests and rendering them (text or --json). Does not own: the choice
 * (host/core/backend.ts, host/core/wasm-relaxed.ts) or the checks themselves (the core's
 * kvl_kernels_conformance).
 */
import { type BackendRecord, BackendError, chooseBackend, openBackend } from "../host/core/backend.js";
import type { BackendName, ConformanceReport } from "../host/core/core-api.js";
import { type DirectReadSupport, type IoPlatform, THIS_PLATFORM, directReadSupport } from "../host/core/direct-io.js";
import { type ThpMode, hugePageAdvice, readThpMode } from "../host/core/huge-pages.js";
import { RELAXED_SET, failedChecks, relaxedVerdict } from "../host/core/wasm-relaxed.js";

interface SelfTestResult {
  readonly backend: BackendName;
  readonly set: string;
  /** The table whose functions ran: must equal set. */
  readonly table: string | null;
  readonly checks: number;
  readonly failed: number;
  readonly error: string | null;
  /** A set --kernels auto runs only if it passes here (simd128-relaxed): a failure is reported,
   * and the other set runs, so it does not fail the doctor. */
  readonly optional: boolean;
}

export interface DoctorReport {
  readonly backend: BackendRecord | null;
  readonly backendError: string | null;
  readonly selfTests: readonly SelfTestResult[];
  /** Linux's transparent huge page mode (null elsewhere): whether direct reads land in huge pages. */
  readonly thp: ThpMode | null;
  /** How each backend bypasses the page cache on this platform (a pack's filesystem may still refuse). */
  readonly directReads: Readonly<Record<BackendName, DirectReadSupport>>;
  readonly pass: boolean;
}

async function selfTest(name: BackendName, record: BackendRecord): Promise<SelfTestResult[]> {
  const results: SelfTestResult[] = [];
  let core;
  try {
    core = await openBackend(name, record);
  } catch (err) {
    return [{ backend: name, set: "-", table: null, checks: 0, failed: 1, error: err instanceof Error ? err.message : String(err), optional: false }];
  }
  try {
    for (const set of core.kernelSets().filter((s) => s.supported)) {
      try {
        const report: ConformanceReport = core.conformance(set.name);
        const wrongTable = report.table !== set.name;
        results.push({ backend: name, set: set.name, table: report.table, checks: report.checks.length,
          failed: report.failed + (wrongTable ? 1 : 0),
          error: wrongTable ? `asked for ${set.name}, ran ${report.table}` : report.failed ? failedChecks(report) : null, optional: false });
      } catch (err) {
        results.push({ backend: name, set: set.name, table: null, checks: 0, failed: 1, error: err instanceof Error ? err.message : String(err), optional: false });
      }
    }
  } finally {
    core.close();
  }
  if (name === "wasm") {
    // the verdict --kernels auto acts on, where relaxed SIMD is there to judge
    const verdict = await relaxedVerdict(record.wasm.dist);
    if (verdict.available) {
      const r = verdict.report;
      results.push({ backend: name, set: RELAXED_SET, table: r?.table ?? null, checks: r?.checks.length ?? 0,
        failed: verdict.why === null ? 0 : Math.max(r?.failed ?? 0, 1), error: verdict.why, optional: true });
    }
  }
  return results;
}

/** PASS: some self-test ran, and every one passed but those of optional sets (reported, not fatal). */
export function selfTestsPass(selfTests: readonly SelfTestResult[]): boolean {
  return selfTests.length > 0 && selfTests.every((t) => t.failed === 0 || t.optional);
}

export function directReadsHere(io: IoPlatform = THIS_PLATFORM): Record<BackendName, DirectReadSupport> {
  return { native: directReadSupport("native", io), wasm: directReadSupport("wasm", io) };
}

export async function runDoctor(backendOption: string | undefined): Promise<DoctorReport> {
  const thp = readThpMode();
  const directReads = directReadsHere();
  let record: BackendRecord;
  try {
    record = chooseBackend({ option: backendOption });
  } catch (err) {
    if (!(err instanceof BackendError)) throw err;
    return { backend: null, backendError: err.message, selfTests: [], thp, directReads, pass: false };
  }
  const selfTests: SelfTestResult[] = [];
  if (record.native.loads) selfTests.push(...(await selfTest("native", record)));
  if (record.wasm.usable) selfTests.push(...(await selfTest("wasm", record)));
  const pass = selfTestsPass(selfTests);
  return { backend: record, backendError: null, selfTests, thp, directReads, pass };
}

const yes = (b: boolean) => (b ? "yes" : "no");

export function renderDoctor(report: DoctorReport): string {
  const lines: string[] = ["kvl doctor (no model): backends and kernels"];
  const r = report.backend;
  if (!r) {
    lines.push(`backend: ${report.backendError}`, "FAIL");
    return lines.join("\n");
  }
  lines.push(`node ${r.node} on ${r.platform}; CPU: ${r.cpu.model}, ${r.cpu.cores} cores`);
  lines.push(`  CPU flags for the kernels: ${r.cpu.flags ? r.cpu.flags.join(" ") || "(none)" : "(not listed by this OS)"}`);
  lines.push(`backend: ${r.chosen} — ${r.reason}${r.requestedBy === "default" ? "" : ` [--backend/KVL_BACKEND=${r.requested}]`}`);
  const sets = (s: readonly { name: string; supported: boolean }[]) =>
    s.map((k) => `${k.name}${k.supported ? "" : " (not on this CPU)"}`).join(", ");
  lines.push(`native addon: ${r.native.path}${r.native.origin ? ` (${r.native.origin})` : ""}`);
  for (const s of r.native.skipped) lines.push(`  skipped ${s.origin} ${s.path}: ${s.error}`);
  lines.push(r.native.loads
    ? `  loads; kernel sets: ${sets(r.native.kernelSets)}; picks ${r.native.defaultKernelSet}`
    : `  not available: ${r.native.error}`);
  lines.push(`WebAssembly: ${r.wasm.dist}`);
  lines.push(`  SIMD128 ${yes(r.wasm.features.simd128)}, threads ${yes(r.wasm.features.threads)}, ` +
    `relaxed SIMD ${yes(r.wasm.features.relaxedSimd)}${r.wasm.usable ? "" : `; not usable: ${r.wasm.error}`}`);
  for (const name of ["native", "wasm"] as const) lines.push(`direct reads, ${name}: ${report.directReads[name].detail}`);
  for (const name of ["native", "wasm"] as const) {
    const advice = hugePageAdvice(name, report.thp);
    if (advice) lines.push(`huge pages, ${name}: ${advice.detail}`);
  }
  lines.push("kernel self-test (every entry against the scalar reference):");
  for (const t of report.selfTests) {
    const status = t.failed === 0
      ? `ok${t.optional ? " (--kernels auto runs it)" : ""}`
      : t.optional ? `not used (--kernels auto runs simd128): ${t.error}` : `FAILED ${t.failed}${t.error ? `: ${t.error}` : ""}`;
    lines.push(`  ${t.backend.padEnd(6)} ${t.set.padEnd(15)} ${String(t.checks).padStart(4)} checks  ${status}`);
  }
  lines.push(report.pass ? "PASS" : "FAIL");
  return lines.join("\n");
}
