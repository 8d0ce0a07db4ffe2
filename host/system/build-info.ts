/**
 * build-info.ts — which build of kvl this is: the package version and the commit it was built
 * from. An npm package and a single executable carry dist/build-info.json (written by
 * scripts/write-build-info.mjs when they are made: npm pack's prepack, build-exe); a git checkout
 * asks git.
 *
 * Owns: reading those two figures. Does not own: the backend (backend.ts) or printing them
 * (cli/program.ts: kvl --version).
 */
import { spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";

import { packageRoot } from "./paths.js";

export interface BuildInfo {
  readonly version: string;
  /** The commit (12 hex digits, "+dirty" when built from changed files), or null when unknown. */
  readonly commit: string | null;
}

export const BUILD_INFO_FILE = join("dist", "build-info.json");

export function readBuildInfo(root: string = packageRoot): BuildInfo {
  const { version } = JSON.parse(readFileSync(join(root, "package.json"), "utf8")) as { version: string };
  try {
    const recorded = JSON.parse(readFileSync(join(root, BUILD_INFO_FILE), "utf8")) as { commit?: unknown };
    if (typeof recorded.commit === "string") return { version, commit: recorded.commit };
  } catch {
    // no record: a checkout, asked below
  }
  if (!existsSync(join(root, ".git"))) return { version, commit: null };
  const r = spawnSync("git", ["-C", root, "rev-parse", "--short=12", "HEAD"], { encoding: "utf8" });
  return { version, commit: r.status === 0 ? r.stdout.trim() : null };
}
