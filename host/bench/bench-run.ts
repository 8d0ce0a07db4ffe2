/**
 * bench-run.ts — the measurement procedure of `kvl bench`, on one backend or on native then
 * WebAssembly in one run.
 *
 * Owns: the procedure — per backend and prompt length a fresh engine, opened in this process
 * (engine-host.ts openHostedEngine, not the worker: no message passing inside the timings) from
 * the RAM plan (planner.ts, with the plan's instances, reconciled with what the engines report)
 * made with the backend's act mode (--act-dtype auto resolved per backend: plan/act-mode.ts);
 * a cold prefill of a random prompt (bench-prompt.ts) in one chunk, greedy decode, optionally
 * a warm-up prefill and the same prompt and decode again on warm caches; the engine-stats deltas
 * of each phase (the CRC checks of first reads among them: their share of the decode step); --membw probes around each decode; --drop-caches before each open; the peak
 * RSS of each run (VmHWM, reset before each engine open where Linux allows, after a garbage
 * collection so a closed run's WebAssembly memories are gone) against its plan; and the --json
 * record these make; with --image SIDE, after a backend's prompts, a fresh engine with the vision
 * tower encodes a random SIDE x SIDE image (the official preprocessing) twice: encode time and
 * GFLOP/s of MoonViT + projector against the FMA peak. Does not own: the bounds (bench-model.ts), the limits (bench-limits.ts),
 * the native/wasm ratios (bench-compare.ts), rendering (cli/bench.ts).
 */
import { writeFileSync } from "node:fs";

import { type BenchComparison, nativeOverWasm } from "./bench-compare.js";
import { type Limits, dropPageCache, probeLimits } from "./bench-limits.js";
import { type DecodeRecord, type LookaheadRecord, kvRowBytes, type PackBytes, type PromptRecord, adjacentBounds, decodeBounds, promptBounds, visionFlops } from "./bench-model.js";
import { randomPrompt } from "./bench-prompt.js";
import { OVERRIDDEN_NOTE, type RoutingRecorder, type RoutingSpec, RunRouting, type Trace, routingLabel } from "./bench-routing.js";
import type { BackendRecord } from "../core/backend.js";
import { type BackendName, type CachePolicy, CoreError, type CoreSession, type EngineStats, type ExpertLookahead, type KernelChoice } from "../core/core-api.js";
import { type HostedEngine, openHostedEngine } from "../engine/engine-host.js";
import { type ThpMode, readThpMode } from "../core/huge-pages.js";
import { loadPreprocessorConfig, preprocessImage } from "../image/image-preprocess.js";
import { PackReader } from "../pack/pack-format.js";
import { type ActDtypeChoice, actModeFor, actModeJson } from "../plan/act-mode.js";
import { DEFAULT_MAX_BATCH, DEFAULT_MAX_CONTEXT } from "../plan/defaults.js";
import { plan } from "../plan/planner.js";
import type { RamChoice } from "../plan/ram-budget.js";
import { collectGarbage } from "../system/collect-garbage.js";
import { peakRssBytes } from "../system/process-memory.js";
import { UserError } from "../system/user-error.js";

interface BenchOptions {
  model: string;
  /** native, wasm, or both in this order */
  backends: readonly BackendName[];
  /** what --backend asked for ("auto", "native", "wasm", "both") and why these backends run */
  backendRequest: string;
  backendReason: string;
  /** The backend choice's record: the native kernel set --kernels auto runs (act-mode.ts). */
  backendRecord: Pick<BackendRecord, "native">;
  /** --ram-mib: auto (what the machine gives now) or MiB */
  ramMib: RamChoice;
  /** chat: plan exactly as kvl chat does (its context, prefill chunk and vision reservation);
   * bench: a bench-only plan (context sized to the prompts, no vision, one prefill chunk per prompt) */
  plan: BenchPlan;
  /** as given: "auto" or MiB */
  cacheMib: string;
  /** as given: "auto", "0" or MiB (the settings record keeps the text) */
  trunkCacheMib: string;
  /** resolved (no 0) */
  threads: number;
  promptLens: readonly number[];
  decodeTokens: number;
  warm: boolean;
  warmupTokens: number;
  /** undefined: the plan's own (chat: DEFAULT_MAX_BATCH; bench: the longest prompt); 0 = the longest prompt */
  maxBatch?: number | undefined;
  seed: number;
  /** auto: per backend, the mode act-mode.ts's table gives for its kernel set. */
  actDtype: ActDtypeChoice;
  /** the kernel set each backend runs (kvl chat --kernels; default auto) */
  kernels?: KernelChoice | undefined;
  dropCaches: boolean;
  membw?: string | undefined;
  instances?: number | undefined;
  /** the engine option expertLookahead (--expert-lookahead; absent: auto) */
  expertLookahead?: ExpertLookahead | undefined;
  /** --routing: each mode runs every backend and prompt length (absent: the model's only) */
  routings?: readonly RoutingSpec[] | undefined;
  /** --cache-policy: each policy runs every routing mode, backend and prompt length (absent: the
   * engine's default, adaptive) */
  cachePolicies?: readonly CachePolicy[] | undefined;
  /** the traces of trace:FILE modes, read and checked against the pack by the caller */
  traces?: ReadonlyMap<string, Trace> | undefined;
  /** --routing-out: records the first run under the model's routing */
  recorder?: RoutingRecorder | undefined;
  /** --image SIDE: also encode a random SIDE x SIDE image on each backend (0 or absent: no) */
  imageSide?: number | undefined;
}

/** One image encode on one backend (--image): MoonViT + projector, timed twice. */
export interface ImageRecord {
  backend: BackendName;
  /** the random image's side in pixels, and the patch grid the official preprocessing made */
  side: number;
  grid: [number, number];
  media_tokens: number;
  kernels: string;
  /** the first includes the CRC checks of the vision tensors' first reads; the second does not */
  encode_s: [number, number];
  /** visionFlops (bench-model.ts): the products of the tower and projector */
  flops: number;
  flops_per_s: number;
  /** flops_per_s / the FMA peak (null without one) */
  ratio_to_fma_peak: number | null;
  vision_bytes_read: number;
}

export interface RunRecord {
  backend: BackendName;
  /** --routing: model, uniform or trace:FILE */
  routing: string;
  /** --cache-policy: what the expert cache evicts by (the engine's kvl_engine_info) */
  cache_policy: string;
  /** true unless the model routed: then the tokens are not the model's (note says so) */
  routing_overridden: boolean;
  routing_note?: string;
  /** trace:FILE: the trace's tokens this run consumed, and whether it wrapped around */
  trace_tokens_used?: number;
  trace_wrapped?: boolean;
  instances: number;
  prompt_tokens: number;
  open_s: number;
  /** CRC checks at open (every trunk tensor the engine reads then): the pool's time, and bytes */
  open_verify_s: number;
  open_verify_bytes: number;
  plan_total_bytes: number;
  /** the budget the plan was held to, MiB, and whether --ram-mib auto chose it (and from what) */
  ram_budget_mib: number;
  ram_budget_chosen_by: "auto" | "option";
  ram_budget_detail: string | null;
  plan: string;
  plan_differences: string[];
  open_ssd_bytes: number;
  info: Record<string, unknown>;
  /** The act mode the run planned and opened with, and why (act-mode.ts actModeJson). */
  act_mode: ReturnType<typeof actModeJson>;
  streamed_trunk_bytes: number;
  cold_prompt?: PromptRecord;
  decode_after_cold?: DecodeRecord;
  warm_prompt?: PromptRecord;
  decode_warm?: DecodeRecord;
  /** VmHWM since the reset before this run's engine open (else since the process started) */
  peak_rss_bytes?: number | null;
  peak_rss_over_plan?: number | null;
}

export interface BenchResult {
  model: string;
  backend: string;
  backend_reason: string;
  settings: Record<string, unknown>;
  limits: Limits;
  pack_bytes: PackBytes;
  runs: RunRecord[];
  /** --image: one record per backend */
  images?: ImageRecord[];
  native_over_wasm?: BenchComparison;
  peak_rss_bytes: number | null;
  /** whether VmHWM could be reset before each run (Linux); else peaks include all before */
  peak_rss_reset: boolean;
  ru_maxrss_bytes: number;
  /** Linux's transparent huge page mode (host/core/huge-pages.ts; null elsewhere) */
  transparent_huge_pages: ThpMode | null;
}

// ---- process memory -------------------------------------------------------------------------

/** Resets VmHWM to the current RSS (Linux >= 4.0); false where it cannot. */
function resetPeakRss(): boolean {
  try {
    writeFileSync("/proc/self/clear_refs", "5\n");
    return true;
  } catch {
    return false;
  }
}

/** A full garbage collection (closed engines' WebAssembly memories are freed only then). */
async function collectAll(): Promise<void> {
  collectGarbage();
  await new Promise((r) => setTimeout(r, 50)); // terminated pthread workers let go of the memory
  collectGarbage();
}

// ---- timing ---------------------------------------------------------------------------------

const now = (): number => performance.now() / 1000;

function argmax(logits: Float32Array): number {
  let best = 0;
  for (let i = 1; i < logits.length; i++) if (logits[i]! > logits[best]!) best = i;
  return best;
}

type Delta = Record<keyof EngineStats, number>;

function delta(after: EngineStats, before: EngineStats): Delta {
  const out = {} as Delta;
  for (const k of Object.keys(after) as Array<keyof EngineStats>) out[k] = after[k] - before[k];
  return out;
}

const ssdBytes = (d: Pick<EngineStats, "expertBytesRead" | "trunkBytesRead">): number => d.expertBytesRead + d.trunkBytesRead;

function hitRate(d: Delta): number | null {
  const n = d.expertHits + d.expertMisses;
  return n ? d.expertHits / n : null;
}

function lookaheadOf(d: Delta): LookaheadRecord {
  const issued = d.expertLookaheadIssued;
  return { issued, used: d.expertLookaheadUsed, wasted: d.expertLookaheadWasted, cancelled: d.expertLookaheadCancelled,
    pending: d.expertLookaheadPending, hit_rate: issued ? d.expertLookaheadUsed / issued : null };
}

function timePrompt(hosted: HostedEngine, tokens: Int32Array, maxContext: number, maxBatch: number, routing: RunRouting): { session: CoreSession; record: PromptRecord } {
  const engine = hosted.engine;
  const session = engine.newSession({ maxContext, maxBatch });
  try {
    const hook = routing.nextHook();
    if (hook !== null) session.setRouting(hook);
    const before = engine.stats();
    const t0 = now();
    const logits = session.prefill(tokens, null, "last")!;
    const t1 = now();
    const first = argmax(logits);
    const t2 = now();
    const d = delta(engine.stats(), before);
    return {
      session,
      record: {
        tokens: tokens.length, prefill_s: t1 - t0, first_token_s: t2 - t0, prefill_tokens_per_s: tokens.length / (t1 - t0), first_token: first,
        ssd_bytes: ssdBytes(d), expert_misses: d.expertMisses, expert_hits: d.expertHits, expert_stall_s: d.expertStallNs / 1e9,
        trunk_bytes_read: d.trunkBytesRead, expert_bytes_read: d.expertBytesRead, verify_s: d.verifyNs / 1e9, verify_bytes: d.verifyBytes,
      },
    };
  } catch (err) {
    session.close();
    throw err;
  }
}

/** Ends a session of the run: its routing (the trace cursor, the recorder), then the session. */
function closeSession(session: CoreSession, routing: RunRouting): void {
  try {
    routing.endSession(session.position());
  } finally {
    session.close();
  }
}

function median(sorted: number[]): number {
  const n = sorted.length;
  return n % 2 ? sorted[(n - 1) / 2]! : (sorted[n / 2 - 1]! + sorted[n / 2]!) / 2;
}

function timeDecode(hosted: HostedEngine, session: CoreSession, first: number, n: number): DecodeRecord {
  const engine = hosted.engine;
  const start = session.position();
  const before = engine.stats();
  let token = first;
  const times: number[] = [];
  const ids = new Array<number>(n); // allocated before the loop
  for (let i = 0; i < n; i++) {
    const t0 = now();
    const logits = session.step(token);
    token = argmax(logits);
    times.push(now() - t0);
    ids[i] = token;
  }
  const d = delta(engine.stats(), before);
  const mean = times.reduce((a, b) => a + b, 0) / n;
  const sorted = [...times].sort((a, b) => a - b);
  return {
    tokens: n, token_ids: ids, context_start: start, s_per_token_mean: mean, s_per_token_median: median(sorted), s_per_token_min: sorted[0]!,
    tokens_per_s: 1 / mean, ssd_bytes_per_token: ssdBytes(d) / n, expert_hit_rate: hitRate(d),
    expert_stall_s_per_token: d.expertStallNs / 1e9 / n, expert_stall_share: d.expertStallNs / 1e9 / (mean * n),
    expert_lookahead: lookaheadOf(d), trunk_stall_s_per_token: d.trunkStallNs / 1e9 / n,
    expert_bytes_read: d.expertBytesRead, trunk_bytes_read: d.trunkBytesRead,
    verify_s_per_token: d.verifyNs / 1e9 / n, verify_share: d.verifyNs / 1e9 / (mean * n), verify_bytes_per_token: d.verifyBytes / n,
  };
}

/** A decode with its bounds, bracketed by bandwidth probes when --membw is given. */
function boundedDecode(o: BenchOptions, hosted: HostedEngine, session: CoreSession, first: number, pb: PackBytes, limits: Limits,
  kvRow: number): DecodeRecord {
  const before = o.membw ? probeLimits(o.membw, o.model, o.threads, first) : null;
  const dec = timeDecode(hosted, session, first, o.decodeTokens);
  const after = o.membw ? probeLimits(o.membw, o.model, o.threads, first + 1) : null;
  decodeBounds(dec, pb, limits, kvRow);
  if (before && after) adjacentBounds(dec, before, after);
  return dec;
}

// ---- the procedure --------------------------------------------------------------------------

/** The bench's plans: as kvl chat plans (the default: what a user gets), as kvl chat --no-vision
 * plans (chat-text: the same context and chunks, no vision tower reserved), or the bench's own. */
export const BENCH_PLANS = ["chat", "chat-text", "bench"] as const;
export type BenchPlan = (typeof BENCH_PLANS)[number];

/** The session sizes: chat's (its context unless the prompts need more, its prefill chunk) or the
 * bench-only plan's (the context the prompts need, each prompt one chunk). */
export function benchSizes(o: Pick<BenchOptions, "promptLens" | "decodeTokens" | "warm" | "warmupTokens" | "maxBatch" | "plan">): { maxBatch: number; maxContext: number } {
  const longest = Math.max(...o.promptLens);
  let needed = longest + o.decodeTokens + 8;
  if (o.warm) needed = Math.max(needed, o.warmupTokens + 8);
  const oneChunk = Math.max(longest, o.warm ? o.warmupTokens : 0);
  if (o.plan === "chat" || o.plan === "chat-text") {
    return { maxBatch: o.maxBatch === undefined ? DEFAULT_MAX_BATCH : o.maxBatch || oneChunk, maxContext: Math.max(DEFAULT_MAX_CONTEXT, needed) };
  }
  return { maxBatch: o.maxBatch || oneChunk, maxContext: needed };
}

/** One prompt length on one backend: a fresh engine from the plan, cold prompt, decode, optional warm repeat. */
async function benchOne(o: BenchOptions, backend: BackendName, n: number, pb: PackBytes, limits: Limits, sizes: { maxBatch: number; maxContext: number },
  rssReset: boolean, spec: RoutingSpec, policy: CachePolicy | undefined, recorder: RoutingRecorder | null): Promise<RunRecord> {
  const { maxBatch, maxContext } = sizes;
  const trace = spec.kind === "trace" ? o.traces?.get(spec.file) ?? null : null;
  if (spec.kind === "trace" && trace === null) throw new Error(`bench: the trace ${spec.file} was not read`);
  const routing = new RunRouting(spec, trace, pb, o.seed + n, maxBatch, recorder);
  if (o.dropCaches) dropPageCache();
  const mode = await actModeFor(o.actDtype, o.backendRecord, backend, o.kernels ?? "auto");
  const ramPlan = await plan(o.model, {
    backend, ramMib: o.ramMib, cacheMib: o.cacheMib === "auto" ? null : Number(o.cacheMib), trunkCacheMib: o.trunkCacheMib === "auto" ? null : Number(o.trunkCacheMib),
    maxContext, maxBatch, loadVision: o.plan === "chat", threads: o.threads, actDtype: mode.actDtype, check: true, ...(o.instances !== undefined ? { instances: o.instances } : {}),
  });
  await collectAll();
  if (rssReset) resetPeakRss();
  const t0 = now();
  let hosted: HostedEngine;
  try {
    hosted = await openHostedEngine(backend, o.model, {
      nThreads: ramPlan.nThreads, planned: ramPlan.instances, actDtype: mode.actDtype, ...(o.kernels !== undefined ? { kernels: o.kernels } : {}),
      ...(backend === "native" && o.backendRecord.native.loads ? { nativeAddon: o.backendRecord.native.path } : {}),
      ...(o.expertLookahead !== undefined ? { expertLookahead: o.expertLookahead } : {}),
      ...(policy !== undefined ? { expertCachePolicy: policy } : {}),
    });
  } catch (err) {
    if (err instanceof CoreError) throw new UserError(`the ${backend} engine refused ${o.model}: ${err.message}`);
    throw err;
  }
  const openS = now() - t0;
  let run: RunRecord;
  try {
    const engine = hosted.engine;
    const differences = ramPlan.reconcile(engine.parts.map((p) => ({ info: p.info(), sessionBytes: p.sessionBytes(ramPlan.sessionOptions) })));
    const info = engine.info();
    const openStats = engine.stats();
    const kvRow = kvRowBytes(pb, info.kvDtype);
    const streamedTrunk = ramPlan.trunkCacheable - info.trunkCacheBytes;
    run = {
      backend, routing: routingLabel(spec), cache_policy: info.expertCachePolicy, routing_overridden: routing.overridden,
      ...(routing.overridden ? { routing_note: OVERRIDDEN_NOTE } : {}), instances: hosted.ranges.length, prompt_tokens: n, open_s: openS, open_verify_s: openStats.verifyNs / 1e9,
      open_verify_bytes: openStats.verifyBytes, plan_total_bytes: ramPlan.total, ram_budget_mib: ramPlan.settings.ramMib,
      ram_budget_chosen_by: ramPlan.settings.ramChosenBy, ram_budget_detail: ramPlan.settings.ramDetail, plan: ramPlan.describe(),
      plan_differences: differences, open_ssd_bytes: ssdBytes(openStats),
      info: {
        n_threads: info.nThreads, kernels: info.kernels, kv_dtype: info.kvDtype, act_dtype: info.actDtype, trunk_direct_io: info.trunkDirectIo,
        expert_direct_io: info.expertDirectIo, global_bytes: info.globalBytes, trunk_cache_bytes: info.trunkCacheBytes,
        expert_cache_bytes: info.expertCacheBytes, engine_workspace_bytes: info.engineWorkspaceBytes, expert_extent_bytes: info.expertExtentBytes,
        expert_lookahead: info.expertLookahead,
      },
      act_mode: actModeJson(mode),
      streamed_trunk_bytes: streamedTrunk,
    };
    const avoid = [info.mediaPlaceholderTokenId];
    const tokens = randomPrompt(pb.vocab, n, o.seed + n, avoid);
    const cold = timePrompt(hosted, tokens, maxContext, maxBatch, routing);
    try {
      const distinct = cold.record.expert_misses;
      promptBounds(cold.record, pb, limits, streamedTrunk, distinct, kvRow, true);
      run.cold_prompt = cold.record;
      run.decode_after_cold = boundedDecode(o, hosted, cold.session, cold.record.first_token, pb, limits, kvRow);
    } finally {
      closeSession(cold.session, routing);
    }
    if (o.warm) {
      const warmTokens = randomPrompt(pb.vocab, o.warmupTokens, o.seed + 10_000, avoid);
      closeSession(timePrompt(hosted, warmTokens, maxContext, maxBatch, routing).session, routing);
      const warm = timePrompt(hosted, tokens, maxContext, maxBatch, routing);
      try {
        promptBounds(warm.record, pb, limits, streamedTrunk, run.cold_prompt.distinct_experts!, kvRow, false);
        run.warm_prompt = warm.record;
        run.decode_warm = boundedDecode(o, hosted, warm.session, warm.record.first_token, pb, limits, kvRow);
      } finally {
        closeSession(warm.session, routing);
      }
    }
    if (spec.kind === "trace") {
      run.trace_tokens_used = routing.traceTokensUsed;
      run.trace_wrapped = routing.wrapped;
    }
  } catch (err) {
    if (err instanceof CoreError) throw new UserError(`${backend} engine: ${err.message}`);
    throw err;
  } finally {
    hosted.close();
  }
  const peak = peakRssBytes();
  run.peak_rss_bytes = peak;
  run.peak_rss_over_plan = peak === null ? null : peak / run.plan_total_bytes;
  return run;
}

/** A random RGB image (a seeded LCG, as bench/vision-bench.mjs draws it) through the official preprocessing. */
function randomImage(model: string, side: number, merge: [number, number]): { pixelValues: Float32Array; grid: [number, number] } {
  let state = side >>> 0;
  const data = new Uint8Array(side * side * 3);
  for (let i = 0; i < data.length; i++) {
    state = (Math.imul(state, 1664525) + 1013904223) >>> 0;
    data[i] = state >>> 24;
  }
  return preprocessImage({ width: side, height: side, mode: "RGB", data }, loadPreprocessorConfig(model, merge));
}

/** --image: a fresh engine with the vision tower, one random image encoded twice. */
async function benchImage(o: BenchOptions, backend: BackendName, side: number, limits: Limits): Promise<ImageRecord> {
  const hp = (await PackReader.open(o.model)).hparams;
  const g = (key: string): number => {
    const v = hp.get(key);
    if (v === undefined) throw new UserError(`${o.model}: the pack's hparams lack '${key}'; rerun kvl pack`);
    return v;
  };
  const merge: [number, number] = [g("vision.merge_kernel_h"), g("vision.merge_kernel_w")];
  const { pixelValues, grid } = randomImage(o.model, side, merge);
  const ramPlan = await plan(o.model, {
    backend, ramMib: o.ramMib, loadVision: true, threads: o.threads, check: true, ...(o.instances !== undefined ? { instances: o.instances } : {}),
  });
  let hosted: HostedEngine;
  try {
    hosted = await openHostedEngine(backend, o.model, {
      nThreads: ramPlan.nThreads, planned: ramPlan.instances, ...(o.kernels !== undefined ? { kernels: o.kernels } : {}),
    });
  } catch (err) {
    if (err instanceof CoreError) throw new UserError(`the ${backend} engine refused ${o.model}: ${err.message}`);
    throw err;
  }
  try {
    const engine = hosted.engine;
    hosted.lendImageRoom(false); // as chat does for an image: the image lines' RAM back from the expert cache
    const before = engine.stats().visionBytesRead;
    const times: number[] = [];
    let rows: Float32Array<ArrayBufferLike> = new Float32Array(0);
    for (let r = 0; r < 2; r++) {
      const t0 = now();
      rows = engine.encodeImages(pixelValues, Int32Array.from(grid));
      times.push(now() - t0);
    }
    const flops = visionFlops({
      hidden: g("vision.hidden_size"), intermediate: g("vision.intermediate_size"), layers: g("vision.num_hidden_layers"),
      patch: g("vision.patch_size"), merge, textHidden: g("text.hidden_size"),
    }, grid);
    const perS = flops / times[1]!;
    return {
      backend, side, grid, media_tokens: rows.length / engine.info().hiddenSize, kernels: engine.info().kernels,
      encode_s: [times[0]!, times[1]!], flops, flops_per_s: perS,
      ratio_to_fma_peak: limits.fma_flops_per_s ? perS / limits.fma_flops_per_s : null,
      vision_bytes_read: (engine.stats().visionBytesRead - before) / 2,
    };
  } catch (err) {
    if (err instanceof CoreError) throw new UserError(`${backend} engine: ${err.message}`);
    throw err;
  } finally {
    hosted.close();
  }
}

/**
 * Runs the benchmark: every prompt length on every backend asked for (native first), calling
 * onRun after each run. Limits and pack bytes are measured once by the caller, so both backends
 * are held against the same limits.
 */
export async function runBench(o: BenchOptions, pb: PackBytes, limits: Limits, onRun: (run: RunRecord) => void = () => undefined,
  onImage: (image: ImageRecord) => void = () => undefined): Promise<BenchResult> {
  const lens = [...o.promptLens];
  if (!lens.length || Math.min(...lens) < 1 || o.decodeTokens < 1) throw new UserError("--prompt-lens needs positive lengths and --decode-tokens >= 1");
  const sizes = benchSizes(o);
  const rssReset = process.platform === "linux" && resetPeakRss();
  const result: BenchResult = {
    model: o.model,
    backend: o.backends.length > 1 ? "both" : o.backends[0]!,
    backend_reason: o.backendReason,
    settings: {
      ram_mib: o.ramMib, plan: o.plan, cache_mib: o.cacheMib === "auto" ? o.cacheMib : Number(o.cacheMib), trunk_cache_mib: o.trunkCacheMib, threads: o.threads, prompt_lens: lens,
      decode_tokens: o.decodeTokens, warm: o.warm, max_batch: sizes.maxBatch, max_context: sizes.maxContext, seed: o.seed,
      drop_caches: o.dropCaches, act_dtype: o.actDtype, kernels: o.kernels ?? "auto", backend: o.backendRequest, instances: o.instances ?? null,
      expert_lookahead: o.expertLookahead ?? "auto", image: o.imageSide ?? 0,
      routing: (o.routings ?? [{ kind: "model" }]).map(routingLabel),
      cache_policy: o.cachePolicies ?? ["adaptive"],
    },
    limits, pack_bytes: pb, runs: [], peak_rss_bytes: null, peak_rss_reset: rssReset, ru_maxrss_bytes: 0,
    transparent_huge_pages: readThpMode(),
  };
  // the routing modes innermost: the runs a side-by-side compares follow each other in time
  let recorder = o.recorder ?? null;
  for (const backend of o.backends) {
    for (const n of lens) {
      for (const spec of o.routings ?? [{ kind: "model" } as const]) {
        for (const policy of o.cachePolicies ?? [undefined]) {
          const rec = spec.kind === "model" ? recorder : null;
          if (rec !== null) recorder = null; // --routing-out: the first run under the model's routing
          const run = await benchOne(o, backend, n, pb, limits, sizes, rssReset, spec, policy, rec);
          result.runs.push(run);
          onRun(run);
        }
      }
    }
    if (o.imageSide) {
      const image = await benchImage(o, backend, o.imageSide, limits);
      (result.images ??= []).push(image);
      onImage(image);
    }
  }
  // native / wasm on the first routing mode's and policy's runs (the model's routing and the
  // default policy, unless --routing and --cache-policy say otherwise)
  if (o.backends.length > 1) {
    const first = result.runs[0]!;
    result.native_over_wasm = nativeOverWasm(result.runs.filter((r) => r.routing === first.routing && r.cache_policy === first.cache_policy));
  }
  const peaks = result.runs.map((r) => r.peak_rss_bytes).filter((p): p is number => typeof p === "number");
  result.peak_rss_bytes = peaks.length ? Math.max(...peaks) : peakRssBytes();
  result.ru_maxrss_bytes = process.resourceUsage().maxRSS * 1024;
  return result;
}
