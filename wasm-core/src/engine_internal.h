/* engine_internal.h — the engine and session structs, shared by the files of the engine's layers
 * (engine.c, model.c, vision.c, engine_errors.c, trunk.c). Types only: each layer's functions are
 * declared in its own header (engine_errors.h, trunk.h, model.h, vision.h), so a file includes
 * only what lies below it (scripts/c-layers.mjs checks the calls). Not part of the public API.
 * engine.c owns their lifetime and fills them at open; model.c owns the forward pass.
 * The first block of struct kvl_engine (k, pool, trunk, experts, vision, vhp,
 * vision_bytes_read, last_error) is what vision.c relies on; keep it.
 */
#ifndef KVL_ENGINE_INTERNAL_H
#define KVL_ENGINE_INTERNAL_H

#include "kvl_core.h"
#include "kernels.h"
#include "store.h"
#include "threadpool.h"
#include "expert_cache.h"

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
    /* 1: the tower's Linear products in BF16 on AMX tiles (kvl_gemm_bf16_amx): where the table
     * is avx512-bf16, AMX runs (kvl_gemm_amx_available) and act_dtype is not F32 (the exact mode) */
    int vision_bf16;
    char last_error[512];
    /* engine.c adds the text hparams, caches and resident tensors below */
    struct kvl_engine_text *text;
    char *pack_dir;                      /* as opened: the kvl doctor advice of kvl_engine_corrupt */
    /* CRC checks made by the driver thread and its pool (at open, vision weights) */
    uint64_t verify_ns, verify_bytes;
};

/* ---- text decoder (engine.c fills at open, model.c reads) ---------------------------------- */

typedef struct kvl_text_hparams {
    int vocab, hidden, intermediate, moe_intermediate, n_layers, n_heads;
    int n_routed, n_shared, topk, first_dense, moe_freq;
    int kv_lora, nope, rope, v_dim;
    int n_group, topk_group, norm_topk;
    int max_pos;
    float routed_scale, rope_theta, rms_eps, kva_eps;
    int media_token;
} kvl_text_hparams;

/* Non-global trunk tensors, in the order a forward pass uses them within a layer. */
enum {
    KVL_TT_Q = 0, KVL_TT_KVA, KVL_TT_KVB, KVL_TT_O,
    KVL_TT_MLP_GATE, KVL_TT_MLP_UP, KVL_TT_MLP_DOWN,  /* dense MLP or the shared experts */
    KVL_TT_PER_LAYER
};

typedef struct kvl_trunk_tensor {
    const kvl_tensor_rec *rec;   /* in the trunk store */
    uint64_t padded;             /* align4096(nbytes): bytes a read (streaming slot) takes */
    uint64_t slot;               /* bytes a residency slot takes: padded, or with act_i16 and a
                                    Linear weight align4096(align64(nbytes) + 4 * rows) */
    const uint16_t *resident;    /* BF16 data if resident, else NULL (streamed); int16 rows
                                    when scale_i16 is set; the Q8_ROWS record as packed (int8
                                    rows, then f32 scales) when rec->dtype is Q8_ROWS */
    const float *scale_i16;      /* act_i16, resident Linear weight: per-row scales right after
                                    the int16 rows (kvl_quantize_rows_i16); else NULL */
    int next_streamed;           /* id of the next streamed tensor in forward order (wraps) */
} kvl_trunk_tensor;

typedef struct kvl_layer_globals {
    const float *input_ln, *post_ln, *kva_ln;  /* f32 [hidden], [hidden], [kv_lora] */
    const uint16_t *router_w;            /* BF16 [n_routed, hidden]; NULL on dense layers */
    const float *router_bias;            /* f32 [n_routed]; NULL on dense layers */
    int is_moe;
    int mlp_rows;                        /* intermediate (dense) or n_shared*moe_inter; 0 = none */
} kvl_layer_globals;

struct kvl_stream;  /* trunk.c: the double-buffered trunk streamer */

/* The read-ahead tracks its precision for models of at most this many routed experts (Kimi-VL
 * 64, DeepSeek-V3 256); larger ones always read ahead. Halving window: LA_WINDOW guesses. */
#define LA_MAX_EXPERTS 256
#define LA_WINDOW 512

typedef struct kvl_engine_text {
    kvl_text_hparams hp;
    int layer_begin, layer_end;          /* the decoder layers this engine runs */
    kvl_layer_globals *layers;           /* [n_layers]; filled for [layer_begin, layer_end) */
    const float *final_norm;             /* f32 [hidden]; NULL unless layer_end == n_layers */
    const uint16_t *lm_head;             /* BF16 [vocab, hidden]; NULL unless layer_end == n_layers;
                                            int16 rows when lm_head_scale is set */
    const float *lm_head_scale;          /* act_i16: f32 [vocab] row scales; else NULL */
    const float *lm_head_q8_scale;       /* a Q8_ROWS lm_head (--trunk-dtype q8): lm_head holds
                                            int8 [vocab, hidden] rows and these are their f32
                                            scales, inside the same record; else NULL */
    const kvl_tensor_rec *embed;         /* read row-wise from the store, not resident */
    kvl_trunk_tensor *tt;                /* [n_layers * KVL_TT_PER_LAYER]; rec NULL if absent */
    void *global_mem;                    /* one aligned block for every global tensor */
    void *trunk_mem;                     /* one aligned block for resident trunk tensors */
    uint64_t global_bytes, trunk_bytes, workspace_bytes;
    struct kvl_stream *stream;
    kvl_expert_cache *ecache;
    int lookahead;                       /* read the next layer's predicted experts ahead
                                            (model.c predict_next): expert_lookahead AUTO and
                                            a cache smaller than every extent of the range */
    /* the read-ahead's own precision (model.c lookahead_worth_it): the distinct guesses made for
     * layer la_layer (-1: none pending; la_guess[x] = 1 for a guess, models of at most
     * LA_MAX_EXPERTS experts), and of the guesses so far how many the layer then routed to
     * (halved together past LA_WINDOW) */
    int la_layer, la_pending;
    uint32_t la_guessed, la_right;
    uint8_t la_guess[LA_MAX_EXPERTS];
    uint64_t extent_bytes;               /* one routed expert's extent (Q8_EXPERT or Q4_EXPERT),
                                            padded */
    int kv_dtype;                        /* KVL_KV_F32, _BF16 or _I16 (never DEFAULT) */
    int act_bf16;                        /* Linear inputs rounded to BF16 (KVL_ACT_BF16) */
    int act_i16;                         /* Linear inputs quantised to integers (KVL_ACT_I16X1, _I8) */
    int act_i8;                          /* KVL_ACT_I8: act_i16 with the routed experts' inputs
                                            8-bit (matmul_q8_i8, or matmul_q4_i8 for Q4 experts) */
    /* trunk counters (one driver thread at a time, plain integers; trunk_bytes_read and the
     * streamer's CRC checks under the streamer's lock) */
    uint64_t trunk_hits, trunk_misses, trunk_bytes_read, trunk_stall_ns;
    uint64_t stream_verify_ns, stream_verify_bytes;
    uint64_t tokens_prefilled, tokens_decoded;
} kvl_engine_text;

/* Scratch layout of one session; sizes come from kvl_session_layout (model.c). */
/* 64-bit on every target: on wasm32 a large context would wrap size_t (27 layers x 131072
 * tokens of f32 KV is 8.2 GB); kvl_session_new refuses a total above SIZE_MAX. */
typedef struct kvl_session_layout {
    uint64_t off[32];
    uint64_t total;          /* arena bytes */
} kvl_session_layout;

struct kvl_session {
    kvl_engine *engine;
    int max_context, max_batch;
    int position;
    volatile int cancel_flag;  /* set by kvl_session_cancel from another thread */
    const volatile int32_t *cancel_watch; /* kvl_session_watch_cancel: caller-owned, read only */
    void *arena;               /* one aligned block: KV cache + scratch */
    uint64_t arena_bytes;
    /* KV: per layer of the engine's range (layer l at index l - layer_begin) rows [max_context,
     * kv_lora + rope] (c first, then k_rope) in f32 or bf16; with KVL_KV_I16 (model.c kv_i16_*)
     * the rows as int16, one f32 scale per row and the latents transposed in tiles of
     * ATTN_I16_TILE positions [tile][lat][ATTN_I16_TILE] */
    void *kv;
    /* scratch pointers into the arena (model.c) */
    float *x, *xn, *q, *a, *qabs, *chat, *o, *gate, *up, *rlog, *selw, *moe_out, *xg, *yg;
    float *kvt;                /* cached latents transposed [lat][positions] (prefill) */
    float *ones;               /* KVL_KV_I16: lat ones (the latent tiles' row scales) */
    float *thread_scratch;     /* n_threads x per_thread floats */
    size_t per_thread;
    int *seli, *ecount, *elist, *eorder;
    uint16_t *embed_row;
    /* act_i16: the quantised inputs of one pool run (model.c mm_run) and their scales */
    int16_t *xq;
    float *xs;
    /* kvl_session_set_routing (measurement only): KVL_ROUTING_*, the uniform draws' seed, the
     * caller-owned rows [routing_cap][n_layers][topk] (ids, weights; NULL = none) and the row of
     * the running chunk's first token (model.c route_override) */
    int routing_mode;
    uint32_t routing_seed;
    int32_t *routing_ids;
    float *routing_w;
    int routing_cap;
    int routing_row0;
};

#endif
