/* threadpool.c — fixed pool of worker threads with a low-latency fork/join.
 *
 * Owns: worker threads, the spin-then-block fork/join barrier, kvl_split_range, kvl_cpu_count.
 * Does not own: what the workers compute (callers pass fn/ctx), kernel selection, the threads,
 * mutexes, condition variables and atomics themselves (platform.h's, pthreads on POSIX and
 * Win32 on Windows).
 *
 * The decode loop calls kvl_pool_run hundreds of times per token, so a run must cost about a
 * microsecond: the caller publishes work by bumping a generation counter that idle workers spin
 * on for a short while; only workers that spun in vain block on a condition variable, and the
 * caller only takes the mutex when someone is actually asleep (a seq_cst "sleepers" count,
 * Dekker-style, decides that without a lock). Completion uses the same scheme in reverse.
 * Pool code runs with flush-to-zero/denormals-are-zero on x86-64 (see kvl_fast_float_enter in threadpool.h).
 */
/* _GNU_SOURCE comes from the build (wasm-core/CMakeLists.txt); platform.h needs it under -std=c11,
 * and bench/kernels_bench.c's build commands compile this file without it. */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include "threadpool.h"

#include <stdlib.h>

#include "platform.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Spin iterations before blocking: some tens of microseconds, longer than the gap between two
 * runs inside one decode step, shorter than anything a human (or an oversubscribed machine) would
 * notice. On x86 an iteration is a pause (~10-140 cycles depending on the core). WebAssembly has
 * no pause instruction, so there an iteration is one atomic load, about a nanosecond, and 4096 of
 * them gave up after ~2 us: workers then slept between the runs of a decode step and every run
 * paid a wake through Atomics.wait/notify (tens of microseconds in V8). 32x the iterations spin
 * about as long as native does (kernel bench, 2 threads, q8 x int16 decode from DRAM: 15-18 GB/s
 * before, 20-28 after: bench/RESULTS.md "Idle workers, huge pages and prefill products",
 * 2026-12-04). */
#ifdef __wasm__
#define KVL_SPIN_ITERS (4096 * 32)
#else
#define KVL_SPIN_ITERS 4096
#endif

typedef struct kvl_worker {
    struct kvl_pool *pool;
    int index;
    kvl_os_thread handle;
    int started;
} kvl_worker;

struct kvl_pool {
    int n_threads;
    kvl_worker *workers; /* n_threads - 1 entries; the caller is worker 0 */

    /* kvl_atomic_* only (sequentially consistent) */
    volatile int generation; /* bumped once per run (wraps); workers wait for it to change */
    volatile int remaining;  /* workers (excluding the caller) still running this generation */
    volatile int stop;
    volatile int sleepers;       /* workers blocked (or about to block) on wake */
    volatile int caller_waiting; /* caller blocked (or about to block) on done */

    kvl_pool_fn fn;
    void *ctx;

    kvl_os_mutex mutex;
    kvl_os_cond wake;
    kvl_os_cond done;
};

static void worker_loop(kvl_worker *w)
{
    kvl_pool *p = w->pool;
    int seen = 0; /* generation at creation is 0 */
    (void)kvl_fast_float_enter();
    for (;;) {
        int gen = kvl_atomic_load(&p->generation);
        for (int i = 0; gen == seen && i < KVL_SPIN_ITERS; i++) {
            cpu_relax();
            gen = kvl_atomic_load(&p->generation);
        }
        if (gen == seen) {
            kvl_os_mutex_lock(&p->mutex);
            kvl_atomic_fetch_add(&p->sleepers, 1);
            while ((gen = kvl_atomic_load(&p->generation)) == seen)
                kvl_os_cond_wait(&p->wake, &p->mutex);
            kvl_atomic_fetch_add(&p->sleepers, -1);
            kvl_os_mutex_unlock(&p->mutex);
        }
        seen = gen;
        if (kvl_atomic_load(&p->stop))
            return;
        /* fn/ctx were written before the generation bump (seq_cst), so they are visible. */
        p->fn(p->ctx, w->index, p->n_threads);
        if (kvl_atomic_fetch_add(&p->remaining, -1) == 1 && kvl_atomic_load(&p->caller_waiting)) {
            kvl_os_mutex_lock(&p->mutex);
            kvl_os_cond_signal(&p->done);
            kvl_os_mutex_unlock(&p->mutex);
        }
    }
}

static KVL_THREAD_RET KVL_THREAD_CALL worker_main(void *arg)
{
    worker_loop((kvl_worker *)arg);
    return KVL_THREAD_RETURN;
}

/* Wakes all workers for a new generation (run or stop). */
static void publish(kvl_pool *p)
{
    kvl_atomic_fetch_add(&p->generation, 1);
    if (kvl_atomic_load(&p->sleepers) > 0) {
        /* Taking the mutex orders us after any worker that is between incrementing sleepers
         * and cond_wait, so the broadcast cannot be lost. */
        kvl_os_mutex_lock(&p->mutex);
        kvl_os_cond_broadcast(&p->wake);
        kvl_os_mutex_unlock(&p->mutex);
    }
}

static void join_workers(kvl_pool *p)
{
    kvl_atomic_store(&p->stop, 1);
    publish(p);
    for (int i = 0; i < p->n_threads - 1; i++) {
        kvl_worker *w = &p->workers[i];
        if (!w->started)
            continue;
        kvl_os_thread_join(w->handle);
    }
}

kvl_pool *kvl_pool_create(int n_threads)
{
    if (n_threads <= 0)
        n_threads = kvl_cpu_count();
    if (n_threads > 1024)
        n_threads = 1024;
    kvl_pool *p = (kvl_pool *)calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->n_threads = n_threads;
    kvl_atomic_store(&p->generation, 0);
    kvl_atomic_store(&p->remaining, 0);
    kvl_atomic_store(&p->stop, 0);
    kvl_atomic_store(&p->sleepers, 0);
    kvl_atomic_store(&p->caller_waiting, 0);
    if (n_threads == 1)
        return p; /* no workers, no synchronisation objects */

    p->workers = (kvl_worker *)calloc((size_t)(n_threads - 1), sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return NULL;
    }
    if (kvl_os_mutex_init(&p->mutex) != 0) {
        free(p->workers);
        free(p);
        return NULL;
    }
    if (kvl_os_cond_init(&p->wake) != 0) {
        kvl_os_mutex_destroy(&p->mutex);
        free(p->workers);
        free(p);
        return NULL;
    }
    if (kvl_os_cond_init(&p->done) != 0) {
        kvl_os_cond_destroy(&p->wake);
        kvl_os_mutex_destroy(&p->mutex);
        free(p->workers);
        free(p);
        return NULL;
    }
    for (int i = 0; i < n_threads - 1; i++) {
        kvl_worker *w = &p->workers[i];
        w->pool = p;
        w->index = i + 1;
        w->started = kvl_os_thread_start(&w->handle, worker_main, w) == 0;
        if (!w->started) {
            join_workers(p);
            kvl_os_cond_destroy(&p->done);
            kvl_os_cond_destroy(&p->wake);
            kvl_os_mutex_destroy(&p->mutex);
            free(p->workers);
            free(p);
            return NULL;
        }
    }
    return p;
}

void kvl_pool_free(kvl_pool *pool)
{
    if (!pool)
        return;
    if (pool->n_threads > 1) {
        join_workers(pool);
        kvl_os_cond_destroy(&pool->done);
        kvl_os_cond_destroy(&pool->wake);
        kvl_os_mutex_destroy(&pool->mutex);
        free(pool->workers);
    }
    free(pool);
}

int kvl_pool_size(const kvl_pool *pool)
{
    return pool ? pool->n_threads : 0;
}

void kvl_pool_run(kvl_pool *pool, kvl_pool_fn fn, void *ctx)
{
    unsigned fp_mode = kvl_fast_float_enter();
    if (pool->n_threads == 1) {
        fn(ctx, 0, 1);
        kvl_fast_float_leave(fp_mode);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    kvl_atomic_store(&pool->remaining, pool->n_threads - 1);
    publish(pool);

    fn(ctx, 0, pool->n_threads);
    kvl_fast_float_leave(fp_mode);

    for (int i = 0; i < KVL_SPIN_ITERS && kvl_atomic_load(&pool->remaining) != 0; i++)
        cpu_relax();
    if (kvl_atomic_load(&pool->remaining) != 0) {
        kvl_os_mutex_lock(&pool->mutex);
        kvl_atomic_store(&pool->caller_waiting, 1);
        /* A worker finishing after this store sees caller_waiting and signals under the
         * mutex, which it can only take once we are inside cond_wait. */
        while (kvl_atomic_load(&pool->remaining) != 0)
            kvl_os_cond_wait(&pool->done, &pool->mutex);
        kvl_atomic_store(&pool->caller_waiting, 0);
        kvl_os_mutex_unlock(&pool->mutex);
    }
}

void kvl_split_range(size_t total, size_t align, int i, int n, size_t *begin, size_t *end)
{
    if (align == 0)
        align = 1;
    if (n <= 0)
        n = 1;
    if (i < 0 || i >= n) {
        *begin = *end = total;
        return;
    }
    /* Split whole aligned units; the first (units % n) parts get one extra unit. Only the
     * last unit may be partial, so every boundary except `total` is a multiple of align. */
    size_t units = total / align + (total % align != 0);
    size_t base = units / (size_t)n, extra = units % (size_t)n;
    size_t ui = (size_t)i;
    size_t b = ui * base + (ui < extra ? ui : extra);
    size_t e = b + base + (ui < extra ? 1 : 0);
    b *= align;
    e *= align;
    *begin = b < total ? b : total;
    *end = e < total ? e : total;
}

int kvl_cpu_count(void)
{
#ifdef _WIN32
    SYSTEM_INFO si;
    GetSystemInfo(&si);
    return si.dwNumberOfProcessors > 0 ? (int)si.dwNumberOfProcessors : 1;
#else
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
#endif
}
