/* Paged attention for short queries (decodes and verify rows) on the CPU, float32, reading the
 * paged K/V cache in place: no gathered copy of a request's blocks, one call per layer for every
 * short request of the step whatever their shapes.
 *
 * One task per request, or, with fewer requests than threads (one decode), per part of a
 * request's heads, so that the threads share it. A task walks the request's keys once for its
 * q_len * (its heads) query rows (each slot's keys loaded once for all of them), soft-maxes each
 * row over the keys it sees (causal, within the sliding window) and accumulates the values in key
 * order.
 *
 * Row invariance, by construction: a query row's output is computed from its own query vector
 * and the keys it sees, in a fixed order (dot products in 8 fixed lanes then a fixed tree, keys
 * summed one after another), so it does not depend on how many rows, requests or keys share the
 * call. A verify row therefore computes bit for bit what the decode it replaces would.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline float dot(const float *a, const float *b, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        acc += *(const v8f *)(a + d) * *(const v8f *)(b + d);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++)
        s += a[d] * b[d];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        *(v8f *)(y + d) += a * *(const v8f *)(x + d);
    for (; d < n; d++)
        y[d] += a * x[d];
}

#define PREFETCH_AHEAD 4          /* keys ahead whose K (V) lines are requested early */

static inline const float *slot_ptr(const float *cache, const int64_t *table, int64_t j,
                                    int64_t block_size, int64_t slot_floats) {
    return cache + (table[j / block_size] * block_size + j % block_size) * slot_floats;
}

static inline void prefetch_slot(const float *slot, int64_t slot_floats) {
    for (int64_t f = 0; f < slot_floats; f += 16)            /* one 64-byte line per 16 floats */
        __builtin_prefetch(slot + f, 0, 1);
}

/* key j's slot in `cache`, the slot PREFETCH_AHEAD keys on requested early */
static inline const float *walk_slot(const float *cache, const int64_t *table, int64_t j,
                                     int64_t seq_len, int64_t block_size, int64_t slot_floats) {
    if (j + PREFETCH_AHEAD < seq_len)
        prefetch_slot(slot_ptr(cache, table, j + PREFETCH_AHEAD, block_size, slot_floats),
                      slot_floats);
    return slot_ptr(cache, table, j, block_size, slot_floats);
}

/* the query at `pos` sees key j: causal, within the sliding window (0: none) */
static inline int visible(int64_t j, int64_t pos, int64_t window) {
    return j <= pos && (window <= 0 || j > pos - window);
}

/* One request's heads h0 .. h0 + nh - 1: rows r = qi * nh + (h - h0) are query qi of head h (kv
 * head h / group). Keys are walked slot by slot, every kv head of a slot together (one contiguous
 * run of memory). */
static void attend_request(const float *q, int64_t q_token_stride, const float *k_cache,
                           const float *v_cache, float *out, int64_t out_token_stride,
                           const int64_t *table, int64_t q_start, int64_t q_len,
                           int64_t seq_len, int64_t h0, int64_t nh, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, float softcap, float *scores,
                           float *acc, float *inv_sum) {
    const int64_t group = num_heads / num_kv_heads, rows = q_len * nh;
    const int64_t slot_floats = num_kv_heads * head_dim, first_pos = seq_len - q_len;
    int64_t lo_all = window > 0 ? first_pos - window + 1 : 0;
    if (lo_all < 0)
        lo_all = 0;
    /* scores[r * seq_len + j]: only the keys row r sees are written and read */
    for (int64_t j = lo_all; j < seq_len; j++) {
        const float *kj = walk_slot(k_cache, table, j, seq_len, block_size, slot_floats);
        for (int64_t qi = 0; qi < q_len; qi++) {
            if (!visible(j, first_pos + qi, window))
                continue;
            const float *qrow = q + (q_start + qi) * q_token_stride;
            float *srow = scores + (qi * nh - h0) * seq_len + j;
            for (int64_t h = h0; h < h0 + nh; h++) {
                float sc = dot(qrow + h * head_dim, kj + (h / group) * head_dim, head_dim) * scale;
                if (softcap > 0.0f)
                    sc = tanhf(sc / softcap) * softcap;
                srow[h * seq_len] = sc;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = first_pos + r / nh;
        int64_t lo = window > 0 ? pos - window + 1 : 0;
        if (lo < 0)
            lo = 0;
        float *row = scores + r * seq_len;
        float m = row[lo];
        for (int64_t j = lo + 1; j <= pos; j++)
            m = row[j] > m ? row[j] : m;
        float sum = 0.0f;
        for (int64_t j = lo; j <= pos; j++) {
            row[j] = expf(row[j] - m);
            sum += row[j];
        }
        inv_sum[r] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t j = lo_all; j < seq_len; j++) {
        const float *vj = walk_slot(v_cache, table, j, seq_len, block_size, slot_floats);
        for (int64_t qi = 0; qi < q_len; qi++) {
            if (!visible(j, first_pos + qi, window))
                continue;
            for (int64_t h = h0; h < h0 + nh; h++) {
                const int64_t r = qi * nh + h - h0;
                axpy(acc + r * head_dim, scores[r * seq_len + j], vj + (h / group) * head_dim,
                     head_dim);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + (q_start + r / nh) * out_token_stride + (h0 + r % nh) * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = acc[r * head_dim + d] * inv_sum[r];
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
    int64_t max_scores = 0, max_rows = 0;
    for (int64_t b = 0; b < num_reqs; b++) {
        const int64_t rows = requests[b * 3 + 1] * num_heads;
        if (rows * requests[b * 3 + 2] > max_scores)
            max_scores = rows * requests[b * 3 + 2];
        if (rows > max_rows)
            max_rows = rows;
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
        float *scores = malloc(sizeof(float) * (max_scores > 0 ? max_scores : 1));
        float *acc = malloc(sizeof(float) * (max_rows * head_dim > 0 ? max_rows * head_dim : 1));
        float *inv_sum = malloc(sizeof(float) * (max_rows > 0 ? max_rows : 1));
        if (!scores || !acc || !inv_sum) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / parts, h0 = t % parts * part_heads;
            const int64_t nh = num_heads - h0 < part_heads ? num_heads - h0 : part_heads;
            if (!scores || !acc || !inv_sum || nh <= 0)
                continue;
            attend_request(q, q_token_stride, k_cache, v_cache, out, out_token_stride,
                           tables + b * table_width, requests[b * 3], requests[b * 3 + 1],
                           requests[b * 3 + 2], h0, nh, num_heads, num_kv_heads, head_dim,
                           block_size, scale, window, softcap, scores, acc, inv_sum);
        }
        free(scores);
        free(acc);
        free(inv_sum);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? -1 : 0;
}
