/* trunk.h — the trunk streamer (trunk.c): the trunk tensors that are not resident, read on demand
 * into a double buffer by one I/O thread, and kvl_trunk_get, the forward pass's one way to every
 * non-global trunk tensor. For engine.c (sets the streamer up at open, reads its counters) and
 * model.c (reads through it). Not part of the public API. Calls nothing above itself
 * (scripts/c-layers.mjs checks).
 */
#ifndef KVL_TRUNK_H
#define KVL_TRUNK_H

#include "engine_state.h"

/* The streamer of engine e: two 4 KiB-aligned buffers of buf_bytes (at least the largest streamed
 * tensor's align4096(nbytes)) and its I/O thread, which reads the tensors of e->text->tt.
 * KVL_ERR_NOMEM or KVL_ERR_INTERNAL (no thread) on failure, nothing left behind. */
kvl_status kvl_trunk_stream_create(kvl_engine *e, uint64_t buf_bytes, struct kvl_stream **out);
void kvl_trunk_stream_free(struct kvl_stream *st); /* NULL: nothing */
/* Buffer 0 of a streamer no forward pass has used yet: buf_bytes of scratch for checks at open. */
void *kvl_trunk_stream_scratch(struct kvl_stream *st);

/* Trunk tensor tensor_id (layer * KVL_TT_PER_LAYER + KVL_TT_*): its resident copy, or the
 * streamed one, valid until the next call; the next streamed tensor's read is started behind it.
 * A failed read is kvl_engine_fail naming the tensor, a CRC mismatch kvl_engine_corrupt. */
kvl_status kvl_trunk_get(kvl_engine *engine, int tensor_id, const uint16_t **out);

/* The trunk counters the I/O thread adds to (trunk_bytes_read, stream_verify_ns and
 * stream_verify_bytes), read under the streamer's lock; and every trunk counter zeroed. */
void kvl_trunk_counters_get(const kvl_engine_text *t, uint64_t *bytes_read, uint64_t *verify_ns,
                            uint64_t *verify_bytes);
void kvl_trunk_counters_reset(kvl_engine_text *t);

#endif
