/*
 * Fused paged decode attention for the CPU: one query per sequence attends to every
 * cached position of that sequence. Plain C + OpenMP, no torch headers; the loader is
 * kernels/cpu_attention.py, the oracle is kernels/reference.py (paged_decode_attention).
 *
 * Layout (element strides, not bytes):
 *   q, out        [B, H, D] float32, contiguous
 *   k/v cache     element (blk, tok, kvh, d) at base + blk*block_stride + tok*token_stride
 *                 + kvh*head_stride + d; element type float32, float16 or bfloat16, or
 *                 one-byte int8 / fp8 codes with fp32 scales per (block, kv head)
 *   block_tables  int32 [B, *], row i at block_tables + i*bt_stride
 *   context_lens  int32 [B]
 * Query head h reads kv head h / (H / KVH).
 *
 * A work item is a sequence (all its kv heads, whose rows it reads front to back). When
 * there are too few to keep the threads busy (a step of one to a few sequences), it is a
 * part of a sequence's tokens, at least PA_MIN_PART_TOKENS long, whose unnormalised
 * output, max and sum are merged afterwards (flash-decoding's split); sequences too short
 * for that and fewer than the threads are split by kv head instead. Against items of one
 * kv head each (the split used before for under 4 sequences a thread), on 2 threads of a
 * Zen 4: one sequence of 1,024 tokens 1.4x, three of 512 1.5x, five of 400 1.5x. All
 * G = H/KVH query heads of a kv head are computed together, so each K/V row is read from
 * memory once. Two passes:
 *   1. scores[qh][t] = scale * q[qh].K[t]  (into a per-thread buffer, max context long)
 *   2. p = exp(scores - max), out[qh] = sum_t p[qh][t] V[t] / sum_t p[qh][t]
 * Float32 accumulation throughout, no -ffast-math: AVX2+FMA intrinsics where the build
 * has them (register tiles; a polynomial exp with < 2e-7 relative error), scalar C
 * otherwise (also for head_dim not a multiple of 8). On AVX-512 a float32 cache with
 * head_dim 64 and up to 3 query heads per kv head takes zmm passes instead (see
 * "AVX-512, float32" below): 1.3x the AVX2 tiles' speed from DRAM, 1.9x from cache.
 *
 * Memory: the blocks of a sequence are scattered, and a core that stalls on a K/V miss
 * does no arithmetic meanwhile, so both passes software-prefetch the rows they will need
 * a little later, spread evenly through the arithmetic (a few lines per inner
 * iteration) rather than in bursts that would fill the core's miss buffers.
 *
 * Return value: 0 on success, -(i+1) if context_lens[i] is negative or exceeds
 * max_blocks * block_size, -(B+i+1) if a block id used by sequence i is outside
 * [0, num_blocks), -(2B+1) if scratch memory could not be allocated. Validation runs
 * before any output is written.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* sysconf: the L2's size */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PA_AVX2 1
#else
#define PA_AVX2 0
#endif

#include "simd.h" /* INLINE, hsum1, exp8 */
#include "kvq.h"  /* int8 / fp8 codes of a quantised cache */

/* Rows (tokens) the score pass prefetches ahead of the ones it computes; 0 disables
 * software prefetch in both passes. */
#ifndef PA_PREFETCH_ROWS
#define PA_PREFETCH_ROWS 16
#endif

/* Tokens per chunk of the value pass: a chunk's rows (all heads of the item) stay in L1
 * while every (head, query, d) tile sweeps them; the next chunk is prefetched meanwhile. */
#ifndef PA_VALUE_CHUNK
#define PA_VALUE_CHUNK 32
#endif

/* Sequences per thread below which each one's tokens are split into parts (see run); a
 * step of fewer sequences than threads takes one part per thread instead. One sequence on
 * 2 threads of a Zen 2 (SmolLM2's 30 layers, K/V from DRAM, a C harness, two rounds in
 * turns): 2 parts against 8 at 512 tokens 39.2-39.8 against 46.4-47.3 us a layer, 768
 * 70.9-71.6 against 80.4-84.8, 1,024 92.9-102.4 against 108.5-113.4; level at 256 and
 * 2,048. */
#ifndef PA_MIN_ITEMS_PER_THREAD
#define PA_MIN_ITEMS_PER_THREAD 4
#endif

/* Fewest tokens of a part when an item's tokens are split. */
#ifndef PA_MIN_PART_TOKENS
#define PA_MIN_PART_TOKENS 128
#endif

/* Cache element types to build: -DPA_DTYPE=0 (float32), 1 (float16), 2 (bfloat16),
 * 3 (int8 codes) or 4 (fp8 e4m3 codes) for one, all five by default. Each costs about a
 * second of compile time. Quantised caches carry per (block, kv head) scales: the score
 * of token t is scaled by its K scale after the dot product, and its softmax weight by
 * its V scale before the value pass, so the tiles below only widen codes to floats. */
#ifndef PA_DTYPE
#define PA_DTYPE -1
#endif
#define PA_WITH(dt) (PA_DTYPE < 0 || PA_DTYPE == (dt))

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_I8 = 3, DT_FP8 = 4 };

/* ---------------------------------------------------------------- element loads */

INLINE float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* fp8 codes load as value / FP8_F16_FACTOR; run_item folds the factor into the scales. */
INLINE float load1(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)base)[i];
    if (dt == DT_I8) return (float)((const int8_t *)base)[i];
    if (dt == DT_FP8) return half_to_float(fp8_as_f16(((const uint8_t *)base)[i]));
    uint16_t h = ((const uint16_t *)base)[i];
    if (dt == DT_F16) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if PA_AVX2
INLINE __m256 load8(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)base + i);
    if (dt == DT_I8) return i8_load8((const uint8_t *)base + i);
    if (dt == DT_FP8) return fp8_load8_f16((const uint8_t *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Sum of each of eight vectors, as one vector: r[j] = sum(a[j]). */
INLINE __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
    __m256 t01 = _mm256_hadd_ps(a0, a1), t23 = _mm256_hadd_ps(a2, a3);
    __m256 t45 = _mm256_hadd_ps(a4, a5), t67 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t01, t23), u1 = _mm256_hadd_ps(t45, t67);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Sum of each of four vectors: r[j] = sum(a[j]). */
INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#endif

/* ---------------------------------------------------------------- work item, prefetch */

/* One work item: NH kv heads of one sequence, G query heads each, n tokens. rows[t]
 * points at token t's row of the item's first kv head; head hh is hh*head_bytes on. */
typedef struct {
    int n, NH, G, D, head_bytes, row_bytes;
} Item;

/* A cursor over the cache lines of rows[t0:t1] (all NH heads), for spreading prefetches
 * through the arithmetic: step() issues the next k of them. */
typedef struct {
    const void *const *rows;
    int t, end, hh, byte;
} Prefetch;

INLINE Prefetch prefetch_range(const void *const *rows, int t0, int t1) {
    Prefetch p = {rows, t0, t1, 0, 0};
    return p;
}

INLINE void prefetch_step(const Item *it, Prefetch *p, int k) {
#if PA_PREFETCH_ROWS > 0
    for (; k > 0 && p->t < p->end; k--) {
        __builtin_prefetch((const char *)p->rows[p->t] + (int64_t)p->hh * it->head_bytes +
                           p->byte);
        p->byte += 64;
        if (p->byte >= it->row_bytes) {
            p->byte = 0;
            if (++p->hh == it->NH) p->hh = 0, p->t++;
        }
    }
#else
    (void)it, (void)p, (void)k;
#endif
}

/* Cache lines per row of all the item's heads. */
INLINE int lines_per_row(const Item *it) { return it->NH * ((it->row_bytes + 63) / 64); }

/* ---------------------------------------------------------------- pass 1: scores */

#if PA_AVX2
/* s[g*n + j] = scale * q[g] . K[j] for g < GT, j < T: a register tile, each K vector
 * loaded once for all GT query heads. GT in {1, 2} and T in {4, 8} are compile-time
 * constants at each call site. pf_k lines of pf are prefetched per 8-float step. */
INLINE void score_tile(const Item *it, const float *q, const void *const *rows, int64_t off,
                       __m256 vscale, float *s, Prefetch *pf, int pf_k, int GT, int T, int dt) {
    const int D = it->D;
    const char *r[8];
    for (int j = 0; j < T; j++) r[j] = (const char *)rows[j] + off;
    __m256 acc[2][8];
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < T; j++) acc[g][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        prefetch_step(it, pf, pf_k);
        __m256 qv[2];
        for (int g = 0; g < GT; g++) qv[g] = _mm256_loadu_ps(q + (int64_t)g * D + d);
        for (int j = 0; j < T; j++) {
            __m256 kv = load8(r[j], d, dt);
            for (int g = 0; g < GT; g++) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
        }
    }
    for (int g = 0; g < GT; g++) {
        float *sg = s + (int64_t)g * it->n;
        if (T == 8) {
            __m256 v = hsum8(acc[g][0], acc[g][1], acc[g][2], acc[g][3], acc[g][4], acc[g][5],
                             acc[g][6], acc[g][7]);
            _mm256_storeu_ps(sg, _mm256_mul_ps(v, vscale));
        } else {
            __m128 v = hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            _mm_storeu_ps(sg, _mm_mul_ps(v, _mm256_castps256_ps128(vscale)));
        }
    }
}

/* Tokens [t, t+8) of every query head: pairs of query heads in 4-token tiles, a last odd
 * one in an 8-token tile. Prefetches the lines of 8 rows, PA_PREFETCH_ROWS ahead. */
INLINE void score_group8(const Item *it, const float *q, const void *const *rows, int t,
                         __m256 vscale, float *s, Prefetch *pf, int dt) {
    const int G = it->G, steps = it->NH * ((G / 2) * 2 + (G & 1)) * (it->D / 8);
    const int pf_k = (8 * lines_per_row(it) + steps - 1) / steps;
    for (int hh = 0; hh < it->NH; hh++) {
        const int64_t off = (int64_t)hh * it->head_bytes;
        int g = 0;
        for (; g + 2 <= G; g += 2) {
            const int64_t qh = hh * G + g;
            const float *qq = q + qh * it->D;
            float *ss = s + qh * it->n + t;
            for (int half = 0; half < 8; half += 4)
                score_tile(it, qq, rows + t + half, off, vscale, ss + half, pf, pf_k, 2, 4, dt);
        }
        if (g < G) {
            const int64_t qh = hh * G + g;
            score_tile(it, q + qh * it->D, rows + t, off, vscale, s + qh * it->n + t, pf, pf_k,
                       1, 8, dt);
        }
    }
}
#endif

/* s[qh*n + t] = scale * q[qh] . K[t][qh / G], for qh < NH*G, t < n. */
INLINE void scores_pass(const Item *it, const float *q, const void *const *rows, float scale,
                        float *s, int dt) {
    const int n = it->n, G = it->G, D = it->D;
    int t = 0;
#if PA_AVX2
    if ((D & 7) == 0) {
        const int ahead = PA_PREFETCH_ROWS < n ? PA_PREFETCH_ROWS : n;
        Prefetch first = prefetch_range(rows, 0, ahead), pf = prefetch_range(rows, ahead, n);
        prefetch_step(it, &first, ahead * lines_per_row(it));
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= n; t += 8) score_group8(it, q, rows, t, vscale, s, &pf, dt);
        for (; t < n; t++) {
            for (int qh = 0; qh < it->NH * G; qh++) {
                const char *r = (const char *)rows[t] + (int64_t)(qh / G) * it->head_bytes;
                const float *qg = q + (int64_t)qh * D;
                __m256 a = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(r, d, dt), a);
                s[(int64_t)qh * n + t] = hsum1(a) * scale;
            }
        }
        return;
    }
#endif
    for (; t < n; t++) {
        for (int qh = 0; qh < it->NH * G; qh++) {
            const char *r = (const char *)rows[t] + (int64_t)(qh / G) * it->head_bytes;
            const float *qg = q + (int64_t)qh * D;
            float a = 0.0f;
            for (int d = 0; d < D; d++) a += qg[d] * load1(r, d, dt);
            s[(int64_t)qh * n + t] = a * scale;
        }
    }
}

/* ---------------------------------------------------------------- softmax */

/* p = exp(s - max(s)) in place; returns sum(p), and max(s) in *max_out. */
static float softmax_unnormalised(float *s, int n, float *max_out) {
    int t = 0;
    float m = -INFINITY, sum = 0.0f;
#if PA_AVX2
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(s + t), vmax);
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    t = 0;
#if PA_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    sum = hsum1(vsum);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    *max_out = m;
    return sum;
}

/* ---------------------------------------------------------------- pass 2: values */

#if PA_AVX2
/* out[g][d0 : d0+8*DV] += sum_j p[g*n + j] * rows[j][d0 : ...] over j < cn, for g < GT.
 * GT in 1..3 and DV in {1, 4} are compile-time constants at each call site. */
INLINE void value_tile(const Item *it, const float *p, const void *const *rows, int cn,
                       int64_t off, int d0, float *out, Prefetch *pf, int pf_k, int GT, int DV,
                       int dt) {
    __m256 acc[3][4];
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < DV; j++)
            acc[g][j] = _mm256_loadu_ps(out + (int64_t)g * it->D + d0 + 8 * j);
    for (int t = 0; t < cn; t++) {
        prefetch_step(it, pf, pf_k);
        const char *r = (const char *)rows[t] + off;
        __m256 pg[3];
        for (int g = 0; g < GT; g++) pg[g] = _mm256_broadcast_ss(p + (int64_t)g * it->n + t);
        for (int j = 0; j < DV; j++) {
            __m256 v = load8(r, d0 + 8 * j, dt);
            for (int g = 0; g < GT; g++) acc[g][j] = _mm256_fmadd_ps(pg[g], v, acc[g][j]);
        }
    }
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < DV; j++)
            _mm256_storeu_ps(out + (int64_t)g * it->D + d0 + 8 * j, acc[g][j]);
}

/* All d tiles of GT query heads (starting at qh, all of kv head qh / G) over one chunk. */
INLINE void value_tiles_d(const Item *it, const float *p, const void *const *rows, int cn,
                          int qh, float *out, Prefetch *pf, int pf_k, int GT, int dt) {
    const int64_t off = (int64_t)(qh / it->G) * it->head_bytes;
    const float *pq = p + (int64_t)qh * it->n;
    float *oq = out + (int64_t)qh * it->D;
    int d0 = 0;
    for (; d0 + 32 <= it->D; d0 += 32)
        value_tile(it, pq, rows, cn, off, d0, oq, pf, pf_k, GT, 4, dt);
    for (; d0 < it->D; d0 += 8) value_tile(it, pq, rows, cn, off, d0, oq, pf, pf_k, GT, 1, dt);
}

/* Sweeps (tiles) per chunk of the value pass. */
INLINE int value_sweeps(const Item *it) {
    return it->NH * ((it->G + 2) / 3) * (it->D / 32 + (it->D % 32) / 8);
}

/* out[qh] += sum over the chunk's cn tokens, every query head; pf_k lines of pf per
 * token step. */
INLINE void value_chunk(const Item *it, const float *p, const void *const *rows, int cn,
                        float *out, Prefetch *pf, int pf_k, int dt) {
    const int G = it->G;
    for (int hh = 0; hh < it->NH; hh++) {
        int g = 0, qh = hh * G;
        for (; g + 3 <= G; g += 3) value_tiles_d(it, p, rows, cn, qh + g, out, pf, pf_k, 3, dt);
        if (G - g == 2)
            value_tiles_d(it, p, rows, cn, qh + g, out, pf, pf_k, 2, dt);
        else if (G - g == 1)
            value_tiles_d(it, p, rows, cn, qh + g, out, pf, pf_k, 1, dt);
    }
}
#endif

/* Before the value pass: start fetching its first chunk. */
INLINE void values_prefetch_first(const Item *it, const void *const *rows) {
#if PA_AVX2
    const int first = it->n < PA_VALUE_CHUNK ? it->n : PA_VALUE_CHUNK;
    Prefetch pf = prefetch_range(rows, 0, first);
    prefetch_step(it, &pf, first * lines_per_row(it));
#else
    (void)it, (void)rows;
#endif
}

/* out[qh] = inv[qh] * sum_t p[qh*n + t] * V[t][qh / G], for qh < NH*G. */
INLINE void values_pass(const Item *it, const float *p, const void *const *rows,
                        const float *inv, float *out, int dt) {
    const int n = it->n, D = it->D, NQ = it->NH * it->G;
    memset(out, 0, sizeof(float) * (size_t)NQ * D);
#if PA_AVX2
    if ((D & 7) == 0) {
        const int per_token = value_sweeps(it), lines = lines_per_row(it);
        for (int c0 = 0; c0 < n; c0 += PA_VALUE_CHUNK) {
            const int cn = n - c0 < PA_VALUE_CHUNK ? n - c0 : PA_VALUE_CHUNK;
            const int next = n - c0 - cn < PA_VALUE_CHUNK ? n - c0 - cn : PA_VALUE_CHUNK;
            Prefetch pf = prefetch_range(rows, c0 + cn, c0 + cn + next);
            const int pf_k = (next * lines + per_token * cn - 1) / (per_token * cn);
            value_chunk(it, p + c0, rows + c0, cn, out, &pf, pf_k, dt);
        }
        for (int qh = 0; qh < NQ; qh++)
            for (int d = 0; d < D; d++) out[(int64_t)qh * D + d] *= inv[qh];
        return;
    }
#endif
    for (int qh = 0; qh < NQ; qh++) {
        float *o = out + (int64_t)qh * D;
        const float *pq = p + (int64_t)qh * n;
        const int64_t off = (int64_t)(qh / it->G) * it->head_bytes;
        for (int t = 0; t < n; t++)
            for (int d = 0; d < D; d++) o[d] += pq[t] * load1((const char *)rows[t] + off, d, dt);
        for (int d = 0; d < D; d++) o[d] *= inv[qh];
    }
}

/* ---------------------------------------------------------------- AVX-512, float32 */

/* A float32 cache with head_dim 64 and 1-3 query heads per kv head (SmolLM2's 9 over 3):
 * both passes sweep one kv head at a time over all the item's tokens, so that head's
 * G x 4 query vectors (scores) or G x 4 output accumulators (values) stay in zmm
 * registers for the whole sweep. Each K/V row is then loaded once and feeds G FMAs per
 * 16 floats, and no query is reloaded per token: the loop is bound by its FMAs (12 per
 * token and kv head at G = 3, where the AVX2 tiles above, reloading queries, took about
 * twice their FMA time on a Zen 4). A head's rows are 256 contiguous bytes, disjoint
 * from the other heads' lines, so sweeping head by head reads every line once all the
 * same. Prefetch: PA_Z_AHEAD tokens ahead in the same sweep; the last tokens of a sweep
 * fetch the first ones of the next head's. */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && PA_AVX2
#define PA_AVX512 1
#ifndef PA_Z_AHEAD
#define PA_Z_AHEAD 8
#endif
#ifndef PA_Z_FAR
#define PA_Z_FAR 16
#endif

/* Sums of four vectors: r[j] = sum(a[j]). */
INLINE __m128 zsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    return hsum4(b0, b1, b2, b3);
}

/* The 4 lines of token t's row of kv head hh (t past the sweep: the next head's); in the
 * first head's sweep also, PA_Z_FAR tokens ahead, every head's lines of the row into L2,
 * so the later sweeps read L2 and DRAM sees each block front to back. vrows (the score
 * pass of an item whose K and V fit in L2, else NULL): the V rows of those tokens too. */
INLINE void prefetch_head_row(const Item *it, const void *const *rows, const void *const *vrows, int t,
                              int hh) {
#if PA_Z_FAR > 0
    if (hh == 0 && t - PA_Z_AHEAD + PA_Z_FAR < it->n) {
        const char *r = (const char *)rows[t - PA_Z_AHEAD + PA_Z_FAR];
        for (int h = 1; h < it->NH; h++)
            for (int b = 0; b < 256; b += 64) _mm_prefetch(r + (int64_t)h * it->head_bytes + b, _MM_HINT_T1);
        const char *v = vrows ? (const char *)vrows[t - PA_Z_AHEAD + PA_Z_FAR] : NULL;
        for (int h = 0; v && h < it->NH; h++)
            for (int b = 0; b < 256; b += 64) _mm_prefetch(v + (int64_t)h * it->head_bytes + b, _MM_HINT_T1);
    }
#else
    (void)vrows;
#endif
    if (t >= it->n) t -= it->n, hh++;
    if (hh >= it->NH || t >= it->n) return;
    const char *r = (const char *)rows[t] + (int64_t)hh * it->head_bytes;
    for (int b = 0; b < 256; b += 64) __builtin_prefetch(r + b);
}

INLINE float zdot64(const __m512 *qv, const float *r) {
    __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(r));
    a = _mm512_fmadd_ps(qv[1], _mm512_loadu_ps(r + 16), a);
    a = _mm512_fmadd_ps(qv[2], _mm512_loadu_ps(r + 32), a);
    return _mm512_reduce_add_ps(_mm512_fmadd_ps(qv[3], _mm512_loadu_ps(r + 48), a));
}

/* s[qh*n + t] = scale * q[qh] . K[t][qh / G], D = 64, G query heads per kv head. Given
 * vrows (the item's K and V rows fit in half the L2), the first head's sweep also fetches
 * the V rows into L2 as it goes, so DRAM streams V while the later heads' sweeps and the
 * softmax run from cache, and the value pass reads L2 (2 threads of a Zen 4, 2026-12-07,
 * cpu_attention_bench in turns, 64 sequences from DRAM: 320 tokens 1.63-1.68 against
 * 1.77-1.98 ms, 256 tokens best 1.10-1.32 against 1.26-1.47 ms; in the engine's one-call
 * decode layers, within the VM's noise). */
INLINE void scores_z64(const Item *it, const float *q, const void *const *rows, float scale,
                       float *s, int G, const void *const *vrows) {
    const int n = it->n;
    const __m128 vs = _mm_set1_ps(scale);
    for (int t = 0; t < PA_Z_AHEAD && t < n; t++) prefetch_head_row(it, rows, vrows, t, 0);
    for (int hh = 0; hh < it->NH; hh++) {
        const int64_t off = (int64_t)hh * it->head_bytes;
        __m512 qv[3][4];
        for (int g = 0; g < G; g++)
            for (int z = 0; z < 4; z++) qv[g][z] = _mm512_loadu_ps(q + (int64_t)(hh * G + g) * 64 + 16 * z);
        int t = 0;
        for (; t + 4 <= n; t += 4) {
            __m512 acc[3][4];
            for (int j = 0; j < 4; j++) {
                prefetch_head_row(it, rows, vrows, t + j + PA_Z_AHEAD, hh);
                const float *r = (const float *)((const char *)rows[t + j] + off);
                const __m512 k0 = _mm512_loadu_ps(r), k1 = _mm512_loadu_ps(r + 16);
                const __m512 k2 = _mm512_loadu_ps(r + 32), k3 = _mm512_loadu_ps(r + 48);
                for (int g = 0; g < G; g++) {
                    __m512 a = _mm512_mul_ps(qv[g][0], k0);
                    a = _mm512_fmadd_ps(qv[g][1], k1, a);
                    a = _mm512_fmadd_ps(qv[g][2], k2, a);
                    acc[g][j] = _mm512_fmadd_ps(qv[g][3], k3, a);
                }
            }
            for (int g = 0; g < G; g++)
                _mm_storeu_ps(s + (int64_t)(hh * G + g) * n + t,
                              _mm_mul_ps(zsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), vs));
        }
        for (; t < n; t++) {
            prefetch_head_row(it, rows, vrows, t + PA_Z_AHEAD, hh);
            const float *r = (const float *)((const char *)rows[t] + off);
            for (int g = 0; g < G; g++) s[(int64_t)(hh * G + g) * n + t] = zdot64(qv[g], r) * scale;
        }
    }
}

/* out[qh] = inv[qh] * sum_t p[qh*n + t] * V[t][qh / G], D = 64. */
INLINE void values_z64(const Item *it, const float *p, const void *const *rows, const float *inv,
                       float *out, int G) {
    const int n = it->n;
    for (int t = 0; t < PA_Z_AHEAD && t < n; t++) prefetch_head_row(it, rows, NULL, t, 0);
    for (int hh = 0; hh < it->NH; hh++) {
        const int64_t off = (int64_t)hh * it->head_bytes;
        const float *ph = p + (int64_t)hh * G * n;
        __m512 acc[3][4];
        for (int g = 0; g < G; g++)
            for (int z = 0; z < 4; z++) acc[g][z] = _mm512_setzero_ps();
        for (int t = 0; t < n; t++) {
            prefetch_head_row(it, rows, NULL, t + PA_Z_AHEAD, hh);
            const float *r = (const float *)((const char *)rows[t] + off);
            const __m512 v0 = _mm512_loadu_ps(r), v1 = _mm512_loadu_ps(r + 16);
            const __m512 v2 = _mm512_loadu_ps(r + 32), v3 = _mm512_loadu_ps(r + 48);
            for (int g = 0; g < G; g++) {
                const __m512 pg = _mm512_set1_ps(ph[(int64_t)g * n + t]);
                acc[g][0] = _mm512_fmadd_ps(pg, v0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(pg, v1, acc[g][1]);
                acc[g][2] = _mm512_fmadd_ps(pg, v2, acc[g][2]);
                acc[g][3] = _mm512_fmadd_ps(pg, v3, acc[g][3]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 c = _mm512_set1_ps(inv[hh * G + g]);
            float *o = out + (int64_t)(hh * G + g) * 64;
            for (int z = 0; z < 4; z++) _mm512_storeu_ps(o + 16 * z, _mm512_mul_ps(acc[g][z], c));
        }
    }
}
#else
#define PA_AVX512 0
#endif

/* Whether an item of this shape and cache type runs the AVX-512 passes. */
INLINE int use_z64(const Item *it, int dt) {
    return PA_AVX512 && dt == DT_F32 && it->D == 64 && it->G >= 1 && it->G <= 3 &&
           it->row_bytes == 256;
}

/* The score pass, by the fastest path for the item. */
INLINE void scores_any(const Item *it, const float *q, const void *const *rows, float scale,
                       float *s, int dt, const void *const *vrows) {
#if PA_AVX512
    if (use_z64(it, dt)) {
        if (it->G == 3) scores_z64(it, q, rows, scale, s, 3, vrows);
        else if (it->G == 2) scores_z64(it, q, rows, scale, s, 2, vrows);
        else scores_z64(it, q, rows, scale, s, 1, vrows);
        return;
    }
#else
    (void)vrows;
#endif
    scores_pass(it, q, rows, scale, s, dt);
}

/* The value pass, by the fastest path for the item. */
INLINE void values_any(const Item *it, const float *p, const void *const *rows, const float *inv,
                       float *out, int dt) {
#if PA_AVX512
    if (use_z64(it, dt)) {
        if (it->G == 3) values_z64(it, p, rows, inv, out, 3);
        else if (it->G == 2) values_z64(it, p, rows, inv, out, 2);
        else values_z64(it, p, rows, inv, out, 1);
        return;
    }
#endif
    values_pass(it, p, rows, inv, out, dt);
}

/* ---------------------------------------------------------------- driver */

typedef struct {
    const float *q;
    const char *k, *v;
    const int32_t *block_tables;
    const int32_t *context_lens;
    float *out;
    int64_t k_block_stride, v_block_stride, token_stride, head_stride, bt_stride; /* elements */
    int H, KVH, D, block_size, esize;
    int heads_per_item; /* KVH (a work item is a sequence) or 1 (a sequence's kv head) */
    int parts;          /* token ranges per (sequence, heads) item: 1, or split (see run) */
    /* parts > 1: each part's unnormalised output [NQ][D], max and sum [NQ], per item */
    float *part_out, *part_max, *part_sum;
    float scale;
    /* Quantised caches only (NULL otherwise): scale of (blk, kvh) at base + blk*stride + kvh. */
    const float *k_scales, *v_scales;
    int64_t ks_block_stride, vs_block_stride;
    float code_factor; /* what load1/load8 leave out of a code's value (fp8: 256) */
    int64_t l2_half;   /* half the core's L2, bytes (set by run) */
} Args;

/* Per-thread scratch: scores [NQ][max_n], K and V row pointers [max_n], and for quantised
 * caches the per-token K and V scales of the item's heads [NH][max_n]. */
typedef struct {
    float *s;
    const void **k_rows, **v_rows;
    float *ks, *vs;
} Scratch;

/* out[hh*n + t - t0] = factor * scale of token t's block, kv head h0 + hh, for hh < NH
 * and t in [t0, t0 + n). */
static void token_scales(const float *base, int64_t block_stride, const Args *a,
                         const int32_t *bt, int h0, int NH, int t0, int n, float *out) {
    for (int hh = 0; hh < NH; hh++)
        for (int t = 0; t < n; t++)
            out[(int64_t)hh * n + t] =
                a->code_factor * base[bt[(t0 + t) / a->block_size] * block_stride + h0 + hh];
}

/* s[qh*n + t] *= ts[(qh / G)*n + t]: scores by K scales, or probabilities by V scales. */
static void scale_rows(float *s, const float *ts, int NQ, int G, int n) {
    for (int qh = 0; qh < NQ; qh++) {
        float *sq = s + (int64_t)qh * n;
        const float *tq = ts + (int64_t)(qh / G) * n;
        for (int t = 0; t < n; t++) sq[t] *= tq[t];
    }
}

/* Pointers to kv head h of tokens [t0, t1) of a sequence into rows[0 : t1 - t0]. */
static void row_pointers(const char *base, int64_t block_stride, const Args *a,
                         const int32_t *bt, int h, int t0, int t1, const void **rows) {
    for (int t = t0, blk = t0 / a->block_size, o = t0 % a->block_size; t < t1; blk++, o = 0) {
        const char *b = base + (bt[blk] * block_stride + h * a->head_stride) * a->esize;
        for (; o < a->block_size && t < t1; o++, t++) rows[t - t0] = b + o * a->token_stride * a->esize;
    }
}

/* Tokens [t0, t1) of part `part` of an n-token sequence split into `parts`. */
INLINE void part_range(int n, int part, int parts, int *t0, int *t1) {
    *t0 = (int)((int64_t)n * part / parts), *t1 = (int)((int64_t)n * (part + 1) / parts);
}

/* Work item `item` = (sequence, its kv heads [h0, h0 + heads_per_item), part). With one
 * part the item's output goes to out, normalised; with several, each part's unnormalised
 * output, max and sum go to the part buffers and merge_parts combines them. */
INLINE void run_item(const Args *a, int64_t item, const Scratch *w, int dt) {
    const int per_seq = a->KVH / a->heads_per_item;
    const int64_t group = item / a->parts, b = group / per_seq;
    const int h0 = (int)(group % per_seq) * a->heads_per_item;
    int t0, t1;
    part_range(a->context_lens[b], (int)(item % a->parts), a->parts, &t0, &t1);
    const Item it = {t1 - t0, a->heads_per_item, a->H / a->KVH, a->D,
                     (int)(a->head_stride * a->esize), a->D * a->esize};
    const int fits_l2 = 2 * (int64_t)it.n * it.NH * it.row_bytes <= a->l2_half; /* K and V rows */
    const int NQ = it.NH * it.G, split = a->parts > 1;
    const int64_t q0 = (b * a->H + (int64_t)h0 * it.G) * a->D;
    float *out = split ? a->part_out + item * NQ * a->D : a->out + q0;
    const int32_t *bt = a->block_tables + b * a->bt_stride;
    if (it.n <= 0) {
        memset(out, 0, sizeof(float) * (size_t)NQ * a->D);
        for (int qh = 0; split && qh < NQ; qh++)
            a->part_max[item * NQ + qh] = -INFINITY, a->part_sum[item * NQ + qh] = 0.0f;
        return;
    }
    float inv[NQ], mx[NQ];
    row_pointers(a->k, a->k_block_stride, a, bt, h0, t0, t1, w->k_rows);
    row_pointers(a->v, a->v_block_stride, a, bt, h0, t0, t1, w->v_rows);
    scores_any(&it, a->q + q0, w->k_rows, a->scale, w->s, dt, fits_l2 ? w->v_rows : NULL);
    if (!use_z64(&it, dt)) values_prefetch_first(&it, w->v_rows);
    if (a->k_scales) {
        token_scales(a->k_scales, a->ks_block_stride, a, bt, h0, it.NH, t0, it.n, w->ks);
        token_scales(a->v_scales, a->vs_block_stride, a, bt, h0, it.NH, t0, it.n, w->vs);
        scale_rows(w->s, w->ks, NQ, it.G, it.n);
    }
    for (int qh = 0; qh < NQ; qh++) {
        const float sum = softmax_unnormalised(w->s + (int64_t)qh * it.n, it.n, mx + qh);
        inv[qh] = split ? 1.0f : 1.0f / sum;
        if (split) a->part_max[item * NQ + qh] = mx[qh], a->part_sum[item * NQ + qh] = sum;
    }
    if (a->v_scales) scale_rows(w->s, w->vs, NQ, it.G, it.n);
    values_any(&it, w->s, w->v_rows, inv, out, dt);
}

/* out for query head qh of sequence b from its item's parts: each part's output weighted
 * by exp(its max - the overall max), over the parts' sums weighted alike. */
static void merge_parts(const Args *a, int64_t b, int qh) {
    const int G = a->H / a->KVH, NQ = a->heads_per_item * G, D = a->D;
    const int64_t first = (b * (a->KVH / a->heads_per_item) + qh / NQ) * a->parts;
    const int j = qh % NQ;
    float m = -INFINITY, sum = 0.0f, wgt[a->parts];
    for (int p = 0; p < a->parts; p++) {
        const float mp = a->part_max[(first + p) * NQ + j];
        m = mp > m ? mp : m;
    }
    for (int p = 0; p < a->parts; p++) {
        const float mp = a->part_max[(first + p) * NQ + j];
        wgt[p] = mp == -INFINITY ? 0.0f : expf(mp - m);
        sum += wgt[p] * a->part_sum[(first + p) * NQ + j];
    }
    float *o = a->out + (b * a->H + qh) * D;
    memset(o, 0, sizeof(float) * (size_t)D);
    if (!(sum > 0.0f)) return; /* an empty sequence */
    for (int p = 0; p < a->parts; p++) {
        const float c = wgt[p] / sum, *src = a->part_out + ((first + p) * NQ + j) * D;
        for (int d = 0; d < D; d++) o[d] += c * src[d];
    }
}

/* 0 if the inputs are in range, else the error code described at the top. */
static int validate(const Args *a, int B, int64_t num_blocks, int max_context, int *max_n) {
    *max_n = 0;
    for (int i = 0; i < B; i++) {
        int n = a->context_lens[i];
        if (n < 0 || n > max_context) return -(i + 1);
        if (n > *max_n) *max_n = n;
        const int32_t *bt = a->block_tables + (int64_t)i * a->bt_stride;
        for (int j = 0, nb = (n + a->block_size - 1) / a->block_size; j < nb; j++)
            if (bt[j] < 0 || bt[j] >= num_blocks) return -(B + i + 1);
    }
    return 0;
}

static int run(Args *a, int B, int64_t num_blocks, int max_blocks, int num_threads, int dt) {
    int max_n;
    int rc = validate(a, B, num_blocks, max_blocks * a->block_size, &max_n);
    if (rc != 0) return rc;
    if (num_threads < 1) num_threads = 1;
    /* Work items: whole sequences, whose rows (all kv heads) are read front to back. Too
     * few of them to keep the threads busy (a step of one to a few sequences): each one's
     * tokens in parts, flash-decoding style, as many as even out the threads and each
     * worth it; sequences too short for parts, fewer than the threads: their kv heads. */
    a->heads_per_item = a->KVH;
    a->parts = 1;
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    a->l2_half = (l2 > 0 ? l2 : 1 << 20) / 2;
    if (num_threads > 1 && B < PA_MIN_ITEMS_PER_THREAD * num_threads) {
        /* fewer sequences than threads (a batch-1 step): one part per thread, each a long
         * run of rows for the prefetchers; more, smaller parts cost more than they even out
         * (see PA_MIN_ITEMS_PER_THREAD) */
        const int want = B < num_threads ? (num_threads + B - 1) / B : (PA_MIN_ITEMS_PER_THREAD * num_threads + B - 1) / B;
        const int most = max_n / PA_MIN_PART_TOKENS;
        int parts = want < most ? want : most;
        while (parts > 2 && (B * parts) % num_threads) parts--; /* items the threads share evenly */
        if (parts >= 2) a->parts = parts;
        else if (B < num_threads) a->heads_per_item = 1;
    }
    const int64_t groups = (int64_t)B * (a->KVH / a->heads_per_item);
    const int64_t items = groups * a->parts;
    const size_t nq = (size_t)a->heads_per_item * (a->H / a->KVH), n = (size_t)max_n + 8;
    int failed = 0;
    if (a->parts > 1) {
        a->part_out = malloc(sizeof(float) * (size_t)items * nq * (size_t)a->D);
        a->part_max = malloc(sizeof(float) * (size_t)items * nq);
        a->part_sum = malloc(sizeof(float) * (size_t)items * nq);
        if (!a->part_out || !a->part_max || !a->part_sum) {
            free(a->part_out), free(a->part_max), free(a->part_sum);
            return -(2 * B + 1);
        }
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1) \
    reduction(| : failed)
    {
        const size_t nsc = a->k_scales ? (size_t)a->heads_per_item * n : 1;
        Scratch w = {malloc(sizeof(float) * nq * n), malloc(sizeof(void *) * n),
                     malloc(sizeof(void *) * n), malloc(sizeof(float) * nsc),
                     malloc(sizeof(float) * nsc)};
        const int ok = w.s && w.k_rows && w.v_rows && w.ks && w.vs;
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ok) continue;
#if PA_WITH(0)
            if (dt == DT_F32) run_item(a, it, &w, DT_F32);
#endif
#if PA_WITH(1)
            if (dt == DT_F16) run_item(a, it, &w, DT_F16);
#endif
#if PA_WITH(2)
            if (dt == DT_BF16) run_item(a, it, &w, DT_BF16);
#endif
#if PA_WITH(3)
            if (dt == DT_I8) run_item(a, it, &w, DT_I8);
#endif
#if PA_WITH(4)
            if (dt == DT_FP8) run_item(a, it, &w, DT_FP8);
#endif
        }
        if (a->parts > 1) { /* the loop's barrier has passed: every part is in */
#pragma omp for schedule(static)
            for (int64_t bq = 0; bq < (int64_t)B * a->H; bq++) merge_parts(a, bq / a->H, (int)(bq % a->H));
        }
        free(w.s);
        free(w.k_rows);
        free(w.v_rows);
        free(w.ks);
        free(w.vs);
    }
    free(a->part_out);
    free(a->part_max);
    free(a->part_sum);
    return failed ? -(2 * B + 1) : 0;
}

#define PA_ENTRY(NAME, DT, ESIZE)                                                          \
    int NAME(const float *q, const void *k_cache, const void *v_cache,                   \
             int64_t k_block_stride, int64_t v_block_stride, int64_t token_stride,         \
             int64_t head_stride, int64_t num_blocks, const int32_t *block_tables,         \
             int64_t bt_stride, int max_blocks, const int32_t *context_lens, int B, int H, \
             int KVH, int D, int block_size, float scale, float *out, int num_threads) {   \
        if (B <= 0) return 0;                                                              \
        Args a = {q, (const char *)k_cache, (const char *)v_cache, block_tables,           \
                  context_lens, out, k_block_stride, v_block_stride, token_stride,         \
                  head_stride, bt_stride, H, KVH, D, block_size, ESIZE, 1, 1, NULL, NULL,  \
                  NULL, scale, NULL, NULL, 0, 0, 1.0f, 0};                                 \
        return run(&a, B, num_blocks, max_blocks, num_threads, DT);                        \
    }

/* Quantised caches: one-byte codes plus fp32 scales, (blk, kvh) at scales + blk*stride + kvh. */
#define PA_QENTRY(NAME, DT, FACTOR)                                                        \
    int NAME(const float *q, const void *k_cache, const void *v_cache,                   \
             int64_t k_block_stride, int64_t v_block_stride, int64_t token_stride,         \
             int64_t head_stride, int64_t num_blocks, const int32_t *block_tables,         \
             int64_t bt_stride, int max_blocks, const int32_t *context_lens, int B, int H, \
             int KVH, int D, int block_size, float scale, float *out, int num_threads,     \
             const float *k_scales, const float *v_scales, int64_t ks_block_stride,        \
             int64_t vs_block_stride) {                                                    \
        if (B <= 0) return 0;                                                              \
        Args a = {q, (const char *)k_cache, (const char *)v_cache, block_tables,           \
                  context_lens, out, k_block_stride, v_block_stride, token_stride,         \
                  head_stride, bt_stride, H, KVH, D, block_size, 1, 1, 1, NULL, NULL,      \
                  NULL, scale, k_scales, v_scales, ks_block_stride, vs_block_stride,       \
                  FACTOR, 0};                                                              \
        return run(&a, B, num_blocks, max_blocks, num_threads, DT);                        \
    }

#if PA_WITH(0)
PA_ENTRY(paged_decode_attention_f32, DT_F32, 4)
#endif
#if PA_WITH(1)
PA_ENTRY(paged_decode_attention_f16, DT_F16, 2)
#endif
#if PA_WITH(2)
PA_ENTRY(paged_decode_attention_bf16, DT_BF16, 2)
#endif
#if PA_WITH(3)
PA_QENTRY(paged_decode_attention_i8, DT_I8, 1.0f)
#endif
#if PA_WITH(4)
PA_QENTRY(paged_decode_attention_fp8, DT_FP8, FP8_F16_FACTOR)
#endif

/* 1 if this build uses the AVX2+FMA path, 0 for the scalar fallback. */
int paged_attention_simd_level(void) { return PA_AVX512 ? 2 : PA_AVX2; }
