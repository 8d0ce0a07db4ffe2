/* threadpool.h — a fixed pool of worker threads for data-parallel loops.
 *
 * Owns: the worker threads (pthreads on POSIX, Win32 threads on Windows) and the fork/join
 * barrier. kvl_pool_run() calls fn(ctx, i, n) once for each i in [0, n) where n is the pool's
 * thread count (the calling thread is worker 0), and returns when all calls have returned.
 * No allocation after kvl_pool_create. Not reentrant: one kvl_pool_run at a time.
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

#endif
