/* addon.h — what the units of the Node-API addon share: the napi error convention (NAPI_CALL),
 * the readers of JS arguments and the boundary structs (addon_convert.c), the engine and session
 * handle boxes (addon_handles.c), and each unit's exported callbacks for the module table in
 * addon.c. Internal to the addon; what each export does for JS is described once, in the
 * NativeAddon interface of host/core/native-backend.ts.
 *
 * Conventions every unit keeps: a callback that fails throws and returns NULL (the JS caller sees
 * the exception); a reader that fails throws and returns 0 or NULL; a caller mistake is a
 * TypeError / RangeError naming the export and argument; nothing calls exit() or aborts, and there
 * is no global state (the addon loads in any number of worker_threads).
 */
#ifndef KVL_ADDON_H
#define KVL_ADDON_H

#define BUILDING_NODE_EXTENSION 1 /* node_api.h: import the napi_* symbols (dllimport on Windows) */
#include <node_api.h>

#include <stddef.h>
#include <stdint.h>

#include "kvl_core.h"

/* ---------------------------------------------------------------- errors (addon.c) */

/* Throws "kvl addon: <what> failed: <napi detail>" unless an exception is already pending. Must
 * run right after the failed call: napi_get_last_error_info describes the last call made. */
void addon_throw_napi_failure(napi_env env, napi_status status, const char *what);
/* Throws a plain Error with the given code and message; returns NULL so callbacks can
 * `return addon_throw_error(...)`. */
napi_value addon_throw_error(napi_env env, const char *code, const char *msg);

/* Every napi call of a callback goes through NAPI_CALL: on failure it throws a JS Error naming
 * the call and returns NULL from the callback. */
#define NAPI_CALL(env, call)                                                                      \
    do {                                                                                          \
        napi_status napi_call_status_ = (call);                                                   \
        if (napi_call_status_ != napi_ok) {                                                       \
            addon_throw_napi_failure((env), napi_call_status_, #call);                            \
            return NULL;                                                                          \
        }                                                                                         \
    } while (0)

/* ---------------------------------------------------------------- JS values (addon_convert.c) */

napi_value addon_make_string(napi_env env, const char *s, size_t len);
/* A JS string as a malloc'd UTF-8 buffer (caller frees), from a value or argument `index`. */
char *addon_string_from_value(napi_env env, napi_value value, const char *fn, size_t index);
char *addon_get_string_arg(napi_env env, napi_callback_info info, size_t index, const char *fn);
/* A typed array of exactly type `want` (argument `index` of fn, for the error). */
int addon_get_typed_arg(napi_env env, napi_value value, napi_typedarray_type want, void **data,
                        size_t *length, const char *fn, unsigned index);
/* A non-negative integer number below 2^53. */
int addon_get_size_arg(napi_env env, napi_value value, size_t *out, const char *fn, unsigned index);
/* napi_get_cb_info with at least n arguments. */
int addon_get_args(napi_env env, napi_callback_info info, napi_value *argv, size_t n, const char *fn);
/* An integer-valued number in [min, max] (bounds within +-2^53); `what` names it in the error. */
int addon_get_integer(napi_env env, napi_value value, double min, double max, int64_t *out,
                      const char *fn, const char *what);
int addon_get_int32(napi_env env, napi_value value, int32_t *out, const char *fn, const char *what);
int addon_is_nullish(napi_env env, napi_value value);
/* Whether two byte ranges share a byte (an output must not alias the inputs). */
int addon_overlaps(const void *a, size_t a_bytes, const void *b, size_t b_bytes);

/* The boundary structs (kvl_engine_options, kvl_engine_info, kvl_stats) as plain objects,
 * converted from the core's layout table (kvl_struct_layout), never member by member. */
napi_value addon_struct_to_object(napi_env env, int which, const void *base);
int addon_object_to_struct(napi_env env, napi_value obj, int which, void *base, const char *fn,
                           const char *what);
/* { status, <name>: value }, and a kvl_status as a number. */
napi_value addon_status_result(napi_env env, kvl_status status, const char *name, napi_value value);
napi_value addon_make_status(napi_env env, kvl_status status);

/* ---------------------------------------------------------------- handles (addon_handles.c) */

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


/* A fresh engine handle owning `engine` (freed when the handle cannot be made), or NULL. */
napi_value addon_wrap_engine(napi_env env, kvl_engine *engine);
napi_value addon_wrap_session(napi_env env, engine_box *e, napi_value engine_value, kvl_session *session);
/* The box behind handle argument 1 of fn, or NULL after throwing (TypeError: not a handle of
 * this kind; Error ERR_KVL_CLOSED: freed, when `open` is set). */
engine_box *addon_get_engine(napi_env env, napi_value value, int open, const char *fn);
session_box *addon_get_session(napi_env env, napi_value value, int open, const char *fn);
/* kvl_session_free / kvl_engine_free (after the engine's open sessions) once; the box stays. */
void addon_session_close(session_box *b);
void addon_engine_close(engine_box *b);

/* ---------------------------------------------------------------- the exported callbacks */

/* addon.c: the core and its kernel sets */
napi_value js_abi_version(napi_env env, napi_callback_info info);
napi_value js_kernel_sets(napi_env env, napi_callback_info info);
napi_value js_default_kernel_set(napi_env env, napi_callback_info info);
napi_value js_conformance(napi_env env, napi_callback_info info);
napi_value js_constants(napi_env env, napi_callback_info info);
/* addon_convert.c */
napi_value js_struct_layout(napi_env env, napi_callback_info info);
/* addon_pack.c: packing, the sampler and the synthetic weights' generator */
napi_value js_expert_extent_bytes(napi_env env, napi_callback_info info);
napi_value js_pack_expert(napi_env env, napi_callback_info info);
napi_value js_pack_q8_rows(napi_env env, napi_callback_info info);
napi_value js_expert_q4_extent_bytes(napi_env env, napi_callback_info info);
napi_value js_pack_expert_q4(napi_env env, napi_callback_info info);
napi_value js_pcg64_seed(napi_env env, napi_callback_info info);
napi_value js_synth_uniform(napi_env env, napi_callback_info info);
napi_value js_sample_token(napi_env env, napi_callback_info info);
napi_value js_sampler_seed(napi_env env, napi_callback_info info);
/* addon_engine.c */
napi_value js_engine_open(napi_env env, napi_callback_info info);
napi_value js_engine_free(napi_env env, napi_callback_info info);
napi_value js_engine_info(napi_env env, napi_callback_info info);
napi_value js_engine_stats(napi_env env, napi_callback_info info);
napi_value js_engine_reset_stats(napi_env env, napi_callback_info info);
napi_value js_engine_set_expert_slots(napi_env env, napi_callback_info info);
napi_value js_engine_last_error(napi_env env, napi_callback_info info);
/* addon_session.c */
napi_value js_session_bytes(napi_env env, napi_callback_info info);
napi_value js_session_new(napi_env env, napi_callback_info info);
napi_value js_session_free(napi_env env, napi_callback_info info);
napi_value js_session_position(napi_env env, napi_callback_info info);
napi_value js_session_truncate(napi_env env, napi_callback_info info);
napi_value js_session_forward(napi_env env, napi_callback_info info);
napi_value js_session_step(napi_env env, napi_callback_info info);
napi_value js_session_watch_cancel(napi_env env, napi_callback_info info);
napi_value js_session_set_routing(napi_env env, napi_callback_info info);
/* addon_vision.c */
napi_value js_vision_bytes(napi_env env, napi_callback_info info);
napi_value js_vision_encode(napi_env env, napi_callback_info info);

#endif
