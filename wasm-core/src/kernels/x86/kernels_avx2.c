/* kernels_avx2.c — the "avx2" kernel table (AVX2 + FMA + F16C).
 *
 * Owns: AVX2 versions of every kvl_kernels entry. This file alone is compiled with
 * -mavx2 -mfma -mf16c (/arch:AVX2 on MSVC), so nothing here may run before kernels_select.c
 * has checked the CPU and OS.
 * Does not own: the numeric definition of each kernel (kernels_ref.c is the reference; results
 * here differ from it only by FP32 summation order), threading, CPU detection.
 *
 * Matrix products use register tiles of up to 4 weight rows x 2 activation vectors: each
 * weight vector is loaded and converted once and used for 2 tokens, each activation vector
 * once for 4 rows (16 ymm registers allow no more without spills). Decode (n = 1) is
 * memory-bound, so the 4x1 tile keeps just enough independent FMA chains to outrun DRAM.
 * Every loop has a scalar tail for odd sizes.
 */
#include "../kernels.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#if defined(_MSC_VER) && !defined(__clang__)
#define KVL_INLINE static __forceinline
#define KVL_NOINLINE __declspec(noinline)
#elif defined(__GNUC__) || defined(__clang__)
#define KVL_INLINE static inline __attribute__((always_inline))
#define KVL_NOINLINE __attribute__((noinline))
#else
#define KVL_INLINE static inline
#define KVL_NOINLINE
#endif

/* The tile loops below run over compile-time constants (R, T <= 4) and must be fully unrolled so
 * the accumulator arrays become registers; GCC at -O2 does not do that on its own. */
#if defined(__GNUC__) || defined(__clang__)
#define KVL_UNROLL _Pragma("GCC unroll 8")
#else
#define KVL_UNROLL
#endif

#define TR 4 /* rows per tile */
#define TT 2 /* tokens per tile: 4x2 accumulators + 4 weights + 1 activation fit in 16 ymm */

KVL_INLINE float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static float bf16_scalar(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 8 bf16 -> 8 fp32: widen to 32 bits and shift into the high half (exact, no rounding). */
KVL_INLINE __m256 load_bf16x8(const uint16_t *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

KVL_INLINE __m256 load_q8x8(const int8_t *p)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)p);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* ---- generic tile: R rows x T tokens, the weight element type chosen by KIND ------------ */

enum { KIND_BF16, KIND_Q8, KIND_F32 };

KVL_INLINE __m256 load_w(int kind, const void *w, size_t c)
{
    if (kind == KIND_BF16)
        return load_bf16x8((const uint16_t *)w + c);
    if (kind == KIND_Q8)
        return load_q8x8((const int8_t *)w + c);
    return _mm256_loadu_ps((const float *)w + c);
}

KVL_INLINE float scalar_w(int kind, const void *w, size_t c)
{
    if (kind == KIND_BF16)
        return bf16_scalar(((const uint16_t *)w)[c]);
    if (kind == KIND_Q8)
        return (float)((const int8_t *)w)[c];
    return ((const float *)w)[c];
}

/* kvl_bf16_round_daz on 8 lanes: nearest-even by integer add and truncate, subnormal inputs to
 * signed zero (NaN payloads are not preserved: a NaN activation gives a non-finite result
 * either way). */
KVL_INLINE __m256 round_bf16x8(__m256 v)
{
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f800000)),
                                           _mm256_setzero_si256());
    r = _mm256_blendv_epi8(r, _mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u)), subnormal);
    return _mm256_castsi256_ps(r);
}

KVL_INLINE __m256 load_x(int xb, const float *x)
{
    return xb ? round_bf16x8(_mm256_loadu_ps(x)) : _mm256_loadu_ps(x);
}

KVL_INLINE float scalar_x(int xb, float x)
{
    return xb ? kvl_bf16_round_daz(x) : x;
}

KVL_INLINE size_t elem_size(int kind)
{
    return kind == KIND_BF16 ? 2 : kind == KIND_Q8 ? 1 : 4;
}

/* Y[t*ldy + r0 + i] = (sum_c W[r0+i, c] X[t, c]) * (scale ? scale[r0+i] : 1) for i<R, t<T.
 * R and T are compile-time constants at every call site, so the accumulators live in
 * registers after inlining. */
KVL_INLINE void tile(int kind, int xb, float *Y, size_t ldy, const void *W, const float *scale,
                     size_t r0, size_t cols, const float *X, size_t ldx, int prefetch, const int R,
                     const int T)
{
    __m256 acc[TR][TT];
    const char *wrow[TR];
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        wrow[i] = (const char *)W + (r0 + (size_t)i) * cols * elem_size(kind);
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            acc[i][t] = _mm256_setzero_ps();
    }
    size_t c = 0;
    const size_t row_bytes = cols * elem_size(kind);
    for (; c + 8 <= cols; c += 8) {
        /* Rows of a tile are short streams (2-4 KB) that the hardware prefetcher barely ramps
         * up on; fetch the next tile's rows (contiguous after ours) into L2, a line at a time. */
        if (prefetch && ((c * elem_size(kind)) & 63) == 0) {
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                _mm_prefetch(wrow[i] + (size_t)R * row_bytes + c * elem_size(kind), _MM_HINT_T1);
        }
        __m256 w[TR];
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            w[i] = load_w(kind, wrow[i], c);
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            __m256 x = load_x(xb, X + (size_t)t * ldx + c);
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                acc[i][t] = _mm256_fmadd_ps(w[i], x, acc[i][t]);
        }
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            float s = hsum256(acc[i][t]);
            const float *x = X + (size_t)t * ldx;
            for (size_t cc = c; cc < cols; cc++)
                s += scalar_w(kind, wrow[i], cc) * scalar_x(xb, x[cc]);
            if (scale)
                s *= scale[r0 + (size_t)i];
            Y[(size_t)t * ldy + r0 + (size_t)i] = s;
        }
    }
}

/* Decode (one activation vector): one row at a time with four independent accumulators, so
 * each thread reads its share of the matrix as one sequential stream that the hardware
 * prefetchers follow across rows (see decode_row in kernels_avx512.c for the measurement). */
KVL_INLINE void decode_row(int kind, int xb, float *Y, const void *W, const float *scale, size_t r,
                           size_t cols, const float *X)
{
    const char *w = (const char *)W + r * cols * elem_size(kind);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        a0 = _mm256_fmadd_ps(load_w(kind, w, c), load_x(xb, X + c), a0);
        a1 = _mm256_fmadd_ps(load_w(kind, w, c + 8), load_x(xb, X + c + 8), a1);
        a2 = _mm256_fmadd_ps(load_w(kind, w, c + 16), load_x(xb, X + c + 16), a2);
        a3 = _mm256_fmadd_ps(load_w(kind, w, c + 24), load_x(xb, X + c + 24), a3);
    }
    for (; c + 8 <= cols; c += 8)
        a0 = _mm256_fmadd_ps(load_w(kind, w, c), load_x(xb, X + c), a0);
    float s = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; c < cols; c++)
        s += scalar_w(kind, w, c) * scalar_x(xb, X[c]);
    Y[r] = scale ? s * scale[r] : s;
}

/* ---- integer mode ------------------------------------------------------------------------
 *
 * _mm256_madd_epi16 multiplies 16 int16 pairs and adds adjacent products into 8 int32 lanes,
 * exactly. matmul_q8_i16 keeps those lane sums in int32 over a whole KVL_I16_BLOCK block (any
 * partial sum of a block is bounded like the block: exact), reduces them exactly and adds the
 * block sums in FP32 in block order, so it is bit-identical to the reference. matmul_i16_i16
 * adds two madd results (4 products per lane, < 2^31) before converting to FP32. */

enum { IKIND_Q8, IKIND_I16 };

#define TRI 4 /* integer tiles: 4 rows x 2 tokens, as the float ones */
#define TTI 2

KVL_INLINE int32_t hsum_epi32_256(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 16 int8 weights -> 16 int16 */
KVL_INLINE __m256i load_q8x16_i16(const int8_t *p)
{
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
}

KVL_INLINE __m256i load_i16x16(const int16_t *p)
{
    return _mm256_loadu_si256((const __m256i *)(const void *)p);
}

/* One block of cols values: its scale (xs[0]) and integers, by the reference's rule. */
static void quantize_block(int16_t *q, float *xs, const float *x, size_t cols, float limf)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lim = _mm256_set1_ps(limf), nlim = _mm256_set1_ps(-limf);
    /* max(|x|, m) with m second: MAXPS returns the second operand when either is NaN, so a
     * NaN input is ignored, as in the reference. */
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    size_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        m0 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + c), absmask), m0);
        m1 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + c + 8), absmask), m1);
    }
    for (; c + 8 <= cols; c += 8)
        m0 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + c), absmask), m0);
    m0 = _mm256_max_ps(m0, m1);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    for (; c < cols; c++) {
        float a = fabsf(x[c]);
        if (a > amax)
            amax = a;
    }
    /* Same scalar expressions as the reference, so the integers agree exactly. */
    float inv = amax > 0.0f ? limf / amax : 0.0f;
    xs[0] = amax / limf;
    const __m256 vi = _mm256_set1_ps(inv);
    c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(x + c), vi);
        __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(x + c + 8), vi);
        /* NaN -> 0, then the clamp (integer bounds: clamping before rounding is the same) */
        p0 = _mm256_and_ps(p0, _mm256_cmp_ps(p0, p0, _CMP_ORD_Q));
        p1 = _mm256_and_ps(p1, _mm256_cmp_ps(p1, p1, _CMP_ORD_Q));
        p0 = _mm256_max_ps(_mm256_min_ps(p0, lim), nlim);
        p1 = _mm256_max_ps(_mm256_min_ps(p1, lim), nlim);
        /* cvtps rounds with MXCSR (default nearest-even), like rintf in the reference */
        __m256i i = _mm256_packs_epi32(_mm256_cvtps_epi32(p0), _mm256_cvtps_epi32(p1));
        /* pack works per 128-bit lane; restore element order */
        i = _mm256_permute4x64_epi64(i, 0xD8);
        _mm256_storeu_si256((__m256i *)(void *)(q + c), i);
    }
    for (; c < cols; c++)
        q[c] = kvl_i16_round_clamp(x[c] * inv, limf);
}

/* Decode (one token): one row as one sequential stream, four independent accumulators. */
KVL_INLINE void decode_row_int(int kind, float *Y, const void *W, const float *scale, size_t r,
                               size_t cols, const int16_t *x, const float *xs)
{
    if (kind == IKIND_Q8) {
        const int8_t *w = (const int8_t *)W + r * cols;
        float acc = 0.0f;
        for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
            size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            size_t c = b;
            for (; c + 64 <= e; c += 64) {
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(load_q8x16_i16(w + c), load_i16x16(x + c)));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(load_q8x16_i16(w + c + 16), load_i16x16(x + c + 16)));
                a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(load_q8x16_i16(w + c + 32), load_i16x16(x + c + 32)));
                a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(load_q8x16_i16(w + c + 48), load_i16x16(x + c + 48)));
            }
            for (; c + 16 <= e; c += 16)
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(load_q8x16_i16(w + c), load_i16x16(x + c)));
            int32_t s = hsum_epi32_256(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
            for (; c < e; c++)
                s += (int32_t)w[c] * (int32_t)x[c];
            const float p = (float)s * xs[b / KVL_I16_BLOCK];
            acc += p;
        }
        Y[r] = acc * scale[r];
        return;
    }
    const int16_t *w = (const int16_t *)W + r * cols;
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    size_t c = 0;
#define I16_GROUP(o) \
    _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(load_i16x16(w + c + (o)), load_i16x16(x + c + (o))), \
                                        _mm256_madd_epi16(load_i16x16(w + c + (o) + 16), load_i16x16(x + c + (o) + 16))))
    for (; c + 128 <= cols; c += 128) {
        f0 = _mm256_add_ps(f0, I16_GROUP(0));
        f1 = _mm256_add_ps(f1, I16_GROUP(32));
        f2 = _mm256_add_ps(f2, I16_GROUP(64));
        f3 = _mm256_add_ps(f3, I16_GROUP(96));
    }
    for (; c + 32 <= cols; c += 32)
        f0 = _mm256_add_ps(f0, I16_GROUP(0));
#undef I16_GROUP
    if (c + 16 <= cols) {
        f1 = _mm256_add_ps(f1, _mm256_cvtepi32_ps(_mm256_madd_epi16(load_i16x16(w + c), load_i16x16(x + c))));
        c += 16;
    }
    float s = hsum256(_mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(f2, f3)));
    s = kvl_i16_group_sum(w, x, c, cols, s);
    Y[r] = (s * scale[r]) * xs[0];
}

/* Decode, four rows at a time: the next four rows' block b (from w3, the current fourth row), as
 * tile() prefetches its next tile. */
KVL_INLINE void prefetch_next_rows4(const int8_t *w3, size_t cols, size_t b)
{
    for (size_t i = 1; i <= 4; i++)
        _mm_prefetch((const char *)(w3 + i * cols + b), _MM_HINT_T1);
}

/* Q8 x int16 decode, four rows at a time: a 64-column block is four VPMADDWD per row, so the
 * four rows' block sums are reduced together (halves added, then two rounds of horizontal adds),
 * exactly, into one vector whose lanes then take the reference's (float)sum * scale, rounded,
 * plus acc, rounded. Identical to decode_row_int. */
#define KVL_DECODE_ROWS4_Q8 IKIND_Q8 /* the weight kind decode_rows4_q8 serves */
KVL_INLINE __m128i reduce4_epi32(__m256i a, __m256i b, __m256i c, __m256i d)
{
#define HALVES(v) _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
    return _mm_hadd_epi32(_mm_hadd_epi32(HALVES(a), HALVES(b)), _mm_hadd_epi32(HALVES(c), HALVES(d)));
#undef HALVES
}

/* The end of one block of four Q8 rows: their exact int32 sums s plus the scalar tail [c, e),
 * then, lane by lane, the reference's (float)sum * block scale (rounded) + acc (rounded). */
KVL_INLINE __m128 add_block4(__m128 acc, __m128i s, const int8_t *w0, const int8_t *w1, const int8_t *w2,
                             const int8_t *w3, const int16_t *x, size_t c, size_t e, float xsb)
{
    if (c < e) {
        int32_t tail[4] = {0, 0, 0, 0};
        for (size_t k = c; k < e; k++) {
            tail[0] += (int32_t)w0[k] * (int32_t)x[k];
            tail[1] += (int32_t)w1[k] * (int32_t)x[k];
            tail[2] += (int32_t)w2[k] * (int32_t)x[k];
            tail[3] += (int32_t)w3[k] * (int32_t)x[k];
        }
        s = _mm_add_epi32(s, _mm_loadu_si128((const __m128i *)(const void *)tail));
    }
    const __m128 p = _mm_mul_ps(_mm_cvtepi32_ps(s), _mm_set1_ps(xsb));
    return _mm_add_ps(acc, p);
}

KVL_INLINE void decode_rows4_q8(float *Y, const int8_t *W, const float *scale, size_t r,
                                size_t cols, const int16_t *x, const float *xs, int prefetch)
{
    const int8_t *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
    __m128 acc = _mm_setzero_ps(); /* lane i: row r + i */
    for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
        size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        if (prefetch)
            prefetch_next_rows4(w3, cols, b);
        size_t c = b;
        for (; c + 16 <= e; c += 16) {
            __m256i xv = load_i16x16(x + c);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(load_q8x16_i16(w0 + c), xv));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(load_q8x16_i16(w1 + c), xv));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(load_q8x16_i16(w2 + c), xv));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(load_q8x16_i16(w3 + c), xv));
        }
        acc = add_block4(acc, reduce4_epi32(a0, a1, a2, a3), w0, w1, w2, w3, x, c, e, xs[b / KVL_I16_BLOCK]);
    }
    _mm_storeu_ps(Y + r, _mm_mul_ps(acc, _mm_loadu_ps(scale + r)));
}

/* Q8 x 8-bit decode (matmul_q8_i8), four rows at a time: 32 activations are packed to int8 once
 * for the four rows; per row, VPSIGNB gives w its activation's sign (w * sign(x); |w| <= 127, so
 * no overflow), VPMADDUBSW multiplies by |x| as u8 and adds pairs (<= 2*127*127: no saturation),
 * VPMADDWD by ones adds pairs again into int32: four instructions per 32 weights where the int16
 * product takes six. Block sums exact; then as decode_rows4_q8, so identical to it. */
#define KVL_DECODE_ROWS4_I8 1 /* matmul_q8_i8_generic (kernels_matmul_driver.h) */
KVL_INLINE void decode_rows4_q8_i8(float *Y, const int8_t *W, const float *scale, size_t r,
                                   size_t cols, const int16_t *x, const float *xs, int prefetch)
{
    const int8_t *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 acc = _mm_setzero_ps(); /* lane i: row r + i */
#define I8_DOT(a, w) a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8( \
        _mm256_loadu_si256((const __m256i *)(const void *)((w) + c)), x8)), ones))
    for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
        size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        if (prefetch)
            prefetch_next_rows4(w3, cols, b);
        size_t c = b;
        for (; c + 32 <= e; c += 32) {
            /* packs works per 128-bit lane: restore column order */
            const __m256i x8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(load_i16x16(x + c), load_i16x16(x + c + 16)), 0xD8);
            const __m256i ax = _mm256_abs_epi8(x8);
            I8_DOT(a0, w0);
            I8_DOT(a1, w1);
            I8_DOT(a2, w2);
            I8_DOT(a3, w3);
        }
        acc = add_block4(acc, reduce4_epi32(a0, a1, a2, a3), w0, w1, w2, w3, x, c, e, xs[b / KVL_I16_BLOCK]);
    }
#undef I8_DOT
    _mm_storeu_ps(Y + r, _mm_mul_ps(acc, _mm_loadu_ps(scale + r)));
}

/* Primitives of the driver's integer tile (tile_int, kernels_matmul_driver.h): 16 columns a step
 * (VPMADDWD into int32 lanes), no masked loads (scalar column tails); four sums reduced at once by
 * reduce4_epi32. */
#define TI_MASKED 0
#define TI_Q8_STEP 16
#define TI_I16_STEP 16
#define TI_Q8W __m256i
#define TI_Q8X __m256i
#define TI_IACC __m256i
#define TI_I16V __m256i
#define TI_FACC __m256
#define TI_I4 __m128i
#define TI_F4 __m128
#define ti_izero() _mm256_setzero_si256()
#define ti_load_q8w(row, c, e) load_q8x16_i16((row) + (c))
#define ti_load_q8x(row, c, e) load_i16x16((row) + (c))
#define ti_dot_q8(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define ti_ihsum(v) hsum_epi32_256(v)
#define ti_reduce4(a, b, c, d) reduce4_epi32(a, b, c, d)
#define ti_i4_add(a, b) _mm_add_epi32(a, b)
#define ti_i4_load(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define ti_f4_zero() _mm_setzero_ps()
#define ti_f4_from_i4(v) _mm_cvtepi32_ps(v)
#define ti_f4_mul(a, b) _mm_mul_ps(a, b)
#define ti_f4_add(a, b) _mm_add_ps(a, b)
#define ti_f4_splat(v) _mm_set1_ps(v)
#define ti_f4_load(p) _mm_loadu_ps(p)
#define ti_f4_store(p, v) _mm_storeu_ps(p, v)
#define ti_prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#define ti_prefetch_i16_step(p) ti_prefetch(p) /* a step's 32 int16: one line */
#define ti_load_i16(row, c, e) load_i16x16((row) + (c))
#define ti_fzero() _mm256_setzero_ps()
#define ti_fadd(a, b) _mm256_add_ps(a, b)
#define ti_fhsum(v) hsum256(v)
#define ti_i16_quad(w0, x0, w1, x1) _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)))
#define ti_i16_pair(w, x) _mm256_cvtepi32_ps(_mm256_madd_epi16(w, x))

/* Vector primitives of axpy_rows_generic (the driver): avx2_axpy_f32's FMA on 8 floats. */
#define AXPY_VW 8
#define AXPY_VEC __m256
#define AXPY_LOAD(p) _mm256_loadu_ps(p)
#define AXPY_STORE(p, v) _mm256_storeu_ps(p, v)
#define AXPY_SPLAT(a) _mm256_set1_ps(a)
#define AXPY_MADD(a, x, y) _mm256_fmadd_ps(a, x, y)

/* ---- Q8 x int16 prefill with rows in the lanes (matmul_q8_i16_strips, kernels_matmul_driver.h):
 * 8 rows per vector, STRIP_DOT one VPMADDWD and one VPADDD. */

#define STRIP_ROWS 8
#define STRIP_IVEC __m256i
#define STRIP_FVEC __m256
#define STRIP_RMASK __m256i
#define STRIP_RMASK_OF(nr) _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nr)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define STRIP_ILOAD(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define STRIP_IZERO() _mm256_setzero_si256()
#define STRIP_ISPLAT(v) _mm256_set1_epi32(v)
#define STRIP_DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define STRIP_CVT(v) _mm256_cvtepi32_ps(v)
#define STRIP_FZERO() _mm256_setzero_ps()
#define STRIP_FSPLAT(v) _mm256_set1_ps(v)
#define STRIP_FADD(a, b) _mm256_add_ps(a, b)
#define STRIP_FMUL(a, b) _mm256_mul_ps(a, b)
#define STRIP_FLOAD(m, p) _mm256_maskload_ps(p, m)
#define STRIP_FSTORE(m, p, v) _mm256_maskstore_ps(p, m, v)

/* 8 x 8 int32 transpose in registers: r[i] lane j <-> r[j] lane i. */
KVL_INLINE void transpose8_epi32(__m256i r[8])
{
    __m256i t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2x128_si256(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++)
        r[i] = t[i];
}

/* Rows [r0, r0 + nr) (nr <= 8), columns [c0, c0 + nc) as int16 pairs: P[p * 8 + i] = the pair
 * (c0 + 2p, c0 + 2p + 1) of row r0 + i, zero outside the matrix. */
static void pack_q8_strip(int32_t *P, const int8_t *W, size_t cols, size_t r0, size_t nr, size_t c0, size_t nc)
{
    for (size_t c = 0; c < nc; c += 16) {
        const size_t k = nc - c < 16 ? nc - c : 16;
        __m256i r[8];
        for (size_t i = 0; i < 8; i++) {
            if (i >= nr) {
                r[i] = _mm256_setzero_si256();
            } else if (k == 16) {
                r[i] = load_q8x16_i16(W + (r0 + i) * cols + c0 + c);
            } else { /* a column tail: no byte-masked loads on AVX2 */
                int8_t tail[16] = {0};
                memcpy(tail, W + (r0 + i) * cols + c0 + c, k);
                r[i] = load_q8x16_i16(tail);
            }
        }
        transpose8_epi32(r);
        for (int p = 0; p < 8; p++)
            _mm256_storeu_si256((__m256i *)(void *)(P + (c / 2 + (size_t)p) * STRIP_ROWS), r[p]);
    }
}

#include "../kernels_matmul_driver.h"

/* ---- Q4 weights (kernels.h: matmul_q4*) --------------------------------------------------
 *
 * A group's 16 bytes hold its columns 0-15 in the low nibbles and 16-31 in the high ones, so one
 * AND and one shift + AND give both halves in column order. Rows are taken four at a time (the
 * activations loaded once for the four), each tile for every token before the next (its weights
 * stay in L1), the next four rows prefetched in decoding; rows left over take a tile of one.
 *
 * matmul_q4 / _xb: per row and group, the 32 weights q - 8 widened to FP32, their products with x
 * summed in 8 lanes (one multiply, three FMAs), then one FMA by the group's scale into the row's
 * accumulator: within FP32 rounding of the reference.
 *
 * matmul_q4_i16 / _i8: q4d below, for every n. Where a last block holds one group (cols % 64 ==
 * 32) its missing group's sum and scale are 0, and adding that +0 to p changes nothing the result
 * can show (acc starts at +0, so it is never -0, and x + (+-0) = x otherwise). */

/* ---- Q4 integer products (q4d): 8 rows x 64 columns (32 bytes per row) per step -------------
 *
 * As kernels_avx512.c's q4d (which explains the layout and why it is bit-identical), on 256-bit
 * vectors: the token's activations laid out once per chunk in the nibbles' order, each row's 32
 * bytes (two groups, one per 128-bit lane) unpacked by shifts and masks only; _i16: four VPMADDWD
 * on the int16 nibble vectors; _i8: two VPMADDUBSW (nibble u8 times x int8; pairs <= 2 * 15 * 127,
 * two added <= 7620: no saturation) and one VPMADDWD by ones; the accumulator starts at -8 * sum(x)
 * of each group. Eight rows' sums reduced by two rounds of horizontal adds into [g0 r0-3 | g1
 * r0-3] and [g0 r4-7 | g1 r4-7], exactly, then the FP32 steps on the eight rows at once. The
 * tile's scales are first transposed to one vector per block (a 4-byte pair per row; 8 x 8
 * transposes: a gather per block cost 14 % on Zen 4). A last block of one group (cols % 64 == 32)
 * takes 16 bytes and one scale per row (the missing group as 0). */

#define Q4D_KC 4096 /* columns per chunk of laid-out activations (10 KiB of stack, 2 of scales) */
#define Q4D_STEPS (Q4D_KC / 64)

typedef struct {
    __m256i x[Q4D_STEPS][4]; /* _i16: the four int16 layouts; _i8: [0] low, [1] high nibbles' x */
    __m256i corr[Q4D_STEPS]; /* -8 * sum(x) of group 2k in lanes 0-3, of 2k + 1 in lanes 4-7 */
} q4d_act;

/* Columns [c0, c0 + kc) of the token (kc a multiple of 32, c0 of 64). */
static void q4d_layout(int i8, q4d_act *a, const int16_t *x, size_t c0, size_t kc)
{
    const size_t steps = (kc + 63) / 64, ng = kc / 32;
    for (size_t k = 0; k < steps; k++) {
        /* per 128-bit lane: the even int16 in the low 8 bytes, the odd ones in the high 8 */
        const __m256i eo = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        int32_t corr[8] = {0};
        for (int l = 0; l < 2; l++) {
            const size_t g = 2 * k + (size_t)l;
            __m256i v0 = _mm256_setzero_si256(), v1 = v0;
            if (g < ng) {
                v0 = _mm256_loadu_si256((const __m256i *)(const void *)(x + c0 + 32 * g));
                v1 = _mm256_loadu_si256((const __m256i *)(const void *)(x + c0 + 32 * g + 16));
            }
            corr[4 * l] = corr[4 * l + 1] = corr[4 * l + 2] = corr[4 * l + 3] = -8 * hsum_epi32_256(_mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_set1_epi16(1)),
                                                                     _mm256_madd_epi16(v1, _mm256_set1_epi16(1))));
            __m128i *d[4];
            for (int j = 0; j < 4; j++)
                d[j] = (__m128i *)(void *)((char *)&a->x[k][j] + 16 * l);
            if (i8) { /* bytes 0-15: columns 0-15 (low nibbles), 16-31: columns 16-31 (high) */
                const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(v0, v1), 0xD8);
                _mm_storeu_si128(d[0], _mm256_castsi256_si128(b));
                _mm_storeu_si128(d[1], _mm256_extracti128_si256(b, 1));
            } else { /* [columns 2j | 16 + 2j | 2j + 1 | 17 + 2j], j < 8 */
                const __m256i e0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v0, eo), 0xD8);
                const __m256i e1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v1, eo), 0xD8);
                _mm_storeu_si128(d[0], _mm256_castsi256_si128(e0));
                _mm_storeu_si128(d[1], _mm256_castsi256_si128(e1));
                _mm_storeu_si128(d[2], _mm256_extracti128_si256(e0, 1));
                _mm_storeu_si128(d[3], _mm256_extracti128_si256(e1, 1));
            }
        }
        a->corr[k] = _mm256_loadu_si256((const __m256i *)(const void *)corr);
    }
}

/* One row's int32 sums of nibble * x in a step: [group 2k: 4 partial sums | group 2k + 1: 4] */
KVL_INLINE __m256i q4d_row(int i8, __m256i v, const q4d_act *a, size_t k)
{
    if (i8) {
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, m4), a->x[k][0]),
                                           _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), a->x[k][1]));
        return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
    const __m256i m = _mm256_set1_epi16(0x000f);
    const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, m), a->x[k][0]),
                                        _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m), a->x[k][1]));
    const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), m), a->x[k][2]),
                                        _mm256_madd_epi16(_mm256_srli_epi16(v, 12), a->x[k][3]));
    return _mm256_add_epi32(p0, p1);
}

/* Rows r .. r + nr - 1 (nr <= 8) of one token, columns [c0, c0 + kc) laid out in a; acc from Y
 * when c0 > 0 (an earlier chunk's), else 0. */
KVL_INLINE void q4d_rows8(int i8, float *Y, const uint8_t *W, const uint16_t *S, size_t r, int nr, size_t cols,
                          const q4d_act *a, const float *xs, size_t c0, size_t kc, int prefetch)
{
    const size_t rb = cols / 2, ng = cols / 32, full = kc / 64;
    const uint8_t *w[8];
    size_t soff[8]; /* bytes from row r's scales */
    for (int i = 0; i < 8; i++) {
        const size_t d = (size_t)(i < nr ? i : nr - 1);
        w[i] = W + (r + d) * rb + c0 / 2;
        soff[i] = d * ng * 2;
    }
    const uint16_t *s = S + r * ng + c0 / 32;
    /* the tile's scales, step by step: st[k] lane i = row i's pair (2k, 2k + 1), 8 steps at a time
     * by an 8 x 8 transpose; the last block of one group has the missing scale 0 */
    __m256i st[Q4D_STEPS];
    const size_t steps = (kc + 63) / 64;
    size_t k = 0;
    for (; k + 8 <= full; k += 8) {
        __m256i t[8];
        for (int i = 0; i < 8; i++)
            t[i] = _mm256_loadu_si256((const __m256i *)(const void *)(s + soff[i] / 2 + 2 * k));
        transpose8_epi32(t);
        for (int j = 0; j < 8; j++)
            st[k + (size_t)j] = t[j];
    }
    for (; k < steps; k++) {
        uint32_t v[8];
        for (int i = 0; i < 8; i++) {
            const uint16_t *p = s + soff[i] / 2 + 2 * k;
            v[i] = (uint32_t)p[0] | (k < full ? (uint32_t)p[1] << 16 : 0u);
        }
        st[k] = _mm256_loadu_si256((const __m256i *)(const void *)v);
    }
    __m256 acc = _mm256_setzero_ps(); /* lane i: row r + i */
    if (c0 > 0) {
        float y[8];
        for (int i = 0; i < 8; i++)
            y[i] = Y[r + (size_t)(i < nr ? i : nr - 1)];
        acc = _mm256_loadu_ps(y);
    }
    for (k = 0; k < steps; k++) {
        const __m256i sc = st[k];
        if (prefetch && k < full && (k & 1) == 0) { /* into L2, as kernels_avx512.c's q4d */
            for (int i = 0; i < 8; i++)
                _mm_prefetch((const char *)(w[i] + 8 * rb + 32 * k), _MM_HINT_T1);
            _mm_prefetch((const char *)(s + 8 * ng) + 32 * k, _MM_HINT_T1);
        }
        /* four rows at a time reduced to [group 2k: rows | group 2k + 1: rows] (fewer live
         * registers: eight rows' vectors at once spilled), then -8 * sum(x) of each group */
        __m256i t[2];
        for (int h = 0; h < 2; h++) {
            __m256i u[4];
            if (k < full)
                for (int i = 0; i < 4; i++)
                    u[i] = q4d_row(i8, _mm256_loadu_si256((const __m256i *)(const void *)(w[4 * h + i] + 32 * k)), a, k);
            else /* the last block holds one group */
                for (int i = 0; i < 4; i++)
                    u[i] = q4d_row(i8, _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(w[4 * h + i] + 32 * k))), a, k);
            t[h] = _mm256_add_epi32(_mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3])), a->corr[k]);
        }
        const __m256i t0 = t[0], t1 = t[1];
        const __m256 pa = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(t0, t1, 0x20)),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(sc, 16)));
        const __m256 pb = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(t0, t1, 0x31)),
                                        _mm256_castsi256_ps(_mm256_and_si256(sc, _mm256_set1_epi32((int)0xffff0000u))));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_add_ps(pa, pb), _mm256_set1_ps(xs[(c0 + 64 * k) / 64])));
    }
    float y[8];
    _mm256_storeu_ps(y, acc);
    for (int i = 0; i < nr; i++)
        Y[r + (size_t)i] = y[i];
}

/* Any n: tokens in groups of Q4D_TOK, as kernels_avx512.c's q4d_matmul. */
#define Q4D_TOK 4
static void q4d_matmul(int i8, float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows, size_t cols,
                       const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    const size_t nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    q4d_act a[Q4D_TOK];
    for (size_t t0 = 0; t0 < n; t0 += Q4D_TOK) {
        const size_t nt = n - t0 < Q4D_TOK ? n - t0 : Q4D_TOK;
        for (size_t c0 = 0; c0 < cols; c0 += Q4D_KC) {
            const size_t kc = cols - c0 < Q4D_KC ? cols - c0 : Q4D_KC;
            for (size_t t = 0; t < nt; t++)
                q4d_layout(i8, &a[t], Xq + (t0 + t) * ldx, c0, kc);
            for (size_t r = 0; r < rows; r += 8)
                for (size_t t = 0; t < nt; t++)
                    q4d_rows8(i8, Y + (t0 + t) * ldy, W, S, r, rows - r < 8 ? (int)(rows - r) : 8, cols, &a[t],
                              xs + (t0 + t) * nb, c0, kc, t == 0 && r + 16 <= rows);
        }
    }
}

/* q - 8 of a group's 16 bytes as four vectors of 8 FP32: columns 0-7, 8-15, 16-23, 24-31 */
KVL_INLINE void q4_group_f32(const uint8_t *w, __m256 q[4])
{
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)w);
    const __m128i m = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), eight);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* R rows (a constant: 4 or 1) from row r, one token */
KVL_INLINE void q4_rows_f32(int xb, const int R, float *Y, const uint8_t *W, const uint16_t *S, size_t r,
                            size_t cols, const float *x, int prefetch)
{
    const size_t rb = cols / 2, ng = cols / 32;
    __m256 acc[4];
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        acc[i] = _mm256_setzero_ps();
    const uint8_t *w = W + r * rb;
    const uint16_t *s = S + r * ng;
    for (size_t g = 0; g < ng; g++) {
        if (prefetch && (g & 3) == 0)
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                _mm_prefetch((const char *)(w + (size_t)(R + i) * rb + 16 * g), _MM_HINT_T1);
        const __m256 x0 = load_x(xb, x + 32 * g), x1 = load_x(xb, x + 32 * g + 8);
        const __m256 x2 = load_x(xb, x + 32 * g + 16), x3 = load_x(xb, x + 32 * g + 24);
        KVL_UNROLL
        for (int i = 0; i < R; i++) {
            __m256 q[4];
            q4_group_f32(w + (size_t)i * rb + 16 * g, q);
            __m256 gs = _mm256_mul_ps(q[0], x0);
            gs = _mm256_fmadd_ps(q[1], x1, gs);
            gs = _mm256_fmadd_ps(q[2], x2, gs);
            gs = _mm256_fmadd_ps(q[3], x3, gs);
            acc[i] = _mm256_fmadd_ps(gs, _mm256_set1_ps(bf16_scalar(s[(size_t)i * ng + g])), acc[i]);
        }
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        Y[r + (size_t)i] = hsum256(acc[i]);
}

KVL_INLINE void q4_matmul_f32(int xb, float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const float *X, size_t ldx, size_t n)
{
    size_t r = 0;
    for (; r + 4 <= rows; r += 4)
        for (size_t t = 0; t < n; t++)
            q4_rows_f32(xb, 4, Y + t * ldy, W, S, r, cols, X + t * ldx, t == 0 && r + 8 <= rows);
    for (; r < rows; r++)
        for (size_t t = 0; t < n; t++)
            q4_rows_f32(xb, 1, Y + t * ldy, W, S, r, cols, X + t * ldx, 0);
}

static void avx2_matmul_q4(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                           size_t cols, const float *X, size_t ldx, size_t n)
{
    q4_matmul_f32(0, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void avx2_matmul_q4_xb(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const float *X, size_t ldx, size_t n)
{
    q4_matmul_f32(1, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void avx2_matmul_q4_i16(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                               size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    q4d_matmul(0, Y, ldy, W, S, rows, cols, Xq, xs, ldx, n);
}

static void avx2_matmul_q4_i8(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    q4d_matmul(1, Y, ldy, W, S, rows, cols, Xq, xs, ldx, n);
}

/* ---- vector ops ------------------------------------------------------------------------ */

static float avx2_dot_f32(const float *a, const float *b, size_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum256(_mm256_add_ps(s0, s1));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static void avx2_axpy_f32(float *y, float a, const float *x, size_t n)
{
    __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

static void avx2_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
    for (; i < n; i++)
        dst[i] = bf16_scalar(src[i]);
}

static void avx2_q8_to_f32(float *dst, const int8_t *src, float scale, size_t n)
{
    const __m256 s = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
        _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), s));
    }
    for (; i < n; i++)
        dst[i] = (float)src[i] * scale;
}

static void avx2_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(0x7fff);
    const __m256i quiet = _mm256_set1_epi32(0x0040);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        /* Same bit recipe as the reference: RNE by adding 0x7fff + lsb; NaNs made quiet. */
        __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        rounded = _mm256_srli_epi32(rounded, 16);
        __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
        __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
        __m256i r = _mm256_blendv_epi8(rounded, nanv, isnan);
        /* r holds 16-bit values in 32-bit lanes; packus per 128-bit lane, then gather. */
        __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)(void *)(dst + i), _mm_packus_epi32(lo, hi));
    }
    for (; i < n; i++)
        dst[i] = kvl_float_to_bf16(src[i]);
}

/* gemm_tile (kernels.h) on 6 tokens x 16 outputs: 12 ymm accumulators, 2 weight vectors and a
 * broadcast in the 16 registers (the 6 x 16 tile of BLIS's Haswell kernel). */
enum { GEMM_MR = 6, GEMM_NR = 16 };
static void avx2_gemm_tile(size_t kc, const float *A, const float *B, float *C, size_t ldc,
                           int accumulate)
{
    __m256 acc[GEMM_MR][2];
    KVL_UNROLL
    for (int i = 0; i < GEMM_MR; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (size_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(B + k * GEMM_NR), b1 = _mm256_loadu_ps(B + k * GEMM_NR + 8);
        KVL_UNROLL
        for (int i = 0; i < GEMM_MR; i++) {
            const __m256 a = _mm256_broadcast_ss(A + k * GEMM_MR + (size_t)i);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    KVL_UNROLL
    for (int i = 0; i < GEMM_MR; i++) {
        float *c = C + (size_t)i * ldc;
        if (accumulate) {
            acc[i][0] = _mm256_add_ps(_mm256_loadu_ps(c), acc[i][0]);
            acc[i][1] = _mm256_add_ps(_mm256_loadu_ps(c + 8), acc[i][1]);
        }
        _mm256_storeu_ps(c, acc[i][0]);
        _mm256_storeu_ps(c + 8, acc[i][1]);
    }
}

const kvl_kernels kvl_kernels_avx2_table = {
    .name = "avx2",
    .matmul_bf16 = driver_matmul_bf16,
    .matmul_q8 = driver_matmul_q8,
    .matmul_f32 = driver_matmul_f32,
    .matmul_bf16_xb = driver_matmul_bf16_xb,
    .matmul_q8_xb = driver_matmul_q8_xb,
    .quantize_i16_act = driver_quantize_i16_act,
    .matmul_q8_i16 = driver_matmul_q8_i16,
    .matmul_q8_i8 = driver_matmul_q8_i8,
    .matmul_i16_i16 = driver_matmul_i16_i16,
    .matmul_q4 = avx2_matmul_q4,
    .matmul_q4_xb = avx2_matmul_q4_xb,
    .matmul_q4_i16 = avx2_matmul_q4_i16,
    .matmul_q4_i8 = avx2_matmul_q4_i8,
    .dot_f32 = avx2_dot_f32,
    .axpy_f32 = avx2_axpy_f32,
    .axpy_rows_f32 = driver_axpy_rows_f32,
    .bf16_to_f32 = avx2_bf16_to_f32,
    .q8_to_f32 = avx2_q8_to_f32,
    .f32_to_bf16 = avx2_f32_to_bf16,
    /* softmax, gelu_tanh: no AVX2 exp yet, left empty: the scalar references (kernels_select.c) */
    .gemm_mr = GEMM_MR, .gemm_nr = GEMM_NR, .gemm_tile = avx2_gemm_tile, /* gemm_tile_bf16 NULL: no BF16 dot product */
};
