/**
 * serve.ts — `kvl serve MODEL`: the local OpenAI-, Anthropic- and Ollama-compatible server
 * (docs/SERVER.md), with the model options of `kvl chat` (--backend and --instances among them).
 *
 * Owns: the command's own options and their defaults (the model options: options.ts
 * addModelOptions). Does not own: anything the server does (server/serve.ts and the rest of
 * server/).
 */
import { type Command, InvalidArgumentError } from "commander";

import { envRequiredText } from "../host/system/env.js";
import { DEFAULT_MODEL_ID } from "../server/app.js";
import { DEFAULT_HOST } from "../server/auth.js";
import { runServer } from "../server/serve.js";
import { type ModelCliOptions, addModelOptions, modelSettings, nonNegativeInt, positiveInt } from "./options.js";

interface ServeCommandOptions extends ModelCliOptions {
  host: string;
  port: number;
  apiKey?: string;
  modelId?: string;
  maxQueue: number;
  maxBodyMib?: number;
  allowOrigin?: string[];
  allowHost?: string[];
  verbose?: boolean;
}

/** A repeatable option: each use adds one value. */
function collect(value: string, previous: string[] | undefined): string[] {
  return [...(previous ?? []), value];
}

function port(value: string): number {
  const n = nonNegativeInt(value);
  if (n > 65535) throw new InvalidArgumentError("expected a port number (0 to 65535)");
  return n;
}

export function addServeCommand(program: Command): void {
  const command = program
    .command("serve")
    .description("serve a packed model over OpenAI-, Anthropic- and Ollama-compatible HTTP APIs (docs/SERVER.md)")
    .argument("<model>", "packed model directory (from kvl pack / kvl prepare)")
    .option("--host <address>", "address to bind (127.0.0.1: this machine only; another address also needs --api-key)", DEFAULT_HOST)
    .option("--port <n>", "TCP port (0: any free port, printed at start)", port, 8000)
    .option("--api-key <key>", "require this key (x-api-key or Authorization: Bearer) on every endpoint except /healthz " +
      "(default: $KVL_API_KEY, which keeps the key out of the process list)")
    .option("--model-id <id>", `the model id clients must send (default: ${DEFAULT_MODEL_ID}, or -q4 for a pack of 4-bit experts)`)
    .option("--allow-origin <origin>", "let web pages at this origin (e.g. http://localhost:3000; * matches any characters) use the " +
      "API from the browser; repeatable. Pages of other origins are refused (docs/SERVER.md)", collect)
    .option("--allow-host <name>", "also answer requests whose Host header is this name (a reverse proxy, a LAN name); repeatable. " +
      "Otherwise only localhost, loopback addresses and the address the server was reached at", collect);
  addModelOptions(command)
    .option("--max-queue <n>", "requests that may wait while one generates; more get HTTP 429", positiveInt, 8)
    .option("--max-body-mib <mib>", "largest accepted request body; larger ones get HTTP 413 (default: the most the RAM plan holds, " +
      "up to 20)", positiveInt)
    .option("--verbose", "also print the RAM plan's table")
    .action(async (model: string, opts: ServeCommandOptions) => {
      process.exitCode = await runServer({
        model, host: opts.host, port: opts.port, apiKey: opts.apiKey ?? envRequiredText("KVL_API_KEY") ?? null, modelId: opts.modelId,
        backend: opts.backend, ...modelSettings(opts), maxQueue: opts.maxQueue, maxBodyMib: opts.maxBodyMib ?? null,
        allowOrigins: opts.allowOrigin ?? [], allowHosts: opts.allowHost ?? [], verbose: opts.verbose ?? false,
      });
    });
}
