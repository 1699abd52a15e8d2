/*
 * AVX2 helpers shared by the CPU kernels in this directory (each kernel is one C file
 * that includes this; kernels/cpu_build.py hashes the included headers into the build
 * key, so editing this rebuilds them).
 */
#ifndef TANDEM_SIMD_H
#define TANDEM_SIMD_H

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>

/* The sum of the eight lanes of a. */
INLINE float hsum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x), Cephes-style range reduction and polynomial: 2^n * P(r), |rel err| < 2e-7;
 * 0 below -87.3, +inf above 88.7, NaN stays NaN. The constants are shared by exp8 and
 * exp16_nonpositive (AVX-512), which take the same steps lane for lane. */
#define EXP_LO -87.3f
#define EXP_HI 88.7f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 = HI + LO, HI exact in few bits */
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

INLINE __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_LO), hi = _mm256_set1_ps(EXP_HI);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x)); /* operand order keeps a NaN x */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two factors, so that n = 128 (x near 88.7) does not overflow the exponent */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_blendv_ps(_mm256_andnot_ps(under, y), _mm256_set1_ps(INFINITY), over);
}

#if defined(__AVX512F__)
/* exp(x) = 2^n * p for x already clamped to [EXP_LO, EXP_HI]: n = round(x log2 e), p the
 * polynomial of the rest: exp8's constants and steps on sixteen lanes. */
INLINE __m512 exp16_reduced(__m512 x, __m512 *n_out) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    *n_out = n;
    return _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}

/* exp8 on sixteen lanes for x <= 0 or -inf (e.g. scores less their running max), in fewer
 * steps: no overflow branch, and 2^n applied by one scalef. The same value as exp8's lane
 * wherever that is a normal float, and 0 below EXP_LO as there. */
INLINE __m512 exp16_nonpositive(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    __m512 n;
    const __m512 p = exp16_reduced(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), &n);
    return _mm512_maskz_scalef_ps((__mmask16)~under, p, n);
}
#endif
#endif

#endif
