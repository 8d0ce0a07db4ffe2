#!/usr/bin/env node
// write-build-info.mjs — records the commit a package or executable is built from in
// dist/build-info.json (host/system/build-info.ts reads it: kvl --version). Run by npm pack's
// prepack and by scripts/build-exe.mjs; "+dirty" marks a build from uncommitted changes.
//   node scripts/write-build-info.mjs [OUT]     (default dist/build-info.json)
import { spawnSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const out = resolve(process.argv[2] ?? join(ROOT, "dist", "build-info.json"));
const git = (args) => spawnSync("git", ["-C", ROOT, ...args], { encoding: "utf8" });
const head = git(["rev-parse", "--short=12", "HEAD"]);
const dirty = git(["status", "--porcelain", "--untracked-files=no"]).stdout.trim() !== "";
const commit = head.status === 0 ? `${head.stdout.trim()}${dirty ? "+dirty" : ""}` : null;
mkdirSync(dirname(out), { recursive: true });
writeFileSync(out, `${JSON.stringify({ commit }, null, 2)}\n`);
console.log(`${out}: commit ${commit ?? "unknown"}`);
