/* kernels_relaxed.c — the relaxed-SIMD part of the "simd128-relaxed" kernel table.
 *
 * Owns: kvl_relaxed_decode_pass_q8_i8 (kernels.h), the Q8 x 8-bit decode pass of matmul_q8_i8 on
 * i16x8.relaxed_dot_i8x16_i7x16_s. The table itself, its row grouping and every other entry are
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

#include "kernels.h"

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

#endif /* __wasm_relaxed_simd__ */
