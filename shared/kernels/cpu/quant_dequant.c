/* Dequantizing the packed weights of quant_layout.h to float32 exactly (code * scale + offset): the path
 * above the kernel's row limit, and the portable GEMM's rows. */
#include <stdint.h>
#include "quant_layout.h"

#if PD_QUANT_VNNI
/* pd_quant_dequant_row, 16 elements at a time: the pair's 4-byte lanes regrouped by block (even lanes hold
 * block A, odd lanes block B, each in element order), widened to float32, code * scale + offset in one
 * fused rounding as the scalar code computes it */
static void dequant_row_fast(const qweight *w, int64_t n, float *out) {
    const int64_t K = w->K, groups = K / w->group;
    const uint8_t *row = w->packed + n * row_bytes(w);
    const __m512i by_block = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t p = 0; p < K / 64; p++) {
        const __m512i codes = _mm512_permutexvar_epi32(by_block, pair_codes(w, row, p));
        for (int block = 0; block < 2; block++) {
            const int64_t g = n * groups + (p * 64 + block * 32) / w->group;
            const __m512 d = _mm512_set1_ps(scale_at(w->scale, w->half, g));
            const __m512 m = _mm512_set1_ps(scale_at(w->offset, w->half, g));
            for (int j = 0; j < 2; j++) {
                const __m128i bytes = _mm512_extracti32x4_epi32(codes, 2 * block + j);
                const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                _mm512_storeu_ps(out + p * 64 + block * 32 + j * 16, _mm512_fmadd_ps(c, d, m));
            }
        }
    }
}

#endif

/* pair p of row n in position order (quant_layout.h), exactly code * scale + offset: position 8j + i lies in
 * block i / 4 of the pair, so every loop runs over whole 8-float vectors (AVX2 and up) */
void pd_quant_pair_values(const qweight *w, const uint8_t *row, int64_t n, int64_t p, float *out) {
    uint8_t c[64];
    if (w->bits == 8) {
        for (int q = 0; q < 64; q++) c[q] = row[p * 64 + q];
    } else if (p + 1 < w->K / 64 || p % 2 == 1) {
        const uint8_t *b = row + (p / 2) * 64;
        const int shift = 4 * (int)(p % 2);
        for (int q = 0; q < 64; q++) c[q] = (uint8_t)((b[q] >> shift) & 15);
    } else { /* a last pair alone */
        const uint8_t *b = row + p * 32;
        for (int q = 0; q < 32; q++) {
            c[q] = b[q] & 15;
            c[q + 32] = b[q] >> 4;
        }
    }
    const int64_t groups = w->K / w->group;
    float d[8], m[8];
    for (int block = 0; block < 2; block++) {
        const int64_t g = n * groups + (p * 64 + block * 32) / w->group;
        const float dg = scale_at(w->scale, w->half, g), mg = scale_at(w->offset, w->half, g);
        for (int i = 0; i < 4; i++) {
            d[4 * block + i] = dg;
            m[4 * block + i] = mg;
        }
    }
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 8; i++) out[8 * j + i] = (float)c[8 * j + i] * d[i] + m[i];
}

/* row n of w as float32 [K] in element order: position 8j + 4 * block + i holds element 32 * block + 4j + i */
void pd_quant_dequant_row(const qweight *w, int64_t n, float *out) {
    const uint8_t *row = w->packed + n * row_bytes(w);
    float pair[64];
    for (int64_t p = 0; p < w->K / 64; p++) {
        pd_quant_pair_values(w, row, n, p, pair);
        for (int block = 0; block < 2; block++)
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 4; i++) out[p * 64 + block * 32 + 4 * j + i] = pair[8 * j + 4 * block + i];
    }
}

/* rows n0:n1 of w as float32 [n1 - n0, K] */
void pd_quant_dequant(const uint8_t *packed, int bits, const void *scale, const void *offset, int half,
                      int64_t group, int64_t n0, int64_t n1, int64_t K, float *out) {
    const qweight w = {packed, scale, offset, bits, half, K, group};
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) {
#if PD_QUANT_VNNI
        dequant_row_fast(&w, n, out + (n - n0) * K);
#else
        pd_quant_dequant_row(&w, n, out + (n - n0) * K);
#endif
    }
}
