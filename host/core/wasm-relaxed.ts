/**
 * wasm-relaxed.ts — which build of the WebAssembly core an instance loads: the relaxed-SIMD one
 * (kernel set simd128-relaxed) only where relaxed SIMD validates AND the relaxed build passes a
 * self-test here; else the plain one (simd128).
 *
 * The self-test is the core's own conformance report of simd128-relaxed (kernels_conformance.c:
 * every entry against the scalar reference, the 8-bit products bit for bit, once more on weights
 * and activations of +-127 only), run in the relaxed build itself: the code V8 compiles for the
 * engine, on inputs whose sums the scalar reference computes in plain integers. A version number
 * is no proof: Node 20's V8 (relaxed SIMD behind --experimental-wasm-relaxed-simd) gave doubled
 * sums for a relaxed dot product in its baseline compiler (bench/RESULTS.md). The self-test runs
 * once per thread and folder (each engine worker decides for its own instances, kvl doctor shows
 * the same verdict), in an instance of its own (64 MiB, one pthread) that it closes again.
 *
 * Owns: the verdict (relaxedVerdict, judgeRelaxed), the build for a --kernels choice
 * (wasmBuildFor, buildForChoice) and the error for simd128-relaxed where it cannot run. Does not
 * own: the feature probe (wasm-features.ts), instantiating a build (wasm-backend.ts), the checks
 * (the core) or choosing the backend (backend.ts).
 */
import { existsSync } from "node:fs";
import { join } from "node:path";

import type { ConformanceReport, KernelChoice } from "./core-api.js";
import { wasmDistDir } from "../system/paths.js";
import { UserError } from "../system/user-error.js";
import { WASM_BUILD_FILES, WasmBackend, type WasmBuild } from "./wasm-backend.js";
import { probeWasmFeatures } from "./wasm-features.js";

export const RELAXED_SET = "simd128-relaxed";

export interface RelaxedVerdict {
  /** The set --kernels auto runs on WebAssembly here (and the build it loads). */
  readonly autoSet: WasmBuild;
  /** Relaxed SIMD validates in this Node and the relaxed build is there: the self-test ran. */
  readonly available: boolean;
  /** The self-test's report (null when it did not run, or the build did not load). */
  readonly report: ConformanceReport | null;
  /** Why auto does not run simd128-relaxed (null when it does). */
  readonly why: string | null;
}

/** The failed checks of a report, in one line (at most three). */
export function failedChecks(report: ConformanceReport): string {
  const bad = report.checks.filter((c) => !c.ok).map((c) => `${c.kernel} (${c.shape}): ${c.max_err} > ${c.bound}`);
  const more = bad.length > 3 ? `; ${bad.length - 3} more` : "";
  return bad.slice(0, 3).join("; ") + more;
}

/**
 * Runs the self-test of the relaxed build in distDir (exported for the tests: relaxedSimd false
 * stands for a Node without relaxed SIMD, another distDir for a build with a faulty product).
 */
export async function judgeRelaxed(distDir: string, relaxedSimd: boolean): Promise<RelaxedVerdict> {
  const plain = (available: boolean, why: string, report: ConformanceReport | null = null): RelaxedVerdict =>
    ({ autoSet: "simd128", available, report, why });
  if (!relaxedSimd) {
    return plain(false, "this Node's WebAssembly has no relaxed SIMD (Node 22 and later have it; Node 20 only with --experimental-wasm-relaxed-simd)");
  }
  const name = WASM_BUILD_FILES[RELAXED_SET];
  if (!existsSync(join(distDir, `${name}.wasm`)) || !existsSync(join(distDir, `${name}.cjs`))) {
    return plain(false, `no relaxed build in ${distDir} (rebuild it with \`npm run build:wasm\`)`);
  }
  let core: WasmBackend;
  try {
    core = await WasmBackend.create({ distDir, build: RELAXED_SET, pthreads: 1 });
  } catch (err) {
    return plain(true, `the relaxed build does not load here: ${err instanceof Error ? err.message : String(err)}`);
  }
  try {
    const report = core.conformance(RELAXED_SET);
    if (report.table !== RELAXED_SET) return plain(true, `its self-test ran the ${report.table} table`, report);
    if (report.failed !== 0) return plain(true, `its self-test failed: ${failedChecks(report)}`, report);
    return { autoSet: RELAXED_SET, available: true, report, why: null };
  } catch (err) {
    return plain(true, `its self-test did not run: ${err instanceof Error ? err.message : String(err)}`);
  } finally {
    core.close();
  }
}

const verdicts = new Map<string, Promise<RelaxedVerdict>>();

/** The verdict for this Node and the relaxed build in distDir: judged once per thread and folder. */
export function relaxedVerdict(distDir: string = wasmDistDir): Promise<RelaxedVerdict> {
  let verdict = verdicts.get(distDir);
  if (!verdict) {
    verdict = judgeRelaxed(distDir, probeWasmFeatures().relaxedSimd);
    verdicts.set(distDir, verdict);
  }
  return verdict;
}

/** The build for a --kernels choice, given the verdict: simd128-relaxed where auto or asked for
 * and it passed; a UserError when asked for and it cannot run here; simd128 for every other set. */
export function buildForChoice(kernels: KernelChoice | undefined, verdict: RelaxedVerdict): WasmBuild {
  if (kernels === RELAXED_SET) {
    if (verdict.autoSet !== RELAXED_SET) throw new UserError(`--kernels ${RELAXED_SET}: ${verdict.why}; use --kernels auto or simd128`);
    return RELAXED_SET;
  }
  return kernels === undefined || kernels === "auto" ? verdict.autoSet : "simd128";
}

/** The build an instance loads for a --kernels choice (the self-test runs only where it matters). */
export async function wasmBuildFor(kernels: KernelChoice | undefined, distDir: string = wasmDistDir): Promise<WasmBuild> {
  if (kernels !== undefined && kernels !== "auto" && kernels !== RELAXED_SET) return "simd128";
  return buildForChoice(kernels, await relaxedVerdict(distDir));
}
