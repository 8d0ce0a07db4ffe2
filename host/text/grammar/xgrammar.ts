/**
 * xgrammar.ts — the grammar engine, `@mlc-ai/web-xgrammar` (xgrammar's WebAssembly build), loaded
 * once per thread; the one place that knows how.
 *
 * Owns: loading its UMD bundle (an ES module package whose one file is a UMD script that needs
 * `require` and `__filename`: run here as CommonJS), the typed surface kvl uses, and what happens when xgrammar
 * fails: its C++ checks end in an emscripten abort that leaves the instance unusable, so the
 * message it printed (`[FATAL] …: Check failed: …`) is captured and the instance is dropped —
 * the next call loads a fresh one. Callers check schemas first (schema-check.ts), so an abort is
 * the exception, not the way errors are found.
 * Does not own: vocabularies (vocabulary.ts), masks (token-mask.ts), what a schema may hold
 * (schema-check.ts).
 */
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";

import { packageRoot } from "../../system/paths.js";

/** The parts of xgrammar's API kvl calls (lib/xgrammar.d.ts of 0.1.27). */
export interface XgTokenizerInfo {
  getVocabSize(): number;
  dispose(): void;
}
export interface XgCompiledGrammar {
  dispose(): void;
}
export interface XgGrammar {
  dispose(): void;
}
export interface XgMatcher {
  acceptToken(id: number): boolean;
  getNextTokenBitmask(): Promise<Int32Array>;
  isTerminated(): boolean;
  dispose(): void;
}
export interface XgCompiler {
  compileGrammar(ebnf: string, rootRule?: string): Promise<XgCompiledGrammar>;
  compileStructuralTag(tag: unknown): Promise<XgCompiledGrammar>;
  dispose(): void;
}
export interface XGrammar {
  TokenizerInfo: {
    createTokenizerInfo(vocab: string[], vocabType: string, prependSpace: boolean, vocabSize: number, stopIds: number[]): Promise<XgTokenizerInfo>;
  };
  GrammarCompiler: { createGrammarCompiler(info: XgTokenizerInfo, cache?: boolean): Promise<XgCompiler> };
  GrammarMatcher: { createGrammarMatcher(grammar: XgCompiledGrammar, stopIds?: number[], terminateWithoutStop?: boolean): Promise<XgMatcher> };
  Grammar: {
    fromEBNF(ebnf: string, rootRule?: string): Promise<XgGrammar>;
    fromStructuralTag(tag: unknown): Promise<XgGrammar>;
  };
  Testings: {
    _jsonSchemaToEBNF(schema: string, anyWhitespace?: boolean, indent?: number, separators?: [string, string], strict?: boolean): Promise<string>;
  };
}

/** xgrammar refused its input (its own check failed); the instance it ran in is gone. */
export class GrammarEngineError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "GrammarEngineError";
  }
}

let current: Promise<XGrammar> | null = null;

const DYNAMIC_IMPORT = "await import('module')";
/** What xgrammar printed to its console.error since the last guarded call began. */
const printed: string[] = [];

async function load(): Promise<XGrammar> {
  const file = createRequire(join(packageRoot, "package.json")).resolve("@mlc-ai/web-xgrammar");
  // Run as CommonJS with our own `exports`, `require` and `__filename`: the bundle's own
  // CommonJS branch, whatever the host (an `import` lands on globalThis in Node but on the
  // module runner's exports under vitest's runner), no global touched, and each run a fresh
  // instance. Its one dynamic import (node:module, for createRequire) is handed in: code made by
  // new Function has no module loader to import with under every host.
  const code = readFileSync(file, "utf8");
  const parts = code.split(DYNAMIC_IMPORT);
  if (parts.length !== 2) throw new Error(`${file}: expected one ${DYNAMIC_IMPORT} in xgrammar's bundle, found ${parts.length - 1}; is it still version 0.1.27?`);
  const exports: Record<string, unknown> = {};
  // its own console: emscripten binds console.error when the instance starts, and what xgrammar
  // prints there (a failed check's reason, right before it aborts) is kept for guarded()
  const quiet = { ...console, error: (...args: unknown[]) => printed.push(args.map(String).join(" ")) };
  const run = new Function("exports", "module", "require", "__filename", "__dirname", "__nodeModule", "console", parts.join("__nodeModule")) as
    (e: object, m: object, r: NodeJS.Require, f: string, d: string, nodeModule: object, c: Console) => void;
  run(exports, { exports }, createRequire(file), file, dirname(file), await import("node:module"), quiet);
  const xg = exports as unknown as XGrammar;
  await xg.Grammar.fromEBNF('root ::= "a"').then((gr) => gr.dispose()); // starts its WebAssembly now
  return xg;
}

/** The thread's xgrammar (loaded on first use). */
export function xgrammar(): Promise<XGrammar> {
  current ??= load();
  return current;
}

/** Forgets the current instance: after an abort nothing in it can be used again. */
export function dropXGrammar(): void {
  current = null;
}

/**
 * Runs one xgrammar call; an abort becomes a GrammarEngineError with xgrammar's own check
 * message (what it printed, kept from the terminal by its own console) and the instance is dropped, so
 * `onDrop` can forget everything made in it.
 */
export async function guarded<T>(call: () => Promise<T>, onDrop: () => void = () => undefined): Promise<T> {
  printed.length = 0;
  try {
    return await call();
  } catch (err) {
    if (!(err instanceof Error) || !/Aborted\(/.test(err.message)) throw err;
    dropXGrammar();
    onDrop();
    const fatal = printed.find((l) => l.includes("[FATAL]")) ?? printed[0] ?? err.message;
    throw new GrammarEngineError(fatal.replace(/^\[FATAL\][^:]*:\d+:\s*/, "").replace(/^Check failed: .*? is false: /, "").trim());
  }
}
