/**
 * live-server.ts — `kvl serve` as a user runs it, for the tests that need a real server: the
 * compiled CLI (dist/cli/kvl.js) in a child process on 127.0.0.1, port 0, waited for until
 * /healthz says ready; its stdout and stderr kept as one log; stopped with SIGTERM (SIGKILL after
 * 20 s, so a test never leaves a server behind); clients for it (the official `openai` and
 * `@anthropic-ai/sdk`, raw fetch) and `kvl` run as a child without blocking the event loop.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { join } from "node:path";

import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

import { packageRoot } from "../../host/system/paths.js";

export const KVL = join(packageRoot, "dist", "cli", "kvl.js");

/** The environment of a child kvl: this process's, without the variables that would pick its
 * backend, split or key behind the test's back, plus `extra`. */
export function childEnv(extra: Record<string, string>): NodeJS.ProcessEnv {
  const env = { ...process.env };
  delete env.KVL_BACKEND;
  delete env.KVL_INSTANCES;
  delete env.KVL_API_KEY;
  return { ...env, ...extra };
}

export class LiveServer {
  #log = "";
  readonly exited: Promise<number | null>;
  url = "";

  /** @param key the server's --api-key, which the clients below send unless told otherwise */
  constructor(readonly child: ChildProcess, readonly key: string) {
    child.stdout!.on("data", (d: Buffer) => {
      this.#log += d.toString();
    });
    child.stderr!.on("data", (d: Buffer) => {
      this.#log += d.toString();
    });
    this.exited = new Promise((resolve) => child.on("exit", (code) => resolve(code)));
  }

  log(): string {
    return this.#log;
  }

  openai(key = this.key): OpenAI {
    return new OpenAI({ baseURL: `${this.url}/v1`, apiKey: key, maxRetries: 0, timeout: 120_000 });
  }

  anthropic(key = this.key): Anthropic {
    return new Anthropic({ baseURL: this.url, apiKey: key, maxRetries: 0, timeout: 120_000 });
  }

  /** A POST with a JSON (or raw string / bytes) body; the answer's status, text, JSON if any, headers. */
  async post(path: string, body: unknown, headers: Record<string, string> = { "x-api-key": this.key }): Promise<{ status: number; text: string; json: any; headers: Headers }> {
    const response = await fetch(`${this.url}${path}`, {
      method: "POST", headers: { "content-type": "application/json", ...headers },
      body: (typeof body === "string" || body instanceof Uint8Array ? body : JSON.stringify(body)) as string,
    });
    const text = await response.text();
    let json: unknown = null;
    try {
      json = JSON.parse(text);
    } catch {
      json = null;
    }
    return { status: response.status, text, json, headers: response.headers };
  }

  async stop(): Promise<number | null> {
    if (this.child.exitCode !== null) return this.exited;
    this.child.kill("SIGTERM");
    const kill = setTimeout(() => this.child.kill("SIGKILL"), 20_000);
    try {
      return await this.exited;
    } finally {
      clearTimeout(kill);
    }
  }
}

/** `kvl serve PACK --port 0 --threads 1 ARGS`, resolved once the model is ready. */
export async function startServer(pack: string, args: string[], env: Record<string, string>): Promise<LiveServer> {
  const child = spawn(process.execPath, [KVL, "serve", pack, "--port", "0", "--threads", "1", ...args],
    { cwd: packageRoot, env: childEnv(env), stdio: ["ignore", "pipe", "pipe"] });
  const keyAt = args.indexOf("--api-key");
  const server = new LiveServer(child, keyAt >= 0 ? args[keyAt + 1]! : "no-key");
  const deadline = Date.now() + 120_000;
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`kvl serve exited with ${child.exitCode}:\n${server.log()}`);
    const url = /listening on (http:\/\/\S+)/.exec(server.log())?.[1];
    if (url) {
      server.url = url;
      try {
        const status = ((await (await fetch(`${url}/healthz`)).json()) as { status: string }).status;
        if (status === "ready") return server;
      } catch {
        // not answering yet
      }
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  child.kill("SIGKILL");
  throw new Error(`kvl serve did not become ready:\n${server.log()}`);
}

/** `kvl ARGS` in a child process, awaited without blocking this process's event loop (a blocked
 * loop lets a server's keep-alive timeout close sockets a client then reuses). */
export function runKvl(args: string[], env: Record<string, string>, timeoutMs = 120_000): Promise<{ status: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [KVL, ...args], { cwd: packageRoot, env: childEnv(env), stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (d: Buffer) => {
      stdout += d.toString();
    });
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("error", reject);
    child.on("close", (status) => {
      clearTimeout(timer);
      resolve({ status, stdout, stderr });
    });
  });
}
