/* The part of `paged_attention.c` that reads the K/V cache, written once for each element type
 * the cache may hold: `paged_attention.c` includes this file three times, with
 *   KV_T       the cache's element type (float; uint16_t holding bfloat16 bits; uint8_t, fp8),
 *   KV_(name)  this form's name of a function or constant (name; name##_bf16; name##_fp8),
 *   KV_STAGED  0: the float32 form's prompt tiles read the cache in place; 1: the narrow forms'
 *              tiles widen each block of KEYS keys (then each chunk of CHUNK values) of a kv
 *              head into `stage` (float32, exactly) once for all their rows.
 *   KV_TILE_MIN_ROWS  the fewest query rows of a request that run in tiles (rows in lanes);
 *              fewer run row by row (`TILE_MIN_ROWS` in paged_attention.c).
 * The decode rows widen in registers (loadrow / loadpair). Every product and sum is the float32
 * form's, in the same order: a narrow form's result is bit for bit the float32 form's over the
 * widened cache, and as row-invariant.
 *   KV_ENTRY   the name of the exported kernel (default: KV_(paged_attention_short)).
 * (No include guard: included once per element type.)
 */
#ifndef KV_ENTRY
#define KV_ENTRY KV_(paged_attention_short)
#endif

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
    for (int64_t d = 0; d < lanes; d += 8) {
        /* each row's query in a register for the block's keys (not a memory operand of every
         * fused multiply-add: the loads, not the multiply-adds, bounded the loop) */
        vrow q0 = *(const vrow *)(qd[0] + KP * d), q1 = q0, q2 = q0;
        if (n > 1)
            q1 = *(const vrow *)(qd[1] + KP * d);
        if (GROUP_ROWS > 2 && n > 2)
            q2 = *(const vrow *)(qd[GROUP_ROWS > 2 ? 2 : 0] + KP * d);
        __asm__("" : "+v"(q0), "+v"(q1), "+v"(q2));
        for (int p = 0; p < KEYS / KP; p++) {
            const vrow kv = KV_(loadpair)(kp[KP * p] + d, kp[KP * p + KP - 1] + d);
            for (int r = 0; r < n; r++)
                acc[r][p] = fma_row(r == 0 ? q0 : r == 1 ? q1 : q2, kv, acc[r][p]);
        }
    }
    for (int r = 0; r < n; r++) {
#if KP == 2
        v8f s = tree8_pairs(acc[r]);
#else
        v8f s = tree8x8(acc[r]);
#endif
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

/* weigh_block over every dimension: TILE at a time, then one by one (a fused multiply-add below
 * the last multiple of 8, as the 8-lane form computes there, a product then a sum past it) */
static void KV_(weigh_rows)(int n, const float *const *p, const KV_T *v, const int64_t *off,
                            int64_t lo, int64_t hi, int64_t head_dim, float *const *acc) {
    const int64_t vec = head_dim / TILE * TILE, lanes = head_dim & ~(int64_t)7;
    for (int64_t d = 0; d < vec; d += 4 * TILE) {
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
    for (int64_t d = vec; d < head_dim; d++)
        for (int r = 0; r < n; r++)
            for (int64_t j = lo; j <= hi; j++) {
                const float x = KV_(widen1)(v[off[j] + d]);
                acc[r][d] = d < lanes ? __builtin_fmaf(p[r][j], x, acc[r][d])
                                      : acc[r][d] + p[r][j] * x;
            }
}

/* weigh_rows for n rows whose keys are lo[r]..hi[r]: the keys all see together, the rest row by
 * row; each row still takes its keys in order */
static void KV_(weigh_group)(int n, const float *const *p, const KV_T *v, const int64_t *off,
                             const int64_t *lo, const int64_t *hi, int64_t head_dim,
                             float *const *acc) {
    int64_t both_lo = lo[0], both_hi = hi[0];
    for (int r = 1; r < n; r++) {
        both_lo = lo[r] > both_lo ? lo[r] : both_lo;
        both_hi = hi[r] < both_hi ? hi[r] : both_hi;
    }
    if (both_lo > both_hi) {
        for (int r = 0; r < n; r++)
            if (lo[r] <= hi[r])
                KV_(weigh_rows)(1, p + r, v, off, lo[r], hi[r], head_dim, acc + r);
        return;
    }
    for (int r = 0; r < n; r++)
        if (lo[r] < both_lo)
            KV_(weigh_rows)(1, p + r, v, off, lo[r], both_lo - 1, head_dim, acc + r);
    KV_(weigh_rows)(n, p, v, off, both_lo, both_hi, head_dim, acc);
    for (int r = 0; r < n; r++)
        if (hi[r] > both_hi)
            KV_(weigh_rows)(1, p + r, v, off, both_hi + 1, hi[r], head_dim, acc + r);
}

/* One request's heads h0 .. h0 + nh - 1, every query row of each (rows: nh * q_len, row r =
 * query r % q_len of head h0 + r / q_len), in one pass over the keys, then one over the values:
 * each block of 8 keys is scored, and each chunk of CHUNK values weighed, for the rows of a kv
 * head GROUP_ROWS at a time, each key's vector widened once for them (in registers), the slots
 * AHEAD keys on requested early. Scratch: off, the slot offset of every key (seq_len rounded up
 * to KEYS, the padding repeating the last key's); scores, keys_padded floats per row; acc,
 * head_dim floats per row; inv, one per row; qd, KP * head_dim floats per row. */
static void KV_(attend_request)(const float *q, int64_t q_token_stride, const KV_T *k_cache,
                                const KV_T *v_cache, float *out, int64_t out_token_stride,
                                const int64_t *table, int64_t q_start, int64_t q_len,
                                int64_t seq_len, int64_t h0, int64_t nh, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int64_t window, float softcap, int64_t *off,
                                float *scores, float *acc, float *inv, float *qd_mem) {
    const int64_t group = num_heads / num_kv_heads, slot_elems = num_kv_heads * head_dim;
    const int64_t padded = (seq_len + KEYS - 1) & ~(int64_t)(KEYS - 1), rows = nh * q_len;
    const int64_t lanes = head_dim & ~(int64_t)7;
    key_offsets(off, table, seq_len, padded, block_size, slot_elems);
    const int64_t first_pos = seq_len - q_len;           /* query qi sits at first_pos + qi */
    /* each row's query, keys lo..hi, scores and sums; groups: rows g0 .. g0 + gn - 1 of kv head
     * gkv, seeing keys from glo (a multiple of KEYS) to ghi */
    const float *qr[rows], *qd[rows];
    float *sr[rows], *ar[rows];
    int64_t lo[rows], hi[rows], g0[rows], gkv[rows], glo[rows], ghi[rows];
    int gn[rows];
    int64_t groups = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t h = h0 + r / q_len, qi = r % q_len;
        qr[r] = q + (q_start + qi) * q_token_stride + h * head_dim;
        hi[r] = first_pos + qi;
        lo[r] = first_key(hi[r], window);
        sr[r] = scores + r * padded;
        ar[r] = acc + r * head_dim;
        float *dup = qd_mem + r * KP * lanes;
        for (int64_t d = 0; d < lanes; d++)
            for (int i = 0; i < KP; i++)
                dup[KP * (d & ~(int64_t)7) + 8 * i + (d & 7)] = qr[r][d] * KV_(UNIT);
        qd[r] = dup;
        const int64_t first = lo[r] & ~(int64_t)(KEYS - 1);
        if (groups && gkv[groups - 1] == h / group && gn[groups - 1] < GROUP_ROWS) {
            gn[groups - 1]++;
            glo[groups - 1] = first < glo[groups - 1] ? first : glo[groups - 1];
            ghi[groups - 1] = hi[r] > ghi[groups - 1] ? hi[r] : ghi[groups - 1];
        } else {
            g0[groups] = r, gkv[groups] = h / group, gn[groups] = 1;
            glo[groups] = first, ghi[groups] = hi[r];
            groups++;
        }
    }
    const int64_t lo_any = first_key(first_pos, window), kv_lo = h0 / group;
    const int64_t span = ((h0 + nh - 1) / group - kv_lo + 1) * head_dim * (int64_t)sizeof(KV_T);
    const int64_t k_start = lo_any & ~(int64_t)(KEYS - 1);
    struct KV_(ahead) ka = {(const char *)(k_cache + kv_lo * head_dim), off, k_start + AHEAD,
                            seq_len, span};
    const int64_t k_keys = (KEYS + groups - 1) / groups;          /* per group, a block's keys */
    for (int64_t j0 = k_start; j0 < padded; j0 += KEYS) {
        if (ka.key < j0 + AHEAD)
            ka.key = j0 + AHEAD;
        for (int64_t g = 0; g < groups; g++) {
            KV_(prefetch_keys)(&ka, k_keys);
            if (j0 > ghi[g] || j0 + KEYS <= glo[g])
                continue;
            const KV_T *kh = k_cache + gkv[g] * head_dim;
            const int64_t r = g0[g];
            float *o[GROUP_ROWS];
            for (int i = 0; i < gn[g]; i++)
                o[i] = sr[r + i] + j0;
            switch (gn[g]) {                                     /* a constant count each case */
            case 1: KV_(scores_rows)(1, qd + r, qr + r, kh, off, j0, head_dim, scale, o); break;
            case 2: KV_(scores_rows)(2, qd + r, qr + r, kh, off, j0, head_dim, scale, o); break;
#if GROUP_ROWS > 2
            case 3: KV_(scores_rows)(3, qd + r, qr + r, kh, off, j0, head_dim, scale, o); break;
#endif
            }
        }
    }
    for (int64_t r = 0; r < rows; r++)
        inv[r] = softmax_row(sr[r], lo[r] & ~(int64_t)(KEYS - 1),
                             (hi[r] + KEYS) & ~(int64_t)(KEYS - 1), lo[r], hi[r], softcap,
                             NULL);
    memset(acc, 0, sizeof(float) * rows * head_dim);
    struct KV_(ahead) va = {(const char *)(v_cache + kv_lo * head_dim), off, lo_any, seq_len,
                            span};
    KV_(prefetch_keys)(&va, AHEAD);
    const int64_t v_keys = (CHUNK + groups - 1) / groups;        /* per group, a chunk's keys */
    for (int64_t c0 = lo_any; c0 < seq_len; c0 += CHUNK) {
        for (int64_t g = 0; g < groups; g++) {
            KV_(prefetch_keys)(&va, v_keys);
            const int64_t r = g0[g];
            int64_t clo[GROUP_ROWS], chi[GROUP_ROWS];
            for (int i = 0; i < gn[g]; i++) {
                clo[i] = lo[r + i] > c0 ? lo[r + i] : c0;
                chi[i] = hi[r + i] < c0 + CHUNK - 1 ? hi[r + i] : c0 + CHUNK - 1;
            }
            KV_(weigh_group)(gn[g], (const float *const *)sr + r, v_cache + gkv[g] * head_dim,
                             off, clo, chi, head_dim, ar + r);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + (q_start + r % q_len) * out_token_stride + (h0 + r / q_len) * head_dim;
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = ar[r][d] * inv[r];
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
                    for (int i = 0; i < KEYS; i += 4) {
                        const float *k4[4] = {kb + ko[kj + i], kb + ko[kj + i + 1],
                                              kb + ko[kj + i + 2], kb + ko[kj + i + 3]};
                        float *s4[4] = {sg + i * TILE, sg + (i + 1) * TILE, sg + (i + 2) * TILE,
                                        sg + (i + 3) * TILE};
                        tile_scores4(qt + g * head_dim * TILE, k4, head_dim, scale, s4);
                    }
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
int KV_ENTRY(const float *q, int64_t q_token_stride, const KV_T *k_cache,
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
        const int tile = q_len >= KV_TILE_MIN_ROWS && q_len < TILE;
        const int64_t rows = num_heads * (tile ? TILE : q_len);
        max_keys = padded > max_keys ? padded : max_keys;
        max_rows = rows > max_rows ? rows : max_rows;
        max_scores = rows * padded > max_scores ? rows * padded : max_scores;
    }
    /* parts per request: 1, or with fewer requests than threads enough head parts to share */
    int64_t parts = num_reqs >= num_threads ? 1 : (num_threads + num_reqs - 1) / num_reqs;
    /* and, where a task's scores would not stay in the core's caches, one per kv head */
    if (max_scores / parts > SCORES_IN_CACHE && parts < num_kv_heads)
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
        float *qt = malloc(sizeof(float) * QT_ROWS * head_dim * num_heads);
        /* a narrow form's tile's widened keys or values of one kv head: CHUNK slots (KEYS <=
         * CHUNK) */
        float *stage = KV_STAGED ? malloc(sizeof(float) * CHUNK * head_dim) : NULL;
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
            /* a request of KV_TILE_MIN_ROWS rows or more (prompt chunks, long verify passes)
             * rows in lanes, a shorter one (decodes, short verify passes) row by row */
            const int64_t q0 = requests[b * 3], q_len = requests[b * 3 + 1];
            const int64_t seq_len = requests[b * 3 + 2];
            const int64_t tiled = q_len >= KV_TILE_MIN_ROWS ? q_len : 0;
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
                                    window, softcap, off, scores, acc, inv, qt);
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
