/* kernels_bench.c — microbenchmark of the matmul kernels against the machine's DRAM bandwidth.
 *
 * Owns: timing figures only (not a test; nothing here asserts). Does not own: correctness
 * (wasm-core/tests/test_kernels.c).
 *
 * Measures, with 1 and 2 pool threads:
 *   - DRAM read bandwidth: streaming sum over a 1 GiB buffer (the table's own dot_f32);
 *   - decode (n = 1) GB/s of weights streamed, over many distinct expert-size [1408 x 2048]
 *     matrices (and dense-size [11264 x 2048]) totalling ~1.1 GB so nothing is served from cache
 *     (server L3s reach hundreds of MB), and over one [256 x 2048] matrix again and again (in
 *     cache: what the kernel could do with infinite bandwidth), for every product: bf16, q8 (FP32
 *     activations), bf16xb, q8xb (BF16-rounded activations), and the integer mode q8i16
 *     (matmul_q8_i16, int8 weights, 16-bit activations with a scale per 64 columns) and i16i16
 *     (matmul_i16_i16, int16 weights, 15-bit activations with one scale per vector), q8i8
 *     (matmul_q8_i8: 8-bit activations, --act-dtype i8; decode only), and the Q4 expert products
 *     q4, q4xb, q4i16, q4i8 (matmul_q4*: their GB/s count the q bytes and the BF16 scales), whose
 *     activations are quantised once per token outside the timing, as the engine does;
 *   - GFLOP/s for a 64-token batch against one [1408 x 2048] matrix.
 *
 * Build (from the repo root), native:
 *   gcc -std=c11 -O2 -DKVL_X86=1 -Iwasm-core/src -c wasm-core/src/kernels/kernels_ref.c wasm-core/src/kernels/kernels_select.c wasm-core/src/threadpool.c
 *   gcc -std=c11 -O2 -DKVL_X86=1 -mavx2 -mfma -mf16c -Iwasm-core/src -c wasm-core/src/kernels/x86/kernels_avx2.c
 *   gcc -std=c11 -O2 -DKVL_X86=1 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c -Iwasm-core/src -c wasm-core/src/kernels/x86/kernels_avx512.c
 *   gcc -std=c11 -O2 -Iwasm-core/src bench/kernels_bench.c *.o -lm -lpthread -o /tmp/kernels_bench
 * WebAssembly (SIMD128, 2 pthreads; emscripten 3.1.6; its loader calls fetch() on Node >= 18,
 * hence the preload that deletes it, wasm-core/tests/no-fetch.cjs):
 *   NODE_PATH=/usr/share/nodejs emcc -std=c11 -O3 -msimd128 -pthread -sPTHREAD_POOL_SIZE=2 \
 *     -sENVIRONMENT=node,worker -sEXIT_RUNTIME=1 -sALLOW_MEMORY_GROWTH=1 -sMAXIMUM_MEMORY=4GB -Iwasm-core/src \
 *     wasm-core/src/kernels/kernels_ref.c wasm-core/src/kernels/kernels_select.c wasm-core/src/kernels/wasm/kernels_simd128.c \
 *     wasm-core/src/threadpool.c bench/kernels_bench.c -o /tmp/kernels_bench.js
 *   node -r ./wasm-core/tests/no-fetch.cjs /tmp/kernels_bench.js [args]
 * Run:
 *   kernels_bench [level|name|all] [decode]
 *     level: 0 best (default), 1 scalar, 2 avx2, 3 avx512, 4 simd128; or a table name (scalar,
 *     simd128, avx2, avx512, avx512-bf16); "all": every table this build and CPU support.
 *     "decode": only the decode products, plus one "RESULT table kind shape threads GB/s" line
 *     each (wall clock) for scripts (bench/kernels_ab.sh).
 *   kernels_bench ab TABLE_A TABLE_B KIND[,KIND_B]: one decode product on two tables (or two
 *     products, KIND on TABLE_A and KIND_B on TABLE_B, e.g. "ab avx512 avx512 q8i8,q4i8": Q4
 *     against Q8 experts), interleaved (bench_ab; bench/kernels_ab.sh --relaxed runs simd128
 *     against simd128-relaxed on q8i8).
 * In WebAssembly the "cpu" figures are Node's process CPU time (process.cpuUsage()).
 */
#if !defined(_WIN32) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "kernels/kernels.h"
#include "threadpool.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Process CPU time: the machine may be shared, and wall-clock rates then mostly measure the
 * other tenants. Rates are printed against both clocks (CPU time divided by the thread count). */
/* Divisor that turns a CPU time into per-thread time: the thread count. */
#define CPU_DIV(nt) (nt)

#if defined(__EMSCRIPTEN__)
#include <emscripten.h>
/* emscripten's clock() and CLOCK_PROCESS_CPUTIME_ID are the wall clock; Node's process.cpuUsage()
 * is the process's CPU time (all threads; read on the main thread, where main() runs). */
EM_JS(double, js_process_cpu_s, (void), {
    const u = process.cpuUsage();
    return (u.user + u.system) / 1e6;
});
#endif

static double now_s(void);
static double cpu_s(void)
{
#if defined(__EMSCRIPTEN__)
    return js_process_cpu_s();
#elif defined(CLOCK_PROCESS_CPUTIME_ID)
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
#else
    return (double)clock() / CLOCKS_PER_SEC;
#endif
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *const kind_names[] = {"bf16", "q8", "q8i16", "bf16xb", "q8xb", "i16i16", "q8i8",
                                         "q4", "q4xb", "q4i16", "q4i8"};
#define N_KINDS 11
#define IS_Q4(kind) ((kind) >= 7) /* matmul_q4, _xb, _i16, _i8 */
static int g_results; /* print RESULT lines */

/* Weight bytes per element of each kind (Q4: the bytes of q, without the scales). */
static size_t kind_esz(int kind)
{
    return kind == 0 || kind == 3 || kind == 5 ? 2 : 1;
}

/* Bytes of one [rows x cols] matrix: Q4 is its q bytes [rows, cols/2] then its BF16 scales
 * [rows, cols/32], as in an expert extent; the rates count both. */
static size_t mat_bytes(int kind, size_t rows, size_t cols)
{
    return IS_Q4(kind) ? rows * cols / 2 + rows * (cols / 32) * 2 : rows * cols * kind_esz(kind);
}

/* ---- DRAM streaming sum ---- */
typedef struct {
    const kvl_kernels *K;
    const uint64_t *buf;
    size_t n;
    uint64_t part[64];
} sum_ctx;

static void sum_fn(void *p, int i, int n)
{
    sum_ctx *c = (sum_ctx *)p;
    size_t b, e;
    kvl_split_range(c->n, 64, i, n, &b, &e);
    /* The table's own SIMD dot of this part with itself (a plain C sum can be instruction-bound
     * below DRAM speed on fast-memory machines): one stream. Two streams exactly half the part
     * apart ran at half speed on AMD Zen 4 with 16-byte loads (13 against 28 GB/s, bench/RESULTS.md
     * "Idle workers, huge pages and prefill products", 2026-12-04), which measured that pattern,
     * not the machine. */
    const float *f = (const float *)(const void *)(c->buf + b);
    float d = c->K->dot_f32(f, f, 2 * (e - b));
    c->part[i] = (uint64_t)(d != d); /* keeps the call; NaN-free data gives 0 */
}

/* ---- matmul over many matrices ---- */
typedef struct {
    const kvl_kernels *K;
    int kind; /* 0 bf16, 1 q8, 3 bf16 and 4 q8 with BF16-rounded activations (the *_xb entries),
                 2 q8 x i16, 6 q8 x i8 and 5 i16 x i16 (integer mode: activations quantised
                 once, outside the timing) */
    const int16_t *Xq;
    const float *xs;
    const void *W;
    const float *scale;
    size_t rows, cols, n;
    const float *X;
    float *Y;
} mm_ctx;

static void mm_fn(void *p, int i, int nt)
{
    mm_ctx *c = (mm_ctx *)p;
    size_t b, e;
    kvl_split_range(c->rows, 16, i, nt, &b, &e);
    if (b >= e)
        return;
    if (IS_Q4(c->kind)) {
        const uint8_t *q = (const uint8_t *)c->W + b * (c->cols / 2);
        const uint16_t *S = (const uint16_t *)(const void *)((const uint8_t *)c->W + c->rows * c->cols / 2) + b * (c->cols / 32);
        if (c->kind == 7)
            c->K->matmul_q4(c->Y + b, c->rows, q, S, e - b, c->cols, c->X, c->cols, c->n);
        else if (c->kind == 8)
            c->K->matmul_q4_xb(c->Y + b, c->rows, q, S, e - b, c->cols, c->X, c->cols, c->n);
        else if (c->kind == 9)
            c->K->matmul_q4_i16(c->Y + b, c->rows, q, S, e - b, c->cols, c->Xq, c->xs, c->cols, c->n);
        else
            c->K->matmul_q4_i8(c->Y + b, c->rows, q, S, e - b, c->cols, c->Xq, c->xs, c->cols, c->n);
    } else if (c->kind == 6)
        c->K->matmul_q8_i8(c->Y + b, c->rows, (const int8_t *)c->W + b * c->cols, c->scale + b,
                           e - b, c->cols, c->Xq, c->xs, c->cols, c->n);
    else if (c->kind == 2)
        c->K->matmul_q8_i16(c->Y + b, c->rows, (const int8_t *)c->W + b * c->cols, c->scale + b,
                            e - b, c->cols, c->Xq, c->xs, c->cols, c->n);
    else if (c->kind == 5)
        c->K->matmul_i16_i16(c->Y + b, c->rows, (const int16_t *)c->W + b * c->cols, c->scale + b,
                             e - b, c->cols, c->Xq, c->xs, c->cols, c->n);
    else if (c->kind == 3)
        c->K->matmul_bf16_xb(c->Y + b, c->rows, (const uint16_t *)c->W + b * c->cols, e - b, c->cols,
                             c->X, c->cols, c->n);
    else if (c->kind == 4)
        c->K->matmul_q8_xb(c->Y + b, c->rows, (const int8_t *)c->W + b * c->cols, c->scale + b, e - b,
                           c->cols, c->X, c->cols, c->n);
    else if (c->kind == 0)
        c->K->matmul_bf16(c->Y + b, c->rows, (const uint16_t *)c->W + b * c->cols, e - b, c->cols,
                          c->X, c->cols, c->n);
    else
        c->K->matmul_q8(c->Y + b, c->rows, (const int8_t *)c->W + b * c->cols, c->scale + b, e - b,
                        c->cols, c->X, c->cols, c->n);
}

/* The integer products' inputs as the engine quantises them (model.c mm_quantize): q8i16 a
 * scale per KVL_I16_BLOCK columns, i16i16 one per vector (xs holds up to n * cols scales). */
static void quantize_for(const kvl_kernels *K, int kind, int16_t *Xq, float *xs, const float *X,
                         size_t cols, size_t n)
{
    if (kind == 2 || kind == 6 || kind == 9 || kind == 10)
        K->quantize_i16_act(Xq, xs, X, cols, n, cols, cols, KVL_I16_BLOCK,
                            kind == 6 || kind == 10 ? KVL_I8_MAX : KVL_I16_Q8_MAX);
    else if (IS_Q4(kind))
        return; /* FP32 activations */
    else
        K->quantize_i16_act(Xq, xs, X, cols, n, cols, cols, cols, KVL_I16_MAX);
}

/* Normal (never denormal) values: denormal bf16 weights would hit FMA microcode assists and
 * measure those instead of the kernel. */
static void fill_weights(unsigned char *W, int kind, size_t bytes, size_t rows, size_t cols)
{
    if (IS_Q4(kind)) { /* per matrix: any q bytes, then scales of both signs */
        const size_t mb = mat_bytes(kind, rows, cols), qb = rows * cols / 2;
        for (size_t m = 0; m + mb <= bytes; m += mb) {
            for (size_t i = 0; i < qb; i++)
                W[m + i] = (unsigned char)((i * 2654435761u) >> 13);
            uint16_t *S = (uint16_t *)(void *)(W + m + qb);
            for (size_t i = 0; i < rows * (cols / 32); i++)
                S[i] = kvl_float_to_bf16(i % 3 ? 0.01f : -0.013f);
        }
    } else if (kind == 0 || kind == 3) {
        uint16_t *h = (uint16_t *)(void *)W;
        for (size_t i = 0; i < bytes / 2; i++)
            h[i] = kvl_float_to_bf16(0.01f * (float)((int)((i * 2654435761u) >> 20 & 0xff) - 128) + 0.001f);
    } else if (kind == 5) { /* int16 in [-32767, 32767], as kvl_quantize_rows_i16 makes */
        int16_t *h = (int16_t *)(void *)W;
        for (size_t i = 0; i < bytes / 2; i++)
            h[i] = (int16_t)((int)((uint32_t)(i * 2654435761u) >> 12 & 0xffff) % 65535 - 32767);
    } else { /* Q8: int8 in [-127, 127], as the packer makes (the 8-bit dot products rely on it) */
        for (size_t i = 0; i < bytes; i++) {
            W[i] = (unsigned char)((i * 2654435761u) >> 13);
            if (W[i] == 0x80)
                W[i] = 0x81;
        }
    }
}

static void bench_decode(kvl_pool *pool, const kvl_kernels *K, int kind, size_t rows, size_t cols,
                         size_t nmat)
{
    size_t mbytes = mat_bytes(kind, rows, cols);
    if (nmat == 0) /* ~1.1 GB of distinct matrices */
        nmat = ((size_t)1100 << 20) / mbytes;
    unsigned char *W = (unsigned char *)malloc(mbytes * nmat);
    float *scale = (float *)malloc(rows * sizeof(float));
    float *X = (float *)malloc(cols * sizeof(float));
    float *Y = (float *)malloc(rows * sizeof(float));
    if (!W || !scale || !X || !Y) {
        printf("out of memory\n");
        exit(1);
    }
    fill_weights(W, kind, mbytes * nmat, rows, cols);
    for (size_t r = 0; r < rows; r++)
        scale[r] = 0.01f;
    for (size_t c = 0; c < cols; c++)
        X[c] = 0.001f * (float)(c % 17);
    int16_t *Xq = (int16_t *)malloc(cols * sizeof(int16_t));
    float *xs = (float *)malloc(cols * sizeof(float));
    quantize_for(K, kind, Xq, xs, X, cols, 1);
    mm_ctx ctx = {K, kind, Xq, xs, NULL, scale, rows, cols, 1, X, Y};
    double best = 1e30, bestc = 1e30;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = now_s(), c0 = cpu_s();
        for (size_t m = 0; m < nmat * (nmat == 1 ? 2000 : 1); m++) {
            ctx.W = W + (m % nmat) * mbytes;
            kvl_pool_run(pool, mm_fn, &ctx);
        }
        double dt = now_s() - t0, dc = (cpu_s() - c0) / CPU_DIV(kvl_pool_size(pool));
        if (nmat == 1) {
            dt /= 2000;
            dc /= 2000;
        }
        if (dt < best)
            best = dt;
        if (dc < bestc)
            bestc = dc;
    }
    printf("  %-6s %-6s [%5zu x %zu] x %3zu mats (%4.0f MB), %d thr: %6.2f GB/s wall, %6.2f GB/s cpu\n",
           K->name, kind_names[kind], rows, cols, nmat, (double)(mbytes * nmat) / 1e6,
           kvl_pool_size(pool), (double)(mbytes * nmat) / best / 1e9,
           (double)(mbytes * nmat) / bestc / 1e9);
    if (g_results)
        printf("RESULT %s %s %zux%zux%zu %d %.2f\n", K->name, kind_names[kind], rows, cols, nmat,
               kvl_pool_size(pool), (double)(mbytes * nmat) / best / 1e9);
    fflush(stdout);
    free(Xq);
    free(xs);
    free(W);
    free(scale);
    free(X);
    free(Y);
}

static void bench_batch(kvl_pool *pool, const kvl_kernels *K, int kind, size_t rows, size_t cols,
                        size_t n)
{
    const size_t mbytes = mat_bytes(kind, rows, cols);
    unsigned char *W = (unsigned char *)malloc(mbytes);
    float *scale = (float *)malloc(rows * sizeof(float));
    float *X = (float *)malloc(n * cols * sizeof(float));
    float *Y = (float *)malloc(n * rows * sizeof(float));
    if (!W || !scale || !X || !Y) {
        printf("out of memory\n");
        exit(1);
    }
    fill_weights(W, kind, mbytes, rows, cols);
    for (size_t r = 0; r < rows; r++)
        scale[r] = 0.01f;
    for (size_t i = 0; i < n * cols; i++)
        X[i] = 0.001f * (float)(i % 17);
    int16_t *Xq = (int16_t *)malloc(n * cols * sizeof(int16_t));
    float *xs = (float *)malloc(n * cols * sizeof(float));
    quantize_for(K, kind, Xq, xs, X, cols, n);
    mm_ctx ctx = {K, kind, Xq, xs, W, scale, rows, cols, n, X, Y};
    double best = 1e30, bestc = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now_s(), c0 = cpu_s();
        kvl_pool_run(pool, mm_fn, &ctx);
        double dt = now_s() - t0, dc = (cpu_s() - c0) / CPU_DIV(kvl_pool_size(pool));
        if (dt < best)
            best = dt;
        if (dc < bestc)
            bestc = dc;
    }
    double flop = 2.0 * (double)rows * (double)cols * (double)n;
    printf("  %-6s %-6s [%5zu x %zu] x %zu tokens, %d thr: %6.1f GFLOP/s wall, %6.1f GFLOP/s cpu\n",
           K->name, kind_names[kind], rows, cols, n, kvl_pool_size(pool),
           flop / best / 1e9, flop / bestc / 1e9);
    free(Xq);
    free(xs);
    free(W);
    free(scale);
    free(X);
    free(Y);
}

static void empty_fn(void *p, int i, int n)
{
    (void)p;
    (void)i;
    (void)n;
}

static void bench_table(const kvl_kernels *K, int decode_only)
{
    printf("kernels: %s\n", K->name);
    size_t nbuf = (size_t)1 << 27; /* 1 GiB of uint64 */
    uint64_t *buf = (uint64_t *)malloc(nbuf * sizeof(uint64_t));
    if (!buf)
        exit(1);
    for (size_t i = 0; i < nbuf; i++)
        buf[i] = 0x3F8000003F800000ull; /* pairs of 1.0f */
    for (int nt = 1; nt <= 2; nt++) {
        kvl_pool *pool = kvl_pool_create(nt);
        sum_ctx sc;
        memset(&sc, 0, sizeof sc);
        sc.K = K;
        sc.buf = buf;
        sc.n = nbuf;
        double best = 1e30, bestc = 1e30;
        uint64_t total = 0;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now_s(), c0 = cpu_s();
            kvl_pool_run(pool, sum_fn, &sc);
            double dt = now_s() - t0, dc = (cpu_s() - c0) / CPU_DIV(nt);
            if (dt < best)
                best = dt;
            if (dc < bestc)
                bestc = dc;
            for (int i = 0; i < nt; i++)
                total += sc.part[i];
        }
        printf("  DRAM streaming sum 1 GiB, %d thr: %6.2f GB/s wall, %6.2f GB/s cpu (checksum %llu)\n",
               nt, (double)(nbuf * 8) / best / 1e9, (double)(nbuf * 8) / bestc / 1e9,
               (unsigned long long)total);
        if (g_results)
            printf("RESULT %s dram 1GiB %d %.2f\n", K->name, nt, (double)(nbuf * 8) / best / 1e9);
        kvl_pool_free(pool);
    }
    free(buf);

    for (int nt = 1; nt <= 2; nt++) {
        kvl_pool *pool = kvl_pool_create(nt);
        if (decode_only) {
            double t0 = now_s();
            for (int k = 0; k < 20000; k++)
                kvl_pool_run(pool, empty_fn, NULL);
            printf("  kvl_pool_run fork/join of an empty task, %d thr: %.2f us\n", nt,
                   (now_s() - t0) / 20000 * 1e6);
            /* The same after 50 us of serial work on the caller, as between the products of a
             * decode step: a worker that stopped spinning by then pays a wake here. */
            double in_runs = 0;
            for (int k = 0; k < 2000; k++) {
                double t1 = now_s();
                while (now_s() - t1 < 50e-6)
                    ;
                t1 = now_s();
                kvl_pool_run(pool, empty_fn, NULL);
                in_runs += now_s() - t1;
            }
            printf("  kvl_pool_run fork/join of an empty task after a 50 us gap, %d thr: %.2f us\n",
                   nt, in_runs / 2000 * 1e6);
            /* ~1.1 GB of distinct weights per product (more than any L3), then in cache */
            static const int kinds[] = {0, 1, 3, 4, 2, 5, 6, 7, 8, 9, 10};
            for (int k = 0; k < 11; k++)
                bench_decode(pool, K, kinds[k], 1408, 2048, IS_Q4(kinds[k]) ? 0 : kind_esz(kinds[k]) == 2 ? 192 : 384);
            /* dense-size matrices: 8x the work per pool run */
            bench_decode(pool, K, 2, 11264, 2048, 48);
            bench_decode(pool, K, 5, 11264, 2048, 24);
            bench_decode(pool, K, 6, 11264, 2048, 48);
            for (int k = 0; k < 11; k++)
                bench_decode(pool, K, kinds[k], 256, 2048, 1);
            kvl_pool_free(pool);
            continue;
        }
        double t0 = now_s();
        for (int k = 0; k < 100000; k++)
            kvl_pool_run(pool, empty_fn, NULL);
        printf("  kvl_pool_run fork/join of an empty task, %d thr: %.2f us\n", nt,
               (now_s() - t0) / 100000 * 1e6);
        /* ~1.1 GB of distinct weights per run: more than any L3 (this VM reports 480 MB). */
        bench_decode(pool, K, 0, 1408, 2048, 192);
        bench_decode(pool, K, 0, 11264, 2048, 24);
        bench_decode(pool, K, 1, 1408, 2048, 384);
        bench_decode(pool, K, 1, 11264, 2048, 48);
        bench_decode(pool, K, 2, 1408, 2048, 384);
        bench_decode(pool, K, 6, 1408, 2048, 384);
        bench_decode(pool, K, 5, 1408, 2048, 192);
        for (int kind = 7; kind < N_KINDS; kind++) /* Q4 experts: ~1.1 GB of matrices, then in cache */
            bench_decode(pool, K, kind, 1408, 2048, 0);
        for (int kind = 7; kind < N_KINDS; kind++)
            bench_decode(pool, K, kind, 256, 2048, 1);
        /* one matrix over and over: in-cache speed, i.e. what the kernel could do with
         * infinite bandwidth */
        bench_decode(pool, K, 0, 256, 2048, 1);
        bench_decode(pool, K, 1, 256, 2048, 1);
        bench_decode(pool, K, 2, 256, 2048, 1);
        bench_decode(pool, K, 6, 256, 2048, 1);
        bench_decode(pool, K, 5, 256, 2048, 1);
        bench_decode(pool, K, 3, 1408, 2048, 192);
        bench_decode(pool, K, 4, 1408, 2048, 384);
        bench_decode(pool, K, 3, 256, 2048, 1);
        bench_decode(pool, K, 4, 256, 2048, 1);
        for (int kind = 0; kind <= 5; kind++)
            bench_batch(pool, K, kind, 1408, 2048, 64);
        for (int kind = 7; kind < N_KINDS; kind++)
            bench_batch(pool, K, kind, 1408, 2048, 8); /* a routed expert's share of a prompt chunk */
        bench_batch(pool, K, 0, 2048, 2048, 512);
        bench_batch(pool, K, 3, 2048, 2048, 512);
        bench_batch(pool, K, 1, 1408, 2048, 48);
        bench_batch(pool, K, 4, 1408, 2048, 48);
        kvl_pool_free(pool);
    }
}

/* ---- interleaved A/B of two tables on one decode product ----
 * KIND's decode (n = 1) over ~1.1 GB of distinct [1408 x 2048] matrices (DRAM-bound) and over one
 * [256 x 2048] matrix again and again (in cache), 1 and 2 threads: the two tables alternate,
 * AB_ROUNDS rounds on the same data, and each keeps its best round, by the wall clock and by CPU
 * time per thread. On a shared machine that is the fair comparison (both see the same
 * neighbours; the best of many rounds is what the kernel can do; CPU time leaves out the time
 * other processes had the cores). The activations have both signs. The two outputs are compared
 * bit for bit. RESULT lines as decode mode's (wall), then "RESULTCPU" lines (CPU time). */
#define AB_ROUNDS 12
static void bench_ab(const kvl_kernels *T[2], const int kind[2])
{
    static const size_t shapes[][3] = {{1408, 2048, 0}, {256, 2048, 1}}; /* 0: ~1.1 GB of matrices */
    for (size_t s = 0; s < 2; s++) {
        const size_t rows = shapes[s][0], cols = shapes[s][1];
        size_t mbytes[2], nmat[2], runs[2];
        unsigned char *W[2];
        int16_t *Xq[2];
        float *xs[2];
        float *scale = (float *)malloc(rows * sizeof(float)), *X = (float *)malloc(cols * sizeof(float));
        float *Y[2] = {(float *)malloc(rows * sizeof(float)), (float *)malloc(rows * sizeof(float))};
        if (!scale || !X || !Y[0] || !Y[1]) {
            printf("out of memory\n");
            exit(1);
        }
        for (size_t r = 0; r < rows; r++)
            scale[r] = 0.01f;
        for (size_t c = 0; c < cols; c++)
            X[c] = 0.001f * (float)((int)(c % 17) - 8);
        for (int t = 0; t < 2; t++) { /* the same kind on both sides shares its matrices */
            mbytes[t] = mat_bytes(kind[t], rows, cols);
            nmat[t] = shapes[s][2] ? shapes[s][2] : ((size_t)1100 << 20) / mbytes[t];
            runs[t] = nmat[t] == 1 ? 2000 : nmat[t];
            W[t] = t == 1 && kind[1] == kind[0] ? W[0] : (unsigned char *)malloc(mbytes[t] * nmat[t]);
            Xq[t] = (int16_t *)malloc(cols * sizeof(int16_t));
            xs[t] = (float *)malloc(cols * sizeof(float));
            if (!W[t] || !Xq[t] || !xs[t]) {
                printf("out of memory\n");
                exit(1);
            }
            if (t == 0 || W[1] != W[0])
                fill_weights(W[t], kind[t], mbytes[t] * nmat[t], rows, cols);
            quantize_for(T[0], kind[t], Xq[t], xs[t], X, cols, 1);
        }
        for (int nt = 1; nt <= 2; nt++) {
            kvl_pool *pool = kvl_pool_create(nt);
            double best[2] = {1e30, 1e30}, bestc[2] = {1e30, 1e30};
            for (int round = 0; round < AB_ROUNDS; round++)
                for (int t = 0; t < 2; t++) {
                    mm_ctx ctx = {T[t], kind[t], Xq[t], xs[t], NULL, scale, rows, cols, 1, X, Y[t]};
                    double t0 = now_s(), c0 = cpu_s();
                    for (size_t m = 0; m < runs[t]; m++) {
                        ctx.W = W[t] + (m % nmat[t]) * mbytes[t];
                        kvl_pool_run(pool, mm_fn, &ctx);
                    }
                    double dt = (now_s() - t0) / (double)runs[t], dc = (cpu_s() - c0) / CPU_DIV(nt) / (double)runs[t];
                    if (dt < best[t])
                        best[t] = dt;
                    if (dc < bestc[t])
                        bestc[t] = dc;
                }
            for (int t = 0; t < 2; t++)
                printf("RESULT %s %s %zux%zux%zu %d %.2f\nRESULTCPU %s %s %zux%zux%zu %d %.2f\n", T[t]->name,
                       kind_names[kind[t]], rows, cols, nmat[t], nt, (double)mbytes[t] / best[t] / 1e9, T[t]->name,
                       kind_names[kind[t]], rows, cols, nmat[t], nt, (double)mbytes[t] / bestc[t] / 1e9);
            if (kind[0] == kind[1])
                printf("  %s / %s, %s [%zu x %zu] x %zu, %d thr: %.2f wall, %.2f cpu (outputs %s)\n", T[1]->name,
                       T[0]->name, kind_names[kind[0]], rows, cols, nmat[0], nt, best[0] / best[1], bestc[0] / bestc[1],
                       memcmp(Y[0], Y[1], rows * sizeof(float)) == 0 ? "identical" : "DIFFER");
            else /* GB/s against GB/s, and matrices per second (one token's product each) */
                printf("  %s %s / %s %s [%zu x %zu], %d thr: %.2f GB/s ratio wall, %.2f cpu; %.2f products/s ratio wall\n",
                       T[1]->name, kind_names[kind[1]], T[0]->name, kind_names[kind[0]], rows, cols, nt,
                       ((double)mbytes[1] / best[1]) / ((double)mbytes[0] / best[0]),
                       ((double)mbytes[1] / bestc[1]) / ((double)mbytes[0] / bestc[0]), best[0] / best[1]);
            fflush(stdout);
            kvl_pool_free(pool);
        }
        for (int t = 0; t < 2; t++) {
            if (t == 0 || W[1] != W[0])
                free(W[t]);
            free(Xq[t]), free(xs[t]);
        }
        free(scale), free(X), free(Y[0]), free(Y[1]);
    }
}

int main(int argc, char **argv)
{
    const char *which = argc > 1 ? argv[1] : "0";
    if (strcmp(which, "ab") == 0) {
        const kvl_kernels *T[2] = {argc > 3 ? kvl_kernels_by_name(argv[2]) : NULL,
                                   argc > 3 ? kvl_kernels_by_name(argv[3]) : NULL};
        int kind[2] = {-1, -1}; /* KIND, or KIND_A,KIND_B: one kind per table */
        const char *ks = argc > 4 ? argv[4] : "";
        const char *comma = strchr(ks, ',');
        for (int k = 0; k < N_KINDS; k++) {
            const size_t len = strlen(kind_names[k]);
            if (comma ? (size_t)(comma - ks) == len && strncmp(ks, kind_names[k], len) == 0 : strcmp(ks, kind_names[k]) == 0)
                kind[0] = k;
            if (strcmp(comma ? comma + 1 : ks, kind_names[k]) == 0)
                kind[1] = k;
        }
        if (!T[0] || !T[1] || kind[0] < 0 || kind[1] < 0) {
            printf("usage: kernels_bench ab TABLE_A TABLE_B KIND[,KIND_B] (tables supported here, KIND one of bf16 q8 q8i16 bf16xb q8xb i16i16 q8i8 q4 q4xb q4i16 q4i8)\n");
            return 1;
        }
        bench_ab(T, kind);
        return 0;
    }
    int decode_only = argc > 2 && strcmp(argv[2], "decode") == 0;
    g_results = decode_only;
    if (strcmp(which, "all") == 0) {
        const char *const *names = kvl_kernels_compiled_names();
        for (size_t i = 0; names[i]; i++) {
            const kvl_kernels *K = kvl_kernels_by_name(names[i]);
            if (K)
                bench_table(K, decode_only);
            else
                printf("kernels: %s not supported on this CPU\n", names[i]);
        }
        return 0;
    }
    const kvl_kernels *K = which[0] >= '0' && which[0] <= '9' ? kvl_kernels_select(atoi(which))
                                                               : kvl_kernels_by_name(which);
    if (!K) {
        printf("kernels %s not supported\n", which);
        return 1;
    }
    bench_table(K, decode_only);
    return 0;
}
