// run.mjs — times decode_variants.wasm (see decode_variants.c): GB/s of weights, best of 5 timed
// runs per round, best of 4 rounds with the variants interleaved; one thread.
// Usage: node [--experimental-wasm-relaxed-simd: Node 20 only] run.mjs decode_variants.wasm (run.sh decides)
import fs from "node:fs";

const names = ["widen (today)", "widen + plain-load prefetch", "mask/shift, no widening", "relaxed dot i16x8 (8-bit)", "relaxed dot-add i32x4 (8-bit)"];
const { instance } = await WebAssembly.instantiate(fs.readFileSync(process.argv[2]));
const { decode, memory } = instance.exports;
memory.grow(4096); // 256 MiB more
const buf = memory.buffer;
const i8 = new Int8Array(buf), i16 = new Int16Array(buf), f32 = new Float32Array(buf);
const cols = 2048;
let seed = 1;
const rnd = () => ((seed = (seed * 1103515245 + 12345) & 0x7fffffff) % 255) - 127;

for (const [label, rows, reps] of [["in cache (256 x 2048)", 256, 2000], ["DRAM (65536 x 2048)", 65536, 10]]) {
  const W = 8 << 20, X = W + rows * cols, XS = X + 2 * cols, Y = XS + 4 * (cols / 64);
  for (let i = 0; i < rows * cols; i++) i8[W + i] = rnd();
  for (let c = 0; c < cols; c++) i16[X / 2 + c] = rnd();
  for (let b = 0; b < cols / 64; b++) f32[XS / 4 + b] = Math.fround(1 / (b + 3));
  const want = [];
  for (let r = 0; r < 8; r++) {
    let acc = 0;
    for (let b = 0; b < cols; b += 64) {
      let s = 0;
      for (let c = b; c < b + 64; c++) s += i8[W + r * cols + c] * i16[X / 2 + c];
      acc = Math.fround(acc + Math.fround(Math.fround(s) * f32[XS / 4 + b / 64]));
    }
    want.push(acc);
  }
  const best = names.map(() => 0), right = names.map(() => true);
  for (let round = 0; round < 4; round++)
    names.forEach((_, v) => {
      decode(v, W, rows, cols, X, XS, Y);
      if (!want.every((w, r) => f32[Y / 4 + r] === w)) right[v] = false;
      for (let t = 0; t < 5; t++) {
        const t0 = process.hrtime.bigint();
        for (let i = 0; i < reps; i++) decode(v, W, rows, cols, X, XS, Y);
        const s = Number(process.hrtime.bigint() - t0) / 1e9 / reps;
        best[v] = Math.max(best[v], (rows * cols) / s / 1e9);
      }
    });
  console.log(label);
  names.forEach((n, v) => console.log(`  ${n.padEnd(32)} ${best[v].toFixed(1).padStart(6)} GB/s${right[v] ? "" : "  WRONG SUMS"}`));
}
