/**
 * routing-trace-cli.ts — routing traces for `kvl bench --routing trace:FILE`: make one, or print
 * the statistics of any (a generated one, or one a real run recorded with --routing-out).
 *
 *   npx vite-node bench/routing-trace-cli.ts generate OUT [--profile default|kimi-low|uniform]
 *       [--pack DIR] [--tokens N] [--seed N] [--zipf S] [--keep P] [--recall Q] [--window W] [--cross C]
 *   npx vite-node bench/routing-trace-cli.ts stats FILE [FILE...]
 *   npx vite-node bench/routing-trace-cli.ts profiles      (the three profiles' statistics, no file)
 *   npx vite-node bench/routing-trace-cli.ts outlook       (host/plan/routing-outlook.ts's table)
 *
 * --pack takes the shape (layers, MoE layers, experts, top-k) from a pack, so the trace fits it;
 * without it, the full-size Kimi-VL-A3B shape. The generator, its parameters and their sources:
 * bench/routing-trace.ts. Statistics: reuse at distance 1 and within 8 tokens, the top-1/8 share,
 * and simulated plain-LRU and frequency-policy hit rates against the resident fraction.
 */
import { writeFileSync } from "node:fs";

import { packBytes } from "../host/bench/bench-model.js";
import { readTrace, traceHeaderLine, traceLine } from "../host/bench/bench-routing.js";
import { DEFAULT_PARAMS, type GeneratorParams, KIMI_LOW_PARAMS, KIMI_SHAPE, type TraceShape, type TraceStats, UNIFORM_PARAMS, calibratedOutlookTable, generateTrace, traceStats } from "./routing-trace.js";

const PROFILES: Record<string, Readonly<GeneratorParams>> = { default: DEFAULT_PARAMS, "kimi-low": KIMI_LOW_PARAMS, uniform: UNIFORM_PARAMS };

function fail(message: string): never {
  process.stderr.write(`routing-trace: ${message}\n`);
  process.exit(2);
}

function flags(args: string[]): Map<string, string> {
  const out = new Map<string, string>();
  for (let i = 0; i < args.length; i += 2) {
    const k = args[i]!;
    if (!k.startsWith("--") || args[i + 1] === undefined) fail(`expected --flag value pairs, got ${JSON.stringify(args.slice(i))}`);
    out.set(k.slice(2), args[i + 1]!);
  }
  return out;
}

function statsText(label: string, s: TraceStats): string {
  const lines = [`${label}: ${s.tokens} tokens; reuse at distance 1 ${s.reuse1.toFixed(3)}, within 8 ${s.reuse8.toFixed(3)}; ` +
    `top 1/8 of experts carry ${s.top8th.toFixed(3)} of picks`];
  lines.push(`  resident fraction  ${s.curves[0]!.resident.map((f) => f.toFixed(2).padStart(6)).join("")}`);
  for (const c of s.curves) {
    lines.push(`  ${`${c.policy} hit rate`.padEnd(17)}  ${c.hit.map((h) => h.toFixed(3).padStart(6)).join("")}`);
  }
  return lines.join("\n");
}

async function main(argv: string[]): Promise<void> {
  const [command, ...rest] = argv;
  if (command === "generate") {
    const [out, ...more] = rest;
    if (!out || out.startsWith("--")) fail("generate OUT: the output file");
    const f = flags(more);
    const base = PROFILES[f.get("profile") ?? "default"] ?? fail(`--profile ${f.get("profile")}: default, kimi-low or uniform`);
    const params: GeneratorParams = { ...base };
    for (const key of ["tokens", "seed", "zipf", "keep", "recall", "window", "cross"] as const) {
      const v = f.get(key);
      if (v === undefined) continue;
      const n = Number(v);
      if (!Number.isFinite(n) || n < 0) fail(`--${key} ${v}: a non-negative number`);
      params[key] = n;
    }
    let shape: TraceShape = KIMI_SHAPE;
    const pack = f.get("pack");
    if (pack !== undefined) {
      const pb = await packBytes(pack);
      shape = { nLayers: pb.n_layers, moeLayers: pb.moe_layers, nRouted: pb.n_routed, topk: pb.top_k };
    }
    const ids = generateTrace(shape, params);
    const M = shape.moeLayers.length;
    const K = shape.topk;
    const lines = [traceHeaderLine({ n_layers: shape.nLayers, n_routed: shape.nRouted, top_k: K, moe_layers: shape.moeLayers },
      `bench/routing-trace.ts ${JSON.stringify(params)}`)];
    for (let t = 0; t < params.tokens; t++) lines.push(traceLine(ids.subarray(t * M * K, (t + 1) * M * K), null, M, K));
    writeFileSync(out, `${lines.join("\n")}\n`, "utf8");
    process.stdout.write(`${statsText(out, traceStats(ids, M, shape.nRouted, K))}\n`);
    return;
  }
  if (command === "stats") {
    if (rest.length === 0) fail("stats FILE [FILE...]");
    for (const file of rest) {
      const trace = readTrace(file);
      const h = trace.header;
      process.stdout.write(`${statsText(file, traceStats(trace.ids, h.moe_layers.length, h.n_routed, h.topk))}\n`);
    }
    return;
  }
  if (command === "profiles") {
    for (const [name, params] of Object.entries(PROFILES)) {
      const ids = generateTrace(KIMI_SHAPE, params);
      process.stdout.write(`${statsText(`${name} ${JSON.stringify(params)}`, traceStats(ids, KIMI_SHAPE.moeLayers.length, KIMI_SHAPE.nRouted, KIMI_SHAPE.topk))}\n`);
    }
    return;
  }
  if (command === "outlook") {
    process.stdout.write(`${JSON.stringify(calibratedOutlookTable())}\n`);
    return;
  }
  fail("usage: generate OUT [flags] | stats FILE... | profiles | outlook (see the file's header)");
}

main(process.argv.slice(2)).catch((err: unknown) => fail(err instanceof Error ? err.message : String(err)));
