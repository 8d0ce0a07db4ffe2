/* expert_cache.h — bounded cache of routed-expert extents read from experts.bin.
 *
 * Owns: a slab of whole 4 KiB-aligned extents under a hard byte budget, the (layer, expert) →
 * slot map, pinning, the eviction policy, background reader threads that turn misses into
 * aligned direct reads (so reads overlap compute), the CRC check of each extent the first time
 * it is read (in the readers; KVL_ERR_CORRUPT on a mismatch), and the hit/miss/bytes/stall
 * counters.
 * Does not own: the store (store.c) or any math.
 *
 * Protocol: kvl_expert_cache_prefetch() as soon as routing is known (starts reads, no wait);
 * kvl_expert_cache_acquire() pins an extent, waiting for its read if needed; release unpins.
 * An acquire whose read failed returns the read's status: an I/O error, or KVL_ERR_CORRUPT when
 * the extent's data did not match its CRC-32 on its first read.
 * A pinned extent is never evicted. Acquire fails with KVL_ERR_NOMEM only if every slot is
 * pinned (the engine guarantees budget >= one layer's top-k extents).
 */
#ifndef KVL_EXPERT_CACHE_H
#define KVL_EXPERT_CACHE_H

#include <stdint.h>
#include "kvl_core.h"
#include "store.h"

typedef struct kvl_expert_view {
    const int8_t *gate_q, *up_q; /* [I, H] */
    const int8_t *down_q;        /* [H, I] */
    const float *gate_s, *up_s;  /* [I] */
    const float *down_s;         /* [H] */
} kvl_expert_view;

typedef struct kvl_expert_cache kvl_expert_cache;

/* budget_bytes is rounded down to whole extents; at least min_slots slots are required. */
kvl_status kvl_expert_cache_create(kvl_store *experts, int n_layers_total, int n_experts,
                                   uint64_t budget_bytes, int min_slots, int n_io_threads,
                                   kvl_expert_cache **out, char *err, size_t err_len);
void kvl_expert_cache_free(kvl_expert_cache *cache);
uint64_t kvl_expert_cache_bytes(const kvl_expert_cache *cache);   /* slab bytes allocated */
int kvl_expert_cache_slots(const kvl_expert_cache *cache);
void kvl_expert_cache_prefetch(kvl_expert_cache *cache, int layer, const int *experts, int n);
kvl_status kvl_expert_cache_acquire(kvl_expert_cache *cache, int layer, int expert,
                                    kvl_expert_view *out);
void kvl_expert_cache_release(kvl_expert_cache *cache, int layer, int expert);
void kvl_expert_cache_stats(const kvl_expert_cache *cache, uint64_t *hits, uint64_t *misses,
                            uint64_t *bytes_read, uint64_t *stall_ns);
void kvl_expert_cache_reset_stats(kvl_expert_cache *cache);

/* ---- additions by expert_cache.c's author (extensions; nothing above changed) ---- */

/* Every counter the cache keeps. Accounting (see expert_cache.c):
 *   hits + misses == successful acquires (an acquire refused with KVL_ERR_NOMEM counts in neither);
 *   a hit found the extent resident; a miss had to read it, either synchronously in acquire
 *   (sync_reads) or through a prefetch issued for it that this acquire was first to use
 *   (prefetch_served, which also counts in misses);
 *   bytes_read == (sync_reads + prefetch_issued - read_failures - reads_in_flight) * extent_bytes;
 *   prefetch_issued == prefetch_served + prefetch_wasted + prefetch_dropped + prefetch_unclaimed.
 * stall_ns sums, over acquires, the time each spent waiting for its extent's read. */
typedef struct kvl_expert_cache_counters {
    uint64_t hits, misses, bytes_read, stall_ns;
    uint64_t sync_reads;         /* misses read by acquire itself */
    uint64_t prefetch_issued;    /* reads queued by prefetch */
    uint64_t prefetch_served;    /* prefetched extents later acquired (counted as misses) */
    uint64_t prefetch_wasted;    /* prefetched extents evicted before any acquire */
    uint64_t prefetch_dropped;   /* prefetch reads that failed before any acquire claimed them */
    uint64_t read_failures;      /* reads (sync or prefetch) that failed */
    uint64_t prefetch_unclaimed; /* prefetched extents resident now, not yet acquired */
    uint64_t reads_in_flight;    /* reads started and not finished at the time of the snapshot */
    uint64_t evictions;
    uint64_t extent_bytes;       /* one extent padded to 4 KiB (the slot size) */
    uint64_t verify_ns;          /* time the CRC checks of first reads took, summed over threads */
    uint64_t verify_bytes;       /* bytes those checks covered */
    uint64_t corrupt_reads;      /* reads whose data did not match its CRC (also read_failures) */
} kvl_expert_cache_counters;
void kvl_expert_cache_counters_get(const kvl_expert_cache *cache, kvl_expert_cache_counters *out);

/* Non-blocking acquire (added for availability-ordered expert compute): if the extent is resident
 * and its read has finished, pins it, fills *out, counts it like kvl_expert_cache_acquire and
 * returns 1. Otherwise (not resident, still loading, or its read failed) returns 0 and pins
 * nothing; a later kvl_expert_cache_acquire waits for it or reports the failure. */
int kvl_expert_cache_try_acquire(kvl_expert_cache *cache, int layer, int expert,
                                 kvl_expert_view *out);

#endif
