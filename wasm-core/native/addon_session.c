/* addon_session.c — the session exports (kvl_session_*): create, free, position, truncate,
 * forward (every prefill too: kvl_session_prefill is forward without hidden states), step, the
 * cancel flag and the routing override. Arguments are checked here (types, lengths, no output
 * aliasing an input); a failed kvl_status is returned as a number.
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* (engine, maxContext, maxBatch) -> the open engine box and kvl_session_options, or NULL. */
static engine_box *get_session_args(napi_env env, napi_callback_info info, napi_value *engine_value,
                                    kvl_session_options *o, const char *fn)
{
    napi_value argv[3];
    engine_box *b;
    memset(o, 0, sizeof *o);
    if (!addon_get_args(env, info, argv, 3, fn) || !(b = addon_get_engine(env, argv[0], 1, fn)) ||
        !addon_get_int32(env, argv[1], &o->max_context, fn, "argument 2 (maxContext)") ||
        !addon_get_int32(env, argv[2], &o->max_batch, fn, "argument 3 (maxBatch)"))
        return NULL;
    *engine_value = argv[0];
    return b;
}

napi_value js_session_bytes(napi_env env, napi_callback_info info)
{
    napi_value engine_value, js_bytes;
    kvl_session_options o;
    engine_box *b = get_session_args(env, info, &engine_value, &o, "sessionBytes");
    if (!b)
        return NULL;
    uint64_t bytes = 0;
    kvl_status status = kvl_session_bytes(b->engine, &o, &bytes);
    NAPI_CALL(env, napi_create_double(env, status == KVL_OK ? (double)bytes : 0.0, &js_bytes));
    return addon_status_result(env, status, "bytes", js_bytes);
}

napi_value js_session_new(napi_env env, napi_callback_info info)
{
    napi_value engine_value, js_session;
    kvl_session_options o;
    engine_box *e = get_session_args(env, info, &engine_value, &o, "sessionNew");
    if (!e)
        return NULL;
    kvl_session *session = NULL;
    kvl_status status = kvl_session_new(e->engine, &o, &session);
    if (status != KVL_OK || !session) {
        if (session) /* not expected from the core; never leak it */
            kvl_session_free(session);
        NAPI_CALL(env, napi_get_null(env, &js_session));
        return addon_status_result(env, status == KVL_OK ? KVL_ERR_INTERNAL : status, "session", js_session);
    }
    js_session = addon_wrap_session(env, e, engine_value, session);
    if (!js_session)
        return NULL;
    return addon_status_result(env, KVL_OK, "session", js_session);
}

napi_value js_session_free(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    session_box *b;
    if (!addon_get_args(env, info, argv, 1, "sessionFree") || !(b = addon_get_session(env, argv[0], 0, "sessionFree")))
        return NULL;
    addon_session_close(b);
    if (b->cancel_ref) {
        napi_ref ref = b->cancel_ref;
        b->cancel_ref = NULL;
        NAPI_CALL(env, napi_delete_reference(env, ref));
    }
    for (int i = 0; i < 2; i++)
        if (b->routing_ref[i]) {
            napi_ref ref = b->routing_ref[i];
            b->routing_ref[i] = NULL;
            NAPI_CALL(env, napi_delete_reference(env, ref));
        }
    if (b->engine_ref) {
        napi_ref ref = b->engine_ref;
        b->engine_ref = NULL;
        NAPI_CALL(env, napi_delete_reference(env, ref));
    }
    return NULL;
}

napi_value js_session_position(napi_env env, napi_callback_info info)
{
    napi_value argv[1], v;
    session_box *b;
    if (!addon_get_args(env, info, argv, 1, "sessionPosition") ||
        !(b = addon_get_session(env, argv[0], 1, "sessionPosition")))
        return NULL;
    NAPI_CALL(env, napi_create_int32(env, kvl_session_position(b->session), &v));
    return v;
}

napi_value js_session_truncate(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionTruncate";
    napi_value argv[2];
    session_box *b;
    int32_t n;
    if (!addon_get_args(env, info, argv, 2, fn) || !(b = addon_get_session(env, argv[0], 1, fn)) ||
        !addon_get_int32(env, argv[1], &n, fn, "argument 2 (n)"))
        return NULL;
    return addon_make_status(env, kvl_session_truncate(b->session, n));
}

/* An optional Float32Array argument (null/undefined -> NULL, 0 floats) of exactly `want` floats;
 * `what` names it in the errors. Returns 0 after throwing. */
static int get_optional_floats(napi_env env, napi_value value, uint64_t want, void **data, size_t *n,
                               const char *fn, unsigned index, const char *what)
{
    *data = NULL;
    *n = 0;
    if (addon_is_nullish(env, value))
        return 1;
    if (!addon_get_typed_arg(env, value, napi_float32_array, data, n, fn, index))
        return 0;
    if ((uint64_t)*n != want) {
        char msg[200];
        snprintf(msg, sizeof msg, "kvl addon: %s: %s holds %llu floats, not %llu", fn, what,
                 (unsigned long long)*n, (unsigned long long)want);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return 0;
    }
    return 1;
}

napi_value js_session_forward(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionForward";
    napi_value argv[9];
    session_box *b;
    void *tokens = NULL, *hidden_in = NULL, *media, *hidden_out, *logits = NULL;
    size_t n_tokens = 0, n_hidden_in = 0, n_media_floats, n_hidden_out, n_logits = 0;
    int32_t n_media, mode;
    bool decode = false;
    napi_valuetype type = napi_undefined;
    char msg[256];
    if (!addon_get_args(env, info, argv, 9, fn) || !(b = addon_get_session(env, argv[0], 1, fn)) ||
        !addon_get_int32(env, argv[4], &n_media, fn, "argument 5 (nMedia)") ||
        !addon_get_int32(env, argv[6], &mode, fn, "argument 7 (logitsMode)"))
        return NULL;
    if (napi_typeof(env, argv[8], &type) != napi_ok || type != napi_boolean) {
        snprintf(msg, sizeof msg, "kvl addon: %s: argument 9 (decode) must be a boolean", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    NAPI_CALL(env, napi_get_value_bool(env, argv[8], &decode));
    const uint64_t vocab = (uint64_t)b->owner->vocab, hidden = (uint64_t)b->owner->hidden;
    const int tokens_given = !addon_is_nullish(env, argv[1]), hidden_given = !addon_is_nullish(env, argv[2]);
    if (tokens_given == hidden_given) {
        snprintf(msg, sizeof msg, "kvl addon: %s: give exactly one of tokens (argument 2) and hiddenIn "
                 "(argument 3)", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    uint64_t n;
    if (tokens_given) {
        if (!addon_get_typed_arg(env, argv[1], napi_int32_array, &tokens, &n_tokens, fn, 1))
            return NULL;
        n = n_tokens;
    } else {
        if (!addon_get_typed_arg(env, argv[2], napi_float32_array, &hidden_in, &n_hidden_in, fn, 2))
            return NULL;
        if (hidden == 0 || n_hidden_in % hidden != 0) {
            snprintf(msg, sizeof msg, "kvl addon: %s: hiddenIn holds %llu floats, not whole rows of "
                     "hidden_size (%d)", fn, (unsigned long long)n_hidden_in, (int)hidden);
            napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
            return NULL;
        }
        n = n_hidden_in / hidden;
    }
    if (n > (uint64_t)INT32_MAX || n_media < 0 || mode < KVL_LOGITS_NONE || mode > KVL_LOGITS_ALL) {
        snprintf(msg, sizeof msg, "kvl addon: %s: %llu tokens, nMedia %d, logitsMode %d: want at most "
                 "2^31-1 tokens, nMedia >= 0 and a logitsMode of 0, 1 or 2", fn, (unsigned long long)n,
                 (int)n_media, (int)mode);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    if (n_media > 0 && addon_is_nullish(env, argv[3])) {
        snprintf(msg, sizeof msg, "kvl addon: %s: media must be a Float32Array of %d rows, got none",
                 fn, (int)n_media);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    if (!get_optional_floats(env, argv[3], (uint64_t)n_media * hidden, &media, &n_media_floats, fn, 3,
                             "media (nMedia x hidden_size)") ||
        !get_optional_floats(env, argv[5], n * hidden, &hidden_out, &n_hidden_out, fn, 5,
                             "hiddenOut (n_tokens x hidden_size)"))
        return NULL;
    /* logits null with a logitsMode other than none is the core's to refuse (a status): on an
     * engine that does not run the last layers it names the layer range. */
    if (addon_is_nullish(env, argv[7])) {
        /* NULL */
    } else if (mode == KVL_LOGITS_NONE) {
        snprintf(msg, sizeof msg, "kvl addon: %s: logits must be null with logitsMode 0 (none)", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    } else if (!addon_get_typed_arg(env, argv[7], napi_float32_array, &logits, &n_logits, fn, 7)) {
        return NULL;
    } else if ((uint64_t)n_logits != (mode == KVL_LOGITS_LAST ? vocab : n * vocab)) {
        snprintf(msg, sizeof msg, "kvl addon: %s: logits holds %llu floats; logitsMode %d with %llu "
                 "tokens needs %llu (vocab %d)", fn, (unsigned long long)n_logits, (int)mode,
                 (unsigned long long)n, (unsigned long long)(mode == KVL_LOGITS_LAST ? vocab : n * vocab),
                 (int)vocab);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    /* The outputs must not share memory with the inputs or with each other. */
    const size_t out_bytes[2] = {n_hidden_out * sizeof(float), n_logits * sizeof(float)};
    const void *outs[2] = {hidden_out, logits};
    for (int i = 0; i < 2; i++) {
        if (addon_overlaps(outs[i], out_bytes[i], tokens, n_tokens * sizeof(int32_t)) ||
            addon_overlaps(outs[i], out_bytes[i], hidden_in, n_hidden_in * sizeof(float)) ||
            addon_overlaps(outs[i], out_bytes[i], media, n_media_floats * sizeof(float)) ||
            (i == 0 && addon_overlaps(hidden_out, out_bytes[0], logits, out_bytes[1]))) {
            snprintf(msg, sizeof msg, "kvl addon: %s: hiddenOut and logits must not share memory with "
                     "the inputs or each other", fn);
            napi_throw_range_error(env, "ERR_INVALID_ARG_VALUE", msg);
            return NULL;
        }
    }
    kvl_status status = kvl_session_forward(b->session, tokens, hidden_in, (int32_t)n, media, n_media,
                                            hidden_out, mode, logits, decode ? 1 : 0);
    return addon_make_status(env, status);
}

napi_value js_session_step(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionStep";
    napi_value argv[3];
    session_box *b;
    int32_t token;
    void *logits;
    size_t n_logits;
    if (!addon_get_args(env, info, argv, 3, fn) || !(b = addon_get_session(env, argv[0], 1, fn)) ||
        !addon_get_int32(env, argv[1], &token, fn, "argument 2 (token)") ||
        !addon_get_typed_arg(env, argv[2], napi_float32_array, &logits, &n_logits, fn, 2))
        return NULL;
    if ((uint64_t)n_logits != (uint64_t)b->owner->vocab) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: logits holds %llu floats, not vocab_size (%d)", fn,
                 (unsigned long long)n_logits, (int)b->owner->vocab);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    return addon_make_status(env, kvl_session_step(b->session, token, logits));
}

/* sessionWatchCancel(session, flag: Int32Array over a SharedArrayBuffer | null): the core stops
 * the session's calls when flag[0] != 0 (kvl_session_watch_cancel). The array is referenced
 * until replaced or the session is freed, so its memory outlives the watch; it must be shared
 * memory (a SharedArrayBuffer cannot be detached), which the host guarantees. */
napi_value js_session_watch_cancel(napi_env env, napi_callback_info info)
{
    napi_value argv[2];
    session_box *b;
    napi_valuetype type = napi_undefined;
    void *data = NULL;
    size_t length = 0;
    if (!addon_get_args(env, info, argv, 2, "sessionWatchCancel") ||
        !(b = addon_get_session(env, argv[0], 1, "sessionWatchCancel")))
        return NULL;
    NAPI_CALL(env, napi_typeof(env, argv[1], &type));
    if (type != napi_null) {
        if (!addon_get_typed_arg(env, argv[1], napi_int32_array, &data, &length, "sessionWatchCancel", 1))
            return NULL;
        if (length < 1) {
            napi_throw_range_error(env, "ERR_OUT_OF_RANGE",
                                   "kvl addon: sessionWatchCancel: the flag array is empty");
            return NULL;
        }
    }
    kvl_session_watch_cancel(b->session, NULL);
    if (b->cancel_ref) {
        napi_ref ref = b->cancel_ref;
        b->cancel_ref = NULL;
        NAPI_CALL(env, napi_delete_reference(env, ref));
    }
    if (data) {
        NAPI_CALL(env, napi_create_reference(env, argv[1], 1, &b->cancel_ref));
        kvl_session_watch_cancel(b->session, (const volatile int32_t *)data);
    }
    return NULL;
}

/* sessionSetRouting(session, mode, seed, ids: Int32Array | null, weights: Float32Array | null)
 * -> status: kvl_session_set_routing (measurement only: kvl bench --routing). The rows are
 * [capacity][n_layers][topk]; capacity = ids.length / (n_layers * topk), and weights must be as
 * long. The arrays are referenced until replaced or the session is freed, so the memory the core
 * writes and reads outlives the call; the host never detaches them (plain ArrayBuffers it owns). */
napi_value js_session_set_routing(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionSetRouting";
    napi_value argv[5];
    session_box *b;
    int32_t mode;
    int64_t seed;
    if (!addon_get_args(env, info, argv, 5, fn) || !(b = addon_get_session(env, argv[0], 1, fn)) ||
        !addon_get_int32(env, argv[1], &mode, fn, "argument 2 (mode)") ||
        !addon_get_integer(env, argv[2], 0.0, 4294967295.0, &seed, fn, "argument 3 (seed)"))
        return NULL;
    void *ids = NULL, *weights = NULL;
    size_t n_ids = 0, n_w = 0;
    napi_valuetype t_ids = napi_undefined, t_w = napi_undefined;
    NAPI_CALL(env, napi_typeof(env, argv[3], &t_ids));
    NAPI_CALL(env, napi_typeof(env, argv[4], &t_w));
    if (t_ids != napi_null && !addon_get_typed_arg(env, argv[3], napi_int32_array, &ids, &n_ids, fn, 3))
        return NULL;
    if (t_w != napi_null && !addon_get_typed_arg(env, argv[4], napi_float32_array, &weights, &n_w, fn, 4))
        return NULL;
    kvl_engine_info ei;
    if (kvl_engine_get_info(b->owner->engine, &ei) != KVL_OK)
        return addon_throw_error(env, "ERR_KVL_STATUS", "kvl addon: sessionSetRouting: engine info failed");
    size_t row = (size_t)ei.n_layers * (size_t)ei.num_experts_per_tok;
    if ((ids == NULL) != (weights == NULL) || n_ids != n_w || row == 0 || n_ids % row != 0 ||
        n_ids / row > (size_t)INT32_MAX || (ids && n_ids == 0)) {
        char msg[200];
        snprintf(msg, sizeof msg, "kvl addon: %s: ids (%llu) and weights (%llu) must both be null or "
                 "equally long, a positive multiple of n_layers x topk (%llu)", fn,
                 (unsigned long long)n_ids, (unsigned long long)n_w, (unsigned long long)row);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    kvl_status status = kvl_session_set_routing(b->session, mode, (uint32_t)seed, ids, weights,
                                                (int32_t)(row ? n_ids / row : 0));
    if (status != KVL_OK)
        return addon_make_status(env, status); /* the core kept its previous rows */
    for (int i = 0; i < 2; i++)
        if (b->routing_ref[i]) {
            napi_ref ref = b->routing_ref[i];
            b->routing_ref[i] = NULL;
            NAPI_CALL(env, napi_delete_reference(env, ref));
        }
    if (ids) {
        NAPI_CALL(env, napi_create_reference(env, argv[3], 1, &b->routing_ref[0]));
        NAPI_CALL(env, napi_create_reference(env, argv[4], 1, &b->routing_ref[1]));
    }
    return addon_make_status(env, KVL_OK);
}
