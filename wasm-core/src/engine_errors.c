/* engine_errors.c — the engine's errors and the CRC checks of pack data its driver thread reads.
 *
 * Owns: the text of each status (kvl_strerror), the engine's last_error (kvl_engine_fail), the
 * error of data that does not match its CRC-32 (kvl_engine_corrupt: file, tensor, where it sits,
 * and the kvl doctor advice) and the check of data read on the driver thread against its index
 * CRC on the pool's threads (kvl_engine_check, kvl_engine_check_through; docs/FORMAT.md "Checks
 * at run time"): the tensors read at open (lm_head, norms, routers, the resident trunk, the
 * embedding read whole once through memory not in use yet) and the vision weights.
 * Does not own: the checks made where the bytes arrive in a reader thread (the trunk streamer,
 * trunk.c; the expert cache, expert_cache.c), the CRC-32 itself (crc32.c), what is read when.
 * Layer: engine services, below engine.c, model.c, vision.c and trunk.c; calls only the caches,
 * store, thread pool and crc32 (scripts/c-layers.mjs).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_errors.h"
#include "crc32.h"

/* ---- status text and errors ------------------------------------------------------------------ */

const char *kvl_strerror(kvl_status status)
{
    switch (status) { /* the texts of kvl_core.h KVL_STATUS_ROWS, the host's too */
#define STATUS_TEXT(sym, value, name) \
    case KVL_##sym:                   \
        return name;
        KVL_STATUS_ROWS(STATUS_TEXT)
#undef STATUS_TEXT
    }
    return "unknown status";
}

kvl_status kvl_engine_fail(kvl_engine *engine, kvl_status status, const char *fmt, ...)
{
    if (engine) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(engine->last_error, sizeof engine->last_error, fmt, ap);
        va_end(ap);
    }
    return status;
}

kvl_status kvl_engine_read_failed(kvl_engine *e, kvl_status status, kvl_store *store,
                                  const char *what)
{
    /* the store's record: "PATH: read of N bytes at offset O failed (REASON)"; a status other
     * than KVL_ERR_IO (no memory, a bad range) is not the disk's doing and keeps its plain text */
    char io[320] = "";
    if (status != KVL_ERR_IO || !store)
        return kvl_engine_fail(e, status, "reading %s failed: %s", what, kvl_strerror(status));
    kvl_store_last_error(store, io, sizeof io);
    return kvl_engine_fail(e, status, "%s, reading %s; the pack's files changed or its disk failed "
                           "while kvl was running: reconnect the disk or put the pack back as it "
                           "was, check it with `kvl doctor %s`, then try again", io, what,
                           e && e->pack_dir ? e->pack_dir : "MODEL");
}

/* ---- CRC checks of pack data on first read --------------------------------------------------- */

kvl_status kvl_engine_corrupt(kvl_engine *e, const char *file, const char *tensor)
{
    /* where the tensor sits, from its FORMAT.md name */
    char where[64] = "";
    const char *layer = strstr(tensor, ".layers."), *expert = strstr(tensor, ".experts.");
    const char *block = strstr(tensor, ".blocks.");
    if (layer && expert)
        snprintf(where, sizeof where, " (layer %d, expert %d)", atoi(layer + 8), atoi(expert + 9));
    else if (layer)
        snprintf(where, sizeof where, " (layer %d)", atoi(layer + 8));
    else if (block)
        snprintf(where, sizeof where, " (vision block %d)", atoi(block + 8));
    return kvl_engine_fail(e, KVL_ERR_CORRUPT, "%s: tensor '%s'%s does not match its CRC-32 in "
                           "the index: the pack is corrupt; run `kvl doctor %s` (it checks every "
                           "tensor), then repack or copy the pack again", file, tensor, where,
                           e->pack_dir ? e->pack_dir : "MODEL");
}

/* CRC-32 of one buffer over the pool: each thread takes a range, the CRCs are combined in order. */
#define CRC_MAX_PARTS 256
typedef struct crc_job {
    const unsigned char *data;
    size_t len;
    int parts;
    uint32_t crc[CRC_MAX_PARTS];
} crc_job;

static void crc_part(void *ctx, int ti, int nt)
{
    crc_job *j = (crc_job *)ctx;
    size_t b, end;
    (void)nt;
    if (ti >= j->parts) return;
    kvl_split_range(j->len, 64, ti, j->parts, &b, &end);
    j->crc[ti] = kvl_crc32_fast(0, j->data + b, end - b);
}

static uint32_t pool_crc(kvl_engine *e, const void *data, size_t len)
{
    int nt = e->pool ? kvl_pool_size(e->pool) : 1;
    /* below ~1 MiB a pool run's wake-ups (tens of microseconds in WebAssembly) are not worth it */
    if (nt <= 1 || len < ((size_t)1 << 20)) return kvl_crc32_fast(0, data, len);
    crc_job j;
    j.data = (const unsigned char *)data;
    j.len = len;
    j.parts = nt < CRC_MAX_PARTS ? nt : CRC_MAX_PARTS;
    kvl_pool_run(e->pool, crc_part, &j);
    uint32_t crc = j.crc[0];
    for (int i = 1; i < j.parts; i++) {
        size_t b, end;
        kvl_split_range(len, 64, i, j.parts, &b, &end);
        crc = kvl_crc32_combine(crc, j.crc[i], end - b);
    }
    return crc;
}

kvl_status kvl_engine_check(kvl_engine *e, kvl_store *store, const char *file,
                            const kvl_tensor_rec *rec, const void *data)
{
    if (kvl_store_verified(store, rec)) return KVL_OK;
    uint64_t t0 = kvl_now_ns();
    uint32_t crc = pool_crc(e, data, (size_t)rec->nbytes);
    e->verify_ns += kvl_now_ns() - t0;
    e->verify_bytes += rec->nbytes;
    if (crc != rec->crc32) return kvl_engine_corrupt(e, file, rec->name);
    kvl_store_set_verified(store, rec);
    return KVL_OK;
}

/* A tensor the engine never holds whole (the embedding: decoding reads one row per token) is
 * checked at open by reading it through `bounce`, engine memory not filled yet (bounce_bytes, a
 * multiple of 4 KiB, 4 KiB-aligned), so a flipped bit in it is found before any turn uses it. */
kvl_status kvl_engine_check_through(kvl_engine *e, kvl_store *store, const char *file,
                                    const kvl_tensor_rec *rec, void *bounce, uint64_t bounce_bytes)
{
    uint32_t crc = 0;
    for (uint64_t at = 0; at < rec->nbytes; at += bounce_bytes) {
        uint64_t n = rec->nbytes - at < bounce_bytes ? rec->nbytes - at : bounce_bytes;
        kvl_status st = kvl_store_read(store, rec->offset + at, n, bounce);
        if (st != KVL_OK)
            return kvl_engine_fail(e, st, "%s: reading '%s' failed", file, rec->name);
        uint64_t t0 = kvl_now_ns();
        crc = kvl_crc32_combine(crc, pool_crc(e, bounce, (size_t)n), n);
        e->verify_ns += kvl_now_ns() - t0;
        e->verify_bytes += n;
    }
    if (crc != rec->crc32) return kvl_engine_corrupt(e, file, rec->name);
    kvl_store_set_verified(store, rec);
    return KVL_OK;
}
