/**
 * scripts/test (`npm test`) as a developer calls it: `--help` prints its usage and runs nothing;
 * FILE arguments (a path or a test name) run the type check and those vitest files only, ending
 * with the same `N passed, N failed` line; an unknown option or a file that does not exist is one
 * line and exit status 2, before anything runs.
 */
import { spawnSync } from "node:child_process";
import { join } from "node:path";

import { describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

const SCRIPT = join(packageRoot, "scripts", "test");

function run(args: string[]): { status: number | null; stdout: string; stderr: string } {
  const r = spawnSync("bash", [SCRIPT, ...args], { cwd: packageRoot, encoding: "utf8", timeout: 600_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe("scripts/test", () => {
  it("--help prints the usage, with how to run one file, and runs nothing", () => {
    const r = run(["--help"]);
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/^usage: npm test \[-- FILE\.\.\.\]/);
    expect(r.stdout).toContain("npm test -- chat server-unit");
    expect(r.stdout).not.toContain("== "); // no step started
  });

  it("an unknown option or a missing file is one line and status 2", () => {
    expect(run(["--bogus"])).toMatchObject({ status: 2, stdout: "", stderr: "scripts/test: unknown option --bogus; see npm test -- --help\n" });
    expect(run(["no-such-file"])).toMatchObject({ status: 2, stdout: "",
      stderr: "scripts/test: no test file no-such-file; give a path such as test/chat.test.ts or a name such as chat\n" });
  });

  it("a test name runs tsc and that file only, and ends with the summary line", () => {
    const r = run(["docs-map"]);
    expect(r.status, r.stdout + r.stderr).toBe(0);
    expect(r.stdout).toContain("== TypeScript: vitest (test/docs-map.test.ts)");
    expect(r.stdout).toMatch(/^-- vitest: 3 passed, 0 failed$/m);
    expect(r.stdout).not.toContain("== C core");
    expect(r.stdout.trimEnd().split("\n").at(-1)).toBe("5 passed, 0 failed");
  }, 600_000);
});
