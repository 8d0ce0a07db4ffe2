/**
 * paths.ts — where kvl's own files are: the package root when kvl runs from its package (the
 * compiled dist/ folder, or the TypeScript sources under test), the folder its assets are
 * extracted to when it runs as a single executable (sea-assets.ts; that folder has the package's
 * layout for every file kvl reads at run time). Every module that needs one of kvl's own files
 * asks here.
 *
 * Owns: finding the package root (or the asset folder) and the built artefacts in it, where the
 * native addon is looked for, how kvl relaunches itself (kvlCommandArgs), and loading CommonJS
 * files, addons and the dependencies that carry binaries (sharp, tiktoken) at run time from there
 * (a single executable's own require loads only Node's built-in modules). Does not own: model
 * paths.
 */
import { existsSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { envString } from "./env.js";
import { extractSeaAssets } from "./sea-assets.js";

function findPackageRoot(start: string): string {
  let dir = start;
  for (;;) {
    const manifest = join(dir, "package.json");
    if (existsSync(manifest)) {
      const parsed = JSON.parse(readFileSync(manifest, "utf8")) as { name?: string };
      if (parsed.name === "kvl") return dir;
    }
    const parent = dirname(dir);
    if (parent === dir) throw new Error(`kvl: no package.json named "kvl" above ${start}`);
    dir = parent;
  }
}

/** Whether this process is kvl's single executable (node:sea exists from Node 20.12 and
 * process.getBuiltinModule from 20.16; older Nodes run kvl only from its package). */
const runningAsSea: boolean = process.getBuiltinModule?.("node:sea")?.isSea() ?? false;

export const packageRoot: string = runningAsSea
  ? extractSeaAssets(process.getBuiltinModule("node:sea"))
  : findPackageRoot(dirname(fileURLToPath(import.meta.url)));

/** The committed WebAssembly build of the core. */
export const wasmDistDir: string = join(packageRoot, "wasm-core", "dist");

/** Where the native addon is looked for: where `npm ci` (scripts/build-addon.mjs) puts it, or
 * beside the single executable; KVL_ADDON overrides it. */
export function nativeAddonPath(env: NodeJS.ProcessEnv = process.env): string {
  return envString("KVL_ADDON", env) ??
    (runningAsSea ? join(dirname(process.execPath), "kvl_core.node") : join(packageRoot, "build", "addon", "kvl_core.node"));
}

/** How to get the native addon where nativeAddonPath looks, for a message saying it is absent. */
export const NATIVE_ADDON_HINT = runningAsSea
  ? "put the kvl_core.node built for this system beside the executable"
  : "build it with `npm run build:native`";

/** The arguments after process.execPath that run kvl's command line: the compiled script from the
 * package, none for the single executable (its script is built in). */
export function kvlCommandArgs(): string[] {
  return runningAsSea ? [] : [join(packageRoot, "dist", "cli", "kvl.js")];
}

/** Loads a CommonJS file or a Node addon (.node) by its path (a relative one from the working folder). */
export function requireFile(path: string): unknown {
  const file = resolve(path);
  return createRequire(file)(file);
}

/** Loads an npm dependency (its CommonJS entry) as kvl's package resolves it. */
export function requireDependency(name: string): unknown {
  return createRequire(join(packageRoot, "package.json"))(name);
}
