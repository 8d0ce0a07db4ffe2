/* kernels_conformance.c — the kernel self-test every backend runs (kvl doctor, the conformance
 * tests of the TypeScript host).
 *
 * Owns: kvl_kernel_set_* and kvl_kernels_conformance of kvl_core.h: every entry of one kernel
 * table against the scalar table (or, for the products, against a double-precision sum) on fixed
 * pseudo-random data, with shapes that exercise row, column and token tails, reported as JSON.
 * Does not own: the kernels (kernels_*.c), table choice (kernels_select.c). The exhaustive
 * numeric tests (edge cases, independent rounding, every shape) are tests/test_kernels.c; this
 * file is the short check that the set a user's machine picks computes what the reference does.
 *
 * Bounds (u = 2^-24). A product over k columns summed in FP32 in any order is within about
 * k*u*S of the exact sum, S = sum |w x| (Higham 3.1). SIMD tables keep >= 4 lane partial sums
 * plus a few horizontal adds, so (cols/4 + 16)*u*S holds for every order they use, while one
 * dropped or doubled term (~S/cols) is far larger. Integer-mode quantisation and the Q8 x int16
 * product are defined bit-exactly (kernels.h) and compared for equality; so are the BF16
 * conversions. The Q8 x 8-bit product also runs on weights and activations of +-127 only, the
 * edge of the 8-bit dot products' int16 pairs: an engine that computes relaxed SIMD wrongly is
 * caught here, and the host runs this report before it picks simd128-relaxed. The Q4 products
 * (matmul_q4*: cols a multiple of 32) are checked the same ways on shapes of their own, the 8-bit
 * one also on nibbles 0 and 15 with activations of +-127. The blocked GEMM (gemm_bf16: the
 * driver of kernels_gemm.c over the set's gemm_tile) sums chunks of KVL_GEMM_KC columns in column
 * order, so its bound is that order's (test_gemm). The BF16 GEMM (gemm_bf16_xb) and tile
 * (gemm_tile_bf16) are defined bit for bit (kernels.h: VDPBF16PS's order, exact products and
 * flushing) and compared for equality with that definition, written out here, as well as
 * against the double-precision sum.
 */
#include "kernels.h"
#include "kvl_core.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define U (1.0 / 16777216.0)

/* ---- kernel sets ----------------------------------------------------------------------- */

KVL_API int kvl_kernel_set_count(void)
{
    const char *const *names = kvl_kernels_compiled_names();
    int n = 0;
    while (names[n])
        n++;
    return n;
}

KVL_API const char *kvl_kernel_set_name(int index)
{
    if (index < 0 || index >= kvl_kernel_set_count())
        return NULL;
    return kvl_kernels_compiled_names()[index];
}

KVL_API int kvl_kernel_set_supported(const char *name)
{
    return name && kvl_kernels_by_name(name) != NULL;
}

KVL_API const char *kvl_kernel_set_default(void)
{
    const kvl_kernels *k = kvl_kernels_select(KVL_KERNELS_AUTO);
    return k ? k->name : "scalar";
}

/* ---- report ---------------------------------------------------------------------------- */

typedef struct report {
    char *out;
    size_t cap, len;
    int overflow, failed, n_checks;
} report;

static void emit(report *r, const char *fmt, ...)
{
    if (r->overflow)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(r->out + r->len, r->cap - r->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= r->cap - r->len) {
        r->overflow = 1;
        return;
    }
    r->len += (size_t)n;
}

/* max_err and bound are printed with %.9g; a non-finite error fails (and prints as null). */
static void check(report *r, const char *kernel, const char *shape, double max_err, double bound)
{
    int ok = isfinite(max_err) && max_err <= bound;
    if (!ok)
        r->failed++;
    emit(r, "%s{\"kernel\":\"%s\",\"shape\":\"%s\",", r->n_checks ? "," : "", kernel, shape);
    if (isfinite(max_err))
        emit(r, "\"max_err\":%.9g,", max_err);
    else
        emit(r, "\"max_err\":null,");
    emit(r, "\"bound\":%.9g,\"ok\":%s}", bound, ok ? "true" : "false");
    r->n_checks++;
}

/* ---- data ------------------------------------------------------------------------------ */

typedef struct rng {
    uint64_t s;
} rng;

static uint32_t rnd32(rng *g)
{
    g->s ^= g->s << 13;
    g->s ^= g->s >> 7;
    g->s ^= g->s << 17;
    return (uint32_t)(g->s >> 16);
}

static float rndf(rng *g) /* [-1, 1) with mixed magnitudes */
{
    float v = (float)((double)(rnd32(g) & 0xffffff) / 8388608.0 - 1.0);
    return (rnd32(g) & 7) == 0 ? v * 8.0f : v;
}

static double bf16_value(uint16_t h)
{
    return (double)kvl_bf16_to_float(h);
}

/* ---- matrix products ------------------------------------------------------------------- */

enum { P_BF16, P_Q8, P_F32, P_BF16_XB, P_Q8_XB, P_I16_I16, P_Q8_I16, P_Q8_I8, P_KINDS };
static const char *const product_name[P_KINDS] = {"matmul_bf16",    "matmul_q8",     "matmul_f32",
                                                  "matmul_bf16_xb", "matmul_q8_xb",  "matmul_i16_i16",
                                                  "matmul_q8_i16",  "matmul_q8_i8"};

typedef struct buffers {
    uint16_t *wb;   /* BF16 weights */
    int8_t *wq;     /* Q8 weights */
    float *wf;      /* FP32 weights (the BF16 values) */
    int16_t *wi;    /* int16 weights from kvl_quantize_rows_i16 */
    float *scale;   /* Q8 row scales */
    float *iscale;  /* int16 row scales */
    float *x;       /* FP32 activations [n, ldx] */
    int16_t *xq;    /* 15-bit activations [n, ldx], one scale per vector (matmul_i16_i16) */
    float *xs;      /* their scales [n] */
    int16_t *xq_ref;
    float *xs_ref;
    int16_t *xq8;   /* 16-bit activations [n, ldx], a scale per KVL_I16_BLOCK (matmul_q8_i16) */
    float *xs8;     /* their scales [n, nb] */
    int16_t *xq8_ref;
    float *xs8_ref;
    int16_t *xq7;   /* 8-bit activations (|x| <= KVL_I8_MAX) as int16, a scale per KVL_I16_BLOCK
                       (matmul_q8_i8) */
    float *xs7;
    int16_t *xq7_ref;
    float *xs7_ref;
    float *y, *y_ref;
} buffers;

static int alloc_buffers(buffers *b, size_t rows, size_t cols, size_t n, size_t ldx)
{
    memset(b, 0, sizeof *b);
    b->wb = malloc(rows * cols * sizeof *b->wb);
    b->wq = malloc(rows * cols * sizeof *b->wq);
    b->wf = malloc(rows * cols * sizeof *b->wf);
    b->wi = malloc(rows * cols * sizeof *b->wi);
    b->scale = malloc(rows * sizeof *b->scale);
    b->iscale = malloc(rows * sizeof *b->iscale);
    b->x = malloc(n * ldx * sizeof *b->x);
    b->xq = calloc(n * ldx, sizeof *b->xq);
    b->xs = malloc(n * sizeof *b->xs);
    b->xq_ref = calloc(n * ldx, sizeof *b->xq_ref);
    b->xs_ref = malloc(n * sizeof *b->xs_ref);
    const size_t nb = kvl_i16_nblocks(ldx, KVL_I16_BLOCK);
    b->xq8 = calloc(n * ldx, sizeof *b->xq8);
    b->xs8 = malloc(n * nb * sizeof *b->xs8);
    b->xq8_ref = calloc(n * ldx, sizeof *b->xq8_ref);
    b->xs8_ref = malloc(n * nb * sizeof *b->xs8_ref);
    b->xq7 = calloc(n * ldx, sizeof *b->xq7);
    b->xs7 = malloc(n * nb * sizeof *b->xs7);
    b->xq7_ref = calloc(n * ldx, sizeof *b->xq7_ref);
    b->xs7_ref = malloc(n * nb * sizeof *b->xs7_ref);
    b->y = malloc(n * rows * sizeof *b->y);
    b->y_ref = malloc(n * rows * sizeof *b->y_ref);
    return b->wb && b->wq && b->wf && b->wi && b->scale && b->iscale && b->x && b->xq && b->xs &&
           b->xq_ref && b->xs_ref && b->xq8 && b->xs8 && b->xq8_ref && b->xs8_ref && b->xq7 && b->xs7 && b->xq7_ref && b->xs7_ref && b->y && b->y_ref;
}

static void free_buffers(buffers *b)
{
    free(b->wb), free(b->wq), free(b->wf), free(b->wi), free(b->scale), free(b->iscale);
    free(b->x), free(b->xq), free(b->xs), free(b->xq_ref), free(b->xs_ref), free(b->y), free(b->y_ref);
    free(b->xq8), free(b->xs8), free(b->xq8_ref), free(b->xs8_ref);
    free(b->xq7), free(b->xs7), free(b->xq7_ref), free(b->xs7_ref);
}

/* The exact value of term (r, c) for token t, as the kernel's definition multiplies it. */
static double term(int kind, const buffers *b, size_t cols, size_t ldx, size_t r, size_t c, size_t t)
{
    size_t i = r * cols + c;
    double xv = b->x[t * ldx + c];
    switch (kind) {
    case P_BF16: return bf16_value(b->wb[i]) * xv;
    case P_Q8: return (double)b->wq[i] * xv;
    case P_F32: return (double)b->wf[i] * xv;
    case P_BF16_XB: return bf16_value(b->wb[i]) * (double)kvl_bf16_round_daz(b->x[t * ldx + c]);
    case P_Q8_XB: return (double)b->wq[i] * (double)kvl_bf16_round_daz(b->x[t * ldx + c]);
    default: return (double)b->wi[i] * (double)b->xq[t * ldx + c]; /* P_I16_I16 */
    }
}

static double post_scale(int kind, const buffers *b, size_t r, size_t t)
{
    switch (kind) {
    case P_Q8:
    case P_Q8_XB: return b->scale[r];
    case P_I16_I16: return (double)b->iscale[r] * (double)b->xs[t];
    default: return 1.0;
    }
}

static void run_product(int kind, const kvl_kernels *K, const buffers *b, float *y, size_t rows,
                        size_t cols, size_t n, size_t ldx)
{
    switch (kind) {
    case P_BF16: K->matmul_bf16(y, rows, b->wb, rows, cols, b->x, ldx, n); break;
    case P_Q8: K->matmul_q8(y, rows, b->wq, b->scale, rows, cols, b->x, ldx, n); break;
    case P_F32: K->matmul_f32(y, rows, b->wf, rows, cols, b->x, ldx, n); break;
    case P_BF16_XB: K->matmul_bf16_xb(y, rows, b->wb, rows, cols, b->x, ldx, n); break;
    case P_Q8_XB: K->matmul_q8_xb(y, rows, b->wq, b->scale, rows, cols, b->x, ldx, n); break;
    case P_I16_I16: K->matmul_i16_i16(y, rows, b->wi, b->iscale, rows, cols, b->xq, b->xs, ldx, n); break;
    case P_Q8_I16: K->matmul_q8_i16(y, rows, b->wq, b->scale, rows, cols, b->xq8, b->xs8, ldx, n); break;
    default: K->matmul_q8_i8(y, rows, b->wq, b->scale, rows, cols, b->xq7, b->xs7, ldx, n); break;
    }
}

static int test_products(report *rep, const kvl_kernels *K, const kvl_kernels *ref, rng *g,
                         size_t rows, size_t cols, size_t n)
{
    size_t ldx = cols + 3; /* activation rows not packed: the kernels must honour ldx */
    buffers b;
    if (!alloc_buffers(&b, rows, cols, n, ldx)) {
        free_buffers(&b);
        return -1;
    }
    for (size_t i = 0; i < rows * cols; i++) {
        b.wb[i] = kvl_float_to_bf16(rndf(g) * 0.05f);
        b.wf[i] = kvl_bf16_to_float(b.wb[i]);
        b.wq[i] = (int8_t)((int)(rnd32(g) % 255u) - 127);
    }
    for (size_t r = 0; r < rows; r++)
        b.scale[r] = 0.001f + 0.01f * (float)(rnd32(g) & 1023) / 1024.0f;
    for (size_t i = 0; i < n * ldx; i++)
        b.x[i] = rndf(g);
    kvl_quantize_rows_i16(b.wi, b.iscale, b.wb, rows, cols);

    char shape[64];
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu", rows, cols, n);

    /* Integer-mode activations, both ways the engine quantises: bit-identical to the reference. */
    const size_t nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    K->quantize_i16_act(b.xq, b.xs, b.x, cols, n, ldx, ldx, cols, KVL_I16_MAX);
    ref->quantize_i16_act(b.xq_ref, b.xs_ref, b.x, cols, n, ldx, ldx, cols, KVL_I16_MAX);
    K->quantize_i16_act(b.xq8, b.xs8, b.x, cols, n, ldx, ldx, KVL_I16_BLOCK, KVL_I16_Q8_MAX);
    ref->quantize_i16_act(b.xq8_ref, b.xs8_ref, b.x, cols, n, ldx, ldx, KVL_I16_BLOCK, KVL_I16_Q8_MAX);
    K->quantize_i16_act(b.xq7, b.xs7, b.x, cols, n, ldx, ldx, KVL_I16_BLOCK, KVL_I8_MAX);
    ref->quantize_i16_act(b.xq7_ref, b.xs7_ref, b.x, cols, n, ldx, ldx, KVL_I16_BLOCK, KVL_I8_MAX);
    double qdiff = 0.0;
    for (size_t t = 0; t < n; t++) {
        if (memcmp(&b.xs[t], &b.xs_ref[t], sizeof(float)) != 0)
            qdiff = fmax(qdiff, fabs((double)b.xs[t] - b.xs_ref[t]) + 1e-30);
        for (size_t k = 0; k < nb; k++)
            if (memcmp(&b.xs8[t * nb + k], &b.xs8_ref[t * nb + k], sizeof(float)) != 0)
                qdiff = fmax(qdiff, fabs((double)b.xs8[t * nb + k] - b.xs8_ref[t * nb + k]) + 1e-30);
        for (size_t k = 0; k < nb; k++)
            if (memcmp(&b.xs7[t * nb + k], &b.xs7_ref[t * nb + k], sizeof(float)) != 0)
                qdiff = fmax(qdiff, fabs((double)b.xs7[t * nb + k] - b.xs7_ref[t * nb + k]) + 1e-30);
        for (size_t c = 0; c < cols; c++) {
            qdiff = fmax(qdiff, fabs((double)b.xq[t * ldx + c] - b.xq_ref[t * ldx + c]));
            qdiff = fmax(qdiff, fabs((double)b.xq8[t * ldx + c] - b.xq8_ref[t * ldx + c]));
            qdiff = fmax(qdiff, fabs((double)b.xq7[t * ldx + c] - b.xq7_ref[t * ldx + c]));
        }
    }
    check(rep, "quantize_i16_act", shape, qdiff, 0.0);

    for (int kind = 0; kind < P_KINDS; kind++) {
        run_product(kind, K, &b, b.y, rows, cols, n, ldx);
        double worst = 0.0; /* error / bound, so shapes of every size report on one scale */
        double worst_abs = 0.0, worst_bound = 0.0;
        if (kind == P_Q8_I16 || kind == P_Q8_I8) { /* defined bit for bit by the reference */
            run_product(kind, ref, &b, b.y_ref, rows, cols, n, ldx);
            for (size_t i = 0; i < rows * n; i++)
                if (memcmp(&b.y[i], &b.y_ref[i], sizeof(float)) != 0)
                    worst_abs = fmax(worst_abs, fabs((double)b.y[i] - b.y_ref[i]) + 1e-30);
            check(rep, product_name[kind], shape, worst_abs, 0.0);
            continue;
        }
        for (size_t t = 0; t < n; t++)
            for (size_t r = 0; r < rows; r++) {
                double exact = 0.0, mag = 0.0;
                for (size_t c = 0; c < cols; c++) {
                    double v = term(kind, &b, cols, ldx, r, c, t);
                    exact += v;
                    mag += fabs(v);
                }
                double s = post_scale(kind, &b, r, t);
                exact *= s;
                mag *= fabs(s);
                double bound = ((double)cols / 4.0 + 16.0) * U * mag + 1e-37;
                double err = fabs((double)b.y[t * rows + r] - exact);
                if (!(err / bound <= worst)) {
                    worst = isfinite(err) ? err / bound : INFINITY;
                    worst_abs = err;
                    worst_bound = bound;
                }
            }
        check(rep, product_name[kind], shape, worst_abs, worst_bound);
    }
    free_buffers(&b);
    return 0;
}

/* matmul_q8_i8 at the edge of its 8-bit dot products: every weight and activation +-127, so every
 * pair of products is +-2 * 127 * 127 (the largest an int16 lane of the relaxed-SIMD and AVX2
 * dot products holds), in sign patterns that differ by row and column. 12 rows: a pass of eight
 * and one of four in the SIMD decodes; 213 columns: three blocks, then 16 and a scalar tail of 5.
 * Bit-identical to the reference, which sums in plain int32. */
static int test_q8_i8_extremes(report *rep, const kvl_kernels *K, const kvl_kernels *ref)
{
    const size_t rows = 12, cols = 213, nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    int8_t *w = malloc(rows * cols);
    float *x = malloc(cols * sizeof *x), *scale = malloc(rows * sizeof *scale);
    float *xs = malloc(nb * sizeof *xs), *y = malloc(rows * sizeof *y), *y_ref = malloc(rows * sizeof *y_ref);
    int16_t *xq = malloc(cols * sizeof *xq);
    if (!w || !x || !scale || !xs || !y || !y_ref || !xq) {
        free(w), free(x), free(scale), free(xs), free(y), free(y_ref), free(xq);
        return -1;
    }
    for (size_t r = 0; r < rows; r++) {
        scale[r] = 0.01f + 0.001f * (float)r;
        for (size_t c = 0; c < cols; c++) /* mostly one sign per row, so the sums are large */
            w[r * cols + c] = (int8_t)(((c % 7 == 3) ^ (r & 1)) ? -127 : 127);
    }
    for (size_t c = 0; c < cols; c++)
        x[c] = (c / 3) % 4 == 1 ? -1.0f : 1.0f; /* amax 1 in every block: quantised to exactly +-127 */
    ref->quantize_i16_act(xq, xs, x, cols, 1, cols, cols, KVL_I16_BLOCK, KVL_I8_MAX);
    K->matmul_q8_i8(y, rows, w, scale, rows, cols, xq, xs, cols, 1);
    ref->matmul_q8_i8(y_ref, rows, w, scale, rows, cols, xq, xs, cols, 1);
    double worst = 0.0;
    for (size_t r = 0; r < rows; r++)
        if (memcmp(&y[r], &y_ref[r], sizeof(float)) != 0)
            worst = fmax(worst, fabs((double)y[r] - y_ref[r]) + 1e-30);
    check(rep, "matmul_q8_i8", "rows=12 cols=213 n=1 |w|=|x|=127", worst, 0.0);
    free(w), free(x), free(scale), free(xs), free(y), free(y_ref), free(xq);
    return 0;
}

/* ---- Q4 products (cols a multiple of 32) ------------------------------------------------ */

/* matmul_q4 / _xb against the double-precision sum over the dequantised weights ((nibble - 8) *
 * the group's BF16 scale, both signs of scale), with the products' bound; matmul_q4_i16 / _i8 bit
 * for bit against the reference. extreme: nibbles 0 and 15 only and activations quantised to
 * +-127 / +-32767, the largest int16 pairs of the 8-bit dot products (a relaxed-SIMD engine that
 * computes them wrongly fails here). */
static int test_q4(report *rep, const kvl_kernels *K, const kvl_kernels *ref, rng *g, size_t rows, size_t cols,
                   size_t n, int extreme)
{
    const size_t ldx = cols + 3, ng = cols / 32, nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    uint8_t *w = malloc(rows * cols / 2);
    uint16_t *sc = malloc(rows * ng * sizeof *sc);
    float *x = malloc(n * ldx * sizeof *x), *y = malloc(n * rows * sizeof *y), *y_ref = malloc(n * rows * sizeof *y_ref);
    int16_t *xq = calloc(n * ldx, sizeof *xq);
    float *xs = malloc(n * nb * sizeof *xs);
    if (!w || !sc || !x || !y || !y_ref || !xq || !xs) {
        free(w), free(sc), free(x), free(y), free(y_ref), free(xq), free(xs);
        return -1;
    }
    for (size_t i = 0; i < rows * cols / 2; i++)
        w[i] = extreme ? (uint8_t)((rnd32(g) & 1 ? 0x0f : 0) | (rnd32(g) & 1 ? 0xf0 : 0)) : (uint8_t)rnd32(g);
    for (size_t i = 0; i < rows * ng; i++)
        sc[i] = kvl_float_to_bf16((0.001f + 0.01f * (float)(rnd32(g) & 1023) / 1024.0f) * ((rnd32(g) & 3) ? 1.0f : -1.0f));
    for (size_t i = 0; i < n * ldx; i++)
        x[i] = extreme ? ((rnd32(g) & 1) ? 1.0f : -1.0f) : rndf(g);
    char shape[80];
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu%s", rows, cols, n, extreme ? " nibbles 0/15" : "");
    for (int kind = 0; kind < 4; kind++) {
        static const char *const names[4] = {"matmul_q4", "matmul_q4_xb", "matmul_q4_i16", "matmul_q4_i8"};
        if (kind >= 2) {
            const int lim = kind == 3 ? KVL_I8_MAX : KVL_I16_Q8_MAX;
            ref->quantize_i16_act(xq, xs, x, cols, n, ldx, ldx, KVL_I16_BLOCK, lim);
            const kvl_kernels *T[2] = {K, ref};
            float *out[2] = {y, y_ref};
            for (int k = 0; k < 2; k++) {
                if (kind == 2)
                    T[k]->matmul_q4_i16(out[k], rows, w, sc, rows, cols, xq, xs, ldx, n);
                else
                    T[k]->matmul_q4_i8(out[k], rows, w, sc, rows, cols, xq, xs, ldx, n);
            }
            double worst = 0.0;
            for (size_t i = 0; i < rows * n; i++)
                if (memcmp(&y[i], &y_ref[i], sizeof(float)) != 0)
                    worst = fmax(worst, fabs((double)y[i] - y_ref[i]) + 1e-30);
            check(rep, names[kind], shape, worst, 0.0);
            continue;
        }
        if (kind == 0)
            K->matmul_q4(y, rows, w, sc, rows, cols, x, ldx, n);
        else
            K->matmul_q4_xb(y, rows, w, sc, rows, cols, x, ldx, n);
        double worst = 0.0, worst_abs = 0.0, worst_bound = 0.0;
        for (size_t t = 0; t < n; t++)
            for (size_t r = 0; r < rows; r++) {
                double exact = 0.0, mag = 0.0;
                for (size_t c = 0; c < cols; c++) {
                    const uint8_t byte = w[r * (cols / 2) + 16 * (c / 32) + (c % 32) % 16];
                    const int q = (c % 32 < 16 ? byte & 15 : byte >> 4) - 8;
                    const float xv = kind == 1 ? kvl_bf16_round_daz(x[t * ldx + c]) : x[t * ldx + c];
                    const double v = (double)q * bf16_value(sc[r * ng + c / 32]) * (double)xv;
                    exact += v;
                    mag += fabs(v);
                }
                const double bound = ((double)cols / 4.0 + 16.0) * U * mag + 1e-37;
                const double err = fabs((double)y[t * rows + r] - exact);
                if (!(err / bound <= worst)) {
                    worst = isfinite(err) ? err / bound : INFINITY;
                    worst_abs = err;
                    worst_bound = bound;
                }
            }
        check(rep, names[kind], shape, worst_abs, worst_bound);
    }
    free(w), free(sc), free(x), free(y), free(y_ref), free(xq), free(xs);
    return 0;
}

/* ---- blocked GEMM (kvl_gemm_bf16 over the table's gemm_tile) ----------------------------- */

/* Against the double-precision sum, with the bound of its order (kernels.h): each chunk of
 * KVL_GEMM_KC columns summed in column order, chunk sums added, so (min(cols, KC) + chunks + 16)
 * u S; on shapes whose rows, columns and tokens end inside a tile, a panel and a block. */
static int test_gemm(report *rep, const kvl_kernels *K, rng *g, size_t rows, size_t cols, size_t n)
{
    const size_t ldx = cols + 3, ldy = rows + 5;
    uint16_t *w = malloc(rows * cols * sizeof *w);
    float *x = malloc(n * ldx * sizeof *x), *y = malloc(n * ldy * sizeof *y);
    float *work = malloc(KVL_GEMM_WORK_FLOATS * sizeof *work);
    if (!w || !x || !y || !work) {
        free(w), free(x), free(y), free(work);
        return -1;
    }
    for (size_t i = 0; i < rows * cols; i++)
        w[i] = kvl_float_to_bf16(rndf(g) * 0.05f);
    for (size_t i = 0; i < n * ldx; i++)
        x[i] = rndf(g);
    for (size_t i = 0; i < n * ldy; i++)
        y[i] = 12345.0f; /* every output must be written, the gaps left alone */
    kvl_gemm_bf16(K, y, ldy, w, rows, cols, x, ldx, n, work);
    const size_t chunks = (cols + KVL_GEMM_KC - 1) / KVL_GEMM_KC;
    const double factor = (double)(cols < KVL_GEMM_KC ? cols : KVL_GEMM_KC) + (double)chunks + 16.0;
    double worst = 0.0, worst_abs = 0.0, worst_bound = 0.0, gaps = 0.0;
    for (size_t t = 0; t < n; t++) {
        for (size_t r = 0; r < rows; r++) {
            double exact = 0.0, mag = 0.0;
            for (size_t c = 0; c < cols; c++) {
                const double v = bf16_value(w[r * cols + c]) * (double)x[t * ldx + c];
                exact += v;
                mag += fabs(v);
            }
            const double bound = factor * U * mag + 1e-37;
            const double err = fabs((double)y[t * ldy + r] - exact);
            if (!(err / bound <= worst)) {
                worst = isfinite(err) ? err / bound : INFINITY;
                worst_abs = err;
                worst_bound = bound;
            }
        }
        for (size_t r = rows; r < ldy; r++)
            gaps = fmax(gaps, fabs((double)y[t * ldy + r] - 12345.0));
    }
    char shape[80];
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu", rows, cols, n);
    check(rep, "gemm_bf16", shape, worst_abs, worst_bound);
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu: Y outside the rows untouched", rows, cols, n);
    check(rep, "gemm_bf16", shape, gaps, 0.0);
    free(w), free(x), free(y), free(work);
    return 0;
}

/* ---- BF16 products (kvl_gemm_bf16_xb, gemm_tile_bf16) -------------------------------------- */

/* VDPBF16PS's arithmetic (kernels.h gemm_tile_bf16), written here independently of the tables:
 * a BF16 half with subnormals read as zero; one multiply-add, rounded once, subnormal flushed */
static float half_daz(uint16_t h)
{
    return (h & 0x7f80u) == 0 ? ((h & 0x8000u) ? -0.0f : 0.0f) : kvl_bf16_to_float(h);
}

static float dp_step(uint16_t a, uint16_t b, float acc)
{
    const float r = kvl_fmaf_once(half_daz(a), half_daz(b), acc);
    return fabsf(r) < 1.17549435e-38f ? copysignf(0.0f, r) : r;
}

/* kvl_gemm_bf16_xb bit for bit against its definition (chunks of KVL_GEMM_KC columns, pairs odd
 * first, written out here), and against the double-precision sum of the rounded inputs with
 * the bound of that order; outputs outside the rows untouched. */
static int test_gemm_xb(report *rep, const kvl_kernels *K, rng *g, size_t rows, size_t cols, size_t n)
{
    const size_t ldx = cols + 3, ldy = rows + 5;
    uint16_t *w = malloc(rows * cols * sizeof *w);
    float *x = malloc(n * ldx * sizeof *x), *y = malloc(n * ldy * sizeof *y);
    float *work = malloc(KVL_GEMM_WORK_FLOATS * sizeof *work);
    if (!w || !x || !y || !work) {
        free(w), free(x), free(y), free(work);
        return -1;
    }
    for (size_t i = 0; i < rows * cols; i++)
        w[i] = kvl_float_to_bf16(rndf(g) * 0.05f);
    for (size_t i = 0; i < n * ldx; i++)
        x[i] = rndf(g);
    for (size_t i = 0; i < n * ldy; i++)
        y[i] = 12345.0f;
    kvl_gemm_bf16_xb(K, y, ldy, w, rows, cols, x, ldx, n, work);
    const size_t chunks = (cols + KVL_GEMM_KC - 1) / KVL_GEMM_KC;
    const double factor = (double)(cols < KVL_GEMM_KC ? cols : KVL_GEMM_KC) + (double)chunks + 16.0;
    double worst = 0.0, worst_abs = 0.0, worst_bound = 0.0, gaps = 0.0, differ = 0.0;
    for (size_t t = 0; t < n; t++) {
        const float *xt = x + t * ldx;
        for (size_t r = 0; r < rows; r++) {
            const uint16_t *wr = w + r * cols;
            double exact = 0.0, mag = 0.0;
            float def = 0.0f;
            for (size_t k0 = 0; k0 < cols; k0 += KVL_GEMM_KC) {
                const size_t end = cols - k0 < KVL_GEMM_KC ? cols : k0 + KVL_GEMM_KC;
                float acc = 0.0f;
                for (size_t c = k0; c < end; c += 2) {
                    const uint16_t xo = c + 1 < end ? kvl_bf16_bits_daz(xt[c + 1]) : 0;
                    acc = dp_step(xo, c + 1 < end ? wr[c + 1] : 0, acc);
                    acc = dp_step(kvl_bf16_bits_daz(xt[c]), wr[c], acc);
                }
                def = k0 == 0 ? acc : def + acc;
            }
            for (size_t c = 0; c < cols; c++) {
                const double v = bf16_value(wr[c]) * (double)kvl_bf16_round_daz(xt[c]);
                exact += v;
                mag += fabs(v);
            }
            const float got = y[t * ldy + r];
            if (memcmp(&got, &def, sizeof got) != 0)
                differ += 1.0;
            const double bound = factor * U * mag + 1e-37;
            const double err = fabs((double)got - exact);
            if (!(err / bound <= worst)) {
                worst = isfinite(err) ? err / bound : INFINITY;
                worst_abs = err;
                worst_bound = bound;
            }
        }
        for (size_t r = rows; r < ldy; r++)
            gaps = fmax(gaps, fabs((double)y[t * ldy + r] - 12345.0));
    }
    char shape[96];
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu", rows, cols, n);
    check(rep, "gemm_bf16_xb", shape, worst_abs, worst_bound);
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu: outputs differing from the definition", rows, cols, n);
    check(rep, "gemm_bf16_xb", shape, differ, 0.0);
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu: Y outside the rows untouched", rows, cols, n);
    check(rep, "gemm_bf16_xb", shape, gaps, 0.0);
    free(w), free(x), free(y), free(work);
    return 0;
}

/* kvl_gemm_bf16_amx on the sets that run it (avx512-bf16 where AMX is available): against the
 * double-precision sum of the BF16-rounded inputs within (cols + 16) u S (the tile's own order
 * is the hardware's), the outputs outside the rows untouched; elsewhere it must refuse. */
static int test_gemm_amx(report *rep, const kvl_kernels *K, rng *g, size_t rows, size_t cols, size_t n)
{
    if (!K->bf16_dot) {
        check(rep, "gemm_bf16_amx", "runs with avx512-bf16 only (the engine's choice)", 0.0, 0.0);
        return 0;
    }
    if (!kvl_gemm_amx_available()) {
        float y = 7.0f;
        const int rc = kvl_gemm_bf16_amx(&y, 1, NULL, 1, 0, NULL, 1, 1, NULL);
        check(rep, "gemm_bf16_amx", "no AMX on this CPU: refuses, writes nothing",
              rc == -1 && y == 7.0f ? 0.0 : 1.0, 0.0);
        return 0;
    }
    const size_t ldx = cols + 3, ldy = rows + 5;
    uint16_t *w = malloc(rows * cols * sizeof *w);
    float *x = malloc(n * ldx * sizeof *x), *y = malloc(n * ldy * sizeof *y);
    float *work = malloc(KVL_GEMM_WORK_FLOATS * sizeof *work);
    if (!w || !x || !y || !work) {
        free(w), free(x), free(y), free(work);
        return -1;
    }
    for (size_t i = 0; i < rows * cols; i++)
        w[i] = kvl_float_to_bf16(rndf(g) * 0.05f);
    for (size_t i = 0; i < n * ldx; i++)
        x[i] = rndf(g);
    for (size_t i = 0; i < n * ldy; i++)
        y[i] = 12345.0f;
    const int rc = kvl_gemm_bf16_amx(y, ldy, w, rows, cols, x, ldx, n, work);
    double worst = 0.0, worst_abs = rc == 0 ? 0.0 : INFINITY, worst_bound = 0.0, gaps = 0.0;
    for (size_t t = 0; t < n && rc == 0; t++) {
        for (size_t r = 0; r < rows; r++) {
            double exact = 0.0, mag = 0.0;
            for (size_t c = 0; c < cols; c++) {
                const double v = bf16_value(w[r * cols + c]) * (double)kvl_bf16_round_daz(x[t * ldx + c]);
                exact += v;
                mag += fabs(v);
            }
            const double bound = ((double)cols + 16.0) * U * mag + 1e-37;
            const double err = fabs((double)y[t * ldy + r] - exact);
            if (!(err / bound <= worst)) {
                worst = isfinite(err) ? err / bound : INFINITY;
                worst_abs = err;
                worst_bound = bound;
            }
        }
        for (size_t r = rows; r < ldy; r++)
            gaps = fmax(gaps, fabs((double)y[t * ldy + r] - 12345.0));
    }
    char shape[96];
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu", rows, cols, n);
    check(rep, "gemm_bf16_amx", shape, worst_abs, worst_bound);
    snprintf(shape, sizeof shape, "rows=%zu cols=%zu n=%zu: Y outside the rows untouched", rows, cols, n);
    check(rep, "gemm_bf16_amx", shape, gaps, 0.0);
    free(w), free(x), free(y), free(work);
    return 0;
}

/* kvl_attention_bf16_amx on the sets that run it (as gemm_bf16_amx): nq queries against len keys
 * and values of head size hd, the queries' values times qmag (large: many probabilities below
 * the floor), against the float64 attention of the BF16-rounded Q, K, V (p = e^(s - m) exact)
 * within kernels.h's bound; out's other columns and rows untouched. */
static int test_attention_amx(report *rep, const kvl_kernels *K, rng *g, size_t nq, size_t len,
                              size_t hd, float qmag)
{
    if (!K->bf16_dot) {
        check(rep, "attention_bf16_amx", "runs with avx512-bf16 only (the engine's choice)", 0.0, 0.0);
        return 0;
    }
    if (!kvl_gemm_amx_available()) {
        float y = 7.0f, q = 1.0f;
        uint32_t kv = 0;
        const int rc = kvl_attention_bf16_amx(K, &y, 1, &q, 1, 1, &kv, 1, 1, 1.0f, 0.0f, NULL);
        check(rep, "attention_bf16_amx", "no AMX on this CPU: refuses, writes nothing",
              rc == -1 && y == 7.0f ? 0.0 : 1.0, 0.0);
        return 0;
    }
    const size_t ldq = hd + 5, ldk = hd + 7, ldo = hd + 3, rows_out = nq + 2;
    const float floor_p = 7.8886091e-31f; /* the vision tower's ATTN_PROB_FLOOR, 2^-100 */
    const float scale = (float)(1.0 / sqrt((double)hd));
    float *q = malloc(nq * ldq * sizeof *q), *kx = malloc(len * ldk * sizeof *kx);
    float *vx = malloc(len * ldk * sizeof *vx), *out = malloc(rows_out * ldo * sizeof *out);
    uint32_t *kv = malloc(kvl_attn_amx_kv_words(len, hd) * sizeof *kv);
    float *work = malloc(kvl_attn_amx_work_floats(hd) * sizeof *work);
    double *p = malloc(len * sizeof *p);
    if (!q || !kx || !vx || !out || !kv || !work || !p) {
        free(q), free(kx), free(vx), free(out), free(kv), free(work), free(p);
        return -1;
    }
    for (size_t i = 0; i < nq * ldq; i++)
        q[i] = rndf(g) * qmag;
    for (size_t i = 0; i < len * ldk; i++) {
        kx[i] = rndf(g);
        vx[i] = rndf(g);
    }
    for (size_t i = 0; i < rows_out * ldo; i++)
        out[i] = 12345.0f;
    int rc = kvl_attn_amx_pack_kv(kv, kx, vx, ldk, len, hd);
    if (rc == 0)
        rc = kvl_attention_bf16_amx(K, out, ldo, q, ldq, nq, kv, len, hd, scale, floor_p, work);
    double worst = 0.0, worst_abs = rc == 0 ? 0.0 : INFINITY, worst_bound = 0.0, gaps = 0.0;
    double vmax = 0.0;
    for (size_t s = 0; s < len; s++)
        for (size_t d = 0; d < hd; d++)
            vmax = fmax(vmax, fabs((double)kvl_bf16_round_daz(vx[s * ldk + d])));
    for (size_t t = 0; t < nq && rc == 0; t++) {
        double m = -INFINITY, qk = 0.0, sum = 0.0;
        for (size_t s = 0; s < len; s++) {
            double dot = 0.0, mag = 0.0;
            for (size_t d = 0; d < hd; d++) {
                const double v = (double)kvl_bf16_round_daz(q[t * ldq + d]) *
                                 (double)kvl_bf16_round_daz(kx[s * ldk + d]);
                dot += v;
                mag += fabs(v);
            }
            p[s] = (double)scale * dot;
            m = fmax(m, p[s]);
            qk = fmax(qk, mag);
        }
        for (size_t s = 0; s < len; s++) {
            p[s] = exp(p[s] - m);
            sum += p[s];
        }
        const double e_s = fabs((double)scale) * ((double)hd + 16.0) * U * qk + 32.0 * U;
        const double rel = 1.0 / 256.0 + 5.0 * e_s + (2.0 * (double)len + (double)hd + 64.0) * U;
        for (size_t d = 0; d < hd; d++) {
            double o = 0.0, a = 0.0;
            for (size_t s = 0; s < len; s++) {
                const double v = (double)kvl_bf16_round_daz(vx[s * ldk + d]);
                o += p[s] * v;
                a += p[s] * fabs(v);
            }
            o /= sum;
            a /= sum;
            const double bound = rel * a + (double)len * (U + (double)floor_p) * vmax + 1e-37;
            const double err = fabs((double)out[t * ldo + d] - o);
            if (!(err / bound <= worst)) {
                worst = isfinite(err) ? err / bound : INFINITY;
                worst_abs = err;
                worst_bound = bound;
            }
        }
    }
    for (size_t t = 0; t < rows_out; t++)
        for (size_t d = 0; d < ldo; d++)
            if (t >= nq || d >= hd)
                gaps = fmax(gaps, fabs((double)out[t * ldo + d] - 12345.0));
    char shape[112];
    snprintf(shape, sizeof shape, "nq=%zu len=%zu hd=%zu |q|x%g", nq, len, hd, (double)qmag);
    check(rep, "attention_bf16_amx", shape, worst_abs, worst_bound);
    snprintf(shape, sizeof shape, "nq=%zu len=%zu hd=%zu: out outside the queries and head untouched", nq, len, hd);
    check(rep, "attention_bf16_amx", shape, gaps, 0.0);
    free(q), free(kx), free(vx), free(out), free(kv), free(work), free(p);
    return 0;
}

/* The table's gemm_tile_bf16, where it has one, on one tile of kp pairs, bit for bit against
 * the definition above, with subnormal BF16 inputs (read as zero) and partial sums that fall
 * below 2^-126 (flushed) among ordinary ones; accumulate into C too. */
static int test_gemm_tile_bf16(report *rep, const kvl_kernels *K, rng *g, size_t kp)
{
    if (!K->gemm_tile_bf16) {
        check(rep, "gemm_tile_bf16", "none in this set (kvl_gemm_bf16_xb runs gemm_tile)", 0.0, 0.0);
        return 0;
    }
    const size_t mr = (size_t)K->gemm_mr, nr = (size_t)K->gemm_nr, ldc = nr + 3;
    uint32_t *A = malloc(kp * mr * sizeof *A), *B = malloc(kp * nr * sizeof *B);
    float *C = malloc(mr * ldc * sizeof *C), *C0 = malloc(mr * ldc * sizeof *C0);
    if (!A || !B || !C || !C0) {
        free(A), free(B), free(C), free(C0);
        return -1;
    }
    for (int tiny = 0; tiny < 2; tiny++) {
        /* tiny: magnitudes near 2^-64 on both sides, so products and sums cross 2^-126 */
        const float sa = tiny ? 5.421011e-20f : 1.0f;
        for (size_t i = 0; i < kp * mr; i++) {
            uint16_t lo = kvl_float_to_bf16(rndf(g) * sa), hi = kvl_float_to_bf16(rndf(g) * sa);
            if ((rnd32(g) & 15) == 0)
                lo = (uint16_t)((rnd32(g) & 0x807fu) | 1u); /* a subnormal */
            A[i] = kvl_bf16_pair(lo, hi);
        }
        for (size_t i = 0; i < kp * nr; i++) {
            uint16_t lo = kvl_float_to_bf16(rndf(g) * sa), hi = kvl_float_to_bf16(rndf(g) * sa);
            if ((rnd32(g) & 15) == 0)
                hi = (uint16_t)((rnd32(g) & 0x807fu) | 1u);
            B[i] = kvl_bf16_pair(lo, hi);
        }
        for (int accumulate = 0; accumulate < 2; accumulate++) {
            for (size_t i = 0; i < mr * ldc; i++)
                C[i] = C0[i] = rndf(g);
            K->gemm_tile_bf16(kp, A, B, C, ldc, accumulate);
            double differ = 0.0;
            for (size_t i = 0; i < mr; i++)
                for (size_t j = 0; j < ldc; j++) {
                    float want = C0[i * ldc + j];
                    if (j < nr) {
                        float acc = 0.0f;
                        for (size_t q = 0; q < kp; q++) {
                            const uint32_t a = A[q * mr + i], b = B[q * nr + j];
                            acc = dp_step((uint16_t)(a >> 16), (uint16_t)(b >> 16), acc);
                            acc = dp_step((uint16_t)a, (uint16_t)b, acc);
                        }
                        want = accumulate ? want + acc : acc;
                    }
                    if (memcmp(&want, &C[i * ldc + j], sizeof want) != 0)
                        differ += 1.0;
                }
            char shape[96];
            snprintf(shape, sizeof shape, "kp=%zu%s%s: outputs differing from the definition", kp,
                     tiny ? " tiny" : "", accumulate ? " accumulate" : "");
            check(rep, "gemm_tile_bf16", shape, differ, 0.0);
        }
    }
    free(A), free(B), free(C), free(C0);
    return 0;
}

/* ---- vector ops ------------------------------------------------------------------------ */

static int test_vectors(report *rep, const kvl_kernels *K, rng *g, size_t n)
{
    float *a = malloc((n + 1) * sizeof *a), *x = malloc((n + 1) * sizeof *x);
    float *y = malloc((n + 1) * sizeof *y), *y2 = malloc((n + 1) * sizeof *y2);
    uint16_t *h = malloc((n + 1) * sizeof *h), *h2 = malloc((n + 1) * sizeof *h2);
    if (!a || !x || !y || !y2 || !h || !h2) {
        free(a), free(x), free(y), free(y2), free(h), free(h2);
        return -1;
    }
    char shape[32];
    snprintf(shape, sizeof shape, "n=%zu", n);
    for (size_t i = 0; i < n; i++) {
        a[i] = rndf(g);
        x[i] = rndf(g);
    }

    double exact = 0.0, mag = 0.0;
    for (size_t i = 0; i < n; i++) {
        exact += (double)a[i] * x[i];
        mag += fabs((double)a[i] * x[i]);
    }
    check(rep, "dot_f32", shape, fabs((double)K->dot_f32(a, x, n) - exact),
          ((double)n / 4.0 + 16.0) * U * mag + 1e-37);

    double worst = 0.0;
    memcpy(y, a, n * sizeof *y);
    K->axpy_f32(y, 0.75f, x, n);
    for (size_t i = 0; i < n; i++) /* one multiply-add: fused or not, within 2u of the exact */
        worst = fmax(worst, fabs((double)y[i] - ((double)a[i] + 0.75 * x[i])) /
                                (fabs((double)a[i]) + fabs(0.75 * x[i]) + 1e-30));
    check(rep, "axpy_f32", shape, worst, 2.0 * U);

    /* BF16 conversions, bit-exact, with ties, infinities and NaNs at every lane position. */
    static const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x7f800000u, 0xff800000u,
                                        0x7fc00001u, 0xff800001u, 0x7f7fffffu, 0x00000001u};
    for (size_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        if (i % 5 == 1)
            bits = specials[(i / 5) % (sizeof specials / sizeof specials[0])];
        memcpy(&y[i], &bits, sizeof bits);
    }
    K->f32_to_bf16(h, y, n);
    worst = 0.0;
    for (size_t i = 0; i < n; i++)
        if (h[i] != kvl_float_to_bf16(y[i]))
            worst = 1.0;
    check(rep, "f32_to_bf16", shape, worst, 0.0);
    for (size_t i = 0; i < n; i++)
        h2[i] = (uint16_t)rnd32(g);
    K->bf16_to_f32(y2, h2, n);
    worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        float e = kvl_bf16_to_float(h2[i]);
        if (memcmp(&e, &y2[i], sizeof e) != 0)
            worst = 1.0;
    }
    check(rep, "bf16_to_f32", shape, worst, 0.0);
    for (size_t i = 0; i < n; i++)
        ((int8_t *)(void *)h2)[i] = (int8_t)((int)(rnd32(g) % 255u) - 127);
    const float q8s = 0.0123f + (float)(rnd32(g) % 100) * 1e-4f;
    K->q8_to_f32(y2, (const int8_t *)(const void *)h2, q8s, n);
    worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const float e = (float)((const int8_t *)(const void *)h2)[i] * q8s; /* exact int times scale: one rounding */
        if (memcmp(&e, &y2[i], sizeof e) != 0)
            worst = 1.0;
    }
    check(rep, "q8_to_f32", shape, worst, 0.0);

    /* softmax over attention-like scores with masked entries; GELU over its useful range. */
    for (size_t i = 0; i < n; i++)
        y[i] = i % 7 == 3 ? -INFINITY : 30.0f * x[i] * x[i] * x[i] - (i % 5 == 0 ? 60.0f : 0.0f);
    memcpy(y2, y, n * sizeof *y);
    kvl_softmax(y2, n);
    K->softmax(y, n);
    worst = 0.0;
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)y[i] - y2[i]) / fmax((double)y2[i], 1e-30));
    check(rep, "softmax", shape, worst, 2e-6);
    for (size_t i = 0; i < n; i++)
        y[i] = 12.0f * x[i];
    memcpy(y2, y, n * sizeof *y);
    kvl_gelu_tanh(y2, n);
    K->gelu_tanh(y, n);
    worst = 0.0;
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)y[i] - y2[i]) / fmax(fabs((double)y2[i]), 1.0));
    check(rep, "gelu_tanh", shape, worst, 1e-6);

    free(a), free(x), free(y), free(y2), free(h), free(h2);
    return 0;
}

/* axpy_rows_f32 on nh = 5 heads (tiles of 2 and 4 plus a remainder) and np rows over n columns
 * (strided Y, A and X): bit-identical to the table's own axpy_f32 calls in p order (its
 * definition), and within np + 1 roundings of the exact sum. */
static int test_axpy_rows(report *rep, const kvl_kernels *K, rng *g, size_t n, size_t np)
{
    const size_t nh = 5, ldy = n + 3, lda = np + 2, ldx = n + 5;
    float *Y = malloc(nh * ldy * sizeof *Y), *Y2 = malloc(nh * ldy * sizeof *Y2);
    float *A = malloc(nh * lda * sizeof *A), *X = malloc(np * ldx * sizeof *X);
    double *exact = malloc(n * sizeof *exact), *mag = malloc(n * sizeof *mag);
    if (!Y || !Y2 || !A || !X || !exact || !mag) {
        free(Y), free(Y2), free(A), free(X), free(exact), free(mag);
        return -1;
    }
    for (size_t i = 0; i < nh * ldy; i++)
        Y[i] = Y2[i] = rndf(g);
    for (size_t i = 0; i < nh * lda; i++)
        A[i] = rndf(g);
    for (size_t i = 0; i < np * ldx; i++)
        X[i] = rndf(g);
    char shape[48];
    snprintf(shape, sizeof shape, "heads=5 rows=%zu cols=%zu", np, n);
    K->axpy_rows_f32(Y, ldy, A, lda, nh, X, ldx, np, n);
    double differ = 0.0, worst = 0.0;
    for (size_t h = 0; h < nh; h++) {
        for (size_t c = 0; c < n; c++) {
            exact[c] = Y2[h * ldy + c];
            mag[c] = fabs(exact[c]);
        }
        for (size_t p = 0; p < np; p++) {
            for (size_t c = 0; c < n; c++) {
                exact[c] += (double)A[h * lda + p] * X[p * ldx + c];
                mag[c] += fabs((double)A[h * lda + p] * X[p * ldx + c]);
            }
            K->axpy_f32(Y2 + h * ldy, A[h * lda + p], X + p * ldx, n);
        }
        for (size_t c = 0; c < ldy; c++) /* the whole row, padding included: untouched there */
            differ = fmax(differ, memcmp(&Y[h * ldy + c], &Y2[h * ldy + c], sizeof(float)) ? 1.0 : 0.0);
        for (size_t c = 0; c < n; c++)
            worst = fmax(worst, fabs((double)Y[h * ldy + c] - exact[c]) / (mag[c] + 1e-30));
    }
    check(rep, "axpy_rows_f32", shape, worst, (double)(np + 1) * U);
    char what[80];
    snprintf(what, sizeof what, "%s vs axpy_f32 calls", shape);
    check(rep, "axpy_rows_f32", what, differ, 0.0);
    free(Y), free(Y2), free(A), free(X), free(exact), free(mag);
    return 0;
}

/* ---- entry point ----------------------------------------------------------------------- */

KVL_API int kvl_kernels_conformance(const char *set_name, char *out, size_t out_len)
{
    const kvl_kernels *K = set_name ? kvl_kernels_by_name(set_name) : NULL;
    const kvl_kernels *ref = kvl_kernels_by_name("scalar");
    if (!K || !ref)
        return -1;
    if (!out || out_len == 0)
        return -2;
    report rep = {out, out_len, 0, 0, 0, 0};
    rng g = {0x9E3779B97F4A7C15ull};
    emit(&rep, "{\"set\":\"%s\",\"table\":\"%s\",\"checks\":[", set_name, K->name);
    /* rows/cols/tokens: single row and column, SIMD-width tails, a full decode row, an
     * integer-mode block boundary (512) and more, token counts around the register tiles. */
    static const size_t shapes[][3] = {{1, 1, 1},   {3, 31, 1},   {65, 257, 3}, {31, 2048, 1},
                                       {64, 64, 9}, {17, 300, 17}, {9, 1030, 2}, {5, 4200, 1}};
    int oom = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        oom |= test_products(&rep, K, ref, &g, shapes[s][0], shapes[s][1], shapes[s][2]);
    oom |= test_q8_i8_extremes(&rep, K, ref);
    /* Q4: one group (cols 32: a last block of one group), rows around the 4-row tiles, an expert
     * row (2048), 45 groups, tokens around the tiles; then the extremes (12 rows: passes of 4) */
    static const size_t q4_shapes[][3] = {{1, 32, 1}, {5, 96, 1}, {13, 2048, 1}, {9, 1440, 3}, {17, 160, 9}};
    for (size_t s = 0; s < sizeof q4_shapes / sizeof q4_shapes[0]; s++)
        oom |= test_q4(&rep, K, ref, &g, q4_shapes[s][0], q4_shapes[s][1], q4_shapes[s][2], 0);
    oom |= test_q4(&rep, K, ref, &g, 12, 224, 1, 1);
    /* GEMM: one output; tails of every tile size; three column chunks (KC) with a tail and two
     * token blocks (MC) with a tail; two row blocks (NC). Small, since the relaxed build's
     * start-up self-test runs this report (tests/test_kernels.c has the large shapes). */
    static const size_t gemm_shapes[][3] = {{1, 1, 1}, {33, 37, 13}, {50, 300, 100}, {1540, 3, 2}};
    for (size_t s = 0; s < sizeof gemm_shapes / sizeof gemm_shapes[0]; s++)
        oom |= test_gemm(&rep, K, &g, gemm_shapes[s][0], gemm_shapes[s][1], gemm_shapes[s][2]);
    /* the BF16 GEMM on the same shapes plus odd and even column tails and two token blocks */
    static const size_t xb_shapes[][3] = {{1, 1, 1}, {33, 37, 13}, {50, 300, 100}, {1540, 3, 2}, {45, 258, 97}};
    for (size_t s = 0; s < sizeof xb_shapes / sizeof xb_shapes[0]; s++)
        oom |= test_gemm_xb(&rep, K, &g, xb_shapes[s][0], xb_shapes[s][1], xb_shapes[s][2]);
    /* AMX: tails of the 32 x 32 blocks, an odd column count, two column chunks (1536) with a
     * tail, two row blocks (256) */
    static const size_t amx_shapes[][3] = {{1, 1, 1}, {33, 37, 13}, {50, 300, 100}, {45, 1601, 33}, {300, 64, 40}};
    for (size_t s = 0; s < sizeof amx_shapes / sizeof amx_shapes[0]; s++)
        oom |= test_gemm_amx(&rep, K, &g, amx_shapes[s][0], amx_shapes[s][1], amx_shapes[s][2]);
    /* AMX attention: one query and one key; MoonViT's head size over two key blocks (512) with
     * tails of keys and of 32-query tiles; a whole work item (96 queries) with another head
     * size; scores large enough that most probabilities fall below the floor */
    static const size_t attn_shapes[][3] = {{1, 1, 72}, {70, 700, 72}, {96, 33, 40}, {33, 300, 72}};
    static const float attn_qmag[] = {1.0f, 4.0f, 1.0f, 400.0f};
    for (size_t s = 0; s < sizeof attn_shapes / sizeof attn_shapes[0]; s++)
        oom |= test_attention_amx(&rep, K, &g, attn_shapes[s][0], attn_shapes[s][1], attn_shapes[s][2],
                                  attn_qmag[s]);
    oom |= test_gemm_tile_bf16(&rep, K, &g, 1);
    oom |= test_gemm_tile_bf16(&rep, K, &g, 37);
    static const size_t vec_sizes[] = {1, 3, 17, 64, 1027};
    for (size_t s = 0; s < sizeof vec_sizes / sizeof vec_sizes[0]; s++)
        oom |= test_vectors(&rep, K, &g, vec_sizes[s]);
    static const size_t axpy_rows_shapes[][2] = {{1, 1}, {3, 7}, {17, 2}, {64, 33}, {100, 5}, {512, 41}};
    for (size_t s = 0; s < sizeof axpy_rows_shapes / sizeof axpy_rows_shapes[0]; s++)
        oom |= test_axpy_rows(&rep, K, &g, axpy_rows_shapes[s][0], axpy_rows_shapes[s][1]);
    if (oom)
        rep.failed++;
    emit(&rep, "],\"failed\":%d%s}", rep.failed, oom ? ",\"error\":\"out of memory\"" : "");
    if (rep.overflow)
        return -2;
    return rep.failed;
}
