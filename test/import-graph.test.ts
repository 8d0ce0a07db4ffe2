/**
 * The import graph of the TypeScript sources (docs/ARCHITECTURE.md "One direction"): no module
 * imports itself back through others, host/ imports nothing of cli/, server/ or packer/, and the
 * host's wings import only the wings below them.
 */
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join, posix, relative } from "node:path";
import { fileURLToPath } from "node:url";

import { describe, expect, it } from "vitest";

const ROOT = join(dirname(fileURLToPath(import.meta.url)), "..");
const SOURCE_DIRS = ["host", "cli", "server", "packer"];

/** The wings of host/, bottom first: a wing may import its own files and the wings before it. */
const HOST_WINGS = ["system", "image", "text", "pack", "core", "plan", "engine", "bench"];

function sourceFiles(dir: string): string[] {
  return readdirSync(join(ROOT, dir), { recursive: true, encoding: "utf8" })
    .filter((f) => f.endsWith(".ts"))
    .map((f) => posix.join(dir, f.split("\\").join("/")));
}

/** Every relative module a file imports (static, type-only and dynamic), as repo paths. */
function importsOf(file: string, text: string): string[] {
  const out: string[] = [];
  for (const m of text.matchAll(/(?:\bfrom\s+|\bimport\s*\(\s*|^import\s+)"(\.\.?\/[^"]+)\.js"/gm)) {
    out.push(posix.normalize(posix.join(posix.dirname(file), m[1]!)) + ".ts");
  }
  return out;
}

const files = SOURCE_DIRS.flatMap(sourceFiles);
const graph = new Map(files.map((f) => [f, importsOf(f, readFileSync(join(ROOT, f), "utf8"))]));

/** The cycles of the graph, each as its path of files (Tarjan's components of more than one file). */
function cycles(g: Map<string, string[]>): string[][] {
  let next = 0;
  const index = new Map<string, number>();
  const low = new Map<string, number>();
  const stack: string[] = [];
  const onStack = new Set<string>();
  const found: string[][] = [];
  const visit = (v: string): void => {
    index.set(v, next);
    low.set(v, next++);
    stack.push(v);
    onStack.add(v);
    for (const w of g.get(v) ?? []) {
      if (!index.has(w)) {
        visit(w);
        low.set(v, Math.min(low.get(v)!, low.get(w)!));
      } else if (onStack.has(w)) low.set(v, Math.min(low.get(v)!, index.get(w)!));
    }
    if (low.get(v) === index.get(v)) {
      const comp: string[] = [];
      let w: string;
      do {
        w = stack.pop()!;
        onStack.delete(w);
        comp.push(w);
      } while (w !== v);
      if (comp.length > 1 || (g.get(v) ?? []).includes(v)) found.push(comp.sort());
    }
  };
  for (const v of g.keys()) if (!index.has(v)) visit(v);
  return found;
}

const wingOf = (file: string): string | null => {
  const m = /^host\/([^/]+)\//.exec(file);
  return m ? m[1]! : null;
};

describe("import graph", () => {
  it("finds the imports of every source file (the parser sees real edges)", () => {
    // known edges, so that a parser that finds nothing cannot pass the tests below
    expect(graph.get("host/chat-model.ts")).toContain("host/plan/planner.ts");
    expect(graph.get("cli/kvl.ts")?.length).toBeGreaterThan(0);
    expect(cycles(new Map([["a", ["b"]], ["b", ["a"]], ["c", ["a"]]]))).toEqual([["a", "b"]]);
  });

  it("has no cycle", () => {
    expect(cycles(graph)).toEqual([]);
  });

  it("every import resolves to a source file", () => {
    const missing = [...graph].flatMap(([f, deps]) => deps.filter((d) => !graph.has(d)).map((d) => `${f} -> ${d}`));
    expect(missing).toEqual([]);
  });

  it("host/ imports nothing of cli/, server/ or packer/", () => {
    const out = [...graph]
      .filter(([f]) => f.startsWith("host/"))
      .flatMap(([f, deps]) => deps.filter((d) => !d.startsWith("host/")).map((d) => `${f} -> ${d}`));
    expect(out).toEqual([]);
  });

  it("each wing of host/ imports only itself and the wings below it; only chat-model.ts sits on top", () => {
    const topLevel = files.filter((f) => f.startsWith("host/") && wingOf(f) === null);
    expect(topLevel).toEqual(["host/chat-model.ts"]);
    const wings = new Set(files.map(wingOf).filter((w): w is string => w !== null));
    expect([...wings].sort()).toEqual([...HOST_WINGS].sort());
    const upward = [...graph].flatMap(([f, deps]) => {
      const from = wingOf(f);
      if (from === null) return [];
      return deps.filter((d) => {
        const to = wingOf(d);
        return to === null || HOST_WINGS.indexOf(to) > HOST_WINGS.indexOf(from);
      }).map((d) => `${relative(ROOT, join(ROOT, f))} -> ${d}`);
    });
    expect(upward).toEqual([]);
  });
});
