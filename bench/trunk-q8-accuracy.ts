/**
 * trunk-q8-accuracy.ts — what `kvl pack --trunk-dtype q8` costs in accuracy and saves in bytes
 * (README "Numerics"). Measurements, not pass/fail tolerances (test/trunk-q8-engine.test.ts holds
 * the engine to the Q8-dequantised reference within 1e-3).
 *
 *   npx vite-node bench/trunk-q8-accuracy.ts [--tokens 128]
 *
 * On the tiny presets (seed 0; seed 1 with group-limited routing), both packed with the default
 * BF16 trunk and with --trunk-dtype q8 (experts Q8 in both):
 *   - reference: the float64 reference (test/reference/) with the Q8 round trip of the trunk's
 *     Linear weights against the same reference on the BF16 trunk: max |logit difference| over
 *     every position of a 6-token prompt followed by the BF16 reference's greedy continuation;
 *   - engine (native, default kernels, FP32 activations): N greedy tokens from the q8 pack against
 *     N from the BF16 pack: the first step where they differ, and the top-1 agreement when the
 *     q8 engine is fed the BF16 engine's tokens (teacher forcing, so one early difference does not
 *     decide every later step); with the max |logit difference| along that path.
 * And, from the full-size config's shapes: trunk bytes a decoded token reads (every trunk record
 * but the embedding, which is read one row per token) with each trunk dtype.
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { isTrunkLinear, expectedTensors } from "../host/pack/model-spec.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { DTYPE_BF16, DTYPE_F32, DTYPE_Q8_ROWS, recordNbytes } from "../host/pack/pack-format.js";
import { packCheckpoint } from "../packer/pack.js";
import { presetConfigText } from "../packer/synth.js";
import { tempDir, TINY_MODELS, tinyCheckpoint } from "../test/support/pack-fixtures.js";
import { promptIds } from "../test/support/prompt-ids.js";
import { argmax } from "../test/reference/math.js";
import { TextReference } from "../test/reference/text.js";

const argTokens = process.argv.indexOf("--tokens");
const TOKENS = argTokens > 0 ? Number(process.argv[argTokens + 1]) : 128;

function maxAbs(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let m = 0;
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!));
  return m;
}

const native = new NativeBackend();
const tmp = tempDir("trunk-q8-accuracy");
try {
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), native, seed, extra);
    const bf16 = await packCheckpoint(ckpt, join(tmp.dir, `${name}-bf16`), { core: native, allowRevision: true });
    const q8 = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q8`), { core: native, allowRevision: true, trunkDtype: "q8" });
    const V = (JSON.parse(readFileSync(join(ckpt, "config.json"), "utf8")) as { text_config: { vocab_size: number } }).text_config.vocab_size;
    const prompt = promptIds(11, 6, V);

    // engine: greedy from each pack
    const greedy = (pack: string, forced?: number[]): { tokens: number[]; logits: Float32Array[] } => {
      const engine = native.openEngine(pack, { nThreads: 2 });
      const session = engine.newSession({ maxContext: prompt.length + TOKENS + 1 });
      try {
        let logits = session.prefill(Int32Array.from(prompt), null, "last")!;
        const tokens: number[] = [];
        const all: Float32Array[] = [];
        for (let i = 0; i < TOKENS; i++) {
          all.push(logits.slice());
          const t = forced ? forced[i]! : argmax(logits);
          tokens.push(argmax(logits));
          if (i + 1 < TOKENS) logits = session.step(t);
        }
        return { tokens, logits: all };
      } finally {
        session.close();
        engine.close();
      }
    };
    const base = greedy(bf16);
    const free = greedy(q8);
    const forced = greedy(q8, base.tokens);
    const firstDiff = free.tokens.findIndex((t, i) => t !== base.tokens[i]);
    const agree = forced.tokens.filter((t, i) => t === base.tokens[i]).length;
    let engineErr = 0;
    for (let i = 0; i < TOKENS; i++) engineErr = Math.max(engineErr, maxAbs(forced.logits[i]!, base.logits[i]!));

    // reference: Q8 trunk against BF16 trunk along the BF16 engine's path
    const seq = [...prompt, ...base.tokens.slice(0, TOKENS - 1)];
    const refBf16 = TextReference.load(ckpt, { q8Experts: true });
    const refQ8 = TextReference.load(ckpt, { q8Experts: true, q8Trunk: true });
    const want = refBf16.logits(seq);
    const got = refQ8.logits(seq);
    const refErr = maxAbs(got, want);
    // scale: these random-weight models have logits of a few hundred, so absolute errors are
    // read against the logits' own spread; and, for comparison, what Q8 experts alone cost
    let sq = 0;
    let sqDiff = 0;
    let peak = 0;
    for (let i = 0; i < want.length; i++) {
      sq += want[i]! ** 2;
      sqDiff += (got[i]! - want[i]!) ** 2;
      peak = Math.max(peak, Math.abs(want[i]!));
    }
    const rms = Math.sqrt(sq / want.length);
    const rmsDiff = Math.sqrt(sqDiff / want.length);
    const expertsErr = maxAbs(refBf16.logits(seq), TextReference.load(ckpt).logits(seq));
    console.log(`${name}: reference Q8 trunk vs BF16 trunk, ${seq.length} positions: max |logit diff| ${refErr.toExponential(2)}, ` +
      `rms diff ${rmsDiff.toExponential(2)}; logits rms ${rms.toExponential(2)}, max |logit| ${peak.toExponential(2)}; ` +
      `(Q8 experts vs BF16 experts, BF16 trunk: max |logit diff| ${expertsErr.toExponential(2)})`);
    console.log(`${name}: engine q8 pack vs bf16 pack, ${TOKENS} greedy tokens: ` +
      `${firstDiff < 0 ? "identical" : `first difference at token ${firstDiff}`}; teacher-forced top-1 agreement ` +
      `${agree}/${TOKENS}; max |logit diff| along the path ${engineErr.toExponential(2)}`);
  }

  // full-size trunk bytes per decoded token, from the config's shapes
  const full = JSON.parse(presetConfigText("full")) as unknown;
  const perToken = (q8: boolean): number => {
    let bytes = 0;
    for (const [tensor, info] of expectedTensors(full)) {
      if (!tensor.startsWith("language_model.") || tensor.includes(".mlp.experts.") || tensor.endsWith("embed_tokens.weight")) continue;
      const dtype = tensor.endsWith("e_score_correction_bias") ? DTYPE_F32 : q8 && isTrunkLinear(tensor) ? DTYPE_Q8_ROWS : DTYPE_BF16;
      bytes += recordNbytes(dtype, info.shape);
    }
    return bytes;
  };
  const [b, q] = [perToken(false), perToken(true)];
  console.log(`full size: trunk bytes per decoded token ${(b / 1e9).toFixed(3)} GB (bf16) -> ${(q / 1e9).toFixed(3)} GB (q8), ` +
    `saving ${((b - q) / 1e9).toFixed(3)} GB (${((100 * (b - q)) / b).toFixed(1)} %)`);
} finally {
  native.close();
  tmp.cleanup();
}
