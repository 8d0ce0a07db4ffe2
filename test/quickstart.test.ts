/** scripts/quickstart --demo as the README has a new user run it (the bash door to
 * scripts/quickstart.mjs, whose steps are the same on every OS): install, synth, pack, doctor,
 * then the interactive chat. `npm ci` is replaced by a stand-in on PATH (the suite already runs
 * from an installed checkout, and a real `npm ci` would replace the node_modules it runs from);
 * everything after it is the script itself. */
import { spawnSync } from "node:child_process";
import { chmodSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { delimiter, join } from "node:path";

import { afterAll, describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

const scratch = mkdtempSync(join(tmpdir(), "kvl-quickstart-"));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

describe.runIf(process.platform !== "win32")("scripts/quickstart --demo", () => {
  it("runs from install to a chat that answers and quits, with only node and npm on PATH", () => {
    const bin = join(scratch, "bin");
    const npmLog = join(scratch, "npm-args");
    spawnSync("mkdir", ["-p", bin]);
    writeFileSync(join(bin, "npm"), `#!/bin/sh\necho "$@" >> '${npmLog}'\n`);
    chmodSync(join(bin, "npm"), 0o755);
    const env: NodeJS.ProcessEnv = { ...process.env, PATH: [bin, process.env.PATH].join(delimiter), XDG_CACHE_HOME: join(scratch, "cache") };
    delete env.KVL_BACKEND;
    const r = spawnSync("bash", [join(packageRoot, "scripts", "quickstart"), "--demo"], {
      cwd: scratch,
      env,
      input: "hello\n/quit\n",
      encoding: "utf8",
      timeout: 600_000,
    });
    const out = r.stdout + r.stderr;
    expect(r.status, out.slice(-2000)).toBe(0);
    expect(readFileSync(npmLog, "utf8").trim()).toBe("ci --no-audit --no-fund");
    expect(out).not.toMatch(/not found/);
    // the doctor without a model, then the doctor of the packed demo model: both end PASS
    expect(out.match(/^PASS$/gm)?.length).toBe(2);
    expect(out).toContain(`packed into ${join(scratch, "cache", "kvl", "demo-tiny")}`);
    // the chat opened on the demo model, then replied to "hello" (random weights: noise) before /quit
    expect(r.stderr).toMatch(/^kvl chat: \w+, 1 engine, kernels [\w-]+, Linear inputs \w+ \([^)]+\); RAM plan \d+ MiB/m);
    const reply = r.stdout.slice(r.stdout.indexOf("== chat")).split("\n").slice(1).join("\n");
    expect(reply.trim().length).toBeGreaterThan(20);
  }, 600_000);
});
