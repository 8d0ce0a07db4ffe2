/**
 * Seeded mutation fuzzing of the pack reader (host/pack/pack-format.ts), ported from kvl's
 * tests/test_pack_fuzz.py: mutated .idx files (CRC recomputed so the checks behind it run),
 * hparam values, .bin sizes, PACK_COMPLETE.json variants, missing files and mangled assets. The
 * rule: verify + reading records either works or throws UserError with a message — never another
 * exception. Also the index rules store.c enforces, which this reader must enforce too.
 */
import { mkdirSync, readFileSync, readdirSync, symlinkSync, writeFileSync, openSync, ftruncateSync, closeSync, statSync } from "node:fs";
import { join } from "node:path";
import { crc32 as zcrc } from "node:zlib";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { PackReader, verify } from "../host/pack/pack-format.js";
import { UserError } from "../host/system/user-error.js";
import { packCheckpoint } from "../packer/pack.js";
import { anyCore, tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

const IDX_FILES = ["trunk.idx", "experts.idx", "vision.idx"] as const;

/** Python's random.Random is not available; mulberry32 gives a fixed, seeded stream. */
class Rng {
  #a: number;
  constructor(seed: number) {
    this.#a = seed >>> 0;
  }
  next(): number {
    this.#a = (this.#a + 0x6d2b79f5) >>> 0;
    let t = this.#a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  below(n: number): number {
    return Math.floor(this.next() * n);
  }
  int(lo: number, hi: number): number {
    return lo + this.below(hi - lo + 1);
  }
  pick<T>(xs: readonly T[]): T {
    return xs[this.below(xs.length)]!;
  }
  u64(): bigint {
    return (BigInt(this.below(2 ** 32)) << 32n) | BigInt(this.below(2 ** 32));
  }
}

// index helpers (offsets straight from docs/FORMAT.md, independent of the encoder)
function fixCrc(data: Buffer): Buffer {
  if (data.length < 40) return data;
  const out = Buffer.from(data);
  out.fill(0, 36, 40);
  out.writeUInt32LE(zcrc(out) >>> 0, 36);
  return out;
}
const counts = (d: Buffer): [number, number, number] => [d.readUInt32LE(24), d.readUInt32LE(28), d.readUInt32LE(32)];
const recordAt = (d: Buffer, i: number): number => 128 + 64 * counts(d)[0] + 192 * i;
const M64 = (1n << 64n) - 1n;

function edgeU64(r: Rng, cur: bigint): bigint {
  const choices = [0n, 1n, cur + 1n, cur > 0n ? cur - 1n : 0n, cur + 4096n, cur > 4096n ? cur - 4096n : 0n, M64, M64 - 4095n, 1n << 32n,
    (1n << 63n) + (cur % (1n << 63n)), BigInt(r.below(8)) * 4096n, r.u64()];
  return r.pick(choices) & M64;
}
function edgeU32(r: Rng, cur: number): number {
  return r.pick([0, 1, cur + 1, Math.max(cur - 1, 0), 2 ** 32 - 1, 2 ** 31, 2 ** 31 - 1, r.below(6), 2 * cur, r.below(2 ** 32)]) % 2 ** 32;
}

function mutateIdx(data: Buffer, r: Rng): [Buffer, string] {
  let buf = Buffer.from(data);
  const [nHp, nT, cfg] = data.length >= 36 ? counts(data) : [0, 0, 0];
  if (data.length < 128 || nT === 0 || cfg < 2 || data.length !== 128 + 64 * nHp + 192 * nT + cfg) {
    for (let k = r.int(1, 4); k > 0; k--) if (buf.length) buf[r.below(buf.length)]! ^= 1 << r.below(8);
    return [buf, "bitflip-after"];
  }
  const i = r.below(nT);
  const rec = recordAt(data, i);
  const kind = r.pick(["bitflip", "byte", "truncate", "extend", "count", "bin_size", "version", "kind", "reserved", "revision", "offset",
    "nbytes", "shape", "ndim", "dtype", "name", "flags", "swap", "drop", "dup", "hp_key", "hp_dup", "config"] as const);
  switch (kind) {
    case "bitflip":
      for (let k = r.int(1, 4); k > 0; k--) buf[r.below(buf.length)]! ^= 1 << r.below(8);
      break;
    case "byte":
      buf[r.below(buf.length)] = r.pick([0, 0xff, 0x7f, r.below(256)]);
      break;
    case "truncate":
      buf = buf.subarray(0, r.pick([0, 7, 40, 127, 128, buf.length - 1, r.below(buf.length)]));
      break;
    case "extend":
      buf = Buffer.concat([buf, Buffer.from(Array.from({ length: r.pick([1, 64, 192, 300]) }, () => r.below(256)))]);
      break;
    case "count": {
      const at = r.pick([24, 28, 32]);
      buf.writeUInt32LE(edgeU32(r, buf.readUInt32LE(at)), at);
      break;
    }
    case "bin_size":
      buf.writeBigUInt64LE(edgeU64(r, buf.readBigUInt64LE(16)), 16);
      break;
    case "version":
      buf.writeUInt32LE(edgeU32(r, 1), 8);
      break;
    case "kind":
      buf.writeUInt32LE(r.below(5), 12);
      break;
    case "reserved":
      buf[80 + r.below(48)] = r.int(1, 255);
      break;
    case "revision":
      buf[40 + r.below(40)] = r.pick([0x20, 0x80, 0xff, 0x67, 0x01]);
      break;
    case "offset":
      buf.writeBigUInt64LE(edgeU64(r, buf.readBigUInt64LE(rec + 168)), rec + 168);
      break;
    case "nbytes":
      buf.writeBigUInt64LE(edgeU64(r, buf.readBigUInt64LE(rec + 176)), rec + 176);
      break;
    case "shape": {
      const at = rec + 136 + 8 * r.below(4);
      buf.writeBigUInt64LE(r.pick([0n, 1n, 1n << 32n, 1n << 63n, M64, (1n << 32n) + 1n, buf.readBigUInt64LE(at) + 1n]) & M64, at);
      break;
    }
    case "ndim":
      buf.writeUInt32LE(r.pick([0, 1, 2, 3, 4, 5, 2 ** 32 - 1]), rec + 132);
      break;
    case "dtype":
      buf.writeUInt32LE(r.pick([0, 1, 2, 3, 4, 5, 6, 2 ** 32 - 1]), rec + 128);
      break;
    case "name": {
      const choice = r.below(4);
      if (choice === 0) buf.fill(0x6e, rec, rec + 128);
      else if (choice === 1) buf[rec] = 0;
      else if (choice === 2) buf[rec + r.below(20)] = 0xc3;
      else {
        const other = recordAt(data, r.below(nT));
        data.copy(buf, rec, other, other + 128); // a duplicate name
      }
      break;
    }
    case "flags":
      buf.writeUInt32LE(r.pick([1, 2 ** 31, 2 ** 32 - 1]), rec + 188);
      break;
    case "swap": {
      const j = recordAt(data, r.below(nT));
      const width = r.pick([192, 128]);
      data.copy(buf, rec, j, j + width);
      data.copy(buf, j, rec, rec + width);
      break;
    }
    case "drop":
      buf = Buffer.concat([buf.subarray(0, rec), buf.subarray(rec + 192)]);
      buf.writeUInt32LE(nT - 1, 28);
      break;
    case "dup": {
      const end = recordAt(data, nT);
      buf = Buffer.concat([buf.subarray(0, end), data.subarray(rec, rec + 192), buf.subarray(end)]);
      buf.writeUInt32LE(nT + 1, 28);
      break;
    }
    case "hp_key": {
      const at = 128 + 64 * r.below(nHp);
      if (r.below(2)) buf.fill(0x6b, at, at + 56);
      else buf[at] = 0;
      break;
    }
    case "hp_dup": {
      const at = 128 + 64 * r.below(nHp);
      buf = Buffer.concat([buf.subarray(0, 128), data.subarray(at, at + 64), buf.subarray(128)]);
      buf.writeUInt32LE(nHp + 1, 24);
      break;
    }
    case "config": {
      const cut = r.int(1, cfg - 1);
      const tail = r.below(2) ? Buffer.from([0xff, 0xfe]) : Buffer.alloc(0);
      buf = Buffer.concat([buf.subarray(0, buf.length - cut), tail]);
      buf.writeUInt32LE(cfg - cut + tail.length, 32);
      break;
    }
  }
  return [buf, `${kind} rec=${i}`];
}

function setHparam(data: Buffer, key: string, value: number): Buffer {
  const buf = Buffer.from(data);
  for (let k = 0; k < counts(data)[0]; k++) {
    const at = 128 + 64 * k;
    const end = buf.indexOf(0, at);
    if (buf.subarray(at, Math.min(end, at + 56)).toString("latin1") === key) {
      buf.writeDoubleLE(value, at + 56);
      return buf;
    }
  }
  throw new Error(`no hparam ${key}`);
}

interface Case {
  label: string;
  files?: Record<string, Buffer>;
  sparse?: Record<string, number>;
  updateComplete?: boolean;
  remove?: string[];
}

let core: CoreBackend;
let tmp: { dir: string; cleanup: () => void };
let base: string;
beforeAll(async () => {
  core = await anyCore();
  tmp = tempDir("pack-fuzz");
  const ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), core);
  base = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core, allowRevision: true });
});
afterAll(() => {
  core.close();
  tmp.cleanup();
});

let made = 0;
function materialize(c: Case): string {
  const out = join(tmp.dir, `case${made++}`);
  mkdirSync(out);
  const files = { ...c.files };
  if (c.updateComplete !== false && !("PACK_COMPLETE.json" in files)) {
    const complete = JSON.parse(readFileSync(join(base, "PACK_COMPLETE.json"), "utf8")) as { files: Record<string, Record<string, number>> };
    for (const [name, entry] of Object.entries(complete.files)) {
      if (files[name]) {
        entry.size = files[name]!.length;
        if ("crc32" in entry) entry.crc32 = zcrc(files[name]!) >>> 0;
      } else if (c.sparse?.[name] !== undefined) {
        entry.size = c.sparse[name]!;
      }
    }
    files["PACK_COMPLETE.json"] = Buffer.from(JSON.stringify(complete, null, 1));
  }
  for (const name of readdirSync(base)) {
    if (c.remove?.includes(name)) continue;
    if (files[name]) writeFileSync(join(out, name), files[name]!);
    else if (c.sparse?.[name] !== undefined) {
      const fd = openSync(join(out, name), "w");
      ftruncateSync(fd, c.sparse[name]!);
      closeSync(fd);
    } else symlinkSync(join(base, name), join(out, name));
  }
  return out;
}

async function outcome(dir: string): Promise<string> {
  try {
    await verify(dir);
    const reader = await PackReader.open(dir);
    for (const [store, index] of reader.stores) {
      for (const rec of [...index.records.slice(0, 3), ...index.records.slice(-2)]) await reader.raw(store, rec);
    }
    return "ok";
  } catch (err) {
    if (err instanceof UserError) return err.message.trim() ? "user" : "user-without-message";
    return `bad ${err instanceof Error ? `${err.name}: ${err.message}` : String(err)}`.slice(0, 300);
  }
}

describe("mutated packs", () => {
  it("the unmutated copy passes", async () => {
    expect(await outcome(materialize({ label: "unmutated" }))).toBe("ok");
  });

  it("work or raise UserError with a message", async () => {
    const r = new Rng(20261202);
    const idx = Object.fromEntries(IDX_FILES.map((n) => [n, readFileSync(join(base, n))])) as Record<string, Buffer>;
    const cases: Case[] = [];
    for (let n = 0; n < 100; n++) {
      const name = IDX_FILES[n % 3]!;
      let data = idx[name]!;
      const labels: string[] = [];
      for (let k = r.pick([1, 1, 2]); k > 0; k--) {
        const [d, what] = mutateIdx(data, r);
        data = d;
        labels.push(what);
      }
      const stale = r.below(15) === 0;
      cases.push({ label: `${n} ${name} ${labels.join("+")}${stale ? " stale-crc" : ""}`, files: { [name]: stale ? data : fixCrc(data) } });
    }
    const keys: string[] = [];
    const t = idx["trunk.idx"]!;
    for (let k = 0; k < counts(t)[0]; k++) keys.push(t.subarray(128 + 64 * k, t.indexOf(0, 128 + 64 * k)).toString("latin1"));
    const values = [0, -1, NaN, Infinity, -Infinity, 1e30, 2 ** 31, 2 ** 31 - 1, 2 ** 32, 0.5, 3, 1e-30, -0];
    for (let n = 0; n < 40; n++) {
      const key = r.pick(keys);
      const value = r.pick(values);
      cases.push({ label: `hparam ${key}=${value}`, files: Object.fromEntries(IDX_FILES.map((f) => [f, fixCrc(setHparam(idx[f]!, key, value))])) });
    }
    for (let n = 0; n < 12; n++) {
      const name = r.pick(["experts.bin", "vision.bin", "trunk.bin"]);
      const size = statSync(join(base, name)).size;
      const nw = r.pick([0, size - 4096, size + 4096, size + 1, size - 1, Math.floor(size / 2 / 4096) * 4096]);
      const follow = name !== "trunk.bin" && r.below(2) === 0;
      const c: Case = { label: `${name} size ${nw}${follow ? " header-follows" : ""}`, files: {}, sparse: {} };
      if (name === "trunk.bin") c.sparse![name] = nw;
      else {
        const raw = readFileSync(join(base, name));
        c.files![name] = Buffer.concat([raw.subarray(0, nw), Buffer.alloc(Math.max(0, nw - raw.length))]);
      }
      if (follow) {
        const stem = name.replace(".bin", ".idx");
        const buf = Buffer.from(idx[stem]!);
        buf.writeBigUInt64LE(BigInt(nw), 16);
        c.files![stem] = fixCrc(buf);
      }
      cases.push(c);
    }
    const completeRaw = readFileSync(join(base, "PACK_COMPLETE.json"));
    const complete = JSON.parse(completeRaw.toString()) as { files: Record<string, unknown> };
    const variants: Array<[string, Buffer]> = [
      ["empty", Buffer.alloc(0)], ["not-json", Buffer.from('{"format_version": 1, ')], ["list", Buffer.from("[1, 2]")],
      ["null", Buffer.from("null")], ["string", Buffer.from('"done"')], ["deep", Buffer.from(`${"[".repeat(100000)}${"]".repeat(100000)}`)],
      ["not-utf8", Buffer.from([0xff, 0xfe, 0x7b, 0x7d])], ["files-list", Buffer.from(JSON.stringify({ ...complete, files: [1] }))],
      ["files-null", Buffer.from(JSON.stringify({ ...complete, files: null }))], ["files-str", Buffer.from(JSON.stringify({ ...complete, files: "x" }))],
      ["no-files", Buffer.from(JSON.stringify({ format_version: 1 }))], ["version-2", Buffer.from(JSON.stringify({ ...complete, format_version: 2 }))],
      ["version-str", Buffer.from(JSON.stringify({ ...complete, format_version: "1" }))],
      ["version-list", Buffer.from(JSON.stringify({ ...complete, format_version: [1] }))],
      ["entry-int", Buffer.from(JSON.stringify({ ...complete, files: { ...complete.files, "trunk.idx": 7 } }))],
      ["entry-list", Buffer.from(JSON.stringify({ ...complete, files: { ...complete.files, "trunk.bin": [1] } }))],
      ["crc-str", Buffer.from(JSON.stringify({ ...complete, files: { ...complete.files, "experts.idx": { size: 1, crc32: "x" } } }))],
      ["missing-vision", Buffer.from(JSON.stringify({ ...complete, files: Object.fromEntries(Object.entries(complete.files).filter(([k]) => !k.startsWith("vision"))) }))],
    ];
    for (let n = 0; n < 6; n++) {
      const raw = Buffer.from(completeRaw);
      for (let k = r.int(1, 3); k > 0; k--) raw[r.below(raw.length)] = r.below(256);
      variants.push([`bytes${n}`, raw]);
    }
    for (const [label, raw] of variants) cases.push({ label: `PACK_COMPLETE ${label}`, files: { "PACK_COMPLETE.json": raw }, updateComplete: false });
    cases.push({ label: "PACK_COMPLETE missing", remove: ["PACK_COMPLETE.json"], updateComplete: false });
    cases.push({ label: "trunk.idx missing", remove: ["trunk.idx"] });
    cases.push({ label: "experts.bin missing", remove: ["experts.bin"] });
    for (const name of ["config.json", "tokenizer_config.json"]) {
      const raw = readFileSync(join(base, name));
      for (const [n, m] of [Buffer.from(""), Buffer.from("[]"), Buffer.from("{"), raw.subarray(0, raw.length >> 1),
        Buffer.concat([Buffer.from([0xff]), raw]), Buffer.from(`${"[".repeat(50000)}${"]".repeat(50000)}`)].entries()) {
        cases.push({ label: `${name} variant${n}`, files: { [name]: m } });
      }
    }

    const failures: string[] = [];
    const tally: Record<string, number> = {};
    for (const c of cases) {
      const got = await outcome(materialize(c));
      tally[got.split(" ")[0]!] = (tally[got.split(" ")[0]!] ?? 0) + 1;
      if (got !== "ok" && got !== "user") failures.push(`${c.label}: ${got}`);
    }
    expect(failures).toEqual([]);
    console.log(`${cases.length} mutated packs; outcomes: ${JSON.stringify(tally)}`);
    // the mutations must reach both outcomes, or they test nothing
    expect(tally.user ?? 0).toBeGreaterThanOrEqual(cases.length / 2);
    expect(tally.ok ?? 0).toBeGreaterThanOrEqual(5);
  });
});

describe("rules of the format that store.c enforces", () => {
  function editedTrunk(edit: (buf: Buffer, rec: number) => void): Case {
    const buf = Buffer.from(readFileSync(join(base, "trunk.idx")));
    edit(buf, recordAt(buf, counts(buf)[1] - 1));
    return { label: "edit", files: { "trunk.idx": fixCrc(buf) } };
  }
  const setShape = (buf: Buffer, rec: number, ndim: number, dims: bigint[]): void => {
    buf.writeUInt32LE(1, rec + 128);
    buf.writeUInt32LE(ndim, rec + 132);
    dims.forEach((d, i) => buf.writeBigUInt64LE(d, rec + 136 + 8 * i));
    buf.writeBigUInt64LE(0n, rec + 176);
  };
  it.each([
    ["a shape whose product wraps in 64 bits", (b: Buffer, rec: number) => setShape(b, rec, 2, [1n << 32n, 1n << 32n, 0n, 0n]), "bytes but its dtype and shape need 36893488147419103232"],
    ["a zero dimension", (b: Buffer, rec: number) => setShape(b, rec, 2, [0n, 5n, 0n, 0n]), "has a zero dimension in shape [0, 5]"],
    ["a reserved byte", (b: Buffer) => { b[100] = 1; }, "reserved header bytes are not zero"],
    ["an empty name", (b: Buffer, rec: number) => { b[rec] = 0; }, "has an empty name"],
    ["an empty hparam key", (b: Buffer) => { b[128] = 0; }, "hparam record 0 has an empty key"],
    ["a control character in the revision", (b: Buffer) => { b.write(`${"0".repeat(39)}\n`, 40, "latin1"); }, "source revision is not 40 printable ASCII characters"],
  ])("refuses %s", async (_label, edit, message) => {
    const dir = materialize(editedTrunk(edit));
    await expect(verify(dir)).rejects.toThrow(UserError);
    await expect(verify(dir)).rejects.toThrow(message);
  });

  it.each([Infinity, NaN])("refuses hparam %s", async (value) => {
    const files = Object.fromEntries(IDX_FILES.map((f) => [f, fixCrc(setHparam(readFileSync(join(base, f)), "text.rms_norm_eps", value))]));
    const dir = materialize({ label: "hp", files });
    await expect(verify(dir)).rejects.toThrow(`trunk.idx: hparam 'text.rms_norm_eps' = ${value === Infinity ? "Infinity" : "NaN"} is not a finite number`);
  });
});
