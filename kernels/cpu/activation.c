/* SwiGLU's activation in float32 for the CPU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
 * rounded as torch writes it (the quotient, then the product), one call where eager torch makes
 * two (and allocates silu's result).
 *
 * exp is computed here, in 8 lanes, by Cephes' expf: n = round(x / ln 2), r = x - n ln 2 (ln 2 in
 * two parts), e^r by a degree-6 polynomial, times 2^n through the exponent bits; within 2 ulp of
 * the true value on [-87.3, 88.3] (inputs are clamped there: silu needs no more). It is not
 * torch's (Sleef's), so results differ from torch's in the last bits; each element depends on its
 * own inputs alone, so a row's result does not depend on the other rows. */
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline v8f min8(v8f a, v8f b) {                  /* lanes of a < b: a, else b */
    const v8i less = a < b;
    return (v8f)(((v8i)a & less) | ((v8i)b & ~less));
}

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

static inline v8f silu_mul8(v8f g, v8f u) {
    return g / (1.0f + exp8(-g)) * u;
}

/* gate_up: [rows, 2 * n] with row stride `stride` floats, gate the first n columns and up the
 * next n; out: [rows, n] contiguous */
void silu_mul_rows(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t n,
                   int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            *(v8f *)(o + i) = silu_mul8(*(const v8f *)(g + i), *(const v8f *)(u + i));
        if (i < n) {                                      /* the tail, lanes padded with zeros */
            v8f gt = {0, 0, 0, 0, 0, 0, 0, 0}, ut = gt;
            for (int64_t j = i; j < n; j++)
                gt[j - i] = g[j], ut[j - i] = u[j];
            const v8f ot = silu_mul8(gt, ut);
            for (int64_t j = i; j < n; j++)
                o[j] = ot[j - i];
        }
    }
}
