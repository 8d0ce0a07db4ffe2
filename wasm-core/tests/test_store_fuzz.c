/* test_store_fuzz.c — deterministic mutation fuzzing of the index parser (store.c).
 *
 * Owns: a compact writer of small valid stores (a trunk-like BF16/F32 store, an experts store
 * of Q8 extents and one of Q4 extents (format version 3), docs/FORMAT.md; its own byte layout code and bitwise CRC-32, nothing shared with
 * store.c), a seeded mutator (bit flips, byte sets, truncations, extensions, field-targeted edits
 * of header counts / offsets / nbytes / shape / ndim / dtype, record swaps and size-consistent
 * record drops and duplications, .bin size changes), and the oracle every mutated store must
 * satisfy: kvl_store_open either succeeds and then every record is inside the .bin, 4096-aligned,
 * sorted without overlap, sized exactly by its dtype and shape, of a dtype its index's version
 * holds (Q8_ROWS from 2, Q4_EXPERT from 3), findable by name and readable,
 * or it fails with out == NULL and a non-empty message naming the .idx or the .bin.
 * The index CRC is recomputed after most mutations: otherwise the CRC check would reject them all
 * and the validation behind it would go untested. Crashes, leaks and out-of-bounds reads are the
 * sanitizers' job (the ASan/UBSan build of scripts/test runs this too).
 * Does not own: the per-rule corruption tests (test_store.c) or the libFuzzer entry point
 * (fuzz_store_libfuzzer.c, not built by default).
 * Prints "test_store_fuzz: N passed, M failed"; returns non-zero on any failure.
 * Env: KVL_TEST_TMP (temp base; default /dev/shm where writable, else /tmp), KVL_FUZZ_ITERS
 * (default 3000), KVL_FUZZ_SEED (default: a fixed seed, so every run is the same).
 */
/* _GNU_SOURCE and _FILE_OFFSET_BITS=64 come from the build (wasm-core/CMakeLists.txt). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "test_bytes.h"

#ifdef _WIN32
#include <direct.h>
#include <windows.h>
#else
#include <unistd.h>
#endif

static int n_pass, n_fail;
static unsigned long current_iter;

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (cond) {                                                                       \
            n_pass++;                                                                     \
        } else {                                                                          \
            n_fail++;                                                                     \
            printf("FAIL iter %lu %s:%d: %s: ", current_iter, __FILE__, __LINE__, #cond); \
            printf(__VA_ARGS__);                                                          \
            printf("\n");                                                                 \
        }                                                                                 \
    } while (0)

/* ------------------------------------------------------------------ RNG (bytes and CRC: test_bytes.h) */

static uint64_t rng_state;
static uint64_t rnd64(void) { /* xorshift64*: deterministic for a given seed on every platform */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}
static uint32_t rnd(uint32_t n) { return n ? (uint32_t)(rnd64() % n) : 0; }

/* ------------------------------------------------------------------ the valid stores */

typedef struct spec {
    const char *name;
    uint32_t dtype, ndim;
    uint64_t shape[4];
} spec;

static const spec TRUNK[] = {
    {"language_model.model.embed_tokens.weight", KVL_DTYPE_BF16, 2, {11, 8, 0, 0}},
    {"language_model.model.layers.0.input_layernorm.weight", KVL_DTYPE_BF16, 1, {8, 0, 0, 0}},
    {"language_model.model.layers.1.mlp.gate.e_score_correction_bias", KVL_DTYPE_F32, 1, {6, 0, 0, 0}},
    {"language_model.lm_head.weight", KVL_DTYPE_F32, 2, {40, 30, 0, 0}}, /* 4800 bytes: 2 pages */
    {"vision_tower.patch_embed.proj.weight", KVL_DTYPE_BF16, 4, {2, 3, 2, 2}},
    {"language_model.model.norm.weight", KVL_DTYPE_BF16, 1, {2048, 0, 0, 0}}, /* exactly a page */
};
#define N_TRUNK (sizeof TRUNK / sizeof TRUNK[0])
#define N_EXPERT_RECS 4
#define EXP_I 5
#define EXP_H 7
static char expert_names[N_EXPERT_RECS][64];
static spec EXPERTS[N_EXPERT_RECS];
/* the same names as Q4 extents: I and H whole groups of 32 */
#define Q4_I 32
#define Q4_H 32
static spec EXPERTS_Q4[N_EXPERT_RECS];

static const char *HP_KEYS[] = {"text.hidden_size", "text.moe_intermediate_size", "text.n_routed_experts",
                                "text.rms_norm_eps", "media_placeholder_token_id"};
static const double HP_VALS[] = {8.0, 5.0, 2.0, 1e-5, 163605.0};
#define N_HP (sizeof HP_KEYS / sizeof HP_KEYS[0])
static const char CONFIG[] = "{\"model_type\": \"kimi_vl\", \"text_config\": {\"hidden_size\": 8}}";
static const char REVISION[] = "398eede0903cd983a2bfa0cc634e9ac1d843f375";

typedef struct image {
    unsigned char *idx, *bin;
    size_t idx_len, bin_len;
    uint32_t kind;
} image;

static uint64_t spec_nbytes(const spec *t) {
    if (t->dtype == KVL_DTYPE_Q8_EXPERT) return q8_nbytes(t->shape[2], t->shape[3]);
    if (t->dtype == KVL_DTYPE_Q4_EXPERT) return q4_nbytes(t->shape[2], t->shape[3]);
    {
        uint64_t n = t->dtype == KVL_DTYPE_BF16 ? 2 : 4;
        uint32_t d;
        for (d = 0; d < t->ndim; d++) n *= t->shape[d];
        return n;
    }
}

static void build(image *im, uint32_t kind, const spec *ts, uint32_t n) {
    size_t cfg = strlen(CONFIG);
    uint64_t off = 0, offsets[16];
    uint32_t i;
    unsigned char *p;
    memset(im, 0, sizeof *im);
    for (i = 0; i < n; i++) {
        offsets[i] = off;
        off = a4k(off + spec_nbytes(&ts[i]));
    }
    im->kind = kind;
    im->bin_len = (size_t)off;
    im->bin = (unsigned char *)malloc(im->bin_len);
    for (i = 0; i < im->bin_len; i++) im->bin[i] = (unsigned char)rnd64();
    im->idx_len = idx_len_for(N_HP, n, cfg);
    im->idx = (unsigned char *)calloc(im->idx_len, 1);
    idx_put_header(im->idx, kind, off, (uint32_t)N_HP, n, (uint32_t)cfg, REVISION);
    p = im->idx + 128;
    for (i = 0; i < N_HP; i++, p += 64) idx_put_hparam(p, HP_KEYS[i], HP_VALS[i]);
    for (i = 0; i < n; i++, p += 192) {
        uint64_t nb = spec_nbytes(&ts[i]);
        idx_put_record(p, ts[i].name, ts[i].dtype, ts[i].ndim, ts[i].shape, offsets[i], nb,
                       ref_crc32(im->bin + offsets[i], (size_t)nb));
    }
    memcpy(p, CONFIG, cfg);
    idx_seal(im->idx, im->idx_len);
}

/* ------------------------------------------------------------------ files */

/* Unlinks first: truncating an existing file makes ext4 (auto_da_alloc) flush it to disk on
 * close, which turns thousands of tiny rewrites into tens of seconds of I/O wait. */
static int rewrite_file(const char *path, const unsigned char *data, size_t len) {
    remove(path);
    return write_file(path, data, len);
}

static int make_temp_dir(const char *base, char *out, size_t len) {
#ifdef _WIN32
    char tmp[MAX_PATH];
    (void)base;
    if (!GetTempPathA(MAX_PATH, tmp)) return -1;
    snprintf(out, len, "%skvl-test-store-fuzz-%lu", tmp, (unsigned long)GetCurrentProcessId());
    return _mkdir(out) == 0 ? 0 : -1;
#else
    snprintf(out, len, "%s/kvl-test-store-fuzz-XXXXXX", base);
    return mkdtemp(out) ? 0 : -1;
#endif
}

static void remove_dir(const char *dir) {
#ifdef _WIN32
    _rmdir(dir);
#else
    rmdir(dir);
#endif
}

/* ------------------------------------------------------------------ mutations */

/* A growable byte buffer holding the mutated index. */
typedef struct buf {
    unsigned char *p;
    size_t len, cap;
} buf;

static void buf_reserve(buf *b, size_t need) {
    if (need <= b->cap) return;
    b->cap = need + 1024;
    b->p = (unsigned char *)realloc(b->p, b->cap);
    if (!b->p) {
        printf("out of memory\n");
        exit(2);
    }
}
static void buf_insert(buf *b, size_t at, const unsigned char *src, size_t n) {
    buf_reserve(b, b->len + n);
    memmove(b->p + at + n, b->p + at, b->len - at);
    memcpy(b->p + at, src, n);
    b->len += n;
}
static void buf_erase(buf *b, size_t at, size_t n) {
    memmove(b->p + at, b->p + at + n, b->len - at - n);
    b->len -= n;
}

/* Header counts as currently stored (they may already be mutated). */
static uint32_t hdr_nhp(const buf *b) { return b->len >= 28 ? get32(b->p + 24) : 0; }
static uint32_t hdr_nt(const buf *b) { return b->len >= 32 ? get32(b->p + 28) : 0; }
/* Offset of tensor record i, or 0 if it is not wholly inside the buffer. */
static size_t rec_off(const buf *b, uint32_t i) {
    uint64_t o = 128 + 64 * (uint64_t)hdr_nhp(b) + 192 * (uint64_t)i;
    return o + 192 <= b->len ? (size_t)o : 0;
}

/* Values that tend to sit on validation edges. */
static uint64_t interesting64(uint64_t cur) {
    switch (rnd(14)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return cur + 1;
    case 3: return cur - 1;
    case 4: return cur + 4096;
    case 5: return cur - 4096;
    case 6: return UINT64_MAX;
    case 7: return UINT64_MAX - 4095;
    case 8: return (uint64_t)1 << 32;
    case 9: return ((uint64_t)1 << 63) + cur;
    case 10: return (uint64_t)rnd(8) * 4096;
    case 11: return 0xFFFFFFFFull;
    case 12: return (uint64_t)1 << (rnd(64));
    default: return rnd64();
    }
}
static uint32_t interesting32(uint32_t cur) {
    switch (rnd(10)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return cur + 1;
    case 3: return cur - 1;
    case 4: return 0xFFFFFFFFu;
    case 5: return 0x80000000u;
    case 6: return rnd(6);
    case 7: return cur * 2;
    case 8: return 0x7FFFFFFFu;
    default: return (uint32_t)rnd64();
    }
}

enum {
    M_BITFLIP, M_BYTE_SET, M_TRUNCATE, M_EXTEND, M_HDR_COUNT, M_HDR_FIELD, M_REC_OFFSET, M_REC_NBYTES,
    M_REC_SHAPE, M_REC_NDIM, M_REC_DTYPE, M_REC_SWAP, M_REC_DROP, M_REC_DUP, M_CFG_RESIZE, M_HP_DROP,
    M_HP_DUP, M_NAME, M_REC_MOVE, M_REC_FLAGS, M_COUNT
};
static const char *mutation_name[M_COUNT] = {
    "bitflip", "byte-set", "truncate", "extend", "header-count", "header-field", "rec-offset",
    "rec-nbytes", "rec-shape", "rec-ndim", "rec-dtype", "rec-swap", "rec-drop", "rec-dup",
    "config-resize", "hparam-drop", "hparam-dup", "rec-name", "rec-move", "rec-flags"};

static unsigned long mutation_count[M_COUNT];

/* Applies one mutation to the index; may change the bin size the header claims (and the caller
 * then writes a .bin of that size when the mutation asks for consistency via *bin_len). */
static void mutate(buf *b, size_t *bin_len) {
    uint32_t m = rnd(M_COUNT);
    uint32_t nt = hdr_nt(b);
    uint32_t ri = rnd(nt); /* may lie past the buffer if n_tensors was mutated: rec_off says so */
    size_t ro = rec_off(b, ri);
    mutation_count[m]++;
    switch (m) {
    case M_BITFLIP: {
        uint32_t k, n = 1 + rnd(4);
        for (k = 0; k < n && b->len; k++) b->p[rnd((uint32_t)b->len)] ^= (unsigned char)(1u << rnd(8));
        break;
    }
    case M_BYTE_SET: {
        static const unsigned char vals[3] = {0x00, 0xFF, 0x7F};
        if (!b->len) break;
        b->p[rnd((uint32_t)b->len)] = rnd(4) == 3 ? (unsigned char)rnd64() : vals[rnd(3)];
        break;
    }
    case M_TRUNCATE:
        b->len = rnd(3) == 0 ? rnd((uint32_t)b->len + 1) : b->len - (b->len ? 1 + rnd((uint32_t)(b->len < 200 ? b->len : 200)) : 0);
        break;
    case M_EXTEND: {
        unsigned char extra[256];
        uint32_t k, n = 1 + rnd(sizeof extra);
        for (k = 0; k < n; k++) extra[k] = rnd(2) ? 0 : (unsigned char)rnd64();
        buf_insert(b, b->len, extra, n);
        break;
    }
    case M_HDR_COUNT: /* n_hparams, n_tensors or config_json_bytes, without resizing the file */
        if (b->len >= 36) {
            size_t at = 24 + 4 * rnd(3);
            put32(b->p + at, interesting32(get32(b->p + at)));
        }
        break;
    case M_HDR_FIELD: { /* version, kind, bin_size, reserved, revision */
        if (b->len < 128) break;
        switch (rnd(5)) {
        case 0: put32(b->p + 8, interesting32(get32(b->p + 8))); break;
        case 1: put32(b->p + 12, rnd(5)); break;
        case 2: put64(b->p + 16, interesting64(get64(b->p + 16))); break;
        case 3: b->p[80 + rnd(48)] = (unsigned char)(1 + rnd(255)); break;
        default:
            if (rnd(2)) memset(b->p + 40, 0, 40);
            else b->p[40 + rnd(40)] = (unsigned char)rnd(0x30);
        }
        break;
    }
    case M_REC_OFFSET:
        if (ro) put64(b->p + ro + 168, interesting64(get64(b->p + ro + 168)));
        break;
    case M_REC_NBYTES:
        if (ro) put64(b->p + ro + 176, interesting64(get64(b->p + ro + 176)));
        break;
    case M_REC_SHAPE:
        if (ro) {
            size_t at = ro + 136 + 8 * rnd(4);
            put64(b->p + at, rnd(3) ? interesting64(get64(b->p + at)) : (uint64_t)rnd(5));
        }
        break;
    case M_REC_NDIM:
        if (ro) put32(b->p + ro + 132, rnd(3) ? rnd(6) : interesting32(get32(b->p + ro + 132)));
        break;
    case M_REC_DTYPE:
        if (ro) put32(b->p + ro + 128, rnd(3) ? rnd(6) : interesting32(get32(b->p + ro + 128)));
        break;
    case M_REC_SWAP: {
        size_t o2 = rec_off(b, nt ? rnd(nt) : 0);
        if (ro && o2 && o2 != ro) {
            unsigned char tmp[192];
            if (rnd(2)) { /* whole records: the offsets go out of order */
                memcpy(tmp, b->p + ro, 192);
                memcpy(b->p + ro, b->p + o2, 192);
                memcpy(b->p + o2, tmp, 192);
            } else { /* only the names: the offsets stay sorted, shapes move to other names */
                memcpy(tmp, b->p + ro, 128);
                memcpy(b->p + ro, b->p + o2, 128);
                memcpy(b->p + o2, tmp, 128);
            }
        }
        break;
    }
    case M_REC_DROP: /* size-consistent: the header's n_tensors follows */
        if (ro && nt) {
            buf_erase(b, ro, 192);
            put32(b->p + 28, nt - 1);
        }
        break;
    case M_REC_DUP: /* size-consistent duplicate, optionally renamed and moved past the end */
        if (ro && 128 + 64 * (uint64_t)hdr_nhp(b) + 192 * (uint64_t)nt <= b->len) {
            unsigned char rec[192];
            memcpy(rec, b->p + ro, 192);
            if (rnd(2)) {
                rec[rnd(40)] = (unsigned char)('a' + rnd(26));
                /* both bounded: the header's bin_size may itself be mutated already */
                if (rnd(2) && get64(rec + 176) <= (1u << 20) && get64(b->p + 16) <= (1u << 20)) {
                    uint64_t end = get64(b->p + 16);
                    put64(rec + 168, end);
                    put64(b->p + 16, end + a4k(get64(rec + 176)));
                    *bin_len = (size_t)(end + a4k(get64(rec + 176)));
                }
            }
            buf_insert(b, 128 + 64 * (size_t)hdr_nhp(b) + 192 * (size_t)nt, rec, 192);
            put32(b->p + 28, nt + 1);
        }
        break;
    case M_CFG_RESIZE: /* size-consistent change of config_json_bytes */
        if (b->len >= 128) {
            uint32_t cfg = get32(b->p + 32);
            if (rnd(2) && cfg > 0 && cfg <= b->len) {
                uint32_t cut = 1 + rnd(cfg);
                b->len -= cut;
                put32(b->p + 32, cfg - cut);
            } else {
                static const unsigned char junk[] = "\xff\xfe{\"x\": \"\xc3\x28\"}";
                buf_insert(b, b->len, junk, sizeof junk - 1);
                put32(b->p + 32, cfg + (uint32_t)(sizeof junk - 1));
            }
        }
        break;
    case M_HP_DROP: { /* size-consistent */
        uint32_t nhp = hdr_nhp(b);
        if (nhp && 128 + 64 * (size_t)nhp <= b->len) {
            buf_erase(b, 128 + 64 * (size_t)rnd(nhp), 64);
            put32(b->p + 24, nhp - 1);
        }
        break;
    }
    case M_HP_DUP: { /* size-consistent duplicate key, or a fresh key with a hostile value */
        uint32_t nhp = hdr_nhp(b);
        if (nhp && 128 + 64 * (size_t)nhp <= b->len) {
            unsigned char rec[64];
            memcpy(rec, b->p + 128 + 64 * (size_t)rnd(nhp), 64);
            if (rnd(2)) {
                double v = rnd(2) ? 1e308 : -0.0;
                v *= 10; /* infinity, or still -0.0 */
                rec[rnd(20)] = (unsigned char)('A' + rnd(26));
                memcpy(rec + 56, &v, 8);
            }
            buf_insert(b, 128, rec, 64);
            put32(b->p + 24, nhp + 1);
        }
        break;
    }
    case M_NAME:
        if (rnd(4) == 0 && hdr_nhp(b) && 128 + 64 * (size_t)hdr_nhp(b) <= b->len) { /* an hparam key */
            size_t ko = 128 + 64 * (size_t)rnd(hdr_nhp(b));
            if (rnd(2)) memset(b->p + ko, 'k', 56);
            else b->p[ko] = 0;
        } else if (ro) {
            switch (rnd(4)) {
            case 0: memset(b->p + ro, 'n', 128); break;   /* unterminated */
            case 1: b->p[ro] = 0; break;                  /* empty */
            case 2: b->p[ro + 127] = 'z'; break;          /* last byte */
            default: b->p[ro + rnd(128)] = (unsigned char)(0x80 + rnd(128)); /* non-ASCII */
            }
        }
        break;
    case M_REC_MOVE: /* aligned move inside (or just past) the bin: exercises the overlap/sort rules */
        if (ro) {
            uint64_t bin_size = b->len >= 24 ? get64(b->p + 16) : 0;
            put64(b->p + ro + 168, (uint64_t)rnd((uint32_t)(bin_size / 4096 + 2)) * 4096);
        }
        break;
    case M_REC_FLAGS:
        if (ro) put32(b->p + ro + 188, interesting32(0));
        break;
    default: break;
    }
}

/* ------------------------------------------------------------------ the oracle */

/* Independent size of a record per FORMAT.md; 0 if invalid or overflowing. */
static uint64_t expected_nbytes(const kvl_tensor_rec *r) {
    uint64_t n;
    uint32_t d;
    if (r->dtype == KVL_DTYPE_Q8_EXPERT) {
        if (r->ndim != 4 || r->shape[2] == 0 || r->shape[3] == 0) return 0;
        if (r->shape[2] > (1u << 24) || r->shape[3] > (1u << 24)) return 0; /* would overflow here */
        return q8_nbytes(r->shape[2], r->shape[3]);
    }
    if (r->dtype == KVL_DTYPE_Q4_EXPERT) {
        if (r->ndim != 4 || r->shape[2] == 0 || r->shape[3] == 0) return 0;
        if (r->shape[2] > (1u << 24) || r->shape[3] > (1u << 24)) return 0;
        if (r->shape[2] % 32 != 0 || r->shape[3] % 32 != 0) return 0;
        return q4_nbytes(r->shape[2], r->shape[3]);
    }
    if (r->dtype == KVL_DTYPE_Q8_ROWS) {
        if (r->ndim != 2 || r->shape[0] == 0 || r->shape[1] == 0) return 0;
        if (r->shape[0] > (1u << 24) || r->shape[1] > (1u << 24)) return 0;
        return a64(r->shape[0] * r->shape[1]) + 4 * r->shape[0];
    }
    if (r->dtype != KVL_DTYPE_BF16 && r->dtype != KVL_DTYPE_F32) return 0;
    n = r->dtype == KVL_DTYPE_BF16 ? 2 : 4;
    for (d = 0; d < r->ndim; d++) {
        if (r->shape[d] == 0 || n > UINT64_MAX / r->shape[d]) return 0;
        n *= r->shape[d];
    }
    return n;
}

static void check_open(const char *idx_path, const char *bin_path, const buf *idx,
                       const unsigned char *bin, size_t bin_len, uint32_t expected_kind, int io_mode) {
    char err[512];
    kvl_store *s = (kvl_store *)err; /* must be reset to NULL on failure */
    kvl_status st;
    uint32_t i, n;
    memset(err, 0, sizeof err);
    st = kvl_store_open(idx_path, bin_path, expected_kind, io_mode, &s, err, sizeof err);
    if (st != KVL_OK) {
        CHECK(s == NULL, "failed open (status %d) leaves out non-NULL", (int)st);
        CHECK(err[0] != 0, "failed open (status %d) has an empty message", (int)st);
        CHECK(strstr(err, idx_path) != NULL || strstr(err, bin_path) != NULL,
              "message names neither file: '%s'", err);
        /* UNSUPPORTED only when direct I/O was forced on a filesystem that refuses it */
        CHECK(st == KVL_ERR_FORMAT || st == KVL_ERR_IO || st == KVL_ERR_NOMEM ||
                  (st == KVL_ERR_UNSUPPORTED && io_mode == KVL_IO_DIRECT),
              "unexpected status %d: %s", (int)st, err);
        return;
    }
    CHECK(s != NULL, "KVL_OK without a store");
    if (!s) return;
    /* everything below must hold for any store the parser accepts */
    n = kvl_store_count(s);
    CHECK(idx->len >= 128 && n == get32(idx->p + 28), "count %u vs header", n);
    CHECK(kvl_store_bin_size(s) == bin_len, "bin_size %llu, file %llu",
          (unsigned long long)kvl_store_bin_size(s), (unsigned long long)bin_len);
    CHECK(kvl_store_bin_size(s) % 4096 == 0, "bin_size not page-multiple");
    CHECK(expected_kind == 0 || kvl_store_kind(s) == expected_kind, "kind %u, expected %u",
          kvl_store_kind(s), expected_kind);
    CHECK(kvl_store_kind(s) >= 1 && kvl_store_kind(s) <= 3, "kind %u", kvl_store_kind(s));
    CHECK(strlen(kvl_store_revision(s)) == 0 || strlen(kvl_store_revision(s)) == 40, "revision length");
    {
        size_t cfg_len = 0;
        const char *cfg = kvl_store_config_json(s, &cfg_len);
        CHECK(cfg != NULL && idx->len >= 128 && cfg_len == get32(idx->p + 32) &&
                  memcmp(cfg, idx->p + idx->len - cfg_len, cfg_len) == 0 && cfg[cfg_len] == 0,
              "config json");
    }
    {   /* every hparam record is found by its key with its value */
        uint32_t nhp = get32(idx->p + 24), h;
        for (h = 0; h < nhp; h++) {
            const unsigned char *r = idx->p + 128 + 64 * (size_t)h;
            int found = 0;
            double want, got;
            memcpy(&want, r + 56, 8); /* little-endian hosts only; true for every supported target */
            got = kvl_store_hparam(s, (const char *)r, &found);
            CHECK(found && got == want, "hparam %u", h);
            CHECK(got - got == 0.0, "hparam %u = %g accepted though not finite", h, got);
        }
    }
    for (i = 0; i < n; i++) {
        const kvl_tensor_rec *r = kvl_store_at(s, i), *prev = i ? kvl_store_at(s, i - 1) : NULL;
        uint64_t want;
        unsigned char *dst;
        CHECK(r != NULL, "at(%u)", i);
        if (!r) continue;
        CHECK(memchr(r->name, 0, sizeof r->name) != NULL && r->name[0] != 0, "name %u", i);
        CHECK(kvl_store_find(s, r->name) == r, "find(at(%u)->name)", i);
        CHECK(r->ndim >= 1 && r->ndim <= 4, "ndim %u", r->ndim);
        CHECK(r->flags == 0, "flags %u", r->flags);
        CHECK((r->dtype != KVL_DTYPE_Q8_ROWS || get32(idx->p + 8) >= 2) &&
                  (r->dtype != KVL_DTYPE_Q4_EXPERT || get32(idx->p + 8) >= 3),
              "'%s' dtype %u accepted in a version-%u index", r->name, r->dtype, get32(idx->p + 8));
        want = expected_nbytes(r);
        CHECK(want != 0 && r->nbytes == want, "'%s' nbytes %llu, dtype %u and shape need %llu", r->name,
              (unsigned long long)r->nbytes, r->dtype, (unsigned long long)want);
        CHECK(r->offset % 4096 == 0, "'%s' offset %llu unaligned", r->name, (unsigned long long)r->offset);
        CHECK(r->offset <= bin_len && r->nbytes <= bin_len - r->offset, "'%s' [%llu,+%llu) outside %llu-byte bin",
              r->name, (unsigned long long)r->offset, (unsigned long long)r->nbytes, (unsigned long long)bin_len);
        CHECK(!prev || r->offset >= prev->offset + prev->nbytes, "'%s' overlaps or precedes '%s'", r->name,
              prev->name);
        if (r->offset > bin_len || r->nbytes > bin_len - r->offset) continue; /* do not read wild ranges */
        dst = (unsigned char *)kvl_aligned_alloc(4096, (size_t)a4k(r->nbytes ? r->nbytes : 1));
        CHECK(dst != NULL, "alloc");
        if (!dst) continue;
        CHECK(kvl_store_read(s, r->offset, r->nbytes, dst) == KVL_OK, "read '%s'", r->name);
        CHECK(memcmp(dst, bin + r->offset, (size_t)r->nbytes) == 0, "contents of '%s'", r->name);
        kvl_aligned_free(dst);
    }
    CHECK(kvl_store_at(s, n) == NULL, "at(count)");
    kvl_store_close(s);
}

/* ------------------------------------------------------------------ driver */

int main(void) {
    char dir[256], idx_path[512], bin_path[512], bin_mut_path[512], bin_missing_path[512];
    const char *base = getenv("KVL_TEST_TMP");
    const char *iters_env = getenv("KVL_FUZZ_ITERS");
    const char *seed_env = getenv("KVL_FUZZ_SEED");
    unsigned long iters = iters_env ? strtoul(iters_env, NULL, 10) : 3000;
    unsigned long accepted = 0, rejected = 0, it;
    image stores[3];
    buf b = {NULL, 0, 0};
    unsigned char *big_bin = NULL;
    size_t big_cap = 0;
    int k;

    rng_state = 0x9E3779B97F4A7C15ull ^ (seed_env ? strtoull(seed_env, NULL, 10) * 0xD1B54A32D192ED03ull : 0);
    if (rng_state == 0) rng_state = 1; /* xorshift's one fixed point */
    for (k = 0; k < N_EXPERT_RECS; k++) { /* layers 1..2 x experts 0..1 */
        snprintf(expert_names[k], sizeof expert_names[k], "language_model.model.layers.%d.mlp.experts.%d",
                 1 + k / 2, k % 2);
        EXPERTS[k].name = expert_names[k];
        EXPERTS[k].dtype = KVL_DTYPE_Q8_EXPERT;
        EXPERTS[k].ndim = 4;
        EXPERTS[k].shape[0] = (uint64_t)(1 + k / 2);
        EXPERTS[k].shape[1] = (uint64_t)(k % 2);
        EXPERTS[k].shape[2] = EXP_I;
        EXPERTS[k].shape[3] = EXP_H;
    }
    build(&stores[0], 1, TRUNK, (uint32_t)N_TRUNK);
    build(&stores[1], 2, EXPERTS, N_EXPERT_RECS);
    for (k = 0; k < N_EXPERT_RECS; k++) {
        EXPERTS_Q4[k] = EXPERTS[k];
        EXPERTS_Q4[k].dtype = KVL_DTYPE_Q4_EXPERT;
        EXPERTS_Q4[k].shape[2] = Q4_I;
        EXPERTS_Q4[k].shape[3] = Q4_H;
    }
    build(&stores[2], 2, EXPERTS_Q4, N_EXPERT_RECS);
    put32(stores[2].idx + 8, 3); /* Q4_EXPERT records need format version 3 */
    idx_seal(stores[2].idx, stores[2].idx_len);

#ifndef _WIN32
    /* tmpfs by default: thousands of small file rewrites on a real disk cost seconds of I/O wait
     * (test_store.c already covers direct I/O on a real disk) */
    if (!base && access("/dev/shm", W_OK) == 0) base = "/dev/shm";
#endif
    if (!base) base = "/tmp";
    if (make_temp_dir(base, dir, sizeof dir) != 0) {
        printf("cannot create a temp dir under %s\n", base);
        return 2;
    }
    snprintf(idx_path, sizeof idx_path, "%s/fuzz.idx", dir);
    snprintf(bin_path, sizeof bin_path, "%s/fuzz.bin", dir);
    snprintf(bin_mut_path, sizeof bin_mut_path, "%s/fuzz-resized.bin", dir);
    snprintf(bin_missing_path, sizeof bin_missing_path, "%s/never-written.bin", dir);

    /* the unmutated stores must open (otherwise the fuzzing below proves nothing) */
    for (k = 0; k < 3; k++) {
        current_iter = 0;
        b.len = 0;
        buf_insert(&b, 0, stores[k].idx, stores[k].idx_len);
        rewrite_file(idx_path, stores[k].idx, stores[k].idx_len);
        rewrite_file(bin_path, stores[k].bin, stores[k].bin_len);
        {
            kvl_store *s = NULL;
            char err[512];
            CHECK(kvl_store_open(idx_path, bin_path, stores[k].kind, KVL_IO_BUFFERED, &s, err, sizeof err) == KVL_OK,
                  "valid store %d: %s", k, err);
            kvl_store_close(s);
        }
        check_open(idx_path, bin_path, &b, stores[k].bin, stores[k].bin_len, stores[k].kind, KVL_IO_BUFFERED);
    }

    for (it = 1; it <= iters; it++) {
        image *im = &stores[it % 3];
        size_t bin_len = im->bin_len;
        uint32_t n_mut = 1 + rnd(3), j;
        int keep_crc = rnd(20) == 0; /* 5%: leave the CRC stale so that check stays exercised */
        int resize_bin = rnd(8) == 0;
        const char *bp = rnd(100) == 0 ? bin_missing_path : bin_path;
        const unsigned char *bin = im->bin;
        uint32_t expected_kind = rnd(4) == 0 ? 0 : (rnd(8) == 0 ? 1 + rnd(3) : im->kind);
        int io_mode = rnd(10) == 0 ? KVL_IO_AUTO : rnd(20) == 0 ? KVL_IO_DIRECT : KVL_IO_BUFFERED;
        current_iter = it;
        b.len = 0;
        buf_insert(&b, 0, im->idx, im->idx_len);
        for (j = 0; j < n_mut; j++) mutate(&b, &bin_len);
        if (resize_bin) { /* .bin size change: a page more or less, a non-page size, or empty */
            switch (rnd(5)) {
            case 0: bin_len += 4096; break;
            case 1: bin_len = bin_len >= 4096 ? bin_len - 4096 : 0; break;
            case 2: bin_len += 1 + rnd(4095); break;
            case 3: bin_len = 0; break;
            default: /* consistent: header follows the file, so the record bounds decide */
                bin_len = rnd(2) ? bin_len + 4096 * (1 + rnd(2)) : a4k(bin_len / 2);
                if (b.len >= 24) put64(b.p + 16, bin_len);
            }
        }
        if (!keep_crc) idx_seal(b.p, b.len);
        if (bin_len != im->bin_len) { /* extra bytes are zero, like the packer's padding */
            if (!big_bin || bin_len > big_cap) {
                big_cap = bin_len ? bin_len : 1;
                big_bin = (unsigned char *)realloc(big_bin, big_cap);
                if (!big_bin) {
                    printf("out of memory\n");
                    return 2;
                }
            }
            memset(big_bin, 0, bin_len);
            memcpy(big_bin, im->bin, bin_len < im->bin_len ? bin_len : im->bin_len);
            bin = big_bin;
            bp = bin_mut_path;
            rewrite_file(bp, bin, bin_len);
        } else {
            rewrite_file(bin_path, im->bin, im->bin_len); /* the two stores alternate on one path */
        }
        rewrite_file(idx_path, b.p, b.len);
        {
            int before = n_fail;
            char err[512];
            kvl_store *s = NULL;
            /* one probe call to count outcomes; check_open repeats it with the oracle */
            if (kvl_store_open(idx_path, bp, expected_kind, io_mode, &s, err, sizeof err) == KVL_OK) {
                accepted++;
                kvl_store_close(s);
            } else {
                rejected++;
            }
            check_open(idx_path, bp, &b, bin, bin_len, expected_kind, io_mode);
            if (n_fail != before && n_fail - before < 3) printf("  (iter %lu: %u mutations)\n", it, n_mut);
        }
    }
    remove(idx_path);
    remove(bin_path);
    remove(bin_mut_path);
    remove_dir(dir);
    printf("test_store_fuzz: %lu iterations: %lu accepted, %lu rejected; mutations:", iters, accepted, rejected);
    for (k = 0; k < M_COUNT; k++) printf(" %s=%lu", mutation_name[k], mutation_count[k]);
    printf("\n");
    /* Enough of both outcomes, or the mutator is not reaching the checks it claims to exercise. */
    CHECK(iters < 500 || accepted >= iters / 50, "only %lu of %lu mutated stores were accepted", accepted, iters);
    CHECK(iters < 500 || rejected >= iters / 2, "only %lu of %lu mutated stores were rejected", rejected, iters);
    for (k = 0; k < 3; k++) {
        free(stores[k].idx);
        free(stores[k].bin);
    }
    free(b.p);
    free(big_bin);
    printf("test_store_fuzz: %d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
