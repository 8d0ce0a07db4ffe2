/* variants_ab.c — A/B of two builds of the SIMD128 kernels (kernels_simd128.c) and of two builds
 * of the thread pool (threadpool.c) linked into one WebAssembly module, so that both run on the
 * same data, in the same process, in interleaved rounds. Not part of the engine; variants_ab.sh
 * builds it (A: the sources as they are; B: the same files with a patch applied, their external
 * names renamed) and runs it under each Node given.
 *
 * Owns: timing figures only (nothing here asserts; the outputs of A and B are compared bit for
 * bit and the line says "identical" or "DIFFER").
 *
 * Usage: node -r wasm-core/tests/no-fetch.cjs variants_ab.js ROUNDS CASE...
 *   CASE: KIND:SHAPE with KIND one of bf16 q8 q8i16 bf16xb q8xb i16i16 and SHAPE one of
 *     dram    decode (n = 1) over ~1.1 GB of distinct [1408 x 2048] matrices (expert size),
 *     cache   decode over one [256 x 2048] matrix again and again,
 *     p64     a 64-token prompt against one [1408 x 2048] matrix,
 *     p512    a 512-token prompt against one [2048 x 2048] matrix;
 *   or "pool": kvl_pool_run of an empty task right after a gap of serial work on the caller;
 *   or "1thr": the cases after it run on one thread only.
 * Every case runs on 1 and 2 threads ("pool" on 2), A's kernels on A's pool and B's on B's. Per
 * round: A then B, or B then A (alternated, so neither always runs first). Printed per case: the median rate of A and of B over the rounds
 * (wall clock; and per-thread CPU time, process.cpuUsage, which leaves out time other processes
 * had the cores), the median of the per-round ratios B / A and their range (min-max).
 */
#include "kernels/kernels.h"
#include "threadpool.h"

#include <emscripten.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern const kvl_kernels kvl_kernels_simd128_table; /* A */
extern const kvl_kernels kvl_variant_simd128_table; /* B: the patched kernels_simd128.c */

/* B's pool: the patched threadpool.c with its names prefixed (variants_ab.sh) */
kvl_pool *vb_pool_create(int n_threads);
void vb_pool_free(kvl_pool *pool);
void vb_pool_run(kvl_pool *pool, kvl_pool_fn fn, void *ctx);

EM_JS(double, js_process_cpu_s, (void), {
    const u = process.cpuUsage();
    return (u.user + u.system) / 1e6;
});

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

enum { K_BF16, K_Q8, K_Q8I16, K_BF16XB, K_Q8XB, K_I16I16, K_COUNT };
static const char *const kind_names[] = {"bf16", "q8", "q8i16", "bf16xb", "q8xb", "i16i16"};

static size_t esz(int kind)
{
    return kind == K_BF16 || kind == K_BF16XB || kind == K_I16I16 ? 2 : 1;
}

typedef struct {
    const kvl_kernels *K;
    int kind;
    const void *W;
    const float *scale;
    size_t rows, cols, n;
    const float *X;
    const int16_t *Xq;
    const float *xs;
    float *Y;
} mm_ctx;

static void mm_fn(void *p, int i, int nt)
{
    mm_ctx *c = (mm_ctx *)p;
    size_t b, e;
    kvl_split_range(c->rows, 16, i, nt, &b, &e);
    if (b >= e)
        return;
    const kvl_kernels *K = c->K;
    const size_t ld = c->rows, rb = b * c->cols * esz(c->kind);
    const void *W = (const char *)c->W + rb;
    switch (c->kind) {
    case K_BF16: K->matmul_bf16(c->Y + b, ld, W, e - b, c->cols, c->X, c->cols, c->n); break;
    case K_Q8: K->matmul_q8(c->Y + b, ld, W, c->scale + b, e - b, c->cols, c->X, c->cols, c->n); break;
    case K_BF16XB: K->matmul_bf16_xb(c->Y + b, ld, W, e - b, c->cols, c->X, c->cols, c->n); break;
    case K_Q8XB: K->matmul_q8_xb(c->Y + b, ld, W, c->scale + b, e - b, c->cols, c->X, c->cols, c->n); break;
    case K_Q8I16: K->matmul_q8_i16(c->Y + b, ld, W, c->scale + b, e - b, c->cols, c->Xq, c->xs, c->cols, c->n); break;
    default: K->matmul_i16_i16(c->Y + b, ld, W, c->scale + b, e - b, c->cols, c->Xq, c->xs, c->cols, c->n); break;
    }
}

static void fill_weights(unsigned char *W, int kind, size_t bytes)
{
    if (kind == K_BF16 || kind == K_BF16XB) {
        uint16_t *h = (uint16_t *)(void *)W;
        for (size_t i = 0; i < bytes / 2; i++)
            h[i] = kvl_float_to_bf16(0.01f * (float)((int)((i * 2654435761u) >> 20 & 0xff) - 128) + 0.001f);
    } else if (kind == K_I16I16) {
        int16_t *h = (int16_t *)(void *)W;
        for (size_t i = 0; i < bytes / 2; i++)
            h[i] = (int16_t)((int)((uint32_t)(i * 2654435761u) >> 12 & 0xffff) % 65535 - 32767);
    } else {
        for (size_t i = 0; i < bytes; i++) {
            W[i] = (unsigned char)((i * 2654435761u) >> 13);
            if (W[i] == 0x80)
                W[i] = 0x81;
        }
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double minof(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] < m ? v[i] : m;
    return m;
}

static double maxof(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

#define MAX_ROUNDS 64
static int max_threads = 2;

static void report(const char *label, int nt, const char *unit, double *a, double *b, double *ca, double *cb,
                   int rounds, const char *outputs)
{
    double ratio[MAX_ROUNDS], cratio[MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
        ratio[r] = b[r] / a[r];
        cratio[r] = cb ? cb[r] / ca[r] : 0;
    }
    const double rmin = minof(ratio, rounds), rmax = maxof(ratio, rounds);
    printf("%-14s %d thr  A %8.2f  B %8.2f %-7s  B/A %.3f (%.3f-%.3f)", label, nt, median(a, rounds),
           median(b, rounds), unit, median(ratio, rounds), rmin, rmax);
    if (cb) {
        const double cmin = minof(cratio, rounds), cmax = maxof(cratio, rounds);
        printf("  cpu: A %.2f B %.2f  B/A %.3f (%.3f-%.3f)", median(ca, rounds), median(cb, rounds),
               median(cratio, rounds), cmin, cmax);
    }
    printf("%s%s\n", outputs ? "  outputs " : "", outputs ? outputs : "");
    fflush(stdout);
}

static void run_case(int kind, const char *shape, int rounds)
{
    size_t rows = 1408, cols = 2048, n = 1, nmat = 1, runs = 1;
    if (strcmp(shape, "dram") == 0) {
        nmat = ((size_t)1100 << 20) / (rows * cols * esz(kind));
        runs = nmat;
    } else if (strcmp(shape, "cache") == 0) {
        rows = 256;
        runs = 1000;
    } else if (strcmp(shape, "p64") == 0) {
        n = 64;
        runs = 4;
    } else if (strcmp(shape, "p512") == 0) {
        rows = 2048;
        n = 512;
    } else {
        printf("unknown shape %s\n", shape);
        exit(1);
    }
    const size_t mbytes = rows * cols * esz(kind);
    unsigned char *W = (unsigned char *)malloc(mbytes * nmat);
    float *scale = (float *)malloc(rows * sizeof(float)), *X = (float *)malloc(n * cols * sizeof(float));
    float *Y[2] = {(float *)malloc(n * rows * sizeof(float)), (float *)malloc(n * rows * sizeof(float))};
    int16_t *Xq = (int16_t *)malloc(n * cols * sizeof(int16_t));
    float *xs = (float *)malloc(n * cols * sizeof(float));
    if (!W || !scale || !X || !Y[0] || !Y[1] || !Xq || !xs) {
        printf("out of memory\n");
        exit(1);
    }
    fill_weights(W, kind, mbytes * nmat);
    for (size_t r = 0; r < rows; r++)
        scale[r] = 0.01f;
    for (size_t i = 0; i < n * cols; i++)
        X[i] = 0.001f * (float)((int)((i * 7 + i / cols) % 17) - 8);
    if (kind == K_Q8I16)
        kvl_kernels_simd128_table.quantize_i16_act(Xq, xs, X, cols, n, cols, cols, KVL_I16_BLOCK, KVL_I16_Q8_MAX);
    else if (kind == K_I16I16)
        kvl_kernels_simd128_table.quantize_i16_act(Xq, xs, X, cols, n, cols, cols, cols, KVL_I16_MAX);
    const kvl_kernels *T[2] = {&kvl_kernels_simd128_table, &kvl_variant_simd128_table};
    char label[32];
    snprintf(label, sizeof label, "%s:%s", kind_names[kind], shape);
    for (int nt = 1; nt <= max_threads; nt++) {
        kvl_pool *pool[2] = {kvl_pool_create(nt), vb_pool_create(nt)};
        double rate[2][MAX_ROUNDS], crate[2][MAX_ROUNDS];
        for (int round = 0; round < rounds; round++)
            for (int k = 0; k < 2; k++) {
                const int t = round % 2 ? 1 - k : k;
                mm_ctx ctx = {T[t], kind, NULL, scale, rows, cols, n, X, Xq, xs, Y[t]};
                double t0 = now_s(), c0 = js_process_cpu_s();
                for (size_t m = 0; m < runs; m++) {
                    ctx.W = W + (m % nmat) * mbytes;
                    if (t == 0)
                        kvl_pool_run(pool[0], mm_fn, &ctx);
                    else
                        vb_pool_run(pool[1], mm_fn, &ctx);
                }
                const double dt = now_s() - t0, dc = (js_process_cpu_s() - c0) / nt;
                /* GB/s of weights for decode, GFLOP/s for prompts */
                const double work = n == 1 ? (double)mbytes * (double)runs / 1e9
                                           : 2.0 * (double)rows * (double)cols * (double)n * (double)runs / 1e9;
                rate[t][round] = work / dt;
                crate[t][round] = work / dc;
            }
        report(label, nt, n == 1 ? "GB/s" : "GFLOP/s", rate[0], rate[1], crate[0], crate[1], rounds,
               memcmp(Y[0], Y[1], n * rows * sizeof(float)) == 0 ? "identical" : "DIFFER");
        kvl_pool_free(pool[0]);
        vb_pool_free(pool[1]);
    }
    free(W), free(scale), free(X), free(Y[0]), free(Y[1]), free(Xq), free(xs);
}

static void empty_fn(void *p, int i, int n)
{
    (void)p, (void)i, (void)n;
}

/* The fork/join of an empty task right after 50 us of serial work on the caller, as between two
 * products of a decode step: a worker that stopped spinning by then pays a wake. Also with no gap
 * (back-to-back runs). Microseconds per run; B/A < 1 means B is faster. */
static void run_pool(int rounds)
{
    static const double gaps[] = {0.0, 50e-6, 200e-6};
    for (size_t g = 0; g < sizeof gaps / sizeof gaps[0]; g++) {
        const double gap = gaps[g];
        kvl_pool *pa = kvl_pool_create(2), *pb = vb_pool_create(2);
        double us[2][MAX_ROUNDS];
        for (int round = 0; round < rounds; round++)
            for (int k = 0; k < 2; k++) {
                const int t = round % 2 ? 1 - k : k;
                double in_runs = 0;
                const int reps = 1000;
                for (int i = 0; i < reps; i++) {
                    double t1 = now_s();
                    while (now_s() - t1 < gap)
                        ;
                    t1 = now_s();
                    if (t == 0)
                        kvl_pool_run(pa, empty_fn, NULL);
                    else
                        vb_pool_run(pb, empty_fn, NULL);
                    in_runs += now_s() - t1;
                }
                us[t][round] = in_runs / reps * 1e6;
            }
        char label[32];
        snprintf(label, sizeof label, "pool:gap%.0fus", gap * 1e6);
        report(label, 2, "us", us[0], us[1], NULL, NULL, rounds, NULL);
        kvl_pool_free(pa);
        vb_pool_free(pb);
    }
}

int main(int argc, char **argv)
{
    const int rounds = argc > 1 ? atoi(argv[1]) : 0;
    if (rounds < 1 || rounds > MAX_ROUNDS || argc < 3) {
        printf("usage: variants_ab ROUNDS(1-%d) CASE... (see the header)\n", MAX_ROUNDS);
        return 1;
    }
    for (int a = 2; a < argc; a++) {
        if (strcmp(argv[a], "1thr") == 0) {
            max_threads = 1;
            continue;
        }
        if (strcmp(argv[a], "pool") == 0) {
            run_pool(rounds);
            continue;
        }
        char kind[16] = {0};
        const char *colon = strchr(argv[a], ':');
        if (!colon || (size_t)(colon - argv[a]) >= sizeof kind) {
            printf("bad case %s\n", argv[a]);
            return 1;
        }
        memcpy(kind, argv[a], (size_t)(colon - argv[a]));
        int k = -1;
        for (int i = 0; i < K_COUNT; i++)
            if (strcmp(kind, kind_names[i]) == 0)
                k = i;
        if (k < 0) {
            printf("bad kind %s\n", kind);
            return 1;
        }
        run_case(k, colon + 1, rounds);
    }
    return 0;
}
