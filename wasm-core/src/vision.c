/* vision.c — MoonViT vision tower + Kimi-VL multimodal projector forward (spec section 5).
 *
 * Owns: kvl_vision_bytes / kvl_vision_encode: grid validation, patch embedding, bicubic
 * resampling of the learned position table, 2D RoPE, the pre-LN encoder blocks with per-image
 * bidirectional attention, final LayerNorm, the merge_h x merge_w patch merger and the projector
 * (per-member LayerNorm, linear_1, exact GELU, linear_2). Weights are streamed from
 * engine->vision.store one phase at a time (patch embedding, each block, projector halves) into one
 * working buffer, so the working set is one block's weights plus the activations of the call;
 * each tensor's CRC is checked the first time it is read (kvl_engine_check).
 * Does not own: opening the vision store or reading its hparams (engine.c), errors and the CRC
 * check (engine_errors.c), kernels (kernels*.c), threads (threadpool.c), file I/O (store.c),
 * preprocessing (host/image/image-preprocess.ts).
 * Layer: forward passes, below engine.c (vision.h and kvl_core.h's kvl_vision_* are what it calls
 * here); calls only the files below it (scripts/c-layers.mjs checks).
 *
 * All arithmetic is FP32 with BF16 weights, except in the BF16 mode (engine->vision.bf16: AMX
 * runs and the mode is not f32), where the Linear layers' inputs and attention's Q, K, V and
 * probabilities are rounded to BF16 for AMX tiles (kernels.h kvl_gemm_bf16_amx,
 * kvl_attention_bf16_amx); every dimension comes from engine->vision.hp.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "vision.h"
#include "engine_errors.h"

/* MoonViT builds its 2D-RoPE table for 512 x 512 positions in the modeling code (the number is
 * not serialised in config.json); the official processor refuses grids with >= 512 per side. */
#define VISION_ROPE_GRID_LIMIT 512
/* Smallest attention probability kept (2^-100): far below float resolution relative to the
 * largest probability of a row (>= 1/len), yet far above the subnormal range. */
#define ATTN_PROB_FLOOR 7.8886091e-31f
/* PyTorch's bicubic convolution constant (upsample_bicubic2d), not Pillow's -0.5. */
#define BICUBIC_A (-0.75f)

enum {
    BF16_BYTES = 2,
    /* queries per attention work item, a multiple of every table's gemm_mr: each block of
     * keys and values is read from L2 once for this many queries */
    ATTN_QUERIES = 96,
    /* keys per block of the online softmax, a multiple of every gemm_nr: a block's scores are
     * gemm_mr x ATTN_KEYS floats, whatever the image's size */
    ATTN_KEYS = 256,
    /* rows per thread of a product come in multiples of this, a multiple of every table's
     * gemm_nr, so only a product's last panel is a partial one (kvl_gemm_bf16 blocks the rest:
     * tokens, columns; each output's sum is the same on any split, and
     * test/vision-engine.test.ts checks batch invariance) */
    GEMM_ROW_GRAIN = 32,
};
_Static_assert(ATTN_QUERIES <= KVL_ATTN_AMX_QUERIES, "a work item's queries fit one AMX attention call");

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Dimensions and the byte layout of the single working allocation of one call. */
typedef struct vision_plan {
    size_t hidden, inter, heads, head_dim, head_dim_v, patch_values, text_hidden;
    size_t mr, nr; /* the kernel table's GEMM tile */
    size_t merge_area, proj_width;
    size_t pos_h, pos_w, merge_h, merge_w;
    size_t n_images, n_tokens, n_merged, max_image_tokens;
    int n_threads;
    size_t arena_bytes, vec_floats;
    size_t off_vec, off_x, off_xn, off_big, off_cos, off_sin, off_scratch, off_img, off_mimg,
        off_qimg;
    size_t big_floats, scratch_floats_per_thread;
    size_t total_bytes;
} vision_plan;

static int pool_threads(const kvl_engine *engine)
{
    return engine->pool ? kvl_pool_size(engine->pool) : 1;
}

/* kvl_vision_bytes gets a const engine but reports errors through it: last_error is the one
 * mutable diagnostic field, so casting constness away here is deliberate. */
static kvl_status fail(const kvl_engine *engine, kvl_status status, const char *what)
{
    return kvl_engine_fail((kvl_engine *)engine, status, "%s", what);
}

static kvl_status check_hparams(const kvl_engine *engine)
{
    const kvl_vision_hparams *h = &engine->vision.hp;
    char msg[400];
    if (!engine->vision.store)
        return fail(engine, KVL_ERR_INVALID_ARG,
                    "vision weights are not loaded: open the engine with load_vision = 1");
    if (h->hidden <= 0 || h->n_layers <= 0 || h->n_heads <= 0 || h->intermediate <= 0 ||
        h->patch <= 0 || h->pos_h <= 0 || h->pos_w <= 0 || h->merge_h <= 0 || h->merge_w <= 0 ||
        h->text_hidden <= 0 || !(h->ln_eps > 0.0f) || !(h->rope_theta > 0.0f)) {
        snprintf(msg, sizeof msg,
                 "vision hparams are invalid (hidden %d, layers %d, heads %d, intermediate %d, "
                 "patch %d, pos-emb %dx%d, merge %dx%d, text hidden %d, eps %g, rope theta %g); "
                 "repack the model",
                 h->hidden, h->n_layers, h->n_heads, h->intermediate, h->patch, h->pos_h,
                 h->pos_w, h->merge_h, h->merge_w, h->text_hidden, (double)h->ln_eps,
                 (double)h->rope_theta);
        return fail(engine, KVL_ERR_CONFIG, msg);
    }
    /* attention's blocks are whole tiles of the table's GEMM (job_attention) */
    if (!engine->k || engine->k->gemm_mr <= 0 || engine->k->gemm_nr <= 0 ||
        ATTN_QUERIES % engine->k->gemm_mr != 0 || ATTN_KEYS % engine->k->gemm_nr != 0)
        return fail(engine, KVL_ERR_INTERNAL, "vision: no kernels selected, or a GEMM tile "
                    "that does not divide the attention blocks");
    if (h->hidden % h->n_heads != 0 || (h->hidden / h->n_heads) % 4 != 0) {
        snprintf(msg, sizeof msg,
                 "vision hidden size %d with %d heads: the head size must be a whole multiple "
                 "of 4 for 2D RoPE; the config is not a MoonViT configuration",
                 h->hidden, h->n_heads);
        return fail(engine, KVL_ERR_CONFIG, msg);
    }
    return KVL_OK;
}

/* Validate hparams and grids, then lay out the call's working memory. */
static kvl_status make_plan(const kvl_engine *engine, const int32_t *grids, int32_t n_images,
                            vision_plan *pl)
{
    const kvl_vision_hparams *h = &engine->vision.hp;
    char msg[400];
    kvl_status st;
    size_t phase, embed, block, proj1, proj2, off, i;
    uint64_t tokens = 0;

    memset(pl, 0, sizeof *pl);
    st = check_hparams(engine);
    if (st != KVL_OK)
        return st;
    if (n_images < 0 || (n_images > 0 && !grids)) {
        snprintf(msg, sizeof msg, "vision: n_images is %d and grids is %s; pass n_images >= 0 "
                 "and an n_images x 2 grid array", (int)n_images, grids ? "set" : "NULL");
        return fail(engine, KVL_ERR_INVALID_ARG, msg);
    }
    for (i = 0; i < (size_t)n_images; i++) {
        int32_t gh = grids[2 * i], gw = grids[2 * i + 1];
        if (gh <= 0 || gw <= 0 || gh % h->merge_h != 0 || gw % h->merge_w != 0) {
            snprintf(msg, sizeof msg,
                     "vision: image %zu has patch grid %dx%d; each side must be a positive "
                     "multiple of the %dx%d merge kernel (use kvl.image.preprocess)",
                     i, (int)gh, (int)gw, h->merge_h, h->merge_w);
            return fail(engine, KVL_ERR_INVALID_ARG, msg);
        }
        if (gh >= VISION_ROPE_GRID_LIMIT || gw >= VISION_ROPE_GRID_LIMIT) {
            snprintf(msg, sizeof msg,
                     "vision: image %zu has patch grid %dx%d; the vision model supports fewer "
                     "than %d patches per side (Exceed pos emb); downscale or crop the image",
                     i, (int)gh, (int)gw, VISION_ROPE_GRID_LIMIT);
            return fail(engine, KVL_ERR_INVALID_ARG, msg);
        }
        tokens += (uint64_t)gh * (uint64_t)gw;
        if ((uint64_t)gh * (uint64_t)gw > pl->max_image_tokens)
            pl->max_image_tokens = (size_t)gh * (size_t)gw;
    }
    /* Each image is below 512x512 patches; a sum this large cannot be a real request and would
     * overflow the size arithmetic below on 32-bit hosts. */
    if (tokens > ((uint64_t)1 << 24)) {
        snprintf(msg, sizeof msg, "vision: %llu patches in one call is too many; encode the "
                 "images in smaller groups", (unsigned long long)tokens);
        return fail(engine, KVL_ERR_INVALID_ARG, msg);
    }

    {
        /* Rough size in floating point first, so absurd hparams or grids cannot wrap the size_t
         * arithmetic below (notably on 32-bit hosts) into a small, overrun allocation. */
        double D = h->hidden, I = h->intermediate, T = h->text_hidden, n = (double)tokens;
        double P = D * h->merge_h * h->merge_w, side = (double)pl->max_image_tokens;
        double weights = 4.0 * D * D + 2.0 * D * I + P * P + T * P + h->pos_h * D * h->pos_w;
        double acts = n * (3.0 * D + (3.0 * D > I ? 3.0 * D : I)) +
                      pool_threads(engine) * (side * (2.0 * D / h->n_heads + 64.0) +
                                              (double)KVL_GEMM_WORK_FLOATS);
        double estimate = 2.0 * weights + 4.0 * acts;
        if (estimate > (double)SIZE_MAX / 4) {
            snprintf(msg, sizeof msg, "vision: these %d image(s) would need about %.3g bytes of "
                     "working memory, more than this host can address; encode smaller images",
                     (int)n_images, estimate);
            return fail(engine, KVL_ERR_NOMEM, msg);
        }
    }
    pl->hidden = (size_t)h->hidden;
    pl->inter = (size_t)h->intermediate;
    pl->heads = (size_t)h->n_heads;
    pl->head_dim = pl->hidden / pl->heads;
    pl->mr = (size_t)engine->k->gemm_mr;
    pl->nr = (size_t)engine->k->gemm_nr;
    pl->head_dim_v = align_up(pl->head_dim, pl->nr);
    pl->patch_values = 3u * (size_t)h->patch * (size_t)h->patch;
    pl->text_hidden = (size_t)h->text_hidden;
    pl->merge_h = (size_t)h->merge_h;
    pl->merge_w = (size_t)h->merge_w;
    pl->merge_area = pl->merge_h * pl->merge_w;
    pl->proj_width = pl->hidden * pl->merge_area;
    pl->pos_h = (size_t)h->pos_h;
    pl->pos_w = (size_t)h->pos_w;
    pl->n_images = (size_t)n_images;
    pl->n_tokens = (size_t)tokens;
    pl->n_merged = pl->n_tokens / pl->merge_area;
    pl->n_threads = pool_threads(engine);

    /* Weight phases (BF16, every tensor 4096-aligned for direct reads). */
#define AL(x) align_up((size_t)(x), KVL_PAGE)
    {
        size_t D = pl->hidden, I = pl->inter, P = pl->proj_width, T = pl->text_hidden;
        embed = AL(D * pl->patch_values * BF16_BYTES) + AL(D * BF16_BYTES) +
                AL(pl->pos_h * pl->pos_w * D * BF16_BYTES);
        block = 5 * AL(D * BF16_BYTES) + AL(3 * D * D * BF16_BYTES) + AL(3 * D * BF16_BYTES) +
                AL(D * D * BF16_BYTES) + AL(I * D * BF16_BYTES) + AL(I * BF16_BYTES) +
                AL(D * I * BF16_BYTES) + AL(D * BF16_BYTES);
        proj1 = 4 * AL(D * BF16_BYTES) + AL(P * P * BF16_BYTES) + AL(P * BF16_BYTES);
        proj2 = AL(T * P * BF16_BYTES) + AL(T * BF16_BYTES);
        phase = embed;
        if (block > phase) phase = block;
        if (proj1 > phase) phase = proj1;
        if (proj2 > phase) phase = proj2;
        pl->arena_bytes = phase;
        /* FP32 copies of the small vectors of the largest phase */
        pl->vec_floats = 9 * D + I;
        if (4 * D + P > pl->vec_floats) pl->vec_floats = 4 * D + P;
        if (T > pl->vec_floats) pl->vec_floats = T;
        pl->big_floats = pl->n_tokens * (3 * D > I ? 3 * D : I);
        /* per thread (job_attention): one head's keys and values of an image as GEMM panels,
         * a work item's queries as panels, one panel's scores and probabilities for a block of
         * keys, the item's outputs and its softmax state: O(image tokens), never tokens^2 */
        pl->scratch_floats_per_thread = align_up(pl->max_image_tokens, pl->nr) * pl->head_dim +
                                        pl->max_image_tokens * pl->head_dim_v +
                                        ATTN_QUERIES * pl->head_dim +
                                        2 * pl->mr * ATTN_KEYS +
                                        ATTN_QUERIES * pl->head_dim_v + 2 * ATTN_QUERIES;
        /* BF16 mode on AMX (kvl_attention_bf16_amx): one head's keys and values of an image as
         * BF16 pair panels, then the call's work (a work item's queries, one block's scores and
         * probabilities of 32 queries, the item's outputs): also O(image tokens) */
        {
            const size_t amx = kvl_attn_amx_kv_words(pl->max_image_tokens, pl->head_dim) +
                               kvl_attn_amx_work_floats(pl->head_dim);
            if (pl->scratch_floats_per_thread < amx)
                pl->scratch_floats_per_thread = amx;
        }
        /* the products' packed panels (kvl_gemm_bf16) use the same scratch between attentions */
        if (pl->scratch_floats_per_thread < KVL_GEMM_WORK_FLOATS)
            pl->scratch_floats_per_thread = KVL_GEMM_WORK_FLOATS;
    }
#undef AL
    off = pl->arena_bytes;
#define REGION(field, bytes) do { pl->field = off; off = align_up(off + (size_t)(bytes), 64); } while (0)
    REGION(off_vec, pl->vec_floats * sizeof(float));
    REGION(off_x, pl->n_tokens * pl->hidden * sizeof(float));
    REGION(off_xn, pl->n_tokens * pl->hidden * sizeof(float));
    REGION(off_big, pl->big_floats * sizeof(float));
    REGION(off_cos, pl->n_tokens * (pl->head_dim / 2) * sizeof(float));
    REGION(off_sin, pl->n_tokens * (pl->head_dim / 2) * sizeof(float));
    REGION(off_scratch, (size_t)pl->n_threads * pl->scratch_floats_per_thread * sizeof(float));
    REGION(off_img, (pl->n_images + 1) * sizeof(size_t));
    REGION(off_mimg, (pl->n_images + 1) * sizeof(size_t));
    REGION(off_qimg, (pl->n_images + 1) * sizeof(size_t));
#undef REGION
    pl->total_bytes = off;
    return KVL_OK;
}

KVL_API kvl_status kvl_vision_bytes(const kvl_engine *engine, const int32_t *grids,
                                    int32_t n_images, uint64_t *out_bytes)
{
    vision_plan pl;
    kvl_status st;
    if (!engine || !out_bytes)
        return KVL_ERR_INVALID_ARG;
    st = make_plan(engine, grids, n_images, &pl);
    if (st != KVL_OK)
        return st;
    *out_bytes = n_images == 0 ? 0 : (uint64_t)pl.total_bytes;
    return KVL_OK;
}

/* ---------------------------------------------------------------- weight streaming ---- */

typedef struct weight_loader {
    kvl_engine *engine;
    unsigned char *arena;
    size_t arena_used, arena_cap;
    float *vec;
    size_t vec_used, vec_cap;
} weight_loader;

static void loader_reset(weight_loader *ld) { ld->arena_used = 0; ld->vec_used = 0; }

/* Find a tensor and check it is BF16 with exactly the shape the hparams imply. */
static kvl_status check_tensor(kvl_engine *engine, const char *name, unsigned ndim,
                               const size_t *shape, const kvl_tensor_rec **out)
{
    const kvl_tensor_rec *rec = kvl_store_find(engine->vision.store, name);
    uint64_t elems = 1;
    unsigned d;
    if (!rec)
        return kvl_engine_fail(engine, KVL_ERR_CONFIG,
                               "vision store has no tensor '%s'; the pack is incomplete or for "
                               "another model, repack it", name);
    if (rec->dtype != KVL_DTYPE_BF16 || rec->ndim != ndim)
        return kvl_engine_fail(engine, KVL_ERR_CONFIG,
                               "vision tensor '%s' has dtype %u and %u dims, expected BF16 with "
                               "%u dims; repack the model", name, rec->dtype, rec->ndim, ndim);
    for (d = 0; d < ndim; d++) {
        if (rec->shape[d] != (uint64_t)shape[d])
            return kvl_engine_fail(engine, KVL_ERR_CONFIG,
                                   "vision tensor '%s' has size %llu in dim %u, but the vision "
                                   "hparams imply %zu; the pack disagrees with its config",
                                   name, (unsigned long long)rec->shape[d], d, shape[d]);
        elems *= rec->shape[d];
    }
    if (rec->nbytes != elems * BF16_BYTES)
        return kvl_engine_fail(engine, KVL_ERR_FORMAT,
                               "vision tensor '%s' holds %llu bytes, expected %llu",
                               name, (unsigned long long)rec->nbytes,
                               (unsigned long long)(elems * BF16_BYTES));
    *out = rec;
    return KVL_OK;
}

/* Read one BF16 tensor of the expected shape into the arena. */
static kvl_status load_bf16(weight_loader *ld, const char *name, unsigned ndim,
                            const size_t *shape, const uint16_t **out)
{
    const kvl_tensor_rec *rec = NULL;
    kvl_status st = check_tensor(ld->engine, name, ndim, shape, &rec);
    size_t need;
    if (st != KVL_OK)
        return st;
    need = align_up((size_t)rec->nbytes, KVL_PAGE);
    if (ld->arena_used + need > ld->arena_cap)
        return kvl_engine_fail(ld->engine, KVL_ERR_INTERNAL,
                               "vision working buffer too small for '%s'", name);
    st = kvl_store_read(ld->engine->vision.store, rec->offset, rec->nbytes, ld->arena + ld->arena_used);
    if (st != KVL_OK) {
        char what[160];
        snprintf(what, sizeof what, "vision tensor '%s'", name);
        return kvl_engine_read_failed(ld->engine, st, ld->engine->vision.store, what);
    }
    ld->engine->vision.bytes_read += rec->nbytes;
    /* first read of this tensor in this engine: its CRC, before any use */
    st = kvl_engine_check(ld->engine, ld->engine->vision.store, "vision.bin", rec,
                          ld->arena + ld->arena_used);
    if (st != KVL_OK)
        return st;
    *out = (const uint16_t *)(const void *)(ld->arena + ld->arena_used);
    ld->arena_used += need;
    return KVL_OK;
}

/* Read a 1-D BF16 vector and return an FP32 copy. */
static kvl_status load_vec(weight_loader *ld, const char *name, size_t n, const float **out)
{
    const uint16_t *raw = NULL;
    float *dst;
    kvl_status st = load_bf16(ld, name, 1, &n, &raw);
    if (st != KVL_OK)
        return st;
    if (ld->vec_used + n > ld->vec_cap)
        return kvl_engine_fail(ld->engine, KVL_ERR_INTERNAL,
                               "vision vector buffer too small for '%s'", name);
    dst = ld->vec + ld->vec_used;
    ld->engine->k->bf16_to_f32(dst, raw, n);
    ld->vec_used += n;
    *out = dst;
    return KVL_OK;
}

/* Check every vision/projector tensor against the hparams without reading any data, so a bad
 * pack is refused when the engine opens (engine.c) rather than at the first image. */
kvl_status kvl_vision_check(kvl_engine *engine)
{
    static const char *const block_vectors[] = {"norm0.weight", "norm0.bias", "norm1.weight",
                                                "norm1.bias", "wo.bias", "mlp.fc1.bias"};
    static const char *const projector_vectors[] = {
        "vision_tower.encoder.final_layernorm.weight", "vision_tower.encoder.final_layernorm.bias",
        "multi_modal_projector.pre_norm.weight", "multi_modal_projector.pre_norm.bias"};
    const kvl_vision_hparams *h;
    const kvl_tensor_rec *rec;
    size_t D, I, P, T, shape[4], i;
    char name[128];
    kvl_status st;
    int layer;
    if (!engine)
        return KVL_ERR_INVALID_ARG;
    if ((st = check_hparams(engine)) != KVL_OK)
        return st;
    h = &engine->vision.hp;
    D = (size_t)h->hidden; I = (size_t)h->intermediate; T = (size_t)h->text_hidden;
    P = D * (size_t)h->merge_h * (size_t)h->merge_w;
#define CHECK(nm, nd, s0, s1, s2, s3) do { \
        shape[0] = (s0); shape[1] = (s1); shape[2] = (s2); shape[3] = (s3); \
        if ((st = check_tensor(engine, (nm), (nd), shape, &rec)) != KVL_OK) return st; \
    } while (0)
    CHECK("vision_tower.patch_embed.proj.weight", 4, D, 3, (size_t)h->patch, (size_t)h->patch);
    CHECK("vision_tower.patch_embed.proj.bias", 1, D, 0, 0, 0);
    CHECK("vision_tower.patch_embed.pos_emb.weight", 3, (size_t)h->pos_h, (size_t)h->pos_w, D, 0);
    for (layer = 0; layer < h->n_layers; layer++) {
#define BLOCK(suffix) (snprintf(name, sizeof name, "vision_tower.encoder.blocks.%d.%s", layer, suffix), name)
        for (i = 0; i < sizeof block_vectors / sizeof block_vectors[0]; i++)
            CHECK(BLOCK(block_vectors[i]), 1, D, 0, 0, 0);
        CHECK(BLOCK("wqkv.weight"), 2, 3 * D, D, 0, 0);
        CHECK(BLOCK("wqkv.bias"), 1, 3 * D, 0, 0, 0);
        CHECK(BLOCK("wo.weight"), 2, D, D, 0, 0);
        CHECK(BLOCK("mlp.fc0.weight"), 2, I, D, 0, 0);
        CHECK(BLOCK("mlp.fc0.bias"), 1, I, 0, 0, 0);
        CHECK(BLOCK("mlp.fc1.weight"), 2, D, I, 0, 0);
#undef BLOCK
    }
    for (i = 0; i < sizeof projector_vectors / sizeof projector_vectors[0]; i++)
        CHECK(projector_vectors[i], 1, D, 0, 0, 0);
    CHECK("multi_modal_projector.linear_1.weight", 2, P, P, 0, 0);
    CHECK("multi_modal_projector.linear_1.bias", 1, P, 0, 0, 0);
    CHECK("multi_modal_projector.linear_2.weight", 2, T, P, 0, 0);
    CHECK("multi_modal_projector.linear_2.bias", 1, T, 0, 0, 0);
#undef CHECK
    return KVL_OK;
}

/* ------------------------------------------------------------------ parallel ops ------ */

enum vision_op {
    OP_MATMUL,          /* Y[n, rows] = X[n, cols] . W^T (rows split across threads) */
    OP_BIAS,            /* dst[t] += b */
    OP_BIAS_GELU_TANH,  /* dst[t] = gelu_tanh(dst[t] + b) */
    OP_BIAS_GELU_ERF,   /* dst[t] = gelu_erf(dst[t] + b) */
    OP_LAYERNORM,       /* dst[t] = LN(src[t]; w, b) */
    OP_RESIDUAL_BIAS,   /* x[t] += src[t] + b */
    OP_POS_EMB,         /* x[t] += bicubic(pos table)[row, col of t] */
    OP_ROPE,            /* rotate Q and K of qkv rows in place */
    OP_ATTENTION,       /* per (image, head, query tile): softmax(q k^T * scale) v */
    OP_MERGE            /* u[m] = concat_k LN(src[member k of m]) */
};

typedef struct vision_job {
    const kvl_kernels *k;
    const vision_plan *pl;
    int op;
    int bf16; /* Linear products in BF16 on AMX (engine->vision.bf16) */
    float eps;
    /* matmul */
    float *Y;
    size_t ldy, rows, cols, ldx, n;
    const uint16_t *W;
    const float *X;
    /* row-wise ops over `count` rows of `width` floats */
    float *dst;
    const float *src, *w, *b;
    size_t width, count;
    /* shared state */
    float *x, *qkv, *attn_out, *rope_cos, *rope_sin, *scratch;
    const size_t *img_off, *img_moff, *img_qoff;
    const int32_t *grids;
    const uint16_t *pos_table;
} vision_job;

static float bf16_bits_to_f32(uint16_t bits)
{
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Index of the image holding item `t`, given prefix offsets off[0..n]. */
static size_t find_image(const size_t *off, size_t n_images, size_t t)
{
    size_t lo = 0, hi = n_images;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (off[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* PyTorch upsample_bicubic2d (align_corners = False) taps and weights for one output index. */
static void bicubic_taps(size_t dst, size_t in_size, size_t out_size, size_t idx[4], float w[4])
{
    const float A = BICUBIC_A;
    float scale = (float)in_size / (float)out_size;
    float real = scale * ((float)dst + 0.5f) - 0.5f;
    float fl = floorf(real);
    float t = real - fl;
    long base = (long)fl;
    float x1 = t + 1.0f, x2 = 1.0f - t, x3 = 2.0f - t;
    int k;
    w[0] = ((A * x1 - 5.0f * A) * x1 + 8.0f * A) * x1 - 4.0f * A;
    w[1] = ((A + 2.0f) * t - (A + 3.0f)) * t * t + 1.0f;
    w[2] = ((A + 2.0f) * x2 - (A + 3.0f)) * x2 * x2 + 1.0f;
    w[3] = ((A * x3 - 5.0f * A) * x3 + 8.0f * A) * x3 - 4.0f * A;
    for (k = 0; k < 4; k++) {
        long i = base - 1 + k;
        if (i < 0) i = 0;
        if (i > (long)in_size - 1) i = (long)in_size - 1;
        idx[k] = (size_t)i;
    }
}

static void job_pos_emb(const vision_job *j, size_t t)
{
    const vision_plan *pl = j->pl;
    size_t D = pl->hidden;
    size_t img = find_image(j->img_off, pl->n_images, t);
    size_t gh = (size_t)j->grids[2 * img], gw = (size_t)j->grids[2 * img + 1];
    size_t local = t - j->img_off[img], r = local / gw, c = local % gw;
    float *xr = j->x + t * D;
    size_t ry[4], cx[4], d;
    float wy[4], wx[4];
    int a, b;
    if (gh == pl->pos_h && gw == pl->pos_w) {
        /* bicubic at equal size is the identity */
        const uint16_t *row = j->pos_table + (r * pl->pos_w + c) * D;
        for (d = 0; d < D; d++)
            xr[d] += bf16_bits_to_f32(row[d]);
        return;
    }
    bicubic_taps(r, pl->pos_h, gh, ry, wy);
    bicubic_taps(c, pl->pos_w, gw, cx, wx);
    /* each source row is interpolated along the width, then the rows are combined along the
     * height, in PyTorch's order */
    for (d = 0; d < D; d++) {
        float out = 0.0f;
        for (a = 0; a < 4; a++) {
            const uint16_t *row = j->pos_table + ry[a] * pl->pos_w * D;
            float along = 0.0f;
            for (b = 0; b < 4; b++)
                along += wx[b] * bf16_bits_to_f32(row[cx[b] * D + d]);
            out += wy[a] * along;
        }
        xr[d] += out;
    }
}

static void job_rope(const vision_job *j, size_t t)
{
    const vision_plan *pl = j->pl;
    size_t D = pl->hidden, hd = pl->head_dim, pairs = hd / 2, h, p, part;
    const float *cs = j->rope_cos + t * pairs, *sn = j->rope_sin + t * pairs;
    for (part = 0; part < 2; part++) { /* Q then K */
        float *base = j->qkv + t * 3 * D + part * D;
        for (h = 0; h < pl->heads; h++) {
            float *v = base + h * hd;
            for (p = 0; p < pairs; p++) {
                float re = v[2 * p], im = v[2 * p + 1];
                v[2 * p] = re * cs[p] - im * sn[p];
                v[2 * p + 1] = re * sn[p] + im * cs[p];
            }
        }
    }
}

/* Attention of one image's tokens among themselves (flash-style): per work item (image, head,
 * ATTN_QUERIES queries) the keys are taken ATTN_KEYS at a time, and for each panel of gemm_mr
 * queries the block's scores S = Q K^T are GEMM tiles, the probabilities of the block are the
 * table's softmax of each row (exp(s - m_b) / l_b), and O += P V (GEMM tiles) with P rescaled
 * so that O, l and m stay those of the keys seen so far (the online softmax of FlashAttention):
 *   M' = max(M, m_b), O *= e^(M - M'), P = softmax_b * l_b e^(m_b - M'), L = L e^(M - M') +
 *   l_b e^(m_b - M'), with l_b = 1 / (softmax_b at its maximum, where exp gave exactly 1);
 * at the end O / L. Nothing grows with tokens^2: the scores of one block of one panel only.
 * Items are (image, head, query tile) in that order, so a thread's consecutive items mostly share
 * the packed keys/values; `cached` remembers which (image, head) the scratch holds, and in which
 * form: in the BF16 mode the same steps run on AMX tiles (kvl_attention_bf16_amx: 32 queries a
 * tile, KVL_ATTN_AMX_KEYS keys a block) over keys and values packed as BF16 pairs. */
typedef struct attn_cache { size_t img, head; int valid, amx; } attn_cache;

static void job_attention(const vision_job *j, size_t item, float *scratch, attn_cache *cached)
{
    const vision_plan *pl = j->pl;
    const kvl_kernels *K = j->k;
    const size_t D = pl->hidden, hd = pl->head_dim, hdv = pl->head_dim_v, stride = 3 * D;
    const size_t mr = pl->mr, nr = pl->nr, max_len = pl->max_image_tokens;
    const size_t img = find_image(j->img_qoff, pl->n_images, item);
    const size_t first = j->img_off[img], len = j->img_off[img + 1] - first;
    const size_t tiles = (len + ATTN_QUERIES - 1) / ATTN_QUERIES;
    const size_t local = item - j->img_qoff[img], head = local / tiles, tile = local % tiles;
    const size_t q0 = tile * ATTN_QUERIES;
    const size_t nq = len - q0 < ATTN_QUERIES ? len - q0 : ATTN_QUERIES;
    float *kp = scratch;                               /* key panels [len/nr][hd][nr] */
    float *vp = kp + align_up(max_len, nr) * hd;      /* value panels [hdv/nr][len][nr] */
    float *qp = vp + max_len * hdv;                   /* query panels [ATTN_QUERIES/mr][hd][mr] */
    float *S = qp + ATTN_QUERIES * hd;                /* one panel's scores [mr][ATTN_KEYS] */
    float *P = S + mr * ATTN_KEYS;                    /* its probabilities [ATTN_KEYS][mr] */
    float *O = P + mr * ATTN_KEYS;                    /* outputs [ATTN_QUERIES][hdv] */
    float *M = O + ATTN_QUERIES * hdv, *L = M + ATTN_QUERIES; /* running max and sum */
    const float scale = (float)(1.0 / sqrt((double)hd));
    size_t s, t, d, i;
    if (j->bf16 && hd <= KVL_ATTN_AMX_MAX_HD) {
        /* BF16 mode: the same attention on AMX tiles (kernels.h), keys and values packed once
         * per (image, head) as BF16 pairs at the start of the scratch */
        uint32_t *kv = (uint32_t *)(void *)scratch;
        float *work = scratch + kvl_attn_amx_kv_words(max_len, hd);
        const float *qkv = j->qkv + first * stride + head * hd;
        if (!cached->valid || !cached->amx || cached->img != img || cached->head != head) {
            cached->valid = 0;
            cached->amx = 1;
            if (kvl_attn_amx_pack_kv(kv, qkv + D, qkv + 2 * D, stride, len, hd) == 0) {
                cached->img = img;
                cached->head = head;
                cached->valid = 1;
            }
        }
        if (cached->valid &&
            kvl_attention_bf16_amx(K, j->attn_out + (first + q0) * D + head * hd, D,
                                   qkv + q0 * stride, stride, nq, kv, len, hd, scale,
                                   ATTN_PROB_FLOOR, work) == 0)
            return;
        cached->valid = 0; /* not reached where engine->vision.bf16 is set (AMX runs) */
    }
    if (!cached->valid || cached->amx || cached->img != img || cached->head != head) {
        cached->amx = 0;
        const size_t lp = align_up(len, nr);
        for (s = 0; s < lp; s++) {
            const float *row = s < len ? j->qkv + (first + s) * stride + D + head * hd : NULL;
            float *kdst = kp + (s / nr) * hd * nr + s % nr;
            for (d = 0; d < hd; d++)
                kdst[d * nr] = row ? row[d] : 0.0f;
        }
        for (s = 0; s < len; s++) {
            const float *row = j->qkv + (first + s) * stride + 2 * D + head * hd;
            for (d = 0; d < hdv; d++)
                vp[(d / nr) * len * nr + s * nr + d % nr] = d < hd ? row[d] : 0.0f;
        }
        cached->img = img;
        cached->head = head;
        cached->valid = 1;
    }
    for (t = 0; t < align_up(nq, mr); t++) {
        const float *row = t < nq ? j->qkv + (first + q0 + t) * stride + head * hd : NULL;
        float *qdst = qp + (t / mr) * hd * mr + t % mr;
        for (d = 0; d < hd; d++)
            qdst[d * mr] = row ? row[d] : 0.0f;
    }
    memset(O, 0, ATTN_QUERIES * hdv * sizeof(float));
    for (t = 0; t < ATTN_QUERIES; t++) {
        M[t] = -INFINITY;
        L[t] = 0.0f;
    }
    for (size_t k0 = 0; k0 < len; k0 += ATTN_KEYS) {
        const size_t kb = len - k0 < ATTN_KEYS ? len - k0 : ATTN_KEYS;
        for (size_t i0 = 0; i0 < nq; i0 += mr) {
            const float *A = qp + (i0 / mr) * hd * mr;
            for (size_t c = 0; c < kb; c += nr)
                K->gemm_tile(hd, A, kp + ((k0 + c) / nr) * hd * nr, S + c, ATTN_KEYS, 0);
            for (i = 0; i < mr; i++) {
                float *row = S + i * ATTN_KEYS;
                float m_b = -INFINITY, pmax, Mn, alpha, beta;
                size_t arg = 0;
                if (i0 + i >= nq) { /* a padding query: no probabilities */
                    for (s = 0; s < kb; s++)
                        P[s * mr + i] = 0.0f;
                    continue;
                }
                for (s = 0; s < kb; s++) {
                    row[s] *= scale;
                    if (row[s] > m_b) {
                        m_b = row[s];
                        arg = s;
                    }
                }
                K->softmax(row, kb);
                pmax = row[arg]; /* exp(0) / l_b */
                Mn = M[i0 + i] > m_b ? M[i0 + i] : m_b;
                alpha = expf(M[i0 + i] - Mn); /* 0 on the first block (M = -inf) */
                beta = expf(m_b - Mn) / pmax;
                L[i0 + i] = L[i0 + i] * alpha + beta;
                M[i0 + i] = Mn;
                if (alpha != 1.0f)
                    for (d = 0; d < hd; d++)
                        O[(i0 + i) * hdv + d] *= alpha;
                for (s = 0; s < kb; s++) {
                    /* Probabilities this small cannot change a sum that has a term near 1, but
                     * as subnormal floats they make the next product many times slower on x86. */
                    const float p = row[s] * beta;
                    P[s * mr + i] = p < ATTN_PROB_FLOOR ? 0.0f : p;
                }
            }
            for (d = 0; d < hdv; d += nr)
                K->gemm_tile(kb, P, vp + (d / nr) * len * nr + k0 * nr, O + i0 * hdv + d, hdv, 1);
        }
    }
    for (t = 0; t < nq; t++) {
        float *dst = j->attn_out + (first + q0 + t) * D + head * hd;
        const float inv = 1.0f / L[t];
        for (d = 0; d < hd; d++)
            dst[d] = O[t * hdv + d] * inv;
    }
}

static void job_merge(const vision_job *j, size_t m)
{
    const vision_plan *pl = j->pl;
    size_t D = pl->hidden;
    size_t img = find_image(j->img_moff, pl->n_images, m);
    size_t gw = (size_t)j->grids[2 * img + 1];
    size_t cols = gw / pl->merge_w, local = m - j->img_moff[img];
    size_t R = local / cols, C = local % cols, a, b;
    for (a = 0; a < pl->merge_h; a++)
        for (b = 0; b < pl->merge_w; b++) {
            size_t tok = j->img_off[img] + (R * pl->merge_h + a) * gw + (C * pl->merge_w + b);
            float *slot = j->dst + m * pl->proj_width + (a * pl->merge_w + b) * D;
            kvl_layernorm(slot, j->src + tok * D, j->w, j->b, D, j->eps);
        }
}

static void vision_worker(void *ctx, int ti, int nt)
{
    const vision_job *j = (const vision_job *)ctx;
    size_t begin, end, t;
    float *scratch = j->scratch + (size_t)ti * j->pl->scratch_floats_per_thread;
    attn_cache cached;
    cached.valid = 0;
    cached.amx = 0;
    if (j->op == OP_MATMUL) {
        /* whole panels of every table's gemm_nr per thread; the blocked GEMM sums each output
         * in the same order on any split, so results do not depend on the thread count */
        kvl_split_range(j->rows, GEMM_ROW_GRAIN, ti, nt, &begin, &end);
        if (end > begin)
        {
            /* BF16 mode: AMX tiles (engine->vision.bf16 is set only where they run) */
            if (!j->bf16 || kvl_gemm_bf16_amx(j->Y + begin, j->ldy, j->W + begin * j->cols,
                                              end - begin, j->cols, j->X, j->ldx, j->n, scratch) != 0)
                kvl_gemm_bf16(j->k, j->Y + begin, j->ldy, j->W + begin * j->cols, end - begin,
                              j->cols, j->X, j->ldx, j->n, scratch);
        }
        return;
    }
    kvl_split_range(j->count, 1, ti, nt, &begin, &end);
    for (t = begin; t < end; t++) {
        float *row = j->dst ? j->dst + t * j->width : NULL;
        size_t c;
        switch (j->op) {
        case OP_BIAS:
            for (c = 0; c < j->width; c++) row[c] += j->b[c];
            break;
        case OP_BIAS_GELU_TANH:
            for (c = 0; c < j->width; c++) row[c] += j->b[c];
            j->k->gelu_tanh(row, j->width);
            break;
        case OP_BIAS_GELU_ERF:
            for (c = 0; c < j->width; c++) row[c] += j->b[c];
            kvl_gelu_erf(row, j->width);
            break;
        case OP_LAYERNORM:
            kvl_layernorm(row, j->src + t * j->width, j->w, j->b, j->width, j->eps);
            break;
        case OP_RESIDUAL_BIAS: {
            const float *s = j->src + t * j->width;
            for (c = 0; c < j->width; c++) row[c] += s[c] + j->b[c];
            break;
        }
        case OP_POS_EMB: job_pos_emb(j, t); break;
        case OP_ROPE: job_rope(j, t); break;
        case OP_ATTENTION: job_attention(j, t, scratch, &cached); break;
        case OP_MERGE: job_merge(j, t); break;
        default: break;
        }
    }
}

static void run(kvl_engine *engine, vision_job *job)
{
    if (engine->pool)
        kvl_pool_run(engine->pool, vision_worker, job);
    else
        vision_worker(job, 0, 1);
}

static void run_matmul(kvl_engine *engine, vision_job *job, float *Y, const uint16_t *W,
                       size_t rows, size_t cols, const float *X, size_t n)
{
    job->op = OP_MATMUL;
    job->Y = Y; job->ldy = rows; job->W = W; job->rows = rows; job->cols = cols;
    job->X = X; job->ldx = cols; job->n = n;
    run(engine, job);
}

static void run_rows(kvl_engine *engine, vision_job *job, int op, float *dst, const float *src,
                     const float *w, const float *b, size_t width, size_t count)
{
    job->op = op;
    job->dst = dst; job->src = src; job->w = w; job->b = b;
    job->width = width; job->count = count;
    run(engine, job);
}

/* ------------------------------------------------------------------ forward ------------ */

static void build_rope_tables(const vision_plan *pl, const int32_t *grids, float theta,
                              float *cos_out, float *sin_out)
{
    size_t hd = pl->head_dim, quarter = hd / 4, pairs = hd / 2, img, t = 0, i;
    float freq[VISION_ROPE_GRID_LIMIT]; /* hd/4 entries; hd/4 < 512 checked below */
    for (i = 0; i < quarter && i < VISION_ROPE_GRID_LIMIT; i++) {
        /* theta^(-4i/head_dim), as the official table computes it in FP32 */
        float expo = (float)(4 * i) / (float)hd;
        freq[i] = 1.0f / powf(theta, expo);
    }
    for (img = 0; img < pl->n_images; img++) {
        size_t gh = (size_t)grids[2 * img], gw = (size_t)grids[2 * img + 1], r, c;
        for (r = 0; r < gh; r++)
            for (c = 0; c < gw; c++, t++) {
                float *cs = cos_out + t * pairs, *sn = sin_out + t * pairs;
                for (i = 0; i < quarter && i < VISION_ROPE_GRID_LIMIT; i++) {
                    float ax = (float)c * freq[i]; /* pair 2i: column (x) */
                    float ay = (float)r * freq[i]; /* pair 2i+1: row (y) */
                    cs[2 * i] = (float)cos((double)ax);
                    sn[2 * i] = (float)sin((double)ax);
                    cs[2 * i + 1] = (float)cos((double)ay);
                    sn[2 * i + 1] = (float)sin((double)ay);
                }
            }
    }
}

static kvl_status encode(kvl_engine *engine, const vision_plan *pl, unsigned char *mem,
                         const float *pixel_values, const int32_t *grids, float *out)
{
    const kvl_vision_hparams *h = &engine->vision.hp;
    size_t D = pl->hidden, I = pl->inter, N = pl->n_tokens, M = pl->n_merged;
    size_t P = pl->proj_width, T = pl->text_hidden, i;
    float *x = (float *)(void *)(mem + pl->off_x);
    float *xn = (float *)(void *)(mem + pl->off_xn);
    float *big = (float *)(void *)(mem + pl->off_big);
    size_t *img_off = (size_t *)(void *)(mem + pl->off_img);
    size_t *img_moff = (size_t *)(void *)(mem + pl->off_mimg);
    size_t *img_qoff = (size_t *)(void *)(mem + pl->off_qimg);
    weight_loader ld;
    vision_job job;
    char name[128];
    kvl_status st;
    int layer;
    const uint16_t *W = NULL;
    const float *b = NULL, *w = NULL, *b2 = NULL, *w2 = NULL;

    ld.engine = engine;
    ld.arena = mem;
    ld.arena_cap = pl->arena_bytes;
    ld.vec = (float *)(void *)(mem + pl->off_vec);
    ld.vec_cap = pl->vec_floats;
    loader_reset(&ld);

    img_off[0] = 0;
    img_moff[0] = 0;
    img_qoff[0] = 0;
    for (i = 0; i < pl->n_images; i++) {
        size_t cells = (size_t)grids[2 * i] * (size_t)grids[2 * i + 1];
        img_off[i + 1] = img_off[i] + cells;
        img_moff[i + 1] = img_moff[i] + cells / pl->merge_area;
        img_qoff[i + 1] = img_qoff[i] + pl->heads * ((cells + ATTN_QUERIES - 1) / ATTN_QUERIES);
    }
    memset(&job, 0, sizeof job);
    job.k = engine->k;
    job.bf16 = engine->vision.bf16;
    job.pl = pl;
    job.eps = h->ln_eps;
    job.x = x;
    job.qkv = big;
    job.attn_out = xn;
    job.rope_cos = (float *)(void *)(mem + pl->off_cos);
    job.rope_sin = (float *)(void *)(mem + pl->off_sin);
    job.scratch = (float *)(void *)(mem + pl->off_scratch);
    job.img_off = img_off;
    job.img_moff = img_moff;
    job.img_qoff = img_qoff;
    job.grids = grids;
    build_rope_tables(pl, grids, h->rope_theta, job.rope_cos, job.rope_sin);

    /* patch embedding: conv with stride = kernel = patch is one dense map per patch */
    {
        size_t wshape[4], pshape[3];
        wshape[0] = D; wshape[1] = 3; wshape[2] = (size_t)h->patch; wshape[3] = (size_t)h->patch;
        pshape[0] = pl->pos_h; pshape[1] = pl->pos_w; pshape[2] = D;
        if ((st = load_bf16(&ld, "vision_tower.patch_embed.proj.weight", 4, wshape, &W)) != KVL_OK ||
            (st = load_vec(&ld, "vision_tower.patch_embed.proj.bias", D, &b)) != KVL_OK ||
            (st = load_bf16(&ld, "vision_tower.patch_embed.pos_emb.weight", 3, pshape,
                            &job.pos_table)) != KVL_OK)
            return st;
        run_matmul(engine, &job, x, W, D, pl->patch_values, pixel_values, N);
        run_rows(engine, &job, OP_BIAS, x, NULL, NULL, b, D, N);
        run_rows(engine, &job, OP_POS_EMB, NULL, NULL, NULL, NULL, D, N);
    }

    for (layer = 0; layer < h->n_layers; layer++) {
        const float *n0w, *n0b, *n1w, *n1b, *bqkv, *bo, *b0, *b1;
        const uint16_t *Wqkv, *Wo, *W0, *W1;
        size_t s_qkv[2], s_o[2], s_0[2], s_1[2];
        s_qkv[0] = 3 * D; s_qkv[1] = D;
        s_o[0] = D; s_o[1] = D;
        s_0[0] = I; s_0[1] = D;
        s_1[0] = D; s_1[1] = I;
        loader_reset(&ld);
#define BLOCK_NAME(suffix) (snprintf(name, sizeof name, "vision_tower.encoder.blocks.%d.%s", layer, suffix), name)
        if ((st = load_vec(&ld, BLOCK_NAME("norm0.weight"), D, &n0w)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("norm0.bias"), D, &n0b)) != KVL_OK ||
            (st = load_bf16(&ld, BLOCK_NAME("wqkv.weight"), 2, s_qkv, &Wqkv)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("wqkv.bias"), 3 * D, &bqkv)) != KVL_OK ||
            (st = load_bf16(&ld, BLOCK_NAME("wo.weight"), 2, s_o, &Wo)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("wo.bias"), D, &bo)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("norm1.weight"), D, &n1w)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("norm1.bias"), D, &n1b)) != KVL_OK ||
            (st = load_bf16(&ld, BLOCK_NAME("mlp.fc0.weight"), 2, s_0, &W0)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("mlp.fc0.bias"), I, &b0)) != KVL_OK ||
            (st = load_bf16(&ld, BLOCK_NAME("mlp.fc1.weight"), 2, s_1, &W1)) != KVL_OK ||
            (st = load_vec(&ld, BLOCK_NAME("mlp.fc1.bias"), D, &b1)) != KVL_OK)
            return st;
#undef BLOCK_NAME
        /* attention half: x += Wo . Attn(RoPE(Q, K), V) + bo */
        run_rows(engine, &job, OP_LAYERNORM, xn, x, n0w, n0b, D, N);
        run_matmul(engine, &job, big, Wqkv, 3 * D, D, xn, N);
        run_rows(engine, &job, OP_BIAS, big, NULL, NULL, bqkv, 3 * D, N);
        run_rows(engine, &job, OP_ROPE, NULL, NULL, NULL, NULL, 3 * D, N);
        run_rows(engine, &job, OP_ATTENTION, NULL, NULL, NULL, NULL, D, img_qoff[pl->n_images]);
        run_matmul(engine, &job, big, Wo, D, D, xn, N);   /* Q/K/V are dead now */
        run_rows(engine, &job, OP_RESIDUAL_BIAS, x, big, NULL, bo, D, N);
        /* MLP half: x += fc1(gelu_tanh(fc0(LN1(x)))) */
        run_rows(engine, &job, OP_LAYERNORM, xn, x, n1w, n1b, D, N);
        run_matmul(engine, &job, big, W0, I, D, xn, N);
        run_rows(engine, &job, OP_BIAS_GELU_TANH, big, NULL, NULL, b0, I, N);
        run_matmul(engine, &job, xn, W1, D, I, big, N);
        run_rows(engine, &job, OP_RESIDUAL_BIAS, x, xn, NULL, b1, D, N);
    }

    /* final LayerNorm, merge with per-member pre_norm, linear_1 + exact GELU */
    {
        size_t s_1[2];
        s_1[0] = P; s_1[1] = P;
        loader_reset(&ld);
        if ((st = load_vec(&ld, "vision_tower.encoder.final_layernorm.weight", D, &w)) != KVL_OK ||
            (st = load_vec(&ld, "vision_tower.encoder.final_layernorm.bias", D, &b)) != KVL_OK ||
            (st = load_vec(&ld, "multi_modal_projector.pre_norm.weight", D, &w2)) != KVL_OK ||
            (st = load_vec(&ld, "multi_modal_projector.pre_norm.bias", D, &b2)) != KVL_OK ||
            (st = load_bf16(&ld, "multi_modal_projector.linear_1.weight", 2, s_1, &W)) != KVL_OK)
            return st;
        run_rows(engine, &job, OP_LAYERNORM, xn, x, w, b, D, N);
        run_rows(engine, &job, OP_MERGE, big, xn, w2, b2, P, M);   /* big = u [M, P] */
        if ((st = load_vec(&ld, "multi_modal_projector.linear_1.bias", P, &b)) != KVL_OK)
            return st;
        run_matmul(engine, &job, xn, W, P, P, big, M);            /* xn = h [M, P] */
        run_rows(engine, &job, OP_BIAS_GELU_ERF, xn, NULL, NULL, b, P, M);
    }
    /* linear_2 straight into the caller's rows */
    {
        size_t s_2[2];
        s_2[0] = T; s_2[1] = P;
        loader_reset(&ld);
        if ((st = load_bf16(&ld, "multi_modal_projector.linear_2.weight", 2, s_2, &W)) != KVL_OK ||
            (st = load_vec(&ld, "multi_modal_projector.linear_2.bias", T, &b)) != KVL_OK)
            return st;
        run_matmul(engine, &job, out, W, T, P, xn, M);
        run_rows(engine, &job, OP_BIAS, out, NULL, NULL, b, T, M);
    }
    return KVL_OK;
}

KVL_API kvl_status kvl_vision_encode(kvl_engine *engine, const float *pixel_values,
                                     const int32_t *grids, int32_t n_images, float *out)
{
    vision_plan pl;
    kvl_status st;
    unsigned char *mem;
    if (!engine)
        return KVL_ERR_INVALID_ARG;
    st = make_plan(engine, grids, n_images, &pl);
    if (st != KVL_OK)
        return st;
    if (n_images == 0)
        return KVL_OK;
    if (!pixel_values || !out)
        return kvl_engine_fail(engine, KVL_ERR_INVALID_ARG,
                               "vision: pixel_values and out must not be NULL");
    if (!engine->k || !engine->k->matmul_bf16)
        return kvl_engine_fail(engine, KVL_ERR_INTERNAL, "vision: no kernels selected");
    /* every record checked before any work, so a bad pack fails fast and whole */
    if ((st = kvl_vision_check(engine)) != KVL_OK)
        return st;
    mem = (unsigned char *)kvl_aligned_alloc(KVL_PAGE, pl.total_bytes);
    if (!mem)
        return kvl_engine_fail(engine, KVL_ERR_NOMEM,
                               "vision: cannot allocate %zu bytes of working memory for %zu "
                               "patches; encode fewer or smaller images",
                               pl.total_bytes, pl.n_tokens);
    st = encode(engine, &pl, mem, pixel_values, grids, out);
    kvl_aligned_free(mem);
    return st;
}
