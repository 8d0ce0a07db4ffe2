/**
 * utf8-mask.ts — which tokens keep a reply valid UTF-8, per decoder state: the second mask of a
 * constrained reply, beside the grammar's.
 *
 * Why: tiktoken tokens are bytes, and xgrammar's character classes let through byte sequences
 * that are not UTF-8 (4-byte lead bytes F5-F7, encoded surrogates, stray continuation bytes;
 * seen on the tiny model in 10 of 20 seeds under a maxLength string). A decoder turns each such
 * byte into U+FFFD, so a string grew past its maxLength. Masking them keeps every constrained
 * reply valid UTF-8, which is also what JSON text must be.
 * Owns: the UTF-8 decoder's states (at a character boundary, or inside one with what the next
 * byte may be), each token's validity and end state from every state (tables built once per
 * vocabulary: ~1.3 MB), and the state of one reply. An empty token (a special id: the stop ids
 * among them) is allowed only at a character boundary, so a reply never ends mid-character.
 */

/** Decoder states: 0 = at a boundary; others = inside a character, by what the next byte may be. */
const enum S {
  Boundary = 0,
  Need1 = 1, // one 80-BF byte left
  Need2 = 2, // two 80-BF bytes left
  Need3 = 3, // three 80-BF bytes left
  E0 = 4, // after E0: A0-BF, then one more
  ED = 5, // after ED: 80-9F, then one more (no surrogates)
  F0 = 6, // after F0: 90-BF, then two more
  F4 = 7, // after F4: 80-8F, then two more (nothing above U+10FFFF)
}
export const UTF8_STATES = 8;
const INVALID = 255;

/** The state after byte b in state s, or INVALID. */
function step(s: number, b: number): number {
  const cont = b >= 0x80 && b <= 0xbf;
  switch (s) {
    case S.Boundary:
      if (b < 0x80) return S.Boundary;
      if (b >= 0xc2 && b <= 0xdf) return S.Need1;
      if (b === 0xe0) return S.E0;
      if (b === 0xed) return S.ED;
      if (b >= 0xe1 && b <= 0xef) return S.Need2;
      if (b === 0xf0) return S.F0;
      if (b >= 0xf1 && b <= 0xf3) return S.Need3;
      if (b === 0xf4) return S.F4;
      return INVALID;
    case S.Need1:
      return cont ? S.Boundary : INVALID;
    case S.Need2:
      return cont ? S.Need1 : INVALID;
    case S.Need3:
      return cont ? S.Need2 : INVALID;
    case S.E0:
      return b >= 0xa0 && b <= 0xbf ? S.Need1 : INVALID;
    case S.ED:
      return b >= 0x80 && b <= 0x9f ? S.Need1 : INVALID;
    case S.F0:
      return b >= 0x90 && b <= 0xbf ? S.Need2 : INVALID;
    case S.F4:
      return b >= 0x80 && b <= 0x8f ? S.Need2 : INVALID;
    default:
      return INVALID;
  }
}

export class Utf8Tables {
  /** allowed[s]: bitmask (bit id%32 of word id/32) of the tokens valid from state s. */
  readonly allowed: Int32Array[];
  /** next[s][id]: the state after token id from state s (INVALID where not allowed). */
  readonly next: Uint8Array[];

  constructor(tokens: ReadonlyArray<Uint8Array>) {
    const n = tokens.length;
    const words = Math.ceil(n / 32);
    this.allowed = [];
    this.next = [];
    for (let s0 = 0; s0 < UTF8_STATES; s0++) {
      const allowed = new Int32Array(words);
      const next = new Uint8Array(n).fill(INVALID);
      for (let id = 0; id < n; id++) {
        const bytes = tokens[id]!;
        if (bytes.length === 0 && s0 !== S.Boundary) continue;
        let s = s0;
        for (let i = 0; i < bytes.length && s !== INVALID; i++) s = step(s, bytes[i]!);
        if (s === INVALID) continue;
        next[id] = s;
        allowed[id >>> 5]! |= 1 << (id & 31);
      }
      this.allowed.push(allowed);
      this.next.push(next);
    }
  }
}

/** One reply's decoder state. */
export class Utf8State {
  state: number = S.Boundary;

  constructor(readonly tables: Utf8Tables) {}

  get mask(): Int32Array {
    return this.tables.allowed[this.state]!;
  }

  accept(token: number): void {
    const s = this.tables.next[this.state]![token];
    if (s === undefined || s === INVALID) throw new Error(`token ${token} breaks UTF-8, which its own mask allowed`);
    this.state = s;
  }
}
