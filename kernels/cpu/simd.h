/* 8-float vectors (GCC's vector extension) and their fused multiply-add, shared by the kernels.
 * The kernels build with -std=c11, where a * b + c is never contracted into a fused multiply-add:
 * fma8 is the one place they ask for it (one rounding), on any CPU. */
#ifndef SPECSERVE_SIMD_H
#define SPECSERVE_SIMD_H

#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* e^x by Cephes' expf: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by a
 * degree-6 polynomial, times 2^n through the exponent bits; within 2 ulp of the true value on
 * [-87.3, 88.3] (inputs are clamped there). Not torch's (Sleef's) nor glibc's: results differ
 * from theirs in the last bits; each lane depends on its own input alone. DEFINE_EXP defines
 * `static inline V name(V x)` on the float vector type V (I: the int32 vector type of as many
 * lanes): the same operations on each lane whatever the vector's width. exp8: 8 lanes. */
#define DEFINE_EXP(name, V, I)                                                                  \
    static inline V name(V x) {                                                                 \
        const V hi = (V){0} + 88.3f, lo = (V){0} - 87.3f;                                       \
        I less = x < hi;                                                                        \
        x = (V)(((I)x & less) | ((I)hi & ~less));                       /* min(x, hi) */       \
        const V neg = -x, neg_lo = -lo;                                                         \
        less = neg < neg_lo;                                                                    \
        x = -(V)(((I)neg & less) | ((I)neg_lo & ~less));                /* -min(-x, -lo) */    \
        const float round_magic = 12582912.0f;         /* 1.5 * 2^23: rounds to an integer */  \
        const V n = (x * 1.44269504088896341f + round_magic) - round_magic;                     \
        const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;                               \
        V p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                          \
        p = p * r + 8.3334519073e-3f;                                                           \
        p = p * r + 4.1665795894e-2f;                                                           \
        p = p * r + 1.6666665459e-1f;                                                           \
        p = p * r + 5.0000001201e-1f;                                                           \
        const V y = (p * (r * r) + r) + 1.0f;                                                   \
        const I bits = (__builtin_convertvector(n, I) + 127) << 23;                             \
        return y * (V)bits;                                                                     \
    }

DEFINE_EXP(exp8, v8f, v8i)


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
