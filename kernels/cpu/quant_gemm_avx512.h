/*
 * The AVX-512 GEMV of quant_gemm.c (included by it, x86 only; compiled with target
 * attributes and chosen at run time, so the library still loads and runs its AVX2 or
 * portable path on CPUs without AVX-512). See quant_gemm.c for the packed layout.
 *
 * A panel's 16 rows are exactly one 16-lane vector, so one k of a panel is one load, one
 * widening and one conversion, and x[k]'s broadcast rides in the FMA's memory operand.
 * With 32 registers a tile holds 8 rows of x (the AVX2 path: 4), so each weight is
 * converted once per 8 rows. On Zen 4, whose 512-bit ops take both halves of its 256-bit
 * pipes, the FMA peak is the AVX2 one and the conversions share the FMA pipes: one row
 * gains ~5% (a weight's load, widening, conversion and FMA are the same pipe time in
 * either width), 4 to 128 rows 1.1-1.2x (SmolLM2's products, quant_gemm_bench.py), and
 * up to 128 rows these tiles beat dequantise + GEMM, so they take those sizes too
 * (QG_GEMV_MAX16). Tried and dropped: building floats from small integers by OR-ing them
 * into 2^23's bits and subtracting (no faster than the conversion).
 *
 * Above QG_GEMV_MAX16_WIDE rows, where the core runs a 512-bit FMA whole, the GEMM:
 * pairs of dequantised panels under 12 x 32 tiles (gemm_tile16); on Intel's server cores,
 * whose two FMA units each run a 512-bit FMA whole, the peak doubles and so does what the
 * tile can reach. Where a 512-bit FMA is split (Zen 4), above QG_GEMV_MAX16 rows the AVX2
 * 6 x 16 GEMM runs instead: the same FMA peak, and the 12 x 32 tile with its copy of x
 * fell behind it (2 vCPUs of a Zen 4, 2026-12-07, SmolLM2's products at 2,048 rows: 175-186
 * against 199-210 GFLOP/s for the 576- and 960-column ones, level for the 3,072-column
 * one). At the engine's default 512-token steps the two are level within the VM's noise
 * (python -m loadtest.profile_offline in turns, five pairs: the GEMMs above 128 rows at
 * 194-202 GFLOP/s either way).
 */
#ifndef TANDEM_QUANT_GEMM_AVX512_H
#define TANDEM_QUANT_GEMM_AVX512_H

#define TGT5 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

/* Sixteen consecutive bytes, sign- or zero-extended to 32-bit lanes; sixteen halves. */
INLINE TGT5 __m512 s16v(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INLINE TGT5 __m512i u16v(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
INLINE TGT5 __m512 h16v(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#define B16(p) _mm512_set1_ps(*(p))

/* y[m][n0 .. n0 + 16) = v + bias, only the columns below N. */
INLINE TGT5 void store_row16(const Args *a, int64_t m, int64_t n0, __m512 v) {
    const int64_t left = a->N - n0;
    const __mmask16 k = left >= NR ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    if (a->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, a->bias + n0));
    _mm512_mask_storeu_ps(a->y + m * a->ldy + n0, k, v);
}

/* Rows of x per GEMV tile: eight rows of one vector each (with the weights and x in
 * registers, 32 of them hold that), so each weight is converted once per eight rows. */
#define MR16 8

/* The GEMV's FMA chains: eight per tile, enough to cover the FMA latency at any mr.
 * Chain of row r for its j-th product of a block: a 1-row tile cycles all eight, a
 * 2-row tile gives each row four, a 3- or 4-row tile two, wider tiles one. */
INLINE int chain16(const int mr, const int r, const int j) {
    return mr == 1 ? (j & 7) : mr == 2 ? 4 * r + (j & 3) : mr <= 4 ? 2 * r + (j & 1) : r;
}

/* Row r's chains summed. */
INLINE TGT5 __m512 fold16(const __m512 c[8], const int mr, const int r) {
    if (mr == 1)
        return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c[0], c[1]), _mm512_add_ps(c[2], c[3])),
                             _mm512_add_ps(_mm512_add_ps(c[4], c[5]), _mm512_add_ps(c[6], c[7])));
    if (mr == 2)
        return _mm512_add_ps(_mm512_add_ps(c[4 * r], c[4 * r + 1]), _mm512_add_ps(c[4 * r + 2], c[4 * r + 3]));
    if (mr <= 4) return _mm512_add_ps(c[2 * r], c[2 * r + 1]);
    return c[r];
}

/* c[chain] += x[r][k] * w for the tile's rows. */
#define FMA_TILE16(k, w, j)                                                              \
    do {                                                                                 \
        for (int r_ = 0; r_ < mr; r_++) {                                                \
            const int ch_ = chain16(mr, r_, (j));                                        \
            c[ch_] = _mm512_fmadd_ps(B16(x[r_] + (k)), (w), c[ch_]);                      \
        }                                                                                \
    } while (0)

/* x . q over one block's quants (Q8_0: int8 [32][16]; Q4: nibbles [16][16], byte row i
 * holding weights i and i + 16), each weight widened once for all the tile's rows. */
INLINE TGT5 void dot_block16(const uint8_t *q, const float *const x[MR16], const int mr, const int fmt,
                             __m512 c[8]) {
    if (fmt == Q8_0) {
#pragma GCC unroll 32
        for (int k = 0; k < QK; k++) FMA_TILE16(k, s16v(q + k * NR), k);
        return;
    }
    const __m512i mask = _mm512_set1_epi32(15);
#pragma GCC unroll 16
    for (int i = 0; i < QK / 2; i++) {
        const __m512i v = u16v(q + i * NR);
        FMA_TILE16(i, _mm512_cvtepi32_ps(_mm512_and_si512(v, mask)), 2 * i);
        FMA_TILE16(i + 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), 2 * i + 1);
    }
}

/* GEMV, block formats: rows m0 .. m0 + mr (1 to 8) of y for one panel; per block,
 * acc += d*t (+ e * the block's sum of x for Q4: e = m for Q4_1, -8d for Q4_0). */
INLINE TGT5 void gemv_tile16(const Args *g, const uint8_t *panel, int64_t n0, int64_t m0, const int mr,
                             const int fmt) {
    const int64_t kb = g->K / QK, bb = block_bytes(fmt);
    const float *x[MR16], *sx[MR16];
    for (int r = 0; r < MR16; r++) {
        x[r] = tile_row(g->x, g->ldx, m0, r, mr);
        sx[r] = g->sx ? tile_row(g->sx, kb, m0, r, mr) : NULL;
    }
    const __m512 z = _mm512_setzero_ps();
    __m512 acc[MR16] = {z, z, z, z, z, z, z, z};
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = panel + b * bb;
#if QG_PF512
        for (int64_t off = 0; off < bb; off += 64) _mm_prefetch((const char *)blk + QG_PF512 + off, _MM_HINT_T0);
#endif
        __m512 c[8] = {z, z, z, z, z, z, z, z};
        const float *xb[MR16];
        for (int r = 0; r < MR16; r++) xb[r] = x[r] + b * QK;
        dot_block16(blk + quant_offset(fmt), xb, mr, fmt, c);
        const __m512 d = h16v(blk);
        const __m512 e = fmt == Q4_1 ? h16v(blk + 32) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        for (int r = 0; r < mr; r++) {
            acc[r] = _mm512_fmadd_ps(d, fold16(c, mr, r), acc[r]);
            if (fmt != Q8_0) acc[r] = _mm512_fmadd_ps(e, B16(sx[r] + b), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) store_row16(g, m0 + r, n0, acc[r]);
}

/* GEMV, INT8_ROW: t = x . q over all of K, y = s*t. */
INLINE TGT5 void gemv_tile16_int8(const Args *g, const uint8_t *panel, int64_t n0, int64_t m0, const int mr) {
    const float *x[MR16];
    for (int r = 0; r < MR16; r++) x[r] = tile_row(g->x, g->ldx, m0, r, mr);
    const __m512 z = _mm512_setzero_ps();
    __m512 c[8] = {z, z, z, z, z, z, z, z};
    const uint8_t *q = panel + 64;
    int64_t k = 0;
    for (; k + 8 <= g->K; k += 8) {
#if QG_PF512
        _mm_prefetch((const char *)q + k * NR + QG_PF512, _MM_HINT_T0);
        _mm_prefetch((const char *)q + k * NR + QG_PF512 + 64, _MM_HINT_T0);
#endif
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) FMA_TILE16(k + j, s16v(q + (k + j) * NR), j);
    }
    for (; k < g->K; k++) FMA_TILE16(k, s16v(q + k * NR), 0);
    const __m512 s = _mm512_loadu_ps((const float *)panel);
    for (int r = 0; r < mr; r++) store_row16(g, m0 + r, n0, _mm512_mul_ps(s, fold16(c, mr, r)));
}
#undef FMA_TILE16

#define GEMV_TILE16(mr) \
    (fmt == INT8_ROW ? gemv_tile16_int8(a, panel, n0, m, mr) : gemv_tile16(a, panel, n0, m, mr, fmt))

/* All rows of x against one panel, in tiles of 8 rows and one of the rest. */
INLINE TGT5 void gemv_rows16(const Args *a, const uint8_t *panel, int64_t n0, const int fmt) {
    int64_t m = 0;
    for (; m + MR16 <= a->M; m += MR16) GEMV_TILE16(8);
    switch (a->M - m) {
        case 7: GEMV_TILE16(7); break;
        case 6: GEMV_TILE16(6); break;
        case 5: GEMV_TILE16(5); break;
        case 4: GEMV_TILE16(4); break;
        case 3: GEMV_TILE16(3); break;
        case 2: GEMV_TILE16(2); break;
        case 1: GEMV_TILE16(1); break;
        default: break;
    }
}
#undef GEMV_TILE16

/* A panel dequantised into buf [K][16], as dequant_panel_avx2 does it (the same
 * operations lane for lane, so the same floats) sixteen lanes at a time. */
static TGT5 void dequant_panel_avx512(const Args *a, const uint8_t *panel, float *buf) {
    const int fmt = a->fmt;
    if (fmt == INT8_ROW) {
        dequant_panel_avx2(a, panel, buf);
        return;
    }
    const __m512i mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int64_t b = 0; b < a->K / QK; b++) {
        const uint8_t *blk = panel + b * block_bytes(fmt), *q = blk + quant_offset(fmt);
        const __m512 d = h16v(blk);
        float *o = buf + b * QK * NR;
        if (fmt == Q8_0) {
            for (int k = 0; k < QK; k++) _mm512_storeu_ps(o + k * NR, _mm512_mul_ps(s16v(q + k * NR), d));
            continue;
        }
        const __m512 mn = fmt == Q4_1 ? h16v(blk + 32) : _mm512_setzero_ps();
        for (int i = 0; i < QK / 2; i++) { /* byte row i: weights i (low) and i + 16 (high) */
            const __m512i v = u16v(q + i * NR);
            __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_srli_epi32(v, 4);
            if (fmt == Q4_0) {
                lo = _mm512_sub_epi32(lo, eight), hi = _mm512_sub_epi32(hi, eight);
                _mm512_storeu_ps(o + i * NR, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
                _mm512_storeu_ps(o + (i + 16) * NR, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
            } else {
                _mm512_storeu_ps(o + i * NR, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), mn));
                _mm512_storeu_ps(o + (i + 16) * NR, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), mn));
            }
        }
    }
}

/* GEMM: rows of x per tile over one or two dequantised panels. 12 rows x 32 columns
 * is 24 accumulators, two panel loads and twelve broadcasts (in the FMAs' memory
 * operands) a k for 24 FMAs: the loads stay under the two FMA units' rate. The tile's
 * rows of x are first copied k-major ([K][mr], gemm_pack_x), so its twelve broadcasts
 * a k come from one cache line or two instead of twelve rows far apart (rows 6 KB
 * apart, as K = 1536's, fall into the same few L1 sets). The threads share the copy
 * (1.02-1.09x against each making its own, most on SmolLM2's narrow products, N = 576). */
#define MR5 12

/* x copied tile by tile, k-major, for every block of mc rows (tiles as
 * gemm_panels_avx512 splits a block): the block at m0 starts at xp + m0 K. Thread t of
 * T copies every T-th tile, so the threads share the copy (each whole tile one
 * thread's: no cache line written by both). */
static TGT5 void gemm_pack_x(const Args *a, int64_t mc, float *xp, int64_t t, int64_t T) {
    int64_t n = 0; /* tiles so far */
    for (int64_t m0 = 0; m0 < a->M; m0 += mc) {
        const int64_t rows = a->M - m0 < mc ? a->M - m0 : mc, tiles = (rows + MR5 - 1) / MR5;
        float *to = xp + m0 * a->K;
        for (int64_t i = 0; i < tiles; i++, n++) {
            const int64_t m = m0 + rows * i / tiles, mr = m0 + rows * (i + 1) / tiles - m;
            for (int64_t r = 0; n % T == t && r < mr; r++) {
                const float *x = a->x + (m + r) * a->ldx;
                for (int64_t k = 0; k < a->K; k++) to[k * mr + r] = x[k];
            }
            to += mr * a->K;
        }
    }
}

/* y[m0 .. m0 + mr][n0 .. n0 + 16 np) = xp @ (b0 | b1), xp the tile's rows [K][mr], b0
 * and b1 two dequantised panels [K][16] (np = 1: b0 alone); one FMA chain per element
 * over k in order from zero, then the bias, as the AVX2 tile: the same result to the bit. */
INLINE TGT5 void gemm_tile16(const Args *a, const float *xp, const float *b0, const float *b1, int64_t n0,
                             int64_t m0, const int mr, const int np) {
    const __m512 z = _mm512_setzero_ps();
    __m512 c[MR5][2];
    for (int r = 0; r < MR5; r++) c[r][0] = z, c[r][1] = z;
#pragma GCC unroll 2
    for (int64_t k = 0; k < a->K; k++) {
        const __m512 w0 = _mm512_loadu_ps(b0 + k * NR), w1 = np == 2 ? _mm512_loadu_ps(b1 + k * NR) : z;
        for (int r = 0; r < mr; r++) {
            const __m512 xv = B16(xp + k * mr + r);
            c[r][0] = _mm512_fmadd_ps(xv, w0, c[r][0]);
            if (np == 2) c[r][1] = _mm512_fmadd_ps(xv, w1, c[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        store_row16(a, m0 + r, n0, c[r][0]);
        if (np == 2) store_row16(a, m0 + r, n0 + NR, c[r][1]);
    }
}

#define GEMM_TILE16(mr) \
    (np == 2 ? gemm_tile16(a, xp, b0, b1, n0, m, mr, 2) : gemm_tile16(a, xp, b0, b1, n0, m, mr, 1))

/* Rows [m0, m1) (xp: their tiles from gemm_pack_x) against one or two dequantised
 * panels, in near-equal tiles of up to 12. */
static TGT5 void gemm_panels_avx512(const Args *a, const float *xp, const float *b0, const float *b1,
                                    int64_t n0, int64_t m0, int64_t m1, const int np) {
    const int64_t rows = m1 - m0, tiles = (rows + MR5 - 1) / MR5;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t m = m0 + rows * t / tiles, mr = m0 + rows * (t + 1) / tiles - m;
        switch (mr) {
            case 12: GEMM_TILE16(12); break;
            case 11: GEMM_TILE16(11); break;
            case 10: GEMM_TILE16(10); break;
            case 9: GEMM_TILE16(9); break;
            case 8: GEMM_TILE16(8); break;
            case 7: GEMM_TILE16(7); break;
            case 6: GEMM_TILE16(6); break;
            case 5: GEMM_TILE16(5); break;
            case 4: GEMM_TILE16(4); break;
            case 3: GEMM_TILE16(3); break;
            case 2: GEMM_TILE16(2); break;
            default: GEMM_TILE16(1); break;
        }
        xp += mr * a->K;
    }
}
#undef GEMM_TILE16

static TGT5 void gemv_panel_avx512(const Args *a, int64_t p) {
    const uint8_t *panel = a->w + p * a->pbytes;
    switch (a->fmt) {
        case Q8_0: gemv_rows16(a, panel, p * NR, Q8_0); break;
        case Q4_0: gemv_rows16(a, panel, p * NR, Q4_0); break;
        case Q4_1: gemv_rows16(a, panel, p * NR, Q4_1); break;
        default: gemv_rows16(a, panel, p * NR, INT8_ROW); break;
    }
}

#endif
