/**
 * sea-assets.ts — kvl as a single executable (Node's single-executable applications, built by
 * `npm run build:exe`, scripts/build-exe.mjs): the files a JavaScript bundle cannot hold (the
 * WebAssembly core with its pthread worker script, the engine worker, tiktoken and sharp with
 * their binaries, the web page) travel as SEA assets and are written once to a folder named by
 * their content, which every later run of the same executable reuses as it is.
 *
 * Owns: the manifest asset (its name and format; the build writes it with assetSetKey), the cache
 * folder (<XDG_CACHE_HOME or ~/.cache>/kvl/sea-KEY; %LOCALAPPDATA%\kvl\sea-KEY on Windows) and the
 * extraction (into a temporary sibling folder, renamed into place when complete, so a folder under
 * the final name is never half written). Does not own: which files are assets (the build script)
 * or where kvl looks for its files (paths.ts, which calls extractSeaAssets as a single executable).
 * Plain Node APIs only: the build script imports the compiled module too.
 */
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync, renameSync, rmSync, statSync, writeFileSync } from "node:fs";
import { homedir } from "node:os";
import { dirname, isAbsolute, join } from "node:path";

import { UserError } from "./user-error.js";

/** The asset holding the SeaManifest; every other asset is a file of the folder, named by its
 * relative path with "/" separators. */
export const SEA_MANIFEST_ASSET = "kvl-sea-manifest.json";

interface SeaManifest {
  /** assetSetKey of the files: the folder is sea-KEY. */
  readonly key: string;
  /** relative path -> size in bytes: a folder with each of these at its size is complete. */
  readonly files: Readonly<Record<string, number>>;
}

/** The parts of node:sea used here (node:sea itself exists from Node 20.12). */
export interface SeaApi {
  getAsset(key: string): ArrayBuffer;
  getAsset(key: string, encoding: string): string;
}

/** A short sha256 over every file's path and contents: equal keys mean equal folders. */
export function assetSetKey(files: ReadonlyMap<string, Uint8Array>): string {
  const all = createHash("sha256");
  for (const name of [...files.keys()].sort()) {
    const data = files.get(name)!;
    all.update(`${name}\0${data.byteLength}\0${createHash("sha256").update(data).digest("hex")}\n`);
  }
  return all.digest("hex").slice(0, 16);
}

/** The user's cache folder for kvl: %LOCALAPPDATA%\kvl on Windows, else $XDG_CACHE_HOME/kvl
 * (an absolute one; the XDG spec ignores a relative value) or ~/.cache/kvl. */
export function kvlCacheDir(env: NodeJS.ProcessEnv = process.env, platform: NodeJS.Platform = process.platform): string {
  if (platform === "win32") {
    const local = env.LOCALAPPDATA;
    return join(local && isAbsolute(local) ? local : join(homedir(), "AppData", "Local"), "kvl");
  }
  const xdg = env.XDG_CACHE_HOME;
  return join(xdg && isAbsolute(xdg) ? xdg : join(homedir(), ".cache"), "kvl");
}

function complete(dir: string, manifest: SeaManifest): boolean {
  for (const [name, size] of Object.entries(manifest.files)) {
    try {
      if (statSync(join(dir, name)).size !== size) return false;
    } catch {
      return false;
    }
  }
  return true;
}

/**
 * The folder holding this executable's assets, written first if it is absent or incomplete
 * (another run may write the same folder at the same moment: whichever rename lands first wins,
 * and both are the same bytes).
 */
export function extractSeaAssets(sea: SeaApi, cacheDir: string = kvlCacheDir()): string {
  const manifest = JSON.parse(sea.getAsset(SEA_MANIFEST_ASSET, "utf8")) as SeaManifest;
  const dir = join(cacheDir, `sea-${manifest.key}`);
  if (complete(dir, manifest)) return dir;
  try {
    mkdirSync(cacheDir, { recursive: true });
    const tmp = mkdtempSync(`${dir}.partial-`);
    try {
      for (const name of Object.keys(manifest.files)) {
        const path = join(tmp, name);
        mkdirSync(dirname(path), { recursive: true });
        writeFileSync(path, new Uint8Array(sea.getAsset(name)));
      }
      // an incomplete folder under the final name (files deleted by hand) is replaced
      if (existsSync(dir) && !complete(dir, manifest)) rmSync(dir, { recursive: true, force: true });
      try {
        renameSync(tmp, dir);
      } catch (err) {
        if (!complete(dir, manifest)) throw err;
      }
    } finally {
      rmSync(tmp, { recursive: true, force: true });
    }
  } catch (err) {
    if (typeof (err as { code?: unknown }).code !== "string") throw err;
    throw new UserError(`cannot write kvl's files to ${dir} (${(err as Error).message}); ` +
      `set ${process.platform === "win32" ? "LOCALAPPDATA" : "XDG_CACHE_HOME"} to a folder you can write to`);
  }
  return dir;
}
