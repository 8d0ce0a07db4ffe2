/**
 * paths.ts — where kvl's own files are, whether running from TypeScript sources (tests) or from
 * the compiled dist/ folder (the `kvl` command).
 *
 * Owns: finding the package root and the built artefacts in it. Does not own: model paths.
 */
import { existsSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

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

export const packageRoot: string = findPackageRoot(dirname(fileURLToPath(import.meta.url)));

/** The committed WebAssembly build of the core. */
export const wasmDistDir: string = join(packageRoot, "wasm-core", "dist");

/** Where `npm ci` (scripts/build-addon.mjs) puts the native addon; KVL_ADDON overrides it. */
export function nativeAddonPath(): string {
  return process.env.KVL_ADDON ?? join(packageRoot, "build", "addon", "kvl_core.node");
}
