/* engine_state.h — struct kvl_engine, engine.c's state: what every layer of the engine reaches
 * through the engine handle (kernels, pool, stores, the last error), with the state each lower
 * file owns embedded by value or by pointer: the text decoder's in model_state.h, the vision
 * tower's in vision_state.h. Types only: each layer's functions are declared in its own header
 * (engine_errors.h, trunk.h, model.h, vision.h), so a file includes only what lies below it
 * (scripts/c-layers.mjs checks the calls). Every file sees the whole struct through this header,
 * so its members may be in any order. Not part of the public API.
 */
#ifndef KVL_ENGINE_STATE_H
#define KVL_ENGINE_STATE_H

#include "kvl_core.h"
#include "kernels/kernels.h"
#include "store.h"
#include "threadpool.h"
#include "model_state.h"
#include "vision_state.h"

struct kvl_engine {
    const kvl_kernels *k;
    kvl_pool *pool;
    kvl_store *trunk, *experts;
    kvl_vision_state vision;             /* vision.store NULL unless load_vision */
    char last_error[512];
    struct kvl_engine_text *text;        /* model_state.h */
    char *pack_dir;                      /* as opened: the kvl doctor advice of kvl_engine_corrupt */
    /* CRC checks made by the driver thread and its pool (at open, vision weights) */
    uint64_t verify_ns, verify_bytes;
};

#endif
