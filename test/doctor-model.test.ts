/**
 * `kvl doctor MODEL` as a user runs it (the compiled dist/cli/kvl.js in a child process) on a
 * tiny synthesized pack and damaged copies of it: PASS on both backends (and on a pack with Q4
 * experts, whose "pack" line names them, and whose data check reads the Q4 extents); FAIL naming the problem
 * for a flipped bit in a store's data, a corrupt index, a truncated store, a missing file, a
 * broken or disagreeing config.json, a source checkpoint given instead of a pack, a RAM budget
 * the plan cannot fit, and a backend that cannot load. (Ported from tests/test_doctor.py.)
 */
import { spawnSync } from "node:child_process";
import { cpSync, existsSync, openSync, readFileSync, rmSync, truncateSync, writeFileSync, writeSync, closeSync, statSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { availableRamBytes } from "../host/engine/model-doctor.js";
import { PackReader, type StoreName } from "../host/pack/pack-format.js";
import { packageRoot } from "../host/system/paths.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { nativeBuilt } from "./helpers.js";
import { tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");
/** Linux's transparent huge page mode, read here as the test's own expectation (null: none). */
const THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled";
const THP_MODE = existsSync(THP_FILE) ? /\[(\w+)\]/.exec(readFileSync(THP_FILE, "utf8"))?.[1] ?? null : null;
const CHECKS = ["pack", "data", "tensor directory", "provenance", "backend", "RAM", "engine", "direct I/O",
  ...(THP_MODE ? ["huge pages"] : []), "generation"];

let tmp: { dir: string; cleanup: () => void };
let ckpt: string;
let pack: string;
/** The same checkpoint packed with --expert-dtype q4. */
let q4Pack: string;
let copies = 0;

function doctor(args: string[], env: Record<string, string> = {}) {
  const base = { ...process.env };
  delete base.KVL_BACKEND;
  const r = spawnSync(process.execPath, [KVL, "doctor", ...args], { encoding: "utf8", env: { ...base, ...env }, timeout: 300_000 });
  const lines = r.stdout.trim().split("\n");
  const checks = new Map<string, { status: string; line: string }>();
  for (const line of lines) {
    const m = /^(OK|WARN|FAIL) {1,4}([^:]+): /.exec(line);
    if (m) checks.set(m[2]!, { status: m[1]!, line });
  }
  return { status: r.status, stdout: r.stdout, stderr: r.stderr, lines, checks, last: lines.at(-1)! };
}

/** The verdict line of a run that must FAIL (exit 1, no PASS anywhere). */
function failLine(r: ReturnType<typeof doctor>): string {
  expect(r.status, r.stdout + r.stderr).toBe(1);
  expect(r.last.startsWith("FAIL: ")).toBe(true);
  expect(r.lines).not.toContain("PASS");
  return r.last;
}

function packCopy(): string {
  const dst = join(tmp.dir, `copy-${copies++}`);
  cpSync(pack, dst, { recursive: true });
  return dst;
}

/** Flips bits of the first data byte of a store's record; returns the record's name. */
function flipDataByte(dir: string, reader: PackReader, store: StoreName, index: number): string {
  const rec = reader.stores.get(store)!.records[index]!;
  const path = join(dir, `${store}.bin`);
  const byte = readFileSync(path)[rec.offset]!;
  const fd = openSync(path, "r+");
  writeSync(fd, Buffer.from([byte ^ 0x10]), 0, 1, rec.offset);
  closeSync(fd);
  return rec.name;
}

beforeAll(async () => {
  tmp = tempDir("doctor");
  const core = await WasmBackend.create();
  try {
    ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), core);
    pack = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core, allowRevision: true });
    q4Pack = await packCheckpoint(ckpt, join(tmp.dir, "pack-q4"), { core, allowRevision: true, expertDtype: "q4" });
  } finally {
    core.close();
  }
}, 300_000);

afterAll(() => tmp?.cleanup());

describe("kvl doctor MODEL on a good tiny pack", () => {
  it.each(["wasm", "native"] as const)("passes on %s, every check OK but provenance (synthetic)", (backend) => {
    if (backend === "native" && !nativeBuilt) return;
    const r = doctor([pack, "--backend", backend, "--ram-mib", "1024", "--quiet"]);
    expect(r.status, r.stdout + r.stderr).toBe(0);
    expect(r.stderr).toBe("");
    expect(r.last).toBe("PASS");
    expect(r.lines.filter((l) => l === "PASS" || l.startsWith("FAIL")).length).toBe(1);
    expect([...r.checks.keys()]).toEqual(CHECKS);
    for (const name of ["pack", "data", "tensor directory", "backend", "RAM", "engine", "generation"]) {
      expect(r.checks.get(name)!.status, r.stdout).toBe("OK");
    }
    // the synthetic pack is recognised as not the pinned checkpoint
    expect(r.checks.get("provenance")!.status).toBe("WARN");
    expect(r.checks.get("provenance")!.line).toContain("synthetic");
    expect(r.checks.get("data")!.line).toMatch(/CRCs of all \d+ tensors match/);
    expect(r.checks.get("backend")!.line).toContain(`${backend} runs — asked for (option)`);
    expect(r.checks.get("backend")!.line).toMatch(/WebAssembly usable/);
    expect(r.checks.get("RAM")!.line).toMatch(new RegExp(`${backend} plan \\d+ MiB of --ram-mib 1024 .*, \\d+ MiB available`));
    expect(r.checks.get("engine")!.line).toContain(`kernels ${backend === "wasm" ? "simd128" : ""}`);
    expect(r.checks.get("direct I/O")!.line).toMatch(/trunk and expert reads bypass the page cache|reads are buffered: the filesystem/);
    if (THP_MODE) {
      // native asks for huge pages itself; a WebAssembly memory has them only with "always"
      const hugePagesOk = backend === "wasm" ? THP_MODE === "always" : THP_MODE !== "never";
      expect(r.checks.get("huge pages")!.status, r.stdout).toBe(hugePagesOk ? "OK" : "WARN");
      expect(r.checks.get("huge pages")!.line).toContain(`"${THP_MODE}"`);
    }
    expect(r.checks.get("generation")!.line).toMatch(/: \d+ greedy tokens? \((length|stop)\) in [\d.]+ s/);
    if (r.checks.get("generation")!.line.includes("(length)")) expect(r.checks.get("generation")!.line).toContain(": 8 greedy tokens");
    // the plan's table only with --verbose
    expect(r.stdout).not.toContain("component");
  }, 120_000);

  it.each(["wasm", "native"] as const)("passes a pack with Q4 experts on %s, naming them; a flipped bit in a Q4 extent is a FAIL naming it", async (backend) => {
    if (backend === "native" && !nativeBuilt) return;
    const r = doctor([q4Pack, "--backend", backend, "--quiet"]);
    expect(r.status, r.stdout + r.stderr).toBe(0);
    expect(r.last).toBe("PASS");
    expect(r.checks.get("pack")!.line).toContain("format version 3, bf16 trunk Linear weights, q4 routed experts");
    expect(r.checks.get("data")!.line).toMatch(/CRCs of all \d+ tensors match/);
    expect(r.checks.get("generation")!.status).toBe("OK");
    const dir = join(tmp.dir, `copy-q4-${backend}`);
    cpSync(q4Pack, dir, { recursive: true });
    const name = flipDataByte(dir, await PackReader.open(dir), "experts", 2);
    const bad = doctor([dir, "--backend", backend, "--quiet"]);
    expect(failLine(bad)).toContain("data: experts.bin is corrupt (1 tensor); rerun kvl pack");
    expect(bad.checks.get("data")!.line).toContain(`experts.bin: data of '${name}' is corrupt`);
  }, 120_000);

  it("--verbose adds the RAM plan's table; progress of the data check goes to stderr", () => {
    const r = doctor([pack, "--verbose"]);
    expect(r.status, r.stdout + r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^ +component +MiB$/m);
    // no --ram-mib: auto, capped at what the tiny model can use
    expect(r.stdout).toMatch(/^ +total +[\d,.]+ +budget [\d,.]+ MiB \(--ram-mib auto\)$/m);
    expect(r.checks.get("RAM")!.line).toMatch(/plan [\d.]+ MiB of --ram-mib auto = \d+ MiB \(auto: .*capped at \d+ MiB, all the model can use\)/);
    const fixed = doctor([pack, "--verbose", "--ram-mib", "4096", "--quick"]);
    expect(fixed.stdout).toMatch(/^ +total +[\d,.]+ +budget 4,096\.0 MiB$/m);
    expect(r.stderr).toMatch(/^checking tensor data: 100\.0% .*done in/m);
  }, 120_000);

  it("--instances and KVL_INSTANCES split the model, and the split one still generates", () => {
    const wasm = doctor([pack, "--quick", "--quiet", "--backend", "wasm", "--instances", "3"]);
    expect(wasm.status, wasm.stdout + wasm.stderr).toBe(0);
    expect(wasm.checks.get("RAM")!.line).toContain("(3 instances,");
    expect(wasm.checks.get("engine")!.line).toContain("as planned (3 ranges)");
    expect(wasm.checks.get("generation")!.status).toBe("OK");
    const native = doctor([pack, "--quick", "--quiet", "--backend", "native"], { KVL_INSTANCES: "2" });
    expect(native.status, native.stdout + native.stderr).toBe(0);
    expect(native.checks.get("engine")!.line).toContain("as planned (2 ranges)");
    const bad = doctor([pack, "--instances", "0"]);
    expect(bad.status).not.toBe(0);
    expect(bad.stderr).toContain("argument '0' is invalid. expected a whole number of 1 or more, in digits (e.g. 256)");
  }, 120_000);

  it("--json is one object with every check, the backend record and the plan", () => {
    const r = doctor([pack, "--json", "--quiet"], { KVL_BACKEND: "wasm" });
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as {
      pass: boolean; verdict: string; checks: { status: string; name: string; detail: string }[];
      backend: { chosen: string; requestedBy: string }; ramPlan: string;
    };
    expect(report.pass).toBe(true);
    expect(report.verdict).toBe("PASS");
    expect(report.checks.map((c) => c.name)).toEqual(CHECKS);
    expect(report.backend.chosen).toBe("wasm");
    expect(report.backend.requestedBy).toBe("KVL_BACKEND");
    expect(report.ramPlan).toContain("WebAssembly instances");
  }, 120_000);
});

describe("kvl doctor MODEL on damaged packs", () => {
  it.each(["experts", "trunk"] as const)("a flipped bit in %s.bin is a FAIL naming the file and tensor; --quick says it did not look, and the engine's own check finds it", async (store) => {
    const dir = packCopy();
    const name = flipDataByte(dir, await PackReader.open(dir), store, store === "trunk" ? 3 : 1);
    const r = doctor([dir, "--quiet"]);
    const line = failLine(r);
    expect(line).toContain(`data: ${store}.bin is corrupt (1 tensor); rerun kvl pack`);
    expect(r.checks.get("data")!.line).toContain(`${store}.bin: data of '${name}' is corrupt`);
    // the engine checks do not run on a corrupt pack
    expect(r.checks.has("generation")).toBe(false);
    const quick = doctor([dir, "--quick", "--quiet"]);
    expect(quick.checks.get("data")!.status).toBe("WARN");
    expect(quick.checks.get("data")!.line).toContain("tensor data not checked (--quick)");
    expect(quick.stdout).not.toContain(`${store}.bin: data of`);
    // the engine checks what it reads (docs/FORMAT.md "Checks at run time"): the trunk tensor at
    // load, the extent in the short run (which reads it: the flipped record is one it routes to)
    expect(failLine(quick)).toContain(`${store}.bin: tensor '${name}'`);
    expect(quick.stdout).toContain(`does not match its CRC-32 in the index: the pack is corrupt; run \`kvl doctor ${dir}\``);
  }, 120_000);

  it("a corrupt index is a FAIL naming it", () => {
    const dir = packCopy();
    const data = readFileSync(join(dir, "trunk.idx"));
    data[200] = data[200]! ^ 0xff;
    writeFileSync(join(dir, "trunk.idx"), data);
    expect(failLine(doctor([dir, "--quiet"]))).toContain("trunk.idx");
  });

  it("a truncated store is a FAIL naming it", () => {
    const dir = packCopy();
    const path = join(dir, "experts.bin");
    truncateSync(path, statSync(path).size - 4096);
    expect(failLine(doctor([dir, "--quiet"]))).toMatch(/experts\.bin: expected \d+ bytes, found \d+ — the pack is incomplete; rerun kvl pack/);
  });

  it.each(["vision.bin", "tiktoken.model", "PACK_COMPLETE.json"])("a missing %s is a FAIL naming it", (file) => {
    const dir = packCopy();
    rmSync(join(dir, file));
    const line = failLine(doctor([dir, "--quiet"]));
    expect(line).toContain(file);
    expect(line).toContain("rerun kvl pack");
  });

  it("a broken config.json is a FAIL", () => {
    const dir = packCopy();
    writeFileSync(join(dir, "config.json"), '{"text_config": {');
    const r = doctor([dir, "--quiet"]);
    expect(failLine(r)).toContain("tensor directory: restore config.json (rerun kvl pack)");
    expect(r.checks.get("tensor directory")!.line).toContain("config.json unreadable");
  });

  it("a config.json that disagrees with the pack is a FAIL", () => {
    const dir = packCopy();
    const config = JSON.parse(readFileSync(join(dir, "config.json"), "utf8")) as { text_config: { num_hidden_layers: number } };
    config.text_config.num_hidden_layers += 1;
    writeFileSync(join(dir, "config.json"), JSON.stringify(config));
    const r = doctor([dir, "--quiet"]);
    const line = failLine(r);
    expect(line).toContain("tensor directory");
    expect(line).toContain("config.json");
    expect(r.checks.get("tensor directory")!.line).toContain("config.json differs from the config stored in the indexes");
  });

  it("a source checkpoint is told to run kvl pack, not that a pack is incomplete", () => {
    const r = doctor([ckpt, "--quiet"]);
    const line = failLine(r);
    expect(line).toContain(`this is a checkpoint, not a pack: run kvl pack ${ckpt} DST`);
    expect(r.stdout).not.toContain("incomplete");
  });
});

describe("kvl doctor MODEL and this machine", () => {
  it("a RAM budget the plan cannot fit is a FAIL with the planner's advice and its table", () => {
    const r = doctor([pack, "--ram-mib", "100", "--quick", "--quiet"]);
    const line = failLine(r);
    expect(line).toMatch(/RAM: the RAM plan needs [\d.]+ MiB, [\d.]+ MiB over --ram-mib 100\.0; raise --ram-mib to \d+/);
    expect(r.stdout).toMatch(/^ +total +[\d.]+ +budget 100\.0 MiB$/m);
    expect(r.checks.has("generation")).toBe(false);
  });

  it("a backend that cannot load is a FAIL naming why", () => {
    const r = doctor([pack, "--backend", "native", "--quick", "--quiet"], { KVL_ADDON: "/nonexistent/kvl_core.node" });
    const line = failLine(r);
    expect(line).toContain("backend: --backend native:");
    expect(line).toContain("/nonexistent/kvl_core.node");
  });

  it("measures the available RAM", () => {
    const available = availableRamBytes();
    expect(available === null || available > 0).toBe(true);
    if (process.platform === "linux") expect(available).not.toBeNull();
  });
});
