/*
 * Element conversions of the quantised KV-cache format (kernels/kv_quant.py owns the
 * format; this header is its C half, shared by kv_cache_quant.c and paged_attention.c).
 *
 *   int8: code = rint(clamp(x / scale, -127, 127)) as two's complement
 *   fp8:  code = e4m3fn(clamp(x / scale, -448, 448)), round to nearest even
 *
 * The decoders return the fp32 value before scaling, except fp8's *_f16 forms, which
 * return value / 256 (an e4m3 code shifted into an fp16 bit pattern, widened by F16C):
 * callers fold FP8_F16_FACTOR into the scale they multiply by anyway.
 */
#ifndef TANDEM_KVQ_H
#define TANDEM_KVQ_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { KVQ_INT8 = 0, KVQ_FP8 = 1 };
#define FP8_F16_FACTOR 256.0f

/* Round to nearest even for |y| < 2^22 (gcc keeps the two adds without -ffast-math). */
INLINE float kvq_rint(float y) { return (y + 12582912.0f) - 12582912.0f; }

INLINE float kvq_qmax(int fmt) { return fmt == KVQ_INT8 ? 127.0f : 448.0f; }

INLINE uint8_t fp8_encode(float y) { /* |y| <= 448 */
    uint32_t bits, mag;
    memcpy(&bits, &y, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const float a = y < 0.0f ? -y : y;
    if (a < 0.015625f) return sign | (uint8_t)kvq_rint(a * 512.0f); /* subnormal: m * 2^-9 */
    memcpy(&mag, &a, sizeof mag);
    mag += 0x7ffffu + ((mag >> 20) & 1u); /* round 23 mantissa bits to 3, ties to even */
    return sign | (uint8_t)((mag >> 20) - (120u << 3)); /* rebias exponent 127 -> 7 */
}

INLINE float fp8_decode(uint8_t c) {
    const uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    float a;
    if (e == 0) {
        a = (float)m * 0.001953125f; /* 2^-9 */
    } else {
        uint32_t bits = ((e + 120u) << 23) | (m << 20);
        memcpy(&a, &bits, sizeof a);
    }
    return (c & 0x80u) ? -a : a;
}

INLINE uint8_t kvq_encode(float y, int fmt) {
    const float q = kvq_qmax(fmt);
    y = y > q ? q : (y < -q ? -q : y);
    if (fmt == KVQ_INT8) return (uint8_t)(int8_t)kvq_rint(y);
    return fp8_encode(y);
}

INLINE float kvq_decode(uint8_t c, int fmt) {
    return fmt == KVQ_INT8 ? (float)(int8_t)c : fp8_decode(c);
}

/* fp8 code -> the fp16 bit pattern of value / 256 (same sign, exponent and mantissa bits). */
INLINE uint16_t fp8_as_f16(uint8_t c) {
    return (uint16_t)(((c & 0x80u) << 8) | ((c & 0x7fu) << 7));
}

#if defined(__AVX2__) && defined(__FMA__)
/* Eight int8 codes -> fp32 values before scaling. */
INLINE __m256 i8_load8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Eight fp8 codes -> fp32 values / 256. Sign-extended to 16 bits and shifted left by 7,
 * a code's sign lands in bit 15 (from the extension) and again in bit 14, which is
 * cleared: what is left is fp8_as_f16's pattern, in three integer instructions. */
INLINE __m256 fp8_load8_f16(const uint8_t *p) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xbf80));
    return _mm256_cvtph_ps(h);
}
#endif

#endif
