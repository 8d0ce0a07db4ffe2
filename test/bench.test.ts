/**
 * `kvl bench` (cli/bench.ts over host/bench/) on a tiny synthesized pack, on both backends:
 * the byte accounting the bounds rest on, checked against the pack's own index and against what
 * the engine read (ported from tests/test_bench.py), the CRC checks of first reads among them
 * (every trunk tensor at open, each distinct expert once: the bytes, from the index, that the
 * share of the decode step rests on); the --membw probes around each decode (a
 * stand-in membw script); `--backend both` and its native/wasm ratios; --act-dtype auto resolved per
 * backend for its kernel set; clear errors for bad
 * options; the prompts are the Python bench's; the Node fallback of the limits. Timing is never
 * asserted, only structure and bytes. The command runs as a user runs it, in a child process over
 * the compiled dist/ (dist/cli/kvl.js).
 */
import { spawnSync } from "node:child_process";
import { chmodSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { markdownReport } from "../cli/bench.js";
import { measureLimits, membwBinary, runMembw } from "../host/bench/bench-limits.js";
import { PAGE, packBytes } from "../host/bench/bench-model.js";
import { randomPrompt } from "../host/bench/bench-prompt.js";
import { PackReader } from "../host/pack/pack-format.js";
import { packageRoot } from "../host/system/paths.js";
import { nativeBuilt } from "./helpers.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");
const BACKENDS: Array<{ backend: "native" | "wasm"; instances: number }> = [
  ...(nativeBuilt ? [{ backend: "native" as const, instances: 1 }] : []),
  { backend: "wasm", instances: 1 },
  { backend: "wasm", instances: 2 },
];

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let limitsFile: string;
let outs = 0;

/** A parsed --json record (its shape is what these tests check). */
type Json = any;

function bench(args: string[]) {
  const env = { ...process.env };
  delete env.KVL_BACKEND;
  delete env.KVL_INSTANCES;
  const r = spawnSync(process.execPath, [KVL, "bench", ...args], { encoding: "utf8", env, timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

/** `kvl bench PACK ARGS --json --out F`: the record (the file and stdout must agree). */
function benchJson(args: string[]): Json {
  const out = join(tmp.dir, `bench-${outs++}.json`);
  const r = bench([pack, ...args, "--json", "--out", out]);
  expect(r.status, r.stderr).toBe(0);
  const result = JSON.parse(readFileSync(out, "utf8"));
  expect(JSON.parse(r.stdout)).toEqual(result);
  return result;
}

beforeAll(async () => {
  tmp = tempDir("bench");
  pack = (await tinyPack(tmp.dir)).pack;
  // fixed limits: these tests check bytes, never speed
  limitsFile = join(tmp.dir, "limits.jsonl");
  writeFileSync(limitsFile, `${JSON.stringify({ mode: "dram", best_bytes_per_s: 10e9 })}\n${JSON.stringify({ mode: "ssd", bytes_per_s: 1e9 })}\n`);
}, 300_000);

afterAll(() => tmp?.cleanup());

describe("byte accounting", () => {
  it("pack bytes match the index", async () => {
    const reader = await PackReader.open(pack);
    const trunk = reader.stores.get("trunk")!.records;
    const experts = reader.stores.get("experts")!.records;
    const pb = await packBytes(pack);
    const embed = trunk.find((r) => r.name.endsWith("embed_tokens.weight"))!;
    expect(pb.trunk_used).toBe(trunk.reduce((t, r) => t + r.nbytes, 0) - embed.nbytes);
    expect(pb.n_extents).toBe(experts.length);
    // every extent starts 4 KiB-aligned, so one padded extent is what a cache miss reads
    expect(experts.every((r) => r.offset % PAGE === 0)).toBe(true);
    expect(pb.extent_padded % PAGE).toBe(0);
    expect(pb.extent_padded - PAGE < pb.extent_data && pb.extent_data <= pb.extent_padded).toBe(true);
    expect(pb.n_moe_layers * reader.hparams.get("text.n_routed_experts")!).toBe(experts.length);
    expect(pb.embed_row * pb.vocab).toBe(embed.nbytes);
  });

  it("draws the Python bench's prompts (numpy default_rng(seed).integers)", () => {
    // kvl.bench.random_prompt(vocab, n, seed, avoid), recorded with numpy 2.4
    expect([...randomPrompt(163840, 12, 16, [88240])]).toEqual([88241, 92883, 134973, 70573, 125642, 15413, 86668, 57029, 2199, 101828, 76106, 3547]);
    expect([...randomPrompt(1000, 10, 0)]).toEqual([850, 636, 511, 269, 307, 40, 75, 16, 175, 813]);
    expect([...randomPrompt(163840, 5, 10000)]).toEqual([27266, 84654, 65697, 69418, 97829]);
    expect([...randomPrompt(7, 10, 2 ** 40 + 3)]).toEqual([5, 5, 3, 6, 2, 3, 2, 0, 5, 1]);
    expect([...randomPrompt(2 ** 31, 4, 5)]).toEqual([1440510676, 1728730615, 48647418, 1735039634]);
  });
});

describe.each(BACKENDS)("on $backend, $instances instance(s)", ({ backend, instances }) => {
  const common = ["--backend", backend, "--instances", String(instances), "--threads", "2"];

  it("a cold prompt reads each distinct expert once", async () => {
    // one chunk and a cache that holds every expert: nothing is evicted, so the bytes read must
    // be exactly (distinct experts) x (padded extent)
    const result = benchJson([...common, "--prompt-lens", "24", "--decode-tokens", "3", "--cache-mib", "64", "--ram-mib", "1024",
      "--limits", limitsFile]);
    const pb = await packBytes(pack);
    expect(result.backend).toBe(backend);
    expect(result.pack_bytes).toEqual(pb);
    expect(result.limits.source).toBe(limitsFile);
    expect(result.runs).toHaveLength(1);
    const run = result.runs[0];
    expect(run.backend).toBe(backend);
    expect(run.instances).toBeGreaterThanOrEqual(instances);
    const cold = run.cold_prompt;
    expect(cold.tokens).toBe(24);
    expect(cold.distinct_experts).toBeGreaterThan(0);
    expect(cold.distinct_experts).toBeLessThanOrEqual(pb.n_extents);
    expect(cold.expert_bytes_read).toBe(cold.distinct_experts * pb.extent_padded);
    expect(cold.bound_ssd_bytes).toBe(run.streamed_trunk_bytes + cold.distinct_experts * pb.extent_padded);
    const decode = run.decode_after_cold;
    expect(decode.tokens).toBe(3);
    expect(decode.context_start).toBe(24);
    // CRC checks of first reads: every trunk tensor at open (all resident here; each range reads
    // its own, the embedding the first, lm_head the last), then each extent read for the first
    // time (the cache holds them all, so every extent read is one) and nothing more
    const trunk = (await PackReader.open(pack)).stores.get("trunk")!.records;
    expect(run.streamed_trunk_bytes).toBe(0);
    expect(run.open_verify_bytes).toBe(trunk.reduce((n: number, r) => n + r.nbytes, 0));
    expect(cold.verify_bytes).toBe(cold.distinct_experts * pb.extent_data);
    expect(decode.verify_bytes_per_token * decode.tokens).toBe((decode.expert_bytes_read / pb.extent_padded) * pb.extent_data);
    expect(decode.verify_share).toBe((decode.verify_s_per_token * decode.tokens) / (decode.s_per_token_mean * decode.tokens));
    // the bound uses the fixed limits given above
    expect(decode.bound_ram_s).toBe(decode.ram_bytes_per_token / 10e9);
    expect(decode.bound_ssd_s).toBe(decode.ssd_bytes_per_token / 1e9);
    expect(decode.ratio).toBe(decode.s_per_token_mean / decode.bound_s);
    expect(decode).not.toHaveProperty("adjacent");
    // the wait for expert reads as a share of the step; the lookahead's counters (none: the cache
    // holds every extent, so the engines read nothing ahead)
    expect(decode.expert_stall_share).toBe(decode.expert_stall_s_per_token / decode.s_per_token_mean);
    expect(result.settings.expert_lookahead).toBe("auto");
    expect(run.info.expert_lookahead).toBe(false);
    expect(decode.expert_lookahead).toEqual({ issued: 0, used: 0, wasted: 0, cancelled: 0, pending: 0, hit_rate: null });
    expect(run.peak_rss_bytes).toBeGreaterThan(0);
    expect(run.peak_rss_over_plan).toBe(run.peak_rss_bytes / run.plan_total_bytes);
    expect(result.peak_rss_bytes).toBeGreaterThan(0);
    expect(result).not.toHaveProperty("native_over_wasm");
  });

  it("adjacent --membw probes bracket each decode", () => {
    // a stand-in for bench/membw.c: each call reports figures of its own and logs its arguments
    const dir = join(tmp.dir, `membw-${backend}-${instances}`);
    spawnSync("mkdir", ["-p", dir]);
    const membw = join(dir, "membw");
    writeFileSync(membw, `#!/bin/sh
n=$(( $(cat "${dir}/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "${dir}/count"
echo "$*" >> "${dir}/calls.log"
case "$1" in
  dram) echo '{"mode": "dram", "note": "a line before the last"}'; echo "{\\"mode\\": \\"dram\\", \\"best_bytes_per_s\\": $((n * 1000000000))}" ;;
  ssd) echo "{\\"mode\\": \\"ssd\\", \\"bytes_per_s\\": $((n * 100000000))}" ;;
  *) echo "stand-in membw: unexpected $1" >&2; exit 2 ;;
esac
`);
    chmodSync(membw, 0o755);
    const result = benchJson([...common, "--prompt-lens", "8", "--decode-tokens", "2", "--warm", "--warmup-tokens", "16",
      "--limits", limitsFile, "--membw", membw]);
    const calls = readFileSync(join(dir, "calls.log"), "utf8").trim().split("\n");
    // two decodes (after the cold prompt, warm), each with a probe before and after: dram then ssd
    expect(calls.map((c) => c.split(" ")[0])).toEqual(["dram", "ssd", "dram", "ssd", "dram", "ssd", "dram", "ssd"]);
    expect(calls[1]!.split(" ")[1]).toBe(join(pack, "experts.bin"));
    const run = result.runs[0];
    const probe = (k: number) => ({ dram_bytes_per_s: (2 * k + 1) * 1e9, ssd_bytes_per_s: (2 * k + 2) * 1e8 });
    for (const [key, first] of [["decode_after_cold", 0], ["decode_warm", 2]] as const) {
      const decode = run[key];
      const adj = decode.adjacent;
      expect(adj.before).toEqual(probe(first));
      expect(adj.after).toEqual(probe(first + 1));
      expect(adj.dram_bytes_per_s).toBe((adj.before.dram_bytes_per_s + adj.after.dram_bytes_per_s) / 2);
      expect(adj.ssd_bytes_per_s).toBe((adj.before.ssd_bytes_per_s + adj.after.ssd_bytes_per_s) / 2);
      expect(adj.bound_s).toBeGreaterThanOrEqual(decode.ram_bytes_per_token / adj.dram_bytes_per_s);
      expect(adj.ratio).toBe(decode.s_per_token_mean / adj.bound_s);
      expect(adj.ratio_median).toBe(decode.s_per_token_median / adj.bound_s);
    }
    // warm: the warm-up prompt filled the cache, so the same prompt reads nothing new
    expect(run.warm_prompt.expert_misses).toBe(0);
    expect(run.warm_prompt.distinct_experts).toBe(run.cold_prompt.distinct_experts);
  });
});

describe.skipIf(!nativeBuilt)("--backend both", () => {
  const args = ["--backend", "both", "--threads", "2", "--prompt-lens", "8", "--decode-tokens", "2", "--limits"];

  it("runs native then WebAssembly and reports native/wasm ratios of the runs' figures", () => {
    const result = benchJson([...args, limitsFile, "--warm", "--warmup-tokens", "16"]);
    expect(result.backend).toBe("both");
    expect(result.settings.backend).toBe("both");
    expect(result.runs.map((r: Json) => r.backend)).toEqual(["native", "wasm"]);
    const [n, w] = result.runs;
    // no --act-dtype: auto, per backend, for the kernel set each runs (vector kernels: i16x1);
    // act_mode names the set the engine reports (on WebAssembly simd128 or simd128-relaxed)
    expect(result.settings.act_dtype).toBe("auto");
    expect(["simd128", "simd128-relaxed"]).toContain(w.info.kernels);
    expect(result.runs.map((r: Json) => [r.backend, r.act_mode.chosen_by, r.act_mode.kernels, r.act_mode.act_dtype, r.info.act_dtype])).toEqual([
      ["native", "auto", n.info.kernels, n.info.kernels === "scalar" ? "f32" : "i16x1", n.info.kernels === "scalar" ? "f32" : "i16x1"],
      ["wasm", "auto", w.info.kernels, "i16x1", "i16x1"],
    ]);
    expect(n.cold_prompt.tokens).toBe(w.cold_prompt.tokens);
    expect(n.decode_after_cold.bound_s).toBeGreaterThan(0);
    const cmp = result.native_over_wasm;
    expect(cmp.prompts).toHaveLength(1);
    const c = cmp.prompts[0];
    expect(c.prompt_tokens).toBe(8);
    // what each side ran, beside the ratios
    expect(c.sides).toEqual({
      native: { act_dtype: n.act_mode.act_dtype, chosen_by: "auto", kernels: n.info.kernels },
      wasm: { act_dtype: "i16x1", chosen_by: "auto", kernels: w.info.kernels },
    });
    for (const phase of ["cold_prompt", "warm_prompt"]) {
      for (const f of ["first_token_s", "prefill_tokens_per_s", "ratio"]) expect(c[phase][f]).toBe(n[phase][f] / w[phase][f]);
    }
    for (const phase of ["decode_after_cold", "decode_warm"]) {
      for (const f of ["tokens_per_s", "s_per_token_mean", "s_per_token_median", "ratio"]) expect(c[phase][f]).toBe(n[phase][f] / w[phase][f]);
      expect(n[phase].tokens_per_s).toBe(1 / n[phase].s_per_token_mean);
    }
    expect(c.peak_rss_bytes).toBe(n.peak_rss_bytes / w.peak_rss_bytes);
    // bench/RESULTS.md's tables from --out records: one row per run and phase, the backend in the label
    const md = markdownReport([["A", result]]).split("\n");
    expect(md.filter((l) => /^\| A, (native|wasm) \((cold|warm)\) \| 8 \|/.test(l))).toHaveLength(4);
    expect(md.filter((l) => /^\| A, (native|wasm) \((after cold prompt|warm)\) \| 8\+2 \|/.test(l))).toHaveLength(4);
  });

  it("--kernels and --act-dtype reach every backend's engine (scalar, i16x1; scalar alone: auto's f32)", () => {
    const result = benchJson([...args, limitsFile, "--kernels", "scalar", "--act-dtype", "i16x1"]);
    expect(result.settings.kernels).toBe("scalar");
    expect(result.settings.act_dtype).toBe("i16x1");
    expect(result.runs.map((r: Json) => [r.backend, r.info.kernels, r.info.act_dtype, r.act_mode.chosen_by])).toEqual([
      ["native", "scalar", "i16x1", "option"], ["wasm", "scalar", "i16x1", "option"],
    ]);
    // without --act-dtype, scalar kernels keep the exact mode
    const auto = benchJson([...args, limitsFile, "--kernels", "scalar"]);
    expect(auto.runs.map((r: Json) => [r.backend, r.info.kernels, r.info.act_dtype, r.info.kv_dtype, r.act_mode.chosen_by])).toEqual([
      ["native", "scalar", "f32", "f32", "auto"], ["wasm", "scalar", "f32", "f32", "auto"],
    ]);
  });

  it("prints each run and the side-by-side table, with each side's mode and kernel set", () => {
    const r = bench([pack, ...args, limitsFile]);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^ +8 {2}Linear inputs, kernels +(i16x1|f32) \(auto\), [a-z0-9-]+ +i16x1 \(auto\), simd128(-relaxed)?$/m);
    expect(r.stdout).toMatch(/^== prompt 8 tokens \[native, 1 engine, expert cache adaptive\]: engine open /m);
    expect(r.stdout).toMatch(/^== prompt 8 tokens \[wasm, \d+ instances?, expert cache adaptive\]: engine open /m);
    expect(r.stdout).toMatch(/^ {2}decode: .* -> ratio \d/m);
    expect(r.stdout).toMatch(/^ {4}expert stall \d+\.\d{3} s\/token = \d+\.\d% of the step, none read ahead$/m);
    expect(r.stdout).toMatch(/^ +expert stall, % of step +\d+\.\d%, read ahead 0\.0\/token +\d+\.\d%, read ahead 0\.0\/token$/m);
    expect(r.stdout).toContain(`limits (${limitsFile}): DRAM 10.000 GB/s, direct read 1.000 GB/s`);
    expect(r.stdout).toMatch(/^native \/ WebAssembly, one run, the same limits/m);
    expect(r.stdout).toMatch(/^ +8 {2}first token, cold +\S+ s \(\S+\) +\S+ s \(\S+\) +\d+\.\d\d$/m);
    expect(r.stdout).toMatch(/^ +8 {2}decode after cold +\S+ tok\/s \(\S+\) +\S+ tok\/s \(\S+\) +\d+\.\d\d$/m);
  });
});

describe("the plan a bench runs", () => {
  it("with no flags, the plan kvl chat makes: its 4096-token context, 256-token prefill chunks, the vision tower reserved, --ram-mib auto", () => {
    const chatLike = benchJson(["--backend", "wasm", "--threads", "2", "--prompt-lens", "24", "--decode-tokens", "3", "--limits", limitsFile]);
    expect(chatLike.settings).toMatchObject({ plan: "chat", max_context: 4096, max_batch: 256, ram_mib: "auto" });
    const run = chatLike.runs[0];
    expect(run.ram_budget_chosen_by).toBe("auto");
    expect(run.plan).toMatch(/^KV cache +[\d,.]+ +4096 tokens/m);
    expect(run.plan).toMatch(/^vision [^\n]*? +[1-9][\d,.]* +\d+x\d+ patches$/m);
    // the bench-only plan, asked for by name: the prompts' context, one chunk, no vision
    const own = benchJson(["--backend", "wasm", "--threads", "2", "--prompt-lens", "24", "--decode-tokens", "3", "--limits", limitsFile, "--plan", "bench"]);
    expect(own.settings).toMatchObject({ plan: "bench", max_context: 24 + 3 + 8, max_batch: 24 });
    expect(own.runs[0].plan).not.toMatch(/patches$/m);
    expect(own.runs[0].plan_total_bytes).toBeLessThan(run.plan_total_bytes);
    // kvl chat --no-vision's plan: chat's context and chunks, nothing reserved for images
    const text1 = benchJson(["--backend", "wasm", "--threads", "2", "--prompt-lens", "24", "--decode-tokens", "3", "--limits", limitsFile, "--plan", "chat-text"]);
    expect(text1.settings).toMatchObject({ plan: "chat-text", max_context: 4096, max_batch: 256 });
    expect(text1.runs[0].plan).toMatch(/^KV cache +[\d,.]+ +4096 tokens/m);
    expect(text1.runs[0].plan).not.toMatch(/patches$/m);
    expect(text1.runs[0].plan).toMatch(/^image decode [^\n]*? 0\.0$/m);
    expect(text1.runs[0].plan_total_bytes).toBeLessThan(run.plan_total_bytes);
    const text = bench([pack, "--backend", "wasm", "--threads", "2", "--prompt-lens", "8", "--decode-tokens", "2", "--limits", limitsFile]);
    expect(text.stdout).toMatch(/^plan: as kvl chat plans it \(context 4096 tokens, 256-token prefill chunks, the vision tower reserved\)$/m);
    expect(text.stdout).toMatch(/RAM plan [\d.]+ MiB of \d+ \(--ram-mib auto\)/);
  });
});

describe("--image", () => {
  it("encodes a random image on each backend and reports its grid, media tokens, FLOP count and rate against the FMA peak", async () => {
    const withFma = join(tmp.dir, "limits-fma.jsonl");
    writeFileSync(withFma, `${readFileSync(limitsFile, "utf8")}${JSON.stringify({ mode: "fma", flops_per_s: 1e11 })}\n`);
    const backend = nativeBuilt ? "both" : "wasm";
    const result = benchJson(["--backend", backend, "--threads", "2", "--prompt-lens", "8", "--decode-tokens", "2", "--limits", withFma, "--image", "100"]);
    expect(result.settings.image).toBe(100);
    expect(result.images.map((r: Json) => r.backend)).toEqual(nativeBuilt ? ["native", "wasm"] : ["wasm"]);
    const reader = await PackReader.open(pack);
    const hp = (k: string): number => reader.hparams.get(k)!;
    const patch = hp("vision.patch_size");
    const [mh, mw] = [hp("vision.merge_kernel_h"), hp("vision.merge_kernel_w")];
    // the official rule for a 100x100 image well under the token limit: padded up to whole merges
    const side = Math.ceil(100 / (patch * mh)) * mh;
    const d = hp("vision.hidden_size");
    const n = side * side;
    const width = d * mh * mw;
    const flops = 2 * n * d * 3 * patch * patch +
      hp("vision.num_hidden_layers") * (2 * n * (4 * d * d + 2 * d * hp("vision.intermediate_size")) + 4 * n * n * d) +
      2 * (n / (mh * mw)) * (width * width + hp("text.hidden_size") * width);
    const visionBytes = reader.stores.get("vision")!.records.reduce((t, r) => t + r.nbytes, 0);
    for (const r of result.images) {
      expect(r.side).toBe(100);
      expect(r.grid).toEqual([side, side]);
      expect(r.media_tokens).toBe(n / (mh * mw));
      expect(r.flops).toBe(flops);
      expect(r.encode_s).toHaveLength(2);
      expect(r.flops_per_s).toBe(flops / r.encode_s[1]);
      expect(r.ratio_to_fma_peak).toBe(r.flops_per_s / 1e11);
      expect(r.vision_bytes_read).toBe(visionBytes); // every vision tensor once per encode
    }
    const text = bench([pack, "--backend", "wasm", "--threads", "2", "--prompt-lens", "8", "--decode-tokens", "2", "--limits", withFma, "--image", "100"]);
    expect(text.status, text.stderr).toBe(0);
    expect(text.stdout).toMatch(new RegExp(`^== image 100x100 \\[wasm, simd128(-relaxed)?\\]: grid ${side}x${side}, ${n / (mh * mw)} media tokens, ` +
      "encode \\d+\\.\\d\\d s \\(first, with CRC checks\\) / \\d+\\.\\d\\d s, \\d+\\.\\d GFLOP at \\d+\\.\\d GFLOP/s = \\d+\\.\\d% of the FMA peak$", "m"));
  });
});

describe("bad options", () => {
  it.each([
    [["--prompt-lens", "a,b"], /^kvl bench: error: --prompt-lens "a,b": give comma-separated integers/],
    [["--prompt-lens", "0,8"], /^kvl bench: error: --prompt-lens needs positive lengths and --decode-tokens >= 1/],
    [["--decode-tokens", "0"], /^kvl bench: error: --prompt-lens needs positive lengths and --decode-tokens >= 1/],
    [["--trunk-cache-mib", "lots"], /^kvl bench: error: --trunk-cache-mib "lots": use auto or a MiB number/],
    [["--expert-lookahead", "on"], /^kvl bench: error: option '--expert-lookahead <mode>' argument 'on' is invalid\. Allowed choices are auto, off\./],
    [["--limits", "/nonexistent/limits.jsonl"], /^kvl bench: error: --limits \/nonexistent\/limits.jsonl: unreadable \(ENOENT/],
    [["--membw", "/nonexistent/membw", "--limits", "LIMITS"], /^kvl bench: error: --membw \/nonexistent\/membw: not an executable file/],
    [["--ram-mib", "64", "--limits", "LIMITS"], /^kvl bench: error: the RAM plan needs .* over --ram-mib 64/],
  ])("%j is a clear error", (args, message) => {
    const r = bench([pack, ...args.map((a) => (a === "LIMITS" ? limitsFile : a))]);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(message);
    expect(r.stderr).not.toMatch(/internal error|\n {4}at /);
    expect(r.stdout).toBe("");
  });

  it("a --limits file without dram and ssd lines is refused", () => {
    const path = join(tmp.dir, "dram-only.jsonl");
    writeFileSync(path, `${JSON.stringify({ mode: "dram", best_bytes_per_s: 1e10 })}\n`);
    const r = bench([pack, "--limits", path]);
    expect(r.status).toBe(1);
    expect(r.stderr).toBe(`kvl bench: error: --limits ${path} needs at least one dram and one ssd line (membw output)\n`);
  });

  it("a directory that is no pack is refused", () => {
    const r = bench([tmp.dir, "--limits", limitsFile]);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/^kvl bench: error: .*PACK_COMPLETE\.json is missing/);
  });
});

describe("limits measured here", () => {
  it("the Node fallback measures DRAM with worker threads and reads experts.bin", async () => {
    const pb = await packBytes(pack);
    const lim = await measureLimits({ model: pack, extent: pb.extent_data, threads: 2, dropCaches: false, nodeOnly: true, dramBytes: 32 << 20, reads: 8 });
    expect(lim.source).toMatch(/^measured here: DRAM by Node worker threads .*, direct reads by Node fs reads.*, no FMA peak$/);
    expect(lim.fma_flops_per_s).toBeNull();
    expect(lim.detail.map((r) => [r.mode, r.impl, r.threads ?? r.qd])).toEqual([["dram", "node", 1], ["dram", "node", 2], ["ssd", "node", 1], ["ssd", "node", 2]]);
    expect(lim.dram_bytes_per_s).toBe(Math.max(...lim.detail.filter((r) => r.mode === "dram").map((r) => r.best_bytes_per_s as number)));
    expect(lim.ssd_bytes_per_s).toBeGreaterThan(0);
  });

  it("leaves no kvl-membw-* build folder behind, also when the measurement fails", async () => {
    const pb = await packBytes(pack);
    const root = mkdtempSync(join(tmpdir(), "kvl-bench-tmpdir-"));
    const saved = process.env.TMPDIR;
    process.env.TMPDIR = root; // os.tmpdir(), where measureLimits builds bench/membw.c
    try {
      const lim = await measureLimits({ model: pack, extent: pb.extent_data, threads: 1, dropCaches: false, dramBytes: 32 << 20, reads: 4 });
      expect(lim.dram_bytes_per_s).toBeGreaterThan(0);
      expect(readdirSync(root)).toEqual([]);
      // a DRAM buffer of -1 bytes: membw refuses it and the Node fallback throws, after the build
      await expect(measureLimits({ model: pack, extent: pb.extent_data, threads: 1, dropCaches: false, dramBytes: -1, reads: 4 })).rejects.toThrow();
      expect(readdirSync(root)).toEqual([]);
    } finally {
      if (saved === undefined) delete process.env.TMPDIR;
      else process.env.TMPDIR = saved;
      rmSync(root, { recursive: true, force: true });
    }
  });

  const membwDir = process.platform === "linux" && process.arch === "x64" ? mkdtempSync(join(tmpdir(), "kvl-membw-test-")) : null;
  const built = membwDir !== null ? membwBinary(membwDir) : { error: "not Linux x86-64" };
  afterAll(() => {
    if (membwDir !== null) rmSync(membwDir, { recursive: true, force: true });
  });
  it.skipIf("error" in built)("bench/membw.c builds and reads experts.bin directly", () => {
    if (!("path" in built)) return;
    const r = runMembw(built.path, ["ssd", join(pack, "experts.bin"), "4096", "1", "4", "1"]);
    if ("error" in r) {
      // a filesystem without O_DIRECT: membw says so, and kvl bench falls back to Node
      expect(r.error).toMatch(/O_DIRECT/);
    } else {
      expect(r.rows[0]).toMatchObject({ mode: "ssd", block: 4096, qd: 1, reads: 4, bytes: 4 * 4096 });
    }
  });
});
