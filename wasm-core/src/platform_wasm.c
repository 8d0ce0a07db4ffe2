/* platform_wasm.c — platform code: the WebAssembly side of platform.h's files, the build's read
 * port: pack files opened and read by the host (Node's fs) straight into this instance's memory.
 *
 * Owns: the JavaScript imports behind platform.h's file functions on WebAssembly, and turning
 * Node's error codes into this libc's errno values (so kvl_os_strerror and the store's messages
 * read the same as natively). A direct open bypasses the page cache where Node can ask for it:
 * O_DIRECT where Node's fs.constants has it (Linux), libuv's UV_FS_O_DIRECT on Windows (which
 * Node's fs.constants does not list; see kvl_js_open); elsewhere (macOS: Node has no F_NOCACHE) a
 * direct open reports EINVAL and the store falls back to buffered reads and says so. The core
 * reads as it does natively: offsets, lengths and destinations 4096-aligned (store.h), and the
 * memory's base is page-aligned, so the addresses Node passes to the OS are aligned too.
 *
 * Every function runs on the thread that calls it: the expert cache's reader threads are
 * emscripten pthreads (Node workers), each with its own `require("fs")`, so several reads are in
 * flight at once and the thread that loaded the module is never involved. Destinations are
 * addresses in the shared memory, passed unsigned (`>>> 0`: an instance may be 4 GiB).
 * Native builds compile this file to nothing.
 */
#ifdef __EMSCRIPTEN__

#include <emscripten.h>
#include <errno.h>
#include <stdint.h>

#include "platform.h"

/* The imports report an error as -(1 + i), i the index of Node's error code in their `codes`
 * list (ERRNO_OF below, same order); a code not listed is EIO (the last entry). */

/* A file descriptor >= 0, or an error as above.
 * UV_FS_O_DIRECT_WIN32 is libuv's UV_FS_O_DIRECT on Windows (include/uv/win.h: 0x02000000), which
 * its uv_fs_open (src/win/fs.c, fs__open) turns into CreateFileW's FILE_FLAG_NO_BUFFERING; Node's
 * fs.openSync passes a numeric flags argument through to uv_fs_open unchanged (only checked to be
 * an int32), so it reaches the OS although fs.constants does not list it on win32. */
EM_JS(int, kvl_js_open, (const char *path, int direct), {
    const fs = require("fs");
    const codes = ["ENOENT", "EACCES", "EINVAL", "EISDIR", "ENOTDIR", "EMFILE", "ENFILE", "EPERM", "ELOOP", "ENAMETOOLONG", "EIO"];
    const c = fs.constants;
    const UV_FS_O_DIRECT_WIN32 = 0x02000000;
    const O_DIRECT = c.O_DIRECT !== undefined ? c.O_DIRECT : process.platform === "win32" ? UV_FS_O_DIRECT_WIN32 : undefined;
    if (direct && O_DIRECT === undefined) return -(1 + 2); /* no page-cache bypass here: EINVAL */
    try {
        return fs.openSync(UTF8ToString(path), c.O_RDONLY | (direct ? O_DIRECT : 0));
    } catch (e) {
        const i = codes.indexOf(e && e.code);
        return -(1 + (i < 0 ? codes.length - 1 : i));
    }
});

EM_JS(void, kvl_js_close, (int fd), {
    try {
        require("fs").closeSync(fd);
    } catch (e) {
        /* closing is best effort, as close(2) is for a read-only file */
    }
});

/* Size in bytes (exact below 2^53, far above any pack file), or EIO as above. */
EM_JS(double, kvl_js_file_size, (int fd), {
    try {
        return require("fs").fstatSync(fd).size;
    } catch (e) {
        return -(1 + 10);
    }
});

/* Bytes read (0 at end of file), or an error as above. */
EM_JS(double, kvl_js_pread, (int fd, void *dst, size_t len, double offset), {
    const codes = ["ENOENT", "EACCES", "EINVAL", "EISDIR", "ENOTDIR", "EMFILE", "ENFILE", "EPERM", "ELOOP", "ENAMETOOLONG", "EIO"];
    try {
        return require("fs").readSync(fd, HEAPU8, dst >>> 0, len >>> 0, offset);
    } catch (e) {
        const i = codes.indexOf(e && e.code);
        return -(1 + (i < 0 ? codes.length - 1 : i));
    }
});

/* Same order as the codes lists in the imports above. */
static const int ERRNO_OF[] = {ENOENT, EACCES, EINVAL, EISDIR, ENOTDIR, EMFILE, ENFILE, EPERM,
                               ELOOP, ENAMETOOLONG, EIO};

static int errno_of(double negative_index) {
    int i = (int)(-negative_index) - 1;
    if (i < 0 || i >= (int)(sizeof ERRNO_OF / sizeof ERRNO_OF[0])) return EIO;
    return ERRNO_OF[i];
}

int kvl_host_open_read(const char *path, int direct, int *out_fd) {
    int fd = kvl_js_open(path, direct);
    if (fd < 0) return errno_of(fd);
    *out_fd = fd;
    return 0;
}

void kvl_host_close(int fd) { kvl_js_close(fd); }

int kvl_host_file_size(int fd, uint64_t *size) {
    double n = kvl_js_file_size(fd);
    if (n < 0) return errno_of(n);
    *size = (uint64_t)n;
    return 0;
}

int kvl_host_pread(int fd, void *dst, size_t len, uint64_t offset, size_t *got) {
    double n = kvl_js_pread(fd, dst, len, (double)offset);
    if (n < 0) return errno_of(n);
    *got = (size_t)n;
    return 0;
}

#else
/* ISO C forbids an empty translation unit. */
typedef int kvl_platform_wasm_unused;
#endif
