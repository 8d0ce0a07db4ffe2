/* test_store.c — tests of store.c: the index parser/validator and the .bin reads.
 *
 * Owns: an independent writer of docs/FORMAT.md stores (its own byte layout code and its own
 * bitwise CRC-32, sharing nothing with store.c), valid-store checks in every io_mode, and one
 * corrupted copy per validation rule. Does not test caching (test_expert_cache.c).
 * Prints "N passed, M failed"; returns non-zero on any failure.
 * Temp dirs: $KVL_TEST_TMP or /tmp (a real disk: direct I/O) and, on Linux, /dev/shm (tmpfs).
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

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (cond) {                                                                       \
            n_pass++;                                                                     \
        } else {                                                                          \
            n_fail++;                                                                     \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            printf(__VA_ARGS__);                                                          \
            printf("\n");                                                                 \
        }                                                                                 \
    } while (0)

/* ------------------------------------------------------------------ independent writer */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

typedef struct spec_tensor {
    char name[160];
    uint32_t dtype, ndim;
    uint64_t shape[4];
    uint64_t nbytes;
} spec_tensor;

typedef struct built_store {
    unsigned char *idx, *bin;
    size_t idx_len, bin_len;
    uint64_t offsets[16];
    uint32_t n_tensors, n_hparams;
} built_store;

static const char *HP_KEYS[] = {"text.hidden_size", "text.num_hidden_layers", "text.rms_norm_eps",
                                "media_placeholder_token_id"};
static const double HP_VALS[] = {64.0, 3.0, 1e-5, 163605.0};
static const char CONFIG[] = "{\"model_type\": \"kimi_vl\", \"text_config\": {\"hidden_size\": 64}}";
static const char REVISION[] = "398eede0903cd983a2bfa0cc634e9ac1d843f375";

static void build(built_store *b, uint32_t kind, const spec_tensor *ts, uint32_t n) {
    size_t n_hp = sizeof HP_KEYS / sizeof HP_KEYS[0];
    size_t cfg = strlen(CONFIG);
    uint64_t off = 0;
    uint32_t i;
    unsigned char *p;
    memset(b, 0, sizeof *b);
    for (i = 0; i < n; i++) {
        b->offsets[i] = off;
        off = a4k(off + ts[i].nbytes);
    }
    b->bin_len = (size_t)off;
    b->bin = (unsigned char *)calloc(b->bin_len ? b->bin_len : 1, 1);
    for (i = 0; i < n; i++) {
        uint64_t k;
        for (k = 0; k < ts[i].nbytes; k++) b->bin[b->offsets[i] + k] = (unsigned char)rnd();
    }
    b->idx_len = idx_len_for(n_hp, n, cfg);
    b->idx = (unsigned char *)calloc(b->idx_len, 1);
    idx_put_header(b->idx, kind, off, (uint32_t)n_hp, n, (uint32_t)cfg, REVISION);
    p = b->idx + 128;
    for (i = 0; i < n_hp; i++, p += 64) idx_put_hparam(p, HP_KEYS[i], HP_VALS[i]);
    for (i = 0; i < n; i++, p += 192)
        idx_put_record(p, ts[i].name, ts[i].dtype, ts[i].ndim, ts[i].shape, b->offsets[i],
                       ts[i].nbytes, ref_crc32(b->bin + b->offsets[i], (size_t)ts[i].nbytes));
    memcpy(p, CONFIG, cfg);
    b->n_tensors = n;
    b->n_hparams = (uint32_t)n_hp;
    idx_seal(b->idx, b->idx_len);
}

static unsigned char *rec_at(built_store *b, uint32_t i) {
    return b->idx + 128 + 64 * (size_t)b->n_hparams + 192 * (size_t)i;
}

static int make_temp_dir(const char *base, char *out, size_t len) {
#ifdef _WIN32
    (void)base;
    char tmp[MAX_PATH];
    if (!GetTempPathA(MAX_PATH, tmp)) return -1;
    snprintf(out, len, "%skvl-test-store-%lu", tmp, (unsigned long)GetCurrentProcessId());
    return _mkdir(out) == 0 ? 0 : -1;
#else
    snprintf(out, len, "%s/kvl-test-store-XXXXXX", base);
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

/* ------------------------------------------------------------------ the stores under test */

static spec_tensor trunk_tensors[] = {
    {"language_model.model.embed_tokens.weight", KVL_DTYPE_BF16, 2, {3, 5, 0, 0}, 30},
    {"language_model.model.layers.0.mlp.gate.e_score_correction_bias", KVL_DTYPE_F32, 1, {7, 0, 0, 0}, 28},
    {"vision_tower.patch_embed.proj.weight", KVL_DTYPE_BF16, 4, {2, 3, 4, 5}, 240},
    {"language_model.lm_head.weight", KVL_DTYPE_F32, 2, {30, 50, 0, 0}, 6000}, /* spans 2 pages */
    {"language_model.model.norm.weight", KVL_DTYPE_BF16, 1, {4096, 0, 0, 0}, 8192}, /* exact pages */
};
#define N_TRUNK (sizeof trunk_tensors / sizeof trunk_tensors[0])

#define EXP_I 5
#define EXP_H 7
static spec_tensor expert_tensors[6];

static void init_expert_specs(void) {
    int l, e, k = 0;
    for (l = 1; l <= 2; l++) {
        for (e = 0; e < 3; e++, k++) {
            spec_tensor *t = &expert_tensors[k];
            snprintf(t->name, sizeof t->name, "language_model.model.layers.%d.mlp.experts.%d", l, e);
            t->dtype = KVL_DTYPE_Q8_EXPERT;
            t->ndim = 4;
            t->shape[0] = (uint64_t)l;
            t->shape[1] = (uint64_t)e;
            t->shape[2] = EXP_I;
            t->shape[3] = EXP_H;
            t->nbytes = q8_nbytes(EXP_I, EXP_H);
        }
    }
}

/* ------------------------------------------------------------------ checks of a valid store */

static void check_contents(kvl_store *s, const built_store *b, const spec_tensor *ts, uint32_t n,
                           const char *label) {
    uint32_t i;
    for (i = 0; i < n; i++) {
        const kvl_tensor_rec *r = kvl_store_find(s, ts[i].name);
        unsigned char *buf;
        unsigned char small[64];
        uint64_t padded = a4k(ts[i].nbytes);
        CHECK(r != NULL, "%s: find(%s)", label, ts[i].name);
        if (!r) continue;
        CHECK(r == kvl_store_at(s, i), "%s: find and at(%u) disagree", label, i);
        CHECK(r->offset == b->offsets[i] && r->nbytes == ts[i].nbytes && r->dtype == ts[i].dtype &&
                  r->ndim == ts[i].ndim && r->shape[0] == ts[i].shape[0] && r->shape[3] == ts[i].shape[3],
              "%s: record fields of %s", label, ts[i].name);
        CHECK(r->crc32 == ref_crc32(b->bin + b->offsets[i], (size_t)ts[i].nbytes), "%s: record crc", label);
        buf = (unsigned char *)kvl_aligned_alloc(KVL_PAGE, (size_t)padded);
        CHECK(buf && ((uintptr_t)buf % KVL_PAGE) == 0, "%s: aligned alloc", label);
        if (!buf) continue;
        memset(buf, 0xAB, (size_t)padded);
        CHECK(kvl_store_read(s, r->offset, r->nbytes, buf) == KVL_OK, "%s: read %s", label, r->name);
        CHECK(memcmp(buf, b->bin + r->offset, (size_t)r->nbytes) == 0, "%s: contents of %s", label, r->name);
        CHECK(memcmp(buf, b->bin + r->offset, (size_t)padded) == 0, "%s: padding of %s is the file's",
              label, r->name);
        if (r->nbytes > 10) {
            uint64_t o = r->offset + 3, len = r->nbytes - 7 < sizeof small ? r->nbytes - 7 : sizeof small;
            memset(small, 0, sizeof small);
            CHECK(kvl_store_read_small(s, o, len, small) == KVL_OK, "%s: read_small", label);
            CHECK(memcmp(small, b->bin + o, (size_t)len) == 0, "%s: read_small contents", label);
        }
        kvl_aligned_free(buf);
    }
}

static void check_valid_trunk(const char *dir, const char *fs_label) {
    built_store b;
    char idx[512], bin[512], err[512], label[128];
    int modes[3] = {KVL_IO_AUTO, KVL_IO_BUFFERED, KVL_IO_DIRECT};
    int direct_seen[3] = {-1, -1, -1};
    int m;
    build(&b, 1, trunk_tensors, N_TRUNK);
    snprintf(idx, sizeof idx, "%s/trunk.idx", dir);
    snprintf(bin, sizeof bin, "%s/trunk.bin", dir);
    CHECK(write_file(idx, b.idx, b.idx_len) == 0 && write_file(bin, b.bin, b.bin_len) == 0, "write %s", idx);
    for (m = 0; m < 3; m++) {
        kvl_store *s = NULL;
        kvl_status st;
        int found = -1;
        size_t cfg_len = 0;
        const char *cfg;
        snprintf(label, sizeof label, "%s io_mode=%d", fs_label, modes[m]);
        st = kvl_store_open(idx, bin, 1, modes[m], &s, err, sizeof err);
        if (modes[m] == KVL_IO_DIRECT && st == KVL_ERR_UNSUPPORTED) {
            printf("note: %s: direct I/O refused: %s\n", fs_label, err);
            CHECK(strstr(err, bin) != NULL, "UNSUPPORTED message names the bin: %s", err);
            CHECK(s == NULL, "no store on failure");
            direct_seen[m] = 0;
            continue;
        }
        CHECK(st == KVL_OK && s, "%s: open: %d %s", label, (int)st, err);
        if (!s) continue;
        direct_seen[m] = kvl_store_direct_io(s);
        CHECK(kvl_store_kind(s) == 1, "%s: kind", label);
        CHECK(kvl_store_count(s) == N_TRUNK, "%s: count", label);
        CHECK(kvl_store_bin_size(s) == b.bin_len, "%s: bin size", label);
        CHECK(strcmp(kvl_store_revision(s), REVISION) == 0, "%s: revision", label);
        CHECK(kvl_store_at(s, N_TRUNK) == NULL, "%s: at out of range", label);
        CHECK(kvl_store_find(s, "language_model.model.embed_tokens") == NULL, "%s: prefix not found", label);
        CHECK(kvl_store_find(s, "zzz") == NULL && kvl_store_find(s, "") == NULL, "%s: missing names", label);
        CHECK(kvl_store_hparam(s, "text.hidden_size", &found) == 64.0 && found == 1, "%s: hparam", label);
        CHECK(kvl_store_hparam(s, "text.rms_norm_eps", &found) == 1e-5 && found == 1, "%s: hparam eps", label);
        CHECK(kvl_store_hparam(s, "media_placeholder_token_id", &found) == 163605.0 && found, "%s: hp", label);
        found = 7;
        CHECK(kvl_store_hparam(s, "text.nope", &found) == 0.0 && found == 0, "%s: missing hparam", label);
        cfg = kvl_store_config_json(s, &cfg_len);
        CHECK(cfg && cfg_len == strlen(CONFIG) && strcmp(cfg, CONFIG) == 0, "%s: config json", label);
        check_contents(s, &b, trunk_tensors, N_TRUNK, label);
        /* misuse of the aligned read is refused, with a message naming the bin */
        {
            unsigned char *buf = (unsigned char *)kvl_aligned_alloc(KVL_PAGE, 2 * KVL_PAGE);
            char detail[512];
            CHECK(kvl_store_read(s, 100, 10, buf) == KVL_ERR_INVALID_ARG, "%s: unaligned offset", label);
            CHECK(kvl_store_read(s, b.bin_len, 10, buf) == KVL_ERR_INVALID_ARG, "%s: read past end", label);
            CHECK(kvl_store_read(s, 0, 10, buf + 8) == KVL_ERR_INVALID_ARG, "%s: unaligned dst", label);
            CHECK(kvl_store_read_small(s, b.bin_len - 4, 8, buf) == KVL_ERR_INVALID_ARG, "%s: small past end",
                  label);
            kvl_store_last_error(s, detail, sizeof detail);
            CHECK(strstr(detail, bin) != NULL, "%s: last_error names the bin: %s", label, detail);
            kvl_aligned_free(buf);
        }
        kvl_store_close(s);
    }
    CHECK(direct_seen[1] == 0, "%s: buffered mode reports direct=0", fs_label);
    CHECK(direct_seen[0] == direct_seen[2] || (direct_seen[2] == 0 && direct_seen[0] == 0),
          "%s: AUTO got direct=%d but DIRECT got %d", fs_label, direct_seen[0], direct_seen[2]);
    printf("note: %s: auto mode direct_io=%d, forced direct %s\n", fs_label, direct_seen[0],
           direct_seen[2] == 1 ? "works" : "refused");
    /* wrong expected kind */
    {
        kvl_store *s = NULL;
        kvl_status st = kvl_store_open(idx, bin, 2, KVL_IO_BUFFERED, &s, err, sizeof err);
        CHECK(st == KVL_ERR_FORMAT && s == NULL && strstr(err, idx), "%s: kind mismatch: %d %s", fs_label,
              (int)st, err);
    }
    remove(idx);
    remove(bin);
    free(b.idx);
    free(b.bin);
}

static void check_valid_experts(const char *dir) {
    built_store b;
    char idx[512], bin[512], err[512];
    kvl_store *s = NULL;
    kvl_status st;
    build(&b, 2, expert_tensors, 6);
    snprintf(idx, sizeof idx, "%s/experts.idx", dir);
    snprintf(bin, sizeof bin, "%s/experts.bin", dir);
    write_file(idx, b.idx, b.idx_len);
    write_file(bin, b.bin, b.bin_len);
    st = kvl_store_open(idx, bin, 2, KVL_IO_AUTO, &s, err, sizeof err);
    CHECK(st == KVL_OK, "experts open: %s", err);
    if (s) {
        kvl_q8_layout lay;
        CHECK(kvl_store_kind(s) == 2 && kvl_store_count(s) == 6, "experts kind/count");
        check_contents(s, &b, expert_tensors, 6, "experts");
        kvl_q8_layout_of(EXP_I, EXP_H, &lay);
        /* FORMAT.md example by hand for I=5, H=7: I*H = 35 */
        CHECK(lay.gate_q == 0 && lay.up_q == 64 && lay.down_q == 128 && lay.gate_s == 192 &&
                  lay.up_s == 256 && lay.down_s == 320 && lay.nbytes == 348,
              "q8 layout %llu %llu %llu %llu %llu %llu", (unsigned long long)lay.up_q,
              (unsigned long long)lay.down_q, (unsigned long long)lay.gate_s, (unsigned long long)lay.up_s,
              (unsigned long long)lay.down_s, (unsigned long long)lay.nbytes);
        kvl_store_close(s);
    }
    remove(idx);
    remove(bin);
    free(b.idx);
    free(b.bin);
}

/* ------------------------------------------------------------------ Q8_ROWS (format version 2) */

/* A trunk with Q8_ROWS matrices (kvl pack --trunk-dtype q8): nbytes = align64(rows*cols) + 4*rows */
static spec_tensor q8_rows_tensors[] = {
    {"language_model.model.embed_tokens.weight", KVL_DTYPE_BF16, 2, {3, 5, 0, 0}, 30},
    {"language_model.lm_head.weight", KVL_DTYPE_Q8_ROWS, 2, {30, 50, 0, 0}, 1536 + 120},
    {"language_model.model.layers.0.self_attn.q_proj.weight", KVL_DTYPE_Q8_ROWS, 2, {7, 9, 0, 0}, 64 + 28},
};
#define N_Q8_ROWS (sizeof q8_rows_tensors / sizeof q8_rows_tensors[0])

typedef enum { Q_VALID, Q_VERSION1, Q_NBYTES, Q_NDIM3, Q_ZERO_ROWS, Q_HUGE_COLS, Q_COUNT } q8_rows_case;
static const char *q8_rows_case_name[Q_COUNT] = {
    "valid v2", "Q8_ROWS in a version-1 index", "Q8_ROWS nbytes", "Q8_ROWS ndim 3", "Q8_ROWS zero rows",
    "Q8_ROWS cols > 2^24"};

/* Each case on the lm_head record (1): opens (valid), or fails with a FORMAT error whose message
 * names the index file and the tensor. */
static void check_q8_rows(const char *dir, q8_rows_case c) {
    built_store b;
    char idx[512], bin[512], err[512];
    kvl_store *s = NULL;
    kvl_status st;
    build(&b, 1, q8_rows_tensors, N_Q8_ROWS);
    put32(b.idx + 8, 2);
    switch (c) {
    case Q_VERSION1: put32(b.idx + 8, 1); break;
    case Q_NBYTES: put64(rec_at(&b, 1) + 176, 1500 + 120); break; /* the 64-byte padding left out */
    case Q_NDIM3: put32(rec_at(&b, 1) + 132, 3); put64(rec_at(&b, 1) + 136 + 16, 1); break;
    case Q_ZERO_ROWS: put64(rec_at(&b, 1) + 136, 0); break;
    case Q_HUGE_COLS: put64(rec_at(&b, 1) + 136 + 8, ((uint64_t)1 << 24) + 1); break;
    default: break;
    }
    idx_seal(b.idx, b.idx_len);
    snprintf(idx, sizeof idx, "%s/q8rows.idx", dir);
    snprintf(bin, sizeof bin, "%s/q8rows.bin", dir);
    write_file(idx, b.idx, b.idx_len);
    write_file(bin, b.bin, b.bin_len);
    st = kvl_store_open(idx, bin, 1, KVL_IO_AUTO, &s, err, sizeof err);
    if (c == Q_VALID) {
        CHECK(st == KVL_OK && s, "%s: open: %s", q8_rows_case_name[c], err);
        if (s) {
            kvl_q8_rows_layout lay;
            const kvl_tensor_rec *r = kvl_store_find(s, "language_model.lm_head.weight");
            check_contents(s, &b, q8_rows_tensors, N_Q8_ROWS, "q8 rows");
            CHECK(r && r->dtype == KVL_DTYPE_Q8_ROWS && r->nbytes == 1656, "lm_head record");
            /* FORMAT.md by hand for [30, 50]: 1500 int8 -> scales at 1536, + 30 * 4 */
            kvl_q8_rows_layout_of(30, 50, &lay);
            CHECK(lay.scale == 1536 && lay.nbytes == 1656, "q8 rows layout %llu %llu",
                  (unsigned long long)lay.scale, (unsigned long long)lay.nbytes);
            kvl_store_close(s);
        }
    } else {
        CHECK(st == KVL_ERR_FORMAT && s == NULL, "%s: status %d (%s)", q8_rows_case_name[c], (int)st, err);
        CHECK(strstr(err, idx) && strstr(err, "language_model.lm_head.weight"),
              "%s: message names the file and tensor: '%s'", q8_rows_case_name[c], err);
        if (getenv("KVL_TEST_VERBOSE")) printf("  %-26s -> %s\n", q8_rows_case_name[c], err);
    }
    remove(idx);
    remove(bin);
    free(b.idx);
    free(b.bin);
}

/* ------------------------------------------------------------------ Q4_EXPERT (format version 3) */

/* An experts store of Q4 extents (kvl pack --expert-dtype q4), I = 32, H = 64: nbytes by
 * test_bytes.h's q4_nbytes, 3456 by hand below */
#define Q4_I 32
#define Q4_H 64
static spec_tensor q4_tensors[] = {
    {"language_model.model.layers.1.mlp.experts.0", KVL_DTYPE_Q4_EXPERT, 4, {1, 0, Q4_I, Q4_H}, 0},
    {"language_model.model.layers.1.mlp.experts.1", KVL_DTYPE_Q4_EXPERT, 4, {1, 1, Q4_I, Q4_H}, 0},
    {"language_model.model.layers.2.mlp.experts.0", KVL_DTYPE_Q4_EXPERT, 4, {2, 0, Q4_I, Q4_H}, 0},
};
#define N_Q4 (sizeof q4_tensors / sizeof q4_tensors[0])

typedef enum {
    Q4_VALID, Q4_VALID_MIXED, Q4_VERSION2, Q4_VERSION1, Q4_NBYTES, Q4_I_NOT_32, Q4_H_NOT_32, Q4_NDIM3,
    Q4_ZERO_I, Q4_HUGE_H, Q4_COUNT
} q4_case;
static const char *q4_case_name[Q4_COUNT] = {
    "valid v3", "valid v3, Q8 and Q4 records", "Q4_EXPERT in a version-2 index",
    "Q4_EXPERT in a version-1 index", "Q4 nbytes", "Q4 I = 48", "Q4 H = 40", "Q4 ndim 3", "Q4 I = 0",
    "Q4 H > 2^24"};

/* Each case on record 1 (the version on every record): opens (valid; the store does not mind Q8 and Q4 extents side by side,
 * the engine does), or fails with a FORMAT error whose message names the index file, the tensor
 * and, where there is one, the rule. */
static void check_q4_experts(const char *dir, q4_case c) {
    built_store b;
    spec_tensor ts[N_Q4];
    char idx[512], bin[512], err[512];
    kvl_store *s = NULL;
    kvl_status st;
    const char *reason = NULL;
    memcpy(ts, q4_tensors, sizeof ts);
    for (size_t i = 0; i < N_Q4; i++) ts[i].nbytes = q4_nbytes(Q4_I, Q4_H);
    if (c == Q4_VALID_MIXED) {
        ts[2].dtype = KVL_DTYPE_Q8_EXPERT;
        ts[2].nbytes = q8_nbytes(Q4_I, Q4_H);
    }
    build(&b, 2, ts, N_Q4);
    put32(b.idx + 8, 3);
    switch (c) {
    case Q4_VERSION2: put32(b.idx + 8, 2); reason = "needs format version 3"; break;
    case Q4_VERSION1: put32(b.idx + 8, 1); reason = "needs format version 3"; break;
    case Q4_NBYTES: put64(rec_at(&b, 1) + 176, q4_nbytes(Q4_I, Q4_H) - 2); reason = "nbytes"; break;
    case Q4_I_NOT_32: put64(rec_at(&b, 1) + 136 + 16, 48); reason = "multiples of 32"; break;
    case Q4_H_NOT_32: put64(rec_at(&b, 1) + 136 + 24, 40); reason = "multiples of 32"; break;
    case Q4_NDIM3: put32(rec_at(&b, 1) + 132, 3); put64(rec_at(&b, 1) + 136 + 24, 0); break;
    case Q4_ZERO_I: put64(rec_at(&b, 1) + 136 + 16, 0); break;
    case Q4_HUGE_H: put64(rec_at(&b, 1) + 136 + 24, ((uint64_t)1 << 24) + 32); break;
    default: break;
    }
    idx_seal(b.idx, b.idx_len);
    snprintf(idx, sizeof idx, "%s/q4.idx", dir);
    snprintf(bin, sizeof bin, "%s/q4.bin", dir);
    write_file(idx, b.idx, b.idx_len);
    write_file(bin, b.bin, b.bin_len);
    st = kvl_store_open(idx, bin, 2, KVL_IO_AUTO, &s, err, sizeof err);
    if (c == Q4_VALID || c == Q4_VALID_MIXED) {
        CHECK(st == KVL_OK && s, "%s: open: %s", q4_case_name[c], err);
        if (s) {
            const kvl_tensor_rec *r = kvl_store_find(s, "language_model.model.layers.1.mlp.experts.1");
            check_contents(s, &b, ts, N_Q4, q4_case_name[c]);
            CHECK(r && r->dtype == KVL_DTYPE_Q4_EXPERT && r->nbytes == 3456, "%s: Q4 record", q4_case_name[c]);
            kvl_store_close(s);
        }
    } else {
        CHECK(st == KVL_ERR_FORMAT && s == NULL, "%s: status %d (%s)", q4_case_name[c], (int)st, err);
        /* the version rule fires on the first Q4 record, the others on record 1 */
        const char *who = c == Q4_VERSION2 || c == Q4_VERSION1 ? ts[0].name : ts[1].name;
        CHECK(strstr(err, idx) && strstr(err, who), "%s: message names the file and %s: '%s'", q4_case_name[c],
              who, err);
        if (reason) CHECK(strstr(err, reason) != NULL, "%s: message says '%s': '%s'", q4_case_name[c], reason, err);
        if (getenv("KVL_TEST_VERBOSE")) printf("  %-26s -> %s\n", q4_case_name[c], err);
    }
    remove(idx);
    remove(bin);
    free(b.idx);
    free(b.bin);
}

static void check_q4_layout(void) {
    kvl_q4_layout lay;
    /* FORMAT.md by hand for I = 32, H = 64: q blocks 32*64/2 = 1024 bytes, scale blocks
     * 2*(32*64/32) = 128 bytes, every offset already a multiple of 64 */
    kvl_q4_layout_of(Q4_I, Q4_H, &lay);
    CHECK(lay.gate_q == 0 && lay.up_q == 1024 && lay.down_q == 2048 && lay.gate_s == 3072 &&
              lay.up_s == 3200 && lay.down_s == 3328 && lay.nbytes == 3456,
          "q4 layout %llu %llu %llu %llu %llu %llu", (unsigned long long)lay.up_q,
          (unsigned long long)lay.down_q, (unsigned long long)lay.gate_s, (unsigned long long)lay.up_s,
          (unsigned long long)lay.down_s, (unsigned long long)lay.nbytes);
    CHECK(q4_nbytes(Q4_I, Q4_H) == 3456 && q4_nbytes(1408, 2048) == 4866048, "the test's own q4 size");
    kvl_q4_layout_of(1408, 2048, &lay);
    CHECK(lay.nbytes == 4866048, "q4 layout of the full-size model's expert: %llu", (unsigned long long)lay.nbytes);
    kvl_q4_layout_of(48, 64, &lay);
    CHECK(lay.nbytes == 0 && lay.up_q == 0, "q4 layout of I = 48 is empty");
    kvl_q4_layout_of(32, 0, &lay);
    CHECK(lay.nbytes == 0, "q4 layout of H = 0 is empty");
}

/* ------------------------------------------------------------------ corruptions */

typedef enum {
    C_MAGIC, C_VERSION, C_KIND, C_CRC, C_TRUNC_IDX, C_TRUNC_HEADER, C_TRUNC_BIN, C_MISSING_BIN,
    C_MISALIGNED, C_OVERLAP, C_UNSORTED, C_NBYTES, C_UNTERMINATED, C_EMPTY_NAME, C_DTYPE, C_NDIM0,
    C_NDIM5, C_UNUSED_DIM, C_OUT_OF_BIN, C_HP_KEY, C_DUP_NAME, C_RESERVED, C_Q8_NBYTES, C_Q8_NDIM,
    C_BIN_SIZE_UNALIGNED, C_COUNT
} corruption;

static const char *corruption_name[C_COUNT] = {
    "bad magic", "wrong version", "unknown kind", "CRC mismatch", "truncated idx", "idx shorter than header",
    "truncated bin", "missing bin", "misaligned offset", "overlapping records", "unsorted records",
    "nbytes != shape", "unterminated name", "empty name", "unknown dtype", "ndim 0", "ndim 5",
    "nonzero unused dim", "range outside bin", "unterminated hparam key", "duplicate name",
    "reserved header bytes", "Q8 nbytes != extent", "Q8 ndim 2", "bin_size not page multiple"};

static void check_corruption(const char *dir, corruption c) {
    built_store b;
    char idx[512], bin[512], err[512];
    kvl_store *s = (kvl_store *)&b; /* must be reset to NULL on failure */
    kvl_status st, want = KVL_ERR_FORMAT;
    size_t idx_len, bin_len;
    int refix = 1;
    const char *must_name;
    int is_experts = (c == C_Q8_NBYTES || c == C_Q8_NDIM);
    if (is_experts) build(&b, 2, expert_tensors, 6);
    else build(&b, 1, trunk_tensors, N_TRUNK);
    idx_len = b.idx_len;
    bin_len = b.bin_len;
    snprintf(idx, sizeof idx, "%s/bad.idx", dir);
    snprintf(bin, sizeof bin, "%s/bad.bin", dir);
    must_name = idx;
    switch (c) {
    case C_MAGIC: b.idx[3] = 'X'; break;
    case C_VERSION: put32(b.idx + 8, 4); break; /* 1, 2 and 3 are read */
    case C_KIND: put32(b.idx + 12, 9); break;
    case C_CRC: b.idx[b.idx_len - 2] ^= 0x20; refix = 0; break;
    case C_TRUNC_IDX: idx_len -= 1; refix = 0; break;
    case C_TRUNC_HEADER: idx_len = 50; refix = 0; break;
    case C_TRUNC_BIN: bin_len -= 4096; must_name = bin; break;
    case C_MISSING_BIN: bin_len = (size_t)-1; must_name = bin; want = KVL_ERR_IO; break;
    case C_MISALIGNED: put64(rec_at(&b, 2) + 168, get64(rec_at(&b, 2) + 168) + 512); break;
    case C_OVERLAP: /* tensor 3 spans 6000 bytes from its offset; move tensor 4 into it */
        put64(rec_at(&b, 4) + 168, get64(rec_at(&b, 3) + 168) + 4096);
        break;
    case C_UNSORTED: { /* swap the offsets of two records: still aligned and in range */
        uint64_t o1 = get64(rec_at(&b, 1) + 168), o2 = get64(rec_at(&b, 2) + 168);
        put64(rec_at(&b, 1) + 168, o2);
        put64(rec_at(&b, 2) + 168, o1);
        break;
    }
    case C_NBYTES: put64(rec_at(&b, 0) + 176, 32); break;
    case C_UNTERMINATED: memset(rec_at(&b, 1), 'a', 128); break;
    case C_EMPTY_NAME: memset(rec_at(&b, 1), 0, 128); break;
    case C_DTYPE: put32(rec_at(&b, 0) + 128, 6); break; /* 4 Q8_ROWS, 5 Q4_EXPERT (check_q8_rows, check_q4_experts) */
    case C_NDIM0: put32(rec_at(&b, 1) + 132, 0); break;
    case C_NDIM5: put32(rec_at(&b, 1) + 132, 5); break;
    case C_UNUSED_DIM: put64(rec_at(&b, 1) + 136 + 8, 1); break; /* ndim 1, shape[1] = 1 */
    case C_OUT_OF_BIN: put64(rec_at(&b, 4) + 168, b.bin_len); break;
    case C_HP_KEY: memset(b.idx + 128 + 64, 'k', 56); break;
    case C_DUP_NAME: memcpy(rec_at(&b, 2), rec_at(&b, 0), 128); break;
    case C_RESERVED: b.idx[100] = 1; break;
    case C_Q8_NBYTES: put64(rec_at(&b, 3) + 176, q8_nbytes(EXP_I, EXP_H) - 4); break;
    case C_Q8_NDIM: put32(rec_at(&b, 3) + 132, 2); break;
    case C_BIN_SIZE_UNALIGNED:
        put64(b.idx + 16, b.bin_len + 100);
        bin_len = b.bin_len; /* file matches neither; the alignment rule fires first */
        break;
    default: break;
    }
    if (refix) idx_seal(b.idx, b.idx_len); /* so the intended rule, not the CRC, fires */
    write_file(idx, b.idx, idx_len);
    remove(bin);
    if (bin_len != (size_t)-1) write_file(bin, b.bin, bin_len);
    st = kvl_store_open(idx, bin, 0, KVL_IO_AUTO, &s, err, sizeof err);
    CHECK(st == want, "%s: status %d, want %d (%s)", corruption_name[c], (int)st, (int)want, err);
    CHECK(s == NULL, "%s: out is NULL on failure", corruption_name[c]);
    CHECK(strstr(err, must_name) != NULL, "%s: message names %s: '%s'", corruption_name[c], must_name, err);
    if (c == C_VERSION)
        CHECK(strstr(err, "format version 4") && strstr(err, "reads versions 1, 2 and 3"),
              "the version refusal lists the versions read: '%s'", err);
    if (getenv("KVL_TEST_VERBOSE")) printf("  %-26s -> %s\n", corruption_name[c], err);
    if (s) kvl_store_close(s);
    remove(idx);
    remove(bin);
    free(b.idx);
    free(b.bin);
}

#ifndef _WIN32
/* A .bin truncated after open: reads past the new end fail with IO and a message, no crash. */
static void check_truncated_after_open(const char *dir) {
    built_store b;
    char idx[512], bin[512], err[512], detail[512];
    kvl_store *s = NULL;
    int mode;
    for (mode = KVL_IO_AUTO; mode <= KVL_IO_BUFFERED; mode += KVL_IO_BUFFERED) {
        build(&b, 1, trunk_tensors, N_TRUNK);
        snprintf(idx, sizeof idx, "%s/shrink.idx", dir);
        snprintf(bin, sizeof bin, "%s/shrink.bin", dir);
        write_file(idx, b.idx, b.idx_len);
        write_file(bin, b.bin, b.bin_len);
        CHECK(kvl_store_open(idx, bin, 1, mode, &s, err, sizeof err) == KVL_OK, "open: %s", err);
        if (s) {
            const kvl_tensor_rec *last = kvl_store_at(s, N_TRUNK - 1);
            unsigned char *buf = (unsigned char *)kvl_aligned_alloc(KVL_PAGE, 2 * KVL_PAGE);
            unsigned char small[16];
            write_file(bin, b.bin, 4096); /* same inode, now one page long */
            CHECK(kvl_store_read(s, last->offset, last->nbytes, buf) == KVL_ERR_IO, "read past new end");
            CHECK(kvl_store_read_small(s, last->offset + 1, 8, small) == KVL_ERR_IO, "small read past new end");
            kvl_store_last_error(s, detail, sizeof detail);
            CHECK(strstr(detail, bin) && strstr(detail, "end of file"), "message: %s", detail);
            CHECK(kvl_store_read(s, 0, 100, buf) == KVL_OK && memcmp(buf, b.bin, 100) == 0, "first page still reads");
            kvl_aligned_free(buf);
            kvl_store_close(s);
            s = NULL;
        }
        remove(idx);
        remove(bin);
        free(b.idx);
        free(b.bin);
    }
}
#endif

static void check_crc(void) {
    const char *v = "123456789";
    /* the published CRC-32 check value for "123456789" */
    CHECK(kvl_crc32(0, v, 9) == 0xCBF43926u, "crc check value %08x", kvl_crc32(0, v, 9));
    CHECK(kvl_crc32(kvl_crc32(0, v, 4), v + 4, 5) == 0xCBF43926u, "crc chaining");
    CHECK(ref_crc32((const unsigned char *)v, 9) == 0xCBF43926u, "test's own crc");
    CHECK(kvl_crc32(0, v, 0) == 0, "crc of nothing");
}

static void check_args(void) {
    char err[256];
    kvl_store *s = (kvl_store *)err;
    CHECK(kvl_store_open("/nonexistent-kvl/x.idx", "/nonexistent-kvl/x.bin", 0, KVL_IO_AUTO, &s, err,
                         sizeof err) == KVL_ERR_IO && s == NULL && strstr(err, "/nonexistent-kvl/x.idx"),
          "missing idx: %s", err);
    CHECK(kvl_store_open("a.idx", "a.bin", 0, 17, &s, err, sizeof err) == KVL_ERR_INVALID_ARG, "bad io_mode");
    CHECK(kvl_store_open(NULL, "a.bin", 0, 0, &s, err, sizeof err) == KVL_ERR_INVALID_ARG, "null path");
    {
        void *p = kvl_aligned_alloc(4096, 100);
        CHECK(p && ((uintptr_t)p % 4096) == 0 && ((unsigned char *)p)[99] == 0, "aligned alloc zeroed");
        kvl_aligned_free(p);
    }
    {
        uint64_t t0 = kvl_now_ns(), t1 = kvl_now_ns();
        CHECK(t1 >= t0 && t0 > 0, "monotonic clock");
    }
}

int main(void) {
    char dir[256];
    const char *base = getenv("KVL_TEST_TMP");
    int c;
    init_expert_specs();
    check_crc();
    check_args();
    if (!base) base = "/tmp";
    if (make_temp_dir(base, dir, sizeof dir) != 0) {
        printf("cannot create a temp dir under %s\n", base);
        return 2;
    }
    check_valid_trunk(dir, base);
    check_valid_experts(dir);
    for (c = 0; c < C_COUNT; c++) check_corruption(dir, (corruption)c);
    for (c = 0; c < Q_COUNT; c++) check_q8_rows(dir, (q8_rows_case)c);
    check_q4_layout();
    for (c = 0; c < Q4_COUNT; c++) check_q4_experts(dir, (q4_case)c);
#ifndef _WIN32
    check_truncated_after_open(dir);
#endif
    remove_dir(dir);
#ifndef _WIN32
    /* tmpfs: direct I/O may be refused there; AUTO must then fall back to buffered */
    if (access("/dev/shm", W_OK) == 0 && make_temp_dir("/dev/shm", dir, sizeof dir) == 0) {
        check_valid_trunk(dir, "/dev/shm (tmpfs)");
        remove_dir(dir);
    }
#endif
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
