/**
 * model-doctor.ts — the checks of `kvl doctor MODEL`: a packed model, the backends and this
 * machine, each check a status (OK, WARN, FAIL), a name and a detail, then a verdict (PASS, or
 * FAIL: what to fix), returned as one report (cli/doctor-model.ts renders it).
 *
 * Checks, in order: the directory is a pack (a source checkpoint is told to run kvl pack) with
 * the files the runtime reads; the pack's structure and index CRCs (pack-format.ts); every
 * tensor's data CRC (the whole pack is read; --quick skips it and says so); the tensor directory
 * and hparams against config.json (model-spec.ts); provenance (SOURCE_REVISION.txt against the
 * indexes and the pinned revision); which backend runs and why (backend.ts's record); the act
 * mode (--act-dtype auto resolved for the backend and kernel set, plan/act-mode.ts) and the RAM
 * plan (planner.ts) made with it and the model options, against --ram-mib and the RAM available
 * now; the engine opened from that plan in its worker, with its kernels and act mode, direct I/O
 * where the model lives and, on Linux, whether the cache's memory gets huge pages
 * (huge-pages.ts); a short greedy generation.
 * A failed pack check stops before the engine checks (they would only repeat the failure).
 *
 * Owns: running the checks and their findings' wording. Does not own: rendering them
 * (cli/doctor-model.ts), or any checked machinery.
 */
import { readFileSync } from "node:fs";
import { freemem } from "node:os";
import { join, resolve } from "node:path";

import { type BackendRecord, BackendError, chooseBackend } from "../core/backend.js";
import { bufferedReadAdvice } from "../core/direct-io.js";
import { hugePageAdvice, readThpMode } from "../core/huge-pages.js";
import { checkpointNotPack, configProblems, missingRuntimeFiles } from "../pack/pack-check.js";
import { PackReader, SOURCE_REVISION_FILE } from "../pack/pack-format.js";
import { type ActMode, actModeFor, actModeText } from "../plan/act-mode.js";
import { MIB } from "../plan/core-bytes.js";
import { type RamPlan, plan } from "../plan/planner.js";
import type { ModelOptions } from "../plan/settings.js";
import { UserError } from "../system/user-error.js";
import { ChatTemplate } from "../text/chat-template.js";
import { buildPrompt } from "../text/conversation.js";
import { Tokenizer } from "../text/tokenizer.js";
import { EngineClient } from "./engine-client.js";

const GENERATION_TOKENS = 8;

type CheckStatus = "OK" | "WARN" | "FAIL";

interface Check {
  readonly status: CheckStatus;
  readonly name: string;
  readonly detail: string;
  /** What to do about a FAIL (the verdict line says it). */
  readonly fix?: string;
}

/** A progress display (packer/progress.ts Progress has this shape). */
interface CheckProgress {
  start(label: string, total: number): void;
  add(bytes: number): void;
  stop(): void;
}

/** The model options (what chat and serve would run the model with) and the doctor's own. */
interface ModelDoctorOptions extends ModelOptions {
  /** --backend; KVL_BACKEND applies when absent. */
  readonly backend?: string | undefined;
  /** Skip the data CRCs. */
  readonly quick: boolean;
  readonly progress: CheckProgress;
  /** The source revision kvl is verified against (packer/hub.ts PINNED_REVISION, from the caller:
   * host/ imports nothing of packer/). */
  readonly pinnedRevision: string;
}

export interface ModelDoctorReport {
  readonly model: string;
  readonly checks: readonly Check[];
  readonly pass: boolean;
  /** The last line: PASS or FAIL: ... */
  readonly verdict: string;
  readonly backend: BackendRecord | null;
  /** The act mode the plan and the engine were made with, and why; null without a backend. */
  readonly actMode: ActMode | null;
  /** The RAM plan's table (planner describe()), also when it refused; null when none was made. */
  readonly ramPlan: string | null;
  /** Whether the plan refused the budget (the table is then shown without --verbose). */
  readonly ramPlanRefused: boolean;
}

const message = (err: unknown): string => (err instanceof Error ? err.message : String(err));

/** A source checkpoint (what kvl pack reads) rather than a pack: a FAIL check, or null. */
function checkNotCheckpoint(model: string): Check | null {
  const found = checkpointNotPack(model);
  return found === null ? null : { status: "FAIL", name: "pack", ...found };
}

async function checkPack(model: string): Promise<{ check: Check; reader: PackReader | null }> {
  let reader: PackReader;
  try {
    reader = await PackReader.open(model);
  } catch (err) {
    if (!(err instanceof UserError)) throw err;
    return { check: { status: "FAIL", name: "pack", detail: err.message, fix: err.message }, reader: null };
  }
  const missing = missingRuntimeFiles(model);
  if (missing.length) {
    const detail = `${missing.join(", ")} missing from ${model} — the pack is incomplete; rerun kvl pack`;
    return { check: { status: "FAIL", name: "pack", detail, fix: detail }, reader: null };
  }
  const stores = [...reader.stores].map(([name, index]) => `${name} ${index.records.length} tensors`).join(", ");
  // which trunk and experts `kvl pack --trunk-dtype / --expert-dtype` made (README "Numerics"):
  // q8 halves the trunk's bytes per token, q4 about halves the experts'
  const trunk = `format version ${reader.stores.get("trunk")!.version}, ${reader.trunkDtype} trunk Linear weights, ` +
    `${reader.expertDtype} routed experts`;
  return { check: { status: "OK", name: "pack", detail: `${stores}; ${trunk}; structure and index CRCs checked` }, reader };
}

async function checkData(reader: PackReader, quick: boolean, progress: CheckProgress): Promise<Check> {
  if (quick) {
    return { status: "WARN", name: "data", detail: "tensor data not checked (--quick): a corrupt byte in trunk.bin, experts.bin or vision.bin " +
      "is found only where the engine reads it (at load and in the short run below, as chat and serve do)" };
  }
  const total = reader.dataBytes;
  progress.start("checking tensor data", total);
  let bad;
  try {
    bad = await reader.corruptData((n) => progress.add(n));
  } catch (err) {
    if (!(err instanceof UserError)) throw err;
    return { status: "FAIL", name: "data", detail: err.message, fix: err.message };
  } finally {
    progress.stop();
  }
  if (bad.length) {
    const files = [...new Set(bad.map((b) => `${b.store}.bin`))];
    const more = bad.length > 3 ? ` (+${bad.length - 3} more)` : "";
    return { status: "FAIL", name: "data", detail: bad.slice(0, 3).map((b) => b.message).join("; ") + more,
      fix: `${files.join(" and ")} ${files.length > 1 ? "are" : "is"} corrupt (${bad.length} tensor${bad.length > 1 ? "s" : ""}); rerun kvl pack` };
  }
  const count = [...reader.stores.values()].reduce((n, i) => n + i.records.length, 0);
  return { status: "OK", name: "data", detail: `CRCs of all ${count} tensors match (${(total / MIB).toFixed(1)} MiB read)` };
}

/** The pack's tensors, shapes, dtypes and hparams against its config.json. */
function checkDirectory(model: string, reader: PackReader): Check {
  const name = "tensor directory";
  const { problems, unusable } = configProblems(model, reader);
  if (unusable) {
    return { status: "FAIL", name, detail: problems.join("; "), fix: problems.at(-1)!.startsWith("config.json unreadable")
      ? "restore config.json (rerun kvl pack)" : "use a Kimi-VL config.json" };
  }
  if (problems.length) {
    const more = problems.length > 3 ? ` (+${problems.length - 3} more)` : "";
    return { status: "FAIL", name, detail: problems.slice(0, 3).join("; ") + more, fix: "the pack does not match its config.json; rerun kvl pack" };
  }
  const dense = reader.stores.get("trunk")!.records.length + reader.stores.get("vision")!.records.length;
  return { status: "OK", name, detail: `${dense} dense tensors and ${reader.stores.get("experts")!.records.length} expert extents match config.json` };
}

function checkProvenance(model: string, reader: PackReader, pinned: string): Check {
  const name = "provenance";
  let revision: string;
  try {
    const raw = readFileSync(join(model, SOURCE_REVISION_FILE));
    if (raw.some((b) => b >= 0x80)) throw new Error("not ASCII");
    revision = raw.toString("latin1").trim();
  } catch {
    return { status: "FAIL", name, detail: `${SOURCE_REVISION_FILE} missing or unreadable`, fix: "rerun kvl pack (or kvl prepare)" };
  }
  if (reader.revision && reader.revision !== revision) {
    return { status: "FAIL", name, detail: `${SOURCE_REVISION_FILE} says ${revision}, the indexes say ${reader.revision}`,
      fix: "the pack was modified; rerun kvl pack" };
  }
  if (revision === pinned) return { status: "OK", name, detail: `pinned revision ${revision}` };
  if (!/^[0-9a-f]{40}$/i.test(revision)) {
    return { status: "WARN", name, detail: `synthetic or unknown source ('${revision}'), not the pinned revision ` +
      `${pinned.slice(0, 12)}: outputs are not the real model's` };
  }
  return { status: "WARN", name, detail: `source revision ${revision} is not the pinned ${pinned}; kvl is verified against the pinned one (use kvl prepare)` };
}

function checkBackend(option: string | undefined): { check: Check; record: BackendRecord | null } {
  const name = "backend";
  let record: BackendRecord;
  try {
    record = chooseBackend({ option });
  } catch (err) {
    if (!(err instanceof BackendError)) throw err;
    return { check: { status: "FAIL", name, detail: err.message,
      fix: `${err.message} (kvl doctor without a model shows every backend; build the addon with npm ci, or choose another --backend)` }, record: null };
  }
  const native = record.native.loads
    ? `native addon loads (kernel sets ${record.native.kernelSets.filter((k) => k.supported).map((k) => k.name).join(", ")})`
    : `native addon unavailable (${record.native.error})`;
  const wasm = record.wasm.usable ? "WebAssembly usable (SIMD128, threads)" : `WebAssembly unusable (${record.wasm.error})`;
  const by = record.requestedBy === "default" ? "" : ` [${record.requestedBy === "option" ? "--backend" : "KVL_BACKEND"}=${record.requested}]`;
  return { check: { status: "OK", name, detail: `${record.chosen} runs — ${record.reason}${by}; ${native}; ${wasm}` }, record };
}

/** Memory the OS can give without swapping: Linux MemAvailable, elsewhere os.freemem(). */
export function availableRamBytes(): number | null {
  if (process.platform === "linux") {
    try {
      const line = readFileSync("/proc/meminfo", "utf8").split("\n").find((l) => l.startsWith("MemAvailable:"));
      if (line) return Number(line.split(/\s+/)[1]) * 1024;
    } catch {
      /* fall back */
    }
  }
  const free = freemem();
  return free > 0 ? free : null;
}

async function checkRam(model: string, record: BackendRecord, o: ModelDoctorOptions, mode: ActMode): Promise<{ check: Check; plan: RamPlan | null; table: string | null }> {
  const name = "RAM";
  const ramMib = o.ramMib;
  let ramPlan: RamPlan;
  try {
    ramPlan = await plan(model, {
      backend: record.chosen, ramMib, cacheMib: o.cacheMib ?? null, trunkCacheMib: o.trunkCacheMib, maxContext: o.maxContext, loadVision: o.loadVision,
      threads: o.threads, actDtype: mode.actDtype, check: true,
      ...(o.instances !== undefined ? { instances: o.instances } : {}),
      ...(o.imageMaxPixels !== undefined ? { imageMaxPixels: o.imageMaxPixels } : {}),
    });
  } catch (err) {
    if (!(err instanceof UserError)) throw err;
    const [first, ...rest] = err.message.split("\n");
    return { check: { status: "FAIL", name, detail: `${record.chosen}: ${first}`, fix: first! }, plan: null,
      table: rest.length ? rest.join("\n") : null };
  }
  const total = ramPlan.total;
  const instances = ramPlan.instances.length;
  const head = `${record.chosen} plan ${(total / MIB).toFixed(0)} MiB of ${ramPlan.budgetText} ` +
    `(${instances} ${record.chosen === "wasm" ? "instance" : "engine"}${instances > 1 ? "s" : ""}, ${ramPlan.nThreads} threads, ` +
    `Linear inputs ${mode.actDtype})`;
  const available = availableRamBytes();
  if (available === null) return { check: { status: "WARN", name, detail: `${head}; available RAM unknown on this system` }, plan: ramPlan, table: ramPlan.describe() };
  const detail = `${head}, ${(available / MIB).toFixed(0)} MiB available`;
  if (available < total) {
    return { check: { status: "WARN", name, detail: `${detail}: close other programs or run with a lower --ram-mib` }, plan: ramPlan, table: ramPlan.describe() };
  }
  return { check: { status: "OK", name, detail }, plan: ramPlan, table: ramPlan.describe() };
}

/** Opens the engine from the plan, reports it and direct I/O, and runs a short greedy reply. */
async function checkEngine(model: string, record: BackendRecord, ramPlan: RamPlan, o: ModelDoctorOptions, mode: ActMode): Promise<Check[]> {
  let client: EngineClient;
  try {
    client = await EngineClient.open(record.chosen, model, { nThreads: ramPlan.nThreads, planned: ramPlan.instances,
      ...(record.chosen === "native" ? { nativeAddon: record.native.path } : {}), kernels: o.kernels, actDtype: mode.actDtype,
      ...(o.expertLookahead !== undefined ? { expertLookahead: o.expertLookahead } : {}) });
  } catch (err) {
    return [{ status: "FAIL", name: "engine", detail: `the ${record.chosen} engine refused the pack (${message(err)})`, fix: `fix the pack (${message(err)})` }];
  }
  const checks: Check[] = [];
  try {
    const info = client.info;
    // in the exact mode, bf16 is the faster choice these kernels have (auto's i16x1 is as fast)
    const hint = info.kernels === "avx512-bf16" && info.actDtype === "f32"
      ? " (BF16 dot products: --act-dtype bf16 processes prompts ~1.5x faster, with BF16 rounding)" : "";
    checks.push({ status: "OK", name: "engine", detail: `opened on ${record.chosen} as planned (${client.ranges.length} ` +
      `range${client.ranges.length > 1 ? "s" : ""}); kernels ${info.kernels}${hint}, Linear inputs ${info.actDtype === mode.actDtype ? actModeText(mode) : info.actDtype}, ` +
      `${info.nThreads} threads` });
    const direct = { trunk: info.trunkDirectIo, expert: info.expertDirectIo };
    const buffered = Object.entries(direct).filter(([, d]) => !d).map(([k]) => k);
    checks.push(buffered.length === 0
      ? { status: "OK", name: "direct I/O", detail: `trunk and expert reads bypass the page cache in ${model}` }
      : { status: "WARN", name: "direct I/O", detail: `${buffered.join(" and ")} reads are buffered: ${bufferedReadAdvice(record.chosen, model)}` });
    const hugePages = hugePageAdvice(record.chosen, readThpMode());
    if (hugePages) checks.push({ status: hugePages.status, name: "huge pages", detail: hugePages.detail });
    checks.push(await checkGeneration(model, client, ramPlan));
  } finally {
    await client.close().catch(() => undefined);
  }
  return checks;
}

async function checkGeneration(model: string, client: EngineClient, ramPlan: RamPlan): Promise<Check> {
  const name = "generation";
  let tokenizer: Tokenizer | undefined;
  try {
    tokenizer = new Tokenizer(model);
    const prompt = buildPrompt([{ role: "user", parts: ["Say hello."] }], new ChatTemplate(model), tokenizer);
    const session = await client.newSession(ramPlan.sessionOptions);
    const started = performance.now();
    const result = await session.generate({
      prompt: Int32Array.from(prompt.tokens), mediaKeys: [], media: null, sampler: { temperature: 0, topK: 0, topP: 1 },
      seed: 0n, maxNewTokens: GENERATION_TOKENS, stopIds: Int32Array.from(tokenizer.stopIds), bannedIds: tokenizer.unsampleableIds(),
    }, () => undefined);
    const elapsed = (performance.now() - started) / 1000;
    await session.close();
    const vocab = client.info.vocabSize;
    if (result.tokens.some((t) => !(t >= 0 && t < vocab))) {
      return { status: "FAIL", name, detail: `bad output ids ${result.tokens.join(", ")}`, fix: "report this as a kvl bug" };
    }
    const n = result.tokens.length;
    const perToken = n > 1 ? `, then ${(result.timings.decodeSPerToken * 1000).toFixed(1)} ms per token` : "";
    return { status: "OK", name, detail: `${n} greedy token${n === 1 ? "" : "s"} (${result.finishReason}) in ${elapsed.toFixed(2)} s: ` +
      `prompt of ${result.promptTokens} tokens, first token ${result.timings.firstTokenS.toFixed(2)} s${perToken}` };
  } catch (err) {
    return { status: "FAIL", name, detail: message(err), fix: `generation failed (${message(err)})` };
  } finally {
    tokenizer?.close();
  }
}

export async function runModelDoctor(modelArg: string, options: ModelDoctorOptions): Promise<ModelDoctorReport> {
  const model = resolve(modelArg);
  const checks: Check[] = [];
  let ramPlanText: string | null = null;
  let refused = false;
  const notPack = checkNotCheckpoint(model);
  let reader: PackReader | null = null;
  if (notPack) {
    checks.push(notPack);
  } else {
    const pack = await checkPack(model);
    checks.push(pack.check);
    reader = pack.reader;
  }
  if (reader) {
    checks.push(await checkData(reader, options.quick, options.progress));
    checks.push(checkDirectory(model, reader));
    checks.push(checkProvenance(model, reader, options.pinnedRevision));
  }
  const packOk = reader !== null && !checks.some((c) => c.status === "FAIL");
  const backend = checkBackend(options.backend);
  checks.push(backend.check);
  // resolved before the plan, which counts the integer modes' bytes
  const actMode = backend.record ? await actModeFor(options.actDtype, backend.record, backend.record.chosen, options.kernels) : null;
  if (packOk && backend.record && actMode) {
    const ram = await checkRam(model, backend.record, options, actMode);
    checks.push(ram.check);
    ramPlanText = ram.table;
    refused = ram.plan === null;
    if (ram.plan) checks.push(...(await checkEngine(model, backend.record, ram.plan, options, actMode)));
  }
  const failed = checks.filter((c) => c.status === "FAIL");
  const verdict = failed.length ? `FAIL: ${failed.map((c) => `${c.name}: ${c.fix ?? c.detail}`).join("; ")}` : "PASS";
  return { model, checks, pass: failed.length === 0, verdict, backend: backend.record, actMode, ramPlan: ramPlanText, ramPlanRefused: refused };
}
