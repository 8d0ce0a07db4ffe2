/**
 * low-ram-table.ts — the table of bench/low-ram.sh's run (issue 38 items 3 and 5): per memory
 * cap, expert dtype, backend and routing, what kvl reached against what the disk allows.
 *
 *   npx vite-node bench/low-ram-table.ts OUT      (OUT: bench/low-ram.sh's folder)
 *
 * Bound per run: the cache's extents C of N (the engine's slab: the run's own plan, with the
 * image lines' loan natively when vision is reserved), its hit rate h, then
 *   disk s/token = (1 - h) x (MoE layers x top-k) x the padded extent / the direct-read rate
 * (the row's NAME.disk.jsonl: the mean of the probes low-ram.sh ran just before and after it, 2 MiB
 * pieces at queue depth 4, the figure kvl bench divides by; limits.jsonl's where a row has none),
 * and compute = the
 * same pack and backend's all-in-RAM warm decode (median s/token) of this run. h: uniform C / N
 * (no policy beats it); the calibrated trace: bench/routing-trace.ts simulatePolicy of the
 * run's cache policy (the default adaptive, or the policy the row names) on the replayed trace with exactly C (the policy alone: no pins or
 * read-ahead); the model's own routing has no bound here (its trace is the run's, not known
 * ahead). The bound of the issue (item 5) is serial = disk + compute: a layer's misses are known
 * only once it routes, so under routing nothing predicts (uniform, a trace) its reads cannot
 * start earlier; overlapped = max(disk, compute) is the floor no engine passes. Ratios: kvl's
 * warm decode median over each.
 */
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";

import { loadLimits } from "../host/bench/bench-limits.js";
import { readTrace } from "../host/bench/bench-routing.js";
import { simulatePolicy } from "./routing-trace.js";

interface Decode {
  tokens: number;
  s_per_token_median: number;
  ssd_bytes_per_token: number;
  expert_hit_rate: number;
  expert_stall_share: number;
  expert_lookahead?: { issued: number; used: number; wasted: number };
}
interface Run {
  backend: string;
  routing: string;
  cache_policy: string;
  plan: string;
  info: { expert_extent_bytes: number; expert_cache_bytes: number };
  decode_warm?: Decode;
  peak_rss_bytes?: number;
  plan_total_bytes: number;
}
interface Bench {
  runs: Run[];
}

const out = process.argv[2];
if (!out) throw new Error("usage: low-ram-table.ts OUT");
const load = (name: string): Run[] => {
  const file = join(out, `${name}.json`);
  return existsSync(file) ? (JSON.parse(readFileSync(file, "utf8")) as Bench).runs : [];
};
/** The direct-read rates (bytes/s) probed around row `name`, in order (empty without probes). */
const probes = (name: string): number[] => {
  const file = join(out, `${name}.disk.jsonl`);
  if (!existsSync(file)) return [];
  return readFileSync(file, "utf8").split("\n").filter((l) => l.trim())
    .map((l) => JSON.parse(l) as { mode?: string; bytes_per_s?: number })
    .filter((r) => r.mode === "ssd" && typeof r.bytes_per_s === "number").map((r) => r.bytes_per_s as number);
};
const limits = loadLimits(join(out, "limits.jsonl"));
const trace = readTrace(join(out, "calibrated.jsonl"));
const h = trace.header;
const M = h.moe_layers.length;
const K = h.topk;
const E = h.n_routed;
const N = M * E;
const PAGE = 4096;
const f = (x: number | undefined, n = 3): string => (x === undefined || !Number.isFinite(x) ? "-" : x.toFixed(n));
const pct = (x: number): string => `${(100 * x).toFixed(1)} %`;

const rows = [
  "| cap | experts | backend | extents cached | routing | hit rate (bound's) | GB read a token | disk wait, % of step | read ahead used / issued a token | kvl s/token | compute (in RAM) | direct reads before / after, GB/s | disk at that rate | bound: serial sum (item 5) / overlapped max | kvl / bound (serial / overlapped) | peak RSS / plan GiB |",
  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
];
for (const cap of ["4352M", "8448M"]) {
  for (const backend of ["native", "wasm"]) {
    for (const dtype of ["q8", "q4"]) {
      const names = ["model", "calibrated", "uniform", "policies", "textonly"].map((r) => `cap${cap}-${dtype}-${backend}-${r}`);
      const runs = names.flatMap((name) => load(name).map((run) => ({ run, rates: probes(name), textOnly: name.endsWith("-textonly") })));
      if (runs.length === 0) continue;
      const inRam = load(`ram-${dtype}`).find((r) => r.backend === backend)?.decode_warm?.s_per_token_median ?? Number.NaN;
      for (const { run, rates, textOnly } of runs) {
        const d = run.decode_warm;
        if (!d) continue;
        const padded = Math.ceil(run.info.expert_extent_bytes / PAGE) * PAGE;
        // the engine's slab: the plan's own extents and, natively with vision, the image lines' loan
        const C = Math.floor(run.info.expert_cache_bytes / padded);
        const kind = run.routing === "model" ? "model" : run.routing === "uniform" ? "uniform" : "calibrated";
        const policy = run.cache_policy as "lru" | "frequency" | "adaptive";
        const hit = kind === "uniform" ? C / N : kind === "calibrated" ? simulatePolicy(trace.ids, M, E, K, C, policy, 64) : Number.NaN;
        const rate = rates.length ? rates.reduce((a, b) => a + b, 0) / rates.length : limits.ssd_bytes_per_s;
        const disk = ((1 - hit) * M * K * padded) / rate;
        const floor = Math.max(disk, inRam);
        const la = d.expert_lookahead;
        rows.push(`| ${cap.replace("4352M", "4 GiB").replace("8448M", "8 GiB")} + 256 MiB | ${dtype} | ${backend} | ${C} (${pct(C / N)}) | ${kind}${run.cache_policy === "adaptive" ? "" : `, ${run.cache_policy}`}${textOnly ? ", chat --no-vision plan" : ""} | ` +
          `${pct(d.expert_hit_rate)} (${Number.isFinite(hit) ? pct(hit) : "-"}) | ${f(d.ssd_bytes_per_token / 1e9)} | ${(100 * d.expert_stall_share).toFixed(0)} % | ` +
          `${la ? `${f(la.used / d.tokens, 1)} / ${f(la.issued / d.tokens, 1)}` : "-"} | ${f(d.s_per_token_median)} | ${f(inRam)} | ` +
          `${rates.length ? rates.map((r) => f(r / 1e9, 2)).join(" / ") : `${f(limits.ssd_bytes_per_s / 1e9, 2)} (limits)`} | ${f(disk)} | ` +
          `${f(disk + inRam)} / ${f(floor)} | ${Number.isFinite(hit) ? `${f(d.s_per_token_median / (disk + inRam), 2)}x / ${f(d.s_per_token_median / floor, 2)}x` : "-"} | ` +
          `${run.peak_rss_bytes ? (run.peak_rss_bytes / 2 ** 30).toFixed(2) : "-"} / ${(run.plan_total_bytes / 2 ** 30).toFixed(2)} |`);
      }
    }
  }
}
process.stdout.write(`direct read at the start ${(limits.ssd_bytes_per_s / 1e9).toFixed(2)} GB/s (${limits.source}); ${N} extents, ${M} MoE layers x top-${K}\n\n${rows.join("\n")}\n`);
