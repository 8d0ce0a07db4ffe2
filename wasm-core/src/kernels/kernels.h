/* kernels.h — numeric kernels of the kvl core, one dispatch table per instruction set.
 *
 * Owns: matrix products over BF16 / row-wise Q8 / FP32 weights and the small vector ops.
 * Does not own: threading (callers split rows across the pool and call a kernel on a row
 * range), files, memory management.
 *
 * Every table entry has a scalar reference (kernels_ref.c); the AVX2, AVX-512 and SIMD128 tables
 * (x86/kernels_avx2.c, x86/kernels_avx512.c, wasm/kernels_simd128.c; its relaxed-SIMD variant takes
 * one pass from wasm/kernels_relaxed.c) must agree with it within float rounding
 * (bit for bit where an entry says so) and each handles sizes that are not multiples of the
 * vector width (scalar tail or masked loads). Layouts:
 *   W row-major [rows, cols]; X row-major [n, ldx] (n activation vectors);
 *   Y[t*ldy + r] = sum_c W[r, c] * X[t*ldx + c]   for t < n, r < rows.
 */
#ifndef KVL_KERNELS_H
#define KVL_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct kvl_kernels {
    const char *name; /* "scalar", "simd128", "simd128-relaxed", "avx2", "avx512", "avx512-bf16"
                         (at most 15 characters: kvl_engine_info.kernels) */
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

    /* Integer mode (opt-in; WebAssembly's fast decode path, where i32x4.dot_i16x8_s runs at
     * native speed while widening to FP32 is ~5x slower): activations quantised to integers
     * with one FP32 scale per block of columns, weights integer with one FP32 scale per row.
     * quantize_i16_act, per vector t (cols values at X + t*ldx_in) and per block b of `block`
     * columns (the last one may be shorter; nb = kvl_i16_nblocks(cols, block) blocks):
     *   amax = max|x| over the block; inv = amax > 0 ? lim / amax : 0 (one FP32 division);
     *   xs[t*nb + b] = amax / lim; Xq[t*ldx_out + c] = clamp(rint(x[c] * inv), -lim, lim)
     *   (rint in the default mode: half to even; a NaN product, i.e. a non-finite input or
     *   amax below ~5e-35 where inv overflows, gives 0). Every table gives bit-identical Xq and xs.
     * The engine uses block = KVL_I16_BLOCK, lim = KVL_I16_Q8_MAX for matmul_q8_i16 and
     * block = cols, lim = KVL_I16_MAX for matmul_i16_i16. */
    void (*quantize_i16_act)(int16_t *Xq, float *xs, const float *X, size_t cols, size_t n,
                             size_t ldx_in, size_t ldx_out, size_t block, int lim);
    /* Row-wise Q8 weights (|W| <= 127) x activations quantised per KVL_I16_BLOCK columns
     * (|x| <= KVL_I16_Q8_MAX, scales xs [n, nb]). Each block's int32 sum of products is exact
     * (64*127*32767 < 2^31); then, in block order, acc += (float)sum * xs[t*nb + b] (the product
     * rounded, then the sum: never fused); Y = acc * scale[r]. So every table gives
     * bit-identical results. */
    void (*matmul_q8_i16)(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                          size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n);
    /* The same product with 8-bit activations (|x| <= KVL_I8_MAX, quantize_i16_act with that
     * lim, still stored as int16): bit-identical to matmul_q8_i16 on the same input, since every
     * block sum is exact either way. What the bound buys is an 8-bit dot product, where the ISA
     * has one: AVX2 VPMADDUBSW (|x| as u8 times w with x's sign; pairs <= 2*127*127, no
     * saturation) and AVX-512 VNNI VPDPBUSD, four products per int32 lane, and relaxed SIMD's
     * i16x8.relaxed_dot_i8x16_i7x16_s (simd128-relaxed), in decoding (n == 1); other n and plain
     * SIMD128 (no 8-bit dot product) run matmul_q8_i16. */
    void (*matmul_q8_i8)(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                         size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n);
    /* Row-wise int16 weights (|W| <= 32767, kvl_quantize_rows_i16) x 15-bit activations: same
     * bytes as BF16 but an integer dot product. A group of 4 products is exact in int32
     * (4*32767*16383 < 2^31); group sums are added in FP32 in any order (SIMD lanes), so
     * tables agree within FP32 summation error; Y = (acc * scale[r]) * xs[t] (one scale per
     * vector: quantize_i16_act with block = cols). */
    void (*matmul_i16_i16)(float *Y, size_t ldy, const int16_t *W, const float *scale,
                           size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                           size_t ldx, size_t n);

    /* Q4 weights (routed experts, dtype Q4_EXPERT): W = the q bytes [rows, cols/2] (row stride
     * cols/2 bytes), S = BF16 scale bits [rows, cols/32], cols % 32 == 0. In group g (columns
     * 32g .. 32g+31) of row r, byte j (0..15) at W[r*cols/2 + 16g + j] holds column 32g+j in its
     * low nibble and column 32g+16+j in its high one; value(r, c) = (nibble - 8) * bf16(S[r*cols/32
     * + c/32]) (exact in FP32). matmul_q4: FP32 activations; matmul_q4_xb: activations first
     * rounded to BF16 (kvl_bf16_round_daz), as matmul_q8_xb. Both agree with the reference
     * (which sums, per group, q * x in FP32 in column order, then adds that sum times the group's
     * scale to the row's FP32 accumulator) within FP32 rounding. */
    void (*matmul_q4)(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                      size_t cols, const float *X, size_t ldx, size_t n);
    void (*matmul_q4_xb)(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                         size_t cols, const float *X, size_t ldx, size_t n);
    /* Q4 weights x activations quantised per KVL_I16_BLOCK columns (quantize_i16_act with
     * lim = KVL_I16_Q8_MAX, scales xs [n, nb]). Activation block b covers weight groups 2b and
     * 2b+1 (only 2b when it is the last block and cols % 64 == 32); per vector t and row r:
     *   s0, s1 = the int32 sums of q*x over groups 2b, 2b+1 (exact: 32*8*32767 < 2^31; s1 = 0
     *            and no term when group 2b+1 does not exist);
     *   p = (float)s0 * ds[2b]; p = p + (float)s1 * ds[2b+1];  (each product rounded, then the
     *   sum: never fused); acc = acc + p * xs[t*nb + b], blocks in ascending order from 0.0f;
     *   Y[t*ldy + r] = acc.
     * So every table gives bit-identical results. */
    void (*matmul_q4_i16)(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                          size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n);
    /* The same product with 8-bit activations (|x| <= KVL_I8_MAX): bit-identical to
     * matmul_q4_i16 on the same input (every group sum is exact either way); the bound lets the
     * products use 8-bit dot products (AVX2 VPMADDUBSW, AVX-512 VNNI VPDPBUSD, relaxed SIMD's
     * i16x8.relaxed_dot_i8x16_i7x16_s with q - 8 in [-8, 7] as the 7-bit operand). */
    void (*matmul_q4_i8)(float *Y, size_t ldy, const uint8_t *W, const uint16_t *S, size_t rows,
                         size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n);

    float (*dot_f32)(const float *a, const float *b, size_t n);
    void (*axpy_f32)(float *y, float a, const float *x, size_t n);       /* y += a*x */
    /* For h < nh: Y[h*ldy ..] += A[h*lda + p] * X[p*ldx ..] over cols columns, for p = 0..np-1
     * in that order: the np axpy_f32 calls per h, bit for bit (the same operation on every
     * element, in the same order), with Y kept in registers across p and each X row loaded once
     * for a tile of h. Attention's context sum (probabilities x cached latents). */
    void (*axpy_rows_f32)(float *Y, size_t ldy, const float *A, size_t lda, size_t nh,
                          const float *X, size_t ldx, size_t np, size_t cols);
    void (*bf16_to_f32)(float *dst, const uint16_t *src, size_t n);
    /* dst[i] = (float)src[i] * scale: a Q8 row dequantised (one rounding, so every table gives the
     * same bits). Attention's query absorption on a Q8 kv_b_proj. */
    void (*q8_to_f32)(float *dst, const int8_t *src, float scale, size_t n);
    void (*f32_to_bf16)(uint16_t *dst, const float *src, size_t n);      /* round to nearest even */
    /* In place, the same functions as kvl_softmax and kvl_gelu_tanh (their references) with a
     * vectorised exp; agree with them to a few ulp. */
    void (*softmax)(float *x, size_t n);
    void (*gelu_tanh)(float *x, size_t n);

    /* The register tile of the blocked GEMM (kernels_gemm.c, the vision tower's products):
     * C[i*ldc + j] = (accumulate ? C[i*ldc + j] : 0) + sum_{k < kc} A[k*gemm_mr + i] * B[k*gemm_nr + j]
     * for i < gemm_mr tokens, j < gemm_nr outputs, from packed panels (A: kc x mr, B: kc x nr,
     * FP32). The sum over k runs in k order in one FP32 accumulator per output (fused multiply-add
     * where the ISA has it, else a rounded product then the add) and is added to C once at the
     * end, so every set computes the same order and differs only by fusing. gemm_nr is a whole
     * number of the ISA's vectors; gemm_mr * gemm_nr accumulators fill its register file. */
    int gemm_mr, gemm_nr;
    void (*gemm_tile)(size_t kc, const float *A, const float *B, float *C, size_t ldc,
                      int accumulate);
    /* The same tile on BF16 pairs (kvl_gemm_bf16_xb, vision attention in BF16 mode): A and B
     * panels of kp column pairs, A[q*gemm_mr + i] and B[q*gemm_nr + j] each holding columns 2q
     * (low 16 bits) and 2q+1 (high 16 bits) as BF16; per output, for q = 0 .. kp-1 in order,
     *   acc = acc + a(2q+1) * b(2q+1);  acc = acc + a(2q) * b(2q)
     * from acc = 0 (each product exact in FP32, each add rounded to nearest even), added to C
     * once at the end: VDPBF16PS's order (Intel SDM: the odd pair first, then the even one).
     * VDPBF16PS also reads subnormal inputs and partial sums as zero and flushes subnormal
     * results: the reference does the same, so tables agree bit for bit. NULL where the set has
     * no BF16 dot product (bf16_dot == 0): kvl_gemm_bf16_xb then feeds gemm_tile FP32 panels in
     * that order, the same bits except where a partial sum or product is below 2^-126. */
    void (*gemm_tile_bf16)(size_t kp, const uint32_t *A, const uint32_t *B, float *C, size_t ldc,
                           int accumulate);
} kvl_kernels;

/* Every function entry of kvl_kernels, in table order: X(entry). A set may leave any of them
 * NULL (a new set starts with its hot entries only): kvl_kernels_select / kvl_kernels_by_name
 * hand out the set with each empty entry taken from the scalar table (filled once, at the first
 * selection), and kvl_kernels_conformance checks every entry of every set so served.
 * (gemm_tile comes with its gemm_mr, gemm_nr: a set that leaves it NULL gets the scalar three.) */
#define KVL_KERNEL_ENTRIES(X)                                                                      \
    X(matmul_bf16) X(matmul_q8) X(matmul_f32) X(matmul_bf16_xb) X(matmul_q8_xb)                    \
    X(quantize_i16_act) X(matmul_q8_i16) X(matmul_q8_i8) X(matmul_i16_i16) X(matmul_q4)            \
    X(matmul_q4_xb) X(matmul_q4_i16) X(matmul_q4_i8) X(dot_f32) X(axpy_f32) X(axpy_rows_f32)       \
    X(bf16_to_f32) X(q8_to_f32) X(f32_to_bf16) X(softmax) X(gelu_tanh) X(gemm_tile)

/* ---- blocked GEMM (kernels_gemm.c) -------------------------------------------------------
 * Goto-style blocking over a table's gemm_tile: weights packed KVL_GEMM_KC columns x
 * KVL_GEMM_NC rows at a time into FP32 panels of gemm_nr rows (once per call, reused by every
 * token), activations KVL_GEMM_MC tokens x KVL_GEMM_KC columns at a time into panels of gemm_mr
 * tokens (reused by every row panel); tiles at the edges run on zero-padded panels into a small
 * buffer. Each output is the sum of its KVL_GEMM_KC-column chunks, each chunk summed in column
 * order (gemm_tile): within (min(cols, KC) + ceil(cols / KC)) * u * sum|w x| of the exact sum,
 * and the same on every thread split and token count. */
#define KVL_GEMM_KC 128
#define KVL_GEMM_NC 1536 /* a multiple of every gemm_nr (4, 8, 16, 32) */
#define KVL_GEMM_MC 96  /* a multiple of every gemm_mr (4, 6, 12) */
#define KVL_GEMM_MAX_TILE 512 /* gemm_mr * gemm_nr of every table */
/* floats of the work buffer kvl_gemm_bf16 needs, per calling thread (64-byte aligned) */
#define KVL_GEMM_WORK_FLOATS_TILES \
    ((size_t)KVL_GEMM_KC * KVL_GEMM_NC + (size_t)KVL_GEMM_MC * KVL_GEMM_KC + KVL_GEMM_MAX_TILE)
/* kvl_gemm_bf16_amx's blocks: 512 outputs x 1536 columns of weight pairs, 32 tokens x 1536
 * columns of activations, one 32 x 32 edge tile (kernels_gemm.c) */
#define KVL_GEMM_WORK_FLOATS_AMX ((size_t)512 * 768 + (size_t)32 * 768 + 1024)
#define KVL_GEMM_WORK_FLOATS \
    (KVL_GEMM_WORK_FLOATS_TILES > KVL_GEMM_WORK_FLOATS_AMX ? KVL_GEMM_WORK_FLOATS_TILES \
                                                           : KVL_GEMM_WORK_FLOATS_AMX)
/* Y[t*ldy + r] = sum_c bf16(W[r, c]) * X[t*ldx + c], as matmul_bf16 (kernels.h layouts), on
 * k's gemm_tile; work: KVL_GEMM_WORK_FLOATS floats of the caller's. */
void kvl_gemm_bf16(const kvl_kernels *k, float *Y, size_t ldy, const uint16_t *W, size_t rows,
                   size_t cols, const float *X, size_t ldx, size_t n, float *work);
/* BF16 products (the vision tower's default where the CPU has AVX512_BF16): every activation
 * first rounded to BF16 (kvl_bf16_round_daz), each output the sum of KVL_GEMM_KC-column chunks,
 * a chunk summed as gemm_tile_bf16 does (pairs of columns, the odd one first, FP32 adds of exact
 * products) and added to Y (the first chunk stored): bit-identical on every table and thread
 * split (conformance gemm_bf16_xb), within (min(cols, KC) + chunks) * u * sum|w x| of the exact
 * sum of the rounded inputs. On tables with gemm_tile_bf16 it runs on it (two multiply-adds per
 * FP32 lane and instruction); elsewhere on gemm_tile over FP32 panels in that order, no faster
 * than kvl_gemm_bf16. Same work buffer. */
void kvl_gemm_bf16_xb(const kvl_kernels *k, float *Y, size_t ldy, const uint16_t *W, size_t rows,
                      size_t cols, const float *X, size_t ldx, size_t n, float *work);
/* The same BF16 products on AMX tiles (TDPBF16PS; Linux x86-64 with AMX-BF16, the tile state
 * granted by the kernel, and KVL_NO_AMX unset or 0: kvl_gemm_amx_available). The inputs are
 * kvl_gemm_bf16_xb's (BF16 weights, activations rounded by kvl_bf16_round_daz), but the tile's
 * accumulation order is the hardware's: within (cols + 16) * u * sum|w x| of the exact sum
 * of those inputs (conformance gemm_bf16_amx): chunks of 1536 columns accumulate into the
 * outputs in order. Work: KVL_GEMM_WORK_FLOATS floats. Returns 0, or -1 (nothing written) where
 * AMX is not available. */
int kvl_gemm_amx_available(void);
int kvl_gemm_bf16_amx(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                      const float *X, size_t ldx, size_t n, float *work);
/* Attention of one head on AMX tiles (the vision tower's in BF16 mode; same availability as
 * kvl_gemm_bf16_amx): out[t*ldo + d] = sum_s P[t,s] v[s,d] / L[t] for t < nq <= KVL_ATTN_AMX_QUERIES
 * queries Q[t*ldq + d] and len >= 1 keys/values, d < hd <= KVL_ATTN_AMX_MAX_HD. Q, K and V are rounded
 * to BF16 (kvl_bf16_round_daz) and zero-padded to whole 32-column tiles; the scores S = Q K^T are
 * TDPBF16PS sums in FP32, scaled by `scale` in FP32; each query's online softmax runs over blocks
 * of KVL_ATTN_AMX_KEYS keys in FP32 on k's softmax entry (the vision tower's rule: M' = max(M,
 * m_b), L = L e^(M - M') + e^(m_b - M')/softmax_b(max), O *= e^(M - M')), the probabilities
 * P = softmax_b * e^(m_b - M') / softmax_b(max) below prob_floor set to 0, the rest rounded to
 * BF16, and O += P V on tiles into FP32 accumulators; at the end O / L (L of the unrounded P).
 * Bound (conformance attention_bf16_amx), against float64 of the rounded Q, K, V with p = e^(s-m)
 * exact: |out - o| <= (2^-8 + 5 e_s + (2 len + hd + 64) u) A + len (u + prob_floor) max|v|,
 * where A = sum p|v| / sum p and e_s = |scale| (hd + 16) u max_s sum_d |q_d k_sd| + 32 u: the
 * BF16 rounding of P (2^-8 relative: 8 significant bits), the FP32 error of each p (the score's
 * and its row maximum's, the exps and the softmax) in P and again in L, the FP32 sums of L and
 * O; the last term covers FP32 subtractions s - m (relative error u |s - m| in a p = e^(s - m),
 * at most u / e) and the probabilities dropped below the floor.
 * kv: kvl_attn_amx_pack_kv's panels of the head's len keys and values (packed once, reused by
 * every query tile); work: kvl_attn_amx_work_floats(hd) floats. Returns 0, or -1 (nothing
 * written) where AMX is not available or hd, nq are out of range. */
#define KVL_ATTN_AMX_KEYS 512
#define KVL_ATTN_AMX_QUERIES 96
#define KVL_ATTN_AMX_MAX_HD 256
/* uint32 words of the packed keys and values of len keys (head size hd), and the work floats */
size_t kvl_attn_amx_kv_words(size_t len, size_t hd);
size_t kvl_attn_amx_work_floats(size_t hd);
/* K[s*ld + d], V[s*ld + d] (s < len, d < hd) rounded to BF16 into kv's pair panels; 0 or -1
 * (nothing written) as kvl_attention_bf16_amx. */
int kvl_attn_amx_pack_kv(uint32_t *kv, const float *K, const float *V, size_t ld, size_t len,
                         size_t hd);
int kvl_attention_bf16_amx(const kvl_kernels *k, float *out, size_t ldo, const float *Q,
                           size_t ldq, size_t nq, const uint32_t *kv, size_t len, size_t hd,
                           float scale, float prob_floor, float *work);
/* BF16 bits of kvl_bf16_round_daz(x) */
uint16_t kvl_bf16_bits_daz(float x);
/* a * b + c rounded once to FP32, without the C library's fmaf: mingw-w64's is a software one
 * that rounds some tiny and subnormal results otherwise than the hardware (it failed the
 * avx512-bf16 self-test under Windows). The product of two floats is exact in double (at most 48
 * bits); the sum is taken in double rounded to odd (two-sum gives its exact error), and a double
 * with 53 >= 24 + 2 bits rounded to odd then to FP32 is the single rounding of the exact value.
 * The references of gemm_tile_bf16 (kernels_ref.c, kernels_conformance.c) use it. */
static inline float kvl_fmaf_once(float a, float b, float c)
{
    const double p = (double)a * (double)b, q = (double)c;
    double s = p + q;
    if (!isfinite(s))
        return (float)s;
    const double bb = s - p;
    const double e = (p - (s - bb)) + (q - bb);
    if (e != 0.0) {
        uint64_t bits;
        memcpy(&bits, &s, sizeof bits);
        if ((bits & 1u) == 0) { /* round to odd: one ulp toward the exact value */
            bits = (e > 0.0) == (s > 0.0) ? bits + 1u : bits - 1u;
            memcpy(&s, &bits, sizeof s);
        }
    }
    return (float)s;
}

/* A pair of BF16 values as gemm_tile_bf16 reads them: column 2q low, 2q+1 high */
static inline uint32_t kvl_bf16_pair(uint16_t even, uint16_t odd)
{
    return (uint32_t)even | (uint32_t)odd << 16;
}

#define KVL_I16_MAX 16383    /* activation range of matmul_i16_i16 (4 products exact in int32) */
#define KVL_I16_Q8_MAX 32767 /* activation range of matmul_q8_i16 */
#define KVL_I8_MAX 127       /* activation range of matmul_q8_i8 (--act-dtype i8) */
#define KVL_I16_BLOCK 64     /* columns per activation scale (and exact int32 block) of matmul_q8_i16 */

/* blocks of `block` columns in a row of cols (the last one may be shorter) */
static inline size_t kvl_i16_nblocks(size_t cols, size_t block)
{
    return (cols + block - 1) / block;
}

/* level: 0 = best supported, 1 scalar, 2 avx2, 3 avx512, 4 simd128 (WebAssembly builds only).
 * Level 3 is avx512-bf16 on CPUs with AVX512_BF16; level 4 is simd128-relaxed in the relaxed
 * WebAssembly build (built with -DKVL_WASM_RELAXED=1, kvl_core_relaxed.wasm: a module that
 * instantiates at all has relaxed SIMD, and the host checks that its engine computes it right
 * before it loads that build). Returns NULL if the CPU (or the build) does not support the
 * requested level. */
const kvl_kernels *kvl_kernels_select(int level);
/* 1 if the running CPU supports the level (and it was compiled in). */
int kvl_kernels_supported(int level);
/* The table named name ("scalar", "simd128", "simd128-relaxed", "avx2", "avx512" = AVX-512
 * without BF16 dot products, "avx512-bf16") if it is compiled into this build and the running CPU
 * supports it, else NULL. */
const kvl_kernels *kvl_kernels_by_name(const char *name);
/* NULL-terminated names of the tables compiled into this build, in the order scalar,
 * simd128 [, simd128-relaxed] | avx2, avx512, avx512-bf16 (some may be unsupported by the
 * running CPU). */
const char *const *kvl_kernels_compiled_names(void);


/* kernels_relaxed.c (relaxed build only): matmul_q8_i8's decode (n == 1) on R = 8 or 4 rows
 * `step` rows apart from row r, Y[row] for each, bit-identical to the reference; the rows'
 * grouping and the rows left over are kernels_simd128.c's. */
void kvl_relaxed_decode_pass_q8_i8(int R, size_t step, float *Y, const int8_t *W, const float *scale,
                                   size_t r, size_t cols, const int16_t *x, const float *xs);

/* kernels_relaxed.c (relaxed build only): matmul_q4_i8 for one token on rows r + i * step,
 * i < nr <= 8, columns [c0, c0 + kc) (multiples of 32), as kernels_simd128.c's q4d passes:
 * x8 = the token's columns [c0, c0 + kc) as int8, corr[g] = -8 * their sum over group g; the
 * accumulators start from Y[row] when c0 > 0. Bit-identical to the reference. */
void kvl_relaxed_q4_i8_pass(float *Y, const uint8_t *W, const uint16_t *S, size_t r, size_t step, int nr,
                            size_t cols, const int8_t *x8, const int32_t *corr, const float *xs, size_t c0,
                            size_t kc);

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
/* The integer mode's scalar steps, shared by every table's tails so they cannot drift from the
 * reference: rint (half to even) then clamp to [-lim, lim], a NaN giving 0; and the sum of
 * w[k]*x[k] over columns [c, cols) in groups of 4 (each exact in int32) added to acc in FP32. */
int16_t kvl_i16_round_clamp(float v, float lim);
float kvl_i16_group_sum(const int16_t *w, const int16_t *x, size_t c, size_t cols, float acc);
/* BF16 rows [rows, cols] -> int16 rows for matmul_i16_i16: scale[r] = rowmax|w| / 32767,
 * Wq = clamp(rint(w * (32767 / rowmax)), -32767, 32767); an all-zero row gets scale 0. Done once
 * at load, never in the decode loop, so it has no SIMD variants. */
/* Wq may be W itself (in place: each row is read whole before it is written; engine.c converts
 * resident weights so). */
void kvl_quantize_rows_i16(int16_t *Wq, float *scale, const uint16_t *W, size_t rows, size_t cols);
/* Single-value BF16 conversions (same rounding as the table entries; NaN stays a quiet NaN). */
float kvl_bf16_to_float(uint16_t h);
uint16_t kvl_float_to_bf16(float f);

#endif
