/**
 * token-mask.ts — constrained decoding in the engine worker: a grammar's next-token mask applied
 * to the logits before sampling (greedy or sampled alike: a masked id is -inf).
 *
 * Owns: the vocabulary given to xgrammar once per model (lazily, on the first constrained reply:
 * ~0.2 s for 163,840 ids), compiled grammars cached by their spec (the last COMPILED_KEPT), and
 * TokenMask, one reply's matcher: the mask before each sample, each sampled token fed back.
 * Everything here lives in the worker's own xgrammar instance; after an xgrammar abort it is all
 * rebuilt on the next use.
 * Does not own: the token loop (host/engine/generation.ts), what a spec means (grammar-spec.ts).
 */
import { type GrammarSpec, grammarKey, grammarSource } from "./grammar-spec.js";
import { Utf8State, Utf8Tables } from "./utf8-mask.js";
import { byteLevelVocabulary, vocabularyBytes } from "./vocabulary.js";
import { type XgCompiledGrammar, type XgCompiler, type XgMatcher, type XgTokenizerInfo, guarded, xgrammar } from "./xgrammar.js";

/** Compiled grammars kept per model: a server's clients tend to resend the same few schemas. */
const COMPILED_KEPT = 32;

/** One reply's grammar state: xgrammar's matcher and the UTF-8 decoder's (utf8-mask.ts). */
export class TokenMask {
  constructor(readonly matcher: XgMatcher, readonly utf8: Utf8State) {}

  /** Sets every id the grammar does not allow next, or that would break UTF-8, to -inf. */
  async apply(logits: Float32Array): Promise<void> {
    const mask = await this.matcher.getNextTokenBitmask();
    const utf8 = this.utf8.mask;
    let any = 0;
    for (let w = 0; w < mask.length; w++) any |= mask[w]! & (utf8[w] ?? 0);
    // never both masks empty together: should the grammar allow only bytes that are not UTF-8,
    // its own mask wins (the grammar's guarantee is the one a client relies on)
    if (any !== 0) for (let w = 0; w < mask.length; w++) mask[w]! &= utf8[w] ?? 0;
    applyBitmask(mask, logits);
  }

  /** The sampled token moves the grammar on; a token the mask did not allow is a bug. */
  accept(token: number): void {
    if (!this.matcher.acceptToken(token)) throw new Error(`the grammar refused token ${token}, which its own mask allowed`);
    try {
      this.utf8.accept(token);
    } catch {
      this.utf8.state = 0; // only after the fallback above: resynchronise at a boundary
    }
  }

  dispose(): void {
    this.matcher.dispose();
  }
}

/** xgrammar's bitmask (bit id%32 of word id/32 set = allowed) applied to logits. */
export function applyBitmask(mask: Int32Array, logits: Float32Array): void {
  const n = logits.length;
  for (let w = 0; w < mask.length; w++) {
    const word = mask[w]!;
    if (word === -1) continue; // all 32 allowed: the common case inside free text
    const base = w * 32;
    if (word === 0) {
      logits.fill(-Infinity, base, Math.min(base + 32, n)); // none allowed: most words between JSON tokens
      continue;
    }
    for (let b = 0; b < 32; b++) {
      const id = base + b;
      if (id < n && ((word >>> b) & 1) === 0) logits[id] = -Infinity;
    }
  }
  for (let id = mask.length * 32; id < n; id++) logits[id] = -Infinity;
}

export class GrammarEngine {
  #model: Promise<{ info: XgTokenizerInfo; compiler: XgCompiler; utf8: Utf8Tables }> | null = null;
  readonly #compiled = new Map<string, Promise<XgCompiledGrammar>>();

  /** @param vocabSize the logits' length */
  constructor(readonly modelDir: string, readonly vocabSize: number) {}

  #forget = (): void => {
    this.#model = null;
    this.#compiled.clear();
  };

  #tokenizer(): Promise<{ info: XgTokenizerInfo; compiler: XgCompiler; utf8: Utf8Tables }> {
    this.#model ??= (async () => {
      const xg = await xgrammar();
      const tokens = vocabularyBytes(this.modelDir, this.vocabSize);
      const utf8 = new Utf8Tables(tokens);
      const vocab = byteLevelVocabulary(tokens);
      const info = await guarded(() => xg.TokenizerInfo.createTokenizerInfo(vocab, "byte_level", false, this.vocabSize, []), this.#forget);
      const compiler = await guarded(() => xg.GrammarCompiler.createGrammarCompiler(info, true), this.#forget);
      return { info, compiler, utf8 };
    })();
    const pending = this.#model;
    pending.catch(() => {
      if (this.#model === pending) this.#model = null;
    });
    return pending;
  }

  #compile(spec: GrammarSpec): Promise<XgCompiledGrammar> {
    const key = grammarKey(spec);
    const hit = this.#compiled.get(key);
    if (hit) {
      this.#compiled.delete(key); // most recent last
      this.#compiled.set(key, hit);
      return hit;
    }
    const pending = (async () => {
      const { compiler } = await this.#tokenizer();
      const xg = await xgrammar();
      const source = await grammarSource(xg, spec);
      return guarded(() => ("ebnf" in source ? compiler.compileGrammar(source.ebnf, "root") : compiler.compileStructuralTag(source.structuralTag)), this.#forget);
    })();
    this.#compiled.set(key, pending);
    pending.catch(() => this.#compiled.delete(key));
    while (this.#compiled.size > COMPILED_KEPT) {
      const oldest = this.#compiled.keys().next().value!;
      void this.#compiled.get(oldest)!.then((g) => g.dispose(), () => undefined);
      this.#compiled.delete(oldest);
    }
    return pending;
  }

  /** A fresh matcher for one reply; `stopIds` are the only ids that may end it. */
  async constrain(spec: GrammarSpec, stopIds: readonly number[]): Promise<TokenMask> {
    const compiled = await this.#compile(spec);
    const { utf8 } = await this.#tokenizer();
    const xg = await xgrammar();
    const matcher = await guarded(() => xg.GrammarMatcher.createGrammarMatcher(compiled, [...stopIds], false), this.#forget);
    return new TokenMask(matcher, new Utf8State(utf8));
  }
}
