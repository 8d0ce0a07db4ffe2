/**
 * ram-budget.test.ts — `--ram-mib auto`, the default: the budget from the machine's memory
 * figures (fake ones, with the rule's arithmetic done by hand here), the cgroup reader over a fake
 * /sys/fs/cgroup (v1 and v2, a limit on an ancestor, "unlimited", the reclaimable file cache), the
 * planner capping auto at what the model can use and refusing a machine too small in one message
 * with what to do, and for real: `kvl chat` with no flags on this machine budgets more than the
 * old fixed 4096 MiB, and inside a 3 GiB memory cgroup budgets within it and runs without an OOM kill.
 */
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, rmdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { PackFacts } from "../host/plan/core-bytes.js";
import { readPackFacts } from "../host/plan/core-bytes.js";
import { planFromFacts } from "../host/plan/planner.js";
import { autoRamBudget, parseRamChoice, ramBudget } from "../host/plan/ram-budget.js";
import { type MachineMemory, readCgroupMemory } from "../host/system/machine-memory.js";
import { packageRoot } from "../host/system/paths.js";
import { UserError } from "../host/system/user-error.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const MIB = 2 ** 20;
const GIB = 2 ** 30;
const KVL = join(packageRoot, "dist", "cli", "kvl.js");

const tmp = tempDir("kvl-ram-budget-");
let pack: string;
beforeAll(async () => {
  ({ pack } = await tinyPack(tmp.dir));
});
afterAll(() => tmp.cleanup());

const machine = (o: Partial<MachineMemory>): MachineMemory => ({
  totalBytes: 16 * GIB, availableBytes: 9 * GIB, availableSource: "MemAvailable", cgroupLimitBytes: null, cgroupUsageBytes: null,
  ownRssBytes: 100 * MIB, ...o,
});

describe("the auto rule on given figures", () => {
  it("a 16 GiB laptop with 9 GiB available: 9216 - 2458 (15 % of 16384) = 6758 MiB", () => {
    const b = autoRamBudget(machine({}));
    expect(b).toMatchObject({ mib: 6758, chosenBy: "auto" });
    expect(b.detail).toMatch(/^auto: MemAvailable 9216 MiB less 2458 MiB headroom/);
  });

  it("a small machine keeps at least 1536 MiB free: 8 GiB total, 5 GiB available -> 5120 - 1536 = 3584 MiB", () => {
    expect(autoRamBudget(machine({ totalBytes: 8 * GIB, availableBytes: 5 * GIB })).mib).toBe(3584);
  });

  it("a 3 GiB cgroup binds a 24 GiB machine: 3072 - 0 used by others - 256 margin = 2816 MiB", () => {
    const b = autoRamBudget(machine({ totalBytes: 24 * GIB, availableBytes: 22 * GIB, cgroupLimitBytes: 3 * GIB, cgroupUsageBytes: 100 * MIB }));
    expect(b.mib).toBe(2816);
    expect(b.detail).toMatch(/^auto: cgroup limit 3072 MiB less 0 MiB used by others and 256 MiB margin \(smaller than MemAvailable 22528 MiB/);
  });

  it("what other processes hold in the group counts: 8 GiB limit, 1 GiB of others -> 8192 - 1024 - 512 = 6656 MiB", () => {
    const b = autoRamBudget(machine({ totalBytes: 64 * GIB, availableBytes: 60 * GIB, cgroupLimitBytes: 8 * GIB, cgroupUsageBytes: 1124 * MIB }));
    expect(b.mib).toBe(6656);
  });

  it("a roomy cgroup does not bind: the machine's figure stays", () => {
    const b = autoRamBudget(machine({ cgroupLimitBytes: 64 * GIB, cgroupUsageBytes: 100 * MIB }));
    expect(b.mib).toBe(6758);
    expect(b.detail).toMatch(/smaller than cgroup limit 65536 MiB/);
  });

  it("--ram-mib N is taken as given; a bad value is one line naming the option", () => {
    expect(ramBudget(4096)).toEqual({ mib: 4096, chosenBy: "option", detail: null });
    expect(parseRamChoice("auto")).toBe("auto");
    expect(parseRamChoice("8192")).toBe(8192);
    for (const bad of ["0", "-1", "4.5", "lots", ""]) expect(() => parseRamChoice(bad)).toThrow(/--ram-mib .*use auto .* or a whole number of MiB/);
  });
});

describe("the cgroup reader", () => {
  const fake = (files: Record<string, string>) => (path: string): string | null => files[path] ?? null;

  it("v2: the smallest limit up the hierarchy, with that group's usage less its inactive file cache", () => {
    const read = fake({
      "/proc/self/cgroup": "0::/user.slice/app.scope\n",
      "/sys/fs/cgroup/user.slice/app.scope/memory.max": "max\n",
      "/sys/fs/cgroup/user.slice/memory.max": "4294967296\n",
      "/sys/fs/cgroup/user.slice/memory.current": "1073741824\n",
      "/sys/fs/cgroup/user.slice/memory.stat": "anon 1\ninactive_file 268435456\nactive_file 5\n",
    });
    expect(readCgroupMemory(read, "/sys/fs/cgroup")).toEqual({ limit: 4 * GIB, usage: 768 * MIB });
  });

  it("v1: memory.limit_in_bytes, and the 'unlimited' value is no limit", () => {
    const v1 = (limit: string) => fake({
      "/proc/self/cgroup": "5:cpu,cpuacct:/\n4:memory:/jobs/42\n0::/\n",
      "/sys/fs/cgroup/memory/jobs/42/memory.limit_in_bytes": limit,
      "/sys/fs/cgroup/memory/jobs/42/memory.usage_in_bytes": "2147483648",
      "/sys/fs/cgroup/memory/jobs/42/memory.stat": "cache 9\ntotal_inactive_file 1073741824\n",
      "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
    });
    expect(readCgroupMemory(v1("3221225472"), "/sys/fs/cgroup")).toEqual({ limit: 3 * GIB, usage: GIB });
    expect(readCgroupMemory(v1("9223372036854771712"), "/sys/fs/cgroup")).toEqual({ limit: null, usage: null });
  });

  it("no cgroup file (not Linux, or hidden): no limit", () => {
    expect(readCgroupMemory(() => null)).toEqual({ limit: null, usage: null });
  });
});

describe("the planner with --ram-mib auto", () => {
  let facts: PackFacts;
  beforeAll(async () => {
    facts = await readPackFacts(pack);
  });

  it("never claims more than the model can use: a 64 GiB machine's budget is capped at the plan's total", () => {
    const p = planFromFacts(facts, { backend: "native", ramMib: "auto", machineMemory: machine({ totalBytes: 64 * GIB, availableBytes: 60 * GIB }), threads: 2 });
    expect(p.settings.ramChosenBy).toBe("auto");
    expect(p.settings.ramMib).toBe(Math.ceil(p.total / MIB));
    expect(p.settings.ramMib).toBeLessThan(1024); // the tiny model, all resident
    expect(p.settings.ramDetail).toMatch(/^auto: MemAvailable 61440 MiB less 9830 MiB headroom .*; capped at \d+ MiB, all the model can use$/);
    expect(p.budgetText).toMatch(/^--ram-mib auto = \d+ MiB \(auto: /);
    expect(p.components.expertCache).toBeGreaterThan(0);
  });

  it("below the smallest plan that works: one refusal saying what the machine has and what to do", () => {
    let err: unknown;
    try {
      planFromFacts(facts, { backend: "native", ramMib: "auto", machineMemory: machine({ totalBytes: 4 * GIB, availableBytes: 1600 * MIB }), threads: 2 });
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(UserError);
    const first = (err as Error).message.split("\n")[0]!;
    expect(first).toMatch(/^the RAM plan needs [\d.]+ MiB, but this machine can give kvl only 64\.0 MiB now \(auto: MemAvailable 1600 MiB less 1536 MiB headroom/);
    expect(first).toMatch(/close other programs to free [\d.]+ MiB, or pass --ram-mib \d+ if that much will be free when kvl runs$/);
  });
});

describe("kvl chat with no flags", () => {
  const chatJson = (prefix: string[] = []): { status: number | null; json: Record<string, unknown> | null; stderr: string } => {
    const r = spawnSync(prefix[0] ?? process.execPath, [...prefix.slice(1), ...(prefix.length ? [process.execPath] : []), KVL, "chat", pack, "Say hello.",
      "--max-new", "4", "--temperature", "0", "--json", "--quiet"], { encoding: "utf8", timeout: 300_000 });
    const last = r.stdout.trim().split("\n").at(-1);
    return { status: r.status, json: last ? JSON.parse(last) as Record<string, unknown> : null, stderr: r.stderr };
  };

  it("on this machine: auto from its free memory, which is more than the old fixed 4096 MiB before the model's cap", () => {
    const r = chatJson();
    expect(r.status, r.stderr).toBe(0);
    expect(r.json!.ram_budget_chosen_by).toBe("auto");
    const m = /^auto: MemAvailable (\d+) MiB less (\d+) MiB headroom/.exec(String(r.json!.ram_budget_detail));
    expect(m, String(r.json!.ram_budget_detail)).not.toBeNull();
    expect(Number(m![1]) - Number(m![2])).toBeGreaterThan(4096);
    expect(r.json!.ram_budget_mib).toBeLessThanOrEqual(Number(m![1]) - Number(m![2]));
  });

  it("inside a 3 GiB memory cgroup: the budget is within it, the run ends normally, no OOM kill", () => {
    const cg = makeCgroup(3 * GIB);
    try {
      const r = chatJson(["sh", "-c", `echo $$ > ${cg.procs} && exec "$@"`, "sh"]);
      expect(r.status, r.stderr).toBe(0);
      const detail = String(r.json!.ram_budget_detail);
      expect(detail).toMatch(/^auto: cgroup limit 3072 MiB less \d+ MiB used by others and 256 MiB margin/);
      expect(r.json!.ram_budget_mib).toBeLessThanOrEqual(2816);
      expect(Number(r.json!.peak_rss_bytes)).toBeLessThan(3 * GIB);
      expect(cg.oomKills()).toBe(0);
    } finally {
      cg.remove();
    }
  });
});

/** A memory cgroup with `limit` bytes under this process's own (v1) or at the v2 root, as
 * bench/cgroup-run.sh makes them (the tests run as root, as CI does). */
function makeCgroup(limit: number): { procs: string; oomKills: () => number; remove: () => void } {
  const name = `kvl-test-${process.pid}`;
  let dir: string;
  let oom: () => number;
  if (existsSync("/sys/fs/cgroup/cgroup.controllers") && readFileSync("/sys/fs/cgroup/cgroup.controllers", "utf8").split(/\s+/).includes("memory")) {
    dir = join("/sys/fs/cgroup", name);
    mkdirSync(dir);
    writeFileSync(join(dir, "memory.max"), String(limit));
    oom = () => Number(/^oom_kill (\d+)$/m.exec(readFileSync(join(dir, "memory.events"), "utf8"))?.[1] ?? 0);
  } else {
    const own = /^\d+:(?:[^:]*,)?memory(?:,[^:]*)?:(.*)$/m.exec(readFileSync("/proc/self/cgroup", "utf8"))?.[1];
    if (own === undefined) throw new Error("no memory cgroup to nest a limited one in (the test needs root and cgroups, as CI has)");
    dir = join("/sys/fs/cgroup/memory", own, name);
    mkdirSync(dir);
    writeFileSync(join(dir, "memory.limit_in_bytes"), String(limit));
    oom = () => Number(/^oom_kill (\d+)$/m.exec(readFileSync(join(dir, "memory.oom_control"), "utf8"))?.[1] ?? 0);
  }
  return { procs: join(dir, "cgroup.procs"), oomKills: oom, remove: () => rmdirSync(dir) };
}
