/* Paged attention for short queries (decodes and verify rows) on the CPU, float32, reading the
 * paged K/V cache in place: no gathered copy of a request's blocks, one call per layer for every
 * short request of the step whatever their shapes.
 *
 * One task per request, or, with fewer requests than threads (one decode), per part of a
 * request's heads, so that the threads share it. A task walks the request's keys once for all
 * its query rows: each block of 8 keys is scored for every row while in the L1 cache (eight dot
 * products side by side in 8-float lanes of the head's dimensions, then summed across lanes
 * together), each row soft-maxed over the keys it sees (causal, within the sliding window), then
 * each chunk of 16 values weighed into every row's sums. A slot's offset is computed once per
 * task, not per key and row.
 *
 * Row invariance, by construction: a query row's output is computed from its own query vector
 * and the keys it sees, in a fixed order (each score: fused multiply-adds in 8 lanes then the
 * tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); the softmax sum in 8 lanes by the key's
 * index mod 8 then the same tree; the values in key order), so it does not depend on how many
 * rows, requests or keys share the call. A verify row therefore computes bit for bit what the
 * decode it replaces would.
 *
 * The cache holds float32, or bfloat16 (`--kv-cache-dtype bfloat16`: half the bytes a token):
 * `paged_attention_short` reads the one, `paged_attention_short_bf16` the other (both written
 * once, in `paged_attention_kv.h`). The bf16 form widens each block of keys (and each chunk of
 * values) of the heads a task reads exactly to float32 into a small scratch in the L1 cache, once
 * for all its rows, and runs the float32 form's arithmetic on it: the same products and sums in
 * the same order, so it computes bit for bit what the float32 form computes over the widened
 * cache, row-invariant alike.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "simd.h"

#define KEYS 8                              /* keys scored together, at indices KEYS * i + l */

static inline float tree8(v8f a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* tree8 of each of a[0..7], as one vector */
static inline v8f tree8x8(const v8f a[8]) {
#if defined(__AVX__)
    const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                              _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8f s;
    for (int i = 0; i < 8; i++)
        s[i] = tree8(a[i]);
    return s;
#endif
}

/* q . K[j0 + i] for i < 8, K[j] at k + off[j] */
static inline v8f scores8(const float *q, const float *k, const int64_t *off, int64_t j0,
                          int64_t head_dim) {
    const float *kp[KEYS];
    v8f acc[KEYS];
    for (int i = 0; i < KEYS; i++) {
        kp[i] = k + off[j0 + i];
        acc[i] = splat8(0.0f);
    }
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 8) {
        const v8f qv = *(const v8f *)(q + d);
        for (int i = 0; i < KEYS; i++)
            acc[i] = fma8(qv, *(const v8f *)(kp[i] + d), acc[i]);
    }
    v8f s = tree8x8(acc);
    for (int64_t d = lanes; d < head_dim; d++)            /* dimensions past the lanes, in order */
        for (int i = 0; i < KEYS; i++)
            s[i] += q[d] * kp[i][d];
    return s;
}

/* scores8 for two query rows at once against the same keys (each key's vector loaded once for
 * both): each row's products and sums are scores8's, in its order, so each row's scores are bit
 * for bit what scores8 gives it alone */
static inline void scores8x2(const float *qa, const float *qb, const float *k, const int64_t *off,
                             int64_t j0, int64_t head_dim, float scale, float *sa, float *sb) {
    const float *kp[KEYS];
    v8f acc_a[KEYS], acc_b[KEYS];
    for (int i = 0; i < KEYS; i++) {
        kp[i] = k + off[j0 + i];
        acc_a[i] = splat8(0.0f);
        acc_b[i] = splat8(0.0f);
    }
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 8) {
        const v8f qav = *(const v8f *)(qa + d), qbv = *(const v8f *)(qb + d);
        for (int i = 0; i < KEYS; i++) {
            const v8f kv = *(const v8f *)(kp[i] + d);
            acc_a[i] = fma8(qav, kv, acc_a[i]);
            acc_b[i] = fma8(qbv, kv, acc_b[i]);
        }
    }
    v8f a = tree8x8(acc_a), b = tree8x8(acc_b);
    for (int64_t d = lanes; d < head_dim; d++)
        for (int i = 0; i < KEYS; i++) {
            a[i] += qa[d] * kp[i][d];
            b[i] += qb[d] * kp[i][d];
        }
    *(v8f *)sa = a * scale;
    *(v8f *)sb = b * scale;
}

/* acc[0 .. 8 * nv) += p[j] * V[j] for keys lo..hi in order, V[j] at v + off[j]: a row's
 * weighted sum continued over a chunk of keys (registers in, the same chain of fused
 * multiply-adds as one pass over all its keys) */
static inline __attribute__((always_inline)) void weigh8(const float *p, const float *v,
                                                         const int64_t *off, int64_t lo,
                                                         int64_t hi, float *acc_mem,
                                                         const int nv) {
    v8f acc[8];
    for (int c = 0; c < nv; c++)
        acc[c] = *(const v8f *)(acc_mem + 8 * c);
    for (int64_t j = lo; j <= hi; j++) {
        const v8f pj = splat8(p[j]);
        const float *vj = v + off[j];
        for (int c = 0; c < nv; c++)
            acc[c] = fma8(pj, *(const v8f *)(vj + 8 * c), acc[c]);
    }
    for (int c = 0; c < nv; c++)
        *(v8f *)(acc_mem + 8 * c) = acc[c];
}

static void weigh(const float *p, const float *v, const int64_t *off, int64_t lo, int64_t hi,
                  int64_t head_dim, float *acc) {
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 64) {
        switch ((lanes - d) / 8 < 8 ? (lanes - d) / 8 : 8) {   /* a constant count each case */
        case 8: weigh8(p, v + d, off, lo, hi, acc + d, 8); break;
        case 7: weigh8(p, v + d, off, lo, hi, acc + d, 7); break;
        case 6: weigh8(p, v + d, off, lo, hi, acc + d, 6); break;
        case 5: weigh8(p, v + d, off, lo, hi, acc + d, 5); break;
        case 4: weigh8(p, v + d, off, lo, hi, acc + d, 4); break;
        case 3: weigh8(p, v + d, off, lo, hi, acc + d, 3); break;
        case 2: weigh8(p, v + d, off, lo, hi, acc + d, 2); break;
        default: weigh8(p, v + d, off, lo, hi, acc + d, 1); break;
        }
    }
    for (int64_t d = lanes; d < head_dim; d++)            /* dimensions past the lanes */
        for (int64_t j = lo; j <= hi; j++)
            acc[d] += p[j] * v[off[j] + d];
}

/* weigh8 for two rows over the same keys lo..hi (each value vector loaded once for both): each
 * row's chain of fused multiply-adds is weigh8's */
static inline __attribute__((always_inline)) void weigh8x2(const float *pa, const float *pb,
                                                           const float *v, const int64_t *off,
                                                           int64_t lo, int64_t hi, float *acc_a,
                                                           float *acc_b, const int nv) {
    v8f a[8], b[8];
    for (int c = 0; c < nv; c++) {
        a[c] = *(const v8f *)(acc_a + 8 * c);
        b[c] = *(const v8f *)(acc_b + 8 * c);
    }
    for (int64_t j = lo; j <= hi; j++) {
        const v8f paj = splat8(pa[j]), pbj = splat8(pb[j]);
        const float *vj = v + off[j];
        for (int c = 0; c < nv; c++) {
            const v8f vv = *(const v8f *)(vj + 8 * c);
            a[c] = fma8(paj, vv, a[c]);
            b[c] = fma8(pbj, vv, b[c]);
        }
    }
    for (int c = 0; c < nv; c++) {
        *(v8f *)(acc_a + 8 * c) = a[c];
        *(v8f *)(acc_b + 8 * c) = b[c];
    }
}

/* weigh for two rows whose keys are lo_a..hi_a and lo_b..hi_b: the keys both see together, the
 * rest row by row; each row still takes its keys in order, so each row's sums are weigh's */
static void weigh2(const float *pa, const float *pb, const float *v, const int64_t *off,
                   int64_t lo_a, int64_t hi_a, int64_t lo_b, int64_t hi_b, int64_t head_dim,
                   float *acc_a, float *acc_b) {
    const int64_t lo = lo_a > lo_b ? lo_a : lo_b, hi = hi_a < hi_b ? hi_a : hi_b;
    if (lo > hi) {
        if (lo_a <= hi_a)
            weigh(pa, v, off, lo_a, hi_a, head_dim, acc_a);
        if (lo_b <= hi_b)
            weigh(pb, v, off, lo_b, hi_b, head_dim, acc_b);
        return;
    }
    if (lo_a < lo)
        weigh(pa, v, off, lo_a, lo - 1, head_dim, acc_a);
    if (lo_b < lo)
        weigh(pb, v, off, lo_b, lo - 1, head_dim, acc_b);
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 64) {
        switch ((lanes - d) / 8 < 8 ? (lanes - d) / 8 : 8) {   /* a constant count each case */
        case 8: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 8); break;
        case 7: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 7); break;
        case 6: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 6); break;
        case 5: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 5); break;
        case 4: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 4); break;
        case 3: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 3); break;
        case 2: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 2); break;
        default: weigh8x2(pa, pb, v + d, off, lo, hi, acc_a + d, acc_b + d, 1); break;
        }
    }
    for (int64_t d = lanes; d < head_dim; d++)            /* dimensions past the lanes */
        for (int64_t j = lo; j <= hi; j++) {
            acc_a[d] += pa[j] * v[off[j] + d];
            acc_b[d] += pb[j] * v[off[j] + d];
        }
    if (hi_a > hi)
        weigh(pa, v, off, hi + 1, hi_a, head_dim, acc_a);
    if (hi_b > hi)
        weigh(pb, v, off, hi + 1, hi_b, head_dim, acc_b);
}

/* a row's scores (keys first..end-1, in place) -> e^(s - max) over lo..hi, 0 elsewhere; returns
 * 1 / their sum */
static float softmax_row(float *scores, int64_t first, int64_t end, int64_t lo, int64_t hi,
                         float softcap) {
    if (softcap > 0.0f)
        for (int64_t j = lo; j <= hi; j++)
            scores[j] = tanhf(scores[j] / softcap) * softcap;
    const v8i iota = {0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t lo32 = (int32_t)lo, hi32 = (int32_t)hi;
    const v8i lo8 = {lo32, lo32, lo32, lo32, lo32, lo32, lo32, lo32};
    const v8i hi8 = {hi32, hi32, hi32, hi32, hi32, hi32, hi32, hi32};
    v8f most = splat8(scores[lo]);                 /* the maximum by lane (exact in any order) */
    for (int64_t j0 = first; j0 < end; j0 += KEYS) {
        const int32_t at = (int32_t)j0;
        const v8i key = iota + (v8i){at, at, at, at, at, at, at, at};
        const v8i seen = (key >= lo8) & (key <= hi8);
        const v8f s = *(const v8f *)(scores + j0);
        const v8i more = seen & (s > most);
        most = (v8f)(((v8i)s & more) | ((v8i)most & ~more));
    }
    float m = most[0];
    for (int l = 1; l < 8; l++)
        m = most[l] > m ? most[l] : m;
    v8f sum = splat8(0.0f);
    for (int64_t j0 = first; j0 < end; j0 += KEYS) {      /* summed by lane: key index mod 8 */
        const int32_t at = (int32_t)j0;
        const v8i key = iota + (v8i){at, at, at, at, at, at, at, at};
        const v8f e = (v8f)((v8i)exp8(*(v8f *)(scores + j0) - m) & (key >= lo8) & (key <= hi8));
        *(v8f *)(scores + j0) = e;
        sum += e;
    }
    return 1.0f / tree8(sum);
}

/* off[j]: the element offset of key j's slot for j < padded, keys past seq_len repeating the
 * last key's */
static void key_offsets(int64_t *off, const int64_t *table, int64_t seq_len, int64_t padded,
                        int64_t block_size, int64_t slot_elems) {
    for (int64_t j = 0; j < padded; j++) {
        const int64_t key = j < seq_len ? j : seq_len - 1;
        off[j] = (table[key / block_size] * block_size + key % block_size) * slot_elems;
    }
}

/* the first key the query at `pos` sees: within the sliding window (0: none) */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

#define CHUNK 16                      /* keys whose values every row weighs in turn (in L1) */
#define SCORES_IN_CACHE (64 * 1024)   /* floats of a task's scores kept in the L2 cache */
#define AHEAD 16                                /* keys ahead whose slots are requested early */

/* bfloat16 K/V: the top 16 bits of a float32, widened exactly by a shift */
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));

static inline v8f widen8_bf16(const uint16_t *p) {
#if defined(__AVX2__)
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
    return (v8f)(__builtin_convertvector(*(const v8h *)p, v8u) << 16);
#endif
}

#if defined(__AVX512F__)
static inline __m512 widen16_bf16(const uint16_t *p) {          /* widen8_bf16, 16 at a time */
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

/* fp8 (e4m3) K/V, `--kv-cache-dtype fp8`: sign, 4 exponent bits (bias 7), 3 mantissa bits, no
 * infinities. Its bits below the sign, shifted left by 7, are a float16 worth exactly 2^-8 of it
 * (subnormals included: both formats' subnormals sit at the bottom of the same exponent range,
 * 8 binades apart), so a float16 conversion and a multiplication by 256 widen it exactly. */
static inline v8f widen8_fp8(const uint8_t *p) {
#if defined(__F16C__) && defined(__AVX2__)
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    return (v8f)_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
#else
    v8f f;
    for (int i = 0; i < 8; i++) {
        const int m = p[i] & 0x7f, e = m >> 3;
        const float mag = e ? ldexpf(1.0f + (float)(m & 7) / 8.0f, e - 7)
                            : ldexpf((float)(m & 7), -9);
        f[i] = p[i] & 0x80 ? -mag : mag;   /* 0x7f / 0xff (NaN) widen to 480: never written */
    }
    return f;
#endif
}

#if defined(__AVX512F__)
static inline __m512 widen16_fp8(const uint8_t *p) {            /* widen8_fp8, 16 at a time */
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
#define STAGE16(form)                                                                         \
    for (; d + 16 <= lanes; d += 16)                                                            \
        _mm512_storeu_ps(dst + d, widen16_##form(src + d));
#else
#define STAGE16(form)
#endif

/* stage_<form>: keys from .. from + n - 1 (key j's slot at cache + off[j]), `used` elements of
 * each from `skip` on (the kv heads a task reads), widened to float32 at to + i * used (a slot's
 * elements past a multiple of 8 through an 8-element copy) */
#define DEFINE_STAGE(form, T)                                                                   \
    static void stage_##form(const T *cache, const int64_t *off, int64_t from, int64_t n,       \
                             int64_t skip, int64_t used, float *to) {                           \
        const int64_t lanes = used & ~(int64_t)7;                                               \
        for (int64_t i = 0; i < n; i++) {                                                       \
            const T *src = cache + off[from + i] + skip;                                        \
            float *dst = to + i * used;                                                         \
            int64_t d = 0;                                                                      \
            STAGE16(form)                                                                       \
            for (; d < lanes; d += 8)                                                           \
                *(v8f *)(dst + d) = widen8_##form(src + d);                                     \
            if (lanes < used) {                                                                 \
                T tail[8] = {0};                                                                \
                memcpy(tail, src + lanes, sizeof(T) * (used - lanes));                          \
                const v8f w = widen8_##form(tail);                                              \
                memcpy(dst + lanes, &w, sizeof(float) * (used - lanes));                        \
            }                                                                                   \
        }                                                                                       \
    }

DEFINE_STAGE(bf16, uint16_t)
DEFINE_STAGE(fp8, uint8_t)

#define TILE_MIN_ROWS 4          /* a request of this many query rows or more: rows in lanes */

/* Rows in lanes: TILE query rows of one head (consecutive positions) held across a vector's
 * lanes, for prompt chunks (`attend_tiles`). Each lane computes what its row computes in
 * `attend_request`, operation for operation: a score's eight partial sums over the dimensions
 * d = l mod 8 (the same fused multiply-adds in the same order) summed by the same tree; the
 * softmax's maximum, exponentials and its sum by key index mod 8; each value dimension's chain of
 * fused multiply-adds in key order. Only which lanes hold what changes, so a prompt row computes
 * bit for bit what the decode at its position computes. */
#if defined(__AVX512F__)
#define TILE 16
typedef float vrow __attribute__((vector_size(64), aligned(4)));
typedef int32_t vrowi __attribute__((vector_size(64), aligned(4)));
static inline vrow fma_row(vrow a, vrow b, vrow c) {
    return (vrow)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#else
#define TILE 8
typedef v8f vrow;
typedef v8i vrowi;
static inline vrow fma_row(vrow a, vrow b, vrow c) {
    return fma8(a, b, c);
}
#endif

static inline vrow splat_row(float x) {
#if TILE == 16
    return (vrow)_mm512_set1_ps(x);
#else
    return splat8(x);
#endif
}

static inline vrowi splat_rowi(int32_t x) {
#if TILE == 16
    return (vrowi)_mm512_set1_epi32(x);
#else
    return (v8i){x, x, x, x, x, x, x, x};
#endif
}

#if TILE == 16
DEFINE_EXP(exp_row, vrow, vrowi)                  /* exp8's operations, lane for lane */
#else
static inline vrow exp_row(vrow x) {
    return exp8(x);
}
#endif

/* the scores of TILE rows (qt: their queries, dimension-major, qt[d * TILE + row]) against two
 * keys ka, kb, times scale, into sa, sb (TILE floats each) */
static inline void tile_scores2(const float *qt, const float *ka, const float *kb,
                                int64_t head_dim, float scale, float *sa, float *sb) {
    vrow pa[8], pb[8];
    for (int l = 0; l < 8; l++)
        pa[l] = pb[l] = splat_row(0.0f);
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 8)
        for (int l = 0; l < 8; l++) {
            vrow qv = *(const vrow *)(qt + (d + l) * TILE);
            __asm__("" : "+v"(qv));             /* one load for both keys (not one each) */
            pa[l] = fma_row(qv, splat_row(ka[d + l]), pa[l]);
            pb[l] = fma_row(qv, splat_row(kb[d + l]), pb[l]);
        }
    vrow a = ((pa[0] + pa[1]) + (pa[2] + pa[3])) + ((pa[4] + pa[5]) + (pa[6] + pa[7]));
    vrow b = ((pb[0] + pb[1]) + (pb[2] + pb[3])) + ((pb[4] + pb[5]) + (pb[6] + pb[7]));
    for (int64_t d = lanes; d < head_dim; d++) {
        const vrow qv = *(const vrow *)(qt + d * TILE);
        a = a + qv * ka[d];
        b = b + qv * kb[d];
    }
    *(vrow *)sa = a * scale;
    *(vrow *)sb = b * scale;
}

/* weigh for four rows whose score columns are p + i (stride TILE, key j at (j - base) * TILE):
 * keys lo..hi all four see, nv vectors of W dimensions from v + off[j] (W: 8 for v8f, TILE
 * for vrow; nv <= 4), into acc[i] */
#define WEIGH_TILE4(name, vec, W, splat, fma)                                                    \
    static inline __attribute__((always_inline)) void name(                                     \
        const float *p, int64_t base, const float *v, const int64_t *off, int64_t lo,            \
        int64_t hi, float *const acc[4], const int nv) {                                         \
        vec a[4][4];                                                                             \
        for (int i = 0; i < 4; i++)                                                              \
            for (int c = 0; c < nv; c++)                                                         \
                a[i][c] = *(const vec *)(acc[i] + W * c);                                        \
        for (int64_t j = lo; j <= hi; j++) {                                                     \
            const float *pj = p + (j - base) * TILE;                                             \
            const float *vj = v + off[j];                                                        \
            vec vv[4];                                                                           \
            for (int c = 0; c < nv; c++)                                                         \
                vv[c] = *(const vec *)(vj + W * c);                                              \
            for (int i = 0; i < 4; i++) {                                                        \
                const vec pij = splat(pj[i]);                                                    \
                for (int c = 0; c < nv; c++)                                                     \
                    a[i][c] = fma(pij, vv[c], a[i][c]);                                          \
            }                                                                                    \
        }                                                                                        \
        for (int i = 0; i < 4; i++)                                                              \
            for (int c = 0; c < nv; c++)                                                         \
                *(vec *)(acc[i] + W * c) = a[i][c];                                              \
    }
WEIGH_TILE4(weigh_tile4, v8f, 8, splat8, fma8)
WEIGH_TILE4(weigh_tile4_wide, vrow, TILE, splat_row, fma_row)

/* one row's weigh over keys lo..hi from a tile's score column (stride TILE) */
static void weigh_column(const float *p, int64_t base, const float *v, const int64_t *off,
                         int64_t lo, int64_t hi, int64_t head_dim, float *acc) {
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 8) {
        v8f a = *(const v8f *)(acc + d);
        for (int64_t j = lo; j <= hi; j++)
            a = fma8(splat8(p[(j - base) * TILE]), *(const v8f *)(v + off[j] + d), a);
        *(v8f *)(acc + d) = a;
    }
    for (int64_t d = lanes; d < head_dim; d++)
        for (int64_t j = lo; j <= hi; j++)
            acc[d] += p[(j - base) * TILE] * v[off[j] + d];
}

/* weigh for the first `rows` rows of a tile, 4 at a time: the keys all four see together
 * (dimensions in vectors), the rest row by row; each row takes its keys in order, dimension by
 * dimension as weigh does */
static void weigh_tile(const float *p, int64_t base, const float *v, const int64_t *off,
                       const int64_t *lo, const int64_t *hi, int rows, int64_t head_dim,
                       float *acc) {
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int i = rows & ~3; i < rows; i++)                     /* past the fours: one by one */
        if (lo[i] <= hi[i])
            weigh_column(p + i, base, v, off, lo[i], hi[i], head_dim, acc + i * head_dim);
    for (int i0 = 0; i0 + 4 <= rows; i0 += 4) {
        int64_t clo = lo[i0], chi = hi[i0];
        for (int i = i0 + 1; i < i0 + 4; i++) {
            clo = lo[i] > clo ? lo[i] : clo;
            chi = hi[i] < chi ? hi[i] : chi;
        }
        if (clo > chi) {
            for (int i = i0; i < i0 + 4; i++)
                if (lo[i] <= hi[i])
                    weigh_column(p + i, base, v, off, lo[i], hi[i], head_dim,
                                 acc + i * head_dim);
            continue;
        }
        for (int i = i0; i < i0 + 4; i++)
            if (lo[i] < clo)
                weigh_column(p + i, base, v, off, lo[i], clo - 1, head_dim, acc + i * head_dim);
        /* dimensions in vectors of TILE floats, 4 at a time, then one of 8 where left: each
         * dimension a lane of a fused multiply-add, as weigh's 8-float vectors */
        const int64_t wide = head_dim & ~(int64_t)(TILE - 1);
        for (int64_t d = 0, step; d < lanes; d += step) {
            step = d >= wide ? 8 : wide - d < 4 * TILE ? wide - d : 4 * TILE;
            float *const a[4] = {acc + i0 * head_dim + d, acc + (i0 + 1) * head_dim + d,
                                 acc + (i0 + 2) * head_dim + d, acc + (i0 + 3) * head_dim + d};
            if (d >= wide) {
                weigh_tile4(p + i0, base, v + d, off, clo, chi, a, 1);
                continue;
            }
            switch ((wide - d) / TILE < 4 ? (wide - d) / TILE : 4) {
            case 4: weigh_tile4_wide(p + i0, base, v + d, off, clo, chi, a, 4); break;
            case 3: weigh_tile4_wide(p + i0, base, v + d, off, clo, chi, a, 3); break;
            case 2: weigh_tile4_wide(p + i0, base, v + d, off, clo, chi, a, 2); break;
            default: weigh_tile4_wide(p + i0, base, v + d, off, clo, chi, a, 1); break;
            }
        }
        for (int i = i0; i < i0 + 4; i++)
            for (int64_t d = lanes; d < head_dim; d++)
                for (int64_t j = clo; j <= chi; j++)
                    acc[i * head_dim + d] += p[(j - base) * TILE + i] * v[off[j] + d];
        for (int i = i0; i < i0 + 4; i++)
            if (hi[i] > chi)
                weigh_column(p + i, base, v, off, chi + 1, hi[i], head_dim, acc + i * head_dim);
    }
}

#define KV_T float
#define KV_(name) name
#define KV_STAGED 0
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_
#undef KV_STAGED

#define KV_T uint16_t
#define KV_(name) name##_bf16
#define KV_STAGED 1
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_
#undef KV_STAGED

#define KV_T uint8_t
#define KV_(name) name##_fp8
#define KV_STAGED 1
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_
#undef KV_STAGED
