/* The AVX2 int8 GEMV of the weight-only quantized linears (quant_gemm.c on CPUs with AVX2 but not AVX-512 VNNI,
 * a few rows of x at a time): y[N] = w[N, K] @ x[K] over the packed layout of quant_layout.h, with the VNNI
 * path's numerics.
 *
 * x is held in two int8 planes per 32-element block (x ~ s (hi + lo / 256), as quant_gemm.c's quantize_x),
 * written in the layout's position order so that a pair's 4-byte lanes alternate its two blocks. Codes meet
 * x in `vpmaddubsw` (unsigned by signed bytes into int16 pairs) and `vpmaddwd` (into int32 lanes of 4):
 * - 4-bit codes (<= 15) multiply x directly: 2 * 15 * 127 per int16, so a pair's two halves add in int16;
 * - 8-bit codes go as c - 128 (the sign moved onto x, |c - 128| <= 128: no int16 saturates), and the
 *   offsets' term takes 128 * scale more.
 * Per lane 256 * hi + lo is exact in int32; float32 from the pair's block scales on. */
#include <stdint.h>
#include <stdlib.h>
#include "quant_layout.h"

#if PD_QUANT_AVX2

static inline __attribute__((always_inline)) float hmax(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static inline __attribute__((always_inline)) float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* 32 floats rounded to int8 in element order (|v| <= 127.5) */
static inline __attribute__((always_inline)) __m256i to_int8(const __m256 v[4]) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_round_ps(v[j], mode));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* one 32-element block of x in two int8 planes, element order: s = max|x| / 127, hi = round(x / s), lo =
 * round((x - hi s) 256 / s) clamped to +-127 (quant_gemm.c's block_planes); s / 256 and sum(x) returned */
static inline __attribute__((always_inline)) void block_planes(const float *x, __m256i *hi, __m256i *lo,
                                                               float *s256, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
    __m256 v[4], mag = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        mag = _mm256_max_ps(mag, _mm256_andnot_ps(sign, v[j]));
        total = _mm256_add_ps(total, v[j]);
    }
    const float amax = hmax(mag), s = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / s;
    *s256 = s / 256.0f;
    *sum = hsum(total);
    const __m256 vs = _mm256_set1_ps(s), vinv = _mm256_set1_ps(inv), v256 = _mm256_set1_ps(inv * 256.0f);
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 h[4], l[4];
    for (int j = 0; j < 4; j++) {
        h[j] = _mm256_round_ps(_mm256_mul_ps(v[j], vinv), mode);
        l[j] = _mm256_mul_ps(_mm256_fnmadd_ps(h[j], vs, v[j]), v256);
        l[j] = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps(l[j], mode), top), bottom);
    }
    *hi = to_int8(h);
    *lo = to_int8(l);
}

/* the 4-byte groups of blocks a and b interleaved, the layout's position order within a pair */
static inline __attribute__((always_inline)) void interleave(__m256i a, __m256i b, int8_t *out) {
    const __m256i even = _mm256_unpacklo_epi32(a, b), odd = _mm256_unpackhi_epi32(a, b);
    _mm256_storeu_si256((__m256i *)out, _mm256_permute2x128_si256(even, odd, 0x20));
    _mm256_storeu_si256((__m256i *)(out + 32), _mm256_permute2x128_si256(even, odd, 0x31));
}

/* x [K] in two int8 planes per 32-element block, in the layout's position order (a pair's 4-byte groups
 * alternate its blocks); s256[b] = s_b / 256; gsum[g]: the sum of x over scale group g */
static void quantize_x(const float *x, int64_t K, int64_t group, int8_t *hi, int8_t *lo, float *s256, float *gsum) {
    for (int64_t g = 0; g < K / group; g++) gsum[g] = 0.0f;
    for (int64_t p = 0; p < K / 64; p++) {
        __m256i h[2], l[2];
        for (int b = 0; b < 2; b++) {
            float sum;
            block_planes(x + 64 * p + 32 * b, &h[b], &l[b], s256 + 2 * p + b, &sum);
            gsum[(64 * p + 32 * b) / group] += sum;
        }
        interleave(h[0], h[1], hi + 64 * p);
        interleave(l[0], l[1], lo + 64 * p);
    }
}

/* lanes alternate p[0], p[1]: the two blocks of a pair */
static inline __attribute__((always_inline)) __m256 pair_floats(const float *p) {
    return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)p));
}

/* the weight scales of pair p of a row (its scales from `row_scale`), lanes alternating the blocks */
static inline __attribute__((always_inline)) __m256 weight_scales(const qweight *w, const void *row_scale,
                                                                  int64_t p) {
    if (w->group != 32) return _mm256_set1_ps(scale_at(row_scale, w->half, p * 64 / w->group));
    if (!w->half) return pair_floats((const float *)row_scale + 2 * p);
    const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)((const uint16_t *)row_scale + 2 * p)));
    return _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(two)));
}

/* the 64 codes of an int4 chunk: pairs 2q and 2q + 1 as the low and high nibbles of 64 bytes, two halves each */
static inline __attribute__((always_inline)) void codes128(const uint8_t *q, __m256i even[2], __m256i odd[2]) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < 2; i++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
        even[i] = _mm256_and_si256(b, low);
        odd[i] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
}

/* int32 lanes of 4: over a pair's two halves, its codes c by x in int8, 256 x the hi plane plus the lo plane;
 * 8-bit codes come as c - 128 */
static inline __attribute__((always_inline)) __m256i pair_dot(const int bits, const __m256i c[2], const int8_t *xh,
                                                              const int8_t *xl) {
    const __m256i ones = _mm256_set1_epi16(1), w256 = _mm256_set1_epi16(256);
    __m256i h[2], l[2];
    for (int i = 0; i < 2; i++) {
        h[i] = _mm256_loadu_si256((const __m256i *)(xh + 32 * i));
        l[i] = _mm256_loadu_si256((const __m256i *)(xl + 32 * i));
    }
    if (bits == 4) {
        const __m256i hs = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], h[0]), _mm256_maddubs_epi16(c[1], h[1]));
        const __m256i ls = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], l[0]), _mm256_maddubs_epi16(c[1], l[1]));
        return _mm256_add_epi32(_mm256_madd_epi16(hs, w256), _mm256_madd_epi16(ls, ones));
    }
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 2; i++) {
        const __m256i a = _mm256_abs_epi8(c[i]);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(h[i], c[i])), w256));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(l[i], c[i])), ones));
    }
    return sum;
}

/* elements i:i + 8 of a float32 or float16 table */
static inline __attribute__((always_inline)) __m256 eight_floats(const void *t, int half, int64_t i) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)t + i)))
                : _mm256_loadu_ps((const float *)t + i);
}

/* one output: channel n's lanes summed, plus the offsets' term: over groups, (offset + 128 scale for 8-bit
 * codes) times the row's sum of x (`gsum`) */
static inline __attribute__((always_inline)) float channel_sum(const qweight *w, int64_t n, const float *gsum,
                                                               __m256 acc) {
    const int64_t groups = w->K / w->group, first = n * groups;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
        __m256 z = eight_floats(w->offset, w->half, first + g);
        if (w->bits == 8) z = _mm256_fmadd_ps(eight_floats(w->scale, w->half, first + g), _mm256_set1_ps(128.0f), z);
        acc = _mm256_fmadd_ps(z, _mm256_loadu_ps(gsum + g), acc);
    }
    float total = hsum(acc);
    for (; g < groups; g++) {
        float z = scale_at(w->offset, w->half, first + g);
        if (w->bits == 8) z += 128.0f * scale_at(w->scale, w->half, first + g);
        total += z * gsum[g];
    }
    return total;
}

#define NT 4

/* acc += pair p of a channel (codes c, weight scales d) against x */
static inline __attribute__((always_inline)) __m256 pair_into(const int bits, const __m256i c[2], __m256 d, int64_t p,
                                                              const int8_t *xh, const int8_t *xl, const float *s256,
                                                              __m256 acc) {
    const __m256 v = _mm256_cvtepi32_ps(pair_dot(bits, c, xh + p * 64, xl + p * 64));
    return _mm256_fmadd_ps(v, _mm256_mul_ps(d, pair_floats(s256 + 2 * p)), acc);
}

/* channels n0:n0 + nt against one row of x: an int4 chunk's 64 bytes are read once for its two pairs */
static inline __attribute__((always_inline)) void tile(const int bits, const int nt, const qweight *w, const int8_t *xh,
                                                       const int8_t *xl, const float *s256, const float *gsum,
                                                       int64_t n0, float *y) {
    const int64_t pairs = w->K / 64, groups = w->K / w->group, elem = w->half ? 2 : 4;
    const __m256i flip = _mm256_set1_epi8((char)0x80), low = _mm256_set1_epi8(15);
    __m256 acc[NT];
    for (int i = 0; i < nt; i++) {
        acc[i] = _mm256_setzero_ps();
        prefetch_row(w, n0 + i + PREFETCH_ROWS); /* hints past the matrix's end are harmless */
    }
    for (int64_t p = 0; p < pairs; p += bits == 4 ? 2 : 1)
        for (int i = 0; i < nt; i++) {
            const uint8_t *row = w->packed + (n0 + i) * row_bytes(w);
            const void *sc = (const char *)w->scale + (n0 + i) * groups * elem;
            __m256i c[2], odd[2];
            if (bits == 8) {
                for (int j = 0; j < 2; j++)
                    c[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + p * 64 + 32 * j)), flip);
                acc[i] = pair_into(8, c, weight_scales(w, sc, p), p, xh, xl, s256, acc[i]);
            } else if (p + 1 < pairs) {
                codes128(row + p * 32, c, odd);
                acc[i] = pair_into(4, c, weight_scales(w, sc, p), p, xh, xl, s256, acc[i]);
                acc[i] = pair_into(4, odd, weight_scales(w, sc, p + 1), p + 1, xh, xl, s256, acc[i]);
            } else { /* a last pair alone: positions q (low nibble) and q + 32 (high) in byte q */
                const __m256i b = _mm256_loadu_si256((const __m256i *)(row + p * 32));
                c[0] = _mm256_and_si256(b, low);
                c[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
                acc[i] = pair_into(4, c, weight_scales(w, sc, p), p, xh, xl, s256, acc[i]);
            }
        }
    for (int i = 0; i < nt; i++) y[n0 + i] = channel_sum(w, n0 + i, gsum, acc[i]);
}

#define TILES(bits)                                                                      \
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < N; n += NT) {    \
        if (n + NT <= N)                                                                 \
            tile(bits, NT, w, xh, xl, s256, gsum, n, y);                                 \
        else                                                                             \
            for (int64_t r = n; r < N; r++) tile(bits, 1, w, xh, xl, s256, gsum, r, y); \
    }

static void gemv(const qweight *w, const int8_t *xh, const int8_t *xl, const float *s256, const float *gsum,
                 int64_t N, float *y) {
    if (w->bits == 4) {
        TILES(4)
    } else {
        TILES(8)
    }
}

void pd_quant_gemv_avx2(const float *x, int64_t K, const uint8_t *packed, int bits, const void *scale,
                        const void *offset, int half, int64_t group, int64_t N, float *y) {
    const qweight w = {packed, scale, offset, bits, half, K, group};
    const int64_t blocks = K / 32, groups = K / group;
    int8_t *xh = malloc(2 * K), *xl = xh + K;
    float *s256 = malloc((blocks + groups) * sizeof(float)), *gsum = s256 + blocks;
    quantize_x(x, K, group, xh, xl, s256, gsum);
    gemv(&w, xh, xl, s256, gsum, N, y);
    free(xh);
    free(s256);
}

#endif
