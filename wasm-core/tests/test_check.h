/* test_check.h — the C tests' shared check: CHECK(cond, fmt, ...) counts a check, and on a
 * failure prints the file, line and message and counts the failure; each test prints its
 * `NAME: N passed, N failed` summary from `checks` and `failures`.
 * Single-threaded tests only: test_expert_cache (checks from two threads) and test_store_fuzz
 * (the iteration in each message) keep their own.
 */
#ifndef KVL_TEST_CHECK_H
#define KVL_TEST_CHECK_H

#include <stdio.h>

static int checks = 0, failures = 0;

#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        checks++;                                                                             \
        if (!(cond)) {                                                                        \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                       \
            printf(__VA_ARGS__);                                                              \
            printf("\n");                                                                     \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

#endif
