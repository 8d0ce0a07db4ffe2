/* trunk.c — the trunk streamer: the trunk tensors that did not fit the trunk cache, read into a
 * double buffer by one I/O thread while the forward pass computes on the previous one.
 *
 * Owns: the streamer (two buffers, the I/O thread, the prefetch of the next streamed tensor in
 * forward order), kvl_trunk_get (the resident copy or the streamed one, with the trunk hit, miss
 * and stall counters), the CRC check of each streamed tensor the first time it arrives, in the
 * I/O thread (docs/FORMAT.md "Checks at run time"), and the counters that thread adds to, under
 * its lock.
 * Does not own: which tensors are resident or streamed, and their order (engine.c plans the trunk
 * cache at open and fills engine->text->tt), the forward math (model.c), reads (store.c).
 * Layer: engine services, below engine.c and model.c; calls engine_errors.c, the store and crc32
 * (scripts/c-layers.mjs).
 */
#include <stdio.h>
#include <stdlib.h>

#include "trunk.h"
#include "engine_errors.h"
#include "crc32.h"
#include "platform.h"

enum { SLOT_EMPTY = 0, SLOT_LOADING = 1, SLOT_READY = 2 };

typedef struct kvl_stream {
    kvl_engine *engine;
    kvl_os_mutex mu;
    kvl_os_cond cv;
    kvl_os_thread thread;
    int quit;
    void *buf[2];
    uint64_t buf_bytes;
    int tensor[2], state[2];
    kvl_status status[2];
    int pending;   /* slot queued for the I/O thread, or -1 */
    int current;   /* slot compute is using, or -1 */
} kvl_stream;

static void stream_io_loop(kvl_stream *st)
{
    kvl_engine_text *t = st->engine->text;
    kvl_os_mutex_lock(&st->mu);
    for (;;) {
        while (!st->quit && st->pending < 0) kvl_os_cond_wait(&st->cv, &st->mu);
        if (st->quit) break;
        int slot = st->pending;
        st->pending = -1;
        const kvl_tensor_rec *rec = t->tt[st->tensor[slot]].rec;
        kvl_os_mutex_unlock(&st->mu);
        kvl_status s = kvl_store_read(st->engine->trunk, rec->offset, rec->nbytes, st->buf[slot]);
        /* first read of this tensor: its CRC, here where the bytes arrive (compute overlaps) */
        uint64_t crc_ns = 0;
        int checked = 0;
        if (s == KVL_OK && !kvl_store_verified(st->engine->trunk, rec)) {
            uint64_t t0 = kvl_now_ns();
            uint32_t crc = kvl_crc32_fast(0, st->buf[slot], (size_t)rec->nbytes);
            crc_ns = kvl_now_ns() - t0;
            checked = 1;
            if (crc == rec->crc32) kvl_store_set_verified(st->engine->trunk, rec);
            else s = KVL_ERR_CORRUPT;
        }
        kvl_os_mutex_lock(&st->mu);
        st->status[slot] = s;
        st->state[slot] = SLOT_READY;
        if (s == KVL_OK) t->trunk_bytes_read += rec->nbytes;
        if (checked) {
            t->stream_verify_ns += crc_ns;
            t->stream_verify_bytes += rec->nbytes;
        }
        kvl_os_cond_broadcast(&st->cv);
    }
    kvl_os_mutex_unlock(&st->mu);
}

static KVL_THREAD_RET KVL_THREAD_CALL stream_thread_main(void *arg)
{
    stream_io_loop((kvl_stream *)arg);
    return KVL_THREAD_RETURN;
}

/* queue `tensor` into `slot`; caller holds the lock and the slot is not loading */
static void stream_queue(kvl_stream *st, int slot, int tensor)
{
    st->tensor[slot] = tensor;
    st->state[slot] = SLOT_LOADING;
    st->pending = slot;
    kvl_os_cond_broadcast(&st->cv);
}

kvl_status kvl_trunk_get(kvl_engine *engine, int id, const uint16_t **out)
{
    kvl_engine_text *t = engine->text;
    kvl_trunk_tensor *tt = &t->tt[id];
    if (tt->resident) {
        t->trunk_hits++;
        *out = tt->resident;
        return KVL_OK;
    }
    kvl_stream *st = t->stream;
    t->trunk_misses++;
    kvl_os_mutex_lock(&st->mu);
    int slot = -1;
    for (int i = 0; i < 2; i++)
        if (st->state[i] != SLOT_EMPTY && st->tensor[i] == id) slot = i;
    if (slot < 0) {
        /* not prefetched (first use, or out of order): read now into the slot not in use */
        slot = st->current == 0 ? 1 : 0;
        while (st->state[slot] == SLOT_LOADING) kvl_os_cond_wait(&st->cv, &st->mu);
        stream_queue(st, slot, id);
    }
    if (st->state[slot] != SLOT_READY) {
        uint64_t t0 = kvl_now_ns();
        while (st->state[slot] != SLOT_READY) kvl_os_cond_wait(&st->cv, &st->mu);
        t->trunk_stall_ns += kvl_now_ns() - t0;
    }
    kvl_status s = st->status[slot];
    if (s != KVL_OK) {
        /* empty again: the next use reads (and checks) it afresh */
        st->state[slot] = SLOT_EMPTY;
        kvl_os_mutex_unlock(&st->mu);
        if (s == KVL_ERR_CORRUPT) return kvl_engine_corrupt(engine, "trunk.bin", tt->rec->name);
        char what[160];
        snprintf(what, sizeof what, "trunk tensor '%s'", tt->rec->name);
        return kvl_engine_read_failed(engine, s, engine->trunk, what);
    }
    st->current = slot;
    /* the other slot held the previous tensor, which the caller no longer uses: fill it with
     * the next streamed tensor so its read overlaps the compute on this one */
    int other = 1 - slot;
    int next = tt->next_streamed;
    if (next != id && !(st->state[other] != SLOT_EMPTY && st->tensor[other] == next)) {
        while (st->state[other] == SLOT_LOADING) kvl_os_cond_wait(&st->cv, &st->mu);
        stream_queue(st, other, next);
    }
    *out = (const uint16_t *)st->buf[slot];
    kvl_os_mutex_unlock(&st->mu);
    return KVL_OK;
}

void kvl_trunk_stream_free(kvl_stream *st)
{
    if (!st) return;
    kvl_os_mutex_lock(&st->mu);
    st->quit = 1;
    kvl_os_cond_broadcast(&st->cv);
    kvl_os_mutex_unlock(&st->mu);
    kvl_os_thread_join(st->thread);
    kvl_os_mutex_destroy(&st->mu);
    kvl_os_cond_destroy(&st->cv);
    kvl_aligned_free(st->buf[0]);
    kvl_aligned_free(st->buf[1]);
    free(st);
}

kvl_status kvl_trunk_stream_create(kvl_engine *e, uint64_t buf_bytes, kvl_stream **out)
{
    kvl_stream *st = (kvl_stream *)calloc(1, sizeof *st);
    if (!st) return KVL_ERR_NOMEM;
    st->engine = e;
    st->buf_bytes = buf_bytes;
    st->buf[0] = kvl_aligned_alloc(KVL_PAGE, (size_t)buf_bytes);
    st->buf[1] = kvl_aligned_alloc(KVL_PAGE, (size_t)buf_bytes);
    if (!st->buf[0] || !st->buf[1]) {
        kvl_aligned_free(st->buf[0]);
        kvl_aligned_free(st->buf[1]);
        free(st);
        return KVL_ERR_NOMEM;
    }
    st->tensor[0] = st->tensor[1] = -1;
    st->pending = -1;
    st->current = -1;
    if (kvl_os_mutex_init(&st->mu) != 0) goto no_mutex;
    if (kvl_os_cond_init(&st->cv) != 0) goto no_cond;
    if (kvl_os_thread_start(&st->thread, stream_thread_main, st) != 0) goto no_thread;
    *out = st;
    return KVL_OK;
no_thread:
    kvl_os_cond_destroy(&st->cv);
no_cond:
    kvl_os_mutex_destroy(&st->mu);
no_mutex:
    kvl_aligned_free(st->buf[0]);
    kvl_aligned_free(st->buf[1]);
    free(st);
    return KVL_ERR_INTERNAL;
}

void *kvl_trunk_stream_scratch(kvl_stream *st) { return st->buf[0]; }

void kvl_trunk_counters_get(const kvl_engine_text *t, uint64_t *bytes_read, uint64_t *verify_ns,
                            uint64_t *verify_bytes)
{
    if (t->stream) kvl_os_mutex_lock(&t->stream->mu); /* the I/O thread adds to these */
    *bytes_read = t->trunk_bytes_read;
    *verify_ns = t->stream_verify_ns;
    *verify_bytes = t->stream_verify_bytes;
    if (t->stream) kvl_os_mutex_unlock(&t->stream->mu);
}

void kvl_trunk_counters_reset(kvl_engine_text *t)
{
    if (t->stream) kvl_os_mutex_lock(&t->stream->mu);
    t->trunk_hits = t->trunk_misses = t->trunk_bytes_read = t->trunk_stall_ns = 0;
    t->stream_verify_ns = t->stream_verify_bytes = 0;
    if (t->stream) kvl_os_mutex_unlock(&t->stream->mu);
}
