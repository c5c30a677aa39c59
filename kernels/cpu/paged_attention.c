/* Paged attention for short queries (decodes and verify rows) on the CPU, float32, reading the
 * paged K/V cache in place: no gathered copy of a request's blocks, one call per layer for every
 * short request of the step whatever their shapes.
 *
 * One task per request, or, with fewer requests than threads (one decode), per part of a
 * request's heads, so that the threads share it. A task walks the request's keys once for all
 * its query rows, the rows of a kv head up to GROUP_ROWS at a time: each block of 8 keys is
 * scored for those rows together (each key's vector loaded once for them; with AVX-512, two
 * keys' 8 lanes in one 16-float vector), each row soft-maxed over the keys it sees (causal,
 * within the sliding window), then each chunk of 16 values weighed into those rows' sums
 * together. A slot's offset is computed once per task, not per key and row.
 *
 * Row invariance, by construction: a query row's output is computed from its own query vector
 * and the keys it sees, in a fixed order (each score: fused multiply-adds in 8 lanes then the
 * tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); the softmax sum in 8 lanes by the key's
 * index mod 8 then the same tree; the values in key order), so it does not depend on how many
 * rows, requests or keys share the call. A verify row therefore computes bit for bit what the
 * decode it replaces would.
 *
 * The cache holds float32, bfloat16 or fp8 e4m3 (`--kv-cache-dtype`: a half or a quarter of
 * the bytes a token): `paged_attention_short` reads the one, `paged_attention_short_bf16` and
 * `_fp8` the others (all written once, in `paged_attention_kv.h`; where the build has
 * AVX512-BF16, `paged_attention_short_bf16` is `paged_attention_dot.h`'s form, on the bf16
 * dot-product units, and this file's bf16 form `paged_attention_short_bf16w` serves the head
 * sizes that one does not take). The narrow forms here widen each
 * value exactly to float32 in registers, once for all the rows that read it (prompt tiles: into
 * a small scratch in the L1 cache), and run the float32 form's arithmetic on it: the same
 * products and sums in the same order, so they compute bit for bit what the float32 form
 * computes over the widened cache, row-invariant alike.
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

/* off[j]: the element offset of key j's slot for j < padded, keys past seq_len repeating the
 * last key's */
static void key_offsets(int64_t *off, const int64_t *table, int64_t seq_len, int64_t padded,
                        int64_t block_size, int64_t slot_elems) {
    int64_t j = 0;
    for (int64_t b = 0; j < seq_len; b++)
        for (int64_t i = 0, base = table[b] * block_size; i < block_size && j < seq_len; i++)
            off[j++] = (base + i) * slot_elems;
    for (; j < padded; j++)
        off[j] = off[seq_len - 1];
}

/* the first key the query at `pos` sees: within the sliding window (0: none) */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

#define CHUNK 16                      /* keys whose values every row weighs in turn (in L1) */
/* floats of a task's scores kept in the L2 cache (1.5 MiB). Parts per kv head keep a task's
 * scores small, but 3 kv heads on 2 threads leave one idle a third of the time: a 9-row verify
 * at 2.8K keys took 22.3-22.9 ms in 3 tasks, 20.2-21.3 in 2 (SmolLM2's shape, 2 threads,
 * benchmarks/attention_chunk.py --rows 9), at 7K 56-58 against 52-53 */
#define SCORES_IN_CACHE (384 * 1024)
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
static inline __m512 widen16_bf16_bits(__m256i w) {            /* widen8_bf16, 16 at a time */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}

static inline __m512 widen16_bf16(const uint16_t *p) {
    return widen16_bf16_bits(_mm256_loadu_si256((const __m256i *)p));
}
#endif

static inline float widen1_bf16(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp8 (e4m3) K/V, `--kv-cache-dtype fp8`: sign, 4 exponent bits (bias 7), 3 mantissa bits, no
 * infinities. Its bits below the sign, shifted left by 7, are a float16 worth exactly 2^-8 of it
 * (subnormals included: both formats' subnormals sit at the bottom of the same exponent range,
 * 8 binades apart), so a float16 conversion and a multiplication by 256 widen it exactly. The
 * vector forms sign-extend each byte to 16 bits and shift it left by 7: the sign lands in bits
 * 15 and 14, the rest in bits 13..7; clearing bit 14 leaves that float16. */
#define FP8_TO_HALF ((short)0xbfff)
static inline float widen1_fp8(uint8_t x) {
    const int m = x & 0x7f, e = m >> 3;
    const float mag = e ? ldexpf(1.0f + (float)(m & 7) / 8.0f, e - 7) : ldexpf((float)(m & 7), -9);
    return x & 0x80 ? -mag : mag;          /* 0x7f / 0xff (NaN) widen to 480: never written */
}

/* 2^-8 of 8 fp8 values (exactly) */
static inline v8f small8_fp8(const uint8_t *p) {
#if defined(__F16C__) && defined(__AVX2__)
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return (v8f)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(FP8_TO_HALF)));
#else
    v8f f;
    for (int i = 0; i < 8; i++)
        f[i] = widen1_fp8(p[i]) * 0x1p-8f;
    return f;
#endif
}

static inline v8f widen8_fp8(const uint8_t *p) {
    return small8_fp8(p) * 256.0f;
}

#if defined(__AVX512F__)
static inline __m512 small16_fp8(__m128i bytes) {               /* small8_fp8, 16 at a time */
    const __m256i b = _mm256_cvtepi8_epi16(bytes);
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7),
                                            _mm256_set1_epi16(FP8_TO_HALF)));
}

static inline __m512 widen16_fp8(const uint8_t *p) {            /* widen8_fp8, 16 at a time */
    return _mm512_mul_ps(small16_fp8(_mm_loadu_si128((const __m128i *)p)), _mm512_set1_ps(256.0f));
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

/* A request of this many query rows or more (prompt chunks, long verify passes) runs rows in
 * lanes, a shorter one (decodes, verify passes of up to 9 rows: n-gram's, lossy_kv's k = 8)
 * row by row. The embedded model's shape at 2.8K tokens of context, 30 layers
 * (`benchmarks/attention_chunk.py`, results/cpu/attention/rows-2800.txt): 5 rows row by row
 * 16.2 ms against 33.4 in 16-lane tiles over float32, 13.2 against 26.8 over bf16, 17.0 against
 * 23.1 over fp8; 9 rows 22.3 against 35.3, 22.8 against 28.7, but 29.9 against 25.2 over fp8
 * (each group of rows widens the keys again). So the fp8 form tiles from 9 rows (26.1-26.5 ms
 * against 30.5-30.6 row by row; 8 rows even, 27.5-28.4 either way: results/cpu/attention/
 * fp8-rows-2800.txt). */
#define TILE_MIN_ROWS 10
#define TILE_MIN_ROWS_FP8 9

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

/* The decode rows' loads (`attend_request`), each form widening exactly to float32 in registers,
 * UNIT_<form> times smaller: loadrow_<form>, TILE consecutive values (of a value vector);
 * loadpair_<form>(a, b), 8 values from a then, with TILE 16, 8 from b (two keys' score lanes in
 * one vector: KP keys a vector). widen1_<form>: one value, full size. The rows multiply their
 * queries and probabilities by UNIT (a power of 2: exact), so every product is the same. */
#define KP (TILE / 8)
#define GROUP_ROWS (KP + 1)        /* rows of a kv head scored and weighed together, at most */
/* rows a head of the scratch qt holds: a tile's queries, or a row task's (KP copies each) */
#define QT_ROWS (KP * (TILE_MIN_ROWS - 1) > TILE ? KP * (TILE_MIN_ROWS - 1) : TILE)

static inline float widen1(float x) {
    return x;
}

#define UNIT 1.0f
#define UNIT_bf16 1.0f
#define UNIT_fp8 256.0f         /* fp8's loads: a float16 conversion, without the x256 */

#if TILE == 16
static inline vrow loadrow(const float *p) {
    return *(const vrow *)p;
}

static inline vrow loadrow_bf16(const uint16_t *p) {
    return (vrow)widen16_bf16(p);
}

static inline vrow loadrow_fp8(const uint8_t *p) {
    return (vrow)small16_fp8(_mm_loadu_si128((const __m128i *)p));
}

static inline vrow loadpair(const float *a, const float *b) {
    const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
    return (vrow)_mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(b)),
                                                     1));
}

static inline vrow loadpair_bf16(const uint16_t *a, const uint16_t *b) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)a);
    return (vrow)widen16_bf16_bits(_mm256_inserti128_si256(
        _mm256_castsi128_si256(lo), _mm_loadu_si128((const __m128i *)b), 1));
}

static inline vrow loadpair_fp8(const uint8_t *a, const uint8_t *b) {
    return (vrow)small16_fp8(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                                _mm_loadl_epi64((const __m128i *)b)));
}

/* the two keys' 8 lanes of a loadpair-shaped vector */
static inline void split_pair(vrow x, v8f *a, v8f *b) {
    *a = (v8f)_mm512_castps512_ps256((__m512)x);
    *b = (v8f)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)x), 1));
}
#else
static inline vrow loadrow(const float *p) {
    return *(const v8f *)p;
}

static inline vrow loadrow_bf16(const uint16_t *p) {
    return widen8_bf16(p);
}

static inline vrow loadrow_fp8(const uint8_t *p) {
    return small8_fp8(p);
}

#define loadpair(a, b) loadrow(a)
#define loadpair_bf16(a, b) loadrow_bf16(a)
#define loadpair_fp8(a, b) loadrow_fp8(a)
#endif

/* the scores of TILE rows (qt: their queries, dimension-major, qt[d * TILE + row]) against four
 * keys k[0..3], times scale, into s[0..3] (TILE floats each). Each row's score is what its row
 * computes in `attend_request`: eight partial sums over d = l + 8 m (fused multiply-adds in that
 * order), summed by ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), then the dimensions past
 * the lanes in order, then the scale. The partial sums are built two at a time and summed into
 * the tree as they complete (16 live accumulators for four keys), so each query vector is loaded
 * once for four keys: 512 rows over 2.8K keys 22.3 -> 18.6-19.1 ms a layer on two threads against
 * two keys a load (`benchmarks/attention_chunk.py --rows 512`). */
static inline void tile_scores4(const float *qt, const float *const k[4], int64_t head_dim,
                                float scale, float *const s[4]) {
    const int64_t lanes = head_dim & ~(int64_t)7;
    vrow half[4], t[4];                            /* (p0 + p1) + (p2 + p3) ; p4 + p5 */
    for (int l = 0; l < 8; l += 2) {
        vrow pa[4], pb[4];
        for (int i = 0; i < 4; i++)
            pa[i] = pb[i] = splat_row(0.0f);
        for (int64_t d = l; d < lanes; d += 8) {
            vrow qa = *(const vrow *)(qt + d * TILE), qb = *(const vrow *)(qt + (d + 1) * TILE);
            __asm__("" : "+v"(qa), "+v"(qb));     /* one load each for the four keys */
            for (int i = 0; i < 4; i++) {
                pa[i] = fma_row(qa, splat_row(k[i][d]), pa[i]);
                pb[i] = fma_row(qb, splat_row(k[i][d + 1]), pb[i]);
            }
        }
        for (int i = 0; i < 4; i++) {
            const vrow pair = pa[i] + pb[i];
            if (l == 0 || l == 4)
                t[i] = pair;
            else if (l == 2)
                half[i] = t[i] + pair;
            else
                t[i] = half[i] + (t[i] + pair);
        }
    }
    for (int i = 0; i < 4; i++) {
        vrow a = lanes ? t[i] : splat_row(0.0f);
        for (int64_t d = lanes; d < head_dim; d++)
            a = a + *(const vrow *)(qt + d * TILE) * k[i][d];
        *(vrow *)s[i] = a * scale;
    }
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

#if TILE == 16
/* tree8x8 of the 8 keys of four loadpair-shaped vectors (key 2p in lanes 0-7 of x[p], key 2p + 1
 * in lanes 8-15), with the same sums: adjacent lanes, then adjacent pair sums, then the two
 * halves, each level one addition of the even and the odd lanes */
static inline v8f tree8_pairs(const vrow x[4]) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2,
                                          0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#define PAIRS(a, b) _mm512_add_ps(_mm512_permutex2var_ps(a, even, b),                          \
                                  _mm512_permutex2var_ps(a, odd, b))
    const __m512 u0 = PAIRS((__m512)x[0], (__m512)x[1]), u1 = PAIRS((__m512)x[2], (__m512)x[3]);
    const __m512 v = PAIRS(u0, u1);
#undef PAIRS
    const __m512 w = _mm512_add_ps(_mm512_permutexvar_ps(even, v), _mm512_permutexvar_ps(odd, v));
    return (v8f)_mm512_castps512_ps256(w);
}
#endif

/* a row's scores (keys first..end-1, in place) -> e^(s - max) over lo..hi, 0 elsewhere; returns
 * 1 / their sum (and the max at *max_out, where not NULL) */
static float softmax_row(float *scores, int64_t first, int64_t end, int64_t lo, int64_t hi,
                         float softcap, float *max_out) {
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
    if (max_out)
        *max_out = m;
    v8f sum = splat8(0.0f);                               /* summed by lane: key index mod 8 */
    int64_t j0 = first;
#if TILE == 16
    /* 16 exponentials at a time (exp8's operations, lane for lane), each half added in turn */
    const vrowi iota16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (; j0 + 16 <= end; j0 += 16) {
        const vrowi key = iota16 + splat_rowi((int32_t)j0);
        const vrowi seen = (key >= splat_rowi(lo32)) & (key <= splat_rowi(hi32));
        const vrow e = (vrow)((vrowi)exp_row(*(vrow *)(scores + j0) - m) & seen);
        *(vrow *)(scores + j0) = e;
        v8f low, high;
        split_pair(e, &low, &high);
        sum += low;
        sum += high;
    }
#endif
    for (; j0 < end; j0 += KEYS) {
        const int32_t at = (int32_t)j0;
        const v8i key = iota + (v8i){at, at, at, at, at, at, at, at};
        const v8f e = (v8f)((v8i)exp8(*(v8f *)(scores + j0) - m) & (key >= lo8) & (key <= hi8));
        *(v8f *)(scores + j0) = e;
        sum += e;
    }
    return 1.0f / tree8(sum);
}

#define KV_T float
#define KV_(name) name
#define KV_STAGED 0
#define KV_TILE_MIN_ROWS TILE_MIN_ROWS
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_
#undef KV_STAGED
#undef KV_TILE_MIN_ROWS
#undef KV_ENTRY

#define KV_T uint16_t
#define KV_(name) name##_bf16
#if defined(__AVX512BF16__)     /* the widening form: for head sizes the dot form cannot take */
#define KV_ENTRY paged_attention_short_bf16w
#endif
#define KV_STAGED 1
#define KV_TILE_MIN_ROWS TILE_MIN_ROWS
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_
#undef KV_STAGED
#undef KV_TILE_MIN_ROWS
#undef KV_ENTRY

#define KV_T uint8_t
#define KV_(name) name##_fp8
#define KV_STAGED 1
#define KV_TILE_MIN_ROWS TILE_MIN_ROWS_FP8
#include "paged_attention_kv.h"
#undef KV_T
#undef KV_
#undef KV_STAGED
#undef KV_TILE_MIN_ROWS
#undef KV_ENTRY

#include "paged_attention_dot.h"

/* which form reads a bfloat16 cache in this build: 1, the bf16 dot-product form (queries and
 * weights rounded to bfloat16, `paged_attention_dot.h`), or 0, the widening form (the float32
 * form's arithmetic on the widened cache) */
int paged_attention_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
