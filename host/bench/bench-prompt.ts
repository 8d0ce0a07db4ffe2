/**
 * bench-prompt.ts — the random prompts of `kvl bench`: numpy's draws, so a seed names the same
 * prompt on every machine and in every bench/RESULTS.md figure, the earlier Python bench's included.
 *
 * Owns: randomPrompt(vocab, n, seed, avoid), bit for bit numpy's
 * `default_rng(seed).integers(0, vocab, size=n, dtype=int64)` (SeedSequence → PCG64 XSL-RR →
 * Lemire's bounded 32-bit draw, numpy's own order of 32-bit halves), then each avoided id replaced
 * by (id + 1) % vocab. Identical prompts route to the same experts, so two runs of the same
 * settings read the same bytes and differ in time only. Does not own: what the prompt is used for
 * (bench-run.ts).
 */
import { seedSequenceState } from "../core/seed-sequence.js";

const MASK32 = 0xffffffffn;
const MASK64 = (1n << 64n) - 1n;
const MASK128 = (1n << 128n) - 1n;

// PCG_DEFAULT_MULTIPLIER_128 (numpy/random/src/pcg64/pcg64.h)
const PCG_MULT = (2549297995355413924n << 64n) + 4865540595714422341n;

/** numpy's PCG64 bit generator with its next_uint32 buffering (low half first). */
class Pcg64 {
  #state: bigint;
  readonly #inc: bigint;
  #half: number | null = null;

  constructor(seed: bigint) {
    const words = seedSequenceState(seed); // generate_state(4, uint64)
    const [s0, s1, i0, i1] = [words[0]!, words[1]!, words[2]!, words[3]!];
    const initState = (s0 << 64n) | s1;
    const initSeq = (i0 << 64n) | i1;
    this.#inc = ((initSeq << 1n) | 1n) & MASK128;
    this.#state = 0n;
    this.#step();
    this.#state = (this.#state + initState) & MASK128;
    this.#step();
  }

  #step(): void {
    this.#state = (this.#state * PCG_MULT + this.#inc) & MASK128;
  }

  next64(): bigint {
    this.#step();
    const s = this.#state;
    const x = ((s >> 64n) ^ s) & MASK64;
    const rot = Number(s >> 122n);
    return ((x >> BigInt(rot)) | (x << BigInt((64 - rot) & 63))) & MASK64;
  }

  next32(): number {
    if (this.#half !== null) {
      const out = this.#half;
      this.#half = null;
      return out;
    }
    const v = this.next64();
    this.#half = Number(v >> 32n);
    return Number(v & MASK32);
  }
}

/**
 * n token ids uniform over [0, vocab) without the avoided ids (the media placeholder needs
 * media), as numpy's default_rng(seed).integers draws them (vocab up to 2^32 - 1).
 */
export function randomPrompt(vocab: number, n: number, seed: number, avoid: Iterable<number> = []): Int32Array {
  if (!Number.isInteger(vocab) || vocab < 1 || vocab > 0xffffffff) throw new RangeError(`vocab must be in 1..2^32-1, got ${vocab}`);
  if (!Number.isInteger(n) || n < 0) throw new RangeError(`prompt length must be a non-negative integer, got ${n}`);
  if (!Number.isSafeInteger(seed) || seed < 0) throw new RangeError(`seed must be a non-negative integer, got ${seed}`);
  const rng = new Pcg64(BigInt(seed));
  const out = new Float64Array(n);
  const range = vocab - 1; // numpy: high - low - 1 (exclusive high)
  if (range > 0) {
    // random_bounded_uint64_fill -> buffered_bounded_lemire_uint32
    const excl = BigInt(vocab);
    const threshold = Number((MASK32 - BigInt(range)) % excl);
    for (let i = 0; i < n; i++) {
      let m = BigInt(rng.next32()) * excl;
      let leftover = Number(m & MASK32);
      if (leftover < vocab) {
        while (leftover < threshold) {
          m = BigInt(rng.next32()) * excl;
          leftover = Number(m & MASK32);
        }
      }
      out[i] = Number(m >> 32n);
    }
  }
  for (const bad of avoid) {
    for (let i = 0; i < n; i++) if (out[i] === bad) out[i] = (bad + 1) % vocab;
  }
  return Int32Array.from(out);
}
