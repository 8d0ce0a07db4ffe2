/* expert_cache.c — bounded cache of routed-expert extents (see expert_cache.h).
 *
 * Owns: equal slots (each one 4 KiB-padded extent, in blocks of at most 1 GiB), the (layer, expert) -> slot map,
 * pin counts, the eviction policy (pick_victim, the only place that decides), a fixed request
 * ring serviced by background reader threads, and the counters.
 * Does not own: the store or its file handles (store.c), routing or any math (model.c).
 *
 * Concurrency: one mutex guards all metadata; reads run outside it. A slot is FREE, LOADING
 * (a read in flight: never a victim, whatever its pin count), READY, or FAILED (a read failed;
 * kept only while acquirers that waited on it still hold pins). Acquirers that find a slot
 * LOADING pin it and wait on done_cv. Nothing is allocated after create: the ring has
 * n_chunks entries per slot and a slot is queued at most once (only when it turns LOADING).
 *
 * Reads are split into n_chunks page-aligned pieces that the reader threads take separately:
 * virtualised and NVMe disks only reach their bandwidth with several requests in flight, and a
 * decode step often waits on a single extent, so one extent is read by every reader at once.
 * The slot turns READY (or FAILED) when its last chunk lands.
 *
 * CRC on first read (docs/FORMAT.md "Checks at run time"): an extent whose record the store has
 * not yet marked checked is checked as it lands, before any acquire can use it: each reader
 * computes the CRC-32 of the piece it read (crc32.c, where the bytes arrive, off the compute
 * threads), the last one combines the pieces' CRCs and compares the whole with experts.idx. A
 * mismatch fails the read with KVL_ERR_CORRUPT (the slot is FAILED or dropped as for an I/O
 * error, so a later acquire reads and checks it again); a match marks the record checked, and
 * its later re-reads (after an eviction) are not checked again. A synchronous read in acquire
 * checks on the acquiring thread.
 *
 * Prefetch: a call names one layer's experts in the order they will be acquired. Members
 * already resident are marked wanted; the others are claimed while a slot is free or holds an
 * unpinned extent this batch does not want; what does not fit stays pending and is issued as
 * releases free slots. The next prefetch call replaces the batch.
 *
 * Lookahead: predicted extents of the next layer (kvl_expert_cache_lookahead) are claimed only
 * when the batch has nothing pending, from FREE slots, unused predictions or the coldest extent
 * that nobody wants (pick_victim's FOR_LOOKAHEAD), and queued behind the batch's reads. Such a
 * slot is `predicted` until an acquire uses it. The next prefetch call resolves the predictions
 * it does not want: a read no reader has started is cancelled (its pieces removed from the ring,
 * the slot freed), one already read or reading becomes `stale`, the first victim of any claim.
 */
/* _GNU_SOURCE and _FILE_OFFSET_BITS=64 come from the build (wasm-core/CMakeLists.txt). */
#include "expert_cache.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32.h"
#include "platform.h"

#define MAX_IO_THREADS 16
/* Largest block of slots (see struct kvl_expert_cache); a test build sets a few slots' worth. */
#ifndef KVL_CACHE_BLOCK_BYTES
#define KVL_CACHE_BLOCK_BYTES ((uint64_t)1 << 30)
#endif
/* Size of the pieces readers take (see create); the same test build sets one page, so that its
 * extents are read, and their CRCs combined, in several pieces. */
#ifndef KVL_CACHE_CHUNK_BYTES
#define KVL_CACHE_CHUNK_BYTES ((uint64_t)2 << 20)
#endif
/* layers x experts above this cannot be a real MoE and would make the map tables absurd */
#define MAX_KEYS (1 << 24)

enum { SLOT_FREE = 0, SLOT_LOADING = 1, SLOT_READY = 2, SLOT_FAILED = 3 };

typedef struct cache_slot {
    int32_t key;          /* layer * n_experts + expert, or -1 when FREE */
    int32_t pins;
    int32_t state;
    int32_t unclaimed;    /* 1: filled by a prefetch that no acquire has used yet */
    int32_t wanted;       /* 1: named by the latest prefetch call and not yet acquired */
    int32_t chunks_left;  /* LOADING by the readers: pieces not yet finished */
    int32_t verify;       /* LOADING: 1 if this read checks the extent's CRC (first read) */
    int32_t predicted;    /* 1: read by a lookahead and not yet acquired */
    int32_t stale;        /* predicted, and the batch of its layer did not want it (or, during
                             resolve_predictions, 2: to be cancelled) */
    int32_t started;      /* LOADING: a reader has taken one of its pieces */
    kvl_status chunk_error; /* first failure among this read's pieces */
    kvl_status error;     /* FAILED: what the read returned */
    uint64_t last_use;    /* LRU clock value of the last prefetch/acquire/release touching it */
} cache_slot;

struct kvl_expert_cache {
    kvl_store *store;
    int n_layers, n_experts, n_keys;
    const kvl_tensor_rec **rec_of; /* [n_keys]; NULL for layers without routed experts */
    int32_t *slot_of;              /* [n_keys]; -1 when not resident */
    cache_slot *slots;
    /* Slots in use: [0, n_slots). kvl_expert_cache_set_slots parks [n_slots, n_created): no
     * extent, pages given back to the OS, never a victim (every loop stops at n_slots). */
    int n_slots, n_created, min_slots;
    /* The slots live in blocks of at most KVL_CACHE_BLOCK_BYTES (whole slots each): one block
     * of several GiB is refused by emscripten's allocator (a 2.2e9-byte malloc fails in a
     * 3.8 GiB memory where three 1e9-byte ones succeed), so no platform asks for one. */
    unsigned char **blocks;
    int n_blocks, slots_per_block;
    uint64_t extent_bytes;         /* slot stride: align4096(nbytes) */
    uint32_t dtype;                /* the extents' dtype, KVL_DTYPE_Q8_EXPERT or _Q4_EXPERT */
    /* sub-block offsets of an extent: kvl_q8_layout or kvl_q4_layout, by dtype */
    uint64_t gate_q, up_q, down_q, gate_s, up_s, down_s;

    int32_t *ring;                 /* [n_slots * n_chunks] queued slot * n_chunks + chunk */
    int ring_head, ring_count, ring_cap;
    int n_chunks;                  /* pieces one prefetched extent is read in */
    uint64_t chunk_bytes;          /* bytes per piece (a multiple of 4 KiB; the last is shorter) */
    uint32_t *chunk_crc;           /* [n_slots * n_chunks]: CRC-32 of each piece of a checked read */
    /* Keys of the latest prefetch call that found no free slot yet; issued as releases free
     * slots, so a batch larger than the cache still streams ahead of its acquires. */
    int32_t *pending;              /* [n_experts] */
    int pending_n, pending_pos;

    kvl_os_mutex lock;
    kvl_os_cond work_cv;           /* reader threads wait for queued slots */
    kvl_os_cond done_cv;           /* acquirers wait for LOADING slots */
    kvl_os_thread threads[MAX_IO_THREADS];
    int n_threads, stop;
    int sync_ready;                /* lock and condvars initialised (free() must destroy them) */

    uint64_t clock;
    /* Eviction by frequency (see pick_victim): acquisitions per key, halved every
     * AGING_PER_KEY * n_keys acquisitions so popularity follows the recent past. */
    uint32_t *uses;                /* [n_keys] */
    uint64_t uses_since_aging;
    int policy;                    /* KVL_CACHE_POLICY_ADAPTIVE, _FREQUENCY or _LRU */
    /* ADAPTIVE (see duel_record): two shadow directories of n_slots keys each, no data, one run
     * by plain LRU and one by the frequency rule, fed every acquisition; each one's hits, halved
     * every n_keys acquisitions, decide which rule the real cache evicts by. */
    uint8_t *in_shadow[2];         /* [n_keys] each: 1 if the key is in that shadow */
    int shadow_n[2];
    uint32_t shadow_hits[2];
    uint64_t *acquired_at;         /* [n_keys]: acquisition clock of the key's latest acquire */
    uint64_t acq_clock, batch_start, duel_since;
    int batch_layer;               /* layer of the latest acquisition: a new one starts a batch */
    /* the current batch's shadow hits, counted into shadow_hits when it ends if it was a decode
     * step's (at most step_picks acquisitions: min_slots, the engine's top-k) */
    uint32_t batch_hits[2];
    int step_picks;
    kvl_expert_cache_counters ctr; /* prefetch_unclaimed and extent_bytes filled on read-out */
};

#include "errbuf.h" /* set_err */

/* ------------------------------------------------------------------ policy */

#define AGING_PER_KEY 8

enum { SHADOW_LRU = 0, SHADOW_FREQUENCY = 1 };

/* 1 if key a is a better victim than key b under shadow rule `which` (the real cache's rules on
 * acquisition times instead of slot times). */
static int shadow_colder(const kvl_expert_cache *c, int which, int a, int b) {
    if (which == SHADOW_FREQUENCY && c->uses[a] != c->uses[b]) return c->uses[a] < c->uses[b];
    return c->acquired_at[a] < c->acquired_at[b];
}

/* key enters shadow `which` (it was not in it): into a free place, else in place of the coldest
 * key the current layer batch has not acquired (a real layer never evicts its own picks); with
 * none, it is read and not kept, as in the real cache. O(n_keys), a few thousand at most. */
static int shadow_victim(const kvl_expert_cache *c, int which) {
    const uint8_t *in = c->in_shadow[which];
    int victim = -1;
    for (int k = 0; k < c->n_keys; k++) {
        if (!in[k] || c->acquired_at[k] >= c->batch_start) continue;
        if (victim < 0 || shadow_colder(c, which, k, victim)) victim = k;
    }
    return victim;
}

static void shadow_insert(kvl_expert_cache *c, int which, int key) {
    uint8_t *in = c->in_shadow[which];
    if (c->shadow_n[which] < c->n_slots) {
        in[key] = 1;
        c->shadow_n[which]++;
        return;
    }
    int victim = shadow_victim(c, which);
    if (victim < 0) return;
    in[victim] = 0;
    in[key] = 1;
}

/* The batch that ends now (lock held): a decode step's (at most step_picks acquisitions) adds its
 * shadow hits to the duel; a prompt chunk's (one layer's picks for many tokens) does not. A chunk
 * reads most of a layer's experts whatever is cached, so plain LRU hits nothing there while the
 * frequency rule keeps the popular ones: counted, a prompt left the duel on frequency for ~30
 * decoded tokens after it (bench/RESULTS.md "Low RAM against the bounds"). The shadows still take
 * a chunk's keys, so they hold what the real cache holds. The duel's hits are halved every n_keys
 * decode acquisitions. */
static void duel_end_batch(kvl_expert_cache *c) {
    const uint64_t n = c->acq_clock - c->batch_start; /* the ended batch's acquisitions (the clock has counted the new one) */
    if (c->batch_layer >= 0 && n <= (uint64_t)c->step_picks) {
        for (int which = 0; which < 2; which++) {
            const uint64_t sum = (uint64_t)c->shadow_hits[which] + c->batch_hits[which];
            c->shadow_hits[which] = sum > UINT32_MAX ? UINT32_MAX : (uint32_t)sum;
        }
        c->duel_since += n;
        if (c->duel_since >= (uint64_t)c->n_keys) {
            c->shadow_hits[0] >>= 1;
            c->shadow_hits[1] >>= 1;
            c->duel_since = 0;
        }
    }
    c->batch_hits[0] = c->batch_hits[1] = 0;
}

/* ADAPTIVE's bookkeeping for one acquisition of key (lock held, after count_use's counts): each
 * shadow scores a hit if it holds key, then takes it in. Set dueling (as CPU caches choose
 * between insertion policies): the real cache follows whichever shadow hit more lately. Chosen
 * by simulation on bench/routing-trace.ts's traces (bench/RESULTS.md "Expert cache policy"):
 * plain LRU hits nothing once a token's picks outgrow the cache and beats the frequency rule on
 * calibrated routing above that, while frequency is best on uniform routing; the duel follows
 * the better of the two at every size. */
static void duel_record(kvl_expert_cache *c, int key) {
    int layer = key / c->n_experts;
    c->acq_clock++;
    if (layer != c->batch_layer) {
        duel_end_batch(c);
        c->batch_layer = layer;
        c->batch_start = c->acq_clock;
    }
    for (int which = 0; which < 2; which++) {
        if (c->in_shadow[which][key]) {
            if (c->batch_hits[which] < UINT32_MAX) c->batch_hits[which]++;
        } else {
            shadow_insert(c, which, key);
        }
    }
    c->acquired_at[key] = c->acq_clock;
}

/* One acquisition of key (lock held). */
static void count_use(kvl_expert_cache *c, int key) {
    if (c->uses[key] < UINT32_MAX) c->uses[key]++;
    if (++c->uses_since_aging >= (uint64_t)AGING_PER_KEY * (uint64_t)c->n_keys) {
        for (int k = 0; k < c->n_keys; k++) c->uses[k] >>= 1;
        c->uses_since_aging = 0;
    }
    if (c->policy == KVL_CACHE_POLICY_ADAPTIVE) duel_record(c, key);
}

/* Whether evictions go by frequency now: always (FREQUENCY), never (LRU), or as the duel says. */
static int evict_by_frequency(const kvl_expert_cache *c) {
    if (c->policy == KVL_CACHE_POLICY_ADAPTIVE)
        return c->shadow_hits[SHADOW_FREQUENCY] >= c->shadow_hits[SHADOW_LRU];
    return c->policy == KVL_CACHE_POLICY_FREQUENCY;
}

/* What a victim is chosen for (pick_victim). */
enum { FOR_ACQUIRE = 0, FOR_PREFETCH = 1, FOR_LOOKAHEAD = 2 };

/* 1 if slot a is a better victim than slot b: fewer recent uses of its key, then older. */
static int colder(const kvl_expert_cache *c, int by_frequency, const cache_slot *a, const cache_slot *b) {
    if (by_frequency && c->uses[a->key] != c->uses[b->key])
        return c->uses[a->key] < c->uses[b->key];
    return a->last_use < b->last_use;
}

/* The eviction policy, in one place: a FREE slot if any, else the READY slot with no pins whose
 * extent is coldest: by the frequency rule, acquired least often recently (halved counts, see
 * count_use), the least recently used among equals; by LRU, the least recently used. The policy
 * (kvl_engine_options.expert_cache_policy) picks the rule: ADAPTIVE (the default) the one its
 * shadow duel favours now (duel_record). Why not one fixed rule: decoding streams each token's
 * top-k experts of every layer through the cache; when that cycle is larger than the cache, LRU
 * evicts every extent before its next use (0 % hits with --cache-mib 512 on the full-size
 * model, where frequency kept the popular ones: 14.8 %, bench/RESULTS.md), but when it fits,
 * recency is what trained routing rewards. For a prefetch, slots the current prefetch batch still wants are excluded
 * too, so a batch never evicts its own members. LOADING slots are never victims. An unused
 * prediction (stale) goes before any other READY extent, the oldest first: it was read for a
 * layer that did not route to it. A lookahead (purpose FOR_LOOKAHEAD, for layer la_layer) also
 * leaves alone the other predictions and every extent of la_layer, which its routing may want.
 * Returns -1 if none. Called with the lock held; O(n_slots), which is small next to one
 * multi-MB read. */
static int pick_victim(const kvl_expert_cache *c, int purpose, int la_layer) {
    int i, best = -1, stale = -1;
    const int by_frequency = evict_by_frequency(c);
    for (i = 0; i < c->n_slots; i++) {
        const cache_slot *s = &c->slots[i];
        if (s->state == SLOT_FREE) return i;
        if (s->state != SLOT_READY || s->pins != 0 || (purpose != FOR_ACQUIRE && s->wanted)) continue;
        if (s->predicted && s->stale) {
            if (stale < 0 || s->last_use < c->slots[stale].last_use) stale = i;
            continue;
        }
        if (purpose == FOR_LOOKAHEAD && (s->predicted || s->key / c->n_experts == la_layer)) continue;
        if (best < 0 || colder(c, by_frequency, s, &c->slots[best])) best = i;
    }
    return stale >= 0 ? stale : best;
}

/* Unmaps slot i (lock held). */
static void drop_slot(kvl_expert_cache *c, int i, int count_eviction) {
    cache_slot *s = &c->slots[i];
    if (s->key >= 0) {
        c->slot_of[s->key] = -1;
        if (count_eviction) {
            c->ctr.evictions++;
            if (s->unclaimed) c->ctr.prefetch_wasted++;
            if (s->predicted) c->ctr.lookahead_wasted++;
        }
    }
    s->key = -1;
    s->pins = 0;
    s->state = SLOT_FREE;
    s->unclaimed = 0;
    s->wanted = 0;
    s->predicted = 0;
    s->stale = 0;
    s->started = 0;
    s->error = KVL_OK;
}

/* Maps key into slot i as LOADING (lock held). */
static void claim_slot(kvl_expert_cache *c, int i, int32_t key, int pins, int unclaimed) {
    cache_slot *s = &c->slots[i];
    if (s->state != SLOT_FREE) drop_slot(c, i, 1);
    s->key = key;
    s->pins = pins;
    s->state = SLOT_LOADING;
    s->unclaimed = unclaimed;
    s->wanted = unclaimed;
    s->predicted = 0;
    s->stale = 0;
    s->started = 0;
    s->error = KVL_OK;
    s->verify = !kvl_store_verified(c->store, c->rec_of[key]);
    s->last_use = ++c->clock;
    c->slot_of[key] = i;
}

/* Records the end of slot i's read (lock held) and wakes its waiters. */
static void finish_read(kvl_expert_cache *c, int i, kvl_status st) {
    cache_slot *s = &c->slots[i];
    if (st == KVL_OK) {
        s->state = SLOT_READY;
        c->ctr.bytes_read += c->extent_bytes;
    } else {
        c->ctr.read_failures++;
        if (s->pins == 0) {
            /* nobody waits: forget it, so the next acquire retries with a fresh read */
            if (s->unclaimed) c->ctr.prefetch_dropped++;
            if (s->predicted) c->ctr.lookahead_dropped++;
            drop_slot(c, i, 0);
        } else {
            s->state = SLOT_FAILED;
            s->error = st;
        }
    }
    kvl_os_cond_broadcast(&c->done_cv);
}

/* ------------------------------------------------------------------ readers */

/* Start of slot i. */
static unsigned char *slot_base(const kvl_expert_cache *c, int i) {
    return c->blocks[i / c->slots_per_block] + (size_t)(i % c->slots_per_block) * c->extent_bytes;
}

static kvl_status read_slot(kvl_expert_cache *c, int i, const kvl_tensor_rec *rec) {
    return kvl_store_read(c->store, rec->offset, rec->nbytes, slot_base(c, i));
}

/* Data bytes of piece `chunk` of the extent `rec` (> 0: the extent's padding is under one page). */
static uint64_t chunk_len(const kvl_expert_cache *c, const kvl_tensor_rec *rec, int chunk) {
    uint64_t begin = (uint64_t)chunk * c->chunk_bytes;
    return rec->nbytes - begin < c->chunk_bytes ? rec->nbytes - begin : c->chunk_bytes;
}

/* Reads piece `chunk` of the extent `rec` into slot i. */
static kvl_status read_chunk(kvl_expert_cache *c, int i, const kvl_tensor_rec *rec, int chunk) {
    uint64_t begin = (uint64_t)chunk * c->chunk_bytes;
    return kvl_store_read(c->store, rec->offset + begin, chunk_len(c, rec, chunk),
                          slot_base(c, i) + (size_t)begin);
}

/* The extent's whole CRC against experts.idx (lock held): a match marks the record checked. */
static kvl_status check_crc(kvl_expert_cache *c, const kvl_tensor_rec *rec, uint32_t crc) {
    if (crc != rec->crc32) {
        c->ctr.corrupt_reads++;
        return KVL_ERR_CORRUPT;
    }
    kvl_store_set_verified(c->store, rec);
    return KVL_OK;
}

/* Slot i's pieces' CRCs combined in order, checked (lock held; every piece has landed). */
static kvl_status check_pieces(kvl_expert_cache *c, int i, const kvl_tensor_rec *rec) {
    const uint32_t *crc = c->chunk_crc + (size_t)i * (size_t)c->n_chunks;
    uint32_t all = crc[0];
    for (int k = 1; k < c->n_chunks; k++) all = kvl_crc32_combine(all, crc[k], chunk_len(c, rec, k));
    return check_crc(c, rec, all);
}

/* Queues every piece of slot i (lock held). */
static void queue_slot(kvl_expert_cache *c, int i) {
    int k;
    c->slots[i].chunks_left = c->n_chunks;
    c->slots[i].chunk_error = KVL_OK;
    for (k = 0; k < c->n_chunks; k++) {
        c->ring[(c->ring_head + c->ring_count) % c->ring_cap] = i * c->n_chunks + k;
        c->ring_count++;
    }
}

static KVL_THREAD_RET KVL_THREAD_CALL reader_main(void *arg) {
    kvl_expert_cache *c = (kvl_expert_cache *)arg;
    kvl_os_mutex_lock(&c->lock);
    for (;;) {
        int i, chunk, verify;
        const kvl_tensor_rec *rec;
        kvl_status st;
        cache_slot *s;
        uint32_t crc = 0;
        uint64_t t0, crc_ns = 0;
        while (c->ring_count == 0 && !c->stop) kvl_os_cond_wait(&c->work_cv, &c->lock);
        if (c->stop) break;
        i = c->ring[c->ring_head] / c->n_chunks;
        chunk = c->ring[c->ring_head] % c->n_chunks;
        c->ring_head = (c->ring_head + 1) % c->ring_cap;
        c->ring_count--;
        /* a LOADING slot cannot be re-targeted, so key, rec and verify stay valid during the read
         * (a started read is never cancelled: resolve_predictions cancels unstarted ones only) */
        c->slots[i].started = 1;
        rec = c->rec_of[c->slots[i].key];
        verify = c->slots[i].verify;
        kvl_os_mutex_unlock(&c->lock);
        st = read_chunk(c, i, rec, chunk);
        if (st == KVL_OK && verify) {
            t0 = kvl_now_ns();
            crc = kvl_crc32_fast(0, slot_base(c, i) + (size_t)chunk * c->chunk_bytes,
                                 (size_t)chunk_len(c, rec, chunk));
            crc_ns = kvl_now_ns() - t0;
        }
        kvl_os_mutex_lock(&c->lock);
        s = &c->slots[i];
        if (st != KVL_OK && s->chunk_error == KVL_OK) s->chunk_error = st;
        if (st == KVL_OK && verify) {
            c->chunk_crc[(size_t)i * (size_t)c->n_chunks + (size_t)chunk] = crc;
            c->ctr.verify_ns += crc_ns;
            c->ctr.verify_bytes += chunk_len(c, rec, chunk);
        }
        if (--s->chunks_left == 0) {
            if (s->chunk_error == KVL_OK && verify) s->chunk_error = check_pieces(c, i, rec);
            finish_read(c, i, s->chunk_error);
        }
    }
    kvl_os_mutex_unlock(&c->lock);
    return KVL_THREAD_RETURN;
}

/* ------------------------------------------------------------------ create / free */

kvl_status kvl_expert_cache_create(kvl_store *experts, int n_layers_total, int n_experts,
                                   uint64_t budget_bytes, int min_slots, int n_io_threads, int policy,
                                   kvl_expert_cache **out, char *err, size_t err_len) {
    kvl_expert_cache *c;
    const char *path;
    uint64_t n_fit, nbytes = 0, inter = 0, hidden = 0;
    uint32_t n_found = 0, dtype = 0;
    int l, e, i;
    char name[160];

    if (err && err_len) err[0] = 0;
    if (!out) return KVL_ERR_INVALID_ARG;
    *out = NULL;
    if (!experts) {
        set_err(err, err_len, "expert cache: no experts store");
        return KVL_ERR_INVALID_ARG;
    }
    path = kvl_store_bin_path(experts);
    if (kvl_store_kind(experts) != 2) {
        set_err(err, err_len, "%s: is not an experts store (kind %u)", path, kvl_store_kind(experts));
        return KVL_ERR_CONFIG;
    }
    if (n_layers_total <= 0 || n_experts <= 0 || (int64_t)n_layers_total * n_experts > MAX_KEYS) {
        set_err(err, err_len, "expert cache: invalid dimensions %d layers x %d experts", n_layers_total,
                n_experts);
        return KVL_ERR_CONFIG;
    }
    if (n_io_threads < 0) n_io_threads = 0;
    if (n_io_threads > MAX_IO_THREADS) n_io_threads = MAX_IO_THREADS;
    if (policy < KVL_CACHE_POLICY_DEFAULT || policy > KVL_CACHE_POLICY_LRU) {
        set_err(err, err_len, "expert cache: policy %d is invalid (0 default, 1 adaptive, 2 frequency, 3 lru)", policy);
        return KVL_ERR_INVALID_ARG;
    }

    c = (kvl_expert_cache *)calloc(1, sizeof *c);
    if (!c) {
        set_err(err, err_len, "expert cache: out of memory");
        return KVL_ERR_NOMEM;
    }
    c->store = experts;
    c->n_layers = n_layers_total;
    c->n_experts = n_experts;
    c->n_keys = n_layers_total * n_experts;
    c->rec_of = (const kvl_tensor_rec **)calloc((size_t)c->n_keys, sizeof *c->rec_of);
    c->slot_of = (int32_t *)malloc((size_t)c->n_keys * sizeof *c->slot_of);
    c->uses = (uint32_t *)calloc((size_t)c->n_keys, sizeof *c->uses);
    c->policy = policy == KVL_CACHE_POLICY_DEFAULT ? KVL_CACHE_POLICY_ADAPTIVE : policy;
    c->batch_layer = -1;
    c->step_picks = min_slots > 1 ? min_slots : 1;
    if (c->policy == KVL_CACHE_POLICY_ADAPTIVE) {
        c->in_shadow[0] = (uint8_t *)calloc((size_t)c->n_keys, 1);
        c->in_shadow[1] = (uint8_t *)calloc((size_t)c->n_keys, 1);
        c->acquired_at = (uint64_t *)calloc((size_t)c->n_keys, sizeof *c->acquired_at);
    }
    if (!c->rec_of || !c->slot_of || !c->uses ||
        (c->policy == KVL_CACHE_POLICY_ADAPTIVE && (!c->in_shadow[0] || !c->in_shadow[1] || !c->acquired_at))) {
        set_err(err, err_len, "expert cache: out of memory");
        kvl_expert_cache_free(c);
        return KVL_ERR_NOMEM;
    }
    /* Map every (layer, expert) by its FORMAT.md name; all extents must share one dtype and size. */
    for (l = 0; l < n_layers_total; l++) {
        for (e = 0; e < n_experts; e++) {
            const kvl_tensor_rec *r;
            c->slot_of[l * n_experts + e] = -1;
            snprintf(name, sizeof name, "language_model.model.layers.%d.mlp.experts.%d", l, e);
            r = kvl_store_find(experts, name);
            if (!r) continue;
            if (r->dtype != KVL_DTYPE_Q8_EXPERT && r->dtype != KVL_DTYPE_Q4_EXPERT) {
                set_err(err, err_len, "%s: '%s' is not a Q8 or Q4 expert extent (dtype %u)", path, name,
                        r->dtype);
                kvl_expert_cache_free(c);
                return KVL_ERR_FORMAT;
            }
            if (n_found == 0) {
                nbytes = r->nbytes;
                inter = r->shape[2];
                hidden = r->shape[3];
                dtype = r->dtype;
            } else if (r->dtype != dtype) {
                set_err(err, err_len, "%s: extent '%s' is %s but the others are %s; a pack's routed "
                        "experts are all Q8 or all Q4", path, name,
                        r->dtype == KVL_DTYPE_Q4_EXPERT ? "Q4_EXPERT" : "Q8_EXPERT",
                        dtype == KVL_DTYPE_Q4_EXPERT ? "Q4_EXPERT" : "Q8_EXPERT");
                kvl_expert_cache_free(c);
                return KVL_ERR_FORMAT;
            } else if (r->nbytes != nbytes || r->shape[2] != inter || r->shape[3] != hidden) {
                set_err(err, err_len, "%s: extent '%s' has shape [.., .., %llu, %llu], others have "
                        "[.., .., %llu, %llu]; all experts must have one size", path, name,
                        (unsigned long long)r->shape[2], (unsigned long long)r->shape[3],
                        (unsigned long long)inter, (unsigned long long)hidden);
                kvl_expert_cache_free(c);
                return KVL_ERR_FORMAT;
            }
            c->rec_of[l * n_experts + e] = r;
            n_found++;
        }
    }
    if (n_found == 0 || n_found != kvl_store_count(experts)) {
        set_err(err, err_len, "%s: holds %u records but %u of them are experts of %d layers x %d "
                "experts per config; the pack does not match this model", path, kvl_store_count(experts),
                n_found, n_layers_total, n_experts);
        kvl_expert_cache_free(c);
        return KVL_ERR_CONFIG;
    }
    c->dtype = dtype;
    if (dtype == KVL_DTYPE_Q4_EXPERT) {
        kvl_q4_layout l4;
        kvl_q4_layout_of(inter, hidden, &l4);
        c->gate_q = l4.gate_q; c->up_q = l4.up_q; c->down_q = l4.down_q;
        c->gate_s = l4.gate_s; c->up_s = l4.up_s; c->down_s = l4.down_s;
    } else {
        kvl_q8_layout l8;
        kvl_q8_layout_of(inter, hidden, &l8);
        c->gate_q = l8.gate_q; c->up_q = l8.up_q; c->down_q = l8.down_q;
        c->gate_s = l8.gate_s; c->up_s = l8.up_s; c->down_s = l8.down_s;
    }
    c->extent_bytes = (nbytes + KVL_PAGE - 1) / KVL_PAGE * KVL_PAGE;
    n_fit = budget_bytes / c->extent_bytes;
    if (n_fit > n_found) n_fit = n_found; /* more slots than extents would never be used */
    if (min_slots < 0) min_slots = 0;
    if (n_fit < (uint64_t)min_slots && n_fit < n_found) {
        set_err(err, err_len, "expert cache budget of %llu bytes holds %llu extents of %llu bytes; at "
                "least %d are needed (one layer's top-k); raise the expert cache size to >= %llu bytes",
                (unsigned long long)budget_bytes, (unsigned long long)n_fit,
                (unsigned long long)c->extent_bytes, min_slots,
                (unsigned long long)c->extent_bytes * (uint64_t)min_slots);
        kvl_expert_cache_free(c);
        return KVL_ERR_INVALID_ARG;
    }
    if (n_fit == 0) {
        set_err(err, err_len, "expert cache budget of %llu bytes holds no extent of %llu bytes",
                (unsigned long long)budget_bytes, (unsigned long long)c->extent_bytes);
        kvl_expert_cache_free(c);
        return KVL_ERR_INVALID_ARG;
    }
    c->n_slots = c->n_created = (int)n_fit;
    c->min_slots = min_slots;
    c->slots = (cache_slot *)calloc((size_t)c->n_slots, sizeof *c->slots);
    /* pieces of about 2 MiB: enough requests in flight to keep a disk busy, few enough that
     * each request stays large */
    c->n_chunks = (int)((c->extent_bytes + KVL_CACHE_CHUNK_BYTES - 1) / KVL_CACHE_CHUNK_BYTES);
    if (c->n_chunks < 1) c->n_chunks = 1;
    c->chunk_bytes = (c->extent_bytes / KVL_PAGE + (uint64_t)c->n_chunks - 1) / (uint64_t)c->n_chunks * KVL_PAGE;
    /* rounding pieces up to whole pages can leave the last ones empty: drop them */
    c->n_chunks = (int)((c->extent_bytes + c->chunk_bytes - 1) / c->chunk_bytes);
    c->ring_cap = c->n_slots * c->n_chunks;
    c->ring = (int32_t *)calloc((size_t)c->ring_cap, sizeof *c->ring);
    c->chunk_crc = (uint32_t *)calloc((size_t)c->ring_cap, sizeof *c->chunk_crc);
    c->pending = (int32_t *)calloc((size_t)n_experts, sizeof *c->pending);
    c->slots_per_block = (int)(KVL_CACHE_BLOCK_BYTES / c->extent_bytes);
    if (c->slots_per_block < 1) c->slots_per_block = 1;
    c->n_blocks = (c->n_slots + c->slots_per_block - 1) / c->slots_per_block;
    c->blocks = (unsigned char **)calloc((size_t)c->n_blocks, sizeof *c->blocks);
    for (i = 0; c->blocks && i < c->n_blocks; i++) {
        int in_block = c->n_slots - i * c->slots_per_block;
        uint64_t bytes = (uint64_t)(in_block < c->slots_per_block ? in_block : c->slots_per_block) * c->extent_bytes;
        c->blocks[i] = bytes <= (uint64_t)SIZE_MAX ? (unsigned char *)kvl_large_alloc((size_t)bytes) : NULL;
        if (!c->blocks[i]) break;
    }
    if (!c->slots || !c->ring || !c->chunk_crc || !c->pending || !c->blocks || i < c->n_blocks) {
        set_err(err, err_len, "expert cache: cannot allocate %d slots of %llu bytes", c->n_slots,
                (unsigned long long)c->extent_bytes);
        kvl_expert_cache_free(c);
        return KVL_ERR_NOMEM;
    }
    for (i = 0; i < c->n_slots; i++) c->slots[i].key = -1;
    c->ctr.extent_bytes = c->extent_bytes;
    kvl_os_mutex_init(&c->lock);
    kvl_os_cond_init(&c->work_cv);
    kvl_os_cond_init(&c->done_cv);
    c->sync_ready = 1;
    for (i = 0; i < n_io_threads; i++) {
        if (kvl_os_thread_start(&c->threads[i], reader_main, c) != 0) {
            set_err(err, err_len, "expert cache: cannot start reader thread %d", i);
            kvl_expert_cache_free(c);
            return KVL_ERR_INTERNAL;
        }
        c->n_threads = i + 1;
    }
    *out = c;
    return KVL_OK;
}

void kvl_expert_cache_free(kvl_expert_cache *c) {
    int i;
    if (!c) return;
    if (c->sync_ready) {
        /* queued but unstarted prefetches are simply abandoned; reads in flight finish first */
        kvl_os_mutex_lock(&c->lock);
        c->stop = 1;
        kvl_os_cond_broadcast(&c->work_cv);
        kvl_os_mutex_unlock(&c->lock);
        for (i = 0; i < c->n_threads; i++) kvl_os_thread_join(c->threads[i]);
        kvl_os_cond_destroy(&c->done_cv);
        kvl_os_cond_destroy(&c->work_cv);
        kvl_os_mutex_destroy(&c->lock);
    }
    if (c->blocks)
        for (i = 0; i < c->n_blocks; i++) kvl_aligned_free(c->blocks[i]);
    free(c->blocks);
    free(c->ring);
    free(c->chunk_crc);
    free(c->pending);
    free(c->slots);
    free(c->slot_of);
    free(c->uses);
    free(c->in_shadow[0]);
    free(c->in_shadow[1]);
    free(c->acquired_at);
    free((void *)c->rec_of);
    free(c);
}

uint64_t kvl_expert_cache_bytes(const kvl_expert_cache *c) { return (uint64_t)c->n_created * c->extent_bytes; }
const char *kvl_expert_cache_policy_name(int policy) {
    switch (policy) {
    case KVL_CACHE_POLICY_FREQUENCY: return "frequency";
    case KVL_CACHE_POLICY_LRU: return "lru";
    default: return "adaptive";
    }
}

int kvl_expert_cache_slots(const kvl_expert_cache *c) { return c->n_created; }

int kvl_expert_cache_active_slots(const kvl_expert_cache *cache) {
    kvl_expert_cache *c = (kvl_expert_cache *)cache; /* the lock is logically mutable */
    int n;
    kvl_os_mutex_lock(&c->lock);
    n = c->n_slots;
    kvl_os_mutex_unlock(&c->lock);
    return n;
}

/* Parks slots [n, n_slots) (lock held, n < n_slots, none pinned): no claim reaches them from
 * now on; reads in flight on them finish (a started read cannot be stopped, and its queued
 * pieces must be taken for its slot to leave LOADING); then their extents are dropped, counted
 * as evictions like any other, and their pages given back block by block. */
static void park_slots(kvl_expert_cache *c, int n) {
    const int old = c->n_slots;
    int i, loading;
    c->n_slots = n;
    do {
        loading = 0;
        for (i = n; i < old; i++) loading |= c->slots[i].state == SLOT_LOADING;
        if (loading) kvl_os_cond_wait(&c->done_cv, &c->lock);
    } while (loading);
    for (i = n; i < old; i++) drop_slot(c, i, c->slots[i].key >= 0);
    for (i = n; i < old;) {
        const int block = i / c->slots_per_block, in_block = i % c->slots_per_block;
        int end = (block + 1) * c->slots_per_block;
        if (end > old) end = old;
        kvl_os_release_pages(c->blocks[block] + (size_t)in_block * c->extent_bytes,
                             (size_t)(end - i) * c->extent_bytes);
        i = end;
    }
    /* the duel's shadows model a cache of n_slots: shrink them with it */
    for (int which = 0; which < 2; which++) {
        while (c->shadow_n[which] > c->n_slots) {
            int victim = shadow_victim(c, which);
            if (victim < 0) break;
            c->in_shadow[which][victim] = 0;
            c->shadow_n[which]--;
        }
    }
}

kvl_status kvl_expert_cache_set_slots(kvl_expert_cache *c, int n, int *active) {
    int i;
    if (active) *active = 0;
    if (!c) return KVL_ERR_INVALID_ARG;
    if (n < c->min_slots) n = c->min_slots;
    if (n < 1) n = 1;
    if (n > c->n_created) n = c->n_created;
    kvl_os_mutex_lock(&c->lock);
    for (i = n; i < c->n_slots; i++) {
        if (c->slots[i].pins > 0) {
            if (active) *active = c->n_slots;
            kvl_os_mutex_unlock(&c->lock);
            return KVL_ERR_INVALID_ARG; /* a call is running on the engine */
        }
    }
    if (n < c->n_slots) park_slots(c, n);
    else c->n_slots = n; /* parked slots are FREE already: the next claims fill them */
    if (active) *active = c->n_slots;
    kvl_os_mutex_unlock(&c->lock);
    return KVL_OK;
}

/* ------------------------------------------------------------------ prefetch / acquire */

static int key_of(const kvl_expert_cache *c, int layer, int expert) {
    int key;
    if (layer < 0 || layer >= c->n_layers || expert < 0 || expert >= c->n_experts) return -1;
    key = layer * c->n_experts + expert;
    return c->rec_of[key] ? key : -1;
}

/* Queues reads for pending keys while slots can be claimed (lock held). */
static void issue_pending(kvl_expert_cache *c) {
    int queued = 0;
    while (c->pending_pos < c->pending_n) {
        int32_t key = c->pending[c->pending_pos];
        int slot;
        if (c->slot_of[key] >= 0) { /* read meanwhile by an acquire */
            c->pending_pos++;
            continue;
        }
        slot = pick_victim(c, FOR_PREFETCH, -1);
        if (slot < 0) break; /* every slot pinned, loading or wanted: wait for a release */
        claim_slot(c, slot, key, 0, 1);
        queue_slot(c, slot);
        c->ctr.prefetch_issued++;
        c->pending_pos++;
        queued += c->n_chunks;
    }
    if (queued == 1) kvl_os_cond_signal(&c->work_cv);
    else if (queued > 1) kvl_os_cond_broadcast(&c->work_cv);
}

/* Predictions the new batch (marked wanted) does not want (lock held): a read no reader has
 * started is cancelled — its pieces leave the ring and its slot is freed — and any other is
 * marked stale, the first victim of the next claim. */
static void resolve_predictions(kvl_expert_cache *c) {
    int i, cancel = 0;
    for (i = 0; i < c->n_slots; i++) {
        cache_slot *s = &c->slots[i];
        if (!s->predicted || s->key < 0) continue;
        if (s->wanted) { /* this batch does want it, even if an earlier one did not */
            s->stale = 0;
            continue;
        }
        if (s->state == SLOT_LOADING && !s->started && s->pins == 0) {
            s->stale = 2;
            cancel++;
        } else {
            s->stale = 1;
        }
    }
    if (cancel == 0) return;
    {
        /* keep the other queued pieces in their order */
        int kept = 0, k;
        for (k = 0; k < c->ring_count; k++) {
            int32_t entry = c->ring[(c->ring_head + k) % c->ring_cap];
            if (c->slots[entry / c->n_chunks].stale == 2) continue;
            c->ring[(c->ring_head + kept) % c->ring_cap] = entry;
            kept++;
        }
        c->ring_count = kept;
    }
    for (i = 0; i < c->n_slots; i++) {
        if (c->slots[i].stale != 2) continue;
        c->ctr.lookahead_cancelled++;
        drop_slot(c, i, 0);
    }
}

void kvl_expert_cache_prefetch(kvl_expert_cache *c, int layer, const int *experts, int n) {
    int i, j;
    if (!c || !experts || n <= 0 || c->n_threads == 0) return;
    kvl_os_mutex_lock(&c->lock);
    /* a new batch replaces the previous one: what it still wanted is no longer protected */
    for (i = 0; i < c->n_slots; i++) c->slots[i].wanted = 0;
    c->pending_n = c->pending_pos = 0;
    for (j = 0; j < n; j++) {
        int key = key_of(c, layer, experts[j]), slot;
        if (key < 0) continue;
        slot = c->slot_of[key];
        if (slot >= 0) {
            c->slots[slot].wanted = 1;
            c->slots[slot].last_use = ++c->clock;
        } else if (c->pending_n < c->n_experts) {
            c->pending[c->pending_n++] = key;
        }
    }
    resolve_predictions(c);
    issue_pending(c);
    kvl_os_mutex_unlock(&c->lock);
}

void kvl_expert_cache_lookahead(kvl_expert_cache *c, int layer, const int *experts, int n) {
    int j, queued = 0;
    if (!c || !experts || n <= 0 || c->n_threads == 0) return;
    kvl_os_mutex_lock(&c->lock);
    /* the current batch's own misses first: while any waits for a slot, predict nothing */
    for (j = 0; j < n && c->pending_pos >= c->pending_n; j++) {
        int key = key_of(c, layer, experts[j]), slot;
        if (key < 0 || c->slot_of[key] >= 0) continue;
        slot = pick_victim(c, FOR_LOOKAHEAD, layer);
        if (slot < 0) break;
        claim_slot(c, slot, key, 0, 0);
        c->slots[slot].predicted = 1;
        queue_slot(c, slot);
        c->ctr.lookahead_issued++;
        queued += c->n_chunks;
    }
    if (queued == 1) kvl_os_cond_signal(&c->work_cv);
    else if (queued > 1) kvl_os_cond_broadcast(&c->work_cv);
    kvl_os_mutex_unlock(&c->lock);
}

static int has_unpinned_loading(const kvl_expert_cache *c) {
    int i;
    for (i = 0; i < c->n_slots; i++)
        if (c->slots[i].state == SLOT_LOADING && c->slots[i].pins == 0) return 1;
    return 0;
}

static void fill_view(const kvl_expert_cache *c, int slot, kvl_expert_view *v) {
    const unsigned char *base = slot_base(c, slot);
    v->dtype = c->dtype;
    v->gate_q = base + c->gate_q;
    v->up_q = base + c->up_q;
    v->down_q = base + c->down_q;
    v->gate_s = base + c->gate_s;
    v->up_s = base + c->up_s;
    v->down_s = base + c->down_s;
}

/* Pins a slot that holds the wanted extent (lock held). An extent a prefetch or a lookahead
 * brought in counts as a miss served by it the first time, a hit after that. */
static void pin_resident(kvl_expert_cache *c, cache_slot *s) {
    s->pins++;
    s->last_use = ++c->clock;
    s->wanted = 0;
    if (s->predicted) {
        s->predicted = 0;
        s->stale = 0;
        c->ctr.misses++;
        c->ctr.lookahead_used++;
    } else if (s->unclaimed) {
        s->unclaimed = 0;
        c->ctr.misses++;
        c->ctr.prefetch_served++;
    } else {
        c->ctr.hits++;
    }
}

kvl_status kvl_expert_cache_acquire(kvl_expert_cache *c, int layer, int expert, kvl_expert_view *out) {
    int key, slot;
    cache_slot *s;
    kvl_status st;
    uint64_t t0;
    if (!c || !out) return KVL_ERR_INVALID_ARG;
    key = key_of(c, layer, expert);
    if (key < 0) return KVL_ERR_INVALID_ARG;
    kvl_os_mutex_lock(&c->lock);
    count_use(c, key);
    for (;;) {
        slot = c->slot_of[key];
        if (slot >= 0) {
            s = &c->slots[slot];
            pin_resident(c, s);
            if (s->state == SLOT_LOADING) {
                t0 = kvl_now_ns();
                while (s->state == SLOT_LOADING) kvl_os_cond_wait(&c->done_cv, &c->lock);
                c->ctr.stall_ns += kvl_now_ns() - t0;
            }
            if (s->state == SLOT_FAILED) {
                st = s->error;
                if (--s->pins == 0) drop_slot(c, slot, 0);
                kvl_os_mutex_unlock(&c->lock);
                return st;
            }
            kvl_os_mutex_unlock(&c->lock);
            fill_view(c, slot, out);
            return KVL_OK;
        }
        slot = pick_victim(c, FOR_ACQUIRE, -1);
        if (slot >= 0) break;
        /* No victim now. Unpinned prefetch reads in flight will free up a slot when they land,
         * so wait for one instead of failing; only a cache whose every slot is pinned says NOMEM. */
        if (!has_unpinned_loading(c)) {
            kvl_os_mutex_unlock(&c->lock);
            return KVL_ERR_NOMEM;
        }
        t0 = kvl_now_ns();
        kvl_os_cond_wait(&c->done_cv, &c->lock);
        c->ctr.stall_ns += kvl_now_ns() - t0;
    }
    claim_slot(c, slot, key, 1, 0);
    c->ctr.misses++;
    c->ctr.sync_reads++;
    int verify = c->slots[slot].verify;
    kvl_os_mutex_unlock(&c->lock);

    const kvl_tensor_rec *rec = c->rec_of[key];
    uint32_t crc = 0;
    uint64_t crc_ns = 0;
    t0 = kvl_now_ns();
    st = read_slot(c, slot, rec);
    if (st == KVL_OK && verify) {
        uint64_t t1 = kvl_now_ns();
        crc = kvl_crc32_fast(0, slot_base(c, slot), (size_t)rec->nbytes);
        crc_ns = kvl_now_ns() - t1;
    }
    t0 = kvl_now_ns() - t0;

    kvl_os_mutex_lock(&c->lock);
    c->ctr.stall_ns += t0;
    if (st == KVL_OK && verify) {
        c->ctr.verify_ns += crc_ns;
        c->ctr.verify_bytes += rec->nbytes;
        st = check_crc(c, rec, crc);
    }
    finish_read(c, slot, st);
    s = &c->slots[slot];
    if (st != KVL_OK) {
        /* others may have pinned it while we read; the last one out frees it */
        if (--s->pins == 0) drop_slot(c, slot, 0);
        kvl_os_mutex_unlock(&c->lock);
        return st;
    }
    kvl_os_mutex_unlock(&c->lock);
    fill_view(c, slot, out);
    return KVL_OK;
}

int kvl_expert_cache_try_acquire(kvl_expert_cache *c, int layer, int expert, kvl_expert_view *out) {
    int key, slot;
    cache_slot *s;
    if (!c || !out) return 0;
    key = key_of(c, layer, expert);
    if (key < 0) return 0;
    kvl_os_mutex_lock(&c->lock);
    slot = c->slot_of[key];
    if (slot < 0 || c->slots[slot].state != SLOT_READY) {
        kvl_os_mutex_unlock(&c->lock);
        return 0;
    }
    /* the same bookkeeping as acquire's resident path, minus any waiting */
    count_use(c, key);
    s = &c->slots[slot];
    pin_resident(c, s);
    kvl_os_mutex_unlock(&c->lock);
    fill_view(c, slot, out);
    return 1;
}

void kvl_expert_cache_release(kvl_expert_cache *c, int layer, int expert) {
    int key, slot;
    if (!c) return;
    key = key_of(c, layer, expert);
    if (key < 0) return;
    kvl_os_mutex_lock(&c->lock);
    slot = c->slot_of[key];
    if (slot >= 0 && c->slots[slot].pins > 0) {
        cache_slot *s = &c->slots[slot];
        s->pins--;
        s->last_use = ++c->clock;
        if (s->state == SLOT_FAILED && s->pins == 0) drop_slot(c, slot, 0);
        if (s->pins == 0 && c->pending_pos < c->pending_n) issue_pending(c);
    }
    kvl_os_mutex_unlock(&c->lock);
}

/* ------------------------------------------------------------------ counters */

void kvl_expert_cache_counters_get(const kvl_expert_cache *cache, kvl_expert_cache_counters *out) {
    /* the lock is logically mutable: reading counters does not change the cache */
    kvl_expert_cache *c = (kvl_expert_cache *)cache;
    int i;
    uint64_t unclaimed = 0, loading = 0, predicted = 0;
    kvl_os_mutex_lock(&c->lock);
    *out = c->ctr;
    out->duel_lru_hits = c->shadow_hits[SHADOW_LRU];
    out->duel_frequency_hits = c->shadow_hits[SHADOW_FREQUENCY];
    for (i = 0; i < c->n_slots; i++) {
        unclaimed += (uint64_t)(c->slots[i].key >= 0 && c->slots[i].unclaimed);
        predicted += (uint64_t)(c->slots[i].key >= 0 && c->slots[i].predicted);
        loading += (uint64_t)(c->slots[i].state == SLOT_LOADING);
    }
    kvl_os_mutex_unlock(&c->lock);
    out->prefetch_unclaimed = unclaimed;
    out->lookahead_unclaimed = predicted;
    out->reads_in_flight = loading;
    out->extent_bytes = c->extent_bytes;
}

void kvl_expert_cache_stats(const kvl_expert_cache *cache, uint64_t *hits, uint64_t *misses,
                            uint64_t *bytes_read, uint64_t *stall_ns) {
    kvl_expert_cache_counters k;
    kvl_expert_cache_counters_get(cache, &k);
    if (hits) *hits = k.hits;
    if (misses) *misses = k.misses;
    if (bytes_read) *bytes_read = k.bytes_read;
    if (stall_ns) *stall_ns = k.stall_ns;
}

/* Counters restart from zero. Prefetched extents not yet acquired keep their "unclaimed" mark,
 * so their later acquire still counts as a miss; the prefetch_issued identity then holds only
 * for resets made while no prefetch is outstanding. */
void kvl_expert_cache_reset_stats(kvl_expert_cache *c) {
    kvl_os_mutex_lock(&c->lock);
    memset(&c->ctr, 0, sizeof c->ctr);
    c->ctr.extent_bytes = c->extent_bytes;
    kvl_os_mutex_unlock(&c->lock);
}
