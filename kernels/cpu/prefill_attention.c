/*
 * Causal attention of one sequence's prefill chunk over its paged float32 cache, on the
 * CPU (AVX-512 builds; elsewhere the entry point returns -1 and the caller uses torch's
 * SDPA). Plain C + OpenMP; the loader is kernels/cpu_attention.py
 * (paged_prefill_attention), the oracle kernels/reference.py (paged_prefill_attention).
 *
 * The chunk's own K/V are already in the cache: query row i, at position prefix + i,
 * attends to positions 0 .. prefix + i. Layout (element strides): q and out [Q, H, D]
 * rows at q_stride / out_stride; cache element (blk, tok, kvh, d) at base +
 * blk*block_stride + tok*token_stride + kvh*head_stride + d; block_table one int32 row.
 * Query head h reads kv head h / (H / KVH); head_dim 64 or 128.
 *
 * Flash-attention style:
 *   1. each kv head's K and V rows are gathered into kc, vc [KVH][C][D] (C = context
 *      rounded up to 16, zero-padded), so the keys of a tile lie at fixed offsets;
 *   2. a work item is (query head, 16 rows), one row per lane. Per tile of 16 keys:
 *      S[j] = sum_d Q^T[d] * K[j][d] (key j's float broadcast against 16 rows), the causal
 *      mask on diagonal tiles, an online softmax whose maxima and sums run down the
 *      16 score registers (no horizontal reductions), then
 *      O^T[d] = O^T[d] * alpha + sum_j P[j] * V[j][d], 8 dims at a time (8 sums and the
 *      16 probabilities in registers).
 * An earlier layout (8 rows x 32 keys, keys across lanes, K transposed) spent a third of
 * its time in per-row horizontal maxima and sums. Float32 throughout, no -ffast-math.
 *
 * Returns 0; -1 for a size or build it does not take, -2 for a block id outside
 * [0, num_blocks), -3 if scratch memory could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PF_AVX512 1
#else
#define PF_AVX512 0
#endif

#include "simd.h" /* INLINE, exp16_nonpositive */

#if PF_AVX512
#define PF_ROWS 16 /* query rows per item: one per lane */
#define PF_KEYS 16 /* keys per tile */
#define PF_VDIMS 8 /* output dims per pass over a tile's values */
#define PF_KEEP_BYTES ((size_t)32 << 20) /* scratch up to this size is kept for the next call */

/* Transposes the 16 x 16 floats in m[0..16) in place: four rounds of block swaps, round k
 * (b = 8 >> k) exchanging between rows i and i + b the b-wide halves of each 2b columns:
 * row i takes its columns c & b == 0 and row i + b's (TRANSPOSE_LO), row i + b the rest
 * (TRANSPOSE_HI); indices 16.. select the second operand of the permute. */
static const int32_t TRANSPOSE_LO[4][16] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const int32_t TRANSPOSE_HI[4][16] __attribute__((aligned(64))) = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};

INLINE void transpose16(__m512 m[16]) {
    for (int k = 0, b = 8; k < 4; k++, b /= 2) {
        const __m512i ilo = _mm512_load_si512(TRANSPOSE_LO[k]), ihi = _mm512_load_si512(TRANSPOSE_HI[k]);
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            const __m512 x = m[i], y = m[i + b];
            m[i] = _mm512_permutex2var_ps(x, ilo, y);
            m[i + b] = _mm512_permutex2var_ps(x, ihi, y);
        }
    }
}

typedef struct {
    const float *q, *kc, *vc;
    float *out;
    int64_t q_stride, out_stride;
    int C, prefix, G;
    float scale;
} PfArgs;

/* One item: rows [r0, r0 + nr) of query head qh. D is a constant at each call site, so
 * a key's floats are at fixed displacements from the tile's base. */
INLINE void prefill_rows(const PfArgs *a, int qh, int r0, int nr, const int D) {
    float qt[128 * PF_ROWS] __attribute__((aligned(64))); /* Q^T: [D][16 rows], scaled */
    float ot[128 * PF_ROWS] __attribute__((aligned(64))); /* O^T, unnormalised */
    const int64_t head = (int64_t)(qh / a->G) * a->C * D;
    const float *kc = a->kc + head, *vc = a->vc + head;
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 t[16];
        for (int r = 0; r < PF_ROWS; r++)
            t[r] = r < nr ? _mm512_mul_ps(_mm512_loadu_ps(a->q + (int64_t)(r0 + r) * a->q_stride + (int64_t)qh * D + d0), scale)
                          : _mm512_setzero_ps();
        transpose16(t);
        for (int i = 0; i < 16; i++) _mm512_store_ps(qt + (d0 + i) * PF_ROWS, t[i]);
    }
    memset(ot, 0, sizeof(float) * (size_t)D * PF_ROWS);
    const int first = a->prefix + r0, last = first + nr - 1; /* rows' first and last positions */
    /* lane r's position; lanes past nr are rows that do not exist: computed, never stored */
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(first),
                                         _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int j0 = 0; j0 <= last; j0 += PF_KEYS) {
        const float *kt = kc + (int64_t)j0 * D, *vt = vc + (int64_t)j0 * D;
        __m512 s[PF_KEYS];
        for (int j = 0; j < PF_KEYS; j++) s[j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 qv = _mm512_load_ps(qt + d * PF_ROWS);
            for (int j = 0; j < PF_KEYS; j++) s[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kt[j * D + d]), s[j]);
        }
        if (j0 + PF_KEYS - 1 > first) /* a diagonal tile: key j0 + j is seen from position j0 + j on */
            for (int j = 0; j < PF_KEYS; j++)
                s[j] = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(j0 + j)),
                                            _mm512_set1_ps(-INFINITY), s[j]);
        /* Every row sees key 0 in the first tile, so m is finite from then on: a row that
         * sees no key of a later tile gets alpha 1 and probabilities 0, never NaN. */
        __m512 mt = s[0];
        for (int j = 1; j < PF_KEYS; j++) mt = _mm512_max_ps(mt, s[j]);
        const __m512 mn = _mm512_max_ps(m, mt);
        const __m512 alpha = exp16_nonpositive(_mm512_sub_ps(m, mn)); /* 0 on the first tile */
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < PF_KEYS; j++) {
            s[j] = exp16_nonpositive(_mm512_sub_ps(s[j], mn));
            sum = _mm512_add_ps(sum, s[j]);
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        m = mn;
        for (int d0 = 0; d0 < D; d0 += PF_VDIMS) {
            __m512 acc[PF_VDIMS];
            for (int i = 0; i < PF_VDIMS; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + i) * PF_ROWS), alpha);
#pragma GCC unroll 16
            for (int j = 0; j < PF_KEYS; j++)
#pragma GCC unroll 8
                for (int i = 0; i < PF_VDIMS; i++)
                    acc[i] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vt[j * D + d0 + i]), acc[i]);
            for (int i = 0; i < PF_VDIMS; i++) _mm512_store_ps(ot + (d0 + i) * PF_ROWS, acc[i]);
        }
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 t[16];
        for (int i = 0; i < 16; i++) t[i] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + i) * PF_ROWS), inv);
        transpose16(t);
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(a->out + (int64_t)(r0 + r) * a->out_stride + (int64_t)qh * D + d0, t[r]);
    }
}

static void prefill_rows_64(const PfArgs *a, int qh, int r0, int nr) { prefill_rows(a, qh, r0, nr, 64); }
static void prefill_rows_128(const PfArgs *a, int qh, int r0, int nr) { prefill_rows(a, qh, r0, nr, 128); }

/* The calling thread's scratch, kept between calls up to PF_KEEP_BYTES (a fresh block
 * each call cost page faults on every one). Larger requests get their own block, which
 * the caller frees (it is not pf_kept). */
static __thread float *pf_kept;
static __thread size_t pf_kept_bytes;

static float *pf_scratch(size_t bytes) {
    if (bytes <= pf_kept_bytes) return pf_kept;
    bytes = (bytes + 63) / 64 * 64;
    if (bytes > PF_KEEP_BYTES) return aligned_alloc(64, bytes);
    free(pf_kept);
    pf_kept = aligned_alloc(64, bytes);
    pf_kept_bytes = pf_kept ? bytes : 0;
    return pf_kept;
}
#endif

int paged_prefill_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                const float *v_cache, int64_t k_block_stride,
                                int64_t v_block_stride, int64_t token_stride, int64_t head_stride,
                                int64_t num_blocks, const int32_t *block_table, int num_context,
                                int num_new, int H, int KVH, int D, int block_size, float scale,
                                float *out, int64_t out_stride, int num_threads) {
#if PF_AVX512
    if (num_new < 1 || num_new > num_context || KVH < 1 || H % KVH || (D != 64 && D != 128) ||
        block_size < 1)
        return -1;
    const int nb = (num_context + block_size - 1) / block_size;
    for (int i = 0; i < nb; i++)
        if (block_table[i] < 0 || block_table[i] >= num_blocks) return -2;
    const int C = (num_context + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
    const size_t per_cache = (size_t)KVH * C * D;
    float *kc = pf_scratch(sizeof(float) * 2 * per_cache);
    if (!kc) return -3;
    float *vc = kc + per_cache;
    const PfArgs a = {q, kc, vc, out, q_stride, out_stride, C, num_context - num_new, H / KVH, scale};
    if (num_threads < 1) num_threads = 1;
    const int tiles = (num_new + PF_ROWS - 1) / PF_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t hb = 0; hb < (int64_t)KVH * nb; hb++) {
            const int h = (int)(hb / nb), b = (int)(hb % nb);
            for (int o = 0; o < block_size; o++) {
                const int t = b * block_size + o;
                if (t >= num_context) break;
                const int64_t row = (int64_t)h * C + t;
                const int64_t at = o * token_stride + h * head_stride;
                memcpy(kc + row * D, k_cache + (int64_t)block_table[b] * k_block_stride + at, sizeof(float) * (size_t)D);
                memcpy(vc + row * D, v_cache + (int64_t)block_table[b] * v_block_stride + at, sizeof(float) * (size_t)D);
            }
        }
#pragma omp for schedule(static)
        for (int h = 0; h < KVH; h++) { /* padding keys */
            const int64_t row = (int64_t)h * C + num_context;
            memset(kc + row * D, 0, sizeof(float) * (size_t)(C - num_context) * D);
            memset(vc + row * D, 0, sizeof(float) * (size_t)(C - num_context) * D);
        }
        /* Later row tiles see more keys: hand them out first, dynamically. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < (int64_t)H * tiles; it++) {
            const int tile = tiles - 1 - (int)(it / H), qh = (int)(it % H);
            const int r0 = tile * PF_ROWS, nr = num_new - r0 < PF_ROWS ? num_new - r0 : PF_ROWS;
            if (D == 64)
                prefill_rows_64(&a, qh, r0, nr);
            else
                prefill_rows_128(&a, qh, r0, nr);
        }
    }
    if (kc != pf_kept) free(kc);
    return 0;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)k_block_stride;
    (void)v_block_stride, (void)token_stride, (void)head_stride, (void)num_blocks;
    (void)block_table, (void)num_context, (void)num_new, (void)H, (void)KVH, (void)D;
    (void)block_size, (void)scale, (void)out, (void)out_stride, (void)num_threads;
    return -1;
#endif
}

/* 1 if this build has the kernel (AVX-512), else 0: the caller uses torch. */
int prefill_attention_available(void) { return PF_AVX512; }
