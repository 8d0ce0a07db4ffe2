/**
 * grammar-mask.ts — what constrained decoding costs per decoded token on the full-size vocabulary
 * (163,840 ids), independent of the model (issue 37; bench/RESULTS.md "Constrained decoding").
 *
 *   npx vite-node bench/grammar-mask.ts [--replies 20] [--max-tokens 300]
 *
 * The vocabulary: kvl synth's stand-in tiktoken.model (163,584 byte-pair ranks, the real model's
 * count and structure) plus the 256 special slots, given to xgrammar as the engine worker does
 * (host/text/grammar/token-mask.ts). Timed once: the vocabulary's setup (xgrammar's tokenizer
 * info, its compiler, the UTF-8 tables) and the first compile of each grammar. Per decoded token,
 * over replies walked by random logits (the sampled id is the argmax of random logits after the
 * mask, so the walk wanders the grammar as a noisy model does): TokenMask.apply (xgrammar's
 * bitmask, the UTF-8 mask, the -inf writes into the logits) and TokenMask.accept. The mask runs
 * on the host in the engine worker, so it is the same on the native and the WebAssembly backend.
 */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { tokenizerAssets } from "../packer/synth-tokenizer.js";
import { jsonSchemaGrammar, type GrammarSpec } from "../host/text/grammar/grammar-spec.js";
import { GrammarEngine } from "../host/text/grammar/token-mask.js";
import { toolGrammar } from "../host/text/tool-format.js";

const VOCAB = 163_840;
const STOP = 163_586; // <|im_end|>
const arg = (name: string, fallback: number): number => {
  const at = process.argv.indexOf(name);
  return at >= 0 ? Number(process.argv[at + 1]) : fallback;
};
const REPLIES = arg("--replies", 20);
const MAX_TOKENS = arg("--max-tokens", 300);

const FORM = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 40 }, age: { type: "integer", minimum: 0, maximum: 130 }, kind: { enum: ["person", "company"] },
    emails: { type: "array", items: { type: "string", maxLength: 32 }, maxItems: 3 },
    address: { type: "object", properties: { city: { type: "string" }, zip: { type: ["string", "null"] } }, required: ["city", "zip"], additionalProperties: false },
  },
  required: ["name", "age", "kind", "emails", "address"], additionalProperties: false,
};

function quantile(sorted: number[], q: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
}

/** A small fast generator for the random logits (deterministic per reply). */
function rng(seed: number): () => number {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return (s >>> 0) / 2 ** 32;
  };
}

async function main(): Promise<void> {
  const dir = mkdtempSync(join(tmpdir(), "kvl-grammar-bench-"));
  try {
    for (const [name, bytes] of tokenizerAssets()) writeFileSync(join(dir, name), bytes);
    const engine = new GrammarEngine(dir, VOCAB);
    const specs: Array<[string, GrammarSpec]> = [
      ["json_schema (nested form)", jsonSchemaGrammar(FORM)],
      ["json_object", jsonSchemaGrammar({ type: "object", additionalProperties: true })],
      ["tools, required (2 tools)", toolGrammar([
        { name: "get_weather", description: "", parameters: { type: "object", properties: { city: { type: "string" }, unit: { enum: ["C", "F"] } }, required: ["city", "unit"] } },
        { name: "add", description: "", parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"] } },
      ], { kind: "required" })!],
    ];
    let t = performance.now();
    await engine.constrain(specs[1]![1], [STOP]).then((m) => m.dispose()); // vocabulary setup + one compile
    console.log(`vocabulary setup + first compile (json_object): ${((performance.now() - t) / 1000).toFixed(3)} s`);
    const logits = new Float32Array(VOCAB);
    for (const [label, spec] of specs) {
      t = performance.now();
      (await engine.constrain(spec, [STOP])).dispose();
      const compileMs = performance.now() - t;
      const apply: number[] = [];
      const accept: number[] = [];
      for (let reply = 0; reply < REPLIES; reply++) {
        const mask = await engine.constrain(spec, [STOP]);
        const random = rng(reply + 1);
        for (let step = 0; step < MAX_TOKENS; step++) {
          for (let i = 0; i < VOCAB; i++) logits[i] = random();
          let t0 = performance.now();
          await mask.apply(logits);
          apply.push(performance.now() - t0);
          let best = 0;
          for (let i = 1; i < VOCAB; i++) if (logits[i]! > logits[best]!) best = i;
          if (best === STOP) break;
          t0 = performance.now();
          mask.accept(best);
          accept.push(performance.now() - t0);
        }
        mask.dispose();
      }
      const total = apply.map((a, i) => a + (accept[i] ?? 0)).sort((a, b) => a - b);
      apply.sort((a, b) => a - b);
      const mean = total.reduce((s, x) => s + x, 0) / total.length;
      console.log(`${label}: compile ${compileMs.toFixed(1)} ms (cached after); ${total.length} tokens over ${REPLIES} replies; ` +
        `mask+accept per token: mean ${mean.toFixed(3)} ms, median ${quantile(total, 0.5).toFixed(3)}, p90 ${quantile(total, 0.9).toFixed(3)}, ` +
        `p99 ${quantile(total, 0.99).toFixed(3)}, max ${total.at(-1)!.toFixed(3)} ms; apply alone median ${quantile(apply, 0.5).toFixed(3)} ms`);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
