/**
 * The core's sampler (kvl_sample, kvl_sampler_seed) through both backends: the marshalling of
 * parameters, logits and the generator state. The sampler's own arithmetic is tested in C
 * (wasm-core/tests/test_sampler.c, natively and as WebAssembly).
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";

const cores: Record<string, CoreBackend> = {};
beforeAll(async () => {
  cores.native = new NativeBackend();
  cores.wasm = await WasmBackend.create();
});
afterAll(() => {
  for (const c of Object.values(cores)) c.close();
});

/** The splitmix64 step kvl_sampler_seed applies once (wasm-core/src/sampler.c), written out. */
function splitmixState(seed: bigint): bigint {
  return BigInt.asUintN(64, seed + 0x9e3779b97f4a7c15n);
}

describe.each(["native", "wasm"])("the sampler on %s", (name) => {
  const core = (): CoreBackend => cores[name]!;

  it("seeds the generator as kvl_sampler_seed does, for any 64-bit seed", () => {
    for (const seed of [0n, 1n, 42n, 0xffffffffn, 0x1_0000_0000n, 0xdead_beef_cafe_f00dn, 2n ** 64n - 1n]) {
      expect(core().seedSampler(seed)[0]).toBe(splitmixState(seed));
    }
  });

  it("is greedy at temperature 0 (lowest index on ties) and with top-k 1, and leaves the state alone", () => {
    const logits = Float32Array.from([0.5, 3, -1, 3, 2.9]);
    const rng = core().seedSampler(7n);
    const before = rng[0];
    expect(core().sampleToken(logits.slice(), { temperature: 0, topK: 0, topP: 1 }, rng)).toBe(1);
    expect(rng[0]).toBe(before);
    expect(core().sampleToken(logits.slice(), { temperature: 0.8, topK: 1, topP: 1 }, rng)).toBe(1);
  });

  it("draws reproducibly from the seed, following the distribution, and never outside top-k / top-p", () => {
    const logits = Float32Array.from([Math.log(0.6), Math.log(0.3), Math.log(0.1), -50]);
    const draw = (seed: bigint, params = { temperature: 1, topK: 0, topP: 1 }, n = 3000): number[] => {
      const rng = core().seedSampler(seed);
      return Array.from({ length: n }, () => core().sampleToken(logits.slice(), params, rng));
    };
    const a = draw(123n);
    expect(draw(123n)).toEqual(a);
    expect(draw(124n)).not.toEqual(a);
    const share = (xs: number[], t: number): number => xs.filter((x) => x === t).length / xs.length;
    expect(share(a, 0)).toBeGreaterThan(0.55);
    expect(share(a, 0)).toBeLessThan(0.65);
    expect(share(a, 2)).toBeGreaterThan(0.07);
    expect(share(a, 2)).toBeLessThan(0.13);
    expect(new Set(draw(5n, { temperature: 1, topK: 2, topP: 1 }))).toEqual(new Set([0, 1]));
    // top-p 0.7: the smallest set whose mass exceeds 0.7 is {0, 1}
    expect(new Set(draw(6n, { temperature: 1, topK: 0, topP: 0.7 }))).toEqual(new Set([0, 1]));
  });
});

it("gives the same draws on both backends for the same seed", () => {
  const logits = Float32Array.from({ length: 1000 }, (_, i) => Math.sin(i) * 3);
  const run = (core: CoreBackend): number[] => {
    const rng = core.seedSampler(99n);
    return Array.from({ length: 200 }, () => core.sampleToken(logits.slice(), { temperature: 0.7, topK: 50, topP: 0.9 }, rng));
  };
  expect(run(cores.wasm!)).toEqual(run(cores.native!));
});
