/* y = x W^T (+ b) in float32 for the CPU, on a weight packed once into column panels.
 *
 * Packed layout: W [N, K] becomes panels of PANEL output columns, each [K, PANEL] (k-major; the
 * last panel zero-padded), so a panel streams through once per call while up to ROWS rows of x
 * at a time accumulate into registers.
 *
 * Row invariance, by construction: every output element is the sum over k = 0, 1, ..., K-1 of
 * x[m, k] * W[n, k], one fused multiply-add after another in one vector lane, whatever M is and
 * whichever rows share a register block. A verify row therefore gets bit for bit the logits and
 * activations the decode it replaces would (oneDNN's and MKL's rows depend on the row count).
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define ROWS 6

typedef float v8f __attribute__((vector_size(32), aligned(4)));

#if defined(__FMA__)
#include <immintrin.h>
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

/* rows m0 .. m0 + mr - 1 (mr <= ROWS) against one panel */
static inline void panel_rows(const float *x, int64_t K, const float *panel, int64_t mr,
                              v8f acc[ROWS][2]) {
    for (int64_t r = 0; r < ROWS; r++)
        acc[r][0] = acc[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = 0; k < K; k++) {
        const v8f w0 = *(const v8f *)(panel + k * PANEL);
        const v8f w1 = *(const v8f *)(panel + k * PANEL + 8);
        for (int64_t r = 0; r < mr; r++) {
            const float xv = x[r * K + k];
            const v8f xb = {xv, xv, xv, xv, xv, xv, xv, xv};
            acc[r][0] = fma8(xb, w0, acc[r][0]);
            acc[r][1] = fma8(xb, w1, acc[r][1]);
        }
    }
}

static inline void panel_block(const float *x, int64_t M, int64_t K, const float *panel,
                               int64_t n0, int64_t N, const float *bias, float *y) {
    const int64_t width = N - n0 < PANEL ? N - n0 : PANEL;
    v8f acc[ROWS][2];
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t mr = M - m0 < ROWS ? M - m0 : ROWS;
        switch (mr) {            /* a constant row count per call: fully unrolled inner loops */
        case 6: panel_rows(x + m0 * K, K, panel, 6, acc); break;
        case 5: panel_rows(x + m0 * K, K, panel, 5, acc); break;
        case 4: panel_rows(x + m0 * K, K, panel, 4, acc); break;
        case 3: panel_rows(x + m0 * K, K, panel, 3, acc); break;
        case 2: panel_rows(x + m0 * K, K, panel, 2, acc); break;
        default: panel_rows(x + m0 * K, K, panel, 1, acc); break;
        }
        for (int64_t r = 0; r < mr; r++) {
            float out[PANEL];
            memcpy(out, &acc[r][0], sizeof(float) * 8);
            memcpy(out + 8, &acc[r][1], sizeof(float) * 8);
            float *row = y + (m0 + r) * N + n0;
            for (int64_t c = 0; c < width; c++)
                row[c] = bias ? out[c] + bias[n0 + c] : out[c];
        }
    }
}

/* w [N, K] row-major -> packed [ceil(N / PANEL), K, PANEL] (padding columns zero) */
void linear_pack(const float *w, int64_t N, int64_t K, float *packed) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    memset(packed, 0, sizeof(float) * panels * K * PANEL);
    for (int64_t n = 0; n < N; n++) {
        float *dst = packed + (n / PANEL) * K * PANEL + n % PANEL;
        for (int64_t k = 0; k < K; k++)
            dst[k * PANEL] = w[n * K + k];
    }
}

/* x [M, K] contiguous, packed from linear_pack,
 * bias [N] or NULL, y [M, N] contiguous. Panels are split among the threads. */
void linear_forward(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                    const float *bias, float *y, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; p++)
        panel_block(x, M, K, packed + p * K * PANEL, p * PANEL, N, bias, y);
}
