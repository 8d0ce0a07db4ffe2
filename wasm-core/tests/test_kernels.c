/* test_kernels.c — every kernel table entry against independent references.
 *
 * Owns: the numeric tests of kernels.h (all levels the CPU and build support: scalar, avx2,
 * avx512 natively; scalar, simd128 when built with emcc -msimd128, and simd128-relaxed too in the
 * relaxed build, build-wasm.sh --tests OUT/relaxed).
 * Does not own: threading tests (test_threadpool.c), timing (bench/kernels_bench.c).
 *
 * Tolerances (u = 2^-24, the FP32 unit roundoff). A sum of k products computed in FP32 in any
 * order, with FMA or not, differs from the exact sum by at most about k*u*S, S = sum |w_i x_i|
 * (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1). SIMD code keeps >= 8 lane
 * partial sums, each of <= cols/8 + 1 terms, plus <= 4 levels of horizontal adds and one scale
 * multiply, so it must be within (cols/8 + 8)*u*S of the double-precision sum: a bound that
 * holds for every summation order such code can use, yet is ~30x smaller than the error of a
 * single dropped or doubled term for cols = 2048 (a term is ~S/cols). The scalar reference
 * (sequential sum) must be within (cols + 2)*u*S. Nothing else may differ: weight conversions
 * (bf16 shift, int8 -> float) are exact. The integer mode is checked bit for bit where it is
 * defined so (quantize_i16_act, matmul_q8_i16: every table, the reference and an independent
 * evaluation of the definition agree exactly) and with its own summation bound (matmul_i16_i16).
 */
#include "kernels/kernels.h"
#include "kvl_core.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define U (1.0 / 16777216.0)

static int g_pass, g_fail;

static void check(int ok, const char *level, const char *what, const char *fmt_detail, double a,
                  double b)
{
    if (ok) {
        g_pass++;
        return;
    }
    g_fail++;
    if (g_fail <= 50) {
        printf("FAIL [%s] %s: ", level, what);
        printf(fmt_detail, a, b);
        printf("\n");
    }
}

/* ---- deterministic random data --------------------------------------------------------- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd32(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}
static float rndf(void) /* uniform in [-1, 1) */
{
    return (float)((double)(rnd32() & 0xffffff) / 8388608.0 - 1.0);
}
static float rnd_normalish(void) /* heavier tails, mixed magnitudes */
{
    float v = rndf();
    float m = (float)(1 << (rnd32() % 6)) * 0.25f;
    return v * m;
}

static float bits_to_f(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}
static uint32_t f_to_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}
/* Exact bf16 -> double without the code under test. */
static double bf16_value(uint16_t h)
{
    return (double)bits_to_f((uint32_t)h << 16);
}

static void *xmalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        printf("test_kernels: out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- matmuls --------------------------------------------------------------------------- */

enum { W_BF16, W_Q8, W_F32, W_BF16_XB, W_Q8_XB, W_KINDS };
static const char *kind_name[] = {"matmul_bf16", "matmul_q8", "matmul_f32", "matmul_bf16_xb",
                                  "matmul_q8_xb"};

/* BF16 rounding of an activation, written independently of kernels_ref.c: keep 8 significant
 * bits, nearest-even (rint in the default mode), subnormal inputs as zero. */
static double bf16_round_daz_independent(float x)
{
    if (fabs((double)x) < 1.1754943508222875e-38) /* FLT_MIN */
        return 0.0;
    int e;
    double m = frexp((double)x, &e); /* |m| in [0.5, 1) */
    return ldexp(rint(m * 256.0), e - 8);
}

static double w_value(int kind, const void *W, size_t idx, const float *scale, size_t r)
{
    if (kind == W_BF16 || kind == W_BF16_XB)
        return bf16_value(((const uint16_t *)W)[idx]);
    if (kind == W_Q8 || kind == W_Q8_XB)
        return (double)((const int8_t *)W)[idx] * (double)scale[r];
    return (double)((const float *)W)[idx];
}

static void run_matmul(int kind, const kvl_kernels *K, const kvl_kernels *R, const void *W,
                       const float *scale, size_t rows, size_t cols, const float *X, size_t ldx,
                       size_t n, float *Y, size_t ldy)
{
    const kvl_kernels *T = K ? K : R;
    if (kind == W_BF16)
        T->matmul_bf16(Y, ldy, (const uint16_t *)W, rows, cols, X, ldx, n);
    else if (kind == W_Q8)
        T->matmul_q8(Y, ldy, (const int8_t *)W, scale, rows, cols, X, ldx, n);
    else if (kind == W_BF16_XB)
        T->matmul_bf16_xb(Y, ldy, (const uint16_t *)W, rows, cols, X, ldx, n);
    else if (kind == W_Q8_XB)
        T->matmul_q8_xb(Y, ldy, (const int8_t *)W, scale, rows, cols, X, ldx, n);
    else
        T->matmul_f32(Y, ldy, (const float *)W, rows, cols, X, ldx, n);
}

static void test_matmul(const kvl_kernels *K, const kvl_kernels *ref, int kind, size_t rows,
                        size_t cols, size_t n)
{
    size_t ldx = cols + 3, ldy = rows + 5;
    int xb = kind == W_BF16_XB || kind == W_Q8_XB;
    size_t esz = kind == W_BF16 || kind == W_BF16_XB ? 2 : kind == W_Q8 || kind == W_Q8_XB ? 1 : 4;
    void *W = xmalloc(rows * cols * esz);
    float *scale = (float *)xmalloc(rows * sizeof(float));
    float *X = (float *)xmalloc(n * ldx * sizeof(float));
    float *Y = (float *)xmalloc(n * ldy * sizeof(float));
    float *Yr = (float *)xmalloc(n * ldy * sizeof(float));
    for (size_t i = 0; i < rows * cols; i++) {
        if (esz == 2)
            ((uint16_t *)W)[i] = (uint16_t)(f_to_bits(rnd_normalish()) >> 16);
        else if (esz == 1)
            ((int8_t *)W)[i] = (int8_t)(int)(rnd32() % 256 - 128);
        else
            ((float *)W)[i] = rnd_normalish();
    }
    for (size_t r = 0; r < rows; r++)
        scale[r] = 0.001f + (float)(rnd32() % 1000) * 1e-5f;
    for (size_t i = 0; i < n * ldx; i++) {
        X[i] = rnd_normalish();
        /* BF16 rounding corner cases: exact ties (both parities) and subnormals */
        if (xb && i % 7 == 3)
            X[i] = bits_to_f((f_to_bits(X[i]) & 0xffff0000u) | 0x8000u);
        if (xb && i % 13 == 5)
            X[i] = bits_to_f((rnd32() & 0x807fffffu) | 1u);
    }
    /* Sentinels in the gaps of Y must survive: the kernel writes only its rows. */
    for (size_t i = 0; i < n * ldy; i++)
        Y[i] = Yr[i] = 12345.0f;

    run_matmul(kind, K, ref, W, scale, rows, cols, X, ldx, n, Y, ldy);
    run_matmul(kind, NULL, ref, W, scale, rows, cols, X, ldx, n, Yr, ldy);

    int ok_simd = 1, ok_ref = 1, ok_pair = 1, ok_gap = 1;
    double worst = 0.0, worst_bound = 0.0;
    for (size_t t = 0; t < n && ok_simd && ok_ref && ok_pair; t++) {
        for (size_t r = 0; r < rows; r++) {
            double exact = 0.0, mag = 0.0;
            for (size_t c = 0; c < cols; c++) {
                double x = xb ? bf16_round_daz_independent(X[t * ldx + c]) : (double)X[t * ldx + c];
                double p = w_value(kind, W, r * cols + c, scale, r) * x;
                exact += p;
                mag += fabs(p);
            }
            double y = Y[t * ldy + r], yr = Yr[t * ldy + r];
            double b_simd = ((double)cols / 8.0 + 8.0) * U * mag + 1e-30;
            double b_ref = ((double)cols + 2.0) * U * mag + 1e-30;
            if (fabs(y - exact) > b_simd) {
                ok_simd = 0;
                worst = fabs(y - exact);
                worst_bound = b_simd;
            }
            if (fabs(yr - exact) > b_ref) {
                ok_ref = 0;
                worst = fabs(yr - exact);
                worst_bound = b_ref;
            }
            if (fabs(y - yr) > b_simd + b_ref)
                ok_pair = 0;
        }
    }
    for (size_t t = 0; t < n; t++)
        for (size_t r = rows; r < ldy; r++)
            if (Y[t * ldy + r] != 12345.0f)
                ok_gap = 0;
    char what[128];
    snprintf(what, sizeof what, "%s rows=%zu cols=%zu n=%zu", kind_name[kind], rows, cols, n);
    /* The scalar table is checked against double with its own (sequential) bound. */
    if (K == ref)
        check(ok_ref, K->name, what, "err %g > bound %g", worst, worst_bound);
    else
        check(ok_simd && ok_ref && ok_pair, K->name, what, "err %g > bound %g", worst, worst_bound);
    check(ok_gap, K->name, what, "wrote outside rows (%g %g)", 0, 0);
    free(W);
    free(scale);
    free(X);
    free(Y);
    free(Yr);
}

/* ---- integer mode ---------------------------------------------------------------------- */

/* The quantiser's definition evaluated without the code under test: the FP32 product x * inv
 * (exact in double, then rounded once to float), rint (half to even), NaN -> 0, the clamp. */
static int16_t q_expected(float x, float inv, double lim)
{
    float p = (float)((double)x * (double)inv);
    double v = rint((double)p);
    if (v != v)
        return 0;
    if (v > lim)
        v = lim;
    if (v < -lim)
        v = -lim;
    return (int16_t)v;
}

/* One activation vector of a given kind, for a quantiser range lim and blocks of `block`
 * columns: 0 all zero (amax 0), 1 exact .5 ties at inv = 1 (amax lim), 2 exact .5 ties at
 * inv = 0.5 (amax 2 lim, odd integers), 3 random, 4 small values with one outlier and signed
 * zeros. The amax element sits at a varying position of every block. */
static void fill_act(float *x, size_t cols, int kind, size_t pos, int lim, size_t block)
{
    for (size_t c = 0; c < cols; c++) {
        switch (kind) {
        case 0: x[c] = 0.0f; break;
        case 1: x[c] = (float)((int)(rnd32() % 201) - 100) + 0.5f; break;
        case 2: x[c] = (float)(2 * ((int)(rnd32() % (unsigned)lim) - lim / 2) + 1); break;
        case 3: x[c] = rnd_normalish(); break;
        default: x[c] = c % 5 == 0 ? (c % 2 ? -0.0f : 0.0f) : 1e-3f * rndf(); break;
        }
    }
    for (size_t p = pos % block; p < cols; p += block) {
        if (kind == 1)
            x[p] = (rnd32() & 1) ? (float)lim : -(float)lim;
        else if (kind == 2)
            x[p] = (rnd32() & 1) ? 2.0f * (float)lim : -2.0f * (float)lim;
        else if (kind == 4)
            x[p] = -7.25f;
    }
}

/* quantize_i16_act with blocks of `block` columns and range lim, as the engine calls it (block =
 * cols, lim 16383 for matmul_i16_i16; KVL_I16_BLOCK, 32767 for matmul_q8_i16): bit-identical to
 * the scalar table, and the scalar table equal to the definition evaluated here. */
static void test_quantize_i16(const kvl_kernels *K, const kvl_kernels *ref, size_t cols, size_t n,
                              size_t block, int lim)
{
    size_t ldi = cols + 7, ldo = cols + 5, nb = (cols + block - 1) / block;
    float *X = (float *)xmalloc(n * ldi * sizeof(float));
    int16_t *q = (int16_t *)xmalloc(n * ldo * sizeof(int16_t));
    int16_t *qr = (int16_t *)xmalloc(n * ldo * sizeof(int16_t));
    float *s = (float *)xmalloc(n * nb * sizeof(float)), *sr = (float *)xmalloc(n * nb * sizeof(float));
    for (size_t t = 0; t < n; t++)
        fill_act(X + t * ldi, cols, (int)((n == 1 ? cols : t) % 5), (t * 37 + cols - 1) % cols, lim,
                 block);
    for (size_t i = 0; i < n * ldo; i++)
        q[i] = qr[i] = 0x5a5a; /* sentinels in the gaps */
    K->quantize_i16_act(q, s, X, cols, n, ldi, ldo, block, lim);
    ref->quantize_i16_act(qr, sr, X, cols, n, ldi, ldo, block, lim);
    int same = 1, sane = 1, gap = 1;
    for (size_t t = 0; t < n; t++) {
        for (size_t bi = 0; bi < nb; bi++) {
            const size_t c0 = bi * block, c1 = c0 + block < cols ? c0 + block : cols;
            if (f_to_bits(s[t * nb + bi]) != f_to_bits(sr[t * nb + bi]))
                same = 0;
            double amax = 0.0;
            for (size_t c = c0; c < c1; c++)
                amax = fmax(amax, fabs((double)X[t * ldi + c]));
            /* float quotients rounded via double are correctly rounded (innocuous double rounding) */
            float inv = amax > 0 ? (float)((double)lim / amax) : 0.0f;
            if (f_to_bits(sr[t * nb + bi]) != f_to_bits((float)(amax / (double)lim)))
                sane = 0;
            for (size_t c = c0; c < c1; c++) {
                size_t k = t * ldo + c;
                if (q[k] != qr[k])
                    same = 0;
                double x = X[t * ldi + c];
                if (qr[k] != q_expected((float)x, inv, (double)lim))
                    sane = 0;
                /* nearest integer to x * lim / amax, up to the rounding of inv (lim * 2^-24)
                 * and of the product (half an FP32 ulp of 32768: 2^-9) */
                if (amax > 0 && fabs((double)qr[k] - x * (double)lim / amax) > 0.5 + 8e-3)
                    sane = 0;
            }
        }
        for (size_t c = cols; c < ldo && t + 1 < n; c++)
            if (q[t * ldo + c] != 0x5a5a)
                gap = 0;
    }
    char what[96];
    snprintf(what, sizeof what, "quantize_i16_act cols=%zu n=%zu block=%zu lim=%d", cols, n, block, lim);
    check(same, K->name, what, "differs from scalar (%g %g)", 0, 0);
    check(sane, K->name, what, "scalar not rint(x * (lim/amax)) (%g %g)", 0, 0);
    check(gap, K->name, what, "wrote outside cols (%g %g)", 0, 0);
    free(X);
    free(q);
    free(qr);
    free(s);
    free(sr);
}

/* int8 (q8 = 1) weights with 16-bit activations (a scale per KVL_I16_BLOCK columns), the same
 * with 8-bit activations (q8 = 2: matmul_q8_i8, weights within +-127 as it requires), or int16
 * weights with 15-bit activations (one scale per token). extreme: every product has the largest
 * magnitude and the same sign (w = +-127 (some -128) / +-32767 with x = +-32767 / +-16383 of the
 * same sign), so the int32 block (q8) and group (i16) sums sit at the top of their range. Q8:
 * bit-exact against the scalar table and against the definition (int64 block sums, each times
 * its scale rounded to FP32, added in FP32 in block order); I16: within the FP32 summation bound
 * of the exact product. */
static void test_int_matmul(const kvl_kernels *K, const kvl_kernels *ref, int q8, size_t rows,
                            size_t cols, size_t n, int extreme)
{
    size_t ldx = cols + 5, ldy = rows + 3;
    const int i8 = q8 == 2;
    void *W = xmalloc(rows * cols * (q8 ? 1 : 2));
    float *ws = (float *)xmalloc(rows * sizeof(float));
    float *X = (float *)xmalloc(n * cols * sizeof(float));
    int16_t *Xq = (int16_t *)xmalloc(n * ldx * sizeof(int16_t));
    const size_t nb = q8 ? (cols + KVL_I16_BLOCK - 1) / KVL_I16_BLOCK : 1; /* scales per token */
    float *xs = (float *)xmalloc(n * nb * sizeof(float));
    float *Y = (float *)xmalloc(n * ldy * sizeof(float));
    float *Yr = (float *)xmalloc(n * ldy * sizeof(float));
    signed char *sg = (signed char *)xmalloc(cols);
    for (size_t c = 0; c < cols; c++)
        sg[c] = (rnd32() & 1) ? 1 : -1;
    for (size_t i = 0; i < rows * cols; i++) {
        int v;
        if (extreme)
            v = sg[i % cols] * (q8 ? 127 : 32767);
        else
            v = i8 ? (int)(rnd32() % 255) - 127 : q8 ? (int)(rnd32() % 256) - 128 : (int)(rnd32() % 65535) - 32767;
        if (q8)
            ((int8_t *)W)[i] = (int8_t)(extreme && !i8 && v < 0 && (i % 3) == 0 ? -128 : v);
        else
            ((int16_t *)W)[i] = (int16_t)v;
    }
    for (size_t r = 0; r < rows; r++)
        ws[r] = 0.001f + (float)(rnd32() % 1000) * 1e-5f;
    if (extreme) {
        for (size_t t = 0; t < n; t++) {
            for (size_t c = 0; c < cols; c++)
                Xq[t * ldx + c] = (int16_t)(sg[c] * (i8 ? KVL_I8_MAX : q8 ? 32767 : 16383));
            for (size_t k = 0; k < nb; k++)
                xs[t * nb + k] = ldexpf(1.0f + (float)((t + k) % 8) / 8.0f, -14);
        }
    } else {
        for (size_t i = 0; i < n * cols; i++)
            X[i] = rnd_normalish();
        if (q8)
            ref->quantize_i16_act(Xq, xs, X, cols, n, cols, ldx, KVL_I16_BLOCK, i8 ? KVL_I8_MAX : KVL_I16_Q8_MAX);
        else
            ref->quantize_i16_act(Xq, xs, X, cols, n, cols, ldx, cols, KVL_I16_MAX);
    }
    for (size_t i = 0; i < n * ldy; i++)
        Y[i] = Yr[i] = 12345.0f;
    if (i8) {
        K->matmul_q8_i8(Y, ldy, (const int8_t *)W, ws, rows, cols, Xq, xs, ldx, n);
        ref->matmul_q8_i8(Yr, ldy, (const int8_t *)W, ws, rows, cols, Xq, xs, ldx, n);
    } else if (q8) {
        K->matmul_q8_i16(Y, ldy, (const int8_t *)W, ws, rows, cols, Xq, xs, ldx, n);
        ref->matmul_q8_i16(Yr, ldy, (const int8_t *)W, ws, rows, cols, Xq, xs, ldx, n);
    } else {
        K->matmul_i16_i16(Y, ldy, (const int16_t *)W, ws, rows, cols, Xq, xs, ldx, n);
        ref->matmul_i16_i16(Yr, ldy, (const int16_t *)W, ws, rows, cols, Xq, xs, ldx, n);
    }
    int ok = 1, ok_gap = 1;
    double bad_a = 0, bad_b = 0;
    for (size_t t = 0; t < n; t++) {
        const int16_t *x = Xq + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            double y = Y[t * ldy + r], yr = Yr[t * ldy + r];
            if (q8) {
                const int8_t *w = (const int8_t *)W + r * cols;
                float acc = 0.0f;
                for (size_t b = 0; b < cols; b += 64) {
                    int64_t isum = 0;
                    for (size_t c = b; c < cols && c < b + 64; c++)
                        isum += (int64_t)w[c] * x[c];
                    float p = (float)isum * xs[t * nb + b / 64];
                    acc += p;
                }
                float want = acc * ws[r];
                if (f_to_bits(Y[t * ldy + r]) != f_to_bits(want) ||
                    f_to_bits(Yr[t * ldy + r]) != f_to_bits(want)) {
                    ok = 0;
                    bad_a = y;
                    bad_b = want;
                }
            } else {
                const int16_t *w = (const int16_t *)W + r * cols;
                double sc = (double)ws[r] * (double)xs[t];
                double exact = 0.0, mag = 0.0;
                for (size_t c = 0; c < cols; c++) {
                    double p = (double)((int64_t)w[c] * x[c]);
                    exact += p;
                    mag += fabs(p);
                }
                exact *= sc;
                mag *= sc;
                /* each group sum of 4 exact products is rounded once to FP32, the group sums
                 * are added in FP32 (SIMD: >= 4 lanes of <= cols/16 terms each, <= 16 more
                 * additions for the accumulators, horizontal sums and scalar tails; scalar: one
                 * chain of ceil(cols/4)), then two scale multiplications */
                double b_simd = ((double)cols / 16.0 + 16.0) * U * mag + 1e-30;
                double b_ref = ((double)cols / 4.0 + 4.0) * U * mag + 1e-30;
                int bad = fabs(yr - exact) > b_ref || fabs(y - yr) > b_simd + b_ref;
                if (K != ref && fabs(y - exact) > b_simd)
                    bad = 1;
                if (bad) {
                    ok = 0;
                    bad_a = y;
                    bad_b = exact;
                }
            }
        }
        for (size_t r = rows; r < ldy; r++)
            if (Y[t * ldy + r] != 12345.0f)
                ok_gap = 0;
    }
    char what[128];
    snprintf(what, sizeof what, "%s%s rows=%zu cols=%zu n=%zu", i8 ? "matmul_q8_i8" : q8 ? "matmul_q8_i16" : "matmul_i16_i16",
             extreme ? " (extreme)" : "", rows, cols, n);
    check(ok, K->name, what, "got %.9g want %.9g", bad_a, bad_b);
    check(ok_gap, K->name, what, "wrote outside rows (%g %g)", 0, 0);
    free(W);
    free(ws);
    free(X);
    free(Xq);
    free(xs);
    free(Y);
    free(Yr);
    free(sg);
}

/* kvl_quantize_rows_i16 against the definition in double: scale = rowmax / 32767 (an FP32
 * quotient, correctly rounded), q = rint of the FP32 product w * (32767 / rowmax). */
static void test_quantize_rows_i16(void)
{
    size_t rows = 7, cols = 301;
    uint16_t *W = (uint16_t *)xmalloc(rows * cols * sizeof(uint16_t));
    int16_t *q = (int16_t *)xmalloc(rows * cols * sizeof(int16_t));
    float *sc = (float *)xmalloc(rows * sizeof(float));
    for (size_t i = 0; i < rows * cols; i++)
        W[i] = (uint16_t)(f_to_bits(rnd_normalish()) >> 16);
    for (size_t c = 0; c < cols; c++)
        W[2 * cols + c] = (c & 1) ? 0x8000 : 0; /* all-zero row (signed zeros) */
    for (size_t c = 0; c < cols; c++) /* ties: rowmax 32767 -> inv 1, w = k + 0.5 */
        W[3 * cols + c] = (uint16_t)(f_to_bits((float)((int)(c % 64) - 32) + 0.5f) >> 16);
    W[3 * cols + 17] = (uint16_t)(f_to_bits(-32767.0f) >> 16); /* not exact in bf16: 32768 */
    kvl_quantize_rows_i16(q, sc, W, rows, cols);
    int ok = 1;
    for (size_t r = 0; r < rows; r++) {
        double rmax = 0.0;
        for (size_t c = 0; c < cols; c++)
            rmax = fmax(rmax, fabs(bf16_value(W[r * cols + c])));
        float inv = rmax > 0 ? (float)(32767.0 / rmax) : 0.0f;
        if (f_to_bits(sc[r]) != f_to_bits((float)(rmax / 32767.0)))
            ok = 0;
        for (size_t c = 0; c < cols; c++) {
            double w = bf16_value(W[r * cols + c]);
            int16_t v = q[r * cols + c];
            if (v != q_expected((float)w, inv, 32767.0) || v < -32767)
                ok = 0;
            if (rmax > 0 && fabs((double)v - w * 32767.0 / rmax) > 0.5 + 8e-3) /* as above */
                ok = 0;
            if (rmax == 0 && v != 0)
                ok = 0;
        }
    }
    check(ok, "helper", "kvl_quantize_rows_i16 vs double", "(%g %g)", 0, 0);
    /* in place, as engine.c converts resident weights (act_i16): the same rows and scales */
    {
        uint16_t *Wi = (uint16_t *)xmalloc(rows * cols * sizeof(uint16_t));
        float *si = (float *)xmalloc(rows * sizeof(float));
        memcpy(Wi, W, rows * cols * sizeof(uint16_t));
        kvl_quantize_rows_i16((int16_t *)(void *)Wi, si, Wi, rows, cols);
        int same = memcmp(Wi, q, rows * cols * sizeof(int16_t)) == 0 &&
                   memcmp(si, sc, rows * sizeof(float)) == 0;
        check(same, "helper", "kvl_quantize_rows_i16 in place", "(%g %g)", 0, 0);
        free(Wi);
        free(si);
    }
    free(W);
    free(q);
    free(sc);
}

/* Accuracy of the integer mode against the exact product (double), relative to sum |w||x| per
 * output: BF16 weights through kvl_quantize_rows_i16 + matmul_i16_i16, Q8 weights through
 * matmul_q8_i16 (the Q8 weights themselves are exact here: only the activations are quantised),
 * and the FP32 path (matmul_bf16) for comparison. Printed; asserted only against 1e-3. */
static void report_int_accuracy(const kvl_kernels *K)
{
    const size_t rows = 128, cols = 2048, n = 4;
    uint16_t *Wb = (uint16_t *)xmalloc(rows * cols * sizeof(uint16_t));
    int16_t *Wq = (int16_t *)xmalloc(rows * cols * sizeof(int16_t));
    int8_t *W8 = (int8_t *)xmalloc(rows * cols);
    float *s16 = (float *)xmalloc(rows * sizeof(float)), *s8 = (float *)xmalloc(rows * sizeof(float));
    float *X = (float *)xmalloc(n * cols * sizeof(float));
    int16_t *Xq = (int16_t *)xmalloc(n * cols * sizeof(int16_t));
    float *xs = (float *)xmalloc(n * sizeof(float));
    int16_t *Xq8 = (int16_t *)xmalloc(n * cols * sizeof(int16_t));
    float *xs8 = (float *)xmalloc(n * (cols / KVL_I16_BLOCK) * sizeof(float));
    float *Y16 = (float *)xmalloc(n * rows * sizeof(float)), *Y8 = (float *)xmalloc(n * rows * sizeof(float));
    float *Yf = (float *)xmalloc(n * rows * sizeof(float));
    for (size_t i = 0; i < rows * cols; i++) {
        Wb[i] = (uint16_t)(f_to_bits(rnd_normalish()) >> 16);
        W8[i] = (int8_t)((int)(rnd32() % 255) - 127);
    }
    for (size_t r = 0; r < rows; r++)
        s8[r] = 0.001f + (float)(rnd32() % 1000) * 1e-5f;
    for (size_t i = 0; i < n * cols; i++)
        X[i] = rnd_normalish();
    kvl_quantize_rows_i16(Wq, s16, Wb, rows, cols);
    K->quantize_i16_act(Xq, xs, X, cols, n, cols, cols, cols, KVL_I16_MAX);
    K->quantize_i16_act(Xq8, xs8, X, cols, n, cols, cols, KVL_I16_BLOCK, KVL_I16_Q8_MAX);
    K->matmul_i16_i16(Y16, rows, Wq, s16, rows, cols, Xq, xs, cols, n);
    K->matmul_q8_i16(Y8, rows, W8, s8, rows, cols, Xq8, xs8, cols, n);
    K->matmul_bf16(Yf, rows, Wb, rows, cols, X, cols, n);
    double e16 = 0.0, e8 = 0.0, ef = 0.0;
    for (size_t t = 0; t < n; t++)
        for (size_t r = 0; r < rows; r++) {
            double ex = 0, mag = 0, ex8 = 0, mag8 = 0;
            for (size_t c = 0; c < cols; c++) {
                double x = X[t * cols + c], w = bf16_value(Wb[r * cols + c]);
                double w8 = (double)W8[r * cols + c] * s8[r];
                ex += w * x;
                mag += fabs(w * x);
                ex8 += w8 * x;
                mag8 += fabs(w8 * x);
            }
            e16 = fmax(e16, fabs(Y16[t * rows + r] - ex) / mag);
            ef = fmax(ef, fabs(Yf[t * rows + r] - ex) / mag);
            e8 = fmax(e8, fabs(Y8[t * rows + r] - ex8) / mag8);
        }
    printf("test_kernels: [%s] integer mode, [%zu x %zu] x %zu tokens, max |y - exact| / sum|w||x|: "
           "i16 x i16 %.2e, q8 x i16 %.2e (FP32 matmul_bf16 %.2e)\n",
           K->name, rows, cols, n, e16, e8, ef);
    check(e16 <= 1e-3 && e8 <= 1e-3, K->name, "integer mode accuracy sanity", "%g %g", e16, e8);
    free(Wb);
    free(Wq);
    free(W8);
    free(s16);
    free(s8);
    free(X);
    free(Xq);
    free(xs);
    free(Xq8);
    free(xs8);
    free(Y16);
    free(Y8);
    free(Yf);
}

/* ---- Q4 weights ------------------------------------------------------------------------- */

/* The format's definition (q4-spec / kernels.h), written here without the code under test: in
 * group g = c / 32 of row r, byte (c % 32) % 16 of the group's 16 bytes holds column c in its low
 * nibble when c % 32 < 16, else in its high nibble; the weight is (nibble - 8) times the group's
 * BF16 scale. */
static int q4_nibble(const uint8_t *W, size_t cols, size_t r, size_t c)
{
    const uint8_t byte = W[r * (cols / 2) + 16 * (c / 32) + (c % 32) % 16];
    return c % 32 < 16 ? byte & 15 : byte >> 4;
}
static double q4_scale(const uint16_t *S, size_t cols, size_t r, size_t c)
{
    return bf16_value(S[r * (cols / 32) + c / 32]);
}

enum { Q4_F32, Q4_XB, Q4_I16, Q4_I8 };
static const char *q4_name[] = {"matmul_q4", "matmul_q4_xb", "matmul_q4_i16", "matmul_q4_i8"};

/* One Q4 product on one table against the scalar table and against the definition.
 * extreme: every nibble 0 or 15 (q = -8 or 7), activations at their limits (+-32767 / +-127 of
 * one sign per column; matmul_q4 / _xb: +-1 and large), so the int32 group sums sit at the top of
 * their range and every 8-bit dot product's pair at its largest. Scales are BF16 of both signs.
 * Bounds (u = 2^-24, S = sum |w x| of the dequantised terms): matmul_q4 / _xb, the scalar table
 * sums each group's 32 products in FP32, multiplies by the scale and adds to one FP32
 * accumulator: within (cols + 2) u S of the exact sum; a SIMD table splits the same terms into
 * >= 4 lanes (each group's partial sums, one scale multiply, the group chain of cols / 32 adds)
 * plus horizontal adds: within (cols / 8 + 16) u S. matmul_q4_i16 / _i8: bit for bit against the
 * scalar table and against kernels.h's arithmetic evaluated here (int64 group sums, the FP32
 * operations in its order), and the scalar table within (nb + 6) u S of the exact product of the
 * dequantised weights and the quantised activations (each block: the sum rounded to FP32, two
 * scale products, their sum, the activation scale product, then one add per block). */
static void test_q4(const kvl_kernels *K, const kvl_kernels *ref, int mode, size_t rows, size_t cols,
                    size_t n, int extreme)
{
    const size_t ldx = cols + 5, ldy = rows + 3, ng = cols / 32, nb = (cols + 63) / 64;
    const int integer = mode == Q4_I16 || mode == Q4_I8, xb = mode == Q4_XB;
    const int lim = mode == Q4_I8 ? KVL_I8_MAX : KVL_I16_Q8_MAX;
    uint8_t *W = (uint8_t *)xmalloc(rows * cols / 2);
    uint16_t *S = (uint16_t *)xmalloc(rows * ng * sizeof(uint16_t));
    float *X = (float *)xmalloc(n * ldx * sizeof(float));
    int16_t *Xq = (int16_t *)xmalloc(n * ldx * sizeof(int16_t));
    float *xs = (float *)xmalloc(n * nb * sizeof(float));
    float *Y = (float *)xmalloc(n * ldy * sizeof(float));
    float *Yr = (float *)xmalloc(n * ldy * sizeof(float));
    signed char *sg = (signed char *)xmalloc(cols);
    for (size_t c = 0; c < cols; c++)
        sg[c] = (rnd32() & 1) ? 1 : -1;
    for (size_t i = 0; i < rows * cols / 2; i++) {
        if (extreme) /* nibbles 0 and 15 only: one per row mostly, so the sums are large */
            W[i] = (uint8_t)(((i / (cols / 2)) & 1) ? (i % 7 == 3 ? 0x0f : 0xff) : (i % 5 == 2 ? 0xf0 : 0x00));
        else
            W[i] = (uint8_t)rnd32();
    }
    for (size_t i = 0; i < rows * ng; i++) {
        float v = (0.002f + (float)(rnd32() % 1000) * 1e-5f) * ((rnd32() & 3) == 0 ? -1.0f : 1.0f);
        if (i % 11 == 4)
            v = 0.0f; /* an all-zero group */
        S[i] = (uint16_t)(f_to_bits(v) >> 16);
    }
    for (size_t i = 0; i < n * ldx; i++) {
        X[i] = extreme ? (float)sg[i % ldx < cols ? i % ldx : 0] * ((i % ldx) % 9 == 0 ? 300.0f : 1.0f) : rnd_normalish();
        if (xb && i % 7 == 3) /* BF16 rounding ties and subnormals, as test_matmul */
            X[i] = bits_to_f((f_to_bits(X[i]) & 0xffff0000u) | 0x8000u);
        if (xb && i % 13 == 5)
            X[i] = bits_to_f((rnd32() & 0x807fffffu) | 1u);
    }
    if (integer) {
        if (extreme) {
            for (size_t t = 0; t < n; t++) {
                for (size_t c = 0; c < cols; c++)
                    Xq[t * ldx + c] = (int16_t)(sg[c] * lim);
                for (size_t b = 0; b < nb; b++)
                    xs[t * nb + b] = ldexpf(1.0f + (float)((t + b) % 8) / 8.0f, -14);
            }
        } else {
            ref->quantize_i16_act(Xq, xs, X, cols, n, ldx, ldx, KVL_I16_BLOCK, lim);
        }
    }
    for (size_t i = 0; i < n * ldy; i++)
        Y[i] = Yr[i] = 12345.0f;
    const kvl_kernels *tabs[2] = {K, ref};
    float *outs[2] = {Y, Yr};
    for (int k = 0; k < 2; k++) {
        if (mode == Q4_F32)
            tabs[k]->matmul_q4(outs[k], ldy, W, S, rows, cols, X, ldx, n);
        else if (mode == Q4_XB)
            tabs[k]->matmul_q4_xb(outs[k], ldy, W, S, rows, cols, X, ldx, n);
        else if (mode == Q4_I16)
            tabs[k]->matmul_q4_i16(outs[k], ldy, W, S, rows, cols, Xq, xs, ldx, n);
        else
            tabs[k]->matmul_q4_i8(outs[k], ldy, W, S, rows, cols, Xq, xs, ldx, n);
    }
    int ok = 1, ok_ref = 1, ok_gap = 1;
    double bad_a = 0, bad_b = 0;
    for (size_t t = 0; t < n; t++) {
        for (size_t r = 0; r < rows; r++) {
            const double y = Y[t * ldy + r], yr = Yr[t * ldy + r];
            double exact = 0.0, mag = 0.0;
            for (size_t c = 0; c < cols; c++) {
                const double w = (double)(q4_nibble(W, cols, r, c) - 8) * q4_scale(S, cols, r, c);
                const double xv = integer ? (double)Xq[t * ldx + c] * (double)xs[t * nb + c / 64]
                                  : xb    ? bf16_round_daz_independent(X[t * ldx + c])
                                          : (double)X[t * ldx + c];
                exact += w * xv;
                mag += fabs(w * xv);
            }
            if (integer) {
                float acc = 0.0f;
                for (size_t b = 0; b < nb; b++) {
                    int64_t s0 = 0, s1 = 0;
                    for (size_t c = 64 * b; c < 64 * b + 32; c++)
                        s0 += (int64_t)(q4_nibble(W, cols, r, c) - 8) * Xq[t * ldx + c];
                    float p = (float)s0 * (float)q4_scale(S, cols, r, 64 * b);
                    if (64 * b + 32 < cols) {
                        for (size_t c = 64 * b + 32; c < 64 * b + 64; c++)
                            s1 += (int64_t)(q4_nibble(W, cols, r, c) - 8) * Xq[t * ldx + c];
                        const float p1 = (float)s1 * (float)q4_scale(S, cols, r, 64 * b + 32);
                        p = p + p1;
                    }
                    const float q = p * xs[t * nb + b];
                    acc = acc + q;
                }
                if (f_to_bits(Y[t * ldy + r]) != f_to_bits(acc) || f_to_bits(Yr[t * ldy + r]) != f_to_bits(acc)) {
                    ok = 0;
                    bad_a = y;
                    bad_b = acc;
                }
                if (fabs(yr - exact) > ((double)nb + 6.0) * U * mag + 1e-30) {
                    ok_ref = 0;
                    bad_a = yr;
                    bad_b = exact;
                }
            } else {
                const double b_simd = ((double)cols / 8.0 + 16.0) * U * mag + 1e-30;
                const double b_ref = ((double)cols + 2.0) * U * mag + 1e-30;
                if (fabs(yr - exact) > b_ref) {
                    ok_ref = 0;
                    bad_a = yr;
                    bad_b = exact;
                }
                if (K != ref && (fabs(y - exact) > b_simd || fabs(y - yr) > b_simd + b_ref)) {
                    ok = 0;
                    bad_a = y;
                    bad_b = exact;
                }
            }
        }
        for (size_t r = rows; r < ldy; r++)
            if (Y[t * ldy + r] != 12345.0f)
                ok_gap = 0;
    }
    char what[128];
    snprintf(what, sizeof what, "%s%s rows=%zu cols=%zu n=%zu", q4_name[mode], extreme ? " (extreme)" : "", rows,
             cols, n);
    check(ok, K->name, what, "got %.9g want %.9g", bad_a, bad_b);
    if (K == ref)
        check(ok_ref, "scalar", what, "reference %.9g, exact %.9g", bad_a, bad_b);
    check(ok_gap, K->name, what, "wrote outside rows (%g %g)", 0, 0);
    free(W);
    free(S);
    free(X);
    free(Xq);
    free(xs);
    free(Y);
    free(Yr);
    free(sg);
}

/* ---- vector ops ------------------------------------------------------------------------ */

/* q8_to_f32 against its definition, (float)w * scale rounded once, bit for bit, over every int8
 * (the -128 the packer never writes included), with an element past n left alone. */
static void test_q8_to_f32(const kvl_kernels *K, size_t n)
{
    int8_t *w = (int8_t *)xmalloc(n + 1);
    float *y = (float *)xmalloc((n + 1) * sizeof(float));
    const float scale = 0.00731f + (float)(n % 7) * 1e-3f;
    for (size_t i = 0; i < n + 1; i++) {
        w[i] = (int8_t)(int)((i * 37u + n) % 256u - 128u);
        y[i] = -1.0f;
    }
    K->q8_to_f32(y, w, scale, n);
    int ok = y[n] == -1.0f;
    for (size_t i = 0; i < n; i++)
        if (f_to_bits(y[i]) != f_to_bits((float)((double)w[i] * (double)scale)))
            ok = 0;
    char what[64];
    snprintf(what, sizeof what, "q8_to_f32 n=%zu", n);
    check(ok, K->name, what, "(%g %g)", 0, 0);
    free(w);
    free(y);
}

static void test_vec(const kvl_kernels *K, size_t n)
{
    float *a = (float *)xmalloc((n + 1) * sizeof(float));
    float *b = (float *)xmalloc((n + 1) * sizeof(float));
    float *y = (float *)xmalloc((n + 1) * sizeof(float));
    for (size_t i = 0; i < n + 1; i++) {
        a[i] = rnd_normalish();
        b[i] = rnd_normalish();
        y[i] = rnd_normalish();
    }
    double exact = 0.0, mag = 0.0;
    for (size_t i = 0; i < n; i++) {
        exact += (double)a[i] * b[i];
        mag += fabs((double)a[i] * b[i]);
    }
    float d = K->dot_f32(a, b, n);
    char what[64];
    snprintf(what, sizeof what, "dot_f32 n=%zu", n);
    check(fabs(d - exact) <= ((double)n + 2.0) * U * mag + 1e-30, K->name, what, "got %g want %g", d,
          exact);

    float a0 = rndf();
    float *y0 = (float *)xmalloc((n + 1) * sizeof(float));
    memcpy(y0, y, (n + 1) * sizeof(float));
    K->axpy_f32(y, a0, a, n);
    int ok = y[n] == y0[n]; /* untouched past n */
    for (size_t i = 0; i < n; i++) {
        double e = (double)y0[i] + (double)a0 * a[i];
        /* mul+add: 2 roundings; FMA: 1 */
        if (fabs(y[i] - e) > 2.0 * U * (fabs((double)y0[i]) + fabs((double)a0 * a[i])) + 1e-38)
            ok = 0;
    }
    snprintf(what, sizeof what, "axpy_f32 n=%zu", n);
    check(ok, K->name, what, "(%g %g)", 0, 0);
    free(a);
    free(b);
    free(y);
    free(y0);
}

/* axpy_rows_f32: nh heads x np rows over n columns, strided: bit-identical to the table's own
 * axpy_f32 calls in row order (its definition), padding untouched, and within np + 1 roundings of
 * the exact sum (double). */
static void test_axpy_rows(const kvl_kernels *K, size_t nh, size_t np, size_t n)
{
    const size_t ldy = n + 2, lda = np + 1, ldx = n + 3;
    float *Y = (float *)xmalloc(nh * ldy * sizeof(float)), *Y2 = (float *)xmalloc(nh * ldy * sizeof(float));
    float *A = (float *)xmalloc(nh * lda * sizeof(float)), *X = (float *)xmalloc((np ? np : 1) * ldx * sizeof(float));
    for (size_t i = 0; i < nh * ldy; i++)
        Y[i] = Y2[i] = rnd_normalish();
    for (size_t i = 0; i < nh * lda; i++)
        A[i] = rndf();
    for (size_t i = 0; i < np * ldx; i++)
        X[i] = rnd_normalish();
    K->axpy_rows_f32(Y, ldy, A, lda, nh, X, ldx, np, n);
    int same = 1, close = 1;
    for (size_t h = 0; h < nh; h++) {
        for (size_t c = 0; c < n; c++) {
            double e = Y2[h * ldy + c], mag = fabs(e);
            for (size_t p = 0; p < np; p++) {
                e += (double)A[h * lda + p] * X[p * ldx + c];
                mag += fabs((double)A[h * lda + p] * X[p * ldx + c]);
            }
            if (fabs(Y[h * ldy + c] - e) > (double)(np + 1) * U * mag + 1e-37)
                close = 0;
        }
        for (size_t p = 0; p < np; p++)
            K->axpy_f32(Y2 + h * ldy, A[h * lda + p], X + p * ldx, n);
    }
    same = memcmp(Y, Y2, nh * ldy * sizeof(float)) == 0;
    char what[80];
    snprintf(what, sizeof what, "axpy_rows_f32 heads=%zu rows=%zu cols=%zu", nh, np, n);
    check(same, K->name, what, "differs from axpy_f32 calls (%g %g)", 0, 0);
    check(close, K->name, what, "off the exact sum (%g %g)", 0, 0);
    free(Y);
    free(Y2);
    free(A);
    free(X);
}

/* Expected bf16 bits for hand-picked edge cases, derived from the IEEE definition by hand. */
static const struct {
    uint32_t in;
    uint16_t out;
} bf16_cases[] = {
    {0x3F800000u, 0x3F80}, /* 1.0 */
    {0x3F808000u, 0x3F80}, /* tie, even kept bit 0 -> down */
    {0x3F818000u, 0x3F82}, /* tie, odd -> up */
    {0x3F808001u, 0x3F81}, /* just above tie -> up */
    {0x3F807FFFu, 0x3F80}, /* just below tie -> down */
    {0xBF818000u, 0xBF82}, /* negative tie, odd -> away (magnitude up) */
    {0x7F7FFFFFu, 0x7F80}, /* FLT_MAX rounds to +inf */
    {0x7F7F7FFFu, 0x7F7F}, /* largest value that stays finite */
    {0x7F800000u, 0x7F80}, /* +inf */
    {0xFF800000u, 0xFF80}, /* -inf */
    {0x00000000u, 0x0000}, /* +0 */
    {0x80000000u, 0x8000}, /* -0 */
    {0x00000001u, 0x0000}, /* smallest denormal -> 0 */
    {0x00008000u, 0x0000}, /* denormal tie, even -> down */
    {0x00018000u, 0x0002}, /* denormal tie, odd -> up */
    {0x00008001u, 0x0001}, /* denormal above tie */
    {0x007FFFFFu, 0x0080}, /* largest denormal -> smallest normal */
    {0x807FFFFFu, 0x8080},
};

static int is_bf16_nan(uint16_t h)
{
    return (h & 0x7F80) == 0x7F80 && (h & 0x007F) != 0;
}

/* softmax and gelu_tanh against their scalar references (expf/tanhf): rows of attention-like
 * scores spanning -100..+30 with masked (-inf) entries, a fully masked row, and GELU inputs over
 * the whole useful range including the saturated tails. */
static void test_exp_based(const kvl_kernels *K, size_t n)
{
    float *x = (float *)xmalloc((n + 1) * sizeof(float));
    float *y = (float *)xmalloc((n + 1) * sizeof(float));
    char what[64];
    for (int pass = 0; pass < 3; pass++) {
        for (size_t i = 0; i < n; i++) {
            float v = rndf();
            x[i] = pass == 2 ? -INFINITY : 30.0f * v * v * v - (i % 7 == 0 ? 70.0f : 0.0f);
            if (pass == 1 && i % 5 == 3) x[i] = -INFINITY;
        }
        memcpy(y, x, n * sizeof(float));
        kvl_softmax(y, n);
        K->softmax(x, n);
        double worst = 0.0, total = 0.0;
        for (size_t i = 0; i < n; i++) {
            worst = fmax(worst, fabs((double)x[i] - y[i]) / fmax((double)y[i], 1e-30));
            total += x[i];
        }
        snprintf(what, sizeof what, "softmax n=%zu pass %d", n, pass);
        /* entries below 1e-30 of the row's mass are compared absolutely */
        check(worst <= 2e-6 || n == 0, K->name, what, "max rel err %g (sum %g)", worst, total);
        check(n == 0 || fabs(total - 1.0) <= 1e-5, K->name, what, "sums to %g (max rel err %g)",
              total, worst);
    }
    for (size_t i = 0; i < n; i++)
        x[i] = 12.0f * rndf() * (i % 3 == 0 ? 1.0f : 0.25f);
    memcpy(y, x, n * sizeof(float));
    kvl_gelu_tanh(y, n);
    K->gelu_tanh(x, n);
    double worst = 0.0;
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)x[i] - y[i]) / fmax(fabs((double)y[i]), 1.0));
    snprintf(what, sizeof what, "gelu_tanh n=%zu", n);
    /* relative to the activation scale (>= 1): the reference's 1 + tanhf(u) itself cancels to
     * ~1e-7 absolute for negative inputs */
    check(worst <= 1e-6, K->name, what, "max err %g (relative to max(|y|, 1)) %g", worst, 0);
    free(x);
    free(y);
}

/* ---- blocked GEMM (kvl_gemm_bf16 over the table's gemm_tile) ---------------------------- */

/* kernels.h defines the GEMM's order exactly: per output, each chunk of KVL_GEMM_KC columns
 * summed in column order from 0 (fused on the x86 sets, product rounded then added on scalar and
 * SIMD128), chunk sums added to the output in order. So every table must match this evaluation
 * of the definition bit for bit, give the same bits for any row range and token subset (the
 * engine's thread split and batching), and be within (min(cols, KC) + chunks + 1) u S of the
 * exact sum. */
static float gemm_definition(int fused, const uint16_t *w, const float *x, size_t cols)
{
    float y = 0.0f;
    for (size_t k0 = 0; k0 < cols; k0 += KVL_GEMM_KC) {
        float acc = 0.0f;
        for (size_t k = k0; k < cols && k < k0 + KVL_GEMM_KC; k++) {
            const float wv = (float)bf16_value(w[k]);
            if (fused) {
                acc = fmaf(wv, x[k], acc);
            } else {
                const float p = wv * x[k];
                acc = acc + p;
            }
        }
        y = k0 == 0 ? acc : y + acc;
    }
    return y;
}

static void test_gemm(const kvl_kernels *K, size_t rows, size_t cols, size_t n)
{
    const int fused = strncmp(K->name, "avx", 3) == 0;
    const size_t ldx = cols + 5, ldy = rows + 3;
    uint16_t *w = xmalloc(rows * cols * sizeof *w);
    float *x = xmalloc(n * ldx * sizeof *x), *y = xmalloc(n * ldy * sizeof *y);
    float *y2 = xmalloc(n * ldy * sizeof *y2);
    float *work = xmalloc(KVL_GEMM_WORK_FLOATS * sizeof *work);
    for (size_t i = 0; i < rows * cols; i++)
        w[i] = (uint16_t)(f_to_bits(rnd_normalish() * 0.05f) >> 16);
    for (size_t i = 0; i < n * ldx; i++)
        x[i] = rnd_normalish();
    kvl_gemm_bf16(K, y, ldy, w, rows, cols, x, ldx, n, work);
    /* the same product cut as a thread split (rows from an odd offset) and in token batches */
    const size_t rsplit = rows / 3, tsplit = n / 2;
    kvl_gemm_bf16(K, y2, ldy, w, rsplit, cols, x, ldx, tsplit, work);
    kvl_gemm_bf16(K, y2 + rsplit, ldy, w + rsplit * cols, rows - rsplit, cols, x, ldx, tsplit, work);
    kvl_gemm_bf16(K, y2 + tsplit * ldy, ldy, w, rows, cols, x + tsplit * ldx, ldx, n - tsplit, work);
    const double chunks = (double)((cols + KVL_GEMM_KC - 1) / KVL_GEMM_KC);
    const double factor = (double)(cols < KVL_GEMM_KC ? cols : KVL_GEMM_KC) + chunks + 1.0;
    int exact_ok = 1, split_ok = 1, bound_ok = 1;
    double worst = 0.0;
    for (size_t t = 0; t < n; t++)
        for (size_t r = 0; r < rows; r++) {
            const float got = y[t * ldy + r];
            const float def = gemm_definition(fused, w + r * cols, x + t * ldx, cols);
            if (f_to_bits(got) != f_to_bits(def))
                exact_ok = 0;
            if (f_to_bits(got) != f_to_bits(y2[t * ldy + r]))
                split_ok = 0;
            double exact = 0.0, mag = 0.0;
            for (size_t c = 0; c < cols; c++) {
                const double v = bf16_value(w[r * cols + c]) * (double)x[t * ldx + c];
                exact += v;
                mag += fabs(v);
            }
            const double err = fabs((double)got - exact), bound = factor * U * mag + 1e-37;
            if (!(err <= bound))
                bound_ok = 0;
            worst = fmax(worst, err / bound);
        }
    char what[96];
    snprintf(what, sizeof what, "gemm_bf16 rows=%zu cols=%zu n=%zu: the definition's bits", rows, cols, n);
    check(exact_ok, K->name, what, "(%g %g)", 0, 0);
    snprintf(what, sizeof what, "gemm_bf16 rows=%zu cols=%zu n=%zu: same bits split", rows, cols, n);
    check(split_ok, K->name, what, "(%g %g)", 0, 0);
    snprintf(what, sizeof what, "gemm_bf16 rows=%zu cols=%zu n=%zu: bound", rows, cols, n);
    check(bound_ok, K->name, what, "worst err/bound %g (%g)", worst, 0);
    free(w), free(x), free(y), free(y2), free(work);
}

static void test_bf16(const kvl_kernels *K, const kvl_kernels *ref)
{
    size_t ncase = sizeof bf16_cases / sizeof bf16_cases[0];
    /* Edge cases at every position of a vector (lane and tail handling). */
    for (size_t len = 1; len <= 40; len += 13) {
        float in[64];
        uint16_t out[64];
        for (size_t k = 0; k < ncase; k++) {
            for (size_t i = 0; i < len; i++)
                in[i] = bits_to_f(bf16_cases[(k + i) % ncase].in);
            K->f32_to_bf16(out, in, len);
            int ok = 1;
            for (size_t i = 0; i < len; i++)
                if (out[i] != bf16_cases[(k + i) % ncase].out)
                    ok = 0;
            check(ok, K->name, "f32_to_bf16 edge cases", "(%g %g)", (double)len, (double)k);
        }
    }
    /* NaNs: quiet NaN out, sign kept, never an infinity (0x7F800001 truncates to inf bits). */
    uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu, 0x7FFFFFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        float f = bits_to_f(nans[i]);
        uint16_t h;
        K->f32_to_bf16(&h, &f, 1);
        check(is_bf16_nan(h) && (h >> 15) == (nans[i] >> 31), K->name, "f32_to_bf16 NaN",
              "in %g out %g", (double)nans[i], (double)h);
        check(is_bf16_nan(kvl_float_to_bf16(f)), "helper", "kvl_float_to_bf16 NaN", "(%g %g)", 0, 0);
        check(isnan(kvl_bf16_round(f)), "helper", "kvl_bf16_round NaN", "(%g %g)", 0, 0);
    }
    /* Random bit patterns (all classes) must match the scalar table bit for bit. */
    size_t n = 1027;
    float *in = (float *)xmalloc(n * sizeof(float));
    uint16_t *o = (uint16_t *)xmalloc(n * sizeof(uint16_t));
    uint16_t *orf = (uint16_t *)xmalloc(n * sizeof(uint16_t));
    float *back = (float *)xmalloc(n * sizeof(float));
    for (int rep = 0; rep < 20; rep++) {
        for (size_t i = 0; i < n; i++)
            in[i] = bits_to_f(rnd32() ^ (rnd32() << 16));
        K->f32_to_bf16(o, in, n);
        ref->f32_to_bf16(orf, in, n);
        int same = memcmp(o, orf, n * sizeof(uint16_t)) == 0;
        /* Rounding is to nearest: |bf16(x) - x| <= half a bf16 ulp for finite results. */
        int nearest = 1;
        for (size_t i = 0; i < n; i++) {
            double x = in[i], h = bf16_value(o[i]);
            if (isnan(x) || isinf(h))
                continue;
            double ulp = ldexp(1.0, (int)(((o[i] >> 7) & 0xFF) ? ((o[i] >> 7) & 0xFF) : 1) - 127 - 7);
            if (fabs(h - x) > 0.5 * ulp)
                nearest = 0;
        }
        check(same, K->name, "f32_to_bf16 random bits == scalar", "(%g %g)", 0, 0);
        check(nearest, K->name, "f32_to_bf16 within half ulp", "(%g %g)", 0, 0);
        K->bf16_to_f32(back, o, n);
        int exact = 1;
        for (size_t i = 0; i < n; i++) {
            uint32_t want = (uint32_t)o[i] << 16;
            if (f_to_bits(back[i]) != want)
                exact = 0;
        }
        check(exact, K->name, "bf16_to_f32 exact", "(%g %g)", 0, 0);
    }
    free(in);
    free(o);
    free(orf);
    free(back);
}

/* ---- scalar helpers vs double formulas --------------------------------------------------- */

static void test_helpers(void)
{
    const size_t n = 1000;
    float x[1000], y[1000], w[1000], b[1000], up[1000];
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)(((double)i - 500.0) / 50.0); /* [-10, 10) */
        up[i] = rndf();
        w[i] = rndf();
        b[i] = rndf();
    }
    /* Each float formula has a handful of roundings on |value|-sized quantities, plus library
     * functions accurate to a few ulp; where 1 + tanh / 1 + erf cancels (x << 0) the absolute
     * error scales with |x| * u. Hence: |f - exact| <= 16 u |exact| + 8 u |x|. */
    float g[1000];
    memcpy(g, x, sizeof g);
    kvl_gelu_tanh(g, n);
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        double e = 0.5 * v * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (v + 0.044715 * v * v * v)));
        if (fabs(g[i] - e) > 16 * U * fabs(e) + 8 * U * fabs(v))
            ok = 0;
    }
    check(ok, "helper", "gelu_tanh vs double", "(%g %g)", 0, 0);
    memcpy(g, x, sizeof g);
    kvl_gelu_erf(g, n);
    ok = 1;
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        double e = 0.5 * v * (1.0 + erf(v / sqrt(2.0)));
        if (fabs(g[i] - e) > 16 * U * fabs(e) + 8 * U * fabs(v))
            ok = 0;
    }
    check(ok, "helper", "gelu_erf vs double", "(%g %g)", 0, 0);
    memcpy(g, x, sizeof g);
    kvl_silu_mul(g, up, n);
    ok = 1;
    for (size_t i = 0; i < n; i++) {
        double v = x[i];
        double e = v / (1.0 + exp(-v)) * up[i];
        if (fabs(g[i] - e) > 16 * U * fabs(e) + 1e-30)
            ok = 0;
    }
    check(ok, "helper", "silu_mul vs double", "(%g %g)", 0, 0);

    /* softmax: including large logits (overflow without max subtraction) and masked -inf. */
    for (int variant = 0; variant < 3; variant++) {
        size_t m = variant == 0 ? 1 : variant == 1 ? 257 : 1000;
        for (size_t i = 0; i < m; i++)
            g[i] = variant == 2 ? 80.0f + 10.0f * rndf() : 4.0f * rndf();
        if (variant == 1)
            g[3] = g[100] = -INFINITY;
        double mx = -INFINITY, sum = 0.0;
        for (size_t i = 0; i < m; i++)
            mx = fmax(mx, g[i]);
        double e[1000];
        for (size_t i = 0; i < m; i++)
            sum += (e[i] = exp((double)g[i] - mx));
        kvl_softmax(g, m);
        double s = 0.0;
        ok = 1;
        for (size_t i = 0; i < m; i++) {
            s += g[i];
            /* expf (few ulp) + FP32 sum of m terms (m u) + one reciprocal */
            if (fabs(g[i] - e[i] / sum) > ((double)m + 8.0) * U * (e[i] / sum) + 1e-45)
                ok = 0;
            if (!(g[i] >= 0.0f))
                ok = 0;
        }
        if (fabs(s - 1.0) > ((double)m + 8.0) * U)
            ok = 0;
        check(ok, "helper", "softmax vs double, sums to 1", "n=%g sum=%g", (double)m, s);
    }
    for (size_t i = 0; i < 5; i++)
        g[i] = -INFINITY;
    kvl_softmax(g, 5);
    check(g[0] == 0.2f && g[4] == 0.2f, "helper", "softmax all masked is uniform", "%g %g", g[0], 0);

    /* rmsnorm / layernorm: double statistics internally; a few roundings per output. */
    for (size_t i = 0; i < n; i++)
        x[i] = 3.0f + rnd_normalish();
    kvl_rmsnorm(y, x, w, n, 1e-6f);
    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    double inv = 1.0 / sqrt(ss / n + 1e-6);
    ok = 1;
    for (size_t i = 0; i < n; i++) {
        double e = x[i] * inv * w[i];
        if (fabs(y[i] - e) > 4 * U * fabs(e) + 1e-30)
            ok = 0;
    }
    check(ok, "helper", "rmsnorm vs double", "(%g %g)", 0, 0);
    kvl_layernorm(y, x, w, b, n, 1e-5f);
    double mean = 0.0, var = 0.0;
    for (size_t i = 0; i < n; i++)
        mean += x[i];
    mean /= n;
    for (size_t i = 0; i < n; i++)
        var += (x[i] - mean) * (x[i] - mean);
    var /= n;
    ok = 1;
    for (size_t i = 0; i < n; i++) {
        double nv = (x[i] - mean) / sqrt(var + 1e-5);
        double e = nv * w[i] + b[i];
        /* x - mean cancels: error relative to (|x| + |mean|) * inv_std, not to the result */
        if (fabs(y[i] - e) >
            8 * U * ((fabs(x[i]) + fabs(mean)) / sqrt(var + 1e-5) * fabs(w[i]) + fabs(b[i])))
            ok = 0;
    }
    check(ok, "helper", "layernorm vs double", "(%g %g)", 0, 0);

    check(kvl_bf16_round(1.00390625f) == 1.0f, "helper", "bf16_round tie to even", "%g %g",
          kvl_bf16_round(1.00390625f), 1.0);
    check(kvl_bf16_round(1.01171875f) == 1.015625f, "helper", "bf16_round tie odd up", "%g %g",
          kvl_bf16_round(1.01171875f), 1.015625);
    check(kvl_bf16_to_float(0x4049) == 3.140625f, "helper", "bf16_to_float", "%g %g",
          kvl_bf16_to_float(0x4049), 3.140625);
}

int main(void)
{
    const kvl_kernels *ref = kvl_kernels_select(1);
    if (!ref || !kvl_kernels_supported(1)) {
        printf("test_kernels: scalar table missing\n");
        return 1;
    }
    check(kvl_kernels_select(0) != NULL, "select", "best level available", "(%g %g)", 0, 0);
    check(kvl_kernels_select(5) == NULL && kvl_kernels_select(-1) == NULL, "select",
          "invalid level rejected", "(%g %g)", 0, 0);
#if defined(__wasm__)
    check(kvl_kernels_select(2) == NULL && kvl_kernels_select(3) == NULL, "select",
          "x86 levels rejected in WebAssembly", "(%g %g)", 0, 0);
#else
    check(kvl_kernels_select(4) == NULL, "select", "simd128 rejected outside WebAssembly", "(%g %g)", 0, 0);
#endif
    /* kvl_kernels_by_name / kvl_kernels_compiled_names agree with the levels */
    {
        const char *const *names = kvl_kernels_compiled_names();
        int ok = names && names[0] && strcmp(names[0], "scalar") == 0;
        for (size_t i = 0; ok && names[i]; i++) {
            const kvl_kernels *T = kvl_kernels_by_name(names[i]);
            if (T && strcmp(T->name, names[i]) != 0)
                ok = 0;
            if (i > 4)
                ok = 0;
        }
        ok = ok && kvl_kernels_by_name("scalar") == ref && kvl_kernels_by_name("nonsense") == NULL &&
             kvl_kernels_by_name(NULL) == NULL;
        for (int level = 1; level <= 4; level++) {
            const kvl_kernels *T = kvl_kernels_select(level);
            if (T && kvl_kernels_by_name(T->name) != T)
                ok = 0;
        }
        check(ok, "select", "kvl_kernels_by_name / kvl_kernels_compiled_names", "(%g %g)", 0, 0);
        /* a set may leave entries empty (kernels.h KVL_KERNEL_ENTRIES); as served, none is */
        int full = 1;
        for (size_t i = 0; names && names[i]; i++) {
            const kvl_kernels *T = kvl_kernels_by_name(names[i]);
            if (!T)
                continue;
#define CHECK_ENTRY(entry) \
    if (!T->entry)         \
        full = 0;
            KVL_KERNEL_ENTRIES(CHECK_ENTRY)
#undef CHECK_ENTRY
            if (T->gemm_mr <= 0 || T->gemm_nr <= 0)
                full = 0;
        }
        check(full, "select", "every served set has every entry (empty ones from scalar)", "(%g %g)", 0, 0);
        /* every set this build has is a row of kvl_core.h KVL_KERNEL_SET_ROWS (the names the host
         * knows), at the level kvl_kernels_select gives it */
        int known = 1, nsets = 0;
        const kvl_const_desc *sets = kvl_constants(KVL_CONST_KERNEL_SETS, &nsets);
        for (size_t i = 0; names && names[i]; i++) {
            int found = 0;
            for (int j = 0; sets && j < nsets; j++)
                if (strcmp(sets[j].name, names[i]) == 0) {
                    const kvl_kernels *L = kvl_kernels_select(sets[j].value);
                    found = 1;
                    /* the level's best set is this one, or another of the same level */
                    if (kvl_kernels_supported(sets[j].value) && !L)
                        known = 0;
                }
            if (!found)
                known = 0;
        }
        check(known, "select", "every compiled set is a row of KVL_KERNEL_SET_ROWS", "(%g %g)", 0, 0);
    }
    test_helpers();
    test_quantize_rows_i16();

    static const size_t rows_list[] = {1, 3, 31, 64, 65, 257};
    static const size_t cols_list[] = {1, 3, 31, 64, 65, 257, 2048};
    static const size_t n_list[] = {1, 3, 4, 9, 17};
    /* Every level the CPU supports; on an AVX-512 machine with BF16 dot products also the
     * AVX-512 table that CPUs without them get. */
    const kvl_kernels *tables[5];
    int n_tables = 0;
    for (int level = 1; level <= 4; level++) {
        if (!kvl_kernels_supported(level)) {
            printf("test_kernels: level %d not supported on this CPU/build, not tested\n", level);
            continue;
        }
        const kvl_kernels *K = kvl_kernels_select(level);
        check(K != NULL, "select", "supported level has a table", "(%g %g)", (double)level, 0);
        if (K)
            tables[n_tables++] = K;
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
        if (K && level == 3 && strcmp(K->name, "avx512") != 0)
            tables[n_tables++] = kvl_kernels_by_name("avx512");
#endif
#if defined(KVL_WASM_RELAXED) /* the relaxed build: level 4 is simd128-relaxed, test plain simd128 too */
        if (K && level == 4 && strcmp(K->name, "simd128") != 0)
            tables[n_tables++] = kvl_kernels_by_name("simd128");
#endif
    }
    for (int ti = 0; ti < n_tables; ti++) {
        const kvl_kernels *K = tables[ti];
        /* BF16-activation shapes past the blocking limits: > 2048 columns (chunked sums), > 32
         * tokens (several L2 blocks), > 16384 columns in decode (chunked activation). */
        static const size_t xb_shapes[][3] = {{5, 4200, 37}, {9, 16500, 1}, {7, 300, 70},
                                              {4, 2048, 33}, {66, 1408, 40}, {16, 32, 5}, {16, 64, 5}, {32, 128, 5}, {64, 32, 5}, {16, 64, 1}, {4096, 64, 5}, {16,32,2}, {48, 64, 5}};
        for (int kind = W_BF16_XB; kind <= W_Q8_XB; kind++)
            for (size_t i = 0; i < sizeof xb_shapes / sizeof xb_shapes[0]; i++)
                test_matmul(K, ref, kind, xb_shapes[i][0], xb_shapes[i][1], xb_shapes[i][2]);
        for (int kind = 0; kind < W_KINDS; kind++)
            for (size_t a = 0; a < sizeof rows_list / sizeof rows_list[0]; a++)
                for (size_t b = 0; b < sizeof cols_list / sizeof cols_list[0]; b++)
                    for (size_t c = 0; c < sizeof n_list / sizeof n_list[0]; c++) {
                        /* keep the run short: the largest shapes only with few tokens */
                        if (rows_list[a] * cols_list[b] * n_list[c] > 2500000)
                            continue;
                        test_matmul(K, ref, kind, rows_list[a], cols_list[b], n_list[c]);
                    }
        static const size_t icols[] = {1,   3,   7,   8,   15,  16,   17,   31,   32,   33,   63,  64,  65,
                                       100, 127, 129, 257, 511, 512, 513, 1000, 1024, 1025, 1536, 2048, 2051};
        /* 17, 29 and 43 rows: simd128's decode takes rows in groups of eight passes `step` rows
         * apart (step 2-4 at these widths, then what is left at a smaller step) */
        static const size_t irows[] = {1, 3, 4, 5, 9, 13, 17, 29, 43};
        for (size_t b = 0; b < sizeof icols / sizeof icols[0]; b++) {
            for (size_t nn = 1; nn <= 17; nn++) {
                test_quantize_i16(K, ref, icols[b], nn, icols[b], KVL_I16_MAX);
                test_quantize_i16(K, ref, icols[b], nn, KVL_I16_BLOCK, KVL_I16_Q8_MAX);
                test_quantize_i16(K, ref, icols[b], nn, KVL_I16_BLOCK, KVL_I8_MAX);
                for (size_t a = 0; a < sizeof irows / sizeof irows[0]; a++) {
                    /* all n in 1..17 on a few row counts, a subset elsewhere (run time) */
                    if (irows[a] > 5 && nn % 4 != 1 && nn != 2)
                        continue;
                    test_int_matmul(K, ref, 1, irows[a], icols[b], nn, 0);
                    test_int_matmul(K, ref, 0, irows[a], icols[b], nn, 0);
                    if (nn <= 2) /* matmul_q8_i8: its own code decodes (n = 1), n > 1 is matmul_q8_i16's */
                        test_int_matmul(K, ref, 2, irows[a], icols[b], nn, 0);
                }
            }
            test_int_matmul(K, ref, 1, 9, icols[b], 5, 1);
            test_int_matmul(K, ref, 0, 9, icols[b], 5, 1);
            test_int_matmul(K, ref, 1, 5, icols[b], 1, 1);
            test_int_matmul(K, ref, 0, 5, icols[b], 1, 1);
            test_int_matmul(K, ref, 2, 9, icols[b], 1, 1);
        }
        test_int_matmul(K, ref, 1, 33, 5000, 3, 1);
        test_int_matmul(K, ref, 0, 33, 5000, 3, 0);
        test_int_matmul(K, ref, 1, 2, 16500, 1, 0);
        test_int_matmul(K, ref, 0, 2, 16500, 1, 1);
        test_int_matmul(K, ref, 2, 2, 16500, 1, 1);
        test_int_matmul(K, ref, 2, 43, 11264, 1, 0);
        report_int_accuracy(K);
        /* Q4 products: rows around the row tiles (4 / 8 rows), cols = 32 (one group: the last
         * activation block holds one group), 64, 96, 160, 192 and 224 (the decode's 128- or
         * 64-column steps with a last step of two or three groups), the expert widths 1408 and
         * 2048, and 1440 (45 groups); every n in 1..5 */
        static const size_t q4rows[] = {1, 3, 4, 5, 9, 13, 17, 29};
        static const size_t q4cols[] = {32, 64, 96, 160, 192, 224, 1408, 1440, 2048};
        for (int mode = Q4_F32; mode <= Q4_I8; mode++) {
            for (size_t a = 0; a < sizeof q4rows / sizeof q4rows[0]; a++)
                for (size_t b = 0; b < sizeof q4cols / sizeof q4cols[0]; b++)
                    for (size_t nn = 1; nn <= 5; nn++) {
                        if (q4cols[b] >= 1408 && q4rows[a] > 5 && nn % 2 == 0)
                            continue; /* run time */
                        test_q4(K, ref, mode, q4rows[a], q4cols[b], nn, 0);
                    }
            for (size_t b = 0; b < sizeof q4cols / sizeof q4cols[0]; b++) {
                test_q4(K, ref, mode, 13, q4cols[b], 1, 1);
                test_q4(K, ref, mode, 9, q4cols[b], 3, 1);
            }
            test_q4(K, ref, mode, 37, 2048, 1, 0); /* several row tiles of a pass */
            /* decode: SIMD128's passes of eight rows `step` apart, then of four, then the rest */
            test_q4(K, ref, mode, 70, 2048, 1, 0);
            test_q4(K, ref, mode, 33, 4160, 2, 1);
            /* decode over more than one chunk of laid-out activations (4096 columns), the last
             * chunk of two groups or of one */
            test_q4(K, ref, mode, 19, 4160, 1, 1);
            test_q4(K, ref, mode, 11, 8224, 1, 0);
        }
        static const size_t vn[] = {0, 1, 3, 15, 16, 17, 31, 33, 64, 65, 257, 2048, 2051};
        for (size_t i = 0; i < sizeof vn / sizeof vn[0]; i++) {
            test_vec(K, vn[i]);
            test_q8_to_f32(K, vn[i]);
        }
        static const size_t ah[] = {1, 2, 3, 4, 5, 8, 9}, ap[] = {0, 1, 2, 7, 65};
        static const size_t acols[] = {1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 512, 513, 576};
        for (size_t i = 0; i < sizeof ah / sizeof ah[0]; i++)
            for (size_t j = 0; j < sizeof ap / sizeof ap[0]; j++)
                for (size_t c = 0; c < sizeof acols / sizeof acols[0]; c++)
                    test_axpy_rows(K, ah[i], ap[j], acols[c]);
        for (size_t i = 0; i < sizeof vn / sizeof vn[0]; i++)
            test_exp_based(K, vn[i]);
        test_bf16(K, ref);
        /* GEMM: tails of every tile, two row blocks (KVL_GEMM_NC), column chunks (KVL_GEMM_KC)
         * with and without a tail, two token blocks (KVL_GEMM_MC) and a tail */
        static const size_t gs[][3] = {{1, 1, 1}, {3, 5, 2}, {32, 256, 12}, {33, 257, 13},
                                       {17, 300, 17}, {70, 600, 97}, {1601, 200, 25}, {385, 37, 200}};
        for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
            test_gemm(K, gs[i][0], gs[i][1], gs[i][2]);
        printf("test_kernels: level %s tested\n", K->name);
    }
    printf("test_kernels: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
