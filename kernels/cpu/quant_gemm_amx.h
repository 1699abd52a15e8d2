/*
 * The AMX GEMM of quant_gemm.c for Intel CPUs with AMX-BF16 (Sapphire Rapids and later):
 * block-format weights (Q8_0, Q4_0, Q4_1) and per-row int8 ones (INT8_ROW, K a multiple
 * of 32) times float32 x on the tile unit, to float32 accuracy. Included by quant_gemm.c
 * (x86 only, target attributes, chosen at run time once the kernel has granted the
 * process the tile state); see that file for the packed layout.
 *
 * Why: the FMA GEMM is bound by the FMA units (two 16-lane FMAs a cycle); one
 * TDPBF16PS is 16 x 16 x 32 multiply-adds, and the tile unit runs one every 16 cycles
 * beside the vector pipes: 32 multiply-adds a cycle from the FMAs against 1,024 from
 * the tile unit.
 *
 * Exactness. bf16 keeps 8 significant bits, float32 24:
 *  - a weight's integer code (Q8_0: q in [-128, 127]; Q4_0: nib - 8; Q4_1: nib) has at
 *    most 8 significant bits, so it is exact in bf16. Its block's scales stay out of the
 *    tiles: per block t = x . code over 32 k on the tile unit, then acc += d*t (+ m*sum(x)
 *    for Q4_1) in float32 FMAs, as the float GEMV does. INT8_ROW has one scale per row:
 *    its tiles sum the whole of K and are scaled once (2.3-2.5x its AVX-512 GEMM from 64
 *    rows on SmolLM2's products, 1.5x the int8 model offline, machine F).
 *  - x is split exactly into three bf16 parts, x = hi + mid + lo (hi: x cut to its top
 *    8 bits; mid: the rest cut to its top 8; lo: what is left, at most 8 bits).
 *  So every product on the tile unit is exact and t is a float32 sum of exact products
 *  (the tile unit adds in float32, rounding to nearest even): float32 accuracy, as the
 *  float paths, not a bf16 approximation. The tile unit flushes bf16 subnormals to zero:
 *  a part below 2^-126 is lost, an absolute error under 2^-126 per product. Where x holds
 *  a NaN or an infinity the caller takes the float path instead.
 *
 * Tiles: two m-tiles of 16 rows (the last pass may have one) times two panels of 16
 * columns, four accumulator tiles (C), per k-part the two m-tiles' A tiles and the two
 * panels' B tiles: all eight.
 *   A: x part, 16 rows x 32 bf16 (one block of k), read from xa [3][Mp][K] with stride K.
 *   B: codes, 16 rows of k pairs x 16 columns x 2 bf16 (VNNI-style pairs), made per panel
 *      from its quants (bm: [kb][16][16][2]).
 *   C: 16 x 16 float32 per block, stored and folded into acc (memory, L1) by the vector
 *      pipes after each block.
 *
 * Measured (SmolLM2's four products, Q4_1, 2 threads, 2 vCPUs of a Xeon with AMX,
 * 2026-12-07): 1.6-2.0x the AVX-512 GEMM at 41-512 rows (384-565 against 219-330
 * GFLOP/s), 1.3-1.5x the GEMVs at 12-32 rows. Tried and dropped: folding the scale into
 * the weights as two exact bf16 parts (d*code has at most 15 significant bits) so the
 * tiles sum over all of K with no fold per block: twice the tile products and tile
 * loads, 1.3-1.45x the AVX-512 GEMM where this is 1.6-1.9x.
 */
#ifndef TANDEM_QUANT_GEMM_AMX_H
#define TANDEM_QUANT_GEMM_AMX_H

#include <sys/syscall.h>
#include <unistd.h>

#define TGTA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MT_A 32 /* rows of x per pass: two m-tiles (the last may have one: xa is padded to 16s) */
#ifndef QG_MCA
#define QG_MCA 128 /* rows of x per block of the AMX GEMM (its parts stay in L2) */
#endif

/* The CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use them (Linux asks
 * each process to request the tile state once). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0; /* AMX-BF16, AMX-TILE */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows of 64 bytes. */
static TGTA void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* The three bf16 parts of every row of x (rows M .. Mp zero) into xa [3][Mp][K], and, for
 * Q4_1's m term, its block sums (as block_sums: in order, float32) into sx [Mp][kb]; rows
 * t, t + T, ... of thread t. Returns -1 (nothing usable) if x holds a NaN or an infinity. */
static TGTA int amx_split_x(const Args *a, int64_t Mp, uint16_t *xa, float *sx, int64_t t, int64_t T) {
    const int64_t K = a->K, kb = K / QK;
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 sign = _mm512_set1_ps(-0.0f), big = _mm512_set1_ps(FLT_MAX);
    int finite = 1;
    for (int64_t m = t; m < Mp; m += T) {
        uint16_t *hi = xa + m * K, *mid = hi + Mp * K, *lo = mid + Mp * K;
        if (m >= a->M) {
            memset(hi, 0, (size_t)K * 2), memset(mid, 0, (size_t)K * 2), memset(lo, 0, (size_t)K * 2);
            for (int64_t b = 0; sx && b < kb; b++) sx[m * kb + b] = 0.0f;
            continue;
        }
        const float *x = a->x + m * a->ldx;
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = _mm512_loadu_ps(x + k);
            finite &= _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, v), big, _CMP_LE_OQ) == 0xffff;
            const __m512i h = _mm512_and_si512(_mm512_castps_si512(v), top);
            const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(h)); /* exact */
            const __m512i md = _mm512_and_si512(_mm512_castps_si512(r), top);
            const __m512 l = _mm512_sub_ps(r, _mm512_castsi512_ps(md)); /* exact, <= 8 bits */
            _mm256_storeu_si256((__m256i *)(hi + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
            _mm256_storeu_si256((__m256i *)(mid + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(md, 16)));
            _mm256_storeu_si256((__m256i *)(lo + k),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(l), 16)));
        }
        for (int64_t b = 0; sx && b < kb; b++) {
            float v = 0.0f;
            for (int64_t k = 0; k < QK; k++) v += x[b * QK + k];
            sx[m * kb + b] = v;
        }
    }
    return finite ? 0 : -1;
}

/* Two rows of codes (16 columns each, as float) as one B-tile row: column j's pair. */
INLINE TGTA __m512i bf16_pairs(__m512 even, __m512 odd) {
    return _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32((int)0xffff0000u)),
                           _mm512_srli_epi32(_mm512_castps_si512(even), 16));
}

/* A panel's codes as B tiles, bm [kb][16 k pairs][16 columns][2]. */
static TGTA void amx_codes(const Args *a, const uint8_t *panel, uint16_t *bm) {
    const int fmt = a->fmt;
    const __m512i mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(fmt == Q4_0 ? 8 : 0);
    for (int64_t b = 0; b < a->K / QK; b++) {
        const uint8_t *q = fmt == INT8_ROW ? panel + 64 + b * QK * NR /* after the row scales */
                                           : panel + b * block_bytes(fmt) + quant_offset(fmt);
        __m512i *o = (__m512i *)(bm + b * 512);
        if (fmt == Q8_0 || fmt == INT8_ROW) { /* the same int8 [32][16] per block */
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(o + p, bf16_pairs(s16v(q + 2 * p * NR), s16v(q + (2 * p + 1) * NR)));
            continue;
        }
        for (int p = 0; p < 8; p++) { /* k 2p, 2p + 1: low nibbles; k 2p + 16, 2p + 17: high */
            const __m512i v0 = u16v(q + 2 * p * NR), v1 = u16v(q + (2 * p + 1) * NR);
            const __m512 l0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v0, mask), eight));
            const __m512 l1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v1, mask), eight));
            const __m512 h0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v0, 4), eight));
            const __m512 h1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v1, 4), eight));
            _mm512_store_si512(o + p, bf16_pairs(l0, l1));
            _mm512_store_si512(o + p + 8, bf16_pairs(h0, h1));
        }
    }
}

/* acc[r][0 .. 16) += d * c[r] (+ e * s[r * kb], Q4_1) for the 16 rows of one C tile. */
INLINE TGTA void amx_fold(float *acc, int64_t lda, const float *c, __m512 d, __m512 e, const float *s,
                          int64_t kb, const int q41) {
    for (int r = 0; r < 16; r++) {
        __m512 v = _mm512_fmadd_ps(d, _mm512_load_ps(c + 16 * r), _mm512_load_ps(acc + r * lda));
        if (q41) v = _mm512_fmadd_ps(e, _mm512_set1_ps(s[r * kb]), v);
        _mm512_store_ps(acc + r * lda, v);
    }
}

/* One k-part: both m-tiles' A tiles, then the four products. */
#define AMX_PART(g)                                                                  \
    do {                                                                             \
        _tile_loadd(4, a0 + (g) * Mp * K, 2 * K);                                    \
        _tile_dpbf16ps(0, 4, 6);                                                     \
        if (np == 2) _tile_dpbf16ps(1, 4, 7);                                        \
        if (mt == 2) {                                                               \
            _tile_loadd(5, a0 + (g) * Mp * K + 16 * K, 2 * K);                       \
            _tile_dpbf16ps(2, 5, 6);                                                 \
            if (np == 2) _tile_dpbf16ps(3, 5, 7);                                    \
        }                                                                            \
    } while (0)

/* y rows [m, m + 16 mt) (those below M) x panels p, p + np - 1. */
INLINE TGTA void amx_pass(const Args *a, const uint16_t *xa, const float *sx, int64_t Mp, int64_t m,
                          const uint8_t *panel0, const uint16_t *b0, const uint16_t *b1, int64_t n0,
                          const int mt, const int np, const int fmt, float *acc, float *cb) {
    const int64_t K = a->K, kb = K / QK, bb = block_bytes(fmt), pb = a->pbytes;
    const int q41 = fmt == Q4_1, rows = fmt == INT8_ROW; /* INT8_ROW: one scale per row, all of K */
    memset(acc, 0, 32 * 32 * sizeof(float));
    for (int64_t b = 0; b < kb; b++) {
        const uint16_t *a0 = xa + m * K + b * QK;
        if (!rows || b == 0) {
            _tile_zero(0);
            if (np == 2) _tile_zero(1);
            if (mt == 2) _tile_zero(2);
            if (mt == 2 && np == 2) _tile_zero(3);
        }
        _tile_loadd(6, b0 + b * 512, 64);
        if (np == 2) _tile_loadd(7, b1 + b * 512, 64);
        AMX_PART(0);
        AMX_PART(1);
        AMX_PART(2);
        if (rows && b + 1 < kb) continue; /* the tiles sum every block: scaled once, below */
        _tile_stored(0, cb, 64);
        if (np == 2) _tile_stored(1, cb + 256, 64);
        if (mt == 2) _tile_stored(2, cb + 512, 64);
        if (mt == 2 && np == 2) _tile_stored(3, cb + 768, 64);
        for (int j = 0; j < np; j++) {
            const uint8_t *blk = panel0 + j * pb + b * bb;
            const __m512 d = rows ? _mm512_loadu_ps((const float *)(panel0 + j * pb)) : h16v(blk);
            const __m512 e = q41 ? h16v(blk + 32) : _mm512_setzero_ps();
            const float *s = sx ? sx + m * kb + b : NULL;
            amx_fold(acc + 16 * j, 32, cb + 256 * j, d, e, s, kb, q41);
            if (mt == 2)
                amx_fold(acc + 16 * 32 + 16 * j, 32, cb + 512 + 256 * j, d, e, s ? s + 16 * kb : NULL, kb, q41);
        }
    }
    for (int64_t r = 0; r < 16 * mt && m + r < a->M; r++)
        for (int j = 0; j < np; j++)
            if (n0 + NR * j < a->N) store_row16(a, m + r, n0 + NR * j, _mm512_load_ps(acc + r * 32 + 16 * j));
}
#undef AMX_PART

/* One thread's panels [p0, p1): per block of QG_MCA rows, each pair of panels' codes made
 * once and swept by every pass of 32 rows. bm: two panels' codes (2 kb KB); acc, cb: 4 KB
 * each. */
static TGTA void gemm_panels_amx(const Args *a, const uint16_t *xa, const float *sx, int64_t Mp,
                                 int64_t p0, int64_t p1, uint16_t *bm, float *acc, float *cb) {
    const int fmt = a->fmt;
    uint16_t *b1 = bm + a->K / QK * 512;
    amx_configure();
    for (int64_t m0 = 0; m0 < Mp; m0 += QG_MCA) {
        const int64_t m1 = Mp - m0 < QG_MCA ? Mp : m0 + QG_MCA;
        for (int64_t p = p0; p < p1; p += 2) {
            const int np = p + 1 < p1 ? 2 : 1;
            const uint8_t *panel = a->w + p * a->pbytes;
            amx_codes(a, panel, bm);
            if (np == 2) amx_codes(a, panel + a->pbytes, b1);
            for (int64_t m = m0; m < m1; m += MT_A) {
                const int mt = m1 - m >= MT_A ? 2 : 1;
                if (mt == 2 && np == 2) amx_pass(a, xa, sx, Mp, m, panel, bm, b1, p * NR, 2, 2, fmt, acc, cb);
                else if (mt == 2) amx_pass(a, xa, sx, Mp, m, panel, bm, b1, p * NR, 2, 1, fmt, acc, cb);
                else if (np == 2) amx_pass(a, xa, sx, Mp, m, panel, bm, b1, p * NR, 1, 2, fmt, acc, cb);
                else amx_pass(a, xa, sx, Mp, m, panel, bm, b1, p * NR, 1, 1, fmt, acc, cb);
            }
        }
    }
    _tile_release();
}

#endif
