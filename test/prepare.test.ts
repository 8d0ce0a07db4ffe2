/**
 * `kvl prepare` against a local stand-in of the Hugging Face hub (test/support/hub-standin.ts),
 * over real HTTP: first the hub client alone (packer/hub.ts: metadata, Range reads, resumable
 * downloads with checksums, errors), then whole prepares of a synthesized tiny checkpoint served
 * as the pinned revision, compared byte for byte with a direct pack of the same checkpoint.
 */
import { spawn, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";

import { verify } from "../host/pack/pack-format.js";
import { packageRoot } from "../host/system/paths.js";
import { UserError } from "../host/system/user-error.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { Hub, HubError, PINNED_REPO, PINNED_REVISION, fileChecksum, hubEndpoint, hubToken } from "../packer/hub.js";
import { packCheckpoint } from "../packer/pack.js";
import { type PrepareOptions, prepare } from "../packer/prepare.js";
import type { Progress } from "../packer/progress.js";
import { ASSET_NAMES, INDEX_NAME, readIndex } from "../packer/safetensors.js";
import { synthesize } from "../packer/synth.js";
import { HubStandin } from "./support/hub-standin.js";

const scratchDirs: string[] = [];
function tempDir(tag: string): string {
  const dir = mkdtempSync(join(tmpdir(), `kvl-prepare-${tag}-`));
  scratchDirs.push(dir);
  return dir;
}
afterAll(() => {
  for (const dir of scratchDirs) rmSync(dir, { recursive: true, force: true });
});

/** A port nothing listens on (bound, then closed). */
async function closedPort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const port = (server.address() as { port: number }).port;
  await new Promise<void>((ok) => server.close(() => ok()));
  return port;
}

function sha256(data: Buffer): string {
  return createHash("sha256").update(data).digest("hex");
}

/** A minimal valid safetensors file: one F32 tensor "w" of `n` values, then the data. */
function safetensorsBytes(n: number): Buffer {
  let header = JSON.stringify({ w: { dtype: "F32", shape: [n], data_offsets: [0, 4 * n] }, __metadata__: { format: "pt" } });
  header += " ".repeat((8 - (header.length % 8)) % 8);
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(header.length));
  return Buffer.concat([prefix, Buffer.from(header), randomBytes(4 * n)]);
}

describe("hub client (packer/hub.ts) against the stand-in hub", () => {
  let root: string;
  let hub: HubStandin;
  let big: Buffer;
  const logs: string[] = [];
  const client = (options: { token?: string | null; revision?: string; endpoint?: string; readTimeoutMs?: number } = {}): Hub =>
    new Hub(PINNED_REPO, options.revision ?? PINNED_REVISION, options.endpoint ?? hub.endpoint,
      { token: options.token ?? null, log: (l) => logs.push(l), retryDelayMs: 5, readTimeoutMs: options.readTimeoutMs ?? 30_000 });

  beforeAll(async () => {
    root = tempDir("repo");
    big = safetensorsBytes(300_000); // ~1.2 MB, an LFS file
    writeFileSync(join(root, "model-00001-of-00001.safetensors"), big);
    writeFileSync(join(root, "config.json"), '{"model_type": "kimi_vl"}\n');
    hub = await HubStandin.start({ root, repoId: PINNED_REPO, commit: PINNED_REVISION });
  });
  afterAll(async () => hub.stop());
  afterEach(() => {
    hub.clearFaults();
    logs.length = 0;
  });

  it("reads metadata as huggingface_hub does: LFS files through the CDN redirect, small ones directly", async () => {
    const c = client();
    expect(await c.probe()).toBe(PINNED_REVISION);
    const lfs = await c.metadata("model-00001-of-00001.safetensors");
    expect(lfs).toEqual({ size: big.length, checksum: { algorithm: "sha256", hex: sha256(big) }, commit: PINNED_REVISION,
      url: `${hub.cdnOrigin}/lfs/${sha256(big)}?signature=0` });
    const small = await c.metadata("config.json");
    expect(small.checksum).toEqual({ algorithm: "git-sha1", hex: hub.gitSha1Of("config.json") });
    expect(small.size).toBe(statSync(join(root, "config.json")).size);
    expect(small.url).toBe(`${hub.endpoint}/${PINNED_REPO}/resolve/${PINNED_REVISION}/config.json`);
    expect(await c.exists("config.json")).toBe(true);
    expect(await c.exists("generation_config.json")).toBe(false);
  });

  it("reads a safetensors header with two bounded Range requests", async () => {
    const before = hub.requests.length;
    const { length, header } = await client().safetensorsHeader("model-00001-of-00001.safetensors");
    expect(length).toBe(Number(big.readBigUInt64LE(0)));
    expect(header.w).toEqual({ dtype: "F32", shape: [300_000], data_offsets: [0, 1_200_000] });
    const cdn = hub.requests.slice(before).filter((r) => r.server === "cdn");
    expect(cdn.map((r) => r.range)).toEqual(["bytes=0-7", `bytes=8-${8 + length - 1}`]);
    expect(cdn.every((r) => r.status === 206)).toBe(true);
  });

  it("downloads and verifies; the token goes to the hub, never to the CDN", async () => {
    const dir = tempDir("dl");
    const before = hub.requests.length;
    const path = await client({ token: "hf_secret" }).download("model-00001-of-00001.safetensors", dir);
    expect(readFileSync(path).equals(big)).toBe(true);
    expect(existsSync(`${path}.part`)).toBe(false);
    const seen = hub.requests.slice(before);
    expect(seen.filter((r) => r.server === "hub").every((r) => r.authorization === "Bearer hf_secret")).toBe(true);
    expect(seen.filter((r) => r.server === "cdn").map((r) => [r.authorization, r.status])).toEqual([[null, 200]]);
    // Small (non-LFS) files are checked against their git blob sha1.
    const config = await client().download("config.json", dir);
    expect(readFileSync(config, "utf8")).toBe('{"model_type": "kimi_vl"}\n');
  });

  it("resumes a transfer cut off mid-body from the .part file with a Range request", async () => {
    const dir = tempDir("dl");
    const file = "model-00001-of-00001.safetensors";
    const cut = Math.floor(big.length / 2) + 123;
    hub.dropAt(file, cut);
    const before = hub.transfersOf(file).length;
    const path = await client().download(file, dir);
    expect(readFileSync(path).equals(big)).toBe(true);
    // It resumes from what reached the disk: bytes still buffered in the HTTP stream when the
    // connection dropped are not (so at most `cut`, usually exactly `cut`).
    const transfers = hub.transfersOf(file).slice(before);
    expect(transfers).toHaveLength(2);
    expect(transfers[0]?.range).toBeNull();
    const from = Number(/^bytes=(\d+)-$/.exec(transfers[1]?.range ?? "")?.[1]);
    expect(from).toBeGreaterThan(0);
    expect(from).toBeLessThanOrEqual(cut);
    expect(transfers[1]?.status).toBe(206);
    expect(logs).toContain(`transfer of ${file} interrupted (ECONNRESET: aborted); resuming from byte ${from} (attempt 2/4)`);
  });

  it("a transfer that stalls times out and resumes", async () => {
    const dir = tempDir("dl");
    const file = "model-00001-of-00001.safetensors";
    const at = 700_001;
    void hub.holdAt(file, at);
    const before = hub.transfersOf(file).length;
    const t0 = Date.now();
    expect(readFileSync(await client({ readTimeoutMs: 300 }).download(file, dir)).equals(big)).toBe(true);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(300);
    const transfers = hub.transfersOf(file).slice(before).map((t) => t.range);
    expect(transfers).toHaveLength(2);
    expect(transfers[0]).toBeNull();
    const from = Number(/^bytes=(\d+)-$/.exec(transfers[1] ?? "")?.[1]);
    expect(from).toBeGreaterThan(0);
    expect(from).toBeLessThanOrEqual(at);
    expect(logs, JSON.stringify(logs)).toContain(`transfer of ${file} interrupted (ETIMEDOUT: no data for 0.3 s); resuming from byte ${from} (attempt 2/4)`);
  });

  it("asks the hub for a new CDN link when the one it has expired", async () => {
    const dir = tempDir("dl");
    const file = "model-00001-of-00001.safetensors";
    const before = hub.requests.length;
    let expired = false;
    hub.onRequest = (r) => {
      if (r.server === "cdn" && !expired) {
        expired = true;
        hub.expireLinks(); // this very request is refused
      }
    };
    try {
      expect(readFileSync(await client().download(file, dir)).equals(big)).toBe(true);
    } finally {
      hub.onRequest = undefined;
    }
    const seen = hub.requests.slice(before).map((r) => `${r.server} ${r.method} ${r.status}`);
    expect(seen).toEqual(["hub HEAD 302", "cdn GET 403", "hub HEAD 302", "cdn GET 200"]);
    expect(logs.some((l) => l.includes(`the download location of ${file} answered HTTP 403`))).toBe(true);
  });

  it("retries after server errors and gives up with a clear message when they persist", async () => {
    const dir = tempDir("dl");
    const file = "model-00001-of-00001.safetensors";
    hub.failWith(file, 500, 2);
    expect(readFileSync(await client().download(file, dir)).equals(big)).toBe(true);
    expect(logs.filter((l) => l.includes("HTTP 500"))).toHaveLength(2);
    hub.failWith(file, 503, 10);
    const dir2 = tempDir("dl");
    await expect(client().download(file, dir2)).rejects.toThrow(
      /^downloading model-00001-of-00001\.safetensors failed 4 times in a row \(.*HTTP 503.*\); rerun kvl prepare/);
  });

  it("a corrupted transfer is discarded and fetched again; corrupted twice, it is refused and nothing is kept", async () => {
    const file = "model-00001-of-00001.safetensors";
    const dir = tempDir("dl");
    hub.corruptAt(file, big.length - 1000, 1);
    const before = hub.transfersOf(file).length;
    expect(readFileSync(await client().download(file, dir)).equals(big)).toBe(true);
    expect(hub.transfersOf(file).slice(before).map((t) => t.range)).toEqual([null, null]);
    expect(logs.some((l) => l.includes("checksum mismatch") && l.includes("downloading it again from the start"))).toBe(true);

    const dir2 = tempDir("dl");
    hub.corruptAt(file, 4096, 2);
    const err = await client().download(file, dir2).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UserError);
    const message = (err as Error).message;
    expect(message).toContain(`${file}: checksum mismatch: the downloaded bytes have sha256 `);
    expect(message).toContain(`but the hub says ${sha256(big)}`);
    expect(message).toContain("refuses to pack it");
    expect(existsSync(join(dir2, file))).toBe(false);
    expect(existsSync(join(dir2, `${file}.part`))).toBe(false);
  });

  it("a stale .part of another version of the file is caught by the checksum and replaced", async () => {
    const file = "model-00001-of-00001.safetensors";
    const dir = tempDir("dl");
    writeFileSync(join(dir, `${file}.part`), randomBytes(5000));
    const before = hub.transfersOf(file).length;
    expect(readFileSync(await client().download(file, dir)).equals(big)).toBe(true);
    expect(hub.transfersOf(file).slice(before).map((t) => t.range)).toEqual(["bytes=5000-", null]);
    // A finished file that matches is reused without a transfer; one that does not is replaced.
    const again = hub.transfersOf(file).length;
    await client().download(file, dir);
    expect(hub.transfersOf(file).length).toBe(again);
    writeFileSync(join(dir, file), Buffer.alloc(big.length));
    expect(readFileSync(await client().download(file, dir)).equals(big)).toBe(true);
    expect(hub.transfersOf(file).length).toBe(again + 1);
  });

  it("checksums files the way the hub names them", async () => {
    const path = join(tempDir("sum"), "f");
    writeFileSync(path, "hello\n");
    expect(await fileChecksum(path, "sha256")).toBe(sha256(Buffer.from("hello\n")));
    // `git hash-object` of "hello\n"
    expect(await fileChecksum(path, "git-sha1")).toBe("ce013625030ba8dba906f756967f9e9ca394464a");
  });

  it("errors: unreachable endpoint, unknown revision, gated repository, missing repository", async () => {
    const port = await closedPort();
    const offline = `http://127.0.0.1:${port}`;
    const err = await client({ endpoint: offline }).probe().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(HubError);
    expect((err as Error).message).toMatch(new RegExp(`^cannot reach ${offline} \\(HF_ENDPOINT\\): .*ECONNREFUSED.*; check your connection or set HF_ENDPOINT$`));

    await expect(client({ revision: "deadbeef" }).probe()).rejects.toThrow(
      `revision deadbeef of ${PINNED_REPO} does not exist on ${hub.endpoint}; use --revision ${PINNED_REVISION}`);

    const other = new Hub("someone/else", PINNED_REVISION, hub.endpoint, { token: null });
    await expect(other.probe()).rejects.toThrow(`someone/else is not accessible on ${hub.endpoint} (HTTP 404, RepoNotFound)`);

    const gated = await HubStandin.start({ root, repoId: PINNED_REPO, commit: PINNED_REVISION, requireToken: "hf_ok" });
    try {
      const denied = new Hub(PINNED_REPO, PINNED_REVISION, gated.endpoint, { token: null }).probe();
      await expect(denied).rejects.toThrow(`${PINNED_REPO} is not accessible on ${gated.endpoint} (HTTP 401, GatedRepo); ` +
        "check HF_ENDPOINT and your access token (HF_TOKEN); the repository is gated");
      const allowed = new Hub(PINNED_REPO, PINNED_REVISION, gated.endpoint, { token: "hf_ok" });
      expect(await allowed.probe()).toBe(PINNED_REVISION);
      const path = await allowed.download("model-00001-of-00001.safetensors", tempDir("dl"));
      expect(readFileSync(path).equals(big)).toBe(true);
    } finally {
      await gated.stop();
    }
  });

  it("takes the endpoint from HF_ENDPOINT and the token from HF_TOKEN or huggingface_hub's token file", () => {
    expect(hubEndpoint({})).toBe("https://huggingface.co");
    expect(hubEndpoint({ HF_ENDPOINT: "http://127.0.0.1:9/" })).toBe("http://127.0.0.1:9");
    const dir = tempDir("token");
    writeFileSync(join(dir, "token"), "hf_from_file\n");
    expect(hubToken({ HF_TOKEN: "hf_env", HF_HOME: dir })).toBe("hf_env");
    expect(hubToken({ HF_HOME: dir })).toBe("hf_from_file");
    expect(hubToken({ HF_TOKEN_PATH: join(dir, "token") })).toBe("hf_from_file");
    expect(hubToken({ HF_TOKEN_PATH: join(dir, "absent") })).toBeNull();
  });
});

// ---------------------------------------------------------------------------------------------
// Whole prepares of a synthesized tiny checkpoint served as the pinned revision

const CHILD = join(packageRoot, "test", "support", "prepare-child.ts");
const VITE_NODE = join(packageRoot, "node_modules", "vite-node", "vite-node.mjs");

/** The environment of a `kvl prepare` child: the stand-in as endpoint, no token from this machine. */
function childEnv(endpoint: string): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env, HF_ENDPOINT: endpoint, HF_TOKEN_PATH: "/nonexistent/kvl-test-token" };
  delete env.HF_TOKEN;
  delete env.HUGGING_FACE_HUB_TOKEN;
  delete env.KVL_BACKEND;
  return env;
}

function topFiles(dir: string): Map<string, Buffer> {
  const out = new Map<string, Buffer>();
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    if (entry.isFile()) out.set(entry.name, readFileSync(join(dir, entry.name)));
  }
  return out;
}

/** Every file of the two packs, byte for byte (and no others). */
function expectSamePack(dst: string, direct: string): void {
  const got = topFiles(dst);
  const want = topFiles(direct);
  expect([...got.keys()].sort()).toEqual([...want.keys()].sort());
  for (const [name, data] of want) expect(got.get(name)?.equals(data), name).toBe(true);
}

interface Bar {
  label: string;
  total: number;
  start: number;
  added: number;
}

/** A Progress that records every bar (label, total, starting count, bytes added). */
function recordingProgress(): { bars: Bar[]; progress: Progress } {
  const bars: Bar[] = [];
  let open: Bar | null = null;
  return {
    bars,
    progress: {
      start(label, total, done = 0) {
        expect(open, "a bar started while another was showing").toBeNull();
        open = { label, total, start: done, added: 0 };
        bars.push(open);
      },
      add(bytes) {
        expect(open, "bytes added with no bar showing").not.toBeNull();
        (open as Bar).added += bytes;
      },
      stop() {
        open = null;
      },
    },
  };
}

describe("kvl prepare (packer/prepare.ts) against the stand-in hub", () => {
  let core: WasmBackend;
  let ckpt: string;
  let direct: string;
  let shards: string[];
  let hub: HubStandin;
  const logs: string[] = [];
  const options = (extra: Partial<PrepareOptions> = {}): PrepareOptions =>
    ({ core, endpoint: hub.endpoint, token: null, log: (l) => logs.push(l), retryDelayMs: 5, ...extra });

  beforeAll(async () => {
    core = await WasmBackend.create();
    // The synthesized checkpoint has no revision of its own: in a snapshots/<commit> folder (the
    // hub cache's layout) the direct pack records the pinned one, as prepare does.
    ckpt = await synthesize(join(tempDir("ckpt"), "snapshots", PINNED_REVISION), { preset: "tiny", seed: 0, core });
    direct = await packCheckpoint(ckpt, join(tempDir("direct"), "pack"), { core });
    shards = [...new Set(readIndex(join(ckpt, INDEX_NAME)).values())].sort();
    hub = await HubStandin.start({ root: ckpt, repoId: PINNED_REPO, commit: PINNED_REVISION });
  });
  afterAll(async () => {
    await hub?.stop();
    core?.close();
  });
  afterEach(() => {
    hub.clearFaults();
    hub.onRequest = undefined;
    logs.length = 0;
  });

  it("downloads, resumes a dropped transfer, and packs exactly what a direct pack gives", async () => {
    expect(shards).toHaveLength(3);
    const sizes = new Map(shards.map((s) => [s, statSync(join(ckpt, s)).size]));
    const biggest = shards.reduce((a, b) => ((sizes.get(b) as number) > (sizes.get(a) as number) ? b : a));
    const cut = Math.floor((sizes.get(biggest) as number) / 2);
    hub.dropAt(biggest, cut);
    const dst = join(tempDir("dst"), "pack");
    // What is in the scratch folder whenever a shard's data transfer starts.
    const onDisk: string[][] = [];
    hub.onRequest = (r) => {
      if (r.server === "cdn" && r.file?.endsWith(".safetensors") && r.range === null) {
        onDisk.push(readdirSync(join(dst, ".download")).filter((n) => n.endsWith(".safetensors")).sort());
      }
    };
    const { bars, progress } = recordingProgress();
    const before = hub.requests.length;
    expect(await prepare(dst, options({ progress }))).toBe(dst);
    const requests = hub.requests.slice(before);
    const transfers = (file: string) => requests.filter((r) => hub.transfersOf(file).includes(r));

    expectSamePack(dst, direct);
    const reader = await verify(dst, { checkDataCrc: true });
    expect(reader.revision).toBe(PINNED_REVISION);
    expect(readFileSync(join(dst, "SOURCE_REVISION.txt"), "utf8")).toBe(`${PINNED_REVISION}\n`);
    expect(existsSync(join(dst, ".download"))).toBe(false);
    expect(existsSync(join(dst, ".pack-journal"))).toBe(false);
    // The .bin files are also the Python packer's (recorded before it was removed).
    const python = (JSON.parse(readFileSync(join(packageRoot, "test", "fixtures", "python-packer-sha256.json"), "utf8")) as
      Record<string, { pack: Record<string, string> }>)["tiny-seed0"]!.pack;
    for (const bin of ["trunk.bin", "experts.bin", "vision.bin"]) expect(sha256(readFileSync(join(dst, bin))), bin).toBe(python[bin]);

    // The cut-off transfer resumed from the .part file (from what had reached it), not from the start.
    const resumed = transfers(biggest);
    expect(resumed.map((t) => t.status)).toEqual([200, 206]);
    const from = Number(/^bytes=(\d+)-$/.exec(resumed[1]?.range ?? "")?.[1]);
    expect(from).toBeGreaterThan(cut / 2);
    expect(from).toBeLessThanOrEqual(cut);
    expect(logs).toContain(`transfer of ${biggest} interrupted (ECONNRESET: aborted); resuming from byte ${from} (attempt 2/4)`);
    // Each shard's data came once; otherwise only two header range reads per shard, the index
    // and the assets.
    for (const shard of shards) {
      expect(transfers(shard).filter((r) => r.range === null), shard).toHaveLength(1);
      const bounded = requests.filter((r) => r.server === "cdn" && r.file === shard && !transfers(shard).includes(r));
      expect(bounded.map((r) => r.range?.replace(/-\d+$/, "-")), shard).toEqual(["bytes=0-", "bytes=8-"]);
    }
    const fetched = new Set(requests.filter((r) => r.method === "GET").map((r) => r.file));
    expect([...fetched].sort()).toEqual([...new Set([...shards, ...ASSET_NAMES, INDEX_NAME])].sort());
    // Bounded scratch: no shard waits on disk while another one arrives, except one still being read.
    expect(onDisk).toHaveLength(3);
    expect(onDisk.every((names) => names.length <= 1)).toBe(true);
    expect(onDisk.filter((names) => names.length === 0).length).toBeGreaterThanOrEqual(2);

    // Progress: one bar at a time; each shard's download has its own; the packing bar
    // continues across them and ends at its total.
    const downloads = bars.filter((b) => b.label.startsWith("downloading "));
    for (const [i, shard] of shards.entries()) {
      const mine = downloads.filter((b) => b.label === `downloading ${shard} (${i + 1}/3)`);
      expect(mine.length, shard).toBe(shard === biggest ? 2 : 1);
      expect(mine.reduce((a, b) => a + b.added, 0)).toBe(sizes.get(shard));
      expect(mine.every((b) => b.total === sizes.get(shard))).toBe(true);
    }
    const packing = bars.filter((b) => b.label === "packing");
    expect(packing.length).toBeGreaterThanOrEqual(2);
    const last = packing.at(-1) as Bar;
    expect(last.start + last.added).toBe(last.total);
    expect(packing.reduce((a, b) => a + b.added, 0)).toBe(last.total);
  });

  it("keeps the download on request, and a rerun on a complete pack asks the hub nothing", async () => {
    const dst = join(tempDir("dst"), "pack");
    await prepare(dst, options({ keepDownload: true }));
    expect(readdirSync(join(dst, ".download")).filter((n) => /\.safetensors|\.part$/.test(n)).sort())
      .toEqual([...shards, INDEX_NAME].sort());
    for (const shard of shards) expect(readFileSync(join(dst, ".download", shard)).equals(readFileSync(join(ckpt, shard)))).toBe(true);
    const before = topFiles(dst);
    const n = hub.requests.length;
    await prepare(dst, options());
    expect(hub.requests.length).toBe(n);
    expect(logs.at(-1)).toBe(`${dst} already holds a complete pack`);
    const after = topFiles(dst);
    for (const [name, data] of before) expect(after.get(name)?.equals(data), name).toBe(true);
    // --ram-budget: the RAM plan of the finished pack is checked, with advice when it cannot fit
    await expect(prepare(dst, options({ ramBudgetMib: 64 }))).rejects.toThrow(/the RAM plan needs [\d.,]+ MiB, .* over --ram-mib 64\.0; .*raise --ram-mib to \d+/);
    await prepare(dst, options({ ramBudgetMib: 8192 }));
    expect(hub.requests.length).toBe(n);
  });

  it("resumes after the process is SIGKILLed mid-download: the pack from its journal, the shard from its .part", async () => {
    const dst = join(tempDir("dst"), "pack");
    const target = shards[2] as string;
    const at = Math.floor(statSync(join(ckpt, target)).size / 3);
    const before = hub.requests.length;
    const held = hub.holdAt(target, at);
    const child = spawn(process.execPath, [VITE_NODE, CHILD, "--", "prepare", dst, "--quiet", "--backend", "wasm"],
      { env: childEnv(hub.endpoint), stdio: ["ignore", "ignore", "pipe"] });
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => { stderr += d.toString(); });
    const exited = new Promise<NodeJS.Signals | number | null>((ok) => child.on("exit", (code, signal) => ok(signal ?? code)));
    await held;
    const part = join(dst, ".download", `${target}.part`);
    const deadline = Date.now() + 60_000;
    while ((existsSync(part) ? statSync(part).size : 0) < at) {
      if (Date.now() > deadline) throw new Error(`the child never wrote ${at} bytes of ${target}; stderr:\n${stderr}`);
      await new Promise((ok) => setTimeout(ok, 10));
    }
    child.kill("SIGKILL");
    expect(await exited).toBe("SIGKILL");
    expect(statSync(part).size).toBe(at);
    expect(existsSync(join(dst, ".pack-journal", "layout.json"))).toBe(true);
    expect(existsSync(join(dst, "PACK_COMPLETE.json"))).toBe(false);

    await prepare(dst, options());
    expectSamePack(dst, direct);
    // The killed transfer continued from the .part file; no shard's data was fetched twice.
    const requests = hub.requests.slice(before);
    const transfers = (file: string) => requests.filter((r) => hub.transfersOf(file).includes(r)).map((r) => r.range);
    expect(transfers(target)).toEqual([null, `bytes=${at}-`]);
    for (const shard of shards.slice(0, 2)) expect(transfers(shard), shard).toEqual([null]);
    expect(logs.some((l) => /^resuming the pack in .*: \d+ items already written$/.test(l))).toBe(true);
  });

  it("refuses a shard whose checksum does not match, keeps the work done, and finishes on a rerun", async () => {
    const dst = join(tempDir("dst"), "pack");
    const target = shards[2] as string;
    const size = statSync(join(ckpt, target)).size;
    const counts = (): number[] => shards.map((s) => hub.transfersOf(s).filter((t) => t.range === null).length);
    const start = counts();
    hub.corruptAt(target, size - 100, 2);
    const err = await prepare(dst, options()).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UserError);
    expect((err as Error).message).toMatch(new RegExp(`^${target.replace(/\./g, "\\.")}: checksum mismatch: the downloaded bytes have ` +
      `sha256 [0-9a-f]{64}, but the hub says ${hub.sha256Of(target)} \\(twice; the second time downloaded from the start\\): ` +
      "the hub's copy or the connection corrupts data, so kvl refuses to pack it\\. Nothing was packed from this file"));
    expect(existsSync(join(dst, "PACK_COMPLETE.json"))).toBe(false);
    expect(existsSync(join(dst, ".download", target))).toBe(false);
    expect(existsSync(join(dst, ".download", `${target}.part`))).toBe(false);
    const journaled = readFileSync(join(dst, ".pack-journal", "done.log"), "utf8").split("\n").filter(Boolean);
    expect(journaled.length).toBeGreaterThan(0);
    expect(counts().map((c, i) => c - (start[i] as number))).toEqual([1, 1, 2]);

    await prepare(dst, options());
    expectSamePack(dst, direct);
    // Nothing lost: the first two shards were not fetched again.
    expect(counts().map((c, i) => c - (start[i] as number))).toEqual([1, 1, 3]);
    expect(logs.some((l) => l.startsWith(`resuming the pack in ${dst}: ${journaled.length} items`))).toBe(true);
  });

  it("fails fast and clearly when the hub is unreachable (HF_ENDPOINT), in the library and the command", async () => {
    const endpoint = `http://127.0.0.1:${await closedPort()}`;
    const dst = join(tempDir("dst"), "pack");
    const saved = process.env.HF_ENDPOINT;
    process.env.HF_ENDPOINT = endpoint;
    try {
      const { endpoint: _ignored, ...fromEnv } = options();
      void _ignored;
      const t0 = Date.now();
      const err = await prepare(dst, fromEnv).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(UserError);
      expect((err as Error).message).toMatch(new RegExp(`^cannot reach ${endpoint} \\(HF_ENDPOINT\\): .*ECONNREFUSED.*; check your connection or set HF_ENDPOINT$`));
      expect(Date.now() - t0).toBeLessThan(5000);
    } finally {
      if (saved === undefined) delete process.env.HF_ENDPOINT;
      else process.env.HF_ENDPOINT = saved;
    }
    expect(existsSync(join(dst, "PACK_COMPLETE.json"))).toBe(false);

    const r = spawnSync(process.execPath, [VITE_NODE, CHILD, "--", "prepare", dst, "--backend", "wasm"],
      { env: childEnv(endpoint), encoding: "utf8", timeout: 120_000 });
    expect(r.status).toBe(1);
    expect(r.stderr).toContain(`kvl prepare: error: cannot reach ${endpoint} (HF_ENDPOINT): `);
    expect(r.stderr).not.toMatch(/^\s+at /m);
  });

  it("refuses revisions other than the pinned one unless asked for explicitly", async () => {
    const dst = join(tempDir("dst"), "pack");
    await expect(prepare(dst, options({ revision: "deadbeef" }))).rejects.toThrow(
      `revision deadbeef of ${PINNED_REPO} does not exist on ${hub.endpoint}; use --revision ${PINNED_REVISION}`);
    expect(existsSync(dst)).toBe(false);

    const other = "0123456789abcdef0123456789abcdef01234567";
    const moved = await HubStandin.start({ root: ckpt, repoId: PINNED_REPO, commit: other });
    // A hub that says the pinned revision is some other commit is not trusted.
    const lying = await HubStandin.start({ root: ckpt, repoId: PINNED_REPO, commit: other, aliases: [PINNED_REVISION] });
    try {
      await expect(prepare(dst, options({ endpoint: moved.endpoint }))).rejects.toThrow(
        `revision ${PINNED_REVISION} of ${PINNED_REPO} does not exist on ${moved.endpoint}; use --revision ${PINNED_REVISION}`);
      await expect(prepare(dst, options({ endpoint: lying.endpoint }))).rejects.toThrow(
        `${lying.endpoint} answered commit ${other} for the pinned revision ${PINNED_REVISION}`);
      expect(existsSync(dst)).toBe(false);
      // Asked for by name, another revision is packed, with a warning, and recorded as such.
      await prepare(dst, options({ endpoint: moved.endpoint, revision: other }));
      expect(logs).toContain(`warning: revision ${other} (${other}) is not the pinned ${PINNED_REVISION}; ` +
        "kvl was verified only against the pinned one");
      expect(readFileSync(join(dst, "SOURCE_REVISION.txt"), "utf8")).toBe(`${other}\n`);
      expect((await verify(dst)).revision).toBe(other);
      for (const bin of ["trunk.bin", "experts.bin", "vision.bin"]) {
        expect(readFileSync(join(dst, bin)).equals(readFileSync(join(direct, bin))), bin).toBe(true);
      }
    } finally {
      await moved.stop();
      await lying.stop();
    }
  });

  it("a gated repository needs the token; with it, the token never reaches the CDN", async () => {
    const gated = await HubStandin.start({ root: ckpt, repoId: PINNED_REPO, commit: PINNED_REVISION, requireToken: "hf_kvl" });
    try {
      const dst = join(tempDir("dst"), "pack");
      await expect(prepare(dst, options({ endpoint: gated.endpoint }))).rejects.toThrow(
        `${PINNED_REPO} is not accessible on ${gated.endpoint} (HTTP 401, GatedRepo)`);
      await prepare(dst, options({ endpoint: gated.endpoint, token: "hf_kvl" }));
      expectSamePack(dst, direct);
      const cdn = gated.requests.filter((r) => r.server === "cdn");
      expect(cdn.length).toBeGreaterThan(0);
      expect(cdn.every((r) => r.authorization === null && r.status < 400)).toBe(true);
    } finally {
      await gated.stop();
    }
  });
});
