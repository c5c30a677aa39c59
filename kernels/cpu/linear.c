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
 * many rows (above MANY_ROWS, on CPUs without AVX-512) each panel's codes are converted once into
 * a float scratch panel instead.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"                                 /* v8f, fma8, exp8; <immintrin.h> */

#define PANEL 16
#define QBLOCK 32                                     /* GGUF's block of k */
#define Q4_BLOCK_BYTES (2 * PANEL * 4 + QBLOCK * PANEL / 2)  /* d, m; then 32 k of 8 bytes */
#define Q8_BLOCK_BYTES (PANEL * 4 + QBLOCK * PANEL)           /* d; then 32 k of 16 bytes */
#define SCALES (PANEL * 4)      /* a block's d (or m) of its 16 columns, in bytes */
#define LEAD 32                 /* blocks ahead of use whose bytes are requested from memory */
#define GROUP 2                 /* panels together at one row: independent chains of sums */
/* I8: linear_i8.c; BF16: F32's panels with each weight's upper 16 bits (a bf16 checkpoint's
 * weights, whose float32 values they are exactly: the same sums from half the bytes) */
enum layout {
    F32 = 0, Q4_1 = 1, Q8_0 = 2, Q4_1_I8 = 3, Q8_0_I8 = 4, U8_I8 = 5, BF16 = 6,
    Q4_1_I8H = 7, Q8_0_I8H = 8, U8_I8H = 9,   /* the _I8 layouts with fp16 scales */
    U8S_I8 = 10,                               /* U8_I8 whose m = -32 d (Q6_K): d alone */
    Q4K_I8 = 11,                               /* Q4_K's super-blocks (linear_i8.c) */
};

/* A panel's 16 columns at one k (or a row's 16 sums) as two 8-float halves: the form of one row
 * against Q4_1 panels on every CPU (`row_group_q4`) and of everything on CPUs without AVX-512. */
typedef struct {
    v8f lo, hi;
} phalf;

static inline phalf half_fma(phalf a, phalf b, phalf c) {
    return (phalf){fma8(a.lo, b.lo, c.lo), fma8(a.hi, b.hi, c.hi)};
}

static inline phalf half_splat(float x) {
    return (phalf){splat8(x), splat8(x)};
}

static inline phalf half_load(const void *p) {
    return (phalf){*(const v8f *)p, *(const v8f *)((const float *)p + 8)};
}

static inline void half_store(float *out, phalf v) {
    *(v8f *)out = v.lo;
    *(v8f *)(out + 8) = v.hi;
}

/* 16 4-bit codes (8 bytes: columns c and c + 8 in the low and high nibble of byte c) */
static inline phalf half_q4(const uint8_t *p) {
    phalf q;
#if defined(__AVX2__)
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    q.lo = (v8f)_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)));
    q.hi = (v8f)_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
#else
    for (int l = 0; l < 8; l++) {
        q.lo[l] = (float)(p[l] & 0x0F);
        q.hi[l] = (float)(p[l] >> 4);
    }
#endif
    return q;
}

static inline phalf half_q8(const int8_t *p) {
    phalf q;
#if defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    q.lo = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    q.hi = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
#else
    for (int l = 0; l < 8; l++) {
        q.lo[l] = (float)p[l];
        q.hi[l] = (float)p[l + 8];
    }
#endif
    return q;
}

/* The row blocks' form of 16 columns: one 512-bit vector where the compiler targets AVX-512, else
 * the two halves. Each lane does the same fused multiply-adds in the same order in every form: the
 * builds agree bit for bit. ROWS rows share a register block (the sums of a block of k and the
 * rows' totals: 2 * ROWS vectors, of the 32 AVX-512 registers or the 16 AVX2 ones). */
#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef v16f prow;
#define ROWS 12
#define MANY_ROWS INT64_MAX      /* codes unpacked in registers were ahead up to 1,024 rows */

static inline prow prow_fma(prow a, prow b, prow c) {
    return (prow)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

static inline prow prow_splat(float x) {
    return (prow)_mm512_set1_ps(x);
}

static inline prow prow_load(const void *p) {
    return *(const prow *)p;
}

static inline void prow_store(float *out, prow v) {
    *(prow *)out = v;
}

static inline prow prow_q4(const uint8_t *p) {
    int64_t bytes;
    memcpy(&bytes, p, 8);                               /* the 8 bytes twice: lanes 0-7, 8-15 */
    const __m512i twice = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes));
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(twice, shift),
                                           _mm512_set1_epi32(0x0F));
    return (prow)_mm512_cvtepi32_ps(codes);
}

static inline prow prow_q8(const int8_t *p) {
    return (prow)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline prow prow_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (prow)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#else
typedef phalf prow;
#define ROWS 6
#define MANY_ROWS 192           /* above this many rows a panel's codes are unpacked once */

static inline prow prow_fma(prow a, prow b, prow c) { return half_fma(a, b, c); }
static inline prow prow_splat(float x) { return half_splat(x); }
static inline prow prow_load(const void *p) { return half_load(p); }
static inline void prow_store(float *out, prow v) { half_store(out, v); }
static inline prow prow_q4(const uint8_t *p) { return half_q4(p); }
static inline prow prow_q8(const int8_t *p) { return half_q8(p); }

static inline prow prow_bf16(const uint16_t *p) {
    phalf w;
    for (int l = 0; l < 8; l++) {              /* the compiler vectorises the shifts */
        uint32_t lo = (uint32_t)p[l] << 16, hi = (uint32_t)p[l + 8] << 16;
        memcpy(&w.lo[l], &lo, 4);
        memcpy(&w.hi[l], &hi, 4);
    }
    return w;
}
#endif

static inline void zero_rows(prow acc[ROWS]) {
    for (int64_t r = 0; r < ROWS; r++)
        acc[r] = prow_splat(0.0f);
}

/* column k of mr rows of x times the panel's 16 weights at k, added to each row's sums */
static inline void fma_rows(const float *x, int64_t K, int64_t k, int64_t mr, prow w,
                            prow acc[ROWS]) {
    for (int64_t r = 0; r < mr; r++)
        acc[r] = prow_fma(prow_splat(x[r * K + k]), w, acc[r]);
}

/* rows m0 .. m0 + mr - 1 (mr <= ROWS) against one panel */
static inline void panel_rows(const float *x, int64_t K, const float *panel, int64_t mr,
                              prow acc[ROWS]) {
    zero_rows(acc);
    for (int64_t k = 0; k < K; k++)
        fma_rows(x, K, k, mr, prow_load(panel + k * PANEL), acc);
}

/* panel_rows on a BF16 panel: the same fused multiply-adds on the same (widened) weights */
static inline void panel_rows_bf16(const float *x, int64_t K, const uint16_t *panel, int64_t mr,
                                   prow acc[ROWS]) {
    zero_rows(acc);
    for (int64_t k = 0; k < K; k++)
        fma_rows(x, K, k, mr, prow_bf16(panel + k * PANEL), acc);
}

/* a block of a quantized panel: its 16 columns' scales d (and minimums m, Q4_1), then codes */
struct block {
    prow d, m;
    const uint8_t *codes;
};

static inline struct block block_at(const uint8_t *panel, int layout, int64_t b) {
    struct block blk = {.codes = NULL};
    const uint8_t *p = panel + b * (layout == Q4_1 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES);
    blk.d = prow_load(p);
    if (layout == Q4_1)
        blk.m = prow_load(p + SCALES);
    blk.codes = p + (layout == Q4_1 ? 2 : 1) * SCALES;
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
static inline prow codes_at(const struct block *blk, int layout, int64_t j) {
    if (layout == Q4_1)
        return prow_q4(blk->codes + j * 8);
    return prow_q8((const int8_t *)(blk->codes + j * PANEL));
}

/* a block's code sums s (one row, 16 columns) into the row's sums: acc + d * s (+ m * sx, Q4_1,
 * sx the row's sum of x over the block), one fused multiply-add after the other */
static inline prow finish_block(const struct block *blk, int layout, float sx, prow s,
                                prow acc) {
    acc = prow_fma(blk->d, s, acc);
    if (layout == Q4_1)
        acc = prow_fma(blk->m, prow_splat(sx), acc);
    return acc;
}

/* rows against one quantized panel ([K / QBLOCK] blocks); its codes unpacked in registers or,
 * given `codes` ([K, PANEL] floats, `panel_codes`), read from there; xs: the rows' block sums */
static inline void panel_rows_quantized(const float *x, const float *xs, int64_t K,
                                        const uint8_t *panel, const float *codes, int layout,
                                        int64_t mr, prow acc[ROWS]) {
    const int64_t blocks = K / QBLOCK;
    zero_rows(acc);
    for (int64_t b = 0; b < blocks; b++) {
        prow s[ROWS];
        zero_rows(s);
        if (codes) {
            const float *c = codes + b * QBLOCK * PANEL;
            for (int64_t j = 0; j < QBLOCK; j++)
                fma_rows(x, K, b * QBLOCK + j, mr, prow_load(c + j * PANEL), s);
        } else {
            prefetch_block(panel, layout, b + LEAD);
            const struct block blk = block_at(panel, layout, b);
            for (int64_t j = 0; j < QBLOCK; j++)
                fma_rows(x, K, b * QBLOCK + j, mr, codes_at(&blk, layout, j), s);
        }
        const struct block blk = block_at(panel, layout, b);
        for (int64_t r = 0; r < mr; r++)
            acc[r] = finish_block(&blk, layout, xs[r * blocks + b], s[r], acc[r]);
    }
}

static inline void panel_rows_q4(const float *x, const float *xs, int64_t K, const uint8_t *panel,
                                 const float *codes, int64_t mr, prow acc[ROWS]) {
    panel_rows_quantized(x, xs, K, panel, codes, Q4_1, mr, acc);
}

static inline void panel_rows_q8(const float *x, const float *xs, int64_t K, const uint8_t *panel,
                                 const float *codes, int64_t mr, prow acc[ROWS]) {
    panel_rows_quantized(x, xs, K, panel, codes, Q8_0, mr, acc);
}

/* one row against GROUP quantized panels at once: independent chains of fused multiply-adds (one
 * panel's leave the FMA latency exposed at one row); each element's sum is the same sequence as
 * in panel_rows_quantized. out: the GROUP panels' 16 sums. */
static inline void row_group(const float *x, const float *xs, int64_t K,
                             const uint8_t *const panels[GROUP], int layout,
                             float out[GROUP][PANEL]) {
    prow acc[GROUP];
    for (int g = 0; g < GROUP; g++)
        acc[g] = prow_splat(0.0f);
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        struct block blk[GROUP];
        prow s[GROUP];
        for (int g = 0; g < GROUP; g++) {
            prefetch_block(panels[g], layout, b + LEAD);
            blk[g] = block_at(panels[g], layout, b);
            s[g] = prow_splat(0.0f);
        }
        for (int64_t j = 0; j < QBLOCK; j++) {
            const prow xb = prow_splat(x[b * QBLOCK + j]);
            for (int g = 0; g < GROUP; g++)
                s[g] = prow_fma(xb, codes_at(&blk[g], layout, j), s[g]);
        }
        for (int g = 0; g < GROUP; g++)
            acc[g] = finish_block(&blk[g], layout, xs[b], s[g], acc[g]);
    }
    for (int g = 0; g < GROUP; g++)
        prow_store(out[g], acc[g]);
}

/* row_group for Q4_1 panels in halves on every CPU: at one row the 4-bit codes' conversion bounds
 * the loop, and its 256-bit form issues on more ports than the 512-bit one (a Q8_0 code converts
 * in one instruction, and there the 512-bit form is faster). The same sums in the same order. */
static inline void row_group_q4(const float *x, const float *xs, int64_t K,
                                const uint8_t *const panels[GROUP], float out[GROUP][PANEL]) {
    phalf acc[GROUP];
    for (int g = 0; g < GROUP; g++)
        acc[g] = half_splat(0.0f);
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        phalf s[GROUP];
        for (int g = 0; g < GROUP; g++) {
            prefetch_block(panels[g], Q4_1, b + LEAD);
            s[g] = half_splat(0.0f);
        }
        for (int64_t j = 0; j < QBLOCK; j++) {
            const phalf xb = half_splat(x[b * QBLOCK + j]);
            for (int g = 0; g < GROUP; g++) {
                const uint8_t *codes = panels[g] + b * Q4_BLOCK_BYTES + 2 * SCALES + j * 8;
                s[g] = half_fma(xb, half_q4(codes), s[g]);
            }
        }
        for (int g = 0; g < GROUP; g++) {       /* acc + d * s + m * sx, as finish_block */
            const uint8_t *blk = panels[g] + b * Q4_BLOCK_BYTES;
            acc[g] = half_fma(half_load(blk), s[g], acc[g]);
            acc[g] = half_fma(half_load(blk + SCALES), half_splat(xs[b]), acc[g]);
        }
    }
    for (int g = 0; g < GROUP; g++)
        half_store(out[g], acc[g]);
}

/* a quantized panel's codes as floats in panel layout [K, PANEL] (exact) */
static void panel_codes(const uint8_t *panel, int layout, int64_t K, float *out) {
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const struct block blk = block_at(panel, layout, b);
        for (int64_t j = 0; j < QBLOCK; j++)
            prow_store(out + (b * QBLOCK + j) * PANEL, codes_at(&blk, layout, j));
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

/* 16 sums of row `row` into y's columns n0 .. (those there are), plus the bias */
static inline void store_row(const float out[PANEL], int64_t row, int64_t n0, int64_t N,
                             const float *bias, float *y) {
    if (!bias && N - n0 >= PANEL) {          /* a whole panel: a constant-size copy (vector moves,
                                              * not the library's copy of a variable length) */
        memcpy(y + row * N + n0, out, sizeof(float) * PANEL);
        return;
    }
    const int64_t width = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t c = 0; c < width; c++)
        y[row * N + n0 + c] = bias ? out[c] + bias[n0 + c] : out[c];
}

static inline void store_rows(const prow *acc, int64_t m0, int64_t mr, int64_t n0,
                              int64_t N, const float *bias, float *y) {
    for (int64_t r = 0; r < mr; r++) {
        float out[PANEL];
        prow_store(out, acc[r]);
        store_row(out, m0 + r, n0, N, bias, y);
    }
}

/* a constant row count per call: fully unrolled inner loops */
#define ROW_CASE(n, fn, ...) case n: fn(__VA_ARGS__, n, acc); break;
#if ROWS == 12
#define WIDE_CASES(fn, ...)                                                                   \
    ROW_CASE(12, fn, __VA_ARGS__) ROW_CASE(11, fn, __VA_ARGS__) ROW_CASE(10, fn, __VA_ARGS__)  \
    ROW_CASE(9, fn, __VA_ARGS__) ROW_CASE(8, fn, __VA_ARGS__) ROW_CASE(7, fn, __VA_ARGS__)
#else
#define WIDE_CASES(fn, ...)
#endif
#define ROW_CASES(fn, ...)                                                                    \
    switch (mr) {                                                                             \
    WIDE_CASES(fn, __VA_ARGS__)                                                               \
    ROW_CASE(6, fn, __VA_ARGS__) ROW_CASE(5, fn, __VA_ARGS__) ROW_CASE(4, fn, __VA_ARGS__)     \
    ROW_CASE(3, fn, __VA_ARGS__) ROW_CASE(2, fn, __VA_ARGS__)                                 \
    default: fn(__VA_ARGS__, 1, acc); break;                                                  \
    }

/* one panel (of `layout`) against every row of x; quantized: xs the rows' block sums, codes the
 * panel's codes as floats or NULL */
static inline void panel_block(const float *x, const float *xs, int64_t M, int64_t K,
                               const void *panel, const float *codes, int layout, int64_t n0,
                               int64_t N, const float *bias, float *y) {
    prow acc[ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t mr = M - m0 < ROWS ? M - m0 : ROWS;
        const float *xm = x + m0 * K, *xsm = xs + m0 * (K / QBLOCK);
        if (layout == F32) {
            ROW_CASES(panel_rows, xm, K, panel)
        } else if (layout == BF16) {
            ROW_CASES(panel_rows_bf16, xm, K, panel)
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

#include "linear_i8.c"

/* w [N, K] row-major -> packed [ceil(N / PANEL), K, PANEL] BF16: each weight's upper 16 bits
 * (exactly its value where the weight is a bf16's; padding columns zero) */
void linear_pack_bf16(const float *w, int64_t N, int64_t K, uint16_t *packed) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    memset(packed, 0, sizeof(uint16_t) * panels * K * PANEL);
    for (int64_t n = 0; n < N; n++) {
        uint16_t *dst = packed + (n / PANEL) * K * PANEL + n % PANEL;
        for (int64_t k = 0; k < K; k++) {
            uint32_t bits;
            memcpy(&bits, w + n * K + k, 4);
            dst[k * PANEL] = (uint16_t)(bits >> 16);
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

/* rows[0 .. n-1] of a weight packed in F32 or Q8_0 panels, each exactly the (dequantized)
 * weight's row, d * q for Q8_0 (one rounding, as gguf): out [n, K] (a tied embedding's lookup) */
void linear_rows(const void *packed, int layout, int64_t K, const int64_t *rows, int64_t n,
                 float *out) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = rows[i] / PANEL, c = rows[i] % PANEL;
        float *o = out + i * K;
        if (layout == Q8_0_I8 || layout == Q8_0_I8H) {
            linear_row_q8_i8(packed, layout, K, rows[i], o);
            continue;
        }
        if (layout == F32) {
            const float *panel = (const float *)packed + p * K * PANEL;
            for (int64_t k = 0; k < K; k++)
                o[k] = panel[k * PANEL + c];
            continue;
        }
        if (layout == BF16) {
            const uint16_t *panel = (const uint16_t *)packed + p * K * PANEL;
            for (int64_t k = 0; k < K; k++) {
                const uint32_t bits = (uint32_t)panel[k * PANEL + c] << 16;
                memcpy(o + k, &bits, 4);
            }
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
    if (i8_layout(layout)) {
        linear_pack_i8(layout, codes, d, m, N, K, packed);
        return;
    }
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
                memcpy(blk + SCALES + 4 * c, m + n * blocks + b, 4);
            uint8_t *out = blk + (layout == Q4_1 ? 2 : 1) * SCALES;
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
    if (i8_layout(layout))
        return linear_forward_i8(x, M, K, packed, layout, N, bias, y, num_threads);
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_bytes = layout == Q4_1   ? K / QBLOCK * Q4_BLOCK_BYTES
                                : layout == Q8_0 ? K / QBLOCK * Q8_BLOCK_BYTES
                                                 : K * PANEL * 4;
    const uint8_t *base = packed;
    if (layout == F32 || layout == BF16) {
        const int64_t bytes = K * PANEL * (layout == F32 ? 4 : 2);
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && panels > 1)
        for (int64_t p = 0; p < panels; p++)
            panel_block(x, NULL, M, K, base + p * bytes, NULL, layout, p * PANEL, N, bias, y);
        return 0;
    }
    float *xs = malloc(sizeof(float) * (size_t)(M * (K / QBLOCK) + 1));
    if (!xs)
        return -1;
    block_sums(x, M, K, xs);
    if (M == 1) {              /* a single decode: each thread's panels GROUP at a time */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
            const int64_t end = panels * (t + 1) / n;
            for (int64_t p = panels * t / n; p < end; p += GROUP) {
                const int64_t used = end - p < GROUP ? end - p : GROUP;
                const uint8_t *group[GROUP];
                float out[GROUP][PANEL];
                for (int64_t g = 0; g < GROUP; g++)   /* a short last group repeats its last */
                    group[g] = base + (p + (g < used ? g : used - 1)) * panel_bytes;
                if (layout == Q4_1)
                    row_group_q4(x, xs, K, group, out);
                else
                    row_group(x, xs, K, group, layout, out);
                for (int64_t g = 0; g < used; g++)
                    store_row(out[g], 0, (p + g) * PANEL, N, bias, y);
            }
        }
    } else if (M > MANY_ROWS) {        /* many row blocks: each panel's codes unpacked once */
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
