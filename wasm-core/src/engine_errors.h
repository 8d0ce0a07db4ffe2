/* engine_errors.h — the engine's errors and the checks of pack data read by its driver thread
 * (engine_errors.c), for every file above it: engine.c, model.c, vision.c and trunk.c.
 * Not part of the public API. Calls nothing above itself (scripts/c-layers.mjs checks).
 */
#ifndef KVL_ENGINE_ERRORS_H
#define KVL_ENGINE_ERRORS_H

#include "engine_state.h"

/* Set engine->last_error (printf-style) and return status; engine may be NULL (then only status). */
kvl_status kvl_engine_fail(kvl_engine *engine, kvl_status status, const char *fmt, ...);

/* A read of pack data that failed while the engine runs (a short read because the file shrank,
 * EIO, a disk gone): last_error is one line with the store's own record of the read (the file's
 * path, bytes, offset and the OS's reason), what was being read (`what`, e.g. "expert 2 of
 * layer 3") and what to do (reconnect the disk or put the pack back; kvl doctor). Returns status. */
kvl_status kvl_engine_read_failed(kvl_engine *engine, kvl_status status, kvl_store *store,
                                  const char *what);

/* Checks on first read (docs/FORMAT.md "Checks at run time").
 * kvl_engine_corrupt: the error of data that does not match its CRC-32 — last_error names the
 * file ("trunk.bin", "experts.bin", "vision.bin"), the tensor (with its layer, expert or vision
 * block) and says to run kvl doctor on the pack; returns KVL_ERR_CORRUPT.
 * kvl_engine_check: data just read for rec (its nbytes bytes) against rec->crc32, unless the
 * store has the record marked checked; on the pool's threads (the driver thread's work: open,
 * vision); a match marks the record, a mismatch is kvl_engine_corrupt.
 * kvl_engine_check_through: a tensor the engine never holds whole (the embedding: decoding reads
 * one row per token) read and checked through `bounce`, memory not in use yet (bounce_bytes, a
 * multiple of 4 KiB, 4 KiB-aligned); a failed read is kvl_engine_fail naming file and tensor.
 * The time and bytes checked are added to engine->verify_ns / verify_bytes. */
kvl_status kvl_engine_corrupt(kvl_engine *engine, const char *file, const char *tensor);
kvl_status kvl_engine_check(kvl_engine *engine, kvl_store *store, const char *file,
                            const kvl_tensor_rec *rec, const void *data);
kvl_status kvl_engine_check_through(kvl_engine *engine, kvl_store *store, const char *file,
                                    const kvl_tensor_rec *rec, void *bounce, uint64_t bounce_bytes);

#endif
