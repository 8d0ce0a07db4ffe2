/**
 * act-mode.ts — `--act-dtype auto`: the inputs the Linear layers get when the user names no mode,
 * from one table of backend and kernel set, resolved once the backend is chosen and before the
 * RAM plan is made (the integer modes' int16 trunk rows and workspace are bytes the plan counts).
 *
 * Owns: the table (AUTO_ACT_DTYPE), the kernel set an engine will run, known before it is opened
 * (expectedKernelSet), and the resolved mode with why (ActMode), as the load line of chat and
 * serve, their --json, kvl bench's --json and kvl doctor show it. An explicit --act-dtype always
 * wins; f32 stays the exact mode. Does not own: the modes' arithmetic (the core; README
 * "Numerics"), the KV dtype that goes with a mode (core-api.ts defaultKvDtype, which the plan
 * applies to the resolved mode), or choosing the backend (backend.ts).
 *
 * The table is measured (README "Numerics", bench/RESULTS.md): i16x1 is the fastest mode natively
 * (decoding 1.5x faster than f32; with AVX-512 it reads prompts as fast as bf16) and on
 * WebAssembly (0.73-0.84x of native speed, where f32 runs at 0.25x); bf16 is slower than f32
 * without AVX512_BF16 and gave no speed-up over i16x1 even with it; i8 equals i16x1 on two
 * threads. i16x1's accuracy bound is README "Numerics"'s (logits within 1e-3 plus twice what its
 * input rounding moves the float64 reference on the test models; greedy tokens match). Scalar
 * kernels have no vector integer products to gain from: there auto keeps the exact mode.
 */
import type { BackendRecord } from "../core/backend.js";
import { ACT_DTYPE_NAMES, type ActDtype, type BackendName, type KernelChoice, type KvDtype, defaultKvDtype } from "../core/core-api.js";
import type { WasmBuild } from "../core/wasm-backend.js";
import { wasmBuildFor } from "../core/wasm-relaxed.js";

/** What --act-dtype takes: a mode, or auto (the table's mode for the backend and kernel set). */
export type ActDtypeChoice = ActDtype | "auto";
export const ACT_DTYPE_CHOICES: readonly ActDtypeChoice[] = ["auto", ...ACT_DTYPE_NAMES];

/** One row of the table: these kernel sets on this backend run this mode, and why. */
interface AutoActRow {
  readonly backend: BackendName;
  readonly kernels: readonly string[];
  readonly actDtype: ActDtype;
  readonly why: string;
}

/** backend + kernel set -> mode. A kernel set not listed runs the exact mode. */
export const AUTO_ACT_DTYPE: readonly AutoActRow[] = [
  { backend: "native", kernels: ["avx2", "avx512", "avx512-bf16"], actDtype: "i16x1", why: "the fastest mode natively" },
  { backend: "wasm", kernels: ["simd128", "simd128-relaxed"], actDtype: "i16x1", why: "the fastest mode on WebAssembly" },
  { backend: "native", kernels: ["scalar"], actDtype: "f32", why: "the exact mode where there are no vector kernels" },
  { backend: "wasm", kernels: ["scalar"], actDtype: "f32", why: "the exact mode where there are no vector kernels" },
];

/** The mode an engine runs, and why. */
export interface ActMode {
  readonly actDtype: ActDtype;
  /** The KV cache's rows that go with it (the core's default for the mode). */
  readonly kvDtype: KvDtype;
  /** auto: the table chose it; option: --act-dtype named it. */
  readonly chosenBy: "auto" | "option";
  /** The kernel set it was resolved for. */
  readonly kernels: string;
  /** Why this mode, in a few words. */
  readonly reason: string;
}

/** The kernel set the engine will run: the one --kernels names (the engine refuses one it cannot
 * run), else the backend's default here: natively what the addon's test load reported; on
 * WebAssembly the default set of the build an instance loads (wasmAuto: wasm-relaxed.ts's choice,
 * simd128-relaxed where its self-test passed, else simd128; the core's KVL_KERNELS cap does not
 * reach an instance, whose getenv has emscripten's own environment). */
export function expectedKernelSet(record: Pick<BackendRecord, "native">, backend: BackendName, kernels: KernelChoice, wasmAuto: WasmBuild): string {
  if (kernels !== "auto") return kernels;
  return backend === "wasm" ? wasmAuto : (record.native.defaultKernelSet ?? "scalar");
}

/** The mode for an --act-dtype choice on this backend and kernel set: the named one, or the table's. */
export function resolveActMode(choice: ActDtypeChoice, backend: BackendName, kernelSet: string): ActMode {
  if (choice !== "auto") {
    return { actDtype: choice, kvDtype: defaultKvDtype(choice), chosenBy: "option", kernels: kernelSet, reason: "--act-dtype" };
  }
  const row = AUTO_ACT_DTYPE.find((r) => r.backend === backend && r.kernels.includes(kernelSet));
  const actDtype = row?.actDtype ?? "f32";
  return {
    actDtype, kvDtype: defaultKvDtype(actDtype), chosenBy: "auto", kernels: kernelSet,
    reason: row?.why ?? "the exact mode for a kernel set the table does not list",
  };
}

/** resolveActMode for the kernel set this backend will run (expectedKernelSet; on WebAssembly
 * after the relaxed build's verdict, judged once per thread: wasm-relaxed.ts). */
export async function actModeFor(choice: ActDtypeChoice, record: Pick<BackendRecord, "native">, backend: BackendName,
  kernels: KernelChoice): Promise<ActMode> {
  const wasmAuto = backend === "wasm" ? await wasmBuildFor(kernels) : "simd128"; // unused natively
  return resolveActMode(choice, backend, expectedKernelSet(record, backend, kernels, wasmAuto));
}

/** "i16x1 (auto: the fastest mode on WebAssembly)", "f32 (--act-dtype)". The kernel set is named
 * beside it by the load line, from the engine (on WebAssembly simd128 or simd128-relaxed, which
 * run the same mode). */
export function actModeText(mode: ActMode): string {
  return mode.chosenBy === "auto" ? `${mode.actDtype} (auto: ${mode.reason})` : `${mode.actDtype} (--act-dtype)`;
}

/** The mode as --json reports it. */
export function actModeJson(mode: ActMode): { act_dtype: ActDtype; kv_dtype: KvDtype; chosen_by: "auto" | "option"; kernels: string; reason: string } {
  return { act_dtype: mode.actDtype, kv_dtype: mode.kvDtype, chosen_by: mode.chosenBy, kernels: mode.kernels, reason: mode.reason };
}
