/**
 * `kvl bench --routing` and `--routing-out` (host/bench/bench-routing.ts) and the trace generator
 * and statistics (bench/routing-trace.ts):
 *   - as a user runs it (child process over dist/, a tiny pack, native, WebAssembly and a split
 *     into two instances): --routing-out records the model's routing, and replaying it with
 *     trace:FILE decodes the same tokens; uniform and trace runs are flagged in --json and the
 *     side-by-side table; a malformed trace is one error line naming the file and line;
 *   - the trace reader refuses each kind of malformed file with FILE:LINE, and reads back what the
 *     recorder writes (weights as the same FP32 values);
 *   - the statistics on traces whose figures follow by hand, and the generator's defaults against
 *     the published figures they are calibrated to (reuse at distance 1 ~45 %, within 8 tokens
 *     ~80 %, top 1/8 of experts ~40 % of picks: bench/routing-trace.ts [R1], [R4]).
 * Timing is never asserted.
 */
import { spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { RoutingRecorder, parseRoutingList, parseTrace } from "../host/bench/bench-routing.js";
import { UserError } from "../host/system/user-error.js";
import { packageRoot } from "../host/system/paths.js";
import { DEFAULT_PARAMS, KIMI_SHAPE, generateTrace, simulatePolicy, traceStats } from "../bench/routing-trace.js";
import { nativeBuilt } from "./helpers.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");
const RUNS: Array<{ backend: "native" | "wasm"; instances: number }> = [
  ...(nativeBuilt ? [{ backend: "native" as const, instances: 1 }] : []),
  { backend: "wasm", instances: 1 },
  { backend: "wasm", instances: 2 },
];

let tmp: { dir: string; cleanup: () => void };
let pack = "";
let limitsFile = "";

beforeAll(async () => {
  tmp = tempDir("bench-routing");
  pack = (await tinyPack(tmp.dir)).pack;
  limitsFile = join(tmp.dir, "limits.jsonl");
  writeFileSync(limitsFile, `${JSON.stringify({ mode: "dram", best_bytes_per_s: 10e9 })}\n${JSON.stringify({ mode: "ssd", bytes_per_s: 1e9 })}\n`);
}, 300_000);

afterAll(() => tmp?.cleanup());

function bench(args: string[]) {
  const env = { ...process.env };
  delete env.KVL_BACKEND;
  delete env.KVL_INSTANCES;
  const r = spawnSync(process.execPath, [KVL, "bench", pack, "--limits", limitsFile, "--prompt-lens", "5", "--decode-tokens", "6", "--cache-mib", "1", ...args],
    { encoding: "utf8", env, timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe.each(RUNS)("kvl bench --routing on $backend, $instances instance(s)", ({ backend, instances }) => {
  const where = ["--backend", backend, "--instances", String(instances)];

  it("--routing-out then trace:FILE decodes the model's tokens; overridden runs are flagged", () => {
    const file = join(tmp.dir, `routing-${backend}-${instances}.jsonl`);
    const first = bench([...where, "--routing", "model,uniform", "--routing-out", file, "--json"]);
    expect(first.status, first.stderr).toBe(0);
    const rec = JSON.parse(first.stdout);
    expect(rec.settings.routing).toEqual(["model", "uniform"]);
    const [model, uniform] = rec.runs;
    expect([model.routing, model.routing_overridden, model.routing_note]).toEqual(["model", false, undefined]);
    expect([uniform.routing, uniform.routing_overridden, uniform.routing_note]).toEqual(["uniform", true, "routing overridden: tokens are not the model's"]);
    // the prompt's 5 tokens and the 6 decoded ones, one line each after the header
    const lines = readFileSync(file, "utf8").trimEnd().split("\n");
    expect(lines.length).toBe(1 + 5 + 6);
    const second = bench([...where, "--routing", `trace:${file}`, "--json"]);
    expect(second.status, second.stderr).toBe(0);
    const replay = JSON.parse(second.stdout).runs[0];
    expect([replay.routing, replay.routing_overridden, replay.trace_tokens_used, replay.trace_wrapped]).toEqual([`trace:${file}`, true, 11, false]);
    expect(replay.decode_after_cold.token_ids).toEqual(model.decode_after_cold.token_ids);
    expect(replay.cold_prompt.first_token).toBe(model.cold_prompt.first_token);
    expect(uniform.decode_after_cold.token_ids).not.toEqual(model.decode_after_cold.token_ids);
  });

  it("--cache-policy runs each policy; none changes a token", () => {
    const r = bench([...where, "--routing", "model", "--cache-policy", "lru,adaptive,frequency", "--json"]);
    expect(r.status, r.stderr).toBe(0);
    const rec = JSON.parse(r.stdout);
    expect(rec.settings.cache_policy).toEqual(["lru", "adaptive", "frequency"]);
    expect(rec.runs.map((run: { cache_policy: string }) => run.cache_policy)).toEqual(["lru", "adaptive", "frequency"]);
    const [lru, adaptive, frequency] = rec.runs;
    expect(adaptive.decode_after_cold.token_ids).toEqual(lru.decode_after_cold.token_ids);
    expect(frequency.decode_after_cold.token_ids).toEqual(lru.decode_after_cold.token_ids);
  });
});

describe("kvl bench --routing as text and its errors", () => {
  it("prints the side-by-side table with the flag", () => {
    const r = bench(["--routing", "model,uniform"]);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toContain("routing uniform: routing overridden: tokens are not the model's");
    const table = r.stdout.slice(r.stdout.indexOf("routing side by side"));
    expect(table).toMatch(/hit rate\s+SSD GB\/token\s+disk wait % of step\s+read ahead used \/ wasted per token\s+s\/token/);
    expect(table).toMatch(/\n\s*\S+\s+5\s+model\s+adaptive\s+after cold/);
    expect(table).toMatch(/\n\s*\S+\s+5\s+uniform \*\s+adaptive\s+after cold/);
  });

  it("a malformed trace, a trace of another shape, a bad list: one line each", () => {
    const bad = join(tmp.dir, "bad.jsonl");
    writeFileSync(bad, '{"kvl_routing":1,"n_layers":4,"n_routed":8,"topk":2,"moe_layers":[1,2,3]}\n{"ids":[[0,1],[2,3],[4,5]]}\n{"ids":[[0,1],[2,3],[4]]}\n');
    let r = bench(["--routing", `trace:${bad}`]);
    expect(r.status).toBe(1);
    expect(r.stderr.trim().split("\n")).toEqual([`kvl bench: error: ${bad}:3: "ids" must hold 3 arrays (one per MoE layer) of 2 values (kvl routing trace: docs in host/bench/bench-routing.ts)`]);
    const other = join(tmp.dir, "other.jsonl");
    writeFileSync(other, '{"kvl_routing":1,"n_layers":5,"n_routed":8,"topk":2,"moe_layers":[1,2,3]}\n{"ids":[[0,1],[2,3],[4,5]]}\n');
    r = bench(["--routing", `trace:${other}`]);
    expect(r.status).toBe(1);
    expect(r.stderr).toContain(`${other}:1: the trace is for n_layers 5`);
    r = bench(["--routing", "model,random"]);
    expect(r.status).toBe(1);
    expect(r.stderr).toContain('"random" is not model, uniform or trace:FILE');
    r = bench(["--cache-policy", "lru,clock"]);
    expect(r.status).toBe(1);
    expect(r.stderr.trim()).toBe('kvl bench: error: --cache-policy "lru,clock": "clock" is not adaptive, frequency, lru');
    r = bench(["--cache-policy", "lru,lru"]);
    expect(r.status).toBe(1);
    expect(r.stderr.trim()).toBe('kvl bench: error: --cache-policy "lru,lru" names lru twice');
    r = bench(["--routing", "uniform", "--routing-out", join(tmp.dir, "x.jsonl")]);
    expect(r.status).toBe(1);
    expect(r.stderr).toContain("--routing must include model");
  });
});

describe("the trace format", () => {
  const HEADER = '{"kvl_routing":1,"n_layers":3,"n_routed":4,"topk":2,"moe_layers":[1,2]}';
  const cases: Array<[string, string, RegExp]> = [
    ["", "t:1: empty file", /t:1: empty file/],
    ["{", "t:1: not JSON", /t:1: not JSON/],
    ['{"kvl_routing":2}', "t:1: header", /t:1: the header must be an object with "kvl_routing": 1/],
    ['{"kvl_routing":1,"n_layers":3,"n_routed":4,"topk":2,"moe_layers":[2,1]}\n{}', "t:1: moe_layers", /t:1: header "moe_layers" must be increasing/],
    ['{"kvl_routing":1,"n_layers":3,"n_routed":4,"topk":5,"moe_layers":[1]}\n{}', "t:1: topk", /t:1: header "topk" 5 exceeds "n_routed" 4/],
    [HEADER, "t:2: no tokens", /t:2: no token lines/],
    [`${HEADER}\n{"ids":[[0,1],[2,3]]}\n[1]`, "t:3: not an object", /t:3: a token line must be an object/],
    [`${HEADER}\n{"ids":[[0,1],[2,4]]}`, "t:2: id range", /t:2: ids\[1\]\[1\] = 4 is not an expert id in \[0, 4\)/],
    [`${HEADER}\n{"ids":[[0,1],[2,2]]}`, "t:2: twice", /t:2: ids\[1\] names expert 2 twice/],
    [`${HEADER}\n{"ids":[[0,1],[2,3]],"w":[[1,2],[3,"x"]]}`, "t:2: weight", /t:2: w\[1\]\[1\] = "x" is not a finite number/],
  ];
  it.each(cases)("refuses %j (%s)", (text, _label, message) => {
    expect(() => parseTrace(text, "t")).toThrow(UserError);
    expect(() => parseTrace(text, "t")).toThrow(message);
  });

  it("reads back what the recorder writes, weights as the same FP32 values", () => {
    const dims = { n_layers: 3, n_routed: 4, top_k: 2, moe_layers: [1, 2] };
    const rec = new RoutingRecorder(dims, "test");
    const weights = Float32Array.of(0.1, 0.7, 1 / 3, 2.5e-8, 1e30, -0.5);
    // rows [capacity 1][n_layers 3][topk 2]; layer 0 is dense and not written
    rec.taken(0, 1, { ids: Int32Array.of(9, 9, 3, 0, 1, 2), weights }, 0, 3);
    rec.endSession();
    const file = join(tmp.dir, "roundtrip.jsonl");
    rec.write(file);
    const trace = parseTrace(readFileSync(file, "utf8"), file);
    expect(trace.tokens).toBe(1);
    expect([...trace.ids]).toEqual([3, 0, 1, 2]);
    expect(Buffer.from(trace.weights.buffer).equals(Buffer.from(weights.slice(2).buffer))).toBe(true);
  });

  it("parses --routing lists", () => {
    expect(parseRoutingList("model,uniform,trace:a.jsonl")).toEqual([{ kind: "model" }, { kind: "uniform" }, { kind: "trace", file: "a.jsonl" }]);
    expect(() => parseRoutingList("model,model")).toThrow(/names a mode twice/);
    expect(() => parseRoutingList("trace:")).toThrow(/is not model, uniform or trace:FILE/);
  });
});

describe("trace statistics and the generator", () => {
  /** ids [tokens][M][K] from per-token rows */
  const trace = (rows: number[][][]): Int32Array => Int32Array.from(rows.flat(2));

  it("reuse on traces whose figures follow by hand", () => {
    // one layer, top-2 of 4: the same pair every token -> every later pick repeats at distance 1
    const same = traceStats(trace(Array.from({ length: 20 }, () => [[0, 1]])), 1, 4, 2, []);
    expect([same.reuse1, same.reuse8]).toEqual([1, 1]);
    // alternating disjoint pairs -> nothing repeats at distance 1, everything within 8
    const alt = traceStats(trace(Array.from({ length: 20 }, (_, t) => [t % 2 ? [2, 3] : [0, 1]])), 1, 4, 2, []);
    expect([alt.reuse1, alt.reuse8]).toEqual([0, 1]);
    // top 1/8 of 8 experts is one expert: expert 0 in every token, the other pick rotating over 1..7 -> 1/2
    const pop = traceStats(trace(Array.from({ length: 70 }, (_, t) => [[0, 1 + (t % 7)]])), 1, 8, 2, []);
    expect(pop.top8th).toBe(0.5);
  });

  it("policy simulation: a cycle longer than the cache defeats LRU, not frequency", () => {
    // one layer, top-1 of 4 experts, cycling 0,1,2,3 with capacity 3: LRU always evicts the next
    // one needed (0 hits); with capacity for all 4 every access after the warm-up hits
    const cycle = trace(Array.from({ length: 400 }, (_, t) => [[t % 4]]));
    expect(simulatePolicy(cycle, 1, 4, 1, 3, "lru", 8)).toBe(0);
    expect(simulatePolicy(cycle, 1, 4, 1, 4, "lru", 8)).toBe(1);
    // 0 every third token, 1,2,3 in turn between: 0,1,2,0,3,1,0,2,3,... with capacity 2. LRU
    // evicts 0 before each return (two others came since): 0 hits. Frequency keeps 0 (the most
    // used) and evicts the other, which never comes next: the zeros hit, tokens 9, 12, ..., 399
    // of the 392 counted after the warm-up of 8
    const skewed = trace(Array.from({ length: 400 }, (_, t) => [[t % 3 === 0 ? 0 : 1 + ((t - Math.floor(t / 3) - 1) % 3)]]));
    expect(simulatePolicy(skewed, 1, 4, 1, 2, "lru", 8)).toBe(0);
    expect(simulatePolicy(skewed, 1, 4, 1, 2, "frequency", 8)).toBe(131 / 392);
    // adaptive: the LRU shadow never hits here, the frequency one does, so it evicts by frequency
    expect(simulatePolicy(skewed, 1, 4, 1, 2, "adaptive", 8)).toBe(131 / 392);
  });

  it("policy simulation: adaptive follows the better rule at each size, on calibrated and uniform routing", () => {
    const M = KIMI_SHAPE.moeLayers.length;
    const E = KIMI_SHAPE.nRouted;
    const K = KIMI_SHAPE.topk;
    const calibrated = generateTrace(KIMI_SHAPE, { ...DEFAULT_PARAMS, tokens: 600 });
    const uniform = generateTrace(KIMI_SHAPE, { ...DEFAULT_PARAMS, tokens: 600, zipf: 0, keep: 0, recall: 0, cross: 0 });
    for (const [ids, fraction] of [[calibrated, 0.06], [calibrated, 0.18], [uniform, 0.18]] as const) {
      const capacity = Math.round(fraction * M * E);
      const [lru, frequency, adaptive] = (["lru", "frequency", "adaptive"] as const).map((p) => simulatePolicy(ids, M, E, K, capacity, p, 64));
      expect(adaptive, `${fraction}: lru ${lru}, frequency ${frequency}`).toBeGreaterThanOrEqual(Math.max(lru!, frequency!) - 0.01);
    }
  });

  it("the defaults meet the published figures they are calibrated to", () => {
    const M = KIMI_SHAPE.moeLayers.length;
    const ids = generateTrace(KIMI_SHAPE, { ...DEFAULT_PARAMS, tokens: 1500 });
    // every row holds K distinct expert ids
    for (let r = 0; r < ids.length / 6; r++) expect(new Set(ids.subarray(r * 6, r * 6 + 6)).size).toBe(6);
    const s = traceStats(ids, M, 64, 6, []);
    expect(s.reuse1).toBeGreaterThan(0.4);
    expect(s.reuse1).toBeLessThan(0.5);
    expect(s.reuse8).toBeGreaterThan(0.75);
    expect(s.reuse8).toBeLessThan(0.85);
    expect(s.top8th).toBeGreaterThan(0.35);
    expect(s.top8th).toBeLessThan(0.45);
  });
});
