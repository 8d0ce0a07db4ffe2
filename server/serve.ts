/**
 * serve.ts — `kvl serve` as a process: checks the options, binds the port first (a busy port
 * fails in a second, not after the load), loads the model in the background (GET /healthz says
 * loading, then ready), serves until SIGINT/SIGTERM, then shuts down cleanly.
 *
 * Owns: option checks (UserErrors), the HTTP server and its listen socket (createHttpServer: the
 * Host/Origin rules, the body slots and the headers' deadline in front of the app), the startup
 * and ready lines on stderr (the load line between them is host/chat-model.ts loadLine), a
 * failed load stopping the server with exit status 1 (the reason on stderr), and shutdown (the
 * running reply stops, open streams end with an error event, waiting requests get 503, then
 * connections close and the engine closes; a second signal exits at once).
 * Does not own: the routes (app.ts), the queue (queue.ts), the model (model.ts).
 */
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, statSync } from "node:fs";
import { type RequestListener, type Server, createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";

import { chooseBackend } from "../host/core/backend.js";
import { loadLine } from "../host/chat-model.js";
import { checkPackFolder } from "../host/pack/pack-format.js";
import { MIB } from "../host/plan/core-bytes.js";
import { BODY_BYTES_FLOOR, bodySlots } from "../host/plan/input-lines.js";
import type { ModelOptions } from "../host/plan/settings.js";
import { UserError } from "../host/system/user-error.js";
import { type ServerConfig, createApp, defaultModelId } from "./app.js";
import { isLoopbackHost } from "./auth.js";
import { BodyGate, DEFAULT_READ_DEADLINES, gateBodies } from "./body.js";
import { AccessRules, guardRequests } from "./guard.js";
import { ChatServedModel } from "./model.js";
import { EngineQueue } from "./queue.js";

/** The server's options and the model's (ModelOptions: what runs it and what its plan holds). */
interface ServeOptions extends ModelOptions {
  model: string;
  host: string;
  port: number;
  apiKey: string | null;
  /** --model-id; absent: defaultModelId of what the pack's experts are stored as. */
  modelId?: string | undefined;
  /** --backend; KVL_BACKEND applies when absent. */
  backend?: string | undefined;
  maxQueue: number;
  /** null = auto: the RAM plan's body limit (plan/input-lines.ts). */
  maxBodyMib: number | null;
  /** --allow-host: more names the Host header may carry (guard.ts); "*" any. */
  allowHosts?: string[];
  /** --allow-origin: origins whose web pages may use the API (guard.ts). */
  allowOrigins?: string[];
  verbose?: boolean;
}

/** How long open connections get to finish after a signal before they are closed. */
const GRACE_MS = 5000;

function say(line: string): void {
  process.stderr.write(`${line}\n`);
}

/** What /api/tags reports of the pack: its size on disk, a digest of its completion record, when it was made. */
function packFacts(dir: string): ServerConfig["pack"] {
  let sizeBytes = 0;
  for (const entry of readdirSync(dir, { withFileTypes: true })) if (entry.isFile()) sizeBytes += statSync(join(dir, entry.name)).size;
  const marker = join(dir, "PACK_COMPLETE.json");
  try {
    const text = readFileSync(marker);
    // what the pack holds, as its marker says (the packer writes expert_dtype and trunk_dtype
    // only when they are not the defaults, q8 and bf16; FORMAT.md "Completion marker")
    const parsed = JSON.parse(text.toString("utf8")) as { expert_dtype?: unknown; trunk_dtype?: unknown };
    return {
      sizeBytes,
      digest: createHash("sha256").update(text).digest("hex"),
      modifiedAt: statSync(marker).mtime.toISOString(),
      expertDtype: parsed.expert_dtype === "q4" ? "q4" : "q8",
      trunkDtype: parsed.trunk_dtype === "q8" ? "q8" : "bf16",
    };
  } catch {
    return { sizeBytes, digest: "", modifiedAt: new Date(0).toISOString() };
  }
}

function checkServeOptions(o: ServeOptions): void {
  checkPackFolder(o.model);
  const ranges: Array<[string, number, number, number]> = [
    ["--port", o.port, 0, 65535], ["--max-queue", o.maxQueue, 1, 1 << 20], ["--max-context", o.maxContext, 2, 1 << 24],
  ];
  if (o.maxBodyMib !== null) ranges.push(["--max-body-mib", o.maxBodyMib, 1, 1 << 16]);
  for (const [name, value, low, high] of ranges) {
    if (!Number.isSafeInteger(value) || value < low || value > high) throw new UserError(`${name} ${value} is out of range (${low} to ${high})`);
  }
  if (o.apiKey !== null && o.apiKey.length === 0) throw new UserError("--api-key must not be empty");
  if (o.modelId !== undefined && !o.modelId) throw new UserError("--model-id must not be empty");
}

/**
 * The HTTP server over the app, in the order a request meets them: the Host and Origin rules
 * (guard.ts), a body slot (body.ts gateBodies, `admit` first: 503 while loading), the app; Node's
 * headersTimeout is the headers' deadline (the bodies' are in readJsonBody), and its
 * requestTimeout, past both, only ends connections whose body no route reads.
 */
export function createHttpServer(app: RequestListener, config: ServerConfig, rules: AccessRules, gate: BodyGate, admit: () => void,
  log: (line: string) => void): Server {
  const deadlines = config.deadlines ?? DEFAULT_READ_DEADLINES;
  const server = createServer({
    headersTimeout: deadlines.headersMs,
    requestTimeout: deadlines.headersMs + deadlines.bodyTotalMs + 1000,
    // how often Node looks for connections past headersTimeout (its default, 30 s, would double the deadline)
    connectionsCheckingInterval: Math.max(50, Math.min(1000, Math.floor(deadlines.headersMs / 4))),
  }, guardRequests(gateBodies(app, gate, admit, log, deadlines), rules, log, deadlines));
  server.keepAliveTimeout = 5000;
  return server;
}

/** Why a listen failed and what to do, by the OS's code: the port (in use, privileged) or the
 * address (not valid or no name resolves: ENOTFOUND; valid but not on this machine). */
export function listenErrorText(host: string, port: number, err: NodeJS.ErrnoException): string {
  const where = `cannot listen on ${host}:${port}`;
  const hosts = "give --host an address of this machine (127.0.0.1, the default; 0.0.0.0 for all of its interfaces)";
  switch (err.code) {
    case "EADDRINUSE":
      return `${where} (the port is in use); is another server using the port? choose another with --port`;
    case "EACCES":
      return `${where} (permission denied: ports below 1024 need privileges); choose a port of 1024 or more with --port`;
    case "ENOTFOUND":
    case "EAI_AGAIN":
      return `${where} ('${host}' is not a valid IP address, nor a name that resolves to one); ${hosts}`;
    case "EADDRNOTAVAIL":
      return `${where} (${host} is not an address of this machine); ${hosts}`;
    default:
      return `${where} (${err.message}); check --host and --port`;
  }
}

function listen(server: Server, host: string, port: number): Promise<AddressInfo> {
  return new Promise((resolve, reject) => {
    const onError = (err: NodeJS.ErrnoException): void => {
      server.off("listening", onListening);
      reject(new UserError(listenErrorText(host, port, err)));
    };
    const onListening = (): void => {
      server.off("error", onError);
      resolve(server.address() as AddressInfo);
    };
    server.once("error", onError);
    server.once("listening", onListening);
    server.listen({ host, port, exclusive: true });
  });
}

/** Runs the server until a signal (exit status 0) or a failed load (1). */
export async function runServer(o: ServeOptions): Promise<number> {
  const rules = new AccessRules({ bindHost: o.host, allowHosts: o.allowHosts ?? [], allowOrigins: o.allowOrigins ?? [] });
  checkServeOptions(o);
  const record = chooseBackend({ option: o.backend });
  const queue = new EngineQueue(o.maxQueue);
  // bodies are read only once the model is ready (gateBodies answers 503 before), under the
  // plan's limit, which replaces this placeholder then
  const pack = packFacts(o.model);
  const modelId = o.modelId ?? defaultModelId(pack.expertDtype ?? "q8");
  const config: ServerConfig = {
    modelId, apiKey: o.apiKey, maxContext: o.maxContext, maxBodyBytes: BODY_BYTES_FLOOR, vision: o.loadVision, pack,
  };
  const app = createApp(queue, config);
  const server = createHttpServer(app.callback(), config, rules, new BodyGate(bodySlots(o.maxQueue)), () => queue.requireReady(), say);
  const address = await listen(server, o.host, o.port);
  // once bound: an address that cannot be bound gets its own reason, not this warning
  if (!isLoopbackHost(o.host) && !o.apiKey) {
    say(`kvl serve: warning: listening on ${o.host} without --api-key; anyone who can reach this port can use the model`);
  }
  const shown = address.family === "IPv6" ? `[${address.address}]` : address.address;
  const pages = rules.listedOrigins.length ? `web pages of ${rules.listedOrigins.join(", ")} allowed` : "web pages of other origins refused (--allow-origin)";
  say(`kvl serve: loading ${o.model}; listening on http://${shown}:${address.port} (GET /healthz says when the model is ready; ${pages})`);

  let stopping = false;
  let exitCode = 0;
  const closed = new Promise<void>((resolve) => server.once("close", () => resolve()));
  const stop = (): void => {
    if (stopping) return;
    stopping = true;
    queue.beginShutdown(); // open streams end now with an error event, waiting requests get 503
    server.close();
    // a connection whose reply just ended (an open stream ends with an error event) goes idle:
    // close idle ones as they appear, all of them after the grace period
    const sweep = setInterval(() => server.closeIdleConnections(), 100);
    const force = setTimeout(() => server.closeAllConnections(), GRACE_MS);
    server.once("close", () => {
      clearInterval(sweep);
      clearTimeout(force);
    });
    server.closeIdleConnections();
  };
  const onSignal = (signal: NodeJS.Signals): void => {
    if (stopping) {
      say(`kvl serve: ${signal} again; exiting now`);
      process.exit(130);
    }
    say(`kvl serve: ${signal}: stopping`);
    stop();
  };
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);

  try {
    const failure = await queue.start(() => ChatServedModel.open(o.model, {
      backend: record, ramMib: o.ramMib, cacheMib: o.cacheMib, trunkCacheMib: o.trunkCacheMib, maxContext: o.maxContext,
      threads: o.threads, kernels: o.kernels, actDtype: o.actDtype, loadVision: o.loadVision, instances: o.instances, imageMaxPixels: o.imageMaxPixels,
      requests: { maxQueue: o.maxQueue, maxBodyBytes: o.maxBodyMib === null ? null : o.maxBodyMib * MIB },
    }));
    if (failure) {
      say(`kvl serve: error: cannot load the model: ${failure.message}`);
      if (!(failure instanceof UserError) && failure.stack) say(failure.stack);
      exitCode = 1;
      stop();
    } else if (!stopping) {
      const model = (queue.requireReady() as ChatServedModel).chat;
      config.maxBodyBytes = model.plan.requestBodies!.bodyBytes;
      say(loadLine("serve", model, o.verbose ?? false));
      if (o.verbose) say(model.plan.describe());
      say(`kvl serve: model ready as '${modelId}'; chat in a browser at http://${shown}:${address.port}/`);
    }
    await closed;
  } finally {
    process.off("SIGINT", onSignal);
    process.off("SIGTERM", onSignal);
    await queue.close().catch((err: Error) => say(`kvl serve: closing the engine failed: ${err.message}`));
  }
  return exitCode;
}
