/* test_packing.c — checks packing.c: kvl_synth_uniform against values numpy's PCG64 generator
 * gave (kvl/synth.py's generator, numpy 2.4.6: the seed words are SeedSequence(h).generate_state(
 * 4, uint64) for the stream of (seed 3, "x.weight") and (seed 3, "y.weight")), a stream split over
 * calls, kvl_pack_expert against hand-computed extents (scales, half-to-even rounding,
 * clipping, zero rows, padding, non-finite weights refused), and kvl_pack_expert_q4 against
 * hand-computed groups (ties, all-zero groups and the sign of their scale, a negative maximum,
 * quotients at .5, subnormal weights and scales rounding to BF16 at a tie) and against FORMAT.md's
 * group rule written out in double on irregular BF16 input.
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

/* the FP32 value of BF16 bits */
static float kvl_test_bf16_value(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

/* ---- Q4_EXPERT (docs/FORMAT.md) ---------------------------------------------------------- */

/* I = 32, H = 64: gate and up are 32 rows of 2 groups, down 64 rows of 1 group. FORMAT.md's
 * offsets: each q block I*H/2 = 1024 bytes, each scale block 2*(I*H/32) = 128 bytes. */
enum { Q4_I = 32, Q4_H = 64, Q4_UP_Q = 1024, Q4_DOWN_Q = 2048, Q4_GATE_S = 3072, Q4_UP_S = 3200,
       Q4_DOWN_S = 3328, Q4_BYTES = 3456 };

/* BF16 bits of k * 2^-133 (k < 128): the subnormal BF16 weights */
static uint16_t sub_bf16(int k, int negative) { return (uint16_t)((negative ? 0x8000u : 0u) | (unsigned)k); }

static unsigned le16(const uint8_t *p) { return (unsigned)p[0] | ((unsigned)p[1] << 8); }

/* FORMAT.md's rule for one group, in double (exact here: BF16 / BF16 quotients are never within
 * FP32 rounding of a .5 they do not equal) and with BF16 rounding written out on the FP32 bits:
 * the scale bits and the 32 q values */
static unsigned q4_group_ref(const uint16_t *x, int q[32]) {
    int first = 0;
    for (int c = 1; c < 32; c++)
        if (fabs((double)kvl_test_bf16_value(x[c])) > fabs((double)kvl_test_bf16_value(x[first]))) first = c;
    float d32 = (float)((double)kvl_test_bf16_value(x[first]) / -8.0);
    uint32_t bits;
    memcpy(&bits, &d32, 4);
    uint32_t low = bits & 0xFFFFu, bf = bits >> 16;
    if (low > 0x8000u || (low == 0x8000u && (bf & 1u))) bf++;
    double ds = (double)kvl_test_bf16_value((uint16_t)bf);
    for (int c = 0; c < 32; c++) {
        double v = ds == 0.0 ? 0.0 : (double)kvl_test_bf16_value(x[c]) / ds;
        double r = floor(v + 0.5);
        if (r - v == 0.5 && fmod(r, 2.0) != 0.0) r -= 1.0; /* a tie goes to the even one */
        q[c] = r > 7.0 ? 7 : r < -8.0 ? -8 : (int)r;
    }
    return (unsigned)bf;
}

/* rows x cols of BF16 bits at w, against the extent's q bytes at q and scale bits at sc */
static int q4_matrix_matches(const uint16_t *w, int rows, int cols, const uint8_t *q, const uint8_t *sc) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < cols / 32; g++) {
            int v[32];
            unsigned d = q4_group_ref(w + r * cols + 32 * g, v);
            if (le16(sc + 2 * (r * (cols / 32) + g)) != d) return 0;
            for (int j = 0; j < 16; j++)
                if (q[r * (cols / 2) + 16 * g + j] != (uint8_t)((v[j] + 8) | ((v[j + 16] + 8) << 4))) return 0;
        }
    return 1;
}

static void test_pack_expert_q4(void) {
    static uint16_t g[Q4_I * Q4_H], u[Q4_I * Q4_H], d[Q4_H * Q4_I];
    static uint8_t out[Q4_BYTES];
    memset(g, 0, sizeof g);
    /* row 0, group 0: max 8 tied with -8 (the first wins: d = -1, bits 0xBF80); 0.5 -> -0.5 -> 0,
     * 1.5 -> -2, 2.5 -> -2 (half to even); -8 -> 8 -> clamped to 7 */
    const float a[8] = {8.0f, 4.0f, -4.0f, 1.0f, 0.5f, 1.5f, 2.5f, -8.0f};
    for (int c = 0; c < 8; c++) g[c] = bf16_of(a[c]);
    g[16] = bf16_of(3.0f);
    /* row 0, group 1: negative max -16 tied with 16 (the first wins: d = 2, bits 0x4000);
     * 0.5, 1.5, -2.5, 3.5 after the division */
    g[32 + 0] = bf16_of(1.0f);
    g[32 + 1] = bf16_of(3.0f);
    g[32 + 2] = bf16_of(-5.0f);
    g[32 + 3] = bf16_of(7.0f);
    g[32 + 5] = bf16_of(-16.0f);
    g[32 + 9] = bf16_of(16.0f);
    g[32 + 20] = bf16_of(6.0f);
    /* row 1: group 0 all +0 (m = +0: d = -0, bits 0x8000), group 1 all -0 (d = +0) */
    for (int c = 32; c < 64; c++) g[Q4_H + c] = 0x8000;
    /* row 2, group 0: subnormal weights, m = 5 * 2^-133: m / -8 rounds up to -2^-133 (0x8001) */
    g[2 * Q4_H + 0] = sub_bf16(5, 0);
    g[2 * Q4_H + 1] = sub_bf16(1, 0);
    g[2 * Q4_H + 2] = sub_bf16(3, 1);
    /* row 2, group 1: m = 4 * 2^-133: m / -8 is half of the smallest BF16, a tie that goes to
     * the even -0: every q 0 */
    g[2 * Q4_H + 32] = sub_bf16(4, 0);
    g[2 * Q4_H + 33] = sub_bf16(3, 1);
    /* row 3, group 0: m = 12 * 2^-133: -1.5 * 2^-133, a tie that goes to the even -2 * 2^-133 */
    g[3 * Q4_H + 0] = sub_bf16(12, 0);
    g[3 * Q4_H + 1] = sub_bf16(1, 0);
    g[3 * Q4_H + 2] = sub_bf16(3, 0);
    g[3 * Q4_H + 3] = sub_bf16(5, 1);
    /* row 3, group 1: m = -3: d = 0.375 (0x3EC0), quotients 0.5, 1.5, 7.5, -2.5, -8 */
    g[3 * Q4_H + 32] = bf16_of(0.1875f);
    g[3 * Q4_H + 33] = bf16_of(0.5625f);
    g[3 * Q4_H + 34] = bf16_of(-0.9375f);
    g[3 * Q4_H + 48] = bf16_of(-3.0f);
    g[3 * Q4_H + 49] = bf16_of(2.8125f);
    /* up and down: BF16 bits of every finite exponent, subnormals and zeros included */
    uint32_t lcg = 12345u;
    for (int i = 0; i < Q4_I * Q4_H; i++) {
        uint16_t b[2];
        for (int k = 0; k < 2; k++) {
            lcg = lcg * 1664525u + 1013904223u;
            b[k] = (uint16_t)(lcg >> 16);
            if ((b[k] & 0x7F80u) == 0x7F80u) b[k] &= 0xBFFFu; /* not Inf or NaN */
        }
        u[i] = b[0];
        /* down: one exponent range per row, so groups mostly share a magnitude */
        d[i] = (uint16_t)((b[1] & 0x807Fu) | ((unsigned)(100 + (i / Q4_I) % 60) << 7));
    }

    CHECK(kvl_expert_q4_extent_bytes(Q4_I, Q4_H) == Q4_BYTES, "q4 extent bytes %zu, want %d",
          kvl_expert_q4_extent_bytes(Q4_I, Q4_H), Q4_BYTES);
    /* I = 64, H = 32: FORMAT.md gives 1024-byte q and 128-byte scale blocks, 3456 in all; I = 32,
     * H = 96: 1536 and 192, 5184 */
    CHECK(kvl_expert_q4_extent_bytes(64, 32) == 3456 && kvl_expert_q4_extent_bytes(32, 96) == 5184,
          "q4 extent bytes of other shapes");
    CHECK(kvl_expert_q4_extent_bytes(48, 64) == 0 && kvl_expert_q4_extent_bytes(32, 0) == 0,
          "q4 extent bytes of a shape that is not whole groups");
    memset(out, 0xAA, sizeof out);
    CHECK(kvl_pack_expert_q4(g, u, d, Q4_I, Q4_H, out, sizeof out) == KVL_OK, "pack_expert_q4 failed");

    const uint8_t want_r0g0[16] = {0x50, 0x84, 0x8C, 0x87, 0x88, 0x86, 0x86, 0x8F,
                                   0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88};
    const uint8_t want_r0g1[16] = {0x88, 0x8A, 0x86, 0x8C, 0xB8, 0x80, 0x88, 0x88,
                                   0x88, 0x8F, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88};
    const uint8_t want_r2g0[16] = {0x83, 0x87, 0x8B, 0x88, 0x88, 0x88, 0x88, 0x88,
                                   0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88};
    const uint8_t want_r3g0[16] = {0x82, 0x88, 0x86, 0x8A, 0x88, 0x88, 0x88, 0x88,
                                   0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88};
    const uint8_t want_r3g1[16] = {0x08, 0xFA, 0x86, 0x88, 0x88, 0x88, 0x88, 0x88,
                                   0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88};
    CHECK(memcmp(out + 0, want_r0g0, 16) == 0, "row 0 group 0: ties, halves, clamp");
    CHECK(memcmp(out + 16, want_r0g1, 16) == 0, "row 0 group 1: negative max");
    CHECK(memcmp(out + 64, want_r2g0, 16) == 0, "row 2 group 0: subnormal weights");
    CHECK(memcmp(out + 96, want_r3g0, 16) == 0, "row 3 group 0: subnormal scale tie");
    CHECK(memcmp(out + 112, want_r3g1, 16) == 0, "row 3 group 1: quotients at .5");
    int zero_groups = 1;
    for (int i = 32; i < 64; i++) zero_groups &= out[i] == 0x88;  /* row 1 */
    for (int i = 80; i < 96; i++) zero_groups &= out[i] == 0x88;  /* row 2 group 1 */
    for (int i = 128; i < Q4_UP_Q; i++) zero_groups &= out[i] == 0x88; /* rows 4.. all zero */
    CHECK(zero_groups, "all-zero groups hold q = 0 (0x88 bytes)");
    const uint8_t *gs = out + Q4_GATE_S;
    CHECK(le16(gs + 0) == 0xBF80 && le16(gs + 2) == 0x4000, "row 0 scales %#x %#x", le16(gs), le16(gs + 2));
    CHECK(le16(gs + 4) == 0x8000 && le16(gs + 6) == 0x0000, "row 1 scales %#x %#x (the sign of zero)",
          le16(gs + 4), le16(gs + 6));
    CHECK(le16(gs + 8) == 0x8001 && le16(gs + 10) == 0x8000, "row 2 scales %#x %#x", le16(gs + 8), le16(gs + 10));
    CHECK(le16(gs + 12) == 0x8002 && le16(gs + 14) == 0x3EC0, "row 3 scales %#x %#x", le16(gs + 12), le16(gs + 14));
    CHECK(le16(gs + 16) == 0x8000, "row 4 (all +0) scale %#x", le16(gs + 16));
    CHECK(q4_matrix_matches(g, Q4_I, Q4_H, out, out + Q4_GATE_S), "gate against the group rule");
    CHECK(q4_matrix_matches(u, Q4_I, Q4_H, out + Q4_UP_Q, out + Q4_UP_S), "up against the group rule");
    CHECK(q4_matrix_matches(d, Q4_H, Q4_I, out + Q4_DOWN_Q, out + Q4_DOWN_S), "down against the group rule");

    CHECK(kvl_pack_expert_q4(g, u, d, Q4_I, Q4_H, out, sizeof out - 1) == KVL_ERR_INVALID_ARG,
          "wrong out size accepted");
    CHECK(kvl_pack_expert_q4(g, u, d, 48, Q4_H, out, sizeof out) == KVL_ERR_INVALID_ARG,
          "I not a multiple of 32 accepted");
    CHECK(kvl_pack_expert_q4(g, u, d, Q4_I, 80, out, sizeof out) == KVL_ERR_INVALID_ARG,
          "H not a multiple of 32 accepted");
    d[700] = 0x7FC0; /* NaN */
    CHECK(kvl_pack_expert_q4(g, u, d, Q4_I, Q4_H, out, sizeof out) == KVL_ERR_FORMAT, "NaN weight accepted");
    d[700] = 0xFF80; /* -Inf */
    CHECK(kvl_pack_expert_q4(g, u, d, Q4_I, Q4_H, out, sizeof out) == KVL_ERR_FORMAT, "-Inf weight accepted");
}

int main(void) {
    test_synth();
    test_pack_expert();
    test_pack_expert_q4();
    printf("test_packing: %d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
