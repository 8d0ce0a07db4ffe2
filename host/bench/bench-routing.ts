/**
 * bench-routing.ts — `kvl bench --routing model|uniform|trace:FILE` and `--routing-out FILE`:
 * which experts the MoE layers take while a benchmark runs, for measurement only.
 *
 * The random-weight test models route nothing like a trained model (design.md "Low RAM"), so the
 * expert cache, read-ahead and disk are also measured under routing a trained model would
 * produce (a trace: one recorded with --routing-out, or made by bench/routing-trace.ts) and under
 * the worst case (uniform). The core computes everything as usual except the routed choice
 * (kvl_session_set_routing); such runs are flagged: their tokens are not the model's.
 *
 * Owns: the --routing list, the trace file format (JSONL, below) with its reader (a malformed
 * file is one UserError naming the file and line) and writer, and the hooks a run's sessions get
 * (trace rows consumed in order across the run's sessions, uniform seeds per session, the
 * recorder of --routing-out). Does not own the procedure (bench-run.ts) or rendering (cli/bench.ts).
 *
 * Trace format: UTF-8 JSON lines. Line 1, the header:
 *   {"kvl_routing":1,"n_layers":27,"n_routed":64,"topk":6,"moe_layers":[1,2,...,26],"source":"..."}
 * then one line per token, in the order the tokens ran (a prompt's tokens, then each decoded one;
 * the sessions of a run one after another):
 *   {"ids":[[6 expert ids] per MoE layer, in moe_layers order],"w":[[6 weights] per MoE layer]}
 * "w" is optional (generated traces): without it each layer weighs the given experts with the
 * router's own scores. Weights are written as the shortest decimal of the FP32 value, so a
 * recorded trace replays bit for bit.
 */
import { readFileSync, writeFileSync } from "node:fs";

import type { RoutingHook, RoutingRows } from "../core/core-api.js";
import { UserError } from "../system/user-error.js";

export const OVERRIDDEN_NOTE = "routing overridden: tokens are not the model's";

export type RoutingSpec = { kind: "model" } | { kind: "uniform" } | { kind: "trace"; file: string };

export function routingLabel(spec: RoutingSpec): string {
  return spec.kind === "trace" ? `trace:${spec.file}` : spec.kind;
}

/** --routing: a comma list of model, uniform, trace:FILE (a file name may not hold a comma). */
export function parseRoutingList(text: string): RoutingSpec[] {
  const out: RoutingSpec[] = [];
  for (const raw of text.split(",")) {
    const item = raw.trim();
    if (item === "model" || item === "uniform") out.push({ kind: item });
    else if (item.startsWith("trace:") && item.length > 6) out.push({ kind: "trace", file: item.slice(6) });
    else throw new UserError(`--routing ${JSON.stringify(text)}: ${JSON.stringify(item)} is not model, uniform or trace:FILE`);
  }
  const labels = out.map(routingLabel);
  if (new Set(labels).size !== labels.length) throw new UserError(`--routing ${JSON.stringify(text)} names a mode twice`);
  return out;
}

/** What a trace must agree with: the pack's MoE shape. */
export interface RoutingDims {
  n_layers: number;
  n_routed: number;
  top_k: number;
  moe_layers: readonly number[];
}

export interface TraceHeader {
  kvl_routing: 1;
  n_layers: number;
  n_routed: number;
  topk: number;
  moe_layers: number[];
  source?: string;
}

export interface Trace {
  header: TraceHeader;
  tokens: number;
  /** [tokens][moe_layers][topk] */
  ids: Int32Array;
  /** [tokens][moe_layers][topk]; NaN rows where a token had no "w" */
  weights: Float32Array;
}

const isInt = (v: unknown): v is number => typeof v === "number" && Number.isInteger(v);

/** Parses a trace's text; every problem is one UserError `FILE:LINE: what`. */
export function parseTrace(text: string, file: string): Trace {
  const lines = text.split("\n");
  if (lines.at(-1) === "") lines.pop();
  const fail = (line: number, what: string): never => {
    throw new UserError(`${file}:${line}: ${what} (kvl routing trace: docs in host/bench/bench-routing.ts)`);
  };
  const json = (line: number): unknown => {
    try {
      return JSON.parse(lines[line - 1]!);
    } catch (err) {
      return fail(line, `not JSON: ${(err as Error).message}`);
    }
  };
  if (lines.length === 0) fail(1, "empty file: a header line is expected");
  const h = json(1) as Record<string, unknown> | null;
  if (h === null || typeof h !== "object" || Array.isArray(h) || h.kvl_routing !== 1) fail(1, 'the header must be an object with "kvl_routing": 1');
  const header = h as Record<string, unknown>;
  for (const key of ["n_layers", "n_routed", "topk"] as const) {
    if (!isInt(header[key]) || (header[key] as number) < 1) fail(1, `header "${key}" must be a positive integer`);
  }
  const nLayers = header.n_layers as number;
  const nRouted = header.n_routed as number;
  const K = header.topk as number;
  const moe = header.moe_layers;
  if (!Array.isArray(moe) || moe.length === 0 || !moe.every((l, i) => isInt(l) && l >= 0 && l < nLayers && (i === 0 || l > (moe[i - 1] as number)))) {
    fail(1, `header "moe_layers" must be increasing layer indices in [0, ${nLayers})`);
  }
  if (K > nRouted) fail(1, `header "topk" ${K} exceeds "n_routed" ${nRouted}`);
  const M = (moe as number[]).length;
  const tokens = lines.length - 1;
  if (tokens === 0) fail(2, "no token lines after the header");
  const ids = new Int32Array(tokens * M * K);
  const weights = new Float32Array(tokens * M * K).fill(Number.NaN);
  for (let t = 0; t < tokens; t++) {
    const line = t + 2;
    const row = json(line) as Record<string, unknown> | null;
    if (row === null || typeof row !== "object" || Array.isArray(row)) fail(line, "a token line must be an object with \"ids\"");
    const r = row as Record<string, unknown>;
    const shaped = (v: unknown, what: string): unknown[][] => {
      if (!Array.isArray(v) || v.length !== M || !v.every((x) => Array.isArray(x) && x.length === K)) {
        fail(line, `"${what}" must hold ${M} arrays (one per MoE layer) of ${K} values`);
      }
      return v as unknown[][];
    };
    const idRows = shaped(r.ids, "ids");
    for (let m = 0; m < M; m++) {
      const seen = new Set<number>();
      for (let k = 0; k < K; k++) {
        const x = idRows[m]![k];
        if (!isInt(x) || x < 0 || x >= nRouted) fail(line, `ids[${m}][${k}] = ${JSON.stringify(x)} is not an expert id in [0, ${nRouted})`);
        if (seen.has(x as number)) fail(line, `ids[${m}] names expert ${String(x)} twice`);
        seen.add(x as number);
        ids[(t * M + m) * K + k] = x as number;
      }
    }
    if (r.w !== undefined) {
      const wRows = shaped(r.w, "w");
      for (let m = 0; m < M; m++) {
        for (let k = 0; k < K; k++) {
          const x = wRows[m]![k];
          if (typeof x !== "number" || !Number.isFinite(x)) fail(line, `w[${m}][${k}] = ${JSON.stringify(x)} is not a finite number`);
          weights[(t * M + m) * K + k] = x as number;
        }
      }
    }
  }
  const out: TraceHeader = { kvl_routing: 1, n_layers: nLayers, n_routed: nRouted, topk: K, moe_layers: [...(moe as number[])] };
  if (typeof header.source === "string") out.source = header.source;
  return { header: out, tokens, ids, weights };
}

export function readTrace(file: string): Trace {
  let text: string;
  try {
    text = readFileSync(file, "utf8");
  } catch (err) {
    throw new UserError(`--routing trace:${file}: ${(err as Error).message}`);
  }
  return parseTrace(text, file);
}

/** The trace's shape against the pack's. */
export function checkTraceFits(trace: Trace, file: string, dims: RoutingDims): void {
  const h = trace.header;
  const want = `n_layers ${dims.n_layers}, n_routed ${dims.n_routed}, topk ${dims.top_k}, moe_layers [${dims.moe_layers.join(",")}]`;
  if (h.n_layers !== dims.n_layers || h.n_routed !== dims.n_routed || h.topk !== dims.top_k ||
    h.moe_layers.length !== dims.moe_layers.length || h.moe_layers.some((l, i) => l !== dims.moe_layers[i])) {
    throw new UserError(`${file}:1: the trace is for n_layers ${h.n_layers}, n_routed ${h.n_routed}, topk ${h.topk}, ` +
      `moe_layers [${h.moe_layers.join(",")}]; this pack has ${want}`);
  }
}

/** One token line: ids (and weights unless null) [moe_layers][topk]. */
export function traceLine(ids: ArrayLike<number>, weights: ArrayLike<number> | null, nMoe: number, K: number): string {
  const rows = (v: ArrayLike<number>, f: (x: number) => number): number[][] =>
    Array.from({ length: nMoe }, (_, m) => Array.from({ length: K }, (_, k) => f(v[m * K + k]!)));
  const line: { ids: number[][]; w?: number[][] } = { ids: rows(ids, (x) => x) };
  if (weights !== null) line.w = rows(weights, (x) => x);
  return JSON.stringify(line);
}

export function traceHeaderLine(dims: RoutingDims, source: string): string {
  const h: TraceHeader = { kvl_routing: 1, n_layers: dims.n_layers, n_routed: dims.n_routed, topk: dims.top_k, moe_layers: [...dims.moe_layers], source };
  return JSON.stringify(h);
}

/** --routing-out: the routing the model took, token by token, session after session. */
export class RoutingRecorder {
  readonly #lines: string[];
  /** this session's tokens by position: ids and weights [moe_layers][topk] */
  #session = new Map<number, { ids: Int32Array; weights: Float32Array }>();

  constructor(private readonly dims: RoutingDims, source: string) {
    this.#lines = [traceHeaderLine(dims, source)];
  }

  taken(pos0: number, n: number, rows: RoutingRows, layerBegin: number, layerEnd: number): void {
    const { n_layers: L, top_k: K, moe_layers: moe } = this.dims;
    for (let i = 0; i < n; i++) {
      let tok = this.#session.get(pos0 + i);
      if (!tok) {
        tok = { ids: new Int32Array(moe.length * K), weights: new Float32Array(moe.length * K) };
        this.#session.set(pos0 + i, tok);
      }
      moe.forEach((layer, m) => {
        if (layer < layerBegin || layer >= layerEnd) return;
        const at = (i * L + layer) * K;
        tok.ids.set(rows.ids.subarray(at, at + K), m * K);
        tok.weights.set(rows.weights.subarray(at, at + K), m * K);
      });
    }
  }

  /** A session ended: its tokens in position order. */
  endSession(): void {
    const K = this.dims.top_k;
    const M = this.dims.moe_layers.length;
    for (const pos of [...this.#session.keys()].sort((a, b) => a - b)) {
      const tok = this.#session.get(pos)!;
      this.#lines.push(traceLine(tok.ids, tok.weights, M, K));
    }
    this.#session = new Map();
  }

  get tokens(): number {
    return this.#lines.length - 1;
  }

  write(file: string): void {
    writeFileSync(file, `${this.#lines.join("\n")}\n`, "utf8");
  }
}

/**
 * The routing of one benchmark run (one engine): a hook per session. Trace rows are consumed in
 * order across the run's sessions and wrap around when the run needs more tokens than the trace
 * holds (wrapped says so); uniform draws a fresh seed per session, so a repeated prompt does not
 * repeat its routing.
 */
export class RunRouting {
  #cursor = 0;
  #sessions = 0;
  wrapped = false;

  constructor(readonly spec: RoutingSpec, private readonly trace: Trace | null, private readonly dims: RoutingDims, private readonly seed: number,
    private readonly capacity: number, private readonly recorder: RoutingRecorder | null) {}

  get overridden(): boolean {
    return this.spec.kind !== "model";
  }

  /** Trace tokens consumed so far. */
  get traceTokensUsed(): number {
    return this.#cursor;
  }

  /** The hook of the next session, or null (the model's routing, nothing recorded). */
  nextHook(): RoutingHook | null {
    const session = this.#sessions++;
    if (this.spec.kind === "model") {
      const rec = this.recorder;
      if (rec === null) return null;
      return { mode: "model", seed: 0, capacity: this.capacity, taken: (p, n, rows, lb, le) => rec.taken(p, n, rows, lb, le) };
    }
    if (this.spec.kind === "uniform") {
      return { mode: "uniform", seed: (Math.imul(this.seed + 1, 0x9e3779b1) + session) >>> 0, capacity: this.capacity };
    }
    const trace = this.trace!;
    const base = this.#cursor;
    const { n_layers: L, top_k: K } = this.dims;
    const moe = trace.header.moe_layers;
    const M = moe.length;
    return {
      mode: "given", seed: 0, capacity: this.capacity,
      fill: (pos0, n, rows) => {
        for (let i = 0; i < n; i++) {
          const t = (base + pos0 + i) % trace.tokens;
          for (let m = 0; m < M; m++) {
            const from = (t * M + m) * K;
            const to = (i * L + moe[m]!) * K;
            rows.ids.set(trace.ids.subarray(from, from + K), to);
            rows.weights.set(trace.weights.subarray(from, from + K), to);
          }
        }
      },
    };
  }

  /** A session of the run ended at this position. */
  endSession(position: number): void {
    if (this.spec.kind === "trace") {
      this.#cursor += position;
      if (this.#cursor > this.trace!.tokens) this.wrapped = true;
    }
    if (this.spec.kind === "model") this.recorder?.endSession();
  }
}
