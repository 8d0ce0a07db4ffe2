/**
 * options.ts — options shared by several commands, defined once: the model options of chat,
 * serve, bench and doctor (addModelOptions, with their defaults from host/plan/defaults.ts, and
 * modelSettings, what they give the host), --expert-dtype of pack and prepare, and the check of the KVL_* environment variables that
 * stand in for some of them (checkEnvironment, before any command).
 */
import { type Command, InvalidArgumentError, Option } from "commander";

import { BACKEND_REQUESTS } from "../host/core/backend.js";
import { type ExpertLookahead, KERNEL_CHOICES, type KernelChoice } from "../host/core/core-api.js";
import { EXPERT_DTYPES } from "../host/pack/pack-format.js";
import { ACT_DTYPE_CHOICES, type ActDtypeChoice } from "../host/plan/act-mode.js";
import { type RamChoice, parseRamChoice } from "../host/plan/ram-budget.js";
import type { ModelOptions } from "../host/plan/settings.js";
import { DEFAULT_ACT_DTYPE, DEFAULT_EXPERT_LOOKAHEAD, DEFAULT_KERNELS, DEFAULT_MAX_CONTEXT, DEFAULT_RAM_MIB, DEFAULT_THREADS } from "../host/plan/defaults.js";
import { envChoice, envPositiveInt } from "../host/system/env.js";
import { UserError } from "../host/system/user-error.js";

/** Every KVL_* variable with a restricted value is checked before any command runs, so a bad one
 * is one line naming it whatever the command (free-text ones, KVL_ADDON and KVL_API_KEY, need no
 * check; KVL_PACK_TEST_KILL_AT is a test hook). */
export function checkEnvironment(env: NodeJS.ProcessEnv = process.env): void {
  envChoice("KVL_BACKEND", BACKEND_REQUESTS, env);
  envPositiveInt("KVL_INSTANCES", env);
  envPositiveInt("KVL_PACK_FLUSH_ITEMS", env);
}

/** Option argument parsers: a clear commander error for anything but a whole number. */
/** --expert-dtype of kvl pack and kvl prepare: what the routed experts are stored as. */
export function expertDtypeOption(): Option {
  return new Option("--expert-dtype <dtype>", "the routed experts: q8 row-wise, or q4 in groups of 32 with BF16 scales " +
    "(about half the bytes a token reads from the experts; accuracy: README Numerics)")
    .choices(EXPERT_DTYPES).default("q8");
}

/** One wording for every count option, whatever is wrong with the value (0, -1, 1e9, 1.5, abc):
 * the range and how to write it. */
function wholeNumber(value: string, min: number): number {
  const n = Number(value);
  if (!/^\d+$/.test(value) || !Number.isSafeInteger(n) || n < min) {
    throw new InvalidArgumentError(`expected a whole number of ${min} or more, in digits (e.g. 256)`);
  }
  return n;
}

export function nonNegativeInt(value: string): number {
  return wholeNumber(value, 0);
}

export function positiveInt(value: string): number {
  return wholeNumber(value, 1);
}

/** --instances: split the decoder layers over at least N engines (env KVL_INSTANCES when absent;
 * WebAssembly adds instances where one memory of 4 GiB is not enough). */
function instancesOption(): Option {
  return new Option("--instances <n>", "split the model over at least N instances (env KVL_INSTANCES); " +
    "WebAssembly uses more where one 4 GiB memory is not enough")
    .argParser(positiveInt);
}

/** --backend: which build of the core runs (env KVL_BACKEND when absent). */
export function backendOption(): Option {
  return new Option("--backend <name>", "core build to run: auto picks the native addon where it loads, else WebAssembly (env KVL_BACKEND)")
    .choices(BACKEND_REQUESTS);
}

/** --kernels: the kernel set the engine runs (auto: the fastest this CPU and backend have). */
function kernelsOption(): Option {
  return new Option("--kernels <set>", "kernel set (auto: the fastest this CPU and backend have)")
    .choices(KERNEL_CHOICES).default(DEFAULT_KERNELS);
}

/** --max-image-mp: the largest image (megapixels) the RAM plan reserves decode memory for. */
function maxImageMpOption(): Option {
  return new Option("--max-image-mp <mp>", "reserve decode memory in the RAM plan for images of up to about this many " +
    "megapixels (default: the most that fits, 12 to 64; lower it to leave more of --ram-mib to the caches)")
    .argParser((value: string): number => {
      const n = Number(value);
      if (!/^\d+(\.\d+)?$/.test(value) || !(n > 0)) throw new InvalidArgumentError("expected a positive number of megapixels");
      return n;
    });
}

/** Megapixels (--max-image-mp) → the planner's pixel limit. */
function megapixelsToPixels(mp: number | undefined): number | undefined {
  return mp === undefined ? undefined : Math.round(mp * 1e6);
}

/** --act-dtype: the inputs of the Linear layers (README "Numerics"); auto: host/plan/act-mode.ts's table. */
function actDtypeOption(): Option {
  return new Option("--act-dtype <dtype>", "inputs of the Linear layers: auto (the fastest mode for the backend and kernel set: " +
    "i16x1 with vector kernels, f32 with scalar ones; the load line says which and why), f32 (exact), bf16 (as the checkpoint's " +
    "own BF16 inference: logits move by BF16 rounding), i16x1 (inputs as 16-bit integers, integer products: the fastest " +
    "mode, logits move by ~2e-3 on the test models) or i8 (i16x1 with the routed " +
    "experts' inputs 8-bit, as llama.cpp: 8-bit dot products in decoding on AVX2 and AVX-512 VNNI; README \"Numerics\")")
    .choices([...ACT_DTYPE_CHOICES]).default(DEFAULT_ACT_DTYPE);
}

/** --expert-lookahead: whether the next layer's predicted experts are read ahead (README "Memory"). */
function expertLookaheadOption(): Option {
  return new Option("--expert-lookahead <mode>", "auto: while a layer computes, read the experts the next layer's router picks " +
    "on the current hidden state, whenever the expert cache cannot hold every expert (costs disk reads, never changes a result); " +
    "off: read each layer's experts only once it routes")
    .choices(["auto", "off"]).default(DEFAULT_EXPERT_LOOKAHEAD);
}

/** --cache-mib, --trunk-cache-mib: auto or a whole number of MiB (a bad one is one line naming the option). */
function cacheMibParser(flag: string): (text: string) => number | "auto" {
  return (text) => {
    if (text === "auto") return text;
    if (!/^\s*\+?\d+\s*$/.test(text) || !Number.isSafeInteger(Number(text))) throw new UserError(`${flag} ${JSON.stringify(text)}: use auto or a MiB number`);
    return Number(text);
  };
}

/** Which model options a command takes beyond those every one of them takes. */
interface ModelOptionSet {
  /** --backend as the command takes it; default backendOption(). */
  readonly backend?: Option;
  /** --max-context (kvl bench sizes the context from its prompts); default true. */
  readonly context?: boolean;
  /** --no-vision and --max-image-mp (kvl bench runs text only); default true. */
  readonly vision?: boolean;
}

/** The model options as commander gives them. */
export interface ModelCliOptions {
  backend?: string;
  instances?: number;
  ramMib: RamChoice;
  cacheMib: number | "auto";
  trunkCacheMib: number | "auto";
  threads: number;
  /** Absent where the command takes no --max-context. */
  maxContext?: number;
  kernels: KernelChoice;
  actDtype: ActDtypeChoice;
  /** --no-vision sets it false; absent where the command takes no vision options. */
  vision?: boolean;
  maxImageMp?: number;
  maxImageTokens?: number;
  expertLookahead: ExpertLookahead;
}

/** The model options: what runs the model (backend, instances, threads, kernels, act dtype) and
 * what the RAM plan holds (budget, caches, context, vision, image limit). */
export function addModelOptions(command: Command, set: ModelOptionSet = {}): Command {
  command
    .addOption(set.backend ?? backendOption())
    .addOption(instancesOption())
    .option("--ram-mib <mib>", "RAM budget: the plan holds every resident byte within it; auto: what this machine can give now, " +
      "less headroom for other programs (README \"RAM\")", (text: string) => parseRamChoice(text), DEFAULT_RAM_MIB)
    .option("--cache-mib <mib>", "expert cache: auto (what the RAM budget leaves once the trunk cache is full) or MiB",
      cacheMibParser("--cache-mib"), "auto")
    .option("--trunk-cache-mib <mib>", "trunk cache: auto (what the RAM budget leaves), 0 = stream the trunk, or MiB",
      cacheMibParser("--trunk-cache-mib"), "auto")
    .option("--threads <n>", "compute threads (0 = every core)", nonNegativeInt, DEFAULT_THREADS);
  if (set.context ?? true) command.option("--max-context <n>", "context length in tokens", positiveInt, DEFAULT_MAX_CONTEXT);
  command.addOption(kernelsOption()).addOption(actDtypeOption()).addOption(expertLookaheadOption());
  if (set.vision ?? true) {
    command.option("--no-vision", "do not load the vision tower").addOption(maxImageMpOption())
      .option("--max-image-tokens <n>", "media tokens an image may become (default: the model's own 1024): a smaller budget " +
        "downscales images as the official processor would for it, trading detail for encode time", positiveInt);
  }
  return command;
}

/** What the model options give the host (host/plan/settings.ts ModelOptions). */
export function modelSettings(o: ModelCliOptions): ModelOptions {
  return {
    ramMib: o.ramMib, cacheMib: o.cacheMib === "auto" ? undefined : o.cacheMib, trunkCacheMib: o.trunkCacheMib === "auto" ? null : o.trunkCacheMib,
    maxContext: o.maxContext ?? DEFAULT_MAX_CONTEXT, threads: o.threads, kernels: o.kernels, actDtype: o.actDtype, loadVision: o.vision ?? true,
    instances: o.instances, imageMaxPixels: megapixelsToPixels(o.maxImageMp), expertLookahead: o.expertLookahead,
    ...(o.maxImageTokens !== undefined ? { maxImageTokens: o.maxImageTokens } : {}),
  };
}
