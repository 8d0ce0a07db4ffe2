/**
 * `kvl pack --trunk-dtype q8` (docs/FORMAT.md "Q8_ROWS", "Versions"): every trunk Linear weight
 * is a Q8_ROWS record whose bytes equal an independent row-wise Q8 written from FORMAT.md, the
 * rest of the pack is byte-identical to the default BF16 pack, the pack says format version 2
 * and trunk_dtype q8, its CRCs cover the new records, both cores give the same bytes, a SIGKILLed
 * q8 pack resumes to the same bytes, an unfinished pack is not resumed with the other trunk
 * dtype, the readers refuse Q8_ROWS in a version-1 index, and the pack checks and kvl doctor
 * accept it (doctor names the format version and trunk dtype).
 * The default (bf16) staying byte-identical to the Python packer is test/packer-python-hashes.
 */
import { spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { configProblems, openRunnablePack } from "../host/pack/pack-check.js";
import { packageRoot } from "../host/system/paths.js";
import {
  DTYPE_Q8_ROWS, PackReader, STORE_TRUNK, decodeIndex, encodeIndex, verify,
} from "../host/pack/pack-format.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { UserError } from "../host/system/user-error.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { CheckpointSource } from "../packer/tensor-source.js";
import { copyDir, runPack, tempDir, tinyCheckpoint, treeBytes, treeDiff } from "./support/pack-fixtures.js";

// Independent of the packer and the core: FORMAT.md's row rule and layout, written out here.
const a64 = (x: number): number => Math.ceil(x / 64) * 64;
const widen = new Uint32Array(1);
const widened = new Float32Array(widen.buffer);
/** BF16 bits -> the FP32 value (the top half of an FP32) */
const bits2f = (b: number): number => {
  widen[0] = b << 16;
  return widened[0]!;
};
const u16 = (b: Uint8Array): Uint16Array => new Uint16Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));

function roundHalfEven(x: number): number {
  const f = Math.floor(x);
  const d = x - f;
  if (d < 0.5) return f;
  if (d > 0.5) return f + 1;
  return f % 2 === 0 ? f : f + 1;
}

/** A Q8_ROWS record's bytes: int8 rows, zero padding to 64, one FP32 scale per row. */
function referenceQ8Rows(bits: Uint16Array, rows: number, cols: number): Uint8Array {
  const out = new Uint8Array(a64(rows * cols) + 4 * rows);
  const q = new Int8Array(out.buffer, 0, rows * cols);
  const s = new Float32Array(out.buffer, a64(rows * cols), rows);
  for (let r = 0; r < rows; r++) {
    let amax = 0;
    for (let c = 0; c < cols; c++) amax = Math.max(amax, Math.abs(bits2f(bits[r * cols + c]!)));
    const scale = Math.fround(amax / 127);
    s[r] = scale;
    if (scale === 0) continue;
    for (let c = 0; c < cols; c++) q[r * cols + c] = Math.max(-127, Math.min(127, roundHalfEven(Math.fround(bits2f(bits[r * cols + c]!) / scale))));
  }
  return out;
}

/** FORMAT.md's list of Q8_ROWS tensors, spelled out (not the packer's regex). */
function isTrunkLinear(name: string): boolean {
  if (name === "language_model.lm_head.weight") return true;
  const suffixes = ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"];
  return suffixes.some((s) => new RegExp(`^language_model\\.model\\.layers\\.\\d+\\.${s.replace(/\./g, "\\.")}\\.weight$`).test(name));
}

let tmp: { dir: string; cleanup: () => void };
let native: NativeBackend;
let ckpt: string;
let bf16Pack: string;
let q8Pack: string;

beforeAll(async () => {
  tmp = tempDir("pack-q8");
  native = new NativeBackend();
  ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), native, 0);
  bf16Pack = await packCheckpoint(ckpt, join(tmp.dir, "bf16"), { core: native, allowRevision: true });
  q8Pack = await packCheckpoint(ckpt, join(tmp.dir, "q8"), { core: native, allowRevision: true, trunkDtype: "q8" });
}, 120_000);

afterAll(() => {
  native?.close();
  tmp?.cleanup();
});

describe("a pack with a Q8 trunk", () => {
  it("stores every trunk Linear weight as FORMAT.md's Q8_ROWS bytes and every other tensor as the BF16 pack does", async () => {
    const reader = await verify(q8Pack, { checkDataCrc: true });
    const plain = await PackReader.open(bf16Pack);
    const src = await CheckpointSource.open(ckpt);
    let quantised = 0;
    try {
      for (const rec of reader.stores.get("trunk")!.records) {
        const raw = await reader.raw("trunk", rec);
        if (isTrunkLinear(rec.name)) {
          quantised++;
          const [rows, cols] = src.tensorInfo(rec.name).shape as [number, number];
          expect(rec.dtype, rec.name).toBe(DTYPE_Q8_ROWS);
          expect(rec.shape).toEqual([rows, cols]);
          expect(rec.nbytes).toBe(a64(rows * cols) + 4 * rows);
          const want = referenceQ8Rows(u16(await src.read(rec.name)), rows, cols);
          expect(Buffer.from(raw).equals(Buffer.from(want)), rec.name).toBe(true);
          // the reader's dequantisation is q * scale of that row
          const deq = await reader.tensorF32(rec.name);
          const q = new Int8Array(want.buffer, 0, rows * cols);
          const s = new Float32Array(want.buffer, a64(rows * cols), rows);
          expect(deq[cols + 1]).toBe(Math.fround(q[cols + 1]! * s[1]!));
        } else {
          const other = plain.record(rec.name);
          expect(rec.dtype, rec.name).toBe(other.dtype);
          expect(rec.dtype === DTYPE_Q8_ROWS).toBe(false);
          expect(Buffer.from(raw).equals(Buffer.from(await plain.raw("trunk", other))), rec.name).toBe(true);
        }
      }
    } finally {
      await src.close();
    }
    // tiny preset: 3 dense-or-shared MLP + 4 attention per layer, plus lm_head
    const layers = reader.hparams.get("text.num_hidden_layers")!;
    expect(quantised).toBe(layers * 7 + 1);
    expect(reader.trunkDtype).toBe("q8");
    expect(plain.trunkDtype).toBe("bf16");
    for (const store of ["experts", "vision"]) {
      expect(readFileSync(join(q8Pack, `${store}.bin`)).equals(readFileSync(join(bf16Pack, `${store}.bin`))), store).toBe(true);
    }
    expect(readFileSync(join(q8Pack, "trunk.bin")).length).toBeLessThan(readFileSync(join(bf16Pack, "trunk.bin")).length);
  });

  it("says format version 2 and trunk_dtype q8; the default pack stays version 1 without the key", () => {
    const complete = JSON.parse(readFileSync(join(q8Pack, "PACK_COMPLETE.json"), "utf8")) as Record<string, unknown>;
    expect(complete.format_version).toBe(2);
    expect(complete.trunk_dtype).toBe("q8");
    const plain = JSON.parse(readFileSync(join(bf16Pack, "PACK_COMPLETE.json"), "utf8")) as Record<string, unknown>;
    expect(plain.format_version).toBe(1);
    expect("trunk_dtype" in plain).toBe(false);
    for (const store of ["trunk", "experts", "vision"]) {
      expect(readFileSync(join(q8Pack, `${store}.idx`)).readUInt32LE(8), store).toBe(2);
      expect(readFileSync(join(bf16Pack, `${store}.idx`)).readUInt32LE(8), store).toBe(1);
    }
  });

  it("has CRCs that find a flipped byte in a Q8 record's scales", async () => {
    const reader = await PackReader.open(q8Pack);
    const rec = reader.record("language_model.lm_head.weight");
    const copy = copyDir(q8Pack, join(tmp.dir, "q8-corrupt"));
    const bin = readFileSync(join(copy, "trunk.bin"));
    bin[rec.offset + rec.nbytes - 1]! ^= 0x40; // the last row's scale
    writeFileSync(join(copy, "trunk.bin"), bin);
    await expect(verify(copy, { checkDataCrc: true })).rejects.toThrow(/trunk\.bin: data of 'language_model\.lm_head\.weight' is corrupt/);
  });

  it("is the same bytes from the WebAssembly core", async () => {
    const wasm = await WasmBackend.create();
    try {
      const dst = await packCheckpoint(ckpt, join(tmp.dir, "q8-wasm"), { core: wasm, allowRevision: true, trunkDtype: "q8" });
      expect(treeDiff(treeBytes(dst), treeBytes(q8Pack))).toBeNull();
    } finally {
      wasm.close();
    }
  });

  it("is named by kvl doctor --json (format version and trunk dtype), which passes it", () => {
    const run = (pack: string): { pass: boolean; detail: string } => {
      const r = spawnSync(process.execPath, [join(packageRoot, "dist", "cli", "kvl.js"), "doctor", pack, "--quick", "--json", "--backend", "native"],
        { encoding: "utf8", timeout: 120_000 });
      const report = JSON.parse(r.stdout) as { checks: Array<{ name: string; status: string; detail: string }> };
      return { pass: report.checks.every((c) => c.status !== "FAIL"), detail: report.checks.find((c) => c.name === "pack")!.detail };
    };
    const q8 = run(q8Pack);
    expect(q8.detail).toContain("format version 2, q8 trunk Linear weights");
    expect(q8.pass).toBe(true);
    expect(run(bf16Pack).detail).toContain("format version 1, bf16 trunk Linear weights");
  });

  it("passes the runtime's pack checks (config agreement)", async () => {
    const reader = await openRunnablePack(q8Pack);
    expect(configProblems(q8Pack, reader).problems).toEqual([]);
  });
});

describe("kvl pack --trunk-dtype q8 in a child process", () => {
  const args = (dst: string, ...more: string[]): string[] => [ckpt, dst, "--quiet", "--allow-revision", "--backend", "native", ...more];

  it("SIGKILLed at fixed points, then rerun, gives the uninterrupted q8 pack byte for byte", () => {
    const dst = join(tmp.dir, "q8-killed");
    for (const point of ["item:3", "flush:2", "final:trunk.idx"]) {
      const r = runPack(args(dst, "--trunk-dtype", "q8"), { KVL_PACK_TEST_KILL_AT: point, KVL_PACK_FLUSH_ITEMS: "4" });
      expect(r.signal, r.stderr).toBe("SIGKILL");
    }
    const r = runPack(args(dst, "--trunk-dtype", "q8"));
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), treeBytes(q8Pack))).toBeNull();
  });

  it("refuses to finish an unfinished pack with the other trunk dtype, naming the one to use", () => {
    const dst = join(tmp.dir, "bf16-killed");
    const killed = runPack(args(dst), { KVL_PACK_TEST_KILL_AT: "item:3" });
    expect(killed.signal, killed.stderr).toBe("SIGKILL");
    const r = runPack(args(dst, "--trunk-dtype", "q8"));
    expect(r.status).not.toBe(0);
    expect(r.stderr).toMatch(/unfinished pack made with --trunk-dtype bf16, not q8; rerun with --trunk-dtype bf16/);
    const finish = runPack(args(dst));
    expect(finish.status, finish.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), treeBytes(bf16Pack))).toBeNull();
  });

  it("rejects an unknown --trunk-dtype", () => {
    const r = runPack(args(join(tmp.dir, "never"), "--trunk-dtype", "q4"));
    expect(r.status).not.toBe(0);
    expect(r.stderr).toMatch(/--trunk-dtype.*q4.*bf16, q8/s);
  });
});

describe("the index reader and Q8_ROWS", () => {
  const rec = { name: "m.weight", dtype: DTYPE_Q8_ROWS, shape: [3, 5], offset: 0, nbytes: a64(15) + 12, crc32: 0 };

  it("reads a version-2 index with a Q8_ROWS record", () => {
    const idx = decodeIndex(encodeIndex(STORE_TRUNK, 4096, [], [rec], "{}", null, 2), "t.idx");
    expect(idx.version).toBe(2);
    expect(idx.records[0]!.nbytes).toBe(76);
  });

  it("refuses Q8_ROWS in a version-1 index, a wrong size, a 3-D shape and version 4, naming the file and tensor", () => {
    expect(() => decodeIndex(encodeIndex(STORE_TRUNK, 4096, [], [rec], "{}", null, 1), "t.idx"))
      .toThrow(/t\.idx: tensor 'm\.weight' is Q8_ROWS, which needs format version 2/);
    expect(() => decodeIndex(encodeIndex(STORE_TRUNK, 4096, [], [{ ...rec, nbytes: 15 + 12 }], "{}", null, 2), "t.idx"))
      .toThrow(/t\.idx: tensor 'm\.weight' is 27 bytes but its dtype and shape need 76/);
    expect(() => decodeIndex(encodeIndex(STORE_TRUNK, 4096, [], [{ ...rec, shape: [3, 5, 1] }], "{}", null, 2), "t.idx"))
      .toThrow(/t\.idx: tensor 'm\.weight': Q8_ROWS records need shape \[rows, cols\]/);
    expect(() => decodeIndex(encodeIndex(STORE_TRUNK, 4096, [], [], "{}", null, 4), "t.idx"))
      .toThrow(UserError);
    expect(() => decodeIndex(encodeIndex(STORE_TRUNK, 4096, [], [], "{}", null, 4), "t.idx"))
      .toThrow(/format version 4, this kvl reads versions 1, 2 and 3; repack/);
  });

  it("refuses a pack whose marker and indexes disagree on the version", async () => {
    const copy = copyDir(q8Pack, join(tmp.dir, "q8-marker-v1"));
    const marker = join(copy, "PACK_COMPLETE.json");
    writeFileSync(marker, readFileSync(marker, "utf8").replace('"format_version": 2', '"format_version": 1'));
    await expect(PackReader.open(copy)).rejects.toThrow(/trunk\.idx: format version 2 differs from PACK_COMPLETE\.json's 1/);
  });
});
