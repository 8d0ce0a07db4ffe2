/* fuzz_store_libfuzzer.c — optional coverage-guided (libFuzzer) entry point for the index parser.
 *
 * Owns: LLVMFuzzerTestOneInput, which treats the input as an .idx image, recomputes its CRC (so
 * the fuzzer is not stuck behind the CRC check), writes it and a zero-filled .bin of the size the
 * header claims (capped at 1 MiB, else one page), opens the pair with kvl_store_open and, if it
 * opens, reads every record; crashes, leaks and out-of-bounds accesses are the sanitizers' to find.
 * Does not own: the deterministic fuzzer that ctest runs (test_store_fuzz.c).
 *
 * Not built by default: the name does not start with test_, so wasm-core/CMakeLists.txt's
 * tests/test_*.c glob ignores it. Build by hand with clang, e.g. from the repository root:
 *   clang -g -O1 -std=c11 -D_GNU_SOURCE -D_FILE_OFFSET_BITS=64 -fsanitize=fuzzer,address,undefined \
 *     -Inative/include -Inative/src wasm-core/tests/fuzz_store_libfuzzer.c wasm-core/src/store.c \
 *     -o /tmp/fuzz_store -lpthread
 *   /tmp/fuzz_store -max_len=8192 -max_total_time=60 [corpus_dir]
 * A valid seed corpus: any pack's trunk.idx / experts.idx (e.g. from `kvl synth` + `kvl pack`).
 * Without libFuzzer, -DKVL_FUZZ_STANDALONE_MAIN adds a main() that runs the given files once each.
 */
/* _GNU_SOURCE and _FILE_OFFSET_BITS=64: pass them on the command line as above. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"

#ifdef _WIN32
#include <process.h>
#define fuzz_getpid _getpid
#else
#include <unistd.h>
#define fuzz_getpid getpid
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int write_bytes(const char *path, const unsigned char *p, size_t n) {
    FILE *f;
    remove(path);
    f = fopen(path, "wb");
    if (!f) return -1;
    if (n && fwrite(p, 1, n, f) != n) {
        fclose(f);
        return -1;
    }
    return fclose(f);
}

static char idx_path[256], bin_path[256];

static void remove_temp_files(void) {
    remove(idx_path);
    remove(bin_path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    unsigned char *idx, *bin;
    uint64_t bin_size = 4096;
    kvl_store *s = NULL;
    char err[512];
    if (!idx_path[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(idx_path, sizeof idx_path, "%s/kvl-fuzz-%d.idx", tmp ? tmp : "/tmp", (int)fuzz_getpid());
        snprintf(bin_path, sizeof bin_path, "%s/kvl-fuzz-%d.bin", tmp ? tmp : "/tmp", (int)fuzz_getpid());
        atexit(remove_temp_files);
    }
    idx = (unsigned char *)malloc(size ? size : 1);
    if (!idx) return 0;
    if (size) memcpy(idx, data, size);
    if (size >= 40) { /* CRC-32 of the image with the CRC field zeroed, stored little-endian */
        uint32_t crc;
        memset(idx + 36, 0, 4);
        crc = kvl_crc32(0, idx, size);
        idx[36] = (unsigned char)crc;
        idx[37] = (unsigned char)(crc >> 8);
        idx[38] = (unsigned char)(crc >> 16);
        idx[39] = (unsigned char)(crc >> 24);
    }
    if (size >= 24) {
        uint64_t claimed = 0;
        int k;
        for (k = 7; k >= 0; k--) claimed = (claimed << 8) | idx[16 + k];
        if (claimed <= (1u << 20)) bin_size = claimed;
    }
    bin = (unsigned char *)calloc(bin_size ? (size_t)bin_size : 1, 1);
    if (bin && write_bytes(idx_path, idx, size) == 0 && write_bytes(bin_path, bin, (size_t)bin_size) == 0 &&
        kvl_store_open(idx_path, bin_path, 0, KVL_IO_BUFFERED, &s, err, sizeof err) == KVL_OK) {
        uint32_t i, n = kvl_store_count(s);
        for (i = 0; i < n; i++) {
            const kvl_tensor_rec *r = kvl_store_at(s, i);
            void *dst = kvl_aligned_alloc(KVL_PAGE, (size_t)((r->nbytes + KVL_PAGE - 1) / KVL_PAGE * KVL_PAGE + KVL_PAGE));
            /* a record the parser accepted must read back; anything else is a parser bug */
            if (dst && kvl_store_read(s, r->offset, r->nbytes, dst) != KVL_OK) abort();
            if (kvl_store_find(s, r->name) != r) abort();
            kvl_aligned_free(dst);
        }
        kvl_store_close(s);
    } else if (s) {
        abort(); /* a failed open must leave out == NULL */
    }
    free(bin);
    free(idx);
    return 0;
}

#ifdef KVL_FUZZ_STANDALONE_MAIN
/* Replays inputs without libFuzzer (e.g. a crash file found elsewhere). */
int main(int argc, char **argv) {
    int i;
    for (i = 1; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        unsigned char *p;
        long n;
        if (!f) continue;
        fseek(f, 0, SEEK_END);
        n = ftell(f);
        fseek(f, 0, SEEK_SET);
        p = (unsigned char *)malloc(n > 0 ? (size_t)n : 1);
        if (p && (n <= 0 || fread(p, 1, (size_t)n, f) == (size_t)n)) LLVMFuzzerTestOneInput(p, n > 0 ? (size_t)n : 0);
        free(p);
        fclose(f);
        printf("%s: ok\n", argv[i]);
    }
    return 0;
}
#endif
