/* VeriCache's drafter on the C decoder: the attention of draft rows, one row a request, over the
 * request's compressed pages and its dense keys (sinks, the recent tail and the round's drafts,
 * in a small paged cache), with one softmax over both. Two page formats, read as they are stored
 * (`struct draft_pages`'s kind), never decoded into a cache:
 *
 * `quant` (KIVI-style codes, `kv_cache/compress/quant.py`): the scales and zeros fold into the
 * query and into the probabilities, only the codes are widened:
 *     logit = (q * s_k) . c_k + q . z_k    (keys: a scale and zero per page, head and channel)
 *     out   = (p * s_v) @ c_v + p @ z_v    (values: a scale and zero per token and head)
 * Codes are packed little end first, 8 / bits to a byte: keys channel by channel along a
 * page's tokens (a page's tokens are scored in vector lanes), values token by token along the
 * dimensions (a token's codes weighed into the sums of its dimensions). A vector of codes is one
 * plane of TILE bytes (plane j: code j of every byte).
 *
 * Spherical-KV (`kv_cache/compress/spherical.py`, one tier, float16 values): per query head a
 * table of its groups' products with every codeword, then a token's logit is
 *     sum_j radius[t, j] / 255 * scale[page, j] * table[j, theta[t, j]]   (the Triton form's)
 *
 * Mustafar (bitmap-sparse tiles, `kv_cache/compress/mustafar.py`, layout in
 * `kernels/reference/mustafar_attention.py`): a tile's kept float16 values are expanded by its
 * bitmap into 64 lanes (AVX-512 VBMI2's expanding load, else bit by bit): a key tile is one
 * channel of 64 tokens (scored in lanes, the channel's query value broadcast), a value tile 64
 * dimensions of one token (weighed by its probability).
 *
 * A draft's output feeds only the draft: the verify pass reads the full cache, so outputs stay
 * those of plain decoding whatever this computes. It is the module path's math
 * (`QuantPagesBatch.attend` merged with the dense part) in another summation order: tests hold
 * it to float32 tolerance, not bits (Mustafar: `MustafarCompressor._attend_prepared`).
 *
 * Tasks: (request, kv head, part of its keys), the parts merged by their maxima and sums, so that
 * one request's three kv heads still keep two threads busy.
 *
 * Included by `decoder.c` after `paged_attention.c` (key_offsets, softmax_row, tree8, widen8_bf16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* one request's pages of one layer, page-major (`QuantArena`: every page's fields are views of
 * these six tensors) */
struct quant_pages {
    const uint8_t *k_codes;            /* [num_pages, kv_heads, head_dim, page_size*kbits/8] */
    const uint16_t *k_scale, *k_zero;  /* float16 [num_pages, kv_heads, head_dim] */
    const uint8_t *v_codes;            /* [num_pages, page_size, kv_heads, head_dim*vbits/8] */
    const uint16_t *v_scale, *v_zero;  /* float16 [num_pages, page_size, kv_heads] */
    int64_t num_pages;
};

/* one request's Mustafar pages of one layer, as `MustafarCompressor._prepare_pages` joins them:
 * tokens 64 * num_blocks */
struct mustafar_pages {
    const int64_t *k_bitmaps, *k_offsets;   /* [kv_heads, num_blocks, head_dim] */
    const uint16_t *k_values;               /* float16, every key tile's kept values */
    const int64_t *v_bitmaps, *v_offsets;   /* [kv_heads, num_blocks * 64, head_dim / 64] */
    const uint16_t *v_values;
    int64_t num_blocks;
};

/* one request's Spherical-KV pages of one layer, joined along their tokens (all of one tier) */
struct spherical_pages {
    const uint8_t *theta, *radius;          /* group-major: [kv_heads, groups, tokens] */
    const float *scale;                     /* [kv_heads, tokens / page_size, groups] */
    const float *codebook;                  /* [kv_heads, groups, codes, group] */
    const uint16_t *values;                 /* float16 [kv_heads, tokens, head_dim] */
    int64_t tokens, group, codes;
};

enum { DRAFT_QUANT = 0, DRAFT_MUSTAFAR = 1, DRAFT_SPHERICAL = 2 };

/* a draft step's pages: layer l's of the step's request r at pages[l * row_stride + r], a
 * struct quant_pages or mustafar_pages as kind says (key_bits, value_bits: quant's) */
struct draft_pages {
    const void *pages;
    int64_t row_stride, page_size, key_bits, value_bits, kind;
};

/* request r's pages in the row of the table that starts at first */
static inline const void *draft_row(const struct draft_pages *d, int64_t first, int64_t r) {
    if (d->kind == DRAFT_MUSTAFAR)
        return (const struct mustafar_pages *)d->pages + first + r;
    if (d->kind == DRAFT_SPHERICAL)
        return (const struct spherical_pages *)d->pages + first + r;
    return (const struct quant_pages *)d->pages + first + r;
}

/* how many tokens those pages hold */
static inline int64_t draft_page_tokens(const struct draft_pages *d, int64_t first, int64_t r) {
    const void *row = draft_row(d, first, r);
    if (d->kind == DRAFT_MUSTAFAR)
        return ((const struct mustafar_pages *)row)->num_blocks * 64;
    if (d->kind == DRAFT_SPHERICAL)
        return ((const struct spherical_pages *)row)->tokens;
    return ((const struct quant_pages *)row)->num_pages * d->page_size;
}

#define MAX_G 8                  /* query heads of a kv head taken together, at most */

typedef uint8_t vrowb __attribute__((vector_size(TILE), aligned(1)));

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const int e = (h >> 10) & 31, m = h & 0x3ff;
    const float f = e == 0 ? ldexpf((float)m, -24)
                    : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 0x400), e - 25);
    return h & 0x8000 ? -f : f;
#endif
}

/* 8 float16 values as floats */
static inline v8f half8(const uint16_t *h) {
#if defined(__F16C__)
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    v8f f;
    for (int i = 0; i < 8; i++)
        f[i] = half_to_float(h[i]);
    return f;
#endif
}

/* 8 values of a dense cache (float32, or bfloat16 bits) as floats */
static inline v8f dense8(const void *cache, int64_t at, int bf16) {
    if (bf16)
        return widen8_bf16((const uint16_t *)cache + at);
    v8f x;
    memcpy(&x, (const float *)cache + at, sizeof x);
    return x;
}

/* what one part of the keys of one request's kv head h gives n <= MAX_G of its query heads */
struct draft_part {
    const float *q[MAX_G];              /* the heads' queries */
    float *s[MAX_G];                    /* scores, then e^(s - max), at [t - a] */
    float *acc[MAX_G];                  /* the probabilities' unnormalized sums of values */
    float max[MAX_G], sum[MAX_G];
};

/* TILE bytes from b, each widened to an int32 lane (n < TILE: the first n, the rest 0) */
static inline vrowi bytes_row(const uint8_t *b, int64_t n) {
    uint8_t pad[TILE];
    if (n < TILE) {
        memset(pad, 0, sizeof pad);
        if (n > 0)
            memcpy(pad, b, (size_t)n);
        b = pad;
    }
#if TILE == 16
    return (vrowi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
#elif defined(__AVX2__)
    return (vrowi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
#else
    vrowb x;
    memcpy(&x, b, sizeof x);
    return __builtin_convertvector(x, vrowi);
#endif
}

static inline __attribute__((always_inline)) void put_row(float *at, vrow x) {
    memcpy(at, &x, sizeof x);
}

#define BLOCK_TOKENS 64                         /* a page's tokens scored together, at most */
#define AHEAD_TOKENS 8                  /* tokens ahead whose value codes are requested early */
#define BLOCK_VECS (BLOCK_TOKENS / TILE)

/* the code planes of TILE bytes x (per = 8 / bits codes a byte; plane j: code j of every byte)
 * widened, each weighed by head g's weight[g * stride] into its sums acc[g][c * per + j]: the
 * inner step of scoring keys (weights: the query) and of weighing values (the probabilities) */
static inline __attribute__((always_inline)) void weigh_planes(
    const int n, const int per, vrowi x, const float *weight, int64_t stride,
    vrow acc[][BLOCK_VECS], int c) {
    const int bits = 8 / per, mask = (1 << bits) - 1;
    for (int j = 0; j < per; j++) {
        const vrow cj = __builtin_convertvector((x >> (j * bits)) & mask, vrow);
        for (int g = 0; g < n; g++)
            acc[g][c * per + j] = fma_row(splat_row(weight[g * stride]), cj, acc[g][c * per + j]);
    }
}

/* lanes of a and b alternating: half 0 from their first TILE / 2 lanes, half 1 their last */
static inline __attribute__((always_inline)) vrow interleave_rows(vrow a, vrow b, int half) {
    vrowi m;
    for (int l = 0; l < TILE; l++)
        m[l] = half * (TILE / 2) + l / 2 + (l % 2) * TILE;
    return __builtin_shuffle(a, b, m);
}

static inline __attribute__((always_inline)) vrow load_row(const float *at) {
    vrow x;
    memcpy(&x, at, sizeof x);
    return x;
}

/* n query heads' scores of tokens b0 .. b0 + BLOCK_TOKENS - 1 of a page (those past its end,
 * or outside lo .. hi - 1, computed over zero codes and not written), per = 8 / kbits codes a
 * byte: every count a constant where it is inlined. A chunk of TILE bytes at a time, its per
 * planes' sums of every head held in registers over the channels; lane l of chunk c, plane j
 * holds token b0 + (c * TILE + l) * per + j. */
static inline __attribute__((always_inline)) void score_block(
    const int n, const int per, struct draft_part *w, const uint8_t *codes, int64_t pbytes,
    int64_t b0, int64_t lo, int64_t hi, int64_t base, int64_t a, int64_t D, const float *qp,
    const float *qz, float scale) {
    const int chunks = BLOCK_VECS / per, bits = 8 / per, mask = (1 << bits) - 1;
    const int64_t byte0 = b0 / per, nbytes = pbytes - byte0;
    float lanes[MAX_G][BLOCK_TOKENS];            /* the sums, vector v at [g][v * TILE] */
    for (int c = 0; c < chunks; c++) {
        vrow acc[4][MAX_G];
        for (int j = 0; j < per; j++)
            for (int g = 0; g < n; g++)
                acc[j][g] = splat_row(0.0f);
        const uint8_t *cd = codes + byte0 + c * TILE;
        for (int64_t d = 0; d < D; d++, cd += pbytes) {
            const vrowi x = bytes_row(cd, nbytes - c * TILE);
            for (int j = 0; j < per; j++) {
                const vrow cj = __builtin_convertvector((x >> (j * bits)) & mask, vrow);
                for (int g = 0; g < n; g++)
                    acc[j][g] = fma_row(splat_row(qp[g * D + d]), cj, acc[j][g]);
            }
        }
        for (int j = 0; j < per; j++)
            for (int g = 0; g < n; g++)
                put_row(lanes[g] + (c * per + j) * TILE, acc[j][g]);
    }
    if (b0 >= lo && b0 + BLOCK_TOKENS <= hi) {    /* a whole block: planes back to token order */
        const vrow sc = splat_row(scale);
        for (int g = 0; g < n; g++) {
            const vrow z = splat_row(qz[g]);
            float *out = w->s[g] + base + b0 - a;
            for (int c = 0; c < chunks; c++, out += TILE * per) {
                const float *pl = lanes[g] + c * per * TILE;
                if (per == 1) {
                    put_row(out, (load_row(pl) + z) * sc);
                } else if (per == 2) {
                    const vrow p0 = load_row(pl), p1 = load_row(pl + TILE);
                    put_row(out, (interleave_rows(p0, p1, 0) + z) * sc);
                    put_row(out + TILE, (interleave_rows(p0, p1, 1) + z) * sc);
                } else {
                    const vrow p0 = load_row(pl), p1 = load_row(pl + TILE);
                    const vrow p2 = load_row(pl + 2 * TILE), p3 = load_row(pl + 3 * TILE);
                    const vrow u0 = interleave_rows(p0, p2, 0), u1 = interleave_rows(p0, p2, 1);
                    const vrow v0 = interleave_rows(p1, p3, 0), v1 = interleave_rows(p1, p3, 1);
                    put_row(out, (interleave_rows(u0, v0, 0) + z) * sc);
                    put_row(out + TILE, (interleave_rows(u0, v0, 1) + z) * sc);
                    put_row(out + 2 * TILE, (interleave_rows(u1, v1, 0) + z) * sc);
                    put_row(out + 3 * TILE, (interleave_rows(u1, v1, 1) + z) * sc);
                }
            }
        }
        return;
    }
    for (int g = 0; g < n; g++)                  /* a block cut by lo or hi: lane by lane */
        for (int c = 0; c < chunks; c++)
            for (int j = 0; j < per; j++)
                for (int l = 0; l < TILE; l++) {
                    const int64_t t = b0 + (int64_t)(c * TILE + l) * per + j;
                    if (t >= lo && t < hi)
                        w->s[g][base + t - a] = (lanes[g][(c * per + j) * TILE + l] + qz[g]) *
                                                scale;
                }
}

/* The pages' inner loops (quant's key and value blocks, Mustafar's and Spherical-KV's scores and
 * values) are compiled as functions of their own, one per head count: inlined into the one large
 * task function, GCC kept most of their sums in memory. PER_HEAD_COUNT(NAME, PARAMS, ARGS)
 * defines NAME_1 .. NAME_8 PARAMS, each NAME(N, ARGS) with N its head count, a constant;
 * SWITCH_HEADS(n, CALL) runs CALL(n) for a head count n. */
#define SWITCH_HEADS(n, CALL)                                                                   \
    switch (n) {                                                                                \
    case 1: CALL(1); break;                                                                     \
    case 2: CALL(2); break;                                                                     \
    case 3: CALL(3); break;                                                                     \
    case 4: CALL(4); break;                                                                     \
    case 5: CALL(5); break;                                                                     \
    case 6: CALL(6); break;                                                                     \
    case 7: CALL(7); break;                                                                     \
    default: CALL(8);                                                                           \
    }
#define HEAD_COUNT_FN(NAME, N, PARAMS, ARGS)                                                    \
    static __attribute__((noinline)) void NAME##_##N PARAMS { NAME(N, UNPAREN ARGS); }
#define PER_HEAD_COUNT(NAME, PARAMS, ARGS)                                                      \
    HEAD_COUNT_FN(NAME, 1, PARAMS, ARGS) HEAD_COUNT_FN(NAME, 2, PARAMS, ARGS)                   \
    HEAD_COUNT_FN(NAME, 3, PARAMS, ARGS) HEAD_COUNT_FN(NAME, 4, PARAMS, ARGS)                   \
    HEAD_COUNT_FN(NAME, 5, PARAMS, ARGS) HEAD_COUNT_FN(NAME, 6, PARAMS, ARGS)                   \
    HEAD_COUNT_FN(NAME, 7, PARAMS, ARGS) HEAD_COUNT_FN(NAME, 8, PARAMS, ARGS)
#define UNPAREN(...) __VA_ARGS__

/* score_block for keys of kbits bits */
static inline __attribute__((always_inline)) void score_blocks(
    const int n, int kbits, struct draft_part *w, const uint8_t *codes, int64_t pbytes,
    int64_t b0, int64_t lo, int64_t hi, int64_t base, int64_t a, int64_t D, const float *qp,
    const float *qz, float scale) {
    if (kbits == 2)
        score_block(n, 4, w, codes, pbytes, b0, lo, hi, base, a, D, qp, qz, scale);
    else if (kbits == 4)
        score_block(n, 2, w, codes, pbytes, b0, lo, hi, base, a, D, qp, qz, scale);
    else
        score_block(n, 1, w, codes, pbytes, b0, lo, hi, base, a, D, qp, qz, scale);
}
PER_HEAD_COUNT(score_blocks, (int kbits, struct draft_part *w, const uint8_t *codes,
                              int64_t pbytes, int64_t b0, int64_t lo, int64_t hi, int64_t base,
                              int64_t a, int64_t D, const float *qp, const float *qz,
                              float scale),
               (kbits, w, codes, pbytes, b0, lo, hi, base, a, D, qp, qz, scale))

/* scores of the pages' tokens a .. e - 1 (e <= the pages' tokens). A page's key codes are
 * stored channel by channel, each channel's codes of the page's tokens packed along the tokens
 * (`quant.py`), so BLOCK_TOKENS tokens are scored in vector lanes, one channel after the other
 * (q * s_k of the channel broadcast): no sum across lanes. */
static inline __attribute__((always_inline)) void page_scores(
    const int n, struct draft_part *w, const struct quant_pages *pg, int64_t page_size, int kbits,
    int64_t h, int64_t D, int64_t kv_heads, float scale, int64_t a, int64_t e, float *qp) {
    const int64_t pbytes = page_size * kbits / 8;             /* a channel's bytes in a page */
    for (int64_t p = a / page_size; p * page_size < e; p++) {
        const uint16_t *ks = pg->k_scale + (p * kv_heads + h) * D;
        const uint16_t *kz = pg->k_zero + (p * kv_heads + h) * D;
        const uint8_t *codes = pg->k_codes + (p * kv_heads + h) * D * pbytes;
        if (p + 1 < pg->num_pages)              /* the next page's codes of this head, early */
            for (int64_t at = 0; at < D * pbytes; at += 64)
                __builtin_prefetch(codes + kv_heads * D * pbytes + at, 0, 1);
        float qz[MAX_G];
        v8f z8[MAX_G];
        for (int g = 0; g < n; g++)
            z8[g] = splat8(0.0f);
        for (int64_t d = 0; d < D; d += 8) {           /* q * s_k and q . z_k, 8 channels a step */
            const v8f s8 = half8(ks + d), zk = half8(kz + d);
            for (int g = 0; g < n; g++) {
                v8f q8;
                memcpy(&q8, w->q[g] + d, sizeof q8);
                const v8f qs = q8 * s8;
                memcpy(qp + g * D + d, &qs, sizeof qs);
                z8[g] = fma8(q8, zk, z8[g]);
            }
        }
        for (int g = 0; g < n; g++)
            qz[g] = tree8(z8[g]);
        const int64_t base = p * page_size;
        const int64_t lo = (a > base ? a : base) - base;
        const int64_t hi = (e < base + page_size ? e : base + page_size) - base;
        for (int64_t b0 = lo / BLOCK_TOKENS * BLOCK_TOKENS; b0 < hi; b0 += BLOCK_TOKENS) {
#define CALL(N) score_blocks_##N(kbits, w, codes, pbytes, b0, lo, hi, base, a, D, qp, qz, scale)
            SWITCH_HEADS(n, CALL)
#undef CALL
        }
    }
}

/* n query heads' value sums over the pages' tokens a .. e - 1, dimensions d0 .. d0 + 63: each
 * token's codes of them read once (BLOCK_VECS vectors, per = 8 / vbits codes a byte), weighed
 * by pw[g * len + t - a] into sums held in registers; lane l of chunk c, plane j is dimension
 * d0 + (c * TILE + l) * per + j. */
static inline __attribute__((always_inline)) void value_block(
    const int n, const int per, struct draft_part *w, const uint8_t *codes, int64_t stride,
    int64_t d0, int64_t a, int64_t e, const float *pw, const float *zsum) {
    const int chunks = BLOCK_VECS / per;
    const int64_t len = e - a;
    vrow acc[MAX_G][BLOCK_VECS];
    for (int g = 0; g < n; g++)
        for (int v = 0; v < BLOCK_VECS; v++)
            acc[g][v] = splat_row(0.0f);
    const uint8_t *ct = codes + a * stride + d0 / per;
    for (int64_t t = 0; t < len; t++, ct += stride) {
        __builtin_prefetch(ct + AHEAD_TOKENS * stride, 0, 1);
        for (int c = 0; c < chunks; c++)
            weigh_planes(n, per, bytes_row(ct + c * TILE, TILE), pw + t, len, acc, c);
    }
    for (int g = 0; g < n; g++)
        for (int c = 0; c < chunks; c++)
            for (int j = 0; j < per; j++)
                for (int l = 0; l < TILE; l++)
                    w->acc[g][d0 + (c * TILE + l) * per + j] = acc[g][c * per + j][l] + zsum[g];
}

/* value_block for values of vbits bits */
static inline __attribute__((always_inline)) void value_blocks(
    const int n, int vbits, struct draft_part *w, const uint8_t *codes, int64_t stride,
    int64_t d0, int64_t a, int64_t e, const float *pw, const float *zsum) {
    if (vbits == 2)
        value_block(n, 4, w, codes, stride, d0, a, e, pw, zsum);
    else if (vbits == 4)
        value_block(n, 2, w, codes, stride, d0, a, e, pw, zsum);
    else
        value_block(n, 1, w, codes, stride, d0, a, e, pw, zsum);
}
PER_HEAD_COUNT(value_blocks, (int vbits, struct draft_part *w, const uint8_t *codes,
                              int64_t stride, int64_t d0, int64_t a, int64_t e, const float *pw,
                              const float *zsum),
               (vbits, w, codes, stride, d0, a, e, pw, zsum))

/* the pages' tokens a .. e - 1 weighed into acc (which they set), 64 dimensions at a time
 * (value_block), weights e^(s - max) * s_v in pw (n * (e - a)), the zeros' sums apart */
static inline __attribute__((always_inline)) void page_values(
    const int n, struct draft_part *w, const struct quant_pages *pg, int vbits, int64_t h,
    int64_t D, int64_t kv_heads, int64_t a, int64_t e, float *pw) {
    const int64_t len = e - a, bytes = D * vbits / 8;
    float zsum[MAX_G];
    v8f z8[MAX_G];                  /* 8 tokens a step: their scales gathered (strided by head) */
    for (int g = 0; g < n; g++)
        z8[g] = splat8(0.0f);
    int64_t t = a;
    for (; t + 8 <= e; t += 8) {
        uint16_t vs16[8], vz16[8];
        for (int i = 0; i < 8; i++) {
            vs16[i] = pg->v_scale[(t + i) * kv_heads + h];
            vz16[i] = pg->v_zero[(t + i) * kv_heads + h];
        }
        const v8f vs = half8(vs16), vz = half8(vz16);
        for (int g = 0; g < n; g++) {
            v8f s8;
            memcpy(&s8, w->s[g] + t - a, sizeof s8);
            const v8f p8 = s8 * vs;
            memcpy(pw + g * len + t - a, &p8, sizeof p8);
            z8[g] = fma8(s8, vz, z8[g]);
        }
    }
    for (int g = 0; g < n; g++)
        zsum[g] = tree8(z8[g]);
    for (; t < e; t++) {
        const int64_t at = t * kv_heads + h;
        const float vs = half_to_float(pg->v_scale[at]), vz = half_to_float(pg->v_zero[at]);
        for (int g = 0; g < n; g++) {
            pw[g * len + t - a] = w->s[g][t - a] * vs;
            zsum[g] += w->s[g][t - a] * vz;
        }
    }
    const uint8_t *codes = pg->v_codes + h * bytes;
    for (int64_t d0 = 0; d0 < D; d0 += BLOCK_TOKENS) {
#define CALL(N) value_blocks_##N(vbits, w, codes, kv_heads * bytes, d0, a, e, pw, zsum)
        SWITCH_HEADS(n, CALL)
#undef CALL
    }
}

/* scores of the dense keys t = from .. b - 1 of n query heads (dense key j's slot at off[j],
 * the pages' tokens before them) */
static inline __attribute__((always_inline)) void dense_scores(
    const int n, struct draft_part *w, const void *k_cache, int bf16, const int64_t *off,
    int64_t page_tokens, int64_t h, int64_t D, float scale, int64_t a, int64_t from, int64_t b) {
    for (int64_t t = from; t < b; t++) {
        const int64_t at = off[t - page_tokens] + h * D;
        v8f dot[MAX_G];
        for (int g = 0; g < n; g++)
            dot[g] = splat8(0.0f);
        for (int64_t d = 0; d < D; d += 8) {
            const v8f k = dense8(k_cache, at + d, bf16);
            for (int g = 0; g < n; g++)
                dot[g] = fma8(*(const v8f *)(w->q[g] + d), k, dot[g]);
        }
        for (int g = 0; g < n; g++)
            w->s[g][t - a] = tree8(dot[g]) * scale;
    }
}

/* the dense keys' values weighed into acc by their probabilities */
static inline __attribute__((always_inline)) void dense_values(
    const int n, struct draft_part *w, const void *v_cache, int bf16, const int64_t *off,
    int64_t page_tokens, int64_t h, int64_t D, int64_t a, int64_t from, int64_t b) {
    for (int64_t t = from; t < b; t++) {
        const int64_t at = off[t - page_tokens] + h * D;
        for (int64_t d = 0; d < D; d += 8) {
            const v8f v = dense8(v_cache, at + d, bf16);
            for (int g = 0; g < n; g++) {
                v8f *o = (v8f *)(w->acc[g] + d);
                *o = fma8(splat8(w->s[g][t - a]), v, *o);
            }
        }
    }
}

/* e^(s - max) of keys a .. b - 1 in place, each head's max and 1 / sum */
static inline void part_softmax(const int n, struct draft_part *w, int64_t len, float softcap) {
    const int64_t stride = (len + 7) & ~(int64_t)7;
    for (int g = 0; g < n; g++)
        w->sum[g] = 1.0f / softmax_row(w->s[g], 0, stride, 0, len - 1, softcap, &w->max[g]);
}

#define TILE_VECS (64 / TILE)            /* vectors of a Mustafar tile's 64 elements */

/* x with its bits in reverse order (a Mustafar bitmap holds element e at bit 63 - e) */
static inline uint64_t reverse64(uint64_t x) {
    x = (x >> 32) | (x << 32);
    x = ((x >> 16) & 0x0000ffff0000ffffull) | ((x & 0x0000ffff0000ffffull) << 16);
    x = ((x >> 8) & 0x00ff00ff00ff00ffull) | ((x & 0x00ff00ff00ff00ffull) << 8);
    x = ((x >> 4) & 0x0f0f0f0f0f0f0f0full) | ((x & 0x0f0f0f0f0f0f0f0full) << 4);
    x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
    return ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
}

/* a tile's 64 elements as floats: element e (bit e of bits) the next kept value, else 0 */
static inline void expand64(uint64_t bits, const uint16_t *kept, float *out) {
#if defined(__AVX512VBMI2__) && defined(__AVX512BW__)
    const __m512i lo = _mm512_maskz_expandloadu_epi16((__mmask32)bits, kept);
    const __m512i hi = _mm512_maskz_expandloadu_epi16(
        (__mmask32)(bits >> 32), kept + __builtin_popcount((uint32_t)bits));
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_castsi512_si256(lo)));
    _mm512_storeu_ps(out + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1)));
    _mm512_storeu_ps(out + 32, _mm512_cvtph_ps(_mm512_castsi512_si256(hi)));
    _mm512_storeu_ps(out + 48, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1)));
#else
    memset(out, 0, sizeof(float) * 64);
    for (int k = 0; bits; bits &= bits - 1, k++)
        out[__builtin_ctzll(bits)] = half_to_float(kept[k]);
#endif
}

/* the Mustafar pages' scores of tokens a .. e - 1: each 64-token block's key tiles, one channel
 * after another, scored in lanes */
static inline __attribute__((always_inline)) void mustafar_scores(
    const int n, struct draft_part *w, const struct mustafar_pages *pg, int64_t h, int64_t D,
    float scale, int64_t a, int64_t e) {
    float tile[64] __attribute__((aligned(64)));
    float lanes[MAX_G][64];
    for (int64_t block = a / 64; block * 64 < e; block++) {
        vrow acc[MAX_G][TILE_VECS];
        for (int g = 0; g < n; g++)
            for (int v = 0; v < TILE_VECS; v++)
                acc[g][v] = splat_row(0.0f);
        const int64_t at = (h * pg->num_blocks + block) * D;
        for (int64_t c = 0; c < D; c++) {
            const uint64_t bits = (uint64_t)pg->k_bitmaps[at + c];
            if (!bits)
                continue;
            expand64(reverse64(bits), pg->k_values + pg->k_offsets[at + c], tile);
            for (int g = 0; g < n; g++) {
                const vrow qc = splat_row(w->q[g][c]);
                for (int v = 0; v < TILE_VECS; v++)
                    acc[g][v] = fma_row(qc, load_row(tile + TILE * v), acc[g][v]);
            }
        }
        const int64_t lo = a > block * 64 ? a : block * 64;
        const int64_t hi = e < block * 64 + 64 ? e : block * 64 + 64;
        if (lo == block * 64 && hi == lo + 64) {          /* a whole block: stored as vectors */
            for (int g = 0; g < n; g++)
                for (int v = 0; v < TILE_VECS; v++)
                    put_row(w->s[g] + lo - a + TILE * v, acc[g][v] * splat_row(scale));
            continue;
        }
        for (int g = 0; g < n; g++) {
            for (int v = 0; v < TILE_VECS; v++)
                put_row(lanes[g] + TILE * v, acc[g][v]);
            for (int64_t t = lo; t < hi; t++)
                w->s[g][t - a] = lanes[g][t - block * 64] * scale;
        }
    }
}

/* the Mustafar pages' tokens a .. e - 1 weighed into acc (which they set): 64 dimensions (a
 * value tile of each token) at a time, their sums held in registers over the tokens */
static inline __attribute__((always_inline)) void mustafar_values(
    const int n, struct draft_part *w, const struct mustafar_pages *pg, int64_t h, int64_t D,
    int64_t a, int64_t e) {
    float tile[64] __attribute__((aligned(64)));
    const int64_t tiles = D / 64, tokens = pg->num_blocks * 64;
    for (int64_t j = 0; j < tiles; j++) {
        vrow acc[MAX_G][TILE_VECS];
        for (int g = 0; g < n; g++)
            for (int v = 0; v < TILE_VECS; v++)
                acc[g][v] = splat_row(0.0f);
        for (int64_t t = a; t < e; t++) {
            const int64_t at = (h * tokens + t) * tiles + j;
            const uint64_t bits = (uint64_t)pg->v_bitmaps[at];
            if (!bits)
                continue;
            expand64(reverse64(bits), pg->v_values + pg->v_offsets[at], tile);
            for (int g = 0; g < n; g++) {
                const vrow p = splat_row(w->s[g][t - a]);
                for (int v = 0; v < TILE_VECS; v++)
                    acc[g][v] = fma_row(p, load_row(tile + TILE * v), acc[g][v]);
            }
        }
        for (int g = 0; g < n; g++)
            for (int v = 0; v < TILE_VECS; v++)
                put_row(w->acc[g] + 64 * j + TILE * v, acc[g][v]);
    }
}

/* the Spherical-KV pages' scores of tokens a .. e - 1 (table: n * groups * codes of scratch) */
static inline __attribute__((always_inline)) void spherical_scores(
    const int n, struct draft_part *w, const struct spherical_pages *pg, int64_t page_size,
    int64_t h, int64_t D, float scale, int64_t a, int64_t e, float *table) {
    const int64_t gs = pg->group, G = D / gs, K = pg->codes;
    const float *cb = pg->codebook + h * G * K * gs;
    for (int g = 0; g < n; g++)                          /* q's groups . every codeword */
        for (int64_t j = 0; j < G; j++)
            for (int64_t c = 0; c < K; c++) {
                const float *word = cb + (j * K + c) * gs, *qj = w->q[g] + j * gs;
                v8f dot = splat8(0.0f);
                for (int64_t i = 0; i < gs; i += 8)
                    dot = fma8(*(const v8f *)(qj + i), *(const v8f *)(word + i), dot);
                table[(g * G + j) * K + c] = tree8(dot);
            }
    const float unit = scale / 255.0f;
    const int64_t T = pg->tokens;
    const uint8_t *theta = pg->theta + h * G * T, *radius = pg->radius + h * G * T;
    for (int64_t t = a; t < e;) {
        const int64_t page = t / page_size;
        const int64_t end = e < (page + 1) * page_size ? e : (page + 1) * page_size;
        const float *sc = pg->scale + (h * (T / page_size) + page) * G;
#if defined(__AVX2__)
        for (; t + TILE <= end; t += TILE) {           /* TILE tokens in lanes, tables gathered */
            vrow acc[MAX_G];
            for (int g = 0; g < n; g++)
                acc[g] = splat_row(0.0f);
            for (int64_t j = 0; j < G; j++) {
                const vrowi idx = bytes_row(theta + j * T + t, TILE);
                const vrow r = __builtin_convertvector(bytes_row(radius + j * T + t, TILE), vrow)
                               * sc[j];
                for (int g = 0; g < n; g++) {
                    const float *tg = table + (g * G + j) * K;
#if TILE == 16
                    const vrow look = (vrow)_mm512_i32gather_ps((__m512i)idx, tg, 4);
#else
                    const vrow look = (vrow)_mm256_i32gather_ps(tg, (__m256i)idx, 4);
#endif
                    acc[g] = fma_row(r, look, acc[g]);
                }
            }
            for (int g = 0; g < n; g++)
                put_row(w->s[g] + t - a, acc[g] * splat_row(unit));
        }
#endif
        for (; t < end; t++)                            /* the rest one token at a time */
            for (int g = 0; g < n; g++) {
                float s = 0.0f;
                for (int64_t j = 0; j < G; j++)
                    s = __builtin_fmaf((float)radius[j * T + t] * sc[j],
                                       table[(g * G + j) * K + theta[j * T + t]], s);
                w->s[g][t - a] = s * unit;
            }
    }
}

/* TILE float16 values as floats */
static inline vrow half_row(const uint16_t *h) {
#if TILE == 16
    return (vrow)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#else
    return half8(h);
#endif
}

/* the Spherical-KV pages' float16 values of tokens a .. e - 1 weighed into acc (which they set):
 * 64 dimensions at a time, their sums held in registers over the tokens */
static inline __attribute__((always_inline)) void spherical_values(
    const int n, struct draft_part *w, const struct spherical_pages *pg, int64_t h, int64_t D,
    int64_t a, int64_t e) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        vrow acc[MAX_G][TILE_VECS];
        for (int g = 0; g < n; g++)
            for (int v = 0; v < TILE_VECS; v++)
                acc[g][v] = splat_row(0.0f);
        const uint16_t *x = pg->values + (h * pg->tokens + a) * D + d0;
        for (int64_t t = a; t < e; t++, x += D)
            for (int v = 0; v < TILE_VECS; v++) {
                const vrow xv = half_row(x + TILE * v);
                for (int g = 0; g < n; g++)
                    acc[g][v] = fma_row(splat_row(w->s[g][t - a]), xv, acc[g][v]);
            }
        for (int g = 0; g < n; g++)
            for (int v = 0; v < TILE_VECS; v++)
                put_row(w->acc[g] + d0 + TILE * v, acc[g][v]);
    }
}

PER_HEAD_COUNT(mustafar_scores, (struct draft_part *w, const struct mustafar_pages *pg,
                                 int64_t h, int64_t D, float scale, int64_t a, int64_t e),
               (w, pg, h, D, scale, a, e))
PER_HEAD_COUNT(mustafar_values, (struct draft_part *w, const struct mustafar_pages *pg,
                                 int64_t h, int64_t D, int64_t a, int64_t e), (w, pg, h, D, a, e))
PER_HEAD_COUNT(spherical_scores, (struct draft_part *w, const struct spherical_pages *pg,
                                  int64_t page_size, int64_t h, int64_t D, float scale,
                                  int64_t a, int64_t e, float *table),
               (w, pg, page_size, h, D, scale, a, e, table))
PER_HEAD_COUNT(spherical_values, (struct draft_part *w, const struct spherical_pages *pg,
                                  int64_t h, int64_t D, int64_t a, int64_t e),
               (w, pg, h, D, a, e))
#undef PER_HEAD_COUNT
#undef HEAD_COUNT_FN
#undef UNPAREN

/* One task: n of kv head h's query heads over keys [a, b) of a request's sequence: its pages'
 * tokens first (t < page_tokens; pg: the request's pages in draft's format), then its dense keys
 * (dense key j's slot at off[j]). Sets w->max, w->sum and w->acc. Scratch: qp (MAX_G * 4 * D:
 * quant's scaled queries, Spherical-KV's tables), pw (MAX_G * (b - a)). */
static inline __attribute__((always_inline)) void draft_part_n(
    const int n, struct draft_part *w, const struct draft_pages *draft, const void *pg,
    int64_t page_tokens, const void *k_cache, const void *v_cache, int bf16, const int64_t *off,
    int64_t h, int64_t D, int64_t kv_heads, float scale, float softcap, int64_t a, int64_t b,
    float *qp, float *pw) {
    const int64_t e = b < page_tokens ? b : page_tokens, dense_from = a > e ? a : e;
    const int64_t page_size = draft->page_size;
    const int kind = a < e ? (int)draft->kind : -1;                 /* -1: no page tokens */
#define MUSTAFAR(N) mustafar_scores_##N(w, pg, h, D, scale, a, e)
#define SPHERICAL(N) spherical_scores_##N(w, pg, page_size, h, D, scale, a, e, qp)
    if (kind == DRAFT_MUSTAFAR)
        SWITCH_HEADS(n, MUSTAFAR)
    else if (kind == DRAFT_SPHERICAL)
        SWITCH_HEADS(n, SPHERICAL)
    else if (kind == DRAFT_QUANT)
        page_scores(n, w, pg, page_size, (int)draft->key_bits, h, D, kv_heads, scale, a, e, qp);
#undef MUSTAFAR
#undef SPHERICAL
    dense_scores(n, w, k_cache, bf16, off, page_tokens, h, D, scale, a, dense_from, b);
    part_softmax(n, w, b - a, softcap);
#define MUSTAFAR(N) mustafar_values_##N(w, pg, h, D, a, e)
#define SPHERICAL(N) spherical_values_##N(w, pg, h, D, a, e)
    if (kind == DRAFT_MUSTAFAR)
        SWITCH_HEADS(n, MUSTAFAR)
    else if (kind == DRAFT_SPHERICAL)
        SWITCH_HEADS(n, SPHERICAL)
    else if (kind == DRAFT_QUANT)
        page_values(n, w, pg, (int)draft->value_bits, h, D, kv_heads, a, e, pw);
    else
        for (int g = 0; g < n; g++)
            memset(w->acc[g], 0, sizeof(float) * D);
#undef MUSTAFAR
#undef SPHERICAL
    dense_values(n, w, v_cache, bf16, off, page_tokens, h, D, a, dense_from, b);
}
#undef SWITCH_HEADS

/* Every request of the step one query row (q: [rows, q_token_stride], request r's row r), its
 * dense keys in the paged cache k_cache / v_cache (float32, or bfloat16 bits where bf16) as
 * paged_attention_short reads them (requests: [r] = first row, 1, dense keys; tables), its
 * pages those of draft's row that starts at first (request r's at first + r; no pages: none)
 * -> out [rows, out_token_stride]. Requires head_dim a multiple of 64 (the Python side checks).
 * Returns 0, or -1 where scratch memory failed. */
int draft_attention(const float *q, int64_t q_token_stride, const void *k_cache,
                    const void *v_cache, int bf16, float *out, int64_t out_token_stride,
                    const int64_t *requests, const int64_t *tables, int64_t table_width,
                    int64_t num_reqs, const struct draft_pages *draft, int64_t first,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    float scale, float softcap, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, slot = num_kv_heads * D;
    int64_t longest = 1;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = requests[r * 3 + 2] + draft_page_tokens(draft, first, r);
        longest = n > longest ? n : longest;
    }
    const int64_t heads = num_reqs * num_kv_heads;
    const int64_t parts = heads >= 2 * num_threads ? 1 : (2 * num_threads + heads - 1) / heads;
    const int64_t per_part = G * (D + 2), tasks = heads * parts;
    float *parts_out = malloc(sizeof(float) * tasks * per_part);
    if (!parts_out)
        return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    {
        const int64_t most = ((longest + parts - 1) / parts + 8) & ~(int64_t)7;
        const int64_t n_max = G < MAX_G ? G : MAX_G;
        float *scores = malloc(sizeof(float) * n_max * most);
        float *pw = malloc(sizeof(float) * n_max * most);
        /* quant's scaled queries (D a head), Spherical-KV's tables (groups * codes <= 4 * D:
         * 16-dim groups, 64 codewords) */
        float *qp = malloc(sizeof(float) * MAX_G * 4 * D);
        int64_t *off = malloc(sizeof(int64_t) * (longest + 8));
        if (!scores || !pw || !qp || !off) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed)
                continue;
            const int64_t r = task / (num_kv_heads * parts), h = task / parts % num_kv_heads;
            const int64_t part = task % parts, dense = requests[r * 3 + 2];
            const int64_t page_tokens = draft_page_tokens(draft, first, r);
            const void *pg = page_tokens ? draft_row(draft, first, r) : NULL;
            const int64_t total = dense + page_tokens;
            const int64_t a = total * part / parts, b = total * (part + 1) / parts;
            float *res = parts_out + task * per_part;       /* max [G], sum [G], acc [G, D] */
            if (a == b) {
                for (int64_t g = 0; g < G; g++)
                    res[g] = -INFINITY, res[G + g] = 0.0f;
                continue;
            }
            key_offsets(off, tables + r * table_width, dense, dense, block_size, slot);
            const float *qr = q + requests[r * 3] * q_token_stride + h * G * D;
            for (int64_t g0 = 0; g0 < G; g0 += MAX_G) {
                const int n = (int)(G - g0 < MAX_G ? G - g0 : MAX_G);
                struct draft_part w;
                for (int g = 0; g < n; g++) {
                    w.q[g] = qr + (g0 + g) * D;
                    w.s[g] = scores + g * most;
                    w.acc[g] = res + 2 * G + (g0 + g) * D;
                }
#define PART(N)                                                                                 \
    case N:                                                                                     \
        draft_part_n(N, &w, draft, pg, page_tokens, k_cache, v_cache, bf16, off, h, D,          \
                     num_kv_heads, scale, softcap, a, b, qp, pw);                               \
        break;
                switch (n) {                                  /* a constant count each case */
                    PART(1) PART(2) PART(3) PART(4) PART(5) PART(6) PART(7) PART(8)
                }
#undef PART
                for (int g = 0; g < n; g++)
                    res[g0 + g] = w.max[g], res[G + g0 + g] = w.sum[g];
            }
        }
        free(scores);
        free(pw);
        free(qp);
        free(off);
    }
    if (!failed)
        for (int64_t r = 0; r < num_reqs; r++)     /* the parts merged by their maxima and sums */
            for (int64_t h = 0; h < num_kv_heads; h++)
                for (int64_t g = 0; g < G; g++) {
                    const float *first = parts_out + (r * num_kv_heads + h) * parts * per_part;
                    float m = -INFINITY, total = 0.0f;
                    for (int64_t p = 0; p < parts; p++)
                        m = first[p * per_part + g] > m ? first[p * per_part + g] : m;
                    float *o = out + requests[r * 3] * out_token_stride + (h * G + g) * D;
                    for (int64_t d = 0; d < D; d++)
                        o[d] = 0.0f;
                    for (int64_t p = 0; p < parts; p++) {
                        const float *res = first + p * per_part;
                        if (res[G + g] == 0.0f)
                            continue;
                        const float w = expf(res[g] - m);
                        total += w * res[G + g];
                        for (int64_t d = 0; d < D; d++)
                            o[d] += w * res[2 * G + g * D + d];
                    }
                    for (int64_t d = 0; d < D; d++)
                        o[d] /= total;
                }
    free(parts_out);
    return failed ? -1 : 0;
}
