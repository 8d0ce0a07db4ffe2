/**
 * Pack data checked as it is first read (docs/FORMAT.md "Checks at run time"): one flipped bit
 * in experts.bin, trunk.bin or vision.bin, in a copy of the tiny pack, is found by the engine the
 * first time it reads the tensor, on both backends, and the call fails with KVL_ERR_CORRUPT
 * naming the file, the tensor (its layer, expert or vision block) and `kvl doctor PACK`; nothing
 * is answered from the bytes.
 *
 *   - the clean pack: every tensor the engine reads is checked exactly once (the trunk at open,
 *     each expert extent at its first read, not again after an eviction), and the greedy tokens
 *     are the float64 reference's;
 *   - experts.bin: the prefill that routes through the extent fails, the session is rolled back
 *     (also over a forced split into 2 instances, the bad extent in the second), and the next
 *     attempt fails again (read and checked afresh). The random tiny model routes a prompt through
 *     some of its experts only, so the flipped extent is the first of layer 2's whose flip makes
 *     the test prompt (a chat turn, as `kvl chat` renders it) fail: the checks below are that the
 *     error names exactly that extent, everywhere;
 *   - trunk.bin: a resident tensor (and the embedding, read a row at a time while decoding) is
 *     refused at open; the same tensor streamed (trunk cache 0) fails the first forward pass, and
 *     the next;
 *   - vision.bin: the image encode fails, text still runs with the clean pack's tokens;
 *   - through the engine worker the error is a CorruptPackError (a UserError);
 *   - `kvl chat` prints one line `kvl chat: error: experts.bin: tensor ...` and exits 1, on both
 *     backends, and its load line says what the checks cost where that is over 3 % of decoding
 *     (WebAssembly); `kvl serve` answers the request 500 in the API's shape with the same
 *     message, and goes on serving.
 */
import { cpSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { ChatTemplate } from "../host/text/chat-template.js";
import { buildPrompt } from "../host/text/conversation.js";
import { KVL_ERR_CORRUPT, type CoreEngine, CoreError, CorruptPackError, type EngineOptions } from "../host/core/core-api.js";
import { EngineClient } from "../host/engine/engine-client.js";
import { openHostedEngine } from "../host/engine/engine-host.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { STORE_KINDS, type StoreName, decodeIndex, expertRecordName } from "../host/pack/pack-format.js";
import { Tokenizer } from "../host/text/tokenizer.js";
import { UserError } from "../host/system/user-error.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { nativeBuilt } from "./helpers.js";
import { TextReference } from "./reference/text.js";
import { GREEDY_TOKENS, engineGreedy, promptIds, referenceGreedy } from "./support/engine-checks.js";
import { type LiveServer, runKvl, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;
type BackendName = "wasm" | "native";
const BACKENDS: BackendName[] = ["wasm", "native"];

const BAD_LAYER = 2;
const BAD_TRUNK = "language_model.model.layers.1.self_attn.q_proj.weight";
const EMBED = "language_model.model.embed_tokens.weight";
const BAD_VISION = "vision_tower.encoder.blocks.1.wqkv.weight";
/** The user's message of the test turn (library, `kvl chat` and `kvl serve` alike). */
const PROMPT = "Describe the weather in three short sentences, please.";

let tmp: { dir: string; cleanup: () => void };
let clean: string;
let reference: TextReference;
let wasm: WasmBackend;
let native: NativeBackend;
const corrupt: Record<string, string> = {};
/** PROMPT as a chat turn's token ids */
let turn: Int32Array;
/** the extent flipped in corrupt.experts, and its expert id (in layer BAD_LAYER) */
let badExpert: string;
let badId: number;

function sumBytes(pack: string, store: StoreName): number {
  const index = decodeIndex(readFileSync(join(pack, `${store}.idx`)), `${store}.idx`, STORE_KINDS[store]);
  return index.records.reduce((n, r) => n + r.nbytes, 0);
}

/** Bytes a read of one extent takes (its data padded to 4 KiB). */
const padded = (nbytes: number): number => Math.ceil(nbytes / 4096) * 4096;

function record(pack: string, store: StoreName, name: string): { offset: number; nbytes: number } {
  const index = decodeIndex(readFileSync(join(pack, `${store}.idx`)), `${store}.idx`, STORE_KINDS[store]);
  const rec = index.byName.get(name);
  if (!rec) throw new Error(`${name} is not in ${store}.idx`);
  return rec;
}

/** `dir`'s `store`.bin: the clean pack's, with one bit of `tensor`'s data flipped. */
function writeFlipped(dir: string, store: StoreName, tensor: string): void {
  const rec = record(clean, store, tensor);
  const bytes = readFileSync(join(clean, `${store}.bin`));
  bytes[rec.offset + Math.floor(rec.nbytes / 2)]! ^= 0x10;
  writeFileSync(join(dir, `${store}.bin`), bytes);
}

/** A copy of the clean pack with one bit of `tensor`'s data in `store`.bin flipped. */
function flipOneBit(label: string, store: StoreName, tensor: string): string {
  const dir = join(tmp.dir, label);
  cpSync(clean, dir, { recursive: true });
  writeFlipped(dir, store, tensor);
  return dir;
}

/** The core's message for this tensor (file, tensor, where, the doctor command). */
function corruptMessage(file: string, tensor: string, where: string, pack: string): RegExp {
  const esc = (s: string): string => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  return new RegExp(`^${esc(file)}: tensor '${esc(tensor)}' \\(${esc(where)}\\) does not match its CRC-32 in the index: ` +
    `the pack is corrupt; run \`kvl doctor ${esc(pack)}\``);
}

function expectCorrupt(fn: () => unknown, message: RegExp): void {
  let caught: unknown;
  try {
    fn();
  } catch (err) {
    caught = err;
  }
  expect(caught).toBeInstanceOf(CoreError);
  expect((caught as CoreError).status).toBe(KVL_ERR_CORRUPT);
  expect((caught as CoreError).message).toMatch(message);
}

function openEngine(backend: BackendName, pack: string, options: Omit<EngineOptions, "nThreads"> = {}): CoreEngine {
  // everything resident and every extent cached unless a test says otherwise
  return (backend === "wasm" ? wasm : native).openEngine(pack, { nThreads: THREADS, trunkCacheBytes: 0, expertCacheBytes: 64 * 2 ** 20, ...options });
}

beforeAll(async () => {
  tmp = tempDir("corrupt");
  let ckpt: string;
  ({ ckpt, pack: clean } = await tinyPack(tmp.dir, 0));
  reference = TextReference.load(ckpt, { q8Experts: true });
  native = new NativeBackend();
  wasm = await WasmBackend.create({ memoryBytes: 512 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) });
  const tokenizer = new Tokenizer(clean);
  try {
    turn = Int32Array.from(buildPrompt([{ role: "user", parts: [PROMPT] }], new ChatTemplate(clean), tokenizer).tokens);
  } finally {
    tokenizer.close();
  }
  // the first extent of layer BAD_LAYER whose flipped bit the turn runs into
  corrupt.experts = join(tmp.dir, "bad-experts");
  cpSync(clean, corrupt.experts, { recursive: true });
  for (badId = 0; badId < reference.cfg.n_routed_experts; badId++) {
    badExpert = expertRecordName(BAD_LAYER, badId);
    writeFlipped(corrupt.experts, "experts", badExpert);
    const engine = native.openEngine(corrupt.experts, { nThreads: THREADS });
    const session = engine.newSession({ maxContext: 1024 });
    let failed = false;
    try {
      session.prefill(turn, null, "last");
    } catch {
      failed = true;
    } finally {
      session.close();
      engine.close();
    }
    if (failed) break;
  }
  expect(badId).toBeLessThan(reference.cfg.n_routed_experts);
  corrupt.trunk = flipOneBit("bad-trunk", "trunk", BAD_TRUNK);
  corrupt.embed = flipOneBit("bad-embed", "trunk", EMBED);
  corrupt.vision = flipOneBit("bad-vision", "vision", BAD_VISION);
}, 300_000);

afterAll(() => {
  wasm?.close();
  native?.close();
  tmp?.cleanup();
});

describe.each(BACKENDS)("pack data checked on first read, on %s", (backend) => {
  it("a clean pack: each tensor is checked once, the greedy tokens are the reference's", () => {
    const engine = openEngine(backend, clean);
    try {
      // at open: every trunk tensor (all resident, and the embedding read through for its check)
      expect(engine.stats().verifyBytes).toBe(sumBytes(clean, "trunk"));
      const { ids, want } = referenceGreedy(reference);
      expect(engineGreedy(engine, ids)).toEqual(want);
      const after = engine.stats();
      const extent = record(clean, "experts", badExpert).nbytes;
      // each extent read was read for the first time (the cache holds them all): checked once
      expect(after.expertBytesRead).toBeGreaterThan(0);
      expect(after.verifyBytes - sumBytes(clean, "trunk")).toBe((after.expertBytesRead / padded(extent)) * extent);
      engineGreedy(engine, ids);
      expect(engine.stats().verifyBytes).toBe(after.verifyBytes);
    } finally {
      engine.close();
    }
    // a cache of one layer's top-k: decoding evicts extents and reads them again, but each is
    // checked once (the same greedy run with every extent cached says how many there are)
    const extent = record(clean, "experts", badExpert).nbytes;
    const ids = promptIds(3, 8, reference.cfg.vocab_size);
    const distinct = ((): number => {
      const all = openEngine(backend, clean);
      try {
        engineGreedy(all, ids);
        return all.stats().expertMisses; // each extent the run reads, read once
      } finally {
        all.close();
      }
    })();
    const small = openEngine(backend, clean, { expertCacheBytes: reference.cfg.num_experts_per_tok * padded(extent) });
    try {
      engineGreedy(small, ids);
      const s = small.stats();
      expect(s.expertBytesRead / padded(extent)).toBeGreaterThan(distinct); // re-reads happened
      expect(s.verifyBytes - sumBytes(clean, "trunk")).toBe(distinct * extent);
    } finally {
      small.close();
    }
  });

  it("experts.bin: the turn that reads the extent fails naming it, is rolled back, and fails again", () => {
    const engine = openEngine(backend, corrupt.experts!);
    const session = engine.newSession({ maxContext: 1024 });
    try {
      const message = corruptMessage("experts.bin", badExpert, `layer ${BAD_LAYER}, expert ${badId}`, corrupt.experts!);
      expectCorrupt(() => session.prefill(turn, null, "last"), message);
      expect(session.position()).toBe(0);
      expectCorrupt(() => session.prefill(turn, null, "last"), message);
      expect(session.position()).toBe(0);
    } finally {
      session.close();
      engine.close();
    }
  });

  it("experts.bin over 2 instances: the second range fails, every range is rolled back", async () => {
    const hosted = await openHostedEngine(backend, corrupt.experts!, evenSplit(corrupt.experts!, { nThreads: THREADS, instances: 2, instanceMemoryBytes: 256 * 2 ** 20,
      expertCacheBytes: 64 * 2 ** 20 }));
    try {
      expect(hosted.ranges).toEqual([[0, 2], [2, 4]]);
      const session = hosted.engine.newSession({ maxContext: 1024 });
      try {
        expectCorrupt(() => session.prefill(turn, null, "last"),
          corruptMessage("experts.bin", badExpert, `layer ${BAD_LAYER}, expert ${badId}`, corrupt.experts!));
        // the first range had run its layers: it is truncated back with the failed one
        expect(session.position()).toBe(0);
      } finally {
        session.close();
      }
    } finally {
      hosted.close();
    }
  });

  it("trunk.bin: a resident tensor and the embedding are refused at open, a streamed one at each forward pass", () => {
    expectCorrupt(() => openEngine(backend, corrupt.trunk!), corruptMessage("trunk.bin", BAD_TRUNK, "layer 1", corrupt.trunk!));
    expectCorrupt(() => openEngine(backend, corrupt.embed!),
      new RegExp(`^trunk\\.bin: tensor '${EMBED.replace(/\./g, "\\.")}' does not match its CRC-32`));
    const engine = openEngine(backend, corrupt.trunk!, { trunkCacheBytes: -1 });
    const session = engine.newSession({ maxContext: 64 });
    try {
      const message = corruptMessage("trunk.bin", BAD_TRUNK, "layer 1", corrupt.trunk!);
      expectCorrupt(() => session.prefill(Int32Array.of(1, 2, 3), null, "last"), message);
      expectCorrupt(() => session.step(4), message);
      expect(session.position()).toBe(0);
    } finally {
      session.close();
      engine.close();
    }
  });

  it("vision.bin: the image fails naming the tensor; text still gives the clean pack's tokens", () => {
    const patch = 14;
    const grids = Int32Array.of(4, 4);
    const pixels = new Float32Array(16 * 3 * patch * patch).map((_, i) => Math.sin(i) * 0.5);
    const { ids } = referenceGreedy(reference);
    const cleanEngine = openEngine(backend, clean, { loadVision: true });
    let rows: Float32Array;
    let tokens: number[];
    try {
      rows = cleanEngine.encodeImages(pixels, grids);
      tokens = engineGreedy(cleanEngine, ids);
    } finally {
      cleanEngine.close();
    }
    const engine = openEngine(backend, corrupt.vision!, { loadVision: true });
    try {
      const message = corruptMessage("vision.bin", BAD_VISION, "vision block 1", corrupt.vision!);
      expectCorrupt(() => engine.encodeImages(pixels, grids), message);
      expect(engineGreedy(engine, ids)).toEqual(tokens);
      expect(tokens).toHaveLength(GREEDY_TOKENS);
      expectCorrupt(() => engine.encodeImages(pixels, grids), message);
    } finally {
      engine.close();
    }
    expect(rows.length).toBeGreaterThan(0);
  });

  it("through the engine worker the error is a CorruptPackError, a UserError with the core's message", async () => {
    let caught: unknown;
    try {
      await (await EngineClient.open(backend, corrupt.trunk!, evenSplit(corrupt.trunk!, { nThreads: THREADS }))).close();
    } catch (err) {
      caught = err;
    }
    expect(caught).toBeInstanceOf(CorruptPackError);
    expect(caught).toBeInstanceOf(UserError);
    expect((caught as Error).message).toMatch(corruptMessage("trunk.bin", BAD_TRUNK, "layer 1", corrupt.trunk!));
  });

  it("kvl chat prints one line naming the file and the tensor and exits 1", async () => {
    const env = { KVL_BACKEND: backend };
    const args = (pack: string): string[] => ["chat", pack, PROMPT, "--temperature", "0", "--max-new", "4", "--threads", "1", "--quiet"];
    const good = await runKvl([...args(clean), "--json"], env);
    expect(good.status, good.stderr).toBe(0);
    expect(JSON.parse(good.stdout).prompt_token_ids).toEqual([...turn]); // the turn of the library tests
    // the load line says where the checks cost more than 3 % of decoding (README "Data checks")
    const loud = await runKvl(args(clean).filter((a) => a !== "--quiet"), env);
    expect(loud.status, loud.stderr).toBe(0);
    const loadLine = loud.stderr.split("\n").find((l) => l.startsWith(`kvl chat: ${backend}`))!;
    expect(loadLine).toMatch(/; loaded in [\d.]+ s/);
    expect(loadLine.includes("; CRC checks of first reads cost ~3 % of decoding until every expert has been read once")).toBe(backend === "wasm");
    const bad = await runKvl(args(corrupt.experts!), env);
    expect(bad.status).toBe(1);
    const lines = bad.stderr.trim().split("\n");
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/^kvl chat: error: /);
    expect(lines[0]!.replace(/^kvl chat: error: /, "")).toMatch(
      corruptMessage("experts.bin", badExpert, `layer ${BAD_LAYER}, expert ${badId}`, corrupt.experts!));
  });
});

describe("kvl serve on a pack with a corrupt extent", () => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(corrupt.experts!, ["--api-key", "k"], { KVL_BACKEND: nativeBuilt ? "native" : "wasm" });
  }, 120_000);
  afterAll(async () => {
    await server?.stop();
  });

  it("answers 500 in the API's shape naming the file and tensor, and goes on serving", async () => {
    const body = { model: "kimi-vl-a3b-instruct-q8", max_tokens: 4, temperature: 0, messages: [{ role: "user", content: PROMPT }] };
    const message = corruptMessage("experts.bin", badExpert, `layer ${BAD_LAYER}, expert ${badId}`, corrupt.experts!);
    for (let i = 0; i < 2; i++) {
      const r = await server.post("/v1/chat/completions", body);
      expect(r.status).toBe(500);
      expect(r.json.error.type).toBe("server_error");
      expect(r.json.error.message).toMatch(message);
    }
    const anthropic = await server.post("/v1/messages", { ...body, model: "kimi-vl-a3b-instruct-q8" });
    expect(anthropic.status).toBe(500);
    expect(anthropic.json).toMatchObject({ type: "error", error: { type: "api_error" } });
    expect(anthropic.json.error.message).toMatch(message);
    expect(((await (await fetch(`${server.url}/healthz`)).json()) as { status: string }).status).toBe("ready");
    expect(server.log()).toContain(`kvl serve: experts.bin: tensor '${badExpert}' (layer ${BAD_LAYER}, expert ${badId})`);
  });
});
