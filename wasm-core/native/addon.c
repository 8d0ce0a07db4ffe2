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
 *   packQ8Rows(w, rows, cols, out)                  kvl_pack_q8_rows into out (Uint8Array); the
 *                                                   kvl_status as a number (0 = ok)
 *   expertQ4ExtentBytes(I, H)                       kvl_expert_q4_extent_bytes
 *   packExpertQ4(gate, up, down, I, H, out)         kvl_pack_expert_q4 into out (Uint8Array); the
 *                                                   kvl_status as a number (0 = ok)
 *   pcg64Seed(words, state)                         kvl_pcg64_seed: BigUint64Array(4) each
 *   synthUniform(state, count, center, half, out)   kvl_synth_uniform into out (Uint16Array:
 *                                                   BF16 bits, Float32Array: FP32); advances state
 *   sampleToken(logits, temperature, topK, topP, rng, workspace) -> token   kvl_sample; rng: a
 *                                                   BigUint64Array(1) state advanced in place
 *   samplerSeed(rng)                                rng[0] = kvl_sampler_seed's state of rng[0]
 *   constants(which)                                kvl_constants(which) -> [{ name, value }]
 *   structLayout(which)                             kvl_struct_layout(which) -> { bytes, fields:
 *                                                   [{ name, cName, offset, bytes, kind }] }: name
 *                                                   the JS property, cName the C member, kind the
 *                                                   KVL_FIELD_* number; which a KVL_STRUCT_* number
 *
 * The text engine (kvl_engine_* / kvl_session_*). Engines and sessions are opaque handles
 * (type-tagged napi_externals, see "engine and session handles" below). A failed kvl_status is
 * returned as a number, never thrown: the caller reads the detail with engineLastError. A
 * caller mistake (wrong type, wrong typed-array length, a handle of the wrong kind) throws a
 * TypeError / RangeError; using a freed handle throws an Error "... engine closed" / "... session
 * closed" (code ERR_KVL_CLOSED). Integers are JS numbers; uint64 results are Numbers (exact
 * below 2^53).
 *   engineOpen(packDir, codes)        kvl_engine_open -> { status, error, engine }: error is the
 *                                     core's err buffer ("" on success), engine a handle or null.
 *                                     codes: the kvl_engine_options members by their JS names
 *                                     (see "the boundary structs": nThreads, expertCacheBytes,
 *                                     ...), each optional (absent = 0; loadVision may be a
 *                                     boolean); codes may be null
 *   engineFree(engine)                kvl_engine_free, after freeing the sessions of this engine
 *                                     still open (their handles then throw "session closed");
 *                                     a second free does nothing
 *   engineInfo(engine)                kvl_engine_get_info as an object (vocabSize, ...,
 *                                     trunkDirectIo a boolean, kernels "avx2", ...)
 *   engineStats(engine)               kvl_engine_get_stats as an object (expertHits, ...)
 *   engineResetStats(engine)          kvl_engine_reset_stats
 *   engineLastError(engine)           kvl_engine_last_error: the detail of the last failed call
 *                                     on the engine or any of its sessions
 *   sessionBytes(engine, maxContext, maxBatch)   kvl_session_bytes -> { status, bytes }
 *   sessionNew(engine, maxContext, maxBatch)     kvl_session_new -> { status, session }: session
 *                                     a handle or null; it keeps its engine's handle alive
 *   sessionFree(session)              kvl_session_free; a second free does nothing
 *   sessionPosition(session)          kvl_session_position
 *   sessionTruncate(session, n)       kvl_session_truncate -> status
 *   sessionPrefill(session, tokens, media, nMedia, logitsMode, logits)
 *                                     kvl_session_prefill -> status. tokens: Int32Array (its
 *                                     length is n_tokens); media: null, or a Float32Array of
 *                                     nMedia x hidden_size floats; logitsMode: 0 none, 1 last,
 *                                     2 all; logits: null for none, a Float32Array of vocab_size
 *                                     floats for last, n_tokens x vocab_size for all (not
 *                                     sharing memory with tokens or media). Runs to completion on
 *                                     the calling thread.
 *   sessionForward(session, tokens, hiddenIn, media, nMedia, hiddenOut, logitsMode, logits, decode)
 *                                     kvl_session_forward -> status, for engines of a layer range
 *                                     (codes layerBegin/layerEnd). Exactly one of tokens
 *                                     (Int32Array, n_tokens = its length) and hiddenIn
 *                                     (Float32Array of n_tokens x hidden_size) is non-null;
 *                                     media as prefill; hiddenOut: null or a Float32Array of
 *                                     n_tokens x hidden_size; logitsMode/logits as prefill, except
 *                                     that logits may be null whatever the mode; decode: boolean.
 *                                     Which of them a range takes (and a missing buffer) is the
 *                                     core's check, a status; the addon checks types, lengths and
 *                                     that outputs alias no input. On the calling thread.
 *   sessionStep(session, token, logits)          kvl_session_step -> status; logits: a
 *                                     Float32Array of vocab_size floats. On the calling thread.
 *   sessionWatchCancel(session, flag) kvl_session_watch_cancel on flag[0] of an Int32Array over a
 *                                     SharedArrayBuffer (or null): another thread (the Node main
 *                                     thread) stops a running call by setting it (Atomics.store).
 *   sessionSetRouting(session, mode, seed, ids, weights)   kvl_session_set_routing -> status
 *                                     (kvl bench --routing only): ids an Int32Array and weights a
 *                                     Float32Array of capacity x n_layers x topk, or both null;
 *                                     referenced until replaced or the session is freed.
 *
 * The vision encoder (kvl_vision_*). These two return a result, not a status, so a failed
 * kvl_status is thrown: an Error whose message is the core's detail (kvl_engine_last_error, else
 * kvl_strerror), code ERR_KVL_STATUS and a numeric `status` property (the host rebuilds its
 * CoreError from them). Caller mistakes throw TypeError / RangeError as above.
 *   visionBytes(engine, grids)        kvl_vision_bytes -> bytes (a Number): the working memory of
 *                                     one encode of these images. grids: Int32Array of n_images x
 *                                     (gh, gw), so of even length (0 images = 0 bytes). The core
 *                                     checks the grids (positive multiples of the merge kernel,
 *                                     under the position table) and that vision is loaded.
 *   visionEncode(engine, pixelValues, grids, out)   kvl_vision_encode -> undefined. grids as
 *                                     visionBytes (checked by the core first, through
 *                                     kvl_vision_bytes); pixelValues: a Float32Array of exactly
 *                                     sum(gh*gw) x 3 x patch x patch floats; out: a Float32Array of
 *                                     exactly sum((gh/merge_h)*(gw/merge_w)) x hidden_size floats
 *                                     (FP32 text-space embeddings, not rounded), sharing no memory
 *                                     with the inputs. The core allocates its working memory for
 *                                     the call. Runs to completion on the calling thread.
 *
 * The three structs above (kvl_engine_options, kvl_engine_info, kvl_stats) are converted from the
 * core's layout table (kvl_struct_layout), never field by field: a member's property is its C name
 * in camelCase (vocab_size -> vocabSize), a BOOL32 member a boolean.
 *
 * To add a function: write a napi_callback below and add one row to kvl_functions[].
 * Every napi call goes through NAPI_CALL, which throws a JS Error naming the call and returns
 * NULL (the JS caller then sees the exception).
 */
#define BUILDING_NODE_EXTENSION 1 /* node_api.h: import the napi_* symbols (dllimport on Windows) */
#include <node_api.h>

#include <stddef.h>
#include <stdint.h>
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

/* Reads `value` as a UTF-8 string into a malloc'd buffer (caller frees). Throws a TypeError
 * naming argument `index` of `fn` and returns NULL when it is not a string. */
static char *string_from_value(napi_env env, napi_value value, const char *fn, size_t index)
{
    napi_valuetype type = napi_undefined;
    napi_status st = napi_typeof(env, value, &type);
    if (st != napi_ok) {
        throw_napi_failure(env, st, "napi_typeof");
        return NULL;
    }
    if (type != napi_string) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument %u must be a string", fn,
                 (unsigned)index + 1);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    size_t len = 0;
    st = napi_get_value_string_utf8(env, value, NULL, 0, &len);
    if (st != napi_ok) {
        throw_napi_failure(env, st, "napi_get_value_string_utf8");
        return NULL;
    }
    char *s = malloc(len + 1);
    if (!s) {
        napi_throw_error(env, "ERR_KVL_NOMEM", "kvl addon: out of memory");
        return NULL;
    }
    st = napi_get_value_string_utf8(env, value, s, len + 1, &len);
    if (st != napi_ok) {
        free(s);
        throw_napi_failure(env, st, "napi_get_value_string_utf8");
        return NULL;
    }
    return s;
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
    if (index >= argc || index >= sizeof argv / sizeof argv[0]) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument %u must be a string", fn,
                 (unsigned)index + 1);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    return string_from_value(env, argv[index], fn, index);
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

static napi_value js_expert_q4_extent_bytes(napi_env env, napi_callback_info info)
{
    napi_value argv[2], v;
    size_t inter, hidden;
    if (!get_args(env, info, argv, 2, "expertQ4ExtentBytes") ||
        !get_size_arg(env, argv[0], &inter, "expertQ4ExtentBytes", 0) ||
        !get_size_arg(env, argv[1], &hidden, "expertQ4ExtentBytes", 1))
        return NULL;
    NAPI_CALL(env, napi_create_double(env, (double)kvl_expert_q4_extent_bytes(inter, hidden), &v));
    return v;
}

/* packExpert (q4 = 0) and packExpertQ4 (q4 = 1): the same arguments, the same checks */
static napi_value pack_expert_any(napi_env env, napi_callback_info info, int q4)
{
    const char *fn = q4 ? "packExpertQ4" : "packExpert";
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
    if (n_gate != inter * hidden || n_up != inter * hidden || n_down != inter * hidden) {
        char msg[128];
        snprintf(msg, sizeof msg, "kvl addon: %s: matrix sizes differ from I x H", fn);
        return throw_error(env, "ERR_INVALID_ARG_VALUE", msg);
    }
    kvl_status st = q4 ? kvl_pack_expert_q4(gate, up, down, inter, hidden, out, n_out)
                       : kvl_pack_expert(gate, up, down, inter, hidden, out, n_out);
    NAPI_CALL(env, napi_create_int32(env, (int32_t)st, &v));
    return v;
}

static napi_value js_pack_expert(napi_env env, napi_callback_info info)
{
    return pack_expert_any(env, info, 0);
}

static napi_value js_pack_expert_q4(napi_env env, napi_callback_info info)
{
    return pack_expert_any(env, info, 1);
}

static napi_value js_pack_q8_rows(napi_env env, napi_callback_info info)
{
    const char *fn = "packQ8Rows";
    napi_value argv[4], v;
    void *w, *out;
    size_t n_w, n_out, rows, cols;
    if (!get_args(env, info, argv, 4, fn) ||
        !get_typed_arg(env, argv[0], napi_uint16_array, &w, &n_w, fn, 0) ||
        !get_size_arg(env, argv[1], &rows, fn, 1) || !get_size_arg(env, argv[2], &cols, fn, 2) ||
        !get_typed_arg(env, argv[3], napi_uint8_array, &out, &n_out, fn, 3))
        return NULL;
    if (n_w != rows * cols)
        return throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: packQ8Rows: matrix size differs from rows x cols");
    kvl_status st = kvl_pack_q8_rows(w, rows, cols, out, n_out);
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

static int get_integer(napi_env env, napi_value value, double min, double max, int64_t *out,
                       const char *fn, const char *what);

/* sampleToken(logits: Float32Array, temperature, topK, topP, rng: BigUint64Array(1),
 * workspace: Int32Array(>= logits.length)) -> token: kvl_sample with the sampler state in rng[0]
 * (advanced in place); logits are used as scratch. */
static napi_value js_sample_token(napi_env env, napi_callback_info info)
{
    const char *fn = "sampleToken";
    napi_value argv[6], result;
    void *logits, *rng, *workspace;
    size_t n_logits, n_rng, n_work;
    double temperature, top_p;
    int64_t top_k;
    if (!get_args(env, info, argv, 6, fn) ||
        !get_typed_arg(env, argv[0], napi_float32_array, &logits, &n_logits, fn, 0) ||
        !get_typed_arg(env, argv[4], napi_biguint64_array, &rng, &n_rng, fn, 4) ||
        !get_typed_arg(env, argv[5], napi_int32_array, &workspace, &n_work, fn, 5) ||
        !get_integer(env, argv[2], 0, 2147483647.0, &top_k, fn, "topK"))
        return NULL;
    NAPI_CALL(env, napi_get_value_double(env, argv[1], &temperature));
    NAPI_CALL(env, napi_get_value_double(env, argv[3], &top_p));
    if (n_logits < 1 || n_logits > 2147483647u || n_rng != 1 || n_work < n_logits)
        return throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: sampleToken: logits must be "
                           "non-empty, rng hold 1 word and workspace at least as many ints as logits");
    kvl_sampler s;
    s.temperature = (float)temperature;
    s.top_k = (int32_t)top_k;
    s.top_p = (float)top_p;
    memcpy(&s.rng_state, rng, 8);
    int32_t token = kvl_sample(&s, (float *)logits, (int32_t)n_logits, (int32_t *)workspace);
    memcpy(rng, &s.rng_state, 8);
    NAPI_CALL(env, napi_create_int32(env, token, &result));
    return result;
}

/* samplerSeed(rng: BigUint64Array(1)): rng[0] = the kvl_sampler_seed state of seed rng[0]. */
static napi_value js_sampler_seed(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    void *rng;
    size_t n_rng;
    if (!get_args(env, info, argv, 1, "samplerSeed") ||
        !get_typed_arg(env, argv[0], napi_biguint64_array, &rng, &n_rng, "samplerSeed", 0))
        return NULL;
    if (n_rng != 1)
        return throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: samplerSeed: rng holds 1 word");
    kvl_sampler s;
    uint64_t seed;
    memset(&s, 0, sizeof s);
    memcpy(&seed, rng, 8);
    kvl_sampler_seed(&s, seed);
    memcpy(rng, &s.rng_state, 8);
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

/* ---------------------------------------------------------------- engine and session handles */

/* An engine or a session reaches JS as a napi_external over a box, type-tagged so that a handle
 * of the other kind (or any other external) is refused with a TypeError. The box outlives the C
 * object: freeing sets the pointer to NULL, after which every call but a free throws an Error
 * "… engine closed" / "… session closed" (code ERR_KVL_CLOSED), and a second free does nothing;
 * only the external's finalizer frees the box itself. So neither a double free nor a use after
 * free can be reached from JS.
 *
 * Order of frees: a session box holds a strong napi_ref on its engine's external, so an engine
 * is not collected while one of its sessions is reachable. An engine box also lists its open
 * sessions: freeing the engine (engineFree, or its finalizer, which can then only run first at
 * environment teardown) frees those sessions first and detaches them, so kvl_session_free never
 * runs after kvl_engine_free of its engine and no box ever points at a freed box.
 * A box is only touched on the thread of the env that made it (externals do not cross
 * worker_threads), so none of this takes a lock. */
typedef struct session_box session_box;

typedef struct engine_box {
    kvl_engine *engine;    /* NULL once freed */
    int32_t vocab, hidden; /* kvl_engine_info, cached at open for the argument checks */
    session_box *sessions; /* the open sessions of this engine (doubly linked) */
} engine_box;

struct session_box {
    kvl_session *session;  /* NULL once freed */
    engine_box *owner;     /* NULL once freed (or detached by the engine's free) */
    session_box *prev, *next;
    napi_ref engine_ref;   /* strong reference on the owner's external; NULL once released */
    napi_ref cancel_ref;   /* the watched cancel flag's Int32Array, kept alive; NULL if none */
    napi_ref routing_ref[2]; /* sessionSetRouting's ids and weights arrays, kept alive; NULL if none */
};

static const napi_type_tag ENGINE_TAG = {0x6b766c5f656e6769ULL, 0x6e655f68616e646cULL};
static const napi_type_tag SESSION_TAG = {0x6b766c5f73657373ULL, 0x696f6e5f68616e64ULL};

static void session_close(session_box *b)
{
    if (!b->session)
        return;
    kvl_session_free(b->session);
    b->session = NULL;
    if (b->prev)
        b->prev->next = b->next;
    else if (b->owner)
        b->owner->sessions = b->next;
    if (b->next)
        b->next->prev = b->prev;
    b->prev = b->next = NULL;
    b->owner = NULL;
}

static void engine_close(engine_box *b)
{
    while (b->sessions)
        session_close(b->sessions);
    if (b->engine) {
        kvl_engine_free(b->engine);
        b->engine = NULL;
    }
}

static void engine_finalize(napi_env env, void *data, void *hint)
{
    (void)env;
    (void)hint;
    engine_close(data);
    free(data);
}

static void session_finalize(napi_env env, void *data, void *hint)
{
    (void)hint;
    session_box *b = data;
    session_close(b);
    if (b->engine_ref)
        napi_delete_reference(env, b->engine_ref); /* a finalizer has no one to report to */
    if (b->cancel_ref)
        napi_delete_reference(env, b->cancel_ref);
    for (int i = 0; i < 2; i++)
        if (b->routing_ref[i])
            napi_delete_reference(env, b->routing_ref[i]);
    free(b);
}

/* The box behind handle argument 1 of `fn`, or NULL after throwing: a TypeError when the value
 * is not a handle of this kind, an Error "<kind> closed" when it was freed and `open` is set. */
static void *get_handle(napi_env env, napi_value value, const napi_type_tag *tag, const char *kind,
                        int open, const char *fn)
{
    napi_valuetype type = napi_undefined;
    bool tagged = false;
    void *box = NULL;
    char msg[160];
    if (napi_typeof(env, value, &type) != napi_ok || type != napi_external ||
        napi_check_object_type_tag(env, value, tag, &tagged) != napi_ok || !tagged ||
        napi_get_value_external(env, value, &box) != napi_ok || !box) {
        snprintf(msg, sizeof msg, "kvl addon: %s: argument 1 must be a kvl %s handle", fn, kind);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    if (open && (tag == &ENGINE_TAG ? ((engine_box *)box)->engine == NULL
                                    : ((session_box *)box)->session == NULL)) {
        snprintf(msg, sizeof msg, "kvl addon: %s: %s closed", fn, kind);
        napi_throw_error(env, "ERR_KVL_CLOSED", msg);
        return NULL;
    }
    return box;
}

static engine_box *get_engine(napi_env env, napi_value value, int open, const char *fn)
{
    return get_handle(env, value, &ENGINE_TAG, "engine", open, fn);
}

static session_box *get_session(napi_env env, napi_value value, int open, const char *fn)
{
    return get_handle(env, value, &SESSION_TAG, "session", open, fn);
}

/* Reads an integer-valued JS number in [min, max] (bounds within +-2^53) into *out, or throws
 * (TypeError: not a number; RangeError: not an integer in range) and returns 0. */
static int get_integer(napi_env env, napi_value value, double min, double max, int64_t *out,
                       const char *fn, const char *what)
{
    napi_valuetype type = napi_undefined;
    double d = 0;
    char msg[224];
    if (napi_typeof(env, value, &type) != napi_ok || type != napi_number ||
        napi_get_value_double(env, value, &d) != napi_ok) {
        snprintf(msg, sizeof msg, "kvl addon: %s: %s must be a number", fn, what);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return 0;
    }
    if (!(d >= min && d <= max) || d != (double)(int64_t)d) {
        snprintf(msg, sizeof msg, "kvl addon: %s: %s must be an integer in [%.0f, %.0f], got %g",
                 fn, what, min, max, d);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return 0;
    }
    *out = (int64_t)d;
    return 1;
}

static int get_int32(napi_env env, napi_value value, int32_t *out, const char *fn, const char *what)
{
    int64_t v;
    if (!get_integer(env, value, (double)INT32_MIN, (double)INT32_MAX, &v, fn, what))
        return 0;
    *out = (int32_t)v;
    return 1;
}

static int is_nullish(napi_env env, napi_value value)
{
    napi_valuetype type = napi_undefined;
    return napi_typeof(env, value, &type) == napi_ok && (type == napi_null || type == napi_undefined);
}

/* Whether two byte ranges share a byte (a logits array must not alias the inputs). */
static int overlaps(const void *a, size_t a_bytes, const void *b, size_t b_bytes)
{
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return a_bytes && b_bytes && pa < pb + b_bytes && pb < pa + a_bytes;
}

/* ---------------------------------------------------------------- the boundary structs */

/* kvl_engine_options, kvl_engine_info and kvl_stats cross as plain objects, converted member by
 * member from the core's own table (kvl_struct_layout, generated from the X-macro rows that
 * declare them in kvl_core.h): nothing here names a member. A member's property is its C name in
 * camelCase, each '_' dropped and the character after it upper-cased (vocab_size -> vocabSize);
 * the WebAssembly host applies the same rule (host/core/wasm-engine.ts), and test/boundary.test.ts
 * holds both to the TypeScript types. */
static void js_field_name(const char *c_name, char *out, size_t out_len)
{
    size_t j = 0;
    for (size_t i = 0; c_name[i] && j + 1 < out_len; i++) {
        char c = c_name[i];
        if (c == '_' && c_name[i + 1]) {
            c = c_name[++i];
            if (c >= 'a' && c <= 'z')
                c = (char)(c - 'a' + 'A');
        }
        out[j++] = c;
    }
    out[j] = '\0';
}

#define KVL_JS_NAME_BYTES 64 /* the longest member name is 26 characters */

/* kvl_struct_layout, or NULL with an Error thrown (the core describes every KVL_STRUCT_*). */
static const kvl_field_desc *core_layout(napi_env env, int which, int *count, size_t *bytes)
{
    const kvl_field_desc *fields = kvl_struct_layout(which, count, bytes);
    if (!fields) {
        char msg[96];
        snprintf(msg, sizeof msg, "kvl addon: the core has no layout for struct %d", which);
        napi_throw_error(env, "ERR_KVL_INTERNAL", msg);
    }
    return fields;
}

/* The struct at base (a KVL_STRUCT_* `which`) as an object: int32 and 64-bit members as numbers
 * (64-bit ones exact below 2^53), BOOL32 members as booleans, char arrays as strings (up to the
 * first NUL). */
static napi_value struct_to_object(napi_env env, int which, const void *base)
{
    int n = 0;
    const kvl_field_desc *fields = core_layout(env, which, &n, NULL);
    if (!fields)
        return NULL;
    napi_value obj;
    NAPI_CALL(env, napi_create_object(env, &obj));
    for (int i = 0; i < n; i++) {
        const kvl_field_desc *f = &fields[i];
        const char *p = (const char *)base + f->offset;
        napi_value v;
        int32_t i32;
        int64_t i64;
        uint64_t u64;
        switch (f->kind) {
        case KVL_FIELD_I32:
            memcpy(&i32, p, sizeof i32);
            NAPI_CALL(env, napi_create_int32(env, i32, &v));
            break;
        case KVL_FIELD_BOOL32:
            memcpy(&i32, p, sizeof i32);
            NAPI_CALL(env, napi_get_boolean(env, i32 != 0, &v));
            break;
        case KVL_FIELD_I64:
            memcpy(&i64, p, sizeof i64);
            NAPI_CALL(env, napi_create_double(env, (double)i64, &v));
            break;
        case KVL_FIELD_U64:
            memcpy(&u64, p, sizeof u64);
            NAPI_CALL(env, napi_create_double(env, (double)u64, &v));
            break;
        case KVL_FIELD_CHARS: {
            const char *end = memchr(p, '\0', f->bytes);
            NAPI_CALL(env, napi_create_string_utf8(env, p, end ? (size_t)(end - p) : f->bytes, &v));
            break;
        }
        default: {
            char msg[160];
            snprintf(msg, sizeof msg, "kvl addon: member %.64s of struct %d has an unknown kind %d",
                     f->name, which, (int)f->kind);
            return throw_error(env, "ERR_KVL_INTERNAL", msg);
        }
        }
        char name[KVL_JS_NAME_BYTES];
        js_field_name(f->name, name, sizeof name);
        NAPI_CALL(env, napi_set_named_property(env, obj, name, v));
    }
    return obj;
}

/* An object -> the struct at base (a KVL_STRUCT_* `which`), zeroed first: every property optional
 * (absent = 0, the core's default), each an integer in its member's range (the core checks the
 * values); a BOOL32 member also takes a boolean. Errors name `what` and the property. Throws and
 * returns 0 on a bad value. Only numeric members can be written (no input struct has text). */
static int object_to_struct(napi_env env, napi_value obj, int which, void *base, const char *fn,
                            const char *what)
{
    const double max_safe = 9007199254740991.0;
    int n = 0;
    size_t bytes = 0;
    const kvl_field_desc *fields = core_layout(env, which, &n, &bytes);
    if (!fields)
        return 0;
    memset(base, 0, bytes);
    for (int i = 0; i < n; i++) {
        const kvl_field_desc *f = &fields[i];
        char name[KVL_JS_NAME_BYTES], label[128];
        js_field_name(f->name, name, sizeof name);
        snprintf(label, sizeof label, "%.48s %s", what, name);
        napi_value v;
        napi_valuetype type = napi_undefined;
        napi_status st = napi_get_named_property(env, obj, name, &v);
        if (st != napi_ok) {
            throw_napi_failure(env, st, "napi_get_named_property");
            return 0;
        }
        if (napi_typeof(env, v, &type) != napi_ok || type == napi_undefined)
            continue;
        char *dst = (char *)base + f->offset;
        int64_t x;
        if (f->kind == KVL_FIELD_BOOL32 && type == napi_boolean) {
            bool b = false;
            st = napi_get_value_bool(env, v, &b);
            if (st != napi_ok) {
                throw_napi_failure(env, st, "napi_get_value_bool");
                return 0;
            }
            x = b;
        } else if (f->kind == KVL_FIELD_I32 || f->kind == KVL_FIELD_BOOL32) {
            if (!get_integer(env, v, (double)INT32_MIN, (double)INT32_MAX, &x, fn, label))
                return 0;
        } else if (f->kind == KVL_FIELD_U64) {
            if (!get_integer(env, v, 0, max_safe, &x, fn, label))
                return 0;
        } else if (f->kind == KVL_FIELD_I64) {
            if (!get_integer(env, v, -max_safe, max_safe, &x, fn, label))
                return 0;
        } else {
            char msg[256];
            snprintf(msg, sizeof msg, "kvl addon: %.64s: %.128s cannot be set (member kind %d)", fn,
                     label, (int)f->kind);
            throw_error(env, "ERR_KVL_INTERNAL", msg);
            return 0;
        }
        if (f->kind == KVL_FIELD_I32 || f->kind == KVL_FIELD_BOOL32) {
            int32_t y = (int32_t)x;
            memcpy(dst, &y, sizeof y);
        } else if (f->kind == KVL_FIELD_U64) {
            uint64_t y = (uint64_t)x;
            memcpy(dst, &y, sizeof y);
        } else {
            memcpy(dst, &x, sizeof x);
        }
    }
    return 1;
}

/* constants(which) -> [{ name, value }]: kvl_constants (a KVL_CONST_* list of codes). RangeError
 * for a `which` the core does not have. */
static napi_value js_constants(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    int32_t which;
    if (!get_args(env, info, argv, 1, "constants") || !get_int32(env, argv[0], &which, "constants", "which"))
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

/* structLayout(which) -> { bytes, fields: [{ name, cName, offset, bytes, kind }] }:
 * kvl_struct_layout with each member's JS property name (name) beside its C name; kind is the
 * KVL_FIELD_* number. RangeError for a `which` the core does not describe. */
static napi_value js_struct_layout(napi_env env, napi_callback_info info)
{
    const char *fn = "structLayout";
    napi_value argv[1];
    int32_t which;
    if (!get_args(env, info, argv, 1, fn) || !get_int32(env, argv[0], &which, fn, "which"))
        return NULL;
    int n = 0;
    size_t bytes = 0;
    const kvl_field_desc *fields = kvl_struct_layout(which, &n, &bytes);
    if (!fields) {
        char msg[128];
        snprintf(msg, sizeof msg, "kvl addon: structLayout: the core describes no struct %d",
                 (int)which);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    napi_value result, list, v;
    NAPI_CALL(env, napi_create_object(env, &result));
    NAPI_CALL(env, napi_create_double(env, (double)bytes, &v));
    NAPI_CALL(env, napi_set_named_property(env, result, "bytes", v));
    NAPI_CALL(env, napi_create_array_with_length(env, (size_t)n, &list));
    for (int i = 0; i < n; i++) {
        napi_value row;
        char name[KVL_JS_NAME_BYTES];
        js_field_name(fields[i].name, name, sizeof name);
        NAPI_CALL(env, napi_create_object(env, &row));
        NAPI_CALL(env, napi_create_string_utf8(env, name, NAPI_AUTO_LENGTH, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "name", v));
        NAPI_CALL(env, napi_create_string_utf8(env, fields[i].name, NAPI_AUTO_LENGTH, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "cName", v));
        NAPI_CALL(env, napi_create_uint32(env, fields[i].offset, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "offset", v));
        NAPI_CALL(env, napi_create_uint32(env, fields[i].bytes, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "bytes", v));
        NAPI_CALL(env, napi_create_int32(env, fields[i].kind, &v));
        NAPI_CALL(env, napi_set_named_property(env, row, "kind", v));
        NAPI_CALL(env, napi_set_element(env, list, (uint32_t)i, row));
    }
    NAPI_CALL(env, napi_set_named_property(env, result, "fields", list));
    return result;
}

/* { status, <name>: value } — the shape of the calls that return a status and a result. */
static napi_value status_result(napi_env env, kvl_status status, const char *name, napi_value value)
{
    napi_value obj, js_status;
    NAPI_CALL(env, napi_create_object(env, &obj));
    NAPI_CALL(env, napi_create_int32(env, (int32_t)status, &js_status));
    NAPI_CALL(env, napi_set_named_property(env, obj, "status", js_status));
    NAPI_CALL(env, napi_set_named_property(env, obj, name, value));
    return obj;
}

static napi_value make_status(napi_env env, kvl_status status)
{
    napi_value v;
    NAPI_CALL(env, napi_create_int32(env, (int32_t)status, &v));
    return v;
}

/* ---------------------------------------------------------------- engine functions */

/* The engineOpen codes object -> kvl_engine_options (object_to_struct: every property optional,
 * absent = 0, the core's default; loadVision may be a boolean). codes may be null. */
static int read_engine_options(napi_env env, napi_value codes, kvl_engine_options *o, const char *fn)
{
    memset(o, 0, sizeof *o);
    if (!codes || is_nullish(env, codes))
        return 1;
    napi_valuetype type = napi_undefined;
    if (napi_typeof(env, codes, &type) != napi_ok || type != napi_object) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument 2 must be an object of option codes", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return 0;
    }
    return object_to_struct(env, codes, KVL_STRUCT_ENGINE_OPTIONS, o, fn, "option code");
}

/* A fresh engine handle owning `engine` (freed here when the handle cannot be made). */
static napi_value wrap_engine(napi_env env, kvl_engine *engine)
{
    kvl_engine_info info;
    if (kvl_engine_get_info(engine, &info) != KVL_OK) {
        kvl_engine_free(engine);
        return throw_error(env, "ERR_KVL_INTERNAL",
                           "kvl addon: engineOpen: kvl_engine_get_info failed on a new engine");
    }
    engine_box *b = calloc(1, sizeof *b);
    if (!b) {
        kvl_engine_free(engine);
        return throw_error(env, "ERR_KVL_NOMEM", "kvl addon: engineOpen: out of memory");
    }
    b->engine = engine;
    b->vocab = info.vocab_size;
    b->hidden = info.hidden_size;
    napi_value v;
    napi_status st = napi_create_external(env, b, engine_finalize, NULL, &v);
    if (st != napi_ok) {
        engine_close(b);
        free(b);
        throw_napi_failure(env, st, "napi_create_external");
        return NULL;
    }
    st = napi_type_tag_object(env, v, &ENGINE_TAG);
    if (st != napi_ok) {
        engine_close(b); /* the finalizer frees the box */
        throw_napi_failure(env, st, "napi_type_tag_object");
        return NULL;
    }
    return v;
}

#define KVL_OPEN_ERR_BYTES 8192 /* the core's open errors quote paths of up to 4 KiB */

static napi_value js_engine_open(napi_env env, napi_callback_info info)
{
    const char *fn = "engineOpen";
    napi_value argv[2];
    size_t argc = 2;
    NAPI_CALL(env, napi_get_cb_info(env, info, &argc, argv, NULL, NULL));
    if (argc < 1)
        return throw_error(env, "ERR_MISSING_ARGS", "kvl addon: engineOpen takes (packDir, codes)");
    kvl_engine_options options;
    if (!read_engine_options(env, argc >= 2 ? argv[1] : NULL, &options, fn))
        return NULL;
    char *dir = string_from_value(env, argv[0], fn, 0);
    if (!dir)
        return NULL;
    char *err = calloc(KVL_OPEN_ERR_BYTES, 1);
    if (!err) {
        free(dir);
        return throw_error(env, "ERR_KVL_NOMEM", "kvl addon: engineOpen: out of memory");
    }
    kvl_engine *engine = NULL;
    kvl_status status = kvl_engine_open(dir, &options, &engine, err, KVL_OPEN_ERR_BYTES);
    free(dir);
    if (status == KVL_OK && !engine) {
        free(err);
        return throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: engineOpen: kvl_engine_open returned no engine");
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
        throw_napi_failure(env, st, "napi_create_string_utf8");
        return NULL;
    }
    napi_value js_engine;
    if (engine) {
        js_engine = wrap_engine(env, engine);
        if (!js_engine)
            return NULL;
    } else {
        NAPI_CALL(env, napi_get_null(env, &js_engine));
    }
    napi_value result = status_result(env, status, "engine", js_engine);
    if (!result)
        return NULL;
    NAPI_CALL(env, napi_set_named_property(env, result, "error", js_error));
    return result;
}

static napi_value js_engine_free(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!get_args(env, info, argv, 1, "engineFree") || !(b = get_engine(env, argv[0], 0, "engineFree")))
        return NULL;
    engine_close(b);
    return NULL;
}

static napi_value js_engine_info(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!get_args(env, info, argv, 1, "engineInfo") || !(b = get_engine(env, argv[0], 1, "engineInfo")))
        return NULL;
    kvl_engine_info out;
    kvl_status st = kvl_engine_get_info(b->engine, &out);
    if (st != KVL_OK)
        return throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: engineInfo: kvl_engine_get_info failed");
    return struct_to_object(env, KVL_STRUCT_ENGINE_INFO, &out);
}

static napi_value js_engine_stats(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!get_args(env, info, argv, 1, "engineStats") || !(b = get_engine(env, argv[0], 1, "engineStats")))
        return NULL;
    kvl_stats out;
    kvl_status st = kvl_engine_get_stats(b->engine, &out);
    if (st != KVL_OK)
        return throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: engineStats: kvl_engine_get_stats failed");
    return struct_to_object(env, KVL_STRUCT_STATS, &out);
}

static napi_value js_engine_reset_stats(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!get_args(env, info, argv, 1, "engineResetStats") ||
        !(b = get_engine(env, argv[0], 1, "engineResetStats")))
        return NULL;
    kvl_engine_reset_stats(b->engine);
    return NULL;
}

static napi_value js_engine_last_error(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    engine_box *b;
    if (!get_args(env, info, argv, 1, "engineLastError") ||
        !(b = get_engine(env, argv[0], 1, "engineLastError")))
        return NULL;
    const char *msg = kvl_engine_last_error(b->engine);
    return make_string(env, msg ? msg : "", NAPI_AUTO_LENGTH);
}

/* ---------------------------------------------------------------- session functions */

/* (engine, maxContext, maxBatch) -> the open engine box and kvl_session_options, or NULL. */
static engine_box *get_session_args(napi_env env, napi_callback_info info, napi_value *engine_value,
                                    kvl_session_options *o, const char *fn)
{
    napi_value argv[3];
    engine_box *b;
    memset(o, 0, sizeof *o);
    if (!get_args(env, info, argv, 3, fn) || !(b = get_engine(env, argv[0], 1, fn)) ||
        !get_int32(env, argv[1], &o->max_context, fn, "argument 2 (maxContext)") ||
        !get_int32(env, argv[2], &o->max_batch, fn, "argument 3 (maxBatch)"))
        return NULL;
    *engine_value = argv[0];
    return b;
}

static napi_value js_session_bytes(napi_env env, napi_callback_info info)
{
    napi_value engine_value, js_bytes;
    kvl_session_options o;
    engine_box *b = get_session_args(env, info, &engine_value, &o, "sessionBytes");
    if (!b)
        return NULL;
    uint64_t bytes = 0;
    kvl_status status = kvl_session_bytes(b->engine, &o, &bytes);
    NAPI_CALL(env, napi_create_double(env, status == KVL_OK ? (double)bytes : 0.0, &js_bytes));
    return status_result(env, status, "bytes", js_bytes);
}

static napi_value js_session_new(napi_env env, napi_callback_info info)
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
        return status_result(env, status == KVL_OK ? KVL_ERR_INTERNAL : status, "session", js_session);
    }
    session_box *b = calloc(1, sizeof *b);
    if (!b) {
        kvl_session_free(session);
        return throw_error(env, "ERR_KVL_NOMEM", "kvl addon: sessionNew: out of memory");
    }
    b->session = session;
    b->owner = e;
    b->next = e->sessions;
    if (e->sessions)
        e->sessions->prev = b;
    e->sessions = b;
    napi_status st = napi_create_reference(env, engine_value, 1, &b->engine_ref);
    const char *what = "napi_create_reference";
    if (st == napi_ok) {
        st = napi_create_external(env, b, session_finalize, NULL, &js_session);
        what = "napi_create_external";
    }
    if (st != napi_ok) {
        session_close(b);
        if (b->engine_ref)
            napi_delete_reference(env, b->engine_ref);
        free(b);
        throw_napi_failure(env, st, what);
        return NULL;
    }
    st = napi_type_tag_object(env, js_session, &SESSION_TAG);
    if (st != napi_ok) {
        session_close(b); /* the finalizer frees the box and the reference */
        throw_napi_failure(env, st, "napi_type_tag_object");
        return NULL;
    }
    return status_result(env, KVL_OK, "session", js_session);
}

static napi_value js_session_free(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    session_box *b;
    if (!get_args(env, info, argv, 1, "sessionFree") || !(b = get_session(env, argv[0], 0, "sessionFree")))
        return NULL;
    session_close(b);
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

static napi_value js_session_position(napi_env env, napi_callback_info info)
{
    napi_value argv[1], v;
    session_box *b;
    if (!get_args(env, info, argv, 1, "sessionPosition") ||
        !(b = get_session(env, argv[0], 1, "sessionPosition")))
        return NULL;
    NAPI_CALL(env, napi_create_int32(env, kvl_session_position(b->session), &v));
    return v;
}

static napi_value js_session_truncate(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionTruncate";
    napi_value argv[2];
    session_box *b;
    int32_t n;
    if (!get_args(env, info, argv, 2, fn) || !(b = get_session(env, argv[0], 1, fn)) ||
        !get_int32(env, argv[1], &n, fn, "argument 2 (n)"))
        return NULL;
    return make_status(env, kvl_session_truncate(b->session, n));
}

static napi_value js_session_prefill(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionPrefill";
    napi_value argv[6];
    session_box *b;
    void *tokens, *media = NULL, *logits = NULL;
    size_t n_tokens, n_media_floats = 0, n_logits = 0;
    int32_t n_media, mode;
    char msg[256];
    if (!get_args(env, info, argv, 6, fn) || !(b = get_session(env, argv[0], 1, fn)) ||
        !get_typed_arg(env, argv[1], napi_int32_array, &tokens, &n_tokens, fn, 1) ||
        !get_int32(env, argv[3], &n_media, fn, "argument 4 (nMedia)") ||
        !get_int32(env, argv[4], &mode, fn, "argument 5 (logitsMode)"))
        return NULL;
    const uint64_t vocab = (uint64_t)b->owner->vocab, hidden = (uint64_t)b->owner->hidden;
    if (n_tokens > (size_t)INT32_MAX) {
        snprintf(msg, sizeof msg, "kvl addon: %s: %llu tokens is more than one call takes", fn,
                 (unsigned long long)n_tokens);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    if (n_media < 0) {
        snprintf(msg, sizeof msg, "kvl addon: %s: nMedia must be >= 0, got %d", fn, (int)n_media);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    if (mode < KVL_LOGITS_NONE || mode > KVL_LOGITS_ALL) {
        snprintf(msg, sizeof msg, "kvl addon: %s: logitsMode must be 0 (none), 1 (last) or 2 (all), got %d",
                 fn, (int)mode);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    if (is_nullish(env, argv[2])) {
        if (n_media > 0) {
            snprintf(msg, sizeof msg, "kvl addon: %s: media must be a Float32Array of %d rows, got none",
                     fn, (int)n_media);
            napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
            return NULL;
        }
    } else {
        if (!get_typed_arg(env, argv[2], napi_float32_array, &media, &n_media_floats, fn, 2))
            return NULL;
        if ((uint64_t)n_media_floats != (uint64_t)n_media * hidden) {
            snprintf(msg, sizeof msg, "kvl addon: %s: media holds %llu floats, not nMedia (%d) x "
                     "hidden_size (%d)", fn, (unsigned long long)n_media_floats, (int)n_media, (int)hidden);
            napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
            return NULL;
        }
    }
    if (mode == KVL_LOGITS_NONE) {
        if (!is_nullish(env, argv[5])) {
            snprintf(msg, sizeof msg, "kvl addon: %s: logits must be null with logitsMode 0 (none)", fn);
            napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
            return NULL;
        }
    } else {
        if (!get_typed_arg(env, argv[5], napi_float32_array, &logits, &n_logits, fn, 5))
            return NULL;
        uint64_t want = mode == KVL_LOGITS_LAST ? vocab : (uint64_t)n_tokens * vocab;
        if ((uint64_t)n_logits != want) {
            snprintf(msg, sizeof msg, "kvl addon: %s: logits holds %llu floats; logitsMode %d with %llu "
                     "tokens needs %llu (vocab %d)", fn, (unsigned long long)n_logits, (int)mode,
                     (unsigned long long)n_tokens, (unsigned long long)want, (int)vocab);
            napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
            return NULL;
        }
        if (overlaps(logits, n_logits * sizeof(float), tokens, n_tokens * sizeof(int32_t)) ||
            overlaps(logits, n_logits * sizeof(float), media, n_media_floats * sizeof(float))) {
            snprintf(msg, sizeof msg, "kvl addon: %s: logits shares memory with tokens or media", fn);
            napi_throw_range_error(env, "ERR_INVALID_ARG_VALUE", msg);
            return NULL;
        }
    }
    kvl_status status = kvl_session_prefill(b->session, tokens, (int32_t)n_tokens, media, n_media,
                                            mode, logits);
    return make_status(env, status);
}

/* An optional Float32Array argument (null/undefined -> NULL, 0 floats) of exactly `want` floats;
 * `what` names it in the errors. Returns 0 after throwing. */
static int get_optional_floats(napi_env env, napi_value value, uint64_t want, void **data, size_t *n,
                               const char *fn, unsigned index, const char *what)
{
    *data = NULL;
    *n = 0;
    if (is_nullish(env, value))
        return 1;
    if (!get_typed_arg(env, value, napi_float32_array, data, n, fn, index))
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

static napi_value js_session_forward(napi_env env, napi_callback_info info)
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
    if (!get_args(env, info, argv, 9, fn) || !(b = get_session(env, argv[0], 1, fn)) ||
        !get_int32(env, argv[4], &n_media, fn, "argument 5 (nMedia)") ||
        !get_int32(env, argv[6], &mode, fn, "argument 7 (logitsMode)"))
        return NULL;
    if (napi_typeof(env, argv[8], &type) != napi_ok || type != napi_boolean) {
        snprintf(msg, sizeof msg, "kvl addon: %s: argument 9 (decode) must be a boolean", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    NAPI_CALL(env, napi_get_value_bool(env, argv[8], &decode));
    const uint64_t vocab = (uint64_t)b->owner->vocab, hidden = (uint64_t)b->owner->hidden;
    const int tokens_given = !is_nullish(env, argv[1]), hidden_given = !is_nullish(env, argv[2]);
    if (tokens_given == hidden_given) {
        snprintf(msg, sizeof msg, "kvl addon: %s: give exactly one of tokens (argument 2) and hiddenIn "
                 "(argument 3)", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    uint64_t n;
    if (tokens_given) {
        if (!get_typed_arg(env, argv[1], napi_int32_array, &tokens, &n_tokens, fn, 1))
            return NULL;
        n = n_tokens;
    } else {
        if (!get_typed_arg(env, argv[2], napi_float32_array, &hidden_in, &n_hidden_in, fn, 2))
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
    if (n_media > 0 && is_nullish(env, argv[3])) {
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
    if (is_nullish(env, argv[7])) {
        /* NULL */
    } else if (mode == KVL_LOGITS_NONE) {
        snprintf(msg, sizeof msg, "kvl addon: %s: logits must be null with logitsMode 0 (none)", fn);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    } else if (!get_typed_arg(env, argv[7], napi_float32_array, &logits, &n_logits, fn, 7)) {
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
        if (overlaps(outs[i], out_bytes[i], tokens, n_tokens * sizeof(int32_t)) ||
            overlaps(outs[i], out_bytes[i], hidden_in, n_hidden_in * sizeof(float)) ||
            overlaps(outs[i], out_bytes[i], media, n_media_floats * sizeof(float)) ||
            (i == 0 && overlaps(hidden_out, out_bytes[0], logits, out_bytes[1]))) {
            snprintf(msg, sizeof msg, "kvl addon: %s: hiddenOut and logits must not share memory with "
                     "the inputs or each other", fn);
            napi_throw_range_error(env, "ERR_INVALID_ARG_VALUE", msg);
            return NULL;
        }
    }
    kvl_status status = kvl_session_forward(b->session, tokens, hidden_in, (int32_t)n, media, n_media,
                                            hidden_out, mode, logits, decode ? 1 : 0);
    return make_status(env, status);
}

static napi_value js_session_step(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionStep";
    napi_value argv[3];
    session_box *b;
    int32_t token;
    void *logits;
    size_t n_logits;
    if (!get_args(env, info, argv, 3, fn) || !(b = get_session(env, argv[0], 1, fn)) ||
        !get_int32(env, argv[1], &token, fn, "argument 2 (token)") ||
        !get_typed_arg(env, argv[2], napi_float32_array, &logits, &n_logits, fn, 2))
        return NULL;
    if ((uint64_t)n_logits != (uint64_t)b->owner->vocab) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: logits holds %llu floats, not vocab_size (%d)", fn,
                 (unsigned long long)n_logits, (int)b->owner->vocab);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    return make_status(env, kvl_session_step(b->session, token, logits));
}

/* sessionWatchCancel(session, flag: Int32Array over a SharedArrayBuffer | null): the core stops
 * the session's calls when flag[0] != 0 (kvl_session_watch_cancel). The array is referenced
 * until replaced or the session is freed, so its memory outlives the watch; it must be shared
 * memory (a SharedArrayBuffer cannot be detached), which the host guarantees. */
static napi_value js_session_watch_cancel(napi_env env, napi_callback_info info)
{
    napi_value argv[2];
    session_box *b;
    napi_valuetype type = napi_undefined;
    void *data = NULL;
    size_t length = 0;
    if (!get_args(env, info, argv, 2, "sessionWatchCancel") ||
        !(b = get_session(env, argv[0], 1, "sessionWatchCancel")))
        return NULL;
    NAPI_CALL(env, napi_typeof(env, argv[1], &type));
    if (type != napi_null) {
        if (!get_typed_arg(env, argv[1], napi_int32_array, &data, &length, "sessionWatchCancel", 1))
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
static napi_value js_session_set_routing(napi_env env, napi_callback_info info)
{
    const char *fn = "sessionSetRouting";
    napi_value argv[5];
    session_box *b;
    int32_t mode;
    int64_t seed;
    if (!get_args(env, info, argv, 5, fn) || !(b = get_session(env, argv[0], 1, fn)) ||
        !get_int32(env, argv[1], &mode, fn, "argument 2 (mode)") ||
        !get_integer(env, argv[2], 0.0, 4294967295.0, &seed, fn, "argument 3 (seed)"))
        return NULL;
    void *ids = NULL, *weights = NULL;
    size_t n_ids = 0, n_w = 0;
    napi_valuetype t_ids = napi_undefined, t_w = napi_undefined;
    NAPI_CALL(env, napi_typeof(env, argv[3], &t_ids));
    NAPI_CALL(env, napi_typeof(env, argv[4], &t_w));
    if (t_ids != napi_null && !get_typed_arg(env, argv[3], napi_int32_array, &ids, &n_ids, fn, 3))
        return NULL;
    if (t_w != napi_null && !get_typed_arg(env, argv[4], napi_float32_array, &weights, &n_w, fn, 4))
        return NULL;
    kvl_engine_info ei;
    if (kvl_engine_get_info(b->owner->engine, &ei) != KVL_OK)
        return throw_error(env, "ERR_KVL_STATUS", "kvl addon: sessionSetRouting: engine info failed");
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
        return make_status(env, status); /* the core kept its previous rows */
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
    return make_status(env, KVL_OK);
}

/* ---------------------------------------------------------------- vision */

/* Throws the failed kvl_status of a call on b's engine: an Error with the core's detail as its
 * message, code ERR_KVL_STATUS and a numeric `status` property. Returns NULL. */
static napi_value throw_status(napi_env env, const engine_box *b, kvl_status status)
{
    const char *detail = kvl_engine_last_error(b->engine);
    if (!detail || !*detail)
        detail = kvl_strerror(status);
    if (!detail)
        detail = "kvl: the core call failed";
    napi_value code, message, error, js_status;
    NAPI_CALL(env, napi_create_string_utf8(env, "ERR_KVL_STATUS", NAPI_AUTO_LENGTH, &code));
    NAPI_CALL(env, napi_create_string_utf8(env, detail, NAPI_AUTO_LENGTH, &message));
    NAPI_CALL(env, napi_create_error(env, code, message, &error));
    NAPI_CALL(env, napi_create_int32(env, (int32_t)status, &js_status));
    NAPI_CALL(env, napi_set_named_property(env, error, "status", js_status));
    NAPI_CALL(env, napi_throw(env, error));
    return NULL;
}

/* Reads argument `index` of fn as the grids Int32Array: n_images x (gh, gw). Returns 0 after
 * throwing (wrong type: TypeError; odd length or too many images: RangeError). */
static int get_grids(napi_env env, napi_value value, int32_t **grids, int32_t *n_images, const char *fn,
                     unsigned index)
{
    void *data = NULL;
    size_t n = 0;
    if (!get_typed_arg(env, value, napi_int32_array, &data, &n, fn, index))
        return 0;
    if (n % 2 != 0 || n / 2 > (size_t)INT32_MAX) {
        char msg[200];
        snprintf(msg, sizeof msg, "kvl addon: %s: grids holds %llu int32s; want n_images x 2 (rows, "
                 "columns of patches per image)", fn, (unsigned long long)n);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return 0;
    }
    *grids = data;
    *n_images = (int32_t)(n / 2);
    return 1;
}

static napi_value js_vision_bytes(napi_env env, napi_callback_info info)
{
    const char *fn = "visionBytes";
    napi_value argv[2], v;
    engine_box *b;
    int32_t *grids, n_images;
    if (!get_args(env, info, argv, 2, fn) || !(b = get_engine(env, argv[0], 1, fn)) ||
        !get_grids(env, argv[1], &grids, &n_images, fn, 1))
        return NULL;
    uint64_t bytes = 0;
    kvl_status status = kvl_vision_bytes(b->engine, grids, n_images, &bytes);
    if (status != KVL_OK)
        return throw_status(env, b, status);
    NAPI_CALL(env, napi_create_double(env, (double)bytes, &v));
    return v;
}

static napi_value js_vision_encode(napi_env env, napi_callback_info info)
{
    const char *fn = "visionEncode";
    napi_value argv[4];
    engine_box *b;
    int32_t *grids, n_images;
    void *pixels, *out;
    size_t n_pixels, n_out;
    char msg[300];
    if (!get_args(env, info, argv, 4, fn) || !(b = get_engine(env, argv[0], 1, fn)) ||
        !get_typed_arg(env, argv[1], napi_float32_array, &pixels, &n_pixels, fn, 1) ||
        !get_grids(env, argv[2], &grids, &n_images, fn, 2) ||
        !get_typed_arg(env, argv[3], napi_float32_array, &out, &n_out, fn, 3))
        return NULL;
    /* The core's checks of the grids and of the engine first (vision loaded, grids positive
     * multiples of the merge kernel, at most 2^24 patches): after them the sizes below are exact
     * and cannot overflow. */
    uint64_t bytes = 0;
    kvl_status status = kvl_vision_bytes(b->engine, grids, n_images, &bytes);
    if (status != KVL_OK)
        return throw_status(env, b, status);
    kvl_engine_info ei;
    if (kvl_engine_get_info(b->engine, &ei) != KVL_OK)
        return throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: visionEncode: kvl_engine_get_info failed");
    if (ei.vision_patch_size <= 0 || ei.vision_merge_h <= 0 || ei.vision_merge_w <= 0)
        return throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: visionEncode: the engine reports no vision dimensions");
    uint64_t patches = 0, rows = 0;
    for (int32_t i = 0; i < n_images; i++) {
        const uint64_t gh = (uint64_t)grids[2 * i], gw = (uint64_t)grids[2 * i + 1];
        patches += gh * gw;
        rows += (gh / (uint64_t)ei.vision_merge_h) * (gw / (uint64_t)ei.vision_merge_w);
    }
    const uint64_t patch_values = 3u * (uint64_t)ei.vision_patch_size * (uint64_t)ei.vision_patch_size;
    if ((uint64_t)n_pixels != patches * patch_values) {
        snprintf(msg, sizeof msg, "kvl addon: %s: pixelValues holds %llu floats; the grids' %llu patches "
                 "need %llu (patches x 3 x %d x %d)", fn, (unsigned long long)n_pixels,
                 (unsigned long long)patches, (unsigned long long)(patches * patch_values),
                 (int)ei.vision_patch_size, (int)ei.vision_patch_size);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    if ((uint64_t)n_out != rows * (uint64_t)b->hidden) {
        snprintf(msg, sizeof msg, "kvl addon: %s: out holds %llu floats; the grids' %llu merged rows need "
                 "%llu (rows x hidden_size %d)", fn, (unsigned long long)n_out, (unsigned long long)rows,
                 (unsigned long long)(rows * (uint64_t)b->hidden), (int)b->hidden);
        napi_throw_range_error(env, "ERR_OUT_OF_RANGE", msg);
        return NULL;
    }
    if (overlaps(out, n_out * sizeof(float), pixels, n_pixels * sizeof(float)) ||
        overlaps(out, n_out * sizeof(float), grids, (size_t)n_images * 2 * sizeof(int32_t))) {
        snprintf(msg, sizeof msg, "kvl addon: %s: out shares memory with pixelValues or grids", fn);
        napi_throw_range_error(env, "ERR_INVALID_ARG_VALUE", msg);
        return NULL;
    }
    status = kvl_vision_encode(b->engine, pixels, grids, n_images, out);
    if (status != KVL_OK)
        return throw_status(env, b, status);
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
    {"packQ8Rows", js_pack_q8_rows},
    {"expertQ4ExtentBytes", js_expert_q4_extent_bytes},
    {"packExpertQ4", js_pack_expert_q4},
    {"pcg64Seed", js_pcg64_seed},
    {"synthUniform", js_synth_uniform},
    {"sampleToken", js_sample_token},
    {"samplerSeed", js_sampler_seed},
    {"structLayout", js_struct_layout},
    {"constants", js_constants},
    {"engineOpen", js_engine_open},
    {"engineFree", js_engine_free},
    {"engineInfo", js_engine_info},
    {"engineStats", js_engine_stats},
    {"engineResetStats", js_engine_reset_stats},
    {"engineLastError", js_engine_last_error},
    {"sessionBytes", js_session_bytes},
    {"sessionNew", js_session_new},
    {"sessionFree", js_session_free},
    {"sessionPosition", js_session_position},
    {"sessionTruncate", js_session_truncate},
    {"sessionPrefill", js_session_prefill},
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
