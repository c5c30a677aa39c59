/* SwiGLU's activation in float32 for the CPU: out = silu(gate) * up, silu(g) = g / (1 + exp(-g))
 * rounded as torch writes it (the quotient, then the product), one call where eager torch makes
 * two (and allocates silu's result).
 *
 * exp is simd.h's exp8 (Cephes' expf in 8 lanes, within 2 ulp; inputs clamped to [-87.3, 88.3]:
 * silu needs no more). It is not torch's (Sleef's), so results differ from torch's in the last
 * bits; each element depends on its own inputs alone, so a row's result does not depend on the
 * other rows. */
#include <stdint.h>

#include "simd.h"

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
