/* vision_state.h — the vision tower's state in the engine (vision.c owns it; engine.c opens
 * vision.bin and fills the hyper-parameters at open when load_vision = 1, and reads the counter
 * into kvl_stats). Types only, not part of the public API.
 */
#ifndef KVL_VISION_STATE_H
#define KVL_VISION_STATE_H

#include <stdint.h>

#include "store.h"

/* Vision hyper-parameters, read from the hparam table at open when load_vision = 1. */
typedef struct kvl_vision_hparams {
    int hidden, n_layers, n_heads, intermediate, patch, pos_h, pos_w, merge_h, merge_w;
    int text_hidden;
    float rope_theta, ln_eps;
} kvl_vision_hparams;

typedef struct kvl_vision_state {
    kvl_store *store;          /* vision.bin; NULL unless load_vision */
    kvl_vision_hparams hp;
    uint64_t bytes_read;       /* vision weights read (kvl_stats vision_bytes_read) */
    /* 1: the tower's Linear products in BF16 on AMX tiles (kvl_gemm_bf16_amx): where the table
     * is avx512-bf16, AMX runs (kvl_gemm_amx_available) and act_dtype is not F32 (the exact mode) */
    int bf16;
} kvl_vision_state;

#endif
