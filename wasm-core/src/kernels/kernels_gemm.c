/* kernels_gemm.c — the blocked GEMM driver (kvl_gemm_bf16) over a table's register tile.
 *
 * Owns: the loop nest, the packing of weights and activations into the panels gemm_tile reads,
 * and the edge tiles (kernels.h, "blocked GEMM"). Plain C, no ISA flags: the only vector code is
 * the table's gemm_tile, called once per tile of gemm_mr x gemm_nr outputs over up to
 * KVL_GEMM_KC columns (thousands of multiply-adds per call, so the indirect call costs nothing).
 * Does not own: the tiles (kernels_ref.c, kernels_avx2.c, kernels_avx512.c, kernels_simd128.c),
 * threading (callers split rows: vision.c gives each thread whole panels), memory (the caller's
 * work buffer).
 *
 * Why blocked: the row-tile kernels (matmul_bf16) reload a 4 x 4 tile's operands every 16
 * columns and end every output in a horizontal sum; MoonViT's products have thousands of tokens,
 * so here each weight is widened to FP32 once per call, each activation packed once per
 * KVL_GEMM_NC rows, and the tile's inner step is one or two vector loads, gemm_mr broadcasts and
 * gemm_mr * gemm_nr / lanes multiply-adds from L1/L2 (Goto and van de Geijn's layering, the
 * structure of BLIS and of XNNPACK's f32 GEMM microkernels).
 */
#include "kernels.h"

#include <string.h>

/* bf16 bits -> FP32 (exact) */
static float bf16f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* B panels for rows [r0, r0 + nc) and columns [k0, k0 + kc): panel p holds rows r0 + p*nr ..
 * as Bp[p*kc*nr + k*nr + j] (zero past the last row). */
static void pack_weights(float *Bp, const uint16_t *W, size_t cols, size_t r0, size_t nc,
                         size_t k0, size_t kc, size_t nr)
{
    for (size_t p = 0; p * nr < nc; p++) {
        float *dst = Bp + p * kc * nr;
        const size_t rn = nc - p * nr < nr ? nc - p * nr : nr;
        const uint16_t *w = W + (r0 + p * nr) * cols + k0;
        /* written in order, read from nr rows at once (each row's cache line serves 32
         * columns): row by row, every write went to another line of a 400 KB panel block */
        for (size_t k = 0; k < kc; k++) {
            float *d = dst + k * nr;
            size_t j = 0;
            for (; j < rn; j++)
                d[j] = bf16f(w[j * cols + k]);
            for (; j < nr; j++)
                d[j] = 0.0f;
        }
    }
}

/* A panels for tokens [t0, t0 + mc) and columns [k0, k0 + kc): Ap[p*kc*mr + k*mr + i]
 * (zero past the last token). */
static void pack_acts(float *Ap, const float *X, size_t ldx, size_t t0, size_t mc, size_t k0,
                      size_t kc, size_t mr)
{
    for (size_t p = 0; p * mr < mc; p++) {
        float *dst = Ap + p * kc * mr;
        const size_t tn = mc - p * mr < mr ? mc - p * mr : mr;
        const float *x = X + (t0 + p * mr) * ldx + k0;
        /* written in order, read from mr rows at once (as pack_weights) */
        for (size_t k = 0; k < kc; k++) {
            float *d = dst + k * mr;
            size_t i = 0;
            for (; i < tn; i++)
                d[i] = x[i * ldx + k];
            for (; i < mr; i++)
                d[i] = 0.0f;
        }
    }
}

void kvl_gemm_bf16(const kvl_kernels *K, float *Y, size_t ldy, const uint16_t *W, size_t rows,
                   size_t cols, const float *X, size_t ldx, size_t n, float *work)
{
    const size_t mr = (size_t)K->gemm_mr, nr = (size_t)K->gemm_nr;
    float *Bp = work;                                      /* [KC][NC], as panels */
    float *Ap = Bp + (size_t)KVL_GEMM_KC * KVL_GEMM_NC;   /* [KC][MC], as panels */
    float *edge = Ap + (size_t)KVL_GEMM_MC * KVL_GEMM_KC; /* one tile, [mr][nr] */
    if (cols == 0) { /* an empty sum: zeros, as the reference */
        for (size_t t = 0; t < n; t++)
            memset(Y + t * ldy, 0, rows * sizeof(float));
        return;
    }
    for (size_t r0 = 0; r0 < rows; r0 += KVL_GEMM_NC) {
        const size_t nc = rows - r0 < KVL_GEMM_NC ? rows - r0 : KVL_GEMM_NC;
        for (size_t k0 = 0; k0 < cols; k0 += KVL_GEMM_KC) {
            const size_t kc = cols - k0 < KVL_GEMM_KC ? cols - k0 : KVL_GEMM_KC;
            const int accumulate = k0 > 0;
            pack_weights(Bp, W, cols, r0, nc, k0, kc, nr);
            for (size_t t0 = 0; t0 < n; t0 += KVL_GEMM_MC) {
                const size_t mc = n - t0 < KVL_GEMM_MC ? n - t0 : KVL_GEMM_MC;
                pack_acts(Ap, X, ldx, t0, mc, k0, kc, mr);
                /* a token panel (gemm_mr x kc, the broadcast operand) stays in L1 while the
                 * weight panels (the vector loads) stream from L2, as BLIS's Skylake-X kernels
                 * do: the other order ran at half the FMA peak (L1 is 32-48 KiB) */
                for (size_t i0 = 0; i0 < mc; i0 += mr) {
                    const float *A = Ap + i0 * kc;
                    const size_t tn = mc - i0 < mr ? mc - i0 : mr;
                    for (size_t j0 = 0; j0 < nc; j0 += nr) {
                        const float *B = Bp + j0 * kc; /* panel j0 / nr */
                        const size_t rn = nc - j0 < nr ? nc - j0 : nr;
                        float *C = Y + (t0 + i0) * ldy + r0 + j0;
                        if (tn == mr && rn == nr) {
                            K->gemm_tile(kc, A, B, C, ldy, accumulate);
                            continue;
                        }
                        /* an edge: the whole tile on zero-padded panels, then its real part
                         * (the same sum, then the same add to C) */
                        K->gemm_tile(kc, A, B, edge, nr, 0);
                        for (size_t i = 0; i < tn; i++)
                            for (size_t j = 0; j < rn; j++)
                                C[i * ldy + j] = accumulate ? C[i * ldy + j] + edge[i * nr + j]
                                                            : edge[i * nr + j];
                    }
                }
            }
        }
    }
}
