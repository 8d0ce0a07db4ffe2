/* platform.h — small internal portability layer (POSIX / Win32) for the native core.
 *
 * Owns: read-only file handles with positional reads (pread / ReadFile+OVERLAPPED), opening
 * with page-cache bypass (O_DIRECT, FILE_FLAG_NO_BUFFERING, F_NOCACHE) and the alignment such
 * reads need where the OS says (Windows: the volume's sector sizes), file sizes, aligned
 * allocation, a monotonic clock, and the core's one threading layer: thread / mutex /
 * condition-variable wrappers and atomic ints (kvl_atomic_*), used by the thread pool, the trunk
 * streamer, the expert cache, the session's cancel flags, model.c's work counters and crc32.c's
 * once-flag.
 * Does not own: any policy (what to read, when to fall back) — callers decide that.
 *
 * Everything is static inline so any .c file can include it without link-time coupling.
 * Functions return 0 on success or a system error code (errno / GetLastError()).
 * Threads: declare entry points as `static KVL_THREAD_RET KVL_THREAD_CALL fn(void *arg)` and
 * `return KVL_THREAD_RETURN;` so no trampoline allocation is needed on either platform.
 * On POSIX, a file including this must define _GNU_SOURCE (or get it from the build) before its
 * first system header, or -std=c11 hides pread, posix_memalign, clock_gettime and O_DIRECT.
 */
#ifndef KVL_PLATFORM_H
#define KVL_PLATFORM_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#include <malloc.h>
#else
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#endif

/* ------------------------------------------------------------------ files */

#ifdef __EMSCRIPTEN__
/* WebAssembly: files are the host's (Node's fs, reached through JavaScript imports in
 * platform_wasm.c, on whichever thread calls them), read straight into this instance's memory;
 * emscripten's own virtual filesystem is never used. Same contracts as below; errors are errno
 * values of this libc. */
int kvl_host_open_read(const char *path, int direct, int *out_fd);
void kvl_host_close(int fd);
int kvl_host_file_size(int fd, uint64_t *size);
int kvl_host_pread(int fd, void *dst, size_t len, uint64_t offset, size_t *got);
#endif

#ifdef _WIN32
typedef HANDLE kvl_os_file;
#define KVL_OS_FILE_INVALID INVALID_HANDLE_VALUE
/* the error code a filesystem gives when it cannot do unbuffered I/O */
#define KVL_OS_ERR_UNSUPPORTED_DIRECT ERROR_INVALID_PARAMETER
#else
typedef int kvl_os_file;
#define KVL_OS_FILE_INVALID (-1)
#define KVL_OS_ERR_UNSUPPORTED_DIRECT EINVAL
#endif

#ifdef _WIN32
/* UTF-8 path -> freshly allocated wide string (NULL on failure). */
static inline wchar_t *kvl_os_widen(const char *utf8) {
    int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, utf8, -1, NULL, 0);
    wchar_t *w;
    if (n <= 0) return NULL;
    w = (wchar_t *)malloc((size_t)n * sizeof(wchar_t));
    if (!w) return NULL;
    if (MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, utf8, -1, w, n) != n) {
        free(w);
        return NULL;
    }
    return w;
}
#endif

/* Open a file for reading. direct != 0 asks the OS to bypass its page cache. */
static inline int kvl_os_open_read(const char *path, int direct, kvl_os_file *out) {
#if defined(__EMSCRIPTEN__)
    return kvl_host_open_read(path, direct, out);
#elif defined(_WIN32)
    DWORD flags = FILE_ATTRIBUTE_NORMAL | FILE_FLAG_RANDOM_ACCESS;
    wchar_t *wpath = kvl_os_widen(path);
    HANDLE h;
    if (!wpath) return ERROR_INVALID_NAME;
    if (direct) flags = FILE_FLAG_NO_BUFFERING;
    h = CreateFileW(wpath, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE, NULL, OPEN_EXISTING,
                    flags, NULL);
    free(wpath);
    if (h == INVALID_HANDLE_VALUE) return (int)GetLastError();
    *out = h;
    return 0;
#else
    int flags = O_RDONLY;
    int fd;
#ifdef O_CLOEXEC
    flags |= O_CLOEXEC;
#endif
#if defined(O_DIRECT)
    if (direct) flags |= O_DIRECT;
#endif
    do {
        fd = open(path, flags);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return errno;
#if !defined(O_DIRECT) && defined(F_NOCACHE)
    /* macOS: no O_DIRECT, but F_NOCACHE keeps reads out of the unified buffer cache. */
    if (direct && fcntl(fd, F_NOCACHE, 1) != 0) {
        int e = errno;
        close(fd);
        return e;
    }
#elif !defined(O_DIRECT)
    if (direct) {
        close(fd);
        return EINVAL;
    }
#endif
    *out = fd;
    return 0;
#endif
}

/* The alignment in bytes that reads through f, opened with direct != 0 at path, must keep, where
 * the OS says: on Windows, offsets and lengths multiples of the volume's logical sector and
 * buffers aligned to its physical sector (Microsoft, "File Buffering"), so the larger of the two,
 * from FileStorageInfo (Windows 8 and later), else the logical sector from GetDiskFreeSpaceW.
 * 0 where the OS does not say (POSIX and WebAssembly here): the caller's probe read settles it. */
static inline uint32_t kvl_os_direct_alignment(kvl_os_file f, const char *path) {
#if defined(_WIN32) && !defined(__EMSCRIPTEN__)
    FILE_STORAGE_INFO si;
    wchar_t *wpath;
    wchar_t root[MAX_PATH + 1];
    DWORD per_cluster, bytes_per_sector, free_clusters, clusters;
    uint32_t align = 0;
    if (GetFileInformationByHandleEx(f, FileStorageInfo, &si, sizeof si)) {
        align = (uint32_t)si.LogicalBytesPerSector;
        if (si.PhysicalBytesPerSectorForAtomicity > align) align = (uint32_t)si.PhysicalBytesPerSectorForAtomicity;
        if (align) return align;
    }
    wpath = kvl_os_widen(path);
    if (wpath && GetVolumePathNameW(wpath, root, MAX_PATH + 1) &&
        GetDiskFreeSpaceW(root, &per_cluster, &bytes_per_sector, &free_clusters, &clusters)) {
        align = (uint32_t)bytes_per_sector;
    }
    free(wpath);
    return align;
#else
    (void)f; (void)path;
    return 0;
#endif
}

static inline void kvl_os_close(kvl_os_file f) {
#if defined(__EMSCRIPTEN__)
    if (f >= 0) kvl_host_close(f);
#elif defined(_WIN32)
    if (f != INVALID_HANDLE_VALUE) CloseHandle(f);
#else
    if (f >= 0) close(f);
#endif
}

static inline int kvl_os_file_size(kvl_os_file f, uint64_t *size) {
#if defined(__EMSCRIPTEN__)
    return kvl_host_file_size(f, size);
#elif defined(_WIN32)
    LARGE_INTEGER li;
    if (!GetFileSizeEx(f, &li)) return (int)GetLastError();
    *size = (uint64_t)li.QuadPart;
    return 0;
#else
    struct stat st;
    if (fstat(f, &st) != 0) return errno;
    *size = (uint64_t)st.st_size;
    return 0;
#endif
}

/* One positional read of up to len bytes; *got = bytes read (0 at end of file).
 * Safe to call concurrently on one handle (no shared file position is used). */
static inline int kvl_os_pread(kvl_os_file f, void *dst, size_t len, uint64_t offset, size_t *got) {
#if defined(__EMSCRIPTEN__)
    return kvl_host_pread(f, dst, len, offset, got);
#elif defined(_WIN32)
    OVERLAPPED ov;
    DWORD n = 0;
    DWORD want = len > 0x40000000u ? 0x40000000u : (DWORD)len;
    memset(&ov, 0, sizeof ov);
    ov.Offset = (DWORD)(offset & 0xffffffffu);
    ov.OffsetHigh = (DWORD)(offset >> 32);
    if (!ReadFile(f, dst, want, &n, &ov)) {
        DWORD e = GetLastError();
        if (e == ERROR_HANDLE_EOF) {
            *got = 0;
            return 0;
        }
        return (int)e;
    }
    *got = (size_t)n;
    return 0;
#else
    ssize_t n;
    /* Linux caps a single read at 0x7ffff000 bytes; stay well below on every OS. */
    size_t want = len > ((size_t)1 << 30) ? ((size_t)1 << 30) : len;
    do {
        n = pread(f, dst, want, (off_t)offset);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return errno;
    *got = (size_t)n;
    return 0;
#endif
}

/* Human-readable text for a code returned by the functions above. */
static inline void kvl_os_strerror(int code, char *buf, size_t len) {
    if (!buf || len == 0) return;
#ifdef _WIN32
    {
        DWORD n = FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, NULL,
                                 (DWORD)code, 0, buf, (DWORD)len, NULL);
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ')) buf[--n] = 0;
        if (n == 0) {
            const char *unk = "system error";
            size_t k = strlen(unk);
            if (k >= len) k = len - 1;
            memcpy(buf, unk, k);
            buf[k] = 0;
        }
    }
#else
    {
        /* strerror only runs on error paths; its text is copied out at once. */
        const char *s = strerror(code);
        size_t k = s ? strlen(s) : 0;
        if (k >= len) k = len - 1;
        if (k) memcpy(buf, s, k);
        buf[k] = 0;
    }
#endif
}

/* ------------------------------------------------------------------ memory */

/* Gives the pages of [p, p+bytes) back to the OS, their contents dropped: the next touch maps
 * fresh pages (zeroed or stale, never an error). p and bytes are whole 4 KiB pages. A hint, so
 * failure is ignored. Linux: MADV_DONTNEED (RSS falls at once). Windows: MEM_RESET says the data
 * is not wanted, and VirtualUnlock of unlocked pages takes them out of the working set (its
 * documented effect; it then reports ERROR_NOT_LOCKED). WebAssembly: nothing, a memory never
 * shrinks. */
static inline void kvl_os_release_pages(void *p, size_t bytes) {
#if defined(__EMSCRIPTEN__)
    (void)p; (void)bytes;
#elif defined(_WIN32)
    if (VirtualAlloc(p, bytes, MEM_RESET, PAGE_READWRITE)) (void)VirtualUnlock(p, bytes);
#elif defined(__linux__)
    (void)madvise(p, bytes, MADV_DONTNEED);
#else
    (void)p; (void)bytes;
#endif
}

/* Gives the C heap's free memory back to the OS where the allocator keeps it (glibc holds freed
 * chunks in its arenas until malloc_trim); elsewhere a no-op (the Windows heap and emscripten's
 * return or keep memory by their own rules). */
static inline void kvl_os_trim_heap(void) {
#if defined(__GLIBC__) && !defined(__EMSCRIPTEN__)
    (void)malloc_trim(0);
#endif
}

/* alignment must be a power of two and a multiple of sizeof(void *); not zeroed. */
/* Ask for transparent huge pages on [p, p+bytes) (Linux MADV_HUGEPAGE; a hint, so failure is
 * ignored; elsewhere a no-op: Windows large pages need a privilege ordinary users lack). */
static inline void kvl_os_advise_hugepages(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
#endif
}

static inline void *kvl_os_aligned_malloc(size_t alignment, size_t bytes) {
    if (bytes == 0) bytes = alignment;
#ifdef _WIN32
    return _aligned_malloc(bytes, alignment);
#else
    {
        void *p = NULL;
        if (posix_memalign(&p, alignment, bytes) != 0) return NULL;
        return p;
    }
#endif
}

static inline void kvl_os_aligned_free(void *p) {
#ifdef _WIN32
    _aligned_free(p);
#else
    free(p);
#endif
}

/* ------------------------------------------------------------------ clock */

static inline uint64_t kvl_os_now_ns(void) {
#ifdef _WIN32
    static LARGE_INTEGER freq; /* benign race: every thread computes the same value */
    LARGE_INTEGER now;
    if (freq.QuadPart == 0) QueryPerformanceFrequency(&freq);
    QueryPerformanceCounter(&now);
    /* split to avoid overflow of now * 1e9 */
    return (uint64_t)(now.QuadPart / freq.QuadPart) * 1000000000ull +
           (uint64_t)(now.QuadPart % freq.QuadPart) * 1000000000ull / (uint64_t)freq.QuadPart;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
#endif
}

/* ------------------------------------------------------------------ atomics */

/* Atomic ints, sequentially consistent: the thread pool's lock-free handshakes (a Dekker-style
 * "sleepers" count) rely on the total order. C11 <stdatomic.h> needs a flag on MSVC, so these are
 * the GCC/Clang builtins there and Interlocked* on MSVC (long is 32 bits on Windows, as int). */
static inline int kvl_atomic_load(volatile int *p) {
#if defined(_MSC_VER) && !defined(__clang__)
    return (int)InterlockedCompareExchange((volatile long *)p, 0, 0);
#else
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
#endif
}
static inline void kvl_atomic_store(volatile int *p, int v) {
#if defined(_MSC_VER) && !defined(__clang__)
    InterlockedExchange((volatile long *)p, (long)v);
#else
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
#endif
}
/* returns the value before the addition */
static inline int kvl_atomic_fetch_add(volatile int *p, int v) {
#if defined(_MSC_VER) && !defined(__clang__)
    return (int)InterlockedExchangeAdd((volatile long *)p, (long)v);
#else
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
#endif
}
/* 1 if *p was `expect` and is now `desired`, else 0 (*p unchanged) */
static inline int kvl_atomic_cas(volatile int *p, int expect, int desired) {
#if defined(_MSC_VER) && !defined(__clang__)
    return (int)InterlockedCompareExchange((volatile long *)p, (long)desired, (long)expect) == expect;
#else
    return __atomic_compare_exchange_n(p, &expect, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
#endif
}

/* ------------------------------------------------------------------ threads */

#ifdef _WIN32
typedef HANDLE kvl_os_thread;
typedef SRWLOCK kvl_os_mutex;
typedef CONDITION_VARIABLE kvl_os_cond;
#define KVL_THREAD_RET DWORD
#define KVL_THREAD_CALL WINAPI
#define KVL_THREAD_RETURN 0
typedef DWORD(WINAPI *kvl_os_thread_fn)(void *);
#else
typedef pthread_t kvl_os_thread;
typedef pthread_mutex_t kvl_os_mutex;
typedef pthread_cond_t kvl_os_cond;
#define KVL_THREAD_RET void *
#define KVL_THREAD_CALL
#define KVL_THREAD_RETURN NULL
typedef void *(*kvl_os_thread_fn)(void *);
#endif

static inline int kvl_os_thread_start(kvl_os_thread *t, kvl_os_thread_fn fn, void *arg) {
#ifdef _WIN32
    HANDLE h = CreateThread(NULL, 0, fn, arg, 0, NULL);
    if (!h) return (int)GetLastError();
    *t = h;
    return 0;
#else
    return pthread_create(t, NULL, fn, arg);
#endif
}

static inline void kvl_os_thread_join(kvl_os_thread t) {
#ifdef _WIN32
    WaitForSingleObject(t, INFINITE);
    CloseHandle(t);
#else
    pthread_join(t, NULL);
#endif
}

static inline int kvl_os_mutex_init(kvl_os_mutex *m) {
#ifdef _WIN32
    InitializeSRWLock(m);
    return 0;
#else
    return pthread_mutex_init(m, NULL);
#endif
}
static inline void kvl_os_mutex_destroy(kvl_os_mutex *m) {
#ifdef _WIN32
    (void)m; /* SRW locks need no cleanup */
#else
    pthread_mutex_destroy(m);
#endif
}
static inline void kvl_os_mutex_lock(kvl_os_mutex *m) {
#ifdef _WIN32
    AcquireSRWLockExclusive(m);
#else
    pthread_mutex_lock(m);
#endif
}
static inline void kvl_os_mutex_unlock(kvl_os_mutex *m) {
#ifdef _WIN32
    ReleaseSRWLockExclusive(m);
#else
    pthread_mutex_unlock(m);
#endif
}

static inline int kvl_os_cond_init(kvl_os_cond *c) {
#ifdef _WIN32
    InitializeConditionVariable(c);
    return 0;
#else
    return pthread_cond_init(c, NULL);
#endif
}
static inline void kvl_os_cond_destroy(kvl_os_cond *c) {
#ifdef _WIN32
    (void)c;
#else
    pthread_cond_destroy(c);
#endif
}
/* Callers always wait in a loop re-checking their predicate (spurious wake-ups). */
static inline void kvl_os_cond_wait(kvl_os_cond *c, kvl_os_mutex *m) {
#ifdef _WIN32
    SleepConditionVariableSRW(c, m, INFINITE, 0);
#else
    pthread_cond_wait(c, m);
#endif
}
static inline void kvl_os_cond_signal(kvl_os_cond *c) {
#ifdef _WIN32
    WakeConditionVariable(c);
#else
    pthread_cond_signal(c);
#endif
}
static inline void kvl_os_cond_broadcast(kvl_os_cond *c) {
#ifdef _WIN32
    WakeAllConditionVariable(c);
#else
    pthread_cond_broadcast(c);
#endif
}

#endif /* KVL_PLATFORM_H */
