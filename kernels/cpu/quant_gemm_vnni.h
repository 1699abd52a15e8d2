/*
 * The integer GEMV of quant_gemm.c for CPUs with AVX-512 VNNI and VBMI (Zen 4, Ice Lake
 * and later): Q8_0/Q4_0/Q4_1 weights multiplied as the bytes they are, without converting
 * a single weight to float. Included by quant_gemm.c (x86 only, target attributes, chosen
 * at run time); see that file for the packed layout.
 *
 * Why: converting each weight to float is what bounds the float GEMV (a load, a widening
 * and a conversion per 16 weights beside each FMA: ~3.5 vector ops per 16 weights, on
 * pipes the FMA shares). vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and adds
 * each lane's four products into an int32: one op per 64 weights and one activation digit.
 *
 * Exactness. x stays float32 in spirit: each block of 32 elements of x is written as
 * s * X with s = 2^(E - 22), 2^E > max |x| (a power of two, so x / s is exact), and X the
 * nearest integer of 23 bits, split into three signed bytes X = a*65536 + b*256 + c. The
 * only rounding is x -> s*X, at most 2^-23 of the block's largest |x| (a float32 sum of
 * the products already rounds at 2^-24 of its partial sums); every integer product and
 * sum after it is exact, and a block's three digit sums are combined in float32 with one
 * rounding (their total stays under 2^31). So the result is x . w to float32 accuracy,
 * like the float paths, not an 8-bit approximation of it (llama.cpp's Q8 activations).
 * Where x holds a NaN or infinity the caller takes the float path instead.
 *
 * Layout. A 64-byte load of a panel holds 4 byte rows of its 16 weight rows; one vpermb
 * puts row j's 4 bytes (4 consecutive k; Q4: the low nibbles k .. k+3, the high ones
 * k+16 .. k+19) into lane j, as vpdpbusd wants. Q4 nibbles are the unsigned operand as
 * they are; Q8_0 codes are made unsigned by XOR 0x80 (q + 128), and 128 * (the block's
 * digit sum) comes off again. Per block and row of x:
 *   t = (A*256 + B)*256 + C   (A, B, C: the digit products summed, exact integers)
 *   acc += (d*s) * t  (+ e * sum(x) for Q4, e = m (Q4_1) or -8d (Q4_0), as the float path)
 */
#ifndef TANDEM_QUANT_GEMM_VNNI_H
#define TANDEM_QUANT_GEMM_VNNI_H

#define TGTV __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,f16c")))

/* Rows of x per tile: 3 int32 accumulators per row, the float sums, the weights and the
 * constants fit the 32 registers at 4. */
#define MRV 4

/* The digits of every block of x (see the top); 0, or -1 if x holds a NaN or an infinity
 * (or on no memory): the caller then takes the float path. Per block, vectorised: the
 * largest |x| gives E (its exponent field, so 2^E > max |x|; E >= -100, so that tiny
 * blocks keep their scales normal floats), x * 2^(22 - E) is exact and rounds to X at
 * the nearest integer, and X splits into signed bytes c = X's low byte, b, then a. */
static TGTV int digits_make(const Args *a, Digits *dg) {
    const int64_t kb = a->K / QK;
    dg->dig = malloc((size_t)(a->M * kb * 3 * QK));
    dg->scale = malloc((size_t)(a->M * kb) * sizeof(float));
    dg->dsum = malloc((size_t)(a->M * kb * 3) * sizeof(int32_t));
    if (!dg->dig || !dg->scale || !dg->dsum) return digits_free(dg), -1;
    const __m512 sign = _mm512_set1_ps(-0.0f), big = _mm512_set1_ps(FLT_MAX);
    for (int64_t m = 0; m < a->M; m++)
        for (int64_t b = 0; b < kb; b++) {
            const float *x = a->x + m * a->ldx + b * QK;
            const int64_t at = m * kb + b;
            const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
            const __m512 a0 = _mm512_andnot_ps(sign, x0), a1 = _mm512_andnot_ps(sign, x1);
            /* NaN or infinity (tested apart: vmaxps may drop a NaN operand) */
            if (_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ))
                return digits_free(dg), -1;
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            float up;
            dg->scale[at] = digit_scale(mx, &up);
            const __m512 vup = _mm512_set1_ps(up);
            int8_t *dig = dg->dig + at * 3 * QK;
            __m512i sum[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int h = 0; h < 2; h++) {
                const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, vup)); /* nearest */
                const __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(X, 24), 24);
                const __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, c), 8);
                const __m512i bb = _mm512_srai_epi32(_mm512_slli_epi32(X1, 24), 24);
                const __m512i aa = _mm512_srai_epi32(_mm512_sub_epi32(X1, bb), 8); /* |aa| <= 64 */
                const __m512i d3[3] = {aa, bb, c};
                for (int g = 0; g < 3; g++) {
                    _mm_storeu_si128((__m128i *)(dig + g * QK + 16 * h), _mm512_cvtepi32_epi8(d3[g]));
                    sum[g] = _mm512_add_epi32(sum[g], d3[g]);
                }
            }
            for (int g = 0; g < 3; g++) dg->dsum[at * 3 + g] = _mm512_reduce_add_epi32(sum[g]);
        }
    return 0;
}

/* Byte p = 4j + t of the result is byte 16t + j of the load: row j's four byte rows. */
INLINE TGTV __m512i lanes_of_rows(const uint8_t *p, __m512i idx) {
    return _mm512_permutexvar_epi8(idx, _mm512_loadu_si512((const void *)p));
}

/* Four digit bytes as one int32, broadcast. */
INLINE TGTV __m512i dig4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* s[r][digit][set] += w (unsigned bytes) . digits of row r at k (four of them). */
#define DP_ROWS(w, k, set)                                                                  \
    do {                                                                                    \
        for (int r_ = 0; r_ < mr; r_++)                                                     \
            for (int g_ = 0; g_ < 3; g_++)                                                  \
                s[r_][g_][set] = _mm512_dpbusd_epi32(s[r_][g_][set], (w), dig4(d[r_] + g_ * QK + (k))); \
    } while (0)

/* GEMV: rows m0 .. m0 + mr (1 to 4) of y for one panel, block formats. */
INLINE TGTV void vnni_tile(const Args *g, const Digits *dg, const uint8_t *panel, int64_t n0,
                           int64_t m0, const int mr, const int fmt) {
    const int64_t kb = g->K / QK, bb = block_bytes(fmt);
    const __m512i lo4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512i idx;
    {
        uint8_t ix[64];
        for (int j = 0; j < 16; j++)
            for (int t = 0; t < 4; t++) ix[4 * j + t] = (uint8_t)(16 * t + j);
        idx = _mm512_loadu_si512((const void *)ix);
    }
    int64_t row[MRV];
    for (int r = 0; r < MRV; r++) row[r] = m0 + (r < mr ? r : 0);
    const __m512 z = _mm512_setzero_ps();
    __m512 acc[MRV] = {z, z, z, z};
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = panel + b * bb, *q = blk + quant_offset(fmt);
#if QG_PF512
        for (int64_t off = 0; off < bb; off += 64) _mm_prefetch((const char *)blk + QG_PF512 + off, _MM_HINT_T0);
#endif
        const int8_t *d[MRV];
        for (int r = 0; r < MRV; r++) d[r] = dg->dig + (row[r] * kb + b) * 3 * QK;
        const __m512i zi = _mm512_setzero_si512();
        __m512i s[MRV][3][2];
        for (int r = 0; r < MRV; r++)
            for (int gg = 0; gg < 3; gg++) s[r][gg][0] = zi, s[r][gg][1] = zi;
        if (fmt == Q8_0) {
#pragma GCC unroll 8
            for (int k = 0; k < QK; k += 4) {
                const __m512i w = _mm512_xor_si512(lanes_of_rows(q + k * NR, idx), flip);
                DP_ROWS(w, k, mr == 1 ? (k >> 2) & 1 : 0);
            }
        } else {
#pragma GCC unroll 4
            for (int i = 0; i < QK / 2; i += 4) {
                const __m512i v = lanes_of_rows(q + i * NR, idx);
                const __m512i lo = _mm512_and_si512(v, lo4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                DP_ROWS(lo, i, 0);
                DP_ROWS(hi, i + 16, mr == 1 ? 1 : 0);
            }
        }
        const __m512 dv = h16v(blk);
        const __m512 e = fmt == Q4_1 ? h16v(blk + 32) : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
        for (int r = 0; r < mr; r++) {
            const int64_t at = row[r] * kb + b;
            __m512i sum[3];
            for (int gg = 0; gg < 3; gg++) {
                sum[gg] = mr == 1 ? _mm512_add_epi32(s[r][gg][0], s[r][gg][1]) : s[r][gg][0];
                if (fmt == Q8_0) /* the codes went in as q + 128 */
                    sum[gg] = _mm512_sub_epi32(sum[gg], _mm512_set1_epi32(128 * dg->dsum[at * 3 + gg]));
            }
            const __m512 c256 = _mm512_set1_ps(256.0f);
            __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0]), c256, _mm512_cvtepi32_ps(sum[1]));
            t = _mm512_fmadd_ps(t, c256, _mm512_cvtepi32_ps(sum[2]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(dg->scale[at])), t, acc[r]);
            if (fmt != Q8_0) acc[r] = _mm512_fmadd_ps(e, B16(g->sx + at), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) store_row16(g, m0 + r, n0, acc[r]);
}
#undef DP_ROWS

/* All rows of x against one panel, in tiles of 4 rows and one of the rest. */
INLINE TGTV void vnni_rows(const Args *a, const Digits *dg, const uint8_t *panel, int64_t n0, const int fmt) {
    int64_t m = 0;
    for (; m + MRV <= a->M; m += MRV) vnni_tile(a, dg, panel, n0, m, 4, fmt);
    switch (a->M - m) {
        case 3: vnni_tile(a, dg, panel, n0, m, 3, fmt); break;
        case 2: vnni_tile(a, dg, panel, n0, m, 2, fmt); break;
        case 1: vnni_tile(a, dg, panel, n0, m, 1, fmt); break;
        default: break;
    }
}

static TGTV void gemv_panel_vnni(const Args *a, const Digits *dg, int64_t p) {
    const uint8_t *panel = a->w + p * a->pbytes;
    switch (a->fmt) {
        case Q8_0: vnni_rows(a, dg, panel, p * NR, Q8_0); break;
        case Q4_0: vnni_rows(a, dg, panel, p * NR, Q4_0); break;
        default: vnni_rows(a, dg, panel, p * NR, Q4_1); break;
    }
}

#endif
