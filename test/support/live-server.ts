/**
 * live-server.ts — `kvl serve` as a user runs it, for the tests that need a real server: the
 * compiled CLI (dist/cli/kvl.js) in a child process on 127.0.0.1, port 0, waited for until
 * /healthz says ready; its stdout and stderr kept as one log; stopped with SIGTERM (SIGKILL after
 * 20 s, so a test never leaves a server behind).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { join } from "node:path";

import { packageRoot } from "../../host/paths.js";

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

  constructor(readonly child: ChildProcess) {
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
  const server = new LiveServer(child);
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
