/*
 * y = x @ W.T (+ bias) for x float32 [M, K] and W [N, K] kept quantised (GGUF Q8_0,
 * Q4_0, Q4_1, or int8 with one fp32 scale per row), plus the dequantised rows of W for an
 * embedding lookup. Weights are dequantised in registers; x stays float32, so the product
 * equals x @ W.dequantize().T up to float32 summation order. Loader: kernels/cpu_quant.py;
 * reference: kernels/quant_formats.py. Dequantised weights (embedding, the panel buffer)
 * are bit-identical to gguf's: d*q is exact in float32 (f16 d, 4/8-bit q), so d*q + m
 * rounds once, fused or not; the build adds -ffp-contract=off all the same.
 *
 * Packed layout (made once at load by quant_pack; every quant and scale kept as is):
 * rows in panels of 16 (zero rows past N), a panel one contiguous stream of its blocks of
 * 32 columns, each block the 16 rows' scales then their quants transposed row-fastest:
 *   Q8_0: d f16[16] | q int8[32][16]                        544 B (34 per row, as GGUF)
 *   Q4_0: d f16[16] | nib u8[16][16]                        288 B
 *   Q4_1: d f16[16] | m f16[16] | nib u8[16][16]            320 B
 * (nib[i][j]: row j's byte i, weight i low, i + 16 high, as in GGUF) and for INT8_ROW a
 * panel is s f32[16] | q int8[K][16]. One vector load of 8 bytes and a zero/sign
 * extension gives one k for 8 rows: no horizontal sums, scales load as vectors.
 *
 * Small M (decode, M <= QG_GEMV_MAX; AVX-512: M <= QG_GEMV_MAX16): per panel, per block, t = sum_k x[k]*q[k] for each
 * row of x into several FMA chains (FMA latency), then acc += d*t (Q4_1: + m*sum(x) of the
 * block; Q4_0: - 8d*sum(x)), the block sums of x computed once per call. Each weight byte
 * is read from DRAM once; rows of x in tiles of up to 4 re-read the panel from L1, and a
 * tile converts each weight to float once for all its rows (4 rows cost 2x one row, not 4x:
 * what makes verifying a speculative draft cheap). With AVX-512 VNNI (M <= QG_VNNI_MAX),
 * and on AVX2 alone for Q4 at one row (QG_AVX2_INT_MAX), the weights' integer codes
 * multiply x's exact integer digits instead (quant_gemm_vnni.h, quant_gemm_avx2_int.h).
 * Larger M: per panel, dequantise it into a float32 [K][16] buffer once (L1/L2), then a
 * 6 x 16 FMA micro-kernel sweeps every row of the M block over it (as packed_gemm.c);
 * with AVX-512, two panels at a time under a 12 x 32 tile (quant_gemm_avx512.h). Where the
 * CPU has AMX-BF16 and the kernel grants it, block formats, and INT8_ROW with K a whole
 * number of blocks, from QG_AMX_MIN rows run on the tile unit instead (quant_gemm_amx.h:
 * the weights' integer codes and three exact bf16 parts of x, so still float32 accuracy).
 *
 * Threads (OpenMP) split the panels. The AVX2/FMA/F16C code is compiled with target
 * attributes and chosen at run time, with an AVX-512 path beside it (quant_gemm_avx512.h);
 * quant_set_isa caps the choice (tests: each path, and the plain C one).
 * Entry points return 0, or -1 on an invalid size/format, -2 on an id out of range.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define QG_X86 1
#define TGT __attribute__((target("avx2,fma,f16c")))
#else
#define QG_X86 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#define NR 16 /* rows of W per panel */
#define QK 32 /* columns per block */
#define MR 6  /* rows of x per tile of the panel GEMM */
#ifndef QG_GEMV_MAX
/* Largest M run by the AVX2 GEMV path. At 24 when first measured (4-row tiles, 2 threads,
 * SmolLM2's shapes, 2026-12-03: 1.2-1.3x dequantise + GEMM at M 12-16); against today's
 * GEMM, on a Zen 2 VM (the 30 Q4_1 layers from DRAM, 2 threads, a C harness, two rounds):
 * M 8 13.9-14.0 ms against 18.8-18.9, 10 17.9-18.2 against 19.0-19.3, 12 20.3-20.4
 * against 20.5-20.6, 14 24.3-24.4 against 23.6, 16 26.8-27.1 against 25.1-25.2, 20
 * 33.4-33.5 against 28.8-29.8, 24 39.4-39.7 against 33.0-33.2. Not re-measured on Zen 3. */
#define QG_GEMV_MAX 12
#endif
/* The same for the AVX-512 path (see quant_gemm_avx512.h), by how the core runs a 512-bit
 * FMA. Split in two 256-bit halves (Zen 4): these tiles beat dequantise + GEMM up to 128
 * rows. Whole, on two units (Intel's server cores; AMD from Zen 5): the GEMM's peak
 * doubles and it wins from ~40 rows (one thread, SmolLM2's products, an Emerald Rapids
 * Xeon: 32 rows 119 against 110-115 GFLOP/s, 48 rows 125 against 130, 64 rows 125
 * against 134). A rule on the CPU's identity, not a timing, so a machine always takes
 * the same path for the same M and its outputs do not depend on a measurement. */
#ifndef QG_GEMV_MAX16
#define QG_GEMV_MAX16 128
#endif
#ifndef QG_GEMV_MAX16_WIDE
#define QG_GEMV_MAX16_WIDE 40
#endif
#ifndef QG_VNNI_MAX
#define QG_VNNI_MAX 8 /* largest M of the integer GEMV (quant_gemm_vnni.h), block formats */
#endif
#ifndef QG_AVX2_INT_MAX
#define QG_AVX2_INT_MAX 1 /* largest M of the AVX2 integer GEMV (quant_gemm_avx2_int.h), Q4 */
#endif
#ifndef QG_AMX_MIN
/* Smallest M of the AMX GEMM (quant_gemm_amx.h), block formats, where the CPU has it: it
 * pads x to 16-row tiles, and beats the GEMVs from about 12 rows (SmolLM2's products, 2
 * threads, a Xeon with AMX, 2026-12-07: 9 rows 0.95x, 12 1.3x, 16-32 1.5x, 40 1.25x). */
#define QG_AMX_MIN 12
#endif
#ifndef QG_MC
#define QG_MC 96 /* rows of x per block of the panel GEMM */
#endif
#ifndef QG_MC5
/* The same for the AVX-512 GEMM: each block dequantises every panel again, and the
 * 12 x 32 tile gets through a block twice as fast where the FMA runs 512 bits whole
 * (one thread, an Emerald Rapids Xeon, SmolLM2's products at M = 512: 96 rows 125-136
 * GFLOP/s, 144 rows 130-145, 192 rows 131-148, 240 rows 129-147) */
#define QG_MC5 192
#endif
#ifndef QG_PF
/* GEMV: prefetch this many bytes ahead in the panel stream (0: off). On a Zen 2 VM (2
 * vCPUs, memory read ~25 GB/s), SmolLM2's 30 Q4_1 layers at M = 1 from DRAM, 2 threads,
 * three rounds in turns of a C harness: none 5.1-5.3 ms, 512 bytes 4.1-4.5, 1,024
 * 3.8-4.2, 2,048 3.8-4.1, 4,096 3.7-4.1 (M = 2: 4.5 against 4.6-4.7 at 512; M = 16
 * level); through cpu_quant.linear, three pairs, 5.39-5.46 ms against 5.52-5.62 at 512. */
#define QG_PF 4096
#endif
#ifndef QG_PF512
/* The same for the AVX-512 GEMVs (integer and float), which stream a panel faster. 512
 * bytes ahead (8 lines) covered too little of DRAM's latency there: on a Zen 5 VM
 * (2 vCPUs, memory read ~75 GB/s), SmolLM2's 30 layers, both builds in one process in
 * turns, 4,096 bytes ahead against 512: Q4_1 at M = 1 1.25-1.42 ms against 1.44-1.57
 * (none: 1.36), the Q8_0 head 2.26 against 2.49, M = 9 5.7 against 7.2, M = 16-40 5-10%
 * less; 8,192 and 16,384 no better. Not re-measured on Zen 4 or Intel. */
#define QG_PF512 4096
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, INT8_ROW = 3 };

typedef struct {
    int fmt;
    const uint8_t *w;
    const float *x, *bias, *sx; /* sx: block sums of x, [M][K/32] (Q4 GEMV only) */
    float *y;
    int64_t ldx, ldy, M, N, K, pbytes;
} Args;

/* Instruction sets, each a superset of the last; the best allowed (quant_set_isa): the
 * CPU's own best unless capped lower. */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_VNNI = 3, ISA_AMX = 4 };
static int isa_cap = ISA_AMX;

/* This thread's number in its parallel region, and the region's thread count. */
INLINE int64_t thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
INLINE int64_t num_threads_now(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

INLINE int64_t num_panels(int64_t N) { return (N + NR - 1) / NR; }
INLINE int64_t block_bytes(int fmt) { return fmt == Q8_0 ? 544 : fmt == Q4_0 ? 288 : 320; }
INLINE int64_t quant_offset(int fmt) { return fmt == Q4_1 ? 64 : 32; }
INLINE int64_t panel_bytes(int fmt, int64_t K) {
    return fmt == INT8_ROW ? 64 + NR * K : K / QK * block_bytes(fmt);
}
static int valid(int fmt, int64_t N, int64_t K) {
    return fmt >= Q8_0 && fmt <= INT8_ROW && N >= 0 && K >= 0 && (fmt == INT8_ROW || K % QK == 0);
}

/* IEEE half to float, exactly (subnormals, infinities and NaN payloads included). */
static float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff, bits;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | mant << 13;
    } else if (e) {
        bits = sign | (e + 112) << 23 | mant << 13;
    } else if (!mant) {
        bits = sign;
    } else { /* subnormal: normalise */
        uint32_t be = 113;
        while (!(mant & 0x400)) mant <<= 1, be--;
        bits = sign | be << 23 | (mant & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

long quant_packed_size(int fmt, long N, long K) {
    return valid(fmt, N, K) ? (long)(num_panels(N) * panel_bytes(fmt, K)) : -1;
}

/* src: N GGUF rows (INT8_ROW: N rows of K int8 and scales[N]) into out. */
int quant_pack(int fmt, const uint8_t *src, const float *scales, long N, long K, uint8_t *out) {
    if (!valid(fmt, N, K) || (fmt == INT8_ROW && !scales)) return -1;
    const int64_t pb = panel_bytes(fmt, K), gb = fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20;
    const int64_t rb = fmt == INT8_ROW ? K : K / QK * gb, nq = fmt == Q8_0 ? 32 : 16;
    const int64_t hdr = fmt == Q4_1 ? 4 : 2, qo = quant_offset(fmt);
    memset(out, 0, (size_t)(num_panels(N) * pb));
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        uint8_t *panel = out + n / NR * pb;
        const int64_t j = n % NR;
        const uint8_t *row = src + n * rb;
        if (fmt == INT8_ROW) {
            memcpy(panel + 4 * j, scales + n, 4);
            for (int64_t k = 0; k < K; k++) panel[64 + k * NR + j] = row[k];
            continue;
        }
        for (int64_t b = 0; b < K / QK; b++) {
            const uint8_t *g = row + b * gb;
            uint8_t *o = panel + b * block_bytes(fmt);
            memcpy(o + 2 * j, g, 2);
            if (fmt == Q4_1) memcpy(o + 32 + 2 * j, g + 2, 2);
            for (int64_t i = 0; i < nq; i++) o[qo + i * NR + j] = g[hdr + i];
        }
    }
    return 0;
}

/* Row j of a panel, dequantised into out[k * stride] as gguf does (mul, then add). */
static void dequant_lane(int fmt, const uint8_t *panel, int64_t K, int64_t j, float *out,
                         int64_t stride) {
    if (fmt == INT8_ROW) {
        float s;
        memcpy(&s, panel + 4 * j, 4);
        for (int64_t k = 0; k < K; k++) out[k * stride] = (float)(int8_t)panel[64 + k * NR + j] * s;
        return;
    }
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *o = panel + b * block_bytes(fmt), *q = o + quant_offset(fmt) + j;
        const float d = half_to_float(o + 2 * j), m = fmt == Q4_1 ? half_to_float(o + 32 + 2 * j) : 0;
        float *r = out + b * QK * stride;
        for (int64_t i = 0; i < (fmt == Q8_0 ? 32 : 16); i++) {
            const int v = q[i * NR];
            if (fmt == Q8_0) {
                r[i * stride] = (float)(int8_t)v * d;
            } else if (fmt == Q4_0) {
                r[i * stride] = (float)((v & 15) - 8) * d, r[(i + 16) * stride] = (float)((v >> 4) - 8) * d;
            } else {
                r[i * stride] = d * (float)(v & 15) + m, r[(i + 16) * stride] = d * (float)(v >> 4) + m;
            }
        }
    }
}

/* out[t] = row ids[t] of W dequantised; -2 (nothing written) if an id is out of range. */
int quant_embedding(int fmt, const uint8_t *packed, long N, long K, const int64_t *ids, long T,
                    float *out) {
    if (!valid(fmt, N, K) || T < 0) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -2;
    const int64_t pb = panel_bytes(fmt, K);
#pragma omp parallel for schedule(static) if (T * K >= (1 << 16))
    for (int64_t t = 0; t < T; t++)
        dequant_lane(fmt, packed + ids[t] / NR * pb, K, ids[t] % NR, out + t * K, 1);
    return 0;
}

/* Portable path: the panel dequantised (exactly), then plain dot products. */
static void dequant_panel_c(const Args *a, const uint8_t *panel, float *buf) {
    for (int64_t j = 0; j < NR; j++) dequant_lane(a->fmt, panel, a->K, j, buf + j, NR);
}

static void gemm_panel_c(const Args *a, const float *buf, int64_t n0, int64_t m0, int64_t m1) {
    for (int64_t j = 0; j < NR && n0 + j < a->N; j++)
        for (int64_t m = m0; m < m1; m++) {
            float s = 0.0f;
            for (int64_t k = 0; k < a->K; k++) s += a->x[m * a->ldx + k] * buf[k * NR + j];
            a->y[m * a->ldy + n0 + j] = a->bias ? s + a->bias[n0 + j] : s;
        }
}

/* The integer GEMV's activations (quant_gemm_vnni.h says why and how exactly). */
/* x as digits: for row m, block b, the digits a, b, c of its 32 elements (dig, 96 bytes),
 * the scale s and the three digit sums (for Q8_0's offset). */
typedef struct {
    int8_t *dig;  /* [M][kb][3][32] */
    float *scale; /* [M][kb] */
    int32_t *dsum; /* [M][kb][3] */
    int8_t *vec;  /* the AVX2 integer GEMV's digits, [M][kb][24][32] (quant_gemm_avx2_int.h) */
} Digits;

/* A block's scale s = 2^(E - 22), E the least with 2^E > mx (its largest |x|; E >= -100,
 * so that tiny blocks keep normal floats), and *up = 1/s: x * up is exact and rounds to
 * the block's 23-bit integer X (quant_gemm_vnni.h). */
static float digit_scale(float mx, float *up) {
    uint32_t bits;
    memcpy(&bits, &mx, 4);
    int e = (int)(bits >> 23) - 126; /* mx < 2^e (mx = 0: e = -126) */
    e = e < -100 ? -100 : e;
    const uint32_t up_bits = (uint32_t)(127 + 22 - e) << 23, s_bits = (uint32_t)(127 + e - 22) << 23;
    float s;
    memcpy(up, &up_bits, 4), memcpy(&s, &s_bits, 4);
    return s;
}

static void digits_free(Digits *dg) {
    free(dg->dig), free(dg->scale), free(dg->dsum), free(dg->vec);
    dg->dig = NULL, dg->scale = NULL, dg->dsum = NULL, dg->vec = NULL;
}

#if QG_X86
#include "quant_gemm_avx2.h"
#include "quant_gemm_avx2_int.h"
#include "quant_gemm_avx512.h"
#include "quant_gemm_vnni.h"
#include "quant_gemm_amx.h"
#endif

/* How one call multiplies: GEMV tiles (integer, AVX-512 or AVX2), or dequantised panels
 * through a micro-kernel (AVX2 or plain C). */
typedef enum { GEMV_VNNI, GEMV_AVX512, GEMV_AVX2, GEMM_AMX, GEMM_AVX512, GEMM_AVX2, GEMM_C, GEMV_AVX2_INT } Path;

/* Whether the CPU runs a 512-bit FMA whole (see QG_GEMV_MAX16): Intel's AVX-512 cores
 * and AMD's from family 0x1A (Zen 5); Zen 4 (0x19) splits it. */
static int whole_512bit_fma(void) {
#if QG_X86
    static int whole = -1;
    if (whole < 0) {
        unsigned a, b, c, d;
        char vendor[13] = {0};
        whole = 0;
        if (__get_cpuid(0, &a, &b, &c, &d)) {
            memcpy(vendor, &b, 4), memcpy(vendor + 4, &d, 4), memcpy(vendor + 8, &c, 4);
            if (__get_cpuid(1, &a, &b, &c, &d)) {
                const unsigned family = ((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (a >> 20) & 0xff : 0);
                whole = !strcmp(vendor, "GenuineIntel") || (!strcmp(vendor, "AuthenticAMD") && family >= 0x1a);
            }
        }
    }
    return whole;
#else
    return 0;
#endif
}

static Path choose_path(int isa, int fmt, int64_t M, int64_t K) {
    if (isa >= ISA_VNNI && fmt != INT8_ROW && M <= QG_VNNI_MAX) return GEMV_VNNI;
    if (isa == ISA_AMX && (fmt != INT8_ROW || K % QK == 0) && M >= QG_AMX_MIN) return GEMM_AMX;
    if (isa >= ISA_AVX512 && whole_512bit_fma()) return M <= QG_GEMV_MAX16_WIDE ? GEMV_AVX512 : GEMM_AVX512;
    if (isa >= ISA_AVX512) return M <= QG_GEMV_MAX16 ? GEMV_AVX512 : GEMM_AVX2; /* see quant_gemm_avx512.h */
    if (isa >= ISA_AVX2 && (fmt == Q4_0 || fmt == Q4_1) && M <= QG_AVX2_INT_MAX) return GEMV_AVX2_INT;
    if (isa >= ISA_AVX2) return M <= QG_GEMV_MAX ? GEMV_AVX2 : GEMM_AVX2;
    return GEMM_C;
}

/* One thread's panels [p0, p1) on `path`. */
static void run_panels(const Args *a, const Digits *dg, int64_t p0, int64_t p1, Path path, float *buf,
                       const float *xp) {
#if QG_X86
    for (int64_t p = p0; path == GEMV_VNNI && p < p1; p++) gemv_panel_vnni(a, dg, p);
    for (int64_t p = p0; path == GEMV_AVX512 && p < p1; p++) gemv_panel_avx512(a, p);
    for (int64_t p = p0; path == GEMV_AVX2 && p < p1; p++) gemv_panel_avx2(a, p);
    for (int64_t p = p0; path == GEMV_AVX2_INT && p < p1; p++) gemv_panel_avx2_int(a, dg, p);
#else
    (void)dg, (void)xp;
#endif
    if (path != GEMM_AVX512 && path != GEMM_AVX2 && path != GEMM_C) return;
    const int64_t mc = path == GEMM_AVX512 ? QG_MC5 : QG_MC;
    for (int64_t m0 = 0; m0 < a->M; m0 += mc) {
        const int64_t m1 = a->M - m0 < mc ? a->M : m0 + mc;
#if QG_X86
        float *b1 = buf + a->K * NR;
        for (int64_t p = p0; path == GEMM_AVX512 && p < p1; p += 2) { /* panels in pairs */
            const int np = p + 1 < p1 ? 2 : 1;
            dequant_panel_avx512(a, a->w + p * a->pbytes, buf);
            if (np == 2) dequant_panel_avx512(a, a->w + (p + 1) * a->pbytes, b1);
            gemm_panels_avx512(a, xp + m0 * a->K, buf, b1, p * NR, m0, m1, np);
        }
        if (path == GEMM_AVX512) continue;
#endif
        for (int64_t p = p0; p < p1; p++) {
            const uint8_t *panel = a->w + p * a->pbytes;
#if QG_X86
            if (path == GEMM_AVX2) {
                dequant_panel_avx2(a, panel, buf);
                gemm_panel_avx2(a, buf, p * NR, m0, m1);
                continue;
            }
#endif
            dequant_panel_c(a, panel, buf);
            gemm_panel_c(a, buf, p * NR, m0, m1);
        }
    }
}

/* The CPU's best instruction set: AVX-512 VNNI + VBMI on top of AVX-512 (F, BW, VL, DQ)
 * on top of AVX2+FMA+F16C, or less. */
static int cpu_isa(void) {
#if QG_X86
    static int have = -1;
    if (have < 0) {
        const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
        const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        const int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
        have = !avx2 ? ISA_PORTABLE : !avx512 ? ISA_AVX2 : !vnni ? ISA_AVX512 : amx_usable() ? ISA_AMX : ISA_VNNI;
    }
    return have;
#else
    return ISA_PORTABLE;
#endif
}

static int use_isa(void) { return cpu_isa() < isa_cap ? cpu_isa() : isa_cap; }

/* Block sums of x for the Q4 GEMV (sum x*(q - 8) = sum x*q - 8 sum x; Q4_1 adds m sum x). */
static float *block_sums(const Args *a) {
    const int64_t kb = a->K / QK;
    float *sx = malloc((size_t)(a->M * kb) * sizeof(float));
    if (!sx) return NULL;
    for (int64_t m = 0; m < a->M; m++)
        for (int64_t b = 0; b < kb; b++) {
            float s = 0.0f;
            for (int64_t k = 0; k < QK; k++) s += a->x[m * a->ldx + b * QK + k];
            sx[m * kb + b] = s;
        }
    return sx;
}

#if QG_X86
/* The AMX GEMM (quant_gemm_amx.h): x split into bf16 parts by all threads, then each
 * thread its panels. 1 (nothing written) where x is not finite: the caller goes on. */
static int amx_linear(const Args *a, int num_threads) {
    const int64_t Mp = (a->M + 15) / 16 * 16, K = a->K, kb = K / QK, P = num_panels(a->N);
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    if (threads > (P + 1) / 2) threads = (P + 1) / 2;
    uint16_t *xa = aligned_alloc(64, (size_t)(3 * Mp * K * 2 + 64));
    float *sx = a->fmt == Q4_1 ? aligned_alloc(64, (size_t)(Mp * kb * 4 + 64)) : NULL;
    if (!xa || (a->fmt == Q4_1 && !sx)) return free(xa), free(sx), -3;
    int bad = 0, rc = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : bad)
    {
        const int64_t t = thread_num(), T = num_threads_now();
        bad |= amx_split_x(a, Mp, xa, sx, t, T) != 0;
    }
    if (!bad) {
#pragma omp parallel num_threads((int)threads) reduction(| : rc)
        {
            const int64_t t = thread_num(), T = num_threads_now();
            /* whole pairs of panels per thread, so that no thread runs one alone */
            const int64_t pairs = (P + 1) / 2, p0 = 2 * (pairs * t / T), p1 = 2 * (pairs * (t + 1) / T);
            uint16_t *bm = aligned_alloc(64, (size_t)(kb * 2048 + 64));
            float *scratch = aligned_alloc(64, (size_t)(2 * 32 * 32 * 4));
            if (!bm || !scratch) rc = -3;
            else if (p0 < P) gemm_panels_amx(a, xa, sx, Mp, p0, p1 < P ? p1 : P, bm, scratch, scratch + 32 * 32);
            free(bm), free(scratch);
        }
    }
    free(xa), free(sx);
    return bad ? 1 : rc;
}
#endif

int quant_linear(int fmt, const float *x, long ldx, const uint8_t *packed, const float *bias,
                 float *y, long ldy, long M, long N, long K, int num_threads) {
    if (!valid(fmt, N, K) || M < 0 || ldx < K || ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    Args a = {fmt, packed, x, bias, NULL, y, ldx, ldy, M, N, K, panel_bytes(fmt, K)};
    Path path = choose_path(use_isa(), fmt, M, K);
    Digits dg = {NULL, NULL, NULL, NULL};
#if QG_X86
    if (path == GEMV_VNNI && digits_make(&a, &dg) != 0) path = choose_path(ISA_AVX512, fmt, M, K);
    if (path == GEMM_AMX) {
        const int rc = amx_linear(&a, num_threads);
        if (rc != 1) return rc;
        path = choose_path(ISA_AVX512, fmt, M, K); /* x is not finite: the float path */
    }
#endif
    const int gemv = path == GEMV_VNNI || path == GEMV_AVX512 || path == GEMV_AVX2 || path == GEMV_AVX2_INT;
    float *sx = NULL;
    if (gemv && (fmt == Q4_0 || fmt == Q4_1) && K > 0 && !(sx = block_sums(&a))) {
        digits_free(&dg);
        return -3;
    }
    a.sx = sx;
    const int64_t P = num_panels(N);
    int64_t threads = num_threads < 1 ? 1 : num_threads;
    if (threads > P / 2) threads = P / 2 > 1 ? P / 2 : 1;
    float *xp = NULL; /* the AVX-512 GEMM's copy of x (gemm_pack_x), shared */
    if (path == GEMM_AVX512 && !(xp = malloc((size_t)(M * K + 1) * sizeof(float)))) { /* K may be 0 */
        digits_free(&dg);
        return -3;
    }
    int rc = 0;
#pragma omp parallel num_threads((int)threads) reduction(| : rc)
    {
        const int64_t t = thread_num(), T = num_threads_now();
        const int64_t p0 = P * t / T, p1 = P * (t + 1) / T;
#if QG_X86
        if (xp) {
            gemm_pack_x(&a, QG_MC5, xp, t, T);
#pragma omp barrier
        }
#endif
        float *buf = gemv ? NULL : malloc((size_t)(2 * K * NR + 16) * sizeof(float)); /* two panels */
        Path mine = path;
        Digits own = {NULL, NULL, NULL, NULL}; /* the AVX2 integer GEMV's, this thread's own */
#if QG_X86
        if (mine == GEMV_AVX2_INT && p0 < p1 && digit_vectors_make(&a, &own) != 0) mine = GEMV_AVX2; /* x not finite */
#endif
        if (!gemv && !buf) rc = -3;
        else if (p0 < p1) run_panels(&a, mine == GEMV_AVX2_INT ? &own : &dg, p0, p1, mine, buf, xp);
        free(buf);
        digits_free(&own);
    }
    free(xp);
    free(sx);
    digits_free(&dg);
    return rc;
}

/* Caps the instructions quant_linear may use: 0 portable C, 1 AVX2, 2 AVX-512, 3 AVX-512
 * VNNI, 4 AMX (the default: the CPU's best). Process-wide; for tests and benchmarks. */
void quant_set_isa(int cap) { isa_cap = cap < ISA_PORTABLE ? ISA_PORTABLE : cap > ISA_AMX ? ISA_AMX : cap; }

/* The instructions quant_linear uses now, numbered as quant_set_isa's cap. */
int quant_isa(void) { return use_isa(); }

/* The path quant_linear takes now for M rows of x against a K-column weight in fmt,
 * numbered as Path (tests and benchmarks; a non-finite x may still send it to a float
 * path). */
int quant_path(int fmt, int64_t M, int64_t K) { return (int)choose_path(use_isa(), fmt, M, K); }
