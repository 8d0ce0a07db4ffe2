/* expert_cache.h — bounded cache of routed-expert extents read from experts.bin.
 *
 * Owns: a slab of whole 4 KiB-aligned extents under a hard byte budget, the (layer, expert) →
 * slot map, pinning, the eviction policy, background reader threads that turn misses into
 * aligned direct reads (so reads overlap compute), and the hit/miss/bytes/stall counters.
 * Does not own: the store (store.c) or any math.
 *
 * Protocol: kvl_expert_cache_prefetch() as soon as routing is known (starts reads, no wait);
 * kvl_expert_cache_acquire() pins an extent, waiting for its read if needed; release unpins.
 * A pinned extent is never evicted. Acquire fails with KVL_ERR_NOMEM only if every slot is
 * pinned (the engine guarantees budget >= one layer's top-k extents).
 */
#ifndef KVL_EXPERT_CACHE_H
#define KVL_EXPERT_CACHE_H

#include <stdint.h>
#include "kvl.h"
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

#endif
