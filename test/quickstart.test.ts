/** scripts/quickstart --demo as the README has a new user run it (the bash door to
 * scripts/quickstart.mjs, whose steps are the same on every OS): install, synth, pack, doctor,
 * then the interactive chat. `npm` is a stand-in on PATH that records any call (the suite runs
 * from an installed, current checkout, so the quickstart must skip npm ci; a real `npm ci` would
 * replace the node_modules it runs from); everything after it is the script itself. When an
 * install is current is scripts/install-state.mjs's rule, checked here on made-up checkouts. */
import { spawnSync } from "node:child_process";
import { chmodSync, existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { delimiter, join } from "node:path";

import { afterAll, describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";
// @ts-expect-error -- plain JavaScript of scripts/ (no declarations): installOutdated(root) → string | null
import { installOutdated } from "../scripts/install-state.mjs";

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
    // this checkout is installed and current: a second quickstart does not rerun npm ci
    expect(existsSync(npmLog)).toBe(false);
    expect(r.stdout).toContain("== kvl is installed and node_modules matches package-lock.json: npm ci skipped (delete node_modules to reinstall)");
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

describe("when scripts/quickstart reruns npm ci (scripts/install-state.mjs)", () => {
  /** A checkout whose lock has `locked` and whose node_modules (unless null) records `installed`. */
  function checkout(name: string, locked: Record<string, object>, installed: Record<string, object> | null, built = true): string {
    const root = join(scratch, name);
    mkdirSync(join(root, "dist", "cli"), { recursive: true });
    if (built) writeFileSync(join(root, "dist", "cli", "kvl.js"), "");
    writeFileSync(join(root, "package-lock.json"), JSON.stringify({ packages: { "": {}, ...locked } }));
    if (installed) {
      mkdirSync(join(root, "node_modules"), { recursive: true });
      writeFileSync(join(root, "node_modules", ".package-lock.json"), JSON.stringify({ packages: installed }));
    }
    return root;
  }
  const a = { version: "1.0.0", integrity: "sha512-a" };
  const other = process.platform === "win32" ? "linux" : "win32";

  it("current: every locked package installed as locked; optional ones for another platform may be absent", () => {
    expect(installOutdated(checkout("current", { "node_modules/a": a, "node_modules/b-other": { ...a, optional: true, os: [other] } },
      { "node_modules/a": a }))).toBeNull();
  });

  it("not current: nothing installed, not built, a package changed, or an optional one for this platform missing", () => {
    expect(installOutdated(checkout("fresh", { "node_modules/a": a }, null))).toBe("node_modules is missing or was not installed by npm");
    expect(installOutdated(checkout("unbuilt", { "node_modules/a": a }, { "node_modules/a": a }, false))).toBe("kvl is not built yet");
    expect(installOutdated(checkout("changed", { "node_modules/a": { ...a, version: "1.1.0" } }, { "node_modules/a": a })))
      .toBe("node_modules/a is not the locked 1.1.0");
    expect(installOutdated(checkout("platform", { "node_modules/b": { ...a, optional: true, os: [process.platform], cpu: [process.arch] } }, {})))
      .toBe("node_modules/b is not the locked 1.0.0");
  });
});
