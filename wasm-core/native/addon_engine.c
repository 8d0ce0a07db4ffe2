/* addon_engine.c — the text engine's exports (kvl_engine_*): open, free, info, stats and the
 * last error. A failed kvl_status is returned as a number, never thrown.
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The engineOpen codes object -> kvl_engine_options (object_to_struct: every property optional,
 * absent = 0, the core's default; loadVision may be a boolean). codes may be null. */
static int read_engine_options(napi_env env, napi_value codes, kvl_engine_options *o, const char *fn)
{
    memset(o, 0, sizeof *o);
    if (!codes || addon_is_nullish(env, codes))
        return 1;
    napi_valuetype type = napi_undefined;
    if (napi_typeof(env, codes, &type) != napi_ok || type != napi_object) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument 2 must be an object of option codes", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return 0;
    }
    return addon_object_to_struct(env, codes, KVL_STRUCT_ENGINE_OPTIONS, o, fn, "option code");
}

#define KVL_OPEN_ERR_BYTES 8192 /* the core's open errors quote paths of up to 4 KiB */

napi_value js_engine_open(napi_env env, napi_callback_info info)
{
    const char *fn = "engineOpen";
    napi_value argv[2];
    size_t argc = 2;
    NAPI_CALL(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL));
    if (argc < 1)
        return addon_throw_error(env, "ERR_MISSING_ARGS", "kvl addon: engineOpen takes (packDir, codes)");
    kvl_engine_options options;
    if (!read_engine_options(env, argc >= 2 ? argv[1] : NULL, &options, fn))
        return NULL;
    char *dir = addon_string_from_value(env, argv[0], fn, 0);
    if (!dir)
        return NULL;
    char *err = calloc(KVL_OPEN_ERR_BYTES, 1);
    if (!err) {
        free(dir);
        return addon_throw_error(env, "ERR_KVL_NOMEM", "kvl addon: engineOpen: out of memory");
    }
    kvl_engine *engine = NULL;
    kvl_status status = kvl_engine_open(dir, &options, &engine, err, KVL_OPEN_ERR_BYTES);
    free(dir);
    if (status == KVL_OK && !engine) {
        free(err);
        return addon_throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: engineOpen: kvl_engine_open returned no engine");
    }
    if (status != KVL_OK && engine) { /* not expected from the core; never leak it */
        kvl_engine_free(engine);
        engine = NULL;
    }
    const char *end = memchr(err, '\0', KVL_OPEN_ERR_BYTES);
    napi_value js_error;
    napi_status st = napi_create_string_utf8(env, err, end ? (size_t)(end - err) : KVL_OPEN_ERR_BYTES, &js_error);
    free(err);
    if (st != napi_ok) {
        if (engine)
            kvl_engine_free(engine);
        addon_throw_napi_failure(env, st, "napi_create_string_utf8");
        return NULL;
    }
    napi_value js_engine;
    if (engine) {
        js_engine = addon_wrap_engine(env, engine);
        if (!js_engine)
            return NULL;
    } else {
        NAPI_CALL(env, napi_get_null(env, &js_engine));
    }
    napi_value result = addon_status_result(env, status, "engine", js_engine);
    if (!result)
        return NULL;
    NAPI_CALL(env, napi_set_named_property(env, result, "error", js_error));
    return result;
}

napi_value js_engine_free(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!addon_get_args(env, info, argv, 1, "engineFree") || !(b = addon_get_engine(env, argv[0], 0, "engineFree")))
        return NULL;
    addon_engine_close(b);
    return NULL;
}

napi_value js_engine_info(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!addon_get_args(env, info, argv, 1, "engineInfo") || !(b = addon_get_engine(env, argv[0], 1, "engineInfo")))
        return NULL;
    kvl_engine_info out;
    kvl_status st = kvl_engine_get_info(b->engine, &out);
    if (st != KVL_OK)
        return addon_throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: engineInfo: kvl_engine_get_info failed");
    return addon_struct_to_object(env, KVL_STRUCT_ENGINE_INFO, &out);
}

napi_value js_engine_stats(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!addon_get_args(env, info, argv, 1, "engineStats") || !(b = addon_get_engine(env, argv[0], 1, "engineStats")))
        return NULL;
    kvl_stats out;
    kvl_status st = kvl_engine_get_stats(b->engine, &out);
    if (st != KVL_OK)
        return addon_throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: engineStats: kvl_engine_get_stats failed");
    return addon_struct_to_object(env, KVL_STRUCT_STATS, &out);
}

napi_value js_engine_reset_stats(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!addon_get_args(env, info, argv, 1, "engineResetStats") ||
        !(b = addon_get_engine(env, argv[0], 1, "engineResetStats")))
        return NULL;
    kvl_engine_reset_stats(b->engine);
    return NULL;
}

/* (engine, slots) -> { status, active }: kvl_engine_set_expert_slots */
napi_value js_engine_set_expert_slots(napi_env env, napi_callback_info info)
{
    napi_value argv[2], js_active;
    engine_box *b;
    int32_t slots, active = 0;
    if (!addon_get_args(env, info, argv, 2, "engineSetExpertSlots") ||
        !(b = addon_get_engine(env, argv[0], 1, "engineSetExpertSlots")) ||
        !addon_get_int32(env, argv[1], &slots, "engineSetExpertSlots", "slots"))
        return NULL;
    kvl_status status = kvl_engine_set_expert_slots(b->engine, slots, &active);
    if (napi_create_int32(env, active, &js_active) != napi_ok) return NULL;
    return addon_status_result(env, status, "active", js_active);
}

napi_value js_engine_last_error(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!addon_get_args(env, info, argv, 1, "engineLastError") ||
        !(b = addon_get_engine(env, argv[0], 1, "engineLastError")))
        return NULL;
    const char *msg = kvl_engine_last_error(b->engine);
    return addon_make_string(env, msg ? msg : "", NAPI_AUTO_LENGTH);
}
