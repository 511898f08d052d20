/* Weight-only quantized GEMM on CPU: y[M, N] = x[M, K] @ w[N, K]^T over the packed layout of
 * quant_layout.h.
 *
 * AVX-512 VNNI: the codes multiply x held in two int8 planes per 32-element block (x ~ s (hi + lo / 256),
 * relative error under 2^-15 of the block's largest |x|), int32 dot products, float32 scales and sums.
 * AVX2 (no VNNI): the same planes and sums through vpmaddubsw and vpmaddwd (quant_gemm_avx2.c).
 * Elsewhere: float32 dot products with every weight dequantized exactly (quant_gemm_f32.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "quant_layout.h"

#if PD_QUANT_VNNI

#define MT_MAX 8
#define NT_MAX 4

/* one 32-element block of x (v0, v1) in two int8 planes: 16 dwords of hi and of lo, scale s / 256 */
static inline __attribute__((always_inline)) void block_planes(__m512 v0, __m512 v1, __m256i *hi, __m256i *lo,
                                                               float *s256) {
    const __m512 mag = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float amax = _mm512_reduce_max_ps(mag);
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
    *s256 = s / 256.0f;
    const __m512 vs = _mm512_set1_ps(s), vinv = _mm512_set1_ps(inv), v256 = _mm512_set1_ps(inv * 256.0f);
    const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 h0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, vinv), mode);
    const __m512 h1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, vinv), mode);
    const __m512 l0 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_fnmadd_ps(h0, vs, v0), v256), mode);
    const __m512 l1 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_fnmadd_ps(h1, vs, v1), v256), mode);
    *hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h0))),
                                  _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h1)), 1);
    *lo = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(l0, top), bottom)))),
        _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(l1, top), bottom))), 1);
}

/* x in two int8 planes per 32-element block b: x ~ s_b * (hi + lo / 256), |error| <= s_b / 512 with
 * s_b = max|x| / 127 over the block; written in the packed element order (the 4-byte lanes of a pair
 * alternate its two blocks). gsum[m, g]: the sum of x over scale group g. */
static void quantize_x(const float *x, int64_t M, int64_t K, int64_t group, int8_t *hi, int8_t *lo, float *s256,
                       float *gsum) {
    const int64_t blocks = K / 32, groups = K / group;
    const __m512i interleave = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < groups; g++) gsum[m * groups + g] = 0.0f;
        for (int64_t p = 0; p < K / 64; p++) {
            const float *xp = x + m * K + p * 64;
            __m512 v[4];
            for (int j = 0; j < 4; j++) v[j] = _mm512_loadu_ps(xp + 16 * j);
            __m256i ha, la, hb, lb;
            block_planes(v[0], v[1], &ha, &la, s256 + m * blocks + 2 * p);
            block_planes(v[2], v[3], &hb, &lb, s256 + m * blocks + 2 * p + 1);
            gsum[m * groups + p * 64 / group] += _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
            gsum[m * groups + (p * 64 + 32) / group] += _mm512_reduce_add_ps(_mm512_add_ps(v[2], v[3]));
            const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(ha), hb, 1);
            const __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(la), lb, 1);
            _mm512_storeu_si512(hi + m * K + p * 64, _mm512_permutexvar_epi32(interleave, h));
            _mm512_storeu_si512(lo + m * K + p * 64, _mm512_permutexvar_epi32(interleave, l));
        }
    }
}

/* lanes alternate p[0], p[1]: the two blocks of a pair */
static inline __attribute__((always_inline)) __m512 pair_floats(const float *p) {
    return _mm512_broadcast_f32x2(_mm_castpd_ps(_mm_load_sd((const double *)p)));
}

/* the weight scales of pair p of a row (scales from `row_scale`) */
static inline __attribute__((always_inline)) __m512 weight_scales(const qweight *w, const void *row_scale,
                                                                  int64_t p) {
    if (w->group != 32) return _mm512_set1_ps(scale_at(row_scale, w->half, p * 64 / w->group));
    if (!w->half) return pair_floats((const float *)row_scale + 2 * p);
    const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)((const uint16_t *)row_scale + 2 * p)));
    return _mm512_broadcast_f32x2(two);
}

/* one output: channel n's lane sums plus the offsets' term, the sum over groups of offset * sum(x) of the row
 * (`gsum`: that row's group sums) */
static inline __attribute__((always_inline)) float channel_sum(const qweight *w, int64_t n, const float *gsum,
                                                               __m512 acc) {
    const int64_t groups = w->K / w->group;
    const void *z = (const char *)w->offset + n * groups * (w->half ? 2 : 4);
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 k = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        const __m512 zs = w->half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)z + g))
                                  : _mm512_maskz_loadu_ps(k, (const float *)z + g);
        acc = _mm512_fmadd_ps(zs, _mm512_maskz_loadu_ps(k, gsum + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* acc[m] += pair p of one output channel (codes c) against MT input rows */
static inline __attribute__((always_inline)) void pair_dot(const int MT, __m512i c, __m512 d, int64_t p,
                                                           const int8_t *xh, const int8_t *xl, const float *s256,
                                                           int64_t K, __m512 *acc) {
    const int64_t blocks = K / 32;
    for (int m = 0; m < MT; m++) {
        const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, _mm512_loadu_si512(xh + m * K + p * 64));
        /* 256 hi + lo, exact in int32 (4 products of at most 255 * 127 a lane) */
        const __m512 v = _mm512_cvtepi32_ps(
            _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), c, _mm512_loadu_si512(xl + m * K + p * 64)));
        acc[m] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, pair_floats(s256 + m * blocks + 2 * p)), acc[m]);
    }
}

/* NT output channels from n0 against MT input rows (`prefetch`: each channel's row PREFETCH_ROWS ahead too) */
static inline __attribute__((always_inline)) void tile(const int NT, const int MT, const int prefetch,
                                                       const qweight *w, const int8_t *xh, const int8_t *xl,
                                                       const float *s256, const float *gsum, int64_t n0, float *y,
                                                       int64_t N) {
    const int64_t K = w->K, pairs = K / 64, groups = K / w->group, elem = w->half ? 2 : 4;
    __m512 acc[NT_MAX][MT_MAX];
    for (int i = 0; i < NT; i++)
        for (int m = 0; m < MT; m++) acc[i][m] = _mm512_setzero_ps();
    for (int i = 0; i < NT; i++) {
        const uint8_t *row = w->packed + (n0 + i) * row_bytes(w);
        const void *sc = (const char *)w->scale + (n0 + i) * groups * elem;
        if (prefetch) prefetch_row(w, n0 + i + PREFETCH_ROWS); /* a tile's rows hinted together ran ~5% slower */
        if (w->bits == 8) {
            for (int64_t p = 0; p < pairs; p++)
                pair_dot(MT, _mm512_loadu_si512(row + p * 64), weight_scales(w, sc, p), p, xh, xl, s256, K, acc[i]);
        } else {
            int64_t p = 0;
            for (; p + 1 < pairs; p += 2) {
                __m512i even, odd;
                codes128(row + p * 32, &even, &odd);
                pair_dot(MT, even, weight_scales(w, sc, p), p, xh, xl, s256, K, acc[i]);
                pair_dot(MT, odd, weight_scales(w, sc, p + 1), p + 1, xh, xl, s256, K, acc[i]);
            }
            if (p < pairs) pair_dot(MT, codes64(row + p * 32), weight_scales(w, sc, p), p, xh, xl, s256, K, acc[i]);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int m = 0; m < MT; m++) y[m * N + n0 + i] = channel_sum(w, n0 + i, gsum + m * w->K / w->group, acc[i][m]);
}

/* RT_N output channels from n0 against RT_M input rows, pairs outermost: each pair's x is loaded once for
 * all the channels and each channel's codes once for all the rows; the same sums in the same order as
 * `tile`, so the same bits. Against `tile` by channel (RT_N 1), at one thread: 1.3-1.8x at 128-2,048 rows
 * (a prefill), 1.1-1.3x at 16 (a batch-16 decode step); 4 x 8 ran as fast as 4 x 6 and 8 x 4, faster
 * than 2 x 4, 2 x 8 and 8 x 2 */
#define RT_N 4
#define RT_M 8
static void tile_rows(const qweight *w, const int8_t *xh, const int8_t *xl, const float *s256, const float *gsum,
                      int64_t n0, float *y, int64_t N) {
    const int64_t K = w->K, pairs = K / 64, groups = K / w->group, elem = w->half ? 2 : 4, blocks = K / 32;
    __m512 acc[RT_N][RT_M];
    for (int i = 0; i < RT_N; i++)
        for (int m = 0; m < RT_M; m++) acc[i][m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i h[RT_M], l[RT_M];
        __m512 s[RT_M];
        for (int m = 0; m < RT_M; m++) {
            h[m] = _mm512_loadu_si512(xh + m * K + p * 64);
            l[m] = _mm512_loadu_si512(xl + m * K + p * 64);
            s[m] = pair_floats(s256 + m * blocks + 2 * p);
        }
        for (int i = 0; i < RT_N; i++) {
            const __m512i c = pair_codes(w, w->packed + (n0 + i) * row_bytes(w), p);
            const __m512 d = weight_scales(w, (const char *)w->scale + (n0 + i) * groups * elem, p);
            for (int m = 0; m < RT_M; m++) {
                const __m512i hm = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, h[m]);
                const __m512 v = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_slli_epi32(hm, 8), c, l[m]));
                acc[i][m] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, s[m]), acc[i][m]);
            }
        }
    }
    for (int i = 0; i < RT_N; i++)
        for (int m = 0; m < RT_M; m++) y[m * N + n0 + i] = channel_sum(w, n0 + i, gsum + m * groups, acc[i][m]);
}

#define TILE_CASE(mt)                                                                                      \
    case mt:                                                                                               \
        tile(1, mt, 0, &w, xh + m0 * K, xl + m0 * K, s256 + m0 * blocks, gsum + m0 * groups, n, y + m0 * N, N); \
        break;

void pd_quant_gemm(const float *x, int64_t M, int64_t K, const uint8_t *packed, int bits, const void *scale,
                   const void *offset, int half, int64_t group, int64_t N, float *y) {
    const qweight w = {packed, scale, offset, bits, half, K, group};
    const int64_t blocks = K / 32, groups = K / group;
    int8_t *xh = malloc(2 * M * K), *xl = xh + M * K;
    float *s256 = malloc(M * (blocks + groups) * sizeof(float)), *gsum = s256 + M * blocks;
    quantize_x(x, M, K, group, xh, xl, s256, gsum);
    if (M == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n += NT_MAX) {
            if (n + NT_MAX <= N)
                tile(NT_MAX, 1, 1, &w, xh, xl, s256, gsum, n, y, N);
            else
                for (int64_t r = n; r < N; r++) tile(1, 1, 1, &w, xh, xl, s256, gsum, r, y, N);
        }
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += RT_N) {
            const int64_t full = N - n0 >= RT_N ? M / RT_M * RT_M : 0;
            for (int64_t m0 = 0; m0 < full; m0 += RT_M)
                tile_rows(&w, xh + m0 * K, xl + m0 * K, s256 + m0 * blocks, gsum + m0 * groups, n0, y + m0 * N, N);
            for (int64_t n = n0; n < N && n < n0 + RT_N; n++)
                for (int64_t m0 = full; m0 < M; m0 += MT_MAX) {
                    switch (M - m0 < MT_MAX ? M - m0 : MT_MAX) {
                        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
                        TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
                    }
                }
        }
    }
    free(xh);
    free(s256);
}

/* 1: AVX-512 VNNI, 2: AVX2, both with x in two int8 planes; 0: portable float32 */
int pd_quant_isa(void) { return 1; }

#elif PD_QUANT_AVX2

/* Rows of x up to which the int8 GEMV runs once per row, above them the float32 path (quant_gemm_f32.c).
 * Against the float32 path, 2 threads, 2-core AMD EPYC (Zen 1, one vector integer multiplier): int4 0.45-0.58x
 * the time at 1 row, 0.74-0.82x at 8; int8 0.72x at 1 row, 0.91-0.98x at 2-3, 1.09x at 4. */
static inline int64_t gemv_rows(int bits) { return bits == 4 ? 8 : 2; }

void pd_quant_gemm(const float *x, int64_t M, int64_t K, const uint8_t *packed, int bits, const void *scale,
                   const void *offset, int half, int64_t group, int64_t N, float *y) {
    if (M <= gemv_rows(bits))
        for (int64_t m = 0; m < M; m++)
            pd_quant_gemv_avx2(x + m * K, K, packed, bits, scale, offset, half, group, N, y + m * N);
    else
        pd_quant_gemm_f32(x, M, K, packed, bits, scale, offset, half, group, N, y);
}

int pd_quant_isa(void) { return 2; }

#else /* float32 activations, exact weights (quant_gemm_f32.c) */

void pd_quant_gemm(const float *x, int64_t M, int64_t K, const uint8_t *packed, int bits, const void *scale,
                   const void *offset, int half, int64_t group, int64_t N, float *y) {
    pd_quant_gemm_f32(x, M, K, packed, bits, scale, offset, half, group, N, y);
}

int pd_quant_isa(void) { return 0; }

#endif

