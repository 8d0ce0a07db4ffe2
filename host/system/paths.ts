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

/** Where a native addon came from, in the order the loader tries them (backend.ts). */
export type AddonOrigin = "KVL_ADDON" | "local build" | "beside the executable" | "prebuilt";

export interface AddonCandidate {
  readonly path: string;
  readonly origin: AddonOrigin;
}

/** The folder of the prebuilt addons shipped in the package (and in a single executable's
 * assets), one per platform as prebuildify lays them out: prebuilds/<platform>-<arch>/. */
export function prebuiltAddonPath(platform: string = process.platform, arch: string = process.arch): string {
  return join(packageRoot, "prebuilds", `${platform}-${arch}`, "kvl_core.node");
}

/** The addons the loader tries, in order: KVL_ADDON alone when it is set; else a local build
 * (`npm run build:native`'s, or a kvl_core.node beside the single executable), then the prebuilt
 * one for this platform. */
export function nativeAddonCandidates(env: NodeJS.ProcessEnv = process.env): AddonCandidate[] {
  const fromEnv = envString("KVL_ADDON", env);
  if (fromEnv !== undefined) return [{ path: fromEnv, origin: "KVL_ADDON" }];
  const local: AddonCandidate = runningAsSea
    ? { path: join(dirname(process.execPath), "kvl_core.node"), origin: "beside the executable" }
    : { path: join(packageRoot, "build", "addon", "kvl_core.node"), origin: "local build" };
  return [local, { path: prebuiltAddonPath(), origin: "prebuilt" }];
}

/** The first candidate that exists (the one the loader tries first), else the first candidate. */
export function nativeAddonPath(env: NodeJS.ProcessEnv = process.env): string {
  const candidates = nativeAddonCandidates(env);
  return (candidates.find((c) => existsSync(c.path)) ?? candidates[0]!).path;
}

/** How to get a native addon where the loader looks, for a message saying none is there. */
export const NATIVE_ADDON_HINT = runningAsSea
  ? "this executable carries none for this platform; put a kvl_core.node built for this system beside it"
  : "this package has no prebuilt addon for this platform; build one with `npm run build:native` (cmake and a C compiler)";

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
