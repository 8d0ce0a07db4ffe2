/**
 * The engine in its worker thread (host/engine/engine-worker.ts through host/engine/engine-client.ts), on both
 * backends: the main thread's event loop keeps running during a long prefill; cancelling a
 * running prefill rolls the session back and the session then computes what a fresh one does;
 * errors cross the thread boundary as the same classes. Needs dist/ (the worker is compiled JS).
 */
import { existsSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { ENGINE_WORKER_PATH, EngineClient } from "../host/engine/engine-client.js";
import { CoreError } from "../host/core/core-api.js";
import { evenSplit } from "./support/even-split.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const OPTIONS = { nThreads: 2, instanceMemoryBytes: 512 * 2 ** 20 };
/** Long enough that the prefill takes far longer than the 50 ms before the cancel. */
const LONG_PROMPT = Int32Array.from({ length: 6000 }, (_, i) => 100 + ((i * 7919) % 100000));

/** How many values differ (a count, not a diff: a failing toEqual on 163840 floats takes minutes). */
function differingValues(a: Float32Array, b: Float32Array): number {
  expect(a.length).toBe(b.length);
  let n = 0;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) n++;
  return n;
}

let tmp: { dir: string; cleanup: () => void };
let pack: string;

beforeAll(async () => {
  expect(existsSync(ENGINE_WORKER_PATH), "compile first: npx tsc -p .").toBe(true);
  tmp = tempDir("engine-worker");
  ({ pack } = await tinyPack(tmp.dir));
}, 120_000);

afterAll(() => tmp?.cleanup());

describe.each(["wasm", "native"] as const)("the engine worker on %s", (backend) => {
  let client: EngineClient;
  beforeAll(async () => {
    client = await EngineClient.open(backend, pack, evenSplit(pack, OPTIONS));
  });
  afterAll(async () => {
    await client?.close();
  });

  it("leaves the main thread free: a timer keeps firing during a long prefill", async () => {
    const session = await client.newSession({ maxContext: 8192 });
    let ticks = 0;
    const timer = setInterval(() => ticks++, 1);
    let ticksWhilePending = -1;
    try {
      const pending = session.prefill(LONG_PROMPT.subarray(0, 2000), null, "last");
      await new Promise((resolve) => setTimeout(resolve, 20));
      ticksWhilePending = ticks;
      const logits = await pending;
      expect(logits!.length).toBe(client.info.vocabSize);
      expect(await session.position()).toBe(2000);
    } finally {
      clearInterval(timer);
      await session.close();
    }
    expect(ticksWhilePending).toBeGreaterThan(0);
  });

  it("cancels a running prefill: the session rolls back and then computes what a fresh one does", async () => {
    const session = await client.newSession({ maxContext: 8192 });
    const fresh = await client.newSession({ maxContext: 8192 });
    try {
      const head = Int32Array.of(11, 22, 33, 44);
      await session.prefill(head, null, "none");
      const pending = session.prefill(LONG_PROMPT, null, "last");
      setTimeout(() => session.cancel(), 50);
      const error = await pending.then(() => undefined, (e: unknown) => e);
      expect(error).toBeInstanceOf(CoreError);
      expect((error as CoreError).statusName).toBe("cancelled");
      expect(await session.position()).toBe(head.length);
      // after the cancel, the next calls run (the flag is cleared) and give, bit for bit, what a
      // session that made the same calls without the cancelled one gives
      await fresh.prefill(head, null, "none");
      const after = await session.prefill(Int32Array.of(55, 66), null, "last");
      const want = await fresh.prefill(Int32Array.of(55, 66), null, "last");
      expect(differingValues(after!, want!)).toBe(0);
      expect(differingValues(await session.step(77), await fresh.step(77))).toBe(0);
    } finally {
      await session.close();
      await fresh.close();
    }
  });

  it("sends errors back as the same classes, and keeps serving", async () => {
    const session = await client.newSession({ maxContext: 8 });
    try {
      const full = await session.prefill(Int32Array.from({ length: 9 }, (_, i) => i + 1), null, "none").then(() => undefined, (e: unknown) => e);
      expect(full).toBeInstanceOf(CoreError);
      expect(String(full)).toMatch(/context is full/);
      const outside = await session.step(client.info.vocabSize).then(() => undefined, (e: unknown) => e);
      expect(String(outside)).toMatch(/outside the vocabulary/);
      expect((await session.step(5)).length).toBe(client.info.vocabSize);
    } finally {
      await session.close();
    }
  });
});

describe("opening an engine in a worker", () => {
  it("fails with the core's error naming the file, and stops the worker", async () => {
    // planned for the tiny pack, opened where no pack is (as when a pack goes between plan and open)
    const error = await EngineClient.open("native", join(tmp.dir, "no-such-pack"), evenSplit(pack, OPTIONS)).then(() => undefined, (e: unknown) => e);
    expect(String(error)).toMatch(/no-such-pack.*config\.json|PACK_COMPLETE\.json/);
  });
});
