/* The packed layout of weight-only quantized linears on CPU (pdserve.kernels.cpu_quant.pack), shared by
 * quant_gemm.c and quant_dequant.c. */
#ifndef PD_QUANT_LAYOUT_H
#define PD_QUANT_LAYOUT_H
#include <stdint.h>

/* A quantized weight w [N, K]:
 *
 *     w[n, k] = code[n, k] * scale[n, k / group] + offset[n, k / group]
 *
 * Layout (pdserve.kernels.cpu_quant.pack), K a multiple of 64, in pair-blocks of 64 elements (two 32-element
 * blocks A, B): position p of a pair-block holds element e with p = 4 * (2 * ((e % 32) / 4) + e / 32) + e % 4,
 * so that each 4-byte lane of a 64-byte register reads one block (lane i: block i % 2);
 *   bits 8: packed [N, K] uint8, the codes at their positions;
 *   bits 4: packed [N, K / 2] uint8, in chunks of two pair-blocks: byte p of a 64-byte chunk holds position
 *           p of the even pair in its low nibble and of the odd pair in its high nibble; a last pair alone
 *           (K % 128 == 64) is 32 bytes, byte p holding position p (low nibble) and p + 32 (high);
 *   scale, offset: [N, K / group], float32, or float16 (`half`: GGUF's d and m as stored);
 *   group: 32 or a multiple of 64.
 */
typedef struct {
    const uint8_t *packed;
    const void *scale, *offset;
    int bits, half;
    int64_t K, group;
} qweight;

static inline float scale_at(const void *t, int half, int64_t i) {
    return half ? (float)((const _Float16 *)t)[i] : ((const float *)t)[i];
}

static inline int64_t row_bytes(const qweight *w) { return w->bits == 4 ? w->K / 2 : w->K; }

/* row n of w as float32 [K], exactly (quant_dequant.c) */
void pd_quant_dequant_row(const qweight *w, int64_t n, float *out);
/* pair p of row n (its bytes `row`) as float32 [64] in position order, exactly (quant_dequant.c) */
void pd_quant_pair_values(const qweight *w, const uint8_t *row, int64_t n, int64_t p, float *out);
/* y [M, N] = x [M, K] @ w^T in float32 with exact weights (quant_gemm_f32.c) */
void pd_quant_gemm_f32(const float *x, int64_t M, int64_t K, const uint8_t *packed, int bits, const void *scale,
                       const void *offset, int half, int64_t group, int64_t N, float *y);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PD_QUANT_VNNI 1
#include <immintrin.h>

/* the 128 codes of an int4 chunk (pairs 2c and 2c + 1, as low and high nibbles of 64 bytes) */
static inline __attribute__((always_inline)) void codes128(const uint8_t *q, __m512i *even, __m512i *odd) {
    const __m512i b = _mm512_loadu_si512(q), low = _mm512_set1_epi8(15);
    *even = _mm512_and_si512(b, low);
    *odd = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
}

/* the 64 codes of an int4 pair stored alone: 32 bytes, low nibbles then high nibbles */
static inline __attribute__((always_inline)) __m512i codes64(const uint8_t *q) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)q), low = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* the 64 codes of pair p of a row in position order, one byte each */
static inline __attribute__((always_inline)) __m512i pair_codes(const qweight *w, const uint8_t *row, int64_t p) {
    if (w->bits == 8) return _mm512_loadu_si512(row + p * 64);
    if (p + 1 < w->K / 64 || p % 2 == 1) {
        __m512i even, odd;
        codes128(row + (p / 2) * 64, &even, &odd);
        return p % 2 ? odd : even;
    }
    return codes64(row + p * 32); /* a last pair alone */
}

#else
#define PD_QUANT_VNNI 0
#endif

#if !PD_QUANT_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PD_QUANT_AVX2 1
#include <immintrin.h>
/* y [N] = w @ x [K], x in two int8 planes as the VNNI path holds it (quant_gemm_avx2.c) */
void pd_quant_gemv_avx2(const float *x, int64_t K, const uint8_t *packed, int bits, const void *scale,
                        const void *offset, int half, int64_t group, int64_t N, float *y);
#else
#define PD_QUANT_AVX2 0
#endif

#if PD_QUANT_VNNI || PD_QUANT_AVX2
/* At one row of x, the rows PREFETCH_ROWS ahead of those being read are requested explicitly: a decode
 * step's matrices are 0.2-1 MB, each thread streams its half once per call, and the hardware prefetchers'
 * ramp on so short a stream left a batch-1 step's linears at about half the read bandwidth (a batch-1 decode
 * of the default model ran 1.2x faster with it on AVX-512 VNNI, 1.29x on AVX2; the VNNI multi-row path,
 * compute-bound, showed no change beyond the VM's noise and is left without). Hints past the matrix's end
 * are harmless. */
#define PREFETCH_ROWS 16

static inline __attribute__((always_inline)) void prefetch_row(const qweight *w, int64_t n) {
    const int64_t groups = w->K / w->group, elem = w->half ? 2 : 4;
    const char *row = (const char *)w->packed + n * row_bytes(w);
    for (int64_t off = 0; off < row_bytes(w); off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
    _mm_prefetch((const char *)w->scale + n * groups * elem, _MM_HINT_T0);
    _mm_prefetch((const char *)w->offset + n * groups * elem, _MM_HINT_T0);
}
#endif
#endif
