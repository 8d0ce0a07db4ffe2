/**
 * bench.ts — `kvl bench MODEL`: speed of the text engine as ratios to this machine's bandwidth
 * limits, on the backend --backend picks, or on native and then WebAssembly in one run
 * (`--backend both`) with the native/wasm ratios side by side; --json gives every run's record
 * (with its `backend`) and, with both, `native_over_wasm`.
 *
 * Owns: the command's own options and their checks (the model options: options.ts
 * addModelOptions), choosing the backends, and rendering: a block
 * per run as it finishes, the limits and peak RSS, the native/wasm table; --json / --out the
 * whole record; markdownReport (bench/RESULTS.md's tables from several --out records).
 * Does not own: the procedure (host/bench/bench-run.ts), the byte accounting and bounds
 * (host/bench/bench-model.ts), the limits (host/bench/bench-limits.ts), the ratios (host/bench/bench-compare.ts).
 */
import { accessSync, constants as fsConstants, statSync, writeFileSync } from "node:fs";
import { availableParallelism } from "node:os";

import { type Command, InvalidArgumentError, Option } from "commander";

import { BACKEND_REQUESTS, BackendError, type BackendRecord, chooseBackend } from "../host/core/backend.js";
import type { BenchComparison, DecodeComparison, PromptComparison, SideMode } from "../host/bench/bench-compare.js";
import { type Limits, loadLimits, measureLimits } from "../host/bench/bench-limits.js";
import { type DecodeRecord, type PromptRecord, packBytes } from "../host/bench/bench-model.js";
import { BENCH_PLANS, type BenchPlan, type BenchResult, type ImageRecord, type RunRecord, runBench } from "../host/bench/bench-run.js";
import { OVERRIDDEN_NOTE, RoutingRecorder, type Trace, checkTraceFits, parseRoutingList, readTrace } from "../host/bench/bench-routing.js";
import { type BackendName, CACHE_POLICIES, type CachePolicy } from "../host/core/core-api.js";
import { checkOutputFile } from "../host/system/output-path.js";
import { UserError } from "../host/system/user-error.js";
import { type ModelCliOptions, addModelOptions, nonNegativeInt, positiveInt } from "./options.js";

const MIB = 2 ** 20;
const GB = 1e9;

interface BenchCliOptions extends ModelCliOptions {
  promptLens: string;
  decodeTokens: number;
  warm?: boolean;
  warmupTokens: number;
  maxBatch?: number;
  plan: BenchPlan;
  seed: number;
  dropCaches?: boolean;
  limits?: string;
  membw?: string;
  json?: boolean;
  out?: string;
  routing: string;
  routingOut?: string;
  cachePolicy: string;
  image: number;
}

/** --cache-policy: a comma list of adaptive, frequency and lru, each named once. */
export function parseCachePolicyList(text: string): CachePolicy[] {
  const out: CachePolicy[] = [];
  for (const raw of text.split(",")) {
    const item = raw.trim();
    const policy = CACHE_POLICIES.find((p) => p === item);
    if (policy === undefined) throw new UserError(`--cache-policy ${JSON.stringify(text)}: ${JSON.stringify(item)} is not ${CACHE_POLICIES.join(", ")}`);
    if (out.includes(policy)) throw new UserError(`--cache-policy ${JSON.stringify(text)} names ${policy} twice`);
    out.push(policy);
  }
  return out;
}

function integer(value: string): number {
  const n = Number(value);
  if (!/^\s*[+-]?\d+\s*$/.test(value) || !Number.isSafeInteger(n)) throw new InvalidArgumentError("expected an integer");
  return n;
}

/** --prompt-lens: comma-separated integers, sorted and deduplicated (as int() takes them). */
function parsePromptLens(text: string): number[] {
  const parts = text.split(",").filter((x) => x.trim());
  if (parts.some((x) => !/^\s*[+-]?\d+\s*$/.test(x))) {
    throw new UserError(`--prompt-lens ${JSON.stringify(text)}: give comma-separated integers, e.g. 16,512`);
  }
  return [...new Set(parts.map(Number))].sort((a, b) => a - b);
}

function checkExecutable(what: string, path: string): void {
  try {
    if (!statSync(path).isFile()) throw new Error("not a file");
    accessSync(path, fsConstants.X_OK);
  } catch (err) {
    throw new UserError(`${what} ${path}: not an executable file (${(err as Error).message}); build it with ` +
      "gcc -std=c11 -O2 -mavx2 -mfma bench/membw.c -lpthread -o membw");
  }
}

/** The backends to run, native first, why, and the record of the choice (the native kernel set). */
function backendsFor(option: string | undefined): { backends: BackendName[]; request: string; reason: string; record: BackendRecord } {
  if (option === "both") {
    let native: BackendRecord;
    let wasm: BackendRecord;
    try {
      native = chooseBackend({ option: "native" });
      wasm = chooseBackend({ option: "wasm" });
    } catch (err) {
      if (err instanceof BackendError) throw new UserError(`--backend both needs both backends: ${err.message}`);
      throw err;
    }
    return { backends: ["native", "wasm"], request: "both", reason: `both asked for (--backend both): native ${native.reason}; wasm ${wasm.reason}`,
      record: native };
  }
  const record = chooseBackend({ option });
  return { backends: [record.chosen], request: record.requested, reason: record.reason, record };
}

// ---- rendering ------------------------------------------------------------------------------

const g = (x: number): string => `${(x / GB).toFixed(3)} GB`;
const mibText = (n: number): string => (n / MIB).toLocaleString("en-US", { maximumFractionDigits: 0 });
const pyBool = (b: unknown): string => (b ? "True" : "False");

function hitRateText(d: DecodeRecord): string {
  return d.expert_hit_rate === null ? "n/a" : `${(100 * d.expert_hit_rate).toFixed(1)}%`;
}

/** The decode's wait for expert reads as a share of the step, and what reading ahead did. */
function lookaheadText(d: DecodeRecord): string {
  const l = d.expert_lookahead;
  const la = l.issued === 0 ? "none read ahead"
    : `read ahead ${(l.issued / d.tokens).toFixed(1)} experts/token, used ${(100 * l.hit_rate!).toFixed(0)}% ` +
      `(wasted ${(l.wasted / d.tokens).toFixed(1)}/token, cancelled before reading ${(l.cancelled / d.tokens).toFixed(1)}/token)`;
  return `expert stall ${d.expert_stall_s_per_token.toFixed(3)} s/token = ${(100 * d.expert_stall_share).toFixed(1)}% of the step, ${la}`;
}

function units(run: RunRecord): string {
  const word = run.backend === "wasm" ? "instance" : "engine";
  return `${run.instances} ${word}${run.instances > 1 ? "s" : ""}`;
}

/** One run's block of text: backend and instances in its header, then each phase against its bound. */
function formatRun(run: RunRecord): string {
  const info = run.info as Record<string, unknown>;
  const routed = (run.routing === "model" ? "" : `, routing ${run.routing}: ${OVERRIDDEN_NOTE}` +
    (run.trace_wrapped ? " (the trace wrapped around)" : "")) + `, expert cache ${run.cache_policy}`;
  const lines = [`== prompt ${run.prompt_tokens} tokens [${run.backend}, ${units(run)}${routed}]: engine open ${run.open_s.toFixed(2)} s ` +
    `(CRC checks ${run.open_verify_s.toFixed(2)} s of ${g(run.open_verify_bytes)}), ` +
    `RAM plan ${mibText(run.plan_total_bytes)} MiB of ${run.ram_budget_mib} (${run.ram_budget_chosen_by === "auto" ? "--ram-mib auto" : "--ram-mib"}), kernels ${String(info.kernels)} (Linear inputs ${String(info.act_dtype ?? "f32")}` +
    `${run.act_mode?.chosen_by === "auto" ? `, auto: ${run.act_mode.reason}` : ""}), ` +
    `direct I/O trunk=${pyBool(info.trunk_direct_io)} experts=${pyBool(info.expert_direct_io)}, streamed trunk ${g(run.streamed_trunk_bytes)}`];
  for (const [key, label] of [["cold_prompt", "cold"], ["warm_prompt", "warm"]] as const) {
    const p = run[key];
    if (!p) continue;
    const extra = p.flop_floor_s !== undefined
      ? `, FLOP floor ${p.flop_floor_s.toFixed(2)} s (ratio to max bound ${p.ratio_to_max_bound!.toFixed(2)})` : "";
    lines.push(`  ${label} prefill: ${p.prefill_tokens_per_s.toFixed(2)} tok/s, first token ${p.first_token_s.toFixed(2)} s, ` +
      `SSD ${g(p.ssd_bytes)}, distinct experts ${p.distinct_experts}, bound ${p.bound_s!.toFixed(2)} s -> ratio ${p.ratio!.toFixed(2)}${extra}; ` +
      `CRC checks ${p.verify_s.toFixed(3)} s of ${g(p.verify_bytes)}`);
  }
  for (const [key, label] of [["decode_after_cold", "decode"], ["decode_warm", "warm decode"]] as const) {
    const d = run[key];
    if (!d) continue;
    lines.push(`  ${label}: ${d.s_per_token_mean.toFixed(3)} s/token (median ${d.s_per_token_median.toFixed(3)}), ` +
      `SSD ${g(d.ssd_bytes_per_token)}/token, RAM ${g(d.ram_bytes_per_token!)}/token, hit rate ${hitRateText(d)}, ` +
      `bound ${d.bound_s!.toFixed(3)} s (SSD ${d.bound_ssd_s!.toFixed(3)} + RAM ${d.bound_ram_s!.toFixed(3)} = ${d.bound_sum_s!.toFixed(3)}) ` +
      `-> ratio ${d.ratio!.toFixed(2)} (to sum ${d.ratio_to_sum!.toFixed(2)}); CRC checks ${(1000 * d.verify_s_per_token).toFixed(2)} ms/token ` +
      `of ${g(d.verify_bytes_per_token)}/token = ${(100 * d.verify_share).toFixed(1)}% of the step`);
    lines.push(`    ${lookaheadText(d)}`);
    if (d.adjacent) {
      const a = d.adjacent;
      lines.push(`    adjacent probes: DRAM ${g(a.dram_bytes_per_s)}/s, direct read ${g(a.ssd_bytes_per_s)}/s -> bound ` +
        `${a.bound_s.toFixed(3)} s, ratio ${a.ratio.toFixed(2)} (median ${a.ratio_median.toFixed(2)})`);
    }
  }
  const peak = run.peak_rss_bytes;
  lines.push(peak == null ? "  peak RSS n/a" : `  peak RSS ${mibText(peak)} MiB (plan ${mibText(run.plan_total_bytes)} MiB: ${run.peak_rss_over_plan!.toFixed(2)} of it)`);
  return lines.join("\n");
}

/** Per backend and prompt length, each --routing mode's decode side by side (after the cold
 * prompt, and warm with --warm). */
export function formatRoutingTable(result: BenchResult): string {
  const rows: string[][] = [["backend", "prompt", "routing", "cache policy", "decode", "hit rate", "SSD GB/token", "disk wait % of step",
    "read ahead used / wasted per token", "s/token"]];
  for (const r of result.runs) {
    for (const [key, label] of [["decode_after_cold", "after cold"], ["decode_warm", "warm"]] as const) {
      const d = r[key];
      if (!d) continue;
      const l = d.expert_lookahead;
      rows.push([r.backend, String(r.prompt_tokens), `${r.routing}${r.routing_overridden ? " *" : ""}`, r.cache_policy, label, hitRateText(d),
        (d.ssd_bytes_per_token / GB).toFixed(3), (100 * d.expert_stall_share).toFixed(1),
        `${(l.used / d.tokens).toFixed(1)} / ${(l.wasted / d.tokens).toFixed(1)}`, d.s_per_token_mean.toFixed(3)]);
    }
  }
  return `routing side by side (* ${OVERRIDDEN_NOTE}):\n${table(rows)}`;
}

function limitsLine(lim: Limits): string {
  return `limits (${lim.source}): DRAM ${g(lim.dram_bytes_per_s)}/s, direct read ${g(lim.ssd_bytes_per_s)}/s` +
    (lim.fma_flops_per_s ? `, FMA ${(lim.fma_flops_per_s / 1e9).toFixed(0)} GFLOP/s` : "");
}

function table(rows: string[][]): string {
  const widths = rows[0]!.map((_, c) => Math.max(...rows.map((r) => r[c]!.length)));
  return rows.map((r) => r.map((cell, c) => (c === 0 ? cell.padStart(widths[c]!) : cell.padEnd(widths[c]!))).join("  ").trimEnd()).join("\n");
}

/** The native/wasm table of a `--backend both` result: what each side ran (mode and kernel set),
 * then each figure with its ratio to the bound. */
function formatComparison(result: BenchResult): string {
  const cmp = result.native_over_wasm as BenchComparison;
  const rows: string[][] = [["prompt", "measure", "native (ratio to bound)", "wasm (ratio to bound)", "native/wasm"]];
  const routing = result.runs[0]?.routing;
  const run = (backend: BackendName, n: number): RunRecord | undefined =>
    result.runs.find((r) => r.backend === backend && r.prompt_tokens === n && r.routing === routing);
  for (const entry of cmp.prompts) {
    const nat = run("native", entry.prompt_tokens)!;
    const was = run("wasm", entry.prompt_tokens)!;
    const side = (s: SideMode): string => `${s.act_dtype}${s.chosen_by === "auto" ? " (auto)" : ""}, ${s.kernels}`;
    rows.push([String(entry.prompt_tokens), "Linear inputs, kernels", side(entry.sides.native), side(entry.sides.wasm), ""]);
    for (const [key, label] of [["cold_prompt", "first token, cold"], ["warm_prompt", "first token, warm"]] as const) {
      const c = entry[key] as PromptComparison | undefined;
      if (!c) continue;
      const cell = (p: PromptRecord): string => `${p.first_token_s.toFixed(3)} s (${p.ratio!.toFixed(2)})`;
      rows.push([String(entry.prompt_tokens), label, cell(nat[key]!), cell(was[key]!), (c.first_token_s ?? NaN).toFixed(2)]);
    }
    for (const [key, label] of [["decode_after_cold", "decode after cold"], ["decode_warm", "decode, warm"]] as const) {
      const c = entry[key] as DecodeComparison | undefined;
      if (!c) continue;
      const cell = (d: DecodeRecord): string => `${d.tokens_per_s.toFixed(2)} tok/s (${d.ratio!.toFixed(2)})`;
      rows.push([String(entry.prompt_tokens), label, cell(nat[key]!), cell(was[key]!), (c.tokens_per_s ?? NaN).toFixed(2)]);
      const stall = (d: DecodeRecord): string => `${(100 * d.expert_stall_share).toFixed(1)}%, read ahead ${(d.expert_lookahead.issued / d.tokens).toFixed(1)}/token` +
        (d.expert_lookahead.hit_rate === null ? "" : ` (used ${(100 * d.expert_lookahead.hit_rate).toFixed(0)}%)`);
      rows.push(["", "  expert stall, % of step", stall(nat[key]!), stall(was[key]!), ""]);
      if (c.adjacent_ratio !== undefined) {
        rows.push(["", "  ratio to adjacent probes", nat[key]!.adjacent!.ratio.toFixed(2), was[key]!.adjacent!.ratio.toFixed(2), c.adjacent_ratio.toFixed(2)]);
      }
    }
    if (nat.peak_rss_bytes != null && was.peak_rss_bytes != null) {
      rows.push([String(entry.prompt_tokens), "peak RSS (of plan)", `${mibText(nat.peak_rss_bytes)} MiB (${nat.peak_rss_over_plan!.toFixed(2)})`,
        `${mibText(was.peak_rss_bytes)} MiB (${was.peak_rss_over_plan!.toFixed(2)})`, (entry.peak_rss_bytes ?? NaN).toFixed(2)]);
    }
  }
  return `native / WebAssembly, one run, the same limits (first token: time, lower is faster; decode: tokens/s, higher is faster):\n${table(rows)}`;
}

function adjacentCells(d: DecodeRecord): string {
  const a = d.adjacent;
  if (!a) return "n/a | n/a | n/a";
  return `${(a.dram_bytes_per_s / GB).toFixed(1)} / ${(a.ssd_bytes_per_s / GB).toFixed(2)} | ${a.bound_s.toFixed(3)} | ` +
    `**${a.ratio.toFixed(2)}** (${a.ratio_median.toFixed(2)})`;
}

/** Markdown tables of several `kvl bench --out` results, each labelled by its setting (a run's
 * backend joins the label when a result holds more than one). */
export function markdownReport(results: ReadonlyArray<[string, BenchResult]>): string {
  const labelOf = (label: string, res: BenchResult, r: RunRecord): string => (res.backend === "both" ? `${label}, ${r.backend}` : label);
  const out = ["| setting | prompt tokens | engine open s | RAM plan MiB | prefill tok/s | first token s " +
    "| SSD read GB | distinct experts | first-token bound s | ratio | FLOP floor s |",
  "|---|---|---|---|---|---|---|---|---|---|---|"];
  for (const [label, res] of results) {
    for (const r of res.runs) {
      for (const [key, state] of [["cold_prompt", "cold"], ["warm_prompt", "warm"]] as const) {
        const p = r[key];
        if (!p) continue;
        const floor = p.flop_floor_s !== undefined ? p.flop_floor_s.toFixed(2) : "n/a";
        out.push(`| ${labelOf(label, res, r)} (${state}) | ${p.tokens} | ${r.open_s.toFixed(2)} | ${mibText(r.plan_total_bytes)} | ` +
          `${p.prefill_tokens_per_s.toFixed(2)} | ${p.first_token_s.toFixed(2)} | ${(p.ssd_bytes / GB).toFixed(2)} | ${p.distinct_experts} | ` +
          `${p.bound_s!.toFixed(2)} | **${p.ratio!.toFixed(2)}** | ${floor} |`);
      }
    }
  }
  out.push("", "| setting | context (tokens) | decode s/token (mean / median) | SSD GB/token | RAM GB/token | expert hit rate " +
    "| SSD bound s | RAM bound s | bound = max s | ratio | ratio to SSD+RAM sum | expert stall s/token (% of step) " +
    "| read ahead /token (used) | adjacent probes DRAM / direct read GB/s | adjacent bound s | adjacent ratio (median) | CRC checks % of step |",
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
  for (const [label, res] of results) {
    for (const r of res.runs) {
      for (const [key, state] of [["decode_after_cold", "after cold prompt"], ["decode_warm", "warm"]] as const) {
        const d = r[key];
        if (!d) continue;
        out.push(`| ${labelOf(label, res, r)} (${state}) | ${d.context_start}+${d.tokens} | ${d.s_per_token_mean.toFixed(3)} / ` +
          `${d.s_per_token_median.toFixed(3)} | ${(d.ssd_bytes_per_token / GB).toFixed(3)} | ${(d.ram_bytes_per_token! / GB).toFixed(3)} | ` +
          `${hitRateText(d)} | ${d.bound_ssd_s!.toFixed(3)} | ${d.bound_ram_s!.toFixed(3)} | ${d.bound_s!.toFixed(3)} | ` +
          `**${d.ratio!.toFixed(2)}** | ${d.ratio_to_sum!.toFixed(2)} | ${d.expert_stall_s_per_token.toFixed(3)} ` +
          `(${(100 * d.expert_stall_share).toFixed(1)}%) | ${(d.expert_lookahead.issued / d.tokens).toFixed(1)} ` +
          `(${d.expert_lookahead.hit_rate === null ? "n/a" : `${(100 * d.expert_lookahead.hit_rate).toFixed(0)}%`}) | ${adjacentCells(d)} | ` +
          `${(100 * d.verify_share).toFixed(1)} |`);
      }
    }
  }
  out.push("", "| setting | peak RSS MiB (ru_maxrss since start / VmHWM of the engine phase) | RAM plan total MiB |", "|---|---|---|");
  for (const [label, res] of results) {
    const plans = res.runs.map((r) => mibText(r.plan_total_bytes)).join(", ");
    out.push(`| ${label} | ${mibText(res.ru_maxrss_bytes)} / ${res.peak_rss_bytes === null ? "n/a" : mibText(res.peak_rss_bytes)} | ${plans} |`);
  }
  return out.join("\n");
}

/** One --image record: `== image 448x448 [native]: grid 32x32, 256 media tokens, encode ...`. */
export function formatImage(r: ImageRecord): string {
  const peak = r.ratio_to_fma_peak === null ? "no FMA peak measured" : `${(100 * r.ratio_to_fma_peak).toFixed(1)}% of the FMA peak`;
  return `== image ${r.side}x${r.side} [${r.backend}, ${r.kernels}]: grid ${r.grid.join("x")}, ${r.media_tokens} media tokens, ` +
    `encode ${r.encode_s[0].toFixed(2)} s (first, with CRC checks) / ${r.encode_s[1].toFixed(2)} s, ` +
    `${(r.flops / 1e9).toFixed(1)} GFLOP at ${(r.flops_per_s / 1e9).toFixed(1)} GFLOP/s = ${peak}`;
}

// ---- the command ----------------------------------------------------------------------------

async function runBenchCommand(model: string, opts: BenchCliOptions): Promise<void> {
  const promptLens = parsePromptLens(opts.promptLens);
  if (!promptLens.length || promptLens[0]! < 1 || opts.decodeTokens < 1) {
    throw new UserError("--prompt-lens needs positive lengths and --decode-tokens >= 1");
  }
  // the settings record keeps the caches as given: "auto" or MiB
  const trunkCacheMib = String(opts.trunkCacheMib);
  const cacheMib = String(opts.cacheMib);
  const fileLimits = opts.limits !== undefined ? loadLimits(opts.limits) : null;
  if (opts.membw !== undefined) checkExecutable("--membw", opts.membw);
  if (opts.out !== undefined) checkOutputFile(opts.out, "--out"); // before the run, not after it
  const routings = parseRoutingList(opts.routing);
  const cachePolicies = parseCachePolicyList(opts.cachePolicy);
  if (opts.routingOut !== undefined) {
    if (!routings.some((r) => r.kind === "model")) throw new UserError("--routing-out records the model's own routing: --routing must include model");
    checkOutputFile(opts.routingOut, "--routing-out");
  }
  const { backends, request, reason, record } = backendsFor(opts.backend);
  const pb = await packBytes(model);
  const traces = new Map<string, Trace>();
  for (const r of routings) {
    if (r.kind !== "trace") continue;
    const trace = readTrace(r.file);
    checkTraceFits(trace, r.file, pb);
    traces.set(r.file, trace);
  }
  const recorder = opts.routingOut === undefined ? undefined
    : new RoutingRecorder(pb, `kvl bench ${model} --routing model, first run (${backends[0]}, prompt ${promptLens[0]} tokens, seed ${opts.seed}), ` +
      `${new Date().toISOString()}`);
  const threads = opts.threads > 0 ? opts.threads : availableParallelism();
  const limits = fileLimits ?? await measureLimits({ model, extent: pb.extent_data, threads, dropCaches: opts.dropCaches === true, membw: opts.membw });
  const result = await runBench({
    model, backends, backendRequest: request, backendReason: reason, backendRecord: record, ramMib: opts.ramMib, cacheMib, trunkCacheMib,
    threads, promptLens, decodeTokens: opts.decodeTokens, warm: opts.warm === true, warmupTokens: opts.warmupTokens, maxBatch: opts.maxBatch, plan: opts.plan,
    seed: opts.seed, actDtype: opts.actDtype, kernels: opts.kernels, dropCaches: opts.dropCaches === true, membw: opts.membw, instances: opts.instances,
    expertLookahead: opts.expertLookahead, routings, cachePolicies, traces, recorder, imageSide: opts.image,
  }, pb, limits, (run) => {
    if (!opts.json) process.stdout.write(`${formatRun(run)}\n`);
  }, (image) => {
    if (!opts.json) process.stdout.write(`${formatImage(image)}\n`);
  });
  recorder?.write(opts.routingOut!);
  const text = JSON.stringify(result, null, 1);
  if (opts.out !== undefined) writeFileSync(opts.out, `${text}\n`, "utf8");
  if (opts.json) {
    process.stdout.write(`${text}\n`);
    return;
  }
  const st = result.settings as { plan: BenchPlan; max_context: number; max_batch: number };
  const planLine = st.plan === "chat"
    ? `plan: as kvl chat plans it (context ${st.max_context} tokens, ${st.max_batch}-token prefill chunks, the vision tower reserved)`
    : st.plan === "chat-text"
    ? `plan: as kvl chat --no-vision plans it (context ${st.max_context} tokens, ${st.max_batch}-token prefill chunks, no vision tower)`
    : `plan: bench-only (--plan bench: context ${st.max_context} tokens, ${st.max_batch}-token chunks, no vision), not what kvl chat gets`;
  const lines = [planLine, limitsLine(result.limits), result.peak_rss_bytes === null ? "peak RSS n/a" : `peak RSS ${mibText(result.peak_rss_bytes)} MiB` +
    (result.peak_rss_reset ? " (VmHWM of the engine phases)" : " (since the process started: VmHWM cannot be reset here)")];
  if (result.native_over_wasm) lines.push(formatComparison(result));
  if (routings.length > 1 || cachePolicies.length > 1) lines.push(formatRoutingTable(result));
  process.stdout.write(`${lines.join("\n")}\n`);
}

export function addBenchCommand(program: Command): void {
  const command = program
    .command("bench")
    .description("measure speed against this machine's bandwidth limits")
    .argument("<model>", "packed model directory (kvl pack / kvl prepare output)");
  addModelOptions(command, {
    backend: new Option("--backend <name>", "core build to run: auto picks the native addon where it loads, else WebAssembly " +
      "(env KVL_BACKEND); both: native, then WebAssembly, in one run with their ratios").choices([...BACKEND_REQUESTS, "both"]),
    context: false,
    vision: false,
  })
    .option("--prompt-lens <list>", "comma-separated prompt lengths in tokens", "16,512")
    .option("--decode-tokens <n>", "greedy tokens decoded and timed after each prompt", integer, 16)
    .option("--warm", "after the cold prompt, run a warm-up prefill (fills the caches), then time the same prompt and the decode again on warm caches")
    .option("--warmup-tokens <n>", "tokens of the --warm warm-up prompt", positiveInt, 512)
    .addOption(new Option("--plan <which>", "chat: plan exactly as kvl chat does (its context, 256-token prefill chunks, the vision " +
      "tower's reservation, lent to the expert cache natively while no image is in flight: what a user gets); chat-text: as kvl chat --no-vision does (the same without the vision tower); " +
      "bench: a bench-only plan (context sized to the prompts, no vision, each prompt one chunk)")
      .choices([...BENCH_PLANS]).default("chat"))
    .option("--max-batch <n>", "prefill chunk in tokens (default: the plan's; 0 = the longest prompt, so each prompt is one chunk and reads " +
      "each routed expert at most once)", nonNegativeInt)
    .option("--seed <n>", "seed of the random prompts (numpy's default_rng(seed) draws: the same prompts for the same seed)", nonNegativeInt, 0)
    .option("--drop-caches", "echo 3 > /proc/sys/vm/drop_caches before each engine open (root)")
    .option("--limits <file>", "JSON lines from bench/membw.c (dram/ssd/fma); without it the limits are measured here: with membw " +
      "(--membw, else bench/membw.c built with the C compiler), else in Node")
    .option("--membw <binary>", "bench/membw.c binary: re-measure DRAM and direct-read bandwidth right before and after each decode, so its " +
      "ratio uses the machine's bandwidth of that moment (shared machines drift by 30% and more)")
    .option("--routing <list>", "which experts the MoE layers take, for measurement only (comma list, each mode runs every backend " +
      "and prompt length): model (the router's), uniform (k distinct experts at random per token and layer: the worst case for " +
      "any cache), trace:FILE (replay a JSONL routing trace: --routing-out or bench/routing-trace.ts). Any but model is flagged: " +
      "the tokens are not the model's", "model")
    .option("--cache-policy <list>", "what the expert cache evicts by, for measurement (comma list, each runs every routing mode, " +
      "backend and prompt length): adaptive (the default: whichever of the other two its key-only shadow caches show hitting more " +
      "lately), frequency (fewest recent uses, then least recently used), lru (least recently used). Never changes a token", "adaptive")
    .option("--routing-out <file>", "write the routing the first --routing model run took, token by token (JSONL, replayable with trace:FILE)")
    .option("--image <side>", "after each backend's prompts, encode a random side x side image (the official preprocessing) twice: " +
      "encode time and GFLOP/s of the vision tower and projector against the FMA peak (0 = no image)", nonNegativeInt, 0)
    .option("--json", "print one JSON object")
    .option("--out <file>", "also write the JSON to this file")
    .action(runBenchCommand);
}
