/* Decode attention over the paged KV cache on CPU, and the store of a step's K/V into it.
 *
 * Cache: [num_blocks, block_size, Hkv, D] float32, or IEEE half when `half` (kv_cache_dtype float16, read
 * and written through F16C), each block's [block_size, Hkv, D] contiguous and blocks `block_stride`
 * elements apart (a layer's view of the engine's pool, which holds every layer's K and V of a block
 * together). A sequence's token s sits in block block_tables[i, s / block_size] at offset
 * s % block_size. Query head h reads KV head h / (H / Hkv). Without F16C the half entry points refuse
 * (pd_kv_half_supported is 0) and the caller takes torch's path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define PD_KV_HALF 1
#else
#define PD_KV_HALF 0
#endif

int pd_kv_half_supported(void) { return PD_KV_HALF; }

/* The cached row at element `at` as float32: in place for a float32 cache, converted into buf [D] for half. */
static inline const float *load_row(const void *cache, int half, int64_t at, int64_t D, float *buf) {
    if (!half) return (const float *)cache + at;
#if PD_KV_HALF
    const uint16_t *row = (const uint16_t *)cache + at;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + d))));
    for (; d < D; d++) buf[d] = _cvtsh_ss(row[d]);
#endif
    return buf;
}

/* cache[at : at + count] <- src, rounded to nearest even for a half cache. */
void pd_store_row(void *cache, int half, int64_t at, const float *src, int64_t count) {
    if (!half) {
        memcpy((float *)cache + at, src, count * sizeof(float));
        return;
    }
#if PD_KV_HALF
    uint16_t *row = (uint16_t *)cache + at;
    int64_t d = 0;
    for (; d + 8 <= count; d += 8)
        _mm_storeu_si128((__m128i *)(row + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
    for (; d < count; d++) row[d] = _cvtss_sh(src[d], _MM_FROUND_TO_NEAREST_INT);
#endif
}

/* out[i, h] = softmax_s(scale * q[i, h] . k[i, s]) @ v[i, s] over s < context_lens[i]; q, out [n, H, D].
 * Returns -1 (nothing computed) when a context outruns its table or a block id is outside the cache. */
int pd_paged_decode(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const void *k_cache,
                    const void *v_cache, int half, int64_t num_blocks, int64_t block_size, int64_t block_stride,
                    const int64_t *block_tables,
                    int64_t table_width, const int64_t *context_lens, float scale, float *out) {
    const int64_t group = H / Hkv, token_stride = Hkv * D;
    if (half && !PD_KV_HALF) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = context_lens[i];
        if (len < 1 || len > table_width * block_size) return -1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (block_tables[i * table_width + b] < 0 || block_tables[i * table_width + b] >= num_blocks) return -1;
    }
#pragma omp parallel
    {
        float *scores = NULL, *row = malloc(D * sizeof(float));
        int64_t capacity = 0;
#pragma omp for schedule(static) collapse(2)
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t len = context_lens[i], kv_head = h / group;
                const int64_t *table = block_tables + i * table_width;
                if (len > capacity) {
                    free(scores);
                    capacity = len;
                    scores = malloc(capacity * sizeof(float));
                }
                const float *qh = q + (i * H + h) * D;
                float top = -INFINITY;
                for (int64_t s = 0; s < len; s++) {
                    const float *key = load_row(k_cache, half, table[s / block_size] * block_stride
                                                + (s % block_size) * token_stride + kv_head * D, D, row);
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qh[d] * key[d];
                    scores[s] = dot * scale;
                    top = scores[s] > top ? scores[s] : top;
                }
                float total = 0.0f;
                for (int64_t s = 0; s < len; s++) {
                    scores[s] = expf(scores[s] - top);
                    total += scores[s];
                }
                float *o = out + (i * H + h) * D;
                memset(o, 0, D * sizeof(float));
                for (int64_t s = 0; s < len; s++) {
                    const float *value = load_row(v_cache, half, table[s / block_size] * block_stride
                                                  + (s % block_size) * token_stride + kv_head * D, D, row);
                    const float p = scores[s];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += p * value[d];
                }
                const float inv = 1.0f / total;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        free(scores);
        free(row);
    }
    return 0;
}

/* cache slot slots[t] (block * block_size + offset) <- row t of k and of v ([T, Hkv * D] float32 rows,
 * `stride` floats apart: views into the fused qkv output). Returns -1 (nothing written) when a slot is
 * outside the cache's num_blocks * block_size slots. */
int pd_store_kv(const float *k, const float *v, int64_t T, int64_t stride, int64_t row, const int64_t *slots,
                int64_t num_blocks, int64_t block_size, int64_t block_stride, void *k_cache, void *v_cache,
                int half) {
    if (half && !PD_KV_HALF) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t at = slots[t] / block_size * block_stride + slots[t] % block_size * row;
        pd_store_row(k_cache, half, at, k + t * stride, row);
        pd_store_row(v_cache, half, at, v + t * stride, row);
    }
    return 0;
}
