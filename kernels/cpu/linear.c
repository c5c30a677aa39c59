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
 *
 * GGUF Q4_1 weights (w = d * q + m per block of 32 along k; q in 0..15; d, m per block) stay
 * quantized: the same panels hold, per block of 32 k, d and m of the panel's 16 columns (float32)
 * and the codes (one byte per k holding columns c and c + 8 in its low and high nibble). The
 * kernel factors the scales out of each block, as llama.cpp does: s = sum of x[k] * q[k] over the
 * block's 32 k (fused multiply-adds on the codes converted to floats, exact), then acc + d * s +
 * m * sx, sx the row's sum of x over the block (in k order). That leaves a code conversion and a
 * multiply-add per weight (gguf's own dequantizing, (d * q) + m rounded twice, costs two more
 * operations: the one-row kernel is bound by this arithmetic, not by bytes). The result is the
 * dequantized weight's within float32 rounding (a different order of the same sums, like any
 * GEMM's), and still the same for a row whatever M is. GGUF Q8_0 (w = d * q, q an int8; a typical
 * embedding and LM head) likewise, acc + d * s: d of the 16 columns, then 16 codes per k. With
 * many rows (more than 32 register blocks) each panel's codes are converted once into a float
 * scratch panel instead.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16
#define ROWS 6
#define QBLOCK 32                                     /* GGUF's block of k */
#define Q4_BLOCK_BYTES (2 * PANEL * 4 + QBLOCK * PANEL / 2)  /* d, m; then 32 k of 8 bytes */
#define Q8_BLOCK_BYTES (PANEL * 4 + QBLOCK * PANEL)           /* d; then 32 k of 16 bytes */
#define LEAD 32                 /* blocks ahead of use whose bytes are requested from memory */
enum layout { F32 = 0, Q4_1 = 1, Q8_0 = 2 };

#include "simd.h"                                 /* v8f, fma8, exp8; <immintrin.h> */

static inline void zero_rows(v8f acc[ROWS][2]) {
    for (int64_t r = 0; r < ROWS; r++)
        acc[r][0] = acc[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
}

/* column k of mr rows of x times the panel's 16 weights at k, added to each row's sums */
static inline void fma_rows(const float *x, int64_t K, int64_t k, int64_t mr, v8f w0, v8f w1,
                            v8f acc[ROWS][2]) {
    for (int64_t r = 0; r < mr; r++) {
        const float xv = x[r * K + k];
        const v8f xb = {xv, xv, xv, xv, xv, xv, xv, xv};
        acc[r][0] = fma8(xb, w0, acc[r][0]);
        acc[r][1] = fma8(xb, w1, acc[r][1]);
    }
}

/* rows m0 .. m0 + mr - 1 (mr <= ROWS) against one panel */
static inline void panel_rows(const float *x, int64_t K, const float *panel, int64_t mr,
                              v8f acc[ROWS][2]) {
    zero_rows(acc);
    for (int64_t k = 0; k < K; k++)
        fma_rows(x, K, k, mr, *(const v8f *)(panel + k * PANEL),
                 *(const v8f *)(panel + k * PANEL + 8), acc);
}

/* 16 4-bit codes (8 bytes: columns c and c + 8 in the low and high nibble of byte c) */
static inline void unpack16(const uint8_t *p, v8f *q0, v8f *q1) {
#if defined(__AVX2__)
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *q0 = (v8f)_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)));
    *q1 = (v8f)_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
#else
    for (int l = 0; l < 8; l++) {
        (*q0)[l] = (float)(p[l] & 0x0F);
        (*q1)[l] = (float)(p[l] >> 4);
    }
#endif
}

static inline void unpack16_i8(const int8_t *p, v8f *q0, v8f *q1) {
#if defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    *q0 = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    *q1 = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
#else
    for (int l = 0; l < 8; l++) {
        (*q0)[l] = (float)p[l];
        (*q1)[l] = (float)p[l + 8];
    }
#endif
}

/* a block of a quantized panel: its 16 columns' scales d (and minimums m, Q4_1), then codes */
struct block {
    v8f d0, d1, m0, m1;
    const uint8_t *codes;
    int layout;
};

static inline struct block block_at(const uint8_t *panel, int layout, int64_t b) {
    struct block blk = {.layout = layout};
    const uint8_t *p = panel + b * (layout == Q4_1 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES);
    memcpy(&blk.d0, p, 32);
    memcpy(&blk.d1, p + 32, 32);
    if (layout == Q4_1) {
        memcpy(&blk.m0, p + 64, 32);
        memcpy(&blk.m1, p + 96, 32);
    }
    blk.codes = p + (layout == Q4_1 ? 128 : 64);
    return blk;
}

/* block b of a quantized panel requested from memory ahead of use (the hardware's prefetcher
 * alone left a one-row product at about half the machine's read bandwidth); b may run past the
 * panel: a prefetch never faults */
static inline void prefetch_block(const uint8_t *panel, int layout, int64_t b) {
    const int64_t bytes = layout == Q4_1 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    for (int64_t line = 0; line < bytes; line += 64)
        __builtin_prefetch(panel + b * bytes + line, 0, 1);
}

/* the 16 codes at k = j of a block, as floats (exact) */
static inline void codes_at(const struct block *blk, int64_t j, v8f *q0, v8f *q1) {
    if (blk->layout == Q4_1)
        unpack16(blk->codes + j * 8, q0, q1);
    else
        unpack16_i8((const int8_t *)(blk->codes + j * PANEL), q0, q1);
}

/* a block's code sums s (one row, 16 columns) into the row's sums: acc + d * s (+ m * sx, Q4_1,
 * sx the row's sum of x over the block), one fused multiply-add after the other */
static inline void finish_block(const struct block *blk, float sx, const v8f s[2], v8f acc[2]) {
    acc[0] = fma8(blk->d0, s[0], acc[0]);
    acc[1] = fma8(blk->d1, s[1], acc[1]);
    if (blk->layout == Q4_1) {
        const v8f sb = {sx, sx, sx, sx, sx, sx, sx, sx};
        acc[0] = fma8(blk->m0, sb, acc[0]);
        acc[1] = fma8(blk->m1, sb, acc[1]);
    }
}

/* rows against one quantized panel ([K / QBLOCK] blocks); its codes unpacked in registers or,
 * given `codes` ([K, PANEL] floats, `panel_codes`), read from there; xs: the rows' block sums */
static inline void panel_rows_quantized(const float *x, const float *xs, int64_t K,
                                        const uint8_t *panel, const float *codes, int layout,
                                        int64_t mr, v8f acc[ROWS][2]) {
    const int64_t blocks = K / QBLOCK;
    zero_rows(acc);
    for (int64_t b = 0; b < blocks; b++) {
        v8f s[ROWS][2];
        zero_rows(s);
        if (codes) {
            const float *c = codes + b * QBLOCK * PANEL;
            for (int64_t j = 0; j < QBLOCK; j++)
                fma_rows(x, K, b * QBLOCK + j, mr, *(const v8f *)(c + j * PANEL),
                         *(const v8f *)(c + j * PANEL + 8), s);
        } else {
            prefetch_block(panel, layout, b + LEAD);
            const struct block blk = block_at(panel, layout, b);
            for (int64_t j = 0; j < QBLOCK; j++) {
                v8f q0, q1;
                codes_at(&blk, j, &q0, &q1);
                fma_rows(x, K, b * QBLOCK + j, mr, q0, q1, s);
            }
        }
        const struct block blk = block_at(panel, layout, b);
        for (int64_t r = 0; r < mr; r++)
            finish_block(&blk, xs[r * blocks + b], s[r], acc[r]);
    }
}

static inline void panel_rows_q4(const float *x, const float *xs, int64_t K, const uint8_t *panel,
                                 const float *codes, int64_t mr, v8f acc[ROWS][2]) {
    panel_rows_quantized(x, xs, K, panel, codes, Q4_1, mr, acc);
}

static inline void panel_rows_q8(const float *x, const float *xs, int64_t K, const uint8_t *panel,
                                 const float *codes, int64_t mr, v8f acc[ROWS][2]) {
    panel_rows_quantized(x, xs, K, panel, codes, Q8_0, mr, acc);
}

/* one row against two quantized panels at once: four independent chains of fused multiply-adds
 * (one panel's two leave the FMA latency exposed at one row); each element's sum is the same
 * sequence as in panel_rows_quantized */
static inline void row_pair(const float *x, const float *xs, int64_t K, const uint8_t *pa,
                            const uint8_t *pb, int layout, v8f acc[4]) {
    acc[0] = acc[1] = acc[2] = acc[3] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        prefetch_block(pa, layout, b + LEAD);
        prefetch_block(pb, layout, b + LEAD);
        const struct block ba = block_at(pa, layout, b), bb = block_at(pb, layout, b);
        v8f sa[2] = {{0}}, sb[2] = {{0}};
        for (int64_t j = 0; j < QBLOCK; j++) {
            v8f qa0, qa1, qb0, qb1;
            codes_at(&ba, j, &qa0, &qa1);
            codes_at(&bb, j, &qb0, &qb1);
            const float xv = x[b * QBLOCK + j];
            const v8f xb = {xv, xv, xv, xv, xv, xv, xv, xv};
            sa[0] = fma8(xb, qa0, sa[0]);
            sa[1] = fma8(xb, qa1, sa[1]);
            sb[0] = fma8(xb, qb0, sb[0]);
            sb[1] = fma8(xb, qb1, sb[1]);
        }
        finish_block(&ba, xs[b], sa, acc);
        finish_block(&bb, xs[b], sb, acc + 2);
    }
}

/* a quantized panel's codes as floats in panel layout [K, PANEL] (exact) */
static void panel_codes(const uint8_t *panel, int layout, int64_t K, float *out) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const struct block blk = block_at(panel, layout, b);
        for (int64_t j = 0; j < QBLOCK; j++) {
            v8f q0, q1;
            codes_at(&blk, j, &q0, &q1);
            memcpy(out + (b * QBLOCK + j) * PANEL, &q0, 32);
            memcpy(out + (b * QBLOCK + j) * PANEL + 8, &q1, 32);
        }
    }
}

/* each row's sum of x over each block of QBLOCK k, in k order: xs [M, K / QBLOCK] */
static void block_sums(const float *x, int64_t M, int64_t K, float *xs) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < QBLOCK; j++)
                sum += x[r * K + b * QBLOCK + j];
            xs[r * (K / QBLOCK) + b] = sum;
        }
}

static inline void store_rows(v8f acc[ROWS][2], int64_t m0, int64_t mr, int64_t n0, int64_t N,
                              const float *bias, float *y) {
    const int64_t width = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t r = 0; r < mr; r++) {
        float out[PANEL];
        memcpy(out, &acc[r][0], sizeof(float) * 8);
        memcpy(out + 8, &acc[r][1], sizeof(float) * 8);
        float *row = y + (m0 + r) * N + n0;
        for (int64_t c = 0; c < width; c++)
            row[c] = bias ? out[c] + bias[n0 + c] : out[c];
    }
}

#define ROW_CASES(fn, ...)                                                                \
    switch (mr) {        /* a constant row count per call: fully unrolled inner loops */     \
    case 6: fn(__VA_ARGS__, 6, acc); break;                                                   \
    case 5: fn(__VA_ARGS__, 5, acc); break;                                                   \
    case 4: fn(__VA_ARGS__, 4, acc); break;                                                   \
    case 3: fn(__VA_ARGS__, 3, acc); break;                                                   \
    case 2: fn(__VA_ARGS__, 2, acc); break;                                                   \
    default: fn(__VA_ARGS__, 1, acc); break;                                                  \
    }

/* one panel (of `layout`) against every row of x; quantized: xs the rows' block sums, codes the
 * panel's codes as floats or NULL */
static inline void panel_block(const float *x, const float *xs, int64_t M, int64_t K,
                               const void *panel, const float *codes, int layout, int64_t n0,
                               int64_t N, const float *bias, float *y) {
    v8f acc[ROWS][2];
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t mr = M - m0 < ROWS ? M - m0 : ROWS;
        const float *xm = x + m0 * K, *xsm = xs + m0 * (K / QBLOCK);
        if (layout == F32) {
            ROW_CASES(panel_rows, xm, K, panel)
        } else if (codes) {           /* codes from the float copy, or (NULL) from the panel */
            if (layout == Q4_1) {
                ROW_CASES(panel_rows_q4, xm, xsm, K, panel, codes)
            } else {
                ROW_CASES(panel_rows_q8, xm, xsm, K, panel, codes)
            }
        } else if (layout == Q4_1) {
            ROW_CASES(panel_rows_q4, xm, xsm, K, panel, NULL)
        } else {
            ROW_CASES(panel_rows_q8, xm, xsm, K, panel, NULL)
        }
        store_rows(acc, m0, mr, n0, N, bias, y);
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

/* rows[0 .. n-1] of a weight packed in F32 or Q8_0 panels, each exactly the (dequantized)
 * weight's row, d * q for Q8_0 (one rounding, as gguf): out [n, K] (a tied embedding's lookup) */
void linear_rows(const void *packed, int layout, int64_t K, const int64_t *rows, int64_t n,
                 float *out) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = rows[i] / PANEL, c = rows[i] % PANEL;
        float *o = out + i * K;
        if (layout == F32) {
            const float *panel = (const float *)packed + p * K * PANEL;
            for (int64_t k = 0; k < K; k++)
                o[k] = panel[k * PANEL + c];
            continue;
        }
        const uint8_t *panel = (const uint8_t *)packed + p * (K / QBLOCK) * Q8_BLOCK_BYTES;
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            const uint8_t *blk = panel + b * Q8_BLOCK_BYTES;
            float d;
            memcpy(&d, blk + 4 * c, 4);
            const int8_t *codes = (const int8_t *)(blk + PANEL * 4);
            for (int64_t j = 0; j < QBLOCK; j++)
                o[b * QBLOCK + j] = d * (float)codes[j * PANEL + c];
        }
    }
}

/* codes [N, K] (Q4_1: 0..15; Q8_0: int8), d and (Q4_1) m [N, K / QBLOCK] -> packed
 * [ceil(N / PANEL), K / QBLOCK, block bytes]: per block d[0..15] (then m[0..15]), then the codes
 * (padding columns: d = m = 0, code 0) */
void linear_pack_quantized(int layout, const uint8_t *codes, const float *d, const float *m,
                           int64_t N, int64_t K, uint8_t *packed) {
    const int64_t panels = (N + PANEL - 1) / PANEL, blocks = K / QBLOCK;
    const int64_t bytes = layout == Q4_1 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
    memset(packed, 0, (size_t)(panels * blocks * bytes));
    for (int64_t n = 0; n < N; n++) {
        const int64_t c = n % PANEL;
        uint8_t *dst = packed + (n / PANEL) * blocks * bytes;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = dst + b * bytes;
            memcpy(blk + 4 * c, d + n * blocks + b, 4);
            if (layout == Q4_1)
                memcpy(blk + 64 + 4 * c, m + n * blocks + b, 4);
            uint8_t *out = blk + (layout == Q4_1 ? 128 : 64);
            for (int64_t j = 0; j < QBLOCK; j++) {
                const uint8_t q = codes[n * K + b * QBLOCK + j];
                if (layout == Q4_1)
                    out[j * 8 + c % 8] |= (uint8_t)(c < 8 ? q & 0x0F : (q & 0x0F) << 4);
                else
                    out[j * PANEL + c] = q;
            }
        }
    }
}

/* x [M, K] contiguous; packed from linear_pack (layout F32) or linear_pack_quantized (Q4_1,
 * Q8_0); bias [N] or NULL; y [M, N] contiguous. Panels are split among the threads. Returns 0,
 * or -1 where memory for the rows' block sums could not be had (y untouched). */
int linear_forward(const float *x, int64_t M, int64_t K, const void *packed, int layout,
                   int64_t N, const float *bias, float *y, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_bytes = layout == Q4_1   ? K / QBLOCK * Q4_BLOCK_BYTES
                                : layout == Q8_0 ? K / QBLOCK * Q8_BLOCK_BYTES
                                                 : K * PANEL * 4;
    const uint8_t *base = packed;
    if (layout == F32) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && panels > 1)
        for (int64_t p = 0; p < panels; p++)
            panel_block(x, NULL, M, K, base + p * panel_bytes, NULL, F32, p * PANEL, N, bias, y);
        return 0;
    }
    float *xs = malloc(sizeof(float) * (size_t)(M * (K / QBLOCK) + 1));
    if (!xs)
        return -1;
    block_sums(x, M, K, xs);
    if (M == 1) {                                   /* a single decode: panels two at a time */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
        for (int64_t pp = 0; pp < (panels + 1) / 2; pp++) {
            const int64_t p = 2 * pp;
            if (p + 1 == panels) {
                panel_block(x, xs, 1, K, base + p * panel_bytes, NULL, layout, p * PANEL, N,
                            bias, y);
                continue;
            }
            v8f acc[4], pair[ROWS][2];
            row_pair(x, xs, K, base + p * panel_bytes, base + (p + 1) * panel_bytes, layout,
                     acc);
            pair[0][0] = acc[0], pair[0][1] = acc[1];
            store_rows(pair, 0, 1, p * PANEL, N, bias, y);
            pair[0][0] = acc[2], pair[0][1] = acc[3];
            store_rows(pair, 0, 1, (p + 1) * PANEL, N, bias, y);
        }
    } else if (M > 32 * ROWS) {        /* many row blocks: each panel's codes unpacked once */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && panels > 1)
        {
            float *codes = malloc(sizeof(float) * K * PANEL);     /* NULL: unpack in registers */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                if (codes)
                    panel_codes(base + p * panel_bytes, layout, K, codes);
                panel_block(x, xs, M, K, base + p * panel_bytes, codes, layout, p * PANEL, N,
                            bias, y);
            }
            free(codes);
        }
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && panels > 1)
        for (int64_t p = 0; p < panels; p++)
            panel_block(x, xs, M, K, base + p * panel_bytes, NULL, layout, p * PANEL, N, bias,
                        y);
    }
    free(xs);
    return 0;
}
