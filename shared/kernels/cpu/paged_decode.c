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
#include <omp.h>
#include "simd_math.h"
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

/* Work items: (sequence i, KV head g, piece c of the context), `pieces` per (i, g), enough of them that two
 * threads or more share a batch of one evenly; an item runs the `group` query heads that share KV head g
 * over the same rows, one head after another (the piece's rows stay in L1/L2 between heads). */
#define PD_MIN_PIECE 32

typedef struct {
    int64_t pieces, per; /* pieces per (i, g) and positions per piece (the last may be shorter or empty) */
} pd_split;

static pd_split split_of(int64_t len, int64_t items, int threads) {
    int64_t pieces = items >= 4 * threads ? 1 : (4 * threads + items - 1) / items;
    int64_t max_pieces = (len + PD_MIN_PIECE - 1) / PD_MIN_PIECE;
    if (pieces > max_pieces) pieces = max_pieces;
    if (pieces < 1) pieces = 1;
    const pd_split sp = {pieces, (len + pieces - 1) / pieces};
    return sp;
}

/* scores[t] <- exp(scores[t] - top); returns their sum */
static inline float exp_sum(float *scores, int64_t span, float top) {
#if defined(__AVX512F__) && PD_KV_HALF
    const __m512 vtop = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < span; t += 16) {
        const __mmask16 k = span - t >= 16 ? 0xFFFF : (__mmask16)((1u << (span - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + t), vtop));
        _mm512_mask_storeu_ps(scores + t, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
#else
    float total = 0.0f;
    for (int64_t t = 0; t < span; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    return total;
#endif
}

/* One query head over positions [s0, s1): its max m, its sum l of exp(score - m) and o [D], the exp-weighted
 * sum of values. */
static void attend_head(const float *qh, int64_t D, const void *k_cache, const void *v_cache, int half,
                        const int64_t *at, int64_t span, float scale, float *scores, float *row, float *m, float *l,
                        float *o) {
    float top = -INFINITY;
    for (int64_t t = 0; t < span; t++) {
        const float *key = load_row(k_cache, half, at[t], D, row);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qh[d] * key[d];
        scores[t] = dot * scale;
        top = scores[t] > top ? scores[t] : top;
    }
    const float total = exp_sum(scores, span, top);
    memset(o, 0, D * sizeof(float));
    for (int64_t t = 0; t < span; t++) {
        const float *value = load_row(v_cache, half, at[t], D, row);
        const float p = scores[t];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += p * value[d];
    }
    *m = top;
    *l = total;
}

#if defined(__AVX512F__) && PD_KV_HALF
static inline __attribute__((always_inline)) __m512 row16(const void *cache, int half, int64_t at, int c) {
    if (!half) return _mm512_loadu_ps((const float *)cache + at + 16 * c);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + at + 16 * c)));
}

/* the rows PD_PREFETCH positions ahead, K and V, requested while the scores are computed (a piece's rows sit
 * 16 to a block, its blocks anywhere in the pool), so that the V pass finds its rows cached; measured only
 * together with the grouped heads below */
#define PD_PREFETCH 8

static inline __attribute__((always_inline)) void prefetch_rows(const void *k_cache, const void *v_cache, int half,
                                                                int64_t at, int64_t D) {
    const int64_t bytes = D * (half ? 2 : 4), elem = half ? 2 : 4;
    for (int64_t off = 0; off < bytes; off += 64) {
        _mm_prefetch((const char *)k_cache + at * elem + off, _MM_HINT_T0);
        _mm_prefetch((const char *)v_cache + at * elem + off, _MM_HINT_T0);
    }
}

/* attend_head for G query heads sharing one KV head, D = 16 * ND: each K and V row is read once for all G,
 * q and o held in registers; per head the same sums in the same order as one head alone.
 * scores: [G, span]. */
#define PD_GMAX 4
static inline __attribute__((always_inline)) void attend_heads16(const int ND, const int G, const float *q,
                                                                 const void *k_cache, const void *v_cache, int half,
                                                                 const int64_t *at, int64_t span, float scale,
                                                                 float *scores, float *m, float *l, float *o) {
    const int64_t D = 16 * ND;
    __m512 qv[PD_GMAX][8], ov[PD_GMAX][8];
    float top[PD_GMAX];
    for (int j = 0; j < G; j++) {
        top[j] = -INFINITY;
        for (int c = 0; c < ND; c++) qv[j][c] = _mm512_loadu_ps(q + j * D + 16 * c), ov[j][c] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < span; t++) {
        if (t + PD_PREFETCH < span) prefetch_rows(k_cache, v_cache, half, at[t + PD_PREFETCH], D);
        __m512 kr[8];
        for (int c = 0; c < ND; c++) kr[c] = row16(k_cache, half, at[t], c);
        for (int j = 0; j < G; j++) {
            __m512 acc = _mm512_mul_ps(qv[j][0], kr[0]);
            for (int c = 1; c < ND; c++) acc = _mm512_fmadd_ps(qv[j][c], kr[c], acc);
            const float score = _mm512_reduce_add_ps(acc) * scale;
            scores[j * span + t] = score;
            top[j] = score > top[j] ? score : top[j];
        }
    }
    for (int j = 0; j < G; j++) l[j] = exp_sum(scores + j * span, span, top[j]), m[j] = top[j];
    for (int64_t t = 0; t < span; t++) {
        for (int c = 0; c < ND; c++) {
            const __m512 vr = row16(v_cache, half, at[t], c);
            for (int j = 0; j < G; j++)
                ov[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * span + t]), vr, ov[j][c]);
        }
    }
    for (int j = 0; j < G; j++)
        for (int c = 0; c < ND; c++) _mm512_storeu_ps(o + j * D + 16 * c, ov[j][c]);
}

/* heads per pass: G * ND <= 16 accumulators */
static inline int64_t heads_per_pass(int64_t D) { return D <= 64 ? PD_GMAX : 2; }

#define PD_HEADS16(nd, g) \
    case 8 * (g) + (nd): \
        attend_heads16(nd, g, q, k_cache, v_cache, half, at, span, scale, scores, m, l, o); return 1;

/* 1 when D and G have a register kernel (and it ran) */
static int attend_heads_fast(int64_t D, int64_t G, const float *q, const void *k_cache, const void *v_cache,
                             int half, const int64_t *at, int64_t span, float scale, float *scores, float *m,
                             float *l, float *o) {
    if (D % 16 != 0 || D > 128 || G > PD_GMAX) return 0;
    switch (8 * G + D / 16) {
        PD_HEADS16(1, 1) PD_HEADS16(1, 2) PD_HEADS16(1, 3) PD_HEADS16(1, 4)
        PD_HEADS16(2, 1) PD_HEADS16(2, 2) PD_HEADS16(2, 3) PD_HEADS16(2, 4)
        PD_HEADS16(4, 1) PD_HEADS16(4, 2) PD_HEADS16(4, 3) PD_HEADS16(4, 4)
        PD_HEADS16(6, 1) PD_HEADS16(6, 2) PD_HEADS16(8, 1) PD_HEADS16(8, 2)
    }
    return 0;
}
#else
static inline int64_t heads_per_pass(int64_t D) { (void)D; return 1; }
static int attend_heads_fast(int64_t D, int64_t G, const float *q, const void *k_cache, const void *v_cache,
                             int half, const int64_t *at, int64_t span, float scale, float *scores, float *m,
                             float *l, float *o) {
    return 0;
}
#endif

/* One piece, positions [s0, s1) of a sequence, for the `group` query heads of KV head g: per head j its
 * max m[j], sum l[j] and o[j] [D] (attend_head); `at` [s1 - s0] takes the rows' offsets, scores
 * [group, s1 - s0]. */
static void attend_piece(const float *q, int64_t D, int64_t group, const void *k_cache, const void *v_cache,
                         int half, int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t g,
                         const int64_t *table, int64_t s0, int64_t s1, float scale, float *scores, float *row,
                         int64_t *at, float *m, float *l, float *o) {
    const int64_t span = s1 - s0, pass = heads_per_pass(D);
    for (int64_t s = s0; s < s1; s++)
        at[s - s0] = table[s / block_size] * block_stride + (s % block_size) * token_stride + g * D;
    for (int64_t j = 0; j < group; j += pass) {
        const int64_t G = group - j < pass ? group - j : pass;
        if (attend_heads_fast(D, G, q + j * D, k_cache, v_cache, half, at, span, scale, scores, m + j, l + j,
                              o + j * D))
            continue;
        for (int64_t h = j; h < j + G; h++)
            attend_head(q + h * D, D, k_cache, v_cache, half, at, span, scale, scores, row, m + h, l + h, o + h * D);
    }
}

/* out[i, h] = softmax_s(scale * q[i, h] . k[i, s]) @ v[i, s] over s < context_lens[i]; q, out [n, H, D].
 * Long contexts of a small batch are split into pieces (split_of) whose partial softmaxes are merged.
 * Returns -1 (nothing computed) when a context outruns its table or a block id is outside the cache. */
int pd_paged_decode(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const void *k_cache,
                    const void *v_cache, int half, int64_t num_blocks, int64_t block_size, int64_t block_stride,
                    const int64_t *block_tables,
                    int64_t table_width, const int64_t *context_lens, float scale, float *out) {
    const int64_t group = H / Hkv, token_stride = Hkv * D;
    if (half && !PD_KV_HALF) return -1;
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = context_lens[i];
        if (len < 1 || len > table_width * block_size) return -1;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (block_tables[i * table_width + b] < 0 || block_tables[i * table_width + b] >= num_blocks) return -1;
        max_len = len > max_len ? len : max_len;
    }
    const int threads = omp_get_max_threads();
    const pd_split most = split_of(max_len, n * Hkv, threads);
    const int64_t items = n * Hkv * most.pieces, width = group * (D + 2); /* a piece's partial: m, l, o per head */
    float *partial = malloc(items * width * sizeof(float));
    if (partial == NULL) return -1;
#pragma omp parallel
    {
        /* a piece of any sequence spans at most max(most.per, PD_MIN_PIECE) positions */
        const int64_t span = most.per > PD_MIN_PIECE ? most.per : PD_MIN_PIECE;
        float *scores = malloc(group * span * sizeof(float)), *row = malloc(D * sizeof(float));
        int64_t *at = malloc(span * sizeof(int64_t));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < items; t++) {
            const int64_t i = t / (Hkv * most.pieces), g = t / most.pieces % Hkv, c = t % most.pieces;
            const pd_split sp = split_of(context_lens[i], n * Hkv, threads);
            float *m = partial + t * width, *l = m + group, *o = l + group;
            const int64_t s0 = c * sp.per, s1 = s0 + sp.per < context_lens[i] ? s0 + sp.per : context_lens[i];
            if (c >= sp.pieces || s0 >= s1) {
                for (int64_t j = 0; j < group; j++) m[j] = -INFINITY, l[j] = 0.0f;
                continue;
            }
            attend_piece(q + (i * H + g * group) * D, D, group, k_cache, v_cache, half, block_size, block_stride,
                         token_stride, g, block_tables + i * table_width, s0, s1, scale, scores, row, at, m, l, o);
        }
#pragma omp for schedule(static)
        for (int64_t ih = 0; ih < n * H; ih++) {
            const int64_t i = ih / H, h = ih % H, g = h / group, j = h % group;
            const float *first = partial + (i * Hkv + g) * most.pieces * width;
            float top = -INFINITY, total = 0.0f, *dst = out + ih * D;
            for (int64_t c = 0; c < most.pieces; c++) {
                const float mc = first[c * width + j];
                top = mc > top ? mc : top;
            }
            memset(dst, 0, D * sizeof(float));
            for (int64_t c = 0; c < most.pieces; c++) {
                const float *pm = first + c * width, *o = pm + 2 * group + j * D;
                if (pm[j] == -INFINITY) continue;
                const float w = expf(pm[j] - top);
                total += pm[group + j] * w;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) dst[d] += w * o[d];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] *= inv;
        }
        free(scores);
        free(row);
        free(at);
    }
    free(partial);
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
