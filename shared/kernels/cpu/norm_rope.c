/* The decoder's small float32 ops for CPU decode: RMSNorm and the rotary embedding, one call each where
 * torch runs five to eight ops (tens of microseconds a layer at one token). */
#include <math.h>
#include <stdint.h>

/* out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps) for x, out [T, H] contiguous; the mean accumulates
 * in double. */
void pd_rms_norm(const float *x, const float *weight, int64_t T, int64_t H, float eps, float *out) {
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const float *row = x + t * H;
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t h = 0; h < H; h++) sum += (double)row[h] * row[h];
        const float inv = 1.0f / sqrtf((float)(sum / H) + eps);
        float *o = out + t * H;
#pragma omp simd
        for (int64_t h = 0; h < H; h++) o[h] = weight[h] * (row[h] * inv);
    }
}

/* HF's non-interleaved rotation, dst[t, h] = src[t, h] * cos[p] + rotate_half(src[t, h]) * sin[p] with
 * p = positions[t], for heads of D floats: src rows `src_stride` floats apart (a view into the fused qkv
 * output), dst [T, heads, D] contiguous; cos, sin [max_positions, D]. Products rounded before the sum, as
 * torch computes them, so the result is bit-identical. Returns -1 (nothing written) for a position outside
 * the table. */
__attribute__((optimize("fp-contract=off"))) int pd_rotary(const float *src, int64_t T, int64_t heads,
                                                           int64_t src_stride, int64_t D, const int64_t *positions,
                                                           const float *cos, const float *sin,
                                                           int64_t max_positions, float *dst) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = src + t * src_stride + h * D;
            float *y = dst + (t * heads + h) * D;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = x[d] * c[d], b = -x[d + half] * s[d];
                y[d] = a + b;
            }
#pragma omp simd
            for (int64_t d = half; d < D; d++) {
                const float a = x[d] * c[d], b = x[d - half] * s[d];
                y[d] = a + b;
            }
        }
    }
    return 0;
}
