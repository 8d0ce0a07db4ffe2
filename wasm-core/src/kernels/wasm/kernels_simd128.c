/* kernels_simd128.c — the "simd128" kernel table (WebAssembly SIMD128), level 4, and in the
 * relaxed build (-DKVL_WASM_RELAXED=1) also "simd128-relaxed", level 4 there.
 *
 * Owns: SIMD128 versions of every kvl_kernels entry; the simd128-relaxed table, which is this
 * one with matmul_q8_i8's decode passes taken from kernels_relaxed.c. Compiled only into
 * WebAssembly builds made with -msimd128 (emcc); everywhere else this file is empty. A wasm module
 * that uses SIMD128 does not validate on an engine without it, so there is no run-time check to
 * make here: the host probes SIMD128 with WebAssembly.validate before it loads this build (and
 * relaxed SIMD, plus a self-test of its products, before it loads the relaxed one).
 * Does not own: the numeric definition of each kernel (kernels_ref.c is the reference; results
 * here differ from it only by FP32 summation order and, without FMA, by the rounding of each
 * product; quantize_i16_act and matmul_q8_i16 are bit-identical to it), threading.
 *
 * What is fast here (docs: design "Kernels: what is fast in SIMD128"): i32x4.dot_i16x8_s runs at
 * native speed, so the integer-mode products (int8 / int16 weights x 15-bit activations) are the
 * decode path that reaches DRAM bandwidth; the FP32-activation products widen every weight to
 * FP32 and multiply and add separately (SIMD128 has no FMA), several times slower.
 *
 * Float tiles: R = 2 rows x T = 2 tokens, 8 columns per step with two accumulators per output (8
 * FP32 partial sums, as the 8-lane AVX2 code, for the same summation bound), 8 accumulators +
 * 4 weight + 2 activation vectors: within the 16 registers an x86-64 engine maps v128 onto.
 * Integer tiles: 2 rows x 4 tokens. Decode (n = 1) reads one row at a time as one sequential
 * stream with four independent accumulators.
 */
#if defined(__wasm_simd128__)

#include "../kernels.h"

#include <math.h>
#include <string.h>
#include <wasm_simd128.h>

#define KVL_INLINE static inline __attribute__((always_inline))
#define KVL_UNROLL _Pragma("unroll")

#define TR 2 /* float tiles: rows */
#define TT 2 /* float tiles: tokens */
#define TRI 2 /* integer tiles: rows */
#define TTI 4 /* integer tiles: tokens (tile_int reduces up to four tokens' sums with hsum4x4_i32) */
_Static_assert(TTI == 4, "tile_int's Q8 reduction takes at most four tokens");

KVL_INLINE float hsum4(v128_t v)
{
    /* (l0 + l2) + (l1 + l3) */
    v128_t s = wasm_f32x4_add(v, wasm_i32x4_shuffle(v, v, 2, 3, 0, 1));
    s = wasm_f32x4_add(s, wasm_i32x4_shuffle(s, s, 1, 0, 3, 2));
    return wasm_f32x4_extract_lane(s, 0);
}

KVL_INLINE int32_t hsum4_i32(v128_t v)
{
    v128_t s = wasm_i32x4_add(v, wasm_i32x4_shuffle(v, v, 2, 3, 0, 1));
    s = wasm_i32x4_add(s, wasm_i32x4_shuffle(s, s, 1, 0, 3, 2));
    return wasm_i32x4_extract_lane(s, 0);
}

/* The four lane sums [sum a, sum b, sum c, sum d] of four int32 vectors in one vector (exact):
 * 6 shuffles and 3 adds for four sums, where hsum4_i32 takes 2 and 2 for one. */
KVL_INLINE v128_t hsum4x4_i32(v128_t a, v128_t b, v128_t c, v128_t d)
{
    v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 2, 6), wasm_i32x4_shuffle(a, b, 1, 5, 3, 7));
    v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 2, 6), wasm_i32x4_shuffle(c, d, 1, 5, 3, 7));
    return wasm_i32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}

/* [sum a, sum b, sum c, sum d] of four f32x4 (the lanes of each added pairwise) */
KVL_INLINE v128_t hsum4x4_f32(v128_t a, v128_t b, v128_t c, v128_t d)
{
    v128_t ab = wasm_f32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 2, 6), wasm_i32x4_shuffle(a, b, 1, 5, 3, 7));
    v128_t cd = wasm_f32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 2, 6), wasm_i32x4_shuffle(c, d, 1, 5, 3, 7));
    return wasm_f32x4_add(wasm_i32x4_shuffle(ab, cd, 0, 1, 4, 5), wasm_i32x4_shuffle(ab, cd, 2, 3, 6, 7));
}

static float bf16_scalar(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 bf16 -> 2 x 4 fp32: interleave with zero halfwords, i.e. shift into the high half (exact). */
KVL_INLINE void bf16x8(v128_t h, v128_t *lo, v128_t *hi)
{
    const v128_t z = wasm_i32x4_splat(0);
    *lo = wasm_i16x8_shuffle(z, h, 0, 8, 1, 9, 2, 10, 3, 11);
    *hi = wasm_i16x8_shuffle(z, h, 4, 12, 5, 13, 6, 14, 7, 15);
}

/* ---- float-activation products ----------------------------------------------------------- */

enum { KIND_BF16, KIND_Q8, KIND_F32 };

KVL_INLINE size_t elem_size(int kind)
{
    return kind == KIND_BF16 ? 2 : kind == KIND_Q8 ? 1 : 4;
}

/* Weights [c, c+8) as two f32x4. */
KVL_INLINE void load_w8(int kind, const void *w, size_t c, v128_t *lo, v128_t *hi)
{
    if (kind == KIND_BF16) {
        bf16x8(wasm_v128_load((const uint16_t *)w + c), lo, hi);
    } else if (kind == KIND_Q8) {
        v128_t v = wasm_i16x8_load8x8((const int8_t *)w + c);
        *lo = wasm_f32x4_convert_i32x4(wasm_i32x4_extend_low_i16x8(v));
        *hi = wasm_f32x4_convert_i32x4(wasm_i32x4_extend_high_i16x8(v));
    } else {
        *lo = wasm_v128_load((const float *)w + c);
        *hi = wasm_v128_load((const float *)w + c + 4);
    }
}

KVL_INLINE float scalar_w(int kind, const void *w, size_t c)
{
    if (kind == KIND_BF16)
        return bf16_scalar(((const uint16_t *)w)[c]);
    if (kind == KIND_Q8)
        return (float)((const int8_t *)w)[c];
    return ((const float *)w)[c];
}

/* round_bf16x4's five constants, as data no compiler may fold: clang then loads them once before
 * a product's loop and V8 keeps them in registers. As immediates, V8 from Node 24 on (its
 * Turboshaft pipeline) rebuilt each at every use inside the loop (movq + vmovq + vpunpcklqdq),
 * 60 instructions per 16 activations: the BF16-activation products ran at half Node 20's and 22's
 * speed there. Like this, on Node 24 and 26 the BF16 x BF16 decode runs 2.3x, the Q8 one 1.5x and
 * the 64-token product 1.9x as fast, on 20 and 22 1.0-1.06x (CPU time, one thread:
 * bench/RESULTS.md, 2026-12-05). Never written. */
int32_t kvl_simd128_bf16_round_k[5] = {1, 0x7fff, (int32_t)0xffff0000u, 0x7f800000, (int32_t)0x80000000u};

/* kvl_bf16_round_daz on 4 lanes: nearest-even by integer add and truncate, subnormal inputs to
 * signed zero (NaN payloads are not preserved). */
KVL_INLINE v128_t round_bf16x4(v128_t b)
{
    const int32_t *k = kvl_simd128_bf16_round_k; /* 1, 0x7fff, high half, exponent, sign */
    v128_t lsb = wasm_v128_and(wasm_u32x4_shr(b, 16), wasm_i32x4_splat(k[0]));
    v128_t r = wasm_i32x4_add(b, wasm_i32x4_add(lsb, wasm_i32x4_splat(k[1])));
    r = wasm_v128_and(r, wasm_i32x4_splat(k[2]));
    v128_t subnormal = wasm_i32x4_eq(wasm_v128_and(b, wasm_i32x4_splat(k[3])), wasm_i32x4_splat(0));
    return wasm_v128_bitselect(wasm_v128_and(b, wasm_i32x4_splat(k[4])), r, subnormal);
}

KVL_INLINE v128_t load_x(int xb, const float *x)
{
    return xb ? round_bf16x4(wasm_v128_load(x)) : wasm_v128_load(x);
}

KVL_INLINE float scalar_x(int xb, float x)
{
    return xb ? kvl_bf16_round_daz(x) : x;
}

KVL_INLINE v128_t madd(v128_t a, v128_t b, v128_t acc)
{
    return wasm_f32x4_add(acc, wasm_f32x4_mul(a, b));
}

/* Y[t*ldy + r0 + i] = (sum_c W[r0+i, c] X[t, c]) * (scale ? scale[r0+i] : 1) for i<R, t<T. */
KVL_INLINE void tile(int kind, int xb, float *Y, size_t ldy, const void *W, const float *scale,
                     size_t r0, size_t cols, const float *X, size_t ldx, int prefetch, const int R,
                     const int T)
{
    (void)prefetch; /* no prefetch instruction in WebAssembly */
    v128_t acc[TR][TT][2];
    const char *wrow[TR];
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        wrow[i] = (const char *)W + (r0 + (size_t)i) * cols * elem_size(kind);
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            acc[i][t][0] = acc[i][t][1] = wasm_f32x4_splat(0.0f);
    }
    size_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        v128_t wl[TR], wh[TR];
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            load_w8(kind, wrow[i], c, &wl[i], &wh[i]);
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            v128_t xl = load_x(xb, X + (size_t)t * ldx + c), xh = load_x(xb, X + (size_t)t * ldx + c + 4);
            KVL_UNROLL
            for (int i = 0; i < R; i++) {
                acc[i][t][0] = madd(wl[i], xl, acc[i][t][0]);
                acc[i][t][1] = madd(wh[i], xh, acc[i][t][1]);
            }
        }
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            float s = hsum4(wasm_f32x4_add(acc[i][t][0], acc[i][t][1]));
            const float *x = X + (size_t)t * ldx;
            for (size_t cc = c; cc < cols; cc++)
                s += scalar_w(kind, wrow[i], cc) * scalar_x(xb, x[cc]);
            if (scale)
                s *= scale[r0 + (size_t)i];
            Y[(size_t)t * ldy + r0 + (size_t)i] = s;
        }
    }
}

KVL_INLINE void decode_row(int kind, int xb, float *Y, const void *W, const float *scale, size_t r,
                           size_t cols, const float *X)
{
    const char *w = (const char *)W + r * cols * elem_size(kind);
    v128_t a0 = wasm_f32x4_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
    size_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        v128_t w0, w1, w2, w3;
        load_w8(kind, w, c, &w0, &w1);
        load_w8(kind, w, c + 8, &w2, &w3);
        a0 = madd(w0, load_x(xb, X + c), a0);
        a1 = madd(w1, load_x(xb, X + c + 4), a1);
        a2 = madd(w2, load_x(xb, X + c + 8), a2);
        a3 = madd(w3, load_x(xb, X + c + 12), a3);
    }
    if (c + 8 <= cols) {
        v128_t w0, w1;
        load_w8(kind, w, c, &w0, &w1);
        a0 = madd(w0, load_x(xb, X + c), a0);
        a1 = madd(w1, load_x(xb, X + c + 4), a1);
        c += 8;
    }
    float s = hsum4(wasm_f32x4_add(wasm_f32x4_add(a0, a1), wasm_f32x4_add(a2, a3)));
    for (; c < cols; c++)
        s += scalar_w(kind, w, c) * scalar_x(xb, X[c]);
    Y[r] = scale ? s * scale[r] : s;
}

/* ---- integer mode ------------------------------------------------------------------------
 *
 * i32x4.dot_i16x8_s multiplies 8 int16 pairs and adds adjacent products into 4 int32 lanes,
 * exactly. matmul_q8_i16 keeps those lane sums in int32 over a whole KVL_I16_BLOCK block (any
 * partial sum of a block is bounded like the block: exact), reduces them exactly and adds the
 * block sums in FP32 in block order: bit-identical to the reference. matmul_i16_i16 adds two dot
 * results (4 products per lane, < 2^31) before converting to FP32. */

enum { IKIND_Q8, IKIND_I16 };

/* One block of cols values: its scale (xs[0]) and integers, by the reference's rule. */
static void quantize_block(int16_t *q, float *xs, const float *x, size_t cols, float limf)
{
    const v128_t lim = wasm_f32x4_splat(limf), nlim = wasm_f32x4_splat(-limf);
    /* pmax(m, |x|) = m < |x| ? |x| : m: a NaN input is ignored, as in the reference */
    v128_t m0 = wasm_f32x4_splat(0.0f), m1 = m0;
    size_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        m0 = wasm_f32x4_pmax(m0, wasm_f32x4_abs(wasm_v128_load(x + c)));
        m1 = wasm_f32x4_pmax(m1, wasm_f32x4_abs(wasm_v128_load(x + c + 4)));
    }
    m0 = wasm_f32x4_pmax(m0, m1);
    float amax = 0.0f;
    float l[4] = {wasm_f32x4_extract_lane(m0, 0), wasm_f32x4_extract_lane(m0, 1),
                  wasm_f32x4_extract_lane(m0, 2), wasm_f32x4_extract_lane(m0, 3)};
    for (int i = 0; i < 4; i++)
        if (l[i] > amax)
            amax = l[i];
    for (; c < cols; c++) {
        float a = fabsf(x[c]);
        if (a > amax)
            amax = a;
    }
    /* Same scalar expressions as the reference, so the integers agree exactly. */
    float inv = amax > 0.0f ? limf / amax : 0.0f;
    xs[0] = amax / limf;
    const v128_t vi = wasm_f32x4_splat(inv);
    for (c = 0; c + 8 <= cols; c += 8) {
        /* nearest = rint (half to even); pmin/pmax keep a NaN, which trunc_sat makes 0 */
        v128_t p0 = wasm_f32x4_nearest(wasm_f32x4_mul(wasm_v128_load(x + c), vi));
        v128_t p1 = wasm_f32x4_nearest(wasm_f32x4_mul(wasm_v128_load(x + c + 4), vi));
        p0 = wasm_f32x4_pmax(wasm_f32x4_pmin(p0, lim), nlim);
        p1 = wasm_f32x4_pmax(wasm_f32x4_pmin(p1, lim), nlim);
        wasm_v128_store(q + c, wasm_i16x8_narrow_i32x4(wasm_i32x4_trunc_sat_f32x4(p0),
                                                       wasm_i32x4_trunc_sat_f32x4(p1)));
    }
    for (; c < cols; c++)
        q[c] = kvl_i16_round_clamp(x[c] * inv, limf);
}

#define DOT_Q8(w, x) wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w), wasm_v128_load(x))
#define DOT_I16(w, x) wasm_i32x4_dot_i16x8(wasm_v128_load(w), wasm_v128_load(x))

KVL_INLINE void decode_row_int(int kind, float *Y, const void *W, const float *scale, size_t r,
                               size_t cols, const int16_t *x, const float *xs)
{
    if (kind == IKIND_Q8) {
        const int8_t *w = (const int8_t *)W + r * cols;
        float acc = 0.0f;
        for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
            size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
            v128_t a0 = wasm_i32x4_splat(0), a1 = a0, a2 = a0, a3 = a0;
            size_t c = b;
            for (; c + 32 <= e; c += 32) {
                a0 = wasm_i32x4_add(a0, DOT_Q8(w + c, x + c));
                a1 = wasm_i32x4_add(a1, DOT_Q8(w + c + 8, x + c + 8));
                a2 = wasm_i32x4_add(a2, DOT_Q8(w + c + 16, x + c + 16));
                a3 = wasm_i32x4_add(a3, DOT_Q8(w + c + 24, x + c + 24));
            }
            for (; c + 8 <= e; c += 8)
                a0 = wasm_i32x4_add(a0, DOT_Q8(w + c, x + c));
            int32_t s = hsum4_i32(wasm_i32x4_add(wasm_i32x4_add(a0, a1), wasm_i32x4_add(a2, a3)));
            for (; c < e; c++)
                s += (int32_t)w[c] * (int32_t)x[c];
            const float p = (float)s * xs[b / KVL_I16_BLOCK];
            acc += p;
        }
        Y[r] = acc * scale[r];
        return;
    }
    const int16_t *w = (const int16_t *)W + r * cols;
    v128_t f0 = wasm_f32x4_splat(0.0f), f1 = f0, f2 = f0, f3 = f0;
    size_t c = 0;
#define I16_QUAD(o) \
    wasm_f32x4_convert_i32x4(wasm_i32x4_add(DOT_I16(w + c + (o), x + c + (o)), DOT_I16(w + c + (o) + 8, x + c + (o) + 8)))
    for (; c + 64 <= cols; c += 64) {
        f0 = wasm_f32x4_add(f0, I16_QUAD(0));
        f1 = wasm_f32x4_add(f1, I16_QUAD(16));
        f2 = wasm_f32x4_add(f2, I16_QUAD(32));
        f3 = wasm_f32x4_add(f3, I16_QUAD(48));
    }
    for (; c + 16 <= cols; c += 16)
        f0 = wasm_f32x4_add(f0, I16_QUAD(0));
#undef I16_QUAD
    if (c + 8 <= cols) {
        f1 = wasm_f32x4_add(f1, wasm_f32x4_convert_i32x4(DOT_I16(w + c, x + c)));
        c += 8;
    }
    float s = hsum4(wasm_f32x4_add(wasm_f32x4_add(f0, f1), wasm_f32x4_add(f2, f3)));
    s = kvl_i16_group_sum(w, x, c, cols, s);
    Y[r] = (s * scale[r]) * xs[0];
}

/* Q8 x int16 decode, R (8 or 4) rows at a time, `step` rows apart. WebAssembly has no prefetch
 * instruction, so what hides DRAM latency is independent weight streams that the hardware
 * prefetcher follows: eight rows in flight, each activation vector loaded once for all of them.
 * Streams close together are followed poorly. Measured on AMD EPYC (Zen 4), plain 16-byte loads,
 * the same natively and in V8: eight interleaved streams 2 KB apart (adjacent rows) read at
 * 11-13 GB/s, 8 KB apart at 18-20, 32 KB apart at 20; two streams 4 KB apart at 12, 256 KB apart
 * at 21; one stream at 24-27. So the streams of a pass are KVL_DECODE_STREAM_GAP bytes apart
 * (decode_q8_i16 picks the step); on the kernel bench that took this decode from 9.2 to 12-16
 * GB/s on one thread, and the int16 one (decode_rows2_int) from 9.4 to 16-23. Each row's 16
 * weights come in one 16-byte load widened in registers (extend_low/high): two widening 8-byte
 * loads (load8x8) ran this pass at 0.68-0.82x from DRAM and 0.60-0.76x in cache on every Node
 * from 20 to 26 (CPU time, one thread: bench/RESULTS.md, 2026-12-05). Block sums are exact int32
 * whatever the order, so the result is identical to decode_row_int. */
KVL_INLINE void decode_rows_q8(int R, size_t step, float *Y, const int8_t *W, const float *scale,
                               size_t r, size_t cols, const int16_t *x, const float *xs)
{
    const int8_t *w = W + r * cols;
    const size_t ld = step * cols; /* bytes from one row of the pass to the next */
    v128_t acc[2] = {wasm_f32x4_splat(0.0f), wasm_f32x4_splat(0.0f)}; /* lane i: row r + (4j + i) * step */
    for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
        size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
        v128_t a[8];
        for (int i = 0; i < R; i++)
            a[i] = wasm_i32x4_splat(0);
        size_t c = b;
        for (; c + 16 <= e; c += 16) {
            v128_t x0 = wasm_v128_load(x + c), x1 = wasm_v128_load(x + c + 8);
            KVL_UNROLL
            for (int i = 0; i < R; i++) {
                v128_t wv = wasm_v128_load(w + (size_t)i * ld + c);
                a[i] = wasm_i32x4_add(a[i], wasm_i32x4_add(wasm_i32x4_dot_i16x8(wasm_i16x8_extend_low_i8x16(wv), x0),
                                                           wasm_i32x4_dot_i16x8(wasm_i16x8_extend_high_i8x16(wv), x1)));
            }
        }
        const v128_t xsb = wasm_f32x4_splat(xs[b / KVL_I16_BLOCK]);
        for (int j = 0; j < R / 4; j++) {
            /* four rows' block sums in one vector, exact; then, lane by lane, the reference's
             * (float)sum * scale (rounded) + acc (rounded) */
            v128_t s = hsum4x4_i32(a[4 * j], a[4 * j + 1], a[4 * j + 2], a[4 * j + 3]);
            if (c < e) {
                int32_t tail[4] = {0, 0, 0, 0};
                for (int i = 0; i < 4; i++)
                    for (size_t k = c; k < e; k++)
                        tail[i] += (int32_t)w[(size_t)(4 * j + i) * ld + k] * (int32_t)x[k];
                s = wasm_i32x4_add(s, wasm_v128_load(tail));
            }
            acc[j] = wasm_f32x4_add(acc[j], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(s), xsb));
        }
    }
    for (int j = 0; j < R / 4; j++) {
        float a[4];
        wasm_v128_store(a, acc[j]);
        for (int i = 0; i < 4; i++) {
            const size_t row = r + (size_t)(4 * j + i) * step;
            Y[row] = a[i] * scale[row];
        }
    }
}

/* Decode, two rows at a time, `gap` rows apart: each activation vector is loaded once for both
 * rows (the loads are half the work of a dot product here) and two weight streams are in flight,
 * far enough apart for the prefetcher (matmul_int_generic picks the gap; decode_rows_q8 says
 * why). Each row's sums are formed in exactly the order of decode_row_int, so the results are
 * identical to it. */
#define KVL_DECODE_ROWS2 1
#ifndef KVL_DECODE_STREAM_GAP
#define KVL_DECODE_STREAM_GAP 65536u /* bytes between the weight streams of one decode pass */
#endif
KVL_INLINE void decode_rows2_int(int kind, float *Y, const void *W, const float *scale, size_t r,
                                 size_t gap, size_t cols, const int16_t *x, const float *xs)
{
    const size_t r1 = r + gap; /* the second row */
    if (kind == IKIND_Q8) {
        const int8_t *w0 = (const int8_t *)W + r * cols, *w1 = (const int8_t *)W + r1 * cols;
        float acc0 = 0.0f, acc1 = 0.0f;
        for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
            size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
            v128_t a0 = wasm_i32x4_splat(0), a1 = a0, a2 = a0, a3 = a0;
            v128_t b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            size_t c = b;
            for (; c + 32 <= e; c += 32) {
                v128_t x0 = wasm_v128_load(x + c), x1 = wasm_v128_load(x + c + 8);
                v128_t x2 = wasm_v128_load(x + c + 16), x3 = wasm_v128_load(x + c + 24);
                /* load8x8 widens as it loads (one pmovsxbw from memory in V8) */
                a0 = wasm_i32x4_add(a0, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w0 + c), x0));
                b0 = wasm_i32x4_add(b0, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w1 + c), x0));
                a1 = wasm_i32x4_add(a1, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w0 + c + 8), x1));
                b1 = wasm_i32x4_add(b1, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w1 + c + 8), x1));
                a2 = wasm_i32x4_add(a2, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w0 + c + 16), x2));
                b2 = wasm_i32x4_add(b2, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w1 + c + 16), x2));
                a3 = wasm_i32x4_add(a3, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w0 + c + 24), x3));
                b3 = wasm_i32x4_add(b3, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w1 + c + 24), x3));
            }
            for (; c + 8 <= e; c += 8) {
                v128_t xv = wasm_v128_load(x + c);
                a0 = wasm_i32x4_add(a0, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w0 + c), xv));
                b0 = wasm_i32x4_add(b0, wasm_i32x4_dot_i16x8(wasm_i16x8_load8x8(w1 + c), xv));
            }
            int32_t s0 = hsum4_i32(wasm_i32x4_add(wasm_i32x4_add(a0, a1), wasm_i32x4_add(a2, a3)));
            int32_t s1 = hsum4_i32(wasm_i32x4_add(wasm_i32x4_add(b0, b1), wasm_i32x4_add(b2, b3)));
            for (; c < e; c++) {
                s0 += (int32_t)w0[c] * (int32_t)x[c];
                s1 += (int32_t)w1[c] * (int32_t)x[c];
            }
            const float p0 = (float)s0 * xs[b / KVL_I16_BLOCK], p1 = (float)s1 * xs[b / KVL_I16_BLOCK];
            acc0 += p0;
            acc1 += p1;
        }
        Y[r] = acc0 * scale[r];
        Y[r1] = acc1 * scale[r1];
        return;
    }
    const int16_t *w0 = (const int16_t *)W + r * cols, *w1 = (const int16_t *)W + r1 * cols;
    v128_t f0 = wasm_f32x4_splat(0.0f), f1 = f0, f2 = f0, f3 = f0;
    v128_t g0 = f0, g1 = f0, g2 = f0, g3 = f0;
    size_t c = 0;
#define I16_QUAD2(acc, w, o, xa, xb) \
    acc = wasm_f32x4_add(acc, wasm_f32x4_convert_i32x4(wasm_i32x4_add(            \
        wasm_i32x4_dot_i16x8(wasm_v128_load(w + c + (o)), xa),                     \
        wasm_i32x4_dot_i16x8(wasm_v128_load(w + c + (o) + 8), xb))))
    for (; c + 64 <= cols; c += 64) {
        v128_t x0 = wasm_v128_load(x + c), x1 = wasm_v128_load(x + c + 8);
        v128_t x2 = wasm_v128_load(x + c + 16), x3 = wasm_v128_load(x + c + 24);
        I16_QUAD2(f0, w0, 0, x0, x1);
        I16_QUAD2(g0, w1, 0, x0, x1);
        I16_QUAD2(f1, w0, 16, x2, x3);
        I16_QUAD2(g1, w1, 16, x2, x3);
        x0 = wasm_v128_load(x + c + 32), x1 = wasm_v128_load(x + c + 40);
        x2 = wasm_v128_load(x + c + 48), x3 = wasm_v128_load(x + c + 56);
        I16_QUAD2(f2, w0, 32, x0, x1);
        I16_QUAD2(g2, w1, 32, x0, x1);
        I16_QUAD2(f3, w0, 48, x2, x3);
        I16_QUAD2(g3, w1, 48, x2, x3);
    }
    for (; c + 16 <= cols; c += 16) {
        v128_t x0 = wasm_v128_load(x + c), x1 = wasm_v128_load(x + c + 8);
        I16_QUAD2(f0, w0, 0, x0, x1);
        I16_QUAD2(g0, w1, 0, x0, x1);
    }
#undef I16_QUAD2
    if (c + 8 <= cols) {
        v128_t xv = wasm_v128_load(x + c);
        f1 = wasm_f32x4_add(f1, wasm_f32x4_convert_i32x4(wasm_i32x4_dot_i16x8(wasm_v128_load(w0 + c), xv)));
        g1 = wasm_f32x4_add(g1, wasm_f32x4_convert_i32x4(wasm_i32x4_dot_i16x8(wasm_v128_load(w1 + c), xv)));
        c += 8;
    }
    float s0 = hsum4(wasm_f32x4_add(wasm_f32x4_add(f0, f1), wasm_f32x4_add(f2, f3)));
    float s1 = hsum4(wasm_f32x4_add(wasm_f32x4_add(g0, g1), wasm_f32x4_add(g2, g3)));
    s0 = kvl_i16_group_sum(w0, x, c, cols, s0);
    s1 = kvl_i16_group_sum(w1, x, c, cols, s1);
    Y[r] = (s0 * scale[r]) * xs[0];
    Y[r1] = (s1 * scale[r1]) * xs[0];
}

/* Primitives of the driver's integer tile (tile_int, kernels_matmul_driver.h): Q8 16 columns a
 * step, one 16-byte load widened in registers and two dot products per row and token (1.27-1.31x
 * on Node 20, 22 and 1.52-1.56x on Node 24, 26 the prompt rate of 8-column steps, CPU time, one
 * thread; the weights' load form, one 16-byte load widened or two load8x8, made no difference:
 * bench/RESULTS.md, 2026-12-05); int16 8 columns a vector; no masked loads (scalar column tails);
 * four sums reduced at once by hsum4x4_i32. No prefetch instruction in WebAssembly. */
#define TI_MASKED 0
#define TI_Q8_STEP 16
#define TI_I16_STEP 8
typedef struct {
    v128_t lo, hi; /* columns 0-7 and 8-15 of a step, as int16 */
} ti_pair;
#define TI_Q8W ti_pair
#define TI_Q8X ti_pair
#define TI_IACC v128_t
#define TI_I16V v128_t
#define TI_FACC v128_t
#define TI_I4 v128_t
#define TI_F4 v128_t
KVL_INLINE ti_pair ti_load_q8w(const int8_t *row, size_t c, size_t e)
{
    (void)e;
    const v128_t wv = wasm_v128_load(row + c);
    return (ti_pair){wasm_i16x8_extend_low_i8x16(wv), wasm_i16x8_extend_high_i8x16(wv)};
}
KVL_INLINE ti_pair ti_load_q8x(const int16_t *row, size_t c, size_t e)
{
    (void)e;
    return (ti_pair){wasm_v128_load(row + c), wasm_v128_load(row + c + 8)};
}
#define ti_izero() wasm_i32x4_splat(0)
#define ti_dot_q8(acc, w, x) \
    wasm_i32x4_add(acc, wasm_i32x4_add(wasm_i32x4_dot_i16x8((w).lo, (x).lo), wasm_i32x4_dot_i16x8((w).hi, (x).hi)))
#define ti_ihsum(v) hsum4_i32(v)
#define ti_reduce4(a, b, c, d) hsum4x4_i32(a, b, c, d)
#define ti_i4_add(a, b) wasm_i32x4_add(a, b)
#define ti_i4_load(p) wasm_v128_load(p)
#define ti_f4_zero() wasm_f32x4_splat(0.0f)
#define ti_f4_from_i4(v) wasm_f32x4_convert_i32x4(v)
#define ti_f4_mul(a, b) wasm_f32x4_mul(a, b)
#define ti_f4_add(a, b) wasm_f32x4_add(a, b)
#define ti_f4_splat(v) wasm_f32x4_splat(v)
#define ti_f4_load(p) wasm_v128_load(p)
#define ti_f4_store(p, v) wasm_v128_store(p, v)
#define ti_prefetch(p) ((void)(p))
#define ti_prefetch_i16_step(p) ((void)(p))
#define ti_load_i16(row, c, e) wasm_v128_load((row) + (c))
#define ti_fzero() wasm_f32x4_splat(0.0f)
#define ti_fadd(a, b) wasm_f32x4_add(a, b)
#define ti_fhsum(v) hsum4(v)
#define ti_i16_quad(w0, x0, w1, x1) \
    wasm_f32x4_convert_i32x4(wasm_i32x4_add(wasm_i32x4_dot_i16x8(w0, x0), wasm_i32x4_dot_i16x8(w1, x1)))
#define ti_i16_pair(w, x) wasm_f32x4_convert_i32x4(wasm_i32x4_dot_i16x8(w, x))

/* Vector primitives of axpy_rows_generic (the driver): simd128_axpy_f32's madd on 4 floats. */
#define AXPY_VW 4
#define AXPY_VEC v128_t
#define AXPY_LOAD(p) wasm_v128_load(p)
#define AXPY_STORE(p, v) wasm_v128_store(p, v)
#define AXPY_SPLAT(a) wasm_f32x4_splat(a)
#define AXPY_MADD(a, x, y) madd(a, x, y)

#include "../kernels_matmul_driver.h"

/* Q8 x int16 decode (one vector): rows in passes of eight, then four, two, one. The eight rows of
 * a pass are `step` rows apart, so that they start KVL_DECODE_STREAM_GAP bytes apart
 * (decode_rows_q8): a group of 8 * step rows is `step` passes; what is left of the rows takes the
 * largest step it can. */
static void decode_q8_i16(float *Y, const int8_t *W, const float *scale, size_t rows, size_t cols,
                          const int16_t *x, const float *xs)
{
    const size_t want = cols ? (KVL_DECODE_STREAM_GAP + cols - 1) / cols : 1;
    size_t r = 0;
    while (rows - r >= 8) {
        const size_t step = (rows - r) / 8 < want ? (rows - r) / 8 : want;
        for (size_t o = 0; o < step; o++)
            decode_rows_q8(8, step, Y, W, scale, r + o, cols, x, xs);
        r += 8 * step;
    }
    for (; r + 4 <= rows; r += 4)
        decode_rows_q8(4, 1, Y, W, scale, r, cols, x, xs);
    for (; r + 2 <= rows; r += 2)
        decode_rows2_int(IKIND_Q8, Y, W, scale, r, 1, cols, x, xs);
    for (; r < rows; r++)
        decode_row_int(IKIND_Q8, Y, W, scale, r, cols, x, xs);
}

/* Called through a volatile pointer, so that neither clang nor binaryen (which inlines a
 * function with one caller whatever its attributes) merges decode_q8_i16 into the function of
 * the token tiles: merged, V8 allocated registers for the whole and the tiles' prefill products
 * ran 1.5-2x slower (measured, with their source unchanged). One load per product call. */
static void (*volatile decode_q8_i16_call)(float *, const int8_t *, const float *, size_t, size_t,
                                           const int16_t *, const float *) = decode_q8_i16;

static void simd128_matmul_q8_i16(float *Y, size_t ldy, const int8_t *W, const float *scale,
                                  size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                                  size_t ldx, size_t n)
{
    if (n == 1) {
        decode_q8_i16_call(Y, W, scale, rows, cols, Xq, xs);
        return;
    }
    matmul_int_generic(IKIND_Q8, Y, ldy, W, scale, rows, cols, Xq, xs, ldx, n);
}

#if defined(KVL_WASM_RELAXED)
/* matmul_q8_i8's decode in the relaxed build: decode_q8_i16's grouping of the rows, its passes of
 * eight and four rows on relaxed SIMD's 8-bit dot product (kernels_relaxed.c), the two and one
 * rows left on the int16 product, which gives the same bits. */
static void decode_q8_i8_relaxed(float *Y, const int8_t *W, const float *scale, size_t rows, size_t cols,
                                 const int16_t *x, const float *xs)
{
    const size_t want = cols ? (KVL_DECODE_STREAM_GAP + cols - 1) / cols : 1;
    size_t r = 0;
    while (rows - r >= 8) {
        const size_t step = (rows - r) / 8 < want ? (rows - r) / 8 : want;
        for (size_t o = 0; o < step; o++)
            kvl_relaxed_decode_pass_q8_i8(8, step, Y, W, scale, r + o, cols, x, xs);
        r += 8 * step;
    }
    for (; r + 4 <= rows; r += 4)
        kvl_relaxed_decode_pass_q8_i8(4, 1, Y, W, scale, r, cols, x, xs);
    for (; r + 2 <= rows; r += 2)
        decode_rows2_int(IKIND_Q8, Y, W, scale, r, 1, cols, x, xs);
    for (; r < rows; r++)
        decode_row_int(IKIND_Q8, Y, W, scale, r, cols, x, xs);
}

/* through a volatile pointer for the reason decode_q8_i16_call gives */
static void (*volatile decode_q8_i8_relaxed_call)(float *, const int8_t *, const float *, size_t, size_t,
                                                  const int16_t *, const float *) = decode_q8_i8_relaxed;

static void simd128_relaxed_matmul_q8_i8(float *Y, size_t ldy, const int8_t *W, const float *scale,
                                         size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                                         size_t ldx, size_t n)
{
    if (n == 1)
        decode_q8_i8_relaxed_call(Y, W, scale, rows, cols, Xq, xs);
    else
        simd128_matmul_q8_i16(Y, ldy, W, scale, rows, cols, Xq, xs, ldx, n);
}
#endif

/* ---- Q4 weights (kernels.h: matmul_q4*) --------------------------------------------------
 *
 * A group's 16 bytes hold its columns 0-15 in the low nibbles and 16-31 in the high ones: one AND,
 * and one 16-bit shift + AND, give both halves in column order.
 *
 * matmul_q4 / _xb: rows four at a time (each activation vector loaded once for the four); in
 * decoding the four are `step` rows apart so their streams start KVL_DECODE_STREAM_GAP bytes
 * apart, as decode_q8_i16 groups them; for more tokens each tile of four adjacent rows runs every
 * token before the next (weights in L1). Rows left over take a tile whose missing rows repeat the
 * last one and are not stored. q - 8 widened to FP32, per group the 32 products summed in four
 * lanes, times the group's scale, added to the row's accumulator (no FMA in SIMD128): within FP32
 * rounding.
 *
 * matmul_q4_i16 (and matmul_q4_i8 in plain SIMD128, which has no 8-bit dot product; the relaxed
 * build's on kernels_relaxed.c's kvl_relaxed_q4_i8_pass): q4d below, for every n. */

/* the rows of a tile: r + i * step for i < nr, the last one repeated */
KVL_INLINE void q4_tile_rows(const uint8_t *W, const uint16_t *S, size_t cols, size_t r, size_t step, int nr,
                             const uint8_t *w[4], const uint16_t *s[4])
{
    for (int i = 0; i < 4; i++) {
        const size_t row = r + (size_t)(i < nr ? i : nr - 1) * step;
        w[i] = W + row * (cols / 2);
        s[i] = S + row * (cols / 32);
    }
}

KVL_INLINE void q4_store(float *Y, size_t r, size_t step, int nr, v128_t acc)
{
    float l[4];
    wasm_v128_store(l, acc);
    for (int i = 0; i < nr; i++)
        Y[r + (size_t)i * step] = l[i];
}

/* q - 8 of a group's 16 bytes: [columns 0-15] and [16-31] as int8 */
KVL_INLINE void q4_split_q(const uint8_t *w, v128_t *lo, v128_t *hi)
{
    const v128_t b = wasm_v128_load(w), m = wasm_i8x16_splat(0x0f), eight = wasm_i8x16_splat(8);
    *lo = wasm_i8x16_sub(wasm_v128_and(b, m), eight);
    *hi = wasm_i8x16_sub(wasm_v128_and(wasm_u16x8_shr(b, 4), m), eight);
}

/* One token, R rows (tile_rows, nr of them stored) */
KVL_INLINE void q4_rows4_f32(int xb, float *Y, const uint8_t *W, const uint16_t *S, size_t r, size_t step, int nr,
                             size_t cols, const float *x)
{
    const uint8_t *w[4];
    const uint16_t *s[4];
    q4_tile_rows(W, S, cols, r, step, nr, w, s);
    const size_t ng = cols / 32;
    v128_t acc[4];
    for (int i = 0; i < 4; i++)
        acc[i] = wasm_f32x4_splat(0.0f);
    for (size_t g = 0; g < ng; g++) {
        v128_t xv[8];
        KVL_UNROLL
        for (int k = 0; k < 8; k++)
            xv[k] = load_x(xb, x + 32 * g + 4 * (size_t)k);
        KVL_UNROLL
        for (int i = 0; i < 4; i++) {
            v128_t lo, hi;
            q4_split_q(w[i] + 16 * g, &lo, &hi);
            const v128_t l0 = wasm_i16x8_extend_low_i8x16(lo), l1 = wasm_i16x8_extend_high_i8x16(lo);
            const v128_t h0 = wasm_i16x8_extend_low_i8x16(hi), h1 = wasm_i16x8_extend_high_i8x16(hi);
#define Q4F(v, half) wasm_f32x4_convert_i32x4(half ? wasm_i32x4_extend_high_i16x8(v) : wasm_i32x4_extend_low_i16x8(v))
            v128_t a = wasm_f32x4_mul(Q4F(l0, 0), xv[0]);
            v128_t b = wasm_f32x4_mul(Q4F(l0, 1), xv[1]);
            a = madd(Q4F(l1, 0), xv[2], a);
            b = madd(Q4F(l1, 1), xv[3], b);
            a = madd(Q4F(h0, 0), xv[4], a);
            b = madd(Q4F(h0, 1), xv[5], b);
            a = madd(Q4F(h1, 0), xv[6], a);
            b = madd(Q4F(h1, 1), xv[7], b);
#undef Q4F
            acc[i] = madd(wasm_f32x4_add(a, b), wasm_f32x4_splat(bf16_scalar(s[i][g])), acc[i]);
        }
    }
    q4_store(Y, r, step, nr, hsum4x4_f32(acc[0], acc[1], acc[2], acc[3]));
}

/* ---- Q4 integer products (q4d): passes of 8 rows (two of four lanes) ---------------------
 *
 * As kernels_avx512.c's q4d (which explains the layout and why it is bit-identical): the token's
 * activations are laid out once per chunk of Q4D_KC columns in the nibbles' order, so a row's 16
 * bytes of a group, read as eight int16, give four vectors of unsigned nibbles by shifts and masks
 * (no widening: extend_high is two instructions in V8) and four i32x4.dot_i16x8_s; four rows'
 * group sums are reduced at once (q4d_hsum4x4), -8 * sum(x) of the group added, and the FP32 steps
 * run on [row 0 .. row 3] lanes. The block's scales are one 4-byte pair per row (one load per lane).
 * The eight rows of a pass are `step` rows apart, as decode_q8_i16 groups them (streams
 * KVL_DECODE_STREAM_GAP bytes apart: WebAssembly has no prefetch). The relaxed build's
 * matmul_q4_i8 runs kvl_relaxed_q4_i8_pass on the same passes, with the activations as int8 in
 * column order (which is the nibbles' order for a byte dot product). */

#define Q4D_KC 4096 /* columns per chunk of laid-out activations (8 KiB of stack, 0.5 of sums) */

typedef struct {
    v128_t x[Q4D_KC / 32][4]; /* per group: columns [2j], [16 + 2j], [2j + 1], [17 + 2j], j < 8 */
    int32_t corr[Q4D_KC / 32]; /* -8 * sum(x) of each group */
} q4d_act;

static volatile int16_t q4d_m16 = 0x000f; /* a value, not a constant V8 reloads (kernels_relaxed.c) */

/* columns [c0, c0 + kc) of the token (kc, c0 multiples of 32) */
static void q4d_layout(q4d_act *a, const int16_t *x, size_t c0, size_t kc)
{
    for (size_t g = 0; g < kc / 32; g++) {
        const int16_t *xg = x + c0 + 32 * g;
        const v128_t v0 = wasm_v128_load(xg), v1 = wasm_v128_load(xg + 8);
        const v128_t v2 = wasm_v128_load(xg + 16), v3 = wasm_v128_load(xg + 24);
        a->x[g][0] = wasm_i16x8_shuffle(v0, v1, 0, 2, 4, 6, 8, 10, 12, 14);
        a->x[g][1] = wasm_i16x8_shuffle(v2, v3, 0, 2, 4, 6, 8, 10, 12, 14);
        a->x[g][2] = wasm_i16x8_shuffle(v0, v1, 1, 3, 5, 7, 9, 11, 13, 15);
        a->x[g][3] = wasm_i16x8_shuffle(v2, v3, 1, 3, 5, 7, 9, 11, 13, 15);
        const v128_t s = wasm_i32x4_add(wasm_i32x4_add(wasm_i32x4_extadd_pairwise_i16x8(v0), wasm_i32x4_extadd_pairwise_i16x8(v1)),
                                        wasm_i32x4_add(wasm_i32x4_extadd_pairwise_i16x8(v2), wasm_i32x4_extadd_pairwise_i16x8(v3)));
        a->corr[g] = -8 * hsum4_i32(s);
    }
}

/* [sum a, sum b, sum c, sum d] as hsum4x4_i32, with the four shuffles single x64 unpacks
 * (punpck{l,h}{dq,qdq}) in V8 */
KVL_INLINE v128_t q4d_hsum4x4(v128_t a, v128_t b, v128_t c, v128_t d)
{
    const v128_t ab = wasm_i32x4_add(wasm_i32x4_shuffle(a, b, 0, 4, 1, 5), wasm_i32x4_shuffle(a, b, 2, 6, 3, 7));
    const v128_t cd = wasm_i32x4_add(wasm_i32x4_shuffle(c, d, 0, 4, 1, 5), wasm_i32x4_shuffle(c, d, 2, 6, 3, 7));
    return wasm_i32x4_add(wasm_i64x2_shuffle(ab, cd, 0, 2), wasm_i64x2_shuffle(ab, cd, 1, 3));
}

/* one row's four partial sums of nibble * x over group g (w at the group's 16 bytes) */
KVL_INLINE v128_t q4d_dot(const uint8_t *w, const v128_t *xg, v128_t m)
{
    const v128_t v = wasm_v128_load(w);
    return wasm_i32x4_add(wasm_i32x4_add(wasm_i32x4_dot_i16x8(wasm_v128_and(v, m), xg[0]),
                                         wasm_i32x4_dot_i16x8(wasm_v128_and(wasm_u16x8_shr(v, 4), m), xg[1])),
                          wasm_i32x4_add(wasm_i32x4_dot_i16x8(wasm_v128_and(wasm_u16x8_shr(v, 8), m), xg[2]),
                                         wasm_i32x4_dot_i16x8(wasm_u16x8_shr(v, 12), xg[3])));
}

/* Rows r + i * step, i < nr <= R (R = 8 or 4, a constant: every row pointer a local, no array in
 * linear memory; rows from nr on repeat the last and are not stored), one token, columns
 * [c0, c0 + kc); acc from Y when c0 > 0. */
KVL_INLINE void q4d_pass(const int R, float *Y, const uint8_t *W, const uint16_t *S, size_t r, size_t step, int nr,
                         size_t cols, const q4d_act *a, const float *xs, size_t c0, size_t kc)
{
    const size_t rb = cols / 2, ng = cols / 32, nk = kc / 32;
    const v128_t m = wasm_i16x8_splat(q4d_m16), hmask = wasm_i32x4_splat((int32_t)0xffff0000u);
    const uint8_t *w[8];
    const uint16_t *s[8];
    float l[8];
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        const size_t row = r + (size_t)(i < nr ? i : nr - 1) * step;
        w[i] = W + row * rb + c0 / 2;
        s[i] = S + row * ng + c0 / 32;
        l[i] = c0 > 0 ? Y[row] : 0.0f;
    }
    v128_t acc[2]; /* lane i: row 4h + i */
    KVL_UNROLL
    for (int h = 0; h < R / 4; h++)
        acc[h] = wasm_v128_load(l + 4 * h);
    const float *xsb = xs + c0 / 64;
    for (size_t g = 0; g < nk; g += 2) {
        const int two = g + 1 < nk;
        const v128_t *x0 = a->x[g], *x1 = a->x[g + two];
        const v128_t c0v = wasm_i32x4_splat(a->corr[g]), c1v = wasm_i32x4_splat(a->corr[g + two]);
        KVL_UNROLL
        for (int h = 0; h < R / 4; h++) {
            v128_t sc;
            if (two) {
                sc = wasm_v128_load32_zero(s[4 * h]);
                sc = wasm_v128_load32_lane(s[4 * h + 1], sc, 1);
                sc = wasm_v128_load32_lane(s[4 * h + 2], sc, 2);
                sc = wasm_v128_load32_lane(s[4 * h + 3], sc, 3);
            } else {
                sc = wasm_i32x4_make(*s[4 * h], *s[4 * h + 1], *s[4 * h + 2], *s[4 * h + 3]);
            }
            const v128_t s0 = q4d_hsum4x4(q4d_dot(w[4 * h], x0, m), q4d_dot(w[4 * h + 1], x0, m),
                                          q4d_dot(w[4 * h + 2], x0, m), q4d_dot(w[4 * h + 3], x0, m));
            v128_t p = wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_add(s0, c0v)), wasm_i32x4_shl(sc, 16));
            if (two) {
                const v128_t s1 = q4d_hsum4x4(q4d_dot(w[4 * h] + 16, x1, m), q4d_dot(w[4 * h + 1] + 16, x1, m),
                                              q4d_dot(w[4 * h + 2] + 16, x1, m), q4d_dot(w[4 * h + 3] + 16, x1, m));
                p = wasm_f32x4_add(p, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_add(s1, c1v)), wasm_v128_and(sc, hmask)));
            }
            acc[h] = wasm_f32x4_add(acc[h], wasm_f32x4_mul(p, wasm_f32x4_splat(*xsb)));
        }
        KVL_UNROLL
        for (int i = 0; i < R; i++) {
            w[i] += 32;
            s[i] += 2;
        }
        xsb++;
    }
    KVL_UNROLL
    for (int h = 0; h < R / 4; h++)
        wasm_v128_store(l + 4 * h, acc[h]);
    for (int i = 0; i < nr; i++)
        Y[r + (size_t)i * step] = l[i];
}

/* One token's columns [c0, c0 + kc) laid out for the int16 passes (a) or, in the relaxed build with
 * i8, as int8 and -8 * the group sums (x8, corr: kvl_relaxed_q4_i8_pass's). */
typedef struct {
    q4d_act a;
#if defined(KVL_WASM_RELAXED)
    int8_t x8[Q4D_KC];
    int32_t corr[Q4D_KC / 32];
#endif
} q4d_tok;

static void q4d_prepare(int i8, q4d_tok *p, const int16_t *x, size_t c0, size_t kc)
{
#if defined(KVL_WASM_RELAXED)
    if (i8) {
        for (size_t g = 0; g < kc / 32; g++) { /* |x| <= 127: narrowing is exact */
            const int16_t *xg = x + c0 + 32 * g;
            int32_t sum = 0;
            for (int j = 0; j < 32; j++)
                sum += xg[j];
            p->corr[g] = -8 * sum;
            wasm_v128_store(p->x8 + 32 * g, wasm_i8x16_narrow_i16x8(wasm_v128_load(xg), wasm_v128_load(xg + 8)));
            wasm_v128_store(p->x8 + 32 * g + 16, wasm_i8x16_narrow_i16x8(wasm_v128_load(xg + 16), wasm_v128_load(xg + 24)));
        }
        return;
    }
#else
    (void)i8; /* plain SIMD128 has no 8-bit dot product: _i8 is the int16 product */
#endif
    q4d_layout(&p->a, x, c0, kc);
}

/* rows r + i * step, i < nr (R = 8 if nr > 4, else 4), one prepared token */
static void q4d_run(int i8, float *Y, const uint8_t *W, const uint16_t *S, size_t r, size_t step, int nr,
                    size_t cols, const q4d_tok *p, const float *xs, size_t c0, size_t kc)
{
#if defined(KVL_WASM_RELAXED)
    if (i8) {
        kvl_relaxed_q4_i8_pass(Y, W, S, r, step, nr, cols, p->x8, p->corr, xs, c0, kc);
        return;
    }
#else
    (void)i8;
#endif
    if (nr > 4)
        q4d_pass(8, Y, W, S, r, step, nr, cols, &p->a, xs, c0, kc);
    else
        q4d_pass(4, Y, W, S, r, step, nr, cols, &p->a, xs, c0, kc);
}

/* Decoding (n == 1): the rows in passes of eight `step` apart (a group of 8 * step rows is `step`
 * passes), then of four, then one pass of what is left; each chunk of columns over every pass.
 * More tokens: in groups of Q4D_TOK, tiles of eight adjacent rows, each for every token of the
 * group before the next (its weights stay in L1). */
#define Q4D_TOK 2
static void q4d_matmul(int i8, float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows, size_t cols,
                       const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    const size_t nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    q4d_tok p[Q4D_TOK];
    if (n == 1) {
        const size_t rb = cols / 2, want = rb ? (KVL_DECODE_STREAM_GAP + rb - 1) / rb : 1;
        for (size_t c0 = 0; c0 < cols; c0 += Q4D_KC) {
            const size_t kc = cols - c0 < Q4D_KC ? cols - c0 : Q4D_KC;
            q4d_prepare(i8, &p[0], Xq, c0, kc);
            size_t r = 0;
            for (int R = 8; R >= 4; R -= 4)
                while (rows - r >= (size_t)R) {
                    const size_t step = (rows - r) / (size_t)R < want ? (rows - r) / (size_t)R : want;
                    for (size_t o = 0; o < step; o++)
                        q4d_run(i8, Y, W, S, r + o, step, R, cols, &p[0], xs, c0, kc);
                    r += (size_t)R * step;
                }
            if (r < rows)
                q4d_run(i8, Y, W, S, r, 1, (int)(rows - r), cols, &p[0], xs, c0, kc);
        }
        return;
    }
    for (size_t t0 = 0; t0 < n; t0 += Q4D_TOK) {
        const size_t nt = n - t0 < Q4D_TOK ? n - t0 : Q4D_TOK;
        for (size_t c0 = 0; c0 < cols; c0 += Q4D_KC) {
            const size_t kc = cols - c0 < Q4D_KC ? cols - c0 : Q4D_KC;
            for (size_t t = 0; t < nt; t++)
                q4d_prepare(i8, &p[t], Xq + (t0 + t) * ldx, c0, kc);
            for (size_t r = 0; r < rows; r += 8)
                for (size_t t = 0; t < nt; t++)
                    q4d_run(i8, Y + (t0 + t) * ldy, W, S, r, 1, rows - r < 8 ? (int)(rows - r) : 8, cols, &p[t],
                            xs + (t0 + t) * nb, c0, kc);
        }
    }
}

/* matmul_q4 / _xb (xb = 1: BF16-rounded activations): in decoding (n == 1) passes of four rows
 * `step` apart (streams KVL_DECODE_STREAM_GAP bytes apart, as decode_q8_i16), else tiles of four
 * adjacent rows, each for every token; a last tile of fewer rows. */
KVL_INLINE void q4_matmul_f32(int xb, float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const float *X, size_t ldx, size_t n)
{
    size_t r = 0;
    if (n == 1) {
        const size_t rb = cols / 2, want = rb ? (KVL_DECODE_STREAM_GAP + rb - 1) / rb : 1;
        while (rows - r >= 4) {
            const size_t step = (rows - r) / 4 < want ? (rows - r) / 4 : want;
            for (size_t o = 0; o < step; o++)
                q4_rows4_f32(xb, Y, W, S, r + o, step, 4, cols, X);
            r += 4 * step;
        }
        if (r < rows)
            q4_rows4_f32(xb, Y, W, S, r, 1, (int)(rows - r), cols, X);
        return;
    }
    for (; r < rows; r += 4)
        for (size_t t = 0; t < n; t++)
            q4_rows4_f32(xb, Y + t * ldy, W, S, r, 1, rows - r < 4 ? (int)(rows - r) : 4, cols, X + t * ldx);
}

static void simd128_matmul_q4(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const float *X, size_t ldx, size_t n)
{
    q4_matmul_f32(0, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void simd128_matmul_q4_xb(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                 size_t cols, const float *X, size_t ldx, size_t n)
{
    q4_matmul_f32(1, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void simd128_matmul_q4_i16(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                  size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    q4d_matmul(0, Y, ldy, W, S, rows, cols, Xq, xs, ldx, n);
}

#if defined(KVL_WASM_RELAXED)
/* matmul_q4_i8 in the relaxed build: every n on relaxed SIMD's 8-bit dot product
 * (kvl_relaxed_q4_i8_pass), in the row order of the others (q4d_matmul). */
static void simd128_relaxed_matmul_q4_i8(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                         size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    q4d_matmul(1, Y, ldy, W, S, rows, cols, Xq, xs, ldx, n);
}
#endif

/* ---- vector ops ------------------------------------------------------------------------ */

static float simd128_dot_f32(const float *a, const float *b, size_t n)
{
    v128_t s0 = wasm_f32x4_splat(0.0f), s1 = s0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 = madd(wasm_v128_load(a + i), wasm_v128_load(b + i), s0);
        s1 = madd(wasm_v128_load(a + i + 4), wasm_v128_load(b + i + 4), s1);
    }
    float s = hsum4(wasm_f32x4_add(s0, s1));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static void simd128_axpy_f32(float *y, float a, const float *x, size_t n)
{
    const v128_t va = wasm_f32x4_splat(a);
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        wasm_v128_store(y + i, madd(va, wasm_v128_load(x + i), wasm_v128_load(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

static void simd128_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v128_t lo, hi;
        bf16x8(wasm_v128_load(src + i), &lo, &hi);
        wasm_v128_store(dst + i, lo);
        wasm_v128_store(dst + i + 4, hi);
    }
    for (; i < n; i++)
        dst[i] = bf16_scalar(src[i]);
}

static void simd128_q8_to_f32(float *dst, const int8_t *src, float scale, size_t n)
{
    const v128_t s = wasm_f32x4_splat(scale);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v128_t b = wasm_v128_load(src + i);
        const v128_t lo = wasm_i16x8_extend_low_i8x16(b), hi = wasm_i16x8_extend_high_i8x16(b);
        wasm_v128_store(dst + i, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_extend_low_i16x8(lo)), s));
        wasm_v128_store(dst + i + 4, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_extend_high_i16x8(lo)), s));
        wasm_v128_store(dst + i + 8, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_extend_low_i16x8(hi)), s));
        wasm_v128_store(dst + i + 12, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_extend_high_i16x8(hi)), s));
    }
    for (; i < n; i++)
        dst[i] = (float)src[i] * scale;
}

/* Same bit recipe as the reference: RNE by adding 0x7fff + lsb; NaNs made quiet. Result: the
 * 16-bit value in each 32-bit lane. */
KVL_INLINE v128_t f32x4_to_bf16_bits(v128_t u)
{
    v128_t hi = wasm_u32x4_shr(u, 16);
    v128_t rounded = wasm_i32x4_add(u, wasm_i32x4_add(wasm_i32x4_splat(0x7fff), wasm_v128_and(hi, wasm_i32x4_splat(1))));
    rounded = wasm_u32x4_shr(rounded, 16);
    v128_t isnan = wasm_u32x4_gt(wasm_v128_and(u, wasm_i32x4_splat(0x7fffffff)), wasm_i32x4_splat(0x7f800000));
    return wasm_v128_bitselect(wasm_v128_or(hi, wasm_i32x4_splat(0x0040)), rounded, isnan);
}

static void simd128_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v128_t a = f32x4_to_bf16_bits(wasm_v128_load(src + i));
        v128_t b = f32x4_to_bf16_bits(wasm_v128_load(src + i + 4));
        /* every lane is in [0, 0xffff]: the unsigned saturating narrow is exact */
        wasm_v128_store(dst + i, wasm_u16x8_narrow_i32x4(a, b));
    }
    for (; i < n; i++)
        dst[i] = kvl_float_to_bf16(src[i]);
}

/* ---- exp-based element-wise functions --------------------------------------------------- */

/* e^x for 4 lanes, the method of exp16 in kernels_avx512.c: x = n ln2 + r with |r| <= ln2/2
 * (two-part ln2; n * 0.693359375 is exact, so the first reduction step is exact without FMA),
 * e^r by the Cephes expf polynomial, times 2^n as two exact powers of two 2^(n/2) (n in
 * [-150, 128]: each factor is a normal float), so the only rounding of the scaling is the last
 * multiplication, into the subnormal range below -87.3 and to +inf above 88.72, as expf does. */
KVL_INLINE v128_t exp4(v128_t x)
{
    x = wasm_f32x4_pmin(x, wasm_f32x4_splat(88.7228394f));
    x = wasm_f32x4_pmax(x, wasm_f32x4_splat(-104.0f));
    v128_t n = wasm_f32x4_nearest(wasm_f32x4_mul(x, wasm_f32x4_splat(1.44269504088896341f)));
    v128_t r = wasm_f32x4_sub(x, wasm_f32x4_mul(n, wasm_f32x4_splat(0.693359375f)));
    r = wasm_f32x4_sub(r, wasm_f32x4_mul(n, wasm_f32x4_splat(-2.12194440e-4f)));
    v128_t p = wasm_f32x4_splat(1.9875691500e-4f);
    p = madd(p, r, wasm_f32x4_splat(1.3981999507e-3f));
    p = madd(p, r, wasm_f32x4_splat(8.3334519073e-3f));
    p = madd(p, r, wasm_f32x4_splat(4.1665795894e-2f));
    p = madd(p, r, wasm_f32x4_splat(1.6666665459e-1f));
    p = madd(p, r, wasm_f32x4_splat(5.0000001201e-1f));
    p = madd(p, wasm_f32x4_mul(r, r), wasm_f32x4_add(r, wasm_f32x4_splat(1.0f)));
    v128_t ni = wasm_i32x4_trunc_sat_f32x4(n); /* integral already */
    v128_t n1 = wasm_i32x4_shr(ni, 1), n2 = wasm_i32x4_sub(ni, n1);
    v128_t s1 = wasm_i32x4_shl(wasm_i32x4_add(n1, wasm_i32x4_splat(127)), 23);
    v128_t s2 = wasm_i32x4_shl(wasm_i32x4_add(n2, wasm_i32x4_splat(127)), 23);
    return wasm_f32x4_mul(wasm_f32x4_mul(p, s1), s2);
}

/* kvl_softmax with exp4: the same max subtraction, all-masked rule and normalisation. Tails go
 * through a 4-lane buffer padded with -inf (e^-inf = 0). */
static void simd128_softmax(float *x, size_t n)
{
    if (n == 0)
        return;
    v128_t vmax = wasm_f32x4_splat(-INFINITY);
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        vmax = wasm_f32x4_pmax(vmax, wasm_v128_load(x + i));
    float mx = -INFINITY, l[4];
    wasm_v128_store(l, vmax);
    for (int k = 0; k < 4; k++)
        if (l[k] > mx)
            mx = l[k];
    for (; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    if (mx == -INFINITY) {
        for (i = 0; i < n; i++)
            x[i] = 1.0f / (float)n;
        return;
    }
    const v128_t m = wasm_f32x4_splat(mx);
    v128_t vsum = wasm_f32x4_splat(0.0f);
    for (i = 0; i + 4 <= n; i += 4) {
        v128_t e = exp4(wasm_f32x4_sub(wasm_v128_load(x + i), m));
        wasm_v128_store(x + i, e);
        vsum = wasm_f32x4_add(vsum, e);
    }
    if (i < n) {
        float buf[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        memcpy(buf, x + i, (n - i) * sizeof(float));
        v128_t e = exp4(wasm_f32x4_sub(wasm_v128_load(buf), m));
        wasm_v128_store(buf, e);
        memcpy(x + i, buf, (n - i) * sizeof(float));
        vsum = wasm_f32x4_add(vsum, e);
    }
    const v128_t inv = wasm_f32x4_splat(1.0f / hsum4(vsum));
    for (i = 0; i + 4 <= n; i += 4)
        wasm_v128_store(x + i, wasm_f32x4_mul(wasm_v128_load(x + i), inv));
    for (; i < n; i++)
        x[i] *= wasm_f32x4_extract_lane(inv, 0);
}

/* kvl_gelu_tanh as 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), as gelu_tanh16 in kernels_avx512.c. */
KVL_INLINE v128_t gelu_tanh4(v128_t v)
{
    v128_t v3 = wasm_f32x4_mul(wasm_f32x4_mul(v, v), v);
    v128_t u = wasm_f32x4_mul(wasm_f32x4_splat(-1.5957691216057308f), /* -2 sqrt(2/pi) */
                              madd(wasm_f32x4_splat(0.044715f), v3, v));
    return wasm_f32x4_div(v, wasm_f32x4_add(wasm_f32x4_splat(1.0f), exp4(u)));
}

static void simd128_gelu_tanh(float *x, size_t n)
{
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        wasm_v128_store(x + i, gelu_tanh4(wasm_v128_load(x + i)));
    if (i < n) {
        float buf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        memcpy(buf, x + i, (n - i) * sizeof(float));
        wasm_v128_store(buf, gelu_tanh4(wasm_v128_load(buf)));
        memcpy(x + i, buf, (n - i) * sizeof(float));
    }
}

/* gemm_tile (kernels.h) on 4 tokens x 8 outputs: 8 accumulators, 2 weight vectors, a broadcast
 * and a product in the 16 registers V8 maps v128 onto on x86-64 (a 6-token tile spills there).
 * No FMA in SIMD128: each product is rounded, then added, as the scalar reference does. */
enum { GEMM_MR = 4, GEMM_NR = 8 };
static void simd128_gemm_tile(size_t kc, const float *A, const float *B, float *C, size_t ldc,
                              int accumulate)
{
    v128_t acc[GEMM_MR][2];
    KVL_UNROLL
    for (int i = 0; i < GEMM_MR; i++)
        acc[i][0] = acc[i][1] = wasm_f32x4_splat(0.0f);
    for (size_t k = 0; k < kc; k++) {
        const v128_t b0 = wasm_v128_load(B + k * GEMM_NR), b1 = wasm_v128_load(B + k * GEMM_NR + 4);
        KVL_UNROLL
        for (int i = 0; i < GEMM_MR; i++) {
            const v128_t a = wasm_v128_load32_splat(A + k * GEMM_MR + (size_t)i);
            acc[i][0] = wasm_f32x4_add(acc[i][0], wasm_f32x4_mul(a, b0));
            acc[i][1] = wasm_f32x4_add(acc[i][1], wasm_f32x4_mul(a, b1));
        }
    }
    KVL_UNROLL
    for (int i = 0; i < GEMM_MR; i++) {
        float *c = C + (size_t)i * ldc;
        if (accumulate) {
            acc[i][0] = wasm_f32x4_add(wasm_v128_load(c), acc[i][0]);
            acc[i][1] = wasm_f32x4_add(wasm_v128_load(c + 4), acc[i][1]);
        }
        wasm_v128_store(c, acc[i][0]);
        wasm_v128_store(c + 4, acc[i][1]);
    }
}

const kvl_kernels kvl_kernels_simd128_table = {
    "simd128",
    0,
    driver_matmul_bf16,
    driver_matmul_q8,
    driver_matmul_f32,
    driver_matmul_bf16_xb,
    driver_matmul_q8_xb,
    driver_quantize_i16_act,
    simd128_matmul_q8_i16,
    simd128_matmul_q8_i16, /* matmul_q8_i8: no 8-bit dot product in SIMD128 (kernels.h) */
    driver_matmul_i16_i16,
    simd128_matmul_q4,
    simd128_matmul_q4_xb,
    simd128_matmul_q4_i16,
    simd128_matmul_q4_i16, /* matmul_q4_i8: no 8-bit dot product in SIMD128 (kernels.h) */
    simd128_dot_f32,
    simd128_axpy_f32,
    driver_axpy_rows_f32,
    simd128_bf16_to_f32,
    simd128_q8_to_f32,
    simd128_f32_to_bf16,
    simd128_softmax,
    simd128_gelu_tanh,
    GEMM_MR, GEMM_NR, simd128_gemm_tile, NULL /* no BF16 dot product */,
};

#if defined(KVL_WASM_RELAXED)
/* "simd128-relaxed": the simd128 table with matmul_q8_i8's decode on relaxed SIMD, the one
 * product it makes faster and keeps exact (kernels_relaxed.c: why only there, and by how much). */
const kvl_kernels kvl_kernels_simd128_relaxed_table = {
    "simd128-relaxed",
    0,
    driver_matmul_bf16,
    driver_matmul_q8,
    driver_matmul_f32,
    driver_matmul_bf16_xb,
    driver_matmul_q8_xb,
    driver_quantize_i16_act,
    simd128_matmul_q8_i16,
    simd128_relaxed_matmul_q8_i8,
    driver_matmul_i16_i16,
    simd128_matmul_q4,
    simd128_matmul_q4_xb,
    simd128_matmul_q4_i16,
    simd128_relaxed_matmul_q4_i8,
    simd128_dot_f32,
    simd128_axpy_f32,
    driver_axpy_rows_f32,
    simd128_bf16_to_f32,
    simd128_q8_to_f32,
    simd128_f32_to_bf16,
    simd128_softmax,
    simd128_gelu_tanh,
    GEMM_MR, GEMM_NR, simd128_gemm_tile, NULL /* no BF16 dot product */,
};
#endif

#endif /* __wasm_simd128__ */
