/* vision_gemm_bench.c — CPU-time GFLOP/s of the vision tower's three product paths on one thread.
 *
 * Owns: timing figures only (asserts nothing; correctness: kernels_conformance.c gemm_bf16,
 * gemm_bf16_xb, gemm_bf16_amx). Times, on MoonViT's shapes (tokens x rows x cols), the FP32
 * blocked GEMM (kvl_gemm_bf16 on the avx512 tile), the BF16 one on VDPBF16PS (kvl_gemm_bf16_xb on
 * the avx512-bf16 tile) and the AMX one (kvl_gemm_bf16_amx, where AMX runs), best of 3 in
 * process CPU time, and the largest difference between the AMX and VDPBF16PS results.
 *
 * Build and run (from the repo root; Linux x86-64):
 *   S=wasm-core/src; K=$S/kernels; gcc -std=gnu11 -O2 -DKVL_X86=1 -I$S -Iwasm-core/include -c $K/kernels_ref.c $K/kernels_select.c $K/kernels_gemm.c
 *   gcc -std=gnu11 -O2 -DKVL_X86=1 -mavx2 -mfma -mf16c -I$S -Iwasm-core/include -c $K/x86/kernels_avx2.c
 *   gcc -std=gnu11 -O2 -DKVL_X86=1 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c -I$S -Iwasm-core/include -c $K/x86/kernels_avx512.c
 *   gcc -std=gnu11 -O2 -I$S -Iwasm-core/include bench/vision_gemm_bench.c kernels_*.o -lm -lpthread -o /tmp/vision_gemm_bench
 *   /tmp/vision_gemm_bench            (the shapes of a 1024x1024 image's 4356 tokens, and 1024)
 */
#define _GNU_SOURCE
#include "kernels/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void run(const kvl_kernels *f32, const kvl_kernels *bf, size_t n, size_t rows, size_t cols)
{
    uint16_t *W = malloc(rows * cols * 2);
    float *X = malloc(n * cols * 4), *Y = malloc(n * rows * 4), *Y2 = malloc(n * rows * 4);
    float *work = aligned_alloc(64, KVL_GEMM_WORK_FLOATS * 4);
    unsigned s = 1;
    for (size_t i = 0; i < rows * cols; i++) {
        s = s * 1664525u + 1013904223u;
        W[i] = (uint16_t)(0x3c00 + (s >> 20) % 300 + ((s >> 8) & 1 ? 0x8000 : 0));
    }
    for (size_t i = 0; i < n * cols; i++) {
        s = s * 1664525u + 1013904223u;
        X[i] = (float)((int)(s >> 16) % 2000 - 1000) * 1e-3f;
    }
    const char *names[3] = {"fp32 (avx512 tile)", "bf16 VDPBF16PS (xb)", "bf16 AMX"};
    for (int m = 0; m < 3; m++) {
        if (m == 1 && !bf)
            continue;
        if (m == 2 && !kvl_gemm_amx_available())
            continue;
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
            const double t = cpu_s();
            if (m == 0)
                kvl_gemm_bf16(f32, Y, rows, W, rows, cols, X, cols, n, work);
            else if (m == 1)
                kvl_gemm_bf16_xb(bf, Y, rows, W, rows, cols, X, cols, n, work);
            else
                kvl_gemm_bf16_amx(Y2, rows, W, rows, cols, X, cols, n, work);
            const double e = cpu_s() - t;
            if (e < best)
                best = e;
        }
        printf("n=%zu rows=%zu cols=%zu %-22s %.4f CPU-s %7.1f GFLOP/s\n", n, rows, cols, names[m], best,
               2.0 * (double)n * (double)rows * (double)cols / best / 1e9);
    }
    if (bf && kvl_gemm_amx_available()) {
        double d = 0, mx = 0;
        for (size_t i = 0; i < n * rows; i++) {
            d = fmax(d, fabs((double)Y[i] - Y2[i]));
            mx = fmax(mx, fabs((double)Y[i]));
        }
        printf("  AMX vs VDPBF16PS: max |diff| %.3g of max %.3g\n", d, mx);
    }
    free(W), free(X), free(Y), free(Y2), free(work);
}

int main(void)
{
    const kvl_kernels *f32 = kvl_kernels_by_name("avx512");
    const kvl_kernels *bf = kvl_kernels_by_name("avx512-bf16");
    if (!f32) {
        fprintf(stderr, "needs AVX-512\n");
        return 1;
    }
    static const size_t shapes[][3] = {{4356, 3456, 1152}, {4356, 1152, 1152}, {4356, 4304, 1152},
                                       {4356, 1152, 4304}, {1024, 1152, 1152}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        run(f32, bf, shapes[i][0], shapes[i][1], shapes[i][2]);
    return 0;
}
