/* test_packing.c — checks packing.c: kvl_synth_uniform against values numpy's PCG64 generator
 * gave (kvl/synth.py's generator, numpy 2.4.6: the seed words are SeedSequence(h).generate_state(
 * 4, uint64) for the stream of (seed 3, "x.weight") and (seed 3, "y.weight")), a stream split over
 * calls, and kvl_pack_expert against hand-computed extents (scales, half-to-even rounding,
 * clipping, zero rows, padding, non-finite weights refused).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvl_core.h"
#include "test_check.h"


static const uint64_t X_SEED[4] = {0xdc7d45ea24d5dd35ull, 0x42353277b21d9dd9ull,
                                   0x85bc65cbc75ec34eull, 0x08b9b78b2c27b7f3ull};
static const uint64_t Y_SEED[4] = {0xa4ad87beadeca322ull, 0xdd1c17f11a19cc41ull,
                                   0x94a372b0ab69ddd7ull, 0x2b9d6010038b9603ull};

static uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* exact for the values used here */
}

static void test_synth(void) {
    /* numpy: _uniform_fill(uint16[7], 3, "x.weight", 0.0, 0.05) */
    const uint16_t want_x[7] = {0xbda8, 0x3d7d, 0xbcef, 0x3972, 0x3d57, 0xbd98, 0xbcfb};
    /* numpy: _uniform_fill(float32[5], 3, "y.weight", 1.0, 0.05), as bits */
    const uint32_t want_y[5] = {0x3f856a4a, 0x3f70dc8d, 0x3f899513, 0x3f824192, 0x3f72502e};
    const float half = 0.08660254f; /* float32(0.05 * sqrt(3)) */
    kvl_pcg64 rng;
    uint16_t x[7];
    kvl_pcg64_seed(&rng, X_SEED);
    kvl_synth_uniform(&rng, 7, 0.0f, half, 1, x);
    for (int i = 0; i < 7; i++) CHECK(x[i] == want_x[i], "x[%d] = %#x, numpy gave %#x", i, x[i], want_x[i]);

    uint16_t split[7];
    kvl_pcg64_seed(&rng, X_SEED);
    kvl_synth_uniform(&rng, 4, 0.0f, half, 1, split);
    kvl_synth_uniform(&rng, 3, 0.0f, half, 1, split + 4);
    CHECK(memcmp(split, x, sizeof x) == 0, "a stream cut into 4 + 3 differs from one call");

    float y[5];
    kvl_pcg64_seed(&rng, Y_SEED);
    kvl_synth_uniform(&rng, 5, 1.0f, half, 0, y);
    for (int i = 0; i < 5; i++) {
        uint32_t bits;
        memcpy(&bits, &y[i], 4);
        CHECK(bits == want_y[i], "y[%d] bits %#x, numpy gave %#x", i, (unsigned)bits, (unsigned)want_y[i]);
    }
}

static void test_pack_expert(void) {
    enum { I = 2, H = 3 };
    /* gate rows: max 127 -> scale 1: 2.5 -> 2 and 3.5 -> 4 (half to even), -2.5 -> -2;
     * second row all zero -> scale 0, q 0 */
    const float gate[I * H] = {127.0f, 2.5f, -2.5f, 0.0f, 0.0f, 0.0f};
    /* up: max 254 -> scale 2: 3.5/2 = 1.75 -> 2; -254 -> -127; 5/2 = 2.5 -> 2 */
    const float up[I * H] = {3.5f, -254.0f, 5.0f, 0.5f, 1.0f, -1.0f};
    /* down [H, I] */
    const float down[H * I] = {1.0f, -1.0f, 0.0f, 63.5f, 12.0f, 3.0f};
    uint16_t g[I * H], u[I * H], d[H * I];
    for (int i = 0; i < I * H; i++) {
        g[i] = bf16_of(gate[i]);
        u[i] = bf16_of(up[i]);
        d[i] = bf16_of(down[i]);
    }
    size_t n = kvl_expert_extent_bytes(I, H);
    /* docs/FORMAT.md: gate_q 0, up_q 64, down_q 128, gate_s 192, up_s 256, down_s 320, + 4*H */
    CHECK(n == 332, "extent bytes %zu, want 332", n);
    uint8_t out[332];
    memset(out, 0xAA, sizeof out);
    CHECK(kvl_pack_expert(g, u, d, I, H, out, sizeof out) == KVL_OK, "pack_expert failed");
    const int8_t want_gq[6] = {127, 2, -2, 0, 0, 0};
    const int8_t want_uq[6] = {2, -127, 2, 64, 127, -127}; /* row 2: max 1 -> scale 1/127 */
    CHECK(memcmp(out, want_gq, 6) == 0, "gate q");
    CHECK(memcmp(out + 64, want_uq, 6) == 0, "up q: %d %d %d %d %d %d", (int8_t)out[64], (int8_t)out[65],
          (int8_t)out[66], (int8_t)out[67], (int8_t)out[68], (int8_t)out[69]);
    float s[2];
    memcpy(s, out + 192, 8);
    CHECK(s[0] == 1.0f && s[1] == 0.0f, "gate scales %g %g", s[0], s[1]);
    memcpy(s, out + 256, 8);
    CHECK(s[0] == 2.0f && s[1] == 1.0f / 127.0f, "up scales %g %g", s[0], s[1]);
    float ds[3];
    memcpy(ds, out + 320, 12);
    CHECK(ds[0] == 1.0f / 127.0f && ds[1] == 63.5f / 127.0f && ds[2] == 12.0f / 127.0f, "down scales");
    /* down row 1: 63.5 / 0.5 = 127, 0 */
    CHECK((int8_t)out[128 + 2] == 0 && (int8_t)out[128 + 3] == 127, "down q row 1");
    int pad_zero = 1;
    for (size_t i = 6; i < 64; i++) pad_zero &= out[i] == 0;
    for (size_t i = 200; i < 256; i++) pad_zero &= out[i] == 0;
    CHECK(pad_zero, "padding between sub-blocks is not zero");

    CHECK(kvl_pack_expert(g, u, d, I, H, out, sizeof out - 1) == KVL_ERR_INVALID_ARG, "wrong out size accepted");
    u[3] = 0x7FC0; /* NaN */
    CHECK(kvl_pack_expert(g, u, d, I, H, out, sizeof out) == KVL_ERR_FORMAT, "NaN weight accepted");
    u[3] = 0xFF80; /* -Inf */
    CHECK(kvl_pack_expert(g, u, d, I, H, out, sizeof out) == KVL_ERR_FORMAT, "-Inf weight accepted");
}

int main(void) {
    test_synth();
    test_pack_expert();
    printf("test_packing: %d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
