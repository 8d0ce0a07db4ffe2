/**
 * options.ts — options shared by several commands, defined once.
 */
import { Option } from "commander";

import { BACKEND_REQUESTS } from "../host/backend.js";

/** --backend: which build of the core runs (env KVL_BACKEND when absent). */
export function backendOption(): Option {
  return new Option("--backend <name>", "core build to run: auto picks the native addon where it loads, else WebAssembly (env KVL_BACKEND)")
    .choices(BACKEND_REQUESTS);
}
