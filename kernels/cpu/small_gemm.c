/*
 * y = x @ w.T (+ bias) in float32 for few rows of x: the decode-step GEMMs of an
 * nn.Linear, where M (sequences decoding, 1..64) is small and the weight matrix is big,
 * read from DRAM once per step. Plain C + OpenMP, no torch headers; the loader is
 * kernels/cpu_gemm.py, the oracle torch's x @ w.T + b.
 *
 * Layout (element strides, row-major):
 *   x  [M, K], row m at x + m*ldx
 *   w  [N, K], row n at w + n*ldw       (an nn.Linear weight, used in place: no packing)
 *   y  [M, N], row m at y + m*ldy
 *   bias [N] or NULL
 *
 * Why this shape of kernel. For M <= 64 the arithmetic intensity is at most 2*M flops
 * per 4 weight bytes, so small M is bound by DRAM bandwidth and large M by the FMA units;
 * a BLAS that packs the weight into panels on every call adds a write and a re-read of
 * every weight to a computation that only needs to read it once. Here:
 *
 *   - Each thread owns a contiguous range of weight rows (N is split, never K), so every
 *     weight element is read from DRAM exactly once, by one thread, in address order.
 *   - The range is walked in blocks of NR weight rows (NR*K*4 bytes: 7 KB for K=576, 18 KB
 *     for K=1536, so a block stays in the 32 KB L1). For each block, all M rows of x
 *     are swept in tiles of MR rows; x (M*K*4 bytes, <= 393 KB) stays in L2.
 *   - A tile is NR x MR dot products of length K, each accumulated in one 8-lane AVX
 *     register: per 8 k's, NR weight loads + MR x loads feed NR*MR FMAs. NR=3, MR=4 is
 *     12 accumulators + 3 weight vectors + 1 x vector = all 16 ymm registers, and 7 loads
 *     per 12 FMAs (Zen 3/Skylake: 2 FMAs and 2-3 loads per cycle), so large M runs at
 *     FMA throughput. The 12 independent accumulator chains also cover the FMA latency.
 *   - The lanes of each accumulator are summed once per tile, at the end of K (a
 *     4-at-a-time hadd tree when MR=4), then bias is added and the scalars stored.
 *   - M=1 (GEMV) is bandwidth-bound with nothing to reuse: blocks of NR1 rows, one x
 *     load per 8 k's shared by NR1 FMAs into NR1 independent chains.
 *   - Software prefetch: while a block is computed, the block PF_BLOCKS ahead in the
 *     thread's range is prefetched, its cache lines spread evenly over the block's
 *     inner-loop steps (a few per step, not a burst that fills the miss buffers), so the
 *     core rarely waits on DRAM; at K=1536, M=64 a block's compute is long enough that
 *     one block ahead suffices, at M=1 the hardware prefetcher and PF_BLOCKS cover it.
 *   - K % 8 != 0: the last partial vector of each row is a masked load (zeros beyond K),
 *     so there is no scalar tail loop. N % NR and M % MR tails use smaller tiles.
 *
 * Float32 accumulation, no -ffast-math; the summation order differs from torch's (8
 * partial sums per dot product), so results agree to ~1e-6 relative, not bitwise.
 * Without AVX2+FMA the build falls back to plain C loops (same results up to rounding).
 *
 * Returns 0, or -1 if a size or stride is invalid (nothing is written then).
 */
#include <stdint.h>
#include <stddef.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SG_AVX2 1
#else
#define SG_AVX2 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* Weight rows per block for M >= 2 (see the register budget above). */
#define NR 3
/* x rows per tile. */
#define MR 4
/* Weight rows per block for M = 1. */
#ifndef SG_NR1
#define SG_NR1 4
#endif
/* How many blocks ahead of the one being computed to prefetch; 0 disables prefetch. */
#ifndef SG_PF_BLOCKS
#define SG_PF_BLOCKS 2
#endif
/* Minimum weight rows per thread: below that, fewer threads (fork/join costs ~us). */
#ifndef SG_MIN_ROWS_PER_THREAD
#define SG_MIN_ROWS_PER_THREAD 16
#endif

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t ldx, ldw, ldy, M, K;
} Args;

/* ---------------------------------------------------------------- prefetch cursor */

/* The cache lines of weight rows [row, end): next() issues the next k of them. Rows may
 * be strided (ldw > K) and unaligned, so lines are walked per row from the aligned
 * start. */
typedef struct {
    const char *w;
    int64_t row, end, row_stride; /* bytes between rows */
    int64_t byte, last;           /* offset of the next line from the row's aligned start;
                                     one past the row's last byte from there */
} Prefetch;

INLINE void pf_row(Prefetch *p) {
    const uintptr_t start = (uintptr_t)(p->w + p->row * p->row_stride);
    p->byte = 0;
    p->last = (int64_t)(start & 63);
}

INLINE Prefetch pf_range(const Args *a, int64_t row, int64_t end, int64_t row_bytes) {
    Prefetch p = {(const char *)a->w, row, end, a->ldw * 4, 0, 0};
    if (row < end) pf_row(&p);
    p.last += row_bytes; /* pf_row set the misalignment */
    return p;
}

/* Lines in rows [row, end) (an upper bound of what the cursor will issue). */
INLINE int64_t pf_lines(int64_t rows, int64_t row_bytes) { return rows * ((row_bytes + 126) / 64); }

INLINE void pf_next(Prefetch *p, int k, int64_t row_bytes) {
#if SG_PF_BLOCKS > 0
    for (; k > 0 && p->row < p->end; k--) {
        const char *line =
            (const char *)((uintptr_t)(p->w + p->row * p->row_stride) & ~(uintptr_t)63);
        __builtin_prefetch(line + p->byte, 0, 3);
        p->byte += 64;
        if (p->byte >= p->last) {
            if (++p->row < p->end) {
                pf_row(p);
                p->last += row_bytes;
            }
        }
    }
#else
    (void)p, (void)k, (void)row_bytes;
#endif
}

/* ---------------------------------------------------------------- AVX2 tiles */

#if SG_AVX2
/* Lane mask for the last K % 8 elements of a row (all ones if K % 8 == 0). */
INLINE __m256i tail_mask(int64_t K) {
    const int r = (int)(K & 7);
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(r == 0 ? 8 : r), idx);
}

/* Sum of each of four vectors: r[j] = sum(a[j]). */
INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

INLINE float hsum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m0+j][n0+i] = bias[n0+i] + w[n0+i] . x[m0+j] for i < nr, j < mr: one register tile.
 * nr, mr are compile-time constants at each call site (nr*mr + nr + 1 <= 16 registers).
 * pf_k lines of pf are prefetched per 8-k step. */
INLINE void tile(const Args *a, int64_t n0, int64_t m0, int nr, int mr, Prefetch *pf,
                 int pf_k, int64_t row_bytes) {
    const int64_t K = a->K, Kv = (K - 1) & ~(int64_t)7; /* start of the last vector */
    const float *wr[4], *xr[4];
    for (int i = 0; i < nr; i++) wr[i] = a->w + (n0 + i) * a->ldw;
    for (int j = 0; j < mr; j++) xr[j] = a->x + (m0 + j) * a->ldx;
    __m256 acc[4][4];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < Kv; k += 8) {
        pf_next(pf, pf_k, row_bytes);
        __m256 wv[4];
        for (int i = 0; i < nr; i++) wv[i] = _mm256_loadu_ps(wr[i] + k);
        for (int j = 0; j < mr; j++) {
            const __m256 xv = _mm256_loadu_ps(xr[j] + k);
            for (int i = 0; i < nr; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    { /* the last (possibly partial) vector: masked loads read nothing past K */
        const __m256i mask = tail_mask(K);
        pf_next(pf, pf_k, row_bytes);
        __m256 wv[4];
        for (int i = 0; i < nr; i++) wv[i] = _mm256_maskload_ps(wr[i] + k, mask);
        for (int j = 0; j < mr; j++) {
            const __m256 xv = _mm256_maskload_ps(xr[j] + k, mask);
            for (int i = 0; i < nr; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < nr; i++) {
        const float b = a->bias ? a->bias[n0 + i] : 0.0f;
        float *yc = a->y + m0 * a->ldy + n0 + i;
        if (mr == 4) {
            float s[4];
            _mm_storeu_ps(s, _mm_add_ps(hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]),
                                        _mm_set1_ps(b)));
            for (int j = 0; j < 4; j++) yc[j * a->ldy] = s[j];
        } else {
            for (int j = 0; j < mr; j++) yc[j * a->ldy] = hsum1(acc[i][j]) + b;
        }
    }
}

/* One block of nr weight rows against all M rows of x: MR-row tiles, then the M % MR
 * tail. Prefetches the lines of pf (the block PF_BLOCKS ahead) spread over its steps. */
INLINE void block(const Args *a, int64_t n0, int nr, Prefetch *pf, int64_t pf_rows,
                  int64_t row_bytes) {
    const int64_t M = a->M, steps = ((M + MR - 1) / MR) * ((a->K + 7) / 8);
    const int pf_k = (int)((pf_lines(pf_rows, row_bytes) + steps - 1) / steps);
    int64_t m0 = 0;
#define SG_TILES(NRC)                                                           \
    do {                                                                        \
        for (; m0 + MR <= M; m0 += MR) tile(a, n0, m0, NRC, MR, pf, pf_k, row_bytes); \
        switch (M - m0) {                                                       \
            case 3: tile(a, n0, m0, NRC, 3, pf, pf_k, row_bytes); break;        \
            case 2: tile(a, n0, m0, NRC, 2, pf, pf_k, row_bytes); break;        \
            case 1: tile(a, n0, m0, NRC, 1, pf, pf_k, row_bytes); break;        \
            default: break;                                                     \
        }                                                                       \
    } while (0)
    if (nr == 3)
        SG_TILES(3);
    else if (nr == 2)
        SG_TILES(2);
    else
        SG_TILES(1);
#undef SG_TILES
}

/* M = 1: y[0][n0+i] for i < nr (nr <= 8 is a compile-time constant at each call site),
 * nr independent accumulator chains, the x vector loaded once per step for all of them. */
INLINE void gemv_block(const Args *a, int64_t n0, int nr, Prefetch *pf, int pf_k,
                       int64_t row_bytes) {
    const int64_t K = a->K, Kv = (K - 1) & ~(int64_t)7;
    const float *wr[8];
    for (int i = 0; i < nr; i++) wr[i] = a->w + (n0 + i) * a->ldw;
    __m256 acc[8];
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < Kv; k += 8) {
        pf_next(pf, pf_k, row_bytes);
        const __m256 xv = _mm256_loadu_ps(a->x + k);
        for (int i = 0; i < nr; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(wr[i] + k), xv, acc[i]);
    }
    {
        const __m256i mask = tail_mask(K);
        pf_next(pf, pf_k, row_bytes);
        const __m256 xv = _mm256_maskload_ps(a->x + k, mask);
        for (int i = 0; i < nr; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_maskload_ps(wr[i] + k, mask), xv, acc[i]);
    }
    for (int i = 0; i < nr; i++)
        a->y[n0 + i] = hsum1(acc[i]) + (a->bias ? a->bias[n0 + i] : 0.0f);
}
#endif

/* ---------------------------------------------------------------- scalar fallback */

__attribute__((unused)) static void rows_scalar(const Args *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = a->w + n * a->ldw;
        const float b = a->bias ? a->bias[n] : 0.0f;
        for (int64_t m = 0; m < a->M; m++) {
            const float *xr = a->x + m * a->ldx;
            float s = 0.0f;
            for (int64_t k = 0; k < a->K; k++) s += wr[k] * xr[k];
            a->y[m * a->ldy + n] = s + b;
        }
    }
}

/* ---------------------------------------------------------------- driver */

/* Weight rows [n0, n1) of one thread, block by block, prefetching PF_BLOCKS ahead. */
static void rows(const Args *a, int64_t n0, int64_t n1) {
#if SG_AVX2
    const int64_t row_bytes = a->K * 4;
    const int nb = a->M == 1 ? SG_NR1 : NR; /* rows per block */
    const int64_t ahead = (int64_t)SG_PF_BLOCKS * nb;
    { /* the first blocks: nothing to overlap them with, fetch them now */
        Prefetch first = pf_range(a, n0, n0 + ahead < n1 ? n0 + ahead : n1, row_bytes);
        pf_next(&first, (int)pf_lines(ahead, row_bytes), row_bytes);
    }
    for (int64_t n = n0; n < n1; n += nb) {
        const int nr = n1 - n < nb ? (int)(n1 - n) : nb;
        /* the block `ahead` rows on, clipped to this thread's range */
        int64_t p0 = n + ahead, p1 = p0 + nb;
        p0 = p0 < n1 ? p0 : n1;
        p1 = p1 < n1 ? p1 : n1;
        Prefetch pf = pf_range(a, p0, p1, row_bytes);
        if (a->M == 1) {
            const int64_t steps = (a->K + 7) / 8;
            const int pf_k = (int)((pf_lines(p1 - p0, row_bytes) + steps - 1) / steps);
            switch (nr) {
#define SG_GEMV_CASE(R) \
    case R: gemv_block(a, n, R, &pf, pf_k, row_bytes); break;
                SG_GEMV_CASE(8) SG_GEMV_CASE(7) SG_GEMV_CASE(6) SG_GEMV_CASE(5)
                SG_GEMV_CASE(4) SG_GEMV_CASE(3) SG_GEMV_CASE(2) SG_GEMV_CASE(1)
#undef SG_GEMV_CASE
                default: break;
            }
        } else {
            block(a, n, nr, &pf, p1 - p0, row_bytes);
        }
    }
#else
    rows_scalar(a, n0, n1);
#endif
}

int linear_f32(const float *x, long ldx, const float *w, long ldw, const float *bias,
               float *y, long ldy, long M, long N, long K, int num_threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldw < K || ldy < N) return -1;
#if SG_AVX2
    if (SG_NR1 < 1 || SG_NR1 > 8) return -1;
#endif
    if (M == 0 || N == 0) return 0;
    const Args a = {x, w, bias, y, ldx, ldw, ldy, M, K};
    if (K == 0) { /* empty dot products: y = bias (or 0) */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0.0f;
        return 0;
    }
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    if (threads > N / SG_MIN_ROWS_PER_THREAD) threads = N / SG_MIN_ROWS_PER_THREAD;
    if (threads < 1) threads = 1;
    if (threads == 1) {
        rows(&a, 0, N);
        return 0;
    }
    /* Each thread a contiguous range of whole blocks, split as evenly as can be (only the
     * last range may end in a short block). The team may be smaller than asked for, so
     * split by its actual size. */
    const int64_t unit = M == 1 ? SG_NR1 : NR, units = (N + unit - 1) / unit;
#pragma omp parallel num_threads((int)threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int64_t t = 0, T = 1;
#endif
        int64_t n0 = units * t / T * unit, n1 = units * (t + 1) / T * unit;
        n1 = n1 < N ? n1 : N;
        if (n0 < n1) rows(&a, n0, n1);
    }
    return 0;
}

/* 1 if this build uses the AVX2+FMA path, 0 for the scalar fallback. */
int small_gemm_simd_level(void) { return SG_AVX2; }
