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
 * kvl_expert_cache_lookahead() right after it for the next layer's predicted experts (lower
 * priority reads); kvl_expert_cache_acquire() pins an extent, waiting for its read if needed;
 * release unpins.
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

/* One pinned extent's sub-blocks (docs/FORMAT.md), as its dtype lays them out. */
typedef struct kvl_expert_view {
    uint32_t dtype;              /* KVL_DTYPE_Q8_EXPERT or KVL_DTYPE_Q4_EXPERT (every extent of a
                                    cache has the same) */
    const void *gate_q, *up_q;   /* Q8: int8 [I, H]; Q4: q bytes [I, H/2] */
    const void *down_q;          /* Q8: int8 [H, I]; Q4: q bytes [H, I/2] */
    const void *gate_s, *up_s;   /* Q8: f32 [I]; Q4: BF16 bits [I, H/32] */
    const void *down_s;          /* Q8: f32 [H]; Q4: BF16 bits [H, I/32] */
} kvl_expert_view;

typedef struct kvl_expert_cache kvl_expert_cache;

/* budget_bytes is rounded down to whole extents; at least min_slots slots are required. The
 * store's extents must all be Q8_EXPERT or all Q4_EXPERT, of one shape (KVL_ERR_FORMAT otherwise).
 * policy: KVL_CACHE_POLICY_* (kvl_core.h; DEFAULT is ADAPTIVE). */
kvl_status kvl_expert_cache_create(kvl_store *experts, int n_layers_total, int n_experts,
                                   uint64_t budget_bytes, int min_slots, int n_io_threads, int policy,
                                   kvl_expert_cache **out, char *err, size_t err_len);
/* "adaptive", "frequency" or "lru": what a KVL_CACHE_POLICY_* value evicts by (DEFAULT: adaptive). */
const char *kvl_expert_cache_policy_name(int policy);
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
 *   (sync_reads), through a prefetch issued for it that this acquire was first to use
 *   (prefetch_served), or through a lookahead read (lookahead_used; both also count in misses):
 *   misses == sync_reads + prefetch_served + lookahead_used;
 *   bytes_read == (sync_reads + prefetch_issued + lookahead_issued - lookahead_cancelled
 *                  - read_failures - reads_in_flight) * extent_bytes;
 *   prefetch_issued == prefetch_served + prefetch_wasted + prefetch_dropped + prefetch_unclaimed;
 *   lookahead_issued == lookahead_used + lookahead_wasted + lookahead_cancelled
 *                       + lookahead_dropped + lookahead_unclaimed.
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
    /* kvl_expert_cache_lookahead's reads of the next layer's predicted experts */
    uint64_t lookahead_issued;    /* reads queued */
    uint64_t lookahead_used;      /* acquired before being evicted (counted as misses) */
    uint64_t lookahead_wasted;    /* read, then evicted (or failed) before any acquire */
    uint64_t lookahead_cancelled; /* dropped before any piece was read: the next batch did not
                                     want them (no bytes read) */
    uint64_t lookahead_dropped;   /* reads that failed before any acquire claimed them */
    uint64_t lookahead_unclaimed; /* resident or loading now, not yet acquired */
    /* the adaptive policy's duel now: hits its LRU and frequency shadows scored in decode-sized
     * batches, halved as it goes (0 under the other policies) */
    uint64_t duel_lru_hits, duel_frequency_hits;
} kvl_expert_cache_counters;
void kvl_expert_cache_counters_get(const kvl_expert_cache *cache, kvl_expert_cache_counters *out);

/* Non-blocking acquire (added for availability-ordered expert compute): if the extent is resident
 * and its read has finished, pins it, fills *out, counts it like kvl_expert_cache_acquire and
 * returns 1. Otherwise (not resident, still loading, or its read failed) returns 0 and pins
 * nothing; a later kvl_expert_cache_acquire waits for it or reports the failure. */
int kvl_expert_cache_try_acquire(kvl_expert_cache *cache, int layer, int expert,
                                 kvl_expert_view *out);

/* Lookahead (issue 31, added for reads overlapped across layers): queues reads of the extents a
 * prediction names for `layer` (the next layer, while the current one computes), behind every
 * read already queued and at a lower priority than the current prefetch batch:
 *   - nothing is issued while the current batch still has misses waiting for a slot;
 *   - a prediction takes a FREE slot, else an unused earlier prediction, else the coldest READY
 *     extent that is unpinned, not wanted by the current batch, not itself a prediction and not
 *     of `layer` (which may be wanted when it routes); never a pinned, loading or wanted one;
 *   - at the next prefetch call, predictions that batch does not want and whose read has not
 *     started are cancelled (their slots freed, their queued pieces removed); those read already
 *     are marked unused, and every victim choice takes an unused prediction before any other
 *     READY extent.
 * The first acquire of a predicted extent counts as a miss (lookahead_used). Reads only: a
 * prediction changes which extents are resident, never what an acquire returns. */
void kvl_expert_cache_lookahead(kvl_expert_cache *cache, int layer, const int *experts, int n);

/* Lending (issue 38: the RAM plan lends the image lines to the expert cache while no image is
 * in flight): the slots in use, between min_slots (one layer's top-k) and the slots created,
 * with n clamped to that range. Fewer: the slots past n are parked — reads in flight on them
 * finish, their extents are dropped (counted as evictions), their pages given back to the OS
 * (kvl_os_release_pages; nothing on WebAssembly) — so RSS falls by their bytes. More: parked
 * slots are free again and fill as reads claim them. Never while an extent is pinned (a call is
 * running): KVL_ERR_INVALID_ARG, nothing changed. *active (may be NULL): the slots in use after
 * the call. Only residency changes, never what an acquire returns. kvl_expert_cache_slots and
 * kvl_expert_cache_bytes keep reporting the slots created. */
kvl_status kvl_expert_cache_set_slots(kvl_expert_cache *cache, int n, int *active);
int kvl_expert_cache_active_slots(const kvl_expert_cache *cache);

#endif
