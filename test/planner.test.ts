/**
 * The RAM planner (host/plan/planner.ts) on the tiny synthesized pack, packed by `kvl pack`:
 *   - the mirror of the core's byte rules is exact: for 1, 2 and 3 layer ranges, on both
 *     backends, with the trunk all resident, all streamed and partly streamed and a partial
 *     expert cache, each range's engine reports exactly the planned global, trunk, expert and
 *     workspace bytes and session size; reconcile() then finds nothing to change;
 *   - the same on a pack with a Q8 trunk (--trunk-dtype q8: Q8_ROWS records resident as packed
 *     with every activation mode) and on one with Q4 experts (--expert-dtype q4: the expert
 *     cache's slots are the Q4 extents' pages);
 *   - the planned WebAssembly memories are enough: every instance is created with exactly its
 *     planned memory and runs a full prefill chunk, a sample and a step (and the memory left is
 *     small: the plan is not padded by more than its stated allowances);
 *   - a plan over --ram-mib is refused with advice whose every figure, applied alone, gives a
 *     plan that fits (several budgets, both backends, auto and explicit trunk cache), and the
 *     raise figure is the smallest that fits;
 *   - the instance split: a forced instance limit makes the tiny model need 2 or 3 instances,
 *     the fewest whose memories fit, each within the limit; a limit nothing fits is refused;
 *   - bad inputs are UserErrors.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend, CoreEngine } from "../host/core/core-api.js";
import { openHostedEngine } from "../host/engine/engine-host.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { MIB, type PackFacts, WASM_MIN_INSTANCE_BYTES, largestGrid, readPackFacts, trunkTensorBytes, visionBytes } from "../host/plan/core-bytes.js";
import { NODE_NATIVE_BYTES, NODE_WASM_BYTES, PTHREAD_WORKER_BYTES, type RamPlan, planFromFacts } from "../host/plan/planner.js";
import type { PlanOptions } from "../host/plan/settings.js";
import type { SplitEngine } from "../host/engine/split-engine.js";
import { UserError } from "../host/system/user-error.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { type WasmEngine, freeHeapBytes } from "../host/core/wasm-engine.js";
import { packCheckpoint } from "../packer/pack.js";
import { tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

type BackendName = "wasm" | "native";
const BACKENDS: BackendName[] = ["wasm", "native"];
const THREADS = 2;

let tmp: { dir: string; cleanup: () => void };
let native: NativeBackend;
let pack: string;
let facts: PackFacts;
/** The same checkpoint packed with --trunk-dtype q8 (Q8_ROWS trunk Linear weights). */
let q8Pack: string;
let q8Facts: PackFacts;
/** The same checkpoint packed with --expert-dtype q4 (Q4_EXPERT extents). */
let q4Pack: string;
let q4Facts: PackFacts;

beforeAll(async () => {
  tmp = tempDir("planner");
  native = new NativeBackend();
  const ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), native, 0);
  pack = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core: native, allowRevision: true });
  facts = await readPackFacts(pack);
  q8Pack = await packCheckpoint(ckpt, join(tmp.dir, "pack-q8"), { core: native, allowRevision: true, trunkDtype: "q8" });
  q8Facts = await readPackFacts(q8Pack);
  q4Pack = await packCheckpoint(ckpt, join(tmp.dir, "pack-q4"), { core: native, allowRevision: true, expertDtype: "q4" });
  q4Facts = await readPackFacts(q4Pack);
}, 300_000);

afterAll(() => {
  native?.close();
  tmp?.cleanup();
});

function planOf(options: PlanOptions): RamPlan {
  return planFromFacts(facts, { threads: THREADS, instances: 1, ...options });
}

/** The UserError a plan refusal throws (fails the test when none is thrown). */
function refusal(options: PlanOptions): string {
  try {
    planOf(options);
  } catch (err) {
    expect(err).toBeInstanceOf(UserError);
    return (err as Error).message;
  }
  throw new Error(`expected a refusal for ${JSON.stringify(options)}`);
}

/** Opens the plan as the host does (engine-host.ts): WebAssembly instances get exactly their planned memory. */
async function openPlanned(backend: BackendName, p: RamPlan, dir = pack): Promise<{ parts: readonly CoreEngine[]; engine: SplitEngine; sampler: CoreBackend; close: () => void }> {
  const hosted = await openHostedEngine(backend, dir, { nThreads: p.nThreads, planned: p.instances });
  return { parts: hosted.engine.parts, engine: hosted.engine, sampler: hosted.sampler, close: () => hosted.close() };
}

describe.each(BACKENDS)("the plan on %s", (backend) => {
  describe.each([1, 2, 3])("over %i instance(s)", (instances) => {
    it.each([
      { trunk: "auto", kvDtype: "f32", actDtype: "f32" }, { trunk: "stream", kvDtype: "f32", actDtype: "f32" },
      { trunk: "part", kvDtype: "f32", actDtype: "f32" }, { trunk: "part", kvDtype: "bf16", actDtype: "f32" },
      // the integer modes: int16 trunk rows with their scales, the quantised-input workspace, the int16 KV cache
      { trunk: "auto", kvDtype: "i16", actDtype: "i16x1" }, { trunk: "part", kvDtype: "i16", actDtype: "i16x1" },
      { trunk: "part", kvDtype: "i16", actDtype: "i8" },
    ] as const)("equals what each range's engine reports (trunk $trunk, KV $kvDtype, Linear inputs $actDtype)", async ({ trunk, kvDtype, actDtype }) => {
      const order = trunkTensorBytes(facts, actDtype);
      const all = order.reduce((a, b) => a + b, 0);
      // "part": a budget between tensor boundaries, past the middle of the forward order, so a
      // range keeps a prefix of its own tensors and streams the rest
      const part = order.slice(0, Math.ceil(order.length / 2) + 1).reduce((a, b) => a + b, 0) + 4095;
      const trunkCacheMib = trunk === "auto" ? null : trunk === "stream" ? 0 : part / MIB;
      // 0.1 MiB holds 12 of the 24 extents: every range with MoE layers gets a share, none all
      const options: PlanOptions = { backend, instances, ramMib: 4096, cacheMib: 0.1, trunkCacheMib, maxContext: 200, maxBatch: 48, loadVision: false, kvDtype, actDtype };
      const p = planOf(options);
      expect(p.instances.length).toBe(instances);
      expect(p.trunkCacheable).toBe(all);
      const resident = p.components.trunkCache;
      if (trunk === "auto") expect(resident).toBe(all); // the tiny trunk fits entirely
      if (trunk === "stream") expect(resident).toBe(0);
      if (trunk === "part") {
        expect(resident).toBeGreaterThan(0);
        expect(resident).toBeLessThan(all);
        expect(p.instances.some((i) => i.trunkCache > 0 && i.trunkCache < i.trunkCacheable)).toBe(true);
      }
      if (trunk !== "auto") expect(p.components.engineWorkspace).toBeGreaterThan(0);
      expect(p.components.expertCache).toBe(12 * p.instances.find((i) => i.expertExtent > 0)!.expertExtent);

      const opened = await openPlanned(backend, p);
      try {
        const reported = opened.parts.map((e, k) => {
          const inst = p.instances[k]!;
          const checked = engineMatchesPlan(e, inst);
          expect([checked.info.layerBegin, checked.info.layerEnd]).toEqual(inst.range);
          expect(checked.info.kvDtype).toBe(kvDtype);
          expect(checked.info.actDtype).toBe(actDtype);
          return checked;
        });
        // other session shapes (the batch clamped to the context, one token, a wide batch)
        for (const [maxContext, maxBatch] of [[64, 256], [1, 1], [300, 300], [4096, 7]] as const) {
          const q = planOf({ ...options, maxContext, maxBatch });
          opened.parts.forEach((e, k) => {
            const inst = q.instances[k]!;
            expect(e.sessionBytes({ maxContext, maxBatch })).toBe(inst.kv + inst.sessionArena);
          });
        }
        expect(p.reconcile(reported)).toEqual([]);
        expect(p.exact.has("globals") && p.exact.has("sessionArena")).toBe(true);
        expect(p.describe()).toContain("engine-reported");
      } finally {
        opened.close();
      }
    });
  });
});

describe.each(BACKENDS)("the plan of a Q8-trunk pack (kvl pack --trunk-dtype q8) on %s", (backend) => {
  it.each([
    { instances: 1, trunk: "auto", actDtype: "f32" }, { instances: 2, trunk: "part", actDtype: "f32" },
    { instances: 1, trunk: "auto", actDtype: "i16x1" }, { instances: 2, trunk: "part", actDtype: "i16x1" },
    { instances: 1, trunk: "auto", actDtype: "bf16" }, { instances: 2, trunk: "auto", actDtype: "i16x1" },
    { instances: 2, trunk: "part", actDtype: "i8" },
  ] as const)("equals what each range's engine reports ($instances instance(s), trunk $trunk, Linear inputs $actDtype)", async ({ instances, trunk, actDtype }) => {
    const order = trunkTensorBytes(q8Facts, actDtype);
    const all = order.reduce((a, b) => a + b, 0);
    // Q8 records stay as packed with every activation mode (no int16 conversion), so the
    // cacheable trunk is the pages of its records, well under the BF16 pack's
    expect(all).toBe(trunkTensorBytes(q8Facts, "f32").reduce((a, b) => a + b, 0));
    expect(all).toBeLessThan(trunkTensorBytes(facts, "f32").reduce((a, b) => a + b, 0));
    const part = order.slice(0, Math.ceil(order.length / 2) + 1).reduce((a, b) => a + b, 0) + 4095;
    const options: PlanOptions = {
      backend, instances, ramMib: 4096, cacheMib: 0.1, trunkCacheMib: trunk === "auto" ? null : part / MIB,
      maxContext: 200, maxBatch: 48, loadVision: false, actDtype,
    };
    const p = planFromFacts(q8Facts, { threads: THREADS, ...options });
    expect(p.trunkCacheable).toBe(all);
    if (trunk === "part") expect(p.components.engineWorkspace).toBeGreaterThan(0);
    const opened = await openPlanned(backend, p, q8Pack);
    try {
      const reported = opened.parts.map((e, k) => {
        const checked = engineMatchesPlan(e, p.instances[k]!);
        expect(checked.info.actDtype).toBe(actDtype);
        return checked;
      });
      expect(p.reconcile(reported)).toEqual([]);
    } finally {
      opened.close();
    }
  });
});

describe.each(BACKENDS)("the plan of a Q4-experts pack (kvl pack --expert-dtype q4) on %s", (backend) => {
  it.each([
    { instances: 1, trunk: "auto", actDtype: "f32" }, { instances: 2, trunk: "part", actDtype: "i16x1" },
    { instances: 3, trunk: "auto", actDtype: "i8" }, { instances: 2, trunk: "auto", actDtype: "bf16" },
  ] as const)("equals what each range's engine reports ($instances instance(s), trunk $trunk, Linear inputs $actDtype)", async ({ instances, trunk, actDtype }) => {
    const order = trunkTensorBytes(q4Facts, actDtype);
    const part = order.slice(0, Math.ceil(order.length / 2) + 1).reduce((a, b) => a + b, 0) + 4095;
    // the extents as packed: the Q4 record's pages, fewer than the Q8 pack's
    const extent = Math.ceil(q4Facts.expertNbytes / 4096) * 4096;
    expect(extent).toBeLessThan(Math.ceil(facts.expertNbytes / 4096) * 4096);
    // a cache of 12 Q4 extents: every range with MoE layers gets a share, none all 24
    const options: PlanOptions = {
      backend, instances, ramMib: 4096, cacheMib: (12 * extent) / MIB, trunkCacheMib: trunk === "auto" ? null : part / MIB,
      maxContext: 200, maxBatch: 48, loadVision: false, actDtype,
    };
    const p = planFromFacts(q4Facts, { threads: THREADS, ...options });
    expect(p.components.expertCache).toBe(12 * extent);
    expect(p.instances.filter((i) => i.expertExtent > 0).every((i) => i.expertExtent === extent)).toBe(true);
    const opened = await openPlanned(backend, p, q4Pack);
    try {
      const reported = opened.parts.map((e, k) => {
        const checked = engineMatchesPlan(e, p.instances[k]!);
        expect(checked.info.actDtype).toBe(actDtype);
        return checked;
      });
      expect(p.reconcile(reported)).toEqual([]);
    } finally {
      opened.close();
    }
  });
});

/** One range's engine against its instance in the plan: every figure the engine reports equals
 * the plan's, and a 200-token session is the plan's KV + arena. What reconcile() then takes. */
function engineMatchesPlan(e: CoreEngine, inst: RamPlan["instances"][number]): { info: ReturnType<CoreEngine["info"]>; sessionBytes: number } {
  const info = e.info();
  expect({
    globals: info.globalBytes, trunkCache: info.trunkCacheBytes, expertCache: info.expertCacheBytes,
    engineWorkspace: info.engineWorkspaceBytes, expertExtent: info.expertExtentBytes,
  }).toEqual({
    // the slab holds the image lines' loan too (native with vision)
    globals: inst.globals, trunkCache: inst.trunkCache, expertCache: inst.expertCache + inst.expertLoan,
    engineWorkspace: inst.engineWorkspace, expertExtent: inst.expertExtent,
  });
  const sessionBytes = e.sessionBytes({ maxContext: 200, maxBatch: 48 });
  expect(sessionBytes).toBe(inst.kv + inst.sessionArena);
  return { info, sessionBytes };
}

describe("reconcile", () => {
  const base: PlanOptions = { ramMib: 4096, cacheMib: 1, maxContext: 200, maxBatch: 48, loadVision: false, backend: "native" };

  it.each(BACKENDS)("adopts what the engines report where it differs from the plan (%s)", async (backend) => {
    // planned to stream the trunk; the engines were opened keeping it all resident
    const planned = planOf({ ...base, backend, trunkCacheMib: 0 });
    const actual = planOf({ ...base, backend, trunkCacheMib: null });
    const memories = planned.instances.map((i) => i.memoryBytes);
    const total = planned.total;
    const opened = await openPlanned(backend, actual);
    try {
      const reported = opened.parts.map((e) => ({ info: e.info(), sessionBytes: e.sessionBytes(planned.sessionOptions) }));
      const changed = planned.reconcile(reported);
      expect(changed.map((c) => c.split(":")[0])).toEqual(["instance 1 engineWorkspace", "instance 1 trunkCache"]);
      expect(planned.components.trunkCache).toBe(actual.components.trunkCache);
      expect(planned.components.engineWorkspace).toBe(0);
      expect(planned.describe()).toContain("engine-reported");
      if (backend === "wasm") {
        // the instance's memory was fixed at creation: its unplanned rest took the difference
        expect(planned.instances.map((i) => i.memoryBytes)).toEqual(memories);
        expect(planned.total).toBe(total);
      } else {
        // the resident trunk came in, the streaming buffers went
        const workspace = planOf({ ...base, backend, trunkCacheMib: 0 }).components.engineWorkspace;
        expect(planned.total - total).toBe(actual.components.trunkCache - workspace);
      }
    } finally {
      opened.close();
    }
  });

  it("refuses when the engines' exact figures no longer fit the budget", async () => {
    const streamed = planOf({ ...base, trunkCacheMib: 0 });
    const tight = planOf({ ...base, trunkCacheMib: 0, ramMib: streamed.total / MIB }); // fits to the byte
    const opened = await openPlanned("native", planOf({ ...base, trunkCacheMib: null }));
    try {
      const reported = opened.parts.map((e) => ({ info: e.info(), sessionBytes: e.sessionBytes(tight.sessionOptions) }));
      expect(() => tight.reconcile(reported)).toThrow(/MiB over --ram-mib/);
    } finally {
      opened.close();
    }
  });
});

describe("the planned WebAssembly memories", () => {
  it.each([1, 3])("hold %i instance(s) through a full prefill chunk, a sample and a step", async (instances) => {
    // a context and chunk large enough that instances are planned above the module's 64 MiB
    // minimum: the figures themselves are what is tested, not the floor
    const maxContext = 6144;
    const p = planOf({ backend: "wasm", instances, threads: 4, ramMib: 8192, cacheMib: 1, maxContext, maxBatch: maxContext, loadVision: false });
    expect(p.instances.some((i) => i.memoryBytes > WASM_MIN_INSTANCE_BYTES)).toBe(true);
    const opened = await openPlanned("wasm", p);
    try {
      const engine = opened.engine;
      const session = engine.newSession({ maxContext, maxBatch: maxContext });
      try {
        const prompt = Int32Array.from({ length: maxContext - 1 }, (_, i) => 100 + ((i * 7919) % 100_000));
        const logits = session.prefill(prompt, null, "last")!;
        const sampler = opened.sampler;
        const token = sampler.sampleToken(logits, { temperature: 0.8, topK: 0, topP: 0.9 }, sampler.seedSampler(7n));
        expect(session.step(token).length).toBe(engine.info().vocabSize);
        expect(session.position()).toBe(maxContext);
        // what is left free in each instance with its session open: no more than its padding
        // and the stated allowances (2 MiB alignment per large block, the calls' buffers,
        // allocator slack, indexes)
        opened.parts.forEach((e, k) => {
          const inst = p.instances[k]!;
          expect(freeHeapBytes((e as WasmEngine).core)).toBeLessThan(inst.padding + 10 * MIB);
        });
      } finally {
        session.close();
      }
    } finally {
      opened.close();
    }
  });
});


/** Applies each figure of a refusal's advice alone and returns the plans (each must fit). */
function followAdvice(options: PlanOptions, message: string): Array<{ hint: string; plan: RamPlan }> {
  const advice = message.split("\n")[0]!;
  const followed: Array<{ hint: string; plan: RamPlan }> = [];
  const apply = (hint: string, change: Partial<PlanOptions>): void => {
    followed.push({ hint, plan: planOf({ ...options, ...change }) }); // throws if it does not fit
  };
  for (const [flag, key] of [["--cache-mib", "cacheMib"], ["--trunk-cache-mib", "trunkCacheMib"], ["--max-context", "maxContext"]] as const) {
    const m = new RegExp(`lower ${flag} to (\\d+) \\(by ([\\d.]+)\\)`).exec(advice);
    if (m) {
      const to = Number(m[1]);
      const current = options[key] as number;
      expect(Number(m[2])).toBeCloseTo(current - to, 2);
      apply(m[0], { [key]: to });
    }
  }
  const raise = /raise --ram-mib to (\d+)/.exec(advice);
  if (raise) {
    const to = Number(raise[1]);
    apply(raise[0], { ramMib: to });
    // the smallest figure that fits: one MiB less is refused again
    expect(() => planOf({ ...options, ramMib: to - 1 })).toThrow(UserError);
  }
  if (advice.includes("run without vision")) apply("run without vision", { loadVision: false });
  return followed;
}

describe("refusing a plan over --ram-mib", () => {
  const configs: Array<{ name: string; options: PlanOptions }> = [
    // vision with a fixed image limit: an auto limit would shrink to fit instead of refusing (tested below)
    { name: "wasm, auto trunk, vision", options: { backend: "wasm", cacheMib: 1, maxContext: 8192, imageMaxPixels: 12e6 } },
    { name: "wasm, explicit trunk", options: { backend: "wasm", cacheMib: 1, trunkCacheMib: 0.2, maxContext: 4096, loadVision: false } },
    { name: "native, auto trunk, vision", options: { backend: "native", cacheMib: 1, maxContext: 8192, imageMaxPixels: 12e6 } },
    { name: "native, explicit trunk, bf16 KV", options: { backend: "native", cacheMib: 1, trunkCacheMib: 0.3, maxContext: 8192, kvDtype: "bf16", imageMaxPixels: 12e6 } },
    { name: "wasm over 2 instances", options: { backend: "wasm", instances: 2, cacheMib: 1, maxContext: 8192, imageMaxPixels: 12e6 } },
  ];

  it.each(configs)("gives advice that fits when followed ($name)", ({ options }) => {
    const loose = planOf({ ...options, ramMib: 100_000, check: false });
    const need = loose.total / MIB;
    // the user report: 128 MiB, then the figure it named; plus budgets just under, well under
    for (const ramMib of [128, 200, Math.floor(need) - 1, Math.floor(need / 2)]) {
      if (ramMib >= need) continue;
      const message = refusal({ ...options, ramMib });
      const over = (planOf({ ...options, ramMib, check: false }).total - ramMib * MIB) / MIB;
      expect(message).toContain(`MiB over --ram-mib ${ramMib.toLocaleString("en-US", { minimumFractionDigits: 1 })}`);
      expect(over).toBeGreaterThan(0);
      expect(message).toContain("KV cache"); // the table says where the bytes go
      const followed = followAdvice({ ...options, ramMib }, message);
      expect(followed.some((f) => f.hint.startsWith("raise --ram-mib"))).toBe(true);
      for (const f of followed) expect(f.plan.total).toBeLessThanOrEqual(f.plan.ramBytes);
    }
  });

  it("names a cache, context or vision figure when lowering it alone fits", () => {
    const options: PlanOptions = { backend: "native", cacheMib: 1, trunkCacheMib: 0.3, maxContext: 8192, imageMaxPixels: 12e6 };
    const fitting = planOf({ ...options, ramMib: 100_000, check: false });
    // a budget 2 MiB short: dropping vision or shrinking the context each make it fit
    const ramMib = Math.floor(fitting.total / MIB) - 2;
    const message = refusal({ ...options, ramMib });
    expect(message).toContain("run without vision");
    expect(message).toMatch(/lower --max-context to \d+/);
    const followed = followAdvice({ ...options, ramMib }, message);
    expect(followed.map((f) => f.hint.split(" ")[1])).toEqual(expect.arrayContaining(["--max-context", "--ram-mib", "without"]));
  });

  it("refuses an expert cache below one layer's top-k extents, saying how much", () => {
    expect(refusal({ backend: "native", ramMib: 4096, cacheMib: 0 })).toMatch(/raise --cache-mib to at least \d+/);
    // split over 3 instances, each of the 2 ranges with MoE layers needs its own top-k
    const message = refusal({ backend: "native", ramMib: 4096, cacheMib: 0.02, instances: 3 });
    const need = Number(/at least (\d+)/.exec(message)![1]);
    expect(() => planOf({ backend: "native", ramMib: 4096, cacheMib: need, instances: 3 })).not.toThrow();
  });

  it("counts Node itself, its pthread workers and the tokenizer", () => {
    const wasm = planOf({ backend: "wasm", ramMib: 4096, cacheMib: 1, maxContext: 256, instances: 2 });
    expect(wasm.pthreadWorkers).toBe(2 * WasmBackend.pthreadsForEngine(THREADS));
    expect(wasm.components.node).toBeGreaterThanOrEqual(NODE_WASM_BYTES + (wasm.pthreadWorkers - 1) * PTHREAD_WORKER_BYTES);
    const nat = planOf({ backend: "native", ramMib: 4096, cacheMib: 1, maxContext: 256 });
    expect(nat.components.node).toBe(NODE_NATIVE_BYTES);
    expect(nat.components.tokenizer).toBe(wasm.components.tokenizer);
    expect(nat.components.tokenizer).toBeGreaterThan(20 * facts.tokenizerFileBytes);
    const table = wasm.describe();
    for (const label of ["Node + kvl host (measured)", "tokenizer vocabulary", "KV cache", "trunk cache", "total", "layers [0, 2)", "layers [2, 4)"]) {
      expect(table).toContain(label);
    }
  });
});

describe("vision", () => {
  it("plans the largest image grid preprocessing lets through (kvl/image.py's search)", () => {
    // the official config: a thin image gains the most padding (12 x 446), more than a square
    expect(largestGrid({ patch_size: 14, in_token_limit: 4096, pad_input: true }, [2, 2])).toEqual([12, 446]);
    expect(largestGrid({ patch_size: 14, in_token_limit: 4096, pad_input: false }, [2, 2])).toEqual([10, 448]);
    expect(() => largestGrid({ patch_size: 0, in_token_limit: 4096 }, [2, 2])).toThrow(UserError);
  });

  it.each(BACKENDS)("costs working memory and the conversation's embeddings only when loaded (%s)", (backend) => {
    const on = planOf({ backend, ramMib: 4096, cacheMib: 1, maxContext: 1024 });
    const off = planOf({ backend, ramMib: 4096, cacheMib: 1, maxContext: 1024, loadVision: false });
    expect(on.visionGrid).toEqual([12, 446]);
    expect(on.components.vision).toBeGreaterThan(0);
    expect(on.components.mediaCache).toBe(4 * 1024 * 64);
    expect(off.components.vision + off.components.mediaCache).toBe(0);
    expect(on.instances[0]!.engineOptions.loadVision).toBe(true);
    expect(off.instances[0]!.engineOptions.loadVision).toBe(false);
    expect(on.describe()).toContain("12x446 patches");
  });

  // The vision working memory is planned from the estimate (nothing reconciles it: an image's
  // call allocates when it comes), so the estimate must cover the engine's figure for the largest
  // grid the plan admits, whatever kernel table runs (their tiles differ), without padding it much.
  it.each(BACKENDS)("plans at least the engine's working memory for the largest grid, within 10 %% (%s)", async (backend) => {
    const p = planOf({ backend, ramMib: 4096, cacheMib: 1, maxContext: 256 });
    const planned = visionBytes(facts, backend, p.nThreads);
    const opened = await openPlanned(backend, p);
    try {
      const exact = opened.parts[0]!.visionBytes(Int32Array.from(planned.grid));
      const estimate = backend === "wasm" ? planned.inInstance - planned.host - 4096 : planned.inInstance;
      expect(estimate).toBeGreaterThanOrEqual(exact);
      expect(estimate).toBeLessThanOrEqual(exact * 1.1);
    } finally {
      opened.close();
    }
  }, 120_000);
});

describe("the instance split", () => {
  // 16 threads: every instance holds 2 MiB stacks for 15 pool workers and 4 expert readers, so
  // the tiny model's instances are planned above the module's 64 MiB minimum; a long context
  // makes each layer's KV count
  const base: PlanOptions = { backend: "wasm", threads: 16, ramMib: 65_536, cacheMib: 1, maxContext: 8192, loadVision: false };
  const largestAt = (instances: number): number => Math.max(...planOf({ ...base, instances }).instances.map((i) => i.memoryBytes));

  it.each([2, 3])("takes the fewest instances (%i) whose memories fit a forced limit", (want) => {
    const limit = largestAt(want);
    for (let fewer = 1; fewer < want; fewer++) expect(largestAt(fewer)).toBeGreaterThan(limit);
    const p = planOf({ ...base, maxInstanceBytes: limit });
    expect(p.instances.length).toBe(want);
    expect(p.ranges[0]![0]).toBe(0);
    expect(p.ranges.at(-1)![1]).toBe(4);
    for (const inst of p.instances) {
      expect(inst.memoryBytes).toBeLessThanOrEqual(limit);
      expect(inst.memoryBytes % 65536).toBe(0);
      const parts = inst.globals + inst.trunkCache + inst.expertCache + inst.engineWorkspace + inst.kv + inst.sessionArena + inst.runtime + inst.scratch + inst.vision;
      expect(parts).toBe(inst.memoryBytes);
    }
    // the components add up to the total, instance memories included
    const sumInstances = p.instances.reduce((t, i) => t + i.memoryBytes, 0);
    const c = p.components;
    expect(c.globals + c.trunkCache + c.expertCache + c.engineWorkspace + c.kv + c.sessionArena + c.runtime + c.scratch).toBe(sumInstances);
    expect(p.describe()).toMatch(new RegExp(`layers \\[0, ${p.ranges[0]![1]}\\)`));
  });

  it("splits WebAssembly instances full of expert cache so that the trunk stays resident", () => {
    // (the full-size case this guards: 14000 MiB of expert cache in a 20000 MiB budget, where the
    // fewest instances left 1 GB of trunk streamed per token — bench/RESULTS.md)
    const all: PlanOptions = { ...base, cacheMib: 64 }; // every expert extent of the tiny model
    const resident = planOf({ ...all, trunkCacheMib: 1000 });
    expect(resident.instances.length).toBe(1);
    // a limit one page under that instance: a single instance cannot hold the whole trunk
    const limit = resident.instances[0]!.memoryBytes - 65536;
    const p = planOf({ ...all, maxInstanceBytes: limit });
    expect(p.instances.length).toBeGreaterThan(1);
    expect(p.components.trunkCache).toBe(p.trunkCacheable);
    expect(p.components.expertCache).toBe(resident.components.expertCache);
    for (const inst of p.instances) expect(inst.memoryBytes).toBeLessThanOrEqual(limit);
  });

  it("never splits a native run unless asked", () => {
    const p = planOf({ ...base, backend: "native", maxInstanceBytes: WASM_MIN_INSTANCE_BYTES });
    expect(p.instances.length).toBe(1);
    expect(planOf({ ...base, backend: "native", instances: 3 }).instances.length).toBe(3);
  });

  it("refuses a limit no split can meet, with advice that fits", () => {
    // a whole-context chunk: every range's arena is larger than the limit leaves
    const options: PlanOptions = { ...base, threads: THREADS, maxBatch: 8192, maxInstanceBytes: WASM_MIN_INSTANCE_BYTES };
    const message = refusal(options);
    expect(message).toMatch(/over the 64\.0 MiB an instance can hold/);
    const context = /lower --max-context to (\d+)/.exec(message);
    expect(context).not.toBeNull();
    const p = planOf({ ...options, maxContext: Number(context![1]) });
    for (const inst of p.instances) expect(inst.memoryBytes).toBeLessThanOrEqual(WASM_MIN_INSTANCE_BYTES);
  });
});

describe("the auto expert cache (no --cache-mib)", () => {
  const base = { maxContext: 512, loadVision: false } as const;
  const extentOf = (p: RamPlan): number => p.instances.find((i) => i.expertExtent > 0)!.expertExtent;
  /** Every extent of the model cached, and the trunk resident. */
  const allOf = (backend: BackendName): RamPlan => planOf({ ...base, backend, ramMib: 65_536, cacheMib: 10_000 });
  /** The fewest extents the planner accepts (top-k per range with MoE layers), found by trying. */
  const floorOf = (backend: BackendName, extent: number): number => {
    for (let k = 1; ; k++) {
      try {
        planOf({ ...base, backend, ramMib: 65_536, cacheMib: (k * extent) / MIB });
        return k;
      } catch (err) {
        expect((err as Error).message).toMatch(/raise --cache-mib to at least/);
      }
    }
  };

  it.each(BACKENDS)("holds every extent when the budget allows, and says it is auto (%s)", (backend) => {
    const all = allOf(backend);
    const auto = planOf({ ...base, backend, ramMib: 65_536 });
    expect(auto.components.expertCache).toBe(all.components.expertCache);
    expect(auto.components.trunkCache).toBe(auto.trunkCacheable);
    const extents = all.components.expertCache / extentOf(all);
    expect(auto.describe()).toMatch(new RegExp(`expert cache \\(whole extents\\) +[\\d.,]+ +auto, ${extents} extents`));
    expect(all.describe()).not.toMatch(/auto, \d+ extents/);
  });

  it.each(BACKENDS)("takes what the budget leaves once the trunk is resident, to the extent (%s)", (backend) => {
    const all = allOf(backend);
    const extent = extentOf(all);
    const low = planOf({ ...base, backend, ramMib: 65_536, cacheMib: (floorOf(backend, extent) * extent) / MIB });
    // natively every extent counts; a WebAssembly instance's padding can hold several
    if (backend === "native") expect(all.total - low.total).toBeGreaterThan(3 * extent);
    // budgets between the trunk with the fewest extents and every extent: the trunk stays whole,
    // the cache does not shrink as the budget grows, and one more extent would not fit
    let previous = low.components.expertCache;
    for (const f of [0.3, 0.6, 0.9]) {
      const ramMib = (low.total + f * (all.total - low.total)) / MIB;
      const p = planOf({ ...base, backend, ramMib });
      expect(p.total).toBeLessThanOrEqual(ramMib * MIB);
      expect(p.components.trunkCache).toBe(p.trunkCacheable);
      expect(p.components.expertCache).toBeGreaterThanOrEqual(previous);
      if (backend === "native") expect(p.components.expertCache).toBeGreaterThan(previous);
      previous = p.components.expertCache;
      if (p.components.expertCache === all.components.expertCache) continue;
      const more = planOf({ ...base, backend, ramMib, cacheMib: (p.components.expertCache + extent) / MIB, check: false });
      expect(more.total > ramMib * MIB || more.components.trunkCache < more.trunkCacheable).toBe(true);
    }
  });

  // natively: a WebAssembly instance's smallest memory (64 MiB) holds the tiny model's whole trunk
  // and every extent, so no budget leaves part of its trunk streamed
  it("takes nothing from a trunk that does not fit whole", () => {
    const backend = "native";
    const all = allOf(backend);
    const extent = extentOf(all);
    const fewest = (floorOf(backend, extent) * extent) / MIB;
    const streamed = planOf({ ...base, backend, ramMib: 65_536, cacheMib: fewest, trunkCacheMib: 0 });
    // a budget where the fewest extents leave part of the trunk streamed
    let partial: { ramMib: number; trunk: number } | undefined;
    for (let f = 0.05; f < 1 && !partial; f += 0.05) {
      const ramMib = (streamed.total + f * (all.total - streamed.total)) / MIB;
      const trunk = planOf({ ...base, backend, ramMib, cacheMib: fewest, check: false }).components.trunkCache;
      if (trunk > 0 && trunk < all.trunkCacheable) partial = { ramMib, trunk };
    }
    expect(partial).toBeDefined();
    const p = planOf({ ...base, backend, ramMib: partial!.ramMib });
    expect(p.components.trunkCache).toBe(partial!.trunk);
    expect(p.components.expertCache).toBeGreaterThanOrEqual(fewest * MIB - 1);
    expect(p.total).toBeLessThanOrEqual(partial!.ramMib * MIB);
  });
});

describe("bad inputs", () => {
  const ok: PlanOptions = { backend: "native", ramMib: 4096, cacheMib: 1, maxContext: 256 };
  it.each([
    ["max-context 0", { maxContext: 0 }, /--max-context 0 is outside 1\.\.8192/],
    ["max-context past the model", { maxContext: 8193 }, /max_position_embeddings/],
    ["max-context not whole", { maxContext: 10.5 }, /--max-context/],
    ["ram 0", { ramMib: 0 }, /--ram-mib must be positive/],
    ["ram negative", { ramMib: -5 }, /--ram-mib must be positive/],
    ["ram NaN", { ramMib: Number.NaN }, /--ram-mib must be positive/],
    ["cache negative", { cacheMib: -1 }, /non-negative/],
    ["trunk cache negative", { trunkCacheMib: -1 }, /non-negative/],
    ["threads negative", { threads: -2 }, /--threads/],
    ["instances 0", { instances: 0 }, /--instances/],
    ["instances past the layers", { instances: 5 }, /only 4 decoder layers/],
    ["batch 0", { maxBatch: 0 }, /max batch/],
    ["kv dtype", { kvDtype: "f16" as never }, /kv dtype 'f16' unknown/],
    ["an i16 KV cache without act dtype i16x1 or i8", { kvDtype: "i16" as const }, /kv dtype i16 does not go with act dtype f32: act dtypes i16x1 and i8 keep/],
    ["act dtype i16x1 with an f32 KV cache", { kvDtype: "f32" as const, actDtype: "i16x1" as const }, /kv dtype f32 does not go with act dtype i16x1/],
    ["act dtype i8 with a bf16 KV cache", { kvDtype: "bf16" as const, actDtype: "i8" as const }, /kv dtype bf16 does not go with act dtype i8/],
    ["act dtype", { actDtype: "i4" as never }, /act dtype 'i4' unknown/],
    ["the removed act dtype i16", { actDtype: "i16" as never }, /^act dtype 'i16' unknown; use one of f32, bf16, i16x1, i8$/],
    ["instance limit below the module's minimum", { backend: "wasm" as const, maxInstanceBytes: 16 * MIB }, /instance memory limit/],
  ] as const)("%s is a UserError", (_name, change, pattern) => {
    expect(() => planOf({ ...ok, ...change })).toThrow(UserError);
    expect(() => planOf({ ...ok, ...change })).toThrow(pattern);
  });
});

describe("the image decode and request body lines", () => {
  const base: PlanOptions = { backend: "native", cacheMib: 1, maxContext: 1024 };
  /** Bytes per pixel measured for decoding (RGBA output) plus a random-pixel PNG file (1.6 to 2.2). */
  const RGBA_AND_FILE = 4 + 1.6;

  it("admits the decoder's 64 MP when the budget allows, holding that image's pixels and file", () => {
    const p = planOf({ ...base, ramMib: 4096 });
    expect(p.imageBudget!.pixels).toBe(64_000_000);
    expect(p.components.imageDecode).toBe(p.imageBudget!.bytes);
    expect(p.components.imageDecode).toBeGreaterThan(64_000_000 * RGBA_AND_FILE);
    expect(p.describe()).toMatch(/image decode \(file, pixels, resize passes\)\s+[\d,.]+\s+images up to 64\.0 MP \(JPEG, PNG\)/);
    expect(p.describe()).not.toContain("request bodies"); // not a server
  });

  it("lowers the image limit to fit a smaller budget, down to a 12 MP photo, then refuses with advice that fits", () => {
    const without = planOf({ ...base, ramMib: 100_000, loadVision: false }).total;
    let previous = 0;
    for (const extra of [800, 400, 250, 150]) {
      const ramMib = Math.ceil(without / MIB) + extra;
      const p = planOf({ ...base, ramMib });
      expect(p.total).toBeLessThanOrEqual(p.ramBytes);
      expect(p.imageBudget!.pixels).toBeGreaterThanOrEqual(4000 * 3000);
      expect(p.imageBudget!.pixels).toBeLessThanOrEqual(64_000_000);
      if (previous) expect(p.imageBudget!.pixels).toBeLessThanOrEqual(previous); // less budget, no larger image
      previous = p.imageBudget!.pixels;
    }
    expect(previous).toBeLessThan(64_000_000);
    // below what a 12 MP photo needs: refused, and the advice fits when followed
    const ramMib = Math.ceil(without / MIB) + 20;
    const message = refusal({ ...base, ramMib });
    expect(message).toContain("image decode");
    const followed = followAdvice({ ...base, ramMib }, message);
    expect(followed.map((f) => f.hint)).toEqual(expect.arrayContaining([expect.stringMatching(/^raise --ram-mib/), "run without vision"]));
    for (const f of followed) expect(f.plan.total).toBeLessThanOrEqual(f.plan.ramBytes);
  });

  it("keeps an explicit image limit and has no line without vision", () => {
    const p = planOf({ ...base, ramMib: 4096, imageMaxPixels: 20_000_000 });
    expect(p.imageBudget!.pixels).toBe(20_000_000);
    expect(p.components.imageDecode).toBeGreaterThan(20_000_000 * RGBA_AND_FILE);
    expect(p.components.imageDecode).toBeLessThan(planOf({ ...base, ramMib: 4096 }).components.imageDecode);
    const off = planOf({ ...base, ramMib: 4096, loadVision: false });
    expect(off.components.imageDecode).toBe(0);
    expect(off.imageBudget).toBeNull();
  });

  it("holds every body slot of a server: the waiting ones, the running one and one being read", () => {
    const p = planOf({ ...base, ramMib: 4096, requests: { maxQueue: 3, maxBodyBytes: 8 * MIB } });
    expect(p.requestBodies).toMatchObject({ slots: 5, bodyBytes: 8 * MIB });
    // measured on a real server (test/server-api.test.ts): 1.9 to 2.1 resident bytes per body byte
    expect(p.components.requests).toBeGreaterThanOrEqual(5 * 8 * MIB * 2.1);
    expect(p.describe()).toContain("5 bodies of up to 8.0 MiB");
  });

  it("derives the body limit to fit (20 MiB at most), and refuses an explicit one with advice that fits", () => {
    const requests = { maxQueue: 8 };
    expect(planOf({ ...base, ramMib: 4096, requests }).requestBodies!.bodyBytes).toBe(20 * MIB);
    const without = planOf({ ...base, ramMib: 100_000, imageMaxPixels: 12_000_000 }).total;
    const ramMib = Math.ceil(without / MIB) + 200; // room for 200 MiB of bodies: 10 slots x a few MiB, or 4 x 20 MiB
    const derived = planOf({ ...base, ramMib, requests });
    expect(derived.requestBodies!.bodyBytes).toBeLessThan(20 * MIB);
    expect(derived.requestBodies!.bodyBytes).toBeGreaterThanOrEqual(MIB);
    expect(derived.total).toBeLessThanOrEqual(derived.ramBytes);
    const message = refusal({ ...base, ramMib, imageMaxPixels: 12_000_000, requests: { maxQueue: 8, maxBodyBytes: 20 * MIB } });
    const body = Number(/lower --max-body-mib to (\d+)/.exec(message)![1]);
    const queue = Number(/lower --max-queue to (\d+)/.exec(message)![1]);
    expect(planOf({ ...base, ramMib, imageMaxPixels: 12_000_000, requests: { maxQueue: 8, maxBodyBytes: body * MIB } }).total).toBeLessThanOrEqual(ramMib * MIB);
    expect(planOf({ ...base, ramMib, imageMaxPixels: 12_000_000, requests: { maxQueue: queue, maxBodyBytes: 20 * MIB } }).total).toBeLessThanOrEqual(ramMib * MIB);
    expect(() => planOf({ ...base, ramMib, imageMaxPixels: 12_000_000, requests: { maxQueue: 8, maxBodyBytes: (body + 1) * MIB } })).toThrow(UserError);
  });

  it.each([
    ["image limit 0", { imageMaxPixels: 0 }, /image limit must be a whole number of pixels/],
    ["image limit over the decoder's", { imageMaxPixels: 64_000_001 }, /image limit/],
    ["queue 0", { requests: { maxQueue: 0 } }, /--max-queue must be a positive integer/],
    ["body limit 0.5", { requests: { maxQueue: 1, maxBodyBytes: 0.5 } }, /body limit/],
  ] as const)("%s is a UserError", (_name, change, pattern) => {
    expect(() => planOf({ ...base, ramMib: 4096, ...change })).toThrow(pattern);
  });
});
