/* The part of `paged_attention.c` that reads the K/V cache, written once for each element type
 * the cache may hold: `paged_attention.c` includes this file three times, with
 *   KV_T       the cache's element type (float; uint16_t holding bfloat16 bits; uint8_t, fp8),
 *   KV_(name)  this form's name of a function or constant (name; name##_bf16; name##_fp8),
 *   KV_STAGED  0: the float32 form's prompt tiles read the cache in place; 1: the narrow forms'
 *              tiles widen each block of KEYS keys (then each chunk of CHUNK values) of a kv
 *              head into `stage` (float32, exactly) once for all their rows.
 * The decode rows widen in registers (loadrow / loadpair). Every product and sum is the float32
 * form's, in the same order: a narrow form's result is bit for bit the float32 form's over the
 * widened cache, and as row-invariant.
 * (No include guard: included once per element type.)
 */

/* Keys' cache lines requested from memory ahead of use, a few keys at a time between the rows'
 * work (a burst of a whole block's lines would overflow the core's miss queue): key after key,
 * the lines of the kv heads the task reads. */
struct KV_(ahead) {
    const char *at;                     /* the cache's bytes from the task's first kv head on */
    const int64_t *off;                 /* slot offsets, in elements */
    int64_t key, end, bytes;            /* next key, keys end, bytes of a slot the task reads */
};

static inline void KV_(prefetch_keys)(struct KV_(ahead) *a, int64_t n) {
    for (; n > 0 && a->key < a->end; n--, a->key++) {
        const uintptr_t at = (uintptr_t)(a->at + sizeof(KV_T) * a->off[a->key]);
        for (uintptr_t line = at & ~(uintptr_t)63; line < at + a->bytes; line += 64)
            __builtin_prefetch((const void *)line, 0, 1);
    }
}

/* q . K[j0 + i] * scale for i < KEYS, n rows of one kv head at once (K[j] at k + off[j]; each
 * key's vector loaded and widened once for all of them) into out[r][0 .. KEYS). qd[r]: row r's
 * query times UNIT, each 8 dimensions repeated KP times (loadpair's shape); q[r]: the query. Each
 * row's products and sums do not depend on n or the other rows: 8 lanes of fused multiply-adds
 * over the dimensions d = l mod 8 in order, tree8x8's tree, the dimensions past the lanes in
 * order, then the scale. */
static inline __attribute__((always_inline)) void KV_(scores_rows)(
    const int n, const float *const *qd, const float *const *q, const KV_T *k, const int64_t *off,
    int64_t j0, int64_t head_dim, float scale, float *const *out) {
    const KV_T *kp[KEYS];
    vrow acc[GROUP_ROWS][KEYS / KP];
    for (int i = 0; i < KEYS; i++)
        kp[i] = k + off[j0 + i];
    for (int r = 0; r < n; r++)
        for (int p = 0; p < KEYS / KP; p++)
            acc[r][p] = splat_row(0.0f);
    const int64_t lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < lanes; d += 8)
        for (int p = 0; p < KEYS / KP; p++) {
            const vrow kv = KV_(loadpair)(kp[KP * p] + d, kp[KP * p + KP - 1] + d);
            for (int r = 0; r < n; r++)
                acc[r][p] = fma_row(*(const vrow *)(qd[r] + KP * d), kv, acc[r][p]);
        }
    for (int r = 0; r < n; r++) {
        v8f key[KEYS];
        for (int p = 0; p < KEYS / KP; p++)
#if KP == 2
            split_pair(acc[r][p], &key[2 * p], &key[2 * p + 1]);
#else
            key[p] = acc[r][p];
#endif
        v8f s = tree8x8(key);
        for (int64_t d = lanes; d < head_dim; d++)        /* dimensions past the lanes, in order */
            for (int i = 0; i < KEYS; i++)
                s[i] += q[r][d] * KV_(widen1)(kp[i][d]);
        *(v8f *)out[r] = s * scale;
    }
}

/* acc[r][d0 .. d0 + TILE * nc) += p[r][j] * V[j] there, keys lo..hi in order, for n rows at once
 * (each value vector loaded and widened once for all of them): each row's chains of fused
 * multiply-adds, dimension by dimension, are the same whatever n */
static inline __attribute__((always_inline)) void KV_(weigh_block)(
    const int n, const int nc, const float *const *p, const KV_T *v, const int64_t *off,
    int64_t lo, int64_t hi, int64_t d0, float *const *acc) {
    vrow a[GROUP_ROWS][4];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nc; c++)
            a[r][c] = *(const vrow *)(acc[r] + d0 + TILE * c);
    for (int64_t j = lo; j <= hi; j++) {
        const KV_T *vj = v + off[j] + d0;
        vrow vv[4];
        for (int c = 0; c < nc; c++)
            vv[c] = KV_(loadrow)(vj + TILE * c);
        for (int r = 0; r < n; r++) {
            const vrow pj = splat_row(p[r][j] * KV_(UNIT));
            for (int c = 0; c < nc; c++)
                a[r][c] = fma_row(pj, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < nc; c++)
            *(vrow *)(acc[r] + d0 + TILE * c) = a[r][c];
}

/* weigh_block over dimensions d0 .. d1 - 1 (d0 a multiple of TILE): TILE at a time, then one by
 * one (a fused multiply-add below the last multiple of 8, as the 8-lane form computes there, a
 * product then a sum past it) */
static void KV_(weigh_rows)(int n, const float *const *p, const KV_T *v, const int64_t *off,
                            int64_t lo, int64_t hi, int64_t d0, int64_t d1, int64_t head_dim,
                            float *const *acc) {
    const int64_t vec = d1 / TILE * TILE, lanes = head_dim & ~(int64_t)7;
    for (int64_t d = d0; d < vec; d += 4 * TILE) {
        const int nc = (vec - d) / TILE < 4 ? (int)((vec - d) / TILE) : 4;
#define WEIGH_CASE(N, NC)                                                                       \
    case (N) * 8 + (NC): KV_(weigh_block)(N, NC, p, v, off, lo, hi, d, acc); break;
        switch (n * 8 + nc) {                                   /* constant counts each case */
            WEIGH_CASE(1, 1) WEIGH_CASE(1, 2) WEIGH_CASE(1, 3) WEIGH_CASE(1, 4)
            WEIGH_CASE(2, 1) WEIGH_CASE(2, 2) WEIGH_CASE(2, 3) WEIGH_CASE(2, 4)
#if GROUP_ROWS > 2
            WEIGH_CASE(3, 1) WEIGH_CASE(3, 2) WEIGH_CASE(3, 3) WEIGH_CASE(3, 4)
#endif
        }
#undef WEIGH_CASE
    }
    for (int64_t d = vec > d0 ? vec : d0; d < d1; d++)
        for (int r = 0; r < n; r++)
            for (int64_t j = lo; j <= hi; j++) {
                const float x = KV_(widen1)(v[off[j] + d]);
                acc[r][d] = d < lanes ? __builtin_fmaf(p[r][j], x, acc[r][d])
                                      : acc[r][d] + p[r][j] * x;
            }
}

/* A group's values over keys c0 .. c0 + CHUNK - 1 (each row's within lo..hi), dimensions d0 ..
 * d1 - 1: the keys all its rows see together, the rest row by row; each row still takes its keys
 * in order */
static void KV_(weigh_group)(const struct row *rw, const struct group *g, const KV_T *v_cache,
                             const int64_t *off, int64_t c0, int64_t d0, int64_t d1,
                             int64_t head_dim) {
    const float *p[GROUP_ROWS];
    float *acc[GROUP_ROWS];
    int64_t lo[GROUP_ROWS], hi[GROUP_ROWS];
    const int n = g->n;
    for (int i = 0; i < n; i++) {
        const struct row *w = rw + g->row + i;
        p[i] = w->scores;
        acc[i] = w->acc;
        lo[i] = w->lo > c0 ? w->lo : c0;
        hi[i] = w->hi < c0 + CHUNK - 1 ? w->hi : c0 + CHUNK - 1;
    }
    const KV_T *v = v_cache + g->kv * head_dim;
    int64_t both_lo = lo[0], both_hi = hi[0];
    for (int r = 1; r < n; r++) {
        both_lo = lo[r] > both_lo ? lo[r] : both_lo;
        both_hi = hi[r] < both_hi ? hi[r] : both_hi;
    }
    if (both_lo > both_hi) {
        for (int r = 0; r < n; r++)
            if (lo[r] <= hi[r])
                KV_(weigh_rows)(1, p + r, v, off, lo[r], hi[r], d0, d1, head_dim, acc + r);
        return;
    }
    for (int r = 0; r < n; r++)
        if (lo[r] < both_lo)
            KV_(weigh_rows)(1, p + r, v, off, lo[r], both_lo - 1, d0, d1, head_dim, acc + r);
    KV_(weigh_rows)(n, p, v, off, both_lo, both_hi, d0, d1, head_dim, acc);
    for (int r = 0; r < n; r++)
        if (hi[r] > both_hi)
            KV_(weigh_rows)(1, p + r, v, off, both_hi + 1, hi[r], d0, d1, head_dim, acc + r);
}

/* Scores of groups g_from .. g_to - 1 (one request's) against keys j_from .. j_to - 1 (multiples
 * of KEYS): each block of keys scored for every group in turn while in the L1 cache, the slots
 * AHEAD keys on (of the groups' kv heads) requested early */
static void KV_(score_keys)(const struct row *rw, const struct group *gr, int64_t g_from,
                            int64_t g_to, const KV_T *k_cache, const int64_t *off,
                            int64_t j_from, int64_t j_to, int64_t seq_len, int64_t head_dim,
                            float scale) {
    const int64_t kv0 = gr[g_from].kv, groups = g_to - g_from;
    struct KV_(ahead) ka = {(const char *)(k_cache + kv0 * head_dim), off, j_from + AHEAD,
                            j_to < seq_len ? j_to : seq_len,
                            (gr[g_to - 1].kv - kv0 + 1) * head_dim * (int64_t)sizeof(KV_T)};
    const int64_t per = (KEYS + groups - 1) / groups;            /* per group, a block's keys */
    for (int64_t j0 = j_from; j0 < j_to; j0 += KEYS) {
        if (ka.key < j0 + AHEAD)
            ka.key = j0 + AHEAD;
        for (const struct group *g = gr + g_from; g < gr + g_to; g++) {
            KV_(prefetch_keys)(&ka, per);
            if (j0 > g->last || j0 + KEYS <= g->first)
                continue;
            const KV_T *kh = k_cache + g->kv * head_dim;
            const float *qd[GROUP_ROWS], *q[GROUP_ROWS];
            float *o[GROUP_ROWS];
            for (int i = 0; i < g->n; i++) {
                qd[i] = rw[g->row + i].qd;
                q[i] = rw[g->row + i].q;
                o[i] = rw[g->row + i].scores + j0;
            }
            switch (g->n) {                                      /* a constant count each case */
            case 1: KV_(scores_rows)(1, qd, q, kh, off, j0, head_dim, scale, o); break;
            case 2: KV_(scores_rows)(2, qd, q, kh, off, j0, head_dim, scale, o); break;
#if GROUP_ROWS > 2
            case 3: KV_(scores_rows)(3, qd, q, kh, off, j0, head_dim, scale, o); break;
#endif
            }
        }
    }
}

/* Values of groups g_from .. g_to - 1 (one request's), keys from c_from on in chunks of CHUNK,
 * dimensions d0 .. d1 - 1, into their rows' sums (zeroed here): each chunk weighed for every group
 * in turn while in the L1 cache, the slots AHEAD keys on requested early */
static void KV_(weigh_values)(const struct row *rw, const struct group *gr, int64_t g_from,
                              int64_t g_to, const KV_T *v_cache, const int64_t *off,
                              int64_t c_from, int64_t seq_len, int64_t d0, int64_t d1,
                              int64_t head_dim) {
    const int64_t kv0 = gr[g_from].kv, groups = g_to - g_from;
    for (const struct group *g = gr + g_from; g < gr + g_to; g++)
        for (int i = 0; i < g->n; i++)
            memset(rw[g->row + i].acc + d0, 0, sizeof(float) * (d1 - d0));
    struct KV_(ahead) va = {(const char *)(v_cache + kv0 * head_dim + d0), off, c_from, seq_len,
                            ((gr[g_to - 1].kv - kv0) * head_dim + d1 - d0) * (int64_t)sizeof(KV_T)};
    KV_(prefetch_keys)(&va, AHEAD);
    const int64_t per = (CHUNK + groups - 1) / groups;          /* per group, a chunk's keys */
    for (int64_t c0 = c_from; c0 < seq_len; c0 += CHUNK)
        for (const struct group *g = gr + g_from; g < gr + g_to; g++) {
            KV_(prefetch_keys)(&va, per);
            KV_(weigh_group)(rw, g, v_cache, off, c0, d0, d1, head_dim);
        }
}

/* One request's heads h0 .. h0 + nh - 1, every query row of each, by one task: one pass over the
 * keys (score_keys), the softmax, one pass over the values (weigh_values). Scratch: off, the slot
 * offset of every key (seq_len rounded up to KEYS, the padding repeating the last key's); scores,
 * keys_padded floats per row; acc, head_dim floats per row; qd, KP * head_dim per row; rw, gr,
 * one each per row. */
static void KV_(attend_request)(const float *q, int64_t q_token_stride, const KV_T *k_cache,
                                const KV_T *v_cache, float *out, int64_t out_token_stride,
                                const int64_t *table, int64_t q_start, int64_t q_len,
                                int64_t seq_len, int64_t h0, int64_t nh, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int64_t window, float softcap, int64_t *off,
                                float *scores, float *acc, float *qd, struct row *rw,
                                struct group *gr) {
    const int64_t padded = (seq_len + KEYS - 1) & ~(int64_t)(KEYS - 1), rows = nh * q_len;
    key_offsets(off, table, seq_len, padded, block_size, num_kv_heads * head_dim);
    const int64_t groups = decode_rows(q, q_token_stride, out, out_token_stride, q_start, q_len,
                                       seq_len, h0, nh, num_heads / num_kv_heads, head_dim,
                                       window, KV_(UNIT), scores, acc, qd, rw, gr);
    const int64_t lo_any = first_key(seq_len - q_len, window);
    KV_(score_keys)(rw, gr, 0, groups, k_cache, off, lo_any & ~(int64_t)(KEYS - 1), padded,
                    seq_len, head_dim, scale);
    for (int64_t r = 0; r < rows; r++)
        soften_row(rw + r, softcap);
    KV_(weigh_values)(rw, gr, 0, groups, v_cache, off, lo_any, seq_len, 0, head_dim, head_dim);
    for (int64_t r = 0; r < rows; r++)
        finish_row(rw + r, head_dim);
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

/* Fewer requests than threads, every one of them short (one decode): the threads share each
 * request's kv heads rather than its heads, so that no kv head is read twice. The keys of each
 * kv head are parted among the threads for the scores, the rows soft-maxed, then the dimensions
 * of its values parted among them for the sums (each row's arithmetic is the one-task form's:
 * a score does not depend on who computes the others, nor a dimension's chain). Returns 0, or
 * -1 when scratch memory could not be allocated. */
static int KV_(attend_shared)(const float *q, int64_t q_token_stride, const KV_T *k_cache,
                              const KV_T *v_cache, float *out, int64_t out_token_stride,
                              const int64_t *requests, const int64_t *tables,
                              int64_t table_width, int64_t num_reqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, int64_t window, float softcap, int num_threads) {
    /* each request's scratch at its offsets into one allocation of each kind */
    int64_t keys = 0, rows = 0;
    int64_t at_key[num_reqs + 1], at_row[num_reqs + 1], at_group[num_reqs + 1];
    for (int64_t b = 0; b < num_reqs; b++) {
        at_key[b] = keys, at_row[b] = rows;
        keys += (requests[b * 3 + 2] + KEYS - 1) & ~(int64_t)(KEYS - 1);
        rows += num_heads * requests[b * 3 + 1];
    }
    at_key[num_reqs] = keys, at_row[num_reqs] = rows;
    int64_t *off = malloc(sizeof(int64_t) * keys);
    float *scores = malloc(sizeof(float) * keys * num_heads * 3);  /* q_len < TILE_MIN_ROWS */
    float *acc = malloc(sizeof(float) * rows * head_dim);
    float *qd = malloc(sizeof(float) * rows * KP * head_dim);
    struct row *rw = malloc(sizeof(struct row) * rows);
    struct group *gr = malloc(sizeof(struct group) * rows);
    int failed = !(off && scores && acc && qd && rw && gr);
    if (!failed) {
        const int64_t group = num_heads / num_kv_heads;
        const int64_t tasks = num_reqs * num_kv_heads * num_threads;
        const int64_t vecs = head_dim / TILE;          /* dimension parts: whole vectors each */
#pragma omp parallel num_threads(num_threads)
        {
#if defined(__SSE__)
            const unsigned int csr = _mm_getcsr();    /* as paged_attention_short (below) */
            _mm_setcsr(csr | 0x8040);
#endif
#pragma omp for schedule(static, 1)
            for (int64_t b = 0; b < num_reqs; b++) {
                const int64_t seq_len = requests[b * 3 + 2], q_len = requests[b * 3 + 1];
                key_offsets(off + at_key[b], tables + b * table_width, seq_len,
                            at_key[b + 1] - at_key[b], block_size, num_kv_heads * head_dim);
                at_group[b] = decode_rows(q, q_token_stride, out, out_token_stride,
                                          requests[b * 3], q_len, seq_len, 0, num_heads, group,
                                          head_dim, window, KV_(UNIT),
                                          scores + at_key[b] * num_heads * 3,
                                          acc + at_row[b] * head_dim,
                                          qd + at_row[b] * KP * head_dim, rw + at_row[b],
                                          gr + at_row[b]);
            }
            /* task t: request b, kv head kv, part t % num_threads (of its keys, then of its
             * values' dimensions); a kv head's groups are consecutive */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                const int64_t b = t / (num_kv_heads * num_threads);
                const int64_t kv = t / num_threads % num_kv_heads, part = t % num_threads;
                const struct group *g = gr + at_row[b];
                int64_t g_from = 0, g_to;
                while (g_from < at_group[b] && g[g_from].kv < kv)
                    g_from++;
                for (g_to = g_from; g_to < at_group[b] && g[g_to].kv == kv; g_to++)
                    ;
                if (g_from == g_to)
                    continue;
                const int64_t seq_len = requests[b * 3 + 2], q_len = requests[b * 3 + 1];
                const int64_t first = first_key(seq_len - q_len, window) & ~(int64_t)(KEYS - 1);
                const int64_t blocks = (at_key[b + 1] - at_key[b] - first) / KEYS;
                KV_(score_keys)(rw + at_row[b], g, g_from, g_to, k_cache, off + at_key[b],
                                first + blocks * part / num_threads * KEYS,
                                first + blocks * (part + 1) / num_threads * KEYS, seq_len,
                                head_dim, scale);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                soften_row(rw + r, softcap);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                const int64_t b = t / (num_kv_heads * num_threads);
                const int64_t kv = t / num_threads % num_kv_heads, part = t % num_threads;
                const struct group *g = gr + at_row[b];
                int64_t g_from = 0, g_to;
                while (g_from < at_group[b] && g[g_from].kv < kv)
                    g_from++;
                for (g_to = g_from; g_to < at_group[b] && g[g_to].kv == kv; g_to++)
                    ;
                const int64_t d0 = vecs * part / num_threads * TILE;
                const int64_t d1 = part + 1 == num_threads
                                       ? head_dim : vecs * (part + 1) / num_threads * TILE;
                if (g_from == g_to || d0 >= d1)
                    continue;
                const int64_t seq_len = requests[b * 3 + 2], q_len = requests[b * 3 + 1];
                KV_(weigh_values)(rw + at_row[b], g, g_from, g_to, v_cache, off + at_key[b],
                                  first_key(seq_len - q_len, window), seq_len, d0, d1, head_dim);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                finish_row(rw + r, head_dim);
#if defined(__SSE__)
            _mm_setcsr(csr);
#endif
        }
    }
    free(off);
    free(scores);
    free(acc);
    free(qd);
    free(rw);
    free(gr);
    return failed ? -1 : 0;
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
    int shared = num_threads > 1 && num_reqs < num_threads;
    for (int64_t b = 0; b < num_reqs; b++)
        shared &= requests[b * 3 + 1] < TILE_MIN_ROWS;
    if (shared)
        return KV_(attend_shared)(q, q_token_stride, k_cache, v_cache, out, out_token_stride,
                                  requests, tables, table_width, num_reqs, num_heads,
                                  num_kv_heads, head_dim, block_size, scale, window, softcap,
                                  num_threads);
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
        struct row *rw = malloc(sizeof(struct row) * max_rows);
        struct group *gr = malloc(sizeof(struct group) * max_rows);
        const int ok = off && scores && acc && inv && qt && rw && gr && (stage || !KV_STAGED);
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
                                    window, softcap, off, scores, acc, qt, rw, gr);
        }
        free(off);
        free(scores);
        free(acc);
        free(inv);
        free(qt);
        free(stage);
        free(rw);
        free(gr);
#if defined(__SSE__)
        _mm_setcsr(csr);
#endif
    }
    return failed ? -1 : 0;
}
