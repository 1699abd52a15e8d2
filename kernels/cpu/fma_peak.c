/* The machine's compute limit: fused multiply-adds that never leave the registers.
 *
 * Each thread runs CHAINS independent float FMA chains (a = a * m + c) for `iters`
 * rounds: enough chains to cover the FMA latency on both ports of a core, no loads or
 * stores inside the loop, so the only limit is the FMA units themselves. The chains are
 * `width` floats wide, 8 or 16: GCC's vector types compile to AVX2 FMAs, or to AVX-512
 * ones under -march=native where the CPU has them (elsewhere a 16-wide chain is two
 * 8-wide ones, and the portable fallback is the same source). Both widths are measured
 * because they differ by machine: Zen 4 runs a 512-bit FMA as two 256-bit halves (the
 * same rate), Intel's server cores with two 512-bit FMA units run it whole (twice the
 * rate). Returns the GFLOP/s of all `num_threads` threads together, each FMA counting as
 * two FLOPs, timed over the wall clock from the first thread's start to the last one's end.
 */
#include <omp.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
#define CHAINS 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* The chains for vector type V of N floats; the sum of their lanes. */
#define CHAINS_OF(V, N)                                                      \
    static float chains_##N(long iters, float seed) {                        \
        V a[CHAINS], m, c;                                                   \
        for (int l = 0; l < N; l++) m[l] = 0.9999999f, c[l] = 1e-7f;        \
        for (int j = 0; j < CHAINS; j++)                                     \
            for (int l = 0; l < N; l++) a[j][l] = seed + (l ? 0 : j);        \
        for (long i = 0; i < iters; i++) {                                   \
            _Pragma("GCC unroll 12") for (int j = 0; j < CHAINS; j++)        \
                a[j] = a[j] * m + c; /* contracted to one FMA */            \
        }                                                                    \
        V s = a[0];                                                          \
        for (int j = 1; j < CHAINS; j++) s += a[j];                          \
        float t = 0.0f;                                                      \
        for (int l = 0; l < N; l++) t += s[l];                               \
        return t;                                                            \
    }
CHAINS_OF(v8, 8)
CHAINS_OF(v16, 16)

/* GFLOP/s of num_threads threads each running `iters` rounds of chains `width` (8 or 16)
 * floats wide; *sink keeps the result observable so the loop cannot be optimised away. */
double fma_peak_gflops(long iters, int num_threads, int width, float *sink) {
    float total = 0.0f;
    double start = now();
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    total += width == 16 ? chains_16(iters, (float)omp_get_thread_num())
                         : chains_8(iters, (float)omp_get_thread_num());
    double seconds = now() - start;
    *sink = total;
    return 2.0 * (width == 16 ? 16 : 8) * CHAINS * (double)iters * num_threads / seconds / 1e9;
}
