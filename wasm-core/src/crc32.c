/* crc32.c — fast zlib-compatible CRC-32 (see crc32.h).
 *
 * Owns: slicing-by-16 (portable C, every target), the PCLMULQDQ folding CRC of x86-64 (Gopal,
 * Ozturk et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction",
 * Intel, 2009: four 128-bit lanes folded 64 bytes at a time, folded into one, reduced to 64
 * bits, then Barrett-reduced to 32; the constants are the paper's bit-reflected ones for the
 * CRC-32 polynomial), in WebAssembly the host's (Node's zlib.crc32, an import like the file
 * reads of platform_wasm.c), the run-time choice between them, and kvl_crc32_combine.
 * Does not own: the reference kvl_crc32 (store.c). tests/test_crc32.c holds every function here
 * against it, natively, under ASan/UBSan and as WebAssembly.
 *
 * One thread of a 2-vCPU AMD EPYC (Zen 4), GB/s of CPU time (the machine was shared): slicing-
 * by-16 3.3 natively and 2.3 in WebAssembly (Node 20; the reference ~0.2), PCLMULQDQ 14.5,
 * Node's zlib.crc32 4.6. Also measured for WebAssembly and not kept: 16 CRCs at once on
 * i8x16.swizzle table lookups (16 streams, transposed): half the speed of slicing-by-16.
 */
#include "crc32.h"

#include <stdlib.h>
#include <string.h>
#ifdef _MSC_VER
#include <intrin.h>
#endif

#include "platform.h" /* kvl_atomic_*: the once-flags below */

#define CRC_POLY 0xEDB88320u

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__EMSCRIPTEN__) && !defined(__wasm__)
#define KVL_CRC_CLMUL 1
#else
#define KVL_CRC_CLMUL 0
#endif

/* ------------------------------------------------------------------ slicing-by-16 */

/* t[0] is the byte-at-a-time table; t[k][i] is the CRC of byte i followed by k zero bytes, so 16
 * input bytes become 16 independent lookups. 16 KiB, built once (several threads may ask at the
 * same time: one builds, the others wait for it, a few microseconds). */
static uint32_t crc_tables[16][256];
static volatile int tables_state; /* 0 not built, 1 building, 2 ready */

static void build_tables(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ CRC_POLY : c >> 1;
        crc_tables[0][i] = c;
    }
    for (int k = 1; k < 16; k++)
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = crc_tables[k - 1][i];
            crc_tables[k][i] = (c >> 8) ^ crc_tables[0][c & 0xFFu];
        }
}

static const uint32_t (*tables(void))[256]
{
    if (kvl_atomic_load(&tables_state) != 2) {
        if (kvl_atomic_cas(&tables_state, 0, 1)) {
            build_tables();
            kvl_atomic_store(&tables_state, 2);
        } else {
            while (kvl_atomic_load(&tables_state) != 2) {
            }
        }
    }
    return (const uint32_t (*)[256])crc_tables;
}

/* little-endian load; compilers make it one load on the (little-endian) targets kvl runs on */
static uint32_t rd32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* c is the register (the CRC without its final inversion) */
static uint32_t slice16(uint32_t c, const unsigned char *p, size_t n)
{
    const uint32_t (*t)[256] = tables();
    while (n >= 16) {
        uint32_t a = rd32(p) ^ c, b = rd32(p + 4), d = rd32(p + 8), e = rd32(p + 12);
        c = t[15][a & 0xFFu] ^ t[14][(a >> 8) & 0xFFu] ^ t[13][(a >> 16) & 0xFFu] ^ t[12][a >> 24] ^
            t[11][b & 0xFFu] ^ t[10][(b >> 8) & 0xFFu] ^ t[9][(b >> 16) & 0xFFu] ^ t[8][b >> 24] ^
            t[7][d & 0xFFu] ^ t[6][(d >> 8) & 0xFFu] ^ t[5][(d >> 16) & 0xFFu] ^ t[4][d >> 24] ^
            t[3][e & 0xFFu] ^ t[2][(e >> 8) & 0xFFu] ^ t[1][(e >> 16) & 0xFFu] ^ t[0][e >> 24];
        p += 16;
        n -= 16;
    }
    while (n--) c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    return c;
}

uint32_t kvl_crc32_portable(uint32_t crc, const void *data, size_t len)
{
    return ~slice16(~crc, (const unsigned char *)data, len);
}

/* ------------------------------------------------------------------ PCLMULQDQ (x86-64) */

#if KVL_CRC_CLMUL
#include <emmintrin.h>
#include <wmmintrin.h>
#if defined(_MSC_VER) && !defined(__clang__)
#define CLMUL_TARGET
#else
#include <cpuid.h>
/* only these functions use the instruction; the rest of the core keeps the baseline ISA */
#define CLMUL_TARGET __attribute__((target("pclmul,sse2")))
#endif

/* The paper's bit-reflected constants for P = 0x104C11DB7: each is x^k mod P, reflected and
 * shifted left by one (the reflected product of two 64-bit halves is one bit short). */
#define K1 0x0154442bd4ull /* x^(4*128+32) mod P: folds a lane 512 bits ahead (low half) */
#define K2 0x01c6e41596ull /* x^(4*128-32) mod P: (high half) */
#define K3 0x01751997d0ull /* x^(128+32) mod P: folds 128 bits ahead (low half) */
#define K4 0x00ccaa009eull /* x^(128-32) mod P: (high half) */
#define K5 0x0163cd6124ull /* x^64 mod P: 96 -> 64 bits */
#define P_REFLECTED 0x01db710641ull /* P, reflected */
#define MU 0x01f7011641ull /* floor(x^64 / P), reflected: Barrett's constant */

/* x * x^(distance) mod P folded onto next: the low half times k_lo, the high half times k_hi */
static CLMUL_TARGET __m128i fold(__m128i x, __m128i k, __m128i next)
{
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The register after n bytes, n >= 64 and a multiple of 16. */
static CLMUL_TARGET uint32_t fold_clmul(uint32_t c, const unsigned char *p, size_t n)
{
    const __m128i k12 = _mm_set_epi64x((long long)K2, (long long)K1);
    const __m128i k34 = _mm_set_epi64x((long long)K4, (long long)K3);
    const __m128i k5 = _mm_set_epi64x(0, (long long)K5);
    const __m128i pmu = _mm_set_epi64x((long long)MU, (long long)P_REFLECTED);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i x0 = _mm_loadu_si128((const __m128i *)(const void *)p);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(const void *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(const void *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(const void *)(p + 48));
    __m128i t;
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)c));
    p += 64;
    n -= 64;
    /* four independent lanes: the multiplies of one block overlap those of the next */
    while (n >= 64) {
        x0 = fold(x0, k12, _mm_loadu_si128((const __m128i *)(const void *)p));
        x1 = fold(x1, k12, _mm_loadu_si128((const __m128i *)(const void *)(p + 16)));
        x2 = fold(x2, k12, _mm_loadu_si128((const __m128i *)(const void *)(p + 32)));
        x3 = fold(x3, k12, _mm_loadu_si128((const __m128i *)(const void *)(p + 48)));
        p += 64;
        n -= 64;
    }
    /* the lanes into one, then the remaining 16-byte blocks */
    x0 = fold(x0, k34, x1);
    x0 = fold(x0, k34, x2);
    x0 = fold(x0, k34, x3);
    while (n >= 16) {
        x0 = fold(x0, k34, _mm_loadu_si128((const __m128i *)(const void *)p));
        p += 16;
        n -= 16;
    }
    /* 128 -> 96 bits: the low half times x^(128-32) onto the high half */
    t = _mm_clmulepi64_si128(x0, k34, 0x10);
    x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), t);
    /* 96 -> 64 bits */
    t = _mm_srli_si128(x0, 4);
    x0 = _mm_clmulepi64_si128(_mm_and_si128(x0, low32), k5, 0x00);
    x0 = _mm_xor_si128(x0, t);
    /* Barrett: q = (low 32 bits * mu) low 32 bits; remainder = x - q * P */
    t = _mm_and_si128(x0, low32);
    t = _mm_clmulepi64_si128(t, pmu, 0x10);
    t = _mm_and_si128(t, low32);
    t = _mm_clmulepi64_si128(t, pmu, 0x00);
    x0 = _mm_xor_si128(x0, t);
    return (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(x0, 4));
}

static int cpu_has_pclmul(void)
{
    unsigned r[4] = {0, 0, 0, 0};
#if defined(_MSC_VER) && !defined(__clang__)
    int v[4];
    __cpuid(v, 1);
    for (int i = 0; i < 4; i++) r[i] = (unsigned)v[i];
#else
    if (!__get_cpuid(1, &r[0], &r[1], &r[2], &r[3])) return 0;
#endif
    return (int)((r[2] >> 1) & 1u); /* CPUID.1:ECX.PCLMULQDQ */
}

int kvl_crc32_clmul_supported(void)
{
    static volatile int known; /* 0 unknown, 1 no, 2 yes */
    int k = kvl_atomic_load(&known);
    if (k == 0) {
        k = cpu_has_pclmul() ? 2 : 1;
        kvl_atomic_store(&known, k);
    }
    return k == 2;
}

uint32_t kvl_crc32_clmul(uint32_t crc, const void *data, size_t len)
{
    const unsigned char *p = (const unsigned char *)data;
    uint32_t c = ~crc;
    if (len >= 64) {
        size_t body = len & ~(size_t)15;
        c = fold_clmul(c, p, body);
        p += body;
        len -= body;
    }
    return ~slice16(c, p, len);
}
#else
int kvl_crc32_clmul_supported(void) { return 0; }
uint32_t kvl_crc32_clmul(uint32_t crc, const void *data, size_t len)
{
    return kvl_crc32_portable(crc, data, len);
}
#endif

/* ------------------------------------------------------------------ the host's (WebAssembly) */

#if defined(__EMSCRIPTEN__)
#include <emscripten.h>
/* WebAssembly has no carry-less multiply; Node's zlib.crc32 (native code; the function
 * host/pack-format.ts and kvl doctor use) runs twice as fast as slicing-by-16 compiled to
 * WebAssembly (4.6 against 2.3 GB/s of CPU time on the machine of the header's figures). It runs
 * on whichever thread calls, over a view of this instance's memory, as platform_wasm.c's reads do. */
EM_JS(int, kvl_js_crc32_ready, (void), {
    try {
        return typeof require("zlib").crc32 === "function" ? 1 : 0;
    } catch (e) {
        return 0;
    }
});
EM_JS(uint32_t, kvl_js_crc32, (uint32_t crc, const void *data, size_t len), {
    const p = data >>> 0;
    return require("zlib").crc32(HEAPU8.subarray(p, p + (len >>> 0)), crc >>> 0);
});
int kvl_crc32_host_supported(void) { return kvl_js_crc32_ready(); }
uint32_t kvl_crc32_host(uint32_t crc, const void *data, size_t len)
{
    /* a view of at most 2 GiB per call keeps every index a safe JavaScript number */
    const unsigned char *p = (const unsigned char *)data;
    while (len > ((size_t)1 << 30)) {
        crc = kvl_js_crc32(crc, p, (size_t)1 << 30);
        p += (size_t)1 << 30;
        len -= (size_t)1 << 30;
    }
    return kvl_js_crc32(crc, p, len);
}
#else
int kvl_crc32_host_supported(void) { return 0; }
uint32_t kvl_crc32_host(uint32_t crc, const void *data, size_t len)
{
    return kvl_crc32_portable(crc, data, len);
}
#endif

/* ------------------------------------------------------------------ choice */

enum { CHOICE_SLICE16 = 1, CHOICE_CLMUL = 2, CHOICE_HOST = 3 };
static volatile int fast_choice; /* 0 undecided */

static int choice(void)
{
    int c = kvl_atomic_load(&fast_choice);
    if (c == 0) {
        const char *env = getenv("KVL_CRC");
        c = env && strcmp(env, "portable") == 0 ? CHOICE_SLICE16
            : kvl_crc32_clmul_supported()       ? CHOICE_CLMUL
            : kvl_crc32_host_supported()        ? CHOICE_HOST
                                                : CHOICE_SLICE16;
        kvl_atomic_store(&fast_choice, c);
    }
    return c;
}

uint32_t kvl_crc32_fast(uint32_t crc, const void *data, size_t len)
{
    switch (choice()) {
    case CHOICE_CLMUL: return kvl_crc32_clmul(crc, data, len);
    case CHOICE_HOST: return kvl_crc32_host(crc, data, len);
    default: return kvl_crc32_portable(crc, data, len);
    }
}

const char *kvl_crc32_fast_name(void)
{
    int c = choice();
    return c == CHOICE_CLMUL ? "pclmul" : c == CHOICE_HOST ? "node-zlib" : "slice16";
}

/* ------------------------------------------------------------------ combine */

/* a * b mod P in the reflected representation (bit 31 is x^0) */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) p ^= b;
        b = (b & 1u) ? (b >> 1) ^ CRC_POLY : b >> 1; /* b *= x */
    }
    return p;
}

/* x^(8 n) mod P: what appending n bytes multiplies a register by */
static uint32_t xpow8n(uint64_t n)
{
    uint32_t p = 0x80000000u;  /* 1 */
    uint32_t sq = 0x00800000u; /* x^8 */
    while (n) {
        if (n & 1u) p = multmodp(sq, p);
        sq = multmodp(sq, sq);
        n >>= 1;
    }
    return p;
}

uint32_t kvl_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    /* CRC(A||B) = CRC(A) * x^(8 |B|) + CRC(B) mod P (zlib's crc32_combine: the pre- and
     * post-inversions cancel out) */
    return multmodp(xpow8n(len_b), crc_a) ^ crc_b;
}
