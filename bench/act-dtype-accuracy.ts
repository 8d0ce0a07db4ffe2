/**
 * act-dtype-accuracy.ts — what the integer `--act-dtype` modes cost in accuracy over a long
 * generation (README "Numerics"). Measurements, not pass/fail tolerances (test/engine.test.ts and
 * test/trunk-q8-engine.test.ts hold each mode to its bound of the float64 reference).
 *
 *   npx vite-node bench/act-dtype-accuracy.ts [--tokens 128]
 *
 * On the tiny presets (seed 0; seed 1 with group-limited routing), packed with the BF16 trunk and
 * with --trunk-dtype q8, the native engine (default kernels) with each of i16, i16x1 and i8
 * against itself with FP32 activations (`f32`, exact within 1e-3 of the reference): N greedy
 * tokens, the first step where they differ from f32's, the top-1 agreement when the mode is fed
 * f32's tokens (teacher forcing, so one early difference does not decide every later step), and
 * the max |logit difference| along that path, beside the largest |logit| there.
 */
import { join } from "node:path";

import type { ActDtype } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { argmax } from "../test/reference/math.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "../test/support/pack-fixtures.js";
import { promptIds } from "../test/support/prompt-ids.js";

const argTokens = process.argv.indexOf("--tokens");
const TOKENS = argTokens > 0 ? Number(process.argv[argTokens + 1]) : 128;
const MODES: ActDtype[] = ["i16", "i16x1", "i8"];

const native = new NativeBackend();
const tmp = tempDir("act-dtype-accuracy");
try {
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), native, seed, extra);
    for (const trunk of ["bf16", "q8"] as const) {
      const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-${trunk}`), { core: native, allowRevision: true, trunkDtype: trunk });
      // greedy from the pack with one act dtype; fed `forced` instead of its own tokens if given
      const greedy = (actDtype: ActDtype, forced?: number[]): { tokens: number[]; logits: Float32Array[] } => {
        const engine = native.openEngine(pack, { nThreads: 2, actDtype });
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
      const base = greedy("f32");
      let peak = 0;
      for (const l of base.logits) for (const v of l) peak = Math.max(peak, Math.abs(v));
      for (const mode of MODES) {
        const free = greedy(mode);
        const forced = greedy(mode, base.tokens);
        const firstDiff = free.tokens.findIndex((t, i) => t !== base.tokens[i]);
        const agree = forced.tokens.filter((t, i) => t === base.tokens[i]).length;
        let err = 0;
        forced.logits.forEach((l, i) => l.forEach((v, k) => { err = Math.max(err, Math.abs(v - base.logits[i]![k]!)); }));
        console.log(`${name}, ${trunk} trunk, ${mode} vs f32, ${TOKENS} greedy tokens: ` +
          `${firstDiff < 0 ? "identical" : `first difference at token ${firstDiff}`}; teacher-forced top-1 agreement ` +
          `${agree}/${TOKENS}; max |logit diff| along the path ${err.toExponential(2)} (largest |logit| ${peak.toFixed(1)})`);
      }
    }
  }
} finally {
  native.close();
  tmp.cleanup();
}
