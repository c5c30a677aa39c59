/* Linear layers on int8 dot products: GGUF Q4_1 and Q8_0 weights against activations quantized
 * per row in blocks of 32 along k (as llama.cpp's quantized dot products do). Included by
 * linear.c, whose `linear_forward` hands these layouts here.
 *
 * Activations: each row's block of 32 x becomes 32 int8 codes a = round(x * 127 / amax) and a
 * scale e = amax / 127 (amax the block's largest |x|), with t = sum of the codes. Per block and
 * column the kernel sums codes times codes in int32, exactly, then (float) each block's share:
 *   Q4_1 (w = d * q + m, q in 0..15):  acc + d * (e * sum(q * a)) + m * (e * t)
 *   Q8_0 (w = d * q, q an int8):       acc + d * (e * (sum(u * a) - 128 * t)),  u = q + 128
 *   U8 (w = d_h * u + m_h, u in 0..63; d, m per half block of 16 k, h = 0, 1):
 *       acc + d_0 * (e * sum_0(u * a)) + m_0 * (e * t_0)
 *           + d_1 * (e * sum_1(u * a)) + m_1 * (e * t_1)
 * one fused multiply-add after another, block after block. Every GGUF type maps onto one of
 * them (kernels/cpu/linear.py): Q4_0 and Q4_K (in its own super-blocks) onto Q4_1; Q5_0 onto
 * Q8_0 (its codes less 16); Q5_1, Q5_K and Q6_K onto U8.
 * Integer sums are exact in any order, so the result of a row depends on its own x alone: not
 * on how many rows share the call, which rows they are, nor on how the sums are split among
 * registers. Every form (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, or plain C) gives the same
 * bits.
 *
 * Packed layouts, per panel of 16 columns and block of 32 k (the scales as float32):
 *   Q4_1_I8 (384 bytes): d[16], m[16], then 4 chunks of 64 bytes; chunk c's byte 4 * col + i
 *     holds q(col, 8c + i) in its low nibble and q(col, 8c + 4 + i) in its high one;
 *   Q8_0_I8 (576 bytes): d[16], then 8 groups of 64 bytes; group g's byte 4 * col + i holds
 *     u(col, 4g + i);
 *   U8_I8 (768 bytes): d_0[16], d_1[16], m_0[16], m_1[16], then the codes as Q8_0_I8's.
 * Q4_1_I8H (320 bytes), Q8_0_I8H (544) and U8_I8H (640) are those layouts with the scales as
 * fp16: where every scale is a half's (GGUF Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store them so; a
 * K-quant's scale is a product of two), the weight in the bytes the file has (Q4_0, Q4_1, Q8_0),
 * or fewer than with float32 scales (Q5_0, Q5_1); widened in registers, exactly, so they give
 * the float32 forms' bits. A decode step streams its weights from memory: for the embedded
 * model 13% fewer bytes than with float32 scales. U8S_I8 (640 bytes) is U8_I8 for a symmetric
 * type (Q6_K: w = d * (u - 32)): d_0[16], d_1[16], then the codes; m = -32 d is computed in
 * registers (exactly: a power of two), so it gives U8_I8's bits.
 *   Q4K_I8 (2368 bytes a super-block of 8 blocks, 256 k): GGUF Q4_K as the file holds it, in
 *     the Q4_1 family: d[16], dmin[16] (fp16), sc[8][16], mn[8][16] (the 6-bit scales and
 *     minimums, a byte each), then the 8 blocks' codes as Q4_1_I8's. A block's d * sc and
 *     -(dmin * mn) are formed in registers, one float32 product each as gguf forms them, so
 *     the weight is the same; 296 bytes a block against Q4_1_I8's 384.
 * A 64-byte row of codes is then one vector of 16 lanes of 4 k each: `vpdpbusd` against a row's
 * 4 activation codes broadcast to every lane adds 4 products to each column's sum.
 */
#include <math.h>

#define HSCALES (PANEL * 2)     /* a block's fp16 d (or m) of its 16 columns, in bytes */
#define I8_Q4_BYTES (2 * SCALES + QBLOCK * PANEL / 2)
#define I8_Q8_BYTES (SCALES + QBLOCK * PANEL)
#define I8_U8_BYTES (4 * SCALES + QBLOCK * PANEL)
#define I8_Q4H_BYTES (2 * HSCALES + QBLOCK * PANEL / 2)
#define I8_Q8H_BYTES (HSCALES + QBLOCK * PANEL)
#define I8_U8H_BYTES (4 * HSCALES + QBLOCK * PANEL)
#define I8_U8S_BYTES (2 * SCALES + QBLOCK * PANEL)
#define I8_Q4K_HEAD (2 * HSCALES + 2 * 8 * PANEL)          /* d, dmin; sc, mn of 8 blocks */
#define I8_Q4K_SUPER (I8_Q4K_HEAD + 8 * QBLOCK * PANEL / 2)
#define I8_TILE 8           /* rows x panels of one register tile */
/* a panel's block I8_LEAD blocks ahead requested from memory, every cache line of it, while a
 * block is summed (the hardware's prefetcher alone leaves a many-row tile waiting on memory;
 * 4 blocks ahead and one line in four before 86d9e52: the many-row steps' gain is part of
 * docs/BENCHMARKS.md §1's 12th-session comparison) */
#define I8_LEAD 16

/* While a tile sums block b of panel p, the lines it reads next are requested from memory
 * (`i8_prefetch`): block b + I8_LEAD of the same panel and, in a call of at most 3 rows, block
 * b of the panel NP on (`next` bytes on), which the thread's next tile reads (a thread's panels
 * are contiguous). Such a tile is memory-bound and done in microseconds (a panel at K = 576 is
 * 5.8 KB): with the first request alone each tile started on lines nobody had asked for yet
 * (`benchmarks/linear_ab.py`, the embedded model's 30 layers streamed: 0.83-0.87x the time at 1
 * row, 0.78-0.81x at 2 and 3; 4 rows and more, compute-bound, keep the first request alone). */
static inline __attribute__((always_inline)) void i8_prefetch(const uint8_t *panel, int64_t b,
                                                              int64_t bytes, int64_t next) {
    for (int64_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(panel + (b + I8_LEAD) * bytes + line, 0, 1);
        if (next)
            __builtin_prefetch(panel + next + b * bytes + line, 0, 1);
    }
}
#define I8_CHUNK_BYTES (256 << 10)  /* activation codes swept against a thread's panels at once */

/* a call's quantized rows: codes [M, K], per row and block the scale e, e * t and t, and e * t
 * of each half block (eth [M, 2 * blocks]) */
struct i8_rows {
    const int8_t *q;
    const float *e, *et, *eth;
    const int32_t *t;
    int64_t K;
};

static inline int i8_layout(int layout) {
    return layout == Q4_1_I8 || layout == Q8_0_I8 || layout == U8_I8 || layout == Q4_1_I8H
           || layout == Q8_0_I8H || layout == U8_I8H || layout == U8S_I8 || layout == Q4K_I8;
}

/* an int8 layout's family (Q4_1_I8, Q8_0_I8 or U8_I8), and whether its scales are fp16 */
static inline int i8_kind(int layout) {
    return layout == Q4_1_I8H || layout == Q4K_I8 ? Q4_1_I8 : layout == Q8_0_I8H ? Q8_0_I8
           : layout == U8_I8H || layout == U8S_I8 ? U8_I8 : layout;
}

static inline int i8_half(int layout) {
    return layout == Q4_1_I8H || layout == Q8_0_I8H || layout == U8_I8H;
}

/* a U8 layout whose m is not stored: m = -32 d */
static inline int i8_sym(int layout) {
    return layout == U8S_I8;
}

static inline int64_t i8_block_bytes(int layout) {
    switch (layout) {
    case Q4_1_I8: return I8_Q4_BYTES;
    case Q8_0_I8: return I8_Q8_BYTES;
    case Q4_1_I8H: return I8_Q4H_BYTES;
    case Q8_0_I8H: return I8_Q8H_BYTES;
    case U8_I8H: return I8_U8H_BYTES;
    case U8S_I8: return I8_U8S_BYTES;
    case Q4K_I8: return I8_Q4K_SUPER / 8;             /* on average: a panel's bytes */
    default: return I8_U8_BYTES;
    }
}

/* where a block's codes start, past its scales */
static inline int64_t i8_scales_bytes(int layout) {
    const int kind = i8_kind(layout);
    return (kind == Q4_1_I8 ? 2 : kind == Q8_0_I8 ? 1 : i8_sym(layout) ? 2 : 4)
           * (i8_half(layout) ? HSCALES : SCALES);
}

/* an fp16 at p, exactly as a float */
static inline float i8_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {                                       /* zero, subnormal */
        const float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | man << 13;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* block b's scales (i8_blk: its own; Q4K_I8: its super-block's), and its codes */
static inline const uint8_t *i8_blk(const uint8_t *panel, int64_t b, int layout,
                                    int64_t bytes) {
    return layout == Q4K_I8 ? panel + (b >> 3) * I8_Q4K_SUPER : panel + b * bytes;
}

static inline const uint8_t *i8_codes(const uint8_t *panel, int64_t b, int layout,
                                      int64_t bytes) {
    return layout == Q4K_I8
               ? panel + (b >> 3) * I8_Q4K_SUPER + I8_Q4K_HEAD + (b & 7) * (QBLOCK * PANEL / 2)
               : panel + b * bytes + i8_scales_bytes(layout);
}

/* scale j (d, m, ...; U8: d_0, d_1, m_0, m_1) of column col of a block (jb: its index in its
 * Q4_K super-block) */
static inline float i8_scale(const uint8_t *blk, int layout, int j, int col, int jb) {
    if (layout == Q4K_I8) {                             /* d * sc, -(dmin * mn) */
        const float s = i8_f16(blk + HSCALES * j + 2 * col)
                        * (float)blk[2 * HSCALES + 8 * PANEL * j + PANEL * jb + col];
        return j ? -s : s;
    }
    if (i8_sym(layout) && j >= 2)                                 /* m = -32 d, exactly */
        return -32.0f * i8_scale(blk, U8_I8, j - 2, col, jb);
    if (i8_half(layout))
        return i8_f16(blk + HSCALES * j + 2 * col);
    float v;
    memcpy(&v, blk + SCALES * j + 4 * col, 4);
    return v;
}

/* one block of 32 x -> codes, scale, the scale times the codes' sum, the codes' sum, the scale
 * times each half's sum */
static inline void i8_quantize_block(const float *x, int8_t *q, float *e, float *et,
                                     int32_t *t, float eth[2]) {
#if defined(__AVX512F__)
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0),
                                                          _mm512_abs_ps(x1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(i1));
    const int32_t half[2] = {_mm512_reduce_add_epi32(i0), _mm512_reduce_add_epi32(i1)};
#elif defined(__AVX2__)
    /* the scalar form's operations 8 lanes at a time (the rounding, to nearest with ties to
     * even, is the default MXCSR mode's): a libm nearbyintf a value made quantizing 6% of a
     * 16-row step on an AVX2 host */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    const __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
    const __m256 m8 = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
        _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 s = _mm256_set1_ps(inv);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, s));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, s));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, s));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, s));
    /* the packs interleave the 128-bit lanes: 4-code groups i0 lo, i1 lo, i2 lo, i3 lo, i0 hi,
     * ...; the permutation puts them back in order */
    const __m256i codes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1),
                                             _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          codes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    h = _mm256_hadd_epi32(h, h);
    const __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const int32_t half[2] = {_mm_cvtsi128_si32(h4), _mm_extract_epi32(h4, 1)};
#else
    float amax = 0.0f;
    for (int j = 0; j < QBLOCK; j++)
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t half[2] = {0, 0};
    for (int j = 0; j < QBLOCK; j++) {
        const int32_t v = (int32_t)nearbyintf(x[j] * inv);     /* to nearest, ties to even */
        q[j] = (int8_t)v;
        half[j / 16] += v;
    }
#endif
    *e = amax / 127.0f;
    *et = *e * (float)(half[0] + half[1]);
    *t = half[0] + half[1];
    eth[0] = *e * (float)half[0];
    eth[1] = *e * (float)half[1];
}

static void i8_quantize(const float *x, int64_t M, int64_t K, int8_t *q, float *e, float *et,
                        int32_t *t, float *eth, int num_threads) {
    const int64_t blocks = K / QBLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M > 16)
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t i = r * blocks + b;
            i8_quantize_block(x + r * K + b * QBLOCK, q + r * K + b * QBLOCK, e + i, et + i,
                              t + i, eth + 2 * i);
        }
}

/* One block's finish into a (row, panel)'s 16 sums, as the header says, in the same operations
 * in every form. lo, hi: the block's int32 code sums (U8: of its first and second half; else
 * two parts of one sum, Q8_0's before the 128 * t correction); i: the (row, block) index. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
typedef __m512 i8_tile_acc;
#define I8_MANY_ROWS I8_TILE      /* rows of a tile where rows share it (else one panel) */
#define I8_ONE_ROW_PANELS 4       /* panels of a one-row tile */

/* a block's scales j (d, m, ...) of its 16 columns */
static inline __m512 i8_scales16(const uint8_t *blk, int layout, int j, int jb) {
    if (layout == Q4K_I8) {                             /* d * sc, -(dmin * mn) */
        const __m512 s = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + HSCALES * j))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                (const __m128i *)(blk + 2 * HSCALES + 8 * PANEL * j + PANEL * jb)))));
        return j ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(s),
                                                        _mm512_set1_epi32((int)0x80000000)))
                 : s;
    }
    if (i8_sym(layout) && j >= 2)                                 /* m = -32 d, exactly */
        return _mm512_mul_ps(_mm512_loadu_ps(blk + SCALES * (j - 2)), _mm512_set1_ps(-32.0f));
    return i8_half(layout)
               ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + HSCALES * j)))
               : _mm512_loadu_ps(blk + SCALES * j);
}

static inline __m512 i8_finish(const uint8_t *blk, int layout, __m512i lo, __m512i hi,
                               const struct i8_rows *a, int64_t i, int jb, __m512 acc) {
    const __m512 e = _mm512_set1_ps(a->e[i]);
    const int kind = i8_kind(layout);
    if (kind == U8_I8) {
        acc = _mm512_fmadd_ps(i8_scales16(blk, layout, 0, jb),
                              _mm512_mul_ps(_mm512_cvtepi32_ps(lo), e), acc);
        acc = _mm512_fmadd_ps(i8_scales16(blk, layout, 2, jb), _mm512_set1_ps(a->eth[2 * i]), acc);
        acc = _mm512_fmadd_ps(i8_scales16(blk, layout, 1, jb),
                              _mm512_mul_ps(_mm512_cvtepi32_ps(hi), e), acc);
        return _mm512_fmadd_ps(i8_scales16(blk, layout, 3, jb), _mm512_set1_ps(a->eth[2 * i + 1]),
                               acc);
    }
    __m512i isum = _mm512_add_epi32(lo, hi);
    if (kind == Q8_0_I8)
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * a->t[i]));
    acc = _mm512_fmadd_ps(i8_scales16(blk, layout, 0, jb),
                          _mm512_mul_ps(_mm512_cvtepi32_ps(isum), e), acc);
    if (kind == Q4_1_I8)
        acc = _mm512_fmadd_ps(i8_scales16(blk, layout, 1, jb), _mm512_set1_ps(a->et[i]), acc);
    return acc;
}

static inline __m512i i8_bcast(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return _mm512_set1_epi32(v);
}

/* MR rows (from row m0) x NP panels, every block: out[r][p] the 16 sums. Two int32 chains per
 * (row, panel) (the lower and upper halves of a block's k) keep the dot-product unit busy. */
static inline __attribute__((always_inline)) void
i8_tile(const struct i8_rows *a, int64_t m0, const uint8_t *const *panels, int layout,
        int64_t next, const int MR, const int NP, __m512 acc[I8_TILE]) {
    const int64_t K = a->K, blocks = K / QBLOCK, bytes = i8_block_bytes(layout);
    const int kind = i8_kind(layout);
    for (int i = 0; i < MR * NP; i++)
        acc[i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i lo[I8_TILE], hi[I8_TILE];
        for (int i = 0; i < MR * NP; i++)
            lo[i] = hi[i] = _mm512_setzero_si512();
        for (int p = 0; p < NP; p++) {
            const uint8_t *codes = i8_codes(panels[p], b, layout, bytes);
            i8_prefetch(panels[p], b, bytes, next);
            for (int c = 0; c < 4; c++) {
                __m512i w0, w1;
                int k0, k1;                       /* the first k of w0's and w1's groups */
                if (kind == Q4_1_I8) {
                    const __m512i v = _mm512_loadu_si512(codes + 64 * c);
                    w0 = _mm512_and_si512(v, nibble);
                    w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    k0 = 8 * c, k1 = 8 * c + 4;
                } else if (kind == Q8_0_I8) {
                    w0 = _mm512_loadu_si512(codes + 128 * c);
                    w1 = _mm512_loadu_si512(codes + 128 * c + 64);
                    k0 = 8 * c, k1 = 8 * c + 4;
                } else {                          /* U8: lo the first half block, hi the second */
                    w0 = _mm512_loadu_si512(codes + 64 * c);
                    w1 = _mm512_loadu_si512(codes + 64 * (c + 4));
                    k0 = 4 * c, k1 = 16 + 4 * c;
                }
                for (int r = 0; r < MR; r++) {
                    const int8_t *x = a->q + (m0 + r) * K + b * QBLOCK;
                    lo[r * NP + p] = _mm512_dpbusd_epi32(lo[r * NP + p], w0, i8_bcast(x + k0));
                    hi[r * NP + p] = _mm512_dpbusd_epi32(hi[r * NP + p], w1, i8_bcast(x + k1));
                }
            }
        }
        for (int r = 0; r < MR; r++)
            for (int p = 0; p < NP; p++)
                acc[r * NP + p] = i8_finish(i8_blk(panels[p], b, layout, bytes), layout,
                                            lo[r * NP + p], hi[r * NP + p], a,
                                            (m0 + r) * blocks + b, (int)(b & 7),
                                            acc[r * NP + p]);
    }
}

static inline void i8_store(const __m512 *acc, int i, float out[PANEL]) {
    _mm512_storeu_ps(out, acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2: a panel's 16 columns as two halves of 8 int32 / float lanes; 4 products a lane by
 * `vpmaddubsw` (unsigned x signed bytes to int16 pairs) then `vpmaddwd` against ones. Q8_0 takes
 * |q| and the activation with q's sign (|q| <= 128, |a| <= 127), which sums q * a directly: the
 * integer the header's u * a - 128 * t is. Q4_1's codes (<= 15) leave the pairs in int16 for the
 * whole block, one `vpmaddwd` a block: an int16 lane sums 16 products of at most 15 * 127, at
 * most 30480 < 2^15, so the sums are exact and the pairs' second multiply leaves the inner loop
 * (the multiplies are what a many-row tile waits on). */
typedef struct {
    __m256 h[2];
} i8_tile_acc;
/* 2 rows a tile: 4 int16 sums and 4 float accumulators leave the 16 registers room for the
 * codes, two activations and a product (a 3-row tile spilled: its 64-row call 1.14x the time,
 * `benchmarks/linear_ab.py` on a Zen 3 AVX2 host) */
#define I8_MANY_ROWS 2
#define I8_ONE_ROW_PANELS 2

static inline __m256i i8_dot4(__m256i w, __m256i a, int kind) {
    if (kind == Q8_0_I8) {
        const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        w = _mm256_abs_epi8(q);
        a = _mm256_sign_epi8(a, q);
    }
    const __m256i pairs = _mm256_maddubs_epi16(w, a);
    return kind == Q4_1_I8 ? pairs : _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* a running sum plus a group's i8_dot4: int16 lanes for Q4_1, int32 for the others. The empty
 * asm pins each sum to its place in the chain: integer adds are associative, and GCC otherwise
 * gathers a block's chain at its end, every product of the block live at once, each stored to
 * the stack and loaded back (as `perf annotate` showed of the 3-row tile) */
static inline __m256i i8_add(__m256i sum, __m256i dot, int kind) {
    if (kind != Q4_1_I8)
        return _mm256_add_epi32(sum, dot);
    sum = _mm256_add_epi16(sum, dot);
    __asm__("" : "+x"(sum));
    return sum;
}

/* a block's scales j (d, m, ...) of its columns 8 h .. 8 h + 7 */
static inline __m256 i8_scales8(const uint8_t *blk, int layout, int j, int h, int jb) {
    if (layout == Q4K_I8) {                             /* d * sc, -(dmin * mn) */
        const __m256 s = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + HSCALES * j + 16 * h))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                (const __m128i *)(blk + 2 * HSCALES + 8 * PANEL * j + PANEL * jb + 8 * h)))));
        return j ? _mm256_xor_ps(s, _mm256_set1_ps(-0.0f)) : s;
    }
    if (i8_sym(layout) && j >= 2)                                 /* m = -32 d, exactly */
        return _mm256_mul_ps(_mm256_loadu_ps((const float *)(blk + SCALES * (j - 2)) + 8 * h),
                             _mm256_set1_ps(-32.0f));
    return i8_half(layout)
               ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + HSCALES * j + 16 * h)))
               : _mm256_loadu_ps((const float *)(blk + SCALES * j) + 8 * h);
}

static inline __attribute__((always_inline)) void
i8_tile(const struct i8_rows *a, int64_t m0, const uint8_t *const *panels, int layout,
        int64_t next, const int MR, const int NP, i8_tile_acc acc[I8_TILE]) {
    const int64_t K = a->K, blocks = K / QBLOCK, bytes = i8_block_bytes(layout);
    const int kind = i8_kind(layout);
    for (int i = 0; i < MR * NP; i++)
        acc[i].h[0] = acc[i].h[1] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i isum[I8_TILE][2][2];          /* [tile][half block (U8; else 0)][column half] */
        for (int i = 0; i < MR * NP; i++)
            isum[i][0][0] = isum[i][0][1] = isum[i][1][0] = isum[i][1][1] =
                _mm256_setzero_si256();
        for (int p = 0; p < NP; p++) {
            const uint8_t *codes = i8_codes(panels[p], b, layout, bytes);
            i8_prefetch(panels[p], b, bytes, next);
            for (int g = 0; g < 8; g++)
                for (int h = 0; h < 2; h++) {
                    const int kh = kind == U8_I8 && g >= 4;
                    __m256i w;
                    if (kind == Q4_1_I8) {
                        w = _mm256_loadu_si256((const __m256i *)(codes + 64 * (g / 2) + 32 * h));
                        w = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(w, 4) : w, nibble);
                    } else {
                        w = _mm256_loadu_si256((const __m256i *)(codes + 64 * g + 32 * h));
                    }
                    for (int r = 0; r < MR; r++) {
                        int32_t x4;
                        memcpy(&x4, a->q + (m0 + r) * K + b * QBLOCK + 4 * g, 4);
                        isum[r * NP + p][kh][h] = i8_add(
                            isum[r * NP + p][kh][h], i8_dot4(w, _mm256_set1_epi32(x4), kind),
                            kind);
                    }
                }
        }
        if (kind == Q4_1_I8)                                     /* int16 pairs -> int32 */
            for (int i = 0; i < MR * NP; i++)
                for (int h = 0; h < 2; h++)
                    isum[i][0][h] = _mm256_madd_epi16(isum[i][0][h], _mm256_set1_epi16(1));
        for (int r = 0; r < MR; r++) {
            const int64_t i = (m0 + r) * blocks + b;
            for (int p = 0; p < NP; p++)
                for (int h = 0; h < 2; h++) {          /* as the VNNI form, lane by lane */
                    const uint8_t *blk = i8_blk(panels[p], b, layout, bytes);
                    const int jb = (int)(b & 7);
                    const __m256 e = _mm256_set1_ps(a->e[i]);
                    __m256i *is = isum[r * NP + p][0];
                    __m256 v = acc[r * NP + p].h[h];
                    if (kind == U8_I8) {
                        for (int kh = 0; kh < 2; kh++) {
                            const __m256 s = _mm256_mul_ps(
                                _mm256_cvtepi32_ps(isum[r * NP + p][kh][h]), e);
                            v = _mm256_fmadd_ps(i8_scales8(blk, layout, kh, h, jb), s, v);
                            v = _mm256_fmadd_ps(i8_scales8(blk, layout, 2 + kh, h, jb),
                                                _mm256_set1_ps(a->eth[2 * i + kh]), v);
                        }
                    } else {
                        const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(is[h]), e);
                        v = _mm256_fmadd_ps(i8_scales8(blk, layout, 0, h, jb), s, v);
                        if (kind == Q4_1_I8)
                            v = _mm256_fmadd_ps(i8_scales8(blk, layout, 1, h, jb),
                                                _mm256_set1_ps(a->et[i]), v);
                    }
                    acc[r * NP + p].h[h] = v;
                }
        }
    }
}

static inline void i8_store(const i8_tile_acc *acc, int i, float out[PANEL]) {
    _mm256_storeu_ps(out, acc[i].h[0]);
    _mm256_storeu_ps(out + 8, acc[i].h[1]);
}
#else
/* plain C: the same integer sums (exact) and the same float operations, lane by lane */
typedef float i8_acc[PANEL];
typedef i8_acc i8_tile_acc;
#define I8_MANY_ROWS 1
#define I8_ONE_ROW_PANELS 1

static inline void i8_tile_generic(const struct i8_rows *a, int64_t m0,
                                   const uint8_t *const *panels, int layout, int MR, int NP,
                                   i8_acc acc[I8_TILE]) {
    const int64_t K = a->K, blocks = K / QBLOCK, bytes = i8_block_bytes(layout);
    const int kind = i8_kind(layout);
    for (int i = 0; i < MR * NP; i++)
        for (int l = 0; l < PANEL; l++)
            acc[i][l] = 0.0f;
    for (int64_t b = 0; b < blocks; b++)
        for (int p = 0; p < NP; p++) {
            const uint8_t *blk = i8_blk(panels[p], b, layout, bytes);
            const uint8_t *codes = i8_codes(panels[p], b, layout, bytes);
            float scale[4 * PANEL];                   /* d, m (d_0, d_1, m_0, m_1) as floats */
            for (int j = 0; j < (kind == U8_I8 ? 4 : kind == Q4_1_I8 ? 2 : 1); j++)
                for (int l = 0; l < PANEL; l++)
                    scale[PANEL * j + l] = i8_scale(blk, layout, j, l, (int)(b & 7));
            for (int r = 0; r < MR; r++) {
                const int8_t *x = a->q + (m0 + r) * K + b * QBLOCK;
                const int64_t i = (m0 + r) * blocks + b;
                for (int l = 0; l < PANEL; l++) {
                    int32_t isum[2] = {0, 0};         /* by half block (U8), else all in [0] */
                    for (int k = 0; k < QBLOCK; k++) {
                        const int g = k / 4, j = k % 4;
                        const int32_t w = kind == Q4_1_I8
                            ? (codes[64 * (g / 2) + 4 * l + j] >> (4 * (g % 2))) & 0x0F
                            : codes[64 * g + 4 * l + j];
                        isum[kind == U8_I8 && k >= 16] += w * x[k];
                    }
                    float v = acc[r * NP + p][l];
                    if (kind == U8_I8) {
                        for (int kh = 0; kh < 2; kh++) {
                            v = __builtin_fmaf(scale[16 * kh + l], (float)isum[kh] * a->e[i], v);
                            v = __builtin_fmaf(scale[32 + 16 * kh + l], a->eth[2 * i + kh], v);
                        }
                    } else {
                        if (kind == Q8_0_I8)
                            isum[0] -= 128 * a->t[i];
                        v = __builtin_fmaf(scale[l], (float)isum[0] * a->e[i], v);
                        if (kind == Q4_1_I8)
                            v = __builtin_fmaf(scale[16 + l], a->et[i], v);
                    }
                    acc[r * NP + p][l] = v;
                }
            }
        }
}

#define i8_tile(a, m0, panels, layout, next, MR, NP, acc) \
    i8_tile_generic(a, m0, panels, layout, MR, NP, acc)

static inline void i8_store(const i8_acc *acc, int i, float out[PANEL]) {
    memcpy(out, acc[i], sizeof(float) * PANEL);
}
#endif

/* rows m0 .. m0 + mr - 1 against np panels (p0 on; mr * np <= I8_TILE), into y; inlined with
 * a constant layout (`i8_rows_panels`), so each tile is compiled for its one layout */
static inline __attribute__((always_inline)) void
i8_rows_panels_as(const struct i8_rows *a, int64_t m0, int64_t mr, const uint8_t *base,
                  int64_t panel_bytes, int64_t p0, int np, const int layout, int64_t next,
                  int64_t N, const float *bias, float *y) {
    const uint8_t *panels[I8_TILE];
    for (int p = 0; p < np; p++)
        panels[p] = base + (p0 + p) * panel_bytes;
    i8_tile_acc acc[I8_TILE];
#define I8_TILE_CASE(MR, NP)                                                                    \
    case MR * 16 + NP: i8_tile(a, m0, panels, layout, next, MR, NP, acc); break;
    switch (mr * 16 + np) {                   /* constant tile shapes: fully unrolled loops */
        I8_TILE_CASE(1, 4) I8_TILE_CASE(1, 3) I8_TILE_CASE(1, 2) I8_TILE_CASE(2, 2)
        I8_TILE_CASE(3, 2) I8_TILE_CASE(2, 1) I8_TILE_CASE(3, 1) I8_TILE_CASE(4, 1)
        I8_TILE_CASE(5, 1) I8_TILE_CASE(6, 1) I8_TILE_CASE(7, 1) I8_TILE_CASE(8, 1)
    default: i8_tile(a, m0, panels, layout, next, 1, 1, acc); break;
    }
#undef I8_TILE_CASE
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) {
            float out[PANEL];
            i8_store(acc, r * np + p, out);
            store_row(out, m0 + r, (p0 + p) * PANEL, N, bias, y);
        }
}

static void i8_rows_panels(const struct i8_rows *a, int64_t m0, int64_t mr, const uint8_t *base,
                           int64_t panel_bytes, int64_t p0, int np, int layout, int64_t next,
                           int64_t N, const float *bias, float *y) {
#define I8_LAYOUT_CASE(L)                                                                       \
    case L: i8_rows_panels_as(a, m0, mr, base, panel_bytes, p0, np, L, next, N, bias, y); break;
    switch (layout) {                         /* a constant layout each case: its own tiles */
        I8_LAYOUT_CASE(Q4_1_I8) I8_LAYOUT_CASE(Q8_0_I8) I8_LAYOUT_CASE(Q4_1_I8H)
        I8_LAYOUT_CASE(Q8_0_I8H) I8_LAYOUT_CASE(U8_I8H) I8_LAYOUT_CASE(U8S_I8)
        I8_LAYOUT_CASE(Q4K_I8)
    default: i8_rows_panels_as(a, m0, mr, base, panel_bytes, p0, np, U8_I8, next, N, bias, y);
    }
#undef I8_LAYOUT_CASE
}

/* x [M, K] float32 against a weight packed in an int8 layout: y [M, N] (+ bias). Returns 0, or -1
 * where the quantized rows could not get memory (y untouched). */
static int linear_forward_i8(const float *x, int64_t M, int64_t K, const uint8_t *base,
                             int layout, int64_t N, const float *bias, float *y,
                             int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, blocks = K / QBLOCK;
    const int64_t panel_bytes = blocks * i8_block_bytes(layout);
    int8_t *q = malloc((size_t)(M * K) + 64);
    float *scales = malloc(sizeof(float) * (size_t)(4 * M * blocks + 1));   /* e, et, eth */
    int32_t *t = malloc(sizeof(int32_t) * (size_t)(M * blocks + 1));
    if (!q || !scales || !t) {
        free(q);
        free(scales);
        free(t);
        return -1;
    }
    i8_quantize(x, M, K, q, scales, scales + M * blocks, t, scales + 2 * M * blocks, num_threads);
    const struct i8_rows a = {q, scales, scales + M * blocks, scales + 2 * M * blocks, t, K};
    /* tiles: one row against I8_ONE_ROW_PANELS panels, else up to I8_MANY_ROWS rows (2 or 3
     * rows: against 2 panels where the form's registers hold them) */
    const int64_t mr_max = M == 1 ? 1 : M <= 3 && I8_MANY_ROWS >= 3 ? M : I8_MANY_ROWS;
    const int np_max = M == 1 ? I8_ONE_ROW_PANELS : M <= 3 && I8_MANY_ROWS > 3 ? 2 : 1;
    const int64_t chunk = I8_CHUNK_BYTES / K > I8_TILE ? I8_CHUNK_BYTES / K : I8_TILE;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && panels > 1)
    {
        const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
        const int64_t begin = panels * th / nt, end = panels * (th + 1) / nt;
        for (int64_t r0 = 0; r0 < M; r0 += chunk) {
            const int64_t r1 = M - r0 < chunk ? M : r0 + chunk;
            for (int64_t p = begin; p < end; p += np_max) {
                const int np = (int)(end - p < np_max ? end - p : np_max);
                /* the chunk's rows in tiles of equal height (within one): 9 rows as 5 + 4,
                 * not 8 + 1, whose one-row tile waits on its dot products' chains (a 9-row
                 * verify's linear layers 0.96x the time, 10 rows 0.93-0.97x: linear_ab.py) */
                const int64_t tiles = (r1 - r0 + mr_max - 1) / mr_max;
                for (int64_t i = 0, m0 = r0; i < tiles; i++) {
                    const int64_t mr = (r1 - r0) / tiles + (i < (r1 - r0) % tiles);
                    i8_rows_panels(&a, m0, mr, base, panel_bytes, p, np, layout,
                                   M <= 3 ? np * panel_bytes : 0, N, bias, y);
                    m0 += mr;
                }
            }
        }
    }
    free(q);
    free(scales);
    free(t);
    return 0;
}

/* code k (0..15) of column col into a Q4_1_I8 block's codes: chunk k / 8, low nibble for
 * k % 8 < 4, byte 4 * col + k % 4 */
static inline void i8_put_q4(uint8_t *out, int64_t col, int64_t k, uint8_t c) {
    const int64_t g = k / 4;
    out[64 * (g / 2) + 4 * col + k % 4] |= (uint8_t)((c & 0x0F) << (4 * (g % 2)));
}

/* codes [N, K] (Q4_1: 0..15; Q8_0: int8; U8: 0..63), d and (Q4_1, U8) m [N, K / QBLOCK] (U8:
 * [N, K / 16], each half block's), float32 (fp16 for the _I8H layouts) -> the layouts above
 * (padding columns: scales 0, code 0) */
static void linear_pack_i8(int layout, const uint8_t *codes, const void *d_, const void *m_,
                           int64_t N, int64_t K, uint8_t *packed) {
    const int64_t panels = (N + PANEL - 1) / PANEL, blocks = K / QBLOCK;
    const int64_t bytes = i8_block_bytes(layout), size = i8_half(layout) ? 2 : 4;
    const int64_t stride = i8_half(layout) ? HSCALES : SCALES;
    const uint8_t *d = d_, *m = m_;
    const int kind = i8_kind(layout);
    memset(packed, 0, (size_t)(panels * blocks * bytes));
    for (int64_t n = 0; n < N; n++) {
        const int64_t col = n % PANEL;
        uint8_t *dst = packed + (n / PANEL) * blocks * bytes;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = dst + b * bytes;
            if (kind == U8_I8) {
                for (int64_t h = 0; h < 2; h++) {
                    const int64_t at = (n * 2 * blocks + 2 * b + h) * size;
                    memcpy(blk + h * stride + size * col, d + at, size);
                    if (!i8_sym(layout))
                        memcpy(blk + (2 + h) * stride + size * col, m + at, size);
                }
            } else {
                memcpy(blk + size * col, d + (n * blocks + b) * size, size);
                if (kind == Q4_1_I8)
                    memcpy(blk + stride + size * col, m + (n * blocks + b) * size, size);
            }
            uint8_t *out = blk + i8_scales_bytes(layout);
            for (int64_t k = 0; k < QBLOCK; k++) {
                const uint8_t c = codes[n * K + b * QBLOCK + k];
                const int64_t g = k / 4, at = 4 * col + k % 4;
                if (kind == Q4_1_I8)
                    i8_put_q4(out, col, k, c);
                else if (kind == Q8_0_I8)
                    out[64 * g + at] = (uint8_t)(c ^ 0x80);     /* int8 q -> q + 128 */
                else
                    out[64 * g + at] = c;
            }
        }
    }
}

/* row n of a Q8_0_I8 / Q8_0_I8H weight, d * q exactly as gguf dequantizes it: out [K] */
static void linear_row_q8_i8(const uint8_t *packed, int layout, int64_t K, int64_t n,
                             float *out) {
    const int64_t blocks = K / QBLOCK, col = n % PANEL, bytes = i8_block_bytes(layout);
    const uint8_t *panel = packed + (n / PANEL) * blocks * bytes;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * bytes, *codes = blk + i8_scales_bytes(layout);
        const float d = i8_scale(blk, layout, 0, (int)col, 0);
        for (int64_t k = 0; k < QBLOCK; k++)
            out[b * QBLOCK + k] = d * (float)((int32_t)codes[64 * (k / 4) + 4 * col + k % 4]
                                              - 128);
    }
}

/* GGUF Q4_K -> Q4K_I8 (the header's layout; padding columns zero): codes [N, K] (0..15), d and
 * dmin [N, K / 256] (fp16 bits), sc and mn [N, K / 32] (the 6-bit scales and minimums) */
void linear_pack_q4k(const uint8_t *codes, const uint16_t *d, const uint16_t *dmin,
                     const uint8_t *sc, const uint8_t *mn, int64_t N, int64_t K, uint8_t *packed) {
    const int64_t panels = (N + PANEL - 1) / PANEL, supers = K / (8 * QBLOCK);
    memset(packed, 0, (size_t)(panels * supers * I8_Q4K_SUPER));
    for (int64_t n = 0; n < N; n++) {
        const int64_t col = n % PANEL;
        uint8_t *dst = packed + (n / PANEL) * supers * I8_Q4K_SUPER;
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *sup = dst + s * I8_Q4K_SUPER;
            memcpy(sup + 2 * col, d + n * supers + s, 2);
            memcpy(sup + HSCALES + 2 * col, dmin + n * supers + s, 2);
            for (int64_t jb = 0; jb < 8; jb++) {
                const int64_t b = 8 * s + jb;
                sup[2 * HSCALES + PANEL * jb + col] = sc[n * 8 * supers + b];
                sup[2 * HSCALES + 8 * PANEL + PANEL * jb + col] = mn[n * 8 * supers + b];
                uint8_t *out = sup + I8_Q4K_HEAD + jb * (QBLOCK * PANEL / 2);
                for (int64_t k = 0; k < QBLOCK; k++)
                    i8_put_q4(out, col, k, codes[n * K + b * QBLOCK + k]);
            }
        }
    }
}
