/**
 * download-resume.ts — how the hub client of `kvl prepare` (packer/hub.ts, Hub.download: the
 * call prepare's shard hook makes for every shard) copes with interrupted downloads, measured
 * against the local stand-in hub (test/support/hub-standin.ts) over loopback HTTP on this machine.
 *
 *   npx vite-node bench/download-resume.ts [--size-mib N]      (default 2047; at most 2047)
 *
 * Serves one synthesized file, `model-00001-of-00001.safetensors` (a valid safetensors file: one
 * U8 tensor of random bytes, N MiB in all; the cap is the stand-in's: it hashes a file with one
 * readFileSync, which stops below 2 GiB), as an LFS file of the pinned revision: a HEAD on the hub
 * answers the 302 to the stand-in's "CDN" with the sha256 and size; the bytes come from the CDN.
 * Cases, each into a fresh empty directory, each download checked afterwards against the sha256
 * computed while the file was written:
 *   (ref) one plain GET of the CDN URL with the body discarded: what loopback plus the stand-in
 *         deliver without the client's disk writes and checksum pass (no sha256 check: no file);
 *   (a) an uninterrupted download;
 *   (b) the stand-in drops the connection at 50 % of the file; the same download() call resumes;
 *   (c) a child process (this script with --child, run through vite-node as
 *       test/support/prepare-child.ts is) downloads and is SIGKILLed once its .part holds >= 50 %;
 *       then the download runs again, in this process, on the same directory;
 *   (d) the stand-in flips one byte at 50 %; the checksum catches it after the transfer.
 * Figures: bytes the stand-in handed to its HTTP responses (counted by wrapping
 * http.ServerResponse.prototype.write in this process: exact for (a), (b), (d); for the killed
 * child an upper bound on what reached it), requests and the Range of each data transfer (the
 * stand-in's request log), wall seconds of the download() call (it includes the client's own
 * sha256 pass over the file before the rename; the probe() before it is not timed).
 * Not measured: the packing kvl prepare does between shard downloads, TLS, a real network
 * (loopback only; the served file sits in the page cache; stand-in and client share one Node
 * event loop except in (c)'s killed run).
 * Temp files go under /tmp/kvl-dlbench-* and are deleted at the end. Prints one detail line per
 * case, then a markdown section (machine, command, table) for bench/RESULTS.md.
 */
import { execSync, spawn } from "node:child_process";
import { createHash, randomFillSync } from "node:crypto";
import { closeSync, existsSync, mkdirSync, mkdtempSync, openSync, rmSync, statSync, writeFileSync, writeSync } from "node:fs";
import * as http from "node:http";
import { cpus } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { Hub, PINNED_REPO, PINNED_REVISION, fileChecksum } from "../packer/hub.js";
import { HubStandin, type RequestLog } from "../test/support/hub-standin.js";

const FILE = "model-00001-of-00001.safetensors";
const SELF = fileURLToPath(import.meta.url);
const VITE_NODE = join(resolve(SELF, "..", ".."), "node_modules", "vite-node", "vite-node.mjs");
const MB = 1e6;

// ---- child mode (case c): one download, to be killed ---------------------------------------
const childAt = process.argv.indexOf("--child");
if (childAt >= 0) {
  const [endpoint, dir] = process.argv.slice(childAt + 1);
  const hub = new Hub(PINNED_REPO, PINNED_REVISION, endpoint as string, { token: null });
  await hub.probe();
  await hub.download(FILE, dir as string);
  process.exit(0);
}

// ---- the parent ------------------------------------------------------------------------------
const sizeArg = process.argv.indexOf("--size-mib");
const sizeMib = sizeArg >= 0 ? Number(process.argv[sizeArg + 1]) : 2047;
if (!Number.isInteger(sizeMib) || sizeMib < 1 || sizeMib > 2047) {
  throw new Error("--size-mib takes an integer from 1 to 2047 (the stand-in hashes the file with one readFileSync)");
}
const size = sizeMib * 2 ** 20;
const half = Math.floor(size / 2);

/** Bytes handed to server responses' write() (the stand-in's bodies; the client never uses it). */
let served = 0;
const serverWrite = http.ServerResponse.prototype.write;
http.ServerResponse.prototype.write = function (this: http.ServerResponse, chunk: unknown, ...rest: unknown[]): boolean {
  if (typeof chunk === "string") served += Buffer.byteLength(chunk);
  else if (chunk instanceof Uint8Array) served += chunk.length;
  return (serverWrite as (...a: unknown[]) => boolean).call(this, chunk, ...rest);
} as typeof serverWrite;

const mib = (n: number): string => `${(n / 2 ** 20).toFixed(1)} MiB`;
const secs = (ms: number): string => (ms / 1000).toFixed(2);
const rate = (bytes: number, ms: number): string => `${(bytes / MB / (ms / 1000)).toFixed(0)} MB/s`;

/** A valid safetensors file of `total` bytes: one U8 tensor of random bytes. Returns its sha256. */
function writeShard(path: string, total: number): string {
  const pad = (text: string): string => text + " ".repeat((8 - (text.length % 8)) % 8);
  // The header's length depends on the tensor's, which depends on the header's: settle it.
  let header = "";
  let n = total - 8;
  for (let i = 0; i < 3; i++) {
    header = pad(JSON.stringify({ w: { dtype: "U8", shape: [n], data_offsets: [0, n] }, __metadata__: { format: "pt" } }));
    n = total - 8 - header.length;
  }
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(header.length));
  const hash = createHash("sha256");
  const fd = openSync(path, "w");
  try {
    for (const b of [prefix, Buffer.from(header)]) {
      writeSync(fd, b);
      hash.update(b);
    }
    const block = Buffer.alloc(16 << 20);
    for (let left = n; left > 0;) {
      const b = block.subarray(0, Math.min(left, block.length));
      randomFillSync(b);
      writeSync(fd, b);
      hash.update(b);
      left -= b.length;
    }
  } finally {
    closeSync(fd);
  }
  if (statSync(path).size !== total) throw new Error("shard size mismatch");
  return hash.digest("hex");
}

interface Row {
  name: string;
  result: string;
  sent: string;
  requests: string;
  transfers: string;
  seconds: string;
  sha: string;
}

/** The child of case (c) while it runs (killed on the way out if something failed). */
const running: { child: ReturnType<typeof spawn> | null } = { child: null };

async function runCases(hub: HubStandin, work: string, expected: string): Promise<Row[]> {
  const rows: Row[] = [];
  const clientLog: string[] = [];
  const client = (): Hub => new Hub(PINNED_REPO, PINNED_REVISION, hub.endpoint, { token: null, log: (l) => clientLog.push(l) });

  /** What the stand-in saw since `mark`: requests by method, the data transfers of FILE. */
  const seen = (mark: number): { reqs: string; transfers: RequestLog[]; text: string } => {
    const all = hub.requests.slice(mark);
    const ofFile = new Set(hub.transfersOf(FILE));
    const transfers = all.filter((r) => ofFile.has(r));
    const heads = all.filter((r) => r.method === "HEAD").length;
    const gets = all.filter((r) => r.method === "GET").length;
    return { reqs: `${heads} HEAD + ${gets} GET`, transfers, text: transfers.map((r) => `${r.status} ${r.range ?? "whole"}`).join(", ") };
  };
  const rangeStart = (r: RequestLog | undefined): number => Number(/^bytes=(\d+)-$/.exec(r?.range ?? "")?.[1] ?? 0);
  const sentText = (n: number): string => `${n} (${(n / size).toFixed(3)}x)`;

  /** A probe (as prepare does first, untimed), then the timed download. */
  const timedDownload = async (dir: string): Promise<{ ms: number; path: string; mark: number; sent: number }> => {
    const c = client();
    await c.probe();
    const mark = hub.requests.length;
    const before = served;
    const t0 = performance.now();
    const path = await c.download(FILE, dir);
    return { ms: performance.now() - t0, path, mark, sent: served - before };
  };
  const checkSha = async (path: string): Promise<string> => {
    const ok = (await fileChecksum(path, "sha256")) === expected && !existsSync(`${path}.part`);
    return ok ? "ok" : "MISMATCH";
  };
  const freshDir = (tag: string): string => {
    const dir = join(work, tag);
    mkdirSync(dir);
    return dir;
  };

  // (ref) plain GET, body discarded --------------------------------------------------------------
  {
    const meta = await client().metadata(FILE);
    const before = served;
    const t0 = performance.now();
    const got = await new Promise<number>((ok, fail) => {
      http.get(meta.url, { agent: false }, (res) => {
        let n = 0;
        res.on("data", (d: Buffer) => { n += d.length; });
        res.on("end", () => ok(n));
        res.on("error", fail);
      }).on("error", fail);
    });
    const ms = performance.now() - t0;
    console.log(`(ref) plain http.get of the CDN URL, body discarded: ${got} bytes in ${secs(ms)} s = ${rate(got, ms)}`);
    rows.push({ name: "(ref) plain GET, body discarded", result: rate(got, ms), sent: sentText(served - before),
      requests: "1 GET", transfers: "200 whole", seconds: secs(ms), sha: "n/a (nothing kept)" });
  }

  // (a) uninterrupted ---------------------------------------------------------------------------
  {
    const dir = freshDir("a");
    const r = await timedDownload(dir);
    const s = seen(r.mark);
    const t0 = performance.now();
    const sha = await checkSha(r.path);
    const shaMs = performance.now() - t0;
    console.log(`(a) uninterrupted: ${size} bytes in ${secs(r.ms)} s = ${rate(size, r.ms)} (incl. the client's sha256 pass; ` +
      `a second sha256 pass over the finished file took ${secs(shaMs)} s); stand-in sent ${r.sent} bytes; ${s.reqs}; ` +
      `transfers: ${s.text}; sha256 ${sha}`);
    rows.push({ name: "(a) uninterrupted", result: `${rate(size, r.ms)} (a sha256 pass alone: ${secs(shaMs)} s)`,
      sent: sentText(r.sent), requests: s.reqs, transfers: s.text, seconds: secs(r.ms), sha });
    rmSync(dir, { recursive: true, force: true });
  }

  // (b) connection dropped by the stand-in at 50 %, resumed within the same call ------------------
  {
    const dir = freshDir("b");
    hub.dropAt(FILE, half);
    clientLog.length = 0;
    const r = await timedDownload(dir);
    const s = seen(r.mark);
    const from = rangeStart(s.transfers[1]);
    const sha = await checkSha(r.path);
    console.log(`(b) dropped at byte ${half} (50 %): resumed from byte ${from} (${half - from} bytes before the cut sent twice); ` +
      `stand-in sent ${r.sent} bytes for a ${size}-byte file; ${s.reqs}; transfers: ${s.text}; ${secs(r.ms)} s; ` +
      `sha256 ${sha}; client log: ${JSON.stringify(clientLog)}`);
    rows.push({ name: "(b) dropped at 50 %, same run", result: `cut at ${half}, resumed from ${from}`,
      sent: sentText(r.sent), requests: s.reqs, transfers: s.text, seconds: secs(r.ms), sha });
    rmSync(dir, { recursive: true, force: true });
  }

  // (c) a child SIGKILLed once its .part holds >= 50 %, then a rerun ------------------------------
  {
    const dir = freshDir("c");
    const part = join(dir, `${FILE}.part`);
    const mark = hub.requests.length;
    const before = served;
    const t0 = performance.now();
    const proc = spawn(process.execPath, [VITE_NODE, SELF, "--", "--child", hub.endpoint, dir], { stdio: ["ignore", "ignore", "pipe"] });
    running.child = proc;
    let stderr = "";
    proc.stderr?.on("data", (d: Buffer) => { stderr += d.toString(); });
    let status: string | null = null;
    const exited = new Promise<string>((ok) => proc.on("exit", (code, signal) => ok(status = String(signal ?? code))));
    let firstByteMs = NaN;
    for (;;) {
      const have = existsSync(part) ? statSync(part).size : 0;
      if (have > 0 && Number.isNaN(firstByteMs)) firstByteMs = performance.now() - t0;
      if (have >= half) break;
      if (status !== null) throw new Error(`the child exited (${status}) before its .part reached 50 %; stderr:\n${stderr}`);
      if (performance.now() - t0 > 300_000) throw new Error(`the child's .part never reached 50 %; stderr:\n${stderr}`);
      await new Promise((ok) => setTimeout(ok, 1));
    }
    proc.kill("SIGKILL");
    const how = await exited;
    running.child = null;
    const killMs = performance.now() - t0;
    const atKill = statSync(part).size;
    const sentToKilled = served - before;
    const killed = seen(mark);
    await new Promise((ok) => setTimeout(ok, 200)); // the stand-in sees the dead socket

    const r = await timedDownload(dir);
    const s = seen(r.mark);
    const from = rangeStart(s.transfers[0]);
    const refetched = Math.max(0, atKill - from);
    const sha = await checkSha(r.path);
    console.log(`(c) child ${how} ${secs(killMs)} s after spawn (first .part byte at ${secs(firstByteMs)} s: vite-node ` +
      `start-up): the .part held ${atKill} bytes (${((100 * atKill) / size).toFixed(1)} %); the stand-in had handed ` +
      `${sentToKilled} bytes to that response (${sentToKilled - atKill} never reached the .part); killed run transfers: ` +
      `${killed.text}; rerun: ${s.reqs}, transfers: ${s.text}, fetched ${size - from} bytes (stand-in sent ${r.sent}), ` +
      `re-fetched below the kill point: ${refetched} bytes; rerun ${secs(r.ms)} s = ${rate(size - from, r.ms)}; sha256 ${sha}`);
    rows.push({ name: "(c) child SIGKILLed at >= 50 %, then rerun",
      result: `.part held ${atKill} at the kill; rerun asked from ${from}: ${refetched} bytes below the kill point re-fetched`,
      sent: `killed run ${sentToKilled} (${sentToKilled - atKill} not in the .part); rerun ${sentText(r.sent)}`,
      requests: `rerun: ${s.reqs}`, transfers: `killed: ${killed.text}; rerun: ${s.text}`,
      seconds: `${secs(killMs)} spawn to kill (incl. ~${secs(firstByteMs)} start-up) + ${secs(r.ms)} rerun`, sha });
    rmSync(dir, { recursive: true, force: true });
  }

  // (d) one flipped byte at 50 %, caught by the checksum ------------------------------------------
  {
    const dir = freshDir("d");
    hub.corruptAt(FILE, half);
    clientLog.length = 0;
    const r = await timedDownload(dir);
    const s = seen(r.mark);
    const sha = await checkSha(r.path);
    const whole = s.transfers.filter((x) => x.range === null).length;
    console.log(`(d) byte ${half} flipped: ${s.reqs}; transfers: ${s.text}; stand-in sent ${r.sent} bytes; ${secs(r.ms)} s; ` +
      `sha256 ${sha}; client log: ${JSON.stringify(clientLog.map((l) => l.replace(/[0-9a-f]{64}/g, "<sha256>")))}`);
    rows.push({ name: "(d) one byte flipped at 50 %",
      result: `mismatch found after the transfer; ${whole === 2 ? "whole file fetched again from byte 0" : `${whole} whole transfers`}`,
      sent: sentText(r.sent), requests: s.reqs, transfers: s.text, seconds: secs(r.ms), sha });
    rmSync(dir, { recursive: true, force: true });
  }
  return rows;
}

const work = mkdtempSync("/tmp/kvl-dlbench-");
let standin: HubStandin | null = null;
let rows: Row[] = [];
try {
  const repo = join(work, "repo");
  mkdirSync(repo);
  writeFileSync(join(repo, "config.json"), '{"model_type": "kimi_vl"}\n'); // what probe() asks for
  let t0 = performance.now();
  const expected = writeShard(join(repo, FILE), size);
  console.error(`wrote ${FILE}: ${mib(size)} in ${secs(performance.now() - t0)} s, sha256 ${expected}`);
  standin = await HubStandin.start({ root: repo, repoId: PINNED_REPO, commit: PINNED_REVISION });
  t0 = performance.now();
  if (standin.sha256Of(FILE) !== expected) throw new Error("the stand-in hashes the file differently");
  console.error(`the stand-in hashed it in ${secs(performance.now() - t0)} s (once, before any case)`);
  rows = await runCases(standin, work, expected);
} finally {
  running.child?.kill("SIGKILL");
  await standin?.stop();
  rmSync(work, { recursive: true, force: true });
}

// ---- the report --------------------------------------------------------------------------------
let model = cpus()[0]?.model ?? "?";
try {
  model = /Model name:\s*(.+)/.exec(execSync("lscpu", { encoding: "utf8" }))?.[1]?.trim() ?? model;
} catch {
  // no lscpu: keep os.cpus()'s name
}
const nproc = execSync("nproc", { encoding: "utf8" }).trim();
const command = `npx vite-node bench/download-resume.ts${sizeArg >= 0 ? ` --size-mib ${sizeMib}` : ""}`;
console.log([
  "",
  "## Download resume (kvl prepare against the stand-in hub)",
  "",
  `${new Date().toISOString().slice(0, 10)}, ${model}, nproc ${nproc}, Node ${process.version}. Loopback HTTP to ` +
  "test/support/hub-standin.ts, served from this process (the killed download in (c) runs in a child process). " +
  `One LFS file of ${mib(size)} (${size} bytes) from the page cache; the client is packer/hub.ts's Hub.download ` +
  "(what kvl prepare calls for each shard) with its default timeouts and retry delays. Bytes sent = bytes the " +
  "stand-in handed to its responses' write(); seconds = the download() call, including its own sha256 pass.",
  "",
  "```sh",
  command,
  "```",
  "",
  "| case | result | bytes sent by the stand-in (x file size) | requests | data transfers (status, Range) | seconds | final sha256 |",
  "|---|---|---|---|---|---|---|",
  ...rows.map((r) => `| ${r.name} | ${r.result} | ${r.sent} | ${r.requests} | ${r.transfers} | ${r.seconds} | ${r.sha} |`),
  "",
].join("\n"));
if (!rows.every((r) => r.sha === "ok" || r.sha.startsWith("n/a"))) process.exitCode = 1;
