/* Every decoder layer of a decode step in one call, for weight-only quantized Llama-family models on CPU
 * (float32 activations): the same kernels the per-op path calls (pd_rms_norm, pd_quant_gemm, pd_rotary,
 * pd_paged_decode), without the ~20 Python-level torch ops a layer costs at one token.
 *
 * Per layer, for x [n, hidden] (the residual stream, updated in place), one decode token per sequence:
 *   h = rms_norm(x); [q | k | v] = h @ Wqkv^T; q, k rotated at positions; k, v stored at slots;
 *   x += attention(q) @ Wo^T; h = rms_norm(x); [g | u] = h @ Wgu^T; x += (silu(g) * u) @ Wdown^T.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd_math.h"

void pd_quant_gemm(const float *x, int64_t M, int64_t K, const uint8_t *packed, int bits, const void *scale,
                   const void *offset, int half, int64_t group, int64_t N, float *y);
void pd_rms_norm(const float *x, const float *weight, int64_t T, int64_t H, float eps, float *out);
int pd_rotary(const float *src, int64_t T, int64_t heads, int64_t src_stride, int64_t D, const int64_t *positions,
              const float *cos, const float *sin, int64_t max_positions, float *dst);
int pd_paged_decode(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const void *k_cache,
                    const void *v_cache, int half, int64_t num_blocks, int64_t block_size, int64_t block_stride,
                    const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, float scale,
                    float *out);
void pd_store_row(void *cache, int half, int64_t at, const float *src, int64_t count);
int pd_kv_half_supported(void);

typedef struct { /* one quantized linear, as pdserve.kernels.cpu_quant packs it: y [M, N] = x [M, K] @ w^T */
    const uint8_t *packed;
    const void *scale, *offset;
    int64_t bits, half, group, N, K;
} pd_qlinear;

typedef struct {
    const float *input_norm, *post_attention_norm; /* [hidden] */
    pd_qlinear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, Hkv, D] float32 or half (kv_half), blocks block_stride elements apart */
} pd_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* [max_positions, head_dim] */
    int64_t max_positions, num_blocks, block_size, block_stride, kv_half;
} pd_dims;

/* act = silu(g) * u over I elements */
static void silu_mul(const float *g, const float *u, int64_t I, float *act) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= I; j += 16) {
        const __m512 gv = _mm512_loadu_ps(g + j), one = _mm512_set1_ps(1.0f);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(act + j, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + j)));
    }
#endif
    for (; j < I; j++) act[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

static void linear(const pd_qlinear *w, const float *x, int64_t M, float *y) {
    pd_quant_gemm(x, M, w->K, w->packed, (int)w->bits, w->scale, w->offset, (int)w->half, w->group, w->N, y);
}

/* Floats of scratch `pd_decode_layers` needs for n sequences. */
int64_t pd_decode_scratch(const pd_dims *m, int64_t n) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return n * (m->hidden + (q + 2 * kv) + q + kv + q + m->hidden + 2 * m->intermediate + m->intermediate);
}

/* Returns -1 (nothing written) when a position, slot or block id is outside its table, or a context
 * outruns its block table. */
int pd_decode_layers(float *x, int64_t n, const pd_dims *m, const pd_layer *layers, int64_t num_layers,
                     const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                     int64_t table_width, const int64_t *context_lens, float *scratch) {
    const int64_t H = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->intermediate, hidden = m->hidden;
    const int64_t q_size = H * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
    const int half = (int)m->kv_half;
    if (half && !pd_kv_half_supported()) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = context_lens[i];
        if (positions[i] < 0 || positions[i] >= m->max_positions) return -1;
        if (slots[i] < 0 || slots[i] >= m->num_blocks * m->block_size) return -1;
        if (len < 1 || len > table_width * m->block_size) return -1;
        for (int64_t b = 0; b < (len + m->block_size - 1) / m->block_size; b++)
            if (block_tables[i * table_width + b] < 0 || block_tables[i * table_width + b] >= m->num_blocks)
                return -1;
    }
    float *h = scratch, *qkv = h + n * hidden, *qr = qkv + n * qkv_size, *kr = qr + n * q_size;
    float *attn = kr + n * kv_size, *proj = attn + n * q_size, *gu = proj + n * hidden, *act = gu + n * 2 * I;
    for (int64_t l = 0; l < num_layers; l++) {
        const pd_layer *L = layers + l;
        pd_rms_norm(x, L->input_norm, n, hidden, m->eps, h);
        linear(&L->qkv, h, n, qkv);
        pd_rotary(qkv, n, H, qkv_size, D, positions, m->cos, m->sin, m->max_positions, qr);
        pd_rotary(qkv + q_size, n, Hkv, qkv_size, D, positions, m->cos, m->sin, m->max_positions, kr);
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = slots[i] / m->block_size * m->block_stride + slots[i] % m->block_size * kv_size;
            pd_store_row(L->k_cache, half, at, kr + i * kv_size, kv_size);
            pd_store_row(L->v_cache, half, at, qkv + i * qkv_size + q_size + kv_size, kv_size);
        }
        pd_paged_decode(qr, n, H, Hkv, D, L->k_cache, L->v_cache, half, m->num_blocks, m->block_size, m->block_stride,
                        block_tables, table_width, context_lens, m->scale, attn);
        linear(&L->o, attn, n, proj);
        for (int64_t j = 0; j < n * hidden; j++) x[j] += proj[j];
        pd_rms_norm(x, L->post_attention_norm, n, hidden, m->eps, h);
        linear(&L->gate_up, h, n, gu);
        for (int64_t i = 0; i < n; i++) silu_mul(gu + i * 2 * I, gu + i * 2 * I + I, I, act + i * I);
        linear(&L->down, act, n, proj);
        for (int64_t j = 0; j < n * hidden; j++) x[j] += proj[j];
    }
    return 0;
}
