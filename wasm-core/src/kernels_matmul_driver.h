/* kernels_matmul_driver.h — the loop over register tiles shared by the SIMD kernel files.
 *
 * Owns: the order in which a matmul is cut into tiles (decode rows one by one, then TR x TT
 * tiles, token and row tails), so every ISA uses the same blocking.
 * Does not own: the tiles themselves. Included (once, after them) by kernels_avx2.c,
 * kernels_avx512.c and kernels_simd128.c, each compiled with its own ISA flags, which must define
 * KVL_INLINE, TR, TT, and the ISA's tile() and decode_row() with the signatures used below. xb = 1
 * rounds every activation to BF16 as it is loaded (the *_xb entries); it is a constant at each
 * call site. The integer-mode products (matmul_q8_i16: int16 activations with a scale per
 * KVL_I16_BLOCK columns, xs [n, nb]; matmul_i16_i16: one scale per token, xs [n]) use
 * matmul_int_generic, which needs TRI, TTI, tile_int() and decode_row_int(); each gets xs from
 * its first token on. quantize_i16_generic runs the ISA's quantize_block() over the blocks.
 * axpy_rows_generic (where the file defines AXPY_VW and the AXPY_* vector primitives) is
 * axpy_rows_f32.
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
        /* two vectors left (the two terms of one decoded token: --act-dtype i16): one tile, so
         * each weight is loaded once for both */
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

#endif
