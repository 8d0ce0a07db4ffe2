/**
 * synth.ts — `kvl synth OUT`: parses the options and reports; the checkpoint is packer/synth.ts's.
 */
import { readFileSync } from "node:fs";

import { type Command, Option } from "commander";

import { chooseBackend, openBackend } from "../host/core/backend.js";
import { stderrProgress } from "../packer/progress.js";
import { INDEX_NAME } from "../packer/safetensors.js";
import { PRESETS, type Preset, synthesize } from "../packer/synth.js";
import { backendOption, nonNegativeInt } from "./options.js";

export function addSynthCommand(program: Command): void {
  program
    .command("synth")
    .description("write a random-weight checkpoint in the official layout: for tests, benchmarks, and trying kvl without the " +
      "real weights (kvl prepare downloads those)")
    .argument("<out>", "output checkpoint directory")
    .addOption(new Option("--preset <name>", "tiny (about 43 MiB, every structural feature at small dims) or full (the real dims, about 33 GB)").choices(PRESETS).default("tiny"))
    .option("--seed <n>", "weights are a function of seed and tensor name", nonNegativeInt, 0)
    .addOption(new Option("--bias-dtype <dtype>", "on-disk dtype of the router correction bias").choices(["bf16", "f32"]).default("bf16"))
    .option("--n-group <n>", "expert groups for group-limited routing (with --topk-group)", nonNegativeInt)
    .option("--topk-group <n>", "groups kept per token (with --n-group)", nonNegativeInt)
    .addOption(backendOption())
    .action(async (out: string, opts: { preset: Preset; seed: number; biasDtype: "bf16" | "f32"; nGroup?: number; topkGroup?: number; backend?: string }) => {
      const record = chooseBackend({ option: opts.backend });
      const core = await openBackend(record.chosen, record);
      try {
        await synthesize(out, {
          preset: opts.preset, seed: opts.seed, biasDtype: opts.biasDtype, core,
          ...(opts.nGroup !== undefined ? { nGroup: opts.nGroup } : {}),
          ...(opts.topkGroup !== undefined ? { topkGroup: opts.topkGroup } : {}),
          ...(opts.preset === "full" ? { progress: stderrProgress() } : {}),
        });
      } finally {
        core.close();
      }
      const index = JSON.parse(readFileSync(`${out}/${INDEX_NAME}`, "utf8")) as { metadata: { total_size: number } };
      process.stdout.write(`wrote ${opts.preset} checkpoint (seed ${opts.seed}, ${(index.metadata.total_size / 2 ** 20).toFixed(1)} MiB of tensors) ` +
        `to ${out}; it has no source revision, so pack it with --allow-revision\n`);
    });
}
