/**
 * act-dtype-accuracy.ts — what each `--act-dtype` mode costs in accuracy, per backend (README
 * "Numerics", the mode table of bench/RESULTS.md). Measurements, not pass/fail tolerances
 * (test/engine.test.ts and test/trunk-q8-engine.test.ts hold each mode to its bound).
 *
 *   npx vite-node bench/act-dtype-accuracy.ts [--tokens 128] [--backend native|wasm|both]
 *
 * On the tiny presets (seed 0; seed 1 with group-limited routing), packed with the BF16 trunk and
 * with --trunk-dtype q8, each backend (default kernels) in each mode:
 * - prefill: the largest |logit difference| from the float64 reference (test/reference, run on the
 *   same dequantised Q8 weights) over every position of a 24-token prompt;
 * - N greedy tokens against the same engine in f32 (whose greedy tokens are the reference's: the
 *   engine tests check 32 of them): the first step where they differ, the top-1 agreement when the
 *   mode is fed f32's tokens (teacher forcing, so one early difference does not decide every later
 *   step), and the max |logit difference| along that path, beside the largest |logit| there.
 * Prints one Markdown table.
 */
import { join } from "node:path";

import { ACT_DTYPE_NAMES, type ActDtype, type CoreBackend } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { argmax } from "../test/reference/math.js";
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

const native = new NativeBackend();
const backends: CoreBackend[] = [];
if (which !== "wasm") backends.push(native);
if (which !== "native") backends.push(await WasmBackend.create({ memoryBytes: 512 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) }));

const tmp = tempDir("act-dtype-accuracy");
const rows: string[] = [];
try {
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), native, seed, extra);
    for (const trunk of ["bf16", "q8"] as const) {
      const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-${trunk}`), { core: native, allowRevision: true, trunkDtype: trunk });
      const reference = TextReference.load(ckpt, { q8Experts: true, q8Trunk: trunk === "q8" });
      const promptIds24 = promptIds(7, 24, reference.cfg.vocab_size);
      const want = reference.logits(promptIds24);
      for (const core of backends) {
        const kernels = core.defaultKernelSet();
        // greedy from the pack with one act dtype; fed `forced` instead of its own tokens if given
        const greedy = (actDtype: ActDtype, forced?: number[]): { tokens: number[]; logits: Float32Array[] } => {
          const engine = core.openEngine(pack, { nThreads: THREADS, actDtype });
          const session = engine.newSession({ maxContext: 6 + TOKENS + 1 });
          try {
            let logits = session.prefill(Int32Array.from(promptIds(11, 6, engine.info().vocabSize)), null, "last")!;
            const tokens: number[] = [];
            const all: Float32Array[] = [];
            for (let i = 0; i < TOKENS; i++) {
              all.push(logits.slice());
              tokens.push(argmax(logits));
              if (i + 1 < TOKENS) logits = session.step(forced ? forced[i]! : tokens.at(-1)!);
            }
            return { tokens, logits: all };
          } finally {
            session.close();
            engine.close();
          }
        };
        const prefillError = (actDtype: ActDtype): number => {
          const engine = core.openEngine(pack, { nThreads: THREADS, actDtype });
          const session = engine.newSession({ maxContext: 64 });
          try {
            const got = session.prefill(Int32Array.from(promptIds24), null, "all")!;
            let err = 0;
            for (let i = 0; i < got.length; i++) err = Math.max(err, Math.abs(got[i]! - want[i]!));
            return err;
          } finally {
            session.close();
            engine.close();
          }
        };
        const base = greedy("f32");
        let peak = 0;
        for (const l of base.logits) for (const v of l) peak = Math.max(peak, Math.abs(v));
        for (const mode of ACT_DTYPE_NAMES) {
          const free = mode === "f32" ? base : greedy(mode);
          const forced = mode === "f32" ? base : greedy(mode, base.tokens);
          const firstDiff = free.tokens.findIndex((t, i) => t !== base.tokens[i]);
          const agree = forced.tokens.filter((t, i) => t === base.tokens[i]).length;
          let err = 0;
          forced.logits.forEach((l, i) => l.forEach((v, k) => { err = Math.max(err, Math.abs(v - base.logits[i]![k]!)); }));
          rows.push(`| ${name} | ${trunk} | ${core.backend} (${kernels}) | ${mode} | ${prefillError(mode).toExponential(2)} | ` +
            `${firstDiff < 0 ? "none" : firstDiff} | ${agree}/${TOKENS} | ${err.toExponential(2)} (of ${peak.toFixed(1)}) |`);
          console.error(rows.at(-1));
        }
      }
    }
  }
} finally {
  for (const core of backends) core.close();
  if (!backends.includes(native)) native.close();
  tmp.cleanup();
}
console.log(`| model | trunk | backend (kernels) | mode | prefill: max abs logit error vs float64 reference | first greedy difference from f32 (of ${TOKENS}) | teacher-forced top-1 agreement with f32 | max abs logit difference from f32 along the path |`);
console.log("|---|---|---|---|---|---|---|---|");
for (const r of rows) console.log(r);
