/**
 * python-front-end.ts — the commands not yet ported to TypeScript, run by the Python front end
 * (kvl/, over the native library) until their TypeScript replacements land. Each port deletes
 * its Python module and its entry here, so there is always one implementation of a command.
 *
 * Owns: finding the Python interpreter and forwarding argv, stdio and the exit status.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { delimiter, join } from "node:path";

import { packageRoot } from "../host/paths.js";

/** The subcommands the Python front end still owns, with the text its help gives them. */
export const PYTHON_COMMANDS: Readonly<Record<string, string>> = {
  serve: "serve OpenAI- and Anthropic-compatible HTTP APIs",
};

export function pythonInterpreter(): string {
  if (process.env.KVL_PYTHON) return process.env.KVL_PYTHON;
  const venv = join(packageRoot, ".venv", process.platform === "win32" ? "Scripts/python.exe" : "bin/python");
  return existsSync(venv) ? venv : process.platform === "win32" ? "python" : "python3";
}

function pythonEnv(): NodeJS.ProcessEnv {
  const path = process.env.PYTHONPATH;
  return { ...process.env, PYTHONPATH: path ? `${packageRoot}${delimiter}${path}` : packageRoot };
}

/** Runs `python -m kvl COMMAND ARGS...` with this process's stdio; returns its exit status. */
export function runPythonCommand(command: string, args: readonly string[]): number {
  const python = pythonInterpreter();
  const result = spawnSync(python, ["-m", "kvl", command, ...args], { stdio: "inherit", env: pythonEnv() });
  if (result.error) {
    process.stderr.write(`kvl ${command}: cannot run the Python front end (${python}): ${result.error.message}\n` +
      "  install it with `python3 -m venv .venv && .venv/bin/pip install .` (or point KVL_PYTHON at a Python with kvl installed)\n");
    return 1;
  }
  if (result.signal) return 128 + (result.signal === "SIGINT" ? 2 : 15);
  return result.status ?? 1;
}

/** The option list of the Python command, for `kvl COMMAND --help`. */
export function pythonCommandHelp(command: string): string {
  const result = spawnSync(pythonInterpreter(), ["-m", "kvl", command, "--help"], {
    encoding: "utf8", env: pythonEnv(), timeout: 60_000,
  });
  if (result.status !== 0 || !result.stdout) return "\n(options: the Python front end is not installed here)\n";
  const at = result.stdout.search(/^(positional arguments|options):/m);
  return `\n${at >= 0 ? result.stdout.slice(at) : result.stdout}`;
}
