/* store.h — one packed store (X.idx + X.bin, docs/FORMAT.md) and aligned reads from it.
 *
 * Owns: parsing and validating an index (magic, version, CRC, record bounds, alignment,
 * overlaps, bin size), the hparam table, positional reads from the .bin file with direct
 * I/O (O_DIRECT / FILE_FLAG_NO_BUFFERING) or a buffered fallback, and each record's "data
 * checked against its CRC" flag (the checks themselves are the readers').
 * Does not own: caching (expert_cache.c; the trunk cache in engine.c, its streamer in trunk.c)
 * or any math.
 */
#ifndef KVL_STORE_H
#define KVL_STORE_H

#include <stddef.h>
#include <stdint.h>
#include "kvl_core.h"

#define KVL_PAGE 4096u
/* a record's dtype: KVL_DTYPE_* (kvl_core.h KVL_DTYPE_ROWS) */

typedef struct kvl_tensor_rec {
    char name[128];
    uint32_t dtype, ndim;
    uint64_t shape[4];
    uint64_t offset, nbytes;
    uint32_t crc32, flags;
} kvl_tensor_rec;

typedef struct kvl_store kvl_store;

/* io_mode: KVL_IO_*; err receives a message naming the file and what is wrong. */
kvl_status kvl_store_open(const char *idx_path, const char *bin_path, uint32_t expected_kind,
                          int io_mode, kvl_store **out, char *err, size_t err_len);
void kvl_store_close(kvl_store *store);
int kvl_store_direct_io(const kvl_store *store);           /* 1 if reads bypass the page cache */
uint32_t kvl_store_count(const kvl_store *store);
const kvl_tensor_rec *kvl_store_at(const kvl_store *store, uint32_t i);
const kvl_tensor_rec *kvl_store_find(const kvl_store *store, const char *name);
/* value of an hparam; returns 0 and sets *found = 0 if missing */
double kvl_store_hparam(const kvl_store *store, const char *key, int *found);
const char *kvl_store_config_json(const kvl_store *store, size_t *len);
/* Read bytes [offset, offset+nbytes) of the .bin into dst. offset must be 4096-aligned, dst
 * 4096-aligned (kvl_aligned_alloc) and at least align4096(nbytes) long. Thread-safe. */
kvl_status kvl_store_read(kvl_store *store, uint64_t offset, uint64_t nbytes, void *dst);
/* Read a small unaligned range (e.g. one embedding row) through a bounce buffer. Thread-safe. */
kvl_status kvl_store_read_small(kvl_store *store, uint64_t offset, uint64_t nbytes, void *dst);

void *kvl_aligned_alloc(size_t alignment, size_t bytes); /* zeroed; NULL on failure */
/* Large long-lived buffers that reads fill before any use (expert slab, trunk cache, globals):
 * 2 MiB-aligned with transparent huge pages requested (decode streams GBs per token through them;
 * 4 KiB pages cost a TLB walk every 4 KiB) and NOT zeroed, so opening an engine with a 14 GiB
 * cache does not fault 14 GiB in up front: RSS grows as the cache fills, never past the plan.
 * Free with kvl_aligned_free. NULL on failure. */
void *kvl_large_alloc(size_t bytes);
void kvl_aligned_free(void *p);
uint64_t kvl_now_ns(void);

/* ---- additions by store.c's author (extensions; nothing above changed) ---- */

/* zlib-compatible CRC-32 (polynomial 0xEDB88320). Start with crc = 0; chain by passing the
 * previous result. The reference (a half-byte table, ~0.3 GB/s): index CRCs here, and what
 * tests/test_crc32.c holds crc32.c's fast ones against. */
uint32_t kvl_crc32(uint32_t crc, const void *data, size_t len);

/* Byte layout of one Q8_EXPERT extent for moe_intermediate_size I and hidden_size H
 * (docs/FORMAT.md): sub-block offsets relative to the extent start, and nbytes. */
typedef struct kvl_q8_layout {
    uint64_t gate_q, up_q, down_q, gate_s, up_s, down_s, nbytes;
} kvl_q8_layout;
void kvl_q8_layout_of(uint64_t inter, uint64_t hidden, kvl_q8_layout *out);

/* Byte layout of one Q4_EXPERT extent (docs/FORMAT.md), the same members as kvl_q8_layout:
 * q bytes [rows, cols/2] at gate_q, up_q, down_q, BF16 scale bits [rows, cols/32] at gate_s,
 * up_s, down_s. I and H must be multiples of 32 (and nonzero); otherwise every member is 0
 * (nbytes 0: no such extent). */
typedef struct kvl_q4_layout {
    uint64_t gate_q, up_q, down_q, gate_s, up_s, down_s, nbytes;
} kvl_q4_layout;
void kvl_q4_layout_of(uint64_t inter, uint64_t hidden, kvl_q4_layout *out);

/* Byte layout of one Q8_ROWS record [rows, cols] (docs/FORMAT.md): int8 rows at 0, the f32
 * scale of each row at `scale` = align64(rows * cols); nbytes = scale + 4 * rows. */
typedef struct kvl_q8_rows_layout {
    uint64_t scale, nbytes;
} kvl_q8_rows_layout;
void kvl_q8_rows_layout_of(uint64_t rows, uint64_t cols, kvl_q8_rows_layout *out);

uint32_t kvl_store_kind(const kvl_store *store);          /* 1 trunk, 2 experts, 3 vision */
uint64_t kvl_store_bin_size(const kvl_store *store);
const char *kvl_store_revision(const kvl_store *store);   /* 40 hex chars, or "" if unknown */
const char *kvl_store_bin_path(const kvl_store *store);
/* First-read checks (docs/FORMAT.md "Checks at run time"): one flag per record, set once its
 * data, read from the .bin, matched its CRC-32, so the readers (expert_cache.c, trunk.c,
 * engine_errors.c) check each record once per open store and not again when they re-read it after an
 * eviction. Thread-safe; rec must come from this store (kvl_store_at / kvl_store_find). */
int kvl_store_verified(kvl_store *store, const kvl_tensor_rec *rec);
void kvl_store_set_verified(kvl_store *store, const kvl_tensor_rec *rec);
/* Detail message of the most recent failed kvl_store_read / kvl_store_read_small on this store
 * (names the file, offset and system error). Thread-safe; empty if nothing failed. */
void kvl_store_last_error(kvl_store *store, char *buf, size_t len);

#endif
