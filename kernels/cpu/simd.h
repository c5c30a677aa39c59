/* 8-float vectors (GCC's vector extension) and their fused multiply-add, shared by the kernels.
 * The kernels build with -std=c11, where a * b + c is never contracted into a fused multiply-add:
 * fma8 is the one place they ask for it (one rounding), on any CPU. */
#ifndef SPECSERVE_SIMD_H
#define SPECSERVE_SIMD_H

#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8f min8(v8f a, v8f b) {                  /* lanes of a < b: a, else b */
    const v8i less = a < b;
    return (v8f)(((v8i)a & less) | ((v8i)b & ~less));
}

/* e^x in 8 lanes by Cephes' expf: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by
 * a degree-6 polynomial, times 2^n through the exponent bits; within 2 ulp of the true value on
 * [-87.3, 88.3] (inputs are clamped there). Not torch's (Sleef's) nor glibc's: results differ
 * from theirs in the last bits; each lane depends on its own input alone. */
static inline v8f exp8(v8f x) {
    const v8f hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    const v8f lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    x = -min8(-min8(x, hi), -lo);
    const float round_magic = 12582912.0f;                 /* 1.5 * 2^23: rounds to an integer */
    const v8f n = (x * 1.44269504088896341f + round_magic) - round_magic;
    const v8f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v8f y = (p * (r * r) + r) + 1.0f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return y * (v8f)bits;
}


#if defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__FMA__)
static inline v8f fma8(v8f a, v8f b, v8f c) {
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline v8f fma8(v8f a, v8f b, v8f c) {
    v8f r;
    for (int l = 0; l < 8; l++)
        r[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return r;
}
#endif

static inline v8f splat8(float x) {
    return (v8f){x, x, x, x, x, x, x, x};
}

#endif
