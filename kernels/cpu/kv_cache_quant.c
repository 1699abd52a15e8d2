/*
 * Writing into and reading out of the quantised KV cache on the CPU (int8 or fp8 codes
 * with per block, per kv head fp32 scales; the format and the scale rule are documented
 * in kernels/kv_quant.py, whose torch functions are the oracle). Loader:
 * kernels/cpu_kv_cache.py. Plain C + OpenMP; AVX2 for the dequantising gather.
 *
 * One call handles K or V of one layer:
 *   x           [T, KVH, D] float32, element (t, h, d) at x + t*x_tok + h*x_head + d
 *   slots       int64 [T], slot = block * BS + offset
 *   codes       uint8, (blk, tok, h, d) at codes + blk*code_block + (tok*KVH + h)*D + d
 *   scales      float32, (blk, h) at scales + blk*scale_block + h
 */
#include <stdint.h>
#include <stdlib.h>

#include "kvq.h"

typedef struct {
    uint8_t *codes;
    float *scales;
    int64_t code_block, scale_block;
    int BS, KVH, D, fmt;
} Cache;

INLINE uint8_t *row(const Cache *c, int64_t blk, int tok, int h) {
    return c->codes + blk * c->code_block + ((int64_t)tok * c->KVH + h) * c->D;
}

/* The earlier rows [0, first) of head h, from scale old to scale new (new > old). */
static void requantise(const Cache *c, int64_t blk, int h, int first, float old, float new) {
    for (int t = 0; t < first; t++) {
        uint8_t *r = row(c, blk, t, h);
        for (int d = 0; d < c->D; d++)
            r[d] = kvq_encode(kvq_decode(r[d], c->fmt) * old / new, c->fmt);
    }
}

/* One run: tokens [t0, t1) of x, all in block blk, the first at offset `first`. */
static void write_run(const Cache *c, const float *x, int64_t x_tok, int64_t x_head,
                      const int64_t *slots, int t0, int t1, int64_t blk, int first) {
    for (int h = 0; h < c->KVH; h++) {
        float amax = 0.0f;
        for (int t = t0; t < t1; t++) {
            const float *xs = x + t * x_tok + h * x_head;
            for (int d = 0; d < c->D; d++) {
                const float a = xs[d] < 0.0f ? -xs[d] : xs[d];
                amax = a > amax ? a : amax;
            }
        }
        const float need = amax / kvq_qmax(c->fmt);
        float *sp = c->scales + blk * c->scale_block + h;
        const float old = *sp;
        const float scale = first == 0 || need > old ? need : old;
        if (first > 0 && scale > old) requantise(c, blk, h, first, old, scale);
        *sp = scale;
        for (int t = t0; t < t1; t++) {
            const float *xs = x + t * x_tok + h * x_head;
            uint8_t *r = row(c, blk, (int)(slots[t] % c->BS), h);
            for (int d = 0; d < c->D; d++)
                r[d] = scale > 0.0f ? kvq_encode(xs[d] / scale, c->fmt) : 0;
        }
    }
}

/* 0, or -(t+1) if slots[t] is outside [0, num_blocks * BS). */
int kv_quant_write(int fmt, const float *x, int64_t x_tok, int64_t x_head, const int64_t *slots,
                   int T, uint8_t *codes, float *scales, int64_t code_block,
                   int64_t scale_block, int64_t num_blocks, int BS, int KVH, int D) {
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * BS) return -(t + 1);
    const Cache c = {codes, scales, code_block, scale_block, BS, KVH, D, fmt};
    for (int t0 = 0, t1; t0 < T; t0 = t1) {
        const int64_t blk = slots[t0] / BS;
        for (t1 = t0 + 1; t1 < T && slots[t1] / BS == blk; t1++) {
        }
        write_run(&c, x, x_tok, x_head, slots, t0, t1, blk, (int)(slots[t0] % BS));
    }
    return 0;
}

/* dst[0:n] = scale * decode(src[0:n]) for one head row. */
INLINE void dequant_row(const uint8_t *src, float scale, int n, int fmt, float *dst) {
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (fmt == KVQ_INT8) {
        const __m256 s = _mm256_set1_ps(scale);
        for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(i8_load8(src + d), s));
    } else {
        const __m256 s = _mm256_set1_ps(scale * FP8_F16_FACTOR);
        for (; d + 8 <= n; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(fp8_load8_f16(src + d), s));
    }
#endif
    for (; d < n; d++) dst[d] = kvq_decode(src[d], fmt) * scale;
}

/* out [n, KVH, D] float32 = the first n positions of a sequence whose blocks are ids[].
 * 0, or -(j+1) if ids[j] is outside [0, num_blocks). */
int kv_quant_gather(int fmt, const uint8_t *codes, const float *scales, int64_t code_block,
                    int64_t scale_block, int64_t num_blocks, const int32_t *ids, int n, int BS,
                    int KVH, int D, float *out, int num_threads) {
    const int nb = (n + BS - 1) / BS;
    for (int j = 0; j < nb; j++)
        if (ids[j] < 0 || ids[j] >= num_blocks) return -(j + 1);
    const Cache c = {(uint8_t *)codes, (float *)scales, code_block, scale_block, BS, KVH, D, fmt};
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && nb > 1)
    for (int j = 0; j < nb; j++) {
        const float *s = scales + ids[j] * scale_block;
        for (int t = j * BS; t < n && t < (j + 1) * BS; t++)
            for (int h = 0; h < KVH; h++)
                dequant_row(row(&c, ids[j], t - j * BS, h), s[h], D, fmt,
                            out + ((int64_t)t * KVH + h) * D);
    }
    return 0;
}

/* 1 if this build uses AVX2 for the gather, 0 for the scalar fallback. */
int kv_quant_simd_level(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
