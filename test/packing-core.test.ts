/**
 * The core's packing API on both backends: the synthetic-weight generator against values numpy's
 * PCG64 gave (kvl/synth.py's generator), the Q8 and Q4 expert writers against hand-computed bytes,
 * and both backends byte-identical on large random input (Q4: with zero and subnormal groups).
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

  it("writes a Q4 expert extent: groups of 32, BF16 scales, nibbles q + 8", () => {
    // I = H = 32: FORMAT.md's offsets by hand: q blocks of 512 bytes, scale blocks of 64
    expect(core.expertQ4ExtentBytes(32, 32)).toBe(1728);
    expect(core.expertQ4ExtentBytes(32, 96)).toBe(5184);
    const gate = new Uint16Array(32 * 32);
    // row 0: max 8 tied with -8 (the first wins: scale -1, 0xbf80); 0.5, 1.5, 2.5 round half to
    // even; -8 / -1 = 8 is clamped to 7; column 16 goes to the high nibble of byte 0
    [8, 4, -4, 1, 0.5, 1.5, 2.5, -8].forEach((v, c) => (gate[c] = bf16(v)));
    gate[16] = bf16(3);
    // row 1: negative max -16 tied with 16 (scale 2, 0x4000)
    [1, 3, -5, 7].forEach((v, c) => (gate[32 + c] = bf16(v)));
    gate[32 + 5] = bf16(-16);
    gate[32 + 9] = bf16(16);
    gate[32 + 20] = bf16(6);
    // row 2: subnormal weights 5, 1, -3 x 2^-133: the scale -5/8 x 2^-133 rounds to -2^-133 (0x8001)
    [0x0005, 0x0001, 0x8003].forEach((b, c) => (gate[64 + c] = b));
    const up = new Uint16Array(32 * 32).fill(0x8000); // all -0: scale +0
    const down = new Uint16Array(32 * 32); // all +0: scale -0 (0x8000)
    const out = core.packExpertQ4(gate, up, down, 32, 32);
    expect(out.length).toBe(1728);
    const hex = (a: Uint8Array): string => Buffer.from(a).toString("hex");
    expect(hex(out.subarray(0, 16))).toBe("50848c87888686" + "8f" + "88".repeat(8));
    expect(hex(out.subarray(16, 32))).toBe("888a868cb880" + "8888" + "888f" + "88".repeat(6));
    expect(hex(out.subarray(32, 48))).toBe("83878b" + "88".repeat(13));
    expect(out.subarray(48, 1536).every((b) => b === 0x88)).toBe(true);
    const scale = (at: number): number => out[at]! | (out[at + 1]! << 8);
    expect([scale(1536), scale(1538), scale(1540), scale(1542)]).toEqual([0xbf80, 0x4000, 0x8001, 0x8000]);
    expect(scale(1600)).toBe(0x0000);
    expect(scale(1664)).toBe(0x8000);
  });

  it("refuses Q4 shapes that are not whole groups of 32, and NaN weights", () => {
    const w = new Uint16Array(48 * 32);
    expect(() => core.expertQ4ExtentBytes(48, 32)).toThrow(/expertQ4ExtentBytes: .*\(48\).*multiples of 32/);
    expect(() => core.packExpertQ4(w, w, w, 48, 32)).toThrow(/packExpertQ4: .*multiples of 32/);
    expect(() => core.packExpertQ4(w, w, w, 32, 48)).toThrow(/multiples of 32/);
    const g = new Uint16Array(32 * 32).fill(bf16(1));
    expect(() => core.packExpertQ4(g, g, g.subarray(1), 32, 32)).toThrow(/packExpertQ4: gate, up and down/);
    const d = g.slice();
    d[700] = 0xff80; // -Inf
    expect(() => core.packExpertQ4(g, g, d, 32, 32)).toThrow(/NaN or infinite.*re-download/);
  });
});

describe("wasm and native", () => {
  it("give byte-identical extents (Q8 and Q4) and synthetic streams", async () => {
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
      // Q4: random groups, and groups of zeros, subnormals and mixed magnitudes (subnormal scales
      // and quotients are where a flush-to-zero mode or a different rounding would show)
      for (const m of [g, u, d]) {
        m.fill(0, 0, 32);
        for (let c = 32; c < 64; c++) m[c] = (c * 37) % 128 | (c % 3 === 0 ? 0x8000 : 0);
        for (let c = 64; c < 96; c++) m[c] = c % 5 === 0 ? bf16(c) : (c * 11) % 128;
      }
      const q4a = wasm.packExpertQ4(g, u, d, I, H);
      const q4b = native.packExpertQ4(g, u, d, I, H);
      expect(q4a.length).toBe(wasm.expertQ4ExtentBytes(I, H));
      expect(Buffer.from(q4a).equals(Buffer.from(q4b))).toBe(true);
      const f32 = [new Float32Array(1001), new Float32Array(1001)];
      [wasm, native].forEach((core, i) => core.synthUniform(core.pcg64Seed(new BigUint64Array([9n, 8n, 7n, 6n])), 1001, 1, 0.1, f32[i]!));
      expect(Buffer.from(f32[0]!.buffer).equals(Buffer.from(f32[1]!.buffer))).toBe(true);
    } finally {
      wasm.close();
      native.close();
    }
  });
});
