/**
 * The core's packing API on both backends: the synthetic-weight generator against values numpy's
 * PCG64 gave (kvl/synth.py's generator), the Q8 expert writer against hand-computed bytes, and
 * both backends byte-identical on large random input.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";

/** numpy 2.4.6: SeedSequence(sha-derived entropy of (seed 3, "x.weight")).generate_state(4, uint64) */
const X_SEED = new BigUint64Array([0xdc7d45ea24d5dd35n, 0x42353277b21d9dd9n, 0x85bc65cbc75ec34en, 0x08b9b78b2c27b7f3n]);
/** numpy: _uniform_fill(uint16[7], 3, "x.weight", 0.0, 0.05) */
const X_WANT = [0xbda8, 0x3d7d, 0xbcef, 0x3972, 0x3d57, 0xbd98, 0xbcfb];
const HALF = Math.fround(0.05 * Math.sqrt(3));

function bf16(value: number): number {
  return new Uint16Array(new Float32Array([value]).buffer)[1]!;
}

const backends: Record<string, () => Promise<CoreBackend>> = {
  wasm: () => WasmBackend.create(),
  native: async () => new NativeBackend(),
};

describe.each(Object.keys(backends))("%s backend", (name) => {
  let core: CoreBackend;
  beforeAll(async () => {
    core = await backends[name]!();
  });
  afterAll(() => core.close());

  it("draws numpy's PCG64 stream, in one call or several", () => {
    const out = new Uint16Array(7);
    core.synthUniform(core.pcg64Seed(X_SEED), 7, 0, HALF, out);
    expect([...out]).toEqual(X_WANT);
    const state = core.pcg64Seed(X_SEED);
    const split = new Uint16Array(7);
    core.synthUniform(state, 4, 0, HALF, split);
    core.synthUniform(state, 3, 0, HALF, split.subarray(4));
    expect([...split]).toEqual(X_WANT);
  });

  it("writes a Q8 expert extent with half-to-even rounding, zero rows and padding", () => {
    const gate = Uint16Array.from([127, 2.5, -2.5, 0, 0, 0], bf16);
    const up = Uint16Array.from([3.5, -254, 5, 0.5, 1, -1], bf16);
    const down = Uint16Array.from([1, -1, 0, 63.5, 12, 3], bf16);
    expect(core.expertExtentBytes(2, 3)).toBe(332);
    const out = core.packExpert(gate, up, down, 2, 3);
    const q = new Int8Array(out.buffer);
    expect([...q.subarray(0, 6)]).toEqual([127, 2, -2, 0, 0, 0]);
    expect([...q.subarray(64, 70)]).toEqual([2, -127, 2, 64, 127, -127]);
    expect([...q.subarray(128, 134)]).toEqual([127, -127, 0, 127, 127, 32]);
    expect([...new Float32Array(out.buffer, 192, 2)]).toEqual([1, 0]);
    expect([...new Float32Array(out.buffer, 256, 2)]).toEqual([2, Math.fround(1 / 127)]);
    expect(out.subarray(6, 64).every((b) => b === 0)).toBe(true);
  });

  it("refuses a NaN weight with a message that says what to do", () => {
    const gate = new Uint16Array(6).fill(bf16(1));
    const up = gate.slice();
    up[2] = 0x7fc0;
    expect(() => core.packExpert(gate, up, gate, 2, 3)).toThrow(/NaN or infinite.*re-download/);
  });
});

describe("wasm and native", () => {
  it("give byte-identical extents and synthetic streams", async () => {
    const wasm = await WasmBackend.create();
    const native = new NativeBackend();
    try {
      const I = 96, H = 160;
      const draw = (core: CoreBackend, seed: bigint, n: number): Uint16Array => {
        const out = new Uint16Array(n);
        core.synthUniform(core.pcg64Seed(new BigUint64Array([seed, 1n, 2n, 3n])), n, 0, 0.2, out);
        return out;
      };
      for (const seed of [1n, 2n, 3n]) {
        expect(Buffer.from(draw(wasm, seed, I * H).buffer)).toEqual(Buffer.from(draw(native, seed, I * H).buffer));
      }
      const [g, u, d] = [1n, 2n, 3n].map((s) => draw(native, s, I * H)) as [Uint16Array, Uint16Array, Uint16Array];
      const a = wasm.packExpert(g, u, d, I, H);
      const b = native.packExpert(g, u, d, I, H);
      expect(a.length).toBe(wasm.expertExtentBytes(I, H));
      expect(Buffer.from(a).equals(Buffer.from(b))).toBe(true);
      const f32 = [new Float32Array(1001), new Float32Array(1001)];
      [wasm, native].forEach((core, i) => core.synthUniform(core.pcg64Seed(new BigUint64Array([9n, 8n, 7n, 6n])), 1001, 1, 0.1, f32[i]!));
      expect(Buffer.from(f32[0]!.buffer).equals(Buffer.from(f32[1]!.buffer))).toBe(true);
    } finally {
      wasm.close();
      native.close();
    }
  });
});
