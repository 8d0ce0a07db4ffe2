/* kernels_matmul_driver.h — what the SIMD kernel sets share, written once.
 *
 * Owns: the order in which a matmul is cut into tiles (decode rows one by one, then TR x TT
 * tiles, token and row tails), so every ISA uses the same blocking; the integer tile (tile_int)
 * and its loop; the Q8 strips; axpy_rows over tiles; and the driver_* functions a set's table
 * names for those entries (kernels.h). Like llama.cpp's per-arch fallbacks or XNNPACK's
 * templates, it is a template instantiated once per ISA file: kernels_avx2.c, kernels_avx512.c,
 * kernels_simd128.c each define their primitives, then include this file once (compiled with
 * their own ISA flags). The contract is only the names listed here; this file names nothing else
 * of theirs, and they use nothing of it but the driver_* entries and the *_generic loops.
 * Does not own: the tiles of the float products or any instruction.
 *
 * An ISA file defines: KVL_INLINE, KVL_UNROLL, TR, TT and tile() / decode_row() (float products;
 * xb = 1 rounds every activation to BF16 as it is loaded, the *_xb entries, a constant at each
 * call site). For the integer-mode products (matmul_q8_i16: int16 activations with a scale per
 * KVL_I16_BLOCK columns, xs [n, nb]; matmul_i16_i16: one scale per token, xs [n]): TRI, TTI,
 * quantize_block(), decode_row_int(), and tile_int's primitives:
 *   TI_MASKED (1: loads take the columns' end e and zero what lies beyond; 0: whole vectors, and
 *   the driver adds scalar tails), TI_Q8_STEP / TI_I16_STEP (columns per Q8 step / per int16
 *   vector); the types TI_Q8W, TI_Q8X (a Q8 step's weights and activations as int16), TI_IACC
 *   (int32 lanes), TI_I16V, TI_FACC (FP32 lanes), TI_I4 / TI_F4 (4 int32 / FP32 lanes);
 *   ti_load_q8w(row, c, e), ti_load_q8x(row, c, e), ti_dot_q8(acc, w, x) (acc + the exact
 *   products), ti_izero(), ti_ihsum(acc), ti_reduce4(a, b, c, d) (four lane sums in 4 lanes),
 *   ti_i4_add, ti_i4_load, ti_f4_zero, ti_f4_from_i4, ti_f4_mul, ti_f4_add, ti_f4_splat,
 *   ti_f4_load, ti_f4_store, ti_prefetch(p), ti_prefetch_i16_step(p), ti_load_i16(row, c, e),
 *   ti_fzero, ti_fadd, ti_fhsum, ti_i16_quad(w0, x0, w1, x1) (two vectors' products, 4 per FP32
 *   lane) and ti_i16_pair(w, x) (one vector's).
 * Optional hooks, each used where the file defines it: AXPY_VW and the AXPY_* vector primitives
 * (axpy_rows_generic, driver_axpy_rows_f32); STRIP_ROWS, the STRIP_* primitives and
 * pack_q8_strip (a Q8 product of STRIP_TOKENS or more tokens with rows in the lanes,
 * matmul_q8_i16_strips); KVL_DECODE_ROWS4_Q8 + decode_rows4_q8, KVL_DECODE_ROWS2 +
 * decode_rows2_int and KVL_DECODE_STREAM_GAP (decoding several rows at a time);
 * KVL_DECODE_ROWS4_I8 + decode_rows4_q8_i8 (driver_matmul_q8_i8).
 */
#ifndef KVL_KERNELS_MATMUL_DRIVER_H
#define KVL_KERNELS_MATMUL_DRIVER_H

#ifdef AXPY_VW
/* axpy_rows_f32 on a tile of H rows of Y by V vectors of AXPY_VW floats, over every p: each element
 * gets the ISA's axpy_f32 multiply-add (AXPY_MADD), in p order. */
KVL_INLINE void axpy_rows_tile(int H, int V, float *Y, size_t ldy, const float *A, size_t lda,
                               const float *X, size_t ldx, size_t np)
{
    AXPY_VEC s[2][4];
    for (int h = 0; h < H; h++)
        for (int v = 0; v < V; v++)
            s[h][v] = AXPY_LOAD(Y + (size_t)h * ldy + AXPY_VW * v);
    for (size_t p = 0; p < np; p++) {
        AXPY_VEC x[4];
        KVL_UNROLL
        for (int v = 0; v < V; v++)
            x[v] = AXPY_LOAD(X + p * ldx + AXPY_VW * v);
        KVL_UNROLL
        for (int h = 0; h < H; h++) {
            const AXPY_VEC a = AXPY_SPLAT(A[(size_t)h * lda + p]);
            KVL_UNROLL
            for (int v = 0; v < V; v++)
                s[h][v] = AXPY_MADD(a, x[v], s[h][v]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int v = 0; v < V; v++)
            AXPY_STORE(Y + (size_t)h * ldy + AXPY_VW * v, s[h][v]);
}

/* axpy_rows_f32 (kernels.h) over axpy_rows_tile: columns in strips of 4 vectors (pairs of heads,
 * then one), then single vectors, then the scalar tail, split as the ISA's axpy_f32 splits them,
 * each strip of X (np rows) re-read from cache by every pair of heads. */
KVL_INLINE void axpy_rows_generic(float *Y, size_t ldy, const float *A, size_t lda, size_t nh,
                                  const float *X, size_t ldx, size_t np, size_t cols)
{
    size_t c = 0;
    for (; c + 4 * AXPY_VW <= cols; c += 4 * AXPY_VW) {
        size_t h = 0;
        for (; h + 2 <= nh; h += 2)
            axpy_rows_tile(2, 4, Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
        for (; h < nh; h++)
            axpy_rows_tile(1, 4, Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
    }
    for (; c + AXPY_VW <= cols; c += AXPY_VW)
        for (size_t h = 0; h < nh; h++)
            axpy_rows_tile(1, 1, Y + h * ldy + c, ldy, A + h * lda, lda, X + c, ldx, np);
    for (; c < cols; c++)
        for (size_t h = 0; h < nh; h++)
            for (size_t p = 0; p < np; p++)
                Y[h * ldy + c] += A[h * lda + p] * X[p * ldx + c];
}
#endif

#ifdef STRIP_ROWS
/* ---- Q8 x int16 prefill: rows in lanes --------------------------------------------------
 *
 * A tile that keeps columns in the vector lanes (tile_int) ends every 64-column block of every
 * (row, token) pair in a horizontal reduction before its FP32 scale: on AVX-512 (Zen 4) that ran
 * the batched product at half the rate of the BF16 one (96 against 180 GFLOP/s per thread, kernel
 * bench: bench/RESULTS.md "Idle workers, huge pages and prefill products", 2026-12-04).
 * Here the lanes are STRIP_ROWS rows: a strip is repacked, STRIP_CHUNK
 * columns at a time, as int16 column pairs [pair][STRIP_ROWS][2] (the ISA's pack_q8_strip, a
 * transpose of int32 lanes), and each STRIP_DOT multiplies one pair of all the strip's rows by one
 * token's pair of activations broadcast to every lane. A block's int32 sums are exact in any
 * order; they are converted, scaled and added to the FP32 accumulators in block order exactly as
 * the reference does ((float)sum * xs, then + acc, separately rounded), the accumulators live in
 * Y between chunks (stores and loads are exact), and the last chunk multiplies by the row scales:
 * bit-identical to the reference.
 *
 * The file defines: STRIP_ROWS; the types STRIP_IVEC (int32 lanes), STRIP_FVEC (FP32 lanes) and
 * STRIP_RMASK (a strip's rows); STRIP_RMASK_OF(nr) (rows [0, nr)); STRIP_ILOAD(p) (unaligned),
 * STRIP_IZERO(), STRIP_ISPLAT(v), STRIP_DOT(acc, w, x) (acc + the pairwise int16 products of w and
 * x, exact int32), STRIP_CVT(v); STRIP_FZERO(), STRIP_FSPLAT(v), STRIP_FADD, STRIP_FMUL,
 * STRIP_FLOAD(m, p) and STRIP_FSTORE(m, p, v) (masked to the strip's rows); KVL_NOINLINE; and
 * pack_q8_strip(P, W, cols, r0, nr, c0, nc): P[p * STRIP_ROWS + i] = the pair (c0 + 2p,
 * c0 + 2p + 1) of row r0 + i, zero outside the matrix. */

#define STRIP_CHUNK 256 /* columns repacked at a time: 4 blocks, STRIP_ROWS * 512 bytes of pairs */
#define STRIP_TOKENS 8  /* tokens per register tile: 8 int32 + 8 FP32 accumulators */
_Static_assert(STRIP_TOKENS == 8, "block_pairs8 names eight accumulators");

/* Two adjacent int16 as one int32 lane (memory order), for a broadcast. */
KVL_INLINE int32_t pair_at(const int16_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The int32 sums of 8 tokens over npairs packed pairs, added to ia[0..7]. Not inlined: inside
 * strip_tile GCC 12 kept only 18 vector registers live and spilled two accumulators per pair
 * (117 against 181 GFLOP/s on AVX-512). */
static KVL_NOINLINE void block_pairs8(STRIP_IVEC ia[8], const int32_t *P, size_t npairs, const int16_t *x, size_t ldx)
{
    STRIP_IVEC a0 = ia[0], a1 = ia[1], a2 = ia[2], a3 = ia[3], a4 = ia[4], a5 = ia[5], a6 = ia[6], a7 = ia[7];
    for (size_t p = 0; p < npairs; p++) {
        const STRIP_IVEC w = STRIP_ILOAD(P + p * STRIP_ROWS);
        const int16_t *xp = x + 2 * p;
        a0 = STRIP_DOT(a0, w, STRIP_ISPLAT(pair_at(xp)));
        a1 = STRIP_DOT(a1, w, STRIP_ISPLAT(pair_at(xp + ldx)));
        a2 = STRIP_DOT(a2, w, STRIP_ISPLAT(pair_at(xp + 2 * ldx)));
        a3 = STRIP_DOT(a3, w, STRIP_ISPLAT(pair_at(xp + 3 * ldx)));
        a4 = STRIP_DOT(a4, w, STRIP_ISPLAT(pair_at(xp + 4 * ldx)));
        a5 = STRIP_DOT(a5, w, STRIP_ISPLAT(pair_at(xp + 5 * ldx)));
        a6 = STRIP_DOT(a6, w, STRIP_ISPLAT(pair_at(xp + 6 * ldx)));
        a7 = STRIP_DOT(a7, w, STRIP_ISPLAT(pair_at(xp + 7 * ldx)));
    }
    ia[0] = a0; ia[1] = a1; ia[2] = a2; ia[3] = a3; ia[4] = a4; ia[5] = a5; ia[6] = a6; ia[7] = a7;
}

/* One token tile over one packed chunk: T tokens x STRIP_ROWS rows (rm: those that exist). */
KVL_INLINE void strip_tile(const int T, float *Y, size_t ldy, const int32_t *P, size_t nc, size_t c0,
                           STRIP_RMASK rm, size_t r0, const int16_t *X, size_t ldx, const float *xs,
                           size_t nb, size_t cols, int first, int last, STRIP_FVEC sc)
{
    STRIP_FVEC fa[STRIP_TOKENS];
    KVL_UNROLL
    for (int t = 0; t < T; t++)
        fa[t] = first ? STRIP_FZERO() : STRIP_FLOAD(rm, Y + (size_t)t * ldy + r0);
    for (size_t b = 0; b < nc; b += KVL_I16_BLOCK) {
        const size_t e = nc - b < KVL_I16_BLOCK ? nc : b + KVL_I16_BLOCK;
        const size_t full = c0 + e <= cols - (cols & 1) ? e : e - 1; /* an odd last column: alone */
        STRIP_IVEC ia[STRIP_TOKENS];
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            ia[t] = STRIP_IZERO();
        size_t c = b;
        if (T == STRIP_TOKENS) {
            block_pairs8(ia, P + b / 2 * STRIP_ROWS, (full - b) / 2, X + c0 + b, ldx);
            c = b + (full - b) / 2 * 2;
        }
        for (; c + 2 <= full; c += 2) {
            const STRIP_IVEC w = STRIP_ILOAD(P + c / 2 * STRIP_ROWS);
            KVL_UNROLL
            for (int t = 0; t < T; t++)
                ia[t] = STRIP_DOT(ia[t], w, STRIP_ISPLAT(pair_at(X + (size_t)t * ldx + c0 + c)));
        }
        if (c < e) { /* the odd last column: its pair's second weight is zero */
            const STRIP_IVEC w = STRIP_ILOAD(P + c / 2 * STRIP_ROWS);
            KVL_UNROLL
            for (int t = 0; t < T; t++)
                ia[t] = STRIP_DOT(ia[t], w, STRIP_ISPLAT((int32_t)(uint16_t)X[(size_t)t * ldx + c0 + c]));
        }
        const size_t bi = (c0 + b) / KVL_I16_BLOCK;
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            fa[t] = STRIP_FADD(fa[t], STRIP_FMUL(STRIP_CVT(ia[t]), STRIP_FSPLAT(xs[(size_t)t * nb + bi])));
    }
    KVL_UNROLL
    for (int t = 0; t < T; t++)
        STRIP_FSTORE(rm, Y + (size_t)t * ldy + r0, last ? STRIP_FMUL(fa[t], sc) : fa[t]);
}

/* matmul_q8_i16 for n >= STRIP_TOKENS tokens and cols > 0: strips of STRIP_ROWS rows, chunks of
 * columns, tiles of tokens. */
static void matmul_q8_i16_strips(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                                 size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    /* aligned by hand and used with unaligned loads and stores: GCC does not align the stack
     * beyond 16 bytes on Windows x64 (mingw-w64), where an aligned access to it can fault */
    int32_t buf[STRIP_CHUNK / 2 * STRIP_ROWS + 16];
    int32_t *P = (int32_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    const size_t nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK);
    for (size_t r0 = 0; r0 < rows; r0 += STRIP_ROWS) {
        const size_t nr = rows - r0 < STRIP_ROWS ? rows - r0 : STRIP_ROWS;
        const STRIP_RMASK rm = STRIP_RMASK_OF(nr);
        const STRIP_FVEC sc = STRIP_FLOAD(rm, scale + r0);
        for (size_t c0 = 0; c0 < cols; c0 += STRIP_CHUNK) {
            const size_t nc = cols - c0 < STRIP_CHUNK ? cols - c0 : STRIP_CHUNK;
            const int first = c0 == 0, last = c0 + nc == cols;
            pack_q8_strip(P, W, cols, r0, nr, c0, nc);
            size_t t = 0;
            for (; t + STRIP_TOKENS <= n; t += STRIP_TOKENS)
                strip_tile(STRIP_TOKENS, Y + t * ldy, ldy, P, nc, c0, rm, r0, Xq + t * ldx, ldx, xs + t * nb, nb, cols, first, last, sc);
            for (; t + 4 <= n; t += 4)
                strip_tile(4, Y + t * ldy, ldy, P, nc, c0, rm, r0, Xq + t * ldx, ldx, xs + t * nb, nb, cols, first, last, sc);
            for (; t < n; t++)
                strip_tile(1, Y + t * ldy, ldy, P, nc, c0, rm, r0, Xq + t * ldx, ldx, xs + t * nb, nb, cols, first, last, sc);
        }
    }
}
#endif

KVL_INLINE void matmul_generic(int kind, int xb, float *Y, size_t ldy, const void *W, const float *scale,
                               size_t rows, size_t cols, const float *X, size_t ldx, size_t n)
{
    size_t r = 0;
    if (n == 1) {
        for (; r < rows; r++)
            decode_row(kind, xb, Y, W, scale, r, cols, X);
        return;
    }
    for (; r + TR <= rows; r += TR) {
        int pf = r + 2 * TR <= rows; /* next tile exists: prefetch it (first token block only) */
        size_t t = 0;
        for (; t + TT <= n; t += TT)
            tile(kind, xb, Y + t * ldy, ldy, W, scale, r, cols, X + t * ldx, ldx, pf && t == 0, TR, TT);
        for (; t < n; t++)
            tile(kind, xb, Y + t * ldy, ldy, W, scale, r, cols, X + t * ldx, ldx, pf && t < TT, TR, 1);
    }
    for (; r < rows; r++) {
        size_t t = 0;
        for (; t + TT <= n; t += TT)
            tile(kind, xb, Y + t * ldy, ldy, W, scale, r, cols, X + t * ldx, ldx, 0, 1, TT);
        for (; t < n; t++)
            tile(kind, xb, Y + t * ldy, ldy, W, scale, r, cols, X + t * ldx, ldx, 0, 1, 1);
    }
}

#ifdef TRI
/* ---- the integer tile (tile_int): R rows x T tokens of matmul_q8_i16 / matmul_i16_i16 -------
 *
 * One for every set, built from the ISA's primitives (the TI_* list in the header comment).
 * R and T are constants at every call site: each weight vector is loaded once per T tokens, each
 * activation vector once per R rows.
 *
 * Q8: per 64-column block, each (row, token) pair's int32 sum is exact in any order; then, per
 * output, the reference's (float)sum * xs (rounded) + acc (rounded), and acc * scale at the end,
 * so the result is bit-identical to the reference however the sums are reduced. Four sums are
 * reduced together into the lanes of one vector (ti_reduce4): the four rows of a token where R is
 * 4, else the tokens of a row where T > 1 (missing tokens: zero sums and scales), else one sum
 * alone (ti_ihsum). Without masked loads the block's last columns (fewer than TI_Q8_STEP) are
 * added in scalar code.
 *
 * int16: per output, FP32 lanes add the converted int32 sums of each step (4 products per lane
 * on two vectors, ti_i16_quad; without masked loads, then one vector, ti_i16_pair), then the lane
 * sum and the scalar groups of 4 left over (kvl_i16_group_sum); Y = (s * scale) * xs[t]. */
KVL_INLINE void tile_int(int kind, float *Y, size_t ldy, const void *W, const float *scale,
                         size_t r0, size_t cols, const int16_t *X, const float *xs, size_t ldx,
                         int prefetch, const int R, const int T)
{
    if (kind == IKIND_Q8) {
        const size_t nb = kvl_i16_nblocks(cols, KVL_I16_BLOCK); /* xs: [T, nb] */
        const int8_t *wrow[TRI];
        float acc[TRI][TTI];
#define TI_ACC4 (TRI > TTI ? TRI : TTI)
        TI_F4 acc4[TI_ACC4]; /* lane by row (per token) or by token (per row) */
        KVL_UNROLL
        for (int i = 0; i < R; i++) {
            wrow[i] = (const int8_t *)W + (r0 + (size_t)i) * cols;
            KVL_UNROLL
            for (int t = 0; t < T; t++)
                acc[i][t] = 0.0f;
        }
        KVL_UNROLL
        for (int j = 0; j < TI_ACC4; j++)
            acc4[j] = ti_f4_zero();
        for (size_t b = 0; b < cols; b += KVL_I16_BLOCK) {
            const size_t e = cols - b < KVL_I16_BLOCK ? cols : b + KVL_I16_BLOCK;
            TI_IACC ia[TRI][TTI];
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                KVL_UNROLL
                for (int t = 0; t < T; t++)
                    ia[i][t] = ti_izero();
            size_t c = b;
            for (; TI_MASKED ? c < e : c + TI_Q8_STEP <= e; c += TI_Q8_STEP) {
                if (prefetch && (c & 63) == 0) {
                    KVL_UNROLL
                    for (int i = 0; i < R; i++)
                        ti_prefetch(wrow[i] + (size_t)R * cols + c);
                }
                TI_Q8W w[TRI];
                KVL_UNROLL
                for (int i = 0; i < R; i++)
                    w[i] = ti_load_q8w(wrow[i], c, e);
                KVL_UNROLL
                for (int t = 0; t < T; t++) {
                    const TI_Q8X x = ti_load_q8x(X + (size_t)t * ldx, c, e);
                    KVL_UNROLL
                    for (int i = 0; i < R; i++)
                        ia[i][t] = ti_dot_q8(ia[i][t], w[i], x);
                }
            }
            /* the scalar tail [c, e) of each sum (none with masked loads) */
            int32_t tail[TRI][TTI];
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                KVL_UNROLL
                for (int t = 0; t < T; t++) {
                    tail[i][t] = 0;
                    for (size_t k = c; !TI_MASKED && k < e; k++)
                        tail[i][t] += (int32_t)wrow[i][k] * (int32_t)X[(size_t)t * ldx + k];
                }
            const size_t bi = b / KVL_I16_BLOCK;
            /* (indices taken modulo TRI, TTI: in range where a branch cannot run) */
            if (R == 4) {
                KVL_UNROLL
                for (int t = 0; t < T; t++) {
                    TI_I4 s = ti_reduce4(ia[0][t], ia[1 % TRI][t], ia[2 % TRI][t], ia[3 % TRI][t]);
                    if (!TI_MASKED && c < e) {
                        const int32_t tl[4] = {tail[0][t], tail[1 % TRI][t], tail[2 % TRI][t], tail[3 % TRI][t]};
                        s = ti_i4_add(s, ti_i4_load(tl));
                    }
                    acc4[t] = ti_f4_add(acc4[t], ti_f4_mul(ti_f4_from_i4(s), ti_f4_splat(xs[(size_t)t * nb + bi])));
                }
            } else if (T > 1) {
                KVL_UNROLL
                for (int i = 0; i < R; i++) {
                    const TI_IACC z = ti_izero();
                    TI_I4 s = ti_reduce4(ia[i][0], ia[i][1 % TTI], T > 2 ? ia[i][2 % TTI] : z, T > 3 ? ia[i][3 % TTI] : z);
                    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    int32_t tl[4] = {0, 0, 0, 0};
                    KVL_UNROLL
                    for (int t = 0; t < T; t++) {
                        sc[t] = xs[(size_t)t * nb + bi];
                        tl[t] = tail[i][t];
                    }
                    if (!TI_MASKED && c < e)
                        s = ti_i4_add(s, ti_i4_load(tl));
                    acc4[i] = ti_f4_add(acc4[i], ti_f4_mul(ti_f4_from_i4(s), ti_f4_load(sc)));
                }
            } else {
                KVL_UNROLL
                for (int i = 0; i < R; i++) {
                    const float p = (float)(ti_ihsum(ia[i][0]) + tail[i][0]) * xs[bi];
                    acc[i][0] += p;
                }
            }
        }
        if (R == 4) {
            const TI_F4 sc = ti_f4_load(scale + r0);
            KVL_UNROLL
            for (int t = 0; t < T; t++)
                ti_f4_store(Y + (size_t)t * ldy + r0, ti_f4_mul(acc4[t], sc));
            return;
        }
        if (T > 1) {
            KVL_UNROLL
            for (int i = 0; i < R; i++) {
                float a4[4];
                ti_f4_store(a4, acc4[i]);
                KVL_UNROLL
                for (int t = 0; t < T; t++)
                    acc[i][t] = a4[t];
            }
        }
        KVL_UNROLL
        for (int i = 0; i < R; i++)
            KVL_UNROLL
            for (int t = 0; t < T; t++)
                Y[(size_t)t * ldy + r0 + (size_t)i] = acc[i][t] * scale[r0 + (size_t)i];
        return;
    }
    const int16_t *wrow[TRI];
    TI_FACC fa[TRI][TTI];
    KVL_UNROLL
    for (int i = 0; i < R; i++) {
        wrow[i] = (const int16_t *)W + (r0 + (size_t)i) * cols;
        KVL_UNROLL
        for (int t = 0; t < T; t++)
            fa[i][t] = ti_fzero();
    }
    size_t c = 0;
    for (; TI_MASKED ? c < cols : c + 2 * TI_I16_STEP <= cols; c += 2 * TI_I16_STEP) {
        if (prefetch) {
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                ti_prefetch_i16_step(wrow[i] + (size_t)R * cols + c);
        }
        TI_I16V w0[TRI], w1[TRI];
        KVL_UNROLL
        for (int i = 0; i < R; i++) {
            w0[i] = ti_load_i16(wrow[i], c, cols);
            w1[i] = ti_load_i16(wrow[i], c + TI_I16_STEP, cols);
        }
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            const TI_I16V x0 = ti_load_i16(X + (size_t)t * ldx, c, cols);
            const TI_I16V x1 = ti_load_i16(X + (size_t)t * ldx, c + TI_I16_STEP, cols);
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                fa[i][t] = ti_fadd(fa[i][t], ti_i16_quad(w0[i], x0, w1[i], x1));
        }
    }
    if (!TI_MASKED && c + TI_I16_STEP <= cols) {
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            const TI_I16V x0 = ti_load_i16(X + (size_t)t * ldx, c, cols);
            KVL_UNROLL
            for (int i = 0; i < R; i++)
                fa[i][t] = ti_fadd(fa[i][t], ti_i16_pair(ti_load_i16(wrow[i], c, cols), x0));
        }
        c += TI_I16_STEP;
    }
    KVL_UNROLL
    for (int i = 0; i < R; i++)
        KVL_UNROLL
        for (int t = 0; t < T; t++) {
            float s = ti_fhsum(fa[i][t]);
            if (!TI_MASKED)
                s = kvl_i16_group_sum(wrow[i], X + (size_t)t * ldx, c, cols, s);
            Y[(size_t)t * ldy + r0 + (size_t)i] = (s * scale[r0 + (size_t)i]) * xs[t];
        }
}

/* quantize_i16_act (kernels.h) block by block, each block by the ISA's quantize_block(q, xs, x,
 * len, lim), which sets xs[0] and len integers */
KVL_INLINE void quantize_i16_generic(int16_t *Xq, float *xs, const float *X, size_t cols, size_t n,
                                     size_t ldx_in, size_t ldx_out, size_t block, int lim)
{
    const size_t nb = kvl_i16_nblocks(cols, block);
    for (size_t t = 0; t < n; t++)
        for (size_t b = 0; b < nb; b++) {
            const size_t c0 = b * block;
            quantize_block(Xq + t * ldx_out + c0, xs + t * nb + b, X + t * ldx_in + c0,
                           cols - c0 < block ? cols - c0 : block, (float)lim);
        }
}

KVL_INLINE void matmul_int_generic(int kind, float *Y, size_t ldy, const void *W, const float *scale,
                                   size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                                   size_t ldx, size_t n)
{
#ifdef STRIP_ROWS
    if (kind == IKIND_Q8 && n >= STRIP_TOKENS && cols > 0) {
        matmul_q8_i16_strips(Y, ldy, (const int8_t *)W, scale, rows, cols, Xq, xs, ldx, n);
        return;
    }
#endif
    const size_t xstride = kind == IKIND_Q8 ? kvl_i16_nblocks(cols, KVL_I16_BLOCK) : 1;
    size_t r = 0;
    if (n == 1) {
#ifdef KVL_DECODE_ROWS4_Q8
        if (kind == KVL_DECODE_ROWS4_Q8)
            for (; r + 4 <= rows; r += 4)
                decode_rows4_q8(Y, (const int8_t *)W, scale, r, cols, Xq, xs, r + 8 <= rows);
#endif
#ifdef KVL_DECODE_ROWS2
        /* pairs of rows KVL_DECODE_STREAM_GAP bytes apart (decode_rows2_int), in groups of
         * 2 * gap rows; what is left takes the largest gap it can */
        const size_t row_bytes = cols * (kind == IKIND_Q8 ? 1u : 2u);
        const size_t want = row_bytes ? (KVL_DECODE_STREAM_GAP + row_bytes - 1) / row_bytes : 1;
        while (rows - r >= 2) {
            const size_t gap = (rows - r) / 2 < want ? (rows - r) / 2 : want;
            for (size_t o = 0; o < gap; o++)
                decode_rows2_int(kind, Y, W, scale, r + o, gap, cols, Xq, xs);
            r += 2 * gap;
        }
#endif
        for (; r < rows; r++)
            decode_row_int(kind, Y, W, scale, r, cols, Xq, xs);
        return;
    }
    for (; r + TRI <= rows; r += TRI) {
        int pf = r + 2 * TRI <= rows;
        size_t t = 0;
        for (; t + TTI <= n; t += TTI)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t * xstride, ldx, pf && t == 0, TRI, TTI);
#if TTI > 2
        /* two or three vectors left (a prompt's tail, or a routed expert that few of a chunk's
         * tokens chose): a tile of two, so each weight is loaded once for both */
        for (; t + 2 <= n; t += 2)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t * xstride, ldx, pf && t < TTI, TRI, 2);
#endif
        for (; t < n; t++)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t * xstride, ldx, pf && t < TTI, TRI, 1);
    }
    for (; r < rows; r++) {
        size_t t = 0;
        for (; t + TTI <= n; t += TTI)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t * xstride, ldx, 0, 1, TTI);
        for (; t < n; t++)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t * xstride, ldx, 0, 1, 1);
    }
}
#endif

#ifdef KVL_DECODE_ROWS4_I8
/* matmul_q8_i8 (kernels.h): a decoded token (n == 1) on the ISA's 8-bit dot products, four rows
 * at a time (decode_rows4_q8_i8), the last rows and any other n on the int16 product, which gives
 * the same bits. */
KVL_INLINE void matmul_q8_i8_generic(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                                     size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    if (n != 1) {
        matmul_int_generic(IKIND_Q8, Y, ldy, W, scale, rows, cols, Xq, xs, ldx, n);
        return;
    }
    size_t r = 0;
    for (; r + 4 <= rows; r += 4)
        decode_rows4_q8_i8(Y, W, scale, r, cols, Xq, xs, r + 8 <= rows);
    for (; r < rows; r++)
        decode_row_int(IKIND_Q8, Y, W, scale, r, cols, Xq, xs);
}
#endif

/* ---- the entries every set gets from the driver ---------------------------------------------
 * kvl_kernels entries over the loops above, one instance per ISA file; a set's table names the
 * ones it takes (static inline: one a set does not take costs nothing and draws no warning). */
static inline void driver_matmul_bf16(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                                      const float *X, size_t ldx, size_t n)
{
    matmul_generic(KIND_BF16, 0, Y, ldy, W, NULL, rows, cols, X, ldx, n);
}

static inline void driver_matmul_q8(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                                    size_t cols, const float *X, size_t ldx, size_t n)
{
    matmul_generic(KIND_Q8, 0, Y, ldy, W, scale, rows, cols, X, ldx, n);
}

static inline void driver_matmul_f32(float *Y, size_t ldy, const float *W, size_t rows, size_t cols,
                                     const float *X, size_t ldx, size_t n)
{
    matmul_generic(KIND_F32, 0, Y, ldy, W, NULL, rows, cols, X, ldx, n);
}

static inline void driver_matmul_bf16_xb(float *Y, size_t ldy, const uint16_t *W, size_t rows, size_t cols,
                                         const float *X, size_t ldx, size_t n)
{
    matmul_generic(KIND_BF16, 1, Y, ldy, W, NULL, rows, cols, X, ldx, n);
}

static inline void driver_matmul_q8_xb(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                                       size_t cols, const float *X, size_t ldx, size_t n)
{
    matmul_generic(KIND_Q8, 1, Y, ldy, W, scale, rows, cols, X, ldx, n);
}

#ifdef TRI
static inline void driver_quantize_i16_act(int16_t *Xq, float *xs, const float *X, size_t cols, size_t n,
                                           size_t ldx_in, size_t ldx_out, size_t block, int lim)
{
    quantize_i16_generic(Xq, xs, X, cols, n, ldx_in, ldx_out, block, lim);
}

static inline void driver_matmul_q8_i16(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                                        size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    matmul_int_generic(IKIND_Q8, Y, ldy, W, scale, rows, cols, Xq, xs, ldx, n);
}

static inline void driver_matmul_i16_i16(float *Y, size_t ldy, const int16_t *W, const float *scale,
                                         size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                                         size_t ldx, size_t n)
{
    matmul_int_generic(IKIND_I16, Y, ldy, W, scale, rows, cols, Xq, xs, ldx, n);
}
#endif

#ifdef KVL_DECODE_ROWS4_I8
static inline void driver_matmul_q8_i8(float *Y, size_t ldy, const int8_t *W, const float *scale, size_t rows,
                                       size_t cols, const int16_t *Xq, const float *xs, size_t ldx, size_t n)
{
    matmul_q8_i8_generic(Y, ldy, W, scale, rows, cols, Xq, xs, ldx, n);
}
#endif

#ifdef AXPY_VW
static inline void driver_axpy_rows_f32(float *Y, size_t ldy, const float *A, size_t lda, size_t nh,
                                        const float *X, size_t ldx, size_t np, size_t cols)
{
    axpy_rows_generic(Y, ldy, A, lda, nh, X, ldx, np, cols);
}
#endif

#endif
