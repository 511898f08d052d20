/* The float32 path of the weight-only quantized GEMM (quant_gemm.c on CPUs without AVX-512 VNNI):
 * y[M, N] = x[M, K] @ w[N, K]^T with every weight exactly code * scale + offset (quant_layout.h).
 *
 * x is permuted once per call into the layout's position order, so that a pair's 64 codes meet their x in
 * place: position 8j + 4 * block + i of pair p holds element 64p + 32 * block + 4j + i.
 * AVX2 + FMA: the codes widened 8 at a time, dequantized in one fused multiply-add against the pair's
 * scales {d_A x4, d_B x4}, and multiplied into 2 rows of x at once (4 ran slower: 2-core AMD EPYC, AVX2). Elsewhere: the row dequantized
 * into a buffer (quant_dequant.c) and a float32 dot product per row of x. */
#include <stdint.h>
#include <stdlib.h>
#include "quant_layout.h"

static void permute_x(const float *x, int64_t M, int64_t K, float *xp) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < K / 64; p++)
            for (int block = 0; block < 2; block++)
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 4; i++)
                        xp[m * K + p * 64 + 8 * j + 4 * block + i] = x[m * K + p * 64 + block * 32 + 4 * j + i];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* the 64 codes of pair p in position order, 16 bytes each */
static inline __attribute__((always_inline)) void pair_bytes(const qweight *w, const uint8_t *row, int64_t p,
                                                            __m128i b[4]) {
    const __m128i low = _mm_set1_epi8(15);
    if (w->bits == 8) {
        for (int i = 0; i < 4; i++) b[i] = _mm_loadu_si128((const __m128i *)(row + p * 64 + 16 * i));
    } else if (p + 1 < w->K / 64 || p % 2 == 1) {
        const uint8_t *src = row + (p / 2) * 64;
        for (int i = 0; i < 4; i++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(src + 16 * i));
            b[i] = _mm_and_si128(p % 2 ? _mm_srli_epi16(v, 4) : v, low);
        }
    } else { /* a last pair alone: positions q (low nibble) and q + 32 (high) in byte q */
        const __m128i v0 = _mm_loadu_si128((const __m128i *)(row + p * 32));
        const __m128i v1 = _mm_loadu_si128((const __m128i *)(row + p * 32 + 16));
        b[0] = _mm_and_si128(v0, low);
        b[1] = _mm_and_si128(v1, low);
        b[2] = _mm_and_si128(_mm_srli_epi16(v0, 4), low);
        b[3] = _mm_and_si128(_mm_srli_epi16(v1, 4), low);
    }
}

/* column n of y for MT rows of x (xp, position order) at once */
static inline __attribute__((always_inline)) void rows_avx2(const qweight *w, const float *xp, int64_t N,
                                                           int64_t n, const int MT, float *y) {
    const int64_t K = w->K, groups = K / w->group;
    const uint8_t *row = w->packed + n * row_bytes(w);
    __m256 acc[2][2];
    for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < K / 64; p++) {
        __m128i b[4];
        pair_bytes(w, row, p, b);
        const int64_t ga = n * groups + (p * 64) / w->group, gb = n * groups + (p * 64 + 32) / w->group;
        const __m256 d = _mm256_setr_m128(_mm_set1_ps(scale_at(w->scale, w->half, ga)),
                                          _mm_set1_ps(scale_at(w->scale, w->half, gb)));
        const __m256 m = _mm256_setr_m128(_mm_set1_ps(scale_at(w->offset, w->half, ga)),
                                          _mm_set1_ps(scale_at(w->offset, w->half, gb)));
        for (int j = 0; j < 8; j++) {
            const __m128i bytes = j % 2 ? _mm_srli_si128(b[j / 2], 8) : b[j / 2];
            const __m256 wj = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), d, m);
            for (int r = 0; r < MT; r++)
                acc[r][j % 2] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(xp + r * K + p * 64 + 8 * j), acc[r][j % 2]);
        }
    }
    for (int r = 0; r < MT; r++) {
        const __m256 s = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        y[r * N + n] = _mm_cvtss_f32(h);
    }
}

static void gemm_rows(const qweight *w, const float *xp, int64_t M, int64_t N, float *y) {
    const int64_t K = w->K;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += 2) { /* constant MT: the accumulators stay in registers */
            if (M - m0 == 1) rows_avx2(w, xp + m0 * K, N, n, 1, y + m0 * N);
            else rows_avx2(w, xp + m0 * K, N, n, 2, y + m0 * N);
        }
}

#else

static void gemm_rows(const qweight *w, const float *xp, int64_t M, int64_t N, float *y) {
    const int64_t K = w->K;
#pragma omp parallel
    {
        float *row = malloc(K * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *codes = w->packed + n * row_bytes(w);
            for (int64_t p = 0; p < K / 64; p++) pd_quant_pair_values(w, codes, n, p, row + p * 64);
            for (int64_t m = 0; m < M; m++) {
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; k++) acc += row[k] * xp[m * K + k];
                y[m * N + n] = acc;
            }
        }
        free(row);
    }
}

#endif

void pd_quant_gemm_f32(const float *x, int64_t M, int64_t K, const uint8_t *packed, int bits, const void *scale,
                       const void *offset, int half, int64_t group, int64_t N, float *y) {
    const qweight w = {packed, scale, offset, bits, half, K, group};
    float *xp = malloc(M * K * sizeof(float));
    permute_x(x, M, K, xp);
    gemm_rows(&w, xp, M, N, y);
    free(xp);
}
