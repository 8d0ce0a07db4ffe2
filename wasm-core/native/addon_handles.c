/* addon_handles.c — the engine and session handles: type-tagged napi_externals over the boxes of
 * addon.h, their lifetime (close, finalize, the order of frees) and the checks that a JS value is
 * an open handle of the right kind.
 */
#include "addon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const napi_type_tag ENGINE_TAG = {0x6b766c5f656e6769ULL, 0x6e655f68616e646cULL};
static const napi_type_tag SESSION_TAG = {0x6b766c5f73657373ULL, 0x696f6e5f68616e64ULL};

void addon_session_close(session_box *b)
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

void addon_engine_close(engine_box *b)
{
    while (b->sessions)
        addon_session_close(b->sessions);
    if (b->engine) {
        kvl_engine_free(b->engine);
        b->engine = NULL;
    }
}

static void engine_finalize(napi_env env, void *data, void *hint)
{
    (void)env;
    (void)hint;
    addon_engine_close(data);
    free(data);
}

static void session_finalize(napi_env env, void *data, void *hint)
{
    (void)hint;
    session_box *b = data;
    addon_session_close(b);
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

engine_box *addon_get_engine(napi_env env, napi_value value, int open, const char *fn)
{
    return get_handle(env, value, &ENGINE_TAG, "engine", open, fn);
}

session_box *addon_get_session(napi_env env, napi_value value, int open, const char *fn)
{
    return get_handle(env, value, &SESSION_TAG, "session", open, fn);
}

/* A fresh engine handle owning `engine` (freed here when the handle cannot be made). */
napi_value addon_wrap_engine(napi_env env, kvl_engine *engine)
{
    kvl_engine_info info;
    if (kvl_engine_get_info(engine, &info) != KVL_OK) {
        kvl_engine_free(engine);
        return addon_throw_error(env, "ERR_KVL_INTERNAL",
                                 "kvl addon: engineOpen: kvl_engine_get_info failed on a new engine");
    }
    engine_box *b = calloc(1, sizeof *b);
    if (!b) {
        kvl_engine_free(engine);
        return addon_throw_error(env, "ERR_KVL_NOMEM", "kvl addon: engineOpen: out of memory");
    }
    b->engine = engine;
    b->vocab = info.vocab_size;
    b->hidden = info.hidden_size;
    napi_value v;
    napi_status st = napi_create_external(env, b, engine_finalize, NULL, &v);
    if (st != napi_ok) {
        addon_engine_close(b);
        free(b);
        addon_throw_napi_failure(env, st, "napi_create_external");
        return NULL;
    }
    st = napi_type_tag_object(env, v, &ENGINE_TAG);
    if (st != napi_ok) {
        addon_engine_close(b); /* the finalizer frees the box */
        addon_throw_napi_failure(env, st, "napi_type_tag_object");
        return NULL;
    }
    return v;
}

/* A fresh session handle owning `session` of the engine box e, whose handle is engine_value (the
 * session keeps it alive); NULL after throwing, the session freed. */
napi_value addon_wrap_session(napi_env env, engine_box *e, napi_value engine_value, kvl_session *session)
{
    napi_value js_session;
    session_box *b = calloc(1, sizeof *b);
    if (!b) {
        kvl_session_free(session);
        return addon_throw_error(env, "ERR_KVL_NOMEM", "kvl addon: sessionNew: out of memory");
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
        addon_session_close(b);
        if (b->engine_ref)
            napi_delete_reference(env, b->engine_ref);
        free(b);
        addon_throw_napi_failure(env, st, what);
        return NULL;
    }
    st = napi_type_tag_object(env, js_session, &SESSION_TAG);
    if (st != napi_ok) {
        addon_session_close(b); /* the finalizer frees the box and the reference */
        addon_throw_napi_failure(env, st, "napi_type_tag_object");
        return NULL;
    }
    return js_session;
}
