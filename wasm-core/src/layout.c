/* layout.c — kvl_struct_layout and kvl_constants (kvl_core.h): the layout tables of the structs
 * that cross into JavaScript (kvl_engine_options, kvl_engine_info, kvl_stats) and the tables of
 * the codes that do (statuses, kernel levels and sets, option codes), each generated from the
 * same X-macro rows that declare the struct or enum, and the compile-time checks that pin them.
 *
 * Owns: the checks that every row's offset and size are the compiler's (offsetof / sizeof) and
 * that each struct ends where its last row does (rounded up to its alignment: no member outside
 * the rows), in every build; and the wasm32 layout of kvl_field_desc itself, which the
 * WebAssembly host reads from the instance's memory before it knows any other layout.
 * Does not own: the conversion to and from JS objects (native/addon.c, host/core/wasm-engine.ts).
 */
#include <stddef.h>

#include "kvl_core.h"

/* One table row per X-macro row: the compiler's offset and size, the row's kind. */
#define LAYOUT_ROW(T, kind, name, offset, bytes) \
    {#name, (uint32_t)offsetof(T, name), (uint32_t)sizeof(((T *)0)->name), KVL_FIELD_##kind},

/* A row whose numbers are not where the compiler put the member stops the build: move the
 * numbers only on purpose (the JS sides read whatever the table says, but other builds and any
 * saved bytes expect the old place). */
#define LAYOUT_CHECK(T, kind, name, offset, bytes)                                               \
    _Static_assert(offsetof(T, name) == (offset), #T "." #name ": its offset is not the row's"); \
    _Static_assert(sizeof(((T *)0)->name) == (bytes), #T "." #name ": its size is not the row's");

/* sizeof this union is the end of the last row (char arrays: no padding of its own). */
#define LAYOUT_END(kind, name, offset, bytes) char name[(offset) + (bytes)];
#define ROUND_UP(n, a) (((n) + (a) - 1) / (a) * (a))

#define OPTIONS_ROW(kind, name, offset, bytes) LAYOUT_ROW(kvl_engine_options, kind, name, offset, bytes)
#define OPTIONS_CHECK(kind, name, offset, bytes) LAYOUT_CHECK(kvl_engine_options, kind, name, offset, bytes)
#define INFO_ROW(kind, name, offset, bytes) LAYOUT_ROW(kvl_engine_info, kind, name, offset, bytes)
#define INFO_CHECK(kind, name, offset, bytes) LAYOUT_CHECK(kvl_engine_info, kind, name, offset, bytes)
#define STATS_ROW(kind, name, offset, bytes) LAYOUT_ROW(kvl_stats, kind, name, offset, bytes)
#define STATS_CHECK(kind, name, offset, bytes) LAYOUT_CHECK(kvl_stats, kind, name, offset, bytes)

KVL_ENGINE_OPTIONS_FIELDS(OPTIONS_CHECK)
KVL_ENGINE_INFO_FIELDS(INFO_CHECK)
KVL_STATS_FIELDS(STATS_CHECK)

union options_end { KVL_ENGINE_OPTIONS_FIELDS(LAYOUT_END) };
union info_end { KVL_ENGINE_INFO_FIELDS(LAYOUT_END) };
union stats_end { KVL_STATS_FIELDS(LAYOUT_END) };
_Static_assert(sizeof(kvl_engine_options) ==
                   ROUND_UP(sizeof(union options_end), _Alignof(kvl_engine_options)),
               "kvl_engine_options does not end where its last row does");
_Static_assert(sizeof(kvl_engine_info) == ROUND_UP(sizeof(union info_end), _Alignof(kvl_engine_info)),
               "kvl_engine_info does not end where its last row does");
_Static_assert(sizeof(kvl_stats) == ROUND_UP(sizeof(union stats_end), _Alignof(kvl_stats)),
               "kvl_stats does not end where its last row does");

#if defined(__wasm32__)
_Static_assert(sizeof(kvl_field_desc) == 16 && offsetof(kvl_field_desc, name) == 0 &&
                   offsetof(kvl_field_desc, offset) == 4 && offsetof(kvl_field_desc, bytes) == 8 &&
                   offsetof(kvl_field_desc, kind) == 12,
               "kvl_field_desc: host/core/wasm-engine.ts reads it as {name, offset, bytes, kind} at 0, 4, 8, 12");
_Static_assert(sizeof(kvl_const_desc) == 8 && offsetof(kvl_const_desc, name) == 0 &&
                   offsetof(kvl_const_desc, value) == 4,
               "kvl_const_desc: host/core/wasm-engine.ts reads it as {name, value} at 0, 4");
#endif

static const kvl_field_desc OPTIONS_LAYOUT[] = {KVL_ENGINE_OPTIONS_FIELDS(OPTIONS_ROW)};
static const kvl_field_desc INFO_LAYOUT[] = {KVL_ENGINE_INFO_FIELDS(INFO_ROW)};
static const kvl_field_desc STATS_LAYOUT[] = {KVL_STATS_FIELDS(STATS_ROW)};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

const kvl_field_desc *kvl_struct_layout(int which, int *count, size_t *struct_bytes)
{
    const kvl_field_desc *fields = NULL;
    size_t n = 0, bytes = 0;
    switch (which) {
    case KVL_STRUCT_ENGINE_OPTIONS:
        fields = OPTIONS_LAYOUT, n = COUNT(OPTIONS_LAYOUT), bytes = sizeof(kvl_engine_options);
        break;
    case KVL_STRUCT_ENGINE_INFO:
        fields = INFO_LAYOUT, n = COUNT(INFO_LAYOUT), bytes = sizeof(kvl_engine_info);
        break;
    case KVL_STRUCT_STATS:
        fields = STATS_LAYOUT, n = COUNT(STATS_LAYOUT), bytes = sizeof(kvl_stats);
        break;
    default:
        break;
    }
    if (count) *count = (int)n;
    if (struct_bytes) *struct_bytes = bytes;
    return fields;
}

/* ---- kvl_constants ---- */
#define CONST_ROW(sym, value, name) {name, value},

static const kvl_const_desc STATUS_ROWS[] = {KVL_STATUS_ROWS(CONST_ROW)};
static const kvl_const_desc KERNEL_LEVEL_ROWS[] = {KVL_KERNEL_LEVEL_ROWS(CONST_ROW)};
static const kvl_const_desc KERNEL_SET_ROWS[] = {KVL_KERNEL_SET_ROWS(CONST_ROW)};
static const kvl_const_desc ACT_ROWS[] = {KVL_ACT_ROWS(CONST_ROW)};
static const kvl_const_desc IO_ROWS[] = {KVL_IO_ROWS(CONST_ROW)};
static const kvl_const_desc KV_ROWS[] = {KVL_KV_ROWS(CONST_ROW)};
static const kvl_const_desc LOOKAHEAD_ROWS[] = {KVL_LOOKAHEAD_ROWS(CONST_ROW)};
static const kvl_const_desc LOGITS_ROWS[] = {KVL_LOGITS_ROWS(CONST_ROW)};
static const kvl_const_desc ROUTING_ROWS[] = {KVL_ROUTING_ROWS(CONST_ROW)};
static const kvl_const_desc CACHE_POLICY_ROWS[] = {KVL_CACHE_POLICY_ROWS(CONST_ROW)};
static const kvl_const_desc DTYPE_ROWS[] = {KVL_DTYPE_ROWS(CONST_ROW)};

const kvl_const_desc *kvl_constants(int which, int *count)
{
    const kvl_const_desc *rows = NULL;
    size_t n = 0;
    switch (which) {
#define CONST_CASE(id, table) \
    case id:                  \
        rows = table, n = COUNT(table); \
        break;
    CONST_CASE(KVL_CONST_STATUS, STATUS_ROWS)
    CONST_CASE(KVL_CONST_KERNEL_LEVELS, KERNEL_LEVEL_ROWS)
    CONST_CASE(KVL_CONST_KERNEL_SETS, KERNEL_SET_ROWS)
    CONST_CASE(KVL_CONST_ACT, ACT_ROWS)
    CONST_CASE(KVL_CONST_IO, IO_ROWS)
    CONST_CASE(KVL_CONST_KV, KV_ROWS)
    CONST_CASE(KVL_CONST_LOOKAHEAD, LOOKAHEAD_ROWS)
    CONST_CASE(KVL_CONST_LOGITS, LOGITS_ROWS)
    CONST_CASE(KVL_CONST_ROUTING, ROUTING_ROWS)
    CONST_CASE(KVL_CONST_CACHE_POLICY, CACHE_POLICY_ROWS)
    CONST_CASE(KVL_CONST_DTYPE, DTYPE_ROWS)
#undef CONST_CASE
    default:
        break;
    }
    if (count) *count = (int)n;
    return rows;
}
