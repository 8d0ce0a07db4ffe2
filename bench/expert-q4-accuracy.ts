/**
 * expert-q4-accuracy.ts — what `kvl pack --expert-dtype q4` costs in accuracy against Q8 experts
 * (README "Numerics"). Measurements, not pass/fail tolerances (test/expert-q4-engine.test.ts holds
 * the engine to the Q4-dequantised reference).
 *
 *   npx vite-node bench/expert-q4-accuracy.ts [--tokens 128] [--backend native|wasm|both]
 *
 * Against the float64 reference of the ORIGINAL BF16 weights (test/reference/, no quantisation),
 * on the tiny presets (seed 0; seed 1 with group-limited routing), each packed with Q8 experts
 * (the default) and with Q4 experts (BF16 trunk in both):
 *   - the path: the BF16 reference's own greedy continuation, N tokens after a 6-token prompt;
 *   - "reference" rows: the float64 reference on the dequantised Q8 / Q4 experts (what the
 *     storage alone costs, exact arithmetic);
 *   - engine rows, each backend (default kernels) in each --act-dtype: the engine prefilled with the
 *     prompt and fed the path's tokens (teacher forcing, so one early difference does not decide
 *     every later step);
 *   each over the N steps: max and rms |logit difference| from the BF16 reference, and the
 *   top-1 agreement with the path.
 * Then one full-size expert (layer 1, expert 0 of the `full` preset's synthetic weights: I = 1408,
 * H = 2048; uniform random weights, not the real checkpoint's): the relative rms error of each
 * matrix and of the expert's SwiGLU output on 16 random inputs, Q8 and Q4 against BF16, in float64.
 * Prints Markdown tables.
 */
import { join } from "node:path";

import { ACT_DTYPE_NAMES, type ActDtype, type CoreBackend } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { type ExpertDtype } from "../host/pack/pack-format.js";
import { packCheckpoint } from "../packer/pack.js";
import { SynthSource } from "../packer/synth.js";
import { q4RoundtripGroups, q8RoundtripRows } from "../test/reference/checkpoint.js";
import { argmax, type Tensor } from "../test/reference/math.js";
import { TextReference } from "../test/reference/text.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "../test/support/pack-fixtures.js";
import { promptIds } from "../test/support/prompt-ids.js";

const arg = (name: string): string | undefined => {
  const i = process.argv.indexOf(name);
  return i > 0 ? process.argv[i + 1] : undefined;
};
const TOKENS = Number(arg("--tokens") ?? 128);
const which = arg("--backend") ?? "both";
const THREADS = 2;
const EXPERT_DTYPES: readonly ExpertDtype[] = ["q8", "q4"];

/** max |a - b|, rms (a - b) and the top-1 agreement with `path` over `steps` rows of V logits. */
function compare(got: ArrayLike<number>[], want: Float64Array, V: number, path: number[]): { max: number; rms: number; agree: number } {
  let max = 0;
  let sq = 0;
  let agree = 0;
  got.forEach((row, i) => {
    for (let k = 0; k < V; k++) {
      const d = row[k]! - want[i * V + k]!;
      max = Math.max(max, Math.abs(d));
      sq += d * d;
    }
    if (argmax(row) === path[i]) agree++;
  });
  return { max, rms: Math.sqrt(sq / (got.length * V)), agree };
}

const native = new NativeBackend();
const backends: CoreBackend[] = [];
if (which !== "wasm") backends.push(native);
if (which !== "native") backends.push(await WasmBackend.create({ memoryBytes: 512 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) }));

const tmp = tempDir("expert-q4-accuracy");
const rows: string[] = [];
const row = (cells: Array<string | number>): void => {
  rows.push(`| ${cells.join(" | ")} |`);
  console.error(rows.at(-1));
};
try {
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), native, seed, extra);
    const exact = TextReference.load(ckpt);
    const V = exact.cfg.vocab_size;
    const H = exact.cfg.hidden_size;
    const prompt = promptIds(11, 6, V);
    // the BF16 reference's greedy path, and its logits at each of the N steps
    const seq = [...prompt];
    const path: number[] = [];
    for (let i = 0; i < TOKENS; i++) {
      const last = exact.logitsFromHidden(exact.hiddenStates(seq).subarray((seq.length - 1) * H), 1);
      path.push(argmax(last));
      seq.push(path.at(-1)!);
    }
    const along = seq.slice(0, prompt.length + TOKENS - 1); // the inputs whose next-token logits are the N steps
    const wantAll = exact.logits(along);
    const want = wantAll.subarray((prompt.length - 1) * V);
    let peak = 0;
    for (const v of want) peak = Math.max(peak, Math.abs(v));
    const rowsOf = (all: Float64Array): Float64Array[] =>
      Array.from({ length: TOKENS }, (_, i) => all.subarray((prompt.length - 1 + i) * V, (prompt.length + i) * V));
    for (const experts of EXPERT_DTYPES) {
      const ref = TextReference.load(ckpt, experts === "q4" ? { q4Experts: true } : { q8Experts: true });
      const r = compare(rowsOf(ref.logits(along)), want, V, path);
      row([name, experts, "reference (float64)", "exact", r.max.toExponential(2), r.rms.toExponential(2), `${r.agree}/${TOKENS}`, peak.toFixed(1)]);
      const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-${experts}`), { core: native, allowRevision: true, expertDtype: experts });
      for (const core of backends) {
        for (const mode of ACT_DTYPE_NAMES) {
          const engine = core.openEngine(pack, { nThreads: THREADS, actDtype: mode as ActDtype });
          const session = engine.newSession({ maxContext: prompt.length + TOKENS + 1 });
          const got: Float32Array[] = [];
          try {
            let logits = session.prefill(Int32Array.from(prompt), null, "last")!;
            for (let i = 0; i < TOKENS; i++) {
              got.push(logits.slice());
              if (i + 1 < TOKENS) logits = session.step(path[i]!);
            }
          } finally {
            session.close();
            engine.close();
          }
          const e = compare(got, want, V, path);
          row([name, experts, `${core.backend} (${core.defaultKernelSet()})`, mode, e.max.toExponential(2), e.rms.toExponential(2), `${e.agree}/${TOKENS}`, peak.toFixed(1)]);
        }
      }
    }
  }
  console.log(`| model | experts | run | --act-dtype | max abs logit diff from the BF16 float64 reference | rms logit diff | teacher-forced top-1 agreement | largest abs logit |`);
  console.log("|---|---|---|---|---|---|---|---|");
  for (const r of rows) console.log(r);

  // one full-size expert, float64
  const source = new SynthSource({ preset: "full", seed: 0, core: native });
  const bits = async (p: string): Promise<Tensor> => {
    const name = `language_model.model.layers.1.mlp.experts.0.${p}.weight`;
    const raw = await source.read(name);
    const u16 = new Uint16Array(raw.buffer, raw.byteOffset, raw.byteLength / 2);
    return { shape: [...source.tensorInfo(name).shape], data: Float64Array.from(u16, (b) => new Float32Array(new Uint32Array([b << 16]).buffer)[0]!) };
  };
  const w = { gate: await bits("gate_proj"), up: await bits("up_proj"), down: await bits("down_proj") };
  const [I, Hf] = w.gate.shape as [number, number];
  const matvec = (m: Tensor, x: Float64Array): Float64Array => {
    const [r, c] = m.shape as [number, number];
    const y = new Float64Array(r);
    for (let i = 0; i < r; i++) {
      let s = 0;
      for (let k = 0; k < c; k++) s += m.data[i * c + k]! * x[k]!;
      y[i] = s;
    }
    return y;
  };
  const expertOut = (ws: typeof w, x: Float64Array): Float64Array => {
    const g = matvec(ws.gate, x);
    const u = matvec(ws.up, x);
    const h = g.map((v, i) => (v / (1 + Math.exp(-v))) * u[i]!);
    return matvec(ws.down, h);
  };
  const relRms = (a: ArrayLike<number>, b: ArrayLike<number>): number => {
    let n = 0;
    let d = 0;
    for (let i = 0; i < a.length; i++) {
      n += b[i]! ** 2;
      d += (a[i]! - b[i]!) ** 2;
    }
    return Math.sqrt(d / n);
  };
  let s = 7;
  const rand = (): number => {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    return ((s >>> 8) / 2 ** 24 - 0.5) * 2;
  };
  const inputs = Array.from({ length: 16 }, () => Float64Array.from({ length: Hf }, rand));
  console.log("");
  console.log(`| full-size expert (I ${I}, H ${Hf}; synthetic uniform weights) | gate rel. rms error | up | down | SwiGLU output rel. rms error (16 random inputs) |`);
  console.log("|---|---|---|---|---|");
  for (const [label, round] of [["q8 (row-wise)", q8RoundtripRows], ["q4 (groups of 32, BF16 scale)", q4RoundtripGroups]] as const) {
    const q = { gate: round(w.gate), up: round(w.up), down: round(w.down) };
    let out = 0;
    for (const x of inputs) out += relRms(expertOut(q, x), expertOut(w, x)) ** 2;
    console.log(`| ${label} | ${relRms(q.gate.data, w.gate.data).toExponential(2)} | ${relRms(q.up.data, w.up.data).toExponential(2)} | ` +
      `${relRms(q.down.data, w.down.data).toExponential(2)} | ${Math.sqrt(out / inputs.length).toExponential(2)} |`);
  }
} finally {
  for (const core of backends) core.close();
  if (!backends.includes(native)) native.close();
  tmp.cleanup();
}
