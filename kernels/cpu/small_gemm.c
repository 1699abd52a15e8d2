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
 *   - The range is walked in blocks of NR=3 weight rows. For each block, all M rows of x
 *     are swept in tiles of MR=4 rows; the block (3*K*4 bytes: 7 KB at K=576) stays in
 *     the 32 KB L1 while all tiles reuse it, x (M*K*4 bytes, <= 393 KB) stays in L2.
 *     Rows longer than SG_KC_MAX (K=1536) are swept in K chunks so that a chunk of the
 *     block plus a tile's x rows still fit in L1; later chunks add into y.
 *   - A tile is NR x MR dot products, each accumulated in one 8-lane AVX register: per
 *     8 k's, NR weight loads + MR x loads feed NR*MR FMAs. 3 x 4 is 12 accumulators + 3
 *     weight vectors + 1 x vector = all 16 ymm registers, and 7 loads per 12 FMAs (Zen 3
 *     and Skylake do 2 FMAs and 2-3 loads per cycle), so large M runs at FMA throughput
 *     (~85% of peak with the operands in cache); the 12 independent accumulator chains
 *     cover the FMA latency. The lanes are summed once per tile (a 4-at-a-time hadd
 *     tree), then bias is added and the scalars stored. Reusing each x tile for two
 *     blocks (half the L2 traffic for x) measured no faster.
 *   - M=1 (GEMV) has nothing to reuse: blocks of SG_NR1=8 rows, one x load per 8 k's
 *     shared by 8 FMAs into 8 independent chains; it runs at the core's DRAM bandwidth.
 *   - Software prefetch: while a block is computed, the block SG_PF_BLOCKS on in the
 *     thread's range is prefetched, its cache lines spread evenly over the block's
 *     inner-loop steps (one line of each row every few steps, not a burst that fills the
 *     miss buffers), so the loads the FMAs wait on hit L1. Without it the body of
 *     SmolLM2-135M takes 1.1x as long at M=1 and 1.2-1.8x at M=2..64 (one thread).
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
#define SG_NR1 8
#endif
_Static_assert(SG_NR1 >= 1 && SG_NR1 <= 8, "gemv_block has 1..8 accumulators");
/* How many blocks ahead of the one being computed to prefetch; 0 disables prefetch. */
#ifndef SG_PF_BLOCKS
#define SG_PF_BLOCKS 2
#endif
/* Temporal locality hint of the prefetches: 3 = into L1 (prefetcht0). */
#ifndef SG_PF_HINT
#define SG_PF_HINT 3
#endif
/* Longest K chunk of the M >= 2 path: a block's NR rows plus a tile's MR rows of x, of
 * one chunk, must stay in the 32 KB L1 while the tile sweeps them (7 * 768 * 4 = 21 KB),
 * so longer rows (K = 1536) are done in chunks, the partial sums added up in y. */
#ifndef SG_KC_MAX
#define SG_KC_MAX 768
#endif
/* Minimum weight rows per thread: below that, fewer threads (fork/join costs ~us). */
#ifndef SG_MIN_ROWS_PER_THREAD
#define SG_MIN_ROWS_PER_THREAD 16
#endif

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t ldx, ldw, ldy, M, K;
    int64_t kc; /* K chunk of the M >= 2 path: a multiple of 8, or K */
} Args;

/* ---------------------------------------------------------------- prefetch */

/* Prefetch of one block of weight rows, spread evenly over the inner-loop steps that
 * compute an earlier block: an "event" fetches the cache line at byte offset `off` of each
 * of the block's rows (rows are strided by ldw, so one line of each), and the
 * lines_per_row events of a block are spaced num/den apart in steps (an integer credit,
 * as in Bresenham's line), so a block's prefetches end when its predecessor's compute
 * does, whatever M. Each tile copies the state into locals for its loop (registers). */
typedef struct {
    const char *p;          /* first row, rounded down to its cache line */
    int64_t stride;         /* bytes between rows */
    int64_t off, end;       /* offset of the next event; end: lines_per_row * 64 (0: none) */
    int64_t credit, num, den;
} Prefetch;

/* Cache lines an event sequence must cover for rows of row_bytes starting at `start`
 * (one spare when rows are not all equally aligned). */
INLINE int64_t lines_per_row(const char *start, int64_t row_bytes, int64_t stride) {
    return ((int64_t)((uintptr_t)start & 63) + row_bytes + 63) / 64 + (stride % 64 != 0);
}

/* The block of rows of w from row n (nothing if n >= n_end), its events spread over
 * `steps` steps. */
INLINE Prefetch pf_block(const Args *a, int64_t n, int64_t n_end, int64_t steps) {
    const char *start = (const char *)(a->w + n * a->ldw);
    const int64_t stride = a->ldw * 4, lines = lines_per_row(start, a->K * 4, stride);
    Prefetch p = {(const char *)((uintptr_t)start & ~(uintptr_t)63), stride, 0,
                  n < n_end ? lines * 64 : 0, 0, lines, steps};
    return p;
}

/* One step's share of the prefetch; `rows` is a compile-time constant. */
INLINE void pf_step(const char *p, int64_t stride, int64_t *off, int64_t end, int64_t *credit,
                    int64_t num, int64_t den, int rows) {
#if SG_PF_BLOCKS > 0
    *credit += num;
    if (*credit >= den) {
        *credit -= den;
        if (*off < end) {
            for (int i = 0; i < rows; i++)
                __builtin_prefetch(p + i * stride + *off, 0, SG_PF_HINT);
            *off += 64;
        }
    }
#else
    (void)p, (void)stride, (void)off, (void)end, (void)credit, (void)num, (void)den, (void)rows;
#endif
}

/* All of a block's events at once (the first blocks of a range: nothing to overlap). */
INLINE void pf_all(const Prefetch *pf, int rows) {
#if SG_PF_BLOCKS > 0
    for (int64_t off = 0; off < pf->end; off += 64)
        for (int i = 0; i < rows; i++)
            __builtin_prefetch(pf->p + i * pf->stride + off, 0, SG_PF_HINT);
#else
    (void)pf, (void)rows;
#endif
}

/* ---------------------------------------------------------------- AVX2 tiles */

#if SG_AVX2
/* Makes the compiler hold v in a register from here on. Left alone, gcc folds a vector
 * load into every FMA that uses it (rematerialising instead of keeping 16 registers
 * live): 15-16 loads per 12 FMAs instead of 7, and the loop turns load-bound. */
#define SG_IN_REGISTER(v) __asm__("" : "+x"(v))

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

/* y[m0+j][n0+i] (+)= w[n0+i][k0:k1] . x[m0+j][k0:k1] for i < nr, j < mr: one register
 * tile. The first K chunk (k0 == 0) stores the sum plus bias, later ones add to y.
 * nr, mr are compile-time constants at each call site (nr*mr + nr + 1 <= 16 registers);
 * pf_rows (the prefetched block's row count) too. Each 8-k step takes its share of pf. */
INLINE void tile(const Args *a, int64_t n0, int64_t m0, int64_t k0, int64_t k1, int nr,
                 int mr, Prefetch *pf, int pf_rows) {
    const int64_t Kv = k0 + ((k1 - k0 - 1) & ~(int64_t)7); /* start of the last vector */
    const float *wr[4], *xr[4];
    for (int i = 0; i < nr; i++) wr[i] = a->w + (n0 + i) * a->ldw;
    for (int j = 0; j < mr; j++) xr[j] = a->x + (m0 + j) * a->ldx;
    /* the prefetch state in locals, so that it stays in registers through the loop */
    const char *pp = pf->p;
    const int64_t ps = pf->stride, pend = pf->end, pnum = pf->num, pden = pf->den;
    int64_t poff = pf->off, pcredit = pf->credit;
    __m256 acc[4][4];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = k0;
    /* Unrolled twice: loop overhead and the prefetch bookkeeping per pair of steps. */
#pragma GCC unroll 2
    for (; k < Kv; k += 8) {
        pf_step(pp, ps, &poff, pend, &pcredit, pnum, pden, pf_rows);
        __m256 wv[4];
        for (int i = 0; i < nr; i++) {
            wv[i] = _mm256_loadu_ps(wr[i] + k);
            SG_IN_REGISTER(wv[i]);
        }
        for (int j = 0; j < mr; j++) {
            __m256 xv = _mm256_loadu_ps(xr[j] + k);
            SG_IN_REGISTER(xv);
            for (int i = 0; i < nr; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    { /* the last (possibly partial) vector: masked loads read nothing past k1 */
        const __m256i mask = tail_mask(k1 - k0);
        pf_step(pp, ps, &poff, pend, &pcredit, pnum, pden, pf_rows);
        __m256 wv[4];
        for (int i = 0; i < nr; i++) wv[i] = _mm256_maskload_ps(wr[i] + k, mask);
        for (int j = 0; j < mr; j++) {
            const __m256 xv = _mm256_maskload_ps(xr[j] + k, mask);
            for (int i = 0; i < nr; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    pf->off = poff, pf->credit = pcredit;
    for (int i = 0; i < nr; i++) {
        float *yc = a->y + m0 * a->ldy + n0 + i;
        float s[4];
        if (mr == 4)
            _mm_storeu_ps(s, hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        else
            for (int j = 0; j < mr; j++) s[j] = hsum1(acc[i][j]);
        if (k0 == 0) {
            const float b = a->bias ? a->bias[n0 + i] : 0.0f;
            for (int j = 0; j < mr; j++) yc[j * a->ldy] = s[j] + b;
        } else {
            for (int j = 0; j < mr; j++) yc[j * a->ldy] += s[j];
        }
    }
}

/* The nr <= NR rows of a block against x rows [m0, m0 + mr) over [k0, k1); mr is a
 * compile-time constant at each call site. */
INLINE void tile_rows(const Args *a, int64_t n0, int nr, int64_t m0, int64_t k0, int64_t k1,
                      int mr, Prefetch *pf) {
    if (nr == NR)
        tile(a, n0, m0, k0, k1, NR, mr, pf, NR);
    else if (nr == 2)
        tile(a, n0, m0, k0, k1, 2, mr, pf, NR);
    else
        tile(a, n0, m0, k0, k1, 1, mr, pf, NR);
}

/* One block of nr weight rows against all M rows of x: per K chunk, MR-row tiles, then
 * the M % MR tail. The block's prefetch, pf, is spread over all of its steps. */
INLINE void block(const Args *a, int64_t n0, int nr, Prefetch *pf) {
    const int64_t M = a->M, K = a->K;
    for (int64_t k0 = 0; k0 < K; k0 += a->kc) {
        const int64_t k1 = K - k0 < a->kc ? K : k0 + a->kc;
        int64_t m0 = 0;
        for (; m0 + MR <= M; m0 += MR) tile_rows(a, n0, nr, m0, k0, k1, MR, pf);
        switch (M - m0) {
            case 3: tile_rows(a, n0, nr, m0, k0, k1, 3, pf); break;
            case 2: tile_rows(a, n0, nr, m0, k0, k1, 2, pf); break;
            case 1: tile_rows(a, n0, nr, m0, k0, k1, 1, pf); break;
            default: break;
        }
    }
}

/* M = 1: y[0][n0+i] for i < nr (nr <= 8 is a compile-time constant at each call site),
 * nr independent accumulator chains, the x vector loaded once per step for all of them. */
INLINE void gemv_block(const Args *a, int64_t n0, int nr, Prefetch *pf) {
    const int64_t K = a->K, Kv = (K - 1) & ~(int64_t)7;
    const float *wr[8];
    for (int i = 0; i < nr; i++) wr[i] = a->w + (n0 + i) * a->ldw;
    const char *pp = pf->p;
    const int64_t ps = pf->stride, pend = pf->end, pnum = pf->num, pden = pf->den;
    int64_t poff = pf->off, pcredit = pf->credit;
    __m256 acc[8];
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < Kv; k += 8) {
        pf_step(pp, ps, &poff, pend, &pcredit, pnum, pden, SG_NR1);
        const __m256 xv = _mm256_loadu_ps(a->x + k);
        for (int i = 0; i < nr; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(wr[i] + k), xv, acc[i]);
    }
    {
        const __m256i mask = tail_mask(K);
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

/* Weight rows [n0, n1) of one thread, block by block, each block's compute prefetching
 * the block SG_PF_BLOCKS on. */
static void rows(const Args *a, int64_t n0, int64_t n1) {
#if SG_AVX2
    const int nb = a->M == 1 ? SG_NR1 : NR; /* rows per block */
    /* inner-loop steps per block, over which a block's prefetch is spread */
    const int64_t steps = (a->M == 1 ? 1 : (a->M + MR - 1) / MR) * ((a->K + 7) / 8);
    for (int b = 0; b < SG_PF_BLOCKS; b++) { /* the first blocks: nothing to overlap */
        const Prefetch first = pf_block(a, n0 + (int64_t)b * nb, n1, steps);
        if (a->M == 1)
            pf_all(&first, SG_NR1);
        else
            pf_all(&first, NR);
    }
    for (int64_t n = n0; n < n1; n += nb) {
        const int nr = n1 - n < nb ? (int)(n1 - n) : nb;
        /* Prefetching past n1 (another thread's rows, or past the end of w, for a short
         * last block) is harmless: a prefetch never faults. */
        Prefetch pf = pf_block(a, n + (int64_t)SG_PF_BLOCKS * nb, n1, steps);
        if (a->M == 1) {
            switch (nr) {
#define SG_GEMV_CASE(R) \
    case R: gemv_block(a, n, R, &pf); break;
                SG_GEMV_CASE(8) SG_GEMV_CASE(7) SG_GEMV_CASE(6) SG_GEMV_CASE(5)
                SG_GEMV_CASE(4) SG_GEMV_CASE(3) SG_GEMV_CASE(2) SG_GEMV_CASE(1)
#undef SG_GEMV_CASE
                default: break;
            }
        } else {
            block(a, n, nr, &pf);
        }
    }
#else
    rows_scalar(a, n0, n1);
#endif
}

int linear_f32(const float *x, long ldx, const float *w, long ldw, const float *bias,
               float *y, long ldy, long M, long N, long K, int num_threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldw < K || ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t chunks = (K + SG_KC_MAX - 1) / SG_KC_MAX;
    const int64_t kc = chunks <= 1 ? K : ((K + chunks - 1) / chunks + 7) & ~(int64_t)7;
    const Args a = {x, w, bias, y, ldx, ldw, ldy, M, K, kc};
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
