/*
 * The elementwise steps of a Llama layer, fused for the CPU: each is one pass over its
 * rows where torch takes three to six (every intermediate a full tensor written and read
 * back). Plain C + OpenMP, no torch headers; the loader is kernels/cpu_ops.py, the
 * oracles the torch expressions in common/model/llama.py.
 *
 *   add_rms_norm  x += delta (the residual stream, in place; delta may be NULL), then
 *                 out = x * rsqrt(mean(x^2) + eps) * weight
 *   silu_mul      out = silu(gu[:, :I]) * gu[:, I:]  (the fused gate|up projection)
 *   rope_qk       q, k = rotate_half RoPE of the q and k heads of a fused qkv row, with
 *                 the cos/sin tables' rows at each token's position, into contiguous
 *                 q [T, H, D] and k [T, KVH, D]
 *   argmax_rows   out[t] = the index of the largest of row t's C values, the first of
 *                 equal ones; a row holding a NaN gives its first NaN (torch.argmax's
 *                 answer). Greedy sampling's pick over the vocabulary: torch's CPU
 *                 argmax compares one element at a time (~0.9 ns each, 44 us for one
 *                 49,152-entry row; 64 rows 1.8-2.7 ms on 2 threads of a Zen 4).
 *
 * All float32, rows strided (element strides), no -ffast-math: the same products as the
 * torch expressions; the mean of squares and exp() differ only in rounding (a pairwise
 * sum of 8 lanes; simd.h's polynomial exp with < 2e-7 relative error). Rows are split across
 * threads when there are enough of them to pay for the fork.
 *
 * Return value: 0, or -1 for invalid sizes (nothing written).
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FO_AVX2 1
#else
#define FO_AVX2 0
#endif

/* Elements of work below which a call stays on one thread. */
#ifndef FO_MIN_PARALLEL
#define FO_MIN_PARALLEL 32768
#endif

#include "simd.h" /* INLINE, hsum1, exp8 */

/* ---------------------------------------------------------------- add_rms_norm */

static void add_rms_norm_row(float *x, const float *delta, const float *w, float eps,
                             float *out, int64_t C) {
    int64_t c = 0;
    float ss = 0.0f;
#if FO_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= C; c += 8) {
        __m256 v = _mm256_loadu_ps(x + c);
        if (delta) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(delta + c));
            _mm256_storeu_ps(x + c, v);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum1(acc);
#endif
    for (; c < C; c++) {
        float v = x[c];
        if (delta) x[c] = v = v + delta[c];
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
    c = 0;
#if FO_AVX2
    const __m256 rv = _mm256_set1_ps(r);
    for (; c + 8 <= C; c += 8)
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(w + c),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + c), rv)));
#endif
    for (; c < C; c++) out[c] = w[c] * (x[c] * r);
}

int add_rms_norm_f32(float *x, long ldx, const float *delta, long ldd, const float *weight,
                     float eps, float *out, long ldo, long T, long C) {
    if (T < 0 || C < 1 || ldx < C || ldo < C || (delta && ldd < C)) return -1;
#pragma omp parallel for schedule(static) if (T * C >= FO_MIN_PARALLEL)
    for (int64_t t = 0; t < T; t++)
        add_rms_norm_row(x + t * ldx, delta ? delta + t * ldd : 0, weight, eps, out + t * ldo, C);
    return 0;
}

/* ---------------------------------------------------------------- silu_mul */

static void silu_mul_row(const float *g, const float *u, float *out, int64_t I) {
    int64_t i = 0;
#if FO_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, gv)); /* exp(-g) */
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

int silu_mul_f32(const float *gu, long ldg, float *out, long ldo, long T, long I) {
    if (T < 0 || I < 0 || ldg < 2 * I || ldo < I) return -1;
#pragma omp parallel for schedule(static) if (T * I >= FO_MIN_PARALLEL)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * ldg, gu + t * ldg + I, out + t * ldo, I);
    return 0;
}

/* ---------------------------------------------------------------- rope_qk */

/* dst = src * cos + rotate_half(src) * sin for one head of D = 2 * half elements; sin
 * already carries rotate_half's sign (-sin, sin), as in common/model/llama.py. */
static void rope_head(const float *src, const float *cos, const float *sin, float *dst,
                      int64_t half) {
    int64_t i = 0;
#if FO_AVX2
    for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_loadu_ps(src + i), b = _mm256_loadu_ps(src + half + i);
        _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)),
                                                _mm256_mul_ps(b, _mm256_loadu_ps(sin + i))));
        _mm256_storeu_ps(dst + half + i,
                         _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i)),
                                       _mm256_mul_ps(a, _mm256_loadu_ps(sin + half + i))));
    }
#endif
    for (; i < half; i++) {
        const float a = src[i], b = src[half + i];
        dst[i] = a * cos[i] + b * sin[i];
        dst[half + i] = b * cos[half + i] + a * sin[half + i];
    }
}

/* qkv rows [T] (stride ldq): heads 0..H-1 are q, H..H+KVH-1 are k, each D wide; cos/sin
 * [max_pos, D]; positions [T] int64, each in [0, max_pos). */
int rope_qk_f32(const float *qkv, long ldq, const int64_t *positions, const float *cos,
                const float *sin, long max_pos, float *q, float *k, long T, long H, long KVH,
                long D) {
    if (T < 0 || H < 1 || KVH < 0 || D < 2 || D % 2 || ldq < (H + KVH) * D) return -1;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
#pragma omp parallel for schedule(static) if (T * (H + KVH) * D >= FO_MIN_PARALLEL)
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ldq, *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t h = 0; h < H; h++) rope_head(row + h * D, c, s, q + (t * H + h) * D, D / 2);
        for (int64_t h = 0; h < KVH; h++)
            rope_head(row + (H + h) * D, c, s, k + (t * KVH + h) * D, D / 2);
    }
    return 0;
}

/* ---------------------------------------------------------------- argmax_rows */

/* The first index of the row's largest value (NaN counts as largest), two passes: the
 * maximum (and whether a NaN is there), then where it first occurs. Both are exact, so
 * the answer is torch.argmax's whatever the vector width. */
static int64_t argmax_row(const float *x, int64_t C) {
    float m = -INFINITY;
    int nan = 0;
    int64_t c = 0;
#if FO_AVX2
    __m256 vm = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    for (; c + 8 <= C; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        vm = _mm256_max_ps(vm, v); /* a NaN in v is dropped here: vnan keeps it */
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(vnan) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; c < C; c++) {
        nan |= x[c] != x[c];
        m = x[c] > m ? x[c] : m;
    }
    int64_t i = 0;
#if FO_AVX2
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= C; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < C; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0; /* C = 0 */
}

int argmax_rows_f32(const float *x, long ldx, long T, long C, int64_t *out) {
    if (T < 0 || C < 0 || (T > 1 && ldx < C)) return -1;
#pragma omp parallel for schedule(static) if (T * C >= 8 * FO_MIN_PARALLEL)
    for (int64_t t = 0; t < T; t++) out[t] = argmax_row(x + t * ldx, C);
    return 0;
}

/* 1 if this build uses the AVX2+FMA path, 0 for the scalar fallback. */
int fused_ops_simd_level(void) { return FO_AVX2; }
