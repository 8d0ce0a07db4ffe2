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

/* AMX (Sapphire Rapids and later): Linux x86-64 only, where the kernel hands out the tile state
 * on request (arch_prctl ARCH_REQ_XCOMP_PERM); compiled per function (target attributes), so
 * this file keeps no ISA flags. Windows builds and other compilers have no AMX path. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__EMSCRIPTEN__) && !defined(KVL_NO_AMX)
#define KVL_GEMM_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

/* ---- BF16 products (kvl_gemm_bf16_xb) ---------------------------------------------------
 * Panels of column pairs for gemm_tile_bf16 (kernels.h): weights as stored, activations rounded
 * with kvl_bf16_bits_daz; a missing odd column (cols odd) is a zero pair half. */

static uint16_t w_at(const uint16_t *w, size_t cols, size_t k) { return k < cols ? w[k] : 0; }

static void pack_weight_pairs(uint32_t *Bp, const uint16_t *W, size_t cols, size_t r0, size_t nc,
                              size_t k0, size_t kp, size_t nr)
{
    for (size_t p = 0; p * nr < nc; p++) {
        uint32_t *dst = Bp + p * kp * nr;
        const size_t rn = nc - p * nr < nr ? nc - p * nr : nr;
        const uint16_t *w = W + (r0 + p * nr) * cols;
        for (size_t q = 0; q < kp; q++) {
            uint32_t *d = dst + q * nr;
            const size_t k = k0 + 2 * q;
            size_t j = 0;
            for (; j < rn; j++)
                d[j] = kvl_bf16_pair(w[j * cols + k], w_at(w + j * cols, cols, k + 1));
            for (; j < nr; j++)
                d[j] = 0;
        }
    }
}

static void pack_act_pairs(uint32_t *Ap, const float *X, size_t ldx, size_t cols, size_t t0,
                           size_t mc, size_t k0, size_t kp, size_t mr)
{
    for (size_t p = 0; p * mr < mc; p++) {
        uint32_t *dst = Ap + p * kp * mr;
        const size_t tn = mc - p * mr < mr ? mc - p * mr : mr;
        const float *x = X + (t0 + p * mr) * ldx;
        for (size_t q = 0; q < kp; q++) {
            uint32_t *d = dst + q * mr;
            const size_t k = k0 + 2 * q;
            size_t i = 0;
            for (; i < tn; i++)
                d[i] = kvl_bf16_pair(kvl_bf16_bits_daz(x[i * ldx + k]),
                                     k + 1 < cols ? kvl_bf16_bits_daz(x[i * ldx + k + 1]) : 0);
            for (; i < mr; i++)
                d[i] = 0;
        }
    }
}

/* The same pairs as FP32 panels in the tile's order (column 2q+1, then 2q) for gemm_tile on
 * sets without a BF16 dot product: every product is exact, so the FP32 tile's sum is the BF16
 * tile's (fused or not). */
static void pairs_to_f32(float *dst, const uint32_t *src, size_t kp, size_t w)
{
    for (size_t q = 0; q < kp; q++)
        for (size_t j = 0; j < w; j++) {
            const uint32_t pr = src[q * w + j];
            dst[(2 * q) * w + j] = bf16f((uint16_t)(pr >> 16));
            dst[(2 * q + 1) * w + j] = bf16f((uint16_t)(pr & 0xffffu));
        }
}

/* The loop nest of both products (kernels.h "blocked GEMM"); xb: BF16 pairs. */
static void gemm(const kvl_kernels *K, float *Y, size_t ldy, const uint16_t *W, size_t rows,
                 size_t cols, const float *X, size_t ldx, size_t n, float *work, int xb)
{
    const size_t mr = (size_t)K->gemm_mr, nr = (size_t)K->gemm_nr;
    const int pairs_tile = xb && K->bf16_dot && K->gemm_tile_bf16;
    float *Bp = work;                                      /* [KC][NC], as panels */
    float *Ap = Bp + (size_t)KVL_GEMM_KC * KVL_GEMM_NC;   /* [KC][MC], as panels */
    float *edge = Ap + (size_t)KVL_GEMM_MC * KVL_GEMM_KC; /* one tile, [mr][nr] */
    /* xb without a BF16 tile: a block's pairs (half the words of its FP32 panels) are packed
     * into the upper half of the panel buffer and expanded panel by panel into FP32 from its
     * start. In place and safe: expanding column pair q of panel p writes below the pairs still
     * to be read (panel p's FP32 end, (p+1)*2kp*w, is at most the start of panel p+1's pairs,
     * np*w*kp + (p+1)*kp*w, and within a panel pair q's writes reach its own word at most,
     * after reading it) */
    if (cols == 0) { /* an empty sum: zeros, as the reference */
        for (size_t t = 0; t < n; t++)
            memset(Y + t * ldy, 0, rows * sizeof(float));
        return;
    }
    for (size_t r0 = 0; r0 < rows; r0 += KVL_GEMM_NC) {
        const size_t nc = rows - r0 < KVL_GEMM_NC ? rows - r0 : KVL_GEMM_NC;
        const size_t ncp = (nc + nr - 1) / nr * nr;
        for (size_t k0 = 0; k0 < cols; k0 += KVL_GEMM_KC) {
            const size_t kc = cols - k0 < KVL_GEMM_KC ? cols - k0 : KVL_GEMM_KC;
            const size_t kp = (kc + 1) / 2;
            const int accumulate = k0 > 0;
            if (!xb) {
                pack_weights(Bp, W, cols, r0, nc, k0, kc, nr);
            } else if (pairs_tile) {
                pack_weight_pairs((uint32_t *)Bp, W, cols, r0, nc, k0, kp, nr);
            } else {
                /* pairs into the upper half, expanded panel by panel into the lower: panel p's
                 * FP32 floats [p*2kp*nr, (p+1)*2kp*nr) end at or before its pairs start */
                uint32_t *pairs = (uint32_t *)(Bp + ncp * kp);
                pack_weight_pairs(pairs, W, cols, r0, nc, k0, kp, nr);
                for (size_t p = 0; p * nr < nc; p++)
                    pairs_to_f32(Bp + p * 2 * kp * nr, pairs + p * kp * nr, kp, nr);
            }
            for (size_t t0 = 0; t0 < n; t0 += KVL_GEMM_MC) {
                const size_t mc = n - t0 < KVL_GEMM_MC ? n - t0 : KVL_GEMM_MC;
                if (!xb) {
                    pack_acts(Ap, X, ldx, t0, mc, k0, kc, mr);
                } else if (pairs_tile) {
                    pack_act_pairs((uint32_t *)Ap, X, ldx, cols, t0, mc, k0, kp, mr);
                } else {
                    const size_t mcp = (mc + mr - 1) / mr * mr;
                    uint32_t *pairs = (uint32_t *)(Ap + mcp * kp);
                    pack_act_pairs(pairs, X, ldx, cols, t0, mc, k0, kp, mr);
                    for (size_t p = 0; p * mr < mc; p++)
                        pairs_to_f32(Ap + p * 2 * kp * mr, pairs + p * kp * mr, kp, mr);
                }
                /* panel strides: kc floats per row of a tile (FP32), kp words (pairs), 2kp
                 * floats (FP32 from pairs) */
                const size_t kstep = !xb ? kc : pairs_tile ? kp : 2 * kp;
                /* a token panel (gemm_mr x kc, the broadcast operand) stays in L1 while the
                 * weight panels (the vector loads) stream from L2, as BLIS's Skylake-X kernels
                 * do: the other order ran at half the FMA peak (L1 is 32-48 KiB) */
                for (size_t i0 = 0; i0 < mc; i0 += mr) {
                    const float *A = Ap + i0 * kstep;
                    const size_t tn = mc - i0 < mr ? mc - i0 : mr;
                    for (size_t j0 = 0; j0 < nc; j0 += nr) {
                        const float *B = Bp + j0 * kstep; /* panel j0 / nr */
                        const size_t rn = nc - j0 < nr ? nc - j0 : nr;
                        float *C = Y + (t0 + i0) * ldy + r0 + j0;
                        const int full = tn == mr && rn == nr;
                        /* an edge: the whole tile on zero-padded panels, then its real part
                         * (the same sum, then the same add to C) */
                        float *T = full ? C : edge;
                        const size_t ldt = full ? ldy : nr;
                        const int acc_t = full ? accumulate : 0;
                        if (pairs_tile)
                            K->gemm_tile_bf16(kp, (const uint32_t *)A, (const uint32_t *)B, T, ldt, acc_t);
                        else
                            K->gemm_tile(kstep, A, B, T, ldt, acc_t);
                        if (full)
                            continue;
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

void kvl_gemm_bf16(const kvl_kernels *K, float *Y, size_t ldy, const uint16_t *W, size_t rows,
                   size_t cols, const float *X, size_t ldx, size_t n, float *work)
{
    gemm(K, Y, ldy, W, rows, cols, X, ldx, n, work, 0);
}

void kvl_gemm_bf16_xb(const kvl_kernels *K, float *Y, size_t ldy, const uint16_t *W, size_t rows,
                      size_t cols, const float *X, size_t ldx, size_t n, float *work)
{
    gemm(K, Y, ldy, W, rows, cols, X, ldx, n, work, 1);
}

/* ---- AMX BF16 products (kvl_gemm_bf16_amx) -----------------------------------------------
 * TDPBF16PS multiplies a 16-token x 32-column BF16 tile by a 32-column x 16-output one (column
 * pairs interleaved, the layout of pack_weight_pairs with 16 outputs a panel) into 16 x 16 FP32
 * accumulators held in the tile registers: 16,384 multiply-adds an instruction, ~2.3 TFLOP/s a
 * core measured here (2 vCPU Xeon, 2026-12-06) against ~0.15 for AVX-512 FMAs. Its accumulation
 * is not VDPBF16PS's chain (it differs in about half the outputs of a 32-column product), so this
 * product has a bound, not a bit-exact definition (kernels.h). Blocks: KVL_AMX_NC outputs x
 * KVL_AMX_KC columns of weights (768 KiB, L2), KVL_AMX_MC tokens of activations rounded to BF16,
 * and per 32 tokens x 32 outputs four accumulator tiles over the block's columns. */
#define KVL_AMX_KC 1536 /* MoonViT's 1,152 columns in one chunk, its MLP's 4,304 in three */
#define KVL_AMX_NC 512  /* 1.5 MiB of weight pairs: L2 (2 MiB a core on Sapphire Rapids) */
#define KVL_AMX_MC 32
_Static_assert((size_t)KVL_AMX_NC * (KVL_AMX_KC / 2) + (size_t)KVL_AMX_MC * (KVL_AMX_KC / 2) + 1024 <=
                   KVL_GEMM_WORK_FLOATS,
               "kvl_gemm_bf16_amx's blocks fit the work buffer (kernels.h)");

#ifdef KVL_GEMM_AMX
/* 0 unknown, 1 usable, -1 not */
static _Atomic int amx_state;

static int amx_probe(void)
{
    unsigned a, b, c, d;
    const char *off = getenv("KVL_NO_AMX"); /* A/B runs: the VDPBF16PS path instead */
    if (off && off[0] && off[0] != '0')
        return -1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return -1;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) /* AMX-BF16, AMX-TILE */
        return -1;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) /* AVX512_BF16 */
        return -1;
    /* ask Linux for the tile data state (XFEATURE_XTILEDATA = 18); refused on kernels < 5.16 */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) != 0)
        return -1;
    return 1;
}

int kvl_gemm_amx_available(void)
{
    int s = atomic_load(&amx_state);
    if (s == 0) {
        s = amx_probe();
        atomic_store(&amx_state, s);
    }
    return s > 0;
}

typedef struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* A block: tokens [t0, t0 + mc) x columns [k0, k0 + kc) as BF16 pairs, one row of kp32 words
 * per token (kp32: pairs rounded up to whole tiles of 16), zero past the data and to 32 rows.
 * A pair is two consecutive columns, so a row is the token's columns as a BF16 array: 32 at a
 * time by VCVTNE2PS2BF16, which rounds as kvl_bf16_round_daz (kernels.h); every AMX CPU has it. */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void
amx_pack_acts(uint32_t *Ap, const float *X, size_t ldx, size_t kc, size_t t0, size_t mc,
              size_t k0, size_t kp32)
{
    for (size_t i = 0; i < KVL_AMX_MC; i++) {
        uint16_t *d = (uint16_t *)(Ap + i * kp32);
        size_t k = 0;
        if (i < mc) {
            const float *x = X + (t0 + i) * ldx + k0;
            for (; k + 32 <= kc; k += 32) {
                const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
                __m512i v;
                memcpy(&v, &h, sizeof v);
                _mm512_storeu_si512((void *)(d + k), v);
            }
            for (; k < kc; k++)
                d[k] = kvl_bf16_bits_daz(x[k]);
        }
        memset(d + k, 0, (2 * kp32 - k) * sizeof *d);
    }
}

/* 32 rows x 32 outputs at C (row stride ldc floats): C = (accumulate ? C : 0) + the products
 * over kp32 pairs of A's rows (lda words apart) and of two 16-output B panels (bpanel words
 * apart, each [kp32][16]), accumulated in the tile registers from C itself */
__attribute__((target("amx-tile,amx-bf16"))) static void
amx_block_at(const uint32_t *Ap, size_t lda, size_t kp32, const uint32_t *Bp, size_t bpanel,
             float *C, size_t ldc, int accumulate)
{
    /* accumulators 0-3 (rows 0-15 / 16-31 x outputs 0-15 / 16-31), A 4-5, B 6-7 */
    if (accumulate) {
        _tile_loadd(0, C, ldc * 4);
        _tile_loadd(1, C + 16, ldc * 4);
        _tile_loadd(2, C + 16 * ldc, ldc * 4);
        _tile_loadd(3, C + 16 * ldc + 16, ldc * 4);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (size_t q = 0; q < kp32; q += 16) {
        _tile_loadd(4, Ap + q, lda * 4);
        _tile_loadd(5, Ap + 16 * lda + q, lda * 4);
        _tile_loadd(6, Bp + q * 16, 64);
        _tile_loadd(7, Bp + bpanel + q * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, C, ldc * 4);
    _tile_stored(1, C + 16, ldc * 4);
    _tile_stored(2, C + 16 * ldc, ldc * 4);
    _tile_stored(3, C + 16 * ldc + 16, ldc * 4);
}

/* kvl_gemm_bf16_amx's block: 32 tokens of Ap ([32][kp32]) x two consecutive panels of Bp */
static void amx_block(const uint32_t *Ap, size_t kp32, const uint32_t *Bp, float *C, size_t ldc,
                      int accumulate)
{
    amx_block_at(Ap, kp32, kp32, Bp, kp32 * 16, C, ldc, accumulate);
}

__attribute__((target("amx-tile"))) static void amx_begin(void)
{
    /* static and whole: GCC 12 dropped the memset of a stack copy's unused entries, which
     * LDTILECFG reads (nonzero reserved bytes fault) */
    static const amx_config cfg = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) static void amx_end(void)
{
    _tile_release();
}

int kvl_gemm_bf16_amx(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                      const float *X, size_t ldx, size_t n, float *work)
{
    if (!kvl_gemm_amx_available())
        return -1;
    uint32_t *Bp = (uint32_t *)work;                           /* [NC/16][kp32][16] */
    uint32_t *Ap = Bp + (size_t)KVL_AMX_NC * (KVL_AMX_KC / 2); /* [MC][kp32] */
    float *tmp = (float *)(Ap + (size_t)KVL_AMX_MC * (KVL_AMX_KC / 2)); /* [32][32] */
    if (cols == 0) {
        for (size_t t = 0; t < n; t++)
            memset(Y + t * ldy, 0, rows * sizeof(float));
        return 0;
    }
    amx_begin();
    for (size_t r0 = 0; r0 < rows; r0 += KVL_AMX_NC) {
        const size_t nc = rows - r0 < KVL_AMX_NC ? rows - r0 : KVL_AMX_NC;
        for (size_t k0 = 0; k0 < cols; k0 += KVL_AMX_KC) {
            const size_t kc = cols - k0 < KVL_AMX_KC ? cols - k0 : KVL_AMX_KC;
            const size_t kp32 = (kc + 31) / 32 * 16;
            const int accumulate = k0 > 0;
            /* 16-output panels over kp32 pairs (zero past cols: kc is padded to a whole tile) */
            for (size_t p = 0; p * 16 < nc; p++) {
                uint32_t *dst = Bp + p * kp32 * 16;
                const size_t rn = nc - p * 16 < 16 ? nc - p * 16 : 16;
                const uint16_t *w = W + (r0 + p * 16) * cols;
                /* a pair is two consecutive BF16 of a row: one 32-bit word of W */
                const size_t whole = kc / 2;
                for (size_t j = 0; j < 16; j++) {
                    const uint16_t *wj = w + j * cols + k0;
                    size_t q = 0;
                    if (j < rn) {
                        for (; q < whole; q++) {
                            uint32_t v;
                            memcpy(&v, wj + 2 * q, sizeof v);
                            dst[q * 16 + j] = v;
                        }
                        if (kc % 2)
                            dst[q++ * 16 + j] = kvl_bf16_pair(wj[kc - 1], 0);
                    }
                    for (; q < kp32; q++)
                        dst[q * 16 + j] = 0;
                }
            }
            /* an odd number of 16-output panels: one more of zeros for the pair of tiles */
            if ((nc + 15) / 16 % 2)
                memset(Bp + (nc + 15) / 16 * kp32 * 16, 0, kp32 * 16 * sizeof *Bp);
            for (size_t t0 = 0; t0 < n; t0 += KVL_AMX_MC) {
                const size_t mc = n - t0 < KVL_AMX_MC ? n - t0 : KVL_AMX_MC;
                amx_pack_acts(Ap, X, ldx, kc, t0, mc, k0, kp32);
                for (size_t j0 = 0; j0 < nc; j0 += 32) {
                    const size_t rn = nc - j0 < 32 ? nc - j0 : 32;
                    float *C = Y + t0 * ldy + r0 + j0;
                    const uint32_t *B = Bp + (j0 / 16) * kp32 * 16;
                    if (mc == KVL_AMX_MC && rn == 32) {
                        amx_block(Ap, kp32, B, C, ldy, accumulate);
                        continue;
                    }
                    /* an edge: the same arithmetic on a copy of its part of Y */
                    for (size_t i = 0; i < 32; i++)
                        for (size_t j = 0; j < 32; j++)
                            tmp[i * 32 + j] = accumulate && i < mc && j < rn ? C[i * ldy + j] : 0.0f;
                    amx_block(Ap, kp32, B, tmp, 32, accumulate);
                    for (size_t i = 0; i < mc; i++)
                        memcpy(C + i * ldy, tmp + i * 32, rn * sizeof *C);
                }
            }
        }
    }
    amx_end();
    return 0;
}

/* ---- AMX attention (kvl_attention_bf16_amx) ----------------------------------------------
 * Per head: keys as pair panels of 16 keys [hp/2 pairs][16] (hp: hd rounded up to 32), values as
 * panels of 16 dimensions over all key pairs [lenp/2][16] (lenp: len rounded up to 32), both
 * zero-padded, so S = Q K^T and O += P V are amx_block_at calls on whole 32 x 32 tiles. Per call,
 * for each block of KVL_ATTN_AMX_KEYS keys and each 32 queries: the scores' tiles, then per query
 * the vision tower's online-softmax step (attn_row: FP32, AVX-512, the table's softmax for the
 * exps), the block's probabilities rounded to BF16 into a [32][KEYS/2] A tile, then the
 * product into the FP32 outputs O [96][hp] (which stay in L1/L2 between blocks: the rescale
 * by e^(M - M') is a pass over one query's row). */

/* n floats of x (none if x is NULL) rounded to BF16 (VCVTNE2PS2BF16 = kvl_bf16_round_daz),
 * zero up to np (a multiple of 32) */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void
bf16_row(uint16_t *d, const float *x, size_t n, size_t np)
{
    for (size_t k = 0; k < np; k += 32) {
        const size_t rem = x && n > k ? n - k : 0;
        const __mmask16 lo = rem >= 16 ? 0xFFFF : (__mmask16)((1u << rem) - 1u);
        const __mmask16 hi = rem >= 32 ? 0xFFFF : rem > 16 ? (__mmask16)((1u << (rem - 16)) - 1u) : 0;
        const __m512 a = lo ? _mm512_maskz_loadu_ps(lo, x + k) : _mm512_setzero_ps();
        const __m512 b = hi ? _mm512_maskz_loadu_ps(hi, x + k + 16) : _mm512_setzero_ps();
        const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
        __m512i v;
        memcpy(&v, &h, sizeof v);
        _mm512_storeu_si512((void *)(d + k), v);
    }
}

int kvl_attn_amx_pack_kv(uint32_t *kv, const float *K, const float *V, size_t ld, size_t len,
                         size_t hd)
{
    if (!kvl_gemm_amx_available() || hd == 0 || hd > KVL_ATTN_AMX_MAX_HD)
        return -1;
    const size_t hp = (hd + 31) / 32 * 32, hw = hp / 2, lenp = (len + 31) / 32 * 32;
    uint32_t *Kp = kv;                          /* [lenp/16][hw][16] */
    uint16_t *Vh = (uint16_t *)(kv + lenp * hw); /* [hp/16][lenp/2][16] pairs */
    uint16_t r[KVL_ATTN_AMX_MAX_HD];
    for (size_t s = 0; s < lenp; s++) {
        uint32_t w[KVL_ATTN_AMX_MAX_HD / 2];
        bf16_row(r, s < len ? K + s * ld : NULL, hd, hp);
        memcpy(w, r, hp * sizeof *r);
        uint32_t *dst = Kp + (s / 16) * hw * 16 + s % 16;
        for (size_t q = 0; q < hw; q++)
            dst[q * 16] = w[q];
        bf16_row(r, s < len ? V + s * ld : NULL, hd, hp);
        uint16_t *vd = Vh + 2 * ((s / 2) * 16) + (s & 1);
        for (size_t j = 0; j < hp; j++)
            vd[2 * ((j / 16) * (lenp / 2) * 16 + j % 16)] = r[j];
    }
    return 0;
}

/* One query's step over a block of kb keys (row: its kb scores, scaled here in place): the
 * online softmax as vision.c's FP32 path takes it, then its probabilities (kbp of them, zero past
 * kb and below floor) rounded to BF16 into P. */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void
attn_row(const kvl_kernels *k, float *row, size_t kb, size_t kbp, float scale, float floor_p,
         float *M, float *L, float *O, size_t hp, uint16_t *P)
{
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (size_t s = 0; s < kb; s += 16) {
        const __mmask16 m = kb - s >= 16 ? 0xFFFF : (__mmask16)((1u << (kb - s)) - 1u);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + s), vs);
        _mm512_mask_storeu_ps(row + s, m, v);
        vm = _mm512_mask_max_ps(vm, m, vm, v);
    }
    const float m_b = _mm512_reduce_max_ps(vm);
    size_t arg = 0;
    for (size_t s = 0; s < kb; s += 16) { /* the first key at the maximum */
        const __mmask16 m = kb - s >= 16 ? 0xFFFF : (__mmask16)((1u << (kb - s)) - 1u);
        const __mmask16 eq = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, row + s),
                                                     _mm512_set1_ps(m_b), _CMP_EQ_OQ);
        if (eq) {
            arg = s + (size_t)__builtin_ctz(eq);
            break;
        }
    }
    k->softmax(row, kb);
    const float pmax = row[arg]; /* exp(0) / l_b */
    const float Mn = *M > m_b ? *M : m_b;
    const float alpha = expf(*M - Mn); /* 0 on the first block (M = -inf) */
    const float beta = expf(m_b - Mn) / pmax;
    *L = *L * alpha + beta;
    *M = Mn;
    if (alpha != 1.0f) {
        const __m512 va = _mm512_set1_ps(alpha);
        for (size_t d = 0; d < hp; d += 16)
            _mm512_storeu_ps(O + d, _mm512_mul_ps(_mm512_loadu_ps(O + d), va));
    }
    /* Probabilities below the floor cannot change a sum that has a term near 1, but as
     * subnormals they would slow the FP32 path; dropped here too so both paths agree on which */
    const __m512 vb = _mm512_set1_ps(beta), vf = _mm512_set1_ps(floor_p);
    for (size_t s = 0; s < kbp; s += 32) {
        const size_t rem = kb > s ? kb - s : 0;
        const __mmask16 lo = rem >= 16 ? 0xFFFF : (__mmask16)((1u << rem) - 1u);
        const __mmask16 hi = rem >= 32 ? 0xFFFF : rem > 16 ? (__mmask16)((1u << (rem - 16)) - 1u) : 0;
        __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(lo, row + s), vb);
        __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(hi, row + s + 16), vb);
        a = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, vf, _CMP_GE_OQ), a);
        b = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(b, vf, _CMP_GE_OQ), b);
        const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
        __m512i v;
        memcpy(&v, &h, sizeof v);
        _mm512_storeu_si512((void *)(P + s), v);
    }
}

int kvl_attention_bf16_amx(const kvl_kernels *k, float *out, size_t ldo, const float *Q,
                           size_t ldq, size_t nq, const uint32_t *kv, size_t len, size_t hd,
                           float scale, float prob_floor, float *work)
{
    if (!kvl_gemm_amx_available() || hd == 0 || hd > KVL_ATTN_AMX_MAX_HD || len == 0 ||
        nq > KVL_ATTN_AMX_QUERIES || !k || !k->softmax)
        return -1;
    if (nq == 0)
        return 0;
    const size_t QM = KVL_ATTN_AMX_QUERIES, KB = KVL_ATTN_AMX_KEYS;
    const size_t hp = (hd + 31) / 32 * 32, hw = hp / 2, lenp = (len + 31) / 32 * 32;
    const size_t nqp = (nq + 31) / 32 * 32;
    const uint32_t *Kp = kv, *Vp = kv + lenp * hw;
    uint32_t *Qa = (uint32_t *)work;           /* [QM][hw] */
    float *S = (float *)(Qa + QM * hw);        /* [32][KB] */
    uint32_t *Pa = (uint32_t *)(S + 32 * KB);  /* [32][KB/2] */
    float *O = (float *)(Pa + 32 * (KB / 2));  /* [QM][hp] */
    float *M = O + QM * hp, *L = M + QM;
    for (size_t t = 0; t < nqp; t++)
        bf16_row((uint16_t *)(Qa + t * hw), t < nq ? Q + t * ldq : NULL, hd, hp);
    memset(O, 0, nqp * hp * sizeof *O);
    for (size_t t = 0; t < nqp; t++) {
        M[t] = -INFINITY;
        L[t] = 0.0f;
    }
    amx_begin();
    for (size_t k0 = 0; k0 < len; k0 += KB) {
        const size_t kb = len - k0 < KB ? len - k0 : KB, kbp = (kb + 31) / 32 * 32;
        for (size_t i0 = 0; i0 < nq; i0 += 32) {
            for (size_t c = 0; c < kbp; c += 32)
                amx_block_at(Qa + i0 * hw, hw, hw, Kp + (k0 + c) / 16 * hw * 16, hw * 16, S + c, KB, 0);
            for (size_t i = 0; i < 32; i++) {
                uint16_t *P = (uint16_t *)(Pa + i * (KB / 2));
                if (i0 + i >= nq) /* a padding query: no probabilities */
                    memset(P, 0, kbp * sizeof *P);
                else
                    attn_row(k, S + i * KB, kb, kbp, scale, prob_floor, M + i0 + i, L + i0 + i,
                             O + (i0 + i) * hp, hp, P);
            }
            for (size_t d0 = 0; d0 < hp; d0 += 32)
                amx_block_at(Pa, KB / 2, kbp / 2, Vp + d0 / 16 * (lenp / 2) * 16 + k0 / 2 * 16,
                             (lenp / 2) * 16, O + i0 * hp + d0, hp, 1);
        }
    }
    amx_end();
    for (size_t t = 0; t < nq; t++) {
        const float inv = 1.0f / L[t];
        for (size_t d = 0; d < hd; d++)
            out[t * ldo + d] = O[t * hp + d] * inv;
    }
    return 0;
}
#else
int kvl_gemm_amx_available(void)
{
    return 0;
}

int kvl_gemm_bf16_amx(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                      const float *X, size_t ldx, size_t n, float *work)
{
    (void)Y, (void)ldy, (void)W, (void)rows, (void)cols, (void)X, (void)ldx, (void)n, (void)work;
    return -1;
}

int kvl_attn_amx_pack_kv(uint32_t *kv, const float *K, const float *V, size_t ld, size_t len,
                         size_t hd)
{
    (void)kv, (void)K, (void)V, (void)ld, (void)len, (void)hd;
    return -1;
}

int kvl_attention_bf16_amx(const kvl_kernels *k, float *out, size_t ldo, const float *Q,
                           size_t ldq, size_t nq, const uint32_t *kv, size_t len, size_t hd,
                           float scale, float prob_floor, float *work)
{
    (void)k, (void)out, (void)ldo, (void)Q, (void)ldq, (void)nq, (void)kv, (void)len, (void)hd;
    (void)scale, (void)prob_floor, (void)work;
    return -1;
}
#endif

size_t kvl_attn_amx_kv_words(size_t len, size_t hd)
{
    return (len + 31) / 32 * 32 * ((hd + 31) / 32 * 32);
}

size_t kvl_attn_amx_work_floats(size_t hd)
{
    const size_t hp = (hd + 31) / 32 * 32;
    return (size_t)KVL_ATTN_AMX_QUERIES * (hp / 2 + hp + 2) + 32 * KVL_ATTN_AMX_KEYS * 3 / 2;
}
