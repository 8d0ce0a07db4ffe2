/**
 * docs/ARCHITECTURE.md is a true map (issue 28 item 5): it names every file of host/ (all wings)
 * and of wasm-core/src, and every such name in it is a file that exists. A file is named by its
 * path in backticks: `host/plan/planner.ts` or, inside the host/ table, `plan/planner.ts`;
 * `wasm-core/src/store.c` or `src/store.c`. Braces group names: `src/trunk.{h,c}`.
 */
import { readdirSync, readFileSync } from "node:fs";
import { join, posix } from "node:path";

import { describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

const DOC = "docs/ARCHITECTURE.md";
/** The folders mapped, each with the prefix its files may be named without. */
const MAPPED = [
  { dir: "host", short: "host/" },
  { dir: "wasm-core/src", short: "wasm-core/" },
];

/** Every file under a folder of the repo, as repo paths with forward slashes. */
function filesUnder(dir: string): string[] {
  return readdirSync(join(packageRoot, dir), { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => posix.join(posix.relative(packageRoot.split("\\").join("/"), e.parentPath.split("\\").join("/")), e.name))
    .sort();
}

/** `a.{h,c}` -> a.h, a.c (one group per name is all the page uses). */
function expandBraces(name: string): string[] {
  const m = /^(.*)\{([^{}]*)\}(.*)$/.exec(name);
  return m ? m[2]!.split(",").flatMap((part) => expandBraces(`${m[1]}${part.trim()}${m[3]}`)) : [name];
}

/** Every name in backticks in a Markdown text, braces expanded. */
function backticked(text: string): Set<string> {
  return new Set([...text.matchAll(/`([^`\n]+)`/g)].flatMap((m) => expandBraces(m[1]!.trim())));
}

/** The repo paths a name may stand for: itself, or a mapped folder's short form completed. */
function candidates(name: string): string[] {
  return MAPPED.map(({ dir, short }) => (name.startsWith(`${dir}/`) ? name : `${short}${name}`))
    .filter((full, i) => full.startsWith(`${MAPPED[i]!.dir}/`));
}

/** The files of the mapped folders the text does not name. */
function unnamed(text: string, files: readonly string[]): string[] {
  const named = new Set([...backticked(text)].flatMap(candidates));
  return files.filter((f) => !named.has(f));
}

/** Names in the text that can only mean a file of the mapped folders, yet are none: a full path
 * (`host/...`, `wasm-core/src/...`), `WING/x.ts` for a wing of host/, or `src/x.c` / `src/x.h`. */
function stale(text: string, files: readonly string[]): string[] {
  const exists = new Set(files);
  const hostWings = new Set(files.filter((f) => f.split("/").length > 2 && f.startsWith("host/")).map((f) => f.split("/")[1]!));
  const looksMapped = (name: string): boolean =>
    (/^(host|wasm-core\/src)\/[\w./-]+\.\w+$/.test(name)) || /^src\/[\w.-]+\.[ch]$/.test(name) ||
    (/^[\w-]+\/[\w.-]+\.ts$/.test(name) && hostWings.has(name.split("/")[0]!));
  return [...backticked(text)].filter((name) => looksMapped(name) && !candidates(name).some((c) => exists.has(c)));
}

const files = MAPPED.flatMap(({ dir }) => filesUnder(dir));
const doc = readFileSync(join(packageRoot, DOC), "utf8");

describe("docs/ARCHITECTURE.md names every file of host/ and wasm-core/src", () => {
  it("sees the files and the names (a checker that finds nothing cannot pass below)", () => {
    expect(files).toContain("host/chat-model.ts");
    expect(files).toContain("host/plan/planner.ts");
    expect(files).toContain("wasm-core/src/engine.c");
    expect(files.some((f) => f.startsWith("host/") && f.endsWith(".ts"))).toBe(true);
    const text = "`plan/planner.ts` and `host/chat-model.ts`, `src/trunk.{h,c}`, `wasm-core/src/engine.c`";
    expect(unnamed(text, ["host/plan/planner.ts", "host/chat-model.ts", "wasm-core/src/trunk.h",
      "wasm-core/src/trunk.c", "wasm-core/src/engine.c", "host/core/cpu.ts"])).toEqual(["host/core/cpu.ts"]);
    expect(stale("`plan/gone.ts`, `src/gone.c`, `server/app.ts`, `wasm-core/src/x.h`", ["host/plan/planner.ts"]))
      .toEqual(["plan/gone.ts", "src/gone.c", "wasm-core/src/x.h"]);
  });

  it("names every file", () => {
    expect(unnamed(doc, files), `name each in ${DOC}, one line per file or small group`).toEqual([]);
  });

  it("names no file of those folders that does not exist", () => {
    expect(stale(doc, files), `${DOC} names files that moved or were deleted`).toEqual([]);
  });
});
