/* test_threadpool.c — fork/join correctness of threadpool.c and kvl_split_range coverage.
 *
 * Owns: tests of threadpool.h. Does not own: kernel numerics (test_kernels.c), timing.
 *
 * Every worker index must run exactly once per kvl_pool_run, with the right n_threads, and the
 * caller must see every worker's writes when kvl_pool_run returns (and workers must see the
 * caller's writes made before it). Runs are repeated many times with gaps of different lengths
 * so workers are caught both spinning and blocked on the condition variable.
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* pthreads, sysconf, nanosleep under -std=c11 */
#endif
#include "threadpool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#include <windows.h>
static void sleep_ms(int ms) { Sleep((DWORD)ms); }
#else
#include <time.h>
static void sleep_ms(int ms)
{
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
}
#endif

static int g_pass, g_fail;
static void check(int ok, const char *what, long a, long b)
{
    if (ok) {
        g_pass++;
        return;
    }
    g_fail++;
    if (g_fail <= 30)
        printf("FAIL %s (%ld, %ld)\n", what, a, b);
}

#define MAX_T 16

typedef struct {
    long run;              /* written by the caller before each run */
    long seen[MAX_T];      /* worker i stores the run number it observed */
    long count[MAX_T];     /* calls per index, over all runs */
    int nthreads_seen[MAX_T];
    long payload[MAX_T];   /* each worker sums data written by the caller */
    const long *data;
    size_t data_n;
} run_ctx;

static void work(void *p, int i, int n)
{
    run_ctx *c = (run_ctx *)p;
    if (i < 0 || i >= MAX_T)
        return;
    c->seen[i] = c->run;
    c->count[i]++;
    c->nthreads_seen[i] = n;
    long s = 0;
    size_t b, e;
    kvl_split_range(c->data_n, 1, i, n, &b, &e);
    for (size_t k = b; k < e; k++)
        s += c->data[k];
    c->payload[i] = s;
}

static void test_pool(int nthreads, int runs)
{
    kvl_pool *pool = kvl_pool_create(nthreads);
    check(pool != NULL, "pool created", nthreads, 0);
    if (!pool)
        return;
    int n = kvl_pool_size(pool);
    check(n == nthreads, "pool size", n, nthreads);
    if (n > MAX_T) {
        kvl_pool_free(pool);
        return;
    }
    static long data[4099];
    run_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.data = data;
    ctx.data_n = sizeof data / sizeof data[0];
    int bad_seen = 0, bad_n = 0, bad_sum = 0;
    for (int r = 1; r <= runs; r++) {
        ctx.run = r;
        long want = 0;
        for (size_t k = 0; k < ctx.data_n; k++) {
            data[k] = (long)((k * 31u + (size_t)r * 7u) % 1000u);
            want += data[k];
        }
        kvl_pool_run(pool, work, &ctx);
        long got = 0;
        for (int i = 0; i < n; i++) {
            if (ctx.seen[i] != r)
                bad_seen++;
            if (ctx.nthreads_seen[i] != n)
                bad_n++;
            got += ctx.payload[i];
        }
        if (got != want)
            bad_sum++;
        /* Now and then let the workers fall asleep so the blocking path is exercised too. */
        if (r % 97 == 0)
            sleep_ms(2 + r % 3);
    }
    int bad_count = 0;
    for (int i = 0; i < n; i++)
        if (ctx.count[i] != runs)
            bad_count++;
    check(bad_seen == 0, "every index ran in every run", nthreads, bad_seen);
    check(bad_count == 0, "every index ran exactly once per run", nthreads, bad_count);
    check(bad_n == 0, "n_threads passed to fn", nthreads, bad_n);
    check(bad_sum == 0, "caller/worker data visible across the barrier", nthreads, bad_sum);
    kvl_pool_free(pool);
}

static void test_split(void)
{
    static const size_t totals[] = {0, 1, 2, 7, 16, 31, 64, 65, 100, 1000, 1408, 11264, 100003};
    static const size_t aligns[] = {0, 1, 2, 4, 16, 64, 1000};
    int bad = 0, bad_align = 0, bad_balance = 0;
    for (size_t a = 0; a < sizeof totals / sizeof totals[0]; a++)
        for (size_t b = 0; b < sizeof aligns / sizeof aligns[0]; b++)
            for (int n = 1; n <= 17; n++) {
                size_t total = totals[a], align = aligns[b] ? aligns[b] : 1;
                size_t expect_begin = 0, max_len = 0, min_len = (size_t)-1;
                for (int i = 0; i < n; i++) {
                    size_t s, e;
                    kvl_split_range(totals[a], aligns[b], i, n, &s, &e);
                    /* contiguous, in order, no overlap, inside [0, total) */
                    if (s != expect_begin || e < s || e > total)
                        bad++;
                    if (s % align != 0 && s != total)
                        bad_align++;
                    expect_begin = e;
                    /* in aligned units (only the very last unit may be partial) */
                    size_t len = (e - s + align - 1) / align;
                    if (len > max_len)
                        max_len = len;
                    if (len < min_len)
                        min_len = len;
                }
                if (expect_begin != total)
                    bad++;
                /* nearly equal: unit counts differ by at most one */
                if (max_len - min_len > 1) {
                    if (bad_balance++ < 3)
                        printf("unbalanced: total %zu align %zu n %d: %zu..%zu\n", total, align, n,
                               min_len, max_len);
                }
            }
    check(bad == 0, "split_range covers [0,total) without overlap", bad, 0);
    check(bad_align == 0, "split_range boundaries aligned", bad_align, 0);
    check(bad_balance == 0, "split_range balanced", bad_balance, 0);
    size_t s, e;
    kvl_split_range(100, 4, 5, 4, &s, &e);
    check(s == e, "split_range out-of-range part is empty", (long)s, (long)e);
}

int main(void)
{
    check(kvl_cpu_count() >= 1, "cpu count", kvl_cpu_count(), 0);
    kvl_pool *def = kvl_pool_create(0);
    check(def != NULL && kvl_pool_size(def) == kvl_cpu_count(), "default size = cpu count",
          def ? kvl_pool_size(def) : -1, kvl_cpu_count());
    kvl_pool_free(def);
    kvl_pool_free(NULL);
    /* More threads than cores on purpose: oversubscription must stay correct. */
    static const int sizes[] = {1, 2, 3, 4, 7};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        test_pool(sizes[i], sizes[i] > 2 ? 600 : 3000);
    /* Create/free repeatedly: shutdown of spinning and sleeping workers. */
    for (int k = 0; k < 20; k++) {
        kvl_pool *p = kvl_pool_create(1 + k % 4);
        if (k % 2)
            sleep_ms(1);
        kvl_pool_free(p);
    }
    test_split();
    printf("test_threadpool: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
