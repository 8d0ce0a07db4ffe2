/* kernels_avx512.c — the "avx512" kernel table (AVX-512 F/BW/VL/DQ + VNNI).
 *
 * Owns: AVX-512 versions of every kvl_kernels entry. This file alone is compiled with the
 * AVX-512 flags (/arch:AVX512 on MSVC), so nothing here may run before kernels_select.c has
 * checked the CPU and the OS (XCR0 ZMM state).
 * Does not own: the numeric definition of each kernel (kernels_ref.c is the reference; results
 * here differ from it only by FP32 summation order; quantize_i16_act and matmul_q8_i16 are
 * bit-identical to it), threading, CPU detection.
 *
 * Register tiles of up to 4 weight rows x 4 activation vectors (16 zmm accumulators): each
 * weight vector is loaded and widened once per 4 tokens, each activation vector once per 4
 * rows; decode (n = 1) reads one row at a time as a sequential stream (decode_row). Column
 * tails (cols % 16) use masked loads, i.e. the same vector code on zero-padded lanes, so there
 * is no separate slow path.
 *
 * Two tables: "avx512" (every CPU with AVX-512 F/BW/VL/DQ + VNNI) computes the *_xb entries
 * with FP32 FMAs on activations rounded in registers; "avx512-bf16" (CPUs that also have
 * AVX512_BF16) runs them on VDPBF16PS, two products per lane and instruction, which is what
 * makes the BF16-activation mode fast. The plain FP32 entries never use BF16 instructions
 * (VDPBF16PS would round the FP32 activations).
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
#define TT 4 /* tokens per tile */

KVL_INLINE float hsum512(__m512 v)
{
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

KVL_INLINE __mmask16 tail_mask16(size_t k)
{
    return (__mmask16)((1u << k) - 1u); /* k < 16 */
}

/* 16 bf16 -> 16 fp32: widen and shift into the high half (exact). */
KVL_INLINE __m512 bf16x16(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* kvl_bf16_round_daz on 16 lanes: nearest-even by integer add and truncate, subnormal inputs to
 * signed zero (NaN payloads are not preserved). */
KVL_INLINE __m512 round_bf16x16(__m512 v)
{
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 subnormal = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_and_epi32(r, subnormal, b, _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(r);
}

KVL_INLINE __m512 load_x(int xb, const float *x)
{
    return xb ? round_bf16x16(_mm512_loadu_ps(x)) : _mm512_loadu_ps(x);
}

KVL_INLINE __m512 load_x_masked(int xb, const float *x, __mmask16 m)
{
    __m512 v = _mm512_maskz_loadu_ps(m, x);
    return xb ? round_bf16x16(v) : v;
}

enum { KIND_BF16, KIND_Q8, KIND_F32 };

KVL_INLINE size_t elem_size(int kind)
{
    return kind == KIND_BF16 ? 2 : kind == KIND_Q8 ? 1 : 4;
}

KVL_INLINE __m512 load_w(int kind, const void *w, size_t c)
{
    if (kind == KIND_BF16)
        return bf16x16(_mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)w + c)));
    if (kind == KIND_Q8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)((const int8_t *)w + c))));
    return _mm512_loadu_ps((const float *)w + c);
}

KVL_INLINE __m512 load_w_masked(int kind, const void *w, size_t c, __mmask16 m)
{
    if (kind == KIND_BF16)
        return bf16x16(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + c));
    if (kind == KIND_Q8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)w + c)));
    return _mm512_maskz_loadu_ps(m, (const float *)w + c);
}

/* Y[t*ldy + r0 + i] = (sum_c W[r0+i, c] X[t, c]) * (scale ? scale[r0+i] : 1) for i<R, t<T.
 * R and T are constants at every call site, so after inlining the accumulators are registers. */
KVL_INLINE void tile(int kind, int xb, float *Y, size_t ldy, const void *W, const float *scale,
                     size_t r0, size_t cols, const float *X, size_t ldx, int prefetch, const int R,
                     const int T)
{
    __m512 acc[TR][TT]; /* only R x T entries are used (and kept in registers) */
    const char *wrow[TR];
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        wrow[i] = (const char *)W + (r0 + (size_t)i) * cols * elem_size(kind);
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            acc[i][t] = _mm512_setzero_ps();
    }
    size_t c = 0;
    const size_t row_bytes = cols * elem_size(kind);
    for (; c + 16 <= cols; c += 16) {
        /* Rows of a tile are short streams (2-4 KB) that the hardware prefetcher barely ramps
         * up on; fetch the next tile's rows (contiguous after ours) into L2, a line at a time. */
        if (prefetch && ((c * elem_size(kind)) & 63) == 0) {
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                _mm_prefetch(wrow[i] + (size_t)R * row_bytes + c * elem_size(kind), _MM_HINT_T1);
        }
        __m512 w[TR];
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            w[i] = load_w(kind, wrow[i], c);
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            __m512 x = load_x(xb, X + (size_t)t * ldx + c);
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                acc[i][t] = _mm512_fmadd_ps(w[i], x, acc[i][t]);
        }
    }
    if (c < cols) {
        __mmask16 m = tail_mask16(cols - c);
        __m512 w[TR];
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            w[i] = load_w_masked(kind, wrow[i], c, m);
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            __m512 x = load_x_masked(xb, X + (size_t)t * ldx + c, m);
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                acc[i][t] = _mm512_fmadd_ps(w[i], x, acc[i][t]);
        }
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            float s = hsum512(acc[i][t]);
            if (scale)
                s *= scale[r0 + (size_t)i];
            Y[(size_t)t * ldy + r0 + (size_t)i] = s;
        }
}

/* Decode (one activation vector): purely bandwidth-bound. One row at a time with four
 * independent accumulators, so each thread reads its share of the matrix as a single sequential
 * stream: the hardware prefetchers follow it across rows, where a multi-row tile gives them one
 * short (one-page) stream per row to restart on. Measured with bench/kernels_bench.c on the
 * 2-vCPU EPYC VM, 2 threads, weights from DRAM: 43-66 GB/s against 33-38 GB/s for 8-row tiles,
 * in alternating runs. */
KVL_INLINE void decode_row(int kind, int xb, float *Y, const void *W, const float *scale, size_t r,
                           size_t cols, const float *X)
{
    const char *w = (const char *)W + r * cols * elem_size(kind);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t c = 0;
    for (; c + 64 <= cols; c += 64) {
        a0 = _mm512_fmadd_ps(load_w(kind, w, c), load_x(xb, X + c), a0);
        a1 = _mm512_fmadd_ps(load_w(kind, w, c + 16), load_x(xb, X + c + 16), a1);
        a2 = _mm512_fmadd_ps(load_w(kind, w, c + 32), load_x(xb, X + c + 32), a2);
        a3 = _mm512_fmadd_ps(load_w(kind, w, c + 48), load_x(xb, X + c + 48), a3);
    }
    for (; c + 16 <= cols; c += 16)
        a0 = _mm512_fmadd_ps(load_w(kind, w, c), load_x(xb, X + c), a0);
    if (c < cols) {
        __mmask16 m = tail_mask16(cols - c);
        a1 = _mm512_fmadd_ps(load_w_masked(kind, w, c, m), load_x_masked(xb, X + c, m), a1);
    }
    float s = hsum512(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    Y[r] = scale ? s * scale[r] : s;
}

/* ---- BF16 dot products (AVX512_BF16): the *_xb entries of the "avx512-bf16" table ---------
 *
 * Weights are BF16 in memory (matmul_bf16_xb) or converted to BF16 (exact for int8) a panel of
 * DP_R rows x DP_KC columns at a time into a stack buffer (matmul_q8_xb); activations are
 * rounded to BF16 (VCVTNE2PS2BF16: nearest-even, subnormals as zero, the reference's
 * kvl_bf16_round_daz) a block of DP_NB tokens x DP_KC columns at a time into a stack buffer
 * (64 KiB, L2-resident), and every row panel sweeps that block, so each weight panel is reused
 * by DP_NB tokens from L1. Rounding the block once, rather than in every tile, doubled the rate
 * (bench/kernels_bench.c, 1 thread, [1408 x 2048] x 64 tokens: 215 -> 370 GFLOP/s; the FP32
 * matmul_bf16 does 180); 4 x 4 tiles divide the engine's 16-row work items, 6 x 4 was only 4 %
 * faster. Columns beyond DP_KC are summed into Y chunk by chunk. Decode (n = 1) rounds the
 * activation once and streams rows as in decode_row. */

#define DP_R 4       /* rows per register tile */
#define DP_T 4       /* tokens per register tile */
#define DP_NB 32     /* tokens per L2 block */
#define DP_KC 1024   /* columns per chunk */
#define DP_DEC_KC 16384 /* decode: activation columns rounded at a time (32 KiB of stack) */

/* Bit casts between __m512i and __m512bh (compilers disagree on whether a cast is allowed;
 * memcpy of a register is free). */
KVL_INLINE __m512bh AS_BH(__m512i v)
{
    __m512bh h;
    memcpy(&h, &v, sizeof h);
    return h;
}

KVL_INLINE __m512i BH_BITS(__m512bh h)
{
    __m512i v;
    memcpy(&v, &h, sizeof v);
    return v;
}

KVL_INLINE __mmask32 tail_mask32(size_t k)
{
    return (__mmask32)((1u << k) - 1u); /* k < 32 */
}

/* 32 activations -> 32 BF16 (element i of the result is x[i]). */
KVL_INLINE __m512bh x_bf16x32(const float *x)
{
    return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

KVL_INLINE __m512bh x_bf16x32_masked(const float *x, size_t k)
{
    __mmask16 lo = k >= 16 ? (__mmask16)0xffff : tail_mask16(k);
    __mmask16 hi = k > 16 ? tail_mask16(k - 16) : (__mmask16)0;
    return _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + 16), _mm512_maskz_loadu_ps(lo, x));
}

/* 32 int8 -> 32 BF16 (exact: |w| <= 128 needs 8 significant bits). */
KVL_INLINE __m512i q8_bf16x32(__m256i b)
{
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return BH_BITS(_mm512_cvtne2ps_pbh(hi, lo));
}

/* Rows [0, R) of a Q8 panel, columns [k0, k0 + kc), to BF16 at dst (row stride DP_KC). */
KVL_INLINE void q8_panel_to_bf16(uint16_t *dst, const int8_t *W, size_t cols, size_t k0,
                                 size_t kc, int R)
{
    for (int i = 0; i < R; i++) {
        const int8_t *w = W + (size_t)i * cols + k0;
        uint16_t *d = dst + (size_t)i * DP_KC;
        size_t c = 0;
        for (; c + 32 <= kc; c += 32)
            _mm512_storeu_si512((void *)(d + c),
                                q8_bf16x32(_mm256_loadu_si256((const __m256i *)(const void *)(w + c))));
        if (c < kc)
            _mm512_storeu_si512((void *)(d + c), q8_bf16x32(_mm256_maskz_loadu_epi8(tail_mask32(kc - c), w + c)));
    }
}

/* Y[t*ldy + i] (=|+=) scale_i * sum_{c<kc} W[i*ldw + c] Xb[t*DP_KC + c], i < R, t < T; Xb holds
 * BF16 activations zero-padded to a multiple of 32 columns. */
KVL_INLINE void tile_dp(float *Y, size_t ldy, const uint16_t *W, size_t ldw, const float *scale,
                        int accumulate, size_t kc, const uint16_t *Xb, const int R, const int T)
{
    __m512 acc[DP_R][DP_T];
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            acc[i][t] = _mm512_setzero_ps();
    size_t c = 0;
    for (; c + 32 <= kc; c += 32) {
        __m512i w[DP_R];
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            w[i] = _mm512_loadu_si512((const void *)(W + (size_t)i * ldw + c));
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            __m512bh x = AS_BH(_mm512_loadu_si512((const void *)(Xb + (size_t)t * DP_KC + c)));
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                acc[i][t] = _mm512_dpbf16_ps(acc[i][t], AS_BH(w[i]), x);
        }
    }
    if (c < kc) {
        __mmask32 m = tail_mask32(kc - c);
        __m512i w[DP_R];
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            w[i] = _mm512_maskz_loadu_epi16(m, W + (size_t)i * ldw + c);
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            __m512bh x = AS_BH(_mm512_loadu_si512((const void *)(Xb + (size_t)t * DP_KC + c)));
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                acc[i][t] = _mm512_dpbf16_ps(acc[i][t], AS_BH(w[i]), x);
        }
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            float s = hsum512(acc[i][t]);
            if (scale)
                s *= scale[i];
            float *y = Y + (size_t)t * ldy + (size_t)i;
            *y = accumulate ? *y + s : s;
        }
}

/* One panel (R rows, constant) against a block of nb tokens. */
KVL_INLINE void panel_dp(float *Y, size_t ldy, const uint16_t *W, size_t ldw, const float *scale,
                         int accumulate, size_t kc, const uint16_t *Xb, size_t nb, const int R)
{
    size_t t = 0;
    for (; t + DP_T <= nb; t += DP_T)
        tile_dp(Y + t * ldy, ldy, W, ldw, scale, accumulate, kc, Xb + t * DP_KC, R, DP_T);
    for (; t < nb; t++)
        tile_dp(Y + t * ldy, ldy, W, ldw, scale, accumulate, kc, Xb + t * DP_KC, R, 1);
}

/* kc activations to BF16 at dst, zero-padded to the next multiple of 32. */
KVL_INLINE void x_to_bf16(uint16_t *dst, const float *x, size_t kc)
{
    size_t c = 0;
    for (; c + 32 <= kc; c += 32)
        _mm512_storeu_si512((void *)(dst + c), BH_BITS(x_bf16x32(x + c)));
    if (c < kc)
        _mm512_storeu_si512((void *)(dst + c), BH_BITS(x_bf16x32_masked(x + c, kc - c)));
}

KVL_INLINE void decode_row_dp(int kind, float *y, const void *W, const float *scale, size_t r,
                              size_t cols, size_t k0, size_t kc, const uint16_t *xb, int accumulate)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t c = 0;
    if (kind == KIND_BF16) {
        const uint16_t *w = (const uint16_t *)W + r * cols + k0;
        for (; c + 128 <= kc; c += 128) {
            a0 = _mm512_dpbf16_ps(a0, AS_BH(_mm512_loadu_si512((const void *)(w + c))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c))));
            a1 = _mm512_dpbf16_ps(a1, AS_BH(_mm512_loadu_si512((const void *)(w + c + 32))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c + 32))));
            a2 = _mm512_dpbf16_ps(a2, AS_BH(_mm512_loadu_si512((const void *)(w + c + 64))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c + 64))));
            a3 = _mm512_dpbf16_ps(a3, AS_BH(_mm512_loadu_si512((const void *)(w + c + 96))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c + 96))));
        }
        for (; c + 32 <= kc; c += 32)
            a0 = _mm512_dpbf16_ps(a0, AS_BH(_mm512_loadu_si512((const void *)(w + c))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c))));
        if (c < kc) /* xb is zero-padded to a multiple of 32 */
            a1 = _mm512_dpbf16_ps(a1, AS_BH(_mm512_maskz_loadu_epi16(tail_mask32(kc - c), w + c)),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c))));
    } else {
        const int8_t *w = (const int8_t *)W + r * cols + k0;
        for (; c + 64 <= kc; c += 64) {
            a0 = _mm512_dpbf16_ps(a0, AS_BH(q8_bf16x32(_mm256_loadu_si256((const __m256i *)(const void *)(w + c)))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c))));
            a1 = _mm512_dpbf16_ps(a1, AS_BH(q8_bf16x32(_mm256_loadu_si256((const __m256i *)(const void *)(w + c + 32)))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c + 32))));
        }
        for (; c + 32 <= kc; c += 32)
            a2 = _mm512_dpbf16_ps(a2, AS_BH(q8_bf16x32(_mm256_loadu_si256((const __m256i *)(const void *)(w + c)))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c))));
        if (c < kc) /* xb is zero-padded to a multiple of 32 */
            a3 = _mm512_dpbf16_ps(a3, AS_BH(q8_bf16x32(_mm256_maskz_loadu_epi8(tail_mask32(kc - c), w + c))),
                                  AS_BH(_mm512_loadu_si512((const void *)(xb + c))));
    }
    float s = hsum512(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    if (scale)
        s *= scale[r];
    *y = accumulate ? *y + s : s;
}

KVL_INLINE void matmul_dp(int kind, float *Y, size_t ldy, const void *W, const float *scale,
                          size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    if (n == 1) {
        uint16_t xb[DP_DEC_KC + 32];
        for (size_t k0 = 0; k0 < cols; k0 += DP_DEC_KC) {
            size_t kc = cols - k0 < DP_DEC_KC ? cols - k0 : DP_DEC_KC;
            x_to_bf16(xb, X + k0, kc);
            for (size_t r = 0; r < rows; r++)
                decode_row_dp(kind, Y + r, W, scale, r, cols, k0, kc, xb, k0 > 0);
        }
        return;
    }
    uint16_t xblock[DP_NB * DP_KC]; /* the token block's activations, BF16 */
    uint16_t panel[DP_R * DP_KC];   /* Q8 rows converted to BF16 */
    for (size_t k0 = 0; k0 < cols; k0 += DP_KC) {
        size_t kc = cols - k0 < DP_KC ? cols - k0 : DP_KC;
        for (size_t t0 = 0; t0 < n; t0 += DP_NB) {
            size_t nb = n - t0 < DP_NB ? n - t0 : DP_NB;
            float *Yb = Y + t0 * ldy;
            for (size_t t = 0; t < nb; t++)
                x_to_bf16(xblock + t * DP_KC, X + (t0 + t) * ldx + k0, kc);
            size_t r = 0;
            for (; r + DP_R <= rows; r += DP_R) {
                if (kind == KIND_BF16) {
                    panel_dp(Yb + r, ldy, (const uint16_t *)W + r * cols + k0, cols, NULL, k0 > 0, kc,
                             xblock, nb, DP_R);
                } else {
                    q8_panel_to_bf16(panel, (const int8_t *)W + r * cols, cols, k0, kc, DP_R);
                    panel_dp(Yb + r, ldy, panel, DP_KC, scale + r, k0 > 0, kc, xblock, nb, DP_R);
                }
            }
            for (; r < rows; r++) {
                if (kind == KIND_BF16) {
                    panel_dp(Yb + r, ldy, (const uint16_t *)W + r * cols + k0, cols, NULL, k0 > 0, kc,
                             xblock, nb, 1);
                } else {
                    q8_panel_to_bf16(panel, (const int8_t *)W + r * cols, cols, k0, kc, 1);
                    panel_dp(Yb + r, ldy, panel, DP_KC, scale + r, k0 > 0, kc, xblock, nb, 1);
                }
            }
        }
    }
}

static void avx512bf16_matmul_bf16_xb(float *Y, size_t ldy, const uint16_t *W, size_t rows,
                                      size_t cols, const float *X, size_t ldx, size_t n)
{
    matmul_dp(KIND_BF16, Y, ldy, W, NULL, rows, cols, X, ldx, n);
}

static void avx512bf16_matmul_q8_xb(float *Y, size_t ldy, const int8_t *W, const float *scale,
                                    size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    matmul_dp(KIND_Q8, Y, ldy, W, scale, rows, cols, X, ldx, n);
}

/* ---- integer mode ------------------------------------------------------------------------
 *
 * VPDPWSSD (AVX512_VNNI) adds the two int16 x int16 products of each int32 lane to it, exactly
 * and without saturation (the non-"S" form). matmul_q8_i16 accumulates a whole KVL_I16_BLOCK
 * block that way (every partial sum of a block is bounded like the block: exact), reduces the
 * lanes exactly and adds the block sums in FP32 in block order: bit-identical to the reference.
 * matmul_i16_i16 starts each int32 lane from one VPMADDWD and adds one VPDPWSSD (4 products,
 * < 2^31), then converts to FP32. Column tails use zero-masked loads. */

enum { IKIND_Q8, IKIND_I16 };

#define TRI 4 /* integer tiles: 4 rows x 4 tokens, as the float ones */
#define TTI 4

/* 32 int8 weights -> 32 int16 */
KVL_INLINE __m512i load_q8x32_i16(const int8_t *p)
{
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

KVL_INLINE __m512i load_q8x32_i16_masked(const int8_t *p, __mmask32 m)
{
    return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, p));
}

KVL_INLINE __m512i load_i16x32(const int16_t *p)
{
    return _mm512_loadu_si512((const void *)p);
}

/* 4 products per lane: columns [c, c+32) and [c+32, c+64) pairwise */
KVL_INLINE __m512 i16_quad(__m512i w0, __m512i x0, __m512i w1, __m512i x1)
{
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_madd_epi16(w0, x0), w1, x1));
}

/* One block of cols values: its scale (xs[0]) and integers, by the reference's rule. */
static void quantize_block(int16_t *q, float *xs, const float *x, size_t cols, float limf)
{
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512 lim = _mm512_set1_ps(limf), nlim = _mm512_set1_ps(-limf);
    /* max(|x|, m) with m second: VMAXPS returns the second operand when either is NaN, so a
     * NaN input is ignored, as in the reference; masked-off lanes read as 0. */
    __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
    size_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        m0 = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + c)), absmask)), m0);
        m1 = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + c + 16)), absmask)), m1);
    }
    for (; c < cols; c += 16) {
        __mmask16 k = cols - c >= 16 ? (__mmask16)0xffff : tail_mask16(cols - c);
        m0 = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(k, x + c)), absmask)), m0);
    }
    m0 = _mm512_max_ps(m0, m1);
    __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(m0), _mm512_extractf32x8_ps(m0, 1));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    /* Same scalar expressions as the reference, so the integers agree exactly. */
    float inv = amax > 0.0f ? limf / amax : 0.0f;
    xs[0] = amax / limf;
    const __m512 vi = _mm512_set1_ps(inv);
    for (c = 0; c < cols; c += 16) {
        __mmask16 k = cols - c >= 16 ? (__mmask16)0xffff : tail_mask16(cols - c);
        __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + c), vi);
        /* NaN -> 0, then the clamp (integer bounds: clamping before rounding is the same);
         * cvtps rounds with MXCSR (nearest-even by default), like rintf in the reference */
        p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, p, _CMP_ORD_Q), p);
        p = _mm512_max_ps(_mm512_min_ps(p, lim), nlim);
        _mm256_mask_storeu_epi16(q + c, k, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(p)));
    }
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
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            size_t c = b;
            for (; c + 128 <= e; c += 128) {
                a0 = _mm512_dpwssd_epi32(a0, load_q8x32_i16(w + c), load_i16x32(x + c));
                a1 = _mm512_dpwssd_epi32(a1, load_q8x32_i16(w + c + 32), load_i16x32(x + c + 32));
                a2 = _mm512_dpwssd_epi32(a2, load_q8x32_i16(w + c + 64), load_i16x32(x + c + 64));
                a3 = _mm512_dpwssd_epi32(a3, load_q8x32_i16(w + c + 96), load_i16x32(x + c + 96));
            }
            for (; c + 32 <= e; c += 32)
                a0 = _mm512_dpwssd_epi32(a0, load_q8x32_i16(w + c), load_i16x32(x + c));
            if (c < e) {
                __mmask32 m = tail_mask32(e - c);
                a1 = _mm512_dpwssd_epi32(a1, load_q8x32_i16_masked(w + c, m), _mm512_maskz_loadu_epi16(m, x + c));
            }
            const float p = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3))) * xs[b / KVL_I16_BLOCK];
            acc += p;
        }
        Y[r] = acc * scale[r];
        return;
    }
    const int16_t *w = (const int16_t *)W + r * cols;
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    size_t c = 0;
#define I16_QUAD(o) i16_quad(load_i16x32(w + c + (o)), load_i16x32(x + c + (o)), \
                             load_i16x32(w + c + (o) + 32), load_i16x32(x + c + (o) + 32))
    for (; c + 256 <= cols; c += 256) {
        f0 = _mm512_add_ps(f0, I16_QUAD(0));
        f1 = _mm512_add_ps(f1, I16_QUAD(64));
        f2 = _mm512_add_ps(f2, I16_QUAD(128));
        f3 = _mm512_add_ps(f3, I16_QUAD(192));
    }
    for (; c + 64 <= cols; c += 64)
        f0 = _mm512_add_ps(f0, I16_QUAD(0));
#undef I16_QUAD
    if (c < cols) {
        size_t k = cols - c; /* < 64 */
        __mmask32 m0 = k >= 32 ? (__mmask32)0xffffffffu : tail_mask32(k);
        __mmask32 m1 = k > 32 ? tail_mask32(k - 32) : (__mmask32)0;
        f1 = _mm512_add_ps(f1, i16_quad(_mm512_maskz_loadu_epi16(m0, w + c), _mm512_maskz_loadu_epi16(m0, x + c),
                                        _mm512_maskz_loadu_epi16(m1, w + c + 32), _mm512_maskz_loadu_epi16(m1, x + c + 32)));
    }
    float s = hsum512(_mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3)));
    Y[r] = (s * scale[r]) * xs[0];
}

/* Decode, four rows at a time: the next four rows' block b (from w3, the current fourth row), as
 * tile() prefetches its next tile. */
KVL_INLINE void prefetch_next_rows4(const int8_t *w3, size_t cols, size_t b)
{
    for (size_t i = 1; i <= 4; i++)
        _mm_prefetch((const char *)(w3 + i * cols + b), _MM_HINT_T1);
}

/* Q8 x int16 decode, four rows at a time. A 64-column block is only two VPDPWSSD per row, so
 * reducing each row's block sum on its own (_mm512_reduce_add_epi32) would cost more than the
 * products: the four rows' sums are reduced together (halves added, then two rounds of
 * horizontal adds), exactly, into one vector whose lanes then take the reference's (float)sum *
 * scale, rounded, plus acc, rounded. Identical to decode_row_int. */
#define KVL_DECODE_ROWS4_Q8 IKIND_Q8 /* the weight kind decode_rows4_q8 serves */
KVL_INLINE __m128i reduce4_epi32(__m512i a, __m512i b, __m512i c, __m512i d)
{
#define HALVES(v) _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))), \
                                _mm256_extracti128_si256(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)), 1))
    __m128i a4 = HALVES(a), b4 = HALVES(b), c4 = HALVES(c), d4 = HALVES(d);
#undef HALVES
    return _mm_hadd_epi32(_mm_hadd_epi32(a4, b4), _mm_hadd_epi32(c4, d4));
}

KVL_INLINE void decode_rows4_q8(float *Y, const int8_t *W, const float *scale, size_t r,
                                size_t cols, const int16_t *x, const float *xs, int prefetch)
{
    const int8_t *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
    __m128 acc = _mm_setzero_ps(); /* lane i: row r + i */
    for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
        size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        if (prefetch)
            prefetch_next_rows4(w3, cols, b);
        for (size_t c = b; c < e; c += 32) {
            __mmask32 m = e - c >= 32 ? (__mmask32)0xffffffffu : tail_mask32(e - c);
            __m512i xv = _mm512_maskz_loadu_epi16(m, x + c);
            a0 = _mm512_dpwssd_epi32(a0, load_q8x32_i16_masked(w0 + c, m), xv);
            a1 = _mm512_dpwssd_epi32(a1, load_q8x32_i16_masked(w1 + c, m), xv);
            a2 = _mm512_dpwssd_epi32(a2, load_q8x32_i16_masked(w2 + c, m), xv);
            a3 = _mm512_dpwssd_epi32(a3, load_q8x32_i16_masked(w3 + c, m), xv);
        }
        __m128 p = _mm_mul_ps(_mm_cvtepi32_ps(reduce4_epi32(a0, a1, a2, a3)), _mm_set1_ps(xs[b / KVL_I16_BLOCK]));
        acc = _mm_add_ps(acc, p);
    }
    _mm_storeu_ps(Y + r, _mm_mul_ps(acc, _mm_loadu_ps(scale + r)));
}

/* One row's sums of (w * sign(x)) * |x| over up to 64 columns (mask m), 4 products per lane. */
KVL_INLINE __m512i dot_i8_block(__m512i ax, __mmask64 neg, __mmask64 m, const int8_t *w)
{
    const __m512i v = _mm512_maskz_loadu_epi8(m, w);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, _mm512_mask_sub_epi8(v, neg, _mm512_setzero_si512(), v));
}

/* Q8 x 8-bit decode (matmul_q8_i8), four rows at a time: a block's 64 activations are narrowed
 * to int8 once for the four rows (|x| <= 127: exact); per row, the weights take the activations'
 * signs (a masked byte subtraction from zero; |w| <= 127, so no overflow) and VPDPBUSD adds |x|
 * (as u8) times them, four products per int32 lane: one load, one negation and one product per
 * 64 weights, where the int16 product widens twice and takes two VPDPWSSD. Block sums exact;
 * then as decode_rows4_q8, so identical to it. */
#define KVL_DECODE_ROWS4_I8 1 /* matmul_q8_i8_generic (kernels_matmul_driver.h) */
KVL_INLINE void decode_rows4_q8_i8(float *Y, const int8_t *W, const float *scale, size_t r,
                                   size_t cols, const int16_t *x, const float *xs, int prefetch)
{
    const int8_t *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
    __m128 acc = _mm_setzero_ps(); /* lane i: row r + i */
    for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
        const size_t len = cols - b < KVL_I16_BLOCK ? cols - b : KVL_I16_BLOCK; /* <= 64 */
        const __mmask32 m0 = len >= 32 ? (__mmask32)0xffffffffu : tail_mask32(len);
        const __mmask32 m1 = len >= 64 ? (__mmask32)0xffffffffu : len > 32 ? tail_mask32(len - 32) : (__mmask32)0;
        const __mmask64 m = (__mmask64)m0 | ((__mmask64)m1 << 32);
        if (prefetch)
            prefetch_next_rows4(w3, cols, b);
        const __m512i x8 = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_maskz_loadu_epi16(m0, x + b))),
            _mm512_cvtepi16_epi8(_mm512_maskz_loadu_epi16(m1, x + b + 32)), 1);
        const __m512i ax = _mm512_abs_epi8(x8);
        const __mmask64 neg = _mm512_movepi8_mask(x8);
        const __m512i a0 = dot_i8_block(ax, neg, m, w0 + b), a1 = dot_i8_block(ax, neg, m, w1 + b);
        const __m512i a2 = dot_i8_block(ax, neg, m, w2 + b), a3 = dot_i8_block(ax, neg, m, w3 + b);
        __m128 p = _mm_mul_ps(_mm_cvtepi32_ps(reduce4_epi32(a0, a1, a2, a3)), _mm_set1_ps(xs[b / KVL_I16_BLOCK]));
        acc = _mm_add_ps(acc, p);
    }
    _mm_storeu_ps(Y + r, _mm_mul_ps(acc, _mm_loadu_ps(scale + r)));
}

/* Primitives of the driver's integer tile (tile_int, kernels_matmul_driver.h): 32 columns a step
 * (VPDPWSSD into int32 lanes) on masked loads, so no scalar column tails; four sums reduced at
 * once by reduce4_epi32. */
#define TI_MASKED 1
#define TI_Q8_STEP 32
#define TI_I16_STEP 32
#define TI_Q8W __m512i
#define TI_Q8X __m512i
#define TI_IACC __m512i
#define TI_I16V __m512i
#define TI_FACC __m512
#define TI_I4 __m128i
#define TI_F4 __m128
/* the lanes of columns [c, c + 32) that lie below e */
KVL_INLINE __mmask32 ti_mask32(size_t c, size_t e)
{
    return c >= e ? (__mmask32)0 : e - c >= 32 ? (__mmask32)0xffffffffu : tail_mask32(e - c);
}
#define ti_izero() _mm512_setzero_si512()
#define ti_load_q8w(row, c, e) load_q8x32_i16_masked((row) + (c), ti_mask32(c, e))
#define ti_load_q8x(row, c, e) _mm512_maskz_loadu_epi16(ti_mask32(c, e), (row) + (c))
#define ti_dot_q8(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#define ti_ihsum(v) _mm512_reduce_add_epi32(v)
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
/* a step's 64 int16: two lines */
#define ti_prefetch_i16_step(p) (ti_prefetch(p), ti_prefetch((p) + 32))
#define ti_load_i16(row, c, e) _mm512_maskz_loadu_epi16(ti_mask32(c, e), (row) + (c))
#define ti_fzero() _mm512_setzero_ps()
#define ti_fadd(a, b) _mm512_add_ps(a, b)
#define ti_fhsum(v) hsum512(v)
#define ti_i16_quad(w0, x0, w1, x1) i16_quad(w0, x0, w1, x1)
#define ti_i16_pair(w, x) _mm512_cvtepi32_ps(_mm512_madd_epi16(w, x))

/* ---- Q8 x int16 prefill with rows in the lanes (matmul_q8_i16_strips, kernels_matmul_driver.h):
 * 16 rows per vector, STRIP_DOT one VPDPWSSD. */

#define STRIP_ROWS 16
#define STRIP_IVEC __m512i
#define STRIP_FVEC __m512
#define STRIP_RMASK __mmask16
#define STRIP_RMASK_OF(nr) ((nr) == 16 ? (__mmask16)0xffff : tail_mask16(nr))
#define STRIP_ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define STRIP_IZERO() _mm512_setzero_si512()
#define STRIP_ISPLAT(v) _mm512_set1_epi32(v)
#define STRIP_DOT(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#define STRIP_CVT(v) _mm512_cvtepi32_ps(v)
#define STRIP_FZERO() _mm512_setzero_ps()
#define STRIP_FSPLAT(v) _mm512_set1_ps(v)
#define STRIP_FADD(a, b) _mm512_add_ps(a, b)
#define STRIP_FMUL(a, b) _mm512_mul_ps(a, b)
#define STRIP_FLOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define STRIP_FSTORE(m, p, v) _mm512_mask_storeu_ps(p, m, v)

/* 16 x 16 int32 transpose in registers: r[i] lane j <-> r[j] lane i. */
KVL_INLINE void transpose16_epi32(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane of r[i] now holds 4 rows x the same 4 pairs: gather the 128-bit lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Rows [r0, r0 + nr) (nr <= 16), columns [c0, c0 + nc) (nc <= STRIP_CHUNK) as int16 pairs:
 * P[p * 16 + i] = the pair (c0 + 2p, c0 + 2p + 1) of row r0 + i, zero outside the matrix. */
static void pack_q8_strip(int32_t *P, const int8_t *W, size_t cols, size_t r0, size_t nr, size_t c0, size_t nc)
{
    for (size_t c = 0; c < nc; c += 32) {
        const __mmask32 m = nc - c >= 32 ? (__mmask32)0xffffffffu : tail_mask32(nc - c);
        __m512i r[16];
        for (size_t i = 0; i < 16; i++)
            r[i] = i < nr ? load_q8x32_i16_masked(W + (r0 + i) * cols + c0 + c, m) : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int p = 0; p < 16; p++)
            _mm512_storeu_si512((void *)(P + (c / 2 + (size_t)p) * STRIP_ROWS), r[p]);
    }
}

#include "../kernels_matmul_driver.h"

/* ---- Q4 weights (kernels.h: matmul_q4*) --------------------------------------------------
 *
 * As in kernels_avx2.c (which explains the blocks, the reduction and the bit-exactness of the
 * integer products); here: matmul_q4 / _xb widen a group's 16 bytes to 16 int32 lanes once and
 * look both nibbles up in a 16-entry FP32 table of q - 8 (VPERMPS reads the low 4 bits of each
 * index: the low nibble needs no mask), two FMAs per group and row, then one by the group's scale.
 * The "avx512-bf16" table's matmul_q4_xb looks the nibbles up as BF16 (VPERMW) and takes the
 * group's 32 products in one VDPBF16PS on the activations rounded to BF16 (exact products, FP32
 * sums: within FP32 rounding as the FMA version); in decoding, q4x below. matmul_q4_i16 / _i8:
 * q4d below, for every n. */

KVL_INLINE float q4_bf16(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- Q4 integer products (q4d): 8 rows x 128 columns (64 bytes per row) per step ----------
 *
 * Decoding streams each weight byte once, so the per-byte work must stay below DRAM speed (the
 * 4-row, 64-column version this replaced ran at 0.56x Q8's GB/s from DRAM on Zen 4). The
 * token's activations are first laid out once (per chunk of Q4D_KC columns, on the stack) in the
 * nibbles' order, so that a row's 64 bytes are unpacked without any shuffle:
 *   _i16: the bytes read as 32 int16 give four vectors of unsigned nibbles by shifts and masks
 *     (bits 0-3, 4-7, 8-11, 12-15 of each int16: columns 2j, 16 + 2j, 2j + 1, 17 + 2j of its
 *     group) and four VPDPWSSD against the matching int16 activations;
 *   _i8: the low and high nibbles as bytes, two VPDPBUSD (nibble u8 times x int8).
 * The accumulator starts at -8 * sum(x) of each group (in one lane of its four), so it ends at the
 * exact sum of (nibble - 8) * x: each 128-bit lane holds one group's four partial sums. The eight
 * rows' vectors are reduced together (two rounds of unpack + add: exact int32), giving for each
 * group the eight rows' sums, and the FP32 steps of kernels.h then run on [block b | block b + 1]
 * of all eight rows at once: p = (float)s0 * ds0 + (float)s1 * ds1 (separate multiplies and add,
 * never fused), acc + p * xs[b], then acc + p' * xs[b + 1]: each lane one row's own sequence, so
 * bit-identical to the reference. A step's 32 scales (eight rows x four groups, one 8-byte gather
 * per row) go to FP32 with one masked word permute each half (the BF16 bits into the high half of
 * each lane). A last partial step (cols % 128) reads its bytes with a masked load and its scales
 * by hand, missing groups as 0 (a sum of 0 times a scale of 0: +0, which changes no accumulator,
 * as kernels_avx2.c explains). Rows beyond the last repeat it and are not stored. The next tile's
 * rows and scales are prefetched a line per row and step, as the Q8 decode does. */

#define Q4D_KC 4096 /* columns per chunk of laid-out activations (12 KiB of stack) */
#define Q4D_STEPS (Q4D_KC / 128)

typedef struct {
    __m512i x[Q4D_STEPS][4]; /* _i16: the four int16 layouts; _i8: [0] low, [1] high nibbles' x */
    __m512i corr[Q4D_STEPS]; /* -8 * sum(x) of each group, in the first lane of its four */
    __m512 xs[Q4D_STEPS];    /* [xs_b x4 | xs_b+1 x4 | xs_b x4 | xs_b+1 x4] (0 for a missing block) */
} q4d_act;

/* Columns [c0, c0 + kc) of the token (kc a multiple of 32, c0 a multiple of 128). */
static void q4d_layout(int i8, q4d_act *a, const int16_t *x, const float *xs, size_t c0, size_t kc)
{
    static const uint16_t perm[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                      1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const __m512i idx = _mm512_loadu_si512((const void *)perm);
    const size_t steps = (kc + 127) / 128, ng = kc / 32;
    for (size_t k = 0; k < steps; k++) {
        int32_t corr[16] = {0};
        for (int l = 0; l < 4; l++) {
            const size_t g = 4 * k + (size_t)l;
            const __m512i v = g < ng ? _mm512_loadu_si512((const void *)(x + c0 + 32 * g)) : _mm512_setzero_si512();
            corr[4 * l] = -8 * _mm512_reduce_add_epi32(_mm512_madd_epi16(v, _mm512_set1_epi16(1)));
            if (i8) { /* bytes 0-15: columns 0-15 (low nibbles), 16-31: columns 16-31 (high) */
                const __m256i b = _mm512_cvtepi16_epi8(v);
                memcpy((char *)&a->x[k][0] + 16 * l, &b, 16);
                memcpy((char *)&a->x[k][1] + 16 * l, (const char *)&b + 16, 16);
            } else { /* [columns 2j | 16 + 2j | 2j + 1 | 17 + 2j], j < 8 */
                const __m512i p = _mm512_permutexvar_epi16(idx, v);
                for (int j = 0; j < 4; j++)
                    memcpy((char *)&a->x[k][j] + 16 * l, (const char *)&p + 16 * j, 16);
            }
        }
        a->corr[k] = _mm512_loadu_si512((const void *)corr);
        const size_t b = (c0 + 128 * k) / KVL_I16_BLOCK, have = kc - 128 * k; /* columns left */
        const __m128 x0 = _mm_set1_ps(xs[b]), x1 = _mm_set1_ps(have > 64 ? xs[b + 1] : 0.0f);
        const __m256 h = _mm256_set_m128(x1, x0);
        a->xs[k] = _mm512_insertf32x8(_mm512_castps256_ps512(h), h, 1);
    }
}

/* One step's int32 sums of 8 rows -> [g0 r0-3 | g2 r0-3 | g0 r4-7 | g2 r4-7] (A) and the same for
 * g1, g3 (B), exactly. */
KVL_INLINE void q4d_reduce8(const __m512i u[8], __m512i *A, __m512i *B)
{
    __m512i t[4];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_epi32(u[2 * i], u[2 * i + 1]));
    const __m512i lo = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i hi = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
    *A = _mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    *B = _mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
}

/* 8 rows' 4 scales each (u16 lane 4i + g: row i, group g) -> FP32 in q4d_reduce8's layouts */
KVL_INLINE void q4d_scales(__m512i s, __m512 *dA, __m512 *dB)
{
    /* odd word 2d + 1 (the high half of FP32 lane d) <- row 4 * (d / 8) + d % 4, group by d / 4 */
#define Q4D_IX(g0, g1) \
    0, (g0), 0, 4 + (g0), 0, 8 + (g0), 0, 12 + (g0), 0, (g1), 0, 4 + (g1), 0, 8 + (g1), 0, 12 + (g1), \
    0, 16 + (g0), 0, 20 + (g0), 0, 24 + (g0), 0, 28 + (g0), 0, 16 + (g1), 0, 20 + (g1), 0, 24 + (g1), 0, 28 + (g1)
    static const uint16_t ixa[32] = {Q4D_IX(0, 2)}, ixb[32] = {Q4D_IX(1, 3)};
#undef Q4D_IX
    const __m512i ia = _mm512_loadu_si512((const void *)ixa), ib = _mm512_loadu_si512((const void *)ixb);
    *dA = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, ia, s));
    *dB = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, ib, s));
}

/* Rows r .. r + nr - 1 (nr <= 8) of one token, columns [c0, c0 + kc) laid out in a; acc from Y
 * when c0 > 0 (an earlier chunk's), else 0. */
KVL_INLINE void q4d_rows8(int i8, float *Y, const uint8_t *W, const uint16_t *S, size_t r, int nr, size_t cols,
                          const q4d_act *a, size_t c0, size_t kc, int prefetch)
{
    const size_t rb = cols / 2, ng = cols / 32, full = kc / 128;
    const uint8_t *w[8];
    int64_t soff[8];
    for (int i = 0; i < 8; i++) {
        const size_t row = r + (size_t)(i < nr ? i : nr - 1);
        w[i] = W + row * rb + c0 / 2;
        soff[i] = (int64_t)(row * ng * 2);
    }
    const __m512i vsoff = _mm512_loadu_si512((const void *)soff);
    const uint16_t *s = S + c0 / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc = _mm512_setzero_ps(); /* lane 0: rows 0-3, lane 2: rows 4-7; lanes 1, 3 unused */
    if (c0 > 0) {
        float y[8];
        for (int i = 0; i < 8; i++)
            y[i] = Y[r + (size_t)(i < nr ? i : nr - 1)];
        acc = _mm512_insertf32x4(_mm512_castps128_ps512(_mm_loadu_ps(y)), _mm_loadu_ps(y + 4), 2);
    }
    const size_t steps = (kc + 127) / 128;
    for (size_t k = 0; k < steps; k++) {
        __m512i u[8];
        __m512i sc;
        if (k < full) {
            if (prefetch) {
                /* into L2 (T1): into L1 (T0) the streams ran at half the speed (Zen 4) */
                for (int i = 0; i < 8; i++)
                    _mm_prefetch((const char *)(w[i] + 8 * rb + 64 * k), _MM_HINT_T1);
                _mm_prefetch((const char *)(S + (r + 8) * ng) + 64 * k, _MM_HINT_T1);
            }
            for (int i = 0; i < 8; i++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w[i] + 64 * k));
                if (i8) {
                    u[i] = _mm512_dpbusd_epi32(a->corr[k], _mm512_and_si512(v, m4), a->x[k][0]);
                    u[i] = _mm512_dpbusd_epi32(u[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), a->x[k][1]);
                } else {
                    const __m512i m = _mm512_set1_epi16(0x000f);
                    u[i] = _mm512_dpwssd_epi32(a->corr[k], _mm512_and_si512(v, m), a->x[k][0]);
                    u[i] = _mm512_dpwssd_epi32(u[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), m), a->x[k][1]);
                    u[i] = _mm512_dpwssd_epi32(u[i], _mm512_and_si512(_mm512_srli_epi16(v, 8), m), a->x[k][2]);
                    u[i] = _mm512_dpwssd_epi32(u[i], _mm512_srli_epi16(v, 12), a->x[k][3]);
                }
            }
            sc = _mm512_i64gather_epi64(vsoff, (const void *)(s + 4 * k), 1);
        } else { /* the last 1-3 groups */
            const size_t gl = (kc - 128 * k) / 32;
            const __mmask64 mb = ((__mmask64)1 << (16 * gl)) - 1;
            uint16_t st[32] = {0};
            for (int i = 0; i < 8; i++) {
                const __m512i v = _mm512_maskz_loadu_epi8(mb, (const void *)(w[i] + 64 * k));
                if (i8) {
                    u[i] = _mm512_dpbusd_epi32(a->corr[k], _mm512_and_si512(v, m4), a->x[k][0]);
                    u[i] = _mm512_dpbusd_epi32(u[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), a->x[k][1]);
                } else {
                    const __m512i m = _mm512_set1_epi16(0x000f);
                    u[i] = _mm512_dpwssd_epi32(a->corr[k], _mm512_and_si512(v, m), a->x[k][0]);
                    u[i] = _mm512_dpwssd_epi32(u[i], _mm512_and_si512(_mm512_srli_epi16(v, 4), m), a->x[k][1]);
                    u[i] = _mm512_dpwssd_epi32(u[i], _mm512_and_si512(_mm512_srli_epi16(v, 8), m), a->x[k][2]);
                    u[i] = _mm512_dpwssd_epi32(u[i], _mm512_srli_epi16(v, 12), a->x[k][3]);
                }
                memcpy(st + 4 * i, (const char *)S + soff[i] + 2 * (c0 / 32 + 4 * k), 2 * gl);
            }
            sc = _mm512_loadu_si512((const void *)st);
        }
        __m512i A, B;
        __m512 dA, dB;
        q4d_reduce8(u, &A, &B);
        q4d_scales(sc, &dA, &dB);
        const __m512 pa = _mm512_mul_ps(_mm512_cvtepi32_ps(A), dA);
        const __m512 pb = _mm512_mul_ps(_mm512_cvtepi32_ps(B), dB);
        const __m512 q = _mm512_mul_ps(_mm512_add_ps(pa, pb), a->xs[k]);
        acc = _mm512_add_ps(acc, q);
        acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(q, q, _MM_SHUFFLE(3, 3, 1, 1)));
    }
    float y[8];
    _mm_storeu_ps(y, _mm512_castps512_ps128(acc));
    _mm_storeu_ps(y + 4, _mm512_extractf32x4_ps(acc, 2));
    for (int i = 0; i < nr; i++)
        Y[r + (size_t)i] = y[i];
}

/* Any n: tokens in groups of Q4D_TOK (their laid-out activations on the stack together), each
 * tile of eight rows for every token of the group before the next tile (its weights stay in L1);
 * a prompt's tokens thus stream the weights once per group instead of once. */
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
                q4d_layout(i8, &a[t], Xq + (t0 + t) * ldx, xs + (t0 + t) * nb, c0, kc);
            for (size_t r = 0; r < rows; r += 8)
                for (size_t t = 0; t < nt; t++)
                    q4d_rows8(i8, Y + (t0 + t) * ldy, W, S, r, rows - r < 8 ? (int)(rows - r) : 8, cols, &a[t], c0, kc,
                              t == 0 && r + 16 <= rows);
        }
    }
}

enum { Q4F_F32, Q4F_XB, Q4F_DP }; /* FP32 activations, rounded to BF16 (FMAs), BF16 dot products */

/* R rows (a constant: 4 or 1) from row r, one token */
KVL_INLINE void q4_rows_f32(int mode, const int R, float *Y, const uint8_t *W, const uint16_t *S, size_t r,
                            size_t cols, const float *x, int prefetch)
{
    const size_t rb = cols / 2, ng = cols / 32;
    const __m512 lut = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    /* BF16 bits of -8 .. 7 (entries 16-31 unused) */
    const __m512i lutb = _mm512_setr_epi32((int)0xC0E0C100u, (int)0xC0A0C0C0u, (int)0xC040C080u, (int)0xBF80C000u,
                                           0x3F800000, 0x40404000, 0x40A04080, 0x40E040C0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4];
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        acc[i] = _mm512_setzero_ps();
    const uint8_t *w = W + r * rb;
    const uint16_t *s = S + r * ng;
    for (size_t g = 0; g < ng; g++) {
        if (prefetch && (g & 3) == 0)
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                _mm_prefetch((const char *)(w + (size_t)(R + i) * rb + 16 * g), _MM_HINT_T1);
        __m512 x0 = _mm512_setzero_ps(), x1 = x0;
        __m512bh xh;
        if (mode == Q4F_DP) {
            xh = x_bf16x32(x + 32 * g);
        } else {
            x0 = load_x(mode == Q4F_XB, x + 32 * g);
            x1 = load_x(mode == Q4F_XB, x + 32 * g + 16);
            xh = AS_BH(_mm512_setzero_si512());
        }
        KVL_UNROLL
        for (int i = 0; i < R; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(w + (size_t)i * rb + 16 * g));
            __m512 gs;
            if (mode == Q4F_DP) {
                const __m256i d = _mm256_cvtepu8_epi16(b);
                const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(d, _mm256_set1_epi16(0x0f))),
                                                       _mm256_srli_epi16(d, 4), 1);
                gs = _mm512_dpbf16_ps(_mm512_setzero_ps(), AS_BH(_mm512_permutexvar_epi16(idx, lutb)), xh);
            } else {
                const __m512i d = _mm512_cvtepu8_epi32(b);
                gs = _mm512_mul_ps(_mm512_permutexvar_ps(d, lut), x0);
                gs = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut), x1, gs);
            }
            acc[i] = _mm512_fmadd_ps(gs, _mm512_set1_ps(q4_bf16(s[(size_t)i * ng + g])), acc[i]);
        }
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        Y[r + (size_t)i] = hsum512(acc[i]);
}

KVL_INLINE void q4_matmul_f32(int mode, float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const float *X, size_t ldx, size_t n)
{
    size_t r = 0;
    for (; r + 4 <= rows; r += 4)
        for (size_t t = 0; t < n; t++)
            q4_rows_f32(mode, 4, Y + t * ldy, W, S, r, cols, X + t * ldx, t == 0 && r + 8 <= rows);
    for (; r < rows; r++)
        for (size_t t = 0; t < n; t++)
            q4_rows_f32(mode, 1, Y + t * ldy, W, S, r, cols, X + t * ldx, 0);
}

/* ---- matmul_q4_xb decode (n == 1) on VDPBF16PS, 4 rows x 128 columns per step --------------
 *
 * The token's activations are rounded to BF16 once per chunk of Q4D_KC columns and laid out in the
 * order the nibbles take when a row's 64 bytes are split into low and high nibbles and widened to
 * words in-lane (unpack with zero): 128-bit lane L of piece j holds columns 8j .. 8j + 7 of group
 * 4k + L. Per row and step: the split (three ops), four unpacks, four VPERMW of a 16-entry BF16
 * table of q - 8 and four VPDPBF16PS give each group's products summed in its lane's four FP32
 * lanes (exact products, FP32 sums), then one FMA by [ds(g) x4 | ...] (the row's four scales, one
 * 8-byte load and a masked word permute) into the row's accumulator, summed across lanes at the
 * end: within FP32 rounding of the reference, as the other tables. */

typedef struct {
    __m512i x[Q4D_STEPS][4];
} q4x_act;

static void q4x_layout(q4x_act *a, const float *x, size_t c0, size_t kc)
{
    const size_t steps = (kc + 127) / 128, ng = kc / 32;
    for (size_t k = 0; k < steps; k++)
        for (int l = 0; l < 4; l++) {
            const size_t g = 4 * k + (size_t)l;
            const __m512i v = g < ng ? BH_BITS(x_bf16x32(x + c0 + 32 * g)) : _mm512_setzero_si512();
            for (int j = 0; j < 4; j++)
                memcpy((char *)&a->x[k][j] + 16 * l, (const char *)&v + 16 * j, 16);
        }
}

KVL_INLINE void q4x_rows4(float *Y, const uint8_t *W, const uint16_t *S, size_t r, int nr, size_t cols,
                          const q4x_act *a, size_t c0, size_t kc, int prefetch)
{
    /* BF16 bits of -8 .. 7 (entries 16-31 unused) */
    const __m512i lutb = _mm512_setr_epi32((int)0xC0E0C100u, (int)0xC0A0C0C0u, (int)0xC040C080u, (int)0xBF80C000u,
                                           0x3F800000, 0x40404000, 0x40A04080, 0x40E040C0, 0, 0, 0, 0, 0, 0, 0, 0);
    /* odd word 2d + 1 (the high half of FP32 lane d) <- scale d / 4 */
    static const uint16_t ixs[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1,
                                     0, 2, 0, 2, 0, 2, 0, 2, 0, 3, 0, 3, 0, 3, 0, 3};
    const __m512i is = _mm512_loadu_si512((const void *)ixs);
    const size_t rb = cols / 2, ng = cols / 32, full = kc / 128, steps = (kc + 127) / 128;
    const __m512i m4 = _mm512_set1_epi8(0x0f), z = _mm512_setzero_si512();
    const uint8_t *w[4];
    const uint16_t *s[4];
    __m512 acc[4];
    for (int i = 0; i < 4; i++) {
        const size_t row = r + (size_t)(i < nr ? i : nr - 1);
        w[i] = W + row * rb + c0 / 2;
        s[i] = S + row * ng + c0 / 32;
        acc[i] = _mm512_setzero_ps();
    }
    for (size_t k = 0; k < steps; k++) {
        const __mmask64 mb = k < full ? ~(__mmask64)0 : ((__mmask64)1 << (16 * ((kc - 128 * k) / 32))) - 1;
        const __mmask8 ms = k < full ? (__mmask8)0x0f : (__mmask8)((1u << ((kc - 128 * k) / 32)) - 1u);
        if (prefetch && k < full) {
            for (int i = 0; i < 4; i++)
                _mm_prefetch((const char *)(w[i] + 4 * rb + 64 * k), _MM_HINT_T1);
            if ((k & 1) == 0)
                _mm_prefetch((const char *)(s[0] + 4 * ng) + 32 * k, _MM_HINT_T1);
        }
        KVL_UNROLL
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_maskz_loadu_epi8(mb, (const void *)(w[i] + 64 * k));
            const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            __m512 g = _mm512_dpbf16_ps(_mm512_setzero_ps(), AS_BH(_mm512_permutexvar_epi16(_mm512_unpacklo_epi8(lo, z), lutb)),
                                        AS_BH(a->x[k][0]));
            g = _mm512_dpbf16_ps(g, AS_BH(_mm512_permutexvar_epi16(_mm512_unpackhi_epi8(lo, z), lutb)), AS_BH(a->x[k][1]));
            g = _mm512_dpbf16_ps(g, AS_BH(_mm512_permutexvar_epi16(_mm512_unpacklo_epi8(hi, z), lutb)), AS_BH(a->x[k][2]));
            g = _mm512_dpbf16_ps(g, AS_BH(_mm512_permutexvar_epi16(_mm512_unpackhi_epi8(hi, z), lutb)), AS_BH(a->x[k][3]));
            const __m512i sv = _mm512_castsi128_si512(_mm_maskz_loadu_epi16(ms, (const void *)(s[i] + 4 * k)));
            acc[i] = _mm512_fmadd_ps(g, _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, is, sv)), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++)
        Y[r + (size_t)i] = (c0 > 0 ? Y[r + (size_t)i] : 0.0f) + hsum512(acc[i]);
}

static void q4x_matmul(float *Y, const uint8_t *W, const uint16_t *S, size_t rows, size_t cols, const float *x)
{
    q4x_act a;
    for (size_t c0 = 0; c0 < cols; c0 += Q4D_KC) {
        const size_t kc = cols - c0 < Q4D_KC ? cols - c0 : Q4D_KC;
        q4x_layout(&a, x, c0, kc);
        for (size_t r = 0; r < rows; r += 4)
            q4x_rows4(Y, W, S, r, rows - r < 4 ? (int)(rows - r) : 4, cols, &a, c0, kc, r + 8 <= rows);
    }
}

static void avx512_matmul_q4(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                             size_t cols, const float *X, size_t ldx, size_t n)
{
    q4_matmul_f32(Q4F_F32, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void avx512_matmul_q4_xb(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                size_t cols, const float *X, size_t ldx, size_t n)
{
    q4_matmul_f32(Q4F_XB, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void avx512bf16_matmul_q4_xb(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                    size_t cols, const float *X, size_t ldx, size_t n)
{
    if (n == 1) {
        q4x_matmul(Y, W, S, rows, cols, X);
        return;
    }
    q4_matmul_f32(Q4F_DP, Y, ldy, W, S, rows, cols, X, ldx, n);
}

static void avx512_matmul_q4_i16(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                 size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    q4d_matmul(0, Y, ldy, W, S, rows, cols, Xq, xs, ldx, n);
}

static void avx512_matmul_q4_i8(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                                size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    q4d_matmul(1, Y, ldy, W, S, rows, cols, Xq, xs, ldx, n);
}

/* ---- vector ops ------------------------------------------------------------------------ */

static float avx512_dot_f32(const float *a, const float *b, size_t n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= n; i += 16)
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
    }
    return hsum512(_mm512_add_ps(s0, s1));
}

static void avx512_axpy_f32(float *y, float a, const float *x, size_t n)
{
    __m512 va = _mm512_set1_ps(a);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        __m512 r = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

/* axpy_rows_f32 on a tile of H rows of Y by V 16-float vectors (the last one masked by m, as
 * avx512_axpy_f32 masks its tail), over every p: each element gets avx512_axpy_f32's FMA, in p
 * order. */
KVL_INLINE void axpy_rows_tile(int H, int V, __mmask16 m, float *Y, size_t ldy, const float *A,
                               size_t lda, const float *X, size_t ldx, size_t np)
{
    __m512 s[4][4];
    for (int h = 0; h < H; h++)
        for (int v = 0; v < V; v++)
            s[h][v] = _mm512_maskz_loadu_ps(v == V - 1 ? m : 0xffff, Y + (size_t)h * ldy + 16 * v);
    for (size_t p = 0; p < np; p++) {
        __m512 x[4];
        KVL_UNROLL
        for (int v = 0; v < V; v++)
            x[v] = _mm512_maskz_loadu_ps(v == V - 1 ? m : 0xffff, X + p * ldx + 16 * v);
        KVL_UNROLL
        for (int h = 0; h < H; h++) {
            const __m512 a = _mm512_set1_ps(A[(size_t)h * lda + p]);
            KVL_UNROLL
            for (int v = 0; v < V; v++)
                s[h][v] = _mm512_fmadd_ps(a, x[v], s[h][v]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int v = 0; v < V; v++)
            _mm512_mask_storeu_ps(Y + (size_t)h * ldy + 16 * v, v == V - 1 ? m : 0xffff, s[h][v]);
}

/* Columns in strips of 64 (then 16, then one masked vector, as avx512_axpy_f32 splits them). */
static void avx512_axpy_rows_f32(float *Y, size_t ldy, const float *A, size_t lda, size_t nh,
                                 const float *X, size_t ldx, size_t np, size_t cols)
{
    size_t c = 0;
    for (; c + 64 <= cols; c += 64) {
        size_t h = 0;
        for (; h + 4 <= nh; h += 4)
            axpy_rows_tile(4, 4, 0xffff, Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
        for (; h < nh; h++)
            axpy_rows_tile(1, 4, 0xffff, Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
    }
    for (; c + 16 <= cols; c += 16)
        for (size_t h = 0; h < nh; h++)
            axpy_rows_tile(1, 1, 0xffff, Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
    if (c < cols)
        for (size_t h = 0; h < nh; h++)
            axpy_rows_tile(1, 1, tail_mask16(cols - c), Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
}

static void avx512_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, bf16x16(_mm256_loadu_si256((const __m256i *)(const void *)(src + i))));
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        _mm512_mask_storeu_ps(dst + i, m, bf16x16(_mm256_maskz_loadu_epi16(m, src + i)));
    }
}

static void avx512_q8_to_f32(float *dst, const int8_t *src, float scale, size_t n)
{
    const __m512 s = _mm512_set1_ps(scale);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                    _mm_loadu_si128((const __m128i *)(const void *)(src + i)))), s));
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, src + i))), s));
    }
}

KVL_INLINE __m256i f32x16_to_bf16(__m512 v)
{
    /* Same bit recipe as the reference: RNE by adding 0x7fff + lsb; NaNs made quiet. */
    __m512i u = _mm512_castps_si512(v);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i rounded = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1))));
    rounded = _mm512_srli_epi32(rounded, 16);
    __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                              _mm512_set1_epi32(0x7f800000));
    __m512i r = _mm512_mask_or_epi32(rounded, isnan, hi, _mm512_set1_epi32(0x0040));
    return _mm512_cvtepi32_epi16(r);
}

static void avx512_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(void *)(dst + i), f32x16_to_bf16(_mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 m = tail_mask16(n - i);
        _mm256_mask_storeu_epi16(dst + i, m, f32x16_to_bf16(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

/* ---- exp-based element-wise functions --------------------------------------------------- */

/* e^x for 16 lanes: x = n ln2 + r with |r| <= ln2/2 (two-part ln2), e^r by the Cephes expf
 * polynomial, times 2^n by VSCALEFPS, which also gives 0 / subnormals below -87.3 and +inf above
 * 88.72 as expf does. About 1 ulp against expf. */
KVL_INLINE __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7228394f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* kvl_softmax with exp16: the same max subtraction, all-masked rule and normalisation. */
static void avx512_softmax(float *x, size_t n)
{
    if (n == 0)
        return;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
    float mx = _mm512_reduce_max_ps(vmax);
    for (; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    if (mx == -INFINITY) {
        for (i = 0; i < n; i++)
            x[i] = 1.0f / (float)n;
        return;
    }
    const __m512 m = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
        _mm512_storeu_ps(x + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (i < n) {
        __mmask16 k = tail_mask16(n - i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
        e = _mm512_maskz_mov_ps(k, e);
        _mm512_mask_storeu_ps(x + i, k, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
    if (i < n) {
        __mmask16 k = tail_mask16(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    }
}

/* kvl_gelu_tanh as 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)): no cancellation for negative x
 * (the tanh form loses relative precision there, in the reference too), exact limits x and 0. */
KVL_INLINE __m512 gelu_tanh16(__m512 v)
{
    __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), /* -2 sqrt(2/pi) */
                             _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), v3, v));
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(u)));
}

static void avx512_gelu_tanh(float *x, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, gelu_tanh16(_mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 k = tail_mask16(n - i);
        _mm512_mask_storeu_ps(x + i, k, gelu_tanh16(_mm512_maskz_loadu_ps(k, x + i)));
    }
}

/* The two AVX-512 tables differ only in how the BF16-input products run. */
/* gemm_tile (kernels.h) on 12 tokens x 32 outputs: 24 zmm accumulators, 2 weight vectors and a
 * broadcast of the 32 registers; per column 2 loads, 12 broadcasts (folded into the FMAs as
 * {1to16} operands) and 24 FMAs, so the two FMA ports, not the loads, set the pace. */
enum { GEMM_MR = 12, GEMM_NR = 32 };
/* every loop over the tile's 12 tokens unrolled, or GCC keeps the accumulators in memory */
#if defined(__GNUC__) || defined(__clang__)
#define KVL_UNROLL_TILE _Pragma("GCC unroll 16")
#else
#define KVL_UNROLL_TILE
#endif
static void avx512_gemm_tile(size_t kc, const float *A, const float *B, float *C, size_t ldc,
                             int accumulate)
{
    __m512 acc[GEMM_MR][2];
    KVL_UNROLL_TILE
    for (int i = 0; i < GEMM_MR; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (size_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(B + k * GEMM_NR), b1 = _mm512_loadu_ps(B + k * GEMM_NR + 16);
        /* the weight panel streams from L2: ask for it 8 columns (1 KiB) ahead (a prefetch past
         * the panel's end never faults). Measured on the shared 2-vCPU VM, CPU time, paired
         * runs: 0.48-0.68 of the FMA peak with it, 0.46-0.62 without (bench/RESULTS.md) */
        _mm_prefetch((const char *)(B + (k + 8) * GEMM_NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(B + (k + 8) * GEMM_NR + 16), _MM_HINT_T0);
        KVL_UNROLL_TILE
        for (int i = 0; i < GEMM_MR; i++) {
            const __m512 a = _mm512_set1_ps(A[k * GEMM_MR + (size_t)i]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    KVL_UNROLL_TILE
    for (int i = 0; i < GEMM_MR; i++) {
        float *c = C + (size_t)i * ldc;
        if (accumulate) {
            acc[i][0] = _mm512_add_ps(_mm512_loadu_ps(c), acc[i][0]);
            acc[i][1] = _mm512_add_ps(_mm512_loadu_ps(c + 16), acc[i][1]);
        }
        _mm512_storeu_ps(c, acc[i][0]);
        _mm512_storeu_ps(c + 16, acc[i][1]);
    }
}

/* gemm_tile_bf16 (kernels.h) on the same 12 x 32 tile: per column pair 2 loads of 16 weight
 * pairs, 12 broadcasts of a token's pair (folded as {1to16}) and 24 VDPBF16PS, each two
 * multiply-adds per lane: half the instructions of avx512_gemm_tile for the same sums. */
static void avx512bf16_gemm_tile_bf16(size_t kp, const uint32_t *A, const uint32_t *B, float *C,
                                      size_t ldc, int accumulate)
{
    __m512 acc[GEMM_MR][2];
    KVL_UNROLL_TILE
    for (int i = 0; i < GEMM_MR; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (size_t q = 0; q < kp; q++) {
        const __m512bh b0 = AS_BH(_mm512_loadu_si512((const void *)(B + q * GEMM_NR)));
        const __m512bh b1 = AS_BH(_mm512_loadu_si512((const void *)(B + q * GEMM_NR + 16)));
        _mm_prefetch((const char *)(B + (q + 8) * GEMM_NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(B + (q + 8) * GEMM_NR + 16), _MM_HINT_T0);
        KVL_UNROLL_TILE
        for (int i = 0; i < GEMM_MR; i++) {
            const __m512bh a = AS_BH(_mm512_set1_epi32((int)A[q * GEMM_MR + (size_t)i]));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    KVL_UNROLL_TILE
    for (int i = 0; i < GEMM_MR; i++) {
        float *c = C + (size_t)i * ldc;
        if (accumulate) {
            acc[i][0] = _mm512_add_ps(_mm512_loadu_ps(c), acc[i][0]);
            acc[i][1] = _mm512_add_ps(_mm512_loadu_ps(c + 16), acc[i][1]);
        }
        _mm512_storeu_ps(c, acc[i][0]);
        _mm512_storeu_ps(c + 16, acc[i][1]);
    }
}

#define AVX512_TABLE(NAME, BF16_DOT, MATMUL_BF16_XB, MATMUL_Q8_XB, MATMUL_Q4_XB, GEMM_TILE_BF16)            \
    {                                                                                                        \
        .name = NAME, .bf16_dot = BF16_DOT, .matmul_bf16 = driver_matmul_bf16, .matmul_q8 = driver_matmul_q8, \
        .matmul_f32 = driver_matmul_f32, .matmul_bf16_xb = MATMUL_BF16_XB, .matmul_q8_xb = MATMUL_Q8_XB,     \
        .quantize_i16_act = driver_quantize_i16_act, .matmul_q8_i16 = driver_matmul_q8_i16,                  \
        .matmul_q8_i8 = driver_matmul_q8_i8, .matmul_i16_i16 = driver_matmul_i16_i16,                        \
        .matmul_q4 = avx512_matmul_q4, .matmul_q4_xb = MATMUL_Q4_XB, .matmul_q4_i16 = avx512_matmul_q4_i16,   \
        .matmul_q4_i8 = avx512_matmul_q4_i8, .dot_f32 = avx512_dot_f32, .axpy_f32 = avx512_axpy_f32,         \
        .axpy_rows_f32 = avx512_axpy_rows_f32, .bf16_to_f32 = avx512_bf16_to_f32,                            \
        .q8_to_f32 = avx512_q8_to_f32, .f32_to_bf16 = avx512_f32_to_bf16, .softmax = avx512_softmax,         \
        .gelu_tanh = avx512_gelu_tanh, .gemm_mr = GEMM_MR, .gemm_nr = GEMM_NR, .gemm_tile = avx512_gemm_tile, \
        .gemm_tile_bf16 = GEMM_TILE_BF16                                                                     \
    }

const kvl_kernels kvl_kernels_avx512_table =
    AVX512_TABLE("avx512", 0, driver_matmul_bf16_xb, driver_matmul_q8_xb, avx512_matmul_q4_xb, NULL);
const kvl_kernels kvl_kernels_avx512_bf16_table =
    AVX512_TABLE("avx512-bf16", 1, avx512bf16_matmul_bf16_xb, avx512bf16_matmul_q8_xb, avx512bf16_matmul_q4_xb,
                 avx512bf16_gemm_tile_bf16);
