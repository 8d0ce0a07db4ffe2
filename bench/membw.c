/* membw.c — this machine's physical limits for `kvl bench`: DRAM streaming-read bandwidth,
 * direct-I/O (O_DIRECT) read bandwidth of a file, and peak FP32 FMA throughput.
 *
 * Owns: measurements only (prints one JSON object per run on stdout; asserts nothing).
 * Does not own: anything of the kvl library; it links nothing from wasm-core/.
 *
 * Linux only (pthreads, O_DIRECT). Build: gcc -std=c11 -O2 -mavx2 -mfma bench/membw.c -lpthread -o membw
 *   membw dram  SIZE_MIB THREADS REPS [avx512]
 *                                            each thread reads its own contiguous slice with
 *                                            256-bit (or 512-bit) loads; wall time from a common
 *                                            start barrier to the last thread's end; best and
 *                                            median of REPS
 *   membw ssd   FILE BLOCK_BYTES QD READS SEED
 *                                            READS O_DIRECT preads of BLOCK_BYTES (rounded up to
 *                                            4 KiB) at random 4 KiB-aligned offsets, QD threads
 *                                            each with one read in flight (queue depth QD)
 *   membw fma   THREADS SECONDS              FP32 FMA peak (AVX2 256-bit and, if the CPU has it,
 *                                            AVX-512), 12 independent accumulators per thread
 * Drop the page cache before `ssd` (echo 3 > /proc/sys/vm/drop_caches); O_DIRECT bypasses it
 * anyway, but a host-side cache under a virtual disk cannot be dropped from inside the guest.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- DRAM streaming read ------------------------------------------------------------------ */

typedef struct {
    const __m256i *base;
    size_t n_vec;
    pthread_barrier_t *start;
    pthread_barrier_t *stop;
    int reps;
    uint64_t sink;
} dram_arg;

static uint64_t read_slice(const __m256i *p, size_t n_vec)
{
    /* four independent OR chains so the loop is load-bound, not latency-bound */
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    size_t i = 0;
    for (; i + 4 <= n_vec; i += 4) {
        a = _mm256_or_si256(a, _mm256_load_si256(p + i));
        b = _mm256_or_si256(b, _mm256_load_si256(p + i + 1));
        c = _mm256_or_si256(c, _mm256_load_si256(p + i + 2));
        d = _mm256_or_si256(d, _mm256_load_si256(p + i + 3));
    }
    for (; i < n_vec; i++) a = _mm256_or_si256(a, _mm256_load_si256(p + i));
    a = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, a);
    return out[0] ^ out[1] ^ out[2] ^ out[3];
}

__attribute__((target("avx512f")))
static uint64_t read_slice512(const __m256i *p256, size_t n_vec256)
{
    const __m512i *p = (const __m512i *)p256;
    size_t n_vec = n_vec256 / 2;
    __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
    size_t i = 0;
    for (; i + 4 <= n_vec; i += 4) {
        a = _mm512_or_si512(a, _mm512_load_si512(p + i));
        b = _mm512_or_si512(b, _mm512_load_si512(p + i + 1));
        c = _mm512_or_si512(c, _mm512_load_si512(p + i + 2));
        d = _mm512_or_si512(d, _mm512_load_si512(p + i + 3));
    }
    for (; i < n_vec; i++) a = _mm512_or_si512(a, _mm512_load_si512(p + i));
    a = _mm512_or_si512(_mm512_or_si512(a, b), _mm512_or_si512(c, d));
    return (uint64_t)_mm512_reduce_or_epi64(a);
}

static int g_use512;

static void *dram_worker(void *arg)
{
    dram_arg *w = (dram_arg *)arg;
    for (int r = 0; r < w->reps; r++) {
        pthread_barrier_wait(w->start);
        w->sink ^= g_use512 ? read_slice512(w->base, w->n_vec) : read_slice(w->base, w->n_vec);
        pthread_barrier_wait(w->stop);
    }
    return NULL;
}

static int run_dram(size_t size_mib, int threads, int reps, int use512)
{
    g_use512 = use512 && __builtin_cpu_supports("avx512f");
    size_t bytes = size_mib << 20;
    void *buf = NULL;
    if (threads < 1 || reps < 1 || posix_memalign(&buf, 4096, bytes) != 0) {
        fprintf(stderr, "membw dram: bad arguments or cannot allocate %zu MiB\n", size_mib);
        return 1;
    }
    /* write every page so reads hit real memory (not the shared zero page) */
    for (size_t i = 0; i < bytes; i += 8) ((uint64_t *)buf)[i / 8] = i * 0x9E3779B97F4A7C15ull;
    pthread_barrier_t start, stop;
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&stop, NULL, (unsigned)threads + 1);
    size_t total_vec = bytes / 32, per = total_vec / (size_t)threads;
    dram_arg *args = calloc((size_t)threads, sizeof *args);
    pthread_t *tids = calloc((size_t)threads, sizeof *tids);
    double *secs = calloc((size_t)reps, sizeof *secs);
    for (int t = 0; t < threads; t++) {
        args[t].base = (const __m256i *)buf + (size_t)t * per;
        args[t].n_vec = (t == threads - 1) ? total_vec - (size_t)t * per : per;
        args[t].start = &start;
        args[t].stop = &stop;
        args[t].reps = reps;
        pthread_create(&tids[t], NULL, dram_worker, &args[t]);
    }
    for (int r = 0; r < reps; r++) {
        pthread_barrier_wait(&start);
        double t0 = now_s();
        pthread_barrier_wait(&stop);
        secs[r] = now_s() - t0;
    }
    uint64_t sink = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tids[t], NULL);
        sink ^= args[t].sink;
    }
    qsort(secs, (size_t)reps, sizeof *secs, cmp_double);
    printf("{\"mode\": \"dram\", \"isa\": \"%s\", \"threads\": %d, \"bytes\": %zu, "
           "\"reps\": %d, \"best_bytes_per_s\": %.0f, \"median_bytes_per_s\": %.0f, "
           "\"sink\": %llu}\n", g_use512 ? "avx512" : "avx2", threads, bytes, reps, (double)bytes / secs[0], (double)bytes / secs[reps / 2],
           (unsigned long long)(sink & 1));
    free(secs);
    free(tids);
    free(args);
    free(buf);
    return 0;
}

/* ---- direct reads -------------------------------------------------------------------------- */

typedef struct {
    int fd;
    size_t block;
    uint64_t n_slots;        /* number of 4 KiB-aligned start offsets */
    int reads;
    uint64_t rng;
    uint64_t bytes_done;
    int failed;
    char *buf; /* read_buffer(block), made before the clock starts */
} ssd_arg;

static uint64_t next_rand(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Memory for a read buffer as the engine's caches get it: 2 MiB-aligned and, on Linux, asked for
 * transparent huge pages (wasm-core/src/platform.h kvl_os_advise_hugepages), then touched so the
 * pages exist before the clock starts. Direct reads into 4 KiB pages ran 1.3-1.6x slower on a
 * virtio disk (bench/RESULTS.md "Idle workers, huge pages and prefill products", 2026-12-04): a
 * buffer without the advice measured the page size, not the disk. */
static void *read_buffer(size_t bytes)
{
    void *buf = NULL;
    size_t rounded = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    if (posix_memalign(&buf, 2u << 20, rounded) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(buf, rounded, MADV_HUGEPAGE);
#endif
    memset(buf, 0, rounded);
    return buf;
}

static void *ssd_worker(void *arg)
{
    ssd_arg *w = (ssd_arg *)arg;
    char *buf = w->buf;
    for (int i = 0; i < w->reads; i++) {
        off_t off = (off_t)(next_rand(&w->rng) % w->n_slots) * 4096;
        size_t done = 0;
        while (done < w->block) {
            ssize_t got = pread(w->fd, buf + done, w->block - done, off + (off_t)done);
            if (got <= 0) {
                w->failed = 1;
                return NULL;
            }
            done += (size_t)got;
        }
        w->bytes_done += done;
    }
    return NULL;
}

static int run_ssd(const char *path, size_t block, int qd, int reads, uint64_t seed)
{
    block = (block + 4095) / 4096 * 4096;
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) {
        fprintf(stderr, "membw ssd: cannot open %s with O_DIRECT: %s\n", path, strerror(errno));
        return 1;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size < block + 4096 || qd < 1 || reads < qd) {
        fprintf(stderr, "membw ssd: %s too small for %zu-byte blocks, or bad qd/reads\n", path, block);
        close(fd);
        return 1;
    }
    ssd_arg *args = calloc((size_t)qd, sizeof *args);
    pthread_t *tids = calloc((size_t)qd, sizeof *tids);
    int failed = !args || !tids;
    for (int t = 0; !failed && t < qd; t++)
        failed = !(args[t].buf = read_buffer(block));
    if (failed) {
        fprintf(stderr, "membw ssd: cannot allocate %d read buffers of %zu bytes\n", qd, block);
        for (int t = 0; args && t < qd; t++) free(args[t].buf);
        free(args);
        free(tids);
        close(fd);
        return 1;
    }
    double t0 = now_s();
    for (int t = 0; t < qd; t++) {
        args[t].fd = fd;
        args[t].block = block;
        args[t].n_slots = ((uint64_t)sb.st_size - block) / 4096 + 1;
        args[t].reads = reads / qd;
        args[t].rng = seed * 1000003u + (uint64_t)t;
        pthread_create(&tids[t], NULL, ssd_worker, &args[t]);
    }
    uint64_t bytes = 0;
    for (int t = 0; t < qd; t++) {
        pthread_join(tids[t], NULL);
        bytes += args[t].bytes_done;
        failed |= args[t].failed;
    }
    double secs = now_s() - t0;
    for (int t = 0; t < qd; t++) free(args[t].buf);
    close(fd);
    free(tids);
    free(args);
    if (failed) {
        fprintf(stderr, "membw ssd: a direct read of %s failed\n", path);
        return 1;
    }
    printf("{\"mode\": \"ssd\", \"file\": \"%s\", \"block\": %zu, \"qd\": %d, \"reads\": %d, "
           "\"bytes\": %llu, \"seconds\": %.3f, \"bytes_per_s\": %.0f}\n",
           path, block, qd, (reads / qd) * qd, (unsigned long long)bytes, secs,
           (double)bytes / secs);
    return 0;
}

/* ---- FMA peak ---------------------------------------------------------------------------- */

typedef struct {
    double seconds;
    int avx512;
    double flops;
    float sink;
} fma_arg;

#define FMA_ITERS 1000000

static double fma_avx2_block(float *sink)
{
    __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    /* distinct seeds: identical chains would be merged into one by the compiler */
    __m256 a0 = _mm256_set1_ps(1.00f), a1 = _mm256_set1_ps(1.01f), a2 = _mm256_set1_ps(1.02f);
    __m256 a3 = _mm256_set1_ps(1.03f), a4 = _mm256_set1_ps(1.04f), a5 = _mm256_set1_ps(1.05f);
    __m256 a6 = _mm256_set1_ps(1.06f), a7 = _mm256_set1_ps(1.07f), a8 = _mm256_set1_ps(1.08f);
    __m256 a9 = _mm256_set1_ps(1.09f), a10 = _mm256_set1_ps(1.10f), a11 = _mm256_set1_ps(1.11f);
    for (int i = 0; i < FMA_ITERS; i++) {
        a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c);
        a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c);
        a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float out[8];
    _mm256_storeu_ps(out, s);
    *sink += out[0];
    return (double)FMA_ITERS * 12 * 8 * 2;
}

__attribute__((target("avx512f")))
static double fma_avx512_block(float *sink)
{
    __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    __m512 a0 = _mm512_set1_ps(1.00f), a1 = _mm512_set1_ps(1.01f), a2 = _mm512_set1_ps(1.02f);
    __m512 a3 = _mm512_set1_ps(1.03f), a4 = _mm512_set1_ps(1.04f), a5 = _mm512_set1_ps(1.05f);
    __m512 a6 = _mm512_set1_ps(1.06f), a7 = _mm512_set1_ps(1.07f), a8 = _mm512_set1_ps(1.08f);
    __m512 a9 = _mm512_set1_ps(1.09f), a10 = _mm512_set1_ps(1.10f), a11 = _mm512_set1_ps(1.11f);
    for (int i = 0; i < FMA_ITERS; i++) {
        a0 = _mm512_fmadd_ps(a0, m, c); a1 = _mm512_fmadd_ps(a1, m, c);
        a2 = _mm512_fmadd_ps(a2, m, c); a3 = _mm512_fmadd_ps(a3, m, c);
        a4 = _mm512_fmadd_ps(a4, m, c); a5 = _mm512_fmadd_ps(a5, m, c);
        a6 = _mm512_fmadd_ps(a6, m, c); a7 = _mm512_fmadd_ps(a7, m, c);
        a8 = _mm512_fmadd_ps(a8, m, c); a9 = _mm512_fmadd_ps(a9, m, c);
        a10 = _mm512_fmadd_ps(a10, m, c); a11 = _mm512_fmadd_ps(a11, m, c);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    *sink += _mm512_reduce_add_ps(s);
    return (double)FMA_ITERS * 12 * 16 * 2;
}

static void *fma_worker(void *arg)
{
    fma_arg *w = (fma_arg *)arg;
    double t0 = now_s();
    while (now_s() - t0 < w->seconds)
        w->flops += w->avx512 ? fma_avx512_block(&w->sink) : fma_avx2_block(&w->sink);
    w->seconds = now_s() - t0;
    return NULL;
}

static int run_fma(int threads, double seconds)
{
    int have512 = __builtin_cpu_supports("avx512f") ? 1 : 0;
    for (int isa = 0; isa <= have512; isa++) {
        fma_arg *args = calloc((size_t)threads, sizeof *args);
        pthread_t *tids = calloc((size_t)threads, sizeof *tids);
        for (int t = 0; t < threads; t++) {
            args[t].seconds = seconds;
            args[t].avx512 = isa;
            pthread_create(&tids[t], NULL, fma_worker, &args[t]);
        }
        double flops_per_s = 0;
        float sink = 0;
        for (int t = 0; t < threads; t++) {
            pthread_join(tids[t], NULL);
            flops_per_s += args[t].flops / args[t].seconds;
            sink += args[t].sink;
        }
        printf("{\"mode\": \"fma\", \"isa\": \"%s\", \"threads\": %d, \"flops_per_s\": %.0f, "
               "\"sink\": %d}\n", isa ? "avx512" : "avx2", threads, flops_per_s, sink > 0);
        free(tids);
        free(args);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 5 && strcmp(argv[1], "dram") == 0)
        return run_dram((size_t)strtoull(argv[2], NULL, 10), atoi(argv[3]), atoi(argv[4]),
                        argc >= 6 && strcmp(argv[5], "avx512") == 0);
    if (argc >= 7 && strcmp(argv[1], "ssd") == 0)
        return run_ssd(argv[2], (size_t)strtoull(argv[3], NULL, 10), atoi(argv[4]), atoi(argv[5]),
                       strtoull(argv[6], NULL, 10));
    if (argc >= 4 && strcmp(argv[1], "fma") == 0)
        return run_fma(atoi(argv[2]), atof(argv[3]));
    fprintf(stderr, "usage: membw dram SIZE_MIB THREADS REPS [avx512] | membw ssd FILE BLOCK_BYTES QD READS SEED"
                    " | membw fma THREADS SECONDS\n");
    return 2;
}
