/* kernels_ref.c — scalar reference of every kvl_kernels entry and the scalar helpers.
 *
 * Owns: the "scalar" dispatch table (the one numeric reference every SIMD table is tested
 * against), BF16 <-> FP32 conversion with round-to-nearest-even, rmsnorm / layernorm / silu_mul
 * / gelu / softmax.
 * Does not own: SIMD variants (kernels_avx2.c, kernels_avx512.c, kernels_simd128.c), CPU
 * detection and table
 * selection (kernels_select.c), threading (callers split rows).
 *
 * Written to be obviously right rather than fast: plain loops, FP32 accumulation in index order.
 */
#include "kernels.h"

#include <math.h>
#include <string.h>

/* ---- BF16 <-> FP32 --------------------------------------------------------------------- */

float kvl_bf16_to_float(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t kvl_float_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        /* NaN: keep sign and top payload bits, force the quiet bit so truncation can never
         * turn a NaN into an infinity. */
        return (uint16_t)((bits >> 16) | 0x0040u);
    }
    /* Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
     * Overflow of the largest finite values correctly carries into infinity. */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

float kvl_bf16_round(float x)
{
    return kvl_bf16_to_float(kvl_float_to_bf16(x));
}

float kvl_bf16_round_daz(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) == 0) {
        bits &= 0x80000000u;
        memcpy(&x, &bits, sizeof x);
        return x;
    }
    return kvl_bf16_round(x);
}

static void ref_bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = kvl_bf16_to_float(src[i]);
}

static void ref_q8_to_f32(float *dst, const int8_t *src, float scale, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (float)src[i] * scale;
}

static void ref_f32_to_bf16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = kvl_float_to_bf16(src[i]);
}

/* ---- matrix products ------------------------------------------------------------------- */

/* xb = 1: activations rounded to BF16 first (the *_xb entries). */
static void ref_bf16_rows(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                          const float *X, size_t ldx, size_t n, int xb)
{
    for (size_t t = 0; t < n; t++) {
        const float *x = X + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            const uint16_t *w = W + r * cols;
            float acc = 0.0f;
            for (size_t c = 0; c < cols; c++)
                acc += kvl_bf16_to_float(w[c]) * (xb ? kvl_bf16_round_daz(x[c]) : x[c]);
            Y[t * ldy + r] = acc;
        }
    }
}

static void ref_q8_rows(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                        size_t cols, const float *X, size_t ldx, size_t n, int xb)
{
    for (size_t t = 0; t < n; t++) {
        const float *x = X + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            const int8_t *w = W + r * cols;
            float acc = 0.0f;
            for (size_t c = 0; c < cols; c++)
                acc += (float)w[c] * (xb ? kvl_bf16_round_daz(x[c]) : x[c]);
            /* The row scale is common to every term, so it is applied once at the end. */
            Y[t * ldy + r] = acc * scale[r];
        }
    }
}

static void ref_matmul_bf16(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                            const float *X, size_t ldx, size_t n)
{
    ref_bf16_rows(Y, ldy, W, rows, cols, X, ldx, n, 0);
}

static void ref_matmul_q8(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                          size_t cols, const float *X, size_t ldx, size_t n)
{
    ref_q8_rows(Y, ldy, W, scale, rows, cols, X, ldx, n, 0);
}

static void ref_matmul_bf16_xb(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                               const float *X, size_t ldx, size_t n)
{
    ref_bf16_rows(Y, ldy, W, rows, cols, X, ldx, n, 1);
}

static void ref_matmul_q8_xb(float *Y, size_t ldy, const int8_t *W, const float *scale,
                             size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    ref_q8_rows(Y, ldy, W, scale, rows, cols, X, ldx, n, 1);
}

static void ref_matmul_f32(float *Y, size_t ldy, const float *W, size_t rows, size_t cols,
                           const float *X, size_t ldx, size_t n)
{
    for (size_t t = 0; t < n; t++) {
        const float *x = X + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            const float *w = W + r * cols;
            float acc = 0.0f;
            for (size_t c = 0; c < cols; c++)
                acc += w[c] * x[c];
            Y[t * ldy + r] = acc;
        }
    }
}

/* ---- integer mode: 15-bit activations ---------------------------------------------------- */

/* rint in the default mode (half to even), then the clamp; a NaN product (a NaN or infinite
 * input, or inv = inf for amax below ~5e-35) gives 0 in every table. */
int16_t kvl_i16_round_clamp(float v, float lim)
{
    v = rintf(v);
    if (v != v)
        return 0;
    if (v > lim)
        v = lim;
    if (v < -lim)
        v = -lim;
    return (int16_t)v;
}

static void ref_quantize_i16_act(int16_t *Xq, float *xs, const float *X, size_t cols, size_t n,
                                 size_t ldx_in, size_t ldx_out, size_t block, int lim)
{
    const size_t nb = kvl_i16_nblocks(cols, block);
    for (size_t t = 0; t < n; t++) {
        const float *x = X + t * ldx_in;
        int16_t *q = Xq + t * ldx_out;
        for (size_t b = 0; b < nb; b++) {
            const size_t c0 = b * block, c1 = cols - c0 < block ? cols : c0 + block;
            float amax = 0.0f;
            for (size_t c = c0; c < c1; c++) {
                float a = fabsf(x[c]);
                if (a > amax) /* NaN never compares greater: ignored, as by every SIMD max */
                    amax = a;
            }
            /* One division for the inverse so every SIMD variant reproduces the exact same
             * products (and therefore the exact same integers). */
            float inv = amax > 0.0f ? (float)lim / amax : 0.0f;
            xs[t * nb + b] = amax / (float)lim;
            for (size_t c = c0; c < c1; c++)
                q[c] = kvl_i16_round_clamp(x[c] * inv, (float)lim);
        }
    }
}

static void ref_matmul_q8_i16(float *Y, size_t ldy, const int8_t *W, const float *scale,
                              size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                              size_t ldx, size_t n)
{
    const size_t nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    for (size_t t = 0; t < n; t++) {
        const int16_t *x = Xq + t * ldx;
        const float *xst = xs + t * nb;
        for (size_t r = 0; r < rows; r++) {
            const int8_t *w = W + r * cols;
            float acc = 0.0f;
            for (size_t b = 0; b < nb; b++) {
                const size_t c0 = b * KVL_I16_BLOCK;
                const size_t c1 = cols - c0 < KVL_I16_BLOCK ? cols : c0 + KVL_I16_BLOCK;
                int32_t isum = 0; /* exact: 64 * 127 * 32767 < 2^31 */
                for (size_t c = c0; c < c1; c++)
                    isum += (int32_t)w[c] * (int32_t)x[c];
                /* two statements: no compiler may fuse them into one FMA (every table rounds
                 * the product, then the sum) */
                const float p = (float)isum * xst[b];
                acc += p;
            }
            Y[t * ldy + r] = acc * scale[r];
        }
    }
}

float kvl_i16_group_sum(const int16_t *w, const int16_t *x, size_t c, size_t cols, float acc)
{
    for (; c < cols; c += 4) {
        size_t e = cols - c < 4 ? cols : c + 4;
        int32_t isum = 0; /* exact: 4 * 32767 * 16383 < 2^31 */
        for (size_t k = c; k < e; k++)
            isum += (int32_t)w[k] * (int32_t)x[k];
        acc += (float)isum;
    }
    return acc;
}

static void ref_matmul_i16_i16(float *Y, size_t ldy, const int16_t *W, const float *scale,
                               size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                               size_t ldx, size_t n)
{
    for (size_t t = 0; t < n; t++) {
        const int16_t *x = Xq + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            const int16_t *w = W + r * cols;
            float acc = kvl_i16_group_sum(w, x, 0, cols, 0.0f);
            Y[t * ldy + r] = (acc * scale[r]) * xs[t];
        }
    }
}

/* ---- Q4 weights (kernels.h) -------------------------------------------------------------- */

/* q - 8 of column j (0..31) of a group's 16 bytes g: low nibbles hold columns 0..15, high 16..31 */
static int q4_at(const uint8_t *g, size_t j)
{
    return (int)(j < 16 ? g[j] & 15u : g[j - 16] >> 4) - 8;
}

static void ref_q4_rows(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                        size_t cols, const float *X, size_t ldx, size_t n, int xb)
{
    const size_t ng = cols / 32;
    for (size_t t = 0; t < n; t++) {
        const float *x = X + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            const uint8_t *w = W + r * (cols / 2);
            float acc = 0.0f;
            for (size_t g = 0; g < ng; g++) {
                /* the group's q * x in FP32, column order; its scale applied once to the sum */
                float gsum = 0.0f;
                for (size_t j = 0; j < 32; j++) {
                    const float xv = xb ? kvl_bf16_round_daz(x[32 * g + j]) : x[32 * g + j];
                    gsum += (float)q4_at(w + 16 * g, j) * xv;
                }
                acc += gsum * kvl_bf16_to_float(S[r * ng + g]);
            }
            Y[t * ldy + r] = acc;
        }
    }
}

static void ref_matmul_q4(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                          size_t cols, const float *X, size_t ldx, size_t n)
{
    ref_q4_rows(Y, ldy, W, S, rows, cols, X, ldx, n, 0);
}

static void ref_matmul_q4_xb(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                             size_t cols, const float *X, size_t ldx, size_t n)
{
    ref_q4_rows(Y, ldy, W, S, rows, cols, X, ldx, n, 1);
}

/* matmul_q4_i16 and matmul_q4_i8 (the same exact sums): kernels.h's arithmetic, statement by
 * statement (separate statements: no compiler may fuse a product into the following sum). */
static void ref_matmul_q4_i16(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                              size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    const size_t ng = cols / 32, nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    for (size_t t = 0; t < n; t++) {
        const int16_t *x = Xq + t * ldx;
        const float *xst = xs + t * nb;
        for (size_t r = 0; r < rows; r++) {
            const uint8_t *w = W + r * (cols / 2);
            const uint16_t *s = S + r * ng;
            float acc = 0.0f;
            for (size_t b = 0; b < nb; b++) {
                const size_t g0 = 2 * b;
                int32_t s0 = 0, s1 = 0; /* exact: 32 * 8 * 32767 < 2^31 */
                for (size_t j = 0; j < 32; j++)
                    s0 += (int32_t)q4_at(w + 16 * g0, j) * (int32_t)x[32 * g0 + j];
                float p = (float)s0 * kvl_bf16_to_float(s[g0]);
                if (g0 + 1 < ng) {
                    for (size_t j = 0; j < 32; j++)
                        s1 += (int32_t)q4_at(w + 16 * (g0 + 1), j) * (int32_t)x[32 * (g0 + 1) + j];
                    const float p1 = (float)s1 * kvl_bf16_to_float(s[g0 + 1]);
                    p = p + p1;
                }
                const float q = p * xst[b];
                acc = acc + q;
            }
            Y[t * ldy + r] = acc;
        }
    }
}

void kvl_quantize_rows_i16(int16_t *Wq, float *scale, const uint16_t *W, size_t rows, size_t cols)
{
    for (size_t r = 0; r < rows; r++) {
        const uint16_t *w = W + r * cols;
        int16_t *q = Wq + r * cols;
        float rmax = 0.0f;
        for (size_t c = 0; c < cols; c++) {
            float a = fabsf(kvl_bf16_to_float(w[c]));
            if (a > rmax)
                rmax = a;
        }
        float inv = rmax > 0.0f ? 32767.0f / rmax : 0.0f;
        scale[r] = rmax / 32767.0f;
        for (size_t c = 0; c < cols; c++)
            q[c] = kvl_i16_round_clamp(kvl_bf16_to_float(w[c]) * inv, 32767.0f);
    }
}

/* ---- vector ops ------------------------------------------------------------------------ */

static float ref_dot_f32(const float *a, const float *b, size_t n)
{
    float acc = 0.0f;
    for (size_t i = 0; i < n; i++)
        acc += a[i] * b[i];
    return acc;
}

static void ref_axpy_f32(float *y, float a, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] += a * x[i];
}

static void ref_axpy_rows_f32(float *Y, size_t ldy, const float *A, size_t lda, size_t nh,
                              const float *X, size_t ldx, size_t np, size_t cols)
{
    for (size_t h = 0; h < nh; h++)
        for (size_t p = 0; p < np; p++)
            ref_axpy_f32(Y + h * ldy, A[h * lda + p], X + p * ldx, cols);
}

/* gemm_tile (kernels.h) on 4 tokens x 4 outputs: per output one FP32 sum in k order (product
 * rounded, then added), added to C at the end. */
static void ref_gemm_tile(size_t kc, const float *A, const float *B, float *C, size_t ldc,
                          int accumulate)
{
    for (size_t i = 0; i < 4; i++)
        for (size_t j = 0; j < 4; j++) {
            float acc = 0.0f;
            for (size_t k = 0; k < kc; k++)
                acc += A[k * 4 + i] * B[k * 4 + j];
            C[i * ldc + j] = accumulate ? C[i * ldc + j] + acc : acc;
        }
}

uint16_t kvl_bf16_bits_daz(float x)
{
    const float r = kvl_bf16_round_daz(x);
    uint32_t bits;
    memcpy(&bits, &r, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/* one BF16 half of a pair as VDPBF16PS reads it: subnormals as (signed) zero */
static float pair_half_daz(uint32_t pair, int high)
{
    uint32_t bits = (high ? pair >> 16 : pair & 0xffffu) << 16;
    float f;
    if ((bits & 0x7f800000u) == 0)
        bits &= 0x80000000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* acc + a*b in one rounding, a subnormal result flushed to zero of its sign (VDPBF16PS) */
static float fma_ftz(float a, float b, float acc)
{
    const float r = kvl_fmaf_once(a, b, acc);
    return fabsf(r) < 1.17549435e-38f ? copysignf(0.0f, r) : r;
}

/* gemm_tile_bf16 (kernels.h) on 4 tokens x 4 outputs: the definition, VDPBF16PS's order and
 * flushing emulated one output at a time. */
static void ref_gemm_tile_bf16(size_t kp, const uint32_t *A, const uint32_t *B, float *C,
                               size_t ldc, int accumulate)
{
    for (size_t i = 0; i < 4; i++)
        for (size_t j = 0; j < 4; j++) {
            float acc = 0.0f;
            for (size_t q = 0; q < kp; q++) {
                const uint32_t a = A[q * 4 + i], b = B[q * 4 + j];
                acc = fma_ftz(pair_half_daz(a, 1), pair_half_daz(b, 1), acc);
                acc = fma_ftz(pair_half_daz(a, 0), pair_half_daz(b, 0), acc);
            }
            C[i * ldc + j] = accumulate ? C[i * ldc + j] + acc : acc;
        }
}

const kvl_kernels kvl_kernels_scalar_table = {
    "scalar",
    0,
    ref_matmul_bf16,
    ref_matmul_q8,
    ref_matmul_f32,
    ref_matmul_bf16_xb,
    ref_matmul_q8_xb,
    ref_quantize_i16_act,
    ref_matmul_q8_i16,
    ref_matmul_q8_i16, /* matmul_q8_i8: the same exact sums (kernels.h) */
    ref_matmul_i16_i16,
    ref_matmul_q4,
    ref_matmul_q4_xb,
    ref_matmul_q4_i16,
    ref_matmul_q4_i16, /* matmul_q4_i8: the same exact sums (kernels.h) */
    ref_dot_f32,
    ref_axpy_f32,
    ref_axpy_rows_f32,
    ref_bf16_to_f32,
    ref_q8_to_f32,
    ref_f32_to_bf16,
    kvl_softmax,
    kvl_gelu_tanh,
    4, 4, ref_gemm_tile,
    /* the BF16 tile's definition, for the conformance report: bf16_dot is 0, so
     * kvl_gemm_bf16_xb runs ref_gemm_tile on FP32 panels here */
    ref_gemm_tile_bf16,
};

/* ---- scalar helpers -------------------------------------------------------------------- */

void kvl_rmsnorm(float *y, const float *x, const float *w, size_t n, float eps)
{
    if (n == 0)
        return;
    /* Sum of squares in double: the norm of a few thousand values then matches a correctly
     * rounded reference to the last FP32 bit, at negligible cost. */
    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)x[i] * (double)x[i];
    float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (size_t i = 0; i < n; i++)
        y[i] = (x[i] * inv) * (w ? w[i] : 1.0f);
}

void kvl_layernorm(float *y, const float *x, const float *w, const float *b, size_t n, float eps)
{
    if (n == 0)
        return;
    double sum = 0.0;
    for (size_t i = 0; i < n; i++)
        sum += x[i];
    double mean = sum / (double)n;
    double var = 0.0; /* two-pass variance: no cancellation for large means */
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - mean;
        var += d * d;
    }
    var /= (double)n;
    float inv = (float)(1.0 / sqrt(var + (double)eps));
    float meanf = (float)mean;
    for (size_t i = 0; i < n; i++) {
        float v = (x[i] - meanf) * inv;
        y[i] = v * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
}

void kvl_silu_mul(float *gate_inout, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float g = gate_inout[i];
        gate_inout[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void kvl_gelu_tanh(float *x, size_t n)
{
    const float k = 0.7978845608028654f; /* sqrt(2/pi) */
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
    }
}

void kvl_gelu_erf(float *x, size_t n)
{
    const float inv_sqrt2 = 0.7071067811865476f;
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        x[i] = 0.5f * v * (1.0f + erff(v * inv_sqrt2));
    }
}

void kvl_softmax(float *x, size_t n)
{
    if (n == 0)
        return;
    float mx = x[0];
    for (size_t i = 1; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    if (mx == -INFINITY) {
        /* Every entry masked: a uniform distribution is the only finite answer. */
        for (size_t i = 0; i < n; i++)
            x[i] = 1.0f / (float)n;
        return;
    }
    float sum = 0.0f;
    for (size_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx); /* max-subtracted: every exponent <= 0, no overflow */
        sum += x[i];
    }
    float inv = 1.0f / sum;
    for (size_t i = 0; i < n; i++)
        x[i] *= inv;
}
