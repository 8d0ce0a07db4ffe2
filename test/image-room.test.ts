/**
 * The image lines' RAM lent to the expert cache while no image is in flight (planner.ts
 * expertLoans, kvl_engine_set_expert_slots, engine-host.ts lendImageRoom, image-room.ts):
 *   - the plan: natively with vision, the loan is the whole extents the vision and image decode
 *     lines hold (never more, and never past the experts there are); WebAssembly (a memory never
 *     shrinks) and a text-only plan lend nothing; the engine's slab is the cache plus the loan;
 *   - the engine, on both backends and on forced splits: the reference's greedy tokens while the
 *     caches shrink to one layer's top-k and grow back before every step (only residency changes);
 *     the slots in use clamp to [top-k per range, the slab];
 *   - ImageRoom: one recall for image work that overlaps, the room lent again after the last, even
 *     when the work fails;
 *   - a chat turn with an image on a cache that lends (native) or cannot (WebAssembly): the same
 *     reply as with every extent cached; an image attached while another reply is generating is
 *     checked without waiting for that reply to end (the worker gives the room back between
 *     tokens).
 * The pages a parked slot gives back are checked in wasm-core/tests/test_expert_cache.c, and the
 * peak RSS of the full-size model against the plan in bench/RESULTS.md.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import sharp from "sharp";

import { chooseBackend } from "../host/core/backend.js";
import { openHostedEngine } from "../host/engine/engine-host.js";
import { ChatModel } from "../host/chat-model.js";
import { ImageRoom } from "../host/image/image-room.js";
import { MIB, type PackFacts, modelOf, readPackFacts } from "../host/plan/core-bytes.js";
import { planFromFacts } from "../host/plan/planner.js";
import type { PlanOptions } from "../host/plan/settings.js";
import { defaultReplyParams } from "../host/text/reply-params.js";
import { argmax } from "./reference/math.js";
import { TextReference } from "./reference/text.js";
import { GREEDY_TOKENS, referenceGreedy } from "./support/engine-checks.js";
import { nativeBuilt } from "./helpers.js";
import { anyCore, tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";
import { packCheckpoint } from "../packer/pack.js";

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let facts: PackFacts;
let reference: TextReference;
let image: Uint8Array;

beforeAll(async () => {
  tmp = tempDir("image-room");
  const core = await anyCore();
  try {
    const ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), core, 0);
    pack = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core, allowRevision: true });
    reference = TextReference.load(ckpt, { q8Experts: true });
  } finally {
    core.close();
  }
  facts = await readPackFacts(pack);
  const pixels = Buffer.alloc(320 * 240 * 3);
  for (let i = 0; i < pixels.length; i++) pixels[i] = (i * 2654435761) >>> 24;
  image = await sharp(pixels, { raw: { width: 320, height: 240, channels: 3 } }).png().toBuffer();
}, 300_000);

afterAll(() => tmp?.cleanup());

/** A --cache-mib that holds `extents` of the tiny model's extents (a partial cache). */
function cacheOf(extents: number): number {
  return (extents * modelOf(facts).extent + 100) / MIB;
}

function planOf(options: Partial<PlanOptions> & Pick<PlanOptions, "backend">) {
  return planFromFacts(facts, { threads: 2, instances: 1, ramMib: 4096, maxContext: 256, loadVision: true, ...options });
}

describe("the plan lends the image lines to the expert cache", () => {
  it("natively with vision: whole extents within the vision and image decode lines, the rest of the experts at most", () => {
    const m = modelOf(facts);
    const p = planOf({ backend: "native", cacheMib: cacheOf(m.topK + 1) });
    const inst = p.instances[0]!;
    const all = facts.expertRecords;
    const own = inst.expertCache / m.extent;
    const lent = inst.expertLoan / m.extent;
    const room = p.components.vision + p.components.imageDecode;
    expect(own).toBe(m.topK + 1);
    expect(Number.isInteger(lent)).toBe(true);
    expect(lent).toBeGreaterThan(0);
    expect(lent * m.extent).toBeLessThanOrEqual(room);
    // as many as fit in the room, unless every extent is cached by then
    expect(own + lent === all || (lent + 1) * m.extent > room).toBe(true);
    expect(own + lent).toBeLessThanOrEqual(all);
    expect(inst.engineOptions.expertCacheBytes).toBe(inst.expertCache + inst.expertLoan);
    expect(p.expertExtentsCached).toBe(own + lent);
    expect(p.expertExtentsLent).toBe(lent);
    expect(p.describe()).toMatch(new RegExp(`${own} extents; \\+${lent} \\([\\d.,]+ MiB\\) lent by the image lines while no image is in flight`));
  });

  it("WebAssembly and a text-only plan lend nothing", () => {
    const cacheMib = cacheOf(modelOf(facts).topK + 1);
    for (const p of [planOf({ backend: "wasm", cacheMib }), planOf({ backend: "native", cacheMib, loadVision: false })]) {
      expect(p.instances.every((i) => i.expertLoan === 0)).toBe(true);
      expect(p.expertExtentsLent).toBe(0);
      expect(p.describe()).not.toContain("lent by");
    }
  });

  it("the engine's slab is the plan's cache plus its loan: reconciling changes nothing", async () => {
    if (!nativeBuilt) throw new Error("the native addon is not built (npm run build:native)");
    const p = planOf({ backend: "native", cacheMib: cacheOf(modelOf(facts).topK + 1) });
    const hosted = await openHostedEngine("native", pack, { nThreads: p.nThreads, planned: p.instances });
    try {
      const info = hosted.engine.parts[0]!.info();
      const changed = p.reconcile([{ info, sessionBytes: hosted.engine.parts[0]!.sessionBytes(p.sessionOptions) }]);
      expect(changed.filter((c) => c.includes("expertCache"))).toEqual([]);
      expect(info.expertCacheBytes).toBe(p.instances[0]!.expertCache + p.instances[0]!.expertLoan);
      expect(hosted.lendsImageRoom).toBe(true);
    } finally {
      hosted.close();
    }
  }, 120_000);
});

const SETUPS = [
  ...(nativeBuilt ? [{ backend: "native", instances: 1 }, { backend: "native", instances: 2 }] as const : []),
  { backend: "wasm", instances: 1 }, { backend: "wasm", instances: 2 },
] as const;

describe.each(SETUPS)("the expert cache resized between steps ($backend, $instances range(s))", ({ backend, instances }) => {
  it(`decodes the reference's ${GREEDY_TOKENS} greedy tokens while it shrinks to top-k and grows back before every step`, async () => {
    if (backend === "native" && !nativeBuilt) throw new Error("the native addon is not built");
    const m = modelOf(facts);
    const p = planOf({ backend, instances, cacheMib: cacheOf(m.topK * instances + 1) });
    const hosted = await openHostedEngine(backend, pack, { nThreads: p.nThreads, planned: p.instances });
    try {
      expect(hosted.lendsImageRoom).toBe(backend === "native");
      const moeRanges = p.instances.filter((i) => i.expertExtent > 0).length;
      const slab = p.instances.reduce((n, i) => n + (i.expertExtent ? (i.expertCache + i.expertLoan) / i.expertExtent : 0), 0);
      const { ids, want } = referenceGreedy(reference);
      const session = hosted.engine.newSession({ maxContext: 128 });
      try {
        let logits = session.prefill(Int32Array.from(ids), null, "last")!;
        const got: number[] = [];
        for (let step = 0; step < GREEDY_TOKENS; step++) {
          got.push(argmax(logits));
          if (step + 1 === GREEDY_TOKENS) break;
          if (step % 2 === 0) {
            expect(hosted.engine.setExpertSlots(0)).toBe(m.topK * moeRanges);
          } else if (hosted.lendsImageRoom && step % 4 === 1) {
            hosted.lendImageRoom(false); // the plan's own recall: the cache without its loan
            hosted.lendImageRoom(true);
          } else {
            expect(hosted.engine.setExpertSlots(1_000_000)).toBe(slab);
          }
          logits = session.step(got.at(-1)!);
        }
        expect(got).toEqual(want);
      } finally {
        session.close();
      }
    } finally {
      hosted.close();
    }
  }, 180_000);
});

describe("ImageRoom", () => {
  function recorder(): { calls: boolean[]; room: ImageRoom } {
    const calls: boolean[] = [];
    return { calls, room: new ImageRoom(async (lent) => void calls.push(lent)) };
  }

  it("takes the room back once for overlapping image work, and lends it after the last", async () => {
    const { calls, room } = recorder();
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const seen: boolean[][] = [];
    const first = room.hold(async () => {
      seen.push([...calls]);
      await gate;
    });
    const second = room.hold(async () => void seen.push([...calls]));
    await second;
    expect(room.working).toBe(1);
    expect(calls).toEqual([false]); // the first still works: nothing lent yet
    release();
    await first;
    expect(seen).toEqual([[false], [false]]); // each ran after the recall
    expect(calls).toEqual([false, true]);
    expect(room.working).toBe(0);
  });

  it("lends the room again when the work fails", async () => {
    const { calls, room } = recorder();
    await expect(room.hold(async () => {
      throw new Error("bad image");
    })).rejects.toThrow("bad image");
    expect(calls).toEqual([false, true]);
    await room.hold(async () => undefined);
    expect(calls).toEqual([false, true, false, true]);
  });
});

describe.each(SETUPS.filter((s) => s.instances === 1))("a chat turn with an image ($backend)", ({ backend }) => {
  const open = (cacheMib: number): Promise<ChatModel> => ChatModel.open(pack, {
    backend: chooseBackend({ option: backend }), ramMib: 2048, cacheMib, trunkCacheMib: null, maxContext: 4096, threads: 2,
    kernels: "auto", actDtype: "auto", loadVision: true, instances: 1,
  });
  const greedy = { ...defaultReplyParams(), temperature: 0, maxNewTokens: 12 };

  it("replies as with every extent cached, the loan recalled for the image and lent again", async () => {
    const lending = await open(cacheOf(modelOf(facts).topK + 1));
    const whole = await open(64);
    try {
      expect(lending.client.lendsImageRoom).toBe(backend === "native");
      expect(whole.client.lendsImageRoom).toBe(false); // every extent is its own: nothing to lend
      const replies: number[][] = [];
      for (const model of [lending, whole]) {
        const conversation = await model.newConversation();
        try {
          const picture = await model.loadImage(image, "picture.png");
          const report = await conversation.generate([{ role: "user", parts: [picture, "Describe this."] }], greedy, () => undefined);
          expect(report.usage.imagesEncoded).toBe(1);
          replies.push(report.outputTokenIds);
        } finally {
          await conversation.close();
        }
        expect(model.imageRoom.working).toBe(0);
      }
      expect(replies[0]).toEqual(replies[1]);
      expect(replies[0]!.length).toBeGreaterThan(0);
    } finally {
      await lending.close();
      await whole.close();
    }
  }, 300_000);

  it("checks an image attached while another reply generates without waiting for that reply", async () => {
    const model = await open(cacheOf(modelOf(facts).topK + 1));
    try {
      const conversation = await model.newConversation();
      try {
        let pieces = 0;
        let replied = false;
        const reply = conversation.generate([{ role: "user", parts: ["Tell me a long story."] }],
          { ...greedy, maxNewTokens: 3000, seed: 1 }, () => void pieces++);
        void reply.then(() => (replied = true), () => (replied = true));
        // let the reply start, then attach an image (its check decodes it in the image room)
        while (pieces === 0) await new Promise((r) => setTimeout(r, 5));
        await model.loadImage(image, "picture.png");
        // the check did not wait for the reply: it is still generating
        expect(replied).toBe(false);
        const report = await reply;
        expect(report.outputTokenIds.length).toBeGreaterThan(0);
      } finally {
        await conversation.close();
      }
    } finally {
      await model.close();
    }
  }, 300_000);
});
