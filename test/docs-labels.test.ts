/**
 * Figures are labelled by date, commit and machine, never by a work session's or a run's number
 * (issue 28 item 6): "session 12", "r8", "run r11" or "(session 9)" mean nothing to a reader who
 * was not there. Scanned: every Markdown file (README.md, bench/RESULTS.md, docs/, ...) whole, and
 * the comments of every source (TypeScript, JavaScript, C, shell, Python, PowerShell). How a figure
 * is labelled instead: bench/RESULTS.md, its opening paragraphs.
 */
import { closeSync, openSync, readdirSync, readFileSync, readSync } from "node:fs";
import { extname, join, posix } from "node:path";

import { describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

/** Folders never scanned: dependencies, build output (wasm-core/dist is emscripten's), tools. */
const SKIP_DIRS = new Set([".git", "node_modules", "dist", "build", ".venv", "__pycache__"]);
/** This file, whose examples are labels. */
const SELF = "test/docs-labels.test.ts";
const SLASH_COMMENTS = new Set([".ts", ".mjs", ".cjs", ".js", ".c", ".h"]);
const HASH_COMMENTS = new Set([".sh", ".py", ".ps1"]);

type Kind = "markdown" | "slash" | "hash";

/** Labels in any text: "session 12", "Session 4", "sessions 1-15", "session-8"; "run r11"; a run
 * number used as a name ("runs 1 and 2", "run 3)"), not a count ("run 1 thread", "runs 16-wide",
 * "runs 0.132", "killed run 1078132736"). */
const LABELS: readonly RegExp[] = [
  /\bsessions?[ -]\d+/gi,
  /\bruns? r\d+\b/gi,
  /\bruns? \d{1,3}(?![\d.,]\d)(?=\s*(?:[,;:)/]|\.(?!\d)|and\b|$))/gim,
];
/** Markdown has no variables: any bare "r8", "(r11)", "/tmp/kvl-bench/r8" is a run's name. */
const MARKDOWN_RUN = /\br\d+\b/g;
/** In a comment "r1" is mostly an index ("r0 + i", "W[r1]", "(r0, r1, r2)"): a run's name is one
 * after a word of prose ("in r8", "since r6") or alone in brackets ("(r11)"). */
const COMMENT_RUN = /\b(?:runs?|in|at|from|since|before|after|than|then|see) r\d+\b(?![[(])|\(r\d+\)/gi;

function kindOf(path: string): Kind | null {
  const ext = extname(path);
  if (ext === ".md") return "markdown";
  if (SLASH_COMMENTS.has(ext)) return "slash";
  if (HASH_COMMENTS.has(ext)) return "hash";
  if (ext !== "") return null;
  // scripts without an extension (scripts/test, .ci/run): shell, if they start with "#!"
  const fd = openSync(join(packageRoot, path), "r");
  const head = Buffer.alloc(2);
  readSync(fd, head, 0, 2, 0);
  closeSync(fd);
  return head.toString("latin1") === "#!" ? "hash" : null;
}

/** Every scanned file, as a repo path with forward slashes. */
function scannedFiles(dir = ""): { path: string; kind: Kind }[] {
  const out: { path: string; kind: Kind }[] = [];
  for (const e of readdirSync(join(packageRoot, dir), { withFileTypes: true })) {
    const path = dir === "" ? e.name : posix.join(dir, e.name);
    if (e.isDirectory()) {
      if (!SKIP_DIRS.has(e.name) && !e.name.startsWith("build-")) out.push(...scannedFiles(path));
    } else if (e.isFile()) {
      const kind = path === SELF ? null : kindOf(path);
      if (kind) out.push({ path, kind });
    }
  }
  return out;
}

/** The parts of a file a label must not be in, each with its offset in the file. */
function scannedSpans(text: string, kind: Kind): { at: number; text: string }[] {
  if (kind === "markdown") return [{ at: 0, text }];
  // a "//" or "/*" inside a string makes a span of code too: harmless, the labels are prose
  const comment = kind === "slash" ? /\/\*[\s\S]*?\*\/|\/\/[^\n]*/g : /"""[\s\S]*?"""|#[^\n]*/g;
  return [...text.matchAll(comment)].map((m) => ({ at: m.index, text: m[0] }));
}

/** Each label in a text, with its offset. */
function labelsIn(text: string, kind: Kind): { at: number; label: string }[] {
  const patterns = [...LABELS, kind === "markdown" ? MARKDOWN_RUN : COMMENT_RUN];
  return patterns.flatMap((re) => [...text.matchAll(re)].map((m) => ({ at: m.index, label: m[0] })));
}

/** "path:line: the line" for each label in a file. */
function labelledLines(path: string, kind: Kind): string[] {
  const text = readFileSync(join(packageRoot, path), "utf8");
  const lines = text.split("\n");
  const found = new Set<number>();
  for (const span of scannedSpans(text, kind)) {
    for (const { at } of labelsIn(span.text, kind)) {
      found.add(text.slice(0, span.at + at).split("\n").length);
    }
  }
  return [...found].sort((a, b) => a - b).map((n) => `${path}:${n}: ${lines[n - 1]!.trim()}`);
}

const labels = (text: string, kind: Kind): string[] =>
  scannedSpans(text, kind).flatMap((s) => labelsIn(s.text, kind).map((l) => l.label));

describe("figures are labelled by date, commit and machine", () => {
  it("the scanner sees the labels and passes counts and indices", () => {
    for (const text of [
      "as measured in (session 9)", "Session 4, 2026-12-02", "the fixed cache of sessions 1-15",
      "the session-8 block", "0.99 in run r11 at the final commit", "Run r8 at commit",
      "0.88 (r1)", "bench/run_all.sh PACK /tmp/kvl-bench/r8", "a, r1 / r2:", "runs 1 and 2",
      "WebAssembly run 1 / 2", "moved in run 12.",
    ]) {
      expect(labels(text, "markdown"), text).not.toEqual([]);
    }
    for (const text of [
      "WebAssembly can run 1 thread", "native runs 16-wide AVX-512 FMA", "median of runs 0.132",
      "killed run 1078132736 (4390912 not in the .part)", "f32 and i16x1", "run 2 instances",
      "the session's KV cache", "in this session",
    ]) {
      expect(labels(text, "markdown"), text).toEqual([]);
    }
    expect(labels("/* 13 against 28 GB/s, session 14 */", "slash")).toEqual(["session 14"]);
    expect(labels("x = 1; // as in r8 above", "slash")).toEqual(["in r8"]);
    expect(labels("/* the final figure (r11) */", "slash")).toEqual(["(r11)"]);
    expect(labels("# CACHE_MIB=512 for sessions 1-15\nrun 2", "hash")).toEqual(["sessions 1"]);
    for (const code of [
      "/* Y[t*ldy + r0 + i] = sum_c W[r0+i, c] */", "// calls go (r0, r1, r2) per chunk",
      "/* lane i = row r0 + i */", "cpuid(7, 0, r7); /* bit 5 in r7[1] */", "const r1 = 3; // session-free",
    ]) {
      expect(labels(code, "slash"), code).toEqual([]);
    }
  });

  it("scans the docs and the sources", () => {
    const files = new Map(scannedFiles().map((f) => [f.path, f.kind]));
    expect(files.get("README.md")).toBe("markdown");
    expect(files.get("bench/RESULTS.md")).toBe("markdown");
    expect(files.get("docs/ARCHITECTURE.md")).toBe("markdown");
    expect(files.get("host/core/huge-pages.ts")).toBe("slash");
    expect(files.get("wasm-core/src/threadpool.c")).toBe("slash");
    expect(files.get("bench/run_all.sh")).toBe("hash");
    expect(files.get("scripts/test")).toBe("hash");
    expect(files.has("wasm-core/dist/kvl_core.cjs")).toBe(false);
    expect(files.has(SELF)).toBe(false);
    expect([...files.keys()].some((p) => p.startsWith("node_modules/"))).toBe(false);
  });

  it("no Markdown file or source comment names a session or a run by its number", () => {
    const found = scannedFiles().flatMap((f) => labelledLines(f.path, f.kind));
    expect(found, "label these by date, commit and machine, or by their bench/RESULTS.md section").toEqual([]);
  });
});
