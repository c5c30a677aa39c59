/* RMSNorm in float32 for the CPU, with the residual add before it fused in:
 *   sum = x + delta (when delta is given), norm = sum * (1 / sqrt(mean(sum^2) + eps)) * w
 * one row after another, the sum of squares in 8 fixed lanes and a fixed tree, so a row's result
 * does not depend on the other rows (transformers' formula, rounded once per step as it is;
 * torch's eager version is eight operator calls). */
#include <math.h>
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));

static void norm_row(const float *x, const float *delta, const float *w, float *sum, float *norm,
                     int64_t n, float eps) {
    const float *s = x;
    if (delta) {
        for (int64_t d = 0; d < n; d++)
            sum[d] = x[d] + delta[d];
        s = sum;
    }
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        const v8f v = *(const v8f *)(s + d);
        acc += v * v;
    }
    float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++)
        ss += s[d] * s[d];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (d = 0; d < n; d++)
        norm[d] = (s[d] * inv) * w[d];
}

/* x, delta (or NULL), sum (written when delta is given), norm: [rows, n] contiguous; w: [n] */
void rms_norm_rows(const float *x, const float *delta, const float *w, float *sum, float *norm,
                   int64_t rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows >= 64)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * n, delta ? delta + r * n : 0, w, sum ? sum + r * n : 0, norm + r * n, n,
                 eps);
}
