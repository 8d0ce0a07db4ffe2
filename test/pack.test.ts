/**
 * host/pack/pack-format.ts and packer/pack.ts: the index format, fidelity of a pack to its source
 * (trunk and vision bit-exact, the router bias as F32, every expert extent equal to an
 * independent Q8 reference written from docs/FORMAT.md), the layout rules, refusals before
 * anything is written, and damaged packs found by the reader (kvl's tests/test_pack.py).
 */
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, truncateSync, unlinkSync, writeFileSync, openSync, writeSync, closeSync } from "node:fs";
import { join } from "node:path";
import { crc32 as zcrc } from "node:zlib";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import {
  DTYPE_BF16, DTYPE_F32, DTYPE_Q8_EXPERT, PackReader, STORE_TRUNK, STORE_VISION, type TensorRecord, decodeIndex, encodeIndex, verify,
} from "../host/pack/pack-format.js";
import { UserError } from "../host/system/user-error.js";
import { packCheckpoint } from "../packer/pack.js";
import { CheckpointSource, type TensorSource } from "../packer/tensor-source.js";
import { anyCore, copyDir, runPack, tempDir, tinyCheckpoint, treeBytes, treeDiff } from "./support/pack-fixtures.js";

const PINNED = "398eede0903cd983a2bfa0cc634e9ac1d843f375";
const OTHER_REVISION = "0123456789abcdef0123456789abcdef01234567";

// ------------------------------------------------------------------------------------------------
// Independent references (written from docs/FORMAT.md, sharing no code with the packer)

const a64 = (x: number): number => Math.ceil(x / 64) * 64;
const bits2f = (b: number): number => new Float32Array(new Uint32Array([b << 16]).buffer)[0]!;

function roundHalfEven(x: number): number {
  const f = Math.floor(x);
  const diff = x - f;
  if (diff < 0.5) return f;
  if (diff > 0.5) return f + 1;
  return f % 2 === 0 ? f : f + 1;
}

/** Row-wise Q8 of BF16 bits [rows, cols]: scale = max|row| / 127 in FP32, q = clip(rhe(w / scale)). */
function referenceQ8(bits: Uint16Array, rows: number, cols: number): { q: Int8Array; s: Float32Array } {
  const q = new Int8Array(rows * cols);
  const s = new Float32Array(rows);
  for (let r = 0; r < rows; r++) {
    let amax = 0;
    for (let c = 0; c < cols; c++) amax = Math.max(amax, Math.abs(bits2f(bits[r * cols + c]!)));
    const scale = Math.fround(amax / 127);
    s[r] = scale;
    if (scale === 0) continue;
    for (let c = 0; c < cols; c++) {
      const v = roundHalfEven(Math.fround(bits2f(bits[r * cols + c]!) / scale));
      q[r * cols + c] = Math.max(-127, Math.min(127, v));
    }
  }
  return { q, s };
}

/** One extent's bytes from FORMAT.md's layout. */
function referenceExtent(gate: Uint16Array, up: Uint16Array, down: Uint16Array, I: number, H: number): Uint8Array {
  const upOff = a64(I * H);
  const downOff = a64(upOff + I * H);
  const gs = a64(downOff + H * I);
  const us = a64(gs + 4 * I);
  const ds = a64(us + 4 * I);
  const out = new Uint8Array(ds + 4 * H);
  for (const [w, rows, cols, qOff, sOff] of [[gate, I, H, 0, gs], [up, I, H, upOff, us], [down, H, I, downOff, ds]] as const) {
    const { q, s } = referenceQ8(w, rows, cols);
    out.set(new Uint8Array(q.buffer), qOff);
    out.set(new Uint8Array(s.buffer), sOff);
  }
  return out;
}

const u16 = (b: Uint8Array): Uint16Array => new Uint16Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));

// ------------------------------------------------------------------------------------------------
// Index encoding

const sampleRecords = (): TensorRecord[] => [
  { name: "a.weight", dtype: DTYPE_BF16, shape: [3, 5], offset: 0, nbytes: 30, crc32: 11 },
  { name: "b.bias", dtype: DTYPE_F32, shape: [7], offset: 4096, nbytes: 28, crc32: 22 },
  { name: "c", dtype: DTYPE_BF16, shape: [2, 2, 2, 2], offset: 8192, nbytes: 32, crc32: 0xffffffff },
];

describe("index encoding", () => {
  it("round-trips, with the CRC over the file with its own field zeroed", () => {
    const hp = new Map([["text.hidden_size", 64], ["text.rms_norm_eps", 1e-5], ["media_placeholder_token_id", 163605]]);
    const config = '{"model_type": "kimi_vl", "name": "caf\u00e9"}';
    const data = encodeIndex(STORE_TRUNK, 12288, hp, sampleRecords(), config, "ab".repeat(20));
    expect(data.length).toBe(128 + 64 * 3 + 192 * 3 + Buffer.byteLength(config));
    expect(Buffer.from(data.subarray(0, 8)).toString("latin1")).toBe("KVLIDX01");
    const zeroed = Buffer.from(data);
    zeroed.fill(0, 36, 40);
    expect(Buffer.from(data).readUInt32LE(36)).toBe(zcrc(zeroed) >>> 0);
    const idx = decodeIndex(data, "trunk.idx", STORE_TRUNK);
    expect(idx.records).toEqual(sampleRecords());
    expect([...idx.hparams]).toEqual([...hp]);
    expect(idx.configText).toBe(config);
    expect(idx.revision).toBe("ab".repeat(20));
    expect(idx.binSize).toBe(12288);
    expect(idx.kind).toBe(STORE_TRUNK);
  });

  it.each([
    ["misaligned offset", (r: TensorRecord[]) => [r[0]!, { ...r[1]!, offset: 4000 }, r[2]!], "multiple of 4096"],
    ["out of order", (r: TensorRecord[]) => [r[0]!, r[2]!, r[1]!], "overlaps"],
    ["past the end", (r: TensorRecord[]) => [r[0]!, r[1]!, { ...r[2]!, offset: 12288 }], "past bin_size"],
    ["wrong size", (r: TensorRecord[]) => [{ ...r[0]!, nbytes: 31 }, r[1]!, r[2]!], "is 31 bytes but its dtype and shape need 30"],
  ])("refuses a record that is %s", (_name, mutate, message) => {
    const data = encodeIndex(STORE_TRUNK, 12288, [], mutate(sampleRecords()), "{}", null);
    expect(() => decodeIndex(data, "trunk.idx", STORE_TRUNK)).toThrow(UserError);
    expect(() => decodeIndex(data, "trunk.idx", STORE_TRUNK)).toThrow(message);
  });

  it("refuses a flipped byte, a truncation, a bad magic and the wrong store", () => {
    const data = Buffer.from(encodeIndex(STORE_VISION, 12288, [["x", 1]], sampleRecords(), "{}", null));
    expect(() => decodeIndex(data, "vision.idx", STORE_TRUNK)).toThrow("vision.idx: store kind vision, expected trunk — the index is corrupt; rerun kvl pack");
    data[200]! ^= 0x01;
    expect(() => decodeIndex(data, "vision.idx")).toThrow(/^vision\.idx: CRC mismatch \(stored [0-9a-f]{8}, computed [0-9a-f]{8}\)/);
    expect(() => decodeIndex(data.subarray(0, -3), "vision.idx")).toThrow(/expected \d+ bytes from its header, found \d+/);
    const bad = Buffer.concat([Buffer.from("NOTANIDX"), data.subarray(8)]);
    expect(() => decodeIndex(bad, "vision.idx")).toThrow('vision.idx: bad magic "NOTANIDX" (expected "KVLIDX01") — not a kvl index; rerun kvl pack');
  });
});

// ------------------------------------------------------------------------------------------------
// Packs of the tiny checkpoint

let core: CoreBackend;
let tmp: { dir: string; cleanup: () => void };
let ckpt: string;
let pack: string;
beforeAll(async () => {
  core = await anyCore();
  tmp = tempDir("pack");
  ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), core);
  pack = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core, allowRevision: true });
});
afterAll(() => {
  core.close();
  tmp.cleanup();
});

describe("a packed checkpoint", () => {
  it("holds the source's tensors exactly, the router bias as F32 and Q8 experts equal to the reference", async () => {
    const src = await CheckpointSource.open(ckpt);
    const reader = await verify(pack, { checkDataCrc: true });
    try {
      const config = JSON.parse(readFileSync(join(ckpt, "config.json"), "utf8")) as { text_config: Record<string, number>; media_placeholder_token_id: number };
      const tc = config.text_config;
      expect(reader.config).toEqual(config);
      expect(reader.hparams.get("text.hidden_size")).toBe(tc.hidden_size);
      expect(reader.hparams.get("text.moe_intermediate_size")).toBe(tc.moe_intermediate_size);
      expect(reader.hparams.get("media_placeholder_token_id")).toBe(config.media_placeholder_token_id);
      for (const name of ["config.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja", "generation_config.json", "preprocessor_config.json"]) {
        expect(readFileSync(join(pack, name)).equals(readFileSync(join(ckpt, name))), name).toBe(true);
      }
      expect(readFileSync(join(pack, "SOURCE_REVISION.txt"), "utf8")).toBe("unknown\n");
      expect(existsSync(join(pack, ".pack-journal"))).toBe(false);

      const experts = new Set<string>();
      for (const name of src.tensorNames()) {
        const m = /^language_model\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\./.exec(name);
        if (m) {
          experts.add(`${m[1]}.${m[2]}`);
          continue;
        }
        const { dtype, shape } = src.tensorInfo(name);
        const data = await src.read(name);
        const rec = reader.record(name);
        expect(rec.shape).toEqual(shape);
        expect(reader.storeOf(name)).toBe(name.startsWith("vision_tower.") || name.startsWith("multi_modal_projector.") ? "vision" : "trunk");
        const got = await reader.tensor(name);
        if (name.endsWith("e_score_correction_bias")) {
          expect(rec.dtype).toBe(DTYPE_F32);
          const want = dtype === "BF16" ? Float32Array.from(u16(data), bits2f) : new Float32Array(data.buffer);
          expect(got.data).toEqual(want);
        } else {
          expect(rec.dtype).toBe(DTYPE_BF16);
          expect(Buffer.from(got.data.buffer, got.data.byteOffset, got.data.byteLength).equals(Buffer.from(data))).toBe(true);
        }
      }
      const nMoe = [...Array(tc.num_hidden_layers).keys()].filter((l) => l >= tc.first_k_dense_replace!).length;
      expect(experts.size).toBe(nMoe * tc.n_routed_experts!);
      expect(reader.stores.get("experts")!.records.length).toBe(experts.size);
      const [I, H] = [tc.moe_intermediate_size!, tc.hidden_size!];
      for (const id of experts) {
        const [layer, expert] = id.split(".").map(Number) as [number, number];
        const p = `language_model.model.layers.${layer}.mlp.experts.${expert}.`;
        const [gate, up, down] = await Promise.all(["gate_proj", "up_proj", "down_proj"].map(async (k) => u16(await src.read(`${p}${k}.weight`))));
        const rec = reader.stores.get("experts")!.byName.get(`language_model.model.layers.${layer}.mlp.experts.${expert}`)!;
        expect(rec.dtype).toBe(DTYPE_Q8_EXPERT);
        expect(rec.shape).toEqual([layer, expert, I, H]);
        const raw = await reader.raw("experts", rec);
        expect(Buffer.from(raw).equals(Buffer.from(referenceExtent(gate!, up!, down!, I, H))), id).toBe(true);
        // dequantized within half a step of the source
        const deq = await reader.expert(layer, expert);
        const q = await reader.expertQuantized(layer, expert);
        for (let r = 0; r < I; r++) {
          for (let c = 0; c < H; c++) {
            expect(Math.abs(deq.gate_proj[r * H + c]! - bits2f(gate![r * H + c]!))).toBeLessThanOrEqual(q.gate_s[r]! * (0.5 + 1e-4));
          }
        }
      }
    } finally {
      await src.close();
    }
  });

  it("follows the layout rules: 4 KiB-aligned records, zero padding, experts layer-major, the completion marker", async () => {
    const reader = await PackReader.open(pack);
    const tc = (JSON.parse(readFileSync(join(ckpt, "config.json"), "utf8")) as { text_config: Record<string, number> }).text_config;
    const [I, H] = [tc.moe_intermediate_size!, tc.hidden_size!];
    const up = a64(I * H);
    const down = a64(up + I * H);
    const gateS = a64(down + H * I);
    const upS = a64(gateS + 4 * I);
    const downS = a64(upS + 4 * I);
    const extent = downS + 4 * H;
    for (const [store, index] of reader.stores) {
      const binSize = readFileSync(join(pack, `${store}.bin`)).length;
      expect(binSize).toBe(index.binSize);
      expect(binSize % 4096).toBe(0);
      let end = 0;
      for (const rec of index.records) {
        expect(rec.offset % 4096).toBe(0);
        expect(rec.offset).toBeGreaterThanOrEqual(end);
        end = rec.offset + rec.nbytes;
        expect(end).toBeLessThanOrEqual(binSize);
      }
      if (store === "experts") {
        const keys = index.records.map((r) => [r.shape[0]!, r.shape[1]!] as const);
        expect(keys).toEqual([...keys].sort((a, b) => a[0] - b[0] || a[1] - b[1]));
        expect(index.records.every((r) => r.nbytes === extent && r.shape[2] === I && r.shape[3] === H)).toBe(true);
        expect(index.records.map((r) => r.offset)).toEqual(index.records.map((_, i) => i * Math.ceil(extent / 4096) * 4096));
      }
    }
    const bin = readFileSync(join(pack, "experts.bin"));
    const [r0, r1] = reader.stores.get("experts")!.records as [TensorRecord, TensorRecord];
    expect(bin.subarray(I * H, up).every((b) => b === 0)).toBe(true);
    expect(bin.subarray(gateS + 4 * I, upS).every((b) => b === 0)).toBe(true);
    expect(bin.subarray(r0.offset + r0.nbytes, r1.offset).every((b) => b === 0)).toBe(true);
    const complete = JSON.parse(readFileSync(join(pack, "PACK_COMPLETE.json"), "utf8")) as { format_version: number; files: Record<string, unknown> };
    expect(complete.format_version).toBe(1);
    for (const store of ["trunk", "experts", "vision"]) {
      const idx = readFileSync(join(pack, `${store}.idx`));
      expect(complete.files[`${store}.idx`]).toEqual({ size: idx.length, crc32: zcrc(idx) >>> 0 });
      expect(complete.files[`${store}.bin`]).toEqual({ size: readFileSync(join(pack, `${store}.bin`)).length });
    }
  });

  it("stores an F32 router bias unchanged", async () => {
    const dir = join(tmp.dir, "f32bias");
    const src = await tinyCheckpoint(join(dir, "ckpt"), core, 7, { biasDtype: "f32" });
    const out = await packCheckpoint(src, join(dir, "pack"), { core, allowRevision: true });
    const source = await CheckpointSource.open(src);
    const reader = await verify(out, { checkDataCrc: true });
    const name = "language_model.model.layers.1.mlp.gate.e_score_correction_bias";
    expect(source.tensorInfo(name).dtype).toBe("F32");
    expect(Buffer.from((await reader.tensor(name)).data.buffer).equals(Buffer.from(await source.read(name)))).toBe(true);
    await source.close();
    rmSync(dir, { recursive: true });
  });

  it("is the same from a TensorSource object as from the directory, and says when it has nothing to do", async () => {
    const inner = await CheckpointSource.open(ckpt);
    const wrapped: TensorSource = {
      config: () => inner.config(), assetFiles: () => inner.assetFiles(), revision: () => inner.revision(),
      tensorNames: () => inner.tensorNames(), tensorInfo: (n) => inner.tensorInfo(n), shardOf: (n) => inner.shardOf(n),
      read: (n) => inner.read(n),
    };
    const out = join(tmp.dir, "from-object");
    await packCheckpoint(wrapped, out, { core, allowRevision: true });
    expect(treeDiff(treeBytes(out), treeBytes(pack))).toBeNull();
    await expect(packCheckpoint(wrapped, join(tmp.dir, "x"), { core, allowRevision: true, deleteConsumedShards: true }))
      .rejects.toThrow("--delete-consumed-shards needs a checkpoint directory as the source");
    await inner.close();
    const lines: string[] = [];
    await packCheckpoint(ckpt, out, { core, allowRevision: true, log: (l) => lines.push(l) });
    expect(lines).toEqual([`${out} already holds a complete pack; nothing to do`]);
  });
});

describe("kvl pack --synth-preset", () => {
  it("packs the generator's model directly, byte-identical to packing its checkpoint", () => {
    const dst = join(tmp.dir, "direct");
    const r = runPack(["--quiet", "--synth-preset", "tiny", "--seed", "0", dst, "--backend", "wasm"]);
    expect(r.status, r.stderr).toBe(0);
    expect(treeDiff(treeBytes(dst), treeBytes(pack))).toBeNull();
  });

  it("wants exactly DST with it and SRC DST without it", () => {
    const a = runPack(["--synth-preset", "tiny", ckpt, join(tmp.dir, "x")]);
    expect(a.status).toBe(1);
    expect(a.stderr).toBe("kvl pack: error: with --synth-preset give only DST (the source is synthesized)\n");
    const b = runPack([ckpt]);
    expect(b.status).toBe(1);
    expect(b.stderr).toBe("kvl pack: error: expected SRC DST (a checkpoint directory and an output directory)\n");
  });
});

// ------------------------------------------------------------------------------------------------
// Bad inputs: refused before anything is written

async function refuse(src: string, dst: string, match: string | RegExp, allowRevision = true): Promise<string> {
  let message = "";
  try {
    await packCheckpoint(src, dst, { core, allowRevision });
  } catch (err) {
    expect(err).toBeInstanceOf(UserError);
    message = (err as Error).message;
  }
  expect(message).toMatch(match);
  expect(!existsSync(dst) || !readdirSync(dst).some((f) => f.endsWith(".bin")), "wrote output for a refused source").toBe(true);
  return message;
}

function rewriteHeader(shard: string, edit: (h: Record<string, { shape: number[] }>) => void): void {
  const raw = readFileSync(shard);
  const n = Number(raw.readBigUInt64LE(0));
  const header = JSON.parse(raw.subarray(8, 8 + n).toString()) as Record<string, { shape: number[] }>;
  edit(header);
  const text = Buffer.from(JSON.stringify(header));
  expect(text.length).toBeLessThanOrEqual(n);
  writeFileSync(shard, Buffer.concat([raw.subarray(0, 8), text, Buffer.alloc(n - text.length, 0x20), raw.subarray(8 + n)]));
}

describe("refusals", () => {
  let k = 0;
  const copy = (): string => copyDir(ckpt, join(tmp.dir, `bad${k++}`));
  const weightMap = (dir: string): Record<string, string> =>
    (JSON.parse(readFileSync(join(dir, "model.safetensors.index.json"), "utf8")) as { weight_map: Record<string, string> }).weight_map;

  it("refuses an unknown or unpinned revision without --allow-revision", async () => {
    const a = await refuse(ckpt, join(tmp.dir, "rev-a"), /--allow-revision/, false);
    expect(a).toContain("source revision is unknown (no revision recorded)");
    expect(a).toContain(PINNED);
    const src = copy();
    writeFileSync(join(src, "SOURCE_REVISION.txt"), `${OTHER_REVISION}\n`);
    const b = await refuse(src, join(tmp.dir, "rev-b"), OTHER_REVISION, false);
    expect(b).toBe(`cannot pack this source (1 problem(s)):\n  - source revision is ${OTHER_REVISION}, but kvl is pinned to ` +
      `moonshotai/Kimi-VL-A3B-Instruct at ${PINNED}; pass --allow-revision to pack it anyway`);
    const cli = runPack([src, join(tmp.dir, "rev-c"), "--quiet"]);
    expect(cli.status).toBe(1);
    expect(cli.stderr).toMatch(/^kvl pack: error: cannot pack this source/);
    expect(cli.stderr).toContain(OTHER_REVISION);
    expect(cli.stderr).not.toMatch(/\n\s+at /); // no stack trace
  });

  it("refuses a wrong shape in a shard header", async () => {
    const src = copy();
    const wm = weightMap(src);
    const name = Object.keys(wm).find((n) => n.endsWith("self_attn.q_proj.weight"))!;
    rewriteHeader(join(src, wm[name]!), (h) => {
      h[name]!.shape = [...h[name]!.shape].reverse();
    });
    expect(await refuse(src, join(tmp.dir, "out-shape"), "wrong shape")).toContain(name);
  });

  it("refuses a missing tensor", async () => {
    const src = copy();
    const path = join(src, "model.safetensors.index.json");
    const index = JSON.parse(readFileSync(path, "utf8")) as { weight_map: Record<string, string> };
    const name = Object.keys(index.weight_map).find((n) => n.includes(".mlp.experts.3.up_proj"))!;
    delete index.weight_map[name];
    writeFileSync(path, JSON.stringify(index));
    expect(await refuse(src, join(tmp.dir, "out-missing"), "missing")).toContain(name);
  });

  it("refuses a truncated shard, naming it", async () => {
    const src = copy();
    const shard = readdirSync(src).filter((f) => f.endsWith(".safetensors")).sort().at(-1)!;
    truncateSync(join(src, shard), readFileSync(join(src, shard)).length - 1000);
    expect(await refuse(src, join(tmp.dir, "out-trunc"), shard)).toMatch(/is truncated: header says \d+ bytes of data, file has \d+; re-download it/);
  });

  it.each([
    ["q_lora_rank", (t: Record<string, unknown>) => { t.q_lora_rank = 64; }],
    ["rope_scaling", (t: Record<string, unknown>) => { t.rope_scaling = { type: "yarn", factor: 4 }; }],
    ["scoring_func", (t: Record<string, unknown>) => { t.scoring_func = "softmax"; }],
  ])("refuses an unsupported config (%s)", async (match, edit) => {
    const src = copy();
    const config = JSON.parse(readFileSync(join(src, "config.json"), "utf8")) as { text_config: Record<string, unknown> };
    edit(config.text_config);
    writeFileSync(join(src, "config.json"), JSON.stringify(config));
    await refuse(src, join(tmp.dir, `out-${match}`), match);
  });

  it("refuses an unreadable config and a busy destination", async () => {
    const src = copy();
    writeFileSync(join(src, "config.json"), "{not json");
    await refuse(src, join(tmp.dir, "out-config"), /config\.json is unreadable/);
    const dst = join(tmp.dir, "busy");
    mkdirSync(dst);
    writeFileSync(join(dst, "notes.txt"), "mine");
    await refuse(ckpt, dst, `${dst}: is not empty (notes.txt) and holds no unfinished pack; choose an empty or new destination`);
    expect(readFileSync(join(dst, "notes.txt"), "utf8")).toBe("mine");
    await refuse(join(tmp.dir, "nowhere"), join(tmp.dir, "out-none"), `${join(tmp.dir, "nowhere")}: no such checkpoint directory`);
  });
});

// ------------------------------------------------------------------------------------------------
// Damaged packs

describe("damaged packs", () => {
  let k = 0;
  const copy = (): string => copyDir(pack, join(tmp.dir, `damaged${k++}`));

  it("reports a truncated .bin with the sizes", async () => {
    const p = copy();
    const expected = readFileSync(join(p, "experts.bin")).length;
    truncateSync(join(p, "experts.bin"), 4096);
    await expect(verify(p)).rejects.toThrow(new UserError(`experts.bin: expected ${expected} bytes, found 4096 — the pack is incomplete; rerun kvl pack`));
  });

  it("reports a flipped index byte and a missing completion marker", async () => {
    const p = copy();
    const data = readFileSync(join(p, "trunk.idx"));
    data[300]! ^= 0x10;
    writeFileSync(join(p, "trunk.idx"), data);
    await expect(verify(p)).rejects.toThrow(/^trunk\.idx: does not match PACK_COMPLETE\.json/);
    expect(() => decodeIndex(data, "trunk.idx")).toThrow("CRC mismatch");
    unlinkSync(join(p, "PACK_COMPLETE.json"));
    await expect(verify(p)).rejects.toThrow(`${p}: PACK_COMPLETE.json is missing — the pack is incomplete; rerun kvl pack`);
  });

  it("reads PACK_COMPLETE.json as JSON and names what is wrong in it", async () => {
    const p = copy();
    const path = join(p, "PACK_COMPLETE.json");
    const marker = JSON.parse(readFileSync(path, "utf8")) as Record<string, unknown>;
    // readers parse JSON: another layout of the same members reads the same
    writeFileSync(path, JSON.stringify(marker));
    await verify(p);
    const refusal = async (text: string | Buffer): Promise<string> => {
      writeFileSync(path, text);
      const err = await verify(p).then(() => null, (e: unknown) => e);
      expect(err).toBeInstanceOf(UserError);
      return (err as UserError).message;
    };
    const hint = "the pack is incomplete; rerun kvl pack";
    expect(await refusal('{"format_version": 1,\n "files" 1}')).toMatch(
      new RegExp(`^${path.replace(/[.\\/]/g, "\\$&")}: unreadable \\(.* at position 31 \\(line 2 column 10\\)\\) — ${hint}$`));
    expect(await refusal(Buffer.from([0x7b, 0xff, 0x7d]))).toBe(`${path}: unreadable (not UTF-8 text) — ${hint}`);
    expect(await refusal("[1]")).toBe(`${path}: unreadable (the marker is not a JSON object) — ${hint}`);
    expect(await refusal(JSON.stringify({ format_version: 1 }))).toBe(`${path}: unreadable ("files" is missing) — ${hint}`);
    expect(await refusal(JSON.stringify({ ...marker, files: [1] }))).toBe(`${path}: "files" is not a table of file entries — ${hint}`);
    expect(await refusal(JSON.stringify({ ...marker, format_version: "1" }))).toBe(
      `${path}: format version "1", this kvl reads versions 1, 2 and 3; repack with this kvl version`);
    const files = marker.files as Record<string, { size: number; crc32: number }>;
    expect(await refusal(JSON.stringify({ ...marker, files: { ...files, "trunk.idx": { ...files["trunk.idx"], size: String(files["trunk.idx"]!.size) } } })))
      .toBe("trunk.idx: does not match PACK_COMPLETE.json (size/CRC differ) — the pack was modified or is corrupt; rerun kvl pack");
  });

  it("finds corrupt data only with the data CRC check, naming the tensor", async () => {
    const p = copy();
    const reader = await PackReader.open(p);
    const rec = reader.stores.get("vision")!.records[2]!;
    const fd = openSync(join(p, "vision.bin"), "r+");
    const byte = readFileSync(join(p, "vision.bin"))[rec.offset]!;
    writeSync(fd, Buffer.from([byte ^ 0xff]), 0, 1, rec.offset);
    closeSync(fd);
    await verify(p);
    await expect(verify(p, { checkDataCrc: true })).rejects.toThrow(
      new RegExp(`^vision\\.bin: data of '${rec.name.replace(/\./g, "\\.")}' is corrupt \\(CRC [0-9a-f]{8}, index says [0-9a-f]{8}\\); rerun kvl pack$`));
  });
});
