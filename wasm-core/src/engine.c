/* engine.c — the kvl_engine_* and kvl_session_* API of kvl_core.h: the top layer of the core.
 *
 * Owns: opening a pack (stores, PACK_COMPLETE.json, hparams, validation of every tensor the
 * decoder needs, agreement between stores), the resident "global" tensors, the trunk cache
 * (resident non-global trunk tensors in layer order up to a budget; the rest streamed), the
 * expert cache set-up, RAM figures, stats, and session lifetime/argument checks (chunking of
 * prefill). Every trunk tensor read at open (lm_head, norms, routers, the resident trunk, and the
 * embedding, read whole once for the check because decoding reads it a row at a time) is checked
 * against its CRC before it is used or converted (kvl_engine_check).
 * Does not own: the forward math (model.c), vision (vision.c), errors and the CRC checks
 * (engine_errors.c), the trunk streamer (trunk.c), file format parsing (store.c), expert caching
 * policy (expert_cache.c), kernels.
 * Layer: public API, on top: it calls every layer below (model.h, vision.h, trunk.h,
 * engine_errors.h, the caches, store, pool and kernels) and nothing calls it
 * (scripts/c-layers.mjs checks).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_errors.h"
#include "model.h"
#include "platform.h"
#include "trunk.h"
#include "vision.h"

/* Expert-cache reader threads (see load_text); a bench build may set another count. */
#ifndef KVL_EXPERT_READERS
#define KVL_EXPERT_READERS 4
#endif

static uint64_t align4096(uint64_t x) { return (x + 4095u) & ~(uint64_t)4095u; }
static uint64_t align64(uint64_t x) { return (x + 63u) & ~(uint64_t)63u; }
/* A resident Linear weight with act_i16: its int16 rows (the BF16 bytes, converted in place) and
 * then one f32 scale per row, in one 4 KiB-aligned slot (host/planner.ts mirrors this). */
static uint64_t i16_slot_bytes(uint64_t nbytes, uint64_t rows)
{
    return align4096(align64(nbytes) + 4u * rows);
}

/* kvl_quantize_rows_i16 in place over the pool, rows split between the threads (each row is
 * independent, so the result does not depend on the split): the scalar conversion took ~10 ns a
 * weight in WebAssembly, seconds per GB of trunk at open. */
typedef struct i16_convert_job {
    void *data;
    float *scale;
    size_t rows, cols;
} i16_convert_job;

static void i16_convert_rows(void *ctx, int ti, int nt)
{
    const i16_convert_job *j = (const i16_convert_job *)ctx;
    size_t b, e;
    kvl_split_range(j->rows, 1, ti, nt, &b, &e);
    if (b >= e) return;
    char *rows = (char *)j->data + b * j->cols * 2;
    kvl_quantize_rows_i16((int16_t *)(void *)rows, j->scale + b, (const uint16_t *)(void *)rows,
                          e - b, j->cols);
}

static const float *i16_convert(kvl_engine *e, void *data, uint64_t nbytes, size_t rows, size_t cols)
{
    i16_convert_job j;
    j.data = data;
    j.scale = (float *)(void *)((char *)data + align64(nbytes));
    j.rows = rows;
    j.cols = cols;
    kvl_pool_run(e->pool, i16_convert_rows, &j);
    return j.scale;
}

/* ---- version and last error ------------------------------------------------------------------ */

int kvl_abi_version(void) { return KVL_ABI_VERSION; }

const char *kvl_engine_last_error(const kvl_engine *engine)
{
    return engine ? engine->last_error : "no engine";
}

/* ---- open: hparams and validation -------------------------------------------------------------- */

typedef struct open_ctx {
    kvl_engine *e;
    char *err;
    size_t err_len;
} open_ctx;

static kvl_status oerr(open_ctx *c, kvl_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (c->err && c->err_len) vsnprintf(c->err, c->err_len, fmt, ap);
    va_end(ap);
    return st;
}

static const char *dtype_name(uint32_t d)
{
    return d == KVL_DTYPE_BF16 ? "BF16" : d == KVL_DTYPE_F32 ? "F32" : d == KVL_DTYPE_Q8_EXPERT ? "Q8_EXPERT"
           : d == KVL_DTYPE_Q8_ROWS ? "Q8_ROWS" : d == KVL_DTYPE_Q4_EXPERT ? "Q4_EXPERT" : "?";
}

static void shape_text(char *buf, size_t len, uint32_t ndim, const uint64_t *shape)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, len - o, "[");
    for (uint32_t i = 0; i < ndim && i < 4 && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%llu", i ? ", " : "", (unsigned long long)shape[i]);
    if (o < len) snprintf(buf + o, len - o, "]");
}

/* Finds `name` in the store and checks dtype and shape; message names the file and tensor. */
static kvl_status expect(open_ctx *c, kvl_store *store, const char *file, const char *name,
                         uint32_t dtype, uint32_t ndim, uint64_t d0, uint64_t d1,
                         const kvl_tensor_rec **out)
{
    const kvl_tensor_rec *r = kvl_store_find(store, name);
    if (!r)
        return oerr(c, KVL_ERR_CONFIG, "%s: tensor '%s' is missing; the pack does not match its "
                    "config (rerun kvl pack)", file, name);
    uint64_t want[4] = {d0, d1, 0, 0};
    int ok = r->dtype == dtype && r->ndim == ndim;
    for (uint32_t i = 0; ok && i < ndim; i++) ok = r->shape[i] == want[i];
    uint64_t elt = dtype == KVL_DTYPE_F32 ? 4 : 2;
    uint64_t nbytes = (ndim == 1 ? d0 : d0 * d1) * elt;
    if (dtype == KVL_DTYPE_Q8_ROWS) {
        kvl_q8_rows_layout lay;
        kvl_q8_rows_layout_of(d0, d1, &lay);
        nbytes = lay.nbytes;
    }
    if (ok && r->nbytes != nbytes) ok = 0;
    if (!ok) {
        char a[96], b[96];
        shape_text(a, sizeof a, ndim, want);
        shape_text(b, sizeof b, r->ndim, r->shape);
        return oerr(c, KVL_ERR_CONFIG, "%s: tensor '%s' should be %s %s (from the config's "
                    "hparams) but the pack has %s %s with %llu bytes; the pack and its config "
                    "disagree (rerun kvl pack)", file, name, dtype_name(dtype), a,
                    dtype_name(r->dtype), b, (unsigned long long)r->nbytes);
    }
    *out = r;
    return KVL_OK;
}

/* A trunk Linear weight [d0, d1]: BF16 as in the checkpoint, or Q8_ROWS in a pack made with
 * `kvl pack --trunk-dtype q8` (model.c runs it with the Q8 matmul kinds). */
static kvl_status expect_linear(open_ctx *c, const char *name, uint64_t d0, uint64_t d1,
                                const kvl_tensor_rec **out)
{
    const kvl_tensor_rec *r = kvl_store_find(c->e->trunk, name);
    uint32_t dtype = r && r->dtype == KVL_DTYPE_Q8_ROWS ? KVL_DTYPE_Q8_ROWS : KVL_DTYPE_BF16;
    return expect(c, c->e->trunk, "trunk.idx", name, dtype, 2, d0, d1, out);
}

static const char *TEXT_KEYS[] = {
    "text.vocab_size", "text.hidden_size", "text.intermediate_size", "text.moe_intermediate_size",
    "text.num_hidden_layers", "text.num_attention_heads", "text.n_routed_experts",
    "text.n_shared_experts", "text.num_experts_per_tok", "text.first_k_dense_replace",
    "text.moe_layer_freq", "text.kv_lora_rank", "text.q_lora_rank", "text.qk_nope_head_dim",
    "text.qk_rope_head_dim", "text.v_head_dim", "text.routed_scaling_factor", "text.n_group",
    "text.topk_group", "text.norm_topk_prob", "text.rope_theta", "text.rms_norm_eps",
    "text.kv_a_layernorm_eps", "text.max_position_embeddings", "media_placeholder_token_id",
};
#define N_TEXT_KEYS (sizeof TEXT_KEYS / sizeof TEXT_KEYS[0])

static kvl_status read_hparams(open_ctx *c, kvl_text_hparams *hp)
{
    double v[N_TEXT_KEYS];
    for (size_t i = 0; i < N_TEXT_KEYS; i++) {
        int found = 0;
        v[i] = kvl_store_hparam(c->e->trunk, TEXT_KEYS[i], &found);
        if (!found)
            return oerr(c, KVL_ERR_FORMAT, "trunk.idx: hparam '%s' is missing (rerun kvl pack)",
                        TEXT_KEYS[i]);
        if (c->e->experts) {
            int f2 = 0;
            double w = kvl_store_hparam(c->e->experts, TEXT_KEYS[i], &f2);
            if (!f2 || w != v[i])
                return oerr(c, KVL_ERR_CONFIG, "experts.idx and trunk.idx disagree on hparam "
                            "'%s' (%g vs %g): they come from different packs; rerun kvl pack",
                            TEXT_KEYS[i], f2 ? w : -1.0, v[i]);
        }
    }
    /* Hostile packs (test/pack-fuzz.test.ts): converting a NaN, infinite or out-of-range double
     * to int is undefined behaviour, and sums such as nope + rope below are int, so every integer
     * hparam must be a whole number in 0..2^24 (far above any real model's; 16, 19..22 are the
     * real-valued ones). */
    for (size_t i = 0; i < N_TEXT_KEYS; i++) {
        int real_valued = i == 16 || (i >= 19 && i <= 22);
        if (real_valued ? !(v[i] > -1e30 && v[i] < 1e30)
                        : !(v[i] >= 0.0 && v[i] <= 16777216.0 && v[i] == (double)(int64_t)v[i]))
            return oerr(c, KVL_ERR_CONFIG, "trunk.idx: hparam %s = %g is not a valid %s; rerun kvl pack",
                        TEXT_KEYS[i], v[i], real_valued ? "finite number" : "integer in 0..2^24");
    }
    hp->vocab = (int)v[0]; hp->hidden = (int)v[1]; hp->intermediate = (int)v[2];
    hp->moe_intermediate = (int)v[3]; hp->n_layers = (int)v[4]; hp->n_heads = (int)v[5];
    hp->n_routed = (int)v[6]; hp->n_shared = (int)v[7]; hp->topk = (int)v[8];
    hp->first_dense = (int)v[9]; hp->moe_freq = (int)v[10]; hp->kv_lora = (int)v[11];
    int q_lora = (int)v[12];
    hp->nope = (int)v[13]; hp->rope = (int)v[14]; hp->v_dim = (int)v[15];
    hp->routed_scale = (float)v[16]; hp->n_group = (int)v[17]; hp->topk_group = (int)v[18];
    hp->norm_topk = v[19] != 0.0; hp->rope_theta = (float)v[20]; hp->rms_eps = (float)v[21];
    hp->kva_eps = (float)v[22]; hp->max_pos = (int)v[23]; hp->media_token = (int)v[24];
    const char *bad = NULL;
    if (hp->vocab <= 0) bad = "text.vocab_size";
    else if (hp->hidden <= 0) bad = "text.hidden_size";
    else if (hp->n_layers <= 0) bad = "text.num_hidden_layers";
    else if (hp->n_heads <= 0) bad = "text.num_attention_heads";
    else if (hp->kv_lora <= 0) bad = "text.kv_lora_rank";
    else if (hp->nope <= 0) bad = "text.qk_nope_head_dim";
    else if (hp->rope <= 0 || hp->rope % 2) bad = "text.qk_rope_head_dim (must be even)";
    else if (hp->v_dim <= 0) bad = "text.v_head_dim";
    else if (q_lora != 0) bad = "text.q_lora_rank (only null is supported)";
    else if (hp->max_pos <= 0) bad = "text.max_position_embeddings";
    else if (hp->moe_freq <= 0) bad = "text.moe_layer_freq";
    else if (hp->n_routed < 0 || hp->n_shared < 0 || hp->moe_intermediate < 0) bad = "text.n_routed_experts";
    else if (hp->n_routed > 0 && (hp->topk <= 0 || hp->topk > hp->n_routed)) bad = "text.num_experts_per_tok";
    else if (hp->n_routed > 0 && (hp->n_group <= 0 || hp->n_routed % hp->n_group)) bad = "text.n_group";
    else if (hp->n_routed > 0 && (hp->topk_group <= 0 || hp->topk_group > hp->n_group)) bad = "text.topk_group";
    else if (!(hp->rope_theta > 0)) bad = "text.rope_theta";
    if (bad)
        return oerr(c, KVL_ERR_CONFIG, "trunk.idx: hparam %s has an unsupported value", bad);
    return KVL_OK;
}

static int layer_is_moe(const kvl_text_hparams *hp, int l)
{
    return hp->n_routed > 0 && l >= hp->first_dense && l % hp->moe_freq == 0;
}

/* Is layer l one of this engine's (its range [layer_begin, layer_end))? */
static int in_range(const kvl_engine_text *t, int l)
{
    return l >= t->layer_begin && l < t->layer_end;
}

/* The small per-layer trunk tensors that live in the global block (router ones on MoE layers). */
enum { SMALL_INPUT_LN, SMALL_POST_LN, SMALL_KVA_LN, SMALL_ROUTER_W, SMALL_ROUTER_BIAS, SMALL_PER_LAYER };

/* What validating the text decoder's tensors finds, for the loads after it. */
typedef struct text_plan {
    const kvl_tensor_rec *final_norm, *lm_head;
    const kvl_tensor_rec **small;  /* [n_layers * SMALL_PER_LAYER]; router ones NULL on dense layers */
    int n_moe;                     /* MoE layers in the engine's range */
    int has_head;                  /* the last range: lm_head and the final norm are resident */
    int head_i16;                  /* act_i16 and a BF16 lm_head: int16 rows, then V row scales */
    uint64_t head_slot;            /* bytes lm_head takes in the global block */
    uint64_t global_bytes;         /* the whole global block */
} text_plan;

/* ---- open: validation of every tensor the decoder needs, and the global block's size ---------- */

/* The embedding, the final norm and lm_head; what this engine's layer range keeps resident is
 * lm_head and the final norm on the last range (and, per layer, its own layers' norms and
 * routers: expect_layer); every tensor is validated whatever the range. */
static kvl_status expect_head(open_ctx *c, text_plan *pl)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    const uint64_t H = (uint64_t)hp->hidden, V = (uint64_t)hp->vocab;
    kvl_status st;
    if ((st = expect(c, e->trunk, "trunk.idx", "language_model.model.embed_tokens.weight",
                     KVL_DTYPE_BF16, 2, V, H, &t->embed)) != KVL_OK) return st;
    if ((st = expect(c, e->trunk, "trunk.idx", "language_model.model.norm.weight",
                     KVL_DTYPE_BF16, 1, H, 0, &pl->final_norm)) != KVL_OK) return st;
    if ((st = expect_linear(c, "language_model.lm_head.weight", V, H, &pl->lm_head)) != KVL_OK)
        return st;
    pl->has_head = t->layer_end == hp->n_layers;
    /* act_i16: lm_head as int16 rows with its V row scales after them (i16_slot_bytes) */
    pl->head_i16 = t->act_i16 && pl->lm_head->dtype == KVL_DTYPE_BF16;
    pl->head_slot = pl->head_i16 ? i16_slot_bytes(pl->lm_head->nbytes, V) : align4096(pl->lm_head->nbytes);
    pl->global_bytes = pl->has_head ? pl->head_slot + align64(H * 4) : 0;
    return KVL_OK;
}

/* Layer l's trunk tensors: norms, attention, the router on MoE layers, the dense MLP or the
 * shared experts; records them (t->tt, pl->small) and counts the global block bytes of the
 * engine's own layers. */
static kvl_status expect_layer(open_ctx *c, int l, text_plan *pl)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    const uint64_t H = (uint64_t)hp->hidden, nh = (uint64_t)hp->n_heads;
    const uint64_t kvl = (uint64_t)hp->kv_lora, rope = (uint64_t)hp->rope;
    const uint64_t E = (uint64_t)hp->n_routed;
    kvl_layer_globals *lg = &t->layers[l];
    kvl_trunk_tensor *tt = &t->tt[l * KVL_TT_PER_LAYER];
    const kvl_tensor_rec **small = &pl->small[l * SMALL_PER_LAYER];
    const char *pre = "language_model.model.layers";
    char name[160];
    kvl_status st;
    lg->is_moe = layer_is_moe(hp, l);
    pl->n_moe += lg->is_moe && in_range(t, l);
#define EXPECT(suffix, dt, nd, a, b, dst)                                                          \
    do {                                                                                          \
        snprintf(name, sizeof name, "%s.%d.%s", pre, l, suffix);                                  \
        if ((st = expect(c, e->trunk, "trunk.idx", name, dt, nd, a, b, dst)) != KVL_OK) return st; \
    } while (0)
#define EXPECT_LINEAR(suffix, a, b, dst) /* BF16 or Q8_ROWS (expect_linear) */                     \
    do {                                                                                          \
        snprintf(name, sizeof name, "%s.%d.%s", pre, l, suffix);                                  \
        if ((st = expect_linear(c, name, a, b, dst)) != KVL_OK) return st;                        \
    } while (0)
    EXPECT("input_layernorm.weight", KVL_DTYPE_BF16, 1, H, 0, &small[SMALL_INPUT_LN]);
    EXPECT("post_attention_layernorm.weight", KVL_DTYPE_BF16, 1, H, 0, &small[SMALL_POST_LN]);
    EXPECT("self_attn.kv_a_layernorm.weight", KVL_DTYPE_BF16, 1, kvl, 0, &small[SMALL_KVA_LN]);
    EXPECT_LINEAR("self_attn.q_proj.weight", nh * (uint64_t)(hp->nope + hp->rope), H,
                  &tt[KVL_TT_Q].rec);
    EXPECT_LINEAR("self_attn.kv_a_proj_with_mqa.weight", kvl + rope, H, &tt[KVL_TT_KVA].rec);
    EXPECT_LINEAR("self_attn.kv_b_proj.weight", nh * (uint64_t)(hp->nope + hp->v_dim), kvl,
                  &tt[KVL_TT_KVB].rec);
    EXPECT_LINEAR("self_attn.o_proj.weight", H, nh * (uint64_t)hp->v_dim, &tt[KVL_TT_O].rec);
    if (in_range(t, l)) pl->global_bytes += 2 * align64(H * 4) + align64(kvl * 4);
    const char *mlp = lg->is_moe ? "mlp.shared_experts" : "mlp";
    uint64_t rows = lg->is_moe ? (uint64_t)hp->n_shared * (uint64_t)hp->moe_intermediate
                               : (uint64_t)hp->intermediate;
    /* a dense layer without MLP rows would leave its MLP tensors unvalidated and NULL (a
     * crash at the first token; found by fuzzing packs, test/pack-fuzz.test.ts) */
    if (!lg->is_moe && rows == 0)
        return oerr(c, KVL_ERR_CONFIG, "trunk.idx: layer %d is dense but hparam "
                    "text.intermediate_size is 0; rerun kvl pack", l);
    if (lg->is_moe) {
        EXPECT("mlp.gate.weight", KVL_DTYPE_BF16, 2, E, H, &small[SMALL_ROUTER_W]);
        EXPECT("mlp.gate.e_score_correction_bias", KVL_DTYPE_F32, 1, E, 0, &small[SMALL_ROUTER_BIAS]);
        if (in_range(t, l)) pl->global_bytes += align4096(small[SMALL_ROUTER_W]->nbytes) + align64(E * 4);
    }
    if (rows > 0) {
        char sfx[96];
        lg->mlp_rows = (int)rows;
        snprintf(sfx, sizeof sfx, "%s.gate_proj.weight", mlp);
        EXPECT_LINEAR(sfx, rows, H, &tt[KVL_TT_MLP_GATE].rec);
        snprintf(sfx, sizeof sfx, "%s.up_proj.weight", mlp);
        EXPECT_LINEAR(sfx, rows, H, &tt[KVL_TT_MLP_UP].rec);
        snprintf(sfx, sizeof sfx, "%s.down_proj.weight", mlp);
        EXPECT_LINEAR(sfx, H, rows, &tt[KVL_TT_MLP_DOWN].rec);
    }
#undef EXPECT
#undef EXPECT_LINEAR
    return KVL_OK;
}

/* The routed experts: one extent per (MoE layer, expert), all Q8_EXPERT or all Q4_EXPERT (`kvl
 * pack --expert-dtype`), of the size docs/FORMAT.md gives for that dtype; sets t->extent_bytes.
 * The first MoE layer's expert 0 says which dtype the pack holds. Nothing to do without MoE layers
 * in the range. */
static kvl_status expect_experts(open_ctx *c, const text_plan *pl)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    if (pl->n_moe == 0) return KVL_OK;
    const uint64_t H = (uint64_t)hp->hidden, E = (uint64_t)hp->n_routed;
    const uint64_t I = (uint64_t)hp->moe_intermediate;
    kvl_q8_layout l8;
    kvl_q4_layout l4;
    kvl_q8_layout_of(I, H, &l8);
    kvl_q4_layout_of(I, H, &l4); /* nbytes 0 unless I and H are multiples of 32 */
    uint32_t dtype = 0;
    uint64_t nbytes = 0;
    char name[160], first[160] = "";
    for (int l = 0; l < hp->n_layers; l++) {
        if (!t->layers[l].is_moe) continue;
        for (uint64_t x = 0; x < E; x++) {
            snprintf(name, sizeof name, "language_model.model.layers.%d.mlp.experts.%llu", l,
                     (unsigned long long)x);
            const kvl_tensor_rec *r = kvl_store_find(e->experts, name);
            if (!r)
                return oerr(c, KVL_ERR_CONFIG, "experts.idx: expert extent '%s' is missing; the "
                            "pack does not match its config (rerun kvl pack)", name);
            if (dtype == 0) {
                dtype = r->dtype == KVL_DTYPE_Q4_EXPERT ? KVL_DTYPE_Q4_EXPERT : KVL_DTYPE_Q8_EXPERT;
                nbytes = dtype == KVL_DTYPE_Q4_EXPERT ? l4.nbytes : l8.nbytes;
                snprintf(first, sizeof first, "%s", name);
                if (dtype == KVL_DTYPE_Q4_EXPERT && nbytes == 0) /* the store checked the record's
                                                                   own shape; these are the hparams */
                    return oerr(c, KVL_ERR_CONFIG, "experts.idx: Q4 experts need hidden_size (%llu) "
                                "and moe_intermediate_size (%llu) to be multiples of 32, but the "
                                "pack's hparams say otherwise; the pack and its config disagree "
                                "(rerun kvl pack)", (unsigned long long)H, (unsigned long long)I);
            } else if ((r->dtype == KVL_DTYPE_Q8_EXPERT || r->dtype == KVL_DTYPE_Q4_EXPERT) &&
                       r->dtype != dtype) {
                return oerr(c, KVL_ERR_CONFIG, "experts.idx: extent '%s' is %s but '%s' is %s; a "
                            "pack's routed experts are all Q8 or all Q4 (rerun kvl pack)", name,
                            dtype_name(r->dtype), first, dtype_name(dtype));
            }
            if (r->dtype != dtype || r->ndim != 4 || r->shape[0] != (uint64_t)l ||
                r->shape[1] != x || r->shape[2] != I ||
                r->shape[3] != H || r->nbytes != nbytes) {
                char want[96], got[96];
                uint64_t ws[4] = {(uint64_t)l, x, I, H};
                shape_text(want, sizeof want, 4, ws);
                shape_text(got, sizeof got, r->ndim, r->shape);
                return oerr(c, KVL_ERR_CONFIG, "experts.idx: extent '%s' should be %s "
                            "%s with %llu bytes (from the config's hparams) but the pack has %s "
                            "%s with %llu bytes; the pack and its config disagree (rerun kvl "
                            "pack)", name, dtype_name(dtype), want, (unsigned long long)nbytes,
                            dtype_name(r->dtype), got, (unsigned long long)r->nbytes);
            }
        }
    }
    t->extent_bytes = align4096(nbytes);
    return KVL_OK;
}

/* Every tensor the decoder needs, validated against the hparams whatever the layer range. */
static kvl_status expect_text(open_ctx *c, text_plan *pl)
{
    const int n_layers = c->e->text->hp.n_layers;
    kvl_status st = expect_head(c, pl);
    if (st != KVL_OK) return st;
    pl->small = (const kvl_tensor_rec **)calloc((size_t)n_layers * SMALL_PER_LAYER, sizeof *pl->small);
    if (!pl->small) return oerr(c, KVL_ERR_NOMEM, "out of memory opening the pack");
    for (int l = 0; l < n_layers; l++)
        if ((st = expect_layer(c, l, pl)) != KVL_OK) return st;
    return expect_experts(c, pl);
}

/* ---- open: reads of resident trunk data -------------------------------------------------------- */

/* Trunk tensor rec read into dst and checked against its CRC, before anything uses or converts
 * it; small: dst need not be 4 KiB-aligned (kvl_store_read_small). */
static kvl_status read_checked(open_ctx *c, const kvl_tensor_rec *rec, void *dst, int small)
{
    kvl_engine *e = c->e;
    kvl_status st = small ? kvl_store_read_small(e->trunk, rec->offset, rec->nbytes, dst)
                          : kvl_store_read(e->trunk, rec->offset, rec->nbytes, dst);
    if (st != KVL_OK) return oerr(c, st, "trunk.bin: reading '%s' failed", rec->name);
    if ((st = kvl_engine_check(e, e->trunk, "trunk.bin", rec, dst)) != KVL_OK)
        return oerr(c, st, "%s", e->last_error);
    return KVL_OK;
}

/* A BF16 tensor as is at *at (4 KiB-aligned), which then moves past align4096(nbytes). */
static kvl_status read_paged(open_ctx *c, const kvl_tensor_rec *rec, char **at, const uint16_t **dst)
{
    kvl_status st = read_checked(c, rec, *at, 0);
    if (st != KVL_OK) return st;
    *dst = (const uint16_t *)(void *)*at;
    *at += align4096(rec->nbytes);
    return KVL_OK;
}

/* A BF16 vector of count values through tmp, widened to f32 at *at (exact), which then moves
 * past align64(4 count). */
static kvl_status read_widened(open_ctx *c, const kvl_tensor_rec *rec, uint16_t *tmp,
                               uint64_t count, char **at, const float **dst)
{
    kvl_status st = read_checked(c, rec, tmp, 1);
    if (st != KVL_OK) return st;
    c->e->k->bf16_to_f32((float *)(void *)*at, tmp, (size_t)count);
    *dst = (const float *)(void *)*at;
    *at += align64(count * 4);
    return KVL_OK;
}

/* The global block's contents, in the order load_globals gives; tmp holds one norm's BF16. */
static kvl_status read_globals(open_ctx *c, const text_plan *pl, uint16_t *tmp)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    const uint64_t H = (uint64_t)hp->hidden, V = (uint64_t)hp->vocab;
    const uint64_t kvl = (uint64_t)hp->kv_lora, E = (uint64_t)hp->n_routed;
    char *p = (char *)t->global_mem;
    kvl_status st;
    if (pl->has_head) {
        char *head = p;
        if ((st = read_paged(c, pl->lm_head, &p, &t->lm_head)) != KVL_OK) return st;
        p = head + pl->head_slot;
        if (pl->head_i16) /* in place: each row is read before it is overwritten (kernels.h) */
            t->lm_head_scale = i16_convert(e, head, pl->lm_head->nbytes, (size_t)V, (size_t)H);
        if (pl->lm_head->dtype == KVL_DTYPE_Q8_ROWS) { /* int8 rows, then their scales */
            kvl_q8_rows_layout lay;
            kvl_q8_rows_layout_of(V, H, &lay);
            t->lm_head_q8_scale = (const float *)(void *)(head + lay.scale);
        }
    }
    for (int l = t->layer_begin; l < t->layer_end; l++)
        if (t->layers[l].is_moe &&
            (st = read_paged(c, pl->small[l * SMALL_PER_LAYER + SMALL_ROUTER_W], &p,
                             &t->layers[l].router_w)) != KVL_OK)
            return st;
    for (int l = t->layer_begin; l < t->layer_end; l++) {
        kvl_layer_globals *lg = &t->layers[l];
        const kvl_tensor_rec **small = &pl->small[l * SMALL_PER_LAYER];
        if ((st = read_widened(c, small[SMALL_INPUT_LN], tmp, H, &p, &lg->input_ln)) != KVL_OK ||
            (st = read_widened(c, small[SMALL_POST_LN], tmp, H, &p, &lg->post_ln)) != KVL_OK ||
            (st = read_widened(c, small[SMALL_KVA_LN], tmp, kvl, &p, &lg->kva_ln)) != KVL_OK)
            return st;
        if (lg->is_moe) {
            if ((st = read_checked(c, small[SMALL_ROUTER_BIAS], p, 1)) != KVL_OK) return st;
            lg->router_bias = (const float *)(void *)p;
            p += align64(E * 4);
        }
    }
    if (pl->has_head) return read_widened(c, pl->final_norm, tmp, H, &p, &t->final_norm);
    return KVL_OK;
}

/* The globals, for the planner: one block laid out as lm_head (BF16, align4096(nbytes); with
 * act_i16 int16 rows then V f32 scales, align4096(align64(nbytes) + 4 V)), then every MoE
 * layer's router weight (BF16, align4096(nbytes)), then per layer the input/post-attention/kv_a
 * norms widened to f32 (align64 each) and, on MoE layers, the f32 router bias (align64), then
 * the final norm in f32 (align64). BF16 -> f32 is exact. Every tensor is checked against its CRC
 * as read, before it is used or converted. */
static kvl_status load_globals(open_ctx *c, const text_plan *pl)
{
    kvl_engine_text *t = c->e->text;
    const uint64_t gbytes = pl->global_bytes;
    const uint64_t H = (uint64_t)t->hp.hidden, kvl = (uint64_t)t->hp.kv_lora;
    /* gbytes > SIZE_MAX (a wasm32 build) must fail, not wrap to a small block */
    t->global_mem = gbytes <= (uint64_t)SIZE_MAX ? kvl_large_alloc((size_t)gbytes) : NULL;
    if (!t->global_mem)
        return oerr(c, KVL_ERR_NOMEM, "cannot allocate %llu bytes for the resident lm_head and norms",
                    (unsigned long long)gbytes);
    t->global_bytes = gbytes;
    uint16_t *tmp = (uint16_t *)malloc((size_t)(H > kvl ? H : kvl) * 2 + 64);
    if (!tmp) return oerr(c, KVL_ERR_NOMEM, "out of memory opening the pack");
    kvl_status st = read_globals(c, pl, tmp);
    free(tmp);
    return st;
}

/* ---- open: the trunk cache, for the planner ---------------------------------------------------
 * Walk the non-global trunk tensors in forward order (layer 0..L-1; within a layer q_proj,
 * kv_a_proj_with_mqa, kv_b_proj, o_proj, then the dense mlp or shared_experts gate_proj, up_proj,
 * down_proj) and keep each resident while the running sum of align4096(nbytes) (act_i16:
 * i16_slot_bytes for every tensor but kv_b_proj) stays <= budget; the first tensor that does not
 * fit and everything after it are streamed (a prefix, so the layers used first stay hot).
 * trunk_cache_bytes: -1 -> budget 0, 0 -> everything, >0 -> that budget. Streaming takes a
 * double buffer of 2 x the largest streamed tensor's align4096(nbytes) (engine_workspace). */

/* Each of the engine's trunk tensors' padded and slot sizes (tensors of layers outside the range
 * are not this engine's: their records are forgotten); returns the sum of the slots. */
static uint64_t size_trunk_slots(kvl_engine_text *t)
{
    const int n_tt = t->hp.n_layers * KVL_TT_PER_LAYER;
    uint64_t all = 0;
    for (int i = 0; i < n_tt; i++)
        if (!in_range(t, i / KVL_TT_PER_LAYER)) t->tt[i].rec = NULL;
    for (int i = 0; i < n_tt; i++)
        if (t->tt[i].rec) {
            kvl_trunk_tensor *tt = &t->tt[i];
            tt->padded = align4096(tt->rec->nbytes);
            /* act_i16 converts every resident BF16 Linear weight but kv_b_proj, which the
             * attention uses in FP32 (absorbed into the queries, and W_uv) */
            tt->slot = t->act_i16 && i % KVL_TT_PER_LAYER != KVL_TT_KVB &&
                               tt->rec->dtype == KVL_DTYPE_BF16
                           ? i16_slot_bytes(tt->rec->nbytes, tt->rec->shape[0])
                           : tt->padded;
            all += tt->slot;
        }
    return all;
}

/* The first tensor streamed (n_layers * KVL_TT_PER_LAYER: none) when the resident prefix may
 * take budget bytes; *used = the prefix's bytes. */
static int trunk_resident_prefix(const kvl_engine_text *t, uint64_t budget, uint64_t *used)
{
    const int n_tt = t->hp.n_layers * KVL_TT_PER_LAYER;
    *used = 0;
    for (int i = 0; i < n_tt; i++) {
        if (!t->tt[i].rec) continue;
        if (*used + t->tt[i].slot > budget) return i;
        *used += t->tt[i].slot;
    }
    return n_tt;
}

/* The first range reads embedding rows, so the whole tensor is checked at open, through bounce
 * (memory not in use yet: the trunk cache before it is filled, else a streaming buffer). */
static kvl_status check_embedding(open_ctx *c, void *bounce, uint64_t bounce_bytes)
{
    kvl_engine *e = c->e;
    kvl_status st = kvl_engine_check_through(e, e->trunk, "trunk.bin", e->text->embed, bounce,
                                             bounce_bytes);
    return st != KVL_OK ? oerr(c, st, "%s", e->last_error) : KVL_OK;
}

/* The resident prefix read into the trunk cache (int16 rows in place where act_i16 says). */
static kvl_status read_resident_trunk(open_ctx *c, int first_streamed)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    char *p = (char *)t->trunk_mem;
    kvl_status st;
    for (int i = 0; i < first_streamed; i++) {
        kvl_trunk_tensor *tt = &t->tt[i];
        if (!tt->rec) continue;
        if ((st = read_checked(c, tt->rec, p, 0)) != KVL_OK) return st;
        tt->resident = (const uint16_t *)p;
        if (tt->slot != tt->padded) /* int16 rows in place, scales after them */
            tt->scale_i16 = i16_convert(e, p, tt->rec->nbytes, (size_t)tt->rec->shape[0],
                                        (size_t)tt->rec->shape[1]);
        p += tt->slot;
    }
    return KVL_OK;
}

/* The streamed rest chained in forward order (next_streamed, wrapping) and the streamer for it,
 * if any; *max_streamed = the largest streamed tensor's padded size (0: none). */
static kvl_status start_streamer(open_ctx *c, int first_streamed, uint64_t *max_streamed)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    const int n_tt = t->hp.n_layers * KVL_TT_PER_LAYER;
    int first = -1, prev = -1;
    *max_streamed = 0;
    for (int i = first_streamed; i < n_tt; i++) {
        kvl_trunk_tensor *tt = &t->tt[i];
        if (!tt->rec) continue;
        if (tt->padded > *max_streamed) *max_streamed = tt->padded;
        if (first < 0) first = i;
        if (prev >= 0) t->tt[prev].next_streamed = i;
        prev = i;
    }
    if (prev < 0) return KVL_OK;
    t->tt[prev].next_streamed = first;
    kvl_status st = kvl_trunk_stream_create(e, *max_streamed, &t->stream);
    if (st != KVL_OK)
        return oerr(c, st, "cannot allocate the trunk streaming buffers (2 x %llu bytes)",
                    (unsigned long long)*max_streamed);
    t->workspace_bytes = 2 * *max_streamed;
    return KVL_OK;
}

static kvl_status load_trunk_cache(open_ctx *c, const kvl_engine_options *o)
{
    kvl_engine_text *t = c->e->text;
    const uint64_t all = size_trunk_slots(t);
    const uint64_t budget = o->trunk_cache_bytes < 0 ? 0
                            : o->trunk_cache_bytes == 0 ? all : (uint64_t)o->trunk_cache_bytes;
    uint64_t used, max_streamed;
    const int first_streamed = trunk_resident_prefix(t, budget, &used);
    kvl_status st;
    if (used > 0) {
        t->trunk_mem = used <= (uint64_t)SIZE_MAX ? kvl_large_alloc((size_t)used) : NULL;
        if (!t->trunk_mem)
            return oerr(c, KVL_ERR_NOMEM, "cannot allocate the %llu-byte trunk cache; lower "
                        "trunk_cache_bytes", (unsigned long long)used);
    }
    t->trunk_bytes = used;
    const uint64_t bounce_max = (uint64_t)64 << 20;
    if (t->layer_begin == 0 && used > 0 &&
        (st = check_embedding(c, t->trunk_mem, used < bounce_max ? used : bounce_max)) != KVL_OK)
        return st;
    if ((st = read_resident_trunk(c, first_streamed)) != KVL_OK) return st;
    if ((st = start_streamer(c, first_streamed, &max_streamed)) != KVL_OK) return st;
    if (t->layer_begin == 0 && used == 0 && t->stream)
        return check_embedding(c, kvl_trunk_stream_scratch(t->stream), max_streamed);
    return KVL_OK;
}

/* ---- open: the expert cache -------------------------------------------------------------------- */

static kvl_status open_expert_cache(open_ctx *c, const kvl_engine_options *o, int n_moe)
{
    kvl_engine *e = c->e;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    if (n_moe == 0) return KVL_OK;
    uint64_t min_bytes = (uint64_t)hp->topk * t->extent_bytes;
    uint64_t budget = o->expert_cache_bytes ? o->expert_cache_bytes : 512ull << 20;
    if (budget < min_bytes)
        return oerr(c, KVL_ERR_INVALID_ARG, "expert_cache_bytes = %llu is below one layer's "
                    "top-%d expert extents (%d x %llu = %llu bytes); raise it",
                    (unsigned long long)budget, hp->topk, hp->topk,
                    (unsigned long long)t->extent_bytes, (unsigned long long)min_bytes);
    uint64_t all = (uint64_t)n_moe * (uint64_t)hp->n_routed * t->extent_bytes;
    if (budget > all) budget = all; /* never allocate more than every extent */
    /* with every extent of the range resident after its first read, predicting is pointless;
     * the prediction's top-k weights go to the session's yg scratch (hidden floats per token) */
    t->lookahead = o->expert_lookahead == KVL_LOOKAHEAD_AUTO && budget / t->extent_bytes <
                   (uint64_t)n_moe * (uint64_t)hp->n_routed && hp->topk <= hp->hidden;
    t->la_layer = -1;
    t->cache_policy = o->expert_cache_policy;
    char cerr[256] = "";
    /* readers share each extent's ~2 MiB pieces: 4 keeps a disk queue busy (measured: a
     * virtio disk gave ~270 MB/s with one 8 MiB read in flight, ~1.6-2 GB/s with four 2 MiB
     * reads); they sleep when idle and do no math, so they do not compete with the pool */
    kvl_status st = kvl_expert_cache_create(e->experts, hp->n_layers, hp->n_routed, budget, hp->topk,
                                            KVL_EXPERT_READERS, o->expert_cache_policy, &t->ecache, cerr,
                                            sizeof cerr);
    if (st != KVL_OK) return oerr(c, st, "experts.bin: %s", cerr);
    return KVL_OK;
}

/* ---- open: the text decoder -------------------------------------------------------------------- */

/* Everything the text decoder of the engine's layer range needs, after read_hparams: every
 * tensor validated, the global block and the trunk cache read (and checked), the streamer and
 * the expert cache set up. */
static kvl_status load_text(open_ctx *c, const kvl_engine_options *o)
{
    kvl_engine_text *t = c->e->text;
    text_plan pl;
    memset(&pl, 0, sizeof pl);
    t->layers = (kvl_layer_globals *)calloc((size_t)t->hp.n_layers, sizeof *t->layers);
    t->tt = (kvl_trunk_tensor *)calloc((size_t)t->hp.n_layers * KVL_TT_PER_LAYER, sizeof *t->tt);
    if (!t->layers || !t->tt) return oerr(c, KVL_ERR_NOMEM, "out of memory opening the pack");
    kvl_status st = expect_text(c, &pl);
    if (st == KVL_OK) st = load_globals(c, &pl);
    free(pl.small); /* only validation and the global block use these records */
    if (st == KVL_OK) st = load_trunk_cache(c, o);
    if (st == KVL_OK) st = open_expert_cache(c, o, pl.n_moe);
    return st;
}

static kvl_status file_exists(const char *path)
{
    kvl_os_file f = KVL_OS_FILE_INVALID;
    if (kvl_os_open_read(path, 0, &f) != 0) return KVL_ERR_IO;
    kvl_os_close(f);
    return KVL_OK;
}

static void join_path(char *out, size_t len, const char *dir, const char *file)
{
    size_t n = strlen(dir);
    int sep = n > 0 && (dir[n - 1] == '/' || dir[n - 1] == '\\');
    snprintf(out, len, "%s%s%s", dir, sep ? "" : "/", file);
}

static kvl_status open_store(open_ctx *c, const char *dir, const char *stem, uint32_t kind,
                             int io_mode, kvl_store **out)
{
    char idx[4096], bin[4096], serr[384] = "";
    char f1[64], f2[64];
    snprintf(f1, sizeof f1, "%s.idx", stem);
    snprintf(f2, sizeof f2, "%s.bin", stem);
    join_path(idx, sizeof idx, dir, f1);
    join_path(bin, sizeof bin, dir, f2);
    kvl_status st = kvl_store_open(idx, bin, kind, io_mode, out, serr, sizeof serr);
    if (st != KVL_OK) {
        /* store.c names the file; add the pack directory only if it did not */
        if (strstr(serr, f1) || strstr(serr, f2))
            return oerr(c, st, "%s", serr);
        return oerr(c, st, "%s: %s", f1, serr[0] ? serr : kvl_strerror(st));
    }
    return KVL_OK;
}

static kvl_status check_config_agrees(open_ctx *c, kvl_store *other, const char *file)
{
    size_t a_len = 0, b_len = 0;
    const char *a = kvl_store_config_json(c->e->trunk, &a_len);
    const char *b = kvl_store_config_json(other, &b_len);
    if (a_len != b_len || (a_len && memcmp(a, b, a_len) != 0))
        return oerr(c, KVL_ERR_CONFIG, "%s and trunk.idx carry different config.json texts: they "
                    "come from different packs; rerun kvl pack", file);
    return KVL_OK;
}

static int vparam(kvl_store *s, const char *key, double *v)
{
    int found = 0;
    *v = kvl_store_hparam(s, key, &found);
    return found;
}

/* The vision store (load_vision = 1): its config and hparams agreeing with the trunk's, the
 * hparams valid, and every vision tensor validated (kvl_vision_check), so a bad vision pack is
 * refused now rather than at the first image. After read_hparams (text_hidden). */
static kvl_status load_vision(open_ctx *c, const char *pack_dir, int io_mode)
{
    kvl_engine *e = c->e;
    kvl_status st;
    if ((st = open_store(c, pack_dir, "vision", 3, io_mode, &e->vision.store)) != KVL_OK) return st;
    if ((st = check_config_agrees(c, e->vision.store, "vision.idx")) != KVL_OK) return st;
    static const char *VK[] = {"vision.hidden_size", "vision.num_hidden_layers",
                               "vision.num_attention_heads", "vision.intermediate_size",
                               "vision.patch_size", "vision.init_pos_emb_height",
                               "vision.init_pos_emb_width", "vision.merge_kernel_h",
                               "vision.merge_kernel_w", "vision.rope_theta",
                               "vision.layer_norm_eps"};
    double v[11];
    for (int i = 0; i < 11; i++) {
        double w;
        if (!vparam(e->vision.store, VK[i], &v[i]) || !vparam(e->trunk, VK[i], &w) || w != v[i])
            return oerr(c, KVL_ERR_CONFIG, "vision.idx: hparam '%s' is missing or disagrees with "
                        "trunk.idx; rerun kvl pack", VK[i]);
    }
    /* as for the text hparams: no double-to-int conversion of NaN / out-of-range values */
    for (int i = 0; i < 9; i++) {
        if (!(v[i] >= 0.0 && v[i] <= 16777216.0))
            return oerr(c, KVL_ERR_CONFIG, "vision.idx: hparam '%s' = %g is out of range; rerun "
                        "kvl pack", VK[i], v[i]);
    }
    kvl_vision_hparams *vh = &e->vision.hp;
    vh->hidden = (int)v[0]; vh->n_layers = (int)v[1]; vh->n_heads = (int)v[2];
    vh->intermediate = (int)v[3]; vh->patch = (int)v[4]; vh->pos_h = (int)v[5];
    vh->pos_w = (int)v[6]; vh->merge_h = (int)v[7]; vh->merge_w = (int)v[8];
    vh->rope_theta = (float)v[9]; vh->ln_eps = (float)v[10];
    vh->text_hidden = e->text->hp.hidden;
    if (vh->hidden <= 0 || vh->n_layers <= 0 || vh->n_heads <= 0 || vh->hidden % vh->n_heads ||
        vh->patch <= 0 || vh->merge_h <= 0 || vh->merge_w <= 0 || vh->pos_h <= 0 || vh->pos_w <= 0)
        return oerr(c, KVL_ERR_CONFIG, "vision.idx: the vision hparams are invalid; rerun kvl pack");
    if ((st = kvl_vision_check(e)) != KVL_OK) return oerr(c, st, "%s", e->last_error);
    return KVL_OK;
}

void kvl_engine_free(kvl_engine *e)
{
    if (!e) return;
    kvl_engine_text *t = e->text;
    if (t) {
        kvl_trunk_stream_free(t->stream);
        kvl_expert_cache_free(t->ecache);
        kvl_aligned_free(t->global_mem);
        kvl_aligned_free(t->trunk_mem);
        free(t->layers);
        free(t->tt);
        free(t);
    }
    if (e->pool) kvl_pool_free(e->pool);
    kvl_store_close(e->trunk);
    kvl_store_close(e->experts);
    kvl_store_close(e->vision.store);
    free(e->pack_dir);
    free(e);
}

kvl_status kvl_engine_open(const char *pack_dir, const kvl_engine_options *options,
                           kvl_engine **out_engine, char *err, size_t err_len)
{
    kvl_engine_options o;
    open_ctx c;
    kvl_status st;
    char path[4096];
    memset(&o, 0, sizeof o);
    if (options) o = *options;
    c.e = NULL; c.err = err; c.err_len = err_len;
    if (err && err_len) err[0] = 0;
    if (!pack_dir || !out_engine)
        return oerr(&c, KVL_ERR_INVALID_ARG, "kvl_engine_open: pack_dir and out_engine are required");
    *out_engine = NULL;
    if (o.n_threads < 0)
        return oerr(&c, KVL_ERR_INVALID_ARG, "n_threads = %d is negative; use 0 for every core",
                    (int)o.n_threads);
    if (o.trunk_cache_bytes < -1)
        return oerr(&c, KVL_ERR_INVALID_ARG, "trunk_cache_bytes = %lld is invalid (use -1 to stream "
                    "everything, 0 for all resident, or a byte budget)", (long long)o.trunk_cache_bytes);
    if (o.io_mode < KVL_IO_AUTO || o.io_mode > KVL_IO_BUFFERED)
        return oerr(&c, KVL_ERR_INVALID_ARG, "io_mode = %d is invalid", (int)o.io_mode);
    if (o.kernels < KVL_KERNELS_AUTO || o.kernels > KVL_KERNELS_SIMD128)
        return oerr(&c, KVL_ERR_INVALID_ARG, "kernels = %d is invalid", (int)o.kernels);
    if (o.kv_dtype < KVL_KV_DEFAULT || o.kv_dtype > KVL_KV_I16)
        return oerr(&c, KVL_ERR_INVALID_ARG, "kv_dtype = %d is invalid", (int)o.kv_dtype);
    if (o.act_dtype < KVL_ACT_DEFAULT || o.act_dtype > KVL_ACT_I8)
        return oerr(&c, KVL_ERR_INVALID_ARG, "act_dtype = %d is invalid", (int)o.act_dtype);
    if (o.expert_lookahead != KVL_LOOKAHEAD_AUTO && o.expert_lookahead != KVL_LOOKAHEAD_OFF)
        return oerr(&c, KVL_ERR_INVALID_ARG, "expert_lookahead = %d is invalid (0 auto, 1 off)",
                    (int)o.expert_lookahead);
    if (o.expert_cache_policy < KVL_CACHE_POLICY_DEFAULT || o.expert_cache_policy > KVL_CACHE_POLICY_LRU)
        return oerr(&c, KVL_ERR_INVALID_ARG, "expert_cache_policy = %d is invalid (0 default, 1 adaptive, "
                    "2 frequency, 3 lru)", (int)o.expert_cache_policy);
    if (o.act_dtype == KVL_ACT_I16_REMOVED)
        return oerr(&c, KVL_ERR_INVALID_ARG, "act_dtype = 3 (i16, two integer terms per input) was removed: "
                    "use i16x1 (4), faster on every kernel set, or f32 (1), the exact mode");
    /* the integer modes run attention on integers, over an int16 KV cache */
    const int int_kv = o.act_dtype == KVL_ACT_I16X1 || o.act_dtype == KVL_ACT_I8;
    if (o.kv_dtype == KVL_KV_DEFAULT)
        o.kv_dtype = int_kv ? KVL_KV_I16 : KVL_KV_F32;
    if ((o.kv_dtype == KVL_KV_I16) != int_kv)
        return oerr(&c, KVL_ERR_INVALID_ARG, "act_dtype i16x1 and i8 keep the KV cache as int16 rows, and only "
                    "they do: use kv_dtype i16 with act_dtype i16x1 or i8 and f32 or bf16 otherwise");

    join_path(path, sizeof path, pack_dir, "PACK_COMPLETE.json");
    if (file_exists(path) != KVL_OK)
        return oerr(&c, KVL_ERR_FORMAT, "%s is missing: the pack is incomplete; rerun kvl pack",
                    path);

    kvl_engine *e = (kvl_engine *)calloc(1, sizeof *e);
    if (!e) return oerr(&c, KVL_ERR_NOMEM, "out of memory");
    c.e = e;
    e->text = (kvl_engine_text *)calloc(1, sizeof *e->text);
    e->pack_dir = (char *)malloc(strlen(pack_dir) + 1);
    if (!e->text || !e->pack_dir) { st = oerr(&c, KVL_ERR_NOMEM, "out of memory"); goto fail; }
    memcpy(e->pack_dir, pack_dir, strlen(pack_dir) + 1);
    e->k = kvl_kernels_select(o.kernels);
    if (!e->k) {
        st = oerr(&c, KVL_ERR_UNSUPPORTED, "the requested kernels (%d) are not supported by this "
                  "CPU or build; use auto", (int)o.kernels);
        goto fail;
    }
    if ((st = open_store(&c, pack_dir, "trunk", 1, o.io_mode, &e->trunk)) != KVL_OK) goto fail;
    if ((st = open_store(&c, pack_dir, "experts", 2, o.io_mode, &e->experts)) != KVL_OK) goto fail;
    if ((st = check_config_agrees(&c, e->experts, "experts.idx")) != KVL_OK) goto fail;
    if ((st = read_hparams(&c, &e->text->hp)) != KVL_OK) goto fail;
    {
        const int n_layers = e->text->hp.n_layers;
        int begin = o.layer_begin, end = o.layer_end;
        if (begin == 0 && end == 0) end = n_layers;
        if (begin < 0 || end > n_layers || begin >= end) {
            st = oerr(&c, KVL_ERR_INVALID_ARG, "layer range [%d, %d) is not a non-empty range "
                      "within the model's %d layers", (int)o.layer_begin, (int)o.layer_end,
                      n_layers);
            goto fail;
        }
        e->text->layer_begin = begin;
        e->text->layer_end = end;
    }
    if (o.load_vision && (st = load_vision(&c, pack_dir, o.io_mode)) != KVL_OK) goto fail;
    e->pool = kvl_pool_create(o.n_threads);
    if (!e->pool) { st = oerr(&c, KVL_ERR_NOMEM, "cannot create the thread pool"); goto fail; }
    e->text->kv_dtype = o.kv_dtype;
    e->text->act_bf16 = o.act_dtype == KVL_ACT_BF16;
    e->text->act_i16 = o.act_dtype == KVL_ACT_I16X1 || o.act_dtype == KVL_ACT_I8;
    e->text->act_i8 = o.act_dtype == KVL_ACT_I8;
    /* every mode but the exact one takes BF16 vision products where they are faster: AMX, 4x
     * the FP32 tile's GFLOP/s; VDPBF16PS alone ran at half of it here, so without AMX the tower
     * stays FP32 (README "Numerics": the bound against the float64 reference) */
    e->vision.bf16 = o.act_dtype != KVL_ACT_F32 && e->k->bf16_dot && kvl_gemm_amx_available();
    if ((st = load_text(&c, &o)) != KVL_OK) goto fail;
    *out_engine = e;
    return KVL_OK;
fail:
    kvl_engine_free(e);
    return st;
}

kvl_status kvl_engine_get_info(const kvl_engine *e, kvl_engine_info *out)
{
    if (!e || !out) return KVL_ERR_INVALID_ARG;
    const kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    double v;
    memset(out, 0, sizeof *out);
    out->vocab_size = hp->vocab;
    out->hidden_size = hp->hidden;
    out->n_layers = hp->n_layers;
    out->n_heads = hp->n_heads;
    out->kv_lora_rank = hp->kv_lora;
    out->qk_rope_head_dim = hp->rope;
    out->n_routed_experts = hp->n_routed;
    out->num_experts_per_tok = hp->topk;
    out->max_position_embeddings = hp->max_pos;
    if (vparam(e->trunk, "vision.hidden_size", &v)) out->vision_hidden_size = (int32_t)v;
    if (vparam(e->trunk, "vision.merge_kernel_h", &v)) out->vision_merge_h = (int32_t)v;
    if (vparam(e->trunk, "vision.merge_kernel_w", &v)) out->vision_merge_w = (int32_t)v;
    if (vparam(e->trunk, "vision.patch_size", &v)) out->vision_patch_size = (int32_t)v;
    out->media_placeholder_token_id = hp->media_token;
    out->n_threads = kvl_pool_size(e->pool);
    out->trunk_direct_io = kvl_store_direct_io(e->trunk);
    out->expert_direct_io = kvl_store_direct_io(e->experts);
    out->vision_direct_io = e->vision.store ? kvl_store_direct_io(e->vision.store) : 0;
    snprintf(out->kernels, sizeof out->kernels, "%s", e->k->name);
    snprintf(out->kv_dtype, sizeof out->kv_dtype, "%s",
             t->kv_dtype == KVL_KV_I16 ? "i16" : t->kv_dtype == KVL_KV_BF16 ? "bf16" : "f32");
    snprintf(out->act_dtype, sizeof out->act_dtype, "%s",
             t->act_i8 ? "i8" : t->act_i16 ? "i16x1" : t->act_bf16 ? "bf16" : "f32");
    out->global_bytes = t->global_bytes;
    out->trunk_cache_bytes = t->trunk_bytes;
    out->expert_cache_bytes = t->ecache ? kvl_expert_cache_bytes(t->ecache) : 0;
    out->engine_workspace_bytes = t->workspace_bytes;
    out->expert_extent_bytes = t->extent_bytes;
    out->layer_begin = t->layer_begin;
    out->layer_end = t->layer_end;
    out->expert_lookahead = t->lookahead;
    snprintf(out->expert_cache_policy, sizeof out->expert_cache_policy, "%s",
             kvl_expert_cache_policy_name(t->cache_policy));
    return KVL_OK;
}

kvl_status kvl_engine_get_stats(const kvl_engine *e, kvl_stats *out)
{
    if (!e || !out) return KVL_ERR_INVALID_ARG;
    const kvl_engine_text *t = e->text;
    memset(out, 0, sizeof *out);
    if (t->ecache) {
        kvl_expert_cache_counters k;
        kvl_expert_cache_counters_get(t->ecache, &k);
        out->expert_hits = k.hits;
        out->expert_misses = k.misses;
        out->expert_bytes_read = k.bytes_read;
        out->expert_stall_ns = k.stall_ns;
        out->verify_ns = k.verify_ns;
        out->verify_bytes = k.verify_bytes;
        out->expert_lookahead_issued = k.lookahead_issued;
        out->expert_lookahead_used = k.lookahead_used;
        out->expert_lookahead_wasted = k.lookahead_wasted + k.lookahead_dropped;
        out->expert_lookahead_cancelled = k.lookahead_cancelled;
        out->expert_lookahead_pending = k.lookahead_unclaimed;
    }
    out->trunk_hits = t->trunk_hits;
    out->trunk_misses = t->trunk_misses;
    uint64_t stream_verify_ns, stream_verify_bytes;
    kvl_trunk_counters_get(t, &out->trunk_bytes_read, &stream_verify_ns, &stream_verify_bytes);
    out->verify_ns += stream_verify_ns;
    out->verify_bytes += stream_verify_bytes;
    out->verify_ns += e->verify_ns;
    out->verify_bytes += e->verify_bytes;
    out->trunk_stall_ns = t->trunk_stall_ns;
    out->vision_bytes_read = e->vision.bytes_read;
    out->tokens_prefilled = t->tokens_prefilled;
    out->tokens_decoded = t->tokens_decoded;
    return KVL_OK;
}

void kvl_engine_reset_stats(kvl_engine *e)
{
    if (!e) return;
    kvl_engine_text *t = e->text;
    if (t->ecache) kvl_expert_cache_reset_stats(t->ecache);
    kvl_trunk_counters_reset(t);
    t->tokens_prefilled = t->tokens_decoded = 0;
    e->vision.bytes_read = 0;
    e->verify_ns = e->verify_bytes = 0;
}

kvl_status kvl_engine_set_expert_slots(kvl_engine *e, int32_t slots, int32_t *active)
{
    if (active) *active = 0;
    if (!e) return KVL_ERR_INVALID_ARG;
    kvl_expert_cache *cache = e->text->ecache;
    if (!cache) return KVL_OK;
    int before = kvl_expert_cache_active_slots(cache), now = before;
    /* growing into memory the image work just freed: glibc would keep it in its arenas */
    if (slots > before) kvl_os_trim_heap();
    kvl_status st = kvl_expert_cache_set_slots(cache, slots, &now);
    if (active) *active = now;
    if (st != KVL_OK)
        return kvl_engine_fail(e, st, "the expert cache cannot be resized while a call is running on the engine");
    return KVL_OK;
}

/* ---- sessions ---------------------------------------------------------------------------------- */

static kvl_status session_dims(const kvl_engine *e, const kvl_session_options *options,
                               int *ctx, int *batch)
{
    kvl_session_options o;
    memset(&o, 0, sizeof o);
    if (options) o = *options;
    *ctx = o.max_context ? o.max_context : 4096;
    *batch = o.max_batch ? o.max_batch : 256;
    if (*ctx < 1 || *ctx > e->text->hp.max_pos)
        return kvl_engine_fail((kvl_engine *)e, KVL_ERR_INVALID_ARG, "max_context = %d must be "
                               "between 1 and max_position_embeddings (%d)", *ctx, e->text->hp.max_pos);
    if (*batch < 1)
        return kvl_engine_fail((kvl_engine *)e, KVL_ERR_INVALID_ARG, "max_batch = %d must be >= 1",
                               *batch);
    if (*batch > *ctx) *batch = *ctx; /* a chunk never exceeds the context */
    return KVL_OK;
}

kvl_status kvl_session_bytes(const kvl_engine *e, const kvl_session_options *options,
                             uint64_t *out_bytes)
{
    int ctx, batch;
    if (!e || !out_bytes) return KVL_ERR_INVALID_ARG;
    kvl_status st = session_dims(e, options, &ctx, &batch);
    if (st != KVL_OK) return st;
    kvl_session_layout ly;
    kvl_session_layout_compute(e, ctx, batch, &ly);
    *out_bytes = (uint64_t)ly.total + sizeof(kvl_session);
    return KVL_OK;
}

kvl_status kvl_session_new(kvl_engine *e, const kvl_session_options *options, kvl_session **out)
{
    int ctx, batch;
    if (!e || !out) return KVL_ERR_INVALID_ARG;
    *out = NULL;
    kvl_status st = session_dims(e, options, &ctx, &batch);
    if (st != KVL_OK) return st;
    kvl_session_layout ly;
    kvl_session_layout_compute(e, ctx, batch, &ly);
    if (ly.total > (uint64_t)SIZE_MAX)
        return kvl_engine_fail(e, KVL_ERR_NOMEM, "a session with max_context %d needs %llu bytes, "
                               "more than this build can address; lower max_context or split the "
                               "model over more instances", ctx, (unsigned long long)ly.total);
    kvl_session *s = (kvl_session *)calloc(1, sizeof *s);
    if (!s) return kvl_engine_fail(e, KVL_ERR_NOMEM, "out of memory creating a session");
    s->arena = kvl_aligned_alloc(64, (size_t)ly.total);
    if (!s->arena) {
        free(s);
        return kvl_engine_fail(e, KVL_ERR_NOMEM, "cannot allocate %llu bytes for a session "
                               "(max_context %d, max_batch %d); lower them",
                               (unsigned long long)ly.total, ctx, batch);
    }
    s->engine = e;
    s->max_context = ctx;
    s->max_batch = batch;
    s->arena_bytes = ly.total;
    kvl_session_bind(s, &ly);
    *out = s;
    return KVL_OK;
}

void kvl_session_free(kvl_session *s)
{
    if (!s) return;
    kvl_aligned_free(s->arena);
    free(s);
}

int32_t kvl_session_position(const kvl_session *s) { return s ? s->position : 0; }

kvl_status kvl_session_truncate(kvl_session *s, int32_t n)
{
    if (!s) return KVL_ERR_INVALID_ARG;
    if (n < 0 || n > s->position)
        return kvl_engine_fail(s->engine, KVL_ERR_INVALID_ARG, "truncate to %d tokens: must be "
                               "between 0 and the session position %d", (int)n, s->position);
    s->position = n; /* later positions are simply overwritten */
    return KVL_OK;
}

void kvl_session_cancel(kvl_session *s)
{
    if (s) kvl_atomic_store(&s->cancel_flag, 1);
}

void kvl_session_watch_cancel(kvl_session *s, const volatile int32_t *flag)
{
    if (s) s->cancel_watch = flag;
}

kvl_status kvl_session_set_routing(kvl_session *s, int32_t mode, uint32_t seed, int32_t *ids,
                                   float *weights, int32_t capacity)
{
    if (!s) return KVL_ERR_INVALID_ARG;
    kvl_engine *e = s->engine;
    if (mode < KVL_ROUTING_MODEL || mode > KVL_ROUTING_GIVEN)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "routing mode %d is not one of "
                               "KVL_ROUTING_MODEL, _UNIFORM, _GIVEN", (int)mode);
    if (capacity < 0 || (!ids) != (!weights) || (!ids) != (capacity == 0))
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "routing rows: ids and weights are both "
                               "given with a positive capacity or both NULL with 0 (capacity %d)",
                               (int)capacity);
    if (mode == KVL_ROUTING_GIVEN && !ids)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "KVL_ROUTING_GIVEN needs routing rows");
    s->routing_mode = mode;
    s->routing_seed = seed;
    s->routing_ids = ids;
    s->routing_w = weights;
    s->routing_cap = capacity;
    return KVL_OK;
}

kvl_status kvl_session_forward(kvl_session *s, const int32_t *tokens, const float *hidden_in,
                               int32_t n, const float *media, int32_t n_media, float *hidden_out,
                               int32_t mode, float *logits, int32_t decode)
{
    if (!s) return KVL_ERR_INVALID_ARG;
    kvl_engine *e = s->engine;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    const int first_range = t->layer_begin == 0, last_range = t->layer_end == hp->n_layers;
    if (n < 0)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: %d tokens", (int)n);
    if (first_range && n > 0 && !tokens)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: this engine runs the first layers "
                               "[0, %d): it takes token ids, not NULL", t->layer_end);
    if (!first_range && (tokens || (n > 0 && !hidden_in) || n_media != 0))
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: this engine runs layers [%d, %d): "
                               "it takes the previous range's hidden states (hidden_in), not "
                               "tokens or media rows", t->layer_begin, t->layer_end);
    if (first_range && hidden_in)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: this engine runs the first layers; "
                               "it takes tokens, not hidden_in");
    if (!last_range && (mode != KVL_LOGITS_NONE || (n > 0 && !hidden_out)))
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: this engine runs layers [%d, %d) "
                               "of %d: it writes hidden_out (required) and no logits",
                               t->layer_begin, t->layer_end, hp->n_layers);
    if (last_range && hidden_out)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: this engine runs the last layers; "
                               "it writes logits, not hidden_out");
    if (mode < KVL_LOGITS_NONE || mode > KVL_LOGITS_ALL)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "logits_mode = %d is invalid", (int)mode);
    if (mode != KVL_LOGITS_NONE && !logits)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "a logits buffer is required for this "
                               "logits_mode");
    if (mode != KVL_LOGITS_NONE && n == 0)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "logits requested for zero tokens");
    if (n_media < 0 || (n_media > 0 && !media))
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "n_media = %d with a %s media array",
                               (int)n_media, media ? "valid" : "NULL");
    int placeholders = 0;
    for (int32_t i = 0; tokens && i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= hp->vocab)
            return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "token id %d at index %d is outside "
                                   "the vocabulary [0, %d)", (int)tokens[i], (int)i, hp->vocab);
        if (tokens[i] == hp->media_token) placeholders++;
    }
    if (placeholders != n_media)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "the tokens hold %d media placeholder(s) "
                               "(id %d) but %d media embedding row(s) were given; the counts "
                               "must match", placeholders, hp->media_token, (int)n_media);
    if ((int64_t)s->position + n > s->max_context)
        return kvl_engine_fail(e, KVL_ERR_CONTEXT_FULL, "the session context is full: position %d "
                               "+ %d new tokens exceeds max_context %d; truncate the session or "
                               "create one with a larger max_context", s->position, (int)n,
                               s->max_context);
    if (s->routing_ids && n > s->routing_cap)
        return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "forward: %d tokens but the routing rows "
                               "hold %d (kvl_session_set_routing)", (int)n, s->routing_cap);
    kvl_atomic_store(&s->cancel_flag, 0);
    const int pos_before = s->position;
    int cursor = 0;
    kvl_status st = KVL_OK;
    /* the pool's workers run with FTZ/DAZ always; the calling thread only during this call */
    unsigned fp_mode = kvl_fast_float_enter();
    for (int32_t start = 0; start < n; start += s->max_batch) {
        int m = n - start < s->max_batch ? n - start : s->max_batch;
        int last_chunk = start + m == n;
        int cmode = mode == KVL_LOGITS_ALL ? KVL_LOGITS_ALL
                    : (mode == KVL_LOGITS_LAST && last_chunk) ? KVL_LOGITS_LAST : KVL_LOGITS_NONE;
        float *out = mode == KVL_LOGITS_ALL ? logits + (size_t)start * (size_t)hp->vocab : logits;
        const size_t row0 = (size_t)start * (size_t)hp->hidden;
        s->routing_row0 = start;
        st = kvl_model_forward(s, tokens ? tokens + start : NULL, hidden_in ? hidden_in + row0 : NULL,
                               m, n_media ? media : NULL, &cursor,
                               hidden_out ? hidden_out + row0 : NULL, cmode, out);
        if (st != KVL_OK) break;
    }
    kvl_fast_float_leave(fp_mode);
    if (st != KVL_OK) {
        s->position = pos_before; /* roll back: the cache beyond position is ignored */
        return st;
    }
    if (decode) t->tokens_decoded += (uint64_t)n;
    else t->tokens_prefilled += (uint64_t)n;
    return KVL_OK;
}

kvl_status kvl_session_prefill(kvl_session *s, const int32_t *tokens, int32_t n_tokens,
                               const float *media_embeds, int32_t n_media, int32_t logits_mode,
                               float *logits)
{
    if (!s) return KVL_ERR_INVALID_ARG;
    return kvl_session_forward(s, tokens, NULL, n_tokens, media_embeds, n_media, NULL, logits_mode,
                               logits, 0);
}

kvl_status kvl_session_step(kvl_session *s, int32_t token, float *logits)
{
    if (!s) return KVL_ERR_INVALID_ARG;
    return kvl_session_forward(s, &token, NULL, 1, NULL, 0, NULL, KVL_LOGITS_LAST, logits, 1);
}
