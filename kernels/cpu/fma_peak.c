/* The machine's compute limit: fused multiply-adds that never leave the registers.
 *
 * Each thread runs CHAINS independent 8-wide float FMA chains (a = a * m + c) for
 * `iters` rounds: enough chains to cover the FMA latency on both ports of a core, no
 * loads or stores inside the loop, so the only limit is the FMA units themselves. The
 * GCC vector type compiles to AVX2 FMA under -march=native and to whatever the target
 * has elsewhere (the portable fallback is the same source). Returns the GFLOP/s of all
 * `num_threads` threads together, each FMA counting as two FLOPs, timed over the wall
 * clock from the first thread's start to the last one's end.
 */
#include <omp.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32)));
#define CHAINS 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float chains(long iters, float seed) {
    v8 a[CHAINS];
    const v8 m = {0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f,
                  0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f};
    const v8 c = {1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f};
    for (int j = 0; j < CHAINS; j++) {
        v8 s = {seed + j, seed, seed, seed, seed, seed, seed, seed};
        a[j] = s;
    }
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < CHAINS; j++) a[j] = a[j] * m + c;  /* contracted to one FMA */
    }
    v8 s = a[0];
    for (int j = 1; j < CHAINS; j++) s += a[j];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

/* GFLOP/s of num_threads threads each running `iters` rounds; *sink keeps the result
 * observable so the loop cannot be optimised away. */
double fma_peak_gflops(long iters, int num_threads, float *sink) {
    float total = 0.0f;
    double start = now();
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    total += chains(iters, (float)omp_get_thread_num());
    double seconds = now() - start;
    *sink = total;
    return 2.0 * 8 * CHAINS * (double)iters * num_threads / seconds / 1e9;
}
