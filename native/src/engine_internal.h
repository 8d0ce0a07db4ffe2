/* engine_internal.h — the engine and session structs shared by engine.c, model.c and vision.c.
 * Not part of the public API. engine.c owns their lifetime.
 * (Minimal version from the contracts commit; engine.c's author extends it but keeps these
 * fields, which vision.c relies on.)
 */
#ifndef KVL_ENGINE_INTERNAL_H
#define KVL_ENGINE_INTERNAL_H

#include "kvl.h"
#include "kernels.h"
#include "store.h"
#include "threadpool.h"

/* Vision hyper-parameters, read from the hparam table at open when load_vision = 1. */
typedef struct kvl_vision_hparams {
    int hidden, n_layers, n_heads, intermediate, patch, pos_h, pos_w, merge_h, merge_w;
    int text_hidden;
    float rope_theta, ln_eps;
} kvl_vision_hparams;

struct kvl_engine {
    const kvl_kernels *k;
    kvl_pool *pool;
    kvl_store *trunk, *experts, *vision;   /* vision is NULL unless load_vision */
    kvl_vision_hparams vhp;
    uint64_t vision_bytes_read;
    char last_error[512];
    /* engine.c adds the text hparams, caches and resident tensors below */
    struct kvl_engine_text *text;
};

/* vision.c: set engine->last_error and return status */
kvl_status kvl_engine_fail(kvl_engine *engine, kvl_status status, const char *fmt, ...);

#endif
