/* store.c — one packed store (X.idx + X.bin, docs/FORMAT.md): parse, validate, read.
 *
 * Owns: the C reader of the index format (every check of FORMAT.md is done here, once, at
 * open, so the read path carries only a bounds check), the hparam table, the by-name lookup,
 * positional reads of the .bin with direct I/O or a buffered fallback, the reference CRC-32
 * (kvl_crc32; the fast ones are crc32.c's), each record's "data checked" flag, the Q8 and Q4
 * extent layouts, aligned allocation and the monotonic clock.
 * Does not own: caching (expert_cache.c, engine.c, trunk.c), any math, or which stores a pack holds.
 */
/* _GNU_SOURCE and _FILE_OFFSET_BITS=64 come from the build (wasm-core/CMakeLists.txt). */
#include "store.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "platform.h"

#define IDX_HEADER_BYTES 128u
#define IDX_HPARAM_BYTES 64u
#define IDX_TENSOR_BYTES 192u
#define IDX_HPARAM_KEY_BYTES 56u
#define IDX_NAME_BYTES 128u
/* The versions this reader reads run from 1 to the highest min_version of dtype_rows below: a
 * dtype that older readers cannot read raises the version packs holding it say, so such a reader
 * stops at the version instead of calling the index corrupt (FORMAT.md "Versions"). */
/* Q4_EXPERT: I and H are whole numbers of groups of this many columns */
#define Q4_GROUP 32u
/* Upper bound for an expert or Q8_ROWS dimension: keeps every layout product far from u64
 * overflow. */
#define MAX_EXPERT_DIM (1u << 24)

typedef struct hparam_entry {
    char key[IDX_HPARAM_KEY_BYTES];
    double value;
} hparam_entry;

struct kvl_store {
    char *idx_path, *bin_path;
    uint32_t kind;
    uint64_t bin_size;
    char revision[41];
    uint32_t n_hparams, n_tensors;
    hparam_entry *hparams;           /* sorted by key */
    kvl_tensor_rec *recs;            /* file order (sorted by offset) */
    const kvl_tensor_rec **by_name;  /* sorted by name, for kvl_store_find */
    char *config_json;               /* NUL-terminated copy */
    size_t config_len;
    kvl_os_file fd_bulk;             /* aligned reads: direct handle, or the buffered one */
    kvl_os_file fd_buffered;         /* small unaligned reads (always buffered) */
    int direct;                      /* 1 if fd_bulk bypasses the page cache */
    kvl_os_mutex err_lock;
    char last_error[384];
    kvl_os_mutex flag_lock;          /* guards verified */
    unsigned char *verified;         /* [n_tensors]: 1 once the record's data matched its CRC */
};

/* ------------------------------------------------------------------ CRC-32 */

/* Half-byte table of the reflected polynomial 0xEDB88320: 16 constants, so there is no lazy
 * initialisation to race on when several threads compute CRCs at once. */
static const uint32_t crc_nibble[16] = {
    0x00000000u, 0x1DB71064u, 0x3B6E20C8u, 0x26D930ACu, 0x76DC4190u, 0x6B6B51F4u,
    0x4DB26158u, 0x5005713Cu, 0xEDB88320u, 0xF00F9344u, 0xD6D6A3E8u, 0xCB61B38Cu,
    0x9B64C2B0u, 0x86D3D2D4u, 0xA00AE278u, 0xBDBDF21Cu};

uint32_t kvl_crc32(uint32_t crc, const void *data, size_t len) {
    const unsigned char *p = (const unsigned char *)data;
    size_t i;
    crc = ~crc;
    for (i = 0; i < len; i++) {
        crc ^= p[i];
        crc = (crc >> 4) ^ crc_nibble[crc & 0xFu];
        crc = (crc >> 4) ^ crc_nibble[crc & 0xFu];
    }
    return ~crc;
}

/* ------------------------------------------------------------------ small helpers */

#include "errbuf.h" /* set_err */

static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t rd64(const unsigned char *p) {
    return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32);
}
static double rdf64(const unsigned char *p) {
    uint64_t bits = rd64(p);
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = (char *)malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* bounded NUL search: 1 if buf[0..n) holds a NUL */
static int has_nul(const char *buf, size_t n) { return memchr(buf, 0, n) != NULL; }

static const char *kind_name(uint32_t kind) {
    switch (kind) {
    case 1: return "trunk";
    case 2: return "experts";
    case 3: return "vision";
    default: return "unknown";
    }
}

void kvl_q8_layout_of(uint64_t inter, uint64_t hidden, kvl_q8_layout *out) {
    uint64_t ih = inter * hidden;
    out->gate_q = 0;
    out->up_q = align_up(ih, 64);
    out->down_q = align_up(out->up_q + ih, 64);
    out->gate_s = align_up(out->down_q + ih, 64);
    out->up_s = align_up(out->gate_s + 4 * inter, 64);
    out->down_s = align_up(out->up_s + 4 * inter, 64);
    out->nbytes = out->down_s + 4 * hidden;
}

void kvl_q4_layout_of(uint64_t inter, uint64_t hidden, kvl_q4_layout *out) {
    /* each matrix: I*H/2 q bytes (two columns a byte) and I*H/32 BF16 scales (one a group) */
    uint64_t q = inter * hidden / 2, sc = 2 * (inter * hidden / Q4_GROUP);
    memset(out, 0, sizeof *out);
    if (inter == 0 || hidden == 0 || inter % Q4_GROUP != 0 || hidden % Q4_GROUP != 0) return;
    out->up_q = align_up(q, 64);
    out->down_q = align_up(out->up_q + q, 64);
    out->gate_s = align_up(out->down_q + q, 64);
    out->up_s = align_up(out->gate_s + sc, 64);
    out->down_s = align_up(out->up_s + sc, 64);
    out->nbytes = out->down_s + sc;
}

void kvl_q8_rows_layout_of(uint64_t rows, uint64_t cols, kvl_q8_rows_layout *out) {
    out->scale = align_up(rows * cols, 64);
    out->nbytes = out->scale + 4 * rows;
}

/* a*b with overflow detection: 0 on overflow */
static int mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* ------------------------------------------------------------------ memory / clock */

void *kvl_aligned_alloc(size_t alignment, size_t bytes) {
    void *p;
    if (alignment < sizeof(void *)) alignment = sizeof(void *);
    if ((alignment & (alignment - 1)) != 0) return NULL;
    p = kvl_os_aligned_malloc(alignment, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void *kvl_large_alloc(size_t bytes) {
#ifdef __EMSCRIPTEN__
    /* no huge pages in WebAssembly, and its memory is fixed: page alignment (what direct reads
     * need) wastes at most 4 KiB per block instead of 2 MiB */
    const size_t huge = KVL_PAGE;
#else
    const size_t huge = (size_t)2 << 20;
#endif
    void *p = kvl_os_aligned_malloc(huge, bytes);
    if (p) kvl_os_advise_hugepages(p, bytes);
    return p;
}

void kvl_aligned_free(void *p) {
    if (p) kvl_os_aligned_free(p);
}

uint64_t kvl_now_ns(void) { return kvl_os_now_ns(); }

/* ------------------------------------------------------------------ open */

static int cmp_hparam(const void *a, const void *b) {
    return strcmp(((const hparam_entry *)a)->key, ((const hparam_entry *)b)->key);
}
static int cmp_rec_name(const void *a, const void *b) {
    const kvl_tensor_rec *ra = *(const kvl_tensor_rec *const *)a;
    const kvl_tensor_rec *rb = *(const kvl_tensor_rec *const *)b;
    return strcmp(ra->name, rb->name);
}

/* ------------------------------------------------------------------ dtype rows */

/* Store kinds as bits, for dtype_row.stores */
#define IN_TRUNK (1u << 1)
#define IN_EXPERTS (1u << 2)
#define IN_VISION (1u << 3)

/* Fills *bytes with the data bytes a record of this dtype and shape holds; or returns 0 with the
 * broken shape rule (the message after "<idx>: ") in why. Dimensions past ndim are already 0. */
typedef int (*layout_bytes_fn)(const kvl_tensor_rec *t, uint32_t itemsize, uint64_t *bytes,
                               char *why, size_t why_len);

/* One row per record dtype: everything the reader checks that depends on the dtype. A new dtype
 * is one row here (and its layout function), one in host/pack/pack-format.ts DTYPE_ROWS, and its
 * section of docs/FORMAT.md. */
typedef struct dtype_row {
    uint32_t dtype;          /* KVL_DTYPE_* (its name: dtype_name) */
    uint32_t min_version;    /* the lowest format_version whose index may hold it */
    uint32_t stores;         /* IN_* bits: the stores the packer writes it to (the engine checks
                              * which tensors may have it; the index reader accepts any store) */
    uint32_t itemsize;       /* bytes an element, for dense dtypes (0: a packed layout) */
    layout_bytes_fn layout_bytes;
} dtype_row;

/* BF16, F32: any shape of 1..4 nonzero dimensions, itemsize bytes an element */
static int dense_bytes(const kvl_tensor_rec *t, uint32_t itemsize, uint64_t *bytes, char *why,
                       size_t why_len) {
    uint64_t elems = 1;
    uint32_t d;
    for (d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 0 || !mul_ok(elems, t->shape[d], &elems)) {
            set_err(why, why_len, "tensor '%s' has an invalid shape (zero or overflowing dimension %u)",
                    t->name, d);
            return 0;
        }
    }
    if (!mul_ok(elems, itemsize, bytes)) *bytes = 0;
    return 1;
}

/* 1 if shape [L, E, I, H] has 1 <= I, H <= MAX_EXPERT_DIM (L and E identify the record; 0 is valid) */
static int expert_shape_ok(const kvl_tensor_rec *t) {
    return t->ndim == 4 && t->shape[2] != 0 && t->shape[3] != 0 && t->shape[2] <= MAX_EXPERT_DIM &&
           t->shape[3] <= MAX_EXPERT_DIM;
}

static int q8_expert_bytes(const kvl_tensor_rec *t, uint32_t itemsize, uint64_t *bytes, char *why,
                           size_t why_len) {
    kvl_q8_layout lay;
    (void)itemsize;
    if (!expert_shape_ok(t)) {
        set_err(why, why_len, "Q8 expert '%s' must have shape [L, E, I, H] with 1 <= I, H <= %u",
                t->name, MAX_EXPERT_DIM);
        return 0;
    }
    kvl_q8_layout_of(t->shape[2], t->shape[3], &lay);
    *bytes = lay.nbytes;
    return 1;
}

static int q4_expert_bytes(const kvl_tensor_rec *t, uint32_t itemsize, uint64_t *bytes, char *why,
                           size_t why_len) {
    kvl_q4_layout lay;
    (void)itemsize;
    if (!expert_shape_ok(t) || t->shape[2] % Q4_GROUP != 0 || t->shape[3] % Q4_GROUP != 0) {
        set_err(why, why_len, "Q4 expert '%s' must have shape [L, E, I, H] with 1 <= I, H <= %u, "
                "both multiples of %u; the index is corrupt, rerun `kvl pack`", t->name,
                MAX_EXPERT_DIM, Q4_GROUP);
        return 0;
    }
    kvl_q4_layout_of(t->shape[2], t->shape[3], &lay);
    *bytes = lay.nbytes;
    return 1;
}

static int q8_rows_bytes(const kvl_tensor_rec *t, uint32_t itemsize, uint64_t *bytes, char *why,
                         size_t why_len) {
    kvl_q8_rows_layout lay;
    (void)itemsize;
    if (t->ndim != 2 || t->shape[0] == 0 || t->shape[1] == 0 || t->shape[0] > MAX_EXPERT_DIM ||
        t->shape[1] > MAX_EXPERT_DIM) {
        set_err(why, why_len, "Q8_ROWS tensor '%s' must have shape [rows, cols] with 1 <= rows, "
                "cols <= %u", t->name, MAX_EXPERT_DIM);
        return 0;
    }
    kvl_q8_rows_layout_of(t->shape[0], t->shape[1], &lay);
    *bytes = lay.nbytes;
    return 1;
}

static const dtype_row dtype_rows[] = {
    {KVL_DTYPE_BF16, 1, IN_TRUNK | IN_VISION, 2, dense_bytes},
    {KVL_DTYPE_F32, 1, IN_TRUNK, 4, dense_bytes},
    {KVL_DTYPE_Q8_EXPERT, 1, IN_EXPERTS, 0, q8_expert_bytes},
    {KVL_DTYPE_Q8_ROWS, 2, IN_TRUNK, 0, q8_rows_bytes},
    {KVL_DTYPE_Q4_EXPERT, 3, IN_EXPERTS, 0, q4_expert_bytes},
};
#define N_DTYPE_ROWS (sizeof dtype_rows / sizeof dtype_rows[0])

/* A dtype's name as FORMAT.md spells it (kvl_core.h KVL_DTYPE_ROWS), "?" for another value. */
static const char *dtype_name(uint32_t dtype) {
    switch (dtype) {
#define DTYPE_NAME_CASE(sym, value, name) \
    case value: return name;
        KVL_DTYPE_ROWS(DTYPE_NAME_CASE)
#undef DTYPE_NAME_CASE
    default: return "?";
    }
}

static const dtype_row *dtype_row_of(uint32_t dtype) {
    size_t i;
    for (i = 0; i < N_DTYPE_ROWS; i++)
        if (dtype_rows[i].dtype == dtype) return &dtype_rows[i];
    return NULL;
}

/* The newest format_version this reader reads (versions 1 up to it). */
static uint32_t newest_format_version(void) {
    uint32_t v = 1;
    size_t i;
    for (i = 0; i < N_DTYPE_ROWS; i++)
        if (dtype_rows[i].min_version > v) v = dtype_rows[i].min_version;
    return v;
}

/* "1, 2 and 3": the versions read, as the version refusal lists them */
static void versions_text(char *out, size_t out_len) {
    uint32_t v, newest = newest_format_version();
    size_t used = 0;
    out[0] = 0;
    for (v = 1; v <= newest && used < out_len; v++) {
        int n = snprintf(out + used, out_len - used, "%s%u", v == 1 ? "" : v == newest ? " and " : ", ", v);
        if (n < 0) break;
        used += (size_t)n;
    }
}

/* Checks one tensor record's dtype-dependent fields: known dtype, allowed in this version, shape
 * rule, nbytes from the layout. */
static kvl_status check_record_dtype(const char *path, const kvl_tensor_rec *t, uint32_t version,
                                     char *err, size_t err_len) {
    const dtype_row *row = dtype_row_of(t->dtype);
    char why[256];
    uint64_t want = 0;
    if (!row) {
        set_err(err, err_len, "%s: tensor '%s' has unknown dtype %u", path, t->name, t->dtype);
        return KVL_ERR_FORMAT;
    }
    if (version < row->min_version) {
        set_err(err, err_len, "%s: tensor '%s' is %s, which needs format version %u (the index says "
                "%u); the index is corrupt, rerun `kvl pack`", path, t->name, dtype_name(row->dtype),
                row->min_version, version);
        return KVL_ERR_FORMAT;
    }
    if (!row->layout_bytes(t, row->itemsize, &want, why, sizeof why)) {
        set_err(err, err_len, "%s: %s", path, why);
        return KVL_ERR_FORMAT;
    }
    if (want == 0 || t->nbytes != want) {
        set_err(err, err_len, "%s: tensor '%s' has nbytes %llu but its dtype and shape need %llu",
                path, t->name, (unsigned long long)t->nbytes, (unsigned long long)want);
        return KVL_ERR_FORMAT;
    }
    return KVL_OK;
}

/* Reads a whole (small) file into a malloc'd buffer. */
static kvl_status read_whole_file(const char *path, unsigned char **out, uint64_t *out_len,
                                  char *err, size_t err_len) {
    kvl_os_file f = KVL_OS_FILE_INVALID;
    uint64_t size = 0, done = 0;
    unsigned char *buf;
    char sys[160];
    int rc = kvl_os_open_read(path, 0, &f);
    if (rc != 0) {
        kvl_os_strerror(rc, sys, sizeof sys);
        set_err(err, err_len, "%s: cannot open (%s); the pack is missing or incomplete, rerun `kvl pack`",
                path, sys);
        return KVL_ERR_IO;
    }
    rc = kvl_os_file_size(f, &size);
    if (rc != 0) {
        kvl_os_strerror(rc, sys, sizeof sys);
        set_err(err, err_len, "%s: cannot get file size (%s)", path, sys);
        kvl_os_close(f);
        return KVL_ERR_IO;
    }
    if (size > ((uint64_t)1 << 31)) { /* an index is a few MB; anything this big is not one */
        set_err(err, err_len, "%s: %llu bytes is far too large for an index file; the pack is corrupt",
                path, (unsigned long long)size);
        kvl_os_close(f);
        return KVL_ERR_FORMAT;
    }
    buf = (unsigned char *)malloc(size ? (size_t)size : 1);
    if (!buf) {
        set_err(err, err_len, "%s: out of memory reading %llu bytes", path, (unsigned long long)size);
        kvl_os_close(f);
        return KVL_ERR_NOMEM;
    }
    while (done < size) {
        size_t got = 0;
        rc = kvl_os_pread(f, buf + done, (size_t)(size - done), done, &got);
        if (rc != 0 || got == 0) {
            if (rc != 0) kvl_os_strerror(rc, sys, sizeof sys);
            else snprintf(sys, sizeof sys, "file shrank while reading");
            set_err(err, err_len, "%s: read failed at byte %llu (%s)", path, (unsigned long long)done, sys);
            free(buf);
            kvl_os_close(f);
            return KVL_ERR_IO;
        }
        done += got;
    }
    kvl_os_close(f);
    *out = buf;
    *out_len = size;
    return KVL_OK;
}

/* Validates the whole index image and fills the store's tables. */
static kvl_status parse_index(kvl_store *s, const unsigned char *buf, uint64_t size,
                              uint32_t expected_kind, char *err, size_t err_len) {
    const char *path = s->idx_path;
    uint32_t version, kind, n_hp, n_t, cfg_bytes, crc_stored, crc_calc, i;
    uint64_t bin_size, expected_size;
    unsigned char zero_crc[4] = {0, 0, 0, 0};

    if (size < IDX_HEADER_BYTES) {
        set_err(err, err_len, "%s: file is %llu bytes, shorter than the %u-byte header; the pack is "
                "truncated, rerun `kvl pack`", path, (unsigned long long)size, IDX_HEADER_BYTES);
        return KVL_ERR_FORMAT;
    }
    if (memcmp(buf, "KVLIDX01", 8) != 0) {
        set_err(err, err_len, "%s: bad magic (not a kvl index file); rerun `kvl pack`", path);
        return KVL_ERR_FORMAT;
    }
    version = rd32(buf + 8);
    if (version < 1 || version > newest_format_version()) {
        char versions[64];
        versions_text(versions, sizeof versions);
        set_err(err, err_len, "%s: format version %u, this runtime reads versions %s; "
                "repack with this version's `kvl pack`", path, version, versions);
        return KVL_ERR_FORMAT;
    }
    kind = rd32(buf + 12);
    if (kind < 1 || kind > 3) {
        set_err(err, err_len, "%s: unknown store kind %u (expected 1 trunk, 2 experts or 3 vision)",
                path, kind);
        return KVL_ERR_FORMAT;
    }
    if (expected_kind != 0 && kind != expected_kind) {
        set_err(err, err_len, "%s: is a %s store, expected a %s store", path, kind_name(kind),
                kind_name(expected_kind));
        return KVL_ERR_FORMAT;
    }
    bin_size = rd64(buf + 16);
    n_hp = rd32(buf + 24);
    n_t = rd32(buf + 28);
    cfg_bytes = rd32(buf + 32);
    crc_stored = rd32(buf + 36);
    /* every term fits in u64 without overflow: 2^32 * 192 < 2^40 */
    expected_size = (uint64_t)IDX_HEADER_BYTES + (uint64_t)IDX_HPARAM_BYTES * n_hp +
                    (uint64_t)IDX_TENSOR_BYTES * n_t + (uint64_t)cfg_bytes;
    if (size != expected_size) {
        set_err(err, err_len, "%s: file is %llu bytes but its header describes %llu bytes (%u hparams, "
                "%u tensors, %u config bytes); the index is truncated or corrupt, rerun `kvl pack`",
                path, (unsigned long long)size, (unsigned long long)expected_size, n_hp, n_t, cfg_bytes);
        return KVL_ERR_FORMAT;
    }
    crc_calc = kvl_crc32(0, buf, 36);
    crc_calc = kvl_crc32(crc_calc, zero_crc, 4);
    crc_calc = kvl_crc32(crc_calc, buf + 40, (size_t)(size - 40));
    if (crc_calc != crc_stored) {
        set_err(err, err_len, "%s: index CRC-32 mismatch (stored %08x, computed %08x); the file is "
                "corrupt, rerun `kvl pack`", path, crc_stored, crc_calc);
        return KVL_ERR_FORMAT;
    }
    for (i = 80; i < IDX_HEADER_BYTES; i++) {
        if (buf[i] != 0) {
            set_err(err, err_len, "%s: reserved header byte %u is not zero; written by an "
                    "incompatible packer, rerun `kvl pack`", path, i);
            return KVL_ERR_FORMAT;
        }
    }
    if (bin_size % KVL_PAGE != 0) {
        set_err(err, err_len, "%s: bin_size %llu is not a multiple of %u", path,
                (unsigned long long)bin_size, KVL_PAGE);
        return KVL_ERR_FORMAT;
    }
    /* source revision: 40 printable chars, or all zero (unknown) */
    {
        const unsigned char *rev = buf + 40;
        int all_zero = 1;
        for (i = 0; i < 40; i++) all_zero &= rev[i] == 0;
        if (all_zero) {
            s->revision[0] = 0;
        } else {
            for (i = 0; i < 40; i++) {
                if (rev[i] < 0x21 || rev[i] > 0x7e) {
                    set_err(err, err_len, "%s: source revision field is not 40 ASCII characters", path);
                    return KVL_ERR_FORMAT;
                }
                s->revision[i] = (char)rev[i];
            }
            s->revision[40] = 0;
        }
    }
    s->kind = kind;
    s->bin_size = bin_size;
    s->n_hparams = n_hp;
    s->n_tensors = n_t;

    /* hparams */
    s->hparams = (hparam_entry *)calloc(n_hp ? n_hp : 1, sizeof(hparam_entry));
    if (!s->hparams) {
        set_err(err, err_len, "%s: out of memory", path);
        return KVL_ERR_NOMEM;
    }
    for (i = 0; i < n_hp; i++) {
        const unsigned char *r = buf + IDX_HEADER_BYTES + (size_t)i * IDX_HPARAM_BYTES;
        if (!has_nul((const char *)r, IDX_HPARAM_KEY_BYTES) || r[0] == 0) {
            set_err(err, err_len, "%s: hparam record %u has an empty or unterminated key", path, i);
            return KVL_ERR_FORMAT;
        }
        memcpy(s->hparams[i].key, r, IDX_HPARAM_KEY_BYTES);
        s->hparams[i].value = rdf64(r + IDX_HPARAM_KEY_BYTES);
        /* v - v is 0 exactly for finite v (NaN for inf and NaN): the packer writes config numbers
         * only, and host/pack/pack-format.ts refuses the same values */
        if (s->hparams[i].value - s->hparams[i].value != 0.0) {
            set_err(err, err_len, "%s: hparam '%s' is not a finite number; the index is corrupt, "
                    "rerun `kvl pack`", path, s->hparams[i].key);
            return KVL_ERR_FORMAT;
        }
    }
    if (n_hp > 1) qsort(s->hparams, n_hp, sizeof(hparam_entry), cmp_hparam);
    for (i = 1; i < n_hp; i++) {
        if (strcmp(s->hparams[i - 1].key, s->hparams[i].key) == 0) {
            set_err(err, err_len, "%s: hparam key '%s' appears twice", path, s->hparams[i].key);
            return KVL_ERR_FORMAT;
        }
    }

    /* tensor records */
    s->recs = (kvl_tensor_rec *)calloc(n_t ? n_t : 1, sizeof(kvl_tensor_rec));
    s->by_name = (const kvl_tensor_rec **)calloc(n_t ? n_t : 1, sizeof(kvl_tensor_rec *));
    s->verified = (unsigned char *)calloc(n_t ? n_t : 1, 1);
    if (!s->recs || !s->by_name || !s->verified) {
        set_err(err, err_len, "%s: out of memory", path);
        return KVL_ERR_NOMEM;
    }
    for (i = 0; i < n_t; i++) {
        const unsigned char *r = buf + IDX_HEADER_BYTES + (size_t)n_hp * IDX_HPARAM_BYTES +
                                 (size_t)i * IDX_TENSOR_BYTES;
        kvl_tensor_rec *t = &s->recs[i];
        uint32_t d;
        kvl_status st;
        if (!has_nul((const char *)r, IDX_NAME_BYTES) || r[0] == 0) {
            set_err(err, err_len, "%s: tensor record %u has an empty or unterminated name", path, i);
            return KVL_ERR_FORMAT;
        }
        memcpy(t->name, r, IDX_NAME_BYTES);
        t->dtype = rd32(r + 128);
        t->ndim = rd32(r + 132);
        for (d = 0; d < 4; d++) t->shape[d] = rd64(r + 136 + 8 * d);
        t->offset = rd64(r + 168);
        t->nbytes = rd64(r + 176);
        t->crc32 = rd32(r + 184);
        t->flags = rd32(r + 188);
        if (t->flags != 0) {
            set_err(err, err_len, "%s: tensor '%s' has unknown flags %u", path, t->name, t->flags);
            return KVL_ERR_FORMAT;
        }
        if (t->ndim < 1 || t->ndim > 4) {
            set_err(err, err_len, "%s: tensor '%s' has ndim %u (must be 1..4)", path, t->name, t->ndim);
            return KVL_ERR_FORMAT;
        }
        for (d = t->ndim; d < 4; d++) {
            if (t->shape[d] != 0) {
                set_err(err, err_len, "%s: tensor '%s' has a nonzero unused dimension %u", path,
                        t->name, d);
                return KVL_ERR_FORMAT;
            }
        }
        if ((st = check_record_dtype(path, t, version, err, err_len)) != KVL_OK) return st;
        if (t->offset % KVL_PAGE != 0) {
            set_err(err, err_len, "%s: tensor '%s' offset %llu is not a multiple of %u", path,
                    t->name, (unsigned long long)t->offset, KVL_PAGE);
            return KVL_ERR_FORMAT;
        }
        if (t->offset > bin_size || t->nbytes > bin_size - t->offset) {
            set_err(err, err_len, "%s: tensor '%s' range [%llu, +%llu) lies outside the %llu-byte .bin",
                    path, t->name, (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                    (unsigned long long)bin_size);
            return KVL_ERR_FORMAT;
        }
        if (i > 0) {
            const kvl_tensor_rec *p = &s->recs[i - 1];
            if (t->offset < p->offset + p->nbytes) {
                set_err(err, err_len, "%s: tensor '%s' at offset %llu overlaps or precedes '%s' "
                        "(records must be sorted by offset and not overlap)", path, t->name,
                        (unsigned long long)t->offset, p->name);
                return KVL_ERR_FORMAT;
            }
        }
        s->by_name[i] = t;
    }
    if (n_t > 1) qsort((void *)s->by_name, n_t, sizeof(kvl_tensor_rec *), cmp_rec_name);
    for (i = 1; i < n_t; i++) {
        if (strcmp(s->by_name[i - 1]->name, s->by_name[i]->name) == 0) {
            set_err(err, err_len, "%s: tensor name '%s' appears twice", path, s->by_name[i]->name);
            return KVL_ERR_FORMAT;
        }
    }

    /* config json */
    s->config_json = (char *)malloc((size_t)cfg_bytes + 1);
    if (!s->config_json) {
        set_err(err, err_len, "%s: out of memory", path);
        return KVL_ERR_NOMEM;
    }
    memcpy(s->config_json, buf + (size - cfg_bytes), cfg_bytes);
    s->config_json[cfg_bytes] = 0;
    s->config_len = cfg_bytes;
    return KVL_OK;
}

/* Opens the .bin, checks its size and settles direct vs buffered reads. */
static kvl_status open_bin(kvl_store *s, int io_mode, char *err, size_t err_len) {
    const char *path = s->bin_path;
    char sys[160];
    uint64_t size = 0;
    int rc = kvl_os_open_read(path, 0, &s->fd_buffered);
    if (rc != 0) {
        kvl_os_strerror(rc, sys, sizeof sys);
        set_err(err, err_len, "%s: cannot open (%s); the pack is missing or incomplete, rerun `kvl pack`",
                path, sys);
        return KVL_ERR_IO;
    }
    rc = kvl_os_file_size(s->fd_buffered, &size);
    if (rc != 0) {
        kvl_os_strerror(rc, sys, sizeof sys);
        set_err(err, err_len, "%s: cannot get file size (%s)", path, sys);
        return KVL_ERR_IO;
    }
    if (size != s->bin_size) {
        set_err(err, err_len, "%s: expected %llu bytes, found %llu; the pack is incomplete or "
                "truncated, rerun `kvl pack`", path, (unsigned long long)s->bin_size,
                (unsigned long long)size);
        return KVL_ERR_FORMAT;
    }
    s->fd_bulk = s->fd_buffered;
    s->direct = 0;
    if (io_mode == KVL_IO_BUFFERED) return KVL_OK;

    rc = kvl_os_open_read(path, 1, &s->fd_bulk);
    if (rc == 0) {
        /* Direct reads are KVL_PAGE-aligned (offsets, lengths and buffers: the pack's layout), so
         * they work wherever the OS's required alignment (Windows: the volume's sectors) divides
         * KVL_PAGE; a volume that needs more is read buffered. Where the OS does not say (0), the
         * probe read below settles it. */
        uint32_t align = kvl_os_direct_alignment(s->fd_bulk, path);
        if (align != 0 && KVL_PAGE % align != 0) {
            kvl_os_close(s->fd_bulk);
            s->fd_bulk = s->fd_buffered;
            if (io_mode == KVL_IO_DIRECT) {
                set_err(err, err_len, "%s: direct I/O was requested but the volume needs %u-byte "
                        "alignment, more than the pack's %u bytes; use io_mode auto or buffered",
                        path, (unsigned)align, (unsigned)KVL_PAGE);
                return KVL_ERR_UNSUPPORTED;
            }
            return KVL_OK; /* AUTO: buffered, reported by kvl_store_direct_io() = 0 */
        }
    }
    if (rc == 0 && s->bin_size >= KVL_PAGE) {
        /* Some filesystems accept the open flag but refuse the read: probe one aligned page now,
         * so the mode is settled at open and never changes under concurrent readers. */
        void *page = kvl_os_aligned_malloc(KVL_PAGE, KVL_PAGE);
        size_t got = 0;
        if (!page) {
            kvl_os_close(s->fd_bulk);
            s->fd_bulk = s->fd_buffered;
            set_err(err, err_len, "%s: out of memory", path);
            return KVL_ERR_NOMEM;
        }
        rc = kvl_os_pread(s->fd_bulk, page, KVL_PAGE, 0, &got);
        kvl_os_aligned_free(page);
        if (rc == 0 && got == 0) rc = KVL_OS_ERR_UNSUPPORTED_DIRECT; /* treat as refusal */
        if (rc != 0) {
            kvl_os_close(s->fd_bulk);
            s->fd_bulk = KVL_OS_FILE_INVALID;
        }
    } else if (rc == 0) {
        /* empty .bin: nothing will ever be read; keep the direct handle as is */
    } else {
        s->fd_bulk = KVL_OS_FILE_INVALID;
    }
    if (rc != 0) {
        s->fd_bulk = s->fd_buffered;
        if (io_mode == KVL_IO_DIRECT) {
            kvl_os_strerror(rc, sys, sizeof sys);
            set_err(err, err_len, "%s: direct I/O was requested but this filesystem refuses it (%s); "
                    "use io_mode auto or buffered", path, sys);
            return KVL_ERR_UNSUPPORTED;
        }
        return KVL_OK; /* AUTO: buffered fallback, reported by kvl_store_direct_io() = 0 */
    }
    s->direct = 1;
    return KVL_OK;
}

kvl_status kvl_store_open(const char *idx_path, const char *bin_path, uint32_t expected_kind,
                          int io_mode, kvl_store **out, char *err, size_t err_len) {
    kvl_store *s;
    unsigned char *buf = NULL;
    uint64_t size = 0;
    kvl_status st;
    if (err && err_len) err[0] = 0;
    if (!out) return KVL_ERR_INVALID_ARG;
    *out = NULL;
    if (!idx_path || !bin_path) {
        set_err(err, err_len, "kvl_store_open: null path");
        return KVL_ERR_INVALID_ARG;
    }
    if (io_mode != KVL_IO_AUTO && io_mode != KVL_IO_DIRECT && io_mode != KVL_IO_BUFFERED) {
        set_err(err, err_len, "%s: unknown io_mode %d", bin_path, io_mode);
        return KVL_ERR_INVALID_ARG;
    }
    s = (kvl_store *)calloc(1, sizeof *s);
    if (!s) {
        set_err(err, err_len, "%s: out of memory", idx_path);
        return KVL_ERR_NOMEM;
    }
    s->fd_bulk = KVL_OS_FILE_INVALID;
    s->fd_buffered = KVL_OS_FILE_INVALID;
    kvl_os_mutex_init(&s->err_lock);
    kvl_os_mutex_init(&s->flag_lock);
    s->idx_path = dup_str(idx_path);
    s->bin_path = dup_str(bin_path);
    if (!s->idx_path || !s->bin_path) {
        set_err(err, err_len, "%s: out of memory", idx_path);
        kvl_store_close(s);
        return KVL_ERR_NOMEM;
    }
    st = read_whole_file(idx_path, &buf, &size, err, err_len);
    if (st == KVL_OK) st = parse_index(s, buf, size, expected_kind, err, err_len);
    free(buf);
    if (st == KVL_OK) st = open_bin(s, io_mode, err, err_len);
    if (st != KVL_OK) {
        kvl_store_close(s);
        return st;
    }
    *out = s;
    return KVL_OK;
}

void kvl_store_close(kvl_store *s) {
    if (!s) return;
    if (s->fd_bulk != s->fd_buffered) kvl_os_close(s->fd_bulk);
    kvl_os_close(s->fd_buffered);
    kvl_os_mutex_destroy(&s->err_lock);
    kvl_os_mutex_destroy(&s->flag_lock);
    free(s->verified);
    free(s->idx_path);
    free(s->bin_path);
    free(s->hparams);
    free(s->recs);
    free((void *)s->by_name);
    free(s->config_json);
    free(s);
}

/* ------------------------------------------------------------------ accessors */

int kvl_store_direct_io(const kvl_store *s) { return s->direct; }
uint32_t kvl_store_count(const kvl_store *s) { return s->n_tensors; }
uint32_t kvl_store_kind(const kvl_store *s) { return s->kind; }
uint64_t kvl_store_bin_size(const kvl_store *s) { return s->bin_size; }
const char *kvl_store_revision(const kvl_store *s) { return s->revision; }
const char *kvl_store_bin_path(const kvl_store *s) { return s->bin_path; }

const kvl_tensor_rec *kvl_store_at(const kvl_store *s, uint32_t i) {
    return i < s->n_tensors ? &s->recs[i] : NULL;
}

const kvl_tensor_rec *kvl_store_find(const kvl_store *s, const char *name) {
    uint32_t lo = 0, hi = s->n_tensors;
    if (!name) return NULL;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, s->by_name[mid]->name);
        if (c == 0) return s->by_name[mid];
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

double kvl_store_hparam(const kvl_store *s, const char *key, int *found) {
    uint32_t lo = 0, hi = s->n_hparams;
    if (found) *found = 0;
    if (!key) return 0.0;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = strcmp(key, s->hparams[mid].key);
        if (c == 0) {
            if (found) *found = 1;
            return s->hparams[mid].value;
        }
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return 0.0;
}

const char *kvl_store_config_json(const kvl_store *s, size_t *len) {
    if (len) *len = s->config_len;
    return s->config_json;
}

/* A record of this store, by address (kvl_store_at / kvl_store_find return pointers into recs). */
static int record_index(const kvl_store *s, const kvl_tensor_rec *rec, uint32_t *out) {
    if (!rec || rec < s->recs || rec >= s->recs + s->n_tensors) return 0;
    *out = (uint32_t)(rec - s->recs);
    return 1;
}

int kvl_store_verified(kvl_store *s, const kvl_tensor_rec *rec) {
    uint32_t i;
    int v;
    if (!record_index(s, rec, &i)) return 0;
    kvl_os_mutex_lock(&s->flag_lock);
    v = s->verified[i];
    kvl_os_mutex_unlock(&s->flag_lock);
    return v;
}

void kvl_store_set_verified(kvl_store *s, const kvl_tensor_rec *rec) {
    uint32_t i;
    if (!record_index(s, rec, &i)) return;
    kvl_os_mutex_lock(&s->flag_lock);
    s->verified[i] = 1;
    kvl_os_mutex_unlock(&s->flag_lock);
}

void kvl_store_last_error(kvl_store *s, char *buf, size_t len) {
    if (!buf || len == 0) return;
    kvl_os_mutex_lock(&s->err_lock);
    snprintf(buf, len, "%s", s->last_error);
    kvl_os_mutex_unlock(&s->err_lock);
}

/* ------------------------------------------------------------------ reads */

/* code: a system error, 0 = unexpected end of file, -1 = caller passed an invalid range */
static void record_read_error(kvl_store *s, const char *what, uint64_t offset, uint64_t nbytes,
                              int code) {
    char sys[160];
    if (code > 0) kvl_os_strerror(code, sys, sizeof sys);
    else if (code == 0) snprintf(sys, sizeof sys, "unexpected end of file; was the file truncated?");
    else snprintf(sys, sizeof sys, "unaligned, out of range or null destination");
    kvl_os_mutex_lock(&s->err_lock);
    snprintf(s->last_error, sizeof s->last_error, "%s: %s of %llu bytes at offset %llu failed (%s)",
             s->bin_path, what, (unsigned long long)nbytes, (unsigned long long)offset, sys);
    kvl_os_mutex_unlock(&s->err_lock);
}

/* Reads exactly len bytes, looping over short reads (EINTR is handled in kvl_os_pread). */
static int read_fully(kvl_os_file f, unsigned char *dst, uint64_t len, uint64_t offset) {
    uint64_t done = 0;
    while (done < len) {
        size_t got = 0;
        uint64_t left = len - done;
        int rc = kvl_os_pread(f, dst + done, left > SIZE_MAX ? SIZE_MAX : (size_t)left,
                              offset + done, &got);
        if (rc != 0) return rc;
        if (got == 0) return -1; /* EOF: cannot happen for a validated store unless truncated since */
        done += got;
    }
    return 0;
}

kvl_status kvl_store_read(kvl_store *s, uint64_t offset, uint64_t nbytes, void *dst) {
    uint64_t len = align_up(nbytes, KVL_PAGE);
    int rc;
    if (!dst || offset % KVL_PAGE != 0 || ((uintptr_t)dst % KVL_PAGE) != 0 || offset > s->bin_size ||
        len > s->bin_size - offset) {
        record_read_error(s, "aligned read", offset, nbytes, -1);
        return KVL_ERR_INVALID_ARG;
    }
    if (len == 0) return KVL_OK;
    rc = read_fully(s->fd_bulk, (unsigned char *)dst, len, offset);
    if (rc != 0) {
        record_read_error(s, "read", offset, len, rc < 0 ? 0 : rc);
        return KVL_ERR_IO;
    }
    return KVL_OK;
}

kvl_status kvl_store_read_small(kvl_store *s, uint64_t offset, uint64_t nbytes, void *dst) {
    int rc;
    if (!dst || offset > s->bin_size || nbytes > s->bin_size - offset) {
        record_read_error(s, "small read", offset, nbytes, -1);
        return KVL_ERR_INVALID_ARG;
    }
    if (nbytes == 0) return KVL_OK;
    /* The buffered handle takes any alignment, so no bounce buffer (and no allocation) is needed;
     * small reads (an embedding row) leave only a few pages in the page cache. */
    rc = read_fully(s->fd_buffered, (unsigned char *)dst, nbytes, offset);
    if (rc != 0) {
        record_read_error(s, "read", offset, nbytes, rc < 0 ? 0 : rc);
        return KVL_ERR_IO;
    }
    return KVL_OK;
}
