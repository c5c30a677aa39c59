/* The part of `paged_attention.c` that reads the K/V cache, written once for each element type
 * the cache may hold: `paged_attention.c` includes this file twice, with
 *   KV_T       the cache's element type (float; uint16_t holding bfloat16 bits),
 *   KV_(name)  this form's name of a function (name; name##_bf16),
 *   KV_STAGED  0: the float32 form reads the cache in place; 1: the bf16 form widens each block
 *              of KEYS keys (then each chunk of CHUNK values) of the kv heads a task reads into
 *              `stage` (float32, exactly: a bf16 is a float32's top half) once for all its rows,
 *              and the same scores8 / weigh read it there.
 * Every product and sum is the float32 form's, in the same order: the bf16 form's result is bit
 * for bit the float32 form's over the widened cache, and as row-invariant.
 * (No include guard: included once per element type.)
 */

/* Cache lines of keys' slots requested from memory ahead of use, a few at a time between the
 * rows' work (a burst of a whole block's lines would overflow the core's miss queue): the
 * cursor walks slot after slot, every line of each (every kv head), in address order. */
struct KV_(ahead) {
    const char *cache;                  /* bytes: slot offsets are in elements */
    const int64_t *off;
    int64_t key, line, end, slot_lines;
};

static inline void KV_(prefetch_lines)(struct KV_(ahead) *a, int64_t n) {
    for (; n > 0 && a->key < a->end; n--) {
        __builtin_prefetch(a->cache + sizeof(KV_T) * a->off[a->key] + 64 * a->line, 0, 1);
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
static void KV_(attend_request)(const float *q, int64_t q_token_stride, const KV_T *k_cache,
                                const KV_T *v_cache, float *out, int64_t out_token_stride,
                                const int64_t *table, int64_t q_start, int64_t q_len,
                                int64_t seq_len, int64_t h0, int64_t nh, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int64_t window, float softcap, int64_t *off,
                                float *scores, float *acc, float *inv, float *stage) {
    const int64_t group = num_heads / num_kv_heads, slot_elems = num_kv_heads * head_dim;
    const int64_t padded = (seq_len + KEYS - 1) & ~(int64_t)(KEYS - 1), rows = nh * q_len;
    key_offsets(off, table, seq_len, padded, block_size, slot_elems);
    const int64_t first_pos = seq_len - q_len;           /* query qi sits at first_pos + qi */
    const int64_t lo_any = first_key(first_pos, window);
    const int64_t slot_lines = (slot_elems * (int64_t)sizeof(KV_T) + 63) / 64;   /* 64-byte */
    const int64_t k_start = lo_any & ~(int64_t)(KEYS - 1);
#if KV_STAGED
    /* the kv heads this task reads (kv_lo on), widened a block of keys or a chunk of values at a
     * time into `stage`, slot i at stage + staged[i] */
    const int64_t kv_lo = h0 / group, used = ((h0 + nh - 1) / group - kv_lo + 1) * head_dim;
    int64_t staged[CHUNK];
    for (int64_t i = 0; i < CHUNK; i++)
        staged[i] = i * used;
#endif
    struct KV_(ahead) ka = {(const char *)k_cache, off, k_start + AHEAD, 0, seq_len, slot_lines};
    const int64_t k_lines = (KEYS * slot_lines + rows - 1) / rows;    /* per row, a block's lines */
    for (int64_t j0 = k_start; j0 < padded; j0 += KEYS) {
        if (ka.key < j0 + AHEAD)
            ka.key = j0 + AHEAD, ka.line = 0;
#if KV_STAGED
        KV_(stage)(k_cache, off, j0, KEYS, kv_lo * head_dim, used, stage);
#endif
        for (int64_t r = 0; r < rows;) {
            KV_(prefetch_lines)(&ka, k_lines);
            const int64_t h = h0 + r / q_len;
            /* row r, with row r + 1 where it reads the same kv head (scores8x2) */
            const int two = r + 1 < rows && (h0 + (r + 1) / q_len) / group == h / group;
            int need = 0;
            for (int64_t s = r; s < r + 1 + two; s++) {
                const int64_t hi = first_pos + s % q_len;
                need |= !(j0 > hi || j0 + KEYS <= (first_key(hi, window) & ~(int64_t)(KEYS - 1)));
            }
            if (!need) {
                r += 1 + two;
                continue;
            }
#if KV_STAGED
            const float *kh = stage + (h / group - kv_lo) * head_dim;
            const int64_t *ko = staged, kj = 0;
#else
            const float *kh = k_cache + h / group * head_dim;
            const int64_t *ko = off, kj = j0;
#endif
            const float *qr = q + (q_start + r % q_len) * q_token_stride + h * head_dim;
            if (two) {
                KV_(prefetch_lines)(&ka, k_lines);
                const int64_t h1 = h0 + (r + 1) / q_len;
                const float *q1 = q + (q_start + (r + 1) % q_len) * q_token_stride + h1 * head_dim;
                scores8x2(qr, q1, kh, ko, kj, head_dim, scale, scores + r * padded + j0,
                          scores + (r + 1) * padded + j0);
                r += 2;
            } else {
                *(v8f *)(scores + r * padded + j0) = scores8(qr, kh, ko, kj, head_dim) * scale;
                r += 1;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t hi = first_pos + r % q_len, lo = first_key(hi, window);
        inv[r] = softmax_row(scores + r * padded, lo & ~(int64_t)(KEYS - 1),
                             (hi + KEYS) & ~(int64_t)(KEYS - 1), lo, hi, softcap);
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    struct KV_(ahead) va = {(const char *)v_cache, off, lo_any, 0, seq_len, slot_lines};
    KV_(prefetch_lines)(&va, AHEAD * slot_lines);
    const int64_t v_lines = (CHUNK * slot_lines + rows - 1) / rows;
    for (int64_t c0 = lo_any; c0 < seq_len; c0 += CHUNK) {
#if KV_STAGED
        KV_(stage)(v_cache, off, c0, seq_len - c0 < CHUNK ? seq_len - c0 : CHUNK,
                   kv_lo * head_dim, used, stage);
#endif
        for (int64_t r = 0; r < rows;) {
            KV_(prefetch_lines)(&va, v_lines);
            const int64_t h = h0 + r / q_len;
            const int two = r + 1 < rows && (h0 + (r + 1) / q_len) / group == h / group;
            int64_t lo[2], hi[2];
            for (int s = 0; s <= two; s++) {
                const int64_t row_hi = first_pos + (r + s) % q_len;
                const int64_t row_lo = first_key(row_hi, window);
                lo[s] = row_lo > c0 ? row_lo : c0;
                hi[s] = row_hi < c0 + CHUNK - 1 ? row_hi : c0 + CHUNK - 1;
            }
#if KV_STAGED                               /* keys c0 + i at stage + i * used: shifted by c0 */
            const float *p = scores + r * padded + c0;
            const float *vh = stage + (h / group - kv_lo) * head_dim;
            const int64_t *vo = staged, shift = c0;
#else
            const float *p = scores + r * padded;
            const float *vh = v_cache + h / group * head_dim;
            const int64_t *vo = off, shift = 0;
#endif
            if (two) {
                KV_(prefetch_lines)(&va, v_lines);
                weigh2(p, p + padded, vh, vo, lo[0] - shift, hi[0] - shift, lo[1] - shift,
                       hi[1] - shift, head_dim, acc + r * head_dim, acc + (r + 1) * head_dim);
                r += 2;
            } else {
                if (lo[0] <= hi[0])
                    weigh(p, vh, vo, lo[0] - shift, hi[0] - shift, head_dim, acc + r * head_dim);
                r += 1;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + (q_start + r % q_len) * out_token_stride + (h0 + r / q_len) * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = acc[r * head_dim + d] * inv[r];
    }
}

/* attend_request's results for the queries of one request's heads h0 .. h0 + nh - 1 when q_len
 * is a multiple of TILE (a prompt chunk's tile): TILE consecutive queries of a head at a time,
 * rows in lanes (see TILE), every head of the task that reads a kv head together, so that each
 * block of its keys and chunk of its values is read once for all of them. The keys a tile sees
 * are scored into scores[(g * keys + j - first) * TILE + row] (g: the head among those), soft-maxed
 * lane by lane, then weighed four rows at a time. Scratch: off (seq_len rounded up to KEYS),
 * scores (TILE floats per key and head), acc and qt (TILE * head_dim per head), inv (TILE per
 * head), stage (bf16 form: CHUNK * head_dim). */
static void KV_(attend_tiles)(const float *q, int64_t q_token_stride, const KV_T *k_cache,
                              const KV_T *v_cache, float *out, int64_t out_token_stride,
                              const int64_t *table, int64_t q_start, int64_t q_len,
                              int64_t seq_len, int64_t h0, int64_t nh, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, int64_t window, float softcap, int64_t *off,
                              float *scores, float *acc, float *qt, float *inv, float *stage) {
    const int64_t group = num_heads / num_kv_heads, slot_elems = num_kv_heads * head_dim;
    const int64_t padded = (seq_len + KEYS - 1) & ~(int64_t)(KEYS - 1);
    key_offsets(off, table, seq_len, padded, block_size, slot_elems);
#if KV_STAGED
    int64_t staged[CHUNK];                      /* key i of a staged block at stage + i * D */
    for (int64_t i = 0; i < CHUNK; i++)
        staged[i] = i * head_dim;
#endif
    const int64_t first_pos = seq_len - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += TILE) {
        /* the tile's rows: nv of them; lanes past them repeat the last (computed, not written) */
        const int nv = q_len - t0 < TILE ? (int)(q_len - t0) : TILE;
        int64_t lo[TILE], hi[TILE];
        vrowi lo_v, hi_v;
        for (int i = 0; i < TILE; i++) {
            hi[i] = first_pos + t0 + (i < nv ? i : nv - 1);
            lo[i] = first_key(hi[i], window);
            lo_v[i] = (int32_t)lo[i];
            hi_v[i] = (int32_t)hi[i];
        }
        const int64_t first = lo[0] & ~(int64_t)(KEYS - 1);
        const int64_t end = (hi[TILE - 1] + KEYS) & ~(int64_t)(KEYS - 1), keys = end - first;
        for (int64_t hg = h0; hg < h0 + nh;) {            /* the task's heads of one kv head */
            const int64_t kv_at = hg / group * head_dim;
            const int64_t h_end = (hg / group + 1) * group < h0 + nh ? (hg / group + 1) * group
                                                                       : h0 + nh;
            const int64_t n = h_end - hg;
            for (int64_t g = 0; g < n; g++)
                for (int i = 0; i < TILE; i++) {
                    const float *qr = q + (q_start + t0 + (i < nv ? i : nv - 1)) * q_token_stride
                                      + (hg + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        qt[(g * head_dim + d) * TILE + i] = qr[d];
                }
            for (int64_t j0 = first; j0 < end; j0 += KEYS) {
#if KV_STAGED
                KV_(stage)(k_cache, off, j0, KEYS, kv_at, head_dim, stage);
                const float *kb = stage;
                const int64_t *ko = staged, kj = 0;
#else
                const float *kb = k_cache + kv_at;
                const int64_t *ko = off, kj = j0;
#endif
                for (int64_t g = 0; g < n; g++) {
                    float *sg = scores + (g * keys + j0 - first) * TILE;
                    for (int i = 0; i < KEYS; i += 2)
                        tile_scores2(qt + g * head_dim * TILE, kb + ko[kj + i],
                                     kb + ko[kj + i + 1], head_dim, scale, sg + i * TILE,
                                     sg + (i + 1) * TILE);
                }
            }
            for (int64_t g = 0; g < n; g++) {
                float *sg = scores + g * keys * TILE;
                if (softcap > 0.0f)
                    for (int i = 0; i < TILE; i++)
                        for (int64_t j = lo[i]; j <= hi[i]; j++) {
                            float *sj = sg + (j - first) * TILE + i;
                            *sj = tanhf(*sj / softcap) * softcap;
                        }
                vrow most;
                for (int i = 0; i < TILE; i++)
                    most[i] = sg[(lo[i] - first) * TILE + i];
                for (int64_t j = first; j < end; j++) {    /* the maximum each row sees (exact) */
                    const vrowi key = splat_rowi((int32_t)j);
                    const vrow sj = *(const vrow *)(sg + (j - first) * TILE);
                    const vrowi more = (key >= lo_v) & (key <= hi_v) & (sj > most);
                    most = (vrow)(((vrowi)sj & more) | ((vrowi)most & ~more));
                }
                vrow sum[KEYS];                          /* by key index mod 8, as softmax_row */
                for (int l = 0; l < KEYS; l++)
                    sum[l] = splat_row(0.0f);
                for (int64_t j0 = first; j0 < end; j0 += KEYS)
                    for (int l = 0; l < KEYS; l++) {
                        const vrowi key = splat_rowi((int32_t)(j0 + l));
                        vrow *sj = (vrow *)(sg + (j0 + l - first) * TILE);
                        const vrowi seen = (key >= lo_v) & (key <= hi_v);
                        const vrow e = (vrow)((vrowi)exp_row(*sj - most) & seen);
                        *sj = e;
                        sum[l] += e;
                    }
                *(vrow *)(inv + g * TILE) = 1.0f / (((sum[0] + sum[1]) + (sum[2] + sum[3]))
                                                    + ((sum[4] + sum[5]) + (sum[6] + sum[7])));
            }
            memset(acc, 0, sizeof(float) * n * TILE * head_dim);
            for (int64_t c0 = lo[0]; c0 <= hi[TILE - 1]; c0 += CHUNK) {
                const int64_t c1 = c0 + CHUNK - 1 < hi[TILE - 1] ? c0 + CHUNK - 1 : hi[TILE - 1];
                int64_t clo[TILE], chi[TILE];
                for (int i = 0; i < TILE; i++) {
                    clo[i] = lo[i] > c0 ? lo[i] : c0;
                    chi[i] = hi[i] < c1 ? hi[i] : c1;
                }
#if KV_STAGED                               /* keys c0 + i at stage + i * D: shifted by c0 */
                KV_(stage)(v_cache, off, c0, c1 - c0 + 1, kv_at, head_dim, stage);
                for (int i = 0; i < TILE; i++)
                    clo[i] -= c0, chi[i] -= c0;
                for (int64_t g = 0; g < n; g++)
                    weigh_tile(scores + g * keys * TILE, first - c0, stage, staged, clo, chi,
                               nv, head_dim, acc + g * TILE * head_dim);
#else
                for (int64_t g = 0; g < n; g++)
                    weigh_tile(scores + g * keys * TILE, first, v_cache + kv_at, off, clo, chi,
                               nv, head_dim, acc + g * TILE * head_dim);
#endif
            }
            for (int64_t g = 0; g < n; g++)
                for (int i = 0; i < nv; i++) {
                    float *o = out + (q_start + t0 + i) * out_token_stride
                               + (hg + g) * head_dim;
                    const float *a = acc + (g * TILE + i) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        o[d] = a[d] * inv[g * TILE + i];
                }
            hg = h_end;
        }
    }
}

/* requests: [num_reqs, 3] (first query row, q_len, seq_len); tables: [num_reqs, table_width]
 * block ids. q rows are q_token_stride floats apart, heads head_dim apart; out likewise with
 * out_token_stride. Returns 0, or -1 when scratch memory could not be allocated. A row's result
 * does not depend on which task computes it. */
int KV_(paged_attention_short)(const float *q, int64_t q_token_stride, const KV_T *k_cache,
                               const KV_T *v_cache, float *out, int64_t out_token_stride,
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
        const int64_t q_len = requests[b * 3 + 1];
        const int64_t rows = num_heads * (q_len >= TILE_MIN_ROWS && q_len < TILE ? TILE : q_len);
        max_keys = padded > max_keys ? padded : max_keys;
        max_rows = rows > max_rows ? rows : max_rows;
        max_scores = rows * padded > max_scores ? rows * padded : max_scores;
    }
    /* parts per request: 1, or with fewer requests than threads enough head parts to share */
    int64_t parts = num_reqs >= num_threads ? 1 : (num_threads + num_reqs - 1) / num_reqs;
    /* and, where a request's scores would not stay in the core's caches, one per kv head */
    if (max_scores > SCORES_IN_CACHE && parts < num_kv_heads)
        parts = num_kv_heads;
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
        float *qt = malloc(sizeof(float) * TILE * head_dim * num_heads);
        /* the bf16 form's widened keys or values: CHUNK slots (KEYS <= CHUNK) */
        float *stage = KV_STAGED ? malloc(sizeof(float) * CHUNK * num_kv_heads * head_dim) : NULL;
        const int ok = off && scores && acc && inv && qt && (stage || !KV_STAGED);
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
            /* a request of TILE_MIN_ROWS rows or more (prompt chunks, verify rows) rows in lanes,
             * a shorter one (decodes) row by row */
            const int64_t q0 = requests[b * 3], q_len = requests[b * 3 + 1];
            const int64_t seq_len = requests[b * 3 + 2];
            const int64_t tiled = q_len >= TILE_MIN_ROWS ? q_len : 0;
            const int64_t *table = tables + b * table_width;
            if (tiled)
                KV_(attend_tiles)(q, q_token_stride, k_cache, v_cache, out, out_token_stride,
                                  table, q0, tiled, seq_len - (q_len - tiled), h0, nh,
                                  num_heads, num_kv_heads, head_dim, block_size, scale, window,
                                  softcap, off, scores, acc, qt, inv, stage);
            if (q_len > tiled)
                KV_(attend_request)(q, q_token_stride, k_cache, v_cache, out,
                                    out_token_stride, table, q0 + tiled, q_len - tiled, seq_len,
                                    h0, nh, num_heads, num_kv_heads, head_dim, block_size, scale,
                                    window, softcap, off, scores, acc, inv, stage);
        }
        free(off);
        free(scores);
        free(acc);
        free(inv);
        free(qt);
        free(stage);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? -1 : 0;
}
