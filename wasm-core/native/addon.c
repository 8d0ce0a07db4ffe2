/* addon.c — the Node-API (N-API 8) addon over kvl_core.h: the native backend of the TypeScript
 * host, built from the same core sources as the WebAssembly build (CMake target kvl_node, or
 * scripts/build-addon.mjs). Plain C11; no global state, so it loads in any number of
 * worker_threads; nothing here calls exit() or aborts.
 *
 * Exports (keep in step with the host's native backend typings):
 *   backend              "native"
 *   abiVersion()         kvl_abi_version()
 *   kernelSets()         [{ name, supported }] for every kernel set compiled in
 *   defaultKernelSet()   the set KVL_KERNELS_AUTO picks on this machine
 *   conformance(name)    { failed, report }: kvl_kernels_conformance's count and JSON report;
 *                        failed -1 and report "" when the set is unknown or unsupported here
 *   expertExtentBytes(I, H)                         kvl_expert_extent_bytes
 *   packExpert(gate, up, down, I, H, out)           kvl_pack_expert into out (Uint8Array); the
 *                                                   kvl_status as a number (0 = ok)
 *   pcg64Seed(words, state)                         kvl_pcg64_seed: BigUint64Array(4) each
 *   synthUniform(state, count, center, half, out)   kvl_synth_uniform into out (Uint16Array:
 *                                                   BF16 bits, Float32Array: FP32); advances state
 *
 * To add a function: write a napi_callback below and add one row to kvl_functions[].
 * Every napi call goes through NAPI_CALL, which throws a JS Error naming the call and returns
 * NULL (the JS caller then sees the exception).
 */
#define BUILDING_NODE_EXTENSION 1 /* node_api.h: import the napi_* symbols (dllimport on Windows) */
#include <node_api.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvl_core.h"

/* ---------------------------------------------------------------- error handling */

/* Throws "kvl addon: <what> failed: <napi detail>" unless an exception is already pending (a
 * JS exception raised inside the failed call is more useful than ours). Must run right after
 * the failed call: napi_get_last_error_info describes the last call made. */
static void throw_napi_failure(napi_env env, napi_status status, const char *what)
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

#define NAPI_CALL(env, call)                                                                      \
    do {                                                                                          \
        napi_status napi_call_status_ = (call);                                                   \
        if (napi_call_status_ != napi_ok) {                                                       \
            throw_napi_failure((env), napi_call_status_, #call);                                  \
            return NULL;                                                                          \
        }                                                                                         \
    } while (0)

/* Throws a plain Error with the given message; returns NULL so callbacks can `return throw_(…)`. */
static napi_value throw_error(napi_env env, const char *code, const char *msg)
{
    napi_throw_error(env, code, msg);
    return NULL;
}

/* ---------------------------------------------------------------- small helpers */

static napi_value make_string(napi_env env, const char *s, size_t len)
{
    napi_value v;
    NAPI_CALL(env, napi_create_string_utf8(env, s, len, &v));
    return v;
}

/* Reads argument `index` as a UTF-8 string into a malloc'd buffer (caller frees). Throws a
 * TypeError and returns NULL when it is missing or not a string. */
static char *get_string_arg(napi_env env, napi_callback_info info, size_t index, const char *fn)
{
    napi_value argv[4];
    size_t argc = sizeof argv / sizeof argv[0];
    napi_status st = napi_get_cb_info(env, info, &argc, argv, NULL, NULL);
    if (st != napi_ok) {
        throw_napi_failure(env, st, "napi_get_cb_info");
        return NULL;
    }
    napi_valuetype type = napi_undefined;
    if (index < argc && index < sizeof argv / sizeof argv[0]) {
        st = napi_typeof(env, argv[index], &type);
        if (st != napi_ok) {
            throw_napi_failure(env, st, "napi_typeof");
            return NULL;
        }
    }
    if (type != napi_string) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument %u must be a string", fn,
                 (unsigned)index + 1);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    size_t len = 0;
    st = napi_get_value_string_utf8(env, argv[index], NULL, 0, &len);
    if (st != napi_ok) {
        throw_napi_failure(env, st, "napi_get_value_string_utf8");
        return NULL;
    }
    char *s = malloc(len + 1);
    if (!s) {
        napi_throw_error(env, "ERR_KVL_NOMEM", "kvl addon: out of memory");
        return NULL;
    }
    st = napi_get_value_string_utf8(env, argv[index], s, len + 1, &len);
    if (st != napi_ok) {
        free(s);
        throw_napi_failure(env, st, "napi_get_value_string_utf8");
        return NULL;
    }
    return s;
}

/* Reads argument `index` as a typed array of the given type into (*data, *length), or throws a
 * TypeError naming the function and returns 0. */
static int get_typed_arg(napi_env env, napi_value value, napi_typedarray_type want, void **data,
                         size_t *length, const char *fn, unsigned index)
{
    bool is_typed = false;
    napi_typedarray_type type;
    napi_value buffer;
    size_t offset;
    if (napi_is_typedarray(env, value, &is_typed) != napi_ok || !is_typed ||
        napi_get_typedarray_info(env, value, &type, length, data, &buffer, &offset) != napi_ok ||
        type != want) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument %u has the wrong typed-array type", fn, index + 1);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return 0;
    }
    return 1;
}

/* Reads a non-negative integer argument (a JS number) or throws; 0 on failure. */
static int get_size_arg(napi_env env, napi_value value, size_t *out, const char *fn, unsigned index)
{
    double d = -1;
    if (napi_get_value_double(env, value, &d) != napi_ok || !(d >= 0) || d > 9007199254740991.0 ||
        d != (double)(uint64_t)d) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument %u must be a non-negative integer", fn, index + 1);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return 0;
    }
    *out = (size_t)d;
    return 1;
}

/* napi_get_cb_info with an exact argument count; throws and returns 0 otherwise. */
static int get_args(napi_env env, napi_callback_info info, napi_value *argv, size_t n, const char *fn)
{
    size_t argc = n;
    if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok || argc < n) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s takes %u arguments", fn, (unsigned)n);
        napi_throw_type_error(env, "ERR_MISSING_ARGS", msg);
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- exported functions */

static napi_value js_abi_version(napi_env env, napi_callback_info info)
{
    (void)info;
    napi_value v;
    NAPI_CALL(env, napi_create_int32(env, kvl_abi_version(), &v));
    return v;
}

static napi_value js_kernel_sets(napi_env env, napi_callback_info info)
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

static napi_value js_default_kernel_set(napi_env env, napi_callback_info info)
{
    (void)info;
    const char *name = kvl_kernel_set_default();
    if (!name)
        return throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: the core names no default kernel set");
    return make_string(env, name, NAPI_AUTO_LENGTH);
}

#define KVL_REPORT_SMALL ((size_t)1 << 20) /* 1 MiB: the usual report */
#define KVL_REPORT_LARGE ((size_t)8 << 20) /* 8 MiB: the retry when the core says -2 */

static napi_value js_conformance(napi_env env, napi_callback_info info)
{
    char *name = get_string_arg(env, info, 0, "conformance(name)");
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
        return throw_error(env, "ERR_KVL_NOMEM", "kvl addon: conformance: out of memory for the report");
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
        return throw_error(env, "ERR_KVL_INTERNAL", msg);
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
        throw_napi_failure(env, st, what);
        return NULL;
    }
    NAPI_CALL(env, napi_set_named_property(env, result, "failed", js_failed));
    NAPI_CALL(env, napi_set_named_property(env, result, "report", js_report));
    return result;
}

static napi_value js_expert_extent_bytes(napi_env env, napi_callback_info info)
{
    napi_value argv[2], v;
    size_t inter, hidden;
    if (!get_args(env, info, argv, 2, "expertExtentBytes") ||
        !get_size_arg(env, argv[0], &inter, "expertExtentBytes", 0) ||
        !get_size_arg(env, argv[1], &hidden, "expertExtentBytes", 1))
        return NULL;
    NAPI_CALL(env, napi_create_double(env, (double)kvl_expert_extent_bytes(inter, hidden), &v));
    return v;
}

static napi_value js_pack_expert(napi_env env, napi_callback_info info)
{
    const char *fn = "packExpert";
    napi_value argv[6], v;
    void *gate, *up, *down, *out;
    size_t n_gate, n_up, n_down, n_out, inter, hidden;
    if (!get_args(env, info, argv, 6, fn) ||
        !get_typed_arg(env, argv[0], napi_uint16_array, &gate, &n_gate, fn, 0) ||
        !get_typed_arg(env, argv[1], napi_uint16_array, &up, &n_up, fn, 1) ||
        !get_typed_arg(env, argv[2], napi_uint16_array, &down, &n_down, fn, 2) ||
        !get_size_arg(env, argv[3], &inter, fn, 3) || !get_size_arg(env, argv[4], &hidden, fn, 4) ||
        !get_typed_arg(env, argv[5], napi_uint8_array, &out, &n_out, fn, 5))
        return NULL;
    if (n_gate != inter * hidden || n_up != inter * hidden || n_down != inter * hidden)
        return throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: packExpert: matrix sizes differ from I x H");
    kvl_status st = kvl_pack_expert(gate, up, down, inter, hidden, out, n_out);
    NAPI_CALL(env, napi_create_int32(env, (int32_t)st, &v));
    return v;
}

static napi_value js_pcg64_seed(napi_env env, napi_callback_info info)
{
    napi_value argv[2];
    void *words, *state;
    size_t n_words, n_state;
    if (!get_args(env, info, argv, 2, "pcg64Seed") ||
        !get_typed_arg(env, argv[0], napi_biguint64_array, &words, &n_words, "pcg64Seed", 0) ||
        !get_typed_arg(env, argv[1], napi_biguint64_array, &state, &n_state, "pcg64Seed", 1))
        return NULL;
    if (n_words != 4 || n_state != 4)
        return throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: pcg64Seed: both arrays hold 4 words");
    kvl_pcg64 rng;
    kvl_pcg64_seed(&rng, (const uint64_t *)words);
    const uint64_t s[4] = {rng.state_hi, rng.state_lo, rng.inc_hi, rng.inc_lo};
    memcpy(state, s, sizeof s);
    return NULL;
}

static napi_value js_synth_uniform(napi_env env, napi_callback_info info)
{
    const char *fn = "synthUniform";
    napi_value argv[5];
    void *state, *out;
    size_t n_state, count, n_out;
    double center, half;
    if (!get_args(env, info, argv, 5, fn) ||
        !get_typed_arg(env, argv[0], napi_biguint64_array, &state, &n_state, fn, 0) ||
        !get_size_arg(env, argv[1], &count, fn, 1))
        return NULL;
    NAPI_CALL(env, napi_get_value_double(env, argv[2], &center));
    NAPI_CALL(env, napi_get_value_double(env, argv[3], &half));
    napi_typedarray_type type;
    napi_value buffer;
    size_t offset;
    bool is_typed = false;
    NAPI_CALL(env, napi_is_typedarray(env, argv[4], &is_typed));
    if (!is_typed)
        return throw_error(env, "ERR_INVALID_ARG_TYPE", "kvl addon: synthUniform: out must be a Uint16Array or Float32Array");
    NAPI_CALL(env, napi_get_typedarray_info(env, argv[4], &type, &n_out, &out, &buffer, &offset));
    if ((type != napi_uint16_array && type != napi_float32_array) || n_state != 4 || count > n_out)
        return throw_error(env, "ERR_INVALID_ARG_VALUE",
                           "kvl addon: synthUniform: state is 4 words, out a Uint16Array or Float32Array of >= count");
    uint64_t *s = state;
    kvl_pcg64 rng = {s[0], s[1], s[2], s[3]};
    kvl_synth_uniform(&rng, count, (float)center, (float)half, type == napi_uint16_array, out);
    s[0] = rng.state_hi;
    s[1] = rng.state_lo;
    s[2] = rng.inc_hi;
    s[3] = rng.inc_lo;
    return NULL;
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
    {"expertExtentBytes", js_expert_extent_bytes},
    {"packExpert", js_pack_expert},
    {"pcg64Seed", js_pcg64_seed},
    {"synthUniform", js_synth_uniform},
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
