/*
 * y = x @ w.T (+ bias) in float32 against a weight packed once at model load: the CPU
 * GEMM of every nn.Linear of the model, at any number of rows (decode steps with a few
 * sequences, prefill chunks of thousands of tokens). Plain C + OpenMP, no torch headers;
 * the loader is kernels/cpu_gemm.py, the oracle torch's x @ w.T + b.
 *
 * Packed layout. w [N, K] (an nn.Linear weight) becomes P = ceil(N / 16) panels, panel p
 * holding columns 16p .. 16p+15 of y as [K][16] floats (k-major, 64 bytes a k), zero
 * rows past N. A panel is one contiguous stream: the hardware prefetcher follows it, and
 * one k step of the micro-kernel reads exactly one cache line of it.
 *
 * Micro-kernel: a 6 x 16 tile of y in 12 AVX2 registers; per k, two loads of the panel's
 * 16 floats and six broadcasts of x[m][k] feed 12 FMAs (15 of the 16 ymm registers).
 * That is 8 loads per 12 FMAs: FMA-bound on cores with two load ports (Zen, Skylake).
 * Outer product, so every y element is one FMA chain over k in order: no horizontal sums.
 *
 * Blocking (per thread):
 *   - Threads split the panels (N), never M or K, so each weight element is read by one
 *     thread, and for M <= SG_MC (decode steps of up to 96 sequences) exactly once per
 *     call. Every k step also prefetches the same k of the next panel, so the next panel
 *     streams in from DRAM while this one is computed (1.2-1.4x at 16 rows on the LM
 *     head).
 *   - Rows of x in blocks of SG_MC; per panel, K in chunks of at most SG_KC, each chunk
 *     swept by every 6-row tile of the block while it stays in cache (a whole panel of
 *     K = 576 is 36 KB, of K = 1536 96 KB: L1/L2), the block's x rows in L2 across all
 *     of the thread's panels. Later K chunks add into y. Measured on a 2-core Zen: SG_MC
 *     96 and unchunked K beat SG_KC 256-320 and SG_MC 48-72 by a few percent; against
 *     MKL (torch) the whole model's products run 1.9x faster at 1 row, 1.3-1.6x at
 *     16-64, level at 256-512 and 1.1x at 2048 (loadtest/cpu_gemm_bench.py).
 *   - x is used in place (row-major, stride ldx): six row streams, no packing.
 *
 * Float32 accumulation, no -ffast-math: results differ from torch's only by summation
 * order (~1e-6 relative). Without AVX2+FMA the build falls back to plain C loops.
 *
 * Returns 0, or -1 if a size or stride is invalid (nothing is written then).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PG_AVX2 1
#else
#define PG_AVX2 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* Columns of a panel (two 8-lane vectors) and rows of a tile. */
#define NR 16
#define MR 6
/* Rows of x per block (a multiple of MR). */
#ifndef SG_MC
#define SG_MC 96
#endif
/* Longest K chunk. */
#ifndef SG_KC
#define SG_KC 1536
#endif
/* 1: every k step prefetches the same k of the next panel, 0: hardware prefetch only. */
#ifndef SG_PF
#define SG_PF 1
#endif
/* Minimum panels per thread: below that, fewer threads. */
#ifndef SG_MIN_PANELS_PER_THREAD
#define SG_MIN_PANELS_PER_THREAD 2
#endif

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t ldx, ldy, M, N, K;
} Args;

/* Panels of a weight with N rows. */
INLINE int64_t num_panels(int64_t N) { return (N + NR - 1) / NR; }

/* w [N, K] (row n at w + n*ldw) into out [P][K][16], zero-padded past N. */
int pack_f32(const float *w, long ldw, long N, long K, float *out) {
    if (N < 0 || K < 0 || ldw < K) return -1;
    const int64_t P = num_panels(N);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        float *panel = out + p * K * NR;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t n = p * NR + j;
            for (int64_t k = 0; k < K; k++) panel[k * NR + j] = n < N ? w[n * ldw + k] : 0.0f;
        }
    }
    return 0;
}

/* Floats of the packed form of an [N, K] weight. */
long packed_size_f32(long N, long K) { return (long)(num_panels(N) * K * NR); }

#if PG_AVX2
/* y[m0:m0+mr][n0:n0+16] (+)= x[m0:m0+mr][k0:k1] @ panel[k0:k1]; the first chunk stores
 * (plus bias), later ones add. nv < 16 valid columns only for the last panel. mr is a
 * compile-time constant at each call site. */
INLINE void tile(const Args *a, const float *panel, int64_t n0, int nv, int64_t m0,
                 int64_t k0, int64_t k1, int mr) {
    /* Named accumulators (an array would be spilled to the stack every step); the rows a
     * tile of mr < 6 lacks are dead code for the constant mr. */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const int64_t ldx = a->ldx;
    const float *x0 = a->x + m0 * ldx + k0;
    const float *b = panel + k0 * NR;
#if SG_PF
    const int64_t pfd = a->K * NR; /* the same k of the next panel */
#endif
#define PG_ROW(i, c0, c1)                                            \
    if (mr > i) {                                                    \
        const __m256 xv = _mm256_broadcast_ss(x0 + (i) * ldx + k);   \
        c0 = _mm256_fmadd_ps(xv, b0, c0);                            \
        c1 = _mm256_fmadd_ps(xv, b1, c1);                            \
    }
#pragma GCC unroll 4
    for (int64_t k = 0; k < k1 - k0; k++, b += NR) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#if SG_PF
        __builtin_prefetch(b + pfd, 0, 3);
#endif
        PG_ROW(0, c00, c01) PG_ROW(1, c10, c11) PG_ROW(2, c20, c21)
        PG_ROW(3, c30, c31) PG_ROW(4, c40, c41) PG_ROW(5, c50, c51)
    }
#undef PG_ROW
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                               {c30, c31}, {c40, c41}, {c50, c51}};
    const int first = k0 == 0;
    __m256 bias0 = _mm256_setzero_ps(), bias1 = _mm256_setzero_ps();
    if (first && a->bias) {
        float tmp[NR] = {0};
        memcpy(tmp, a->bias + n0, (size_t)nv * sizeof(float));
        bias0 = _mm256_loadu_ps(tmp), bias1 = _mm256_loadu_ps(tmp + 8);
    }
    for (int i = 0; i < mr; i++) {
        float *yr = a->y + (m0 + i) * a->ldy + n0;
        __m256 v0 = acc[i][0], v1 = acc[i][1];
        if (nv == NR) {
            if (first) {
                v0 = _mm256_add_ps(v0, bias0), v1 = _mm256_add_ps(v1, bias1);
            } else {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(yr));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(yr + 8));
            }
            _mm256_storeu_ps(yr, v0), _mm256_storeu_ps(yr + 8, v1);
        } else {
            float tmp[NR];
            _mm256_storeu_ps(tmp, first ? _mm256_add_ps(v0, bias0) : v0);
            _mm256_storeu_ps(tmp + 8, first ? _mm256_add_ps(v1, bias1) : v1);
            for (int j = 0; j < nv; j++) yr[j] = first ? tmp[j] : yr[j] + tmp[j];
        }
    }
}

/* Panels [p0, p1) against rows [m0, m1): per panel, its K chunks, each swept by every
 * tile of the rows while it sits in L1; the y tiles stay in L1/L2 across the chunks. */
static void chunk(const Args *a, int64_t p0, int64_t p1, int64_t m0, int64_t m1, int64_t kc) {
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = a->w + p * a->K * NR;
        const int64_t n0 = p * NR;
        const int nv = a->N - n0 < NR ? (int)(a->N - n0) : NR;
        for (int64_t k0 = 0; k0 < a->K; k0 += kc) {
            const int64_t k1 = a->K - k0 < kc ? a->K : k0 + kc;
            int64_t m = m0;
            for (; m + MR <= m1; m += MR) tile(a, panel, n0, nv, m, k0, k1, MR);
            switch (m1 - m) {
                case 5: tile(a, panel, n0, nv, m, k0, k1, 5); break;
                case 4: tile(a, panel, n0, nv, m, k0, k1, 4); break;
                case 3: tile(a, panel, n0, nv, m, k0, k1, 3); break;
                case 2: tile(a, panel, n0, nv, m, k0, k1, 2); break;
                case 1: tile(a, panel, n0, nv, m, k0, k1, 1); break;
                default: break;
            }
        }
    }
}
#else
static void chunk(const Args *a, int64_t p0, int64_t p1, int64_t m0, int64_t m1, int64_t kc) {
    (void)kc;
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = a->w + p * a->K * NR;
        for (int64_t j = 0; j < NR && p * NR + j < a->N; j++) {
            const int64_t n = p * NR + j;
            for (int64_t m = m0; m < m1; m++) {
                float s = a->bias ? a->bias[n] : 0.0f;
                for (int64_t k = 0; k < a->K; k++) s += a->x[m * a->ldx + k] * panel[k * NR + j];
                a->y[m * a->ldy + n] = s;
            }
        }
    }
}
#endif

/* One thread's panels [p0, p1), in row blocks. */
static void panels(const Args *a, int64_t p0, int64_t p1) {
    const int64_t chunks = (a->K + SG_KC - 1) / SG_KC;
    const int64_t kc = (a->K + chunks - 1) / chunks;
    for (int64_t m0 = 0; m0 < a->M; m0 += SG_MC) {
        const int64_t m1 = a->M - m0 < SG_MC ? a->M : m0 + SG_MC;
        chunk(a, p0, p1, m0, m1, kc);
    }
}

int packed_linear_f32(const float *x, long ldx, const float *packed, const float *bias,
                      float *y, long ldy, long M, long N, long K, int num_threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    if (K == 0) { /* empty dot products: y = bias (or 0) */
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * ldy + n] = bias ? bias[n] : 0.0f;
        return 0;
    }
    const Args a = {x, packed, bias, y, ldx, ldy, M, N, K};
    const int64_t P = num_panels(N);
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    if (threads > P / SG_MIN_PANELS_PER_THREAD) threads = P / SG_MIN_PANELS_PER_THREAD;
    if (threads <= 1) {
        panels(&a, 0, P);
        return 0;
    }
#pragma omp parallel num_threads((int)threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int64_t t = 0, T = 1;
#endif
        const int64_t p0 = P * t / T, p1 = P * (t + 1) / T;
        if (p0 < p1) panels(&a, p0, p1);
    }
    return 0;
}

/* 1 if this build uses the AVX2+FMA path, 0 for the scalar fallback. */
int packed_gemm_simd_level(void) { return PG_AVX2; }
