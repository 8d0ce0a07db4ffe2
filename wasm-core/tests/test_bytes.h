/* test_bytes.h — the C tests' own writer side of docs/FORMAT.md.
 *
 * Owns: put/get of little-endian integers, CRC-32 as zlib computes it, the index layout (header,
 * hyperparameter entries, tensor records, config, header CRC), the Q8 and Q4 extent sizes, and writing a
 * file; all written independently of store.c so a shared bug cannot hide itself.
 */
#ifndef KVL_TEST_BYTES_H
#define KVL_TEST_BYTES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static inline uint32_t ref_crc32(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return c ^ 0xFFFFFFFFu;
}

static inline void put32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static inline void put64(unsigned char *p, uint64_t v) {
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

static inline uint32_t get32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t get64(const unsigned char *p) {
    return (uint64_t)get32(p) | ((uint64_t)get32(p + 4) << 32);
}

static inline uint64_t a64(uint64_t x) { return (x + 63) / 64 * 64; }
static inline uint64_t a4k(uint64_t x) { return (x + 4095) / 4096 * 4096; }

/* FORMAT.md extent size of a (layer, expert) Q8 record, step by step. */
static inline uint64_t q8_nbytes(uint64_t I, uint64_t H) {
    uint64_t up = a64(I * H), down = a64(up + I * H), gs = a64(down + H * I);
    uint64_t us = a64(gs + 4 * I), ds = a64(us + 4 * I);
    return ds + 4 * H;
}

/* FORMAT.md extent size of a (layer, expert) Q4_EXPERT record (I, H multiples of 32), step by
 * step: q bytes two columns a byte, one 2-byte BF16 scale per group of 32. */
static inline uint64_t q4_nbytes(uint64_t I, uint64_t H) {
    uint64_t up = a64(I * H / 2), down = a64(up + I * H / 2), gs = a64(down + H * I / 2);
    uint64_t us = a64(gs + 2 * (I * H / 32)), ds = a64(us + 2 * (I * H / 32));
    return ds + 2 * (H * I / 32);
}

/* ---- index layout: 128-byte header, 64-byte hparam entries, 192-byte records, config JSON */

static inline size_t idx_len_for(size_t n_hp, size_t n_records, size_t config_len) {
    return 128 + 64 * n_hp + 192 * n_records + config_len;
}

/* revision may be NULL (left zero). The header CRC is set last, by idx_seal. */
static inline void idx_put_header(unsigned char *idx, uint32_t kind, uint64_t data_bytes,
                                  uint32_t n_hp, uint32_t n_records, uint32_t config_len,
                                  const char *revision) {
    memcpy(idx, "KVLIDX01", 8);
    put32(idx + 8, 1);
    put32(idx + 12, kind);
    put64(idx + 16, data_bytes);
    put32(idx + 24, n_hp);
    put32(idx + 28, n_records);
    put32(idx + 32, config_len);
    if (revision) memcpy(idx + 40, revision, 40);
}

static inline void idx_put_hparam(unsigned char *entry, const char *key, double value) {
    uint64_t bits;
    memcpy(&bits, &value, 8);
    memcpy(entry, key, strlen(key));
    put64(entry + 56, bits);
}

static inline void idx_put_record(unsigned char *rec, const char *name, uint32_t dtype,
                                  uint32_t ndim, const uint64_t shape[4], uint64_t offset,
                                  uint64_t nbytes, uint32_t data_crc) {
    memcpy(rec, name, strlen(name));
    put32(rec + 128, dtype);
    put32(rec + 132, ndim);
    for (int d = 0; d < 4; d++) put64(rec + 136 + 8 * d, shape[d]);
    put64(rec + 168, offset);
    put64(rec + 176, nbytes);
    put32(rec + 184, data_crc);
}

/* The header CRC: over the whole index with the CRC field zero (no-op below 40 bytes). */
static inline void idx_seal(unsigned char *idx, size_t len) {
    if (len < 40) return;
    put32(idx + 36, 0);
    put32(idx + 36, ref_crc32(idx, len));
}

/* Truncates an existing file in place (same inode: test_store.c relies on that). */
static inline int write_file(const char *path, const unsigned char *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    if (len && fwrite(data, 1, len, f) != len) {
        fclose(f);
        return -1;
    }
    return fclose(f) == 0 ? 0 : -1;
}

#endif
