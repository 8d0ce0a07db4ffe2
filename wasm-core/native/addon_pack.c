/* addon_pack.c — the exports the packer and the tests use without an engine: expert and Q8-row
 * packing (kvl_pack_*), the PCG64 generator of synthetic weights and the token sampler.
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

napi_value js_expert_extent_bytes(napi_env env, napi_callback_info info)
{
    napi_value argv[2], v;
    size_t inter, hidden;
    if (!addon_get_args(env, info, argv, 2, "expertExtentBytes") ||
        !addon_get_size_arg(env, argv[0], &inter, "expertExtentBytes", 0) ||
        !addon_get_size_arg(env, argv[1], &hidden, "expertExtentBytes", 1))
        return NULL;
    NAPI_CALL(env, napi_create_double(env, (double)kvl_expert_extent_bytes(inter, hidden), &v));
    return v;
}

napi_value js_expert_q4_extent_bytes(napi_env env, napi_callback_info info)
{
    napi_value argv[2], v;
    size_t inter, hidden;
    if (!addon_get_args(env, info, argv, 2, "expertQ4ExtentBytes") ||
        !addon_get_size_arg(env, argv[0], &inter, "expertQ4ExtentBytes", 0) ||
        !addon_get_size_arg(env, argv[1], &hidden, "expertQ4ExtentBytes", 1))
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
    if (!addon_get_args(env, info, argv, 6, fn) ||
        !addon_get_typed_arg(env, argv[0], napi_uint16_array, &gate, &n_gate, fn, 0) ||
        !addon_get_typed_arg(env, argv[1], napi_uint16_array, &up, &n_up, fn, 1) ||
        !addon_get_typed_arg(env, argv[2], napi_uint16_array, &down, &n_down, fn, 2) ||
        !addon_get_size_arg(env, argv[3], &inter, fn, 3) || !addon_get_size_arg(env, argv[4], &hidden, fn, 4) ||
        !addon_get_typed_arg(env, argv[5], napi_uint8_array, &out, &n_out, fn, 5))
        return NULL;
    if (n_gate != inter * hidden || n_up != inter * hidden || n_down != inter * hidden) {
        char msg[128];
        snprintf(msg, sizeof msg, "kvl addon: %s: matrix sizes differ from I x H", fn);
        return addon_throw_error(env, "ERR_INVALID_ARG_VALUE", msg);
    }
    kvl_status st = q4 ? kvl_pack_expert_q4(gate, up, down, inter, hidden, out, n_out)
                       : kvl_pack_expert(gate, up, down, inter, hidden, out, n_out);
    NAPI_CALL(env, napi_create_int32(env, (int32_t)st, &v));
    return v;
}

napi_value js_pack_expert(napi_env env, napi_callback_info info)
{
    return pack_expert_any(env, info, 0);
}

napi_value js_pack_expert_q4(napi_env env, napi_callback_info info)
{
    return pack_expert_any(env, info, 1);
}

napi_value js_pack_q8_rows(napi_env env, napi_callback_info info)
{
    const char *fn = "packQ8Rows";
    napi_value argv[4], v;
    void *w, *out;
    size_t n_w, n_out, rows, cols;
    if (!addon_get_args(env, info, argv, 4, fn) ||
        !addon_get_typed_arg(env, argv[0], napi_uint16_array, &w, &n_w, fn, 0) ||
        !addon_get_size_arg(env, argv[1], &rows, fn, 1) || !addon_get_size_arg(env, argv[2], &cols, fn, 2) ||
        !addon_get_typed_arg(env, argv[3], napi_uint8_array, &out, &n_out, fn, 3))
        return NULL;
    if (n_w != rows * cols)
        return addon_throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: packQ8Rows: matrix size differs from rows x cols");
    kvl_status st = kvl_pack_q8_rows(w, rows, cols, out, n_out);
    NAPI_CALL(env, napi_create_int32(env, (int32_t)st, &v));
    return v;
}

napi_value js_pcg64_seed(napi_env env, napi_callback_info info)
{
    napi_value argv[2];
    void *words, *state;
    size_t n_words, n_state;
    if (!addon_get_args(env, info, argv, 2, "pcg64Seed") ||
        !addon_get_typed_arg(env, argv[0], napi_biguint64_array, &words, &n_words, "pcg64Seed", 0) ||
        !addon_get_typed_arg(env, argv[1], napi_biguint64_array, &state, &n_state, "pcg64Seed", 1))
        return NULL;
    if (n_words != 4 || n_state != 4)
        return addon_throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: pcg64Seed: both arrays hold 4 words");
    kvl_pcg64 rng;
    kvl_pcg64_seed(&rng, (const uint64_t *)words);
    const uint64_t s[4] = {rng.state_hi, rng.state_lo, rng.inc_hi, rng.inc_lo};
    memcpy(state, s, sizeof s);
    return NULL;
}

/* sampleToken(logits: Float32Array, temperature, topK, topP, rng: BigUint64Array(1),
 * workspace: Int32Array(>= logits.length)) -> token: kvl_sample with the sampler state in rng[0]
 * (advanced in place); logits are used as scratch. */
napi_value js_sample_token(napi_env env, napi_callback_info info)
{
    const char *fn = "sampleToken";
    napi_value argv[6], result;
    void *logits, *rng, *workspace;
    size_t n_logits, n_rng, n_work;
    double temperature, top_p;
    int64_t top_k;
    if (!addon_get_args(env, info, argv, 6, fn) ||
        !addon_get_typed_arg(env, argv[0], napi_float32_array, &logits, &n_logits, fn, 0) ||
        !addon_get_typed_arg(env, argv[4], napi_biguint64_array, &rng, &n_rng, fn, 4) ||
        !addon_get_typed_arg(env, argv[5], napi_int32_array, &workspace, &n_work, fn, 5) ||
        !addon_get_integer(env, argv[2], 0, 2147483647.0, &top_k, fn, "topK"))
        return NULL;
    NAPI_CALL(env, napi_get_value_double(env, argv[1], &temperature));
    NAPI_CALL(env, napi_get_value_double(env, argv[3], &top_p));
    if (n_logits < 1 || n_logits > 2147483647u || n_rng != 1 || n_work < n_logits)
        return addon_throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: sampleToken: logits must be "
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
napi_value js_sampler_seed(napi_env env, napi_callback_info info)
{
    napi_value argv[1];
    void *rng;
    size_t n_rng;
    if (!addon_get_args(env, info, argv, 1, "samplerSeed") ||
        !addon_get_typed_arg(env, argv[0], napi_biguint64_array, &rng, &n_rng, "samplerSeed", 0))
        return NULL;
    if (n_rng != 1)
        return addon_throw_error(env, "ERR_INVALID_ARG_VALUE", "kvl addon: samplerSeed: rng holds 1 word");
    kvl_sampler s;
    uint64_t seed;
    memset(&s, 0, sizeof s);
    memcpy(&seed, rng, 8);
    kvl_sampler_seed(&s, seed);
    memcpy(rng, &s.rng_state, 8);
    return NULL;
}

napi_value js_synth_uniform(napi_env env, napi_callback_info info)
{
    const char *fn = "synthUniform";
    napi_value argv[5];
    void *state, *out;
    size_t n_state, count, n_out;
    double center, half;
    if (!addon_get_args(env, info, argv, 5, fn) ||
        !addon_get_typed_arg(env, argv[0], napi_biguint64_array, &state, &n_state, fn, 0) ||
        !addon_get_size_arg(env, argv[1], &count, fn, 1))
        return NULL;
    NAPI_CALL(env, napi_get_value_double(env, argv[2], &center));
    NAPI_CALL(env, napi_get_value_double(env, argv[3], &half));
    napi_typedarray_type type;
    napi_value buffer;
    size_t offset;
    bool is_typed = false;
    NAPI_CALL(env, napi_is_typedarray(env, argv[4], &is_typed));
    if (!is_typed)
        return addon_throw_error(env, "ERR_INVALID_ARG_TYPE", "kvl addon: synthUniform: out must be a Uint16Array or Float32Array");
    NAPI_CALL(env, napi_get_typedarray_info(env, argv[4], &type, &n_out, &out, &buffer, &offset));
    if ((type != napi_uint16_array && type != napi_float32_array) || n_state != 4 || count > n_out)
        return addon_throw_error(env, "ERR_INVALID_ARG_VALUE",
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
