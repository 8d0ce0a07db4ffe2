/**
 * Crash safety of packer/pack.ts (kvl's tests/test_pack.py, crash part): `kvl pack` in a child
 * process SIGKILLed at deterministic points (KVL_PACK_TEST_KILL_AT) and at random times, then
 * rerun, must give byte-identical output; --delete-consumed-shards deletes a shard only once
 * everything from it is journaled; a torn journal line and a lost .bin are redone; shard hooks
 * (kvl prepare's downloads) see acquire/release in a durable order; a rerun over a finished pack
 * of another source is refused and leaves it as it was; and the WebAssembly and native cores give
 * byte-identical packs, even when a pack started on one finishes on the other.
 */
import { existsSync, readFileSync, readdirSync, rmSync, appendFileSync, unlinkSync, statSync, copyFileSync, mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { verify } from "../host/pack/pack-format.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { UserError } from "../host/system/user-error.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { readIndex } from "../packer/safetensors.js";
import { InventorySource, readAssets } from "../packer/tensor-source.js";
import { copyDir, runPack, runPackKilledWhen, tempDir, tinyCheckpoint, treeBytes, treeDiff } from "./support/pack-fixtures.js";

let native: NativeBackend;
let tmp: { dir: string; cleanup: () => void };
let ckpt: string;
let clean: Map<string, Buffer>;
let n = 0;
const out = (): string => join(tmp.dir, `out${n++}`);

beforeAll(async () => {
  native = new NativeBackend();
  tmp = tempDir("pack-resume");
  ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), native);
  clean = treeBytes(await packCheckpoint(ckpt, join(tmp.dir, "clean"), { core: native, allowRevision: true }));
});
afterAll(() => {
  native.close();
  tmp.cleanup();
});

const packArgs = (src: string, dst: string, backend: "native" | "wasm", ...more: string[]): string[] =>
  [src, dst, "--quiet", "--allow-revision", "--backend", backend, ...more];

/** Source tensor names whose items are in the journal. */
function journaledInputs(dst: string, src: string): Set<string> {
  const done = new Set(readFileSync(join(dst, ".pack-journal", "done.log"), "latin1").split("\n").slice(0, -1).map((l) => l.split(" ")[0]));
  const names = new Set<string>();
  for (const name of readIndex(join(src, "model.safetensors.index.json")).keys()) {
    const key = name.includes(".mlp.experts.") ? name.split(".").slice(0, -2).join(".") : name;
    if (done.has(key)) names.add(name);
  }
  return names;
}

describe("SIGKILL at a fixed point, then a rerun", () => {
  it.each([
    [["item:1"]], [["item:5", "item:5"]], [["flush:1"]], [["flush:3", "item:2"]],
    [["final:start"]], [["final:trunk.idx"]], [["final:vision.idx"]], [["final:complete"]],
  ])("%j gives byte-identical output", async (points) => {
    const dst = out();
    for (const point of points) {
      const r = runPack(packArgs(ckpt, dst, "native"), { KVL_PACK_TEST_KILL_AT: point, KVL_PACK_FLUSH_ITEMS: "8" });
      expect(r.signal, r.stderr).toBe("SIGKILL");
      if (point !== "final:complete") {
        expect(existsSync(join(dst, "PACK_COMPLETE.json"))).toBe(false);
        await expect(verify(dst)).rejects.toThrow(UserError);
      } else {
        expect(existsSync(join(dst, ".pack-journal"))).toBe(true);
      }
    }
    const r = runPack(packArgs(ckpt, dst, "native"));
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });

  it("at every 7th item and every flush of one pack, run after run, still gives byte-identical output", async () => {
    const dst = out();
    let kills = 0;
    for (const point of ["item:1", "item:7", "flush:1", "item:7", "item:7", "flush:2", "item:7", "flush:1", "item:7", "item:7",
      "flush:3", "item:7", "item:7", "item:7", "flush:1", "item:7", "item:7", "item:7"]) {
      const r = runPack(packArgs(ckpt, dst, kills % 2 ? "wasm" : "native"), { KVL_PACK_TEST_KILL_AT: point, KVL_PACK_FLUSH_ITEMS: "5" });
      if (r.status === 0) break; // the pack finished before this point came
      expect(r.signal, r.stderr).toBe("SIGKILL");
      kills++;
    }
    expect(kills).toBeGreaterThanOrEqual(10);
    const r = runPack(packArgs(ckpt, dst, "native"));
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });
});

describe("SIGKILL from outside", () => {
  it("once the journal shows progress, then a rerun gives byte-identical output", async () => {
    const dst = out();
    const doneLog = join(dst, ".pack-journal", "done.log");
    const first = await runPackKilledWhen(packArgs(ckpt, dst, "native"), { KVL_PACK_FLUSH_ITEMS: "1" },
      () => existsSync(doneLog) && statSync(doneLog).size > 0, 60_000);
    expect(first.killed).toBe(true);
    const r = runPack(packArgs(ckpt, dst, "native"));
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });

  it("at seeded random times during a run, then a rerun gives byte-identical output", async () => {
    // how long a whole run takes here, per core (each run must also give the clean pack)
    const duration = { native: 0, wasm: 0 };
    for (const backend of ["native", "wasm"] as const) {
      const timed = out();
      const t0 = Date.now();
      const whole = runPack(packArgs(ckpt, timed, backend), { KVL_PACK_FLUSH_ITEMS: "1" });
      duration[backend] = Date.now() - t0;
      expect(whole.status, whole.stderr).toBe(0);
      expect(treeDiff(treeBytes(timed), clean)).toBeNull();
    }
    let seed = 12345;
    let killed = 0;
    for (let k = 0; k < 4; k++) {
      const backend = k % 2 ? "wasm" : "native";
      seed = (seed * 1103515245 + 12345) % 2 ** 31;
      let delay = Math.round(duration[backend] * (0.1 + 0.7 * (seed / 2 ** 31)));
      // The VM's speed moves: a run that beats its kill time still has to give the clean pack,
      // and the next try kills at half the time, so every attempt ends in a kill.
      for (let attempt = 0; attempt < 5; attempt++, delay = Math.round(delay / 2)) {
        const dst = out();
        const r = await runPackKilledWhen(packArgs(ckpt, dst, backend), { KVL_PACK_FLUSH_ITEMS: "1" }, () => false, delay);
        if (!r.killed) expect(r.code).toBe(0);
        else killed++;
        const rerun = runPack(packArgs(ckpt, dst, backend));
        expect(rerun.status, rerun.stderr).toBe(0);
        expect(treeDiff(treeBytes(dst), clean), `killed after ${delay} ms`).toBeNull();
        if (r.killed) break;
      }
    }
    expect(killed).toBe(4);
  });
});

describe("--delete-consumed-shards", () => {
  it("deletes a shard only after everything from it is journaled, and the rerun finishes from the journal", async () => {
    const src = copyDir(ckpt, join(tmp.dir, "ckpt-delete"));
    const dst = out();
    const weightMap = readIndex(join(src, "model.safetensors.index.json"));
    const shards = [...new Set(weightMap.values())].sort();
    expect(shards.length).toBeGreaterThanOrEqual(2);
    let sawPartial = false;
    let sawDeleted = false;
    for (const flushNo of [1, 2, 3, 4]) {
      const r = runPack(packArgs(src, dst, "native", "--delete-consumed-shards"), { KVL_PACK_TEST_KILL_AT: `flush:${flushNo}`, KVL_PACK_FLUSH_ITEMS: "16" });
      if (r.status === 0) break;
      expect(r.signal, r.stderr).toBe("SIGKILL");
      const durable = journaledInputs(dst, src);
      for (const shard of shards) {
        const tensors = [...weightMap].filter(([, s]) => s === shard).map(([name]) => name);
        if (!existsSync(join(src, shard))) {
          sawDeleted = true;
          expect(tensors.filter((t) => !durable.has(t)), `${shard} deleted before all its tensors were journaled`).toEqual([]);
        } else if (!tensors.every((t) => durable.has(t))) {
          sawPartial = true;
        }
      }
    }
    expect(sawPartial, "no kill point left a shard with unpacked tensors").toBe(true);
    expect(sawDeleted, "no kill point came after a shard was deleted").toBe(true);
    const r = runPack(packArgs(src, dst, "native", "--delete-consumed-shards"));
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
    expect(shards.filter((s) => existsSync(join(src, s)))).toEqual([]);
    expect(existsSync(join(src, "config.json")) && existsSync(join(src, "model.safetensors.index.json"))).toBe(true);
  });
});

describe("a damaged journal", () => {
  it("redoes a torn last line and the items of a lost .bin", async () => {
    const dst = out();
    const r = runPack(packArgs(ckpt, dst, "native"), { KVL_PACK_TEST_KILL_AT: "flush:4", KVL_PACK_FLUSH_ITEMS: "8" });
    expect(r.signal, r.stderr).toBe("SIGKILL");
    appendFileSync(join(dst, ".pack-journal", "done.log"), "language_model.model.layers.2.mlp.experts.5 0a1b"); // a crash mid-append
    unlinkSync(join(dst, "vision.bin")); // journaled vision items must be redone, not trusted
    const lines: string[] = [];
    await packCheckpoint(ckpt, dst, { core: native, allowRevision: true, log: (l) => lines.push(l) });
    expect(lines[0]).toBe(`resuming the pack in ${dst}: 32 items already written`);
    expect(lines).toContain("vision.bin is missing or resized; rewriting its items");
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });

  it("refuses, in one line, to resume when the journal's shards.json is not its list of shard digests", async () => {
    const dst = out();
    const r = runPack(packArgs(ckpt, dst, "native"), { KVL_PACK_TEST_KILL_AT: "flush:1", KVL_PACK_FLUSH_ITEMS: "8" });
    expect(r.signal).toBe("SIGKILL");
    const shards = join(dst, ".pack-journal", "shards.json");
    expect((JSON.parse(readFileSync(shards, "utf8")) as unknown[]).length).toBe(3);
    for (const damaged of ["[[\"model-00001-of-00003.safetensors\"", '{"model-00001-of-00003.safetensors": "x"}', "[[1, 2]]"]) {
      writeFileSync(shards, damaged);
      await expect(packCheckpoint(ckpt, dst, { core: native, allowRevision: true })).rejects.toThrow(new UserError(
        `${shards}: not a list of [shard, digest] pairs, so the unfinished pack cannot be resumed; delete its directory and pack again`));
    }
  });

  it("refuses to resume an unfinished pack of another source, even one with the same layout (another seed)", async () => {
    const dst = out();
    const r = runPack(packArgs(ckpt, dst, "native"), { KVL_PACK_TEST_KILL_AT: "flush:1", KVL_PACK_FLUSH_ITEMS: "8" });
    expect(r.signal).toBe("SIGKILL");
    const other = await tinyCheckpoint(join(tmp.dir, "ckpt-seed3"), native, 3);
    await expect(packCheckpoint(other, dst, { core: native, allowRevision: true })).rejects.toThrow(
      new UserError(`${dst}: holds an unfinished pack of a different source or kvl version; delete the directory or choose another destination`));
  });
});

describe("a rerun over a finished pack", () => {
  const refusal = (dst: string): RegExp =>
    new RegExp(`^kvl pack: error: ${dst} is a finished pack of another source \\((.*)\\); choose another destination, or remove ${dst} to pack this source there\n$`);

  it("of the same source has nothing to do; of another source, or another --trunk-dtype, is refused and changes nothing", async () => {
    const dst = copyDir(join(tmp.dir, "clean"), out());
    const same = runPack([ckpt, dst, "--allow-revision", "--backend", "native"]);
    expect(same.status, same.stderr).toBe(0);
    expect(same.stderr).toBe(`${dst} already holds a complete pack; nothing to do\n`);
    // another seed: the same config, layout and inventory, other weights
    const other = await tinyCheckpoint(join(tmp.dir, "ckpt-seed4"), native, 4);
    for (const args of [packArgs(other, dst, "native"), ["--synth-preset", "tiny", "--seed", "4", dst, "--quiet", "--backend", "wasm"]]) {
      const r = runPack(args);
      expect(r.status, r.stderr).toBe(1);
      expect(r.stderr).toMatch(refusal(dst));
      expect(r.stderr).toMatch(/\(other data in language_model\./);
    }
    const grouped = await tinyCheckpoint(join(tmp.dir, "ckpt-grouped"), native, 0, { nGroup: 4, topkGroup: 2 });
    const r = runPack(packArgs(grouped, dst, "native"));
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(refusal(dst));
    expect(r.stderr).toContain("(another config.json)");
    const q8 = runPack(packArgs(ckpt, dst, "native", "--trunk-dtype", "q8"));
    expect(q8.status).toBe(1);
    expect(q8.stderr).toBe(`kvl pack: error: ${dst} is a finished pack made with --trunk-dtype bf16, not q8; ` +
      `choose another destination, or remove ${dst} to repack it\n`);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });

  it("killed after its completion marker: another source is refused by the journal, the same one finishes", async () => {
    const dst = out();
    const killed = runPack(packArgs(ckpt, dst, "native"), { KVL_PACK_TEST_KILL_AT: "final:complete" });
    expect(killed.signal, killed.stderr).toBe("SIGKILL");
    const other = await tinyCheckpoint(join(tmp.dir, "ckpt-seed5"), native, 5);
    const r = runPack(packArgs(other, dst, "native"));
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(refusal(dst));
    expect(r.stderr).toContain("(its journal records another source)");
    expect(existsSync(join(dst, ".pack-journal"))).toBe(true);
    const again = runPack(packArgs(ckpt, dst, "native"));
    expect(again.status, again.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });

  it("whose shards --delete-consumed-shards deleted: compared by config.json and revision", async () => {
    const src = copyDir(ckpt, join(tmp.dir, "ckpt-consumed"));
    const dst = out();
    expect(runPack(packArgs(src, dst, "native", "--delete-consumed-shards")).status).toBe(0);
    const same = runPack(packArgs(src, dst, "native"));
    expect(same.status, same.stderr).toBe(0);
    copyFileSync(join(await tinyCheckpoint(join(tmp.dir, "ckpt-grouped-2"), native, 0, { nGroup: 4, topkGroup: 2 }), "config.json"), join(src, "config.json"));
    const r = runPack(packArgs(src, dst, "native"));
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(refusal(dst));
    expect(r.stderr).toContain("(another config.json or source revision)");
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });
});

describe("shard hooks (kvl prepare's downloads)", () => {
  it("acquire each shard before its tensors are read, release it only once they are journaled, and resume", async () => {
    const remote = copyDir(ckpt, join(tmp.dir, "remote"));
    const scratch = join(tmp.dir, "scratch");
    mkdirSync(scratch);
    const weightMap = readIndex(join(remote, "model.safetensors.index.json"));
    const dst = out();
    const events: string[] = [];
    let maxPresent = 0;
    let failOn: string | null = null;
    const source = () => {
      const inventory = new Map([...weightMap].map(([name, shard]) => {
        const entry = JSON.parse(readFileSync(join(remote, shard)).subarray(8, 8 + Number(readFileSync(join(remote, shard)).readBigUInt64LE(0))).toString())[name];
        return [name, { dtype: entry.dtype as string, shape: entry.shape as number[], shard }];
      }));
      const assets = readAssets(remote);
      return new InventorySource(scratch, Buffer.from(assets.get("config.json")!).toString(), assets, inventory, null, {
        acquire: async (shard: string) => {
          if (shard === failOn) throw new UserError(`download of ${shard} failed (test)`);
          events.push(`acquire ${shard}`);
          copyFileSync(join(remote, shard), join(scratch, shard));
          maxPresent = Math.max(maxPresent, readdirSync(scratch).length);
        },
        release: async (shard: string) => {
          events.push(`release ${shard}`);
          if (existsSync(join(dst, ".pack-journal"))) {
            const durable = journaledInputs(dst, remote);
            const missing = [...weightMap].filter(([name, s]) => s === shard && !durable.has(name));
            expect(missing, `${shard} released before its tensors were journaled`).toEqual([]);
          }
          rmSync(join(scratch, shard), { force: true });
        },
      });
    };
    const shards = [...new Set(weightMap.values())].sort();
    failOn = shards[2]!;
    await expect(packCheckpoint(source(), dst, { core: native, allowRevision: true })).rejects.toThrow("download of");
    // each shard is released (deleted) at the flush that makes its last item durable, before the next arrives
    expect(events).toEqual([`acquire ${shards[0]}`, `release ${shards[0]}`, `acquire ${shards[1]}`, `release ${shards[1]}`]);
    events.length = 0;
    failOn = null;
    await packCheckpoint(source(), dst, { core: native, allowRevision: true });
    // the rerun releases what the first run consumed, acquires only what it still needs
    expect(events).toEqual([`release ${shards[0]}`, `release ${shards[1]}`, `acquire ${shards[2]}`, `release ${shards[2]}`]);
    expect(maxPresent).toBeLessThanOrEqual(2);
    expect(readdirSync(scratch)).toEqual([]);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });
});

describe("the two cores", () => {
  it("give byte-identical packs, and a pack started on one finishes on the other", async () => {
    const wasm = await WasmBackend.create();
    try {
      const a = await packCheckpoint(ckpt, out(), { core: wasm, allowRevision: true });
      expect(treeDiff(treeBytes(a), clean)).toBeNull();
    } finally {
      wasm.close();
    }
    const dst = out();
    const r = runPack(packArgs(ckpt, dst, "wasm"), { KVL_PACK_TEST_KILL_AT: "flush:2", KVL_PACK_FLUSH_ITEMS: "8" });
    expect(r.signal, r.stderr).toBe("SIGKILL");
    await expect(verify(dst)).rejects.toThrow(UserError);
    const done = runPack(packArgs(ckpt, dst, "native"));
    expect(done.status, done.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), clean)).toBeNull();
  });
});
