/* kernels.h — numeric kernels of the kvl core, one dispatch table per instruction set.
 *
 * Owns: matrix products over BF16 / row-wise Q8 / FP32 weights and the small vector ops.
 * Does not own: threading (callers split rows across the pool and call a kernel on a row
 * range), files, memory management.
 *
 * Every table entry has a scalar reference (kernels_ref.c); the AVX2 and AVX-512 tables
 * (kernels_avx2.c, kernels_avx512.c) must agree with it within float rounding and each has a
 * scalar tail for sizes that are not multiples of the vector width. Layouts:
 *   W row-major [rows, cols]; X row-major [n, ldx] (n activation vectors);
 *   Y[t*ldy + r] = sum_c W[r, c] * X[t*ldx + c]   for t < n, r < rows.
 */
#ifndef KVL_KERNELS_H
#define KVL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvl_kernels {
    const char *name; /* "scalar", "avx2", "avx512", "avx512-bf16" */
    int bf16_dot;     /* 1 if the *_xb entries run on BF16 dot-product instructions */

    /* BF16 weights (raw uint16 bits), FP32 activations, FP32 accumulate. */
    void (*matmul_bf16)(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                        const float *X, size_t ldx, size_t n);
    /* Row-wise Q8 weights: value = W[r,c] * scale[r]; FP32 activations (exact vs dequantized). */
    void (*matmul_q8)(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                      size_t cols, const float *X, size_t ldx, size_t n);
    /* FP32 weights. */
    void (*matmul_f32)(float *Y, size_t ldy, const float *W, size_t rows, size_t cols,
                       const float *X, size_t ldx, size_t n);
    /* The same products with every activation first rounded to BF16 (kvl_bf16_round_daz:
     * nearest-even, subnormal inputs as zero), i.e. the checkpoint's own BF16 inputs to every
     * Linear, with FP32 products and accumulation. On CPUs with AVX512_BF16 these run on
     * VDPBF16PS, two multiply-adds per FP32 lane and instruction. */
    void (*matmul_bf16_xb)(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                           const float *X, size_t ldx, size_t n);
    void (*matmul_q8_xb)(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                         size_t cols, const float *X, size_t ldx, size_t n);

    /* Opt-in fast path (not the default: it changes results by activation rounding):
     * activations quantised per block of 32 values (scale = max|x|/127 per block, round half
     * even), int8 x int8 dot products (VNNI on AVX-512), weight scale per row.
     * Xq/xs layout: vector t has cols int8 at Xq + t*ldx and cols/32 scales at xs + t*(ldx/32);
     * cols and ldx are multiples of 32. */
    void (*quantize_q8_act)(int8_t *Xq, float *xs, const float *X, size_t cols, size_t n,
                            size_t ldx_in, size_t ldx_out);
    void (*matmul_q8_q8)(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                         size_t cols, const int8_t *Xq, const float *xs, size_t ldx, size_t n);

    float (*dot_f32)(const float *a, const float *b, size_t n);
    void (*axpy_f32)(float *y, float a, const float *x, size_t n);       /* y += a*x */
    void (*bf16_to_f32)(float *dst, const uint16_t *src, size_t n);
    void (*f32_to_bf16)(uint16_t *dst, const float *src, size_t n);      /* round to nearest even */
    /* In place, the same functions as kvl_softmax and kvl_gelu_tanh (their references) with a
     * vectorised exp; agree with them to a few ulp. */
    void (*softmax)(float *x, size_t n);
    void (*gelu_tanh)(float *x, size_t n);
} kvl_kernels;

/* level: 0 = best supported, 1 scalar, 2 avx2, 3 avx512. Returns NULL if the CPU (or the build)
 * does not support the requested level. */
const kvl_kernels *kvl_kernels_select(int level);
/* 1 if the running CPU supports the level (and it was compiled in). */
int kvl_kernels_supported(int level);

/* AVX-512 without the BF16 dot products, the level-3 table on CPUs that lack AVX512_BF16
 * (exposed so the tests cover it on every AVX-512 machine). */
extern const kvl_kernels kvl_kernels_avx512_table;

/* Scalar helpers that are never hot enough to vectorise (still the one reference for each). */
void kvl_rmsnorm(float *y, const float *x, const float *w, size_t n, float eps);
void kvl_layernorm(float *y, const float *x, const float *w, const float *b, size_t n, float eps);
void kvl_silu_mul(float *gate_inout, const float *up, size_t n);   /* g = silu(g) * up */
void kvl_gelu_tanh(float *x, size_t n);
void kvl_gelu_erf(float *x, size_t n);
void kvl_softmax(float *x, size_t n);                               /* in place, FP32 */
float kvl_bf16_round(float x);                                      /* round-trip through BF16 */
/* kvl_bf16_round with subnormal inputs read as (signed) zero, as VCVTNE2PS2BF16 does. */
float kvl_bf16_round_daz(float x);
/* Single-value BF16 conversions (same rounding as the table entries; NaN stays a quiet NaN). */
float kvl_bf16_to_float(uint16_t h);
uint16_t kvl_float_to_bf16(float f);

#endif
