/* Paged attention for short queries (decodes and verify rows) on the CPU, float32, reading the
 * paged K/V cache in place: no gathered copy of a request's blocks, one call per layer for every
 * short request of the step whatever their shapes.
 *
 * One task per (request, query head), so that even one decode spreads over the threads. A task
 * walks the request's keys once for its q_len query rows, soft-maxes each row over the keys it
 * sees (causal, within the sliding window) and accumulates the values in key order in registers.
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

static inline const float *slot_ptr(const float *cache, const int64_t *table, int64_t j,
                                    int64_t block_size, int64_t slot_floats) {
    return cache + (table[j / block_size] * block_size + j % block_size) * slot_floats;
}

static inline void prefetch_floats(const float *p, int64_t n) {
    for (int64_t f = 0; f < n; f += 16)                      /* one 64-byte line per 16 floats */
        __builtin_prefetch(p + f, 0, 1);
}

/* the query at `pos` sees key j: causal, within the sliding window (0: none) */
static inline int visible(int64_t j, int64_t pos, int64_t window) {
    return j <= pos && (window <= 0 || j > pos - window);
}

/* One query head h of one request: its q_len rows (query qi at position first_pos + qi). The
 * scores walk the keys once for all the rows; each row's values then accumulate in registers, 64
 * floats of head_dim at a time, key after key (y + p * v, rounded twice). */
static inline void attend_head(const float *q, int64_t q_token_stride, const float *k_cache,
                               const float *v_cache, float *out, int64_t out_token_stride,
                               const int64_t *table, int64_t q_start, int64_t q_len,
                               int64_t seq_len, int64_t h, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int64_t window, float softcap, float *scores) {
    const int64_t slot_floats = num_kv_heads * head_dim, first_pos = seq_len - q_len;
    const int64_t kv_offset = h / (num_heads / num_kv_heads) * head_dim;
    int64_t lo_all = window > 0 ? first_pos - window + 1 : 0;
    if (lo_all < 0)
        lo_all = 0;
    /* scores[qi * seq_len + j]: only the keys query qi sees are written and read */
    for (int64_t j = lo_all; j < seq_len;) {                       /* block by block */
        const int64_t first = j % block_size, end = j - first + block_size;
        const float *kj = k_cache + (table[j / block_size] * block_size + first) * slot_floats
                          + kv_offset;
        if (end < seq_len)                              /* the next block's keys, requested early */
            for (int64_t i = 0; i < block_size && end + i < seq_len; i++)
                prefetch_floats(slot_ptr(k_cache, table, end + i, block_size, slot_floats)
                                + kv_offset, head_dim);
        for (; j < seq_len && j < end; j++, kj += slot_floats)
            for (int64_t qi = 0; qi < q_len; qi++) {
                if (!visible(j, first_pos + qi, window))
                    continue;
                const float *qrow = q + (q_start + qi) * q_token_stride + h * head_dim;
                float sc = dot(qrow, kj, head_dim) * scale;
                if (softcap > 0.0f)
                    sc = tanhf(sc / softcap) * softcap;
                scores[qi * seq_len + j] = sc;
            }
    }
    for (int64_t qi = 0; qi < q_len; qi++) {
        const int64_t pos = first_pos + qi;
        int64_t lo = window > 0 ? pos - window + 1 : 0;
        if (lo < 0)
            lo = 0;
        float *row = scores + qi * seq_len;
        float m = row[lo];
        for (int64_t j = lo + 1; j <= pos; j++)
            m = row[j] > m ? row[j] : m;
        float sum = 0.0f;
        for (int64_t j = lo; j <= pos; j++) {
            row[j] = expf(row[j] - m);
            sum += row[j];
        }
        const float inv_sum = 1.0f / sum;
        float *o = out + (q_start + qi) * out_token_stride + h * head_dim;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int64_t width = head_dim - d0 < 64 ? head_dim - d0 : 64, full = width / 8 * 8;
            v8f acc[8] = {{0}};
            float tail[8] = {0};
            for (int64_t j = lo; j <= pos;) {                  /* block by block */
                const int64_t first = j % block_size, end = j - first + block_size;
                const float *vj = v_cache + (table[j / block_size] * block_size + first)
                                  * slot_floats + kv_offset + d0;
                for (; j <= pos && j < end; j++, vj += slot_floats) {
                    const float p = row[j];
                    for (int64_t c = 0; c < full / 8; c++)
                        acc[c] += p * *(const v8f *)(vj + 8 * c);
                    for (int64_t d = full; d < width; d++)
                        tail[d - full] += p * vj[d];
                }
            }
            for (int64_t c = 0; c < full / 8; c++)
                for (int64_t l = 0; l < 8; l++)
                    o[d0 + 8 * c + l] = acc[c][l] * inv_sum;
            for (int64_t d = full; d < width; d++)
                o[d0 + d] = tail[d - full] * inv_sum;
        }
    }
}

/* head_dim as a constant where it is a common one: the inner loops unroll */
static void attend_task(const float *q, int64_t q_token_stride, const float *k_cache,
                        const float *v_cache, float *out, int64_t out_token_stride,
                        const int64_t *table, int64_t q_start, int64_t q_len, int64_t seq_len,
                        int64_t h, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, float scale, int64_t window, float softcap,
                        float *scores) {
#define ATTEND(dim)                                                                           \
    attend_head(q, q_token_stride, k_cache, v_cache, out, out_token_stride, table, q_start,   \
                q_len, seq_len, h, num_heads, num_kv_heads, dim, block_size, scale, window,   \
                softcap, scores)
    if (head_dim == 64)
        ATTEND(64);
    else if (head_dim == 128)
        ATTEND(128);
    else
        ATTEND(head_dim);
#undef ATTEND
}

/* requests: [num_reqs, 3] (first query row, q_len, seq_len); tables: [num_reqs, table_width]
 * block ids. q rows are q_token_stride floats apart, heads head_dim apart; out likewise with
 * out_token_stride. One task per (request, query head), so one decode spreads over the threads.
 * Returns 0, or -1 when scratch memory could not be allocated. */
int paged_attention_short(const float *q, int64_t q_token_stride, const float *k_cache,
                          const float *v_cache, float *out, int64_t out_token_stride,
                          const int64_t *requests, const int64_t *tables, int64_t table_width,
                          int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t window,
                          float softcap, int num_threads) {
    int64_t max_scores = 0;
    for (int64_t b = 0; b < num_reqs; b++)
        if (requests[b * 3 + 1] * requests[b * 3 + 2] > max_scores)
            max_scores = requests[b * 3 + 1] * requests[b * 3 + 2];
    const int64_t tasks = num_reqs * num_heads;
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
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / num_heads;
            if (scores)
                attend_task(q, q_token_stride, k_cache, v_cache, out, out_token_stride,
                            tables + b * table_width, requests[b * 3], requests[b * 3 + 1],
                            requests[b * 3 + 2], t % num_heads, num_heads, num_kv_heads,
                            head_dim, block_size, scale, window, softcap, scores);
        }
        free(scores);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? -1 : 0;
}
