/*
 * The integer GEMV of quant_gemm.c for AVX2 CPUs (Zen 2, Zen 3, Intel before AVX-512),
 * Q4_0/Q4_1 weights and one row of x (a batch-1 decode step): the nibbles multiplied as
 * the bytes they are, as in quant_gemm_vnni.h, with vpmaddubsw standing in for
 * vpdpbusd. Included by quant_gemm.c (x86 only, target attributes, chosen at run time).
 *
 * Why: the float GEMV converts every nibble to float (a widening, a mask or shift and a
 * conversion beside each FMA); here 32 weights of 16 rows and one digit of x cost one
 * vpmaddubsw and one 16-bit add. On a Zen 2 VM (2 vCPUs, SmolLM2's 30 Q4_1 layers at one
 * row, 2 threads, a C harness, four rounds in turns): 3.56-3.69 ms from DRAM against
 * 3.94-4.04 for the float GEMV, 3.08-3.19 against 3.58-3.63 with each layer's weights
 * in cache. Each thread makes its own digit vectors (quant_linear): read from the other
 * core's cache, the 14-37 KB of them cost more than making them (the 576 x 1536 product
 * took 31 us against the float GEMV's 29 that way; 26 so). At two or more rows the float
 * tiles win (they convert a weight once for all rows, where this path multiplies it
 * again per row and digit: 170 against 127 us at two rows, one thread), and Q8_0 (the LM
 * head) is read at the memory's speed already: both stay on the float GEMV.
 *
 * Exactness: x is written in the same three signed digits per block as the VNNI path
 * (digits_make there: X = a*65536 + b*256 + c, s = 2^(E-22), 23 bits of the block's
 * largest |x|), every integer product and sum is exact, and the digit sums combine in
 * float32 in the same order, so the two integer paths give the same bits.
 *
 * Layout. A 32-byte load at byte row i of a block's quants holds rows i (low half) and
 * i+1 (high half) of 16 bytes, one per weight row j; a second at i+2 holds i+2 and i+3.
 * vpunpcklbw of the two puts, in 16-bit lane j (j < 8), row j's bytes of k = i and i+2
 * (low half) or i+1 and i+3 (high half); vpunpckhbw the same for rows 8 to 15. The low
 * nibbles are those k, the high ones k+16. vpmaddubsw against a vector of x's digits laid
 * out the same way (the pair (X[i], X[i+2]) repeated in the low half, (X[i+1], X[i+3]) in
 * the high) gives, per lane, row j's two products summed; a row's 16-bit lanes collect
 * the 8 such sums of a block (at most 8 * 2 * 15 * 128 = 30,720: no saturation), and the
 * two halves (other k, same rows) add up in 32 bits at the block's end. Per block and
 * digit g of x, the vectors xv[quad][half][g] (quad: byte rows 4q .. 4q+3; half: low or
 * high nibbles) are made once per call: 24 x 32 bytes a block.
 */
#ifndef TANDEM_QUANT_GEMM_AVX2_INT_H
#define TANDEM_QUANT_GEMM_AVX2_INT_H

/* The digits of every block of x as the vectors above, and the block scales s (dg->vec,
 * dg->scale); 0, or -1 if x holds a NaN or an infinity (or on no memory): the caller then
 * takes the float path. The digits are computed exactly as digits_make computes them. */
static TGT int digit_vectors_make(const Args *a, Digits *dg) {
    const int64_t kb = a->K / QK;
    dg->vec = aligned_alloc(32, (size_t)(a->M * kb * 24 * 32 + 32));
    dg->scale = malloc((size_t)(a->M * kb + 1) * sizeof(float));
    if (!dg->vec || !dg->scale) return digits_free(dg), -1;
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i pairs = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                           1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
    for (int64_t m = 0; m < a->M; m++)
        for (int64_t b = 0; b < kb; b++) {
            const float *x = a->x + m * a->ldx + b * QK;
            const int64_t at = m * kb + b;
            __m256 mxv = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int h = 0; h < 4; h++) { /* (vmaxps may drop a NaN: test for one apart) */
                const __m256 ax = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * h));
                mxv = _mm256_max_ps(mxv, ax);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(ax, big, _CMP_NLE_UQ));
            }
            if (_mm256_movemask_ps(bad)) return digits_free(dg), -1; /* NaN or infinity */
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mxv), _mm256_extractf128_ps(mxv, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float mx = _mm_cvtss_f32(m4);
            float up;
            dg->scale[at] = digit_scale(mx, &up);
            const __m256 vup = _mm256_set1_ps(up);
            __m256i d3[3][4]; /* digit g of x[8h .. 8h+8) as int32 */
            for (int h = 0; h < 4; h++) {
                const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * h), vup)); /* nearest */
                const __m256i c = _mm256_srai_epi32(_mm256_slli_epi32(X, 24), 24);
                const __m256i X1 = _mm256_srai_epi32(_mm256_sub_epi32(X, c), 8);
                const __m256i bb = _mm256_srai_epi32(_mm256_slli_epi32(X1, 24), 24);
                d3[0][h] = _mm256_srai_epi32(_mm256_sub_epi32(X1, bb), 8), d3[1][h] = bb, d3[2][h] = c;
            }
            int8_t dig[3][QK] __attribute__((aligned(32)));
            for (int g = 0; g < 3; g++) { /* int32 to bytes, back in k order */
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(d3[g][0], d3[g][1]),
                                                     _mm256_packs_epi32(d3[g][2], d3[g][3]));
                _mm256_store_si256((__m256i *)dig[g], _mm256_permutevar8x32_epi32(p, order));
            }
            __m256i *v = (__m256i *)(dg->vec + at * 24 * 32);
            for (int q = 0; q < 4; q++)
                for (int hh = 0; hh < 2; hh++)
                    for (int g = 0; g < 3; g++) {
                        int32_t four; /* X[i .. i+3], i = 4q (+16 for the high nibbles) */
                        memcpy(&four, dig[g] + 4 * q + 16 * hh, 4);
                        _mm256_store_si256(v + (q * 2 + hh) * 3 + g, _mm256_shuffle_epi8(_mm256_set1_epi32(four), pairs));
                    }
        }
    return 0;
}

/* The int32 sums of a row's two 16-bit halves (lanes j and j + 8 hold row j). */
INLINE TGT __m256i halves_sum(__m256i s) {
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)));
}

/* Row m of y for one panel (16 columns), Q4_0 or Q4_1. */
INLINE TGT void int_gemv_row(const Args *g, const Digits *dg, const uint8_t *panel, int64_t n0, int64_t m,
                             const int fmt) {
    const int64_t kb = g->K / QK, bb = block_bytes(fmt);
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const __m256 c256 = _mm256_set1_ps(256.0f), m8 = _mm256_set1_ps(-8.0f);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* rows 0-7, 8-15 */
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = panel + b * bb, *q = blk + quant_offset(fmt);
#if QG_PF
        for (int64_t off = 0; off < bb; off += 64) _mm_prefetch((const char *)blk + QG_PF + off, _MM_HINT_T0);
#endif
        const __m256i *v = (const __m256i *)(dg->vec + (m * kb + b) * 24 * 32);
        __m256i s[3][2]; /* [digit][rows 0-7, 8-15], 16-bit */
        for (int gg = 0; gg < 3; gg++) s[gg][0] = s[gg][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int qd = 0; qd < 4; qd++) {
            const __m256i X = _mm256_loadu_si256((const __m256i *)(q + qd * 64));
            const __m256i Y = _mm256_loadu_si256((const __m256i *)(q + qd * 64 + 32));
            const __m256i P = _mm256_unpacklo_epi8(X, Y), Q = _mm256_unpackhi_epi8(X, Y);
            const __m256i PL = _mm256_and_si256(P, lo4), PH = _mm256_and_si256(_mm256_srli_epi16(P, 4), lo4);
            const __m256i QL = _mm256_and_si256(Q, lo4), QH = _mm256_and_si256(_mm256_srli_epi16(Q, 4), lo4);
            for (int gg = 0; gg < 3; gg++) {
                const __m256i lo = _mm256_load_si256(v + (qd * 2) * 3 + gg);
                const __m256i hi = _mm256_load_si256(v + (qd * 2 + 1) * 3 + gg);
                s[gg][0] = _mm256_add_epi16(s[gg][0], _mm256_add_epi16(_mm256_maddubs_epi16(PL, lo), _mm256_maddubs_epi16(PH, hi)));
                s[gg][1] = _mm256_add_epi16(s[gg][1], _mm256_add_epi16(_mm256_maddubs_epi16(QL, lo), _mm256_maddubs_epi16(QH, hi)));
            }
        }
        const float sc = dg->scale[m * kb + b];
        for (int h = 0; h < 2; h++) { /* as the VNNI path: t = (A*256 + B)*256 + C */
            __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves_sum(s[0][h])), c256, _mm256_cvtepi32_ps(halves_sum(s[1][h])));
            t = _mm256_fmadd_ps(t, c256, _mm256_cvtepi32_ps(halves_sum(s[2][h])));
            const __m256 d = h8(blk + 16 * h);
            acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(sc)), t, acc[h]);
            const __m256 e = fmt == Q4_1 ? h8(blk + 32 + 16 * h) : _mm256_mul_ps(d, m8);
            acc[h] = _mm256_fmadd_ps(e, _mm256_set1_ps(g->sx[m * kb + b]), acc[h]);
        }
    }
    store_row(g, m, n0, acc[0], acc[1]);
}

static TGT void gemv_panel_avx2_int(const Args *a, const Digits *dg, int64_t p) {
    const uint8_t *panel = a->w + p * a->pbytes;
    for (int64_t m = 0; m < a->M; m++) {
        if (a->fmt == Q4_1) int_gemv_row(a, dg, panel, p * NR, m, Q4_1);
        else int_gemv_row(a, dg, panel, p * NR, m, Q4_0);
    }
}

#endif
