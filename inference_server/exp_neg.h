/* e^x for x <= 0 (a softmax's terms after its max is taken away, SiLU's e^-|x|), shared by the CPU
 * kernels (paged_attention.c, prefill_attention.c, fused_ops.c): x = n ln2 + f ln2, e^x = 2^n * 2^f,
 * 2^f a degree-6 polynomial on [0, 1) (relative error ~2e-7); x below -87 is taken as -87 (e^-87 is
 * ~1.6e-38, still a normal float). exp_neg16 does 16 lanes, 2^n applied by scalef. */
#ifndef RIPTIDE_EXP_NEG_H
#define RIPTIDE_EXP_NEG_H
#include <math.h>
#include <stdint.h>

#define EXP_NEG_C6 1.535336188319500e-4f
#define EXP_NEG_C5 1.339887440266574e-3f
#define EXP_NEG_C4 9.618437357674640e-3f
#define EXP_NEG_C3 5.550332471162809e-2f
#define EXP_NEG_C2 2.402264791363012e-1f
#define EXP_NEG_C1 6.931472028550421e-1f

static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.44269504088896341f, n = floorf(t), f = t - n;
    float p = EXP_NEG_C6;
    p = p * f + EXP_NEG_C5;
    p = p * f + EXP_NEG_C4;
    p = p * f + EXP_NEG_C3;
    p = p * f + EXP_NEG_C2;
    p = p * f + EXP_NEG_C1;
    p = p * f + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, k);
    __m512 p = _mm512_set1_ps(EXP_NEG_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_NEG_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_NEG_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_NEG_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_NEG_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_NEG_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
#endif
#endif
