/* addon_convert.c — JS values to C and back for every unit of the addon: the argument readers
 * (strings, typed arrays, integers, nullish) and the boundary structs (kvl_engine_options,
 * kvl_engine_info, kvl_stats), converted from the core's own layout table (kvl_struct_layout),
 * never member by member; plus the structLayout export that shows that table to JS.
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

napi_value addon_make_string(napi_env env, const char *s, size_t len)
{
    napi_value v;
    NAPI_CALL(env, napi_create_string_utf8(env, s, len, &v));
    return v;
}

/* Reads `value` as a UTF-8 string into a malloc'd buffer (caller frees). Throws a TypeError
 * naming argument `index` of `fn` and returns NULL when it is not a string. */
char *addon_string_from_value(napi_env env, napi_value value, const char *fn, size_t index)
{
    napi_valuetype type = napi_undefined;
    napi_status st = napi_typeof(env, value, &type);
    if (st != napi_ok) {
        addon_throw_napi_failure(env, st, "napi_typeof");
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
        addon_throw_napi_failure(env, st, "napi_get_value_string_utf8");
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
        addon_throw_napi_failure(env, st, "napi_get_value_string_utf8");
        return NULL;
    }
    return s;
}

/* Reads argument `index` as a UTF-8 string into a malloc'd buffer (caller frees). Throws a
 * TypeError and returns NULL when it is missing or not a string. */
char *addon_get_string_arg(napi_env env, napi_callback_info info, size_t index, const char *fn)
{
    napi_value argv[4];
    size_t argc = sizeof argv / sizeof argv[0];
    napi_status st = napi_get_cb_info(env, info, &argc, argv, NULL, NULL);
    if (st != napi_ok) {
        addon_throw_napi_failure(env, st, "napi_get_cb_info");
        return NULL;
    }
    if (index >= argc || index >= sizeof argv / sizeof argv[0]) {
        char msg[160];
        snprintf(msg, sizeof msg, "kvl addon: %s: argument %u must be a string", fn,
                 (unsigned)index + 1);
        napi_throw_type_error(env, "ERR_INVALID_ARG_TYPE", msg);
        return NULL;
    }
    return addon_string_from_value(env, argv[index], fn, index);
}

/* Reads argument `index` as a typed array of the given type into (*data, *length), or throws a
 * TypeError naming the function and returns 0. */
int addon_get_typed_arg(napi_env env, napi_value value, napi_typedarray_type want, void **data,
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
int addon_get_size_arg(napi_env env, napi_value value, size_t *out, const char *fn, unsigned index)
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
int addon_get_args(napi_env env, napi_callback_info info, napi_value *argv, size_t n, const char *fn)
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

/* Reads an integer-valued JS number in [min, max] (bounds within +-2^53) into *out, or throws
 * (TypeError: not a number; RangeError: not an integer in range) and returns 0. */
int addon_get_integer(napi_env env, napi_value value, double min, double max, int64_t *out,
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

int addon_get_int32(napi_env env, napi_value value, int32_t *out, const char *fn, const char *what)
{
    int64_t v;
    if (!addon_get_integer(env, value, (double)INT32_MIN, (double)INT32_MAX, &v, fn, what))
        return 0;
    *out = (int32_t)v;
    return 1;
}

int addon_is_nullish(napi_env env, napi_value value)
{
    napi_valuetype type = napi_undefined;
    return napi_typeof(env, value, &type) == napi_ok && (type == napi_null || type == napi_undefined);
}

/* Whether two byte ranges share a byte (a logits array must not alias the inputs). */
int addon_overlaps(const void *a, size_t a_bytes, const void *b, size_t b_bytes)
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
napi_value addon_struct_to_object(napi_env env, int which, const void *base)
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
            return addon_throw_error(env, "ERR_KVL_INTERNAL", msg);
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
int addon_object_to_struct(napi_env env, napi_value obj, int which, void *base, const char *fn,
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
            addon_throw_napi_failure(env, st, "napi_get_named_property");
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
                addon_throw_napi_failure(env, st, "napi_get_value_bool");
                return 0;
            }
            x = b;
        } else if (f->kind == KVL_FIELD_I32 || f->kind == KVL_FIELD_BOOL32) {
            if (!addon_get_integer(env, v, (double)INT32_MIN, (double)INT32_MAX, &x, fn, label))
                return 0;
        } else if (f->kind == KVL_FIELD_U64) {
            if (!addon_get_integer(env, v, 0, max_safe, &x, fn, label))
                return 0;
        } else if (f->kind == KVL_FIELD_I64) {
            if (!addon_get_integer(env, v, -max_safe, max_safe, &x, fn, label))
                return 0;
        } else {
            char msg[256];
            snprintf(msg, sizeof msg, "kvl addon: %.64s: %.128s cannot be set (member kind %d)", fn,
                     label, (int)f->kind);
            addon_throw_error(env, "ERR_KVL_INTERNAL", msg);
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

/* structLayout(which) -> { bytes, fields: [{ name, cName, offset, bytes, kind }] }:
 * kvl_struct_layout with each member's JS property name (name) beside its C name; kind is the
 * KVL_FIELD_* number. RangeError for a `which` the core does not describe. */
napi_value js_struct_layout(napi_env env, napi_callback_info info)
{
    const char *fn = "structLayout";
    napi_value argv[1];
    int32_t which;
    if (!addon_get_args(env, info, argv, 1, fn) || !addon_get_int32(env, argv[0], &which, fn, "which"))
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
napi_value addon_status_result(napi_env env, kvl_status status, const char *name, napi_value value)
{
    napi_value obj, js_status;
    NAPI_CALL(env, napi_create_object(env, &obj));
    NAPI_CALL(env, napi_create_int32(env, (int32_t)status, &js_status));
    NAPI_CALL(env, napi_set_named_property(env, obj, "status", js_status));
    NAPI_CALL(env, napi_set_named_property(env, obj, name, value));
    return obj;
}

napi_value addon_make_status(napi_env env, kvl_status status)
{
    napi_value v;
    NAPI_CALL(env, napi_create_int32(env, (int32_t)status, &v));
    return v;
}
