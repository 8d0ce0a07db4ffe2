/* decode_variants.c — probe: ways to write the Q8 x integer decode product (one activation
 * vector, eight weight rows per pass, KVL_DECODE_STREAM_GAP-like spacing, exact int32 sums per
 * 64-column block as kernels_simd128.c's decode_rows_q8) in WebAssembly SIMD128, to see which
 * instruction sequence V8 runs fastest. Not part of the engine; run.sh builds it with clang-16
 * (Debian) and run.mjs times each variant in and out of cache and checks its sums.
 *
 * Every variant returns, per row, the exact sum over 64-column blocks of w * x scaled by xs[b]
 * (FP32, the reference's order), so all must print the same numbers. */
#include <stddef.h>
#include <stdint.h>
#include <wasm_simd128.h>

#define GAP 8192 /* bytes between a pass's row streams, as KVL_DECODE_STREAM_GAP */
#define BLK 64   /* columns per activation scale, as KVL_I16_BLOCK */
#define MAX_COLS 16384

static volatile int32_t sink;

static inline v128_t hsum4x4_i32(v128_t a, v128_t b, v128_t c, v128_t d)
{
    v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 2, 6), wasm_i32x4_shuffle(a, b, 1, 5, 3, 7));
    v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 2, 6), wasm_i32x4_shuffle(c, d, 1, 5, 3, 7));
    return wasm_i32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}

enum {
    WIDEN = 0,       /* today's kernel: extend_low/high to int16, i32x4.dot_i16x8 */
    WIDEN_PREFETCH,  /* WIDEN plus one plain (volatile) load per row and block 1 KiB ahead */
    MASK,            /* no widening: even bytes (L ^ 0x80) & 0xff, odd bytes L >> 8 on int16 lanes,
                      * de-interleaved activations, minus 128 * sum(x_even) per block */
    RELAXED_DOT,     /* 8-bit: i16x8.relaxed_dot_i8x16_i7x16_s on |x| and sign-flipped weights,
                      * then i32x4.extadd_pairwise */
    RELAXED_DOT_ADD, /* 8-bit: i32x4.relaxed_dot_i8x16_i7x16_add_s */
};

static int16_t xe[MAX_COLS];      /* MASK: per 16 columns [x_even | x_odd] */
static int32_t corr[MAX_COLS / BLK];
static int8_t xa[MAX_COLS], xsg[MAX_COLS]; /* RELAXED_*: |x| and sign masks */

static inline __attribute__((always_inline)) void pass(int v, const int8_t *w, size_t ld, size_t cols,
                                                        const int16_t *x, const float *xs, float *y,
                                                        size_t ystep)
{
    v128_t acc[2] = {wasm_f32x4_splat(0), wasm_f32x4_splat(0)};
    const v128_t lo = wasm_i16x8_splat(0x00ff), bias = wasm_i16x8_splat(0x0080);
    for (size_t b = 0; b < cols; b += BLK) {
        v128_t a[8];
        for (int i = 0; i < 8; i++)
            a[i] = wasm_i32x4_splat(0);
        if (v == WIDEN_PREFETCH) {
            int32_t t = 0;
            for (int i = 0; i < 8; i++)
                t += *(volatile const int8_t *)(w + i * ld + b + 1024);
            sink += t;
        }
        for (size_t c = b; c < b + BLK; c += 16) {
            if (v == WIDEN || v == WIDEN_PREFETCH) {
                v128_t x0 = wasm_v128_load(x + c), x1 = wasm_v128_load(x + c + 8);
                _Pragma("clang loop unroll(full)") for (int i = 0; i < 8; i++)
                {
                    v128_t L = wasm_v128_load(w + i * ld + c);
                    a[i] = wasm_i32x4_add(a[i], wasm_i32x4_add(wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(L), x0),
                                                               wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(L), x1)));
                }
            } else if (v == MASK) {
                v128_t x0 = wasm_v128_load(xe + c), x1 = wasm_v128_load(xe + c + 8);
                _Pragma("clang loop unroll(full)") for (int i = 0; i < 8; i++)
                {
                    v128_t L = wasm_v128_load(w + i * ld + c);
                    v128_t ev = wasm_v128_and(wasm_v128_xor(L, bias), lo), od = wasm_i16x8_shr(L, 8);
                    a[i] = wasm_i32x4_add(a[i], wasm_i32x4_add(wasm_i32x4_dot_i16x8(ev, x0), wasm_i32x4_dot_i16x8(od, x1)));
                }
            } else {
                v128_t xv = wasm_v128_load(xa + c), sg = wasm_v128_load(xsg + c);
                _Pragma("clang loop unroll(full)") for (int i = 0; i < 8; i++)
                {
                    v128_t L = wasm_v128_load(w + i * ld + c);
                    v128_t ws = wasm_i8x16_sub(wasm_v128_xor(L, sg), sg);
                    if (v == RELAXED_DOT)
                        a[i] = wasm_i32x4_add(a[i], wasm_i32x4_extadd_pairwise_i16x8(
                                                        (v128_t)__builtin_wasm_relaxed_dot_i8x16_i7x16_s_i16x8((__i8x16)ws, (__i8x16)xv)));
                    else
                        a[i] = (v128_t)__builtin_wasm_relaxed_dot_i8x16_i7x16_add_s_i32x4((__i8x16)ws, (__i8x16)xv, (__i32x4)a[i]);
                }
            }
        }
        const v128_t xsb = wasm_f32x4_splat(xs[b / BLK]);
        const v128_t cb = wasm_i32x4_splat(v == MASK ? corr[b / BLK] : 0);
        for (int j = 0; j < 2; j++) {
            v128_t s = wasm_i32x4_sub(hsum4x4_i32(a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3]), cb);
            acc[j] = wasm_f32x4_add(acc[j], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(s), xsb));
        }
    }
    for (int j = 0; j < 2; j++) {
        float t[4];
        wasm_v128_store(t, acc[j]);
        for (int i = 0; i < 4; i++)
            y[(4 * j + i) * ystep] = t[i];
    }
}

/* One function per variant, each with its own copy of pass() (V8 allocates registers per
 * function, and one function holding all variants ran them up to 1.6x slower). */
#define VARIANT(V)                                                                                   \
    __attribute__((noinline)) static void decode_##V(const int8_t *W, size_t rows, size_t cols,     \
                                                     const int16_t *x, const float *xs, float *y)   \
    {                                                                                                \
        size_t step = (GAP + cols - 1) / cols;                                                       \
        if (step > rows / 8)                                                                         \
            step = rows / 8;                                                                         \
        for (size_t r0 = 0; r0 + 8 * step <= rows; r0 += 8 * step)                                   \
            for (size_t o = 0; o < step; o++)                                                        \
                pass(V, W + (r0 + o) * cols, step * cols, cols, x, xs, y + r0 + o, step);            \
    }
VARIANT(WIDEN)
VARIANT(WIDEN_PREFETCH)
VARIANT(MASK)
VARIANT(RELAXED_DOT)
VARIANT(RELAXED_DOT_ADD)

static void (*const kinds[])(const int8_t *, size_t, size_t, const int16_t *, const float *, float *) = {
    decode_WIDEN, decode_WIDEN_PREFETCH, decode_MASK, decode_RELAXED_DOT, decode_RELAXED_DOT_ADD};

/* y[r] for rows (a multiple of 8), cols (a multiple of 64, at most MAX_COLS); |x| <= 127 for the
 * RELAXED_* variants */
__attribute__((export_name("decode"))) void decode(int v, const int8_t *W, size_t rows, size_t cols,
                                                   const int16_t *x, const float *xs, float *y)
{
    if (v == MASK) {
        for (size_t c = 0; c < cols; c += 16)
            for (int k = 0; k < 8; k++) {
                xe[c + k] = x[c + 2 * k];
                xe[c + 8 + k] = x[c + 2 * k + 1];
            }
        for (size_t b = 0; b < cols; b += BLK) {
            int32_t s = 0;
            for (size_t c = b; c < b + BLK; c += 2)
                s += x[c];
            corr[b / BLK] = 128 * s;
        }
    } else if (v == RELAXED_DOT || v == RELAXED_DOT_ADD) {
        for (size_t c = 0; c < cols; c++) {
            xa[c] = (int8_t)(x[c] < 0 ? -x[c] : x[c]);
            xsg[c] = (int8_t)(x[c] < 0 ? -1 : 0);
        }
    }
    kinds[v](W, rows, cols, x, xs, y);
}
