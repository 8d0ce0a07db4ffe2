/* addon.c — the Node-API (N-API 8) addon over kvl_core.h: the native backend of the TypeScript
 * host, built from the same core sources as the WebAssembly build (CMake target kvl_node, or
 * scripts/build-addon.mjs). This unit owns the module table (one row per export), the napi error
 * convention and the core-wide queries (ABI version, kernel sets, conformance, code lists); the other units
 * each wrap one part of the core (addon.h lists them). Plain C11; no global state, so it loads in
 * any number of worker_threads; nothing here calls exit() or aborts.
 *
 * What each export takes, returns and throws is described once: the NativeAddon interface in
 * host/core/native-backend.ts. To add an export: write its napi_callback in the unit of what it
 * wraps, declare it in addon.h, add one row to kvl_functions[] below and its member to NativeAddon.
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- error handling */

/* Throws "kvl addon: <what> failed: <napi detail>" unless an exception is already pending (a
 * JS exception raised inside the failed call is more useful than ours). Must run right after
 * the failed call: napi_get_last_error_info describes the last call made. */
void addon_throw_napi_failure(napi_env env, napi_status status, const char *what)
{
    const napi_extended_error_info *info = NULL;
    const char *detail = NULL;
    if (napi_get_last_error_info(env, &info) == napi_ok && info && info->error_message)
        detail = info->error_message;
    bool pending = false;
    if (napi_is_exception_pending(env, &pending) == napi_ok && pending)
        return;
    char msg[512];
    if (detail)
        snprintf(msg, sizeof msg, "kvl addon: %s failed: %s", what, detail);
    else
        snprintf(msg, sizeof msg, "kvl addon: %s failed (napi_status %d)", what, (int)status);
    napi_throw_error(env, NULL, msg);
}

/* Throws a plain Error with the given message; returns NULL so callbacks can `return addon_throw_error(…)`. */
napi_value addon_throw_error(napi_env env, const char *code, const char *msg)
{
    napi_throw_error(env, code, msg);
    return NULL;
}

/* ---------------------------------------------------------------- the core and its kernel sets */

napi_value js_abi_version(napi_env env, napi_callback_info info)
{
    (void)info;
    napi_value v;
    NAPI_CALL(env, napi_create_int32(env, kvl_abi_version(), &v));
    return v;
}

napi_value js_kernel_sets(napi_env env, napi_callback_info info)
{
    (void)info;
    int count = kvl_kernel_set_count();
    if (count < 0)
        count = 0;
    napi_value arr;
    NAPI_CALL(env, napi_create_array_with_length(env, (size_t)count, &arr));
    uint32_t n = 0;
    for (int i = 0; i < count; i++) {
        const char *name = kvl_kernel_set_name(i);
        if (!name)
            break;
        napi_value obj, js_name, js_supported;
        NAPI_CALL(env, napi_create_object(env, &obj));
        NAPI_CALL(env, napi_create_string_utf8(env, name, NAPI_AUTO_LENGTH, &js_name));
        NAPI_CALL(env, napi_get_boolean(env, kvl_kernel_set_supported(name) != 0, &js_supported));
        NAPI_CALL(env, napi_set_named_property(env, obj, "name", js_name));
        NAPI_CALL(env, napi_set_named_property(env, obj, "supported", js_supported));
        NAPI_CALL(env, napi_set_element(env, arr, n++, obj));
    }
    return arr;
}

napi_value js_default_kernel_set(napi_env env, napi_callback_info info)
{
    (void)info;
    const char *name = kvl_kernel_set_default();
    if (!name)
        return addon_throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: the core names no default kernel set");
    return addon_make_string(env, name, NAPI_AUTO_LENGTH);
}

#define KVL_REPORT_SMALL ((size_t)1 << 20) /* 1 MiB: the usual report */
#define KVL_REPORT_LARGE ((size_t)8 << 20) /* 8 MiB: the retry when the core says -2 */

napi_value js_conformance(napi_env env, napi_callback_info info)
{
    char *name = addon_get_string_arg(env, info, 0, "conformance(name)");
    if (!name)
        return NULL;

    size_t cap = KVL_REPORT_SMALL;
    char *buf = calloc(cap, 1);
    int failed = buf ? kvl_kernels_conformance(name, buf, cap) : 0;
    if (buf && failed == -2) {
        free(buf);
        cap = KVL_REPORT_LARGE;
        buf = calloc(cap, 1);
        failed = buf ? kvl_kernels_conformance(name, buf, cap) : 0;
    }
    if (!buf) {
        free(name);
        return addon_throw_error(env, "ERR_KVL_NOMEM", "kvl addon: conformance: out of memory for the report");
    }
    if (failed == -2 || failed < -1) {
        char msg[256];
        if (failed == -2)
            snprintf(msg, sizeof msg, "kvl addon: conformance(\"%.64s\"): report larger than %u MiB",
                     name, (unsigned)(KVL_REPORT_LARGE >> 20));
        else
            snprintf(msg, sizeof msg, "kvl addon: conformance(\"%.64s\"): unexpected result %d",
                     name, failed);
        free(buf);
        free(name);
        return addon_throw_error(env, "ERR_KVL_INTERNAL", msg);
    }
    free(name);

    /* The report is NUL-terminated within the buffer (calloc'd, so a terminator exists unless
     * the core filled every byte; then take the whole buffer). */
    size_t len = 0;
    if (failed >= 0) {
        const char *end = memchr(buf, '\0', cap);
        len = end ? (size_t)(end - buf) : cap;
    }

    napi_value result, js_failed, js_report;
    napi_status st = napi_create_object(env, &result);
    const char *what = "napi_create_object";
    if (st == napi_ok) {
        st = napi_create_int32(env, failed, &js_failed);
        what = "napi_create_int32";
    }
    if (st == napi_ok) {
        st = napi_create_string_utf8(env, buf, len, &js_report);
        what = "napi_create_string_utf8";
    }
    free(buf);
    if (st != napi_ok) {
        addon_throw_napi_failure(env, st, what);
        return NULL;
    }
    NAPI_CALL(env, napi_set_named_property(env, result, "failed", js_failed));
    NAPI_CALL(env, napi_set_named_property(env, result, "report", js_report));
    return result;
}

/* The rows of one of the core's code lists (kvl_constants): [{ name, value }]. */
napi_value js_constants(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    int32_t which;
    if (!addon_get_args(env, info, argv, 1, "constants") || !addon_get_int32(env, argv[0], &which, "constants", "which"))
        return NULL;
    int n = 0;
    const kvl_const_desc *rows = kvl_constants(which, &n);
    if (!rows) {
        char msg[128];
        snprintf(msg, sizeof msg, "kvl addon: constants: the core has no list %d", (int)which);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    napi_value list, row, v;
    NAPI_CALL(env, napi_create_array_with_length(env, (size_t)n, &list));
    for (int i = 0; i < n; i++) {
        NAPI_CALL(env, napi_create_object(env, &row));
        NAPI_CALL(env, napi_create_string_utf8(env, rows[i].name, NAPI_AUTO_LENGTH, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "name", v));
        NAPI_CALL(env, napi_create_int32(env, rows[i].value, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "value", v));
        NAPI_CALL(env, napi_set_element(env, list, (uint32_t)i, row));
    }
    return list;
}

/* ---------------------------------------------------------------- module table */

typedef struct kvl_function {
    const char *name;
    napi_callback callback;
} kvl_function;

static const kvl_function kvl_functions[] = {
    {"abiVersion", js_abi_version},
    {"kernelSets", js_kernel_sets},
    {"defaultKernelSet", js_default_kernel_set},
    {"conformance", js_conformance},
    {"constants", js_constants},
    {"expertExtentBytes", js_expert_extent_bytes},
    {"packExpert", js_pack_expert},
    {"packQ8Rows", js_pack_q8_rows},
    {"expertQ4ExtentBytes", js_expert_q4_extent_bytes},
    {"packExpertQ4", js_pack_expert_q4},
    {"pcg64Seed", js_pcg64_seed},
    {"synthUniform", js_synth_uniform},
    {"sampleToken", js_sample_token},
    {"samplerSeed", js_sampler_seed},
    {"structLayout", js_struct_layout},
    {"engineOpen", js_engine_open},
    {"engineFree", js_engine_free},
    {"engineInfo", js_engine_info},
    {"engineStats", js_engine_stats},
    {"engineResetStats", js_engine_reset_stats},
    {"engineSetExpertSlots", js_engine_set_expert_slots},
    {"engineLastError", js_engine_last_error},
    {"sessionBytes", js_session_bytes},
    {"sessionNew", js_session_new},
    {"sessionFree", js_session_free},
    {"sessionPosition", js_session_position},
    {"sessionTruncate", js_session_truncate},
    {"sessionForward", js_session_forward},
    {"sessionStep", js_session_step},
    {"sessionWatchCancel", js_session_watch_cancel},
    {"sessionSetRouting", js_session_set_routing},
    {"visionBytes", js_vision_bytes},
    {"visionEncode", js_vision_encode},
};

NAPI_MODULE_INIT()
{
    for (size_t i = 0; i < sizeof kvl_functions / sizeof kvl_functions[0]; i++) {
        napi_value fn;
        NAPI_CALL(env, napi_create_function(env, kvl_functions[i].name, NAPI_AUTO_LENGTH,
                                            kvl_functions[i].callback, NULL, &fn));
        NAPI_CALL(env, napi_set_named_property(env, exports, kvl_functions[i].name, fn));
    }
    napi_value backend;
    NAPI_CALL(env, napi_create_string_utf8(env, "native", NAPI_AUTO_LENGTH, &backend));
    napi_property_descriptor props[] = {
        {"backend", NULL, NULL, NULL, NULL, backend, napi_enumerable, NULL},
    };
    NAPI_CALL(env, napi_define_properties(env, exports, sizeof props / sizeof props[0], props));
    return exports;
}
