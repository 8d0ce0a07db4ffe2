/**
 * A pack that shrinks, changes or goes away under a running engine (an external or network disk
 * unplugged, a copy overwritten): one line naming the file, what was being read, the OS's reason
 * and what to do; the turn is rolled back and the engine stays usable, on both backends.
 *
 *   - the core: experts.bin or trunk.bin truncated after the engine opened it; the prefill fails
 *     with KVL_ERR_IO whose message is the store's record of the read (path, bytes, offset, the
 *     OS's reason), what was read (the expert and layer, or the embedding row) and the advice;
 *     the session is back at 0 and, the file put back, the same prefill gives the clean logits;
 *   - through the engine worker that error is a PackReadError, a UserError;
 *   - `kvl chat`, interactive: a turn, the pack truncated, the next turn is one error line (ChatModel
 *     notices the changed file before reading from it), the file put back, the retry continues
 *     the conversation (its prompt starts with the first turn, whose KV is reused);
 *   - `kvl serve`: the same as a 500 in the API's shape, and the server goes on;
 *   - what the check before each turn notices: a file rewritten in place (same size), renamed
 *     over, or removed.
 */
import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import { cpSync, readFileSync, renameSync, rmSync, truncateSync, utimesSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { ChatTemplate } from "../host/text/chat-template.js";
import { buildPrompt } from "../host/text/conversation.js";
import { KVL_ERR_IO, type CoreEngine, CoreError, PackReadError } from "../host/core/core-api.js";
import { EngineClient } from "../host/engine/engine-client.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packFileChange, packFileIdentities } from "../host/pack/pack-files.js";
import { Tokenizer } from "../host/text/tokenizer.js";
import { UserError } from "../host/system/user-error.js";
import { BACKENDS } from "./support/backends.js";
import { KVL, childEnv, type LiveServer, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";
import { evenSplit } from "./support/even-split.js";

const THREADS = 2;
const PROMPT = "Describe the weather in three short sentences, please.";
/** The pack copies' data files get this modification time (whole seconds), so putting a file back
 * in place can give it the very time it had (as reconnecting a disk does). */
const MTIME = 1_700_000_000;

let tmp: { dir: string; cleanup: () => void };
let clean: string;
let wasm: WasmBackend;
let native: NativeBackend;
let turn: Int32Array;

const esc = (s: string): string => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

/** A copy of the clean pack whose data files carry MTIME. */
function copyPack(label: string): string {
  const dir = join(tmp.dir, label);
  cpSync(clean, dir, { recursive: true });
  for (const f of ["trunk.bin", "experts.bin", "vision.bin"]) utimesSync(join(dir, f), MTIME, MTIME);
  return dir;
}

/** `file` of `pack` written back in place (same inode) as the clean pack's, with MTIME. */
function putBack(pack: string, file: string): void {
  writeFileSync(join(pack, file), readFileSync(join(clean, file)));
  utimesSync(join(pack, file), MTIME, MTIME);
}

/** The core's message for a read of `what` from `pack`/`file` that hit the truncated end. */
function readFailed(pack: string, file: string, what: RegExp): RegExp {
  return new RegExp(`^${esc(join(pack, file))}: read of \\d+ bytes at offset \\d+ failed \\(unexpected end of file; was the file truncated\\?\\), ` +
    `reading ${what.source}; the pack's files changed or its disk failed while kvl was running: reconnect the disk or put the pack back ` +
    `as it was, check it with \`kvl doctor ${esc(pack)}\`, then try again$`);
}

function caught(fn: () => unknown): unknown {
  try {
    fn();
  } catch (err) {
    return err;
  }
  return undefined;
}

beforeAll(async () => {
  tmp = tempDir("pack-gone");
  ({ pack: clean } = await tinyPack(tmp.dir, 0));
  native = new NativeBackend();
  wasm = await WasmBackend.create({ memoryBytes: 512 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) });
  const tokenizer = new Tokenizer(clean);
  try {
    turn = Int32Array.from(buildPrompt([{ role: "user", parts: [PROMPT] }], new ChatTemplate(clean), tokenizer).tokens);
  } finally {
    tokenizer.close();
  }
}, 300_000);

afterAll(() => {
  wasm?.close();
  native?.close();
  tmp?.cleanup();
});

describe.each(BACKENDS)("a pack file truncated under a running engine, on %s", (backend) => {
  const open = (pack: string, trunkCacheBytes = 0): CoreEngine =>
    (backend === "wasm" ? wasm : native).openEngine(pack, { nThreads: THREADS, trunkCacheBytes, expertCacheBytes: 64 * 2 ** 20 });

  it("experts.bin: the prefill fails in one line naming the file, the read, the OS's reason and what to do; rolled back; put back, it runs", () => {
    const cleanEngine = open(clean);
    let want: Float32Array;
    try {
      const s = cleanEngine.newSession({ maxContext: 256 });
      want = s.prefill(turn, null, "last")!;
      s.close();
    } finally {
      cleanEngine.close();
    }
    const pack = copyPack(`experts-${backend}`);
    const engine = open(pack);
    const session = engine.newSession({ maxContext: 256 });
    try {
      truncateSync(join(pack, "experts.bin"), 4096); // after open: no expert has been read yet
      const err = caught(() => session.prefill(turn, null, "last"));
      expect(err).toBeInstanceOf(CoreError);
      expect((err as CoreError).status).toBe(KVL_ERR_IO);
      expect((err as Error).message).toMatch(readFailed(pack, "experts.bin", /expert \d+ of layer \d+/));
      expect((err as Error).message).not.toContain("\n");
      expect(session.position()).toBe(0);
      putBack(pack, "experts.bin");
      expect(session.prefill(turn, null, "last")).toEqual(want);
      expect(session.position()).toBe(turn.length);
    } finally {
      session.close();
      engine.close();
    }
  });

  it("trunk.bin (streamed): the embedding row's read names the token", () => {
    const pack = copyPack(`trunk-${backend}`);
    const engine = open(pack, -1);
    const session = engine.newSession({ maxContext: 256 });
    try {
      truncateSync(join(pack, "trunk.bin"), 4096);
      const err = caught(() => session.prefill(turn, null, "last"));
      expect((err as CoreError).status).toBe(KVL_ERR_IO);
      expect((err as Error).message).toMatch(readFailed(pack, "trunk.bin", /(the embedding row of token \d+|trunk tensor '[\w.]+')/));
      expect(session.position()).toBe(0);
    } finally {
      session.close();
      engine.close();
    }
  });

  it("through the engine worker the error is a PackReadError, a UserError with the core's message", async () => {
    const pack = copyPack(`worker-${backend}`);
    const client = await EngineClient.open(backend, pack, evenSplit(pack, { nThreads: THREADS }));
    try {
      const session = await client.newSession({ maxContext: 256 });
      truncateSync(join(pack, "experts.bin"), 4096);
      let err: unknown;
      await session.prefill(turn, null, "last").catch((e: unknown) => (err = e));
      expect(err).toBeInstanceOf(PackReadError);
      expect(err).toBeInstanceOf(UserError);
      expect((err as Error).message).toMatch(readFailed(pack, "experts.bin", /expert \d+ of layer \d+/));
      await session.close();
    } finally {
      await client.close();
    }
  });

  it("kvl chat, interactive: one error line, the conversation is kept, and the retry continues it once the file is back", async () => {
    const pack = copyPack(`chat-${backend}`);
    const child = spawn(process.execPath, [KVL, "chat", pack, "--json", "--temperature", "0", "--max-new", "4", "--threads", "1"],
      { env: childEnv({ KVL_BACKEND: backend }) }) as ChildProcessWithoutNullStreams;
    const events: Array<Record<string, any>> = [];
    let out = "";
    let stderr = "";
    const waiters: Array<() => void> = [];
    child.stdout.on("data", (d: Buffer) => {
      out += d.toString();
      let nl: number;
      while ((nl = out.indexOf("\n")) >= 0) {
        const line = out.slice(0, nl);
        out = out.slice(nl + 1);
        if (line.trim()) events.push(JSON.parse(line) as Record<string, any>);
        for (const w of waiters.splice(0)) w();
      }
    });
    child.stderr.on("data", (d: Buffer) => (stderr += d.toString()));
    const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)));
    const nextEvent = async (n: number): Promise<Record<string, any>> => {
      while (events.length < n) await new Promise<void>((r) => waiters.push(r));
      return events[n - 1]!;
    };
    child.stdin.write("Hello there\n");
    const first = await nextEvent(1);
    expect(first.event, stderr).toBe("reply");
    truncateSync(join(pack, "experts.bin"), 4096);
    child.stdin.write(`${PROMPT}\n`);
    const failed = await nextEvent(2);
    expect(failed.event).toBe("error");
    expect(failed.error).toBe(`${join(pack, "experts.bin")} is 4096 bytes, it was ${readFileSync(join(clean, "experts.bin")).length} when kvl ` +
      `opened it; kvl reads the pack while it runs, so this turn was not run: reconnect its disk or put the pack back as it was, or restart ` +
      `kvl to use the new files (\`kvl doctor ${pack}\` checks them)`);
    putBack(pack, "experts.bin");
    child.stdin.write(`${PROMPT}\n`);
    const retry = await nextEvent(3);
    child.stdin.end("/quit\n");
    expect(await exited).toBe(0);
    expect(retry.event, stderr).toBe("reply");
    // the first turn is still the conversation's start, and its KV was kept
    expect(retry.prompt_token_ids.slice(0, first.prompt_token_ids.length)).toEqual(first.prompt_token_ids);
    expect(retry.usage.reused_prompt_tokens).toBeGreaterThanOrEqual(first.usage.prompt_tokens);
    expect(stderr).not.toMatch(/internal error|\n\s+at /);
  }, 180_000);
});

describe.each(BACKENDS)("kvl serve on %s while its pack is truncated", (backend) => {
  let server: LiveServer;
  let pack: string;
  beforeAll(async () => {
    pack = copyPack(`serve-${backend}`);
    server = await startServer(pack, ["--api-key", "k"], { KVL_BACKEND: backend });
  }, 120_000);
  afterAll(async () => {
    await server?.stop();
  });

  it("answers 500 in the API's shape with the one line, logs it without a stack, and answers again once the file is back", async () => {
    const body = { model: "kimi-vl-a3b-instruct-q8", max_tokens: 2, temperature: 0, messages: [{ role: "user", content: PROMPT }] };
    truncateSync(join(pack, "experts.bin"), 4096);
    const r = await server.post("/v1/chat/completions", body);
    expect(r.status).toBe(500);
    expect(r.json.error.type).toBe("server_error");
    expect(r.json.error.message).toMatch(new RegExp(`^${esc(join(pack, "experts.bin"))} is 4096 bytes, it was \\d+ when kvl opened it; ` +
      `kvl reads the pack while it runs, so this turn was not run: .*\`kvl doctor ${esc(pack)}\` checks them\\)$`));
    const a = await server.post("/v1/messages", { ...body, model: "kimi-vl-a3b-instruct-q8" });
    expect(a.status).toBe(500);
    expect(a.json).toMatchObject({ type: "error", error: { type: "api_error" } });
    expect(server.log()).toContain(`kvl serve: ${r.json.error.message}`);
    expect(server.log()).not.toMatch(/\n\s+at /);
    putBack(pack, "experts.bin");
    const ok = await server.post("/v1/chat/completions", body);
    expect(ok.status, ok.text).toBe(200);
    expect(ok.json.choices[0].message.content).toEqual(expect.any(String));
  }, 120_000);
});

describe("what ChatModel's check before each turn notices (host/pack/pack-files.ts)", () => {
  it("a file replaced by rename, rewritten with the same size, or removed; nothing when untouched", () => {
    const pack = copyPack("identities");
    const opened = packFileIdentities(pack);
    expect(opened.map((f) => f.path)).toEqual(["trunk.bin", "experts.bin", "vision.bin"].map((f) => join(pack, f)));
    expect(packFileChange(opened)).toBeNull();
    const experts = join(pack, "experts.bin");
    // same size, other content, written in place: the modification time tells
    const bytes = readFileSync(experts);
    bytes[100]! ^= 1;
    writeFileSync(experts, bytes);
    expect(packFileChange(opened)).toMatch(new RegExp(`^${esc(experts)} was modified \\(at \\d{4}-`));
    // another file renamed over it (what cp to a temporary name and mv, or rsync, do)
    putBack(pack, "experts.bin");
    expect(packFileChange(opened)).toBeNull();
    writeFileSync(`${experts}.new`, readFileSync(join(clean, "experts.bin")));
    utimesSync(`${experts}.new`, MTIME, MTIME);
    renameSync(`${experts}.new`, experts);
    expect(packFileChange(opened)).toBe(`${experts} was replaced by another file`);
    rmSync(join(pack, "vision.bin"));
    expect(packFileChange(opened)).toBe(`${experts} was replaced by another file`); // the first change, in file order
    expect(packFileChange(opened.filter((f) => !f.path.endsWith("experts.bin")))).toBe(`${join(pack, "vision.bin")} is gone (no such file)`);
  });
});
