/* crc32.h — fast zlib-compatible CRC-32 (polynomial 0xEDB88320), for checking pack data as it is
 * first read (docs/FORMAT.md "Checks at run time").
 *
 * Owns: slicing-by-16 CRC-32 in portable C (every backend), the PCLMULQDQ folding CRC-32 on
 * x86-64 (chosen at run time, like the kernel sets), the host's CRC-32 in WebAssembly builds,
 * kvl_crc32_combine (the CRC of A||B from the CRCs of A and B, so pieces read by different
 * threads are checked as one tensor).
 * Does not own: the reference kvl_crc32 (store.c, a half-byte table: the tests hold these
 * against it) or what is verified when (expert_cache.c, trunk.c, engine_errors.c).
 *
 * Every function has zlib's convention: start with crc = 0, chain by passing the previous
 * result. All are thread-safe and allocate nothing.
 */
#ifndef KVL_CRC32_H
#define KVL_CRC32_H

#include <stddef.h>
#include <stdint.h>

/* The fastest implementation here: PCLMULQDQ on x86-64 where the CPU has it, in WebAssembly the
 * host's (Node's zlib.crc32), else slicing-by-16. KVL_CRC=portable in the (native) environment
 * forces slicing-by-16 (measurements). */
uint32_t kvl_crc32_fast(uint32_t crc, const void *data, size_t len);
/* "pclmul", "node-zlib" or "slice16": what kvl_crc32_fast runs. */
const char *kvl_crc32_fast_name(void);
/* Slicing-by-16, any CPU. */
uint32_t kvl_crc32_portable(uint32_t crc, const void *data, size_t len);
/* 1 if kvl_crc32_clmul can run here (x86-64 with PCLMULQDQ); kvl_crc32_clmul must not be called
 * otherwise (on other targets it is kvl_crc32_portable). */
int kvl_crc32_clmul_supported(void);
uint32_t kvl_crc32_clmul(uint32_t crc, const void *data, size_t len);
/* 1 in a WebAssembly build whose host (Node) has zlib.crc32; kvl_crc32_host is slicing-by-16
 * where it has not. */
int kvl_crc32_host_supported(void);
uint32_t kvl_crc32_host(uint32_t crc, const void *data, size_t len);
/* CRC-32 of A||B from crc_a = CRC-32(A), crc_b = CRC-32(B) and len_b = |B| (zlib's
 * crc32_combine): O(log len_b), no tables. */
uint32_t kvl_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

#endif
