/**
 * bench-limits.ts — this machine's physical limits for `kvl bench`: DRAM streaming-read
 * bandwidth, direct-I/O (O_DIRECT) read bandwidth of the pack's experts.bin, and the FP32 FMA
 * peak; and the short probes of the first two taken right before and after each decode.
 *
 * Owns: where the limits come from, in order of preference, and saying which (Limits.source):
 *   1. --limits FILE: the JSON lines of bench/membw.c (bench/run_all.sh writes them);
 *   2. a membw binary: the one given with --membw, else bench/membw.c built with the system C
 *      compiler as bench/run_all.sh builds it (cc -std=c11 -O2 -mavx2 -mfma ... -lpthread; Linux
 *      x86-64 only) in a kvl-membw-* folder under os.tmpdir() that the run removes when it ends,
 *      also when it fails (the build takes about half a second);
 *   3. a measurement in Node: worker_threads each scanning its slice of one large
 *      SharedArrayBuffer with Buffer.indexOf (memchr) for DRAM; fs reads of 4 KiB-aligned
 *      extents of experts.bin opened with fs.constants.O_DIRECT into a WebAssembly memory (page
 *      aligned, as O_DIRECT needs) for the SSD, buffered where the filesystem refuses O_DIRECT
 *      (said in the source); no FMA peak (so no FLOP floor).
 * A membw measurement that fails (e.g. O_DIRECT refused) falls back to the Node one for that
 * limit. Also owns --drop-caches (dropPageCache). Does not own the bounds (bench-model.ts).
 */
import { spawnSync } from "node:child_process";
import { constants as fsConstants, existsSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { open as openAsync } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Worker } from "node:worker_threads";

import type { Probe } from "./bench-model.js";
import { PAGE } from "./bench-model.js";
import { readCpuInfo } from "../core/cpu.js";
import { packageRoot } from "../system/paths.js";
import { UserError } from "../system/user-error.js";

const MIB = 1 << 20;

/** The limits a run's bounds divide by (--json: limits). */
export interface Limits {
  /** best multi-thread streaming read */
  dram_bytes_per_s: number;
  /** best O_DIRECT extent-sized random read (any queue depth) */
  ssd_bytes_per_s: number;
  /** best FP32 FMA peak, all threads; null when not measured */
  fma_flops_per_s: number | null;
  source: string;
  detail: Array<Record<string, unknown>>;
}

type Row = Record<string, unknown>;

const num = (v: unknown): number | null => (typeof v === "number" && Number.isFinite(v) ? v : null);

/** --limits FILE: membw's JSON lines; at least one dram and one ssd line. */
export function loadLimits(path: string): Limits {
  let rows: Row[];
  try {
    rows = readFileSync(path, "utf8").split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as Row);
    if (rows.some((r) => r === null || typeof r !== "object" || Array.isArray(r))) throw new Error("a line is not a JSON object");
  } catch (err) {
    throw new UserError(`--limits ${path}: unreadable (${(err as Error).message}); produce it with bench/run_all.sh or drop --limits to measure here`);
  }
  const dram = rows.filter((r) => r.mode === "dram").map((r) => num(r.best_bytes_per_s)).filter((v): v is number => v !== null);
  const ssd = rows.filter((r) => r.mode === "ssd").map((r) => num(r.bytes_per_s)).filter((v): v is number => v !== null);
  const fma = rows.filter((r) => r.mode === "fma").map((r) => num(r.flops_per_s)).filter((v): v is number => v !== null);
  if (!dram.length || !ssd.length) throw new UserError(`--limits ${path} needs at least one dram and one ssd line (membw output)`);
  return { dram_bytes_per_s: Math.max(...dram), ssd_bytes_per_s: Math.max(...ssd), fma_flops_per_s: fma.length ? Math.max(...fma) : null, source: path, detail: rows };
}

/** echo 3 > /proc/sys/vm/drop_caches after sync (root, Linux). */
export function dropPageCache(): void {
  spawnSync("sync", { stdio: "ignore" });
  try {
    writeFileSync("/proc/sys/vm/drop_caches", "3\n");
  } catch (err) {
    throw new UserError(`--drop-caches needs root on Linux (${(err as Error).message}); run without it`);
  }
}

// ---- membw ----------------------------------------------------------------------------------

const MEMBW_SOURCE = join(packageRoot, "bench", "membw.c");

/** Runs membw with argv; every JSON line it printed (fma prints one per instruction set), or
 * the reason it failed. */
export function runMembw(binary: string, argv: readonly string[]): { rows: Row[] } | { error: string } {
  const proc = spawnSync(binary, argv, { encoding: "utf8", timeout: 600_000 });
  if (proc.error) return { error: proc.error.message };
  if (proc.status !== 0) return { error: proc.stderr.trim() || `exit status ${proc.status ?? proc.signal}` };
  const lines = proc.stdout.split("\n").filter((l) => l.trim());
  try {
    const rows = lines.map((l) => JSON.parse(l) as Row);
    if (!rows.length || rows.some((r) => r === null || typeof r !== "object" || Array.isArray(r))) throw new Error("not objects");
    return { rows };
  } catch {
    return { error: `printed no JSON lines (${JSON.stringify(proc.stdout.slice(0, 120))})` };
  }
}

function compilerFound(cc: string): boolean {
  return spawnSync(cc, ["--version"], { encoding: "utf8", timeout: 30_000 }).status === 0;
}

/**
 * bench/membw.c built into `dir` (a private folder the caller removes) with the system C compiler
 * (env CC, else cc, gcc, clang) as bench/run_all.sh builds it; or why it cannot be.
 */
export function membwBinary(dir: string): { path: string; compiler: string } | { error: string } {
  if (process.platform !== "linux" || process.arch !== "x64") return { error: `bench/membw.c needs Linux on x86-64 (this is ${process.platform} ${process.arch})` };
  if (!existsSync(MEMBW_SOURCE)) return { error: `${MEMBW_SOURCE} is missing` };
  const candidates = process.env.CC ? [process.env.CC] : ["cc", "gcc", "clang"];
  const compiler = candidates.find((cc) => compilerFound(cc)) ?? null;
  if (compiler === null) return { error: `no C compiler (tried ${candidates.join(", ")})` };
  const binary = join(dir, "membw");
  const r = spawnSync(compiler, ["-std=c11", "-O2", "-mavx2", "-mfma", MEMBW_SOURCE, "-lpthread", "-o", binary], { encoding: "utf8", timeout: 120_000 });
  if (r.error || r.status !== 0) {
    return { error: `${compiler} could not build bench/membw.c: ${(r.error?.message ?? r.stderr.trim()).split("\n")[0]}` };
  }
  return { path: binary, compiler };
}

/** The direct-read block for a file: at most `want`, at most half the file (tiny packs), 4 KiB multiple. */
function readBlock(file: string, want: number): number {
  const size = statSync(file).size;
  return Math.min(Math.ceil(want / PAGE) * PAGE, Math.max(PAGE, Math.floor(size / 2 / PAGE) * PAGE));
}

/**
 * Probes next to a decode with a membw binary: a DRAM read (1 GiB, best of 3) and direct reads
 * (128 reads of 2 MiB, 4 in flight: the engine's read pattern). membw runs in a child process,
 * so its buffers never count in this process's peak RSS. UserError when it fails.
 */
export function probeLimits(membw: string, model: string, threads: number, seed: number): Probe {
  const run = (argv: string[]): Row => {
    const r = runMembw(membw, argv);
    if ("error" in r) throw new UserError(`--membw ${membw} ${argv.join(" ")} failed: ${r.error}`);
    return r.rows.at(-1)!;
  };
  const dram = num(run(["dram", "1024", String(threads), "3", "avx2"]).best_bytes_per_s);
  const experts = join(model, "experts.bin");
  const ssd = num(run(["ssd", experts, String(readBlock(experts, 2 * MIB)), "4", "128", String(seed)]).bytes_per_s);
  if (dram === null || ssd === null) throw new UserError(`--membw ${membw}: its dram/ssd lines lack best_bytes_per_s / bytes_per_s`);
  return { dram_bytes_per_s: dram, ssd_bytes_per_s: ssd };
}

// ---- the Node fallback ----------------------------------------------------------------------

const DRAM_WORKER = `
const { workerData, parentPort } = require("node:worker_threads");
const { sab, ctl, begin, end, reps } = workerData;
const view = Buffer.from(sab, begin, end - begin);
const c = new Int32Array(ctl);
let sink = 0;
Atomics.add(c, 2, 1);
Atomics.notify(c, 2);
for (let r = 0; r < reps; r++) {
  Atomics.wait(c, 0, r);           // the go counter: rep r starts when it passes r
  sink ^= view.indexOf(0);         // no zero byte: memchr scans the whole slice
  Atomics.add(c, 1, 1);
  Atomics.notify(c, 1);
}
parentPort.postMessage(sink);
`;

/**
 * Best bytes/s of `threads` worker threads each scanning its own slice of one buffer
 * (Buffer.indexOf of a byte it does not hold: memchr), timed from a common start to the last
 * thread's end, as membw dram does.
 */
async function nodeDramRead(sizeBytes: number, threads: number, reps: number): Promise<number> {
  const sab = new SharedArrayBuffer(sizeBytes);
  new Uint8Array(sab).fill(0x5a); // every page written: reads hit real memory
  const ctl = new SharedArrayBuffer(16);
  const c = new Int32Array(ctl);
  const per = Math.floor(sizeBytes / threads);
  const workers = Array.from({ length: threads }, (_, t) => new Worker(DRAM_WORKER, {
    eval: true, workerData: { sab, ctl, begin: t * per, end: t === threads - 1 ? sizeBytes : (t + 1) * per, reps },
  }));
  const done = workers.map((w) => new Promise<void>((resolve, reject) => {
    w.once("message", () => resolve());
    w.once("error", reject);
  }));
  try {
    // wait (without blocking the event loop: the workers must start) until every worker is ready
    while (Atomics.load(c, 2) < threads) await new Promise((r) => setTimeout(r, 1));
    let best = 0;
    for (let r = 0; r < reps; r++) {
      Atomics.store(c, 1, 0);
      const t0 = performance.now();
      Atomics.store(c, 0, r + 1);
      Atomics.notify(c, 0);
      for (let seen = Atomics.load(c, 1); seen < threads; seen = Atomics.load(c, 1)) Atomics.wait(c, 1, seen, 1000);
      const secs = (performance.now() - t0) / 1000;
      best = Math.max(best, sizeBytes / secs);
    }
    await Promise.all(done);
    return best;
  } finally {
    await Promise.all(workers.map((w) => w.terminate()));
  }
}

function splitmix64(state: { s: bigint }): bigint {
  state.s = (state.s + 0x9e3779b97f4a7c15n) & 0xffffffffffffffffn;
  let z = state.s;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & 0xffffffffffffffffn;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & 0xffffffffffffffffn;
  return z ^ (z >> 31n);
}

/**
 * bytes/s of `reads` reads of `block` bytes (rounded up to 4 KiB) at random 4 KiB-aligned
 * offsets of `path`, `qd` in flight, opened with O_DIRECT where the filesystem allows (direct:
 * false when it refused and the reads went through the page cache).
 */
async function nodeDirectRead(path: string, block: number, qd: number, reads: number, seed: number): Promise<{ bytes_per_s: number; direct: boolean }> {
  block = Math.ceil(block / PAGE) * PAGE;
  const size = statSync(path).size;
  if (size < block) throw new UserError(`${path} is smaller than one ${block}-byte read`);
  const slots = BigInt(Math.floor((size - block) / PAGE) + 1);
  const O_DIRECT = (fsConstants as Record<string, number>).O_DIRECT;
  // a WebAssembly memory starts page-aligned: O_DIRECT reads land at 4 KiB-aligned addresses
  const memory = new WebAssembly.Memory({ initial: Math.ceil((block * qd) / 65536) });
  const attempt = async (direct: boolean): Promise<number> => {
    const handle = await openAsync(path, direct ? fsConstants.O_RDONLY | O_DIRECT! : fsConstants.O_RDONLY);
    try {
      const t0 = performance.now();
      const per = Math.floor(reads / qd);
      const counts = await Promise.all(Array.from({ length: qd }, async (_, k) => {
        const buf = new Uint8Array(memory.buffer, k * block, block);
        const state = { s: BigInt(seed) * 1000003n + BigInt(k) };
        let total = 0;
        for (let i = 0; i < per; i++) {
          const off = Number(splitmix64(state) % slots) * PAGE;
          for (let done = 0; done < block;) {
            const { bytesRead } = await handle.read(buf, done, block - done, off + done);
            if (bytesRead <= 0) break;
            done += bytesRead;
            total += bytesRead;
          }
        }
        return total;
      }));
      return counts.reduce((a, b) => a + b, 0) / ((performance.now() - t0) / 1000);
    } finally {
      await handle.close();
    }
  };
  if (O_DIRECT !== undefined) {
    try {
      return { bytes_per_s: await attempt(true), direct: true };
    } catch (err) {
      if (!["EINVAL", "EOPNOTSUPP", "ENOTSUP"].includes((err as NodeJS.ErrnoException).code ?? "")) throw err;
    }
  }
  return { bytes_per_s: await attempt(false), direct: false };
}

// ---- the limits of a run --------------------------------------------------------------------

interface MeasureOptions {
  model: string;
  /** one routed expert's data bytes: the block of the direct-read measurement */
  extent: number;
  threads: number;
  dropCaches: boolean;
  /** a membw binary to use (--membw); absent: build bench/membw.c */
  membw?: string | undefined;
  /** DRAM buffer of the measurement (tests make it small); default 1 GiB */
  dramBytes?: number;
  /** direct reads per queue depth; default 64 */
  reads?: number;
  /** skip membw (tests of the Node fallback) */
  nodeOnly?: boolean;
}

/**
 * The start-of-run limits without --limits: DRAM (1 GiB, best of 3, 1 thread and `threads`),
 * direct reads of experts.bin (extent-sized, queue depth 1 and 2, 64 reads), FMA (membw only).
 */
export async function measureLimits(o: MeasureOptions): Promise<Limits> {
  // bench/membw.c is built for this run only, in a folder removed when it ends (also on error)
  const scratch = o.nodeOnly || o.membw ? null : mkdtempSync(join(tmpdir(), "kvl-membw-"));
  try {
    return await measure(o, scratch);
  } finally {
    if (scratch !== null) rmSync(scratch, { recursive: true, force: true });
  }
}

async function measure(o: MeasureOptions, scratch: string | null): Promise<Limits> {
  const dramBytes = o.dramBytes ?? 1 << 30;
  const reads = o.reads ?? 64;
  const experts = join(o.model, "experts.bin");
  if (!existsSync(experts)) throw new UserError(`${experts} is missing; rerun kvl pack`);
  const block = readBlock(experts, o.extent);
  const threadCounts = [...new Set([1, o.threads])].sort((a, b) => a - b);
  const rows: Row[] = [];
  const notes: string[] = [];

  let membw: string | null = null;
  let membwWhat = "";
  if (!o.nodeOnly) {
    if (o.membw) {
      membw = o.membw;
      membwWhat = `membw ${o.membw} (--membw)`;
    } else if (scratch !== null) {
      const built = membwBinary(scratch);
      if ("path" in built) {
        membw = built.path;
        membwWhat = `membw (bench/membw.c built with ${built.compiler})`;
      } else {
        notes.push(built.error);
      }
    }
  }

  // DRAM
  let dramFrom = "";
  if (membw) {
    const avx512 = readCpuInfo().flags?.includes("avx512f") ?? false;
    const runs = threadCounts.map((t) => ["dram", String(dramBytes / MIB), String(t), "3", "avx2"]);
    if (avx512) runs.push(["dram", String(dramBytes / MIB), String(o.threads), "3", "avx512"]);
    for (const argv of runs) {
      const r = runMembw(membw, argv);
      if ("error" in r) {
        notes.push(`membw ${argv.join(" ")} failed: ${r.error}`);
        break;
      }
      rows.push(...r.rows.map((row) => ({ ...row, impl: "membw" })));
    }
    if (rows.some((r) => r.mode === "dram" && num(r.best_bytes_per_s) !== null)) dramFrom = "membw";
  }
  if (!dramFrom) {
    for (const t of threadCounts) {
      rows.push({ mode: "dram", impl: "node", threads: t, bytes: dramBytes, best_bytes_per_s: await nodeDramRead(dramBytes, t, 3) });
    }
    dramFrom = "Node worker threads (memchr via Buffer.indexOf)";
  }

  // direct reads
  let ssdFrom = "";
  const qds = [1, 2];
  if (membw) {
    for (const qd of qds) {
      if (o.dropCaches) dropPageCache();
      const r = runMembw(membw, ["ssd", experts, String(block), String(qd), String(reads), String(qd)]);
      if ("error" in r) {
        notes.push(`membw ssd failed: ${r.error}`);
        break;
      }
      rows.push(...r.rows.map((row) => ({ ...row, impl: "membw" })));
    }
    if (rows.some((r) => r.mode === "ssd" && num(r.bytes_per_s) !== null)) ssdFrom = "membw";
  }
  if (!ssdFrom) {
    let direct = true;
    for (const qd of qds) {
      if (o.dropCaches) dropPageCache();
      const r = await nodeDirectRead(experts, block, qd, reads, qd);
      direct &&= r.direct;
      rows.push({ mode: "ssd", impl: "node", qd, block, reads, direct: r.direct, bytes_per_s: r.bytes_per_s });
    }
    ssdFrom = direct ? "Node fs reads with O_DIRECT" : "Node fs reads, BUFFERED (the filesystem refused O_DIRECT: the page cache may inflate it)";
  }

  // FMA peak (membw only)
  let fma: number | null = null;
  if (membw) {
    const r = runMembw(membw, ["fma", String(o.threads), "1"]);
    if ("error" in r) notes.push(`membw fma failed: ${r.error}`);
    else rows.push(...r.rows.map((row) => ({ ...row, impl: "membw" })));
    const peaks = rows.filter((x) => x.mode === "fma").map((x) => num(x.flops_per_s)).filter((v): v is number => v !== null);
    if (peaks.length) fma = Math.max(...peaks);
  }

  const best = (mode: string, key: string): number =>
    Math.max(...rows.filter((r) => r.mode === mode).map((r) => num(r[key])).filter((v): v is number => v !== null));
  const parts = dramFrom === "membw" && ssdFrom === "membw"
    ? `measured here by ${membwWhat}`
    : `measured here: DRAM by ${dramFrom === "membw" ? membwWhat : dramFrom}, direct reads by ${ssdFrom === "membw" ? membwWhat : ssdFrom}` +
      (fma === null ? ", no FMA peak" : "");
  return {
    dram_bytes_per_s: best("dram", "best_bytes_per_s"),
    ssd_bytes_per_s: best("ssd", "bytes_per_s"),
    fma_flops_per_s: fma,
    source: notes.length ? `${parts} (${notes.join("; ")})` : parts,
    detail: rows,
  };
}

