/* kernels_select.c — run-time choice of the kernel table.
 *
 * Owns: CPU feature detection (CPUID + XGETBV, for GCC/Clang and MSVC), the KVL_KERNELS
 * environment override, kvl_kernels_select / kvl_kernels_supported / kvl_kernels_by_name /
 * kvl_kernels_compiled_names; the sets as served, each entry a set leaves empty taken from the
 * scalar table (once, at the first selection).
 * Does not own: any kernel (kernels_ref.c, x86/kernels_avx2.c, x86/kernels_avx512.c,
 * wasm/kernels_simd128.c, wasm/kernels_relaxed.c).
 *
 * Levels: 1 scalar everywhere; 2 avx2 and 3 avx512 on x86; 4 simd128 in WebAssembly builds made
 * with -msimd128 (SIMD128 is a compile-time property of a wasm module: a module that uses it
 * does not validate without it, so there is nothing to detect at run time), and simd128-relaxed
 * in the relaxed build (-DKVL_WASM_RELAXED=1: the same, for relaxed SIMD; whether the engine
 * computes it right is the host's start-up self-test, before it loads that build).
 *
 * The ISA must be supported by both the CPU and the OS: an OS that does not save the YMM / ZMM
 * state on context switch (XCR0 bits) would corrupt registers, so XGETBV is checked too.
 */
#include "kernels.h"

#include <stdlib.h>
#include <string.h>

#if defined(__wasm__) || defined(__EMSCRIPTEN__)
#undef KVL_X86
#define KVL_X86 0
#endif
#ifndef KVL_X86
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#define KVL_X86 1
#else
#define KVL_X86 0
#endif
#endif

extern const kvl_kernels kvl_kernels_scalar_table;
#if defined(__wasm_simd128__)
#define KVL_SIMD128 1
extern const kvl_kernels kvl_kernels_simd128_table;
#else
#define KVL_SIMD128 0
#endif
#if KVL_SIMD128 && defined(KVL_WASM_RELAXED)
#define KVL_RELAXED 1
extern const kvl_kernels kvl_kernels_simd128_relaxed_table;
#else
#define KVL_RELAXED 0
#endif
#if KVL_X86
extern const kvl_kernels kvl_kernels_avx2_table;
extern const kvl_kernels kvl_kernels_avx512_table;
extern const kvl_kernels kvl_kernels_avx512_bf16_table;

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
#include <immintrin.h>
static void cpuid(unsigned leaf, unsigned sub, unsigned out[4])
{
    int r[4];
    __cpuidex(r, (int)leaf, (int)sub);
    for (int i = 0; i < 4; i++)
        out[i] = (unsigned)r[i];
}
static unsigned long long read_xcr0(void)
{
    return (unsigned long long)_xgetbv(0);
}
#else
#include <cpuid.h>
static void cpuid(unsigned leaf, unsigned sub, unsigned out[4])
{
    out[0] = out[1] = out[2] = out[3] = 0;
    if ((unsigned)__get_cpuid_max(leaf & 0x80000000u, NULL) < leaf)
        return;
    __cpuid_count(leaf, sub, out[0], out[1], out[2], out[3]);
}
static unsigned long long read_xcr0(void)
{
    /* Inline asm rather than _xgetbv(): the intrinsic needs -mxsave on this portable file. */
    unsigned lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}
#endif

static int bit(unsigned v, int b)
{
    return (int)((v >> b) & 1u);
}

/* Highest level (1 scalar, 2 avx2, 3 avx512) this CPU + OS can run. */
static int detect_level(void)
{
    unsigned r1[4], r7[4];
    cpuid(0, 0, r1);
    unsigned max_leaf = r1[0];
    cpuid(1, 0, r1);
    /* OSXSAVE (ECX 27) must be set before XGETBV may be executed at all. */
    if (!bit(r1[2], 27) || !bit(r1[2], 28) || !bit(r1[2], 12) || !bit(r1[2], 29))
        return 1; /* no OSXSAVE, AVX, FMA or F16C */
    unsigned long long xcr0 = read_xcr0();
    if ((xcr0 & 0x6u) != 0x6u)
        return 1; /* OS does not save XMM+YMM state */
    if (max_leaf < 7)
        return 1;
    cpuid(7, 0, r7);
    if (!bit(r7[1], 5))
        return 1; /* AVX2 */
    int avx512 = bit(r7[1], 16) /* F */ && bit(r7[1], 17) /* DQ */ && bit(r7[1], 30) /* BW */ &&
                 bit(r7[1], 31) /* VL */ && bit(r7[2], 11) /* VNNI */;
    /* XCR0 bits 5-7: opmask, upper halves of ZMM0-15, ZMM16-31. */
    if (avx512 && (xcr0 & 0xE6u) == 0xE6u)
        return 3;
    return 2;
}

/* AVX512_BF16 (CPUID.(7,1):EAX bit 5), on top of level 3. */
static int has_avx512_bf16(void)
{
    unsigned r7[4] = {0, 0, 0, 0};
    cpuid(7, 0, r7);
    if (r7[0] < 1)
        return 0; /* no subleaf 1 */
    unsigned r71[4] = {0, 0, 0, 0};
    cpuid(7, 1, r71);
    return bit(r71[0], 5);
}
#else
static int detect_level(void)
{
    return KVL_SIMD128 ? 4 : 1;
}
#endif

/* ---- the sets as served: each empty entry taken from the scalar table, once ------------------
 * (kernels.h KVL_KERNEL_ENTRIES). The sets as written are const and may leave entries NULL; the
 * first selection fills a copy of each compiled set, and every later one hands out those copies. */
static const kvl_kernels *const written[] = {
    &kvl_kernels_scalar_table,
#if KVL_SIMD128
    &kvl_kernels_simd128_table,
#endif
#if KVL_RELAXED
    &kvl_kernels_simd128_relaxed_table,
#endif
#if KVL_X86
    &kvl_kernels_avx2_table, &kvl_kernels_avx512_table, &kvl_kernels_avx512_bf16_table,
#endif
};
#define N_SETS (sizeof written / sizeof *written)
static kvl_kernels served_sets[N_SETS];

static void fill_sets(void)
{
    const kvl_kernels *s = &kvl_kernels_scalar_table;
    for (size_t i = 0; i < N_SETS; i++) {
        kvl_kernels *d = &served_sets[i];
        *d = *written[i];
#define KVL_FILL_ENTRY(entry) \
    if (!d->entry)            \
        d->entry = s->entry;
        KVL_KERNEL_ENTRIES(KVL_FILL_ENTRY)
#undef KVL_FILL_ENTRY
        if (!written[i]->gemm_tile) { /* the tile's shape goes with it */
            d->gemm_mr = s->gemm_mr;
            d->gemm_nr = s->gemm_nr;
        }
    }
}

/* Once per process, also when engines are created on several threads at a time: the first caller
 * fills, the others wait for it (C11 atomics; a compiler without them fills on every thread that
 * comes first, each writing the same values). */
#if !defined(__STDC_NO_ATOMICS__)
#include <stdatomic.h>
static atomic_int sets_state; /* 0 not filled, 1 being filled, 2 filled */
static void fill_sets_once(void)
{
    int expected = 0;
    if (atomic_load(&sets_state) == 2)
        return;
    if (atomic_compare_exchange_strong(&sets_state, &expected, 1)) {
        fill_sets();
        atomic_store(&sets_state, 2);
        return;
    }
    while (atomic_load(&sets_state) != 2) {
    }
}
#else
static volatile int sets_filled;
static void fill_sets_once(void)
{
    if (!sets_filled) {
        fill_sets();
        sets_filled = 1;
    }
}
#endif

/* The served copy of a set as written (NULL for NULL). */
static const kvl_kernels *served(const kvl_kernels *t)
{
    if (!t)
        return NULL;
    fill_sets_once();
    for (size_t i = 0; i < N_SETS; i++)
        if (written[i] == t)
            return &served_sets[i];
    return NULL;
}

static const kvl_kernels *written_for(int level);
static const kvl_kernels *table_for(int level)
{
    return served(written_for(level));
}

static const kvl_kernels *written_for(int level)
{
    switch (level) {
    case 1:
        return &kvl_kernels_scalar_table;
#if KVL_X86
    case 2:
        return &kvl_kernels_avx2_table;
    case 3:
        return has_avx512_bf16() ? &kvl_kernels_avx512_bf16_table : &kvl_kernels_avx512_table;
#endif
#if KVL_SIMD128
    case 4: /* the relaxed build's best: by name, "simd128" is still the plain table */
#if KVL_RELAXED
        return &kvl_kernels_simd128_relaxed_table;
#else
        return &kvl_kernels_simd128_table;
#endif
#endif
    default:
        return NULL;
    }
}

int kvl_kernels_supported(int level)
{
    if (level < 1 || level > 4)
        return 0;
    /* x86: 1 < 2 < 3 as detected; wasm: detect_level is 4 or 1 and only 1 and 4 have tables. */
    return level <= detect_level() && table_for(level) != NULL;
}

/* Order of the levels for the KVL_KERNELS cap: scalar below every SIMD level. */
static int rank(int level)
{
    return level == 4 ? 2 : level;
}

const kvl_kernels *kvl_kernels_select(int level)
{
    if (level == 0) {
        int best = detect_level();
        /* KVL_KERNELS=scalar|simd128|avx2|avx512 caps the choice (debugging, A/B numerics); it
         * can never raise it above what the CPU supports, and a name this build or CPU does not
         * support is ignored. (In emscripten builds getenv does not see Node's environment: the
         * host picks the build and the level instead.) */
        const char *env = getenv("KVL_KERNELS");
        if (env) {
            int want = strcmp(env, "scalar") == 0    ? 1
                       : strcmp(env, "avx2") == 0    ? 2
                       : strcmp(env, "avx512") == 0  ? 3
                       : strcmp(env, "simd128") == 0 ? 4
                                                     : best;
            if (kvl_kernels_supported(want) && rank(want) < rank(best))
                best = want;
        }
        return table_for(best);
    }
    if (!kvl_kernels_supported(level))
        return NULL;
    return table_for(level);
}

static const kvl_kernels *written_by_name(const char *name)
{
    if (!name)
        return NULL;
    if (strcmp(name, "scalar") == 0)
        return &kvl_kernels_scalar_table;
#if KVL_SIMD128
    if (strcmp(name, "simd128") == 0)
        return &kvl_kernels_simd128_table;
#endif
#if KVL_RELAXED
    if (strcmp(name, "simd128-relaxed") == 0)
        return &kvl_kernels_simd128_relaxed_table;
#endif
#if KVL_X86
    if (strcmp(name, "avx2") == 0)
        return detect_level() >= 2 ? &kvl_kernels_avx2_table : NULL;
    if (strcmp(name, "avx512") == 0)
        return detect_level() >= 3 ? &kvl_kernels_avx512_table : NULL;
    if (strcmp(name, "avx512-bf16") == 0)
        return detect_level() >= 3 && has_avx512_bf16() ? &kvl_kernels_avx512_bf16_table : NULL;
#endif
    return NULL;
}

const kvl_kernels *kvl_kernels_by_name(const char *name)
{
    return served(written_by_name(name));
}

const char *const *kvl_kernels_compiled_names(void)
{
    static const char *const names[] = {
        "scalar",
#if KVL_SIMD128
        "simd128",
#endif
#if KVL_RELAXED
        "simd128-relaxed",
#endif
#if KVL_X86
        "avx2", "avx512", "avx512-bf16",
#endif
        NULL,
    };
    return names;
}
