/* test_bytes.h — little-endian byte helpers and a bitwise CRC-32 for the C tests.
 *
 * Owns: the tests' own writer side of docs/FORMAT.md (put/get of LE integers, CRC-32 as zlib
 * computes it), written independently of store.c so a shared bug cannot hide itself.
 */
#ifndef KVL_TEST_BYTES_H
#define KVL_TEST_BYTES_H

#include <stddef.h>
#include <stdint.h>

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

#endif
