/**
 * What a plan's expert cache should expect from a trained model's routing (host/plan/routing-outlook.ts):
 *   - the realistic table is what bench/routing-trace.ts's calibrated trace and the adaptive
 *     policy's simulation give (recomputed here at a few sizes), and it rises with the resident
 *     fraction;
 *   - the arithmetic of hit rates and bytes, worked by hand for the full-size Q8 pack at
 *     `kvl chat`'s 4 GiB plan;
 *   - on the tiny pack: a plan whose cache holds part of the experts ends its table with the
 *     outlook (worst case = the resident fraction), one that holds all does not, a Q4 pack is not
 *     told to use 4-bit experts, a plan with vision knows what it would cache without (the same
 *     options planned without vision) and offers --no-vision only when that is more, natively
 *     never on the tiny pack (the image lines lent to the cache hold all of its extents), and the
 *     load line of kvl chat / serve carries it as a second line.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { calibratedOutlookTable } from "../bench/routing-trace.js";
import { type ChatModel, loadLine } from "../host/chat-model.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { MIB, type PackFacts, readPackFacts } from "../host/plan/core-bytes.js";
import { planFromFacts } from "../host/plan/planner.js";
import { CALIBRATED_HIT_BY_RESIDENT_5PCT, calibratedHitRate, outlookText, routingOutlook } from "../host/plan/routing-outlook.js";
import { packCheckpoint } from "../packer/pack.js";
import { tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

describe("the realistic table", () => {
  it("is the calibrated trace's simulated hit rate under the default policy (every 5 %)", () => {
    const simulated = calibratedOutlookTable();
    expect(simulated).toHaveLength(21);
    for (let i = 0; i < 21; i++) expect(CALIBRATED_HIT_BY_RESIDENT_5PCT[i]).toBeCloseTo(simulated[i]!, 3);
  }, 120_000);

  it("rises with the resident fraction, beats the worst case above 0, and interpolates", () => {
    for (let i = 1; i < 21; i++) {
      expect(CALIBRATED_HIT_BY_RESIDENT_5PCT[i]!).toBeGreaterThan(CALIBRATED_HIT_BY_RESIDENT_5PCT[i - 1]!);
      if (i < 20) expect(CALIBRATED_HIT_BY_RESIDENT_5PCT[i]!).toBeGreaterThan(i / 20);
    }
    expect(calibratedHitRate(0.1)).toBeCloseTo(0.448, 6);
    expect(calibratedHitRate(0.125)).toBeCloseTo((0.448 + 0.55) / 2, 6);
    expect(calibratedHitRate(1)).toBe(1);
    expect(() => calibratedHitRate(Number.NaN)).toThrow(RangeError);
  });
});

describe("the outlook's arithmetic", () => {
  it("worked by hand: 199 of 1664 Q8 extents of 8,667,136 bytes, 26 MoE layers x top-6", () => {
    const o = routingOutlook(199, 1664, 156, 8_667_136)!;
    // resident 199/1664 = 0.119591..; the table between 10 % (0.448) and 15 % (0.550):
    // 0.448 + 0.102 x (0.119591 x 20 - 2) = 0.487966
    expect(o.worstHit).toBeCloseTo(0.119591, 6);
    expect(o.realisticHit).toBeCloseTo(0.487966, 5);
    // misses x 156 picks x 8,667,136 bytes
    expect(o.worstBytes / 1e9).toBeCloseTo((1 - 0.119591) * 156 * 8_667_136 / 1e9, 6);
    expect(o.realisticBytes / 1e9).toBeCloseTo(0.692307, 5);
    expect(outlookText(o, false)).toBe("experts: 199 of 1664 extents in RAM (12 %); a trained model's routing should find about 49 % " +
      "of its picks there and read about 0.69 GB a token from disk (worst case, uniform routing: 12 %, 1.19 GB); more RAM, or 4-bit " +
      "experts (kvl pack --expert-dtype q4), read less");
    expect(outlookText(o, true)).toMatch(/; more RAM reads less$/);
    // a text-only plan's larger cache is offered, with its own realistic share, only when larger
    const withText = outlookText(o, false, 281);
    expect(withText).toMatch(/; more RAM, or 4-bit experts \(kvl pack --expert-dtype q4\), or --no-vision \(no images: 281 extents, about (\d+) % found\), read less$/);
    const found = Number(/about (\d+) % found/.exec(withText)![1]);
    expect(found).toBeGreaterThan(49); // more resident than 199 of 1664: more found
    expect(found).toBeLessThan(100);
    expect(outlookText(o, true, 281)).toMatch(/; more RAM, or --no-vision \(no images: 281 extents, about \d+ % found\), read less$/);
    expect(outlookText(o, false, 199)).toBe(outlookText(o, false));
    expect(routingOutlook(1664, 1664, 156, 8_667_136)).toBeNull();
  });
});

describe("the plan quotes it (tiny pack)", () => {
  let tmp: { dir: string; cleanup: () => void };
  let native: NativeBackend;
  let pack: string;
  let facts: PackFacts;
  let q4Facts: PackFacts;

  beforeAll(async () => {
    tmp = tempDir("outlook");
    native = new NativeBackend();
    const ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), native, 0);
    pack = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core: native, allowRevision: true });
    facts = await readPackFacts(pack);
    q4Facts = await readPackFacts(await packCheckpoint(ckpt, join(tmp.dir, "pack-q4"), { core: native, allowRevision: true, expertDtype: "q4" }));
  }, 300_000);

  afterAll(() => {
    native?.close();
    tmp?.cleanup();
  });

  const planWith = (f: PackFacts, extents: number | null) => {
    const extent = Math.ceil(f.expertNbytes / 4096) * 4096;
    return planFromFacts(f, { backend: "native", threads: 2, instances: 1, maxContext: 512, loadVision: false, ramMib: 65_536,
      ...(extents === null ? {} : { cacheMib: (extents * extent) / MIB }) });
  };

  it("ends the table with the realistic and worst rows when the cache holds part of the experts", () => {
    const k = Math.max(6, Math.floor(facts.expertRecords / 4));
    const p = planWith(facts, k);
    const o = p.routingOutlook!;
    expect(o.cached).toBe(k);
    expect(o.extents).toBe(facts.expertRecords);
    expect(o.worstHit).toBeCloseTo(k / facts.expertRecords, 12);
    expect(o.realisticHit).toBeGreaterThan(o.worstHit);
    const last = p.describe().split("\n").at(-1)!;
    expect(last).toMatch(new RegExp(`^Experts: ${k} of ${facts.expertRecords} extents in RAM \\(\\d+ %\\); .*worst case, uniform routing: ` +
      `${Math.round((100 * k) / facts.expertRecords)} %.*4-bit experts`));
    expect(planWith(q4Facts, k).describe()).toMatch(/more RAM reads less\.$/);
  });

  it("with vision loaded, knows what the same options cache without it, and offers --no-vision only when that is more", () => {
    // WebAssembly, where nothing is lent; the tiny model's instance pads its memory with megabytes,
    // so only an explicit --cache-mib keeps its cache partial (the same in the text-only plan:
    // nothing to offer; the sentence of a larger one is outlookText's test above)
    const extent = Math.ceil(facts.expertNbytes / 4096) * 4096;
    const base = { backend: "wasm", threads: 2, instances: 1, maxContext: 512, ramMib: 65_536, cacheMib: (8 * extent) / MIB } as const;
    const withVision = planFromFacts(facts, { ...base, loadVision: true });
    const textOnly = planFromFacts(facts, { ...base, loadVision: false });
    expect(withVision.routingOutlook).not.toBeNull();
    expect(withVision.expertExtentsCached).toBe(8);
    expect(withVision.textOnlyExtentsCached).toBe(textOnly.expertExtentsCached);
    expect(withVision.describe()).not.toContain("--no-vision");
    // a plan without vision has nothing to offer
    expect(textOnly.textOnlyExtentsCached).toBeNull();
  });

  it("natively, where the image lines are lent to the cache, offers no --no-vision for the same budget", () => {
    const extent = Math.ceil(facts.expertNbytes / 4096) * 4096;
    const base = { backend: "native", threads: 2, instances: 1, maxContext: 512 } as const;
    const sized = planFromFacts(facts, { ...base, loadVision: true, ramMib: 65_536, cacheMib: (8 * extent) / MIB });
    const ramMib = sized.total / MIB;
    const withVision = planFromFacts(facts, { ...base, loadVision: true, ramMib });
    const textOnly = planFromFacts(facts, { ...base, loadVision: false, ramMib });
    // the tiny model's image lines hold more than all of its extents: while no image is in flight
    // the cache holds what the text-only plan holds
    expect(withVision.expertExtentsLent).toBeGreaterThan(0);
    expect(withVision.expertExtentsCached).toBe(textOnly.expertExtentsCached);
    expect(withVision.describe()).not.toContain("--no-vision");
  });

  it("says nothing when every extent is cached", () => {
    const p = planWith(facts, null);
    expect(p.routingOutlook).toBeNull();
    expect(p.describe()).not.toContain("trained model's routing");
  });

  it("the load line of kvl chat and serve carries it as a second line, and --verbose's table instead", () => {
    const k = Math.max(6, Math.floor(facts.expertRecords / 4));
    // the fields loadLine reads of a loaded model, around a real plan
    const model = (plan: ReturnType<typeof planWith>) => ({
      backendRecord: { chosen: "native", requestedBy: "default" }, plan, loadSeconds: 1.5, preprocess: null, defaultInTokenLimit: 0,
      client: { info: { kernels: "avx2" } }, actMode: { actDtype: "i16x1", kvDtype: "f32", chosenBy: "option", kernels: "avx2", reason: "" },
    }) as unknown as ChatModel;
    const lines = loadLine("serve", model(planWith(facts, k)), false).split("\n");
    expect(lines).toHaveLength(2);
    expect(lines[0]).toMatch(/^kvl serve: native, 1 engine, kernels avx2/);
    expect(lines[1]).toMatch(new RegExp(`^kvl serve: experts: ${k} of ${facts.expertRecords} extents in RAM \\(\\d+ %\\); a trained model's routing should find about \\d+ %`));
    expect(loadLine("serve", model(planWith(facts, k)), true).split("\n")).toHaveLength(1);
    expect(loadLine("chat", model(planWith(facts, null)), false).split("\n")).toHaveLength(1);
  });
});
