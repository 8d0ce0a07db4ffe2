/**
 * prepare.ts — `kvl prepare DST`: parses the options and reports; downloading and packing are
 * packer/prepare.ts's.
 *
 * Owns: the command's options (--revision, --keep-download, --ram-budget, --expert-dtype, --quiet, --backend),
 * the size syntax of --ram-budget, and printing a UserError as one `kvl prepare: error: ...` line
 * (exit status 1).
 */
import { type Command, InvalidArgumentError, Option } from "commander";

import { chooseBackend, openBackend } from "../host/core/backend.js";
import type { ExpertDtype } from "../host/pack/pack-format.js";
import { PINNED_REVISION } from "../packer/hub.js";
import { prepare } from "../packer/prepare.js";
import { silentProgress, stderrProgress } from "../packer/progress.js";
import { backendOption, expertDtypeOption } from "./options.js";

/** A size in MiB: a plain number is MiB; k/m/g/t with an optional i and b (6000, 6000MiB, 8GiB). */
function parseSizeMib(text: string): number | "auto" {
  if (text === "auto") return text;
  const m = /^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?)?\s*$/.exec(text.toLowerCase());
  if (!m) throw new InvalidArgumentError(`'${text}' is not a size (examples: auto, 6000, 6000MiB, 8GiB)`);
  const unit = (m[2] ?? "m")[0] as "k" | "m" | "g" | "t";
  const factor = { k: 1 / 1024, m: 1, g: 1024, t: 1024 * 1024 }[unit];
  return Math.floor(Number(m[1]) * factor);
}

interface PrepareFlags {
  revision: string;
  keepDownload?: boolean;
  ramBudget: number | "auto";
  expertDtype: ExpertDtype;
  quiet?: boolean;
  backend?: string;
}

export function addPrepareCommand(program: Command): void {
  program
    .command("prepare")
    .description("download the pinned Kimi-VL-A3B-Instruct checkpoint from the Hugging Face hub (HF_ENDPOINT) and pack it, with about one shard of scratch space")
    .argument("<dst>", "runtime directory to create")
    .addOption(new Option("--revision <rev>", `hub revision (default: the pinned ${PINNED_REVISION}); another one is packed with a warning`).default(PINNED_REVISION))
    .option("--keep-download", "keep the downloaded files in DST/.download (needs ~33 GB more disk)")
    .option("--ram-budget <size>", "RAM budget for the final check: auto (what this machine can give now; a plan that does not fit is a note) " +
      "or MiB, or with a unit: 8GiB (a plan that does not fit is an error)", parseSizeMib, "auto")
    .addOption(expertDtypeOption())
    .option("--quiet", "no progress bar")
    .addOption(backendOption())
    .action(async (dst: string, opts: PrepareFlags) => {
      const record = chooseBackend({ option: opts.backend });
      const core = await openBackend(record.chosen, record);
      try {
        await prepare(dst, {
          core,
          revision: opts.revision,
          keepDownload: opts.keepDownload === true,
          ramBudgetMib: opts.ramBudget,
          expertDtype: opts.expertDtype,
          planBackend: record.chosen,
          progress: opts.quiet ? silentProgress : stderrProgress(),
        });
      } finally {
        core.close();
      }
    });
}
