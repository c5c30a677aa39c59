/* Rotary position embedding in float32 for the CPU, transformers' rotate_half convention:
 *   out[i]        = x[i] * cos[i] - x[i + h] * sin[i]        (i < h = head_dim / 2)
 *   out[i + h]    = x[i + h] * cos[i] + x[i] * sin[i]
 * two products and a sum, each rounded (ISO C: no contraction into a fused multiply-add), so the
 * result is bitwise the reference's; torch's eager version is seven operator calls. */
#include <stdint.h>

/* x: [tokens, heads, dim] with row stride x_stride (heads contiguous); cos, sin: [tokens, dim]
 * (each half repeated); out: [tokens, heads, dim] contiguous */
void rope_rows(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
               int64_t tokens, int64_t heads, int64_t dim) {
    const int64_t h = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t j = 0; j < heads; j++) {
            const float *xi = x + t * x_stride + j * dim;
            float *o = out + (t * heads + j) * dim;
            for (int64_t i = 0; i < h; i++) {
                const float a = xi[i] * c[i], b = xi[i + h] * s[i];
                o[i] = a - b;
            }
            for (int64_t i = 0; i < h; i++) {
                const float a = xi[i + h] * c[i + h], b = xi[i] * s[i + h];
                o[i + h] = a + b;
            }
        }
    }
}
