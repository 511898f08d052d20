/* Decode attention over the paged float32 KV cache on CPU, and the store of a step's K/V into it.
 *
 * Cache: [num_blocks, block_size, Hkv, D] float32, each block's [block_size, Hkv, D] contiguous and blocks
 * `block_stride` floats apart (a layer's view of the engine's pool, which holds every layer's K and V of a
 * block together). A sequence's token s sits in block block_tables[i, s / block_size] at offset
 * s % block_size. Query head h reads KV head h / (H / Hkv).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* out[i, h] = softmax_s(scale * q[i, h] . k[i, s]) @ v[i, s] over s < context_lens[i]; q, out [n, H, D].
 * Returns -1 (nothing computed) when a context outruns its table or a block id is outside the cache. */
int pd_paged_decode(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const float *k_cache,
                    const float *v_cache, int64_t num_blocks, int64_t block_size, int64_t block_stride,
                    const int64_t *block_tables,
                    int64_t table_width, const int64_t *context_lens, float scale, float *out) {
    const int64_t group = H / Hkv, token_stride = Hkv * D;
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = context_lens[i];
        if (len < 1 || len > table_width * block_size) return -1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (block_tables[i * table_width + b] < 0 || block_tables[i * table_width + b] >= num_blocks) return -1;
    }
#pragma omp parallel
    {
        float *scores = NULL;
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
                    const float *key = k_cache + table[s / block_size] * block_stride + (s % block_size) * token_stride
                                       + kv_head * D;
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
                    const float *value = v_cache + table[s / block_size] * block_stride + (s % block_size) * token_stride
                                         + kv_head * D;
                    const float p = scores[s];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += p * value[d];
                }
                const float inv = 1.0f / total;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] *= inv;
            }
        free(scores);
    }
    return 0;
}

/* cache slot slots[t] (block * block_size + offset) <- row t of k and of v ([T, Hkv * D] rows, `stride`
 * floats apart: views into the fused qkv output). Returns -1 (nothing written) when a slot is outside the
 * cache's num_blocks * block_size slots. */
int pd_store_kv(const float *k, const float *v, int64_t T, int64_t stride, int64_t row, const int64_t *slots,
                int64_t num_blocks, int64_t block_size, int64_t block_stride, float *k_cache, float *v_cache) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t at = slots[t] / block_size * block_stride + slots[t] % block_size * row;
        memcpy(k_cache + at, k + t * stride, row * sizeof(float));
        memcpy(v_cache + at, v + t * stride, row * sizeof(float));
    }
    return 0;
}
