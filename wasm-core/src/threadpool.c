/* threadpool.c — fixed pool of worker threads with a low-latency fork/join.
 *
 * Owns: worker threads (pthreads on POSIX, Win32 threads on Windows), the spin-then-block
 * fork/join barrier, kvl_split_range, kvl_cpu_count.
 * Does not own: what the workers compute (callers pass fn/ctx), kernel selection.
 *
 * The decode loop calls kvl_pool_run hundreds of times per token, so a run must cost about a
 * microsecond: the caller publishes work by bumping a generation counter that idle workers spin
 * on for a short while; only workers that spun in vain block on a condition variable, and the
 * caller only takes the mutex when someone is actually asleep (a seq_cst "sleepers" count,
 * Dekker-style, decides that without a lock). Completion uses the same scheme in reverse.
 * Pool code runs with flush-to-zero/denormals-are-zero on x86-64 (see kvl_fast_float_enter in threadpool.h).
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* pthreads, sysconf, nanosleep under -std=c11 */
#endif
#include "threadpool.h"

#include <stdlib.h>

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#else
#include <pthread.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif


/* ---- atomics: C11 where available, Interlocked* on MSVC (stdatomic needs a flag there) ---- */
#if defined(_MSC_VER) && !defined(__clang__)
typedef volatile long kvl_atomic;
static long at_load(kvl_atomic *p) { return InterlockedOr(p, 0); }
static void at_store(kvl_atomic *p, long v) { InterlockedExchange(p, v); }
static long at_add(kvl_atomic *p, long v) { return InterlockedExchangeAdd(p, v); } /* old */
#else
#include <stdatomic.h>
typedef atomic_long kvl_atomic;
static long at_load(kvl_atomic *p) { return atomic_load(p); }
static void at_store(kvl_atomic *p, long v) { atomic_store(p, v); }
static long at_add(kvl_atomic *p, long v) { return atomic_fetch_add(p, v); } /* old */
#endif

/* ---- mutex / condition variable --------------------------------------------------------- */
#ifdef _WIN32
typedef SRWLOCK kvl_mutex;
typedef CONDITION_VARIABLE kvl_cond;
static int mutex_init(kvl_mutex *m) { InitializeSRWLock(m); return 0; }
static void mutex_destroy(kvl_mutex *m) { (void)m; }
static void mutex_lock(kvl_mutex *m) { AcquireSRWLockExclusive(m); }
static void mutex_unlock(kvl_mutex *m) { ReleaseSRWLockExclusive(m); }
static int cond_init(kvl_cond *c) { InitializeConditionVariable(c); return 0; }
static void cond_destroy(kvl_cond *c) { (void)c; }
static void cond_wait(kvl_cond *c, kvl_mutex *m) { SleepConditionVariableSRW(c, m, INFINITE, 0); }
static void cond_broadcast(kvl_cond *c) { WakeAllConditionVariable(c); }
static void cond_signal(kvl_cond *c) { WakeConditionVariable(c); }
#else
typedef pthread_mutex_t kvl_mutex;
typedef pthread_cond_t kvl_cond;
static int mutex_init(kvl_mutex *m) { return pthread_mutex_init(m, NULL); }
static void mutex_destroy(kvl_mutex *m) { pthread_mutex_destroy(m); }
static void mutex_lock(kvl_mutex *m) { pthread_mutex_lock(m); }
static void mutex_unlock(kvl_mutex *m) { pthread_mutex_unlock(m); }
static int cond_init(kvl_cond *c) { return pthread_cond_init(c, NULL); }
static void cond_destroy(kvl_cond *c) { pthread_cond_destroy(c); }
static void cond_wait(kvl_cond *c, kvl_mutex *m) { pthread_cond_wait(c, m); }
static void cond_broadcast(kvl_cond *c) { pthread_cond_broadcast(c); }
static void cond_signal(kvl_cond *c) { pthread_cond_signal(c); }
#endif

/* Spin iterations before blocking: some tens of microseconds, longer than the gap between two
 * runs inside one decode step, shorter than anything a human (or an oversubscribed machine) would
 * notice. On x86 an iteration is a pause (~10-140 cycles depending on the core). WebAssembly has
 * no pause instruction, so there an iteration is one atomic load, about a nanosecond, and 4096 of
 * them gave up after ~2 us: workers then slept between the runs of a decode step and every run
 * paid a wake through Atomics.wait/notify (tens of microseconds in V8). 32x the iterations spin
 * about as long as native does (kernel bench, 2 threads, q8 x int16 decode from DRAM: 15-18 GB/s
 * before, 20-28 after, session 14). */
#ifdef __wasm__
#define KVL_SPIN_ITERS (4096 * 32)
#else
#define KVL_SPIN_ITERS 4096
#endif

typedef struct kvl_worker {
    struct kvl_pool *pool;
    int index;
#ifdef _WIN32
    HANDLE handle;
#else
    pthread_t handle;
#endif
    int started;
} kvl_worker;

struct kvl_pool {
    int n_threads;
    kvl_worker *workers; /* n_threads - 1 entries; the caller is worker 0 */

    kvl_atomic generation; /* bumped once per run; workers wait for it to change */
    kvl_atomic remaining;  /* workers (excluding the caller) still running this generation */
    kvl_atomic stop;
    kvl_atomic sleepers;       /* workers blocked (or about to block) on wake */
    kvl_atomic caller_waiting; /* caller blocked (or about to block) on done */

    kvl_pool_fn fn;
    void *ctx;

    kvl_mutex mutex;
    kvl_cond wake;
    kvl_cond done;
};

static void worker_loop(kvl_worker *w)
{
    kvl_pool *p = w->pool;
    long seen = 0; /* generation at creation is 0 */
    (void)kvl_fast_float_enter();
    for (;;) {
        long gen = at_load(&p->generation);
        for (int i = 0; gen == seen && i < KVL_SPIN_ITERS; i++) {
            cpu_relax();
            gen = at_load(&p->generation);
        }
        if (gen == seen) {
            mutex_lock(&p->mutex);
            at_add(&p->sleepers, 1);
            while ((gen = at_load(&p->generation)) == seen)
                cond_wait(&p->wake, &p->mutex);
            at_add(&p->sleepers, -1);
            mutex_unlock(&p->mutex);
        }
        seen = gen;
        if (at_load(&p->stop))
            return;
        /* fn/ctx were written before the generation bump (seq_cst), so they are visible. */
        p->fn(p->ctx, w->index, p->n_threads);
        if (at_add(&p->remaining, -1) == 1 && at_load(&p->caller_waiting)) {
            mutex_lock(&p->mutex);
            cond_signal(&p->done);
            mutex_unlock(&p->mutex);
        }
    }
}

#ifdef _WIN32
static DWORD WINAPI worker_main(LPVOID arg)
{
    worker_loop((kvl_worker *)arg);
    return 0;
}
#else
static void *worker_main(void *arg)
{
    worker_loop((kvl_worker *)arg);
    return NULL;
}
#endif

/* Wakes all workers for a new generation (run or stop). */
static void publish(kvl_pool *p)
{
    at_add(&p->generation, 1);
    if (at_load(&p->sleepers) > 0) {
        /* Taking the mutex orders us after any worker that is between incrementing sleepers
         * and cond_wait, so the broadcast cannot be lost. */
        mutex_lock(&p->mutex);
        cond_broadcast(&p->wake);
        mutex_unlock(&p->mutex);
    }
}

static void join_workers(kvl_pool *p)
{
    at_store(&p->stop, 1);
    publish(p);
    for (int i = 0; i < p->n_threads - 1; i++) {
        kvl_worker *w = &p->workers[i];
        if (!w->started)
            continue;
#ifdef _WIN32
        WaitForSingleObject(w->handle, INFINITE);
        CloseHandle(w->handle);
#else
        pthread_join(w->handle, NULL);
#endif
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
    at_store(&p->generation, 0);
    at_store(&p->remaining, 0);
    at_store(&p->stop, 0);
    at_store(&p->sleepers, 0);
    at_store(&p->caller_waiting, 0);
    if (n_threads == 1)
        return p; /* no workers, no synchronisation objects */

    p->workers = (kvl_worker *)calloc((size_t)(n_threads - 1), sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return NULL;
    }
    if (mutex_init(&p->mutex) != 0) {
        free(p->workers);
        free(p);
        return NULL;
    }
    if (cond_init(&p->wake) != 0) {
        mutex_destroy(&p->mutex);
        free(p->workers);
        free(p);
        return NULL;
    }
    if (cond_init(&p->done) != 0) {
        cond_destroy(&p->wake);
        mutex_destroy(&p->mutex);
        free(p->workers);
        free(p);
        return NULL;
    }
    for (int i = 0; i < n_threads - 1; i++) {
        kvl_worker *w = &p->workers[i];
        w->pool = p;
        w->index = i + 1;
#ifdef _WIN32
        w->handle = CreateThread(NULL, 0, worker_main, w, 0, NULL);
        w->started = w->handle != NULL;
#else
        w->started = pthread_create(&w->handle, NULL, worker_main, w) == 0;
#endif
        if (!w->started) {
            join_workers(p);
            cond_destroy(&p->done);
            cond_destroy(&p->wake);
            mutex_destroy(&p->mutex);
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
        cond_destroy(&pool->done);
        cond_destroy(&pool->wake);
        mutex_destroy(&pool->mutex);
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
    at_store(&pool->remaining, pool->n_threads - 1);
    publish(pool);

    fn(ctx, 0, pool->n_threads);
    kvl_fast_float_leave(fp_mode);

    for (int i = 0; i < KVL_SPIN_ITERS && at_load(&pool->remaining) != 0; i++)
        cpu_relax();
    if (at_load(&pool->remaining) != 0) {
        mutex_lock(&pool->mutex);
        at_store(&pool->caller_waiting, 1);
        /* A worker finishing after this store sees caller_waiting and signals under the
         * mutex, which it can only take once we are inside cond_wait. */
        while (at_load(&pool->remaining) != 0)
            cond_wait(&pool->done, &pool->mutex);
        at_store(&pool->caller_waiting, 0);
        mutex_unlock(&pool->mutex);
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
