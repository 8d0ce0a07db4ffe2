/**
 * pack.ts — `kvl pack SRC DST` (and `kvl pack --synth-preset P DST`): parses the options, opens
 * the chosen core, reports; the packing is packer/pack.ts's.
 *
 * The experts' quantisation (Q8, or Q4 with --expert-dtype q4) runs in whichever core --backend (or KVL_BACKEND) chooses; both
 * give the same bytes. Status lines ("resuming ...", "packed into DST") and the progress bar go
 * to stderr (stdout stays free for what a script reads); --quiet silences both.
 */
import { type Command, Option } from "commander";

import { chooseBackend, openBackend } from "../host/core/backend.js";
import { type ExpertDtype, TRUNK_DTYPES, type TrunkDtype } from "../host/pack/pack-format.js";
import { UserError } from "../host/system/user-error.js";
import { PINNED_REVISION } from "../packer/hub.js";
import { packCheckpoint } from "../packer/pack.js";
import { silentProgress, stderrProgress } from "../packer/progress.js";
import { PRESETS, type Preset, SynthSource } from "../packer/synth.js";
import { backendOption, expertDtypeOption, nonNegativeInt } from "./options.js";

interface PackCommandOptions {
  allowRevision?: boolean;
  deleteConsumedShards?: boolean;
  synthPreset?: Preset;
  seed: number;
  trunkDtype: TrunkDtype;
  expertDtype: ExpertDtype;
  quiet?: boolean;
  backend?: string;
}

export function addPackCommand(program: Command): void {
  program
    .command("pack")
    .description("pack a checkpoint into a kvl runtime directory (resumable: rerun after any interruption)")
    .argument("[src]", "checkpoint directory: config.json, *.safetensors, model.safetensors.index.json (omit with --synth-preset)")
    .argument("[dst]", "output runtime directory (new or empty, or an unfinished pack of the same source)")
    .option("--allow-revision", `pack a source whose revision is not the pinned ${PINNED_REVISION.slice(0, 12)}…`)
    .option("--delete-consumed-shards", "delete each source shard once everything taken from it is durably packed")
    .addOption(new Option("--synth-preset <name>", "pack a synthesized random model directly (no shards written)").choices(PRESETS))
    .option("--seed <n>", "seed for --synth-preset", nonNegativeInt, 0)
    .addOption(new Option("--trunk-dtype <dtype>", "the trunk's Linear weights (attention, dense and shared MLPs, lm_head): " +
      "bf16 as the checkpoint, or q8 row-wise like the experts (half the bytes per token; accuracy: README Numerics)")
      .choices(TRUNK_DTYPES).default("bf16"))
    .addOption(expertDtypeOption())
    .option("--quiet", "no progress bar and no status lines")
    .addOption(backendOption())
    .action(async (src: string | undefined, dst: string | undefined, opts: PackCommandOptions) => {
      const paths = [src, dst].filter((p): p is string => p !== undefined);
      if (opts.synthPreset !== undefined && paths.length !== 1) {
        throw new UserError("with --synth-preset give only DST (the source is synthesized)");
      }
      if (opts.synthPreset === undefined && paths.length !== 2) {
        throw new UserError("expected SRC DST (a checkpoint directory and an output directory)");
      }
      const record = chooseBackend({ option: opts.backend });
      const core = await openBackend(record.chosen, record);
      const common = {
        core,
        trunkDtype: opts.trunkDtype,
        expertDtype: opts.expertDtype,
        deleteConsumedShards: opts.deleteConsumedShards === true,
        progress: opts.quiet ? silentProgress : stderrProgress(),
        ...(opts.quiet ? {} : { log: (line: string) => process.stderr.write(`${line}\n`) }),
      };
      try {
        if (opts.synthPreset !== undefined) {
          // A synthesized model has no hub revision by construction; asking for it is the consent.
          const source = new SynthSource({ preset: opts.synthPreset, seed: opts.seed, core });
          await packCheckpoint(source, paths[0]!, { ...common, allowRevision: true });
        } else {
          await packCheckpoint(paths[0]!, paths[1]!, { ...common, allowRevision: opts.allowRevision === true });
        }
      } finally {
        core.close();
      }
    });
}
