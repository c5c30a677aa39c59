/* The gated MLP's activation in float32 for the CPU: out = act(gate) * up, one call where eager
 * torch makes two or more (and allocates act's result). Both the model's modules
 * (`kernels/cpu/activation.py`) and the one-call decoder (`decoder.c`) run it, so they agree bit
 * for bit.
 *   SwiGLU (ACT_SILU):        silu(g) = g / (1 + exp(-g)), rounded as torch writes it (the
 *                             quotient, then the product);
 *   GeGLU (ACT_GELU_TANH):    gelu's tanh approximation, 0.5 g (1 + tanh(z)) with
 *                             z = sqrt(2 / pi) (g + 0.044715 g^3), computed as its equal
 *                             g / (1 + exp(-2 z)) (as 0.5 (1 + tanh(z)) = sigmoid(2 z)): no
 *                             cancellation in 1 + tanh(z) where tanh(z) nears -1.
 *
 * exp is simd.h's exp8 (Cephes' expf in 8 lanes, within 2 ulp; inputs clamped to [-87.3, 88.3]:
 * neither activation needs more). It is not torch's (Sleef's), so results differ from torch's in
 * the last bits; each element depends on its own inputs alone, so a row's result does not depend
 * on the other rows. */
#include <stdint.h>

#include "simd.h"

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };      /* kernels/cpu/activation.py's ACTIVATIONS */

static inline v8f glu8(v8f g, v8f u, int64_t act) {
    if (act == ACT_GELU_TANH) {
        /* -2 sqrt(2 / pi) = -1.5957691216057308 */
        const v8f z2 = -1.5957691216057308f * (g + 0.044715f * (g * g * g));
        return g / (1.0f + exp8(z2)) * u;
    }
    return g / (1.0f + exp8(-g)) * u;
}

/* gate_up: [rows, 2 * n] with row stride `stride` floats, gate the first n columns and up the
 * next n; out: [rows, n] contiguous; act: ACT_SILU or ACT_GELU_TANH */
void glu_rows(const float *gate_up, int64_t stride, float *out, int64_t rows, int64_t n,
              int64_t act, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            *(v8f *)(o + i) = glu8(*(const v8f *)(g + i), *(const v8f *)(u + i), act);
        if (i < n) {                                      /* the tail, lanes padded with zeros */
            v8f gt = {0, 0, 0, 0, 0, 0, 0, 0}, ut = gt;
            for (int64_t j = i; j < n; j++)
                gt[j - i] = g[j], ut[j - i] = u[j];
            const v8f ot = glu8(gt, ut, act);
            for (int64_t j = i; j < n; j++)
                o[j] = ot[j - i];
        }
    }
}
