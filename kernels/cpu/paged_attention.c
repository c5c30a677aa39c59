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

/* the first key the query at `pos` sees: within the sliding window (0: none) */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

#define CHUNK 16                      /* keys whose values every row weighs in turn (in L1) */
#define AHEAD 16                                /* keys ahead whose slots are requested early */

/* Cache lines of keys' slots requested from memory ahead of use, a few at a time between the
 * rows' work (a burst of a whole block's lines would overflow the core's miss queue): the
 * cursor walks slot after slot, every line of each (every kv head), in address order. */
struct ahead {
    const float *cache;
    const int64_t *off;
    int64_t key, line, end, slot_lines;
};

static inline void prefetch_lines(struct ahead *a, int64_t n) {
    for (; n > 0 && a->key < a->end; n--) {
        __builtin_prefetch(a->cache + a->off[a->key] + 16 * a->line, 0, 1);
        if (++a->line == a->slot_lines) {
            a->line = 0;
            a->key++;
        }
    }
}

/* One request's heads h0 .. h0 + nh - 1, every query row of each, all together in one pass over
 * the keys (slot by slot, every kv head of a slot at once, the slots AHEAD keys on requested
 * early): each block of 8 keys is scored for every row while it is in the L1 cache, and each
 * chunk of values weighed by every row likewise. Scratch: off, the slot offset of every key
 * (seq_len rounded up to KEYS, the padding repeating the last key's); scores, keys_padded floats
 * per row; acc, head_dim floats per row; inv, one per row (rows: nh * q_len, row r = query
 * r % q_len of head h0 + r / q_len). */
static void attend_request(const float *q, int64_t q_token_stride, const float *k_cache,
                           const float *v_cache, float *out, int64_t out_token_stride,
                           const int64_t *table, int64_t q_start, int64_t q_len,
                           int64_t seq_len, int64_t h0, int64_t nh, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, float softcap, int64_t *off,
                           float *scores, float *acc, float *inv) {
    const int64_t group = num_heads / num_kv_heads, slot_floats = num_kv_heads * head_dim;
    const int64_t padded = (seq_len + KEYS - 1) & ~(int64_t)(KEYS - 1), rows = nh * q_len;
    for (int64_t j = 0; j < padded; j++) {
        const int64_t key = j < seq_len ? j : seq_len - 1;
        off[j] = (table[key / block_size] * block_size + key % block_size) * slot_floats;
    }
    const int64_t first_pos = seq_len - q_len;           /* query qi sits at first_pos + qi */
    const int64_t lo_any = first_key(first_pos, window), slot_lines = (slot_floats + 15) / 16;
    const int64_t k_start = lo_any & ~(int64_t)(KEYS - 1);
    struct ahead ka = {k_cache, off, k_start + AHEAD, 0, seq_len, slot_lines};
    const int64_t k_lines = (KEYS * slot_lines + rows - 1) / rows;    /* per row, a block's lines */
    for (int64_t j0 = k_start; j0 < padded; j0 += KEYS) {
        if (ka.key < j0 + AHEAD)
            ka.key = j0 + AHEAD, ka.line = 0;
        for (int64_t r = 0; r < rows; r++) {
            prefetch_lines(&ka, k_lines);
            const int64_t qi = r % q_len, hi = first_pos + qi, h = h0 + r / q_len;
            if (j0 > hi || j0 + KEYS <= (first_key(hi, window) & ~(int64_t)(KEYS - 1)))
                continue;
            const float *qr = q + (q_start + qi) * q_token_stride + h * head_dim;
            *(v8f *)(scores + r * padded + j0) =
                scores8(qr, k_cache + h / group * head_dim, off, j0, head_dim) * scale;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t hi = first_pos + r % q_len, lo = first_key(hi, window);
        inv[r] = softmax_row(scores + r * padded, lo & ~(int64_t)(KEYS - 1),
                             (hi + KEYS) & ~(int64_t)(KEYS - 1), lo, hi, softcap);
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    struct ahead va = {v_cache, off, lo_any, 0, seq_len, slot_lines};
    prefetch_lines(&va, AHEAD * slot_lines);
    const int64_t v_lines = (CHUNK * slot_lines + rows - 1) / rows;
    for (int64_t c0 = lo_any; c0 < seq_len; c0 += CHUNK) {
        for (int64_t r = 0; r < rows; r++) {
            prefetch_lines(&va, v_lines);
            const int64_t row_hi = first_pos + r % q_len, row_lo = first_key(row_hi, window);
            const int64_t lo = row_lo > c0 ? row_lo : c0;
            const int64_t hi = row_hi < c0 + CHUNK - 1 ? row_hi : c0 + CHUNK - 1;
            if (lo <= hi)
                weigh(scores + r * padded, v_cache + (h0 + r / q_len) / group * head_dim, off,
                      lo, hi, head_dim, acc + r * head_dim);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + (q_start + r % q_len) * out_token_stride + (h0 + r / q_len) * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = acc[r * head_dim + d] * inv[r];
    }
}

/* requests: [num_reqs, 3] (first query row, q_len, seq_len); tables: [num_reqs, table_width]
 * block ids. q rows are q_token_stride floats apart, heads head_dim apart; out likewise with
 * out_token_stride. Returns 0, or -1 when scratch memory could not be allocated. A row's result
 * does not depend on which task computes it. */
int paged_attention_short(const float *q, int64_t q_token_stride, const float *k_cache,
                          const float *v_cache, float *out, int64_t out_token_stride,
                          const int64_t *requests, const int64_t *tables, int64_t table_width,
                          int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t window,
                          float softcap, int num_threads) {
    /* scratch per thread: the longest context (rounded up to KEYS), the most query rows of a
     * task, the most scores of one (a request's rows times its keys: a long context's decode
     * and a short context's verify rows never need their product) */
    int64_t max_keys = KEYS, max_rows = 1, max_scores = KEYS;
    for (int64_t b = 0; b < num_reqs; b++) {
        const int64_t padded = (requests[b * 3 + 2] + KEYS - 1) & ~(int64_t)(KEYS - 1);
        const int64_t rows = num_heads * requests[b * 3 + 1];
        max_keys = padded > max_keys ? padded : max_keys;
        max_rows = rows > max_rows ? rows : max_rows;
        max_scores = rows * padded > max_scores ? rows * padded : max_scores;
    }
    /* parts per request: 1, or with fewer requests than threads enough head parts to share */
    int64_t parts = num_reqs >= num_threads ? 1 : (num_threads + num_reqs - 1) / num_reqs;
    if (parts > num_heads)
        parts = num_heads;
    const int64_t part_heads = (num_heads + parts - 1) / parts, tasks = num_reqs * parts;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    {
#if defined(__SSE__)
        /* flush denormals to zero in this kernel only (restored below): a peaked softmax makes
         * many tiny probabilities, and denormal arithmetic is ~100x slower */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
#endif
        int64_t *off = malloc(sizeof(int64_t) * max_keys);
        float *scores = malloc(sizeof(float) * max_scores);
        float *acc = malloc(sizeof(float) * max_rows * head_dim);
        float *inv = malloc(sizeof(float) * max_rows);
        const int ok = off && scores && acc && inv;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / parts, h0 = t % parts * part_heads;
            const int64_t nh = num_heads - h0 < part_heads ? num_heads - h0 : part_heads;
            if (!ok || nh <= 0)
                continue;
            attend_request(q, q_token_stride, k_cache, v_cache, out, out_token_stride,
                           tables + b * table_width, requests[b * 3], requests[b * 3 + 1],
                           requests[b * 3 + 2], h0, nh, num_heads, num_kv_heads, head_dim,
                           block_size, scale, window, softcap, off, scores, acc, inv);
        }
        free(off);
        free(scores);
        free(acc);
        free(inv);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? -1 : 0;
}
