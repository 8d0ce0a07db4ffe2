/**
 * packer/safetensors.ts and the checkpoint-directory source: files laid out by hand from the
 * safetensors spec read back exactly, the writer's bytes are the spec's layout, and every bad file
 * gives a UserError naming the file, what is wrong and what to do (kvl/safetensors_io.py's
 * messages) — including seeded mutations of a real shard header, where anything but "works" or
 * "UserError with a message" is a bug.
 */
import { mkdirSync, readFileSync, symlinkSync, truncateSync, writeFileSync, existsSync, readdirSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { UserError } from "../host/system/user-error.js";
import { INDEX_NAME, SafetensorsFile, SafetensorsWriter, findRevision, writeIndex } from "../packer/safetensors.js";
import { CheckpointSource } from "../packer/tensor-source.js";
import { anyCore, tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

const REV = "398eede0903cd983a2bfa0cc634e9ac1d843f375";

/** A safetensors file straight from the spec: u64 LE header length, JSON header, data. */
function rawShard(path: string, header: unknown, data: Uint8Array): void {
  const json = Buffer.from(JSON.stringify(header), "utf8");
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(json.length));
  writeFileSync(path, Buffer.concat([len, json, data]));
}

function randomBytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13; x >>>= 0; x ^= x >>> 17; x ^= x << 5; x >>>= 0;
    out[i] = x & 0xff;
  }
  return out;
}

async function openError(dir: string): Promise<UserError> {
  try {
    const src = await CheckpointSource.open(dir);
    await src.close();
  } catch (err) {
    expect(err).toBeInstanceOf(UserError);
    return err as UserError;
  }
  throw new Error(`${dir} opened without an error`);
}

let tmp: { dir: string; cleanup: () => void };
let n = 0;
const fresh = (): string => {
  const d = join(tmp.dir, `case${n++}`);
  mkdirSync(d);
  return d;
};
beforeAll(() => {
  tmp = tempDir("safetensors");
});
afterAll(() => tmp.cleanup());

describe("reading", () => {
  it("reads a file laid out by hand: names in header order, dtypes, shapes and exact bytes", async () => {
    const dir = fresh();
    const a = randomBytes(7 * 5 * 2, 1);
    const b = randomBytes(3 * 4, 2);
    const c = randomBytes(2 * 3 * 4 * 4 * 2, 3);
    const d = randomBytes(6 * 8, 4);
    // data deliberately in another order than the header lists the tensors
    const data = Buffer.concat([d, c, a, b]);
    const at = (k: number): number => [d, c, a, b].slice(0, k).reduce((s, x) => s + x.length, 0);
    rawShard(join(dir, "model.safetensors"), {
      "a.weight": { dtype: "BF16", shape: [7, 5], data_offsets: [at(2), at(3)] },
      __metadata__: { format: "pt" },
      "b.bias": { dtype: "F32", shape: [3], data_offsets: [at(3), at(4)] },
      "c.conv": { dtype: "BF16", shape: [2, 3, 4, 4], data_offsets: [at(1), at(2)] },
      "d.ids": { dtype: "I64", shape: [6], data_offsets: [at(0), at(1)] },
    }, data);
    const src = await CheckpointSource.open(dir);
    try {
      expect(src.tensorNames()).toEqual(["a.weight", "b.bias", "c.conv", "d.ids"]);
      expect(src.tensorInfo("a.weight")).toEqual({ dtype: "BF16", shape: [7, 5] });
      expect(src.tensorInfo("b.bias")).toEqual({ dtype: "F32", shape: [3] });
      expect(src.tensorInfo("d.ids")).toEqual({ dtype: "I64", shape: [6] });
      expect(Buffer.from(await src.read("a.weight")).equals(a)).toBe(true);
      expect(Buffer.from(await src.read("b.bias")).equals(b)).toBe(true);
      expect(Buffer.from(await src.read("c.conv")).equals(c)).toBe(true);
      expect(Buffer.from(await src.read("d.ids")).equals(d)).toBe(true);
      expect(src.shardOf("a.weight")).toBe("model.safetensors");
      expect(() => src.tensorInfo("nope")).toThrow(`tensor nope is not in the checkpoint at ${dir}`);
    } finally {
      await src.close();
    }
  });

  it("reads a sharded checkpoint in index order and writes the index (two-space JSON, the Python writer's bytes)", async () => {
    const dir = fresh();
    rawShard(join(dir, "s1.safetensors"), { x: { dtype: "F32", shape: [4], data_offsets: [0, 16] } }, randomBytes(16, 5));
    rawShard(join(dir, "s2.safetensors"), {
      y: { dtype: "F32", shape: [2, 2], data_offsets: [0, 16] }, z: { dtype: "U8", shape: [3], data_offsets: [16, 19] },
    }, randomBytes(19, 6));
    writeIndex(dir, new Map([["y", "s2.safetensors"], ["x", "s1.safetensors"], ["z", "s2.safetensors"]]), 35);
    expect(readFileSync(join(dir, INDEX_NAME), "utf8")).toBe(
      '{\n  "metadata": {\n    "total_size": 35\n  },\n  "weight_map": {\n    "y": "s2.safetensors",\n' +
      '    "x": "s1.safetensors",\n    "z": "s2.safetensors"\n  }\n}\n');
    expect(existsSync(join(dir, `${INDEX_NAME}.partial`))).toBe(false);
    const src = await CheckpointSource.open(dir);
    try {
      expect(src.tensorNames()).toEqual(["y", "x", "z"]);
      expect(src.shardOf("x")).toBe("s1.safetensors");
      expect(Buffer.from(await src.read("x")).equals(randomBytes(16, 5))).toBe(true);
      expect(src.tensorInfo("z")).toEqual({ dtype: "U8", shape: [3] });
    } finally {
      await src.close();
    }
  });
});

describe("writing", () => {
  it("writes the spec's layout: length, compact JSON header padded with spaces to 8 bytes, data", () => {
    const dir = fresh();
    const w = randomBytes(4 * 6 * 2, 7);
    const b = randomBytes(5 * 4, 8);
    const path = join(dir, "x.safetensors");
    const writer = new SafetensorsWriter(path, [{ name: "w", dtype: "BF16", shape: [4, 6] }, { name: "b", dtype: "F32", shape: [5] }]);
    writer.write("w", w);
    writer.write("b", b);
    writer.close();
    let json = '{"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[4,6],"data_offsets":[0,48]},' +
      '"b":{"dtype":"F32","shape":[5],"data_offsets":[48,68]}}';
    json += " ".repeat((8 - (json.length % 8)) % 8);
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(json.length));
    expect(readFileSync(path).equals(Buffer.concat([len, Buffer.from(json), w, b]))).toBe(true);
    expect(existsSync(`${path}.partial`)).toBe(false);

    // the same file, streamed in pieces
    const path2 = join(dir, "y.safetensors");
    const streamed = new SafetensorsWriter(path2, [{ name: "w", dtype: "BF16", shape: [4, 6] }, { name: "b", dtype: "F32", shape: [5] }]);
    streamed.begin("w");
    streamed.append(w.subarray(0, 10));
    streamed.append(w.subarray(10));
    streamed.begin("b");
    streamed.append(b);
    streamed.close();
    expect(readFileSync(path2).equals(readFileSync(path))).toBe(true);
  });

  it("writes and reads back a tensor named __proto__ (an ordinary JSON member)", async () => {
    const path = join(fresh(), "p.safetensors");
    const writer = new SafetensorsWriter(path, [{ name: "__proto__", dtype: "F32", shape: [1] }]);
    writer.write("__proto__", randomBytes(4, 9));
    writer.close();
    const header = readFileSync(path).subarray(8, 8 + Number(readFileSync(path).readBigUInt64LE(0))).toString().trimEnd();
    expect(header).toBe('{"__metadata__":{"format":"pt"},"__proto__":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}');
    const file = await SafetensorsFile.open(path);
    expect([...file.tensors.keys()]).toEqual(["__proto__"]);
    expect(Buffer.from(await file.read("__proto__")).equals(randomBytes(4, 9))).toBe(true);
    await file.close();
  });

  it("enforces order and completeness; an unfinished file never gets its final name", () => {
    const dir = fresh();
    const path = join(dir, "y.safetensors");
    const w = new SafetensorsWriter(path, [{ name: "a", dtype: "F32", shape: [2] }, { name: "b", dtype: "F32", shape: [3] }]);
    expect(() => w.write("b", new Float32Array(3))).toThrow("expected tensor a next");
    expect(() => w.write("a", new Float32Array(3))).toThrow("a: expected F32 [2] (8 bytes), got 12 bytes");
    w.write("a", new Float32Array(2));
    expect(() => w.close()).toThrow("closed before tensor b was written");
    expect(existsSync(path)).toBe(false);
    expect(() => new SafetensorsWriter(join(dir, "z.safetensors"), [{ name: "a", dtype: "Q4", shape: [1] }])).toThrow(`unknown safetensors dtype "Q4" for a`);
    expect(() => new SafetensorsWriter(join(dir, "z.safetensors"), [{ name: "a", dtype: "F32", shape: [1] }, { name: "a", dtype: "F32", shape: [1] }]))
      .toThrow("duplicate tensor name a");
    const aborted = new SafetensorsWriter(join(dir, "q.safetensors"), [{ name: "a", dtype: "F32", shape: [1] }]);
    aborted.abort();
    expect(readdirSync(dir).filter((f) => f.startsWith("q."))).toEqual([]);
  });
});

describe("bad files", () => {
  it("names a truncated shard, the sizes and the fix", async () => {
    const dir = fresh();
    const name = "model-00003-of-00007.safetensors";
    rawShard(join(dir, name), { w: { dtype: "F32", shape: [100, 100], data_offsets: [0, 40000] } }, new Uint8Array(40000));
    writeIndex(dir, new Map([["w", name]]), 40000);
    truncateSync(join(dir, name), readFileSync(join(dir, name)).length - 1000);
    const msg = (await openError(dir)).message;
    expect(msg).toContain(`${name} is truncated`);
    expect(msg).toContain("header says 40000 bytes of data, file has 39000");
    expect(msg).toContain("re-download");
  });

  const good = { dtype: "F32", shape: [2, 3], data_offsets: [0, 24] };
  it.each([
    ["huge_len", "corrupt header: header length field says 1099511627776 bytes"],
    ["not_json", "has a corrupt header: not valid JSON ("],
    ["not_utf8", "has a corrupt header: not valid JSON (not UTF-8 text)"],
    ["bad_dtype", 'has tensor w with unknown dtype "Q7"; this checkpoint format is not supported; re-download it'],
    ["size_mismatch", "needs 24 bytes but data_offsets [0, 20] span 20"],
    ["beyond_end", "is truncated: header says 48 bytes of data, file has 24"],
    ["overlap", "overlap"],
    ["too_short", "is truncated: 2 bytes, too short for a safetensors header length"],
    ["float_offsets", "has a corrupt header: tensor w has shape [2,3] and data_offsets [0.5,24]"],
    ["bool_dim", "has a corrupt header: tensor w has shape [true,3] and data_offsets [0,24]"],
    ["not_object", "the JSON header is not an object"],
    ["lacks_fields", 'entry "w" lacks dtype/shape/data_offsets'],
  ])("%s", async (kind, expected) => {
    const dir = fresh();
    const path = join(dir, "model.safetensors");
    if (kind === "huge_len") {
      const len = Buffer.alloc(8);
      len.writeBigUInt64LE(1n << 40n);
      writeFileSync(path, Buffer.concat([len, Buffer.from("{}")]));
    } else if (kind === "not_json" || kind === "not_utf8") {
      const len = Buffer.alloc(8);
      len.writeBigUInt64LE(5n);
      writeFileSync(path, Buffer.concat([len, Buffer.from(kind === "not_json" ? "{nope" : "{\xff}", "latin1"), Buffer.alloc(8)]));
    } else if (kind === "too_short") {
      writeFileSync(path, Buffer.from([1, 2]));
    } else if (kind === "float_offsets" || kind === "bool_dim") {
      const text = kind === "float_offsets"
        ? '{"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0.5, 24]}}'
        : '{"w": {"dtype": "F32", "shape": [true, 3], "data_offsets": [0, 24]}}';
      const len = Buffer.alloc(8);
      len.writeBigUInt64LE(BigInt(text.length));
      writeFileSync(path, Buffer.concat([len, Buffer.from(text), Buffer.alloc(24)]));
    } else {
      const headers: Record<string, unknown> = {
        bad_dtype: { w: { ...good, dtype: "Q7" } },
        size_mismatch: { w: { ...good, data_offsets: [0, 20] } },
        beyond_end: { w: { ...good, data_offsets: [24, 48] } },
        overlap: { w: good, v: { ...good, data_offsets: [12, 36] } },
        not_object: [1, 2],
        lacks_fields: { w: { dtype: "F32", shape: [2, 3] } },
      };
      rawShard(path, headers[kind], new Uint8Array(kind === "overlap" ? 36 : 24));
    }
    const msg = (await openError(dir)).message;
    expect(msg).toMatch(/^model\.safetensors /);
    expect(msg).toContain(expected);
  });

  it("reports index problems", async () => {
    const dir = fresh();
    expect((await openError(dir)).message).toContain(`holds neither ${INDEX_NAME} nor model.safetensors`);
    rawShard(join(dir, "s1.safetensors"), { x: { dtype: "F32", shape: [2], data_offsets: [0, 8] } }, new Uint8Array(8));
    writeIndex(dir, new Map([["x", "s1.safetensors"], ["y", "s2.safetensors"]]), 16);
    expect((await openError(dir)).message).toMatch(/s2\.safetensors is listed in .* but missing/);
    writeIndex(dir, new Map([["x", "s1.safetensors"], ["y", "s1.safetensors"]]), 16);
    expect((await openError(dir)).message).toContain("does not contain tensor y");
    writeIndex(dir, new Map([["x", "../s1.safetensors"]]), 16);
    expect((await openError(dir)).message).toContain('names shard "../s1.safetensors" outside the checkpoint directory');
    writeFileSync(join(dir, INDEX_NAME), "{not json");
    expect((await openError(dir)).message).toMatch(new RegExp(`^${INDEX_NAME.replace(/\./g, "\\.")} is unreadable \\(.* \\(line 1 column 2\\)\\); re-download it$`));
    writeFileSync(join(dir, INDEX_NAME), '{"weight_map": {}}');
    expect((await openError(dir)).message).toContain("has no valid weight_map; re-download it");
    expect((await openError(join(dir, "nowhere"))).message).toContain("does not exist; pass the folder that holds config.json");
  });

  it("says when config.json is missing, unreadable or not an object", async () => {
    const dir = fresh();
    rawShard(join(dir, "model.safetensors"), { x: { dtype: "F32", shape: [2], data_offsets: [0, 8] } }, new Uint8Array(8));
    const src = await CheckpointSource.open(dir);
    expect(() => src.config()).toThrow(new UserError(`${dir} has no config.json; download it with the checkpoint`));
    writeFileSync(join(dir, "config.json"), "{not json");
    expect(() => src.config()).toThrow(/^config\.json is unreadable \(.* \(line 1 column 2\)\); re-download it$/);
    writeFileSync(join(dir, "config.json"), '{"a":\n  NaN}');
    expect(() => src.config()).toThrow(/^config\.json is unreadable \(.*NaN.*\); re-download it$/);
    writeFileSync(join(dir, "config.json"), Buffer.from([0x7b, 0xff, 0x7d]));
    expect(() => src.config()).toThrow(new UserError("config.json is unreadable (not UTF-8 text); re-download it"));
    writeFileSync(join(dir, "config.json"), "[1]");
    expect(() => src.config()).toThrow("config.json is not a JSON object; re-download it");
    await src.close();
  });
});

describe("revision and assets", () => {
  it("finds the revision in a revision file, hub download metadata or a snapshots path", () => {
    const plain = fresh();
    expect(findRevision(plain)).toBeNull();
    const explicit = fresh();
    writeFileSync(join(explicit, "SOURCE_REVISION.txt"), `${REV}\n`);
    expect(findRevision(explicit)).toBe(REV);
    const bad = fresh();
    writeFileSync(join(bad, ".kvl_revision"), "main\n");
    expect(() => findRevision(bad)).toThrow(new UserError(`${join(bad, ".kvl_revision")} holds "main", not a 40-hex-digit commit hash; fix or delete it`));
    const hub = fresh();
    const meta = join(hub, ".cache", "huggingface", "download");
    mkdirSync(join(meta, "sub"), { recursive: true });
    writeFileSync(join(meta, "config.json.metadata"), `${REV}\n"etag"\n1700000000.0\n`);
    writeFileSync(join(meta, "sub", "model-00001-of-00007.safetensors.metadata"), `${REV.toUpperCase()}\r\nabc\n1.0\n`);
    writeFileSync(join(meta, "junk.metadata"), "not a hash\n");
    expect(findRevision(hub)).toBe(REV);
    writeFileSync(join(meta, "tiktoken.model.metadata"), `${"0".repeat(40)}\nabc\n1.0\n`);
    expect(() => findRevision(hub)).toThrow(`files in ${hub} come from different revisions (${"0".repeat(40)}, ${REV}); re-download them at one revision`);
    const snap = join(fresh(), "models--moonshotai--Kimi-VL-A3B-Instruct", "snapshots", REV);
    mkdirSync(snap, { recursive: true });
    expect(findRevision(snap)).toBe(REV);
  });

  it("gives the checkpoint's revision, its asset files (only those) and its config", async () => {
    const dir = fresh();
    rawShard(join(dir, "model.safetensors"), { x: { dtype: "F32", shape: [2], data_offsets: [0, 8] } }, new Uint8Array(8));
    writeFileSync(join(dir, "config.json"), '{"a": 1}');
    writeFileSync(join(dir, "tiktoken.model"), "IQ== 0\n");
    writeFileSync(join(dir, "unrelated.txt"), "no");
    writeFileSync(join(dir, "SOURCE_REVISION.txt"), REV);
    const src = await CheckpointSource.open(dir);
    expect(src.revision()).toBe(REV);
    const assets = await src.assetFiles();
    expect([...assets.keys()]).toEqual(["config.json", "tiktoken.model"]);
    expect(Buffer.from(assets.get("config.json")!).toString()).toBe('{"a": 1}');
    expect(src.config()).toEqual({ a: 1 });
    await src.close();
  });
});

// ---------------------------------------------------------------------------------------------
// Seeded mutations of a real shard header (kvl's tests/test_pack_fuzz.py, safetensors part)

/** mulberry32: a small seeded generator, so every run mutates the same way. */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

describe("safetensors header mutations", () => {
  let core: CoreBackend;
  let ckpt: string;
  beforeAll(async () => {
    core = await anyCore();
    ckpt = await tinyCheckpoint(join(tmp.dir, "tiny"), core);
  });
  afterAll(() => core.close());

  it("every mutated header either works or is a UserError with a message", async () => {
    const random = rng(20261202);
    const pick = <T>(xs: readonly T[]): T => xs[Math.floor(random() * xs.length)]!;
    const shards = readdirSync(ckpt).filter((f) => f.endsWith(".safetensors")).sort();
    const shard = shards.reduce((a, b) => (readFileSync(join(ckpt, a)).length <= readFileSync(join(ckpt, b)).length ? a : b));
    const whole = readFileSync(join(ckpt, shard));
    const n = Number(whole.readBigUInt64LE(0));
    const rawHeader = whole.subarray(8, 8 + n);
    const data = whole.subarray(8 + n);
    const header = JSON.parse(rawHeader.toString("utf8")) as Record<string, Record<string, unknown>>;
    const names = Object.keys(header).filter((k) => k !== "__metadata__");
    const cases: Array<[string, Buffer]> = [];
    const withHeader = (label: string, text: string): void => {
      const len = Buffer.alloc(8);
      len.writeBigUInt64LE(BigInt(Buffer.byteLength(text)));
      cases.push([label, Buffer.concat([len, Buffer.from(text), data])]);
    };
    const withEntry = (label: string, key: string, valueText: string): void => {
      const h = JSON.parse(JSON.stringify(header)) as Record<string, Record<string, unknown>>;
      const victim = pick(names);
      h[victim]![key] = "@@";
      withHeader(label, JSON.stringify(h).replace('"@@"', valueText));
    };
    for (const v of ["-1", "1.5", "true", '"3"', "null", "[1, [2]]", "1180591620717411303424", "0"]) withEntry(`shape-dim ${v}`, "shape", `[${v}, 4]`);
    for (const v of ["[]", "[0]", "[0, 1, 2]", "[-8, 0]", "[8, 0]", '["0", "8"]', "[1180591620717411303424, 1180591620717411303432]", "null", '"x"', "[0.0, 8.0]", "[true, 9]"]) {
      withEntry(`offsets ${v}`, "data_offsets", v);
    }
    for (const v of ['"BF16"', '"F32"', '"I8"', '"Q4"', '""', "7", "null"]) withEntry(`dtype ${v}`, "dtype", v);
    withEntry("entry list", "shape", '{"x": 1}');
    for (const [label, text] of [["list", "[]"], ["null", "null"], ["int", "5"], ["empty", "{}"],
      ["entry-null", JSON.stringify({ ...header, [names[0]!]: null })], ["entry-str", JSON.stringify({ ...header, [names[0]!]: "x" })],
      ["metadata-list", JSON.stringify({ ...header, __metadata__: [1] })]] as const) {
      withHeader(label, text);
    }
    const [a, b] = [names[0]!, names[names.length - 1]!];
    const swapped = JSON.parse(JSON.stringify(header)) as typeof header;
    [swapped[a]!.data_offsets, swapped[b]!.data_offsets] = [header[b]!.data_offsets, header[a]!.data_offsets];
    withHeader("offsets swapped", JSON.stringify(swapped));
    const overlap = JSON.parse(JSON.stringify(header)) as typeof header;
    overlap[b] = { ...header[a]! };
    withHeader("overlap", JSON.stringify(overlap));
    withHeader("deep nesting", `${"[".repeat(100000)}${"]".repeat(100000)}`);
    cases.push(["not utf8", Buffer.concat([whole.subarray(0, 8), Buffer.from([0xff]), rawHeader.subarray(1), data])]);
    for (let k = 0; k < 12; k++) {
      const raw = Buffer.from(rawHeader);
      const edits = 1 + Math.floor(random() * 3);
      for (let e = 0; e < edits; e++) raw[Math.floor(random() * raw.length)] = pick([0, 0xff, 0x22, 0x7d, 0x39, Math.floor(random() * 256)]);
      cases.push([`bytes${k}`, Buffer.concat([whole.subarray(0, 8), raw, data])]);
    }
    for (const v of [0n, 1n, BigInt(n - 1), BigInt(n + 1), 1n << 63n, (1n << 64n) - 1n, BigInt(whole.length), BigInt(whole.length - 8), 100n * 1024n * 1024n + 1n]) {
      const len = Buffer.alloc(8);
      len.writeBigUInt64LE(v);
      cases.push([`header length ${v}`, Buffer.concat([len, whole.subarray(8)])]);
    }
    cases.push(["truncated 5 bytes", whole.subarray(0, 5)], ["data truncated", whole.subarray(0, whole.length - 1)], ["empty", Buffer.alloc(0)]);

    const failures: string[] = [];
    const outcomes = { ok: 0, user: 0 };
    for (const [k, [label, content]] of cases.entries()) {
      const dir = join(tmp.dir, `fuzz${k}`);
      mkdirSync(dir);
      for (const f of readdirSync(ckpt)) {
        if (f === shard) writeFileSync(join(dir, f), content);
        else symlinkSync(join(ckpt, f), join(dir, f));
      }
      try {
        const src = await CheckpointSource.open(dir);
        try {
          for (const name of src.tensorNames()) {
            if (src.shardOf(name) !== shard) continue;
            const bytes = await src.read(name);
            const { shape } = src.tensorInfo(name);
            const file = await SafetensorsFile.open(join(dir, shard));
            expect(bytes.length).toBe(file.tensors.get(name)!.end - file.tensors.get(name)!.begin);
            expect(shape).toEqual(file.tensors.get(name)!.shape);
          }
        } finally {
          await src.close();
        }
        outcomes.ok++;
      } catch (err) {
        if (err instanceof UserError && err.message.trim()) outcomes.user++;
        else failures.push(`${label}: ${err instanceof Error ? `${err.name}: ${err.message}` : String(err)}`.slice(0, 300));
      }
    }
    expect(failures).toEqual([]);
    expect(outcomes.user).toBeGreaterThanOrEqual(Math.floor(cases.length / 2));
    expect(outcomes.ok).toBeGreaterThanOrEqual(1);
  });
});
