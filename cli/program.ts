/**
 * program.ts — the `kvl` command tree (commander): parses arguments and renders results; no model
 * logic. cli/kvl.ts runs it.
 *
 * Owns: the command tree, its help, --version, and exit statuses, and how errors reach the user:
 * an error the user can fix (UserError, BackendError, a file-system error such as ENOSPC or
 * EACCES: user-error.ts fsUserError; a bad KVL_* variable, checked before any command runs) is
 * one line `kvl CMD: error: ...` and exit status 1; a mistyped command line is commander's one
 * line with the same prefix (no help dump: --help shows it); an argument that is not UTF-8 is
 * refused before any command runs (host/system/argv-text.ts); anything else is a bug and keeps its stack. Every command
 * is TypeScript: `chat`, `serve`, `bench`, `doctor` (with or without a model), `synth`, `pack`,
 * `prepare`.
 */

import { Command } from "commander";

import { BackendError, chooseBackend } from "../host/core/backend.js";
import { readBuildInfo } from "../host/system/build-info.js";
import { UserError, fsUserError } from "../host/system/user-error.js";
import { nonUtf8Argument } from "../host/system/argv-text.js";
import { silentProgress, stderrProgress } from "../packer/progress.js";
import { addBenchCommand } from "./bench.js";
import { addChatCommand } from "./chat.js";
import { runModelDoctor } from "../host/engine/model-doctor.js";
import { PINNED_REVISION } from "../packer/hub.js";
import { renderModelDoctor } from "./doctor-model.js";
import { renderDoctor, runDoctor } from "./doctor.js";
import { type ModelCliOptions, addModelOptions, checkEnvironment, modelSettings } from "./options.js";
import { addPackCommand } from "./pack.js";
import { addPrepareCommand } from "./prepare.js";
import { addServeCommand } from "./serve.js";
import { addSynthCommand } from "./synth.js";

interface DoctorOptions extends ModelCliOptions {
  json?: boolean;
  quick?: boolean;
  verbose?: boolean;
  quiet?: boolean;
}

/** kvl --version: the build (version, commit), the Node it runs on and the backend auto picks. */
function versionLine(): string {
  const { version, commit } = readBuildInfo();
  let backend: string;
  try {
    const r = chooseBackend();
    backend = r.chosen === "native" ? `native ${r.native.defaultKernelSet} (${r.native.origin} addon)` : `wasm (${r.reason})`;
  } catch (err) {
    backend = `none (${(err as Error).message})`;
  }
  return `kvl ${version} (commit ${commit ?? "unknown"}; Node ${process.version} ${process.platform}-${process.arch}; backend ${backend})`;
}

/** `kvl CMD` as the prefix of every error line (the command the arguments name, else `kvl`). */
function errorPrefix(argv: readonly string[]): string {
  const command = argv.slice(2).find((a) => !a.startsWith("-"));
  return command && COMMANDS.includes(command) ? `kvl ${command}` : "kvl";
}

const COMMANDS = ["doctor", "chat", "bench", "serve", "synth", "pack", "prepare"];

function buildProgram(who: string): Command {
  const program = new Command("kvl")
    .description("CPU-first, low-RAM inference runtime for Kimi-VL-A3B-Instruct")
    .option("-V, --version", "print kvl's build: version, commit, Node and the backend it runs")
    .on("option:version", () => {
      process.stdout.write(`${versionLine()}\n`);
      process.exit(0);
    })
    .exitOverride()
    // commander's own errors (an unknown option, a missing argument, a bad choice) get the prefix
    // every other error has; set before the commands are added, which inherit it
    .configureOutput({ outputError: (text, write) => write(text.startsWith("error: ") ? `${who}: ${text}` : text) })
    .hook("preAction", () => checkEnvironment());

  const doctor = program
    .command("doctor")
    .description("check this machine: backends, kernel sets and their self-test; with MODEL: the packed model, " +
      "its data, the act mode and the RAM plan for the model options (as kvl chat and serve take them), direct I/O and a short generation")
    .argument("[model]", "packed model directory");
  addModelOptions(doctor)
    .option("--json", "print the report as JSON")
    .option("--quick", "MODEL: skip the CRC of every tensor's data (reading the whole pack)")
    .option("--verbose", "MODEL: also print the RAM plan's table")
    .option("--quiet", "MODEL: no progress on stderr")
    .action(async (model: string | undefined, opts: DoctorOptions) => {
      if (model !== undefined) {
        const report = await runModelDoctor(model, {
          backend: opts.backend, ...modelSettings(opts), quick: opts.quick ?? false, pinnedRevision: PINNED_REVISION,
          progress: opts.quiet ? silentProgress : stderrProgress(),
        });
        process.stdout.write(opts.json ? `${JSON.stringify(report, null, 2)}\n` : `${renderModelDoctor(report, opts.verbose ?? false)}\n`);
        process.exitCode = report.pass ? 0 : 1;
        return;
      }
      const report = await runDoctor(opts.backend);
      process.stdout.write(opts.json ? `${JSON.stringify(report, null, 2)}\n` : `${renderDoctor(report)}\n`);
      process.exitCode = report.pass ? 0 : 1;
    });

  addChatCommand(program);
  addBenchCommand(program);
  addServeCommand(program);
  addSynthCommand(program);
  addPackCommand(program);
  addPrepareCommand(program);

  return program;
}

/** Runs `kvl` with these arguments (process.argv layout); sets process.exitCode. */
export async function runKvl(argv: string[]): Promise<void> {
  const who = errorPrefix(argv);
  // before anything runs or is written: a name Node could not hold would be "not found", or
  // created with U+FFFD in it
  const notUtf8 = nonUtf8Argument(argv.slice(2));
  if (notUtf8) {
    process.stderr.write(`${who}: error: ${notUtf8.message}\n`);
    process.exitCode = 1;
    return;
  }
  const program = buildProgram(who);
  if (program.commands.some((c) => !COMMANDS.includes(c.name()))) throw new Error("COMMANDS must list every command");
  try {
    await program.parseAsync(argv);
  } catch (err) {
    const code = (err as { exitCode?: number }).exitCode;
    if (typeof code === "number") {
      process.exitCode = code;
      return;
    }
    const userError = err instanceof UserError || err instanceof BackendError ? err : fsUserError(err);
    if (userError !== null) {
      process.stderr.write(`${who}: error: ${userError.message}\n`);
    } else {
      process.stderr.write(`${who}: internal error (a bug; please report it with this output):\n` +
        `${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
    }
    process.exitCode = 1;
  }
}

