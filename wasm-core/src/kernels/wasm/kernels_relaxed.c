/* kernels_relaxed.c — the relaxed-SIMD part of the "simd128-relaxed" kernel table.
 *
 * Owns: kvl_relaxed_decode_pass_q8_i8 (kernels.h), the Q8 x 8-bit decode pass of matmul_q8_i8 on
 * i16x8.relaxed_dot_i8x16_i7x16_s, and kvl_relaxed_q4_i8_pass, matmul_q4_i8's passes on the
 * same instruction. The table itself, its row grouping and every other entry are
 * kernels_simd128.c's (KVL_WASM_RELAXED): where relaxed SIMD is no win, simd128's kernel stays.
 * Compiled only into the relaxed WebAssembly build (wasm-core/build-wasm.sh), by Debian's clang-16
 * with -mrelaxed-simd (emscripten 3.1.6's LLVM 14 has no relaxed dot product), and linked into
 * the emcc link; everywhere else this file is empty.
 *
 * Why this instruction and not i32x4.relaxed_dot_i8x16_i7x16_add_s: the emcc link runs
 * binaryen 108, which predates the final relaxed-SIMD opcodes. Of the relaxed instructions only
 * 0x111 (q15mulr) and 0x112 (this one) mean the same to it and to the final spec; it reads 0x113
 * (the dot-add) as another instruction and would write a broken module, so build-wasm.sh refuses
 * an object with any other relaxed opcode. V8 compiles the pair used here (this dot, then
 * i32x4.dot_i16x8_s with ones) to vpmaddubsw + vpmaddwd, what it emits for the dot-add on x64
 * CPUs without AVX-VNNI.
 *
 * Exactness: |x| <= KVL_I8_MAX = 127 is the 7-bit operand, so the result is the same on every
 * engine (the relaxed freedom is only in how an operand with its top bit set is read). The
 * weights take x's sign as w ^ s, s = (x < 0 ? -1 : 0): where x < 0 that is ~w = -w - 1, so
 * (w ^ s) * |x| = w * x + x there, and a row's block sum is off by the sum of the block's
 * negative x, which is the same instruction's dot(s, |x|): computed once per pass and block,
 * not per row, and taken off each row's block sum. |w| <= 127, so w ^ s is in [-128, 126] and a
 * pair of products is at most 2 * 128 * 127 = 32512 < 2^15: no saturation. Block sums are exact int32,
 * then added in FP32 exactly as the reference does; so the results are bit-identical to
 * kvl_kernels_scalar_table.matmul_q8_i8 on every engine that implements the instruction
 * correctly, which is what the host's start-up self-test checks (a V8 whose Liftoff doubled the
 * dot-add's sums exists: bench/RESULTS.md).
 *
 * Speed (bench/kernels_ab.sh --relaxed, one thread, CPU time, AMD EPYC Zen 4, Node 20 with the
 * flag, 22 and 26; 2026-12-05): 1.06-1.08x simd128's product in cache, 1.00-1.02x from DRAM. On
 * x64 without AVX-VNNI both run two multiply instructions per 16 weights (vpmaddubsw + vpmaddwd
 * here, two vpmaddwd there): what is saved is the widening. The dot-add, which V8 turns into one
 * VPDPBUSD where the CPU has AVX-VNNI, ran at 0.90-0.95x here (the same sequence plus the ones
 * vector made anew each time) and cannot pass binaryen 108 anyway.
 */
#if defined(__wasm_relaxed_simd__)

#include "../kernels.h"

#include <wasm_simd128.h>

#define KVL_INLINE static inline __attribute__((always_inline))
#define KVL_UNROLL _Pragma("clang loop unroll(full)")

/* The four lane sums of four int32 vectors in one vector (exact), as kernels_simd128.c. */
KVL_INLINE v128_t hsum4x4_i32(v128_t a, v128_t b, v128_t c, v128_t d)
{
    v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 2, 6), wasm_i32x4_shuffle(a, b, 1, 5, 3, 7));
    v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 2, 6), wasm_i32x4_shuffle(c, d, 1, 5, 3, 7));
    return wasm_i32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}

/* int16 ones, read from memory so that no compiler sees a constant: as one, V8 reloaded it from
 * memory for every product (vpmaddwd with a memory operand, its address loaded each time); as a
 * value it stays in a register. */
static volatile int16_t one16 = 1;

/* Sixteen products a[k] * b[k] (b: 7-bit), added pairwise into 8 int16 lanes, then those pairwise
 * into four int32 (i32x4.dot_i16x8_s with ones). */
KVL_INLINE v128_t dot16(v128_t a, v128_t b, v128_t ones)
{
    return wasm_i32x4_dot_i16x8((v128_t)__builtin_wasm_relaxed_dot_i8x16_i7x16_s_i16x8((__i8x16)a, (__i8x16)b), ones);
}

/* R rows (8 or 4), `step` rows apart from row r: as kernels_simd128.c decode_rows_q8 (the same
 * streams, blocks, tails and FP32 order), with 16 weights per dot product and no widening. */
KVL_INLINE void pass(const int R, size_t step, float *Y, const int8_t *W, const float *scale, size_t r,
                     size_t cols, const int16_t *x, const float *xs, v128_t ones)
{
    const int8_t *w = W + r * cols;
    const size_t ld = step * cols; /* bytes from one row of the pass to the next */
    const v128_t zero = wasm_i32x4_splat(0);
    v128_t acc[2] = {wasm_f32x4_splat(0.0f), wasm_f32x4_splat(0.0f)}; /* lane i: row r + (4j + i) * step */
    for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
        const size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
        v128_t a[8], negsum = zero; /* the block's negative x summed: every row's sum is off by it */
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            a[i] = zero;
        size_t c = b;
        for (; c + 16 <= e; c += 16) {
            const v128_t x0 = wasm_v128_load(x + c), x1 = wasm_v128_load(x + c + 8);
            /* |x| <= 127: narrowing to int8 is exact. The sign from the int16 shift: V8 has no
             * 8-bit arithmetic shift (an i8x16 one, which clang makes of x8 < 0, is five). */
            const v128_t ax = wasm_i8x16_abs(wasm_i8x16_narrow_i16x8(x0, x1));
            const v128_t sg = wasm_i8x16_narrow_i16x8(wasm_i16x8_shr(x0, 15), wasm_i16x8_shr(x1, 15));
            negsum = wasm_i32x4_add(negsum, dot16(sg, ax, ones));
            KVL_UNROLL
            for (int i = 0; i < R; i++) {
                const v128_t wv = wasm_v128_load(w + (size_t)i * ld + c);
                a[i] = wasm_i32x4_add(a[i], dot16(wasm_v128_xor(wv, sg), ax, ones));
            }
        }
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            a[i] = wasm_i32x4_sub(a[i], negsum);
        const v128_t xsb = wasm_f32x4_splat(xs[b / KVL_I16_BLOCK]);
        KVL_UNROLL
        for (int j = 0; j < R / 4; j++) {
            v128_t s = hsum4x4_i32(a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3]);
            if (c < e) {
                int32_t tail[4] = {0, 0, 0, 0};
                for (int i = 0; i < 4; i++)
                    for (size_t k = c; k < e; k++)
                        tail[i] += (int32_t)w[(size_t)(4 * j + i) * ld + k] * (int32_t)x[k];
                s = wasm_i32x4_add(s, wasm_v128_load(tail));
            }
            /* the reference's (float)sum * scale (rounded), then + acc (rounded): never fused */
            acc[j] = wasm_f32x4_add(acc[j], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(s), xsb));
        }
    }
    KVL_UNROLL
    for (int j = 0; j < R / 4; j++) {
        float l[4];
        wasm_v128_store(l, acc[j]);
        for (int i = 0; i < 4; i++) {
            const size_t row = r + (size_t)(4 * j + i) * step;
            Y[row] = l[i] * scale[row];
        }
    }
}

void kvl_relaxed_decode_pass_q8_i8(int R, size_t step, float *Y, const int8_t *W, const float *scale,
                                   size_t r, size_t cols, const int16_t *x, const float *xs)
{
    const v128_t ones = wasm_i16x8_splat(one16);
    if (R == 8)
        pass(8, step, Y, W, scale, r, cols, x, xs, ones);
    else
        pass(4, step, Y, W, scale, r, cols, x, xs, ones);
}

/* ---- matmul_q4_i8 (kvl_relaxed_q4_i8_pass) -----------------------------------------------
 *
 * The 7-bit operand is the nibble itself (0..15: its top bit is clear, so every engine computes
 * the same), the 8-bit one the activation (|x| <= 127); a pair is at most 2 * 15 * 127 and the two
 * halves of a group added in int16 at most 7620: no saturation. sum(nibble * x) - 8 * sum(x) is
 * the group's sum of (q - 8) * x, the second term computed once per token and group by the caller.
 * Each group's four lanes per row are reduced for four rows at once, exactly, then kernels.h's
 * FP32 steps lane by lane in its order (as kernels_simd128.c's q4d_pass): bit-identical to the
 * reference. */

static volatile int8_t eight8 = 8; /* as one16: a value, not a constant V8 reloads */

/* [sum a, sum b, sum c, sum d] as hsum4x4_i32, with the shuffles single x64 unpacks in V8 (its
 * [0, 4, 2, 6] pattern is three instructions there) */
KVL_INLINE v128_t q4r_hsum4x4(v128_t a, v128_t b, v128_t c, v128_t d)
{
    const v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 1, 5), wasm_i32x4_shuffle(a, b, 2, 6, 3, 7));
    const v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 1, 5), wasm_i32x4_shuffle(c, d, 2, 6, 3, 7));
    return wasm_i32x4_add(wasm_i64x2_shuffle(ab, cd, 0, 2), wasm_i64x2_shuffle(ab, cd, 1, 3));
}

/* one row's four partial sums of nibble * x over a group (wg: its 16 bytes; xa, xb: its x as int8,
 * columns 0-15 and 16-31) */
KVL_INLINE v128_t q4r_dot(const uint8_t *wg, v128_t xa, v128_t xb, v128_t m, v128_t ones)
{
    const v128_t v = wasm_v128_load(wg);
#define RDOT(a, b) (v128_t) __builtin_wasm_relaxed_dot_i8x16_i7x16_s_i16x8((__i8x16)(a), (__i8x16)(b))
    return wasm_i32x4_dot_i16x8(wasm_i16x8_add(RDOT(xa, wasm_v128_and(v, m)), RDOT(xb, wasm_v128_and(wasm_u16x8_shr(v, 4), m))), ones);
#undef RDOT
}

/* matmul_q4_i8 (kvl_relaxed_q4_i8_pass), every n: kernels_simd128.c's q4d passes (which say
 * why eight rows `step` apart and how the steps stay bit-identical) on this instruction: x8 is
 * the token's activations as int8 in column order, which is the order of a group's low nibbles
 * (columns 0-15) and high ones (16-31); corr[g] = -8 * sum(x) of group g, added to the reduced
 * sums of nibble * x. Per row and group: one load, three ops to split the nibbles, two relaxed
 * dots, one int16 add, one dot with ones. */
void kvl_relaxed_q4_i8_pass(float *Y, const uint8_t *W, const uint16_t *S, size_t r, size_t step, int nr,
                            size_t cols, const int8_t *x8, const int32_t *corr, const float *xs, size_t c0,
                            size_t kc)
{
    const size_t rb = cols / 2, ng = cols / 32, nk = kc / 32;
    const int nh = nr > 4 ? 2 : 1;
    const v128_t ones = wasm_i16x8_splat(one16), m = wasm_i8x16_splat(eight8 + 7); /* 0x0f */
    const v128_t hmask = wasm_i32x4_splat((int32_t)0xffff0000u);
    const uint8_t *w[8];
    const uint16_t *s[8];
    float l[8];
    for (int i = 0; i < 8; i++) {
        const size_t row = r + (size_t)(i < nr ? i : nr - 1) * step;
        w[i] = W + row * rb + c0 / 2;
        s[i] = S + row * ng + c0 / 32;
        l[i] = c0 > 0 ? Y[row] : 0.0f;
    }
    v128_t acc[2] = {wasm_v128_load(l), wasm_v128_load(l + 4)}; /* lane i: row 4h + i */
    for (size_t g = 0; g < nk; g += 2) {
        const int two = g + 1 < nk;
        const size_t g1 = g + (size_t)two;
        const v128_t xa0 = wasm_v128_load(x8 + 32 * g), xb0 = wasm_v128_load(x8 + 32 * g + 16);
        const v128_t xa1 = wasm_v128_load(x8 + 32 * g1), xb1 = wasm_v128_load(x8 + 32 * g1 + 16);
        const v128_t xsb = wasm_f32x4_splat(xs[(c0 + 32 * g) / 64]);
        const v128_t c0v = wasm_i32x4_splat(corr[g]), c1v = wasm_i32x4_splat(corr[g1]);
        for (int h = 0; h < nh; h++) {
            const uint8_t *const *wh = w + 4 * h;
            const uint16_t *const *sh = s + 4 * h;
            v128_t sc;
            if (two) {
                sc = wasm_v128_load32_zero(sh[0] + g);
                sc = wasm_v128_load32_lane(sh[1] + g, sc, 1);
                sc = wasm_v128_load32_lane(sh[2] + g, sc, 2);
                sc = wasm_v128_load32_lane(sh[3] + g, sc, 3);
            } else {
                sc = wasm_i32x4_make(sh[0][g], sh[1][g], sh[2][g], sh[3][g]);
            }
            const v128_t s0 = q4r_hsum4x4(q4r_dot(wh[0] + 16 * g, xa0, xb0, m, ones), q4r_dot(wh[1] + 16 * g, xa0, xb0, m, ones),
                                          q4r_dot(wh[2] + 16 * g, xa0, xb0, m, ones), q4r_dot(wh[3] + 16 * g, xa0, xb0, m, ones));
            v128_t p = wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_add(s0, c0v)), wasm_i32x4_shl(sc, 16));
            if (two) {
                const v128_t s1 = q4r_hsum4x4(q4r_dot(wh[0] + 16 * g1, xa1, xb1, m, ones), q4r_dot(wh[1] + 16 * g1, xa1, xb1, m, ones),
                                              q4r_dot(wh[2] + 16 * g1, xa1, xb1, m, ones), q4r_dot(wh[3] + 16 * g1, xa1, xb1, m, ones));
                p = wasm_f32x4_add(p, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_add(s1, c1v)), wasm_v128_and(sc, hmask)));
            }
            acc[h] = wasm_f32x4_add(acc[h], wasm_f32x4_mul(p, xsb));
        }
    }
    wasm_v128_store(l, acc[0]);
    wasm_v128_store(l + 4, acc[1]);
    for (int i = 0; i < nr; i++)
        Y[r + (size_t)i * step] = l[i];
}

#endif /* __wasm_relaxed_simd__ */
