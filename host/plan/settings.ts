/**
 * settings.ts — what a RAM plan is asked for (PlanOptions) and the settings it is built from
 * (PlanSettings: the options with their defaults applied and checked); and the model options as
 * chat, serve and doctor take them (ModelOptions: cli/options.ts modelSettings makes them).
 *
 * Owns: the checks of the options (a bad value is a UserError naming the option) and the defaults
 * of absent ones (defaults.ts; the act dtype: callers resolve --act-dtype auto first, act-mode.ts,
 * and an absent one is the exact mode f32; the KV dtype: the one that goes with the act dtype).
 * Does not own: the plan (planner.ts) or the auto limits that replace the null settings
 * (advice.ts resolveAutoLimits).
 */
import { availableParallelism } from "node:os";

import { type BackendName, ACT_DTYPE_NAMES, KV_DTYPE_NAMES, defaultKvDtype, isIntegerAct, type ActDtype, type ExpertLookahead, type KernelChoice, type KvDtype } from "../core/core-api.js";
import { MAX_INSTANCE_BYTES } from "../core/wasm-backend.js";
import { UserError } from "../system/user-error.js";
import type { ActDtypeChoice } from "./act-mode.js";
import { type PackFacts, WASM_MIN_INSTANCE_BYTES, WASM_PAGE, modelOf } from "./core-bytes.js";
import { DEFAULT_MAX_BATCH, DEFAULT_MAX_CONTEXT, DEFAULT_RAM_MIB } from "./defaults.js";
import { type RequestPlanOptions, type RequestSettings, imagePixelsSetting, requestSettings } from "./input-lines.js";
import { requestedInstances } from "./instances.js";
import { type RamChoice, ramBudget } from "./ram-budget.js";
import type { MachineMemory } from "../system/machine-memory.js";

/** The model options of chat, serve and doctor: what runs the model and what its plan holds. */
export interface ModelOptions {
  /** auto: what the machine can give now (ram-budget.ts). */
  ramMib: RamChoice;
  /** absent = auto (what the budget leaves once the trunk cache is full) */
  cacheMib?: number | undefined;
  /** null = what the budget leaves. */
  trunkCacheMib: number | null;
  maxContext: number;
  /** 0 = every core. */
  threads: number;
  kernels: KernelChoice;
  /** auto: the mode act-mode.ts's table gives for the backend and kernel set (resolved before planning). */
  actDtype: ActDtypeChoice;
  loadVision: boolean;
  /** Instances to split over at least; absent: KVL_INSTANCES, else 1. */
  instances?: number | undefined;
  /** The largest image (pixels) the plan reserves decode memory for; absent: the most that fits. */
  imageMaxPixels?: number | undefined;
  /** --max-image-tokens: the media tokens an image may take by default (the official processor's
   * in_token_limit rule applied with this many merged tokens' patches); absent: the pack's own
   * in_token_limit. Not a plan figure: it can only make images smaller than the plan's. */
  maxImageTokens?: number | undefined;
  /** Reading the next layer's predicted experts ahead (engine option expertLookahead); absent:
   * DEFAULT_EXPERT_LOOKAHEAD. Not a plan figure: it changes which extents are read, no byte count. */
  expertLookahead?: ExpertLookahead | undefined;
}

export interface PlanOptions {
  /** Which backend runs the engines (decides instances, memories and the Node figures). */
  backend: BackendName;
  /** The budget, MiB, or auto (ram-budget.ts); default DEFAULT_RAM_MIB. */
  ramMib?: RamChoice;
  /** The machine's memory figures auto reads (tests give fake ones); absent: read now. */
  machineMemory?: MachineMemory;
  /** Expert cache over all ranges, MiB (whole extents); null or absent = auto: what the budget
   * leaves once the trunk cache has what it can hold (see resolveAutoLimits). */
  cacheMib?: number | null;
  /** Trunk cache over all ranges, MiB; null or absent = auto (whatever the budget leaves). */
  trunkCacheMib?: number | null;
  /** Tokens; default DEFAULT_MAX_CONTEXT; 1..max_position_embeddings. */
  maxContext?: number;
  /** Whether the first range's engine loads the vision tower; default true. */
  loadVision?: boolean;
  /** Prefill chunk in tokens; default DEFAULT_MAX_BATCH. */
  maxBatch?: number;
  kvDtype?: KvDtype;
  /** Inputs of the Linear layers (README "Numerics"), resolved (act-mode.ts: --act-dtype auto is
   * resolved before planning); the integer modes change the resident trunk's and the session's
   * bytes. Default f32, the exact mode. */
  actDtype?: ActDtype;
  /** Compute threads per engine; 0 or absent = every core. */
  threads?: number;
  /** At least this many instances; absent: KVL_INSTANCES, else 1 (engine-host's rule). */
  instances?: number;
  /** WebAssembly: the largest memory of one instance; default MAX_INSTANCE_BYTES (tests force less). */
  maxInstanceBytes?: number;
  /** Refuse (UserError) a plan over ramMib; default true. */
  check?: boolean;
  /** Vision: the largest image (pixels, decoded in strips) the plan reserves decode memory for;
   * absent = auto: the most that fits, in IMAGE_PIXELS_FLOOR..IMAGE_PIXELS_MAX (input-lines.ts). */
  imageMaxPixels?: number;
  /** kvl serve: request bodies the plan holds (absent: no server, no line). */
  requests?: RequestPlanOptions;
}

/** The options with their defaults applied and checked. */
export interface PlanSettings {
  backend: BackendName;
  ramMib: number;
  /** Whether ramMib was given or chosen by auto, and how auto came to it. */
  ramChosenBy: "auto" | "option";
  ramDetail: string | null;
  /** Always a number in a plan; while cacheAuto, resolveAutoLimits picks it. */
  cacheMib: number;
  cacheAuto: boolean;
  trunkCacheMib: number | null;
  maxContext: number;
  loadVision: boolean;
  maxBatch: number;
  kvDtype: KvDtype;
  actDtype: ActDtype;
  threads: number;
  instances: number;
  maxInstanceBytes: number;
  /** null = auto (resolved by resolveAutoLimits before the plan is built). */
  imagePixels: number | null;
  requests: RequestSettings | null;
}

export function settingsOf(facts: PackFacts, options: PlanOptions): PlanSettings {
  const m = modelOf(facts);
  const budget = ramBudget(options.ramMib ?? DEFAULT_RAM_MIB, options.machineMemory);
  const s: PlanSettings = {
    backend: options.backend,
    ramMib: budget.mib,
    ramChosenBy: budget.chosenBy,
    ramDetail: budget.detail,
    cacheMib: options.cacheMib ?? 0,
    cacheAuto: options.cacheMib === undefined || options.cacheMib === null,
    trunkCacheMib: options.trunkCacheMib ?? null,
    maxContext: options.maxContext ?? DEFAULT_MAX_CONTEXT,
    loadVision: options.loadVision ?? true,
    maxBatch: options.maxBatch ?? DEFAULT_MAX_BATCH,
    kvDtype: options.kvDtype ?? defaultKvDtype(options.actDtype ?? "f32"),
    actDtype: options.actDtype ?? "f32",
    threads: options.threads === undefined || options.threads === 0 ? availableParallelism() : options.threads,
    instances: requestedInstances(options.instances),
    maxInstanceBytes: options.maxInstanceBytes ?? MAX_INSTANCE_BYTES,
    imagePixels: imagePixelsSetting(options.imageMaxPixels),
    requests: requestSettings(options.requests),
  };
  if (s.backend !== "wasm" && s.backend !== "native") throw new UserError(`backend must be wasm or native, got ${JSON.stringify(s.backend)}`);
  if (!KV_DTYPE_NAMES.includes(s.kvDtype)) throw new UserError(`kv dtype '${s.kvDtype}' unknown; use one of ${KV_DTYPE_NAMES.join(", ")}`);
  if (!ACT_DTYPE_NAMES.includes(s.actDtype)) throw new UserError(`act dtype '${s.actDtype}' unknown; use one of ${ACT_DTYPE_NAMES.join(", ")}`);
  if ((s.kvDtype === "i16") !== isIntegerAct(s.actDtype)) {
    throw new UserError(`kv dtype ${s.kvDtype} does not go with act dtype ${s.actDtype}: act dtypes i16x1 and i8 keep the KV cache as ` +
      "int16 rows (kv dtype i16), and only they do; leave the kv dtype out to get the one that goes with the act dtype");
  }
  if (!Number.isInteger(s.maxContext) || s.maxContext < 1 || s.maxContext > m.maxPositions) {
    throw new UserError(`--max-context ${s.maxContext} is outside 1..${m.maxPositions} (the model's max_position_embeddings)`);
  }
  const finite = (v: number): boolean => typeof v === "number" && Number.isFinite(v);
  if (!finite(s.ramMib) || s.ramMib <= 0 || !finite(s.cacheMib) || s.cacheMib < 0 || (s.trunkCacheMib !== null && (!finite(s.trunkCacheMib) || s.trunkCacheMib < 0))) {
    throw new UserError("--ram-mib must be positive and cache sizes non-negative");
  }
  if (!Number.isInteger(s.maxBatch) || s.maxBatch < 1) throw new UserError(`max batch must be a positive integer, got ${s.maxBatch}`);
  if (!Number.isInteger(s.threads) || s.threads < 1 || s.threads > 1024) throw new UserError(`--threads must be an integer in 0..1024 (0: every core), got ${options.threads}`);
  if (s.instances > m.nLayers) throw new UserError(`--instances ${s.instances}: the model has only ${m.nLayers} decoder layers to split`);
  if (!Number.isInteger(s.maxInstanceBytes) || s.maxInstanceBytes % WASM_PAGE !== 0 || s.maxInstanceBytes < WASM_MIN_INSTANCE_BYTES ||
    s.maxInstanceBytes > MAX_INSTANCE_BYTES) {
    throw new UserError(`the instance memory limit must be a multiple of 64 KiB in ${WASM_MIN_INSTANCE_BYTES}..${MAX_INSTANCE_BYTES}, got ${s.maxInstanceBytes}`);
  }
  return s;
}
