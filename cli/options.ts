/**
 * options.ts — options shared by several commands, defined once, and the check of the KVL_*
 * environment variables that stand in for some of them (checkEnvironment, before any command).
 */
import { InvalidArgumentError, Option } from "commander";

import { BACKEND_REQUESTS } from "../host/core/backend.js";
import { ACT_DTYPE_NAMES } from "../host/core/core-api.js";
import { envChoice, envPositiveInt } from "../host/system/env.js";

/** Every KVL_* variable with a restricted value is checked before any command runs, so a bad one
 * is one line naming it whatever the command (free-text ones, KVL_ADDON and KVL_API_KEY, need no
 * check; KVL_PACK_TEST_KILL_AT is a test hook). */
export function checkEnvironment(env: NodeJS.ProcessEnv = process.env): void {
  envChoice("KVL_BACKEND", BACKEND_REQUESTS, env);
  envPositiveInt("KVL_INSTANCES", env);
  envPositiveInt("KVL_PACK_FLUSH_ITEMS", env);
}

/** Option argument parsers: a clear commander error for anything but a whole number. */
export function nonNegativeInt(value: string): number {
  const n = Number(value);
  if (!/^\d+$/.test(value) || !Number.isSafeInteger(n)) throw new InvalidArgumentError("expected a non-negative integer");
  return n;
}

export function positiveInt(value: string): number {
  const n = nonNegativeInt(value);
  if (n < 1) throw new InvalidArgumentError("expected a positive integer");
  return n;
}

/** --instances: split the decoder layers over at least N engines (env KVL_INSTANCES when absent;
 * WebAssembly adds instances where one memory of 4 GiB is not enough). */
export function instancesOption(): Option {
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
export function kernelsOption(): Option {
  return new Option("--kernels <set>", "kernel set").choices(["auto", "scalar", "avx2", "avx512", "simd128"]).default("auto");
}

/** --max-image-mp: the largest image (megapixels) the RAM plan reserves decode memory for. */
export function maxImageMpOption(): Option {
  return new Option("--max-image-mp <mp>", "reserve decode memory in the RAM plan for images of up to about this many " +
    "megapixels (default: the most that fits, 12 to 64; lower it to leave more of --ram-mib to the caches)")
    .argParser((value: string): number => {
      const n = Number(value);
      if (!/^\d+(\.\d+)?$/.test(value) || !(n > 0)) throw new InvalidArgumentError("expected a positive number of megapixels");
      return n;
    });
}

/** Megapixels (--max-image-mp) → the planner's pixel limit. */
export function megapixelsToPixels(mp: number | undefined): number | undefined {
  return mp === undefined ? undefined : Math.round(mp * 1e6);
}

/** --act-dtype: the inputs of the Linear layers (README "Numerics"). */
export function actDtypeOption(): Option {
  return new Option("--act-dtype <dtype>", "inputs of the Linear layers: f32 (exact), bf16 (as the checkpoint's own " +
    "BF16 inference: faster prefill on CPUs with AVX512_BF16, logits move by BF16 rounding), i16 (inputs as two " +
    "16-bit integer terms, integer products: WebAssembly's fast mode, logits within 1e-3), i16x1 (one term: " +
    "faster still, logits move by ~2e-3 on the test models) or i8 (i16x1 with the routed experts' inputs 8-bit, as llama.cpp: " +
    "8-bit dot products in decoding on AVX2 and AVX-512 VNNI; README \"Numerics\")").choices([...ACT_DTYPE_NAMES]).default("f32");
}
