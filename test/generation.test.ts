/**
 * Replies generated in the engine worker (host/engine/generation.ts through host/engine/engine-client.ts), on
 * both backends and on a forced 2-instance split: greedy replies equal the float64 reference's,
 * the prefix of a resent conversation is reused and changes nothing, stop ids end a reply
 * without emitting or stepping them, banned ids are never sampled, the stop flag ends a reply
 * keeping its tokens, and a cancel during prefill ends it at once and keeps the session usable.
 */

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { EngineClient, type ClientSession } from "../host/engine/engine-client.js";
import type { GenerationRequest } from "../host/engine/generation.js";
import { argmax } from "./reference/math.js";
import { TextReference } from "./reference/text.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let reference: TextReference;

beforeAll(async () => {
  tmp = tempDir("generation");
  const made = await tinyPack(tmp.dir, 1, { nGroup: 4, topkGroup: 2 });
  pack = made.pack;
  reference = TextReference.load(made.ckpt, { q8Experts: true });
}, 120_000);

afterAll(() => tmp?.cleanup());

const PROMPT = Int32Array.of(1201, 88, 40960, 7, 123456, 99, 5, 31337, 2024, 17);

/** The reference's greedy continuation of ids, top-1 only. */
function referenceGreedy(ids: number[], n: number, banned: number[] = []): number[] {
  const H = reference.cfg.hidden_size;
  const seq = [...ids];
  const out: number[] = [];
  for (let i = 0; i < n; i++) {
    const last = reference.logitsFromHidden(reference.hiddenStates(seq).subarray((seq.length - 1) * H), 1);
    for (const b of banned) last[b] = -Infinity;
    const t = argmax(last);
    out.push(t);
    seq.push(t);
  }
  return out;
}

function request(prompt: Int32Array, overrides: Partial<GenerationRequest> = {}): GenerationRequest {
  return {
    prompt, mediaKeys: [], media: null, sampler: { temperature: 0, topK: 0, topP: 1 }, seed: 1n,
    maxNewTokens: 12, stopIds: new Int32Array(0), bannedIds: new Int32Array(0), ...overrides,
  };
}

describe.each([["wasm", 1], ["native", 1], ["wasm", 2]] as const)("replies on %s with %d instance(s)", (backend, instances) => {
  let client: EngineClient;
  let session: ClientSession;
  let greedy: number[];
  beforeAll(async () => {
    client = await EngineClient.open(backend, pack, evenSplit(pack, { nThreads: 2, instances, instanceMemoryBytes: 256 * 2 ** 20 }));
    session = await client.newSession({ maxContext: 8192 });
    greedy = referenceGreedy([...PROMPT], 12);
  }, 120_000);
  afterAll(async () => {
    await session?.close();
    await client?.close();
  });

  it("generate the reference's greedy tokens, streamed in order, and stop at max_new_tokens", async () => {
    await session.reset();
    const streamed: number[] = [];
    const r = await session.generate(request(PROMPT), (t) => streamed.push(t));
    expect(r.tokens).toEqual(greedy);
    expect(streamed).toEqual(greedy);
    expect(r.finishReason).toBe("length");
    expect(r.promptTokens).toBe(PROMPT.length);
    expect(r.reusedPromptTokens).toBe(0);
    // the last sampled token is never stepped: the KV holds the prompt and all but the last
    expect(await session.position()).toBe(PROMPT.length + greedy.length - 1);
  });

  it("reuse the prefix of a resent conversation, with the same result as a fresh prefill", async () => {
    await session.reset();
    const first = await session.generate(request(PROMPT, { maxNewTokens: 4 }), () => undefined);
    const next = Int32Array.from([...PROMPT, ...first.tokens, 640, 641]);
    const resent = await session.generate(request(next, { maxNewTokens: 6 }), () => undefined);
    expect(resent.reusedPromptTokens).toBe(PROMPT.length + first.tokens.length - 1);
    expect(resent.tokens).toEqual(referenceGreedy([...next], 6));
  });

  it("end at a stop id without emitting it, and never sample a banned id", async () => {
    await session.reset();
    const stopped = await session.generate(request(PROMPT, { stopIds: Int32Array.of(greedy[2]!) }), () => undefined);
    expect(stopped.finishReason).toBe("stop");
    expect(stopped.stopId).toBe(greedy[2]);
    expect(stopped.tokens).toEqual(greedy.slice(0, 2));
    await session.reset();
    const banned = [greedy[0]!, greedy[1]!];
    const r = await session.generate(request(PROMPT, { maxNewTokens: 5, bannedIds: Int32Array.from(banned) }), () => undefined);
    expect(r.tokens).toEqual(referenceGreedy([...PROMPT], 5, banned));
    for (const t of r.tokens) expect(banned).not.toContain(t);
  });

  it("end on the stop flag keeping what was generated, and on a cancel during prefill", async () => {
    await session.reset();
    let seen = 0;
    const r = await session.generate(request(PROMPT, { maxNewTokens: 4000 }), () => {
      if (++seen === 3) session.stop();
    });
    expect(r.finishReason).toBe("stopped");
    expect(r.tokens.length).toBeGreaterThanOrEqual(3);
    expect(r.tokens.length).toBeLessThan(4000);
    // the flag is read before sampling and before stepping: the last token may or may not
    // have been stepped, and the KV holds exactly what was
    const position = await session.position();
    expect(position).toBeGreaterThanOrEqual(PROMPT.length + r.tokens.length - 1);
    expect(position).toBeLessThanOrEqual(PROMPT.length + r.tokens.length);

    const long = Int32Array.from({ length: 6000 }, (_, i) => 100 + ((i * 7919) % 100000));
    const pending = session.generate(request(long), () => undefined);
    setTimeout(() => session.cancel(), 50);
    const cancelled = await pending;
    expect(cancelled.finishReason).toBe("cancelled");
    expect(cancelled.tokens).toEqual([]);
    const after = await session.generate(request(PROMPT, { maxNewTokens: 3 }), () => undefined);
    expect(after.tokens).toEqual(greedy.slice(0, 3));
  });
});

describe("seeded sampling", () => {
  it("gives the same reply for the same seed and another for another seed", async () => {
    const client = await EngineClient.open("native", pack, evenSplit(pack, { nThreads: 2 }));
    try {
      const session = await client.newSession({ maxContext: 256 });
      const sample = async (seed: bigint): Promise<number[]> => {
        await session.reset();
        return (await session.generate(request(PROMPT, { sampler: { temperature: 1.5, topK: 0, topP: 1 }, seed, maxNewTokens: 16 }), () => undefined)).tokens;
      };
      const a = await sample(7n);
      expect(await sample(7n)).toEqual(a);
      expect(await sample(8n)).not.toEqual(a);
      await session.close();
    } finally {
      await client.close();
    }
  });
});
