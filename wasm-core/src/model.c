/* model.c — the text decoder forward pass of the kvl core.
 *
 * Owns: the session scratch layout, the layer-major forward over a chunk of tokens (embedding
 * rows, MLA in its absorbed form over the compressed KV cache, dense MLP, MoE routing with
 * group-limited noaux_tc selection, shared experts, routed experts (Q8 or Q4 extents) from the
 * expert cache, the next layer's predicted experts read ahead (predict_next), final norm, lm_head), the Linear layers' input modes (FP32, BF16-rounded, or
 * quantised to integers for integer products: act_i16, mm_quantize), and the splitting of that
 * work across the pool.
 * Does not own: opening/validating the pack or the trunk cache (engine.c), the trunk streamer
 * (trunk.c: every non-global trunk tensor comes through kvl_trunk_get), errors (engine_errors.c),
 * kernels (kernels_*.c), expert reads (expert_cache.c). Every shape was validated at open, so
 * this file carries no shape checks; nothing here allocates.
 * Layer: forward passes, below engine.c (model.h is what it calls here); calls only the files
 * below it (scripts/c-layers.mjs checks).
 *
 * Parallel shape: decode streams every weight once per token, so the pool work is organised to
 * keep both memory streams busy: each pool run is a list of matmul "segments" (e.g. q_proj and
 * kv_a_proj of one input, or gate+up of the shared expert and of every ready routed expert) cut
 * into row blocks that threads take from a shared counter, so a thread delayed by the OS does not
 * stall the join. Every output row is still computed by one kernel call over the same inputs, so
 * results do not depend on the split (bit-identical to a one-thread run).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model.h"
#include "engine_errors.h"
#include "platform.h"
#include "trunk.h"

#define ARENA_ALIGN 64u
#define ROW_ALIGN 16u
#define SMALL_MATMUL_MACS (1u << 15)

enum {
    L_KV = 0, L_X, L_XN, L_Q, L_A, L_QABS, L_CHAT, L_O, L_GATE, L_UP, L_RLOG, L_SELW,
    L_MOE_OUT, L_XG, L_YG, L_THREAD, L_SELI, L_ECOUNT, L_ELIST, L_EORDER, L_EMBED, L_KVT, L_XQ,
    L_XS, L_ONES, L_COUNT
};

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t max_mlp_width(const kvl_engine_text *t)
{
    /* MoE layers: the shared experts' rows plus one expert's, so that a small chunk (n*topk <=
     * max_batch) fits n*R shared rows and n*topk expert rows of moe_intermediate side by side */
    size_t w = 1;
    for (int l = t->layer_begin; l < t->layer_end; l++) {
        size_t lw = (size_t)t->layers[l].mlp_rows;
        if (t->layers[l].is_moe) lw += (size_t)t->hp.moe_intermediate;
        if (lw > w) w = lw;
    }
    return w;
}

/* the act_i16 workspace (int16 values, f32 scales) of chunks of B tokens; defined beside mm_run */
static void act_workspace(const kvl_engine_text *t, uint64_t B, uint64_t *xq_elems,
                          uint64_t *xs_elems);

/* Prefill chunks of at least this many tokens compute attention in blocks of tokens per head
 * (attn_tiled); shorter ones (decode) token by token for all of a thread's heads at once
 * (attn_per_token), which needs no transposed copy of the cache. */
#define ATTN_TILED_MIN 8

/* attn_i16: with --act-dtype i16x1 (or i8) the KV cache is KVL_KV_I16 and attention's two products run
 * on integers, in prefill chunks (attn_tiled) and decode (attn_per_token) alike: each cached row
 * quantised to int16 once, as store_kv writes it, with one scale per row (|q| <=
 * ATTN_I16_ROW_MAX, the weight range of matmul_i16_i16), and its latents also written
 * transposed into tiles of ATTN_I16_TILE positions; the queries and the probabilities quantised
 * to 15 bits (KVL_I16_MAX) per vector, the probabilities per tile. */
#define ATTN_I16_TILE 128
#define ATTN_I16_ROW_MAX 32767

static int attn_i16(const kvl_engine_text *t)
{
    return t->kv_dtype == KVL_KV_I16;
}

static size_t attn_i16_tiles(int max_context)
{
    return ((size_t)max_context + ATTN_I16_TILE - 1) / ATTN_I16_TILE;
}

/* One layer of a KVL_KV_I16 cache: rows int16 [C][lat + r], their scales f32 [C], the latents
 * in tiles int16 [ceil(C / ATTN_I16_TILE)][lat][ATTN_I16_TILE]; each part 64-byte aligned. */
typedef struct kv_i16_layer {
    int16_t *rows;
    float *scales;
    int16_t *tiles;
} kv_i16_layer;

static uint64_t a64(uint64_t bytes) { return (bytes + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN; }

static uint64_t kv_i16_layer_bytes(const kvl_text_hparams *hp, int max_context)
{
    uint64_t C = (uint64_t)max_context, lat = (uint64_t)hp->kv_lora;
    return a64(C * (lat + (uint64_t)hp->rope) * 2) + a64(C * 4) +
           a64((uint64_t)attn_i16_tiles(max_context) * ATTN_I16_TILE * lat * 2);
}

static kv_i16_layer kv_i16_at(const kvl_session *s, int layer)
{
    const kvl_text_hparams *hp = &s->engine->text->hp;
    uint64_t C = (uint64_t)s->max_context, kvrow = (uint64_t)(hp->kv_lora + hp->rope);
    char *base = (char *)s->kv + (uint64_t)(layer - s->engine->text->layer_begin) *
                                     kv_i16_layer_bytes(hp, s->max_context);
    kv_i16_layer l;
    l.rows = (int16_t *)(void *)base;
    l.scales = (float *)(void *)(base + a64(C * kvrow * 2));
    l.tiles = (int16_t *)(void *)(base + a64(C * kvrow * 2) + a64(C * 4));
    return l;
}

/* Per thread: scores (one row per head for one token, or one block of n_heads tokens), routing
 * scratch in the same place, two cache rows and a rope row; then, for attn_tiled, the
 * transposed context block [lat][n_heads] (attn_i16: one tile's context [n_heads][lat]) and one
 * head's W_uk transposed to [lat][nope] BF16; attn_i16 adds a block's quantised queries
 * [n_heads][lat + rope] int16 and probabilities [n_heads][ATTN_I16_TILE] int16 with their scales
 * (n_heads each). */
static size_t per_thread_floats(const kvl_engine_text *t, int max_context)
{
    const kvl_text_hparams *hp = &t->hp;
    size_t nh = (size_t)hp->n_heads, kvrow = (size_t)(hp->kv_lora + hp->rope);
    size_t scores = nh * (size_t)max_context;
    size_t routing = 3u * (size_t)hp->n_routed + (size_t)hp->n_group + 4u;
    size_t rows = 2u * kvrow + (size_t)hp->rope;
    size_t tiled = (size_t)hp->kv_lora * nh + ((size_t)hp->kv_lora * (size_t)hp->nope + 1u) / 2u;
    size_t i16 = attn_i16(t) ? align_up((nh * kvrow + 1u) / 2u, 4) + align_up(nh, 4) +
                                   nh * ATTN_I16_TILE / 2u + align_up(nh, 4)
                             : 0;
    return align_up((scores > routing ? scores : routing) + rows + tiled + i16, 16);
}

/* Session arena, for the RAM planner (kvl_session_bytes = this total + sizeof(struct kvl_session),
 * a few hundred bytes). Every piece is rounded up to 64 bytes (a64); B = max_batch (clamped to
 * max_context), C = max_context, T = pool threads, H = hidden, nh = heads, L = layers,
 * r = qk_rope_head_dim, lat = kv_lora_rank, W = the widest MLP (max of intermediate_size on
 * dense layers and (n_shared+1)*moe_intermediate on MoE layers), E = routed experts,
 * k = experts per token:
 *   KV      L*C*(lat+r)*(4 f32 | 2 bf16); i16: L*(a64(C*(lat+r)*2) + a64(C*4)
 *           + a64(ceil(C/128)*128*lat*2)) (kv_i16_layer_bytes)
 *   f32     x, xn, moe_out, xg, yg: B*H each; q: B*nh*(nope+r); a: B*(lat+r);
 *           qabs (absorbed q_nope + roped q_rope): B*nh*(lat+r); chat: B*nh*lat; o: B*nh*v;
 *           gate, up: B*W each; router logits B*E; weights B*k; the cached latents
 *           transposed for attn_tiled: lat*C (0 with an i16 cache)
 *   threads T * align16(max(nh*C, 3E + n_group + 4) + 2*(lat+r) + r + lat*nh
 *                       + ceil(lat*nope/2) + i) floats, i = 0 or with attn_i16
 *                       align4(ceil(nh*(lat+r)/2)) + 2*align4(nh) + nh*128/2
 *   ints    selected B*k, counts E+1, token list B*k, expert order E; embed row H uint16
 *   act_i16 (else 0, i.e. 64 bytes each) the quantised inputs of one pool run: int16
 *           B*w + 50*32 with w = max(2H, nh*v, W, lat), their scales f32
 *           B*(ceil(w/64) + 2) + 50 (act_workspace)
 *   ones    (an i16 cache; else 0, i.e. 64 bytes) f32 lat
 */
void kvl_session_layout_compute(const kvl_engine *engine, int max_context, int max_batch,
                                kvl_session_layout *out)
{
    const kvl_engine_text *t = engine->text;
    const kvl_text_hparams *hp = &t->hp;
    uint64_t B = (uint64_t)max_batch, H = (uint64_t)hp->hidden, nh = (uint64_t)hp->n_heads;
    uint64_t kvrow = (uint64_t)(hp->kv_lora + hp->rope);
    uint64_t elt = t->kv_dtype == KVL_KV_BF16 ? 2u : 4u;
    uint64_t nthreads = (uint64_t)kvl_pool_size(engine->pool);
    uint64_t sizes[L_COUNT];
    const int int_attn = attn_i16(t);
    const uint64_t L = (uint64_t)(t->layer_end - t->layer_begin);
    sizes[L_KV] = int_attn ? L * kv_i16_layer_bytes(hp, max_context) : L * (uint64_t)max_context * kvrow * elt;
    sizes[L_X] = B * H * 4;
    sizes[L_XN] = B * H * 4;
    sizes[L_Q] = B * nh * (size_t)(hp->nope + hp->rope) * 4;
    sizes[L_A] = B * kvrow * 4;
    sizes[L_QABS] = B * nh * kvrow * 4;
    sizes[L_CHAT] = B * nh * (size_t)hp->kv_lora * 4;
    sizes[L_O] = B * nh * (size_t)hp->v_dim * 4;
    sizes[L_GATE] = B * max_mlp_width(t) * 4;
    sizes[L_UP] = sizes[L_GATE];
    sizes[L_RLOG] = B * (size_t)hp->n_routed * 4;
    sizes[L_SELW] = B * (size_t)hp->topk * 4;
    sizes[L_MOE_OUT] = B * H * 4;
    sizes[L_XG] = B * H * 4;
    sizes[L_YG] = B * H * 4;
    sizes[L_THREAD] = nthreads * per_thread_floats(t, max_context) * 4;
    sizes[L_SELI] = B * (size_t)hp->topk * sizeof(int);
    sizes[L_ECOUNT] = ((size_t)hp->n_routed + 1) * sizeof(int);
    sizes[L_ELIST] = B * (size_t)hp->topk * sizeof(int);
    sizes[L_EORDER] = (size_t)hp->n_routed * sizeof(int);
    sizes[L_EMBED] = H * sizeof(uint16_t);
    const uint64_t C = (uint64_t)max_context, lat = (uint64_t)hp->kv_lora;
    sizes[L_KVT] = int_attn ? 0 : lat * C * 4;
    sizes[L_ONES] = int_attn ? lat * 4 : 0;
    uint64_t xq_elems, xs_elems;
    act_workspace(t, B, &xq_elems, &xs_elems);
    sizes[L_XQ] = xq_elems * sizeof(int16_t);
    sizes[L_XS] = xs_elems * 4;
    uint64_t off = 0;
    for (int i = 0; i < L_COUNT; i++) {
        uint64_t size = sizes[i] ? sizes[i] : 1;
        out->off[i] = off;
        off += (size + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    }
    out->total = off;
}

void kvl_session_bind(kvl_session *s, const kvl_session_layout *ly)
{
    char *base = (char *)s->arena;
    const kvl_text_hparams *hp = &s->engine->text->hp;
    s->kv = base + ly->off[L_KV];
    s->x = (float *)(base + ly->off[L_X]);
    s->xn = (float *)(base + ly->off[L_XN]);
    s->q = (float *)(base + ly->off[L_Q]);
    s->a = (float *)(base + ly->off[L_A]);
    s->qabs = (float *)(base + ly->off[L_QABS]);
    s->chat = (float *)(base + ly->off[L_CHAT]);
    s->o = (float *)(base + ly->off[L_O]);
    s->gate = (float *)(base + ly->off[L_GATE]);
    s->up = (float *)(base + ly->off[L_UP]);
    s->rlog = (float *)(base + ly->off[L_RLOG]);
    s->selw = (float *)(base + ly->off[L_SELW]);
    s->moe_out = (float *)(base + ly->off[L_MOE_OUT]);
    s->xg = (float *)(base + ly->off[L_XG]);
    s->yg = (float *)(base + ly->off[L_YG]);
    s->thread_scratch = (float *)(base + ly->off[L_THREAD]);
    s->per_thread = per_thread_floats(s->engine->text, s->max_context);
    s->seli = (int *)(base + ly->off[L_SELI]);
    s->ecount = (int *)(base + ly->off[L_ECOUNT]);
    s->elist = (int *)(base + ly->off[L_ELIST]);
    s->eorder = (int *)(base + ly->off[L_EORDER]);
    s->embed_row = (uint16_t *)(base + ly->off[L_EMBED]);
    s->kvt = (float *)(base + ly->off[L_KVT]);
    s->xq = (int16_t *)(void *)(base + ly->off[L_XQ]);
    s->xs = (float *)(void *)(base + ly->off[L_XS]);
    s->ones = (float *)(void *)(base + ly->off[L_ONES]);
    if (attn_i16(s->engine->text))
        for (int c = 0; c < hp->kv_lora; c++) s->ones[c] = 1.0f;
}

/* ---- parallel matmuls: row blocks of one or more products handed out dynamically ---------- */

/* MM_BF16, MM_Q8, MM_Q4 and MM_I16 are the Linear layers: with the engine's BF16 activation mode
 * they take BF16-rounded inputs (the *_xb kernels); with an integer mode (act_i16: I16X1 or I8),
 * MM_Q8, MM_Q4 and MM_I16 take inputs quantised to int16 once per run (mm_quantize) and run integer
 * products, while MM_BF16 (a streamed trunk tensor, which stays BF16) keeps the FP32 product.
 * MM_Q4 is a routed expert of a Q4_EXPERT pack (`kvl pack --expert-dtype q4`), its weights in the
 * matmul_q4 kernels' layout (q bytes [rows, cols/2], BF16 scale bits [rows, cols/32] in scale_q4).
 * MM_I16 is a resident trunk weight converted to int16 rows at open (act_i16 only).
 * MM_BF16_F32ACT always keeps FP32 inputs: the MoE router, which the checkpoint's own code runs in
 * FP32. */
enum { MM_BF16 = 0, MM_Q8 = 1, MM_BF16_F32ACT = 2, MM_I16 = 3, MM_Q4 = 4 };

/* Weight bytes a row of cols columns streams: a Q4 row is cols/2 q bytes and cols/32 BF16 scales */
static uint64_t mm_row_bytes(int kind, size_t cols)
{
    return kind == MM_Q8 ? (uint64_t)cols : kind == MM_Q4 ? (uint64_t)cols / 2 + (uint64_t)cols / 16
                                                         : 2u * (uint64_t)cols;
}

/* Segments per pool run: one layer's FFN at most uses shared gate+up plus gate+up of every
 * routed expert of a wave, and a wave holds at most MOE_WAVE_MAX experts. */
#define MOE_WAVE_MAX 24
#define MM_MAX_SEGS (2 * MOE_WAVE_MAX + 2)
/* Work items per thread: enough that the faster thread absorbs a slow one's lag, few enough that
 * each item is a long sequential stream (>= MM_MIN_ITEM_BYTES of weights). */
#define MM_ITEMS_PER_THREAD 16
#define MM_MIN_ITEM_BYTES (64u << 10)
/* act_i16: each quantised input starts on a 64-byte boundary of the workspace */
#define XQ_ALIGN 32u

typedef struct mm_seg {
    int kind;
    float *Y;
    size_t ldy;
    const void *W;
    const float *scale;
    const uint16_t *scale_q4; /* MM_Q4: BF16 scale bits [rows, cols/32] (scale is NULL) */
    size_t rows, cols;
    const float *X;
    size_t ldx, n;
    const int16_t *Xq;  /* act_i16: X quantised, n vectors [n, ldq]; scales xs [n, nb]: MM_Q8 and
                           MM_Q4 a scale per KVL_I16_BLOCK columns, MM_I16 one per vector (nb = 1) */
    const float *xs;
    size_t ldq;
    int expert;         /* a routed expert's weight (mm_add_expert): act_i8 makes its input 8-bit */
    size_t block_rows;  /* rows per work item */
    int first_item;     /* index of this segment's first work item */
} mm_seg;

typedef struct mm_job {
    const kvl_kernels *k;
    int act_bf16;       /* the engine's activation mode (KVL_ACT_BF16) */
    int act_i16;        /* KVL_ACT_I16X1 or KVL_ACT_I8: integer products */
    int act_i8;         /* KVL_ACT_I8: the routed experts' inputs 8-bit, matmul_q8_i8 */
    int16_t *xq;        /* act_i16: the session's workspace (act_workspace sizes it) */
    float *xs;
    size_t xq_cap, xs_cap;
    int n_seg, n_items;
    int seg_begin, seg_end; /* the segments of the current pool run */
    uint64_t bytes, macs;
    volatile int next;  /* next unclaimed work item */
    mm_seg seg[MM_MAX_SEGS];
} mm_job;

/* act_i16 workspace of a session with chunks of B tokens: int16 values and float scales (mm_quantize:
 * one int16 per input value, an MM_Q8 input with a scale per KVL_I16_BLOCK columns, an
 * MM_I16 input one per vector). One pool run quantises each distinct input once; the
 * largest run is the gate+up of a wave (the shared experts' n tokens of H plus every (token,
 * expert) pair's H: n + n*topk <= 2B vectors on "small" chunks, where n*topk <= B) or its down
 * products (n*R + n*topk*I <= B*W), else one input of B rows (o_proj: nh*v columns). Each input
 * may start XQ_ALIGN - 1 values late. A run that does not fit anyway is split into several pool
 * runs (mm_run), so this is a size for speed; what correctness relies on is that one input always
 * fits (mm_quantize takes a run's first one whatever its size): n <= B vectors of at most w
 * columns, w also covering attn_wuv_int's one head of kv_lora. */
static void act_workspace(const kvl_engine_text *t, uint64_t B, uint64_t *xq_elems,
                          uint64_t *xs_elems)
{
    const kvl_text_hparams *hp = &t->hp;
    uint64_t w = 2u * (uint64_t)hp->hidden;
    uint64_t o = (uint64_t)hp->n_heads * (uint64_t)hp->v_dim, m = (uint64_t)max_mlp_width(t);
    if (o > w) w = o;
    if (m > w) w = m;
    if ((uint64_t)hp->kv_lora > w) w = (uint64_t)hp->kv_lora;
    *xq_elems = t->act_i16 ? B * w + (uint64_t)MM_MAX_SEGS * XQ_ALIGN : 0;
    *xs_elems = t->act_i16 ? B * (kvl_i16_nblocks(w, KVL_I16_BLOCK) + 2u) + MM_MAX_SEGS : 0;
}

static void mm_init(mm_job *j, const kvl_session *s)
{
    const kvl_engine *e = s->engine;
    j->k = e->k;
    j->act_bf16 = e->text->act_bf16;
    j->act_i16 = e->text->act_i16;
    j->act_i8 = e->text->act_i8;
    j->xq = s->xq;
    j->xs = s->xs;
    uint64_t xq_cap, xs_cap;
    act_workspace(e->text, (uint64_t)s->max_batch, &xq_cap, &xs_cap);
    j->xq_cap = (size_t)xq_cap;
    j->xs_cap = (size_t)xs_cap;
    j->n_seg = 0;
    j->n_items = 0;
    j->bytes = 0;
    j->macs = 0;
    j->next = 0;
}

static void mm_add(mm_job *j, int kind, float *Y, size_t ldy, const void *W, const float *scale,
                   size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    mm_seg *g = &j->seg[j->n_seg++];
    g->kind = kind; g->Y = Y; g->ldy = ldy; g->W = W; g->scale = scale;
    g->rows = rows; g->cols = cols; g->X = X; g->ldx = ldx; g->n = n;
    g->scale_q4 = NULL;
    g->Xq = NULL; g->xs = NULL; g->ldq = cols;
    g->expert = 0;
    j->bytes += (uint64_t)rows * mm_row_bytes(kind, cols);
    j->macs += (uint64_t)rows * cols * n;
}

/* A routed expert's weight, one matrix of a pinned extent (dtype: the view's, Q8_EXPERT or
 * Q4_EXPERT; W and scale its q and scale sub-blocks). With act_i8 only these take 8-bit inputs:
 * on the test models, 8-bit inputs to a Q8 trunk as well moved the logits by 9.6 (the largest is
 * 25) where the experts alone moved them by 0.26 (test/trunk-q8-engine.test.ts), so the trunk
 * keeps its 16-bit term. */
static void mm_add_expert(mm_job *j, uint32_t dtype, float *Y, size_t ldy, const void *W,
                          const void *scale, size_t rows, size_t cols, const float *X, size_t ldx,
                          size_t n)
{
    if (dtype == KVL_DTYPE_Q4_EXPERT) {
        mm_add(j, MM_Q4, Y, ldy, W, NULL, rows, cols, X, ldx, n);
        j->seg[j->n_seg - 1].scale_q4 = (const uint16_t *)scale;
    } else {
        mm_add(j, MM_Q8, Y, ldy, W, (const float *)scale, rows, cols, X, ldx, n);
    }
    j->seg[j->n_seg - 1].expert = 1;
}

/* The f32 row scales of a Q8_ROWS record at w (int8 [rows, cols], then the scales) */
static const float *q8_rows_scale(const void *w, size_t rows, size_t cols)
{
    kvl_q8_rows_layout lay;
    kvl_q8_rows_layout_of(rows, cols, &lay);
    return (const float *)(const void *)((const char *)w + lay.scale);
}

/* A trunk Linear weight: a Q8_ROWS record (--trunk-dtype q8) as the experts are run, in every
 * activation mode; its int16 rows where act_i16 converted it at open (resident), else its BF16
 * data (resident, or the streamed copy, which keeps the FP32 product). */
static void mm_add_trunk(mm_job *j, const kvl_engine_text *t, int id, const uint16_t *w, float *Y,
                         size_t ldy, size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    const kvl_trunk_tensor *tt = &t->tt[id];
    if (tt->rec->dtype == KVL_DTYPE_Q8_ROWS)
        mm_add(j, MM_Q8, Y, ldy, w, q8_rows_scale(w, rows, cols), rows, cols, X, ldx, n);
    else if (tt->scale_i16 && w == tt->resident)
        mm_add(j, MM_I16, Y, ldy, w, tt->scale_i16, rows, cols, X, ldx, n);
    else
        mm_add(j, MM_BF16, Y, ldy, w, NULL, rows, cols, X, ldx, n);
}

/* Q8 and Q4 weights take inputs with a scale per KVL_I16_BLOCK columns (matmul_q8_i16 and
 * matmul_q4_i16 alike), int16 weights one per vector */
static int mm_blocked(const mm_seg *g)
{
    return g->kind == MM_Q8 || g->kind == MM_Q4;
}

static int mm_wants_i16(const mm_job *j, const mm_seg *g)
{
    return j->act_i16 && (mm_blocked(g) || g->kind == MM_I16);
}

/* act_i16: quantise the inputs of segments [first, ...) into the workspace, each distinct input
 * (same X, ldx, cols, n) once, on the calling thread before the workers start; returns the end
 * of the segments that fit (at least first + 1: one segment's input always fits). */
static int mm_quantize(mm_job *j, int first)
{
    size_t used = 0, used_s = 0;
    int i;
    for (i = first; i < j->n_seg; i++) {
        mm_seg *g = &j->seg[i];
        if (!mm_wants_i16(j, g)) continue;
        const int q8 = mm_blocked(g);
        const mm_seg *same = NULL;
        for (int p = first; p < i && !same; p++) {
            const mm_seg *h = &j->seg[p];
            if (h->Xq && mm_blocked(h) == q8 && h->expert == g->expert && h->X == g->X && h->ldx == g->ldx &&
                h->cols == g->cols && h->n == g->n)
                same = h;
        }
        if (same) {
            g->Xq = same->Xq; g->xs = same->xs; g->ldq = same->ldq;
            continue;
        }
        size_t off = (used + XQ_ALIGN - 1) / XQ_ALIGN * XQ_ALIGN;
        const size_t len = g->n * g->cols;
        /* Q8 and Q4 weights: a scale per KVL_I16_BLOCK columns and 16-bit range (matmul_q8_i16,
         * matmul_q4_i16), or 8-bit for the experts with act_i8 (matmul_q8_i8, matmul_q4_i8); int16
         * weights: one per vector and 15 bits (matmul_i16_i16's
         * exact groups) */
        const size_t block = q8 ? KVL_I16_BLOCK : g->cols;
        const int lim = !q8 ? KVL_I16_MAX : j->act_i8 && g->expert ? KVL_I8_MAX : KVL_I16_Q8_MAX;
        const size_t per = g->n * kvl_i16_nblocks(g->cols, block);
        if (i > first && (off + len > j->xq_cap || used_s + per > j->xs_cap)) break;
        int16_t *q = j->xq + off;
        float *xs = j->xs + used_s;
        j->k->quantize_i16_act(q, xs, g->X, g->cols, g->n, g->ldx, g->cols, block, lim);
        g->Xq = q; g->xs = xs; g->ldq = g->cols;
        used = off + len;
        used_s += per;
    }
    return i;
}

/* act_i16: rows [b, e) of an integer product on the quantised inputs */
static void mm_do_i16(const mm_job *j, const mm_seg *g, size_t b, size_t e)
{
    if (g->kind == MM_I16)
        j->k->matmul_i16_i16(g->Y + b, g->ldy, (const int16_t *)g->W + b * g->cols, g->scale + b, e - b,
                             g->cols, g->Xq, g->xs, g->ldq, g->n);
    else if (g->kind == MM_Q4)
        (j->act_i8 && g->expert ? j->k->matmul_q4_i8 : j->k->matmul_q4_i16)(
            g->Y + b, g->ldy, (const uint8_t *)g->W + b * (g->cols / 2), g->scale_q4 + b * (g->cols / 32),
            e - b, g->cols, g->Xq, g->xs, g->ldq, g->n);
    else
        (j->act_i8 && g->expert ? j->k->matmul_q8_i8 : j->k->matmul_q8_i16)(
            g->Y + b, g->ldy, (const int8_t *)g->W + b * g->cols, g->scale + b, e - b, g->cols, g->Xq, g->xs,
            g->ldq, g->n);
}

static void mm_do(const mm_job *j, const mm_seg *g, size_t b, size_t e)
{
    if (g->kind == MM_I16 || (mm_blocked(g) && j->act_i16))
        mm_do_i16(j, g, b, e);
    else if (g->kind == MM_Q4)
        (j->act_bf16 ? j->k->matmul_q4_xb : j->k->matmul_q4)(
            g->Y + b, g->ldy, (const uint8_t *)g->W + b * (g->cols / 2), g->scale_q4 + b * (g->cols / 32),
            e - b, g->cols, g->X, g->ldx, g->n);
    else if (g->kind == MM_Q8)
        (j->act_bf16 ? j->k->matmul_q8_xb : j->k->matmul_q8)(
            g->Y + b, g->ldy, (const int8_t *)g->W + b * g->cols, g->scale + b, e - b, g->cols, g->X,
            g->ldx, g->n);
    else
        (j->act_bf16 && g->kind == MM_BF16 ? j->k->matmul_bf16_xb : j->k->matmul_bf16)(
            g->Y + b, g->ldy, (const uint16_t *)g->W + b * g->cols, e - b, g->cols, g->X, g->ldx,
            g->n);
}

static void mm_worker(void *ctx, int ti, int nt)
{
    mm_job *j = (mm_job *)ctx;
    int s = j->seg_begin;
    (void)ti;
    (void)nt;
    for (;;) {
        int item = kvl_atomic_fetch_add(&j->next, 1);
        if (item >= j->n_items) return;
        /* items are claimed in increasing order, so the segment cursor only moves forward */
        while (s + 1 < j->seg_end && item >= j->seg[s + 1].first_item) s++;
        const mm_seg *g = &j->seg[s];
        size_t b = (size_t)(item - g->first_item) * g->block_rows;
        size_t e = b + g->block_rows < g->rows ? b + g->block_rows : g->rows;
        mm_do(j, g, b, e);
    }
}

/* Runs segments [j->seg_begin, j->seg_end): on the caller alone when the work is too small to
 * pay for a fork/join (routers, tiny models), else on the pool in row blocks. */
static void mm_run_segs(kvl_engine *e, mm_job *j)
{
    int nt = kvl_pool_size(e->pool);
    if (j->macs < SMALL_MATMUL_MACS || nt <= 1) {
        for (int i = j->seg_begin; i < j->seg_end; i++) mm_do(j, &j->seg[i], 0, j->seg[i].rows);
        return;
    }
    uint64_t item_bytes = j->bytes / ((uint64_t)nt * MM_ITEMS_PER_THREAD);
    if (item_bytes < MM_MIN_ITEM_BYTES) item_bytes = MM_MIN_ITEM_BYTES;
    int items = 0;
    for (int i = j->seg_begin; i < j->seg_end; i++) {
        mm_seg *g = &j->seg[i];
        uint64_t row_bytes = mm_row_bytes(g->kind, g->cols);
        size_t br = (size_t)(item_bytes / (row_bytes ? row_bytes : 1));
        br = br / ROW_ALIGN * ROW_ALIGN;
        if (br < ROW_ALIGN) br = ROW_ALIGN;
        if (br > g->rows) br = g->rows ? g->rows : 1;
        g->block_rows = br;
        g->first_item = items;
        items += (int)((g->rows + br - 1) / br);
    }
    j->n_items = items;
    j->next = 0; /* published to the workers by kvl_pool_run's release of the generation */
    kvl_pool_run(e->pool, mm_worker, j);
}

/* Runs every segment of j; with act_i16 the inputs are quantised first, in as many pool runs as
 * the workspace needs (one, as act_workspace sizes it). */
static void mm_run(kvl_engine *e, mm_job *j)
{
    for (int first = 0; first < j->n_seg;) {
        j->seg_begin = first;
        j->seg_end = j->act_i16 ? mm_quantize(j, first) : j->n_seg;
        mm_run_segs(e, j);
        first = j->seg_end;
    }
}

/* One product as its own run (the common case before fusion) */
static void par_mm(kvl_session *s, int kind, float *Y, size_t ldy, const void *W,
                   const float *scale, size_t rows, size_t cols, const float *X, size_t ldx,
                   size_t n)
{
    mm_job j;
    mm_init(&j, s);
    mm_add(&j, kind, Y, ldy, W, scale, rows, cols, X, ldx, n);
    mm_run(s->engine, &j);
}

/* One trunk Linear weight as its own run (mm_add_trunk) */
static void par_mm_trunk(kvl_session *s, int id, const uint16_t *w, float *Y, size_t ldy,
                         size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    mm_job j;
    mm_init(&j, s);
    mm_add_trunk(&j, s->engine->text, id, w, Y, ldy, rows, cols, X, ldx, n);
    mm_run(s->engine, &j);
}

/* RMSNorm of n rows (the weight was widened to f32 at open) */
static void norm_rows(float *y, const float *x, const float *w, size_t dim, int n, float eps)
{
    for (int i = 0; i < n; i++) kvl_rmsnorm(y + (size_t)i * dim, x + (size_t)i * dim, w, dim, eps);
}

/* ---- RoPE (spec §4.5): FP32 inv_freq and angle, de-interleaved rotate-half output --------- */

static void rope_apply(float *x, float *tmp, int dim, int pos, float theta)
{
    int half = dim / 2;
    for (int j = 0; j < half; j++) {
        float inv = 1.0f / powf(theta, (float)(2 * j) / (float)dim);
        float ang = (float)pos * inv;
        float c = cosf(ang), s = sinf(ang);
        float x0 = x[2 * j], x1 = x[2 * j + 1];
        tmp[j] = x0 * c - x1 * s;
        tmp[half + j] = x1 * c + x0 * s;
    }
    memcpy(x, tmp, (size_t)dim * sizeof(float));
}

/* ---- attention over heads ------------------------------------------------------------------ */

typedef struct attn_job {
    kvl_session *s;
    const uint16_t *kvb;   /* [n_heads*(nope+v), kv_lora] BF16; NULL when kvb_q is set */
    const int8_t *kvb_q;   /* a Q8_ROWS kv_b_proj (--trunk-dtype q8): int8 rows, same shape */
    const float *kvb_s;    /* ... and their f32 scales [n_heads*(nope+v)]; else NULL */
    const void *kv;        /* this layer's cache rows (f32 or bf16) */
    kv_i16_layer kvq;      /* ... or, with an i16 cache, its parts */
    int wuv_int;           /* W_uv left to attention(): a Q8 kv_b_proj with act_i16 (attn_wuv_int) */
    int n, pos0;
} attn_job;

static const float *kv_row(const attn_job *j, int pos, float *conv)
{
    const kvl_engine_text *t = j->s->engine->text;
    size_t kvrow = (size_t)(t->hp.kv_lora + t->hp.rope);
    if (t->kv_dtype != KVL_KV_BF16) return (const float *)j->kv + (size_t)pos * kvrow;
    j->s->engine->k->bf16_to_f32(conv, (const uint16_t *)j->kv + (size_t)pos * kvrow, kvrow);
    return conv;
}

/* attn_i16 scratch of one thread (per_thread_floats) */
typedef struct attn_i16_scratch {
    int16_t *qq; /* a block's queries [n_heads][lat + rope] */
    float *qs;   /* ... their scales [n_heads] */
    int16_t *aq; /* a block's probabilities of one tile [n_heads][ATTN_I16_TILE] */
    float *as;   /* ... their scales [n_heads] */
} attn_i16_scratch;

/* Attention on integer products (attn_i16) for nv query vectors: a block of one head's tokens
 * (attn_tiled) or one token's heads (attn_per_token). Vector i is the absorbed | roped query at
 * qabs + i * q_stride; it attends to positions 0 .. len0 + i * len_step - 1 (seen = the most
 * of them) and its context goes to chat + i * chat_stride. Scores = the int16 cached rows
 * (their scales kvq.scales) . the queries quantised per vector; FP32 softmax; then each
 * probability times its row's scale, quantised per vector and tile, times the tile's transposed
 * latents, added into the context tile by tile (ctmp: one tile's [nv][lat]). Positions past a
 * vector's own (and a partial tile's padding, whatever it holds) meet zero probabilities, so
 * they add exactly 0. */
static void attn_block_i16(const attn_job *j, const float *qabs, size_t q_stride, size_t nv,
                           size_t len0, size_t len_step, float *chat, size_t chat_stride,
                           float *scores, float *ctmp, const attn_i16_scratch *z)
{
    kvl_session *s = j->s;
    const kvl_kernels *k = s->engine->k;
    const kvl_text_hparams *hp = &s->engine->text->hp;
    const size_t kvl = (size_t)hp->kv_lora, kvrow = kvl + (size_t)hp->rope;
    const size_t seen = len0 + (nv - 1) * len_step;
    const float scale = 1.0f / sqrtf((float)(hp->nope + hp->rope));
    const kv_i16_layer *kq = &j->kvq;
    k->quantize_i16_act(z->qq, z->qs, qabs, kvrow, nv, q_stride, kvrow, kvrow, KVL_I16_MAX);
    k->matmul_i16_i16(scores, seen, kq->rows, kq->scales, seen, kvrow, z->qq, z->qs, kvrow, nv);
    for (size_t i = 0; i < nv; i++) {
        float *row = scores + i * seen;
        size_t len = len0 + i * len_step;
        for (size_t p = 0; p < len; p++) row[p] *= scale;
        k->softmax(row, len);
        for (size_t p = 0; p < len; p++) row[p] *= kq->scales[p];
        memset(row + len, 0, (seen - len) * 4);
        memset(chat + i * chat_stride, 0, kvl * 4);
    }
    for (size_t p0 = 0; p0 < seen; p0 += ATTN_I16_TILE) {
        size_t w = seen - p0 < ATTN_I16_TILE ? seen - p0 : ATTN_I16_TILE;
        k->quantize_i16_act(z->aq, z->as, scores + p0, w, nv, seen, ATTN_I16_TILE, w, KVL_I16_MAX);
        for (size_t i = 0; i < nv && w < ATTN_I16_TILE; i++)
            memset(z->aq + i * ATTN_I16_TILE + w, 0, (ATTN_I16_TILE - w) * sizeof(int16_t));
        k->matmul_i16_i16(ctmp, kvl, kq->tiles + p0 * kvl, s->ones, kvl, ATTN_I16_TILE, z->aq, z->as,
                          ATTN_I16_TILE, nv);
        for (size_t i = 0; i < nv; i++) {
            float *dst = chat + i * chat_stride;
            for (size_t c = 0; c < kvl; c++) dst[c] += ctmp[i * kvl + c];
        }
    }
}

/* Decode and short chunks, per token: the scores of this thread's heads against every cached
 * row as one matmul (rows = positions, vectors = the heads' absorbed | roped queries), then the
 * softmax-weighted sum of latents (axpy_rows_f32: register tiles of heads x latent columns).
 * With an i16 cache (z set) the same on integers: attn_block_i16 over the heads. */
static void attn_per_token(const attn_job *j, size_t hb, size_t he, float *scores,
                           float *conv, float *ctmp, const attn_i16_scratch *z)
{
    kvl_session *s = j->s;
    const kvl_kernels *k = s->engine->k;
    const kvl_text_hparams *hp = &s->engine->text->hp;
    const size_t nh = (size_t)hp->n_heads, kvl = (size_t)hp->kv_lora, nope = (size_t)hp->nope;
    const size_t rope = (size_t)hp->rope, kvrow = kvl + rope;
    const size_t ctx_len = (size_t)s->max_context;
    const float scale = 1.0f / sqrtf((float)(nope + rope));
    for (int t = 0; t < j->n; t++) {
        size_t P = (size_t)(j->pos0 + t); /* attends to positions 0..P */
        float *qt = s->qabs + (size_t)t * nh * kvrow;
        if (z) {
            attn_block_i16(j, qt + hb * kvrow, kvrow, he - hb, P + 1, 0, s->chat + ((size_t)t * nh + hb) * kvl,
                           kvl, scores, ctmp, z);
            continue;
        }
        if (s->engine->text->kv_dtype == KVL_KV_BF16)
            k->matmul_bf16(scores + hb * ctx_len, ctx_len, (const uint16_t *)j->kv, P + 1, kvrow,
                           qt + hb * kvrow, kvrow, he - hb);
        else
            k->matmul_f32(scores + hb * ctx_len, ctx_len, (const float *)j->kv, P + 1, kvrow,
                          qt + hb * kvrow, kvrow, he - hb);
        for (size_t h = hb; h < he; h++) {
            float *row = scores + h * ctx_len;
            for (size_t p = 0; p <= P; p++) row[p] *= scale;
            k->softmax(row, P + 1);
            memset(s->chat + ((size_t)t * nh + h) * kvl, 0, kvl * 4);
        }
        /* chat[h] += p[h][pos] * latent[pos], positions in order (as axpys); FP32 cache rows in
         * place, BF16 ones converted one at a time */
        float *chat = s->chat + ((size_t)t * nh + hb) * kvl;
        if (s->engine->text->kv_dtype != KVL_KV_BF16)
            k->axpy_rows_f32(chat, kvl, scores + hb * ctx_len, ctx_len, he - hb, (const float *)j->kv,
                             kvrow, P + 1, kvl);
        else
            for (size_t p = 0; p <= P; p++)
                k->axpy_rows_f32(chat, kvl, scores + hb * ctx_len + p, ctx_len, he - hb,
                                 kv_row(j, (int)p, conv), kvrow, 1, kvl);
    }
}

/* Prefill chunks: per head, blocks of n_heads tokens as two matmuls. Scores [token][position] =
 * cached rows (latent | rope key) . (absorbed query | roped query), the whole block against
 * positions 0..last of the block (later positions are dropped by the per-token softmax length
 * and zeroed); the context = probabilities . latents, computed transposed against s->kvt (the
 * latents as [lat][positions], built by attention()) so that both operands are read along
 * rows. The same sums as attn_per_token in another FP32 order; with attn_i16 (z set) each block
 * runs on integers instead (attn_block_i16). */
static void attn_tiled(const attn_job *j, size_t hb, size_t he, float *scores, float *chat_t,
                       uint16_t *wukt, int absorbed, const attn_i16_scratch *z)
{
    kvl_session *s = j->s;
    const kvl_kernels *k = s->engine->k;
    const kvl_text_hparams *hp = &s->engine->text->hp;
    const size_t nh = (size_t)hp->n_heads, kvl = (size_t)hp->kv_lora, nope = (size_t)hp->nope;
    const size_t rope = (size_t)hp->rope, qd = nope + rope, kvrow = kvl + rope;
    const size_t n = (size_t)j->n, pos0 = (size_t)j->pos0, ptot = pos0 + n;
    const float scale = 1.0f / sqrtf((float)(nope + rope));
    for (size_t h = hb; h < he; h++) {
        /* absorbed: the caller already put the absorbed queries in qabs (a Q8 kv_b_proj, whose
         * per-row scales do not survive this transposition) */
        for (size_t d = 0; d < nope && !absorbed; d++) {
            const uint16_t *wuk = j->kvb + h * (nope + (size_t)hp->v_dim) * kvl + d * kvl;
            for (size_t c = 0; c < kvl; c++) wukt[c * nope + d] = wuk[c];
        }
        if (!absorbed)
            k->matmul_bf16(s->qabs + h * kvrow, nh * kvrow, wukt, kvl, nope, s->q + h * qd, nh * qd, n);
        for (size_t t0 = 0; t0 < n; t0 += nh) {
            size_t tb = n - t0 < nh ? n - t0 : nh;
            size_t seen = pos0 + t0 + tb; /* positions the block's last token attends to */
            if (z) {
                attn_block_i16(j, s->qabs + (t0 * nh + h) * kvrow, nh * kvrow, tb, pos0 + t0 + 1, 1,
                               s->chat + (t0 * nh + h) * kvl, nh * kvl, scores, chat_t, z);
                continue;
            }
            const float *qb = s->qabs + (t0 * nh + h) * kvrow;
            if (s->engine->text->kv_dtype == KVL_KV_BF16)
                k->matmul_bf16(scores, seen, (const uint16_t *)j->kv, seen, kvrow, qb, nh * kvrow, tb);
            else
                k->matmul_f32(scores, seen, (const float *)j->kv, seen, kvrow, qb, nh * kvrow, tb);
            for (size_t i = 0; i < tb; i++) {
                float *row = scores + i * seen;
                size_t len = pos0 + t0 + i + 1;
                for (size_t p = 0; p < len; p++) row[p] *= scale;
                k->softmax(row, len);
                memset(row + len, 0, (seen - len) * 4);
            }
            k->matmul_f32(chat_t, tb, scores, tb, seen, s->kvt, ptot, kvl);
            for (size_t i = 0; i < tb; i++) {
                float *dst = s->chat + ((t0 + i) * nh + h) * kvl;
                for (size_t c = 0; c < kvl; c++) dst[c] = chat_t[c * tb + i];
            }
        }
    }
}

static void attn_worker(void *ctx, int ti, int nt)
{
    const attn_job *j = (const attn_job *)ctx;
    kvl_session *s = j->s;
    const kvl_kernels *k = s->engine->k;
    const kvl_text_hparams *hp = &s->engine->text->hp;
    size_t hb, he;
    kvl_split_range((size_t)hp->n_heads, 1, ti, nt, &hb, &he);
    if (hb >= he) return;
    const size_t nh = (size_t)hp->n_heads, kvl = (size_t)hp->kv_lora, nope = (size_t)hp->nope;
    const size_t rope = (size_t)hp->rope, vd = (size_t)hp->v_dim, qd = nope + rope;
    const size_t kvrow = kvl + rope;
    const size_t ctx_len = (size_t)s->max_context;
    float *scr = s->thread_scratch + (size_t)ti * s->per_thread;
    float *scores = scr;                          /* [n_heads][max_context] (own heads only) */
    size_t scores_len = nh * ctx_len;
    size_t routing_len = 3u * (size_t)hp->n_routed + (size_t)hp->n_group + 4u;
    float *rowbuf = scr + (scores_len > routing_len ? scores_len : routing_len);
    float *conv = rowbuf + kvrow;                 /* kv_lora + rope */
    float *rtmp = conv + kvrow;                   /* rope */
    float *chat_t = rtmp + rope;                  /* [kv_lora][n_heads] */
    uint16_t *wukt = (uint16_t *)(void *)(chat_t + kvl * nh); /* [kv_lora][nope] */
    float *zbase = chat_t + kvl * nh + (kvl * nope + 1u) / 2u; /* attn_i16 (per_thread_floats) */
    attn_i16_scratch zs;
    zs.qq = (int16_t *)(void *)zbase;
    zs.qs = zbase + align_up((nh * kvrow + 1u) / 2u, 4);
    zs.aq = (int16_t *)(void *)(zs.qs + align_up(nh, 4));
    zs.as = zs.qs + align_up(nh, 4) + nh * ATTN_I16_TILE / 2u;
    const attn_i16_scratch *z = attn_i16(s->engine->text) ? &zs : NULL;
    const int n = j->n;

    /* the roped q_rope goes next to the absorbed query: both paths score [latent | rope] rows */
    for (size_t h = hb; h < he; h++)
        for (int t = 0; t < n; t++) {
            float *qr = s->q + (size_t)t * nh * qd + h * qd + nope;
            rope_apply(qr, rtmp, (int)rope, j->pos0 + t, hp->rope_theta);
            memcpy(s->qabs + ((size_t)t * nh + h) * kvrow + kvl, qr, rope * 4);
        }
    if (n >= ATTN_TILED_MIN && !j->kvb_q) {
        attn_tiled(j, hb, he, scores, chat_t, wukt, 0, z);
    } else {
        for (size_t h = hb; h < he; h++) {
            /* absorb q_nope into latent space, one W_uk row (dequantised exactly, q * scale in
             * FP32, for a Q8 kv_b_proj) at a time */
            for (int t = 0; t < n; t++) memset(s->qabs + ((size_t)t * nh + h) * kvrow, 0, kvl * 4);
            for (size_t d = 0; d < nope; d++) {
                size_t r = h * (nope + vd) + d;
                if (j->kvb_q)
                    k->q8_to_f32(rowbuf, j->kvb_q + r * kvl, j->kvb_s[r], kvl);
                else
                    k->bf16_to_f32(rowbuf, j->kvb + r * kvl, kvl);
                for (int t = 0; t < n; t++)
                    k->axpy_f32(s->qabs + ((size_t)t * nh + h) * kvrow,
                                s->q[(size_t)t * nh * qd + h * qd + d], rowbuf, kvl);
            }
        }
        if (n >= ATTN_TILED_MIN)
            attn_tiled(j, hb, he, scores, chat_t, wukt, 1, z);
        else
            attn_per_token(j, hb, he, scores, conv, chat_t, z);
    }
    for (size_t h = hb; h < he && !j->wuv_int; h++) {
        size_t r = h * (nope + vd) + nope; /* W_uv: rows r .. r + vd of kv_b_proj */
        if (j->kvb_q)
            k->matmul_q8(s->o + h * vd, nh * vd, j->kvb_q + r * kvl, j->kvb_s + r, vd, kvl,
                         s->chat + h * kvl, nh * kvl, (size_t)n);
        else
            k->matmul_bf16(s->o + h * vd, nh * vd, j->kvb + r * kvl, vd, kvl, s->chat + h * kvl,
                           nh * kvl, (size_t)n);
    }
}

static void store_kv(kvl_session *s, int layer, int n, int pos0)
{
    const kvl_engine_text *t = s->engine->text;
    const kvl_text_hparams *hp = &t->hp;
    size_t kvl = (size_t)hp->kv_lora, kvrow = kvl + (size_t)hp->rope;
    size_t layer_rows = (size_t)s->max_context;
    float *tmp = s->thread_scratch; /* thread 0's scratch; no pool job is running */
    float *rtmp = tmp + kvrow;
    const int i16 = t->kv_dtype == KVL_KV_I16;
    const kv_i16_layer l = i16 ? kv_i16_at(s, layer) : (kv_i16_layer){NULL, NULL, NULL};
    for (int i = 0; i < n; i++) {
        float *a = s->a + (size_t)i * kvrow;
        kvl_rmsnorm(tmp, a, t->layers[layer].kva_ln, kvl, hp->kva_eps);
        memcpy(tmp + kvl, a + kvl, (size_t)hp->rope * 4);
        rope_apply(tmp + kvl, rtmp, hp->rope, pos0 + i, hp->rope_theta);
        size_t p = (size_t)(pos0 + i);
        if (i16) {
            /* the row once as int16 with its scale, its latents also into their tile's column */
            int16_t *q = l.rows + p * kvrow;
            s->engine->k->quantize_i16_act(q, l.scales + p, tmp, kvrow, 1, kvrow, kvrow, kvrow, ATTN_I16_ROW_MAX);
            int16_t *tile = l.tiles + (p / ATTN_I16_TILE) * ATTN_I16_TILE * kvl + p % ATTN_I16_TILE;
            for (size_t c = 0; c < kvl; c++) tile[c * ATTN_I16_TILE] = q[c];
            continue;
        }
        size_t idx = ((size_t)(layer - t->layer_begin) * layer_rows + p) * kvrow;
        if (t->kv_dtype == KVL_KV_BF16)
            s->engine->k->f32_to_bf16((uint16_t *)s->kv + idx, tmp, kvrow);
        else
            memcpy((float *)s->kv + idx, tmp, kvrow * 4);
    }
}

/* o = W_uv chat for every head, on a Q8 kv_b_proj with act_i16: as the trunk's other Q8 Linear
 * layers run (mm_run: the context quantised per KVL_I16_BLOCK columns, the integer product), not
 * the FP32 product attn_worker runs otherwise, which SIMD128 widens slowly (8 % of a WebAssembly
 * decode step, bench/RESULTS.md "8-bit activations", 2026-12-04). */
static void attn_wuv_int(kvl_session *s, const attn_job *j)
{
    const kvl_text_hparams *hp = &s->engine->text->hp;
    const size_t nh = (size_t)hp->n_heads, kvl = (size_t)hp->kv_lora, vd = (size_t)hp->v_dim;
    const size_t nope = (size_t)hp->nope;
    for (size_t h0 = 0; h0 < nh; h0 += MM_MAX_SEGS) {
        mm_job mj;
        mm_init(&mj, s);
        for (size_t h = h0; h < nh && h < h0 + MM_MAX_SEGS; h++) {
            size_t r = h * (nope + vd) + nope; /* W_uv: rows r .. r + vd of kv_b_proj */
            mm_add(&mj, MM_Q8, s->o + h * vd, nh * vd, j->kvb_q + r * kvl, j->kvb_s + r, vd, kvl,
                   s->chat + h * kvl, nh * kvl, (size_t)j->n);
        }
        mm_run(s->engine, &mj);
    }
}

static kvl_status attention(kvl_session *s, int layer, int n, int pos0)
{
    kvl_engine *e = s->engine;
    const kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    size_t H = (size_t)hp->hidden, nh = (size_t)hp->n_heads;
    size_t qd = (size_t)(hp->nope + hp->rope), kvrow = (size_t)(hp->kv_lora + hp->rope);
    const int base = layer * KVL_TT_PER_LAYER;
    const uint16_t *w;
    kvl_status st;

    norm_rows(s->xn, s->x, t->layers[layer].input_ln, H, n, hp->rms_eps);
    if (t->tt[base + KVL_TT_Q].resident && t->tt[base + KVL_TT_KVA].resident) {
        /* both read xn: one pool run over both weights */
        const uint16_t *wq, *wa;
        mm_job mj;
        if ((st = kvl_trunk_get(e, base + KVL_TT_Q, &wq)) != KVL_OK) return st;
        if ((st = kvl_trunk_get(e, base + KVL_TT_KVA, &wa)) != KVL_OK) return st;
        mm_init(&mj, s);
        mm_add_trunk(&mj, t, base + KVL_TT_Q, wq, s->q, nh * qd, nh * qd, H, s->xn, H, (size_t)n);
        mm_add_trunk(&mj, t, base + KVL_TT_KVA, wa, s->a, kvrow, kvrow, H, s->xn, H, (size_t)n);
        mm_run(e, &mj);
    } else {
        /* streamed: the double buffer holds one tensor for compute at a time */
        if ((st = kvl_trunk_get(e, base + KVL_TT_Q, &w)) != KVL_OK) return st;
        par_mm_trunk(s, base + KVL_TT_Q, w, s->q, nh * qd, nh * qd, H, s->xn, H, (size_t)n);
        if ((st = kvl_trunk_get(e, base + KVL_TT_KVA, &w)) != KVL_OK) return st;
        par_mm_trunk(s, base + KVL_TT_KVA, w, s->a, kvrow, kvrow, H, s->xn, H, (size_t)n);
    }
    store_kv(s, layer, n, pos0);
    if ((st = kvl_trunk_get(e, base + KVL_TT_KVB, &w)) != KVL_OK) return st;
    attn_job j;
    j.s = s; j.kvb = w; j.kvb_q = NULL; j.kvb_s = NULL; j.n = n; j.pos0 = pos0; j.wuv_int = 0;
    if (t->tt[base + KVL_TT_KVB].rec->dtype == KVL_DTYPE_Q8_ROWS) {
        size_t rows = nh * (size_t)(hp->nope + hp->v_dim);
        j.kvb = NULL;
        j.kvb_q = (const int8_t *)(const void *)w;
        j.kvb_s = q8_rows_scale(w, rows, (size_t)hp->kv_lora);
        j.wuv_int = t->act_i16;
    }
    memset(&j.kvq, 0, sizeof j.kvq);
    if (attn_i16(t)) {
        j.kv = NULL;
        j.kvq = kv_i16_at(s, layer); /* keeps its own transposed tiles */
    } else {
        size_t elt = t->kv_dtype == KVL_KV_BF16 ? 2u : 4u;
        j.kv = (const char *)s->kv + (size_t)(layer - t->layer_begin) * (size_t)s->max_context * kvrow * elt;
        if (n >= ATTN_TILED_MIN) {
            /* for attn_tiled: the cached latents transposed */
            size_t kvl = (size_t)hp->kv_lora, ptot = (size_t)(pos0 + n);
            float *conv = s->thread_scratch; /* no pool job is running */
            for (size_t p = 0; p < ptot; p++) {
                const float *row = kv_row(&j, (int)p, conv);
                for (size_t c = 0; c < kvl; c++) s->kvt[c * ptot + p] = row[c];
            }
        }
    }
    kvl_pool_run(e->pool, attn_worker, &j);
    if (j.wuv_int) attn_wuv_int(s, &j); /* before the O weight may take kv_b_proj's streaming buffer */
    if ((st = kvl_trunk_get(e, base + KVL_TT_O, &w)) != KVL_OK) return st;
    size_t od = nh * (size_t)hp->v_dim;
    par_mm_trunk(s, base + KVL_TT_O, w, s->xn, H, H, od, s->o, od, (size_t)n);
    for (size_t i = 0; i < (size_t)n * H; i++) s->x[i] += s->xn[i];
    return KVL_OK;
}

/* ---- MoE routing (spec §4.8) --------------------------------------------------------------- */

static void route_token(const kvl_text_hparams *hp, const float *logits, const float *bias,
                        float *scratch, int *out_idx, float *out_w)
{
    const int E = hp->n_routed;
    float *sig = scratch, *sel = scratch + E, *chosen = scratch + 2 * E;
    float *gscore = scratch + 3 * E;
    for (int e = 0; e < E; e++) {
        sig[e] = 1.0f / (1.0f + expf(-logits[e]));
        sel[e] = sig[e] + bias[e];
        chosen[e] = 0.0f;
    }
    if (hp->n_group > 1) {
        /* group score = sum of the two best biased scores of the group; experts outside the
         * topk_group best groups get 0.0 (the official masking value, not -inf) */
        const int gs = E / hp->n_group;
        for (int g = 0; g < hp->n_group; g++) {
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int e = g * gs; e < (g + 1) * gs; e++) {
                if (sel[e] > m1) { m2 = m1; m1 = sel[e]; }
                else if (sel[e] > m2) m2 = sel[e];
            }
            gscore[g] = gs >= 2 ? m1 + m2 : m1;
        }
        /* mark kept groups by setting their score to +inf, one best group at a time */
        for (int r = 0; r < hp->topk_group; r++) {
            int best = -1;
            for (int g = 0; g < hp->n_group; g++)
                if (gscore[g] != INFINITY && (best < 0 || gscore[g] > gscore[best])) best = g;
            gscore[best] = INFINITY;
        }
        for (int e = 0; e < E; e++)
            if (gscore[e / gs] != INFINITY) sel[e] = 0.0f;
    }
    float sum = 0.0f;
    for (int k = 0; k < hp->topk; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (chosen[e] == 0.0f && (best < 0 || sel[e] > sel[best])) best = e;
        chosen[best] = 1.0f;
        out_idx[k] = best;
        out_w[k] = sig[best];
        sum += sig[best];
    }
    for (int k = 0; k < hp->topk; k++) {
        if (hp->topk > 1 && hp->norm_topk) out_w[k] /= (sum + 1e-20f);
        out_w[k] *= hp->routed_scale;
    }
}

/* ---- routing override (kvl_session_set_routing: kvl bench --routing, never chat or serve) ---
 * After the router has chosen (seli/selw of the chunk), UNIFORM replaces each token's experts by
 * topk distinct uniform draws and GIVEN by the caller's row; MODEL and UNIFORM write what was
 * taken into the caller's rows when there are any. Weights of replaced experts are the router's
 * own scores of them (sigmoid, normalised over the chosen, scaled), as route_token makes them, so
 * the magnitudes of the MoE output stay those of the model. No allocation. */

/* splitmix64's finaliser: the uniform draws are a pure function of (seed, position, layer, draw) */
static uint64_t routing_mix(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void route_weights(const kvl_text_hparams *hp, const float *logits, const int *idx, float *out_w)
{
    float sum = 0.0f;
    for (int k = 0; k < hp->topk; k++) {
        out_w[k] = 1.0f / (1.0f + expf(-logits[idx[k]]));
        sum += out_w[k];
    }
    for (int k = 0; k < hp->topk; k++) {
        if (hp->topk > 1 && hp->norm_topk) out_w[k] /= (sum + 1e-20f);
        out_w[k] *= hp->routed_scale;
    }
}

static kvl_status route_override(kvl_session *s, int layer, int n)
{
    kvl_engine *e = s->engine;
    const kvl_text_hparams *hp = &e->text->hp;
    const int E = hp->n_routed, K = hp->topk;
    for (int i = 0; i < n; i++) {
        int *idx = s->seli + (size_t)i * K;
        float *w = s->selw + (size_t)i * K;
        const float *logits = s->rlog + (size_t)i * E;
        const size_t row = ((size_t)(s->routing_row0 + i) * (size_t)hp->n_layers + (size_t)layer) * (size_t)K;
        if (s->routing_mode == KVL_ROUTING_UNIFORM) {
            uint64_t key = ((uint64_t)s->routing_seed << 32) ^ ((uint64_t)(uint32_t)(s->position + i) << 8) ^
                           (uint64_t)(uint32_t)layer;
            for (int k = 0; k < K; k++) {
                int x, dup;
                do { /* rejection keeps the k draws distinct and uniform (K << E) */
                    key = routing_mix(key);
                    x = (int)((key >> 11) % (uint64_t)E);
                    dup = 0;
                    for (int j = 0; j < k; j++) dup |= idx[j] == x;
                } while (dup);
                idx[k] = x;
            }
            route_weights(hp, logits, idx, w);
        } else if (s->routing_mode == KVL_ROUTING_GIVEN) {
            const int32_t *gi = s->routing_ids + row;
            const float *gw = s->routing_w + row;
            for (int k = 0; k < K; k++) {
                int x = (int)gi[k], dup = 0;
                for (int j = 0; j < k; j++) dup |= idx[j] == x;
                if (x < 0 || x >= E || dup)
                    return kvl_engine_fail(e, KVL_ERR_INVALID_ARG, "given routing of token %d, "
                                           "layer %d: expert %d is %s", s->routing_row0 + i, layer, x,
                                           dup ? "chosen twice" : "outside [0, n_routed)");
                idx[k] = x;
            }
            if (isnan(gw[0])) route_weights(hp, logits, idx, w);
            else memcpy(w, gw, (size_t)K * sizeof(float));
            continue;
        }
        if (s->routing_ids) {
            for (int k = 0; k < K; k++) s->routing_ids[row + (size_t)k] = idx[k];
            memcpy(s->routing_w + row, w, (size_t)K * sizeof(float));
        }
    }
    return KVL_OK;
}

static int trunk_resident3(const kvl_engine_text *t, int base)
{
    return t->tt[base + KVL_TT_MLP_GATE].resident && t->tt[base + KVL_TT_MLP_UP].resident &&
           t->tt[base + KVL_TT_MLP_DOWN].resident;
}

/* gate/up/down SwiGLU over n tokens with streamed/resident BF16 weights; result in Y [n, H] */
static kvl_status dense_mlp(kvl_session *s, int layer, int n, float *Y)
{
    kvl_engine *e = s->engine;
    const kvl_engine_text *t = e->text;
    size_t H = (size_t)t->hp.hidden, R = (size_t)t->layers[layer].mlp_rows;
    const int base = layer * KVL_TT_PER_LAYER;
    const uint16_t *w;
    kvl_status st;
    if (t->tt[base + KVL_TT_MLP_GATE].resident && t->tt[base + KVL_TT_MLP_UP].resident) {
        const uint16_t *wg, *wu;
        mm_job mj;
        if ((st = kvl_trunk_get(e, base + KVL_TT_MLP_GATE, &wg)) != KVL_OK) return st;
        if ((st = kvl_trunk_get(e, base + KVL_TT_MLP_UP, &wu)) != KVL_OK) return st;
        mm_init(&mj, s);
        mm_add_trunk(&mj, t, base + KVL_TT_MLP_GATE, wg, s->gate, R, R, H, s->xn, H, (size_t)n);
        mm_add_trunk(&mj, t, base + KVL_TT_MLP_UP, wu, s->up, R, R, H, s->xn, H, (size_t)n);
        mm_run(e, &mj);
    } else {
        if ((st = kvl_trunk_get(e, base + KVL_TT_MLP_GATE, &w)) != KVL_OK) return st;
        par_mm_trunk(s, base + KVL_TT_MLP_GATE, w, s->gate, R, R, H, s->xn, H, (size_t)n);
        if ((st = kvl_trunk_get(e, base + KVL_TT_MLP_UP, &w)) != KVL_OK) return st;
        par_mm_trunk(s, base + KVL_TT_MLP_UP, w, s->up, R, R, H, s->xn, H, (size_t)n);
    }
    kvl_silu_mul(s->gate, s->up, (size_t)n * R);
    if ((st = kvl_trunk_get(e, base + KVL_TT_MLP_DOWN, &w)) != KVL_OK) return st;
    par_mm_trunk(s, base + KVL_TT_MLP_DOWN, w, Y, H, H, R, s->gate, R, (size_t)n);
    return KVL_OK;
}

/* ---- routed experts in waves -----------------------------------------------------------------
 * A wave is a set of pinned experts (optionally with the resident shared experts) computed with
 * two pool runs: gate+up of all members, then down of all members. Expert x's (token, slot) pairs
 * are elist[ecount[x] .. ecount[x+1]).
 * "Small" chunks (n*topk <= max_batch: decode and short prompts) give every pair its own row in
 * gate/up (after the shared experts' n*R rows), xg and yg, so experts can be computed in the order
 * their extents become available and still be summed into moe_out in ascending expert order at
 * the end — the same order as a sequential pass, so results do not depend on I/O timing.
 * Larger chunks take experts one at a time in ascending order (rows from 0), each summed at once. */
typedef struct moe_wave {
    int n;
    int x[MOE_WAVE_MAX];
    kvl_expert_view v[MOE_WAVE_MAX];
} moe_wave;

static void moe_wave_run(kvl_session *s, int layer, int n, const moe_wave *wv, int with_shared,
                         int small)
{
    kvl_engine *e = s->engine;
    const kvl_engine_text *t = e->text;
    const size_t H = (size_t)t->hp.hidden, I = (size_t)t->hp.moe_intermediate;
    const size_t R = (size_t)t->layers[layer].mlp_rows;
    const int base = layer * KVL_TT_PER_LAYER;
    const size_t K = (size_t)t->hp.topk;
    float *gbase = s->gate + (small ? (size_t)n * R : 0), *ubase = s->up + (small ? (size_t)n * R : 0);
    mm_job mj;
    mm_init(&mj, s);
    if (with_shared) {
        /* resident (the caller checked), so kvl_trunk_get cannot fail or stream */
        mm_add_trunk(&mj, t, base + KVL_TT_MLP_GATE, t->tt[base + KVL_TT_MLP_GATE].resident, s->gate,
                     R, R, H, s->xn, H, (size_t)n);
        mm_add_trunk(&mj, t, base + KVL_TT_MLP_UP, t->tt[base + KVL_TT_MLP_UP].resident, s->up, R, R,
                     H, s->xn, H, (size_t)n);
    }
    for (int i = 0; i < wv->n; i++) {
        int x = wv->x[i];
        size_t b = (size_t)s->ecount[x], cnt = (size_t)(s->ecount[x + 1] - s->ecount[x]);
        size_t off = small ? b : 0;
        /* one token needs no copy; several were gathered into xg rows off.. */
        const float *X = cnt == 1 ? s->xn + (size_t)(s->elist[b] / (int)K) * H : s->xg + off * H;
        const kvl_expert_view *v = &wv->v[i];
        mm_add_expert(&mj, v->dtype, gbase + off * I, I, v->gate_q, v->gate_s, I, H, X, H, cnt);
        mm_add_expert(&mj, v->dtype, ubase + off * I, I, v->up_q, v->up_s, I, H, X, H, cnt);
    }
    mm_run(e, &mj);
    if (with_shared) kvl_silu_mul(s->gate, s->up, (size_t)n * R);
    mm_init(&mj, s);
    if (with_shared)
        mm_add_trunk(&mj, t, base + KVL_TT_MLP_DOWN, t->tt[base + KVL_TT_MLP_DOWN].resident,
                     s->moe_out, H, H, R, s->gate, R, (size_t)n);
    for (int i = 0; i < wv->n; i++) {
        int x = wv->x[i];
        size_t b = (size_t)s->ecount[x], cnt = (size_t)(s->ecount[x + 1] - s->ecount[x]);
        size_t off = small ? b : 0;
        kvl_silu_mul(gbase + off * I, ubase + off * I, cnt * I);
        mm_add_expert(&mj, wv->v[i].dtype, s->yg + off * H, H, wv->v[i].down_q, wv->v[i].down_s, H, I,
                      gbase + off * I, I, cnt);
    }
    mm_run(e, &mj);
    for (int i = 0; i < wv->n; i++) kvl_expert_cache_release(t->ecache, layer, wv->x[i]);
}

/* moe_out[token] += weight * yg row, for expert x's pairs (rows from row0) */
static void moe_accumulate(kvl_session *s, int x, size_t row0)
{
    const kvl_engine_text *t = s->engine->text;
    const size_t H = (size_t)t->hp.hidden;
    const int K = t->hp.topk;
    int b = s->ecount[x], cnt = s->ecount[x + 1] - b;
    for (int g = 0; g < cnt; g++) {
        int p = s->elist[b + g];
        s->engine->k->axpy_f32(s->moe_out + (size_t)(p / K) * H, s->selw[p],
                               s->yg + (row0 + (size_t)g) * H, H);
    }
}

static kvl_status acquire_failed(kvl_engine *e, kvl_status st, int layer, int x)
{
    if (st == KVL_ERR_CORRUPT) {
        char name[96];
        snprintf(name, sizeof name, "language_model.model.layers.%d.mlp.experts.%d", layer, x);
        return kvl_engine_corrupt(e, "experts.bin", name);
    }
    char what[64];
    snprintf(what, sizeof what, "expert %d of layer %d", x, layer);
    return kvl_engine_read_failed(e, st, e->experts, what);
}

/* ---- lookahead: the next layer's experts, read while this layer computes ------------------
 * Decoding at low RAM waits on the disk: a layer's misses are read only once it routes. So while
 * layer L runs (its own routing and prefetch issued, its experts not yet computed), layer L+1's
 * router is applied to the current hidden state — the residual after L's attention, normed with
 * L+1's post-attention RMSNorm weight — and the experts route_token picks there are read ahead
 * at low priority (kvl_expert_cache_lookahead: behind L's reads, never evicting what L wants or
 * has pinned, cancelled or evicted first when L+1 routes elsewhere). The residual still lacks
 * L's FFN output, so this is a guess; it only decides which extents are read, never what is
 * computed, so results are bit-identical with it on or off (t->lookahead; kvl_engine_options
 * expert_lookahead). Only for layers of this engine's range (a split's next range has its own
 * cache). Prompt chunks predict too, the union of their tokens' guesses: on the full-size Q8
 * pack at --ram-mib 4096 (2026-12-05, 2-vCPU AMD EPYC VM, native, interleaved runs on a busy
 * machine) that read 1-3 % more bytes and cut the cold prompt's wait for expert reads from
 * 1.7-2.1 s to 1.4-1.6 s (16 tokens) and from 0.3-2.7 s to 0.03-0.34 s (128 tokens), where
 * decode-only prediction left it as it was.
 * Scratch: everything it writes is free at this point of ffn / moe and rewritten before its
 * next use: xg (the normed rows), rlog (router logits), thread 0's routing scratch, seli (the
 * guesses, deduplicated in place) and yg (each token's discarded top-k weights). */
/* Whether reading ahead is worth its reads. A guess the layer does not route to is a wasted
 * read of a whole extent, taken from the disk's time when the disk is the limit. The router of
 * the next layer guesses well when routing follows the hidden state (the model's own: 76-81 % of
 * what it read was used on the full-size Q8 pack), and no better than chance when it does not:
 * under kvl bench --routing uniform or a trace it read 128 extents a token of which 6-9 % were
 * used, and 0.3-0.4 GB a token went to waste (bench/RESULTS.md "Routing a trained model would
 * produce"). So the read-ahead keeps its own precision (distinct guesses the layer then routed
 * to, over the last ~LA_WINDOW guesses) and reads ahead only while at least 30 % were right. It
 * keeps guessing (one router product per layer, no reads) and scoring its guesses while it does
 * not read, so it reads again as soon as routing becomes predictable again. (A first version
 * read on every 8th guess to notice that; those reads were 7-11 wasted extents a token.) It
 * decides which extents are read, never what is computed. */
static int lookahead_worth_it(const kvl_engine_text *t)
{
    if (t->hp.n_routed > LA_MAX_EXPERTS || t->la_guessed < 32) return 1;
    return 10u * t->la_right >= 3u * t->la_guessed;
}

/* After layer routes: how many of the read-ahead's distinct guesses for it were right. */
static void lookahead_score(kvl_session *s, int layer, int n_used)
{
    kvl_engine_text *t = s->engine->text;
    if (t->la_layer != layer) return;
    int right = 0;
    for (int u = 0; u < n_used; u++) right += t->la_guess[s->eorder[u]];
    t->la_guessed += (uint32_t)t->la_pending;
    t->la_right += (uint32_t)right;
    if (t->la_guessed > LA_WINDOW) {
        t->la_guessed >>= 1;
        t->la_right >>= 1;
    }
    t->la_layer = -1;
}

static void predict_next(kvl_session *s, int layer, int n)
{
    kvl_engine_text *t = s->engine->text;
    const int next = layer + 1;
    if (!t->lookahead || next >= t->layer_end || !t->layers[next].is_moe) return;
    const kvl_text_hparams *hp = &t->hp;
    const kvl_layer_globals *lg = &t->layers[next];
    const size_t H = (size_t)hp->hidden, E = (size_t)hp->n_routed, K = (size_t)hp->topk;
    norm_rows(s->xg, s->x, lg->post_ln, H, n, hp->rms_eps);
    par_mm(s, MM_BF16_F32ACT, s->rlog, E, lg->router_w, NULL, E, H, s->xg, H, (size_t)n);
    int m = 0; /* distinct guesses so far, in seli[0..m); m <= i * K before token i */
    for (int i = 0; i < n; i++) {
        int *idx = s->seli + (size_t)i * K;
        route_token(hp, s->rlog + (size_t)i * E, lg->router_bias, s->thread_scratch, idx, s->yg);
        for (size_t k = 0; k < K; k++) {
            int x = idx[k], seen = 0;
            for (int j = 0; j < m && !seen; j++) seen = s->seli[j] == x;
            if (!seen) s->seli[m++] = x;
        }
    }
    /* A prompt chunk (n > 1) routes each layer to most of its experts, so its guesses are right
     * whatever the routing: it reads ahead and is not scored. Scored, a prompt turned reading ahead
     * back on for the first decode steps after it, where routing the hidden state does not predict
     * wasted ~13 extents a token (bench/RESULTS.md "Low RAM against the bounds"). */
    if (n > 1 || lookahead_worth_it(t)) kvl_expert_cache_lookahead(t->ecache, next, s->seli, m);
    t->la_layer = -1;
    if (n == 1 && hp->n_routed <= LA_MAX_EXPERTS) {
        memset(t->la_guess, 0, (size_t)hp->n_routed);
        for (int j = 0; j < m; j++) t->la_guess[s->seli[j]] = 1;
        t->la_layer = next;
        t->la_pending = m;
    }
}

static kvl_status moe(kvl_session *s, int layer, int n)
{
    kvl_engine *e = s->engine;
    const kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    const kvl_layer_globals *lg = &t->layers[layer];
    const size_t H = (size_t)hp->hidden, E = (size_t)hp->n_routed, K = (size_t)hp->topk;
    const int base = layer * KVL_TT_PER_LAYER;
    kvl_status st;

    par_mm(s, MM_BF16_F32ACT, s->rlog, E, lg->router_w, NULL, E, H, s->xn, H, (size_t)n);
    for (int i = 0; i < n; i++)
        route_token(hp, s->rlog + (size_t)i * E, lg->router_bias, s->thread_scratch,
                    s->seli + (size_t)i * K, s->selw + (size_t)i * K);
    if (s->routing_mode != KVL_ROUTING_MODEL || s->routing_ids)
        if ((st = route_override(s, layer, n)) != KVL_OK) return st;
    /* group (token, slot) pairs by expert: counting sort into elist */
    memset(s->ecount, 0, (E + 1) * sizeof(int));
    for (size_t p = 0; p < (size_t)n * K; p++) s->ecount[s->seli[p] + 1]++;
    int n_used = 0;
    for (size_t x = 0; x < E; x++) {
        if (s->ecount[x + 1] > 0) s->eorder[n_used++] = (int)x;
        s->ecount[x + 1] += s->ecount[x];
    }
    {
        /* stable placement: ecount[x] serves as bucket x's cursor, then is shifted back */
        for (size_t p = 0; p < (size_t)n * K; p++) {
            int x = s->seli[p];
            s->elist[s->ecount[x]++] = (int)p;
        }
        for (size_t x = E; x > 0; x--) s->ecount[x] = s->ecount[x - 1];
        s->ecount[0] = 0;
    }
    kvl_expert_cache_prefetch(t->ecache, layer, s->eorder, n_used);
    lookahead_score(s, layer, n_used);
    predict_next(s, layer, n); /* seli is free now: elist holds the pairs */

    /* the shared experts run while the routed experts load: fused into the first wave when
     * resident, else streamed on their own now */
    int shared_pending = lg->mlp_rows > 0 && trunk_resident3(t, base);
    if (lg->mlp_rows > 0 && !shared_pending) {
        st = dense_mlp(s, layer, n, s->moe_out);
        if (st != KVL_OK) return st;
    } else if (lg->mlp_rows == 0) {
        memset(s->moe_out, 0, (size_t)n * H * 4);
    }
    if (shared_pending) {
        /* resident, so these only count the trunk hits; moe_wave_run reads tt[].resident */
        const uint16_t *w;
        for (int i = KVL_TT_MLP_GATE; i <= KVL_TT_MLP_DOWN; i++)
            if ((st = kvl_trunk_get(e, base + i, &w)) != KVL_OK) return st;
    }
    moe_wave wv;
    const int small = (size_t)n * K <= (size_t)s->max_batch;
    if (!small) {
        if (shared_pending) {
            wv.n = 0;
            moe_wave_run(s, layer, n, &wv, 1, 0);
        }
        for (int u = 0; u < n_used; u++) {
            int x = s->eorder[u];
            int b = s->ecount[x], cnt = s->ecount[x + 1] - b;
            st = kvl_expert_cache_acquire(t->ecache, layer, x, &wv.v[0]);
            if (st != KVL_OK) return acquire_failed(e, st, layer, x);
            if (cnt > 1)
                for (int g = 0; g < cnt; g++)
                    memcpy(s->xg + (size_t)g * H, s->xn + (size_t)(s->elist[b + g] / (int)K) * H,
                           H * 4);
            wv.n = 1;
            wv.x[0] = x;
            moe_wave_run(s, layer, n, &wv, 0, 0);
            moe_accumulate(s, x, 0);
        }
        return KVL_OK;
    }
    /* small: gather the pairs of experts that several tokens chose, then waves in order of
     * availability; eorder[0..done) are the experts already computed */
    for (int u = 0; u < n_used; u++) {
        int x = s->eorder[u];
        int b = s->ecount[x], cnt = s->ecount[x + 1] - b;
        if (cnt > 1)
            for (int g = 0; g < cnt; g++)
                memcpy(s->xg + (size_t)(b + g) * H,
                       s->xn + (size_t)(s->elist[b + g] / (int)K) * H, H * 4);
    }
    int done = 0;
    while (done < n_used || shared_pending) {
        wv.n = 0;
        if (!shared_pending) {
            /* a wave needs one expert: the earliest-queued one, waiting for its read if needed
             * (nothing else is left to overlap with) */
            int x = s->eorder[done];
            if (!kvl_expert_cache_try_acquire(t->ecache, layer, x, &wv.v[0])) {
                st = kvl_expert_cache_acquire(t->ecache, layer, x, &wv.v[0]);
                if (st != KVL_OK) return acquire_failed(e, st, layer, x);
            }
            wv.x[0] = x;
            wv.n = 1;
        }
        /* take every other member that is ready now, keeping eorder[done + wv.n ..) in order */
        for (int u = done + wv.n; u < n_used && wv.n < MOE_WAVE_MAX; u++) {
            int x = s->eorder[u];
            if (!kvl_expert_cache_try_acquire(t->ecache, layer, x, &wv.v[wv.n])) continue;
            memmove(s->eorder + done + wv.n + 1, s->eorder + done + wv.n,
                    (size_t)(u - done - wv.n) * sizeof(int));
            s->eorder[done + wv.n] = x;
            wv.x[wv.n++] = x;
        }
        moe_wave_run(s, layer, n, &wv, shared_pending, 1);
        shared_pending = 0;
        done += wv.n;
    }
    /* ascending expert order, as a sequential pass would add them */
    for (size_t x = 0; x < E; x++)
        if (s->ecount[x + 1] > s->ecount[x]) moe_accumulate(s, (int)x, (size_t)s->ecount[x]);
    return KVL_OK;
}

static kvl_status ffn(kvl_session *s, int layer, int n)
{
    const kvl_engine_text *t = s->engine->text;
    size_t H = (size_t)t->hp.hidden;
    kvl_status st;
    norm_rows(s->xn, s->x, t->layers[layer].post_ln, H, n, t->hp.rms_eps);
    if (t->layers[layer].is_moe) {
        st = moe(s, layer, n);
    } else {
        predict_next(s, layer, n); /* a dense layer (layer 0) computes while layer 1's guesses load */
        st = dense_mlp(s, layer, n, s->moe_out);
    }
    if (st != KVL_OK) return st;
    for (size_t i = 0; i < (size_t)n * H; i++) s->x[i] += s->moe_out[i];
    return KVL_OK;
}

kvl_status kvl_model_forward(kvl_session *s, const int32_t *tokens, const float *hidden_in, int n,
                             const float *media, int *media_cursor, float *hidden_out,
                             int logits_mode, float *logits)
{
    kvl_engine *e = s->engine;
    kvl_engine_text *t = e->text;
    const kvl_text_hparams *hp = &t->hp;
    const size_t H = (size_t)hp->hidden, V = (size_t)hp->vocab;
    const int pos0 = s->position;
    kvl_status st;

    if (hidden_in) memcpy(s->x, hidden_in, (size_t)n * H * 4);
    for (int i = 0; !hidden_in && i < n; i++) {
        float *dst = s->x + (size_t)i * H;
        if (media && tokens[i] == hp->media_token) {
            memcpy(dst, media + (size_t)(*media_cursor)++ * H, H * 4);
            continue;
        }
        st = kvl_store_read_small(e->trunk, t->embed->offset + (uint64_t)tokens[i] * H * 2, H * 2,
                                  s->embed_row);
        if (st != KVL_OK) {
            char what[64];
            snprintf(what, sizeof what, "the embedding row of token %d", (int)tokens[i]);
            return kvl_engine_read_failed(e, st, e->trunk, what);
        }
        e->k->bf16_to_f32(dst, s->embed_row, H);
    }
    for (int l = t->layer_begin; l < t->layer_end; l++) {
        if (kvl_atomic_load(&s->cancel_flag) ||
            (s->cancel_watch && kvl_atomic_load((volatile int *)s->cancel_watch)))
            return kvl_engine_fail(e, KVL_ERR_CANCELLED, "cancelled; the session is rolled back");
        if ((st = attention(s, l, n, pos0)) != KVL_OK) return st;
        if ((st = ffn(s, l, n)) != KVL_OK) return st;
    }
    if (logits_mode != KVL_LOGITS_NONE) {
        int first = logits_mode == KVL_LOGITS_ALL ? 0 : n - 1;
        int m = n - first;
        norm_rows(s->xn + (size_t)first * H, s->x + (size_t)first * H, t->final_norm, H, m,
                  hp->rms_eps);
        par_mm(s, t->lm_head_scale ? MM_I16 : t->lm_head_q8_scale ? MM_Q8 : MM_BF16, logits, V,
               t->lm_head, t->lm_head_scale ? t->lm_head_scale : t->lm_head_q8_scale, V,
               H, s->xn + (size_t)first * H, H,
               (size_t)m);
    }
    if (hidden_out) memcpy(hidden_out, s->x, (size_t)n * H * 4);
    s->position = pos0 + n;
    return KVL_OK;
}
