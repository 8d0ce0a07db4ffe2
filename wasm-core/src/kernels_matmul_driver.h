/* kernels_matmul_driver.h — the loop over register tiles shared by the SIMD kernel files.
 *
 * Owns: the order in which a matmul is cut into tiles (decode rows one by one, then TR x TT
 * tiles, token and row tails), so every ISA uses the same blocking.
 * Does not own: the tiles themselves. Included (once, after them) by kernels_avx2.c,
 * kernels_avx512.c and kernels_simd128.c, each compiled with its own ISA flags, which must define
 * KVL_INLINE, TR, TT, and the ISA's tile() and decode_row() with the signatures used below. xb = 1
 * rounds every activation to BF16 as it is loaded (the *_xb entries); it is a constant at each
 * call site. The integer-mode products (matmul_q8_i16, matmul_i16_i16: int16 activations with one
 * scale per token) use matmul_int_generic, which needs TRI, TTI, tile_int() and decode_row_int().
 */
#ifndef KVL_KERNELS_MATMUL_DRIVER_H
#define KVL_KERNELS_MATMUL_DRIVER_H

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
KVL_INLINE void matmul_int_generic(int kind, float *Y, size_t ldy, const void *W, const float *scale,
                                   size_t rows, size_t cols, const int16_t *Xq, const float *xs,
                                   size_t ldx, size_t n)
{
    size_t r = 0;
    if (n == 1) {
#ifdef KVL_DECODE_ROWS4_Q8
        if (kind == KVL_DECODE_ROWS4_Q8)
            for (; r + 4 <= rows; r += 4)
                decode_rows4_q8(Y, (const int8_t *)W, scale, r, cols, Xq, xs[0]);
#endif
#ifdef KVL_DECODE_ROWS2
        for (; r + 2 <= rows; r += 2)
            decode_rows2_int(kind, Y, W, scale, r, cols, Xq, xs[0]);
#endif
        for (; r < rows; r++)
            decode_row_int(kind, Y, W, scale, r, cols, Xq, xs[0]);
        return;
    }
    for (; r + TRI <= rows; r += TRI) {
        int pf = r + 2 * TRI <= rows;
        size_t t = 0;
        for (; t + TTI <= n; t += TTI)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t, ldx, pf && t == 0, TRI, TTI);
        for (; t < n; t++)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t, ldx, pf && t < TTI, TRI, 1);
    }
    for (; r < rows; r++) {
        size_t t = 0;
        for (; t + TTI <= n; t += TTI)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t, ldx, 0, 1, TTI);
        for (; t < n; t++)
            tile_int(kind, Y + t * ldy, ldy, W, scale, r, cols, Xq + t * ldx, xs + t, ldx, 0, 1, 1);
    }
}
#endif

#endif
