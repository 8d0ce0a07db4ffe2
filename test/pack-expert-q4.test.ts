/**
 * `kvl pack --expert-dtype q4` (docs/FORMAT.md "Q4_EXPERT extents", "Versions"): on both tiny
 * models every routed expert is a Q4_EXPERT extent whose bytes equal the independent writer's
 * (test/reference/checkpoint.ts q4ExpertExtent, written from FORMAT.md), the trunk and vision are
 * byte-identical to the default pack's (and, with --trunk-dtype q8, to the Q8-trunk pack's), the
 * pack says format version 3 and expert_dtype q4 (after trunk_dtype), the reader dequantises the
 * extents as the reference does, the CRCs cover the new records, both cores give the same bytes, a
 * SIGKILLed q4 pack resumes to the same bytes, an unfinished or finished pack is not taken over
 * with the other expert dtype, a config whose dimensions are not multiples of 32 is refused in one
 * line before anything is written, the readers refuse Q4_EXPERT in an older index and in a wrong
 * shape, and the pack checks, kvl doctor and kvl bench's byte accounting read it.
 * The default (q8) staying byte-identical to the Python packer is test/packer-python-hashes.
 */
import { spawnSync } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { packBytes } from "../host/bench/bench-model.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { expectedTensors } from "../host/pack/model-spec.js";
import { configProblems, openRunnablePack } from "../host/pack/pack-check.js";
import {
  type CompleteMarker, DTYPE_Q4_EXPERT, PackReader, crc32, decodeIndex, encodeIndex, encodeCompleteMarker, verify,
} from "../host/pack/pack-format.js";
import { packageRoot } from "../host/system/paths.js";
import { UserError } from "../host/system/user-error.js";
import { packCheckpoint } from "../packer/pack.js";
import { presetConfigText } from "../packer/synth.js";
import { CheckpointSource, type TensorSource } from "../packer/tensor-source.js";
import { q4ExpertExtent, q4RoundtripGroups } from "./reference/checkpoint.js";
import { copyDir, runPack, tempDir, TINY_MODELS, tinyCheckpoint, treeBytes, treeDiff } from "./support/pack-fixtures.js";

const u16 = (b: Uint8Array): Uint16Array => new Uint16Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));
const a64 = (x: number): number => Math.ceil(x / 64) * 64;
/** FORMAT.md's Q4_EXPERT nbytes for I, H. */
const q4Nbytes = (i: number, h: number): number => {
  const s0 = a64(a64(a64(i * h / 2) + i * h / 2) + h * i / 2);
  return a64(a64(s0 + 2 * (i * h / 32)) + 2 * (i * h / 32)) + 2 * (h * i / 32);
};

let tmp: { dir: string; cleanup: () => void };
let native: NativeBackend;
/** Per tiny model: its checkpoint, the default pack and the q4 pack. */
const models: Array<{ name: string; ckpt: string; q8: string; q4: string }> = [];
let q4TrunkQ8: string;
let q8TrunkQ8: string;

beforeAll(async () => {
  tmp = tempDir("pack-q4");
  native = new NativeBackend();
  for (const { name, seed, extra } of TINY_MODELS) {
    const ckpt = await tinyCheckpoint(join(tmp.dir, `${name}-ckpt`), native, seed, extra);
    const q8 = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q8`), { core: native, allowRevision: true });
    const q4 = await packCheckpoint(ckpt, join(tmp.dir, `${name}-q4`), { core: native, allowRevision: true, expertDtype: "q4" });
    models.push({ name, ckpt, q8, q4 });
  }
  const { ckpt } = models[0]!;
  q4TrunkQ8 = await packCheckpoint(ckpt, join(tmp.dir, "q4-trunk-q8"), { core: native, allowRevision: true, expertDtype: "q4", trunkDtype: "q8" });
  q8TrunkQ8 = await packCheckpoint(ckpt, join(tmp.dir, "q8-trunk-q8"), { core: native, allowRevision: true, trunkDtype: "q8" });
}, 300_000);

afterAll(() => {
  native?.close();
  tmp?.cleanup();
});

describe.each(TINY_MODELS.map((m) => m.name))("a pack with Q4 experts (%s)", (name) => {
  const model = () => models.find((m) => m.name === name)!;

  it("stores every routed expert as FORMAT.md's Q4_EXPERT bytes and the trunk and vision as the default pack does", async () => {
    const { ckpt, q8, q4 } = model();
    const reader = await verify(q4, { checkDataCrc: true });
    const src = await CheckpointSource.open(ckpt);
    try {
      const experts = reader.stores.get("experts")!.records;
      expect(experts.length).toBeGreaterThan(0);
      for (const rec of experts) {
        const [layer, expert, inter, hidden] = rec.shape as [number, number, number, number];
        expect(rec.dtype, rec.name).toBe(DTYPE_Q4_EXPERT);
        expect(rec.nbytes).toBe(q4Nbytes(inter, hidden));
        const part = async (p: string): Promise<Uint16Array> => u16(await src.read(`language_model.model.layers.${layer}.mlp.experts.${expert}.${p}.weight`));
        const want = q4ExpertExtent(await part("gate_proj"), await part("up_proj"), await part("down_proj"), inter, hidden);
        expect(Buffer.from(await reader.raw("experts", rec)).equals(Buffer.from(want)), rec.name).toBe(true);
      }
    } finally {
      await src.close();
    }
    for (const store of ["trunk", "vision"]) {
      expect(readFileSync(join(q4, `${store}.bin`)).equals(readFileSync(join(q8, `${store}.bin`))), store).toBe(true);
    }
    expect(readFileSync(join(q4, "experts.bin")).length).toBeLessThan(readFileSync(join(q8, "experts.bin")).length);
    expect(reader.expertDtype).toBe("q4");
    expect((await PackReader.open(q8)).expertDtype).toBe("q8");
  });

  it("reads back, dequantised, as the reference's Q4 round trip of the checkpoint's weights", async () => {
    const { ckpt, q4 } = model();
    const reader = await PackReader.open(q4);
    const src = await CheckpointSource.open(ckpt);
    try {
      const rec = reader.stores.get("experts")!.records.at(-1)!;
      const [layer, expert, inter, hidden] = rec.shape as [number, number, number, number];
      const got = await reader.expert(layer, expert);
      for (const [p, shape] of [["gate_proj", [inter, hidden]], ["up_proj", [inter, hidden]], ["down_proj", [hidden, inter]]] as const) {
        const bits = u16(await src.read(`language_model.model.layers.${layer}.mlp.experts.${expert}.${p}.weight`));
        const values = Float64Array.from(bits, (b) => new Float32Array(new Uint32Array([b << 16]).buffer)[0]!);
        const want = q4RoundtripGroups({ shape: [...shape], data: values }).data;
        expect(Array.from(got[p]), p).toEqual(Array.from(want));
      }
    } finally {
      await src.close();
    }
  });
});

describe("Q4 experts: version, marker, CRCs, cores, checks", () => {
  it("says format version 3 and expert_dtype q4 (after trunk_dtype q8 when the trunk is Q8 too)", () => {
    const marker = (pack: string): string => readFileSync(join(pack, "PACK_COMPLETE.json"), "utf8");
    const { q4 } = models[0]!;
    const complete = JSON.parse(marker(q4)) as Record<string, unknown>;
    expect(complete.format_version).toBe(3);
    expect(complete.expert_dtype).toBe("q4");
    expect("trunk_dtype" in complete).toBe(false);
    expect(Object.keys(complete)).toEqual(["format_version", "source_revision", "files", "expert_dtype"]);
    const both = JSON.parse(marker(q4TrunkQ8)) as Record<string, unknown>;
    expect(Object.keys(both)).toEqual(["format_version", "source_revision", "files", "trunk_dtype", "expert_dtype"]);
    expect(both.format_version).toBe(3);
    // the marker is written as FORMAT.md says: JSON.stringify with one space, then a line feed
    expect(marker(q4)).toBe(encodeCompleteMarker(complete as unknown as CompleteMarker));
    expect("expert_dtype" in (JSON.parse(marker(models[0]!.q8)) as object)).toBe(false);
    for (const store of ["trunk", "experts", "vision"]) {
      expect(readFileSync(join(q4, `${store}.idx`)).readUInt32LE(8), store).toBe(3);
      expect(readFileSync(join(q4TrunkQ8, `${store}.idx`)).readUInt32LE(8), store).toBe(3);
    }
  });

  it("with --trunk-dtype q8 too: the trunk is the Q8-trunk pack's bytes, the experts the Q4 pack's", () => {
    expect(readFileSync(join(q4TrunkQ8, "trunk.bin")).equals(readFileSync(join(q8TrunkQ8, "trunk.bin")))).toBe(true);
    expect(readFileSync(join(q4TrunkQ8, "experts.bin")).equals(readFileSync(join(models[0]!.q4, "experts.bin")))).toBe(true);
  });

  it("has CRCs that find a flipped bit in an extent's scales", async () => {
    const { q4 } = models[0]!;
    const reader = await PackReader.open(q4);
    const rec = reader.stores.get("experts")!.records[1]!;
    const copy = copyDir(q4, join(tmp.dir, "q4-corrupt"));
    const bin = readFileSync(join(copy, "experts.bin"));
    bin[rec.offset + rec.nbytes - 1]! ^= 0x01; // the last down_proj scale's high byte
    writeFileSync(join(copy, "experts.bin"), bin);
    await expect(verify(copy, { checkDataCrc: true })).rejects.toThrow(new RegExp(`experts\\.bin: data of '${rec.name.replace(/\./g, "\\.")}' is corrupt`));
  });

  it("is the same bytes from the WebAssembly core", async () => {
    const wasm = await WasmBackend.create();
    try {
      const { ckpt, q4 } = models[1]!;
      const dst = await packCheckpoint(ckpt, join(tmp.dir, "q4-wasm"), { core: wasm, allowRevision: true, expertDtype: "q4" });
      expect(treeDiff(treeBytes(dst), treeBytes(q4))).toBeNull();
    } finally {
      wasm.close();
    }
  });

  it("passes the runtime's pack checks; mixed expert dtypes are a problem named", async () => {
    const { q4, q8 } = models[0]!;
    const reader = await openRunnablePack(q4);
    expect(configProblems(q4, reader).problems).toEqual([]);
    // an experts.idx with one Q4 extent among Q8 ones (each record valid on its own)
    const mixed = copyDir(q8, join(tmp.dir, "mixed"));
    const q8Reader = await PackReader.open(q8);
    const experts = q8Reader.stores.get("experts")!;
    const [first, ...rest] = experts.records;
    const q4First = { ...first!, dtype: DTYPE_Q4_EXPERT, nbytes: q4Nbytes(first!.shape[2]!, first!.shape[3]!) };
    const idx = encodeIndex(2, experts.binSize, experts.hparams, [q4First, ...rest], experts.configText, experts.revision, 3);
    writeFileSync(join(mixed, "experts.idx"), idx);
    for (const store of ["trunk", "vision"]) {
      const data = readFileSync(join(mixed, `${store}.idx`));
      const index = decodeIndex(data, `${store}.idx`);
      writeFileSync(join(mixed, `${store}.idx`), encodeIndex(index.kind, index.binSize, index.hparams, index.records, index.configText, index.revision, 3));
    }
    const marker = JSON.parse(readFileSync(join(mixed, "PACK_COMPLETE.json"), "utf8")) as CompleteMarker;
    marker.format_version = 3;
    for (const store of ["trunk", "experts", "vision"]) {
      const data = readFileSync(join(mixed, `${store}.idx`));
      marker.files[`${store}.idx`] = { size: data.length, crc32: crc32(data) };
    }
    writeFileSync(join(mixed, "PACK_COMPLETE.json"), encodeCompleteMarker(marker));
    const bad = await PackReader.open(mixed);
    expect(configProblems(mixed, bad).problems).toEqual([
      `${rest[0]!.name}: dtype Q8_EXPERT, ${first!.name} Q4_EXPERT; the extents must all be Q8_EXPERT or all Q4_EXPERT`,
    ]);
  });

  it("is named by kvl doctor --json (format version 3, q4 routed experts), which passes it", () => {
    const run = (pack: string): { pass: boolean; detail: string } => {
      const r = spawnSync(process.execPath, [join(packageRoot, "dist", "cli", "kvl.js"), "doctor", pack, "--quick", "--json", "--backend", "native"],
        { encoding: "utf8", timeout: 120_000 });
      const report = JSON.parse(r.stdout) as { checks: Array<{ name: string; status: string; detail: string }> };
      return { pass: report.checks.every((c) => c.status !== "FAIL"), detail: report.checks.find((c) => c.name === "pack")!.detail };
    };
    const q4 = run(models[0]!.q4);
    expect(q4.detail).toContain("format version 3, bf16 trunk Linear weights, q4 routed experts");
    expect(q4.pass).toBe(true);
    expect(run(q4TrunkQ8).detail).toContain("format version 3, q8 trunk Linear weights, q4 routed experts");
    expect(run(models[0]!.q8).detail).toContain("format version 1, bf16 trunk Linear weights, q8 routed experts");
  });

  it("kvl bench's byte accounting reads an extent's Q4 bytes", async () => {
    const pb = await packBytes(models[0]!.q4);
    const reader = await PackReader.open(models[0]!.q4);
    const [, , inter, hidden] = reader.stores.get("experts")!.records[0]!.shape as [number, number, number, number];
    expect(pb.extent_data).toBe(q4Nbytes(inter, hidden));
    expect(pb.extent_data).toBeLessThan((await packBytes(models[0]!.q8)).extent_data);
  });
});

describe("kvl pack --expert-dtype q4 in a child process", () => {
  const args = (dst: string, ...more: string[]): string[] => [models[0]!.ckpt, dst, "--quiet", "--allow-revision", "--backend", "native", ...more];

  it("SIGKILLed at fixed points, then rerun, gives the uninterrupted q4 pack byte for byte", () => {
    const dst = join(tmp.dir, "q4-killed");
    for (const point of ["item:3", "flush:2", "final:experts.idx"]) {
      const r = runPack(args(dst, "--expert-dtype", "q4"), { KVL_PACK_TEST_KILL_AT: point, KVL_PACK_FLUSH_ITEMS: "4" });
      expect(r.signal, r.stderr).toBe("SIGKILL");
    }
    const r = runPack(args(dst, "--expert-dtype", "q4"));
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), treeBytes(models[0]!.q4))).toBeNull();
  });

  it("refuses to finish an unfinished pack with the other expert dtype, naming the one to use", () => {
    const dst = join(tmp.dir, "q8-killed");
    const killed = runPack(args(dst), { KVL_PACK_TEST_KILL_AT: "item:3" });
    expect(killed.signal, killed.stderr).toBe("SIGKILL");
    const r = runPack(args(dst, "--expert-dtype", "q4"));
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(`kvl pack: error: ${dst}: holds an unfinished pack made with --expert-dtype q8, not q4; ` +
      "rerun with --expert-dtype q8 to finish it, or delete the directory\n");
    const finish = runPack(args(dst));
    expect(finish.status, finish.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), treeBytes(models[0]!.q8))).toBeNull();
  });

  it("refuses to take a finished pack for one with the other expert dtype", () => {
    const dst = copyDir(models[0]!.q4, join(tmp.dir, "q4-finished"));
    const before = treeBytes(dst);
    const r = runPack(args(dst));
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(`kvl pack: error: ${dst} is a finished pack made with --expert-dtype q4, not q8; ` +
      `choose another destination, or remove ${dst} to repack it\n`);
    expect(treeDiff(treeBytes(dst), before)).toBeNull();
    expect(runPack(args(dst, "--expert-dtype", "q4")).status).toBe(0);
  });

  it("rejects an unknown --expert-dtype, for kvl pack and kvl prepare", () => {
    const r = runPack(args(join(tmp.dir, "never"), "--expert-dtype", "q2"));
    expect(r.status).not.toBe(0);
    expect(r.stderr).toMatch(/--expert-dtype.*q2.*q8, q4/s);
    const prepare = spawnSync(process.execPath, [join(packageRoot, "dist", "cli", "kvl.js"), "prepare", join(tmp.dir, "never2"), "--expert-dtype", "q2"],
      { encoding: "utf8", timeout: 60_000 });
    expect(prepare.status).not.toBe(0);
    expect(prepare.stderr).toMatch(/--expert-dtype.*q2.*q8, q4/s);
    expect(existsSync(join(tmp.dir, "never2"))).toBe(false);
  });
});

/** The tiny config with moe_intermediate_size 48 (not a multiple of 32), and a source of its
 * inventory whose tensors are never read: q4 must be refused before anything is. */
class Moe48Source implements TensorSource {
  readonly #text: string;
  readonly #inventory;

  constructor() {
    const config = JSON.parse(presetConfigText("tiny")) as { text_config: Record<string, unknown> };
    config.text_config.moe_intermediate_size = 48;
    this.#text = JSON.stringify(config);
    this.#inventory = expectedTensors(config);
  }

  config(): unknown {
    return JSON.parse(this.#text);
  }

  async assetFiles(): Promise<ReadonlyMap<string, Uint8Array>> {
    return new Map([["config.json", Buffer.from(this.#text)]]);
  }

  revision(): string | null {
    return null;
  }

  tensorNames(): string[] {
    return [...this.#inventory.keys()];
  }

  tensorInfo(name: string) {
    return this.#inventory.get(name)!;
  }

  shardOf(): string | null {
    return null;
  }

  async read(name: string): Promise<Uint8Array> {
    throw new Error(`${name} read: the refusal should have come first`);
  }
}

describe("the Q4 refusals", () => {
  it("refuses --expert-dtype q4 for dimensions that are not multiples of 32, in one line, writing nothing", async () => {
    const dst = join(tmp.dir, "moe48");
    const err = await packCheckpoint(new Moe48Source(), dst, { core: native, allowRevision: true, expertDtype: "q4" }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UserError);
    expect((err as Error).message).toBe("--expert-dtype q4 needs hidden_size and moe_intermediate_size to be multiples of 32 " +
      "(this config: 64 and 48); pack with --expert-dtype q8");
    expect(existsSync(dst)).toBe(false);
  });

  const rec = { name: "language_model.model.layers.1.mlp.experts.0", dtype: DTYPE_Q4_EXPERT, shape: [1, 0, 32, 64], offset: 0, nbytes: q4Nbytes(32, 64), crc32: 0 };

  it("reads a version-3 index with a Q4_EXPERT record", () => {
    const idx = decodeIndex(encodeIndex(2, 4096, [], [rec], "{}", null, 3), "e.idx");
    expect(idx.version).toBe(3);
    expect(idx.records[0]!.nbytes).toBe(rec.nbytes);
  });

  it("refuses Q4_EXPERT in a version-1 or 2 index, a wrong size, dimensions not multiples of 32, and version 4", () => {
    for (const version of [1, 2]) {
      expect(() => decodeIndex(encodeIndex(2, 4096, [], [rec], "{}", null, version), "e.idx"))
        .toThrow(`e.idx: tensor '${rec.name}' is Q4_EXPERT, which needs format version 3 (the index says ${version})`);
    }
    expect(() => decodeIndex(encodeIndex(2, 4096, [], [{ ...rec, nbytes: rec.nbytes + 2 }], "{}", null, 3), "e.idx"))
      .toThrow(`e.idx: tensor '${rec.name}' is ${rec.nbytes + 2} bytes but its dtype and shape need ${rec.nbytes}`);
    for (const shape of [[1, 0, 48, 64], [1, 0, 32, 40], [1, 0, 0, 64], [32, 64]]) {
      expect(() => decodeIndex(encodeIndex(2, 8192, [], [{ ...rec, shape, nbytes: 64 }], "{}", null, 3), "e.idx"))
        .toThrow(/Q4 expert records need shape \[layer, expert, I, H\] with I, H positive multiples of 32/);
    }
    expect(() => decodeIndex(encodeIndex(2, 4096, [], [], "{}", null, 4), "e.idx"))
      .toThrow("e.idx: format version 4, this kvl reads versions 1, 2 and 3; repack with this kvl version");
  });
});
