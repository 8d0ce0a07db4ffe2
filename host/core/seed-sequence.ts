/**
 * seed-sequence.ts — numpy's SeedSequence, enough of it to seed PCG64: how `kvl synth` seeds each
 * tensor's stream (so its bytes are the ones test/fixtures/python-packer-sha256.json records) and
 * `kvl bench` its prompts.
 *
 * Owns: turning an integer entropy (any size) into the four 64-bit words numpy's
 * `SeedSequence(entropy).generate_state(4, np.uint64)` gives (numpy/random/bit_generator.pyx:
 * pool of 4 uint32 words mixed with hashmix, then output hashing). Does not own: the generator
 * itself (kvl_pcg64_seed / kvl_synth_uniform in the core).
 */
const INIT_A = 0x43b0d7e5;
const MULT_A = 0x931e8875;
const INIT_B = 0x8b51f9dd;
const MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd;
const MIX_MULT_R = 0x4973f715;
const POOL_SIZE = 4;

/** Little-endian 32-bit words of a non-negative integer (at least one word, as numpy). */
function entropyWords(entropy: bigint): number[] {
  if (entropy < 0n) throw new RangeError("SeedSequence entropy must be non-negative");
  const words: number[] = [];
  for (let x = entropy; x > 0n; x >>= 32n) words.push(Number(x & 0xffffffffn));
  return words.length > 0 ? words : [0];
}

/** 32-bit wrapping product. */
const mul = (a: number, b: number): number => Math.imul(a, b) >>> 0;

export function seedSequenceState(entropy: bigint): BigUint64Array {
  const words = entropyWords(entropy);
  let hashConst = INIT_A;
  const hashmix = (value: number): number => {
    value = (value ^ hashConst) >>> 0;
    hashConst = mul(hashConst, MULT_A);
    value = mul(value, hashConst);
    return (value ^ (value >>> 16)) >>> 0;
  };
  const mix = (x: number, y: number): number => {
    const r = (mul(MIX_MULT_L, x) - mul(MIX_MULT_R, y)) >>> 0;
    return (r ^ (r >>> 16)) >>> 0;
  };
  const pool = new Array<number>(POOL_SIZE);
  for (let i = 0; i < POOL_SIZE; i++) pool[i] = hashmix(i < words.length ? words[i]! : 0);
  for (let src = 0; src < POOL_SIZE; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) {
      if (src !== dst) pool[dst] = mix(pool[dst]!, hashmix(pool[src]!));
    }
  }
  for (let src = POOL_SIZE; src < words.length; src++) {
    for (let dst = 0; dst < POOL_SIZE; dst++) pool[dst] = mix(pool[dst]!, hashmix(words[src]!));
  }
  // generate_state(4, uint64): 8 uint32 words, read pairwise as little-endian uint64
  const out = new Uint32Array(8);
  let h = INIT_B;
  for (let i = 0; i < out.length; i++) {
    let v = (pool[i % POOL_SIZE]! ^ h) >>> 0;
    h = mul(h, MULT_B);
    v = mul(v, h);
    out[i] = (v ^ (v >>> 16)) >>> 0;
  }
  return new BigUint64Array(out.buffer);
}
