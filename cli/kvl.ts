#!/usr/bin/env node
/**
 * kvl.ts — the `kvl` command (commander): parses arguments and renders results; no model logic.
 *
 * Owns: the command tree, its help, and exit statuses. `doctor` without a model is TypeScript;
 * the commands listed in python-front-end.ts still run on the Python front end and are replaced
 * one by one.
 */
import { Command, Option } from "commander";

import { BACKEND_REQUESTS } from "../host/backend.js";
import { renderDoctor, runDoctor } from "./doctor.js";
import { PYTHON_COMMANDS, pythonCommandHelp, runPythonCommand } from "./python-front-end.js";

function backendOption(): Option {
  return new Option("--backend <name>", "core build to run: auto picks the native addon where it loads, else WebAssembly (env KVL_BACKEND)")
    .choices(BACKEND_REQUESTS);
}

export function buildProgram(): Command {
  const program = new Command("kvl")
    .description("CPU-first, low-RAM inference runtime for Kimi-VL-A3B-Instruct")
    .showHelpAfterError()
    .exitOverride();

  program
    .command("doctor")
    .description("check this machine: backends, kernel sets and their self-test (with MODEL: the packed model too)")
    .argument("[model]", "packed model directory (checked by the model doctor)")
    .addOption(backendOption())
    .option("--json", "print the report as JSON")
    .allowUnknownOption(true)
    .action(async (model: string | undefined, opts: { backend?: string; json?: boolean }, cmd: Command) => {
      if (model !== undefined) {
        // The model checks (pack consistency, planner, a one-token run) are the Python doctor's.
        process.exitCode = runPythonCommand("doctor", cmd.args);
        return;
      }
      const report = await runDoctor(opts.backend);
      process.stdout.write(opts.json ? `${JSON.stringify(report, null, 2)}\n` : `${renderDoctor(report)}\n`);
      process.exitCode = report.pass ? 0 : 1;
    });

  for (const [name, description] of Object.entries(PYTHON_COMMANDS)) {
    const sub = program
      .command(name)
      .description(description)
      .argument("[args...]", "arguments and options of the command (below)")
      .allowUnknownOption(true)
      .helpOption(false)
      .option("-h, --help", "show this help")
      .addHelpText("after", () => pythonCommandHelp(name));
    if (name !== "synth") sub.addOption(backendOption());
    sub.action((_args: string[], opts: { backend?: string; help?: boolean }, cmd: Command) => {
      if (opts.help) {
        cmd.help();
      }
      const requested = opts.backend ?? process.env.KVL_BACKEND;
      if (requested === "wasm") {
        process.stderr.write(`kvl ${name}: the WebAssembly backend does not run this command yet; ` +
          "it runs on the native core (use --backend native or auto)\n");
        process.exitCode = 2;
        return;
      }
      process.exitCode = runPythonCommand(name, cmd.args);
    });
  }
  return program;
}

async function main(argv: string[]): Promise<void> {
  const program = buildProgram();
  try {
    await program.parseAsync(argv);
  } catch (err) {
    const code = (err as { exitCode?: number }).exitCode;
    if (typeof code === "number") {
      process.exitCode = code;
      return;
    }
    process.stderr.write(`kvl: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exitCode = 1;
  }
}

await main(process.argv);
