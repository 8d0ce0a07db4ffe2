/* errbuf.h — set_err: a formatted message into a caller's error buffer (err, err_len), the one
 * helper the files that report into such buffers (store.c, expert_cache.c) share.
 * Owns: nothing but that; static inline, so no file depends on another through it. */
#ifndef KVL_ERRBUF_H
#define KVL_ERRBUF_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* Writes fmt's message into err (truncated to err_len - 1 bytes); nothing if err is NULL or
 * err_len 0. */
static inline void set_err(char *err, size_t err_len, const char *fmt, ...)
{
    va_list ap;
    if (!err || err_len == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

#endif
