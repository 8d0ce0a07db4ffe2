/* test_expert_cache.c — tests of expert_cache.c over a small experts store.
 *
 * Owns: its own FORMAT.md writer for an experts store (4 layers, layer 0 dense, 3 x 8 Q8
 * extents of random bytes, each 3 pages long), and checks that every acquired view's bytes are
 * the file's, pinned extents survive any amount of eviction pressure, the LRU order, prefetch,
 * NOMEM when every slot is pinned, the counter identities of expert_cache.h, a two-thread
 * random workload with prefetch for budgets from 1 slot to all slots, and the CRC check of first
 * reads: a flipped bit in one extent's data is KVL_ERR_CORRUPT on the prefetch and the
 * synchronous path, again at every later acquire, while the other extents are served; a checked
 * extent is not checked again when re-read after an eviction. A second small store of Q4 extents
 * (format version 3): views point at FORMAT.md's Q4 sub-blocks and say Q4; a store mixing Q8 and
 * Q4 extents is refused.
 * Prints "N passed, M failed"; returns non-zero on any failure.
 */
/* _GNU_SOURCE and _FILE_OFFSET_BITS=64 come from the build (wasm-core/CMakeLists.txt). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert_cache.h"
#include "platform.h"
#include "store.h"
#include "test_bytes.h"

#ifdef _WIN32
#include <direct.h>
#else
#include <sys/stat.h>
#include <unistd.h>
#endif

static int n_pass, n_fail;
static kvl_os_mutex check_lock; /* CHECK is used from two threads */

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        int ok_ = (cond) ? 1 : 0;                                                         \
        kvl_os_mutex_lock(&check_lock);                                                   \
        if (ok_) {                                                                        \
            n_pass++;                                                                     \
        } else {                                                                          \
            n_fail++;                                                                     \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            printf(__VA_ARGS__);                                                          \
            printf("\n");                                                                 \
        }                                                                                 \
        kvl_os_mutex_unlock(&check_lock);                                                 \
    } while (0)

/* ------------------------------------------------------------------ the store under test */

#define N_LAYERS 4 /* layer 0 is dense: no extents */
#define N_EXPERTS 8
#define N_EXTENTS ((N_LAYERS - 1) * N_EXPERTS)
#define DIM_I 40
#define DIM_H 64

/* FORMAT.md sub-block offsets, computed here independently of store.c */
static uint64_t off_up, off_down, off_gs, off_us, off_ds, extent_nbytes, extent_padded;
static unsigned char *bin_data;
static uint64_t ext_offset[N_LAYERS][N_EXPERTS];


typedef struct rng { uint64_t s; } rng;
static uint32_t rnd(rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (uint32_t)(r->s >> 11);
}

/* Writes experts.idx/.bin (kind = 2) or, with kind 1, the same records as a "trunk" store. */
static int write_store(const char *dir, uint32_t kind, const char *stem) {
    char path[512];
    size_t idx_len = idx_len_for(1, N_EXTENTS, 2);
    unsigned char *idx = (unsigned char *)calloc(idx_len, 1), *p;
    uint64_t bin_len = (uint64_t)N_EXTENTS * extent_padded;
    int l, e, rc;
    idx_put_header(idx, kind, bin_len, 1, N_EXTENTS, 2, NULL);
    idx_put_hparam(idx + 128, "text.hidden_size", 64.0);
    p = idx + 128 + 64;
    for (l = 1; l < N_LAYERS; l++) {
        for (e = 0; e < N_EXPERTS; e++, p += 192) {
            char name[128];
            const uint64_t shape[4] = {(uint64_t)l, (uint64_t)e, DIM_I, DIM_H};
            snprintf(name, sizeof name, "language_model.model.layers.%d.mlp.experts.%d", l, e);
            idx_put_record(p, name, 3, 4, shape, ext_offset[l][e], extent_nbytes,
                           ref_crc32(bin_data + ext_offset[l][e], (size_t)extent_nbytes));
        }
    }
    memcpy(p, "{}", 2);
    idx_seal(idx, idx_len);
    snprintf(path, sizeof path, "%s/%s.idx", dir, stem);
    rc = write_file(path, idx, idx_len);
    snprintf(path, sizeof path, "%s/%s.bin", dir, stem);
    rc |= write_file(path, bin_data, (size_t)bin_len);
    free(idx);
    return rc;
}

static void init_data(void) {
    rng r = {0x243F6A8885A308D3ull};
    uint64_t ih = (uint64_t)DIM_I * DIM_H, i, n;
    int l, e, k = 0;
    off_up = a64(ih);
    off_down = a64(off_up + ih);
    off_gs = a64(off_down + ih);
    off_us = a64(off_gs + 4 * DIM_I);
    off_ds = a64(off_us + 4 * DIM_I);
    extent_nbytes = off_ds + 4 * DIM_H;
    extent_padded = a4k(extent_nbytes);
    n = (uint64_t)N_EXTENTS * extent_padded;
    bin_data = (unsigned char *)calloc((size_t)n, 1);
    for (l = 1; l < N_LAYERS; l++) {
        for (e = 0; e < N_EXPERTS; e++, k++) {
            ext_offset[l][e] = (uint64_t)k * extent_padded;
            for (i = 0; i < extent_nbytes; i++) bin_data[ext_offset[l][e] + i] = (unsigned char)rnd(&r);
        }
    }
}

/* 1 if every sub-block of v equals the file's bytes of extent (l, e) */
static int view_matches(const kvl_expert_view *v, int l, int e) {
    const unsigned char *x = bin_data + ext_offset[l][e];
    uint64_t ih = (uint64_t)DIM_I * DIM_H;
    return v->dtype == KVL_DTYPE_Q8_EXPERT &&
           memcmp(v->gate_q, x, (size_t)ih) == 0 && memcmp(v->up_q, x + off_up, (size_t)ih) == 0 &&
           memcmp(v->down_q, x + off_down, (size_t)ih) == 0 &&
           memcmp(v->gate_s, x + off_gs, 4 * DIM_I) == 0 && memcmp(v->up_s, x + off_us, 4 * DIM_I) == 0 &&
           memcmp(v->down_s, x + off_ds, 4 * DIM_H) == 0 && ((uintptr_t)v->gate_s % 64) == 0 &&
           ((uintptr_t)v->down_s % 64) == 0;
}

static void check_identities(kvl_expert_cache *c, uint64_t ok_acquires, const char *label) {
    kvl_expert_cache_counters k;
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.hits + k.misses == ok_acquires, "%s: hits %llu + misses %llu != acquires %llu", label,
          (unsigned long long)k.hits, (unsigned long long)k.misses, (unsigned long long)ok_acquires);
    CHECK(k.read_failures == 0, "%s: read failures", label);
    /* prefetch reads may still be in flight after the workers finished; cancelled lookahead
     * reads read nothing */
    CHECK(k.bytes_read == (k.sync_reads + k.prefetch_issued + k.lookahead_issued - k.lookahead_cancelled -
                           k.reads_in_flight) * extent_padded,
          "%s: bytes %llu != (sync %llu + prefetch %llu + lookahead %llu - cancelled %llu - in flight %llu) * %llu",
          label, (unsigned long long)k.bytes_read, (unsigned long long)k.sync_reads,
          (unsigned long long)k.prefetch_issued, (unsigned long long)k.lookahead_issued,
          (unsigned long long)k.lookahead_cancelled, (unsigned long long)k.reads_in_flight,
          (unsigned long long)extent_padded);
    CHECK(k.misses == k.sync_reads + k.prefetch_served + k.lookahead_used, "%s: misses split", label);
    CHECK(k.lookahead_issued == k.lookahead_used + k.lookahead_wasted + k.lookahead_cancelled +
                                    k.lookahead_dropped + k.lookahead_unclaimed,
          "%s: lookahead identity %llu != %llu+%llu+%llu+%llu+%llu", label,
          (unsigned long long)k.lookahead_issued, (unsigned long long)k.lookahead_used,
          (unsigned long long)k.lookahead_wasted, (unsigned long long)k.lookahead_cancelled,
          (unsigned long long)k.lookahead_dropped, (unsigned long long)k.lookahead_unclaimed);
    CHECK(k.prefetch_issued == k.prefetch_served + k.prefetch_wasted + k.prefetch_dropped + k.prefetch_unclaimed,
          "%s: prefetch identity %llu != %llu+%llu+%llu+%llu", label, (unsigned long long)k.prefetch_issued,
          (unsigned long long)k.prefetch_served, (unsigned long long)k.prefetch_wasted,
          (unsigned long long)k.prefetch_dropped, (unsigned long long)k.prefetch_unclaimed);
    CHECK(k.extent_bytes == extent_padded, "%s: extent bytes", label);
}

static char idx_path[512], bin_path[512], dir_path[256];

static kvl_store *open_store(void) {
    char err[512];
    kvl_store *s = NULL;
    kvl_status st = kvl_store_open(idx_path, bin_path, 2, KVL_IO_AUTO, &s, err, sizeof err);
    CHECK(st == KVL_OK, "open experts store: %s", err);
    return s;
}

static kvl_expert_cache *make_cache_policy(kvl_store *s, int slots, int io_threads, int policy) {
    char err[512];
    kvl_expert_cache *c = NULL;
    kvl_status st = kvl_expert_cache_create(s, N_LAYERS, N_EXPERTS, (uint64_t)slots * extent_padded + 100, 1,
                                            io_threads, policy, &c, err, sizeof err);
    CHECK(st == KVL_OK && c, "create %d slots (policy %d): %s", slots, policy, err);
    return c;
}

static kvl_expert_cache *make_cache(kvl_store *s, int slots, int io_threads) {
    return make_cache_policy(s, slots, io_threads, KVL_CACHE_POLICY_DEFAULT);
}

/* ------------------------------------------------------------------ single-thread checks */

static void check_create_errors(kvl_store *s) {
    char err[512], trunk_idx[512], trunk_bin[512];
    kvl_expert_cache *c = (kvl_expert_cache *)err;
    kvl_store *t = NULL;
    kvl_status st = kvl_expert_cache_create(s, N_LAYERS, N_EXPERTS, 7 * extent_padded, 8, 2, 0, &c, err, sizeof err);
    CHECK(st == KVL_ERR_INVALID_ARG && c == NULL && strstr(err, "budget"), "budget below min_slots: %d %s",
          (int)st, err);
    st = kvl_expert_cache_create(s, N_LAYERS, N_EXPERTS, extent_padded - 1, 0, 2, 0, &c, err, sizeof err);
    CHECK(st == KVL_ERR_INVALID_ARG && c == NULL, "budget below one extent: %s", err);
    /* config says 4 experts per layer: experts 4..7 of the file match nothing */
    st = kvl_expert_cache_create(s, N_LAYERS, 4, 100 * extent_padded, 1, 2, 0, &c, err, sizeof err);
    CHECK(st == KVL_ERR_CONFIG && c == NULL && strstr(err, bin_path), "config mismatch: %s", err);
    st = kvl_expert_cache_create(s, 0, N_EXPERTS, 100 * extent_padded, 1, 2, 0, &c, err, sizeof err);
    CHECK(st == KVL_ERR_CONFIG && c == NULL, "zero layers: %s", err);
    st = kvl_expert_cache_create(s, N_LAYERS, N_EXPERTS, 100 * extent_padded, 1, 2, 4, &c, err, sizeof err);
    CHECK(st == KVL_ERR_INVALID_ARG && c == NULL && strstr(err, "policy 4"), "unknown policy: %s", err);
    /* the same records in a store of kind trunk are refused */
    CHECK(write_store(dir_path, 1, "trunk") == 0, "write trunk-kind store");
    snprintf(trunk_idx, sizeof trunk_idx, "%s/trunk.idx", dir_path);
    snprintf(trunk_bin, sizeof trunk_bin, "%s/trunk.bin", dir_path);
    st = kvl_store_open(trunk_idx, trunk_bin, 0, KVL_IO_BUFFERED, &t, err, sizeof err);
    CHECK(st == KVL_OK, "open trunk-kind store: %s", err);
    if (t) {
        st = kvl_expert_cache_create(t, N_LAYERS, N_EXPERTS, 100 * extent_padded, 1, 2, 0, &c, err, sizeof err);
        CHECK(st == KVL_ERR_CONFIG && c == NULL && strstr(err, trunk_bin), "wrong kind: %s", err);
        kvl_store_close(t);
    }
    remove(trunk_idx);
    remove(trunk_bin);
}

static void check_sequential(kvl_store *s, int slots, int io_threads) {
    kvl_expert_cache *c = make_cache(s, slots, io_threads);
    kvl_expert_view v;
    uint64_t hits, misses, bytes, stall, acquires = 0;
    int pass, l, e;
    char label[64];
    snprintf(label, sizeof label, "sequential slots=%d io=%d", slots, io_threads);
    if (!c) return;
    CHECK(kvl_expert_cache_slots(c) == slots, "%s: slots %d", label, kvl_expert_cache_slots(c));
    CHECK(kvl_expert_cache_bytes(c) == (uint64_t)slots * extent_padded, "%s: bytes", label);
    for (pass = 0; pass < 2; pass++) {
        for (l = 1; l < N_LAYERS; l++) {
            for (e = 0; e < N_EXPERTS; e++) {
                memset(&v, 0, sizeof v);
                CHECK(kvl_expert_cache_acquire(c, l, e, &v) == KVL_OK, "%s: acquire %d,%d", label, l, e);
                CHECK(v.gate_q && view_matches(&v, l, e), "%s: contents %d,%d", label, l, e);
                kvl_expert_cache_release(c, l, e);
                acquires++;
            }
        }
    }
    kvl_expert_cache_stats(c, &hits, &misses, &bytes, &stall);
    /* a cyclic scan larger than the cache defeats LRU entirely; one that fits hits every time */
    if (slots >= N_EXTENTS)
        CHECK(misses == N_EXTENTS && hits == N_EXTENTS, "%s: hits %llu misses %llu", label,
              (unsigned long long)hits, (unsigned long long)misses);
    else
        CHECK(misses == 2 * N_EXTENTS && hits == 0, "%s: hits %llu misses %llu", label,
              (unsigned long long)hits, (unsigned long long)misses);
    CHECK(bytes == misses * extent_padded, "%s: bytes_read %llu", label, (unsigned long long)bytes);
    check_identities(c, acquires, label);
    kvl_expert_cache_reset_stats(c);
    kvl_expert_cache_stats(c, &hits, &misses, &bytes, &stall);
    CHECK(hits == 0 && misses == 0 && bytes == 0 && stall == 0, "%s: reset", label);
    kvl_expert_cache_free(c);
}

/* hit (1) or miss (0) of one acquire+release, judged by the change in the counters */
static int probe(kvl_expert_cache *c, int l, int e) {
    uint64_t h0, h1;
    kvl_expert_view v;
    kvl_expert_cache_stats(c, &h0, NULL, NULL, NULL);
    if (kvl_expert_cache_acquire(c, l, e, &v) != KVL_OK) return -1;
    if (!view_matches(&v, l, e)) return -2;
    kvl_expert_cache_release(c, l, e);
    kvl_expert_cache_stats(c, &h1, NULL, NULL, NULL);
    return h1 == h0 + 1 ? 1 : 0;
}

static void check_lru(kvl_store *s) {
    kvl_expert_cache *c = make_cache(s, 2, 0);
    if (!c) return;
    CHECK(probe(c, 1, 0) == 0, "A miss");
    CHECK(probe(c, 1, 1) == 0, "B miss");
    CHECK(probe(c, 1, 0) == 1, "A hit");
    CHECK(probe(c, 1, 2) == 0, "C miss (evicts B, the least recently used)");
    CHECK(probe(c, 1, 0) == 1, "A still resident");
    CHECK(probe(c, 1, 1) == 0, "B was evicted");
    CHECK(probe(c, 1, 0) == 1, "A resident again");
    CHECK(probe(c, 1, 2) == 0, "C was evicted by B");
    kvl_expert_cache_free(c);
}

/* Two slots; each round acquires the hot extent A, then two cold ones that come back only every
 * fourth round. Between two uses of A more distinct extents arrive than fit, so LRU evicts A
 * every round (the cyclic pattern of decode with a cache smaller than one token's experts);
 * eviction by frequency keeps A. Returns A's hits in rounds 2..11. */
static int hot_extent_hits(kvl_store *s, int policy) {
    kvl_expert_cache *c = make_cache_policy(s, 2, 0, policy);
    int hits = 0;
    if (!c) return -1;
    for (int round = 0; round < 12; round++) {
        int a = probe(c, 1, 0);
        if (round >= 2 && a == 1) hits++;
        CHECK(probe(c, 2, (2 * round) % N_EXPERTS) == 0, "cold extent misses (round %d)", round);
        CHECK(probe(c, 2, (2 * round + 1) % N_EXPERTS) == 0, "cold extent misses (round %d)", round);
    }
    kvl_expert_cache_free(c);
    return hits;
}

/* Two slots. Phase 1 acquires (1,0) and (2,0) alternately 10 times, so both are frequent; phase 2
 * alternates (1,1) and (2,1), which fit together. LRU keeps the new pair and hits from phase 2's
 * second round on; by frequency the old pair's counts keep one of them resident, so the new pair
 * evict each other and never hit. Returns the hits of phase 2's rounds 1..9 (18 acquisitions). */
static int shifting_pair_hits(kvl_store *s, int policy) {
    kvl_expert_cache *c = make_cache_policy(s, 2, 0, policy);
    int hits = 0;
    if (!c) return -1;
    for (int round = 0; round < 10; round++) {
        probe(c, 1, 0);
        probe(c, 2, 0);
    }
    for (int round = 0; round < 10; round++) {
        int a = probe(c, 1, 1), b = probe(c, 2, 1);
        if (round >= 1) hits += (a == 1) + (b == 1);
    }
    kvl_expert_cache_free(c);
    return hits;
}

/* One batch: `times` acquisitions of (l, e) in a row (consecutive acquisitions of one layer are
 * one batch, as a prompt chunk's are). */
static void batch_of(kvl_expert_cache *c, int l, int e, int times) {
    for (int i = 0; i < times; i++) probe(c, l, e);
}

/* Two slots, batches of one token's picks at most 2 (min_slots). Phase 1, 12 rounds of prompt-like
 * batches of 3 acquisitions: the hot extent (1,0), then a cold one of layer 2 and one of layer 3
 * (back every 4th round); the frequency shadow keeps (1,0), the LRU shadow loses it every round,
 * so counted, these batches would put the duel on frequency. Phase 2 is shifting_pair's second
 * phase (decode-sized batches of one), where LRU is right. Returns phase 2's hits in rounds
 * 1..9 (18 acquisitions). */
static int prompt_then_pair_hits(kvl_store *s, int policy) {
    char err[512];
    kvl_expert_cache *c = NULL;
    int hits = 0;
    kvl_status st = kvl_expert_cache_create(s, N_LAYERS, N_EXPERTS, 2 * extent_padded + 100, 2, 0, policy, &c, err, sizeof err);
    CHECK(st == KVL_OK && c, "create: %s", err);
    if (!c) return -1;
    for (int round = 0; round < 12; round++) {
        batch_of(c, 1, 0, 3);
        batch_of(c, 2, 2 + round % 4, 3);
        batch_of(c, 3, 2 + round % 4, 3);
    }
    kvl_expert_cache_counters k;
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.duel_lru_hits == 0 && k.duel_frequency_hits == 0,
          "prompt-sized batches do not vote: duel LRU %llu, frequency %llu", (unsigned long long)k.duel_lru_hits,
          (unsigned long long)k.duel_frequency_hits);
    for (int round = 0; round < 10; round++) {
        int a = probe(c, 1, 1), b = probe(c, 2, 1);
        if (round >= 1) hits += (a == 1) + (b == 1);
    }
    kvl_expert_cache_free(c);
    return hits;
}

static void check_policies(kvl_store *s) {
    int hits = hot_extent_hits(s, KVL_CACHE_POLICY_FREQUENCY);
    CHECK(hits == 10, "by frequency the hot extent stays resident: %d hits of 10", hits);
    hits = hot_extent_hits(s, KVL_CACHE_POLICY_LRU);
    CHECK(hits == 0, "plain LRU evicts it every round: %d hits", hits);
    hits = hot_extent_hits(s, KVL_CACHE_POLICY_DEFAULT);
    CHECK(hits == 10, "adaptive (the default) follows frequency here: %d hits of 10", hits);
    hits = shifting_pair_hits(s, KVL_CACHE_POLICY_LRU);
    CHECK(hits == 18, "plain LRU keeps the new pair: %d hits of 18", hits);
    hits = shifting_pair_hits(s, KVL_CACHE_POLICY_FREQUENCY);
    CHECK(hits == 0, "by frequency the new pair evict each other: %d hits", hits);
    /* the duel needs one LRU-shadow hit to switch: phase 2's round 1 still misses once */
    hits = shifting_pair_hits(s, KVL_CACHE_POLICY_ADAPTIVE);
    CHECK(hits >= 16, "adaptive follows LRU here: %d hits of 18", hits);
    /* prompt chunks do not vote: after a prompt whose batches favour frequency, the duel still
     * follows LRU from the first decode steps, as plain LRU does */
    hits = prompt_then_pair_hits(s, KVL_CACHE_POLICY_LRU);
    CHECK(hits == 18, "plain LRU after a prompt: %d hits of 18", hits);
    hits = prompt_then_pair_hits(s, KVL_CACHE_POLICY_ADAPTIVE);
    CHECK(hits >= 16, "adaptive after a prompt follows LRU: %d hits of 18", hits);
}

static void check_pinning(kvl_store *s, int io_threads) {
    kvl_expert_cache *c = make_cache(s, 3, io_threads);
    kvl_expert_view v[3], w;
    kvl_expert_cache_counters k0, k1;
    int others[4] = {4, 5, 6, 7};
    int i, round;
    if (!c) return;
    for (i = 0; i < 3; i++) CHECK(kvl_expert_cache_acquire(c, 2, i, &v[i]) == KVL_OK, "pin %d", i);
    kvl_expert_cache_counters_get(c, &k0);
    CHECK(kvl_expert_cache_acquire(c, 2, 3, &w) == KVL_ERR_NOMEM, "every slot pinned -> NOMEM");
    kvl_expert_cache_prefetch(c, 3, others, 4); /* nothing can be claimed: must neither block nor evict */
    kvl_expert_cache_counters_get(c, &k1);
    CHECK(k1.prefetch_issued == k0.prefetch_issued && k1.evictions == k0.evictions,
          "prefetch with every slot pinned issues nothing");
    CHECK(k1.hits + k1.misses == k0.hits + k0.misses, "refused acquire is not counted");
    for (i = 0; i < 3; i++) CHECK(view_matches(&v[i], 2, i), "pinned %d intact", i);
    /* pin expert 0 a second time, release one pin of it and all of 1 and 2, then churn */
    CHECK(kvl_expert_cache_acquire(c, 2, 0, &w) == KVL_OK && w.gate_q == v[0].gate_q, "double pin same slot");
    kvl_expert_cache_release(c, 2, 0);
    kvl_expert_cache_release(c, 2, 1);
    kvl_expert_cache_release(c, 2, 2);
    for (round = 0; round < 3; round++) {
        for (i = 0; i < N_EXPERTS; i++) {
            int r = probe(c, 3, i);
            CHECK(r >= 0, "churn acquire 3,%d: %d", i, r);
        }
        kvl_expert_cache_prefetch(c, 1, others, 4);
        for (i = 0; i < 4; i++) {
            int r = probe(c, 1, others[i]);
            CHECK(r >= 0, "churn after prefetch 1,%d: %d", others[i], r);
        }
    }
    CHECK(view_matches(&v[0], 2, 0), "extent pinned throughout churn is intact");
    kvl_expert_cache_release(c, 2, 0);
    kvl_expert_cache_release(c, 2, 0); /* one release too many is ignored */
    CHECK(probe(c, 2, 3) >= 0, "acquire after unpinning");
    kvl_expert_cache_free(c);
}

static void check_prefetch(kvl_store *s) {
    kvl_expert_cache *c = make_cache(s, N_EXTENTS, 2);
    kvl_expert_cache_counters k;
    kvl_expert_view v;
    int all[N_EXPERTS], e, ok = 0;
    uint64_t acquires = 0;
    if (!c) return;
    for (e = 0; e < N_EXPERTS; e++) all[e] = e;
    kvl_expert_cache_prefetch(c, 1, all, N_EXPERTS);
    for (e = 0; e < N_EXPERTS; e++) {
        ok += kvl_expert_cache_acquire(c, 1, e, &v) == KVL_OK && view_matches(&v, 1, e);
        kvl_expert_cache_release(c, 1, e);
        acquires++;
    }
    CHECK(ok == N_EXPERTS, "prefetched views correct");
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.prefetch_issued == N_EXPERTS && k.prefetch_served == N_EXPERTS && k.sync_reads == 0 &&
              k.misses == N_EXPERTS && k.hits == 0,
          "prefetch accounting issued %llu served %llu sync %llu", (unsigned long long)k.prefetch_issued,
          (unsigned long long)k.prefetch_served, (unsigned long long)k.sync_reads);
    kvl_expert_cache_prefetch(c, 1, all, N_EXPERTS); /* all resident: no new reads */
    for (e = 0; e < N_EXPERTS; e++) {
        CHECK(kvl_expert_cache_acquire(c, 1, e, &v) == KVL_OK && view_matches(&v, 1, e), "re-acquire");
        kvl_expert_cache_release(c, 1, e);
        acquires++;
    }
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.hits == N_EXPERTS && k.prefetch_issued == N_EXPERTS, "second round all hits");
    check_identities(c, acquires, "prefetch");
    /* unknown ids are ignored by prefetch and refused by acquire */
    {
        int bad[3] = {-1, N_EXPERTS, 3};
        kvl_expert_cache_prefetch(c, 0, bad, 3);
        kvl_expert_cache_prefetch(c, N_LAYERS, bad, 3);
        kvl_expert_cache_prefetch(c, 2, bad, 3);
        CHECK(kvl_expert_cache_acquire(c, 0, 0, &v) == KVL_ERR_INVALID_ARG, "dense layer refused");
        CHECK(kvl_expert_cache_acquire(c, 1, N_EXPERTS, &v) == KVL_ERR_INVALID_ARG, "expert id refused");
        CHECK(kvl_expert_cache_acquire(c, N_LAYERS, 0, &v) == KVL_ERR_INVALID_ARG, "layer id refused");
        CHECK(kvl_expert_cache_acquire(c, -1, 0, &v) == KVL_ERR_INVALID_ARG, "negative layer refused");
    }
    kvl_expert_cache_free(c);

    /* a prefetch batch larger than the cache must not evict its own members; the rest is issued
     * as acquired members are released, so every acquire in batch order is served by prefetch */
    c = make_cache(s, 4, 2);
    if (!c) return;
    kvl_expert_cache_prefetch(c, 2, all, N_EXPERTS);
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.prefetch_issued == 4 && k.evictions == 0, "oversized batch issued %llu evicted %llu",
          (unsigned long long)k.prefetch_issued, (unsigned long long)k.evictions);
    for (e = 0; e < N_EXPERTS; e++) {
        CHECK(kvl_expert_cache_acquire(c, 2, e, &v) == KVL_OK && view_matches(&v, 2, e), "batch member %d", e);
        kvl_expert_cache_release(c, 2, e);
    }
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.prefetch_issued == N_EXPERTS && k.prefetch_served == N_EXPERTS && k.sync_reads == 0 &&
              k.prefetch_wasted == 0 && k.evictions == N_EXPERTS - 4,
          "streamed batch: issued %llu served %llu sync %llu wasted %llu evictions %llu",
          (unsigned long long)k.prefetch_issued, (unsigned long long)k.prefetch_served,
          (unsigned long long)k.sync_reads, (unsigned long long)k.prefetch_wasted,
          (unsigned long long)k.evictions);
    /* a batch protects its resident members too: with 4 slots holding experts 4..7 of layer 2,
     * prefetching {7, 6, 0, 1} must evict 4 and 5, never 6 or 7 */
    {
        int mix[4] = {7, 6, 0, 1};
        kvl_expert_cache_prefetch(c, 2, mix, 4);
        for (e = 0; e < 4; e++) {
            uint64_t h0, h1;
            kvl_expert_cache_stats(c, &h0, NULL, NULL, NULL);
            CHECK(kvl_expert_cache_acquire(c, 2, mix[e], &v) == KVL_OK && view_matches(&v, 2, mix[e]), "mix");
            kvl_expert_cache_stats(c, &h1, NULL, NULL, NULL);
            CHECK((h1 == h0 + 1) == (e < 2), "mix member %d: hit %d", mix[e], (int)(h1 - h0));
        }
        for (e = 0; e < 4; e++) kvl_expert_cache_release(c, 2, mix[e]);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.sync_reads == 0, "mix needed no synchronous read");
    }
    /* freeing with reads still queued must be clean */
    kvl_expert_cache_prefetch(c, 3, all, N_EXPERTS);
    kvl_expert_cache_free(c);
}

/* ------------------------------------------------------------------ lookahead */

/* Waits until no read is queued or in flight (the readers finish on their own). */
static void wait_reads(kvl_expert_cache *c) {
    kvl_expert_cache_counters k;
    do kvl_expert_cache_counters_get(c, &k);
    while (k.reads_in_flight != 0);
}

/* 1 if (l, e) is resident and read: try_acquire pins nothing else and waits for nothing */
static int resident(kvl_expert_cache *c, int l, int e) {
    kvl_expert_view v;
    if (!kvl_expert_cache_try_acquire(c, l, e, &v)) return 0;
    kvl_expert_cache_release(c, l, e);
    return view_matches(&v, l, e) ? 1 : -1;
}

/* The low-priority reads of kvl_expert_cache_lookahead (expert_cache.h): free slots only while
 * everything else is pinned or wanted; nothing while the batch has misses pending; never an
 * extent of the predicted layer; a used prediction is a miss served by it; an unused one is
 * evicted before a colder extent; the counters add up. */
static void check_lookahead(kvl_store *s) {
    kvl_expert_cache_counters k;
    kvl_expert_view v0, v1;
    uint64_t acquires = 0;
    kvl_expert_cache *c = make_cache(s, 3, 2);
    if (!c) return;
    {
        /* pinned (1,0) and wanted (1,1): the one free slot is all a prediction may take */
        int batch[2] = {0, 1}, guess[3] = {0, 1, 2};
        CHECK(kvl_expert_cache_acquire(c, 1, 0, &v0) == KVL_OK, "pin 1,0");
        acquires++;
        kvl_expert_cache_prefetch(c, 1, batch, 2);
        kvl_expert_cache_lookahead(c, 2, guess, 3);
        wait_reads(c);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 1 && k.evictions == 0, "lookahead into the free slot only: issued %llu evictions %llu",
              (unsigned long long)k.lookahead_issued, (unsigned long long)k.evictions);
        kvl_expert_cache_lookahead(c, 3, guess, 3); /* every slot pinned, wanted or predicted */
        wait_reads(c);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 1 && k.evictions == 0, "no victim for a second guess: issued %llu evictions %llu",
              (unsigned long long)k.lookahead_issued, (unsigned long long)k.evictions);
        CHECK(kvl_expert_cache_acquire(c, 1, 1, &v1) == KVL_OK && view_matches(&v1, 1, 1), "wanted 1,1 served");
        acquires++;
        CHECK(view_matches(&v0, 1, 0), "pinned 1,0 intact");
        kvl_expert_cache_release(c, 1, 1);
        kvl_expert_cache_release(c, 1, 0);
        /* layer 2 routes to the guess: the acquire is a miss served by the lookahead */
        kvl_expert_cache_prefetch(c, 2, guess, 1);
        CHECK(kvl_expert_cache_acquire(c, 2, 0, &v1) == KVL_OK && view_matches(&v1, 2, 0), "predicted 2,0 served");
        acquires++;
        kvl_expert_cache_release(c, 2, 0);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_used == 1 && k.sync_reads == 1 && k.prefetch_served == 1 && k.misses == 3 && k.hits == 0,
              "used %llu sync %llu misses %llu hits %llu", (unsigned long long)k.lookahead_used,
              (unsigned long long)k.sync_reads, (unsigned long long)k.misses, (unsigned long long)k.hits);
        check_identities(c, acquires, "lookahead used");
    }
    kvl_expert_cache_free(c);

    c = make_cache(s, 2, 2);
    if (!c) return;
    {
        /* a batch larger than the cache: its pending misses come first, nothing is predicted */
        int batch[4] = {0, 1, 2, 3}, guess[1] = {5}, e;
        kvl_expert_cache_prefetch(c, 1, batch, 4);
        kvl_expert_cache_lookahead(c, 2, guess, 1);
        for (e = 0; e < 4; e++) {
            CHECK(kvl_expert_cache_acquire(c, 1, e, &v0) == KVL_OK && view_matches(&v0, 1, e), "batch 1,%d", e);
            kvl_expert_cache_release(c, 1, e);
        }
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 0 && k.prefetch_served == 4, "pending batch: lookahead issued %llu, served %llu",
              (unsigned long long)k.lookahead_issued, (unsigned long long)k.prefetch_served);
        /* extents of the predicted layer are left alone: both slots hold layer 2 */
        kvl_expert_cache_counters k0;
        CHECK(probe(c, 2, 0) == 0 && probe(c, 2, 1) == 0, "fill with layer 2");
        kvl_expert_cache_counters_get(c, &k0);
        kvl_expert_cache_lookahead(c, 2, guess, 1);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 0 && k.evictions == k0.evictions, "no victim in the predicted layer: issued %llu",
              (unsigned long long)k.lookahead_issued);
        kvl_expert_cache_lookahead(c, 3, guess, 1); /* another layer's guess may take the colder one */
        wait_reads(c);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 1 && k.lookahead_unclaimed == 1 && k.evictions == k0.evictions + 1,
              "guess for layer 3 evicted a layer-2 extent: issued %llu", (unsigned long long)k.lookahead_issued);
        CHECK(resident(c, 2, 0) + resident(c, 2, 1) == 1, "one layer-2 extent left");
    }
    kvl_expert_cache_free(c);

    c = make_cache(s, 3, 2);
    if (!c) return;
    {
        /* an unused prediction goes first: (3,0) was prefetched and never acquired (no use at
         * all, the coldest extent by frequency), (2,5) acquired before and predicted again; when
         * layer 2 routes to 6 instead, (2,5) is evicted for it and (3,0) stays */
        int one[1] = {0}, five[1] = {5}, six[1] = {6};
        acquires = 0;
        CHECK(probe(c, 2, 5) == 0, "2,5 read once");
        CHECK(probe(c, 1, 0) == 0 && probe(c, 1, 1) == 0, "1,0 and 1,1");
        CHECK(probe(c, 1, 2) == 0, "1,2 evicts the oldest, 2,5");
        acquires += 4;
        CHECK(resident(c, 2, 5) == 0, "2,5 evicted");
        kvl_expert_cache_prefetch(c, 3, one, 1);
        wait_reads(c);
        kvl_expert_cache_lookahead(c, 2, five, 1);
        wait_reads(c);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 1 && k.lookahead_unclaimed == 1, "the guess is read, not yet used");
        kvl_expert_cache_prefetch(c, 2, six, 1); /* layer 2 routes elsewhere */
        wait_reads(c);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.lookahead_issued == 1 && k.lookahead_wasted == 1 && k.lookahead_used == 0 &&
                  k.lookahead_cancelled == 0 && k.lookahead_unclaimed == 0,
              "unused guess evicted: issued %llu wasted %llu used %llu cancelled %llu unclaimed %llu",
              (unsigned long long)k.lookahead_issued, (unsigned long long)k.lookahead_wasted,
              (unsigned long long)k.lookahead_used, (unsigned long long)k.lookahead_cancelled,
              (unsigned long long)k.lookahead_unclaimed);
        CHECK(resident(c, 3, 0) == 1, "the colder prefetched extent stays");
        CHECK(kvl_expert_cache_acquire(c, 2, 6, &v0) == KVL_OK && view_matches(&v0, 2, 6), "2,6 served");
        kvl_expert_cache_release(c, 2, 6);
        acquires += 2; /* resident(3,0) acquired once */
        check_identities(c, acquires, "lookahead wasted");
    }
    kvl_expert_cache_free(c);
}

/* ------------------------------------------------------------------ CRC on first read */

/* A copy of the store with one bit of extent (2, 5) flipped (past its first page, so that in the
 * build with one-page pieces the bad piece is not the first), under the original index. */
static void check_corrupt(void) {
    char dir[300], idx[400], bin[400], err[512];
    kvl_store *s = NULL;
    kvl_expert_cache *c;
    kvl_expert_cache_counters k;
    kvl_expert_view v;
    int batch[3] = {4, 5, 6};
    snprintf(dir, sizeof dir, "%s/bad", dir_path);
#ifdef _WIN32
    _mkdir(dir);
#else
    mkdir(dir, 0700);
#endif
    /* the index (and its CRCs) from the original data, then the .bin again with the flip */
    CHECK(write_store(dir, 2, "experts") == 0, "write the copy");
    snprintf(idx, sizeof idx, "%s/experts.idx", dir);
    snprintf(bin, sizeof bin, "%s/experts.bin", dir);
    bin_data[ext_offset[2][5] + 4096 + 17] ^= 0x10;
    CHECK(write_file(bin, bin_data, (size_t)((uint64_t)N_EXTENTS * extent_padded)) == 0, "flip one bit");
    bin_data[ext_offset[2][5] + 4096 + 17] ^= 0x10;
    for (int io = 0; io <= 2; io += 2) {
        CHECK(kvl_store_open(idx, bin, 2, KVL_IO_AUTO, &s, err, sizeof err) == KVL_OK, "open: %s", err);
        if (!s) return;
        c = make_cache(s, 4, io);
        if (!c) return;
        if (io) kvl_expert_cache_prefetch(c, 2, batch, 3); /* the readers check as pieces land */
        for (int j = 0; j < 3; j++) {
            kvl_status st = kvl_expert_cache_acquire(c, 2, batch[j], &v);
            if (batch[j] == 5) {
                CHECK(st == KVL_ERR_CORRUPT, "io=%d: the flipped extent: status %d", io, (int)st);
            } else {
                CHECK(st == KVL_OK && view_matches(&v, 2, batch[j]), "io=%d: extent %d served", io, batch[j]);
                kvl_expert_cache_release(c, 2, batch[j]);
            }
        }
        /* nothing of it stays: every later acquire reads and checks it again */
        CHECK(!kvl_expert_cache_try_acquire(c, 2, 5, &v), "io=%d: try_acquire finds no corrupt extent", io);
        CHECK(kvl_expert_cache_acquire(c, 2, 5, &v) == KVL_ERR_CORRUPT, "io=%d: corrupt again", io);
        kvl_expert_cache_counters_get(c, &k);
        /* two acquires of (2, 5), each read and checked; with readers, the prefetched read may
         * also fail before the first acquire pins it (then dropped, and that acquire reads again) */
        CHECK((k.corrupt_reads == 2 || (io && k.corrupt_reads == 3)) && k.read_failures == k.corrupt_reads,
              "io=%d: corrupt %llu failures %llu", io, (unsigned long long)k.corrupt_reads,
              (unsigned long long)k.read_failures);
        CHECK(k.verify_bytes == (2 + k.corrupt_reads) * extent_nbytes,
              "io=%d: checked %llu bytes, want (4 and 6 once, 5 at each read) %llu", io,
              (unsigned long long)k.verify_bytes, (unsigned long long)((2 + k.corrupt_reads) * extent_nbytes));
        CHECK(kvl_store_verified(s, kvl_store_find(s, "language_model.model.layers.2.mlp.experts.4")) &&
                  !kvl_store_verified(s, kvl_store_find(s, "language_model.model.layers.2.mlp.experts.5")),
              "io=%d: flags", io);
        kvl_expert_cache_free(c);
        /* one slot: (1,0), (1,1), (1,0) again is three reads but two checks */
        c = make_cache(s, 1, io);
        if (!c) return;
        CHECK(probe(c, 1, 0) == 0 && probe(c, 1, 1) == 0 && probe(c, 1, 0) == 0, "io=%d: three misses", io);
        kvl_expert_cache_counters_get(c, &k);
        CHECK(k.verify_bytes == 2 * extent_nbytes && k.bytes_read == 3 * extent_padded,
              "io=%d: re-read after eviction checked again (%llu bytes checked)", io,
              (unsigned long long)k.verify_bytes);
        kvl_expert_cache_free(c);
        kvl_store_close(s);
        s = NULL;
    }
    remove(idx);
    remove(bin);
#ifdef _WIN32
    _rmdir(dir);
#else
    rmdir(dir);
#endif
}

/* ------------------------------------------------------------------ two threads */

typedef struct worker_arg {
    kvl_expert_cache *cache;
    int slots, iterations, use_prefetch;
    uint64_t seed;
    uint64_t ok_acquires, nomem;
} worker_arg;

static KVL_THREAD_RET KVL_THREAD_CALL worker(void *p) {
    worker_arg *a = (worker_arg *)p;
    rng r;
    int it;
    r.s = a->seed;
    for (it = 0; it < a->iterations; it++) {
        int layer = 1 + (int)(rnd(&r) % (N_LAYERS - 1));
        int k = 1 + (int)(rnd(&r) % 3), n = 0, j, held[3];
        int ids[3];
        kvl_expert_view v[3];
        while (n < k) { /* k distinct experts, like top-k routing */
            int e = (int)(rnd(&r) % N_EXPERTS), dup = 0;
            for (j = 0; j < n; j++) dup |= ids[j] == e;
            if (!dup) ids[n++] = e;
        }
        if (a->use_prefetch && (rnd(&r) & 1)) {
            kvl_expert_cache_prefetch(a->cache, layer, ids, k);
            if (rnd(&r) & 1) { /* a guess for another layer, as model.c's predict_next makes */
                int guess[2] = {(int)(rnd(&r) % N_EXPERTS), (int)(rnd(&r) % N_EXPERTS)};
                kvl_expert_cache_lookahead(a->cache, 1 + layer % (N_LAYERS - 1), guess, 2);
            }
        }
        for (j = 0; j < k; j++) {
            kvl_status st = kvl_expert_cache_acquire(a->cache, layer, ids[j], &v[j]);
            held[j] = st == KVL_OK;
            if (st == KVL_OK) {
                a->ok_acquires++;
                CHECK(view_matches(&v[j], layer, ids[j]), "thread view %d,%d", layer, ids[j]);
            } else {
                /* only legitimate when this thread and the other could pin every slot */
                CHECK(st == KVL_ERR_NOMEM && a->slots < 6, "acquire status %d with %d slots", (int)st, a->slots);
                a->nomem++;
            }
        }
        for (j = 0; j < k; j++) {
            if (!held[j]) continue;
            /* still intact after the other thread's activity: pinned means never evicted */
            CHECK(view_matches(&v[j], layer, ids[j]), "pinned view %d,%d intact at release", layer, ids[j]);
            kvl_expert_cache_release(a->cache, layer, ids[j]);
        }
    }
    return KVL_THREAD_RETURN;
}

static void check_threads(kvl_store *s, int slots, int use_prefetch, int iterations) {
    kvl_expert_cache *c = make_cache(s, slots, 2);
    worker_arg a[2];
    kvl_os_thread t[2];
    char label[64];
    int i;
    if (!c) return;
    snprintf(label, sizeof label, "threads slots=%d prefetch=%d", slots, use_prefetch);
    for (i = 0; i < 2; i++) {
        memset(&a[i], 0, sizeof a[i]);
        a[i].cache = c;
        a[i].slots = slots;
        a[i].iterations = iterations;
        a[i].use_prefetch = use_prefetch;
        a[i].seed = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1) + (uint64_t)slots;
        CHECK(kvl_os_thread_start(&t[i], worker, &a[i]) == 0, "start thread");
    }
    for (i = 0; i < 2; i++) kvl_os_thread_join(t[i]);
    check_identities(c, a[0].ok_acquires + a[1].ok_acquires, label);
    if (!use_prefetch) {
        uint64_t misses, bytes;
        kvl_expert_cache_stats(c, NULL, &misses, &bytes, NULL);
        CHECK(bytes == misses * extent_padded, "%s: bytes == misses * extent", label);
    }
    if (getenv("KVL_TEST_VERBOSE")) {
        kvl_expert_cache_counters k;
        kvl_expert_cache_counters_get(c, &k);
        printf("  %-28s acquires %llu nomem %llu hits %llu misses %llu (prefetch served %llu wasted %llu)\n",
               label, (unsigned long long)(a[0].ok_acquires + a[1].ok_acquires),
               (unsigned long long)(a[0].nomem + a[1].nomem), (unsigned long long)k.hits,
               (unsigned long long)k.misses, (unsigned long long)k.prefetch_served,
               (unsigned long long)k.prefetch_wasted);
    }
    kvl_expert_cache_free(c);
}

/* Q4 extents: layer 1, experts 0 and 1, I = 32, H = 64; FORMAT.md's offsets by hand: q blocks of
 * 32*64/2 = 1024 bytes at 0, 1024, 2048, BF16 scale blocks of 2*(32*64/32) = 128 bytes at 3072,
 * 3200, 3328; 3456 bytes, one page a slot. mixed: expert 1 is a Q8 extent of the same shape. */
static void check_q4(int mixed) {
    enum { QI = 32, QH = 64, Q4_NBYTES = 3456 };
    const uint64_t nb[2] = {Q4_NBYTES, mixed ? q8_nbytes(QI, QH) : Q4_NBYTES};
    const uint64_t off[2] = {0, a4k(nb[0])}, bin_len = a4k(off[1] + nb[1]);
    unsigned char *bin = (unsigned char *)calloc((size_t)bin_len, 1);
    size_t idx_len = idx_len_for(1, 2, 2);
    unsigned char *idx = (unsigned char *)calloc(idx_len, 1);
    char qidx[512], qbin[512], err[512];
    rng r = {0x13198A2E03707344ull};
    for (uint64_t i = 0; i < bin_len; i++) bin[i] = (unsigned char)rnd(&r);
    idx_put_header(idx, 2, bin_len, 1, 2, 2, NULL);
    put32(idx + 8, 3); /* Q4_EXPERT needs format version 3 */
    idx_put_hparam(idx + 128, "text.hidden_size", 64.0);
    for (int e = 0; e < 2; e++) {
        char name[128];
        const uint64_t shape[4] = {1, (uint64_t)e, QI, QH};
        snprintf(name, sizeof name, "language_model.model.layers.1.mlp.experts.%d", e);
        idx_put_record(idx + 128 + 64 + 192 * (size_t)e, name, mixed && e == 1 ? 3 : 5, 4, shape, off[e],
                       nb[e], ref_crc32(bin + off[e], (size_t)nb[e]));
    }
    memcpy(idx + idx_len - 2, "{}", 2);
    idx_seal(idx, idx_len);
    snprintf(qidx, sizeof qidx, "%s/q4.idx", dir_path);
    snprintf(qbin, sizeof qbin, "%s/q4.bin", dir_path);
    CHECK(write_file(qidx, idx, idx_len) == 0 && write_file(qbin, bin, (size_t)bin_len) == 0, "write q4 store");
    kvl_store *s = NULL;
    kvl_status st = kvl_store_open(qidx, qbin, 2, KVL_IO_AUTO, &s, err, sizeof err);
    CHECK(st == KVL_OK && s, "open q4 store: %s", err);
    if (s) {
        kvl_expert_cache *c = NULL;
        st = kvl_expert_cache_create(s, 2, 2, 2 * 4096, 1, 2, 0, &c, err, sizeof err);
        if (mixed) {
            CHECK(st == KVL_ERR_FORMAT && c == NULL && strstr(err, qbin) &&
                      strstr(err, "language_model.model.layers.1.mlp.experts.1") && strstr(err, "all Q8 or all Q4"),
                  "mixed Q8 and Q4 extents: %d %s", (int)st, err);
        } else {
            CHECK(st == KVL_OK && c, "create q4 cache: %s", err);
        }
        for (int e = 0; c && e < 2; e++) {
            kvl_expert_view v;
            const unsigned char *x = bin + off[e];
            CHECK(kvl_expert_cache_acquire(c, 1, e, &v) == KVL_OK, "acquire q4 %d", e);
            CHECK(v.dtype == KVL_DTYPE_Q4_EXPERT, "q4 view dtype %u", v.dtype);
            CHECK(memcmp(v.gate_q, x, 1024) == 0 && memcmp(v.up_q, x + 1024, 1024) == 0 &&
                      memcmp(v.down_q, x + 2048, 1024) == 0 && memcmp(v.gate_s, x + 3072, 128) == 0 &&
                      memcmp(v.up_s, x + 3200, 128) == 0 && memcmp(v.down_s, x + 3328, 128) == 0,
                  "q4 view %d holds FORMAT.md's sub-blocks", e);
            CHECK((const unsigned char *)v.down_s - (const unsigned char *)v.gate_q == 3328, "q4 view offsets");
            kvl_expert_cache_release(c, 1, e);
        }
        if (c) {
            kvl_expert_cache_counters k;
            kvl_expert_cache_counters_get(c, &k);
            CHECK(k.extent_bytes == 4096 && k.corrupt_reads == 0, "q4 slot bytes %llu", (unsigned long long)k.extent_bytes);
        }
        kvl_expert_cache_free(c);
        kvl_store_close(s);
    }
    remove(qidx);
    remove(qbin);
    free(idx);
    free(bin);
}

/* kvl_expert_cache_set_slots: parking drops the extents of the slots past n (every extent
 * still read back right), a pinned slot refuses, n is clamped, reads in flight on parked slots
 * finish and the counters' identities hold. io_threads 0: synchronous reads; 2: prefetches in
 * flight when the cache shrinks. */
static void check_set_slots(kvl_store *s, int io_threads) {
    kvl_expert_cache *c = make_cache_policy(s, N_EXPERTS, io_threads, KVL_CACHE_POLICY_LRU);
    kvl_expert_cache_counters k;
    kvl_expert_view v;
    int e, active = -1, all[N_EXPERTS], hits = 0, misses = 0;
    uint64_t acquires = 0, evictions;
    if (!c) return;
    for (e = 0; e < N_EXPERTS; e++) all[e] = e;
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(probe(c, 1, e) == 0, "set_slots %d: fill %d misses", io_threads, e);
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(probe(c, 1, e) == 1, "set_slots %d: full cache hits %d", io_threads, e);
    /* where the last extent lives (slot 7: slots fill in order), to look at after parking it */
    const unsigned char *parked = NULL;
    if (kvl_expert_cache_acquire(c, 1, N_EXPERTS - 1, &v) == KVL_OK) parked = (const unsigned char *)v.gate_q;
    kvl_expert_cache_release(c, 1, N_EXPERTS - 1);
    acquires++;
    kvl_expert_cache_counters_get(c, &k);
    evictions = k.evictions;
    CHECK(kvl_expert_cache_set_slots(c, 3, &active) == KVL_OK && active == 3, "shrink to 3: active %d", active);
#if defined(__linux__) && !defined(__EMSCRIPTEN__)
    /* its pages went back to the OS: private anonymous pages after MADV_DONTNEED read as zeros
     * (they held the extent's random bytes) */
    if (parked) {
        size_t nonzero = 0;
        for (uint64_t i = 0; i < extent_nbytes; i++) nonzero += parked[i] != 0;
        CHECK(nonzero == 0, "a parked slot's pages were given back: %zu nonzero bytes", nonzero);
    }
#else
    (void)parked;
#endif
    CHECK(kvl_expert_cache_active_slots(c) == 3 && kvl_expert_cache_slots(c) == N_EXPERTS &&
              kvl_expert_cache_bytes(c) == (uint64_t)N_EXPERTS * extent_padded,
          "shrunk: active %d, created %d", kvl_expert_cache_active_slots(c), kvl_expert_cache_slots(c));
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.evictions == evictions + 5, "shrink evicts the 5 parked extents: %llu", (unsigned long long)(k.evictions - evictions));
    /* slots fill in order, so experts 0..2 stayed */
    for (e = 0; e < 3; e++, acquires++) CHECK(probe(c, 1, e) == 1, "kept extent %d hits", e);
    /* a cycle of 8 through 3 LRU slots: every acquire misses, and reads back the right bytes */
    for (int round = 0; round < 2; round++)
        for (e = 3; e < N_EXPERTS + 3; e++, acquires++) {
            int r = probe(c, 1, e % N_EXPERTS);
            hits += r == 1;
            misses += r == 0;
        }
    CHECK(hits == 0 && misses == 2 * N_EXPERTS, "3 slots cycle 8 extents: %d hits %d misses", hits, misses);
    CHECK(kvl_expert_cache_set_slots(c, 100, &active) == KVL_OK && active == N_EXPERTS, "grow clamps to the slots created: %d", active);
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(probe(c, 2, e) >= 0, "after growing %d", e);
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(probe(c, 2, e) == 1, "grown cache holds 8 again: %d", e);
    CHECK(kvl_expert_cache_set_slots(c, 0, &active) == KVL_OK && active == 1, "shrink clamps to min_slots: %d", active);
    CHECK(kvl_expert_cache_set_slots(c, N_EXPERTS, &active) == KVL_OK && active == N_EXPERTS, "grow back: %d", active);
    /* a pinned extent in a slot to park: refused, nothing changed */
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(probe(c, 3, e) == 0, "refill %d", e);
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(kvl_expert_cache_acquire(c, 3, e, &v) == KVL_OK, "pin %d", e);
    CHECK(kvl_expert_cache_set_slots(c, 2, &active) == KVL_ERR_INVALID_ARG && active == N_EXPERTS, "pinned: refused (%d)", active);
    for (e = 0; e < N_EXPERTS; e++) kvl_expert_cache_release(c, 3, e);
    for (e = 0; e < N_EXPERTS; e++, acquires++) CHECK(probe(c, 3, e) == 1, "the refusal dropped nothing: %d", e);
    /* a prefetch batch in flight, then a shrink: its reads finish, the identities hold */
    kvl_expert_cache_prefetch(c, 1, all, N_EXPERTS);
    CHECK(kvl_expert_cache_set_slots(c, 2, &active) == KVL_OK && active == 2, "shrink during prefetch: %d", active);
    for (e = 0; e < N_EXPERTS; e++, acquires++) {
        CHECK(kvl_expert_cache_acquire(c, 1, e, &v) == KVL_OK && view_matches(&v, 1, e), "after a shrink in flight: %d", e);
        kvl_expert_cache_release(c, 1, e);
    }
    kvl_expert_cache_counters_get(c, &k);
    CHECK(k.reads_in_flight == 0 || io_threads > 0, "no read in flight without readers");
    check_identities(c, acquires, io_threads ? "set_slots with readers" : "set_slots");
    kvl_expert_cache_free(c);
}

int main(void) {
    const char *base = getenv("KVL_TEST_TMP");
    const char *iters_env = getenv("KVL_TEST_ITERS");
    int iterations = iters_env ? atoi(iters_env) : 400;
    int budgets[] = {1, 2, 3, 5, 8, 13, N_EXTENTS};
    kvl_store *s;
    size_t b;
    int slots;
    kvl_os_mutex_init(&check_lock);
    if (!base) base = "/tmp";
    init_data();
#ifdef _WIN32
    snprintf(dir_path, sizeof dir_path, "%s/kvl-test-cache-%d", base, (int)GetCurrentProcessId());
    if (_mkdir(dir_path) != 0) {
#else
    snprintf(dir_path, sizeof dir_path, "%s/kvl-test-cache-XXXXXX", base);
    if (!mkdtemp(dir_path)) {
#endif
        printf("cannot create a temp dir under %s\n", base);
        return 2;
    }
    snprintf(idx_path, sizeof idx_path, "%s/experts.idx", dir_path);
    snprintf(bin_path, sizeof bin_path, "%s/experts.bin", dir_path);
    if (write_store(dir_path, 2, "experts") != 0) {
        printf("cannot write the test store under %s\n", dir_path);
        return 2;
    }
    s = open_store();
    if (s) {
        printf("note: experts store direct_io=%d, extent %llu bytes (padded %llu)\n", kvl_store_direct_io(s),
               (unsigned long long)extent_nbytes, (unsigned long long)extent_padded);
        check_create_errors(s);
        for (slots = 1; slots <= N_EXTENTS; slots++) {
            check_sequential(s, slots, 0);
            if (slots == 1 || slots == 7 || slots == N_EXTENTS) check_sequential(s, slots, 2);
        }
        check_lru(s);
        check_set_slots(s, 0);
        check_set_slots(s, 2);
        check_policies(s);
        check_pinning(s, 0);
        check_pinning(s, 2);
        check_prefetch(s);
        check_lookahead(s);
        check_corrupt();
        check_q4(0);
        check_q4(1);
        for (b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
            check_threads(s, budgets[b], 0, iterations);
            check_threads(s, budgets[b], 1, iterations);
        }
        kvl_store_close(s);
    }
    remove(idx_path);
    remove(bin_path);
#ifdef _WIN32
    _rmdir(dir_path);
#else
    rmdir(dir_path);
#endif
    free(bin_data);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
