/**
 * backend.ts — which build of the core runs: the native addon or WebAssembly, decided once at
 * startup and kept as one frozen record (what `kvl doctor`, `--json` stats and the tests read).
 *
 * Owns: the --backend / KVL_BACKEND request, the child-process test load of the addon (a wrong
 * instruction set or a missing library kills the child, never this process), the WebAssembly
 * feature probes, the choice and its reason, and opening the chosen backend.
 * Does not own: what the backends compute (the core), building the addon.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { join, resolve } from "node:path";

import { ADDON_PROBE_ARG, type AddonProbeReport } from "./addon-probe.js";
import type { BackendName, CoreBackend, KernelSet } from "./core-api.js";
import { type CpuInfo, readCpuInfo } from "./cpu.js";
import { envChoice } from "../system/env.js";
import { NativeBackend, loadNativeAddon } from "./native-backend.js";
import { type AddonOrigin, NATIVE_ADDON_HINT, kvlCommandArgs, nativeAddonCandidates, nativeAddonPath, wasmDistDir } from "../system/paths.js";
import { UserError } from "../system/user-error.js";
import { WasmBackend } from "./wasm-backend.js";
import { type WasmFeatures, probeWasmFeatures } from "./wasm-features.js";

export const BACKEND_REQUESTS = ["auto", "native", "wasm"] as const;
export type BackendRequest = (typeof BACKEND_REQUESTS)[number];

export interface NativeStatus {
  /** The addon chosen (the first candidate that loads), else the first one tried. */
  readonly path: string;
  /** Where it came from (paths.ts nativeAddonCandidates), null when none loads. */
  readonly origin: AddonOrigin | null;
  /** Candidates tried before it that exist and do not load, with why. */
  readonly skipped: ReadonlyArray<{ readonly path: string; readonly origin: AddonOrigin; readonly error: string }>;
  readonly present: boolean;
  readonly loads: boolean;
  /** Why it does not load (missing file, the child's error or signal). */
  readonly error: string | null;
  readonly kernelSets: readonly KernelSet[];
  readonly defaultKernelSet: string | null;
}

export interface WasmStatus {
  readonly dist: string;
  readonly present: boolean;
  readonly features: WasmFeatures;
  /** The build needs SIMD128 and threads. */
  readonly usable: boolean;
  readonly error: string | null;
}

export interface BackendRecord {
  readonly chosen: BackendName;
  readonly requested: BackendRequest;
  readonly requestedBy: "option" | "KVL_BACKEND" | "default";
  readonly reason: string;
  readonly native: NativeStatus;
  readonly wasm: WasmStatus;
  readonly cpu: CpuInfo;
  readonly node: string;
  readonly platform: string;
}

export class BackendError extends Error {
  constructor(message: string, readonly record: Omit<BackendRecord, "chosen" | "reason">) {
    super(message);
    this.name = "BackendError";
  }
}

export function parseBackendRequest(value: string, source: string): BackendRequest {
  if ((BACKEND_REQUESTS as readonly string[]).includes(value)) return value as BackendRequest;
  throw new UserError(`${source}: expected one of ${BACKEND_REQUESTS.join(", ")}, got "${value}"`);
}

/** Loads the addon in a child process (kvl itself with the hidden argument of addon-probe.ts) and
 * reports what it says about its kernel sets. */
export function testLoadNativeAddon(path: string = nativeAddonPath(), env: NodeJS.ProcessEnv = process.env,
  origin: AddonOrigin | null = null): NativeStatus {
  const absent = { path, origin: null, skipped: [], present: false, loads: false, kernelSets: [], defaultKernelSet: null };
  if (!existsSync(path)) {
    return { ...absent, error: `no addon at ${path} (${NATIVE_ADDON_HINT})` };
  }
  const child = spawnSync(process.execPath, [...kvlCommandArgs(), ADDON_PROBE_ARG, resolve(path)], { encoding: "utf8", timeout: 60_000, env });
  if (child.error || child.status !== 0) {
    const why = child.error
      ? child.error.message
      : child.signal
        ? `the test process was killed by ${child.signal}`
        : (child.stderr.trim().split("\n").find((l) => /Error/.test(l)) ?? `exit status ${child.status}`);
    return { ...absent, present: true, error: `the addon does not load: ${why}` };
  }
  try {
    const parsed = JSON.parse(child.stdout) as AddonProbeReport;
    return { path, origin, skipped: [], present: true, loads: true, error: null, kernelSets: parsed.sets, defaultKernelSet: parsed.def };
  } catch {
    return { ...absent, present: true, error: `the addon's test load printed no report: ${child.stdout.slice(0, 200)}` };
  }
}

/** Tries the addons in the loader's order (paths.ts nativeAddonCandidates: KVL_ADDON alone, else
 * a local build, then the prebuilt one) and reports the first that loads, or why none does. */
export function probeNativeAddon(env: NodeJS.ProcessEnv = process.env): NativeStatus {
  const skipped: Array<{ path: string; origin: AddonOrigin; error: string }> = [];
  let first: NativeStatus | null = null;
  for (const c of nativeAddonCandidates(env)) {
    if (!existsSync(c.path) && c.origin !== "KVL_ADDON") continue;
    const status = testLoadNativeAddon(c.path, env, c.origin);
    if (status.loads) return { ...status, skipped };
    skipped.push({ path: c.path, origin: c.origin, error: status.error ?? "does not load" });
    first ??= status;
  }
  if (first) return { ...first, skipped: skipped.slice(1), error: `${first.error}${skipped.length > 1 ? `; ${skipped.slice(1).map((s) => `${s.origin} ${s.path}: ${s.error}`).join("; ")}` : ""}` };
  const path = nativeAddonPath(env);
  return { path, origin: null, skipped: [], present: false, loads: false, kernelSets: [], defaultKernelSet: null,
    error: `no addon (${NATIVE_ADDON_HINT})` };
}

export function wasmStatus(dist: string = wasmDistDir): WasmStatus {
  const features = probeWasmFeatures();
  const present = existsSync(join(dist, "kvl_core.wasm")) && existsSync(join(dist, "kvl_core.cjs"));
  const missing = [!features.simd128 && "SIMD128", !features.threads && "threads"].filter(Boolean);
  const error = !present
    ? `no WebAssembly build in ${dist} (rebuild it with \`npm run build:wasm\`)`
    : missing.length > 0
      ? `this Node's WebAssembly lacks ${missing.join(" and ")}`
      : null;
  return { dist, present, features, usable: error === null, error };
}

export interface BackendOptions {
  /** The --backend option; KVL_BACKEND applies when it is absent. */
  readonly option?: string | undefined;
  readonly env?: NodeJS.ProcessEnv;
}

/** Decides the backend. Throws BackendError when an explicit request cannot be met. */
export function chooseBackend(options: BackendOptions = {}): BackendRecord {
  const env = options.env ?? process.env;
  const fromEnv = envChoice("KVL_BACKEND", BACKEND_REQUESTS, env);
  const requestedBy = options.option !== undefined ? "option" : fromEnv !== undefined ? "KVL_BACKEND" : "default";
  const requested = options.option !== undefined ? parseBackendRequest(options.option, "--backend") : fromEnv ?? "auto";
  const native = probeNativeAddon(env);
  const wasm = wasmStatus();
  const base = { requested, requestedBy, native, wasm, cpu: readCpuInfo(), node: process.version,
    platform: `${process.platform} ${process.arch}` } as const;

  let chosen: BackendName;
  let reason: string;
  if (requested === "native") {
    if (!native.loads) throw new BackendError(`--backend native: ${native.error}`, base);
    chosen = "native";
    reason = `asked for (${requestedBy}); runs ${native.defaultKernelSet} kernels`;
  } else if (requested === "wasm") {
    if (!wasm.usable) throw new BackendError(`--backend wasm: ${wasm.error}`, base);
    chosen = "wasm";
    reason = `asked for (${requestedBy})`;
  } else if (native.loads && native.defaultKernelSet !== "scalar") {
    chosen = "native";
    reason = `auto: the native addon (${native.origin}) loads and runs ${native.defaultKernelSet} kernels`;
  } else if (wasm.usable) {
    chosen = "wasm";
    reason = native.loads
      ? "auto: the native addon has only scalar kernels on this CPU; WebAssembly SIMD128 is faster"
      : `auto: ${native.error}`;
  } else if (native.loads) {
    chosen = "native";
    reason = `auto: WebAssembly unusable (${wasm.error}); the native addon runs scalar kernels`;
  } else {
    throw new BackendError(`no backend can run here: native: ${native.error}; wasm: ${wasm.error}`, base);
  }
  return deepFreeze({ ...base, chosen, reason });
}

/** Opens a backend of the given kind (after chooseBackend has vetted it). */
export async function openBackend(name: BackendName, record?: BackendRecord): Promise<CoreBackend> {
  if (name === "native") return new NativeBackend(loadNativeAddon(record?.native.path ?? nativeAddonPath()));
  return WasmBackend.create({ distDir: record?.wasm.dist ?? wasmDistDir });
}

function deepFreeze<T>(value: T): T {
  if (value && typeof value === "object") {
    for (const v of Object.values(value)) deepFreeze(v);
    Object.freeze(value);
  }
  return value;
}
