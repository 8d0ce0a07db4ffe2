/**
 * What the C core checks of a pack's Q4_EXPERT extents (`kvl pack --expert-dtype q4`, issue 31), on
 * both backends: a pack whose routed experts mix Q8_EXPERT and Q4_EXPERT extents (each record
 * valid on its own) is refused at open with one line naming both extents; a Q4 pack opens and
 * decodes; a flipped bit in every Q4 extent is KVL_ERR_CORRUPT on the first read, naming
 * experts.bin and an extent, and a later call fails the same way (the extent stays unchecked).
 * How close the Q4 engine is to the float64 reference: test/expert-q4-engine.test.ts.
 */
import { cpSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { KVL_ERR_CORRUPT, type CoreBackend, CoreError } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { DTYPE_Q4_EXPERT, DTYPE_Q8_EXPERT, STORE_KINDS, type TensorRecord, alignUp, decodeIndex, encodeIndex } from "../host/pack/pack-format.js";
import { packCheckpoint } from "../packer/pack.js";
import { promptIds } from "./support/prompt-ids.js";
import { tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

const THREADS = 2;
let tmp: { dir: string; cleanup: () => void };
let native: NativeBackend;
let wasm: WasmBackend;
let q4Pack: string;
let mixedPack: string;
let corruptPack: string;
/** the extent the mixed pack holds as Q8, and the first one (Q4) */
let q8Name: string;
let firstName: string;

function experts(pack: string): ReturnType<typeof decodeIndex> {
  return decodeIndex(readFileSync(join(pack, "experts.idx")), "experts.idx", STORE_KINDS.experts);
}

/** A copy of `q4` whose experts.idx/.bin hold `q8`'s extent in place of the record named `swap`. */
function mixedCopy(q4: string, q8: string, swap: string, dir: string): string {
  cpSync(q4, dir, { recursive: true });
  const idx4 = experts(q4);
  const bin4 = readFileSync(join(q4, "experts.bin"));
  const bin8 = readFileSync(join(q8, "experts.bin"));
  const chunks: Buffer[] = [];
  const records: TensorRecord[] = [];
  let offset = 0;
  for (const r of idx4.records) {
    const src = r.name === swap ? experts(q8).byName.get(swap)! : r;
    const bytes = (r.name === swap ? bin8 : bin4).subarray(src.offset, src.offset + src.nbytes);
    records.push({ ...src, offset });
    const padded = alignUp(src.nbytes, 4096);
    chunks.push(Buffer.concat([bytes, Buffer.alloc(padded - src.nbytes)]));
    offset += padded;
  }
  writeFileSync(join(dir, "experts.bin"), Buffer.concat(chunks));
  writeFileSync(join(dir, "experts.idx"), encodeIndex(idx4.kind, offset, idx4.hparams, records, idx4.configText, idx4.revision, idx4.version));
  return dir;
}

beforeAll(async () => {
  tmp = tempDir("expert-q4-open");
  native = new NativeBackend();
  wasm = await WasmBackend.create({ memoryBytes: 512 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) });
  const ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), native);
  q4Pack = await packCheckpoint(ckpt, join(tmp.dir, "q4"), { core: native, allowRevision: true, expertDtype: "q4" });
  const q8Pack = await packCheckpoint(ckpt, join(tmp.dir, "q8"), { core: native, allowRevision: true });
  const records = experts(q4Pack).records;
  expect(records.every((r) => r.dtype === DTYPE_Q4_EXPERT)).toBe(true);
  expect(experts(q4Pack).version).toBe(3);
  firstName = records[0]!.name;
  q8Name = records[1]!.name; // the same layer's expert 1: the engine reads expert 0 first
  mixedPack = mixedCopy(q4Pack, q8Pack, q8Name, join(tmp.dir, "mixed"));
  expect(experts(mixedPack).byName.get(q8Name)!.dtype).toBe(DTYPE_Q8_EXPERT);
  corruptPack = join(tmp.dir, "corrupt");
  cpSync(q4Pack, corruptPack, { recursive: true });
  const bin = readFileSync(join(q4Pack, "experts.bin"));
  for (const r of records) bin[r.offset + Math.floor(r.nbytes / 2)]! ^= 0x10;
  writeFileSync(join(corruptPack, "experts.bin"), bin);
}, 300_000);

afterAll(() => {
  wasm?.close();
  native?.close();
  tmp?.cleanup();
});

const esc = (s: string): string => s.replace(/\./g, "\\.");

describe.each(["native", "wasm"] as const)("Q4 experts at open and first read on %s", (backend) => {
  const core = (): CoreBackend => (backend === "wasm" ? wasm : native);

  it("refuses routed experts that mix Q8 and Q4 extents, naming both", () => {
    expect(() => core().openEngine(mixedPack, { nThreads: THREADS })).toThrow(new RegExp(
      `experts\\.idx: extent '${esc(q8Name)}' is Q8_EXPERT but '${esc(firstName)}' is Q4_EXPERT; a pack's routed experts are all Q8 or all Q4 \\(rerun kvl pack\\)`));
  });

  it("opens a Q4 pack and decodes in every activation mode", () => {
    for (const actDtype of ["f32", "bf16", "i16x1", "i8"] as const) {
      const engine = core().openEngine(q4Pack, { nThreads: THREADS, actDtype });
      const session = engine.newSession({ maxContext: 64 });
      try {
        const vocab = engine.info().vocabSize;
        const logits = session.prefill(Int32Array.from(promptIds(3, 12, vocab)), null, "last")!;
        const next = session.step(5);
        expect(logits.length).toBe(vocab);
        expect(logits.every(Number.isFinite) && next.every(Number.isFinite)).toBe(true);
      } finally {
        session.close();
        engine.close();
      }
    }
  });

  it("checks a Q4 extent's CRC on its first read, and again while it stays unchecked", () => {
    const engine = core().openEngine(corruptPack, { nThreads: THREADS });
    const session = engine.newSession({ maxContext: 64 });
    try {
      const ids = Int32Array.from(promptIds(3, 12, engine.info().vocabSize));
      for (let attempt = 0; attempt < 2; attempt++) {
        let caught: unknown;
        try {
          session.prefill(ids, null, "last");
        } catch (e) {
          caught = e;
        }
        expect(caught).toBeInstanceOf(CoreError);
        expect((caught as CoreError).status).toBe(KVL_ERR_CORRUPT);
        expect((caught as CoreError).message).toMatch(/experts\.bin: tensor 'language_model\.model\.layers\.\d+\.mlp\.experts\.\d+' .*does not match its CRC-32/);
        expect(session.position()).toBe(0);
      }
    } finally {
      session.close();
      engine.close();
    }
  });
});
