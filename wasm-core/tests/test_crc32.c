/* test_crc32.c — checks crc32.c: slicing-by-16, PCLMULQDQ (where the CPU has it; elsewhere, and
 * in WebAssembly, kvl_crc32_clmul is slicing-by-16 and is checked as such), the host's (Node's
 * zlib.crc32, in the WebAssembly build; natively slicing-by-16) and kvl_crc32_fast
 * against the reference kvl_crc32 (store.c) and a bitwise CRC written independently
 * (test_bytes.h), on a pseudo-random buffer at every alignment 0..15 and many lengths (every one
 * up to 300, then around the powers of two and the 64-byte folding block), chained and unchained;
 * kvl_crc32_combine against the CRC of the concatenation; the standard check value; and four
 * threads making their first CRC call at once (the tables are built once, on first use).
 * Run natively, under ASan/UBSan (ctest) and as WebAssembly (build-wasm.sh --tests).
 * `test_crc32 --bench` prints throughputs instead (no test, not run by the suite).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32.h"
#include "platform.h"
#include "store.h"
#include "test_bytes.h"
#include "test_check.h"


#define BUF_BYTES (70000u + 16u)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

typedef uint32_t (*crc_fn)(uint32_t, const void *, size_t);
static const struct {
    const char *name;
    crc_fn fn;
} IMPLS[] = {
    {"portable", kvl_crc32_portable},
    {"clmul", kvl_crc32_clmul},
    {"host", kvl_crc32_host},
    {"fast", kvl_crc32_fast},
};
#define N_IMPLS (sizeof IMPLS / sizeof IMPLS[0])

/* Four threads make the first CRC calls of the process at the same moment. */
static unsigned char *thread_buf;
static uint32_t thread_out[4];
static volatile int thread_go;
static KVL_THREAD_RET KVL_THREAD_CALL first_caller(void *arg) {
    int i = (int)(intptr_t)arg;
    while (!thread_go) {
    }
    thread_out[i] = kvl_crc32_portable(0, thread_buf, 65536);
    return KVL_THREAD_RETURN;
}

static void test_first_use_race(unsigned char *buf) {
    kvl_os_thread th[4];
    int started = 0;
    thread_buf = buf;
    for (int i = 0; i < 4; i++) started += kvl_os_thread_start(&th[i], first_caller, (void *)(intptr_t)i) == 0;
    CHECK(started == 4, "only %d of 4 threads started", started);
    thread_go = 1;
    for (int i = 0; i < started; i++) kvl_os_thread_join(th[i]);
    uint32_t want = kvl_crc32(0, buf, 65536);
    for (int i = 0; i < started; i++)
        CHECK(thread_out[i] == want, "thread %d's first CRC %08x, reference %08x", i, thread_out[i], want);
}

static void test_check_value(void) {
    const char *s = "123456789";
    CHECK(kvl_crc32(0, s, 9) == 0xCBF43926u, "reference check value %08x", kvl_crc32(0, s, 9));
    for (size_t k = 0; k < N_IMPLS; k++)
        CHECK(IMPLS[k].fn(0, s, 9) == 0xCBF43926u, "%s: check value %08x", IMPLS[k].name, IMPLS[k].fn(0, s, 9));
}

static void test_lengths(const unsigned char *buf) {
    static size_t lens[400];
    size_t n_lens = 0;
    for (size_t l = 0; l <= 300; l++) lens[n_lens++] = l;
    static const size_t more[] = {319, 320, 321, 383, 384, 385, 511, 512, 513, 1000, 1023, 1024, 1025,
                                  4095, 4096, 4097, 4111, 4159, 65535, 65536, 65537, 70000};
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) lens[n_lens++] = more[i];
    for (size_t k = 0; k < N_IMPLS; k++) {
        int bad = 0;
        for (size_t align = 0; align < 16; align++) {
            for (size_t i = 0; i < n_lens; i++) {
                const unsigned char *p = buf + align;
                uint32_t want = kvl_crc32(0, p, lens[i]);
                uint32_t got = IMPLS[k].fn(0, p, lens[i]);
                if (got != want && bad++ < 5)
                    printf("  %s: length %zu at alignment %zu: %08x, reference %08x\n", IMPLS[k].name,
                           lens[i], align, got, want);
                /* continuing from a previous CRC (a nonzero start) */
                uint32_t seed = kvl_crc32(0, buf + BUF_BYTES - 16, 16);
                want = kvl_crc32(seed, p, lens[i]);
                got = IMPLS[k].fn(seed, p, lens[i]);
                if (got != want && bad++ < 5)
                    printf("  %s: chained, length %zu at alignment %zu: %08x, reference %08x\n",
                           IMPLS[k].name, lens[i], align, got, want);
            }
        }
        CHECK(bad == 0, "%s: %d lengths/alignments differ from the reference", IMPLS[k].name, bad);
    }
    /* the bitwise CRC of test_bytes.h agrees with the reference (two independent writings) */
    CHECK(ref_crc32(buf + 3, 70000) == kvl_crc32(0, buf + 3, 70000), "reference and bitwise CRC differ");
}

static void test_split(const unsigned char *buf) {
    /* a buffer cut at random points and chained piece by piece is the CRC of the whole */
    for (size_t k = 0; k < N_IMPLS; k++) {
        int bad = 0;
        for (int round = 0; round < 200; round++) {
            size_t total = next_u32() % 70000u, at = 0;
            uint32_t c = 0;
            while (at < total) {
                size_t piece = 1 + next_u32() % 9000u;
                if (piece > total - at) piece = total - at;
                c = IMPLS[k].fn(c, buf + at, piece);
                at += piece;
            }
            bad += c != kvl_crc32(0, buf, total);
        }
        CHECK(bad == 0, "%s: %d of 200 piecewise CRCs differ from the whole", IMPLS[k].name, bad);
    }
}

static void test_combine(const unsigned char *buf) {
    int bad = 0;
    for (int round = 0; round < 300; round++) {
        size_t a = next_u32() % 40000u, b = round < 20 ? (size_t)round : next_u32() % 30000u;
        uint32_t ca = kvl_crc32(0, buf, a), cb = kvl_crc32(0, buf + a, b);
        uint32_t want = kvl_crc32(0, buf, a + b);
        uint32_t got = kvl_crc32_combine(ca, cb, b);
        if (got != want && bad++ < 5)
            printf("  combine(|A| %zu, |B| %zu) = %08x, CRC(A||B) %08x\n", a, b, got, want);
    }
    CHECK(bad == 0, "kvl_crc32_combine: %d of 300 differ", bad);
    /* lengths beyond 32 bits: combining B with zero bytes = the CRC of B followed by zeros, so
     * CRC(A||Z) = combine(CRC(A), CRC(Z), |Z|) must agree for a |Z| of zeros computed directly */
    static unsigned char zeros[8192];
    uint32_t a = kvl_crc32(0, buf, 1000);
    CHECK(kvl_crc32_combine(a, kvl_crc32(0, zeros, sizeof zeros), sizeof zeros) ==
              kvl_crc32(a, zeros, sizeof zeros),
          "combine with zeros");
}

static double gbps(crc_fn fn, const unsigned char *buf, size_t n, int reps) {
    uint32_t c = 0;
    uint64_t t0 = kvl_now_ns();
    for (int r = 0; r < reps; r++) c = fn(c, buf, n);
    uint64_t dt = kvl_now_ns() - t0;
    if (c == 0x12345678u) printf("(unlikely)\n"); /* keeps the loop */
    return (double)n * reps / (double)(dt ? dt : 1);
}

static int bench(void) {
    const size_t n = (size_t)16 << 20;
    unsigned char *big = (unsigned char *)malloc(n);
    if (!big) return 1;
    for (size_t i = 0; i < n; i++) big[i] = (unsigned char)next_u32();
    printf("crc32 over a %zu MiB buffer (GB/s, one thread): reference %.2f, slice16 %.2f, clmul %.2f%s, host %.2f%s, fast (%s) %.2f\n",
           n >> 20, gbps(kvl_crc32, big, n, 1), gbps(kvl_crc32_portable, big, n, 8),
           gbps(kvl_crc32_clmul, big, n, 8), kvl_crc32_clmul_supported() ? "" : " (= slice16 here)",
           gbps(kvl_crc32_host, big, n, 8), kvl_crc32_host_supported() ? "" : " (= slice16 here)",
           kvl_crc32_fast_name(), gbps(kvl_crc32_fast, big, n, 8));
    free(big);
    return 0;
}

int main(int argc, char **argv) {
    unsigned char *buf = (unsigned char *)malloc(BUF_BYTES);
    if (!buf) return 1;
    for (size_t i = 0; i < BUF_BYTES; i++) buf[i] = (unsigned char)next_u32();
    if (argc > 1 && strcmp(argv[1], "--bench") == 0) {
        free(buf);
        return bench();
    }
    test_first_use_race(buf); /* first: nothing may have built the tables yet */
    test_check_value();
    test_lengths(buf);
    test_split(buf);
    test_combine(buf);
    printf("test_crc32: fast = %s; clmul %s; host %s\n", kvl_crc32_fast_name(),
           kvl_crc32_clmul_supported() ? "checked" : "not on this CPU/build (checked as slice16)",
           kvl_crc32_host_supported() ? "checked" : "not in this build (checked as slice16)");
    printf("test_crc32: %d passed, %d failed\n", checks - failures, failures);
    free(buf);
    return failures ? 1 : 0;
}
