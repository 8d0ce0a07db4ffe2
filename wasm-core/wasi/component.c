/* component.c — the canonical-ABI exports of the kvl:kernels world (kernels.wit), by hand.
 *
 * Owns: the core-module side of the component built by build.sh: one export per WIT function
 * (export names exactly the WIT names), their cabi_post_* companions that free what a result
 * allocated, and cabi_realloc, through which the host copies argument strings into linear memory.
 * Does not own: the kernels or the report (../src/kernels_*.c, kvl_core.h).
 *
 * Canonical ABI (wasm32): a string is (ptr, len) of UTF-8 bytes; a list<string> is (ptr, len) of
 * (ptr, len) pairs. A function whose flattened results exceed one value returns a pointer to a
 * return area: string and list<string> -> {ptr, len}; result<string, string> -> {u8 discriminant
 * (0 ok, 1 err), pad, ptr, len}, 12 bytes with 4-byte alignment.
 */
#include "kvl_core.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT(name) __attribute__((export_name(name)))

EXPORT("cabi_realloc")
void *cabi_realloc(void *old, size_t old_size, size_t align, size_t new_size);
void *cabi_realloc(void *old, size_t old_size, size_t align, size_t new_size)
{
    (void)old_size;
    (void)align; /* malloc's 16-byte alignment covers every canonical-ABI alignment */
    if (new_size == 0)
        return (void *)align; /* a non-null, aligned pointer the host never dereferences */
    void *p = realloc(old, new_size);
    if (!p)
        abort(); /* the canonical ABI has no way to report it: trap */
    return p;
}

typedef struct {
    const char *ptr;
    size_t len;
} cabi_string;

static _Alignas(4) uint8_t ret_area[12]; /* single-threaded module: one return area */

/* A malloc'd copy of s (strings the host reads must stay valid until cabi_post_*). */
static cabi_string copy_string(const char *s)
{
    size_t n = strlen(s);
    char *p = cabi_realloc(NULL, 0, 1, n ? n : 1);
    memcpy(p, s, n);
    return (cabi_string){p, n};
}

/* kernel-sets: func() -> list<string> */
EXPORT("kernel-sets")
void *kvl_export_kernel_sets(void);
void *kvl_export_kernel_sets(void)
{
    int n = kvl_kernel_set_count();
    cabi_string *list = cabi_realloc(NULL, 0, 4, (size_t)(n > 0 ? n : 1) * sizeof *list);
    for (int i = 0; i < n; i++)
        list[i] = copy_string(kvl_kernel_set_name(i));
    cabi_string *ret = (cabi_string *)ret_area;
    ret->ptr = (const char *)list;
    ret->len = (size_t)n;
    return ret_area;
}

EXPORT("cabi_post_kernel-sets")
void kvl_post_kernel_sets(void *area);
void kvl_post_kernel_sets(void *area)
{
    const cabi_string *ret = area;
    cabi_string *list = (cabi_string *)ret->ptr;
    for (size_t i = 0; i < ret->len; i++)
        free((void *)list[i].ptr);
    free(list);
}

/* default-kernel-set: func() -> string */
EXPORT("default-kernel-set")
void *kvl_export_default_kernel_set(void);
void *kvl_export_default_kernel_set(void)
{
    *(cabi_string *)ret_area = copy_string(kvl_kernel_set_default());
    return ret_area;
}

EXPORT("cabi_post_default-kernel-set")
void kvl_post_default_kernel_set(void *area);
void kvl_post_default_kernel_set(void *area)
{
    free((void *)((cabi_string *)area)->ptr);
}

/* conformance: func(set: string) -> result<string, string> */
EXPORT("conformance")
void *kvl_export_conformance(char *set_ptr, size_t set_len);
void *kvl_export_conformance(char *set_ptr, size_t set_len)
{
    char *name = malloc(set_len + 1);
    char *json = NULL;
    size_t cap = 64 * 1024;
    int rc = -1;
    if (name) {
        memcpy(name, set_ptr, set_len);
        name[set_len] = '\0';
        /* -2: the report did not fit; grow the buffer until it does */
        for (;;) {
            json = cabi_realloc(json, 0, 1, cap);
            rc = kvl_kernels_conformance(name, json, cap);
            if (rc != -2 || cap >= ((size_t)1 << 28))
                break;
            cap *= 2;
        }
    }
    if (set_len) /* the argument string is the callee's to free (allocated by cabi_realloc) */
        free(set_ptr);
    uint8_t *tag = ret_area;
    cabi_string *payload = (cabi_string *)(ret_area + 4);
    if (rc >= 0) {
        *tag = 0;
        payload->ptr = json;
        payload->len = strlen(json);
    } else {
        free(json);
        *tag = 1;
        if (rc == -1) {
            const char *shown = name ? name : "?";
            size_t n = strlen(shown) + 64;
            char *msg = cabi_realloc(NULL, 0, 1, n);
            snprintf(msg, n, "kernel set '%s' not available in this build", shown);
            *payload = (cabi_string){msg, strlen(msg)};
        } else {
            *payload = copy_string("conformance report too large");
        }
    }
    free(name);
    return ret_area;
}

EXPORT("cabi_post_conformance")
void kvl_post_conformance(void *area);
void kvl_post_conformance(void *area)
{
    free((void *)((cabi_string *)((uint8_t *)area + 4))->ptr);
}
