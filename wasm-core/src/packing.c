/* packing.c — the packer's arithmetic (kvl_core.h, "Packing"): the Q8_EXPERT and Q4_EXPERT extent
 * and Q8_ROWS matrix writers and the synthetic-weight generator.
 *
 * Owns: row-wise Q8 and group-wise Q4 quantisation of BF16 weights into the extent and matrix
 * layouts that store.c describes (kvl_q8_layout_of, kvl_q4_layout_of, kvl_q8_rows_layout_of),
 * and numpy's PCG64 stream for `kvl synth`.
 * Does not own: the layouts themselves (store.c), file formats or any I/O (the TypeScript
 * packer).
 *
 * Both must give the same bytes on every compiler and backend: only IEEE single-precision
 * operations that C evaluates exactly as written (divisions, comparisons and nearbyintf in the
 * quantisers; one subtraction, one multiplication, one addition in the generator: no
 * contraction is possible), and integer arithmetic; BF16 rounding on the bits.
 */
#include <math.h>
#include <string.h>

#include "kvl_core.h"
#include "store.h"

size_t kvl_expert_extent_bytes(size_t intermediate, size_t hidden) {
    kvl_q8_layout layout;
    kvl_q8_layout_of(intermediate, hidden, &layout);
    return (size_t)layout.nbytes;
}

static float bf16_to_f32(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* FP32 bits -> BF16 bits, round to nearest even (finite values) */
static uint16_t f32_bits_to_bf16(uint32_t bits) {
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* One matrix [rows, cols] of BF16 bits -> int8 rows + FP32 scales. 0, or -1 on a non-finite weight. */
static int quantize_rows_q8(const uint16_t *w, size_t rows, size_t cols, int8_t *q, float *scale) {
    for (size_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * cols;
        float amax = 0.0f;
        for (size_t c = 0; c < cols; c++) {
            if ((row[c] & 0x7F80u) == 0x7F80u) return -1; /* exponent all ones: Inf or NaN */
            float a = fabsf(bf16_to_f32(row[c]));
            if (a > amax) amax = a;
        }
        float s = amax / 127.0f;
        scale[r] = s;
        int8_t *qr = q + r * cols;
        if (s == 0.0f) {
            memset(qr, 0, cols);
            continue;
        }
        for (size_t c = 0; c < cols; c++) {
            float v = nearbyintf(bf16_to_f32(row[c]) / s); /* default rounding: half to even */
            if (v > 127.0f) v = 127.0f;
            if (v < -127.0f) v = -127.0f;
            qr[c] = (int8_t)v;
        }
    }
    return 0;
}

kvl_status kvl_pack_expert(const uint16_t *gate, const uint16_t *up, const uint16_t *down,
                           size_t intermediate, size_t hidden, uint8_t *out, size_t out_bytes) {
    if (!gate || !up || !down || !out || intermediate == 0 || hidden == 0) return KVL_ERR_INVALID_ARG;
    kvl_q8_layout l;
    kvl_q8_layout_of(intermediate, hidden, &l);
    if (out_bytes != l.nbytes) return KVL_ERR_INVALID_ARG;
    memset(out, 0, out_bytes);
    const size_t I = intermediate, H = hidden;
    if (quantize_rows_q8(gate, I, H, (int8_t *)(out + l.gate_q), (float *)(void *)(out + l.gate_s)) ||
        quantize_rows_q8(up, I, H, (int8_t *)(out + l.up_q), (float *)(void *)(out + l.up_s)) ||
        quantize_rows_q8(down, H, I, (int8_t *)(out + l.down_q), (float *)(void *)(out + l.down_s)))
        return KVL_ERR_FORMAT;
    return KVL_OK;
}

kvl_status kvl_pack_q8_rows(const uint16_t *w, size_t rows, size_t cols, uint8_t *out,
                           size_t out_bytes) {
    if (!w || !out || rows == 0 || cols == 0) return KVL_ERR_INVALID_ARG;
    kvl_q8_rows_layout l;
    kvl_q8_rows_layout_of(rows, cols, &l);
    if (out_bytes != l.nbytes) return KVL_ERR_INVALID_ARG;
    memset(out, 0, out_bytes);
    /* the experts' row quantisation, so one definition of Q8 exists */
    if (quantize_rows_q8(w, rows, cols, (int8_t *)out, (float *)(void *)(out + l.scale)))
        return KVL_ERR_FORMAT;
    return KVL_OK;
}

/* ---- Q4_EXPERT (docs/FORMAT.md): groups of 32 columns, one BF16 scale each ------------------- */

#define Q4_GROUP 32u

size_t kvl_expert_q4_extent_bytes(size_t intermediate, size_t hidden) {
    kvl_q4_layout layout;
    kvl_q4_layout_of(intermediate, hidden, &layout);
    return (size_t)layout.nbytes;
}

/* One matrix [rows, cols] (cols % 32 == 0) of BF16 bits -> q bytes [rows, cols/2] and BF16 scale
 * bits [rows, cols/32], stored little-endian byte by byte (the offsets are 64-aligned within the
 * extent, but the caller's buffer need not be). Per group: m = the weight of largest |w|, the
 * first in column order on a tie (so an all-zero group takes its first weight, +0 or -0);
 * d = BF16(m / -8) (one FP32 division, then nearest-even to BF16); q = clamp(rint(w / ds), -8, 7)
 * with ds = d's value (one FP32 division; rint in the default mode, half to even), all 0 when
 * ds == 0. 0, or -1 on a non-finite weight. */
static int quantize_groups_q4(const uint16_t *w, size_t rows, size_t cols, uint8_t *q, uint8_t *scale) {
    const size_t groups = cols / Q4_GROUP;
    for (size_t r = 0; r < rows; r++) {
        for (size_t g = 0; g < groups; g++) {
            const uint16_t *x = w + r * cols + g * Q4_GROUP;
            int8_t v[Q4_GROUP];
            float m = 0.0f, amax = -1.0f;
            for (size_t c = 0; c < Q4_GROUP; c++) {
                if ((x[c] & 0x7F80u) == 0x7F80u) return -1; /* exponent all ones: Inf or NaN */
                float f = bf16_to_f32(x[c]);
                if (fabsf(f) > amax) { /* strictly larger: the first one wins a tie */
                    amax = fabsf(f);
                    m = f;
                }
            }
            const float dq = m / -8.0f;
            uint32_t dq_bits;
            memcpy(&dq_bits, &dq, 4);
            const uint16_t d = f32_bits_to_bf16(dq_bits);
            const float ds = bf16_to_f32(d);
            uint8_t *sp = scale + 2 * (r * groups + g);
            sp[0] = (uint8_t)(d & 0xFFu);
            sp[1] = (uint8_t)(d >> 8);
            for (size_t c = 0; c < Q4_GROUP; c++) {
                float t = 0.0f;
                if (ds != 0.0f) {
                    t = nearbyintf(bf16_to_f32(x[c]) / ds);
                    if (t > 7.0f) t = 7.0f;
                    if (t < -8.0f) t = -8.0f;
                }
                v[c] = (int8_t)t;
            }
            uint8_t *qp = q + r * (cols / 2) + g * (Q4_GROUP / 2);
            for (size_t j = 0; j < Q4_GROUP / 2; j++)
                qp[j] = (uint8_t)((unsigned)(v[j] + 8) | ((unsigned)(v[j + Q4_GROUP / 2] + 8) << 4));
        }
    }
    return 0;
}

kvl_status kvl_pack_expert_q4(const uint16_t *gate, const uint16_t *up, const uint16_t *down,
                              size_t intermediate, size_t hidden, uint8_t *out, size_t out_bytes) {
    if (!gate || !up || !down || !out || intermediate == 0 || hidden == 0 ||
        intermediate % Q4_GROUP != 0 || hidden % Q4_GROUP != 0)
        return KVL_ERR_INVALID_ARG;
    kvl_q4_layout l;
    kvl_q4_layout_of(intermediate, hidden, &l);
    if (out_bytes != l.nbytes) return KVL_ERR_INVALID_ARG;
    memset(out, 0, out_bytes);
    const size_t I = intermediate, H = hidden;
    if (quantize_groups_q4(gate, I, H, out + l.gate_q, out + l.gate_s) ||
        quantize_groups_q4(up, I, H, out + l.up_q, out + l.up_s) ||
        quantize_groups_q4(down, H, I, out + l.down_q, out + l.down_s))
        return KVL_ERR_FORMAT;
    return KVL_OK;
}

/* ---- numpy PCG64 (pcg64.h: pcg_setseq_128_xsl_rr_64) ----------------------------------------- */

#define PCG_MULT_HI 0x2360ED051FC65DA4ull
#define PCG_MULT_LO 0x4385DF649FCCF645ull

/* 64 x 64 -> 128 without a 128-bit type (MSVC and every wasm toolchain alike) */
static void mul64(uint64_t a, uint64_t b, uint64_t *hi, uint64_t *lo) {
    uint64_t a0 = (uint32_t)a, a1 = a >> 32, b0 = (uint32_t)b, b1 = b >> 32;
    uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    uint64_t mid = (p00 >> 32) + (uint32_t)p01 + (uint32_t)p10;
    *lo = (mid << 32) | (uint32_t)p00;
    *hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

/* state = state * MULT + inc (mod 2^128) */
static void pcg_step(kvl_pcg64 *r) {
    uint64_t hi, lo;
    mul64(r->state_lo, PCG_MULT_LO, &hi, &lo);
    hi += r->state_hi * PCG_MULT_LO + r->state_lo * PCG_MULT_HI;
    uint64_t nlo = lo + r->inc_lo;
    hi += r->inc_hi + (nlo < lo);
    r->state_hi = hi;
    r->state_lo = nlo;
}

static uint64_t pcg_next(kvl_pcg64 *r) {
    pcg_step(r);
    uint64_t x = r->state_hi ^ r->state_lo;
    unsigned rot = (unsigned)(r->state_hi >> 58);
    return (x >> rot) | (x << ((64u - rot) & 63u));
}

void kvl_pcg64_seed(kvl_pcg64 *rng, const uint64_t seed_words[4]) {
    /* numpy: initstate = seed[0]:seed[1], initseq = seed[2]:seed[3] (high word first);
     * state = 0; inc = initseq << 1 | 1; step; state += initstate; step */
    rng->state_hi = 0;
    rng->state_lo = 0;
    rng->inc_hi = (seed_words[2] << 1) | (seed_words[3] >> 63);
    rng->inc_lo = (seed_words[3] << 1) | 1u;
    pcg_step(rng);
    uint64_t lo = rng->state_lo + seed_words[1];
    rng->state_hi += seed_words[0] + (lo < rng->state_lo);
    rng->state_lo = lo;
    pcg_step(rng);
}

static void put_value(uint32_t u, float center, float width, int bf16, void *out, size_t i) {
    uint32_t m = (u >> 9) | 0x3F800000u;
    float v;
    memcpy(&v, &m, 4);
    v -= 1.5f;
    v *= width;
    if (center != 0.0f) v += center;
    if (bf16) {
        uint32_t b;
        memcpy(&b, &v, 4);
        ((uint16_t *)out)[i] = f32_bits_to_bf16(b);
    } else {
        ((float *)out)[i] = v;
    }
}

void kvl_synth_uniform(kvl_pcg64 *rng, size_t count, float center, float half_width, int bf16,
                       void *out) {
    const float width = 2.0f * half_width;
    size_t i = 0;
    for (; i + 1 < count; i += 2) {
        uint64_t r = pcg_next(rng);
        put_value((uint32_t)r, center, width, bf16, out, i);
        put_value((uint32_t)(r >> 32), center, width, bf16, out, i + 1);
    }
    if (i < count) put_value((uint32_t)pcg_next(rng), center, width, bf16, out, i);
}
