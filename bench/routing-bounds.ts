/**
 * routing-bounds.ts — the decode speed the disk allows under each routing, per RAM budget and
 * expert dtype (issue 38 item 5): s/token >= (bytes missed per token) / (direct-read rate), plus
 * the compute of a token when reads and compute do not overlap.
 *
 *   npx vite-node bench/routing-bounds.ts PACK LIMITS.jsonl --compute-q8 S --compute-q4 S
 *       [--trace NAME=FILE ...] [--ram 4096,8192] [--backend native|wasm] [--act-dtype i16x1] [--max-context 4096]
 *
 * Per budget: the RAM plan of PACK (host/plan/planner.ts, as kvl bench plans it) gives the expert
 * cache's bytes; Q8 extents are PACK's, Q4 extents kvl_expert_q4_extent_bytes of the same shape
 * (a Q4 pack's plan differs only in the slot size: trunk and KV are the same). Resident extents
 * C of all N; a token reads K extents in each of the M MoE layers. Hit rates:
 *   - uniform: C / N, the most any policy can hit when picks are independent of the past;
 *   - each trace: the plain-LRU, frequency and adaptive (default) policies' hit rates simulated on it with exactly C
 *     (bench/routing-trace.ts simulatePolicy: the policy alone, no pins or read-ahead).
 * Missed bytes a token = (1 - hit) x M x K x the padded extent; the read rate is the limits
 * file's direct read (what kvl bench divides by). `serial` adds compute (no overlap), `overlap`
 * takes the larger of the two (perfect overlap, the floor). --compute-q8/-q4: the measured
 * in-RAM decode s/token (all hits), e.g. bench/RESULTS.md's.
 */
import { loadLimits } from "../host/bench/bench-limits.js";
import type { BackendName } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { readPackFacts } from "../host/plan/core-bytes.js";
import { planFromFacts } from "../host/plan/planner.js";
import type { ActDtype } from "../host/core/core-api.js";
import { readTrace } from "../host/bench/bench-routing.js";
import { simulatePolicy } from "./routing-trace.js";

const PAGE = 4096;
const GB = 1e9;

function main(argv: string[]): void {
  const [pack, limitsFile, ...rest] = argv;
  if (!pack || !limitsFile) throw new Error("usage: routing-bounds.ts PACK LIMITS.jsonl --compute-q8 S --compute-q4 S [--trace NAME=FILE ...]");
  const traces: Array<[string, string]> = [];
  let ram = [4096, 8192];
  let backend: BackendName = "native";
  let act: ActDtype = "i16x1";
  let maxContext = 4096;
  const compute: Record<"q8" | "q4", number> = { q8: NaN, q4: NaN };
  for (let i = 0; i < rest.length; i += 2) {
    const [k, v] = [rest[i]!, rest[i + 1]!];
    if (k === "--trace") traces.push(v.split("=", 2) as [string, string]);
    else if (k === "--ram") ram = v.split(",").map(Number);
    else if (k === "--backend") backend = v as BackendName;
    else if (k === "--act-dtype") act = v as ActDtype;
    else if (k === "--max-context") maxContext = Number(v);
    else if (k === "--compute-q8") compute.q8 = Number(v);
    else if (k === "--compute-q4") compute.q4 = Number(v);
    else throw new Error(`unknown flag ${k}`);
  }
  return void run(pack, limitsFile, traces, ram, backend, act, maxContext, compute);
}

async function run(pack: string, limitsFile: string, traces: Array<[string, string]>, ram: number[], backend: BackendName, act: ActDtype,
  maxContext: number, compute: Record<"q8" | "q4", number>): Promise<void> {
  const limits = loadLimits(limitsFile);
  const facts = await readPackFacts(pack);
  const hp = facts.hparams;
  const I = hp.get("text.moe_intermediate_size")!;
  const H = hp.get("text.hidden_size")!;
  const K = hp.get("text.num_experts_per_tok")!;
  const core = new NativeBackend();
  const q4Bytes = core.expertQ4ExtentBytes(I, H);
  const loaded = traces.map(([name, file]) => ({ name, trace: readTrace(file) }));
  const N = facts.expertRecords;
  const M = N / hp.get("text.n_routed_experts")!;
  const E = hp.get("text.n_routed_experts")!;
  process.stdout.write(`direct read ${(limits.ssd_bytes_per_s / GB).toFixed(2)} GB/s (${limits.source}); ${N} extents, ${M} MoE layers x top-${K}; ` +
    `compute in RAM q8 ${compute.q8} s, q4 ${compute.q4} s; plan: ${backend}, --act-dtype ${act}, max context ${maxContext}\n\n`);
  const rows = ["| budget | experts | extents cached (of " + N + ") | routing | hit rate | GB missed a token | disk s/token | bound: overlapped (max) | bound: serial (sum) |",
    "|---|---|---|---|---|---|---|---|---|"];
  for (const mib of ram) {
    for (const dtype of ["q8", "q4"] as const) {
      const nbytes = dtype === "q8" ? facts.expertNbytes : q4Bytes;
      const padded = Math.ceil(nbytes / PAGE) * PAGE;
      const p = planFromFacts({ ...facts, expertNbytes: nbytes }, { backend, ramMib: mib, loadVision: false, actDtype: act, threads: 2, maxContext, maxBatch: Math.min(maxContext, 256), check: true });
      const C = p.expertExtentsCached;
      const modes: Array<[string, number]> = [["uniform (C/N, no policy beats it)", C / N]];
      for (const { name, trace } of loaded) {
        modes.push([`${name}, LRU`, simulatePolicy(trace.ids, M, E, K, C, "lru", 64)]);
        modes.push([`${name}, frequency`, simulatePolicy(trace.ids, M, E, K, C, "frequency", 64)]);
        modes.push([`${name}, adaptive (default policy)`, simulatePolicy(trace.ids, M, E, K, C, "adaptive", 64)]);
      }
      for (const [label, hit] of modes) {
        const missed = (1 - hit) * M * K * padded;
        const disk = missed / limits.ssd_bytes_per_s;
        rows.push(`| ${mib} MiB | ${dtype} | ${C} (${((100 * C) / N).toFixed(1)} %) | ${label} | ${(100 * hit).toFixed(1)} % | ${(missed / GB).toFixed(3)} | ` +
          `${disk.toFixed(3)} | ${Math.max(disk, compute[dtype]).toFixed(3)} | ${(disk + compute[dtype]).toFixed(3)} |`);
      }
    }
  }
  process.stdout.write(`${rows.join("\n")}\n`);
  core.close();
}

main(process.argv.slice(2));
