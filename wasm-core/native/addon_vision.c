/* addon_vision.c — the vision encoder's exports (kvl_vision_bytes, kvl_vision_encode). These
 * return a result, not a status, so a failed kvl_status is thrown (code ERR_KVL_STATUS, a numeric
 * `status` property, the core's detail as the message).
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (!addon_get_typed_arg(env, value, napi_int32_array, &data, &n, fn, index))
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

napi_value js_vision_bytes(napi_env env, napi_callback_info info)
{
    const char *fn = "visionBytes";
    napi_value argv[2], v;
    engine_box *b;
    int32_t *grids, n_images;
    if (!addon_get_args(env, info, argv, 2, fn) || !(b = addon_get_engine(env, argv[0], 1, fn)) ||
        !get_grids(env, argv[1], &grids, &n_images, fn, 1))
        return NULL;
    uint64_t bytes = 0;
    kvl_status status = kvl_vision_bytes(b->engine, grids, n_images, &bytes);
    if (status != KVL_OK)
        return throw_status(env, b, status);
    NAPI_CALL(env, napi_create_double(env, (double)bytes, &v));
    return v;
}

napi_value js_vision_encode(napi_env env, napi_callback_info info)
{
    const char *fn = "visionEncode";
    napi_value argv[4];
    engine_box *b;
    int32_t *grids, n_images;
    void *pixels, *out;
    size_t n_pixels, n_out;
    char msg[300];
    if (!addon_get_args(env, info, argv, 4, fn) || !(b = addon_get_engine(env, argv[0], 1, fn)) ||
        !addon_get_typed_arg(env, argv[1], napi_float32_array, &pixels, &n_pixels, fn, 1) ||
        !get_grids(env, argv[2], &grids, &n_images, fn, 2) ||
        !addon_get_typed_arg(env, argv[3], napi_float32_array, &out, &n_out, fn, 3))
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
        return addon_throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: visionEncode: kvl_engine_get_info failed");
    if (ei.vision_patch_size <= 0 || ei.vision_merge_h <= 0 || ei.vision_merge_w <= 0)
        return addon_throw_error(env, "ERR_KVL_INTERNAL", "kvl addon: visionEncode: the engine reports no vision dimensions");
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
    if (addon_overlaps(out, n_out * sizeof(float), pixels, n_pixels * sizeof(float)) ||
        addon_overlaps(out, n_out * sizeof(float), grids, (size_t)n_images * 2 * sizeof(int32_t))) {
        snprintf(msg, sizeof msg, "kvl addon: %s: out shares memory with pixelValues or grids", fn);
        napi_throw_range_error(env, "ERR_INVALID_ARG_VALUE", msg);
        return NULL;
    }
    status = kvl_vision_encode(b->engine, pixels, grids, n_images, out);
    if (status != KVL_OK)
        return throw_status(env, b, status);
    return NULL;
}
