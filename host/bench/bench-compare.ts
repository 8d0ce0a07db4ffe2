/**
 * bench-compare.ts — `kvl bench --backend both`: the native figures over the WebAssembly ones,
 * prompt length by prompt length, all measured in one run against the same limits.
 *
 * Owns: which figures are compared and how (the --json native_over_wasm object): each is the
 * native run's figure divided by the WebAssembly run's for the same prompt length and phase —
 * times (< 1: native is faster), rates (> 1: native is faster), and ratios to the same bound
 * (measured / bound; their quotient shows how much nearer the physical limit native runs) —
 * and, beside them, what each side ran: its Linear inputs' mode and its kernel set.
 * Does not own: the measurements (bench-run.ts) or their rendering (cli/bench.ts).
 */
import type { BackendName } from "../core/core-api.js";
import type { DecodeRecord, PromptRecord } from "./bench-model.js";

/** What a run must hold for the comparison (bench-run.ts RunRecord). */
interface ComparableRun {
  backend: BackendName;
  prompt_tokens: number;
  cold_prompt?: PromptRecord;
  decode_after_cold?: DecodeRecord;
  warm_prompt?: PromptRecord;
  decode_warm?: DecodeRecord;
  peak_rss_bytes?: number | null;
  /** the engine's report: the kernel set that ran */
  info: { kernels?: unknown };
  /** the act mode the run opened with (act-mode.ts actModeJson) */
  act_mode: { act_dtype: string; chosen_by: string };
}

/** What one side ran: its Linear inputs' mode (and whether auto chose it) and its kernel set. */
export interface SideMode {
  act_dtype: string;
  chosen_by: string;
  kernels: string;
}

const PROMPT_FIGURES = ["first_token_s", "prefill_tokens_per_s", "ratio"] as const;
const DECODE_FIGURES = ["tokens_per_s", "s_per_token_mean", "s_per_token_median", "ratio"] as const;

export type PromptComparison = Partial<Record<(typeof PROMPT_FIGURES)[number], number>>;
export type DecodeComparison = Partial<Record<(typeof DECODE_FIGURES)[number] | "adjacent_ratio", number>>;

interface PromptLengthComparison {
  prompt_tokens: number;
  sides: { native: SideMode; wasm: SideMode };
  cold_prompt?: PromptComparison;
  decode_after_cold?: DecodeComparison;
  warm_prompt?: PromptComparison;
  decode_warm?: DecodeComparison;
  peak_rss_bytes?: number;
}

export interface BenchComparison {
  note: string;
  prompts: PromptLengthComparison[];
}

const over = (a: number | null | undefined, b: number | null | undefined): number | undefined =>
  typeof a === "number" && typeof b === "number" && b !== 0 ? a / b : undefined;

function comparePrompts(n: PromptRecord | undefined, w: PromptRecord | undefined): PromptComparison | undefined {
  if (!n || !w) return undefined;
  const out: PromptComparison = {};
  for (const k of PROMPT_FIGURES) {
    const r = over(n[k], w[k]);
    if (r !== undefined) out[k] = r;
  }
  return out;
}

function compareDecodes(n: DecodeRecord | undefined, w: DecodeRecord | undefined): DecodeComparison | undefined {
  if (!n || !w) return undefined;
  const out: DecodeComparison = {};
  for (const k of DECODE_FIGURES) {
    const r = over(n[k], w[k]);
    if (r !== undefined) out[k] = r;
  }
  const adjacent = over(n.adjacent?.ratio, w.adjacent?.ratio);
  if (adjacent !== undefined) out.adjacent_ratio = adjacent;
  return out;
}

function sideMode(run: ComparableRun): SideMode {
  return { act_dtype: run.act_mode.act_dtype, chosen_by: run.act_mode.chosen_by, kernels: String(run.info.kernels) };
}

/** native / wasm for every prompt length both backends ran (in the order of the native runs). */
export function nativeOverWasm(runs: readonly ComparableRun[]): BenchComparison {
  const prompts: PromptLengthComparison[] = [];
  for (const n of runs.filter((r) => r.backend === "native")) {
    const w = runs.find((r) => r.backend === "wasm" && r.prompt_tokens === n.prompt_tokens);
    if (!w) continue;
    const entry: PromptLengthComparison = { prompt_tokens: n.prompt_tokens, sides: { native: sideMode(n), wasm: sideMode(w) } };
    const phases = {
      cold_prompt: comparePrompts(n.cold_prompt, w.cold_prompt),
      decode_after_cold: compareDecodes(n.decode_after_cold, w.decode_after_cold),
      warm_prompt: comparePrompts(n.warm_prompt, w.warm_prompt),
      decode_warm: compareDecodes(n.decode_warm, w.decode_warm),
    };
    for (const [k, v] of Object.entries(phases)) if (v) Object.assign(entry, { [k]: v });
    const rss = over(n.peak_rss_bytes, w.peak_rss_bytes);
    if (rss !== undefined) entry.peak_rss_bytes = rss;
    prompts.push(entry);
  }
  return {
    note: "each figure is the native run's divided by the WebAssembly run's, same prompt and the same limits: " +
      "times below 1 and rates above 1 mean native is faster; ratio = measured / bound",
    prompts,
  };
}
