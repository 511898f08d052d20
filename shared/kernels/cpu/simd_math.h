/* Vector math shared by the AVX-512 kernels (included by paged_decode.c and decode_layers.c). */
#ifndef PD_SIMD_MATH_H
#define PD_SIMD_MATH_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x in 16 lanes (softmax scores less their max, SiLU's -x): x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two
 * parts), e^r by its Taylor polynomial to r^7 (truncation under 2^-27), times 2^n (scalef; 0 past e^-104,
 * below float32's least subnormal; inf past e^89, as expf). About 1 ulp from libm's expf; libm's scalar calls cost a b1 decode step
 * of the default model ~0.17 ms of its ~0.75 ms of attention, and ~0.1 ms in its SiLU. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    static const float taylor[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
