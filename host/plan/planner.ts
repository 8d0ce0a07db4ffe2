/**
 * planner.ts — the RAM plan: every resident byte of a running kvl, decided before anything is
 * allocated, and its split into instances.
 *
 * Owns: the RamPlan (one line per resident component, and per instance its layer range, the
 * options its engine is opened with and, on WebAssembly, its memory size); how many instances
 * (WebAssembly: the fewest, at least the requested --instances, whose memories each fit
 * maxInstanceBytes; native: the requested count); how the expert cache and the trunk cache are
 * shared between the ranges; the automatic trunk cache (whatever the budget leaves, capped at
 * what the trunk can use); the process around the engines (Node, the tokenizer, the JS buffers,
 * the margin); refusing a plan over --ram-mib with advice (advice.ts); reconciling the plan with
 * what the engines report; the plan's table (describe).
 * Does not own: the core's byte rules per range (core-bytes.ts), the input lines — the largest
 * image's decode and kvl serve's request bodies (input-lines.ts), the options' defaults and checks
 * (settings.ts, defaults.ts), the search for what fits — advice and auto limits (advice.ts),
 * resolving --act-dtype auto (act-mode.ts, before planning), allocation or opening engines
 * (engine-host.ts), the layer ranges' rule (instances.ts layerRanges, used as is), the pack
 * format (pack-format.ts).
 *
 * Sharing between ranges: the trunk cache keeps the model's forward-order prefix under the
 * budget (the same tensors a single engine would keep), so each range gets the part of that
 * prefix inside it; the expert cache's whole extents go to ranges in proportion to their MoE
 * layers (at least one layer's top-k each; a dense-only range gets none), handed out one at a
 * time so more budget never takes an extent from any range.
 *
 * Measured constants (node 20.20.2, linux-x64, emscripten 3.1.6), by
 *   node bench/node-overhead.mjs PACK      (after npx tsc -p tsconfig.json)
 * on the tiny pack of `kvl synth --preset tiny` + `kvl pack`: every scenario in fresh processes,
 * five runs each, the largest peak RSS (getrusage maxRSS) kept, since the plan bounds peaks:
 * - NODE_WASM_BYTES: Node with every host module loaded on the main thread (tokenizer and chat
 *   template modules included) and an engine worker_threads worker that loaded what
 *   engine-worker.js imports and created one WebAssembly instance with one pthread worker:
 *   88.6 MiB (a bare Node 20 is 43.9 MiB); 96 MiB.
 * - NODE_NATIVE_BYTES: the same with the native addon loaded instead of an instance: 79.6 MiB;
 *   88 MiB. The addon's threads are native (8 MiB stacks, mostly untouched: an engine with 1 or
 *   33 threads measured the same RSS within 0.3 MiB), so there is no per-thread figure.
 * - PTHREAD_WORKER_BYTES: every emscripten pthread worker is a Node worker with its own isolate:
 *   7.9 MiB each (17 against 1 worker; 8.6 MiB in a separate run of 33 against 1); 9 MiB. An
 *   instance starts WasmBackend.pthreadsForEngine(threads) of them.
 * - INSTANCE_JS_BYTES: an extra instance costs its pthread workers plus 0.8 MiB (three instances
 *   of one worker each against one: 8.7 MiB per instance); 2 MiB.
 * - TOKENIZER_BYTES_PER_FILE_BYTE: the host's Tokenizer (host/text/tokenizer.ts: the tiktoken npm
 *   package, its Rust core in a WebAssembly memory that never shrinks, plus the JS parse of the
 *   file) over the tiny pack's tiktoken.model (163,584 tokens, the real vocabulary size, 2,131,414
 *   bytes): +113.7 to +119.6 MiB peak over bare Node (55.9 to 58.8 bytes per file byte; about 92
 *   MiB once settled); the same ranks with tokens about twice as long (3,775,730 bytes): 53.9 to
 *   54.7 per file byte. 64. Engine and tokenizer
 *   in one process peaked at 160.1 MiB, under the 226 MiB these constants give.
 * - The whole: the same bench opens the tiny pack through EngineClient as this planner plans it
 *   (512 tokens, 2 threads, no vision), prefills 200 tokens and steps 32: peak RSS 271.4 to
 *   274.9 MiB on WebAssembly, plan 419.0 MiB (355.0 without the margin); 209.0 to 212.2 MiB on
 *   native, plan 306.3 MiB (242.3 without the margin).
 * - Inside a WebAssembly instance (the bench's "instance" scenario): core-bytes.ts.
 * - MARGIN_BYTES: allocator fragmentation, page tables, transient copies.
 */
import type { ActDtype, BackendName, EngineInfo, KvDtype } from "../core/core-api.js";
import { WasmBackend } from "../core/wasm-backend.js";
import { DTYPE_Q4_EXPERT } from "../pack/pack-format.js";
import { UserError } from "../system/user-error.js";
import { ExpertFloorError, InstanceLimitError, adviceFor, resolveAutoLimits } from "./advice.js";
import { MIB, type Model, type PackFacts, mib, modelOf, rangeBytes, readPackFacts, sessionLayoutBytes, slotOf, visionBytes,
  visionInInstanceBytes } from "./core-bytes.js";
import { type ImageBudget, type RequestBodies, imageBudgetOf, imageDecodeNote, requestBodiesNote, requestBodiesOf } from "./input-lines.js";
import { layerRanges } from "./instances.js";
import { type RoutingOutlook, outlookText, routingOutlook } from "./routing-outlook.js";
import { type PlanOptions, type PlanSettings, settingsOf } from "./settings.js";

export const NODE_WASM_BYTES = 96 * MIB;
export const NODE_NATIVE_BYTES = 88 * MIB;
export const PTHREAD_WORKER_BYTES = 9 * MIB;
const INSTANCE_JS_BYTES = 2 * MIB;
const TOKENIZER_BYTES_PER_FILE_BYTE = 64;
const MARGIN_BYTES = 64 * MIB;

/** What engine-host should open one range's engine with. */
interface RangeEngineOptions {
  layerBegin: number;
  layerEnd: number;
  /** Whole extents; absent on a range without MoE layers (it has no expert cache). */
  expertCacheBytes?: number;
  /** -1 streams every tensor of the range, > 0 is the resident prefix's exact bytes. */
  trunkCacheBytes: number;
  loadVision: boolean;
  nThreads: number;
  kvDtype: KvDtype;
  actDtype: ActDtype;
}

/** One instance: a layer range, its engine's bytes, and (WebAssembly) its memory. */
interface InstancePlan {
  readonly index: number;
  readonly range: [number, number];
  readonly engineOptions: RangeEngineOptions;
  globals: number;
  trunkCache: number;
  readonly trunkCacheable: number;
  expertCache: number;
  /** Native with vision: extent bytes the image lines (vision, imageDecode) lend this range's
   * expert cache while no image is decoded or encoded (whole extents; 0 otherwise). The engine is
   * opened with expertCache + expertLoan and gives the loan back for each image
   * (engine-host.ts lendImageRoom); the plan counts those bytes once, in the image lines. */
  readonly expertLoan: number;
  engineWorkspace: number;
  readonly kv: number;
  /** The session's arena without its KV, plus the session struct. */
  sessionArena: number;
  /** WebAssembly: static data, thread stacks, alignment, store indexes, allocator slack, rounding. */
  runtime: number;
  /** Per-call buffers the host allocates in the instance (one chunk, a step's logits, the sampler). */
  readonly scratch: number;
  /** Vision working memory inside this instance (WebAssembly, first range). */
  vision: number;
  /** Expert extent bytes as the engine reports it (0 when the range has no MoE layer). */
  readonly expertExtent: number;
  /** Threads the engine starts in the instance (each takes a stack there on WebAssembly). */
  readonly threads: number;
  /** WebAssembly: the memory to create the instance with (64 KiB multiple); native: the sum. */
  memoryBytes: number;
  /** WebAssembly: the part of runtime that rounds the memory up (64 KiB pages, the module's minimum). */
  padding: number;
}

const COMPONENTS = ["node", "tokenizer", "globals", "trunkCache", "expertCache", "kv", "sessionArena", "engineWorkspace",
  "runtime", "scratch", "vision", "mediaCache", "imageDecode", "requests", "logits", "margin"] as const;
type Component = (typeof COMPONENTS)[number];

const LABELS: Record<Component, string> = {
  node: "Node + kvl host (measured)",
  tokenizer: "tokenizer vocabulary",
  globals: "resident trunk (lm_head, norms, routers)",
  trunkCache: "trunk cache",
  expertCache: "expert cache (whole extents)",
  kv: "KV cache",
  sessionArena: "session arena",
  engineWorkspace: "trunk streaming buffers",
  runtime: "instance runtime (stacks, static data, indexes)",
  scratch: "per-call buffers in the instances",
  vision: "vision working memory (largest image)",
  mediaCache: "image embeddings (kept by content, a full context's rows)",
  logits: "logits, sampler and hidden-state buffers",
  margin: "margin (fragmentation, transient copies)",
  imageDecode: "image decode (file, pixels, resize passes)",
  requests: "request bodies (raw and parsed)",
};

interface Evaluated {
  instances: InstancePlan[];
  components: Record<Component, number>;
  total: number;
  largest: number;
  /** resident trunk tensors (forward-order prefix length) */
  prefix: number;
}

export class RamPlan {
  /** Components confirmed by the engines (reconcile). */
  readonly exact = new Set<string>();
  /** Extents the expert caches would hold in the same budget without the vision tower and its
   * image reservations (planFromFacts sets it when vision is loaded and the cache is partial). */
  textOnlyExtentsCached: number | null = null;

  constructor(
    private readonly facts: PackFacts,
    readonly settings: Readonly<PlanSettings>,
    readonly components: Record<Component, number>,
    readonly instances: InstancePlan[],
    readonly trunkCacheable: number,
    readonly trunkAuto: boolean,
    /** Pixels + one image's embeddings the host holds in JS around a vision call (in `vision`). */
    readonly visionHost: number,
    /** The image grid the vision figure is for, or null without vision. */
    readonly visionGrid: [number, number] | null,
  ) {}

  get backend(): BackendName {
    return this.settings.backend;
  }
  get ramBytes(): number {
    return Math.floor(this.settings.ramMib * MIB);
  }
  /** The budget as the load lines say it: "--ram-mib 4096", or "--ram-mib auto = 19800 MiB (how)". */
  get budgetText(): string {
    return this.settings.ramChosenBy === "auto"
      ? `--ram-mib auto = ${this.settings.ramMib} MiB (${this.settings.ramDetail})`
      : `--ram-mib ${this.settings.ramMib}`;
  }
  get maxContext(): number {
    return this.settings.maxContext;
  }
  get maxBatch(): number {
    return this.settings.maxBatch;
  }
  get kvDtype(): KvDtype {
    return this.settings.kvDtype;
  }
  get nThreads(): number {
    return this.settings.threads;
  }
  /** What every range's session is created with (the arenas were planned for it). */
  get sessionOptions(): { maxContext: number; maxBatch: number } {
    return { maxContext: this.maxContext, maxBatch: this.maxBatch };
  }
  get total(): number {
    return COMPONENTS.reduce((t, c) => t + this.components[c], 0);
  }
  /** The ranges, one per instance, in order. */
  get ranges(): Array<[number, number]> {
    return this.instances.map((i) => [...i.range] as [number, number]);
  }
  /** Vision: the decode budget images are checked against (image-decode.ts DecodeLimits.budget). */
  get imageBudget(): ImageBudget | null {
    return imageBudgetOf(this.facts, this.settings);
  }
  /** kvl serve: the body limit and how many bodies the server may hold at once. */
  get requestBodies(): RequestBodies | null {
    return requestBodiesOf(this.settings);
  }
  /** pthread workers all instances start (WebAssembly), 0 on native. */
  get pthreadWorkers(): number {
    return this.backend === "wasm" ? this.instances.length * WasmBackend.pthreadsForEngine(this.nThreads) : 0;
  }

  /** What the expert cache should expect from a trained model's routing, realistic and worst
   * (routing-outlook.ts); null when it holds every extent or the model has no routed experts. */
  get routingOutlook(): RoutingOutlook | null {
    const m = modelOf(this.facts);
    const picks = m.moe.filter(Boolean).length * m.topK;
    return routingOutlook(this.expertExtentsCached, this.facts.expertRecords, picks, m.extent);
  }

  /** Whole extents the expert caches of all ranges hold while no image is in flight (their own
   * and the image lines' loan: what decoding text reads through). */
  get expertExtentsCached(): number {
    return this.instances.reduce((n, i) => n + (i.expertExtent ? (i.expertCache + i.expertLoan) / i.expertExtent : 0), 0);
  }

  /** Of those, the extents the image lines lend (native with vision; 0 otherwise): the caches
   * give them back while an image is decoded or encoded. */
  get expertExtentsLent(): number {
    return this.instances.reduce((n, i) => n + (i.expertExtent ? i.expertLoan / i.expertExtent : 0), 0);
  }

  /** The outlook as the load line and the plan's table say it, or null. */
  get routingOutlookText(): string | null {
    const o = this.routingOutlook;
    return o ? outlookText(o, this.facts.expertDtype === DTYPE_Q4_EXPERT, this.textOnlyExtentsCached) : null;
  }

  describe(): string {
    const rows: Array<[string, string, string]> = [["component", "MiB", ""]];
    const expertSlots = this.expertExtentsCached;
    for (const c of COMPONENTS) {
      if (c === "requests" && !this.requestBodies) continue; // not a server
      let note = "";
      if (c === "node") {
        note = this.backend === "wasm"
          ? `${this.instances.length} instance${this.instances.length === 1 ? "" : "s"}, ${this.pthreadWorkers} pthread workers`
          : "native addon";
      } else if (c === "kv") {
        note = `${this.maxContext} tokens, ${this.kvDtype}`;
      } else if (c === "trunkCache") {
        note = `${this.trunkAuto ? "auto, " : ""}${((100 * this.components.trunkCache) / Math.max(this.trunkCacheable, 1)).toFixed(0)}% of ${mib(this.trunkCacheable)} MiB`;
      } else if (c === "expertCache" && expertSlots) {
        const lent = this.expertExtentsLent;
        note = `${this.settings.cacheAuto ? "auto, " : ""}${expertSlots - lent} extents` +
          (lent ? `; +${lent} (${mib(this.instances.reduce((t, i) => t + i.expertLoan, 0))} MiB) lent by the image lines while no image is in flight` : "");
      } else if (c === "tokenizer") {
        note = "tiktoken";
      } else if (c === "vision" && this.visionGrid) {
        note = `${this.visionGrid[0]}x${this.visionGrid[1]} patches`;
      } else if (c === "imageDecode" && this.imageBudget) {
        note = imageDecodeNote(this.imageBudget);
      } else if (c === "requests" && this.requestBodies) {
        note = requestBodiesNote(this.requestBodies);
      } else if (c === "scratch" && this.components.scratch) {
        note = `one ${Math.min(this.maxBatch, this.maxContext)}-token chunk`;
      }
      if (this.exact.has(c)) note = (note ? `${note}, ` : "") + "engine-reported";
      const label = c === "runtime" && this.backend === "native" ? "engine bookkeeping (store indexes, allocator)" : LABELS[c];
      rows.push([label, mib(this.components[c]), note]);
    }
    rows.push(["total", mib(this.total), `budget ${mib(this.ramBytes)} MiB${this.settings.ramChosenBy === "auto" ? " (--ram-mib auto)" : ""}`]);
    const width = Math.max(...rows.map((r) => r[0].length));
    const lines = rows.map((r) => `${r[0].padEnd(width)}  ${r[1].padStart(10)}  ${r[2]}`.trimEnd());
    const rule = "-".repeat(lines[0]!.length);
    lines.splice(1, 0, rule);
    lines.splice(lines.length - 1, 0, rule);
    if (this.backend === "wasm") {
      lines.push(`WebAssembly instances (one memory each, at most ${mib(this.settings.maxInstanceBytes)} MiB):`);
    } else {
      lines.push(`engines in this process (native)${this.instances.length > 1 ? ", split as forced" : ""}:`);
    }
    for (const i of this.instances) {
      const range = `layers [${i.range[0]}, ${i.range[1]})`;
      lines.push(`  ${String(i.index + 1).padStart(2)}  ${range.padEnd(18)} ${mib(i.memoryBytes).padStart(10)} MiB`);
    }
    const outlook = this.routingOutlookText;
    if (outlook) lines.push(`${outlook[0]!.toUpperCase()}${outlook.slice(1)}.`);
    return lines.join("\n");
  }

  /** Throws UserError when the plan is over the budget, with advice that fits when followed. */
  checkBudget(): void {
    const over = this.total - this.ramBytes;
    if (over <= 0) return;
    const hints = adviceFor(build, this.facts, this.settings);
    if (this.settings.ramChosenBy === "auto") {
      // the smallest plan that works does not fit what the machine has free: say so, with what to do
      throw new UserError(`the RAM plan needs ${mib(this.total)} MiB, but this machine can give kvl only ${mib(this.ramBytes)} MiB now ` +
        `(${this.settings.ramDetail}); close other programs to free ${mib(over)} MiB, ` +
        `${hints.map((h) => h.replace(/^raise --ram-mib to (\d+)/, "or pass --ram-mib $1 if that much will be free when kvl runs")).join(" or ")}\n${this.describe()}`);
    }
    throw new UserError(`the RAM plan needs ${mib(this.total)} MiB, ${mib(over)} MiB over --ram-mib ${mib(this.ramBytes)}; ` +
      `${hints.join(" or ")}\n${this.describe()}`);
  }

  /**
   * Adopts the engines' exact figures (one entry per range, in order: its info and its
   * sessionBytes for this plan's maxContext / maxBatch; visionBytes: kvl_vision_bytes of the
   * largest grid on the first range, when vision is loaded). Returns what differed. On
   * WebAssembly an instance's memory was fixed at creation: a difference moves bytes between the
   * engine's components and the instance's unplanned rest (its padding), and an instance whose
   * engine needs more than its memory holds is a UserError. Throws UserError when the exact plan
   * no longer fits the budget.
   */
  reconcile(engines: ReadonlyArray<{ info: EngineInfo; sessionBytes: number }>, visionBytes: number | null = null): string[] {
    if (engines.length !== this.instances.length) {
      throw new RangeError(`the plan has ${this.instances.length} ranges, ${engines.length} engines were given`);
    }
    const wasm = this.backend === "wasm";
    const changed: string[] = [];
    const move = (inst: InstancePlan, field: "globals" | "expertCache" | "engineWorkspace" | "trunkCache" | "sessionArena" | "vision",
      value: number, what: string): void => {
      const delta = value - inst[field];
      if (delta === 0) return;
      changed.push(`${what}: planned ${inst[field]}, engine ${value}`);
      inst[field] = value;
      this.components[field] += delta;
      if (wasm) {
        inst.padding -= delta;
        inst.runtime -= delta;
        this.components.runtime -= delta;
      } else {
        inst.memoryBytes += delta;
      }
    };
    engines.forEach(({ info, sessionBytes }, k) => {
      const inst = this.instances[k]!;
      if (info.layerBegin !== inst.range[0] || info.layerEnd !== inst.range[1]) {
        throw new RangeError(`engine ${k} runs layers [${info.layerBegin}, ${info.layerEnd}), the plan's range is [${inst.range[0]}, ${inst.range[1]})`);
      }
      move(inst, "globals", info.globalBytes, `instance ${k + 1} globals`);
      // the engine's slab holds the loan too, counted in the image lines
      move(inst, "expertCache", info.expertCacheBytes - inst.expertLoan, `instance ${k + 1} expertCache`);
      move(inst, "engineWorkspace", info.engineWorkspaceBytes, `instance ${k + 1} engineWorkspace`);
      move(inst, "trunkCache", info.trunkCacheBytes, `instance ${k + 1} trunkCache`);
      if (sessionBytes < inst.kv) changed.push(`instance ${k + 1} session: engine reports ${sessionBytes} bytes < KV ${inst.kv}`);
      move(inst, "sessionArena", Math.max(sessionBytes - inst.kv, 0), `instance ${k + 1} sessionArena`);
    });
    for (const c of ["globals", "expertCache", "engineWorkspace", "trunkCache", "sessionArena"]) this.exact.add(c);
    if (visionBytes !== null && this.settings.loadVision) {
      // in the first instance on WebAssembly: the call's page-aligned working memory and the
      // pixels and embeddings copied in; the host's own copies (visionHost) stay as planned
      const first = this.instances[0]!;
      move(first, "vision", visionInInstanceBytes(this.backend, visionBytes, this.visionHost), "vision");
      this.exact.add("vision");
    }
    for (const inst of this.instances) {
      if (wasm && inst.padding < 0) {
        throw new UserError(`instance ${inst.index + 1} (layers [${inst.range[0]}, ${inst.range[1]})) needs ${mib(inst.memoryBytes - inst.padding)} MiB ` +
          `by its engine's figures, more than its ${mib(inst.memoryBytes)} MiB memory; this is a planner bug, please report it\n${this.describe()}`);
      }
    }
    this.checkBudget();
    return changed;
  }
}


/** Expert slots per range: at least top-k on ranges with MoE layers, the rest one at a time to
 * the range with the most MoE layers per slot it holds (never more than its extents). */
function expertSlots(m: Model, ranges: ReadonlyArray<[number, number]>, cacheBytes: number, cacheMib: number): number[] {
  const moeLayers = ranges.map(([b, e]) => m.moe.slice(b, e).filter(Boolean).length);
  const caps = moeLayers.map((n) => n * m.nRouted);
  if (m.extent === 0) return ranges.map(() => 0);
  const total = Math.min(Math.floor(cacheBytes / m.extent), caps.reduce((a, b) => a + b, 0));
  const moeRanges = moeLayers.filter((n) => n > 0).length;
  if (total < m.topK * moeRanges) {
    const need = Math.ceil((m.topK * moeRanges * m.extent) / MIB);
    throw new ExpertFloorError(`--cache-mib ${cacheMib} holds ${total} expert extents; one layer needs ${m.topK}` +
      `${moeRanges > 1 ? ` in each of the ${moeRanges} instances with MoE layers` : ""} (${need} MiB): raise --cache-mib to at least ${need}`);
  }
  const slots = moeLayers.map((n) => (n > 0 ? m.topK : 0));
  let left = total - m.topK * moeRanges;
  if (ranges.length === 1) {
    slots[0]! += left;
    return slots;
  }
  for (; left > 0; left--) {
    // D'Hondt: the range with the largest moeLayers / (slots + 1) that has room; earlier on ties
    let pick = -1;
    for (let i = 0; i < slots.length; i++) {
      if (slots[i]! >= caps[i]!) continue;
      if (pick < 0 || moeLayers[i]! * (slots[pick]! + 1) > moeLayers[pick]! * (slots[i]! + 1)) pick = i;
    }
    slots[pick]! += 1; // total <= the sum of caps, so some range has room
  }
  return slots;
}

/**
 * The extents each range's expert cache borrows from the image lines (natively, with vision):
 * the vision call's working memory and host copies and the largest image's decode are in use
 * only while an image is decoded or encoded, and a WebAssembly memory cannot give pages back, so
 * only native lends. The loan is what the same ranges would hold with those bytes added to the
 * cache budget (expertSlots' rule), less what they hold without them: whole extents, never more
 * than the image lines' bytes.
 */
function expertLoans(m: Model, ranges: ReadonlyArray<[number, number]>, slots: readonly number[], cacheBytes: number,
  s: PlanSettings, imageDecodeBytes: number, visionBytes: number): number[] {
  if (s.backend !== "native" || !s.loadVision || m.extent === 0) return ranges.map(() => 0);
  const lent = expertSlots(m, ranges, cacheBytes + imageDecodeBytes + visionBytes, s.cacheMib);
  return lent.map((n, i) => n - slots[i]!);
}

function evaluate(facts: PackFacts, s: PlanSettings, m: Model, ranges: ReadonlyArray<[number, number]>, slots: number[], loans: number[],
  layouts: ReadonlyArray<{ total: number; kv: number }>, prefix: number, visionInInstance: number, visionHost: number, mediaCache: number): Evaluated {
  const wasm = s.backend === "wasm";
  const B = Math.min(s.maxBatch, s.maxContext);
  const H = m.hidden;
  const V = m.vocab;
  const instances: InstancePlan[] = ranges.map(([begin, end], index) => {
    const bytes = rangeBytes(facts, m, {
      backend: s.backend, range: [begin, end], prefix, expertSlots: slots[index]!, layout: layouts[index]!, threads: s.threads,
      actDtype: s.actDtype, loadVision: s.loadVision, maxBatch: s.maxBatch, maxContext: s.maxContext, vision: index === 0 ? visionInInstance : 0,
    });
    const engineOptions: RangeEngineOptions = {
      layerBegin: begin, layerEnd: end, trunkCacheBytes: bytes.trunkCache > 0 ? bytes.trunkCache : -1, loadVision: index === 0 && s.loadVision,
      nThreads: s.threads, kvDtype: s.kvDtype, actDtype: s.actDtype,
      ...(bytes.expertCache > 0 ? { expertCacheBytes: bytes.expertCache + loans[index]! * bytes.expertExtent } : {}),
    };
    return { index, range: [begin, end], engineOptions, ...bytes, expertLoan: bytes.expertCache > 0 ? loans[index]! * bytes.expertExtent : 0 };
  });
  const sum = (f: (i: InstancePlan) => number): number => instances.reduce((t, i) => t + f(i), 0);
  const n = instances.length;
  const node = wasm
    ? NODE_WASM_BYTES + (n - 1) * INSTANCE_JS_BYTES + (n * WasmBackend.pthreadsForEngine(s.threads) - 1) * PTHREAD_WORKER_BYTES
    : NODE_NATIVE_BYTES;
  // JS: a step's logits, the copy the sampler masks, its workspace; hidden states between ranges
  const logits = 3 * 4 * V + (n > 1 ? 2 * B * H * 4 : 0);
  const components: Record<Component, number> = {
    node, tokenizer: TOKENIZER_BYTES_PER_FILE_BYTE * facts.tokenizerFileBytes,
    globals: sum((i) => i.globals), trunkCache: sum((i) => i.trunkCache), expertCache: sum((i) => i.expertCache), kv: sum((i) => i.kv),
    sessionArena: sum((i) => i.sessionArena), engineWorkspace: sum((i) => i.engineWorkspace), runtime: sum((i) => i.runtime),
    scratch: sum((i) => i.scratch), vision: sum((i) => i.vision) + visionHost, mediaCache, logits, margin: MARGIN_BYTES,
    imageDecode: imageBudgetOf(facts, s)?.bytes ?? 0, requests: requestBodiesOf(s)?.bytes ?? 0,
  };
  const total = COMPONENTS.reduce((t, c) => t + components[c], 0);
  return { instances, components, total, largest: Math.max(...instances.map((i) => i.memoryBytes)), prefix };
}

function build(facts: PackFacts, s: PlanSettings): RamPlan {
  const m = modelOf(facts);
  const cacheBytes = Math.floor(s.cacheMib * MIB);
  // vision: the largest image's working memory, in the first range's instance on WebAssembly,
  // plus the pixels and one image's embeddings the host holds around the call (copied into the
  // instance too on WebAssembly; the addon reads the host's arrays); images' embeddings, one
  // context's rows: the bytes of chat-model.ts's cache by content (image/embedding-cache.ts),
  // which holds every image a prompt shows and, in the rest, images shown before
  let visionInInstance = 0;
  let visionHost = 0;
  let grid: [number, number] | null = null;
  let mediaCache = 0;
  if (s.loadVision) {
    const vision = visionBytes(facts, s.backend, s.threads);
    ({ grid, host: visionHost, inInstance: visionInInstance } = vision);
    mediaCache = 4 * s.maxContext * m.hidden;
  }
  const ramBytes = Math.floor(s.ramMib * MIB);
  const order = m.order;
  const cumulative = [0];
  for (const t of order) cumulative.push(cumulative.at(-1)! + slotOf(t, s.actDtype));
  const cacheable = cumulative.at(-1)!;
  let explicitPrefix = -1;
  if (s.trunkCacheMib !== null) {
    const budget = Math.floor(s.trunkCacheMib * MIB);
    explicitPrefix = 0;
    while (explicitPrefix < order.length && cumulative[explicitPrefix + 1]! <= budget) explicitPrefix++;
  }
  const wasm = s.backend === "wasm";
  const lastN = wasm ? m.nLayers : s.instances;
  let smallest: Evaluated | undefined;
  // WebAssembly: the fewest instances that hold a plan, unless more instances keep more of the
  // trunk resident within the budget (instances full of expert cache would otherwise stream the
  // trunk on every token): the longest resident prefix wins, then the fewest instances.
  let best: Evaluated | undefined;
  for (let n = s.instances; n <= lastN; n++) {
    const ranges = layerRanges(m.nLayers, n);
    const slots = expertSlots(m, ranges, cacheBytes, s.cacheMib);
    const loans = expertLoans(m, ranges, slots, cacheBytes, s, imageBudgetOf(facts, s)?.bytes ?? 0, visionInInstance + visionHost);
    const layouts = ranges.map((r) => sessionLayoutBytes(m, r, s.maxContext, s.maxBatch, s.kvDtype, s.threads, s.actDtype));
    const candidates = explicitPrefix >= 0 ? [explicitPrefix] : Array.from({ length: order.length + 1 }, (_, i) => i);
    let chosen: Evaluated | undefined;
    let cheapest: Evaluated | undefined;
    for (const prefix of candidates) {
      const e = evaluate(facts, s, m, ranges, slots, loans, layouts, prefix, visionInInstance, visionHost, mediaCache);
      if (!smallest || e.largest < smallest.largest) smallest = e;
      if (wasm && e.largest > s.maxInstanceBytes) continue;
      if (!cheapest || e.total < cheapest.total) cheapest = e;
      // auto: the longest prefix that fits the budget (candidates ascend)
      if (e.total <= ramBytes) chosen = e;
    }
    const pick = chosen ?? cheapest;
    if (!pick) continue; // no split into n instances holds it: try more
    if (best && !(chosen && chosen.prefix > best.prefix)) break; // one more instance gains nothing
    best = pick;
    if (!wasm || explicitPrefix >= 0 || !chosen || pick.prefix === order.length) break;
  }
  if (best) return new RamPlan(facts, s, best.components, best.instances, cacheable, s.trunkCacheMib === null, visionHost, grid);
  throw new InstanceLimitError(smallest!.largest, s.maxInstanceBytes, lastN);
}

/** Plans a run of a pack already read (no I/O); refuses (UserError) a plan over the budget when check is set. */
export function planFromFacts(facts: PackFacts, options: PlanOptions): RamPlan {
  let s = resolveAutoLimits(build, facts, settingsOf(facts, options));
  if (s.ramChosenBy === "auto") s = capAutoBudget(facts, s);
  let result: RamPlan;
  try {
    result = build(facts, s);
  } catch (err) {
    if (err instanceof InstanceLimitError) {
      const hints = adviceFor(build, facts, s);
      throw new UserError(hints.length ? `${err.message}; ${hints.join(" or ")}` : err.message);
    }
    throw err;
  }
  if (options.check ?? true) result.checkBudget();
  if (s.loadVision && result.routingOutlook) result.textOnlyExtentsCached = textOnlyExtents(facts, options);
  return result;
}

/** The extents the same options would cache without vision, or null when that plan fails. */
function textOnlyExtents(facts: PackFacts, options: PlanOptions): number | null {
  try {
    return planFromFacts(facts, { ...options, loadVision: false, check: false }).expertExtentsCached;
  } catch {
    return null;
  }
}

/** --ram-mib auto never claims more than the model can use: the budget becomes the plan's total
 * when everything the plan can hold (trunk, experts) is resident within less than the machine
 * gives. A budget the plan does not fit stays as it is (checkBudget says so). */
function capAutoBudget(facts: PackFacts, s: PlanSettings): PlanSettings {
  let planned: RamPlan;
  try {
    planned = build(facts, s);
  } catch {
    return s;
  }
  const needed = Math.ceil(planned.total / MIB);
  if (needed >= s.ramMib) return s;
  const capped = { ...s, ramMib: needed, ramDetail: `${s.ramDetail}; capped at ${needed} MiB, all the model can use` };
  // the auto caches were sized from the larger budget: they already hold all there is
  return capped;
}

/** Plans a run of the pack in packDir (read with pack-format.ts); see planFromFacts. */
export async function plan(packDir: string, options: PlanOptions): Promise<RamPlan> {
  return planFromFacts(await readPackFacts(packDir), options);
}
