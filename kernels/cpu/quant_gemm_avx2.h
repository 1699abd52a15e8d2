/*
 * The AVX2/FMA/F16C half of quant_gemm.c (included by it, x86 only; compiled with target
 * attributes, so the library loads and runs its portable path on any x86 CPU). See
 * quant_gemm.c for the packed layout and the design.
 */
#ifndef TANDEM_QUANT_GEMM_AVX2_H
#define TANDEM_QUANT_GEMM_AVX2_H

/* Eight consecutive bytes, sign- or zero-extended to 32-bit lanes; eight halves. */
INLINE TGT __m256 s8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
INLINE TGT __m256i u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
INLINE TGT __m256 h8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* y[m][n0 .. n0 + 16) = (v0 | v1) + bias, only the columns below N. */
INLINE TGT void store_row(const Args *a, int64_t m, int64_t n0, __m256 v0, __m256 v1) {
    float *yr = a->y + m * a->ldy + n0;
    if (a->N - n0 >= NR) {
        if (a->bias) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(a->bias + n0));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(a->bias + n0 + 8));
        }
        _mm256_storeu_ps(yr, v0), _mm256_storeu_ps(yr + 8, v1);
        return;
    }
    float tmp[NR];
    _mm256_storeu_ps(tmp, v0), _mm256_storeu_ps(tmp + 8, v1);
    for (int64_t j = 0; j < a->N - n0; j++) yr[j] = a->bias ? tmp[j] + a->bias[n0 + j] : tmp[j];
}

/* The GEMV keeps eight FMA chains a[0..7] per block (FMA latency): a one-row tile spreads
 * its k over all eight, a two-row tile gives row r a[4r .. 4r+3], a three- or four-row
 * tile gives row r a[2r], a[2r+1] (its two halves of the panel). Wider tiles convert each
 * weight to float once for all their rows: the conversion, not the FMA, is most of a
 * row's work. Every index is a literal constant (never a loop counter), so the arrays
 * live in registers. */
#define FMA2(xv, w0, w1, i) a[i] = _mm256_fmadd_ps(xv, w0, a[i]), a[i + 1] = _mm256_fmadd_ps(xv, w1, a[i + 1])
#define BX(p) _mm256_broadcast_ss(p)
/* Rows 0 .. mr-1 of a wide tile (mr 3 or 4): x[r][k] times the weight pair (w0, w1). */
#define FMA_ROWS(k, w0, w1)                                           \
    do {                                                              \
        FMA2(BX(x[0] + (k)), w0, w1, 0), FMA2(BX(x[1] + (k)), w0, w1, 2); \
        FMA2(BX(x[2] + (k)), w0, w1, 4);                              \
        if (mr == 4) FMA2(BX(x[3] + (k)), w0, w1, 6);                 \
    } while (0)

/* x . q for k in [k0, k1) of int8 quants [k][16] (a Q8_0 block, an INT8_ROW panel). */
INLINE TGT void dot_s8(const uint8_t *q, const float *x0, const float *x1, int64_t k0, int64_t k1,
                       const int mr, __m256 a[8]) {
    int64_t k = k0;
    for (; mr == 1 && k + 4 <= k1; k += 4) {
#if QG_PF
        if (k1 - k0 > QK) _mm_prefetch((const char *)q + k * NR + QG_PF, _MM_HINT_T0);
#endif
        FMA2(BX(x0 + k), s8(q + k * NR), s8(q + k * NR + 8), 0);
        FMA2(BX(x0 + k + 1), s8(q + (k + 1) * NR), s8(q + (k + 1) * NR + 8), 2);
        FMA2(BX(x0 + k + 2), s8(q + (k + 2) * NR), s8(q + (k + 2) * NR + 8), 4);
        FMA2(BX(x0 + k + 3), s8(q + (k + 3) * NR), s8(q + (k + 3) * NR + 8), 6);
    }
    for (; mr == 2 && k + 2 <= k1; k += 2) {
#if QG_PF
        if (k1 - k0 > QK && !((k - k0) & 2)) _mm_prefetch((const char *)q + k * NR + QG_PF, _MM_HINT_T0);
#endif
        const __m256 w0 = s8(q + k * NR), w1 = s8(q + k * NR + 8);
        const __m256 w2 = s8(q + (k + 1) * NR), w3 = s8(q + (k + 1) * NR + 8);
        FMA2(BX(x0 + k), w0, w1, 0), FMA2(BX(x0 + k + 1), w2, w3, 2);
        FMA2(BX(x1 + k), w0, w1, 4), FMA2(BX(x1 + k + 1), w2, w3, 6);
    }
    for (; k < k1; k++) { /* INT8_ROW's tail of K */
        const __m256 w0 = s8(q + k * NR), w1 = s8(q + k * NR + 8);
        FMA2(BX(x0 + k), w0, w1, 0);
        if (mr == 2) FMA2(BX(x1 + k), w0, w1, 4);
    }
}

/* dot_s8 for a wide tile (mr 3 or 4 rows, x[r] the row pointers). */
INLINE TGT void dot_s8_wide(const uint8_t *q, const float *const x[4], int64_t k0, int64_t k1,
                            const int mr, __m256 a[8]) {
    for (int64_t k = k0; k < k1; k++) {
#if QG_PF
        if (k1 - k0 > QK && !((k - k0) & 3)) _mm_prefetch((const char *)q + k * NR + QG_PF, _MM_HINT_T0);
#endif
        const __m256 w0 = s8(q + k * NR), w1 = s8(q + k * NR + 8);
        FMA_ROWS(k, w0, w1);
    }
}

/* Byte row i of Q4 nibbles [16][16] as floats: w[0..1] weight i, w[2..3] weight i + 16. */
INLINE TGT void nibbles(const uint8_t *p, __m256 w[4]) {
    const __m256i mask = _mm256_set1_epi32(15), v0 = u8(p), v1 = u8(p + 8);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, mask));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}

/* x . q of one Q4 block (the nibble values 0..15; the caller applies d, m or -8d). */
INLINE TGT void dot_q4(const uint8_t *q, const float *x0, const float *x1, const int mr, __m256 a[8]) {
    for (int i = 0; mr == 1 && i < QK / 2; i += 2) {
        __m256 w[4], u[4];
        nibbles(q + i * NR, w), nibbles(q + (i + 1) * NR, u);
        FMA2(BX(x0 + i), w[0], w[1], 0), FMA2(BX(x0 + i + 16), w[2], w[3], 2);
        FMA2(BX(x0 + i + 1), u[0], u[1], 4), FMA2(BX(x0 + i + 17), u[2], u[3], 6);
    }
    for (int i = 0; mr == 2 && i < QK / 2; i++) {
        __m256 w[4];
        nibbles(q + i * NR, w);
        FMA2(BX(x0 + i), w[0], w[1], 0), FMA2(BX(x0 + i + 16), w[2], w[3], 2);
        FMA2(BX(x1 + i), w[0], w[1], 4), FMA2(BX(x1 + i + 16), w[2], w[3], 6);
    }
}

/* dot_q4 for a wide tile (mr 3 or 4 rows, x[r] the row pointers): each byte row of
 * nibbles is converted once, and weights i and i + 16 share row r's two chains. */
INLINE TGT void dot_q4_wide(const uint8_t *q, const float *const x[4], const int mr, __m256 a[8]) {
    for (int i = 0; i < QK / 2; i++) {
        __m256 w[4];
        nibbles(q + i * NR, w);
        FMA_ROWS(i, w[0], w[1]);
        FMA_ROWS(i + 16, w[2], w[3]);
    }
}

/* The chains of row r summed into its two halves. */
INLINE TGT void fold(const __m256 a[8], const int mr, const int r, __m256 s[2]) {
    if (mr == 1) {
        s[0] = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6]));
        s[1] = _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7]));
    } else if (mr > 2) {
        s[0] = a[2 * r], s[1] = a[2 * r + 1];
    } else {
        s[0] = _mm256_add_ps(a[4 * r], a[4 * r + 2]), s[1] = _mm256_add_ps(a[4 * r + 1], a[4 * r + 3]);
    }
}

/* acc += d*t, plus e * (the block's sum of x) for Q4 (e = m for Q4_1, -8d for Q4_0). */
INLINE TGT void scale_block(__m256 acc[2], const __m256 t[2], const __m256 d[2], const __m256 e[2],
                            const float *sx, const int fmt) {
    acc[0] = _mm256_fmadd_ps(d[0], t[0], acc[0]), acc[1] = _mm256_fmadd_ps(d[1], t[1], acc[1]);
    if (fmt != Q8_0) {
        const __m256 s = BX(sx);
        acc[0] = _mm256_fmadd_ps(e[0], s, acc[0]), acc[1] = _mm256_fmadd_ps(e[1], s, acc[1]);
    }
}

/* Row r of a tile of mr rows starting at m0 (rows past mr alias row 0, never read). */
INLINE const float *tile_row(const float *base, int64_t ld, int64_t m0, int r, int mr) {
    return base + (m0 + (r < mr ? r : 0)) * ld;
}

/* GEMV, block formats: rows m0 .. m0 + mr (1 to 4) of y for one panel. mr and fmt are
 * constants at each call site. */
INLINE TGT void gemv_tile(const Args *g, const uint8_t *panel, int64_t n0, int64_t m0, const int mr,
                          const int fmt) {
    const int64_t kb = g->K / QK, bb = block_bytes(fmt);
    const float *x[4], *sx[4];
    for (int r = 0; r < 4; r++) {
        x[r] = tile_row(g->x, g->ldx, m0, r, mr);
        sx[r] = g->sx ? tile_row(g->sx, kb, m0, r, mr) : NULL;
    }
    const __m256 z = _mm256_setzero_ps(), m8 = _mm256_set1_ps(-8.0f);
    __m256 acc[4][2] = {{z, z}, {z, z}, {z, z}, {z, z}};
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = panel + b * bb, *q = blk + quant_offset(fmt);
#if QG_PF
        for (int64_t off = 0; off < bb; off += 64) _mm_prefetch((const char *)blk + QG_PF + off, _MM_HINT_T0);
#endif
        __m256 a[8] = {z, z, z, z, z, z, z, z}, t[2];
        const float *const xb[4] = {x[0] + b * QK, x[1] + b * QK, x[2] + b * QK, x[3] + b * QK};
        if (mr > 2 && fmt == Q8_0) dot_s8_wide(q, xb, 0, QK, mr, a);
        else if (mr > 2) dot_q4_wide(q, xb, mr, a);
        else if (fmt == Q8_0) dot_s8(q, xb[0], xb[1], 0, QK, mr, a);
        else dot_q4(q, xb[0], xb[1], mr, a);
        const __m256 d[2] = {h8(blk), h8(blk + 16)};
        const __m256 e[2] = {fmt == Q4_1 ? h8(blk + 32) : _mm256_mul_ps(d[0], m8),
                             fmt == Q4_1 ? h8(blk + 48) : _mm256_mul_ps(d[1], m8)};
        for (int r = 0; r < mr; r++) fold(a, mr, r, t), scale_block(acc[r], t, d, e, sx[r] + b, fmt);
    }
    for (int r = 0; r < mr; r++) store_row(g, m0 + r, n0, acc[r][0], acc[r][1]);
}

/* GEMV, INT8_ROW: t = x . q over all of K, y = s*t. */
INLINE TGT void gemv_tile_int8(const Args *g, const uint8_t *panel, int64_t n0, int64_t m0, const int mr) {
    const float *x[4];
    for (int r = 0; r < 4; r++) x[r] = tile_row(g->x, g->ldx, m0, r, mr);
    const __m256 z = _mm256_setzero_ps();
    __m256 a[8] = {z, z, z, z, z, z, z, z}, t[2];
    if (mr > 2) dot_s8_wide(panel + 64, x, 0, g->K, mr, a);
    else dot_s8(panel + 64, x[0], x[1], 0, g->K, mr, a);
    const __m256 sc0 = _mm256_loadu_ps((const float *)panel), sc1 = _mm256_loadu_ps((const float *)panel + 8);
    for (int r = 0; r < mr; r++)
        fold(a, mr, r, t), store_row(g, m0 + r, n0, _mm256_mul_ps(sc0, t[0]), _mm256_mul_ps(sc1, t[1]));
}

#define GEMV_TILE(mr) (fmt == INT8_ROW ? gemv_tile_int8(a, panel, n0, m, mr) : gemv_tile(a, panel, n0, m, mr, fmt))

/* All rows of x against one panel, in tiles of 4 rows and one of the rest (the panel
 * re-read from L1). */
INLINE TGT void gemv_rows(const Args *a, const uint8_t *panel, int64_t n0, const int fmt) {
    int64_t m = 0;
    for (; m + 4 <= a->M; m += 4) GEMV_TILE(4);
    switch (a->M - m) {
        case 3: GEMV_TILE(3); break;
        case 2: GEMV_TILE(2); break;
        case 1: GEMV_TILE(1); break;
        default: break;
    }
}
#undef GEMV_TILE

static TGT void gemv_panel_avx2(const Args *a, int64_t p) {
    const uint8_t *panel = a->w + p * a->pbytes;
    switch (a->fmt) {
        case Q8_0: gemv_rows(a, panel, p * NR, Q8_0); break;
        case Q4_0: gemv_rows(a, panel, p * NR, Q4_0); break;
        case Q4_1: gemv_rows(a, panel, p * NR, Q4_1); break;
        default: gemv_rows(a, panel, p * NR, INT8_ROW); break;
    }
}

/* The panel as float32 [K][16], each weight exactly as gguf dequantises it. */
static TGT void dequant_panel_avx2(const Args *a, const uint8_t *panel, float *buf) {
    const int fmt = a->fmt;
    if (fmt == INT8_ROW) {
        const __m256 s0 = _mm256_loadu_ps((const float *)panel), s1 = _mm256_loadu_ps((const float *)panel + 8);
        for (int64_t k = 0; k < a->K; k++) {
            _mm256_storeu_ps(buf + k * NR, _mm256_mul_ps(s8(panel + 64 + k * NR), s0));
            _mm256_storeu_ps(buf + k * NR + 8, _mm256_mul_ps(s8(panel + 64 + k * NR + 8), s1));
        }
        return;
    }
    const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int64_t b = 0; b < a->K / QK; b++) {
        const uint8_t *blk = panel + b * block_bytes(fmt), *q = blk + quant_offset(fmt);
        const __m256 d[2] = {h8(blk), h8(blk + 16)};
        float *o = buf + b * QK * NR;
        if (fmt == Q8_0) {
            for (int k = 0; k < QK * 2; k++) _mm256_storeu_ps(o + k * 8, _mm256_mul_ps(s8(q + k * 8), d[k & 1]));
            continue;
        }
        const __m256 mn[2] = {h8(blk + 32), h8(blk + 48)}; /* Q4_1's m (unused for Q4_0) */
        for (int i = 0; i < QK; i++) { /* i: byte row i / 2, half i % 2 */
            const __m256i v = u8(q + i * 8);
            __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_srli_epi32(v, 4);
            float *ol = o + (i / 2) * NR + (i & 1) * 8, *oh = ol + 16 * NR;
            if (fmt == Q4_0) {
                lo = _mm256_sub_epi32(lo, eight), hi = _mm256_sub_epi32(hi, eight);
                _mm256_storeu_ps(ol, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d[i & 1]));
                _mm256_storeu_ps(oh, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d[i & 1]));
            } else {
                /* one FMA is gguf's d*q + m exactly: d*q (f16 d, 4-bit q) is exact in float32 */
                _mm256_storeu_ps(ol, _mm256_fmadd_ps(d[i & 1], _mm256_cvtepi32_ps(lo), mn[i & 1]));
                _mm256_storeu_ps(oh, _mm256_fmadd_ps(d[i & 1], _mm256_cvtepi32_ps(hi), mn[i & 1]));
            }
        }
    }
}

/* y[m0 .. m0 + mr][n0 .. n0 + 16) = x[m0 .. m0 + mr] @ buf: a 6 x 16 tile in 12
 * accumulators, one FMA chain per element over k in order (as packed_gemm.c). */
INLINE TGT void gemm_tile(const Args *a, const float *buf, int64_t n0, int64_t m0, const int mr) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const int64_t ldx = a->ldx;
    const float *x0 = a->x + m0 * ldx, *b = buf;
#define QG_ROW(i, c0, c1)                                          \
    if (mr > i) {                                                  \
        const __m256 xv = _mm256_broadcast_ss(x0 + (i) * ldx + k); \
        c0 = _mm256_fmadd_ps(xv, b0, c0);                          \
        c1 = _mm256_fmadd_ps(xv, b1, c1);                          \
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < a->K; k++, b += NR) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        QG_ROW(0, c00, c01) QG_ROW(1, c10, c11) QG_ROW(2, c20, c21)
        QG_ROW(3, c30, c31) QG_ROW(4, c40, c41) QG_ROW(5, c50, c51)
    }
#undef QG_ROW
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < mr; i++) store_row(a, m0 + i, n0, acc[i][0], acc[i][1]);
}

/* Rows [m0, m1) over the dequantised panel, in tiles of at most 6 rows of balanced sizes
 * (8 rows as 4 + 4, not 6 + 2: a tile of r rows has 2r FMA chains, and under 8 chains the
 * FMA latency, not the FMA ports, bounds it). */
static TGT void gemm_panel_avx2(const Args *a, const float *buf, int64_t n0, int64_t m0, int64_t m1) {
    const int64_t rows = m1 - m0, tiles = (rows + MR - 1) / MR;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t m = m0 + rows * t / tiles;
        switch (m0 + rows * (t + 1) / tiles - m) {
            case 6: gemm_tile(a, buf, n0, m, 6); break;
            case 5: gemm_tile(a, buf, n0, m, 5); break;
            case 4: gemm_tile(a, buf, n0, m, 4); break;
            case 3: gemm_tile(a, buf, n0, m, 3); break;
            case 2: gemm_tile(a, buf, n0, m, 2); break;
            default: gemm_tile(a, buf, n0, m, 1); break;
        }
    }
}

#endif
