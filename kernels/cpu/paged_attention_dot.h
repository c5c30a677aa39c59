/* The bfloat16 cache on the CPU's bf16 dot-product units (AVX512-BF16, `vdpbf16ps`):
 * `paged_attention_short_bf16` on hosts that have them, for head sizes that are a multiple of 32
 * (others: the widening form, `paged_attention_short_bf16w`, as on hosts without them).
 *
 * Every query row, whatever the request's row count (decodes, verify passes, prompt tiles), takes
 * the same arithmetic, so a row's output depends only on its query and the keys it sees:
 * - its query is rounded to bfloat16 (to nearest even), as the cache's keys are;
 * - a score: lane i of a block of DOT_KEYS keys (block starts at multiples of 16) is key i's
 *   products summed in pairs of dimensions (2c, 2c + 1) by `vdpbf16ps`, the pairs with c even
 *   into one chain and c odd into another, in c order; then (even + odd) * scale;
 * - the keys the row sees (causal, within the sliding window) taken in segments of DOT_SEG by
 *   key index (segment s: keys DOT_SEG * s .. DOT_SEG * (s + 1) - 1); in each, the softmax's
 *   maximum, each e = exp(s - that maximum) (`exp_row`, 0 outside the row's keys), their sum by
 *   key index mod 16 in key order then a fixed tree, each e rounded to bfloat16; and the
 *   segment's values: each dimension's chain of `vdpbf16ps` over pairs of keys (2m, 2m + 1) of
 *   every block in key order;
 * - the segments folded in key order (`dot_fold`: maximum, sum and values rescaled by `exp_row`
 *   of the maxima's differences), the output the values times 1 / the sum.
 * Keys past a row's last (a verify pass's later drafts, a block's padding: copies of the last
 * key) weigh exactly 0, so they add nothing: a verify row or a prompt row computes bit for bit
 * what the decode at its position computes.
 *
 * A task is a request's heads (all, or with fewer requests than threads a part of them) at up
 * to DOT_ROWS query rows (positions x heads), or, where a step holds prompt tiles (a request
 * whose rows of one kv head reach DOT_ROWS / 2) and enough requests for the threads, one kv
 * head's heads at up to DOT_ROWS / G positions, so a tile's keys are transposed once a kv head;
 * it walks its rows' segments in turn, each key's slot from its first kv head to its last. Each
 * block of keys is transposed once (lanes = keys) for all the rows of a kv head, each pair of
 * keys' values interleaved once (lanes = dimensions, a pair a lane), and the rows run DOT_GROUP
 * at a time, their chains interleaved. Against the widening form this does half the
 * multiply-adds an instruction and no widening per row group: a 9-row verify pass over a long
 * context is compute-bound. With fewer requests than threads, a request whose rows fit one task
 * and whose keys span two segments or more (a decode over a long context) is split by segments
 * instead: each task reads whole slots for every head, keeps each row's segment partials, and
 * the rows' partials are folded after the tasks (a decode over 2.8K keys: 0.74-0.83x the time
 * of the head split, which read the middle kv head twice; `benchmarks/attention_ab.py`).
 * (Included once, at the end of paged_attention.c.)
 */
#if defined(__AVX512BF16__)

#define DOT_KEYS 16                  /* keys a block: a score vector's lanes */
#define DOT_ROWS 48                  /* query rows of a task at most: a 16-row tile x 3 heads */
#define DOT_GROUP 4                  /* rows whose chains run interleaved */
/* keys a segment (a multiple of DOT_KEYS): 256 cost a 9-row verify at 2.8K 1.03-1.08x the
 * unsegmented time (a segment's softmax and fold for each of its 45 rows), 512 0.95-1.00x */
#define DOT_SEG 512
/* floats between two rows' scores: a segment's and a block more, so that one block of every row
 * falls in distinct L1 sets (a stride of a whole number of KiB puts many rows in the same set) */
#define DOT_SCORES (DOT_SEG + DOT_KEYS)

/* Transpose 16 x 16 dwords in place: r[i] lane c -> r[c] lane i. */
static inline __attribute__((always_inline)) void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {       /* u[i + k] lane L: element 4L + k of rows i..i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {           /* the 4 x 4 transpose of 128-bit lanes */
        const __m512i p0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
        const __m512i p1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
        const __m512i q0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i q1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_i32x4(p0, q0, 0x88);
        t[4 + k] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
        t[8 + k] = _mm512_shuffle_i32x4(p1, q1, 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
    }
    for (int i = 0; i < 16; i++)            /* t[4L + k]: element 4L + k of rows 0..15 */
        r[i] = t[i];
}

#define DOT_AHEAD (2 * DOT_KEYS)     /* keys ahead whose cache lines are requested early */

/* kv heads kv0 .. kv0 + nkv - 1 of the block's 16 keys (of n): dword c of key i (dimensions 2c,
 * 2c + 1) of kv head kv0 + k at kt[k * D / 2 + c] lane i. Each key's slot is read from its first
 * kv head to its last (a stream), and the same bytes of key i + DOT_AHEAD are requested from
 * memory meanwhile, key by key (a burst of a whole block's lines would overflow the core's miss
 * queue). */
static void dot_keys(const uint16_t *k_cache, const int64_t *off, int64_t j0, int64_t n,
                     int64_t kv0, int64_t nkv, int64_t D, __m512i *kt) {
    const int64_t chunks = nkv * D / 32;                 /* 32 values (16 dwords) a chunk */
    for (int i = 0; i < 16; i++) {
        const uint16_t *key = k_cache + off[j0 + i] + kv0 * D;
        for (int64_t c = 0; c < chunks; c++)
            kt[c * 16 + i] = _mm512_loadu_si512(key + 32 * c);
        if (j0 + i + DOT_AHEAD < n)
            for (int64_t c = 0; c < chunks; c++)
                _mm_prefetch((const char *)(k_cache + off[j0 + i + DOT_AHEAD] + kv0 * D
                                            + 32 * c), _MM_HINT_T2);
    }
    for (int64_t c = 0; c < chunks; c++)
        transpose16x16(kt + 16 * c);
}

/* kv heads kv0 .. kv0 + nkv - 1 of each pair m of the block's keys (2m, 2m + 1), each 32
 * dimensions z of theirs, interleaved: vi[k * D / 2 + (m * Z + z) * 2] holds kv head kv0 + k's
 * dimensions 8L + e (lane 4L + e), the next vector dimensions 8L + 4 + e, each lane key 2m's
 * value then key 2m + 1's; keys DOT_AHEAD on requested meanwhile, as dot_keys */
static void dot_values_of(const uint16_t *v_cache, const int64_t *off, int64_t j0, int64_t n,
                          int64_t kv0, int64_t nkv, int64_t D, __m512i *vi) {
    const int64_t Z = D / 32;
    for (int m = 0; m < DOT_KEYS / 2; m++) {
        const uint16_t *a = v_cache + off[j0 + 2 * m] + kv0 * D;
        const uint16_t *b = v_cache + off[j0 + 2 * m + 1] + kv0 * D;
        for (int64_t k = 0; k < nkv; k++)
            for (int64_t z = 0; z < Z; z++) {
                const __m512i va = _mm512_loadu_si512(a + k * D + 32 * z);
                const __m512i vb = _mm512_loadu_si512(b + k * D + 32 * z);
                vi[k * D / 2 + (m * Z + z) * 2] = _mm512_unpacklo_epi16(va, vb);
                vi[k * D / 2 + (m * Z + z) * 2 + 1] = _mm512_unpackhi_epi16(va, vb);
            }
        for (int64_t i = j0 + 2 * m + DOT_AHEAD; i < j0 + 2 * m + 2 + DOT_AHEAD && i < n; i++)
            for (int64_t c = 0; c < nkv * Z; c++)
                _mm_prefetch((const char *)(v_cache + off[i] + kv0 * D + 32 * c), _MM_HINT_T2);
    }
}

static inline __attribute__((always_inline)) __m512 dot(__m512 acc, __m512i a, uint32_t pair) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)pair));
}

/* the block's scores of nr rows (qp[r]: row r's query, dword pairs) into s[r][0..15] */
static inline __attribute__((always_inline)) void dot_scores(
    int nr, const uint32_t *const *qp, const __m512i *kt, int64_t pairs, float scale,
    float *const *s) {
    __m512 even[DOT_GROUP], odd[DOT_GROUP];
    for (int r = 0; r < nr; r++)
        even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < pairs; c += 2)
        for (int r = 0; r < nr; r++) {
            even[r] = dot(even[r], kt[c], qp[r][c]);
            odd[r] = dot(odd[r], kt[c + 1], qp[r][c + 1]);
        }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < nr; r++)
        _mm512_storeu_ps(s[r], _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), sc));
}

/* the block's weighed values of nr rows (pp[r]: row r's weights of the block's pairs of keys)
 * into acc[r] (D floats, dimensions as vi's lanes) */
static inline __attribute__((always_inline)) void dot_weigh(
    int nr, const uint32_t *const *pp, const __m512i *vi, int64_t Z, float *const *acc) {
    for (int64_t z = 0; z < Z; z++) {
        __m512 lo[DOT_GROUP], hi[DOT_GROUP];
        for (int r = 0; r < nr; r++) {
            lo[r] = _mm512_loadu_ps(acc[r] + 32 * z);
            hi[r] = _mm512_loadu_ps(acc[r] + 32 * z + 16);
        }
        for (int m = 0; m < DOT_KEYS / 2; m++) {
            const __m512i a = vi[(m * Z + z) * 2], b = vi[(m * Z + z) * 2 + 1];
            for (int r = 0; r < nr; r++) {
                lo[r] = dot(lo[r], a, pp[r][m]);
                hi[r] = dot(hi[r], b, pp[r][m]);
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm512_storeu_ps(acc[r] + 32 * z, lo[r]);
            _mm512_storeu_ps(acc[r] + 32 * z + 16, hi[r]);
        }
    }
}

/* Turn row r's scores over a segment's keys (s, keys first .. first + n - 1) into its weights:
 * bfloat16, in place at the start of s's bytes (key j's at (uint16_t *)s + j - first), 0 outside
 * lo .. hi (keys the row sees there: at least one). Returns the sum of its exponentials, their
 * maximum score into *top. */
static float dot_softmax(float *s, int64_t first, int64_t n, int64_t lo, int64_t hi,
                         float softcap, float *top) {
    if (softcap > 0.0f)
        for (int64_t j = lo; j <= hi; j++)
            s[j - first] = tanhf(s[j - first] / softcap) * softcap;
    const vrowi lo_v = splat_rowi((int32_t)(lo - first)), hi_v = splat_rowi((int32_t)(hi - first));
    const vrowi lane = (vrowi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    __m512 most = _mm512_set1_ps(s[lo - first]);                 /* the maximum (exact) */
    for (int64_t b = (lo - first) & ~(int64_t)(DOT_KEYS - 1); b <= hi - first; b += DOT_KEYS) {
        const vrowi key = lane + splat_rowi((int32_t)b);
        const __mmask16 seen = _mm512_cmpge_epi32_mask((__m512i)key, (__m512i)lo_v)
                               & _mm512_cmple_epi32_mask((__m512i)key, (__m512i)hi_v);
        most = _mm512_mask_max_ps(most, seen, most, _mm512_loadu_ps(s + b));
    }
    *top = _mm512_reduce_max_ps(most);
    const vrow t = splat_row(*top);
    vrow sum = splat_row(0.0f);
    uint16_t *w = (uint16_t *)s;
    for (int64_t b = 0; b < n; b += DOT_KEYS) {        /* w's block b written after s's read */
        const vrowi key = lane + splat_rowi((int32_t)b);
        const vrowi seen = (key >= lo_v) & (key <= hi_v);
        const vrow e = (vrow)((vrowi)exp_row(*(const vrow *)(s + b) - t) & seen);
        sum += e;
        _mm256_storeu_si256((__m256i *)(w + b), (__m256i)_mm512_cvtneps_pbh((__m512)e));
    }
    float part[DOT_KEYS];                          /* ((l0 + l1) + (l2 + l3)) + ...: a fixed tree */
    memcpy(part, &sum, sizeof part);
    for (int width = DOT_KEYS / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++)
            part[l] = part[2 * l] + part[2 * l + 1];
    return part[0];
}

/* Rows' softmax states over their segments so far (maximum m, sum l of exponentials relative to
 * m, weighed values acc[r][D]) with each row's next segment (top, sum, part[r]) folded in, for
 * rows r with fold[r] (1: the row's first segment, taken as it is; 2: a later one; 0: none
 * here). Every row folds its segments in key order through this one function, whichever task
 * computed each, alone or beside others: each lane of exp_row depends on its own input only. */
static void dot_fold(int rows, float *m, float *l, float *const *acc, const float *top,
                     const float *sum, float *const *part, const int *fold, int64_t D) {
    for (int r0 = 0; r0 < rows; r0 += TILE) {
        float mv[TILE] = {0}, tv[TILE] = {0}, a[TILE], b[TILE];
        const int n = rows - r0 < TILE ? rows - r0 : TILE;
        for (int i = 0; i < n; i++)
            if (fold[r0 + i] == 2) {
                tv[i] = top[r0 + i];
                mv[i] = top[r0 + i] > m[r0 + i] ? top[r0 + i] : m[r0 + i];
            }
        vrow most, x;
        memcpy(&most, mv, sizeof most);
        memcpy(&x, m + r0, sizeof(float) * n);
        for (int i = n; i < TILE; i++)
            x[i] = 0.0f;
        const vrow ea = exp_row(x - most), eb = exp_row(*(const vrow *)tv - most);
        memcpy(a, &ea, sizeof a);
        memcpy(b, &eb, sizeof b);
        for (int i = 0; i < n; i++) {
            const int r = r0 + i;
            if (fold[r] == 1) {
                m[r] = top[r];
                l[r] = sum[r];
                memcpy(acc[r], part[r], sizeof(float) * D);
            } else if (fold[r] == 2) {
                m[r] = mv[i];
                l[r] = l[r] * a[i] + sum[r] * b[i];
                for (int64_t d = 0; d < D; d++)
                    acc[r][d] = acc[r][d] * a[i] + part[r][d] * b[i];
            }
        }
    }
}

/* row r's output: acc (dimensions as the values' lanes, dot_values_of) / l, into o[D] */
static void dot_write(float *o, const float *acc, float l, int64_t D) {
    const float inv = 1.0f / l;
    for (int64_t z = 0; z < D / 32; z++)
        for (int i = 0; i < 16; i++) {
            const int64_t d = 32 * z + 8 * (i / 4) + i % 4;
            o[d] = acc[32 * z + i] * inv;
            o[d + 4] = acc[32 * z + 16 + i] * inv;
        }
}

/* STEP(nr) for each kv head kv's rows of a task (rows from[kv - kv0] .. from[kv - kv0 + 1] - 1),
 * DOT_GROUP at a time from row g0, nr a constant in each case (their chains fully unrolled) */
#define ROW_GROUPS(STEP)                                                                        \
    for (int64_t kv = kv0; kv <= kv1; kv++)                                                     \
        for (int g0 = from[kv - kv0], end_kv = from[kv - kv0 + 1]; g0 < end_kv; g0 += DOT_GROUP) \
            switch (end_kv - g0 < DOT_GROUP ? end_kv - g0 : DOT_GROUP) {                        \
            case 4: STEP(4); break;                                                             \
            case 3: STEP(3); break;                                                             \
            case 2: STEP(2); break;                                                             \
            default: STEP(1); break;                                                            \
            }

struct dot_task {
    int64_t b, p0, p1, h0, h1;         /* request, positions p0 .. p1 - 1, heads h0 .. h1 - 1 */
    int64_t s0, s1;                    /* segments s0 .. s1 - 1 of its rows' keys; s1 = 0: all */
    int64_t part;                      /* a split request's partials in `parts`; -1: none */
};

/* a task's query rows, by kv head, then position, then head: kv head kv's at rows from[kv -
 * kv0] .. from[kv - kv0 + 1] - 1, each row's position, head and keys lo .. hi. Returns the
 * count. */
static int dot_rows(const struct dot_task *task, const int64_t *requests, int64_t G,
                    int64_t window, int *from, int64_t *pos, int64_t *head, int64_t *lo,
                    int64_t *hi) {
    const int64_t q_len = requests[task->b * 3 + 1], seq_len = requests[task->b * 3 + 2];
    const int64_t kv0 = task->h0 / G, kv1 = (task->h1 - 1) / G;
    int r = 0;
    for (int64_t kv = kv0; kv <= kv1; kv++) {
        from[kv - kv0] = r;
        const int64_t ha = kv * G > task->h0 ? kv * G : task->h0;
        const int64_t hb = (kv + 1) * G < task->h1 ? (kv + 1) * G : task->h1;
        for (int64_t i = task->p0; i < task->p1; i++)
            for (int64_t h = ha; h < hb; h++, r++) {
                pos[r] = i;
                head[r] = h;
                hi[r] = seq_len - q_len + i;
                lo[r] = first_key(hi[r], window);
            }
    }
    from[kv1 - kv0 + 1] = r;
    return r;
}

/* the segments a request's rows see: the first into *sa, their count returned */
static int64_t dot_span(int64_t q_len, int64_t seq_len, int64_t window, int64_t *sa) {
    *sa = first_key(seq_len - q_len, window) / DOT_SEG;
    return (seq_len - 1) / DOT_SEG - *sa + 1;
}

/* whether a request is split by segments into `parts` tasks: its rows fit one task and it has
 * a segment's keys for every part (with 256-key segments, a decode over 260 keys split into
 * tasks of 256 and 4 keys took 1.18x the head split's time; over 400 keys and more the split
 * paid) */
static int dot_split(int64_t q_len, int64_t seq_len, int64_t window, int64_t num_heads,
                     int64_t parts) {
    return parts > 1 && q_len * num_heads <= DOT_ROWS
           && seq_len - first_key(seq_len - q_len, window) >= parts * DOT_SEG;
}

int paged_attention_short_bf16(const float *q, int64_t q_token_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, float *out, int64_t out_token_stride,
                               const int64_t *requests, const int64_t *tables, int64_t table_width,
                               int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int64_t window,
                               float softcap, int num_threads) {
    const int64_t D = head_dim, G = num_heads / num_kv_heads, slot = num_kv_heads * D;
    if (D % 32)
        return paged_attention_short_bf16w(q, q_token_stride, k_cache, v_cache, out,
                                           out_token_stride, requests, tables, table_width,
                                           num_reqs, num_heads, num_kv_heads, head_dim,
                                           block_size, scale, window, softcap, num_threads);
    /* A task: a request's heads h0 .. h1 - 1 (every head, or with fewer requests than threads
     * a part of them) at up to DOT_ROWS / heads positions. It walks the keys once for all its
     * rows, reading each key's slot from its first kv head to its last in turn. With fewer
     * requests than threads, a request whose rows fit one task and whose keys span segments
     * (a decode over a long context) is split by segments instead: every task reads whole
     * slots for all its heads, and the rows' partials are folded after. */
    const int64_t parts = num_reqs >= num_threads ? 1 : (num_threads + num_reqs - 1) / num_reqs;
    const int64_t part_heads = (num_heads + parts - 1) / parts;
    int64_t heads = part_heads < DOT_ROWS ? part_heads : DOT_ROWS;
    for (int64_t b = 0; b < num_reqs && parts == 1 && heads > G; b++)
        if (requests[b * 3 + 1] * G >= DOT_ROWS / 2)
            heads = G;           /* prompt tiles: a kv head's keys read once for DOT_ROWS rows */
    const int64_t per = DOT_ROWS / heads;                        /* positions a task */
    int64_t num_tasks = 0, max_keys = DOT_KEYS, max_rows = 1, num_parts = 0;
    for (int64_t b = 0; b < num_reqs; b++) {
        const int64_t q_len = requests[b * 3 + 1], keys = requests[b * 3 + 2] + 2 * DOT_KEYS;
        int64_t sa;
        const int64_t span = dot_span(q_len, requests[b * 3 + 2], window, &sa);
        const int split = dot_split(q_len, requests[b * 3 + 2], window, num_heads, parts);
        const int64_t rows = split ? q_len * num_heads : (q_len < per ? q_len : per) * heads;
        num_tasks += split ? (span < parts ? span : parts)
                           : (num_heads + heads - 1) / heads * ((q_len + per - 1) / per);
        num_parts += split ? rows * span * (D + 2) : 0;
        max_keys = keys > max_keys ? keys : max_keys;
        max_rows = rows > max_rows ? rows : max_rows;
    }
    struct dot_task *tasks = malloc(sizeof(struct dot_task) * (num_tasks ? num_tasks : 1));
    float *partials = num_parts ? malloc(sizeof(float) * num_parts) : NULL;
    if (!tasks || (num_parts && !partials)) {
        free(tasks);
        return -1;
    }
    int64_t t = 0, at = 0;
    for (int64_t b = 0; b < num_reqs; b++) {
        const int64_t q_len = requests[b * 3 + 1];
        int64_t sa;
        const int64_t span = dot_span(q_len, requests[b * 3 + 2], window, &sa);
        if (dot_split(q_len, requests[b * 3 + 2], window, num_heads, parts)) {
            const int64_t n = span < parts ? span : parts;
            for (int64_t i = 0; i < n; i++)
                tasks[t++] = (struct dot_task){b, 0, q_len, 0, num_heads, sa + span * i / n,
                                               sa + span * (i + 1) / n, at};
            at += q_len * num_heads * span * (D + 2);
            continue;
        }
        for (int64_t p0 = 0; p0 < q_len; p0 += per)
            for (int64_t h0 = 0; h0 < num_heads; h0 += heads)
                tasks[t++] = (struct dot_task){b, p0, p0 + per < q_len ? p0 + per : q_len, h0,
                                               h0 + heads < num_heads ? h0 + heads : num_heads,
                                               0, 0, -1};
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_tasks > 1)
    {
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);                 /* denormals flushed, as vdpbf16ps does */
        int64_t *off = malloc(sizeof(int64_t) * max_keys);
        float *scores = malloc(sizeof(float) * max_rows * DOT_SCORES);
        float *acc = malloc(sizeof(float) * max_rows * D * 2);      /* the rows' and a segment's */
        uint16_t *qb = malloc(sizeof(uint16_t) * max_rows * D);
        __m512i *kt = _mm_malloc(sizeof(__m512i) * num_kv_heads * D / 2, 64);
        __m512i *vi = _mm_malloc(sizeof(__m512i) * num_kv_heads * D / 2, 64);
        const int ok = off && scores && acc && qb && kt && vi;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t ti = 0; ti < num_tasks; ti++) {
            if (!ok)
                continue;
            const struct dot_task *task = &tasks[ti];
            const int64_t q0 = requests[task->b * 3], seq_len = requests[task->b * 3 + 2];
            const int64_t kv0 = task->h0 / G, kv1 = (task->h1 - 1) / G;
            int from[DOT_ROWS + 1];
            int64_t lo[DOT_ROWS], hi[DOT_ROWS], pos[DOT_ROWS], head[DOT_ROWS];
            float most[DOT_ROWS] = {0}, sum[DOT_ROWS] = {0}, m_run[DOT_ROWS] = {0};
            float l_run[DOT_ROWS] = {0};
            int seen[DOT_ROWS];
            const uint32_t *qp[DOT_ROWS];
            float *sr[DOT_ROWS], *ar[DOT_ROWS], *pr[DOT_ROWS];
            const int rows = dot_rows(task, requests, G, window, from, pos, head, lo, hi);
            int r;
            for (r = 0; r < rows; r++) {
                const float *qr = q + (q0 + pos[r]) * q_token_stride + head[r] * D;
                for (int64_t d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i *)(qb + r * D + d),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qr + d)));
                qp[r] = (const uint32_t *)(qb + r * D);
                sr[r] = scores + r * DOT_SCORES;
                ar[r] = acc + r * D;
                pr[r] = acc + (rows + r) * D;
            }
            int64_t first = lo[0], last = hi[0];
            for (r = 1; r < rows; r++) {
                first = lo[r] < first ? lo[r] : first;
                last = hi[r] > last ? hi[r] : last;
            }
            const int64_t sa = first / DOT_SEG, span = last / DOT_SEG - sa + 1;
            const int64_t s0 = task->s1 ? task->s0 : sa, s1 = task->s1 ? task->s1 : sa + span;
            /* keys from .. end - 1: whole blocks of DOT_KEYS within the task's segments */
            const int64_t from_key = (first & ~(int64_t)(DOT_KEYS - 1)) > s0 * DOT_SEG
                                         ? first & ~(int64_t)(DOT_KEYS - 1) : s0 * DOT_SEG;
            const int64_t last_end = (last + DOT_KEYS) & ~(int64_t)(DOT_KEYS - 1);
            const int64_t end = last_end < s1 * DOT_SEG ? last_end : s1 * DOT_SEG;
            const int64_t n = end - from_key;
            /* off[j - from_key]: key j's slot (keys past seq_len: the last key's) */
            const int64_t *table = tables + task->b * table_width;
            int64_t j = from_key;
            for (int64_t b = from_key / block_size, i = from_key % block_size;
                 j < end && j < seq_len; b++, i = 0)
                for (const int64_t base = table[b] * block_size; i < block_size && j < end
                                                                  && j < seq_len; i++, j++)
                    off[j - from_key] = (base + i) * slot;
            for (; j < end; j++)
                off[j - from_key] = off[seq_len - 1 - from_key];
            for (int64_t j = 0; j < DOT_AHEAD && j < n; j++)     /* the first keys' lines */
                for (int64_t byte = kv0 * D * 2; byte < (kv1 + 1) * D * 2; byte += 64)
                    _mm_prefetch((const char *)(k_cache + off[j]) + byte, _MM_HINT_T2);
            for (int64_t s = s0; s < s1; s++) {
                const int64_t ja = s * DOT_SEG > from_key ? s * DOT_SEG : from_key;
                const int64_t jb = (s + 1) * DOT_SEG < end ? (s + 1) * DOT_SEG : end;
                /* the segment's first values, requested as its keys are read (by the time its
                 * weights are known, they have arrived) */
                for (int64_t j = ja; j < ja + DOT_AHEAD && j < jb; j++)
                    for (int64_t byte = kv0 * D * 2; byte < (kv1 + 1) * D * 2; byte += 64)
                        _mm_prefetch((const char *)(v_cache + off[j - from_key]) + byte,
                                     _MM_HINT_T2);
                for (int64_t j0 = ja; j0 < jb; j0 += DOT_KEYS) {
                    float *sc[DOT_ROWS];
                    for (r = 0; r < rows; r++)
                        sc[r] = sr[r] + (j0 - ja);
                    dot_keys(k_cache, off, j0 - from_key, n, kv0, kv1 - kv0 + 1, D, kt);
#define SCORES(nr) dot_scores(nr, qp + g0, kt + (kv - kv0) * D / 2, D / 2, scale, sc + g0)
                    ROW_GROUPS(SCORES);
#undef SCORES
                }
                for (r = 0; r < rows; r++) {      /* rows seeing no key here weigh every one 0 */
                    const int64_t a = lo[r] > ja ? lo[r] : ja, z = hi[r] < jb - 1 ? hi[r] : jb - 1;
                    seen[r] = a <= z;
                    if (seen[r])
                        sum[r] = dot_softmax(sr[r], ja, jb - ja, a, z, softcap, &most[r]);
                    else
                        memset(sr[r], 0, sizeof(uint16_t) * (size_t)(jb - ja));
                }
                memset(pr[0], 0, sizeof(float) * rows * D);
                for (int64_t j0 = ja; j0 < jb; j0 += DOT_KEYS) {
                    const uint32_t *pp[DOT_ROWS];
                    for (r = 0; r < rows; r++)
                        pp[r] = (const uint32_t *)((const uint16_t *)sr[r] + (j0 - ja));
                    dot_values_of(v_cache, off, j0 - from_key, n, kv0, kv1 - kv0 + 1, D, vi);
#define WEIGH(nr) dot_weigh(nr, pp + g0, vi + (kv - kv0) * D / 2, D / 32, pr + g0)
                    ROW_GROUPS(WEIGH);
#undef WEIGH
                }
                if (task->part >= 0) {                  /* each row's segment: kept or folded */
                    for (r = 0; r < rows; r++)
                        if (seen[r]) {
                            float *to = partials + task->part + (r * span + s - sa) * (D + 2);
                            to[0] = most[r];
                            to[1] = sum[r];
                            memcpy(to + 2, pr[r], sizeof(float) * D);
                        }
                } else {
                    for (r = 0; r < rows; r++)
                        seen[r] = !seen[r] ? 0 : s == lo[r] / DOT_SEG ? 1 : 2;
                    dot_fold(rows, m_run, l_run, ar, most, sum, pr, seen, D);
                }
            }
            if (task->part < 0)
                for (r = 0; r < rows; r++)
                    dot_write(out + (q0 + pos[r]) * out_token_stride + head[r] * D, ar[r],
                              l_run[r], D);
        }
        /* a split request's rows: their segments' partials folded in key order */
#pragma omp for schedule(dynamic, 1)
        for (int64_t ti = 0; ti < num_tasks; ti++) {
            const struct dot_task *task = &tasks[ti];
            if (!ok || task->part < 0)
                continue;
            const int64_t q0 = requests[task->b * 3];
            int64_t sa;
            const int64_t span = dot_span(requests[task->b * 3 + 1], requests[task->b * 3 + 2],
                                          window, &sa);
            if (task->s0 != sa)
                continue;                         /* the request's first task merges its rows */
            int from[DOT_ROWS + 1];
            int64_t lo[DOT_ROWS], hi[DOT_ROWS], pos[DOT_ROWS], head[DOT_ROWS];
            const int rows = dot_rows(task, requests, G, window, from, pos, head, lo, hi);
            for (int r = 0; r < rows; r++) {
                float m = 0.0f, l = 0.0f;
                for (int64_t s = lo[r] / DOT_SEG; s <= hi[r] / DOT_SEG; s++) {
                    float *p = partials + task->part + (r * span + s - sa) * (D + 2), *pa = p + 2;
                    const int fold = s == lo[r] / DOT_SEG ? 1 : 2;
                    dot_fold(1, &m, &l, &acc, p, p + 1, &pa, &fold, D);
                }
                dot_write(out + (q0 + pos[r]) * out_token_stride + head[r] * D, acc, l, D);
            }
        }
        free(off);
        free(scores);
        free(acc);
        free(qb);
        _mm_free(kt);
        _mm_free(vi);
        _mm_setcsr(csr);
    }
    free(tasks);
    free(partials);
    return failed ? -1 : 0;
}

#endif
