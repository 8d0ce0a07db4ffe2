/* threadpool.h — a fixed pool of worker threads for data-parallel loops.
 *
 * Owns: the worker threads (pthreads on POSIX, Win32 threads on Windows) and the fork/join
 * barrier. kvl_pool_run() calls fn(ctx, i, n) once for each i in [0, n) where n is the pool's
 * thread count (the calling thread is worker 0), and returns when all calls have returned.
 * No allocation after kvl_pool_create. Not reentrant: one kvl_pool_run at a time.
 * Also owns the per-thread float mode pool code runs in (kvl_fast_float_enter).
 */
#ifndef KVL_THREADPOOL_H
#define KVL_THREADPOOL_H

#include <stddef.h>

typedef struct kvl_pool kvl_pool;
typedef void (*kvl_pool_fn)(void *ctx, int thread_index, int n_threads);

kvl_pool *kvl_pool_create(int n_threads); /* n_threads <= 0: number of online CPUs */
void kvl_pool_free(kvl_pool *pool);
int kvl_pool_size(const kvl_pool *pool);
void kvl_pool_run(kvl_pool *pool, kvl_pool_fn fn, void *ctx);
/* Split [0, total) into n nearly equal ranges aligned to `align` items; range of part i. */
void kvl_split_range(size_t total, size_t align, int i, int n, size_t *begin, size_t *end);
int kvl_cpu_count(void);

/* Flush-to-zero + denormals-are-zero (MXCSR bits 15 and 6) for the calling thread while it runs
 * engine math: a subnormal operand or result costs a microcode assist of ~100+ cycles (softmax
 * tails made the vision encoder 8x slower), and values below 1.2e-38 cannot move an FP32
 * inference result at any tolerance we check. Pool workers keep the mode for life; the caller of
 * kvl_pool_run (and of a whole engine call) gets it for the call and has its own mode restored.
 * x86-64 only (every x86-64 CPU implements DAZ); elsewhere these are no-ops. */
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define KVL_MXCSR_FTZ_DAZ 0x8040u
static inline unsigned kvl_fast_float_enter(void)
{
    unsigned old = _mm_getcsr();
    if ((old & KVL_MXCSR_FTZ_DAZ) != KVL_MXCSR_FTZ_DAZ) _mm_setcsr(old | KVL_MXCSR_FTZ_DAZ);
    return old;
}
static inline void kvl_fast_float_leave(unsigned old)
{
    if ((old & KVL_MXCSR_FTZ_DAZ) != KVL_MXCSR_FTZ_DAZ) _mm_setcsr(old);
}
#else
static inline unsigned kvl_fast_float_enter(void) { return 0; }
static inline void kvl_fast_float_leave(unsigned old) { (void)old; }
#endif

#endif
