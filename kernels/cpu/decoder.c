/* The decoder stack in one call, for every step (decodes, verify rows, prompt chunks). Each layer
 * is `DecoderLayer.forward` (`spec_phases/model.py`) op for op: RMSNorm (with the residual add),
 * the QKV projection, the per-head q/k norms where the layer has them (Qwen3, Gemma 3), RoPE (the
 * layer's table: Gemma 3's sliding layers have their own), the query scale where the family has
 * one (Gemma's query_pre_attn_scalar), the K/V write into the paged cache (float32, or bfloat16 /
 * fp8 e4m3 rounded as torch rounds), paged attention (its window and score soft-cap), the output
 * projection, the attention output's norm (sandwich norms: Gemma 2/3), RMSNorm, the gate-up
 * projection, the gated activation (SwiGLU or GeGLU), the down projection and the MLP output's
 * norm (sandwich norms); then the final norm. What a layer has is read from its `struct
 * decoder_layer` (a NULL norm: none), built once from the model (`spec_phases/cpu_decoder.py`).
 * It runs the same kernels, on the same inputs, in the same order as the model's modules call
 * them one by one (this file includes their sources), so its hidden states are bitwise theirs:
 * only the Python between the kernels is gone.
 *
 * `kernels/cpu/decoder.py` mirrors the structures below in ctypes; `decoder_abi` reports this
 * file's version and the structures' sizes, which it checks when it loads the library.
 */
#include "activation.c"
#include "linear.c"
#include "paged_attention.c"
#include "draft_attention.c"
#include "rms_norm.c"
#include "rope.c"

#include <time.h>

enum { LINEAR_S, ATTENTION_S, ELEMENTWISE_S };         /* where `seconds` adds each kernel's time */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* the time since *mark into seconds[what] (when timing), and *mark moved to now */
static void lap(double *seconds, int what, double *mark) {
    if (!seconds)
        return;
    const double t = now();
    seconds[what] += t - *mark;
    *mark = t;
}

struct decoder_linear {
    const void *data;                   /* packed by linear_pack / linear_pack_quantized */
    const float *bias;                  /* [out_features] or NULL */
    int64_t layout;                     /* enum layout */
};

struct decoder_layer {
    const float *input_norm, *post_attention_norm;     /* float32 [hidden] */
    const float *q_norm, *k_norm;       /* float32 [head_dim] per-head norms or NULL */
    /* float32 [hidden]: the norms of the attention's and of the MLP's outputs (sandwich norms:
     * Gemma 2/3), or NULL */
    const float *attn_out_norm, *mlp_out_norm;
    struct decoder_linear qkv, o, gate_up, down;
    int64_t window;                                     /* sliding window; 0: full attention */
    int64_t rope;                       /* which of the step's RoPE tables (cos, sin) it reads */
    int64_t activation;                 /* activation.c's ACT_SILU or ACT_GELU_TANH */
    float query_scale;                  /* queries times this after RoPE; 1: left as they are */
};

struct decoder_model {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale, softcap;
    const float *final_norm;
};

/* The step's buffers, each [rows, width] contiguous: x the residual stream (the embedded tokens
 * on entry; updated in place), h the normed rows (the final hidden states on return), qkv, qk
 * (roped queries then keys), attn ([rows, num_heads * head_dim]), out, gate_up, act. */
struct decoder_buffers {
    float *x, *h, *qkv, *qk, *attn, *out, *gate_up, *act;
};

/* The LM head and the token embedding of `decoder_draft`'s steps: the head packed as the linear
 * layers are ([vocab, hidden]); the embedding the head's own rows (a tied embedding, read back by
 * linear_rows) where embed is NULL, else embed's float32 rows [vocab, hidden]; each embedded row
 * times embed_scale (1: the family scales none). The drafts' vocabulary: the head's first
 * `scored` tokens (all of them, or the first ids) and the num_extra tokens extra_ids (ascending,
 * each at least scored), whose rows of the head `extra` holds in the head's layout (a draft
 * chooses among those; every logit it computes is the full head's, bit for bit). */
struct decoder_head {
    struct decoder_linear head;
    const float *embed;
    float embed_scale;
    int64_t scored;
    struct decoder_linear extra;
    const int64_t *extra_ids;
    int64_t num_extra;
};

#define DECODER_ABI_VERSION 12         /* bumped whenever an exported signature or struct changes */

/* out[0]: DECODER_ABI_VERSION; out[1..9]: the sizes of struct decoder_linear, decoder_layer,
 * decoder_model, decoder_buffers, quant_pages, mustafar_pages, spherical_pages, draft_pages and
 * decoder_head */
void decoder_abi(int64_t *out) {
    out[0] = DECODER_ABI_VERSION;
    out[1] = (int64_t)sizeof(struct decoder_linear);
    out[2] = (int64_t)sizeof(struct decoder_layer);
    out[3] = (int64_t)sizeof(struct decoder_model);
    out[4] = (int64_t)sizeof(struct decoder_buffers);
    out[5] = (int64_t)sizeof(struct quant_pages);
    out[6] = (int64_t)sizeof(struct mustafar_pages);
    out[7] = (int64_t)sizeof(struct spherical_pages);
    out[8] = (int64_t)sizeof(struct draft_pages);
    out[9] = (int64_t)sizeof(struct decoder_head);
}

/* float32 -> bfloat16 as torch rounds (to nearest, ties to even; a NaN stays a NaN) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float32 -> fp8 e4m3 as torch rounds (to nearest, ties to even), saturating: magnitudes from
 * 448 (the largest e4m3) on, infinities included, store 448; a NaN stores 0x7f with its sign */
static inline uint8_t fp8_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return sign | 0x7f;
    if (a >= 0x43e00000u)                                          /* 448.0f */
        return sign | 0x7e;
    if (a < 0x3c800000u) {                 /* below 2^-6: subnormal, a multiple of 2^-9 */
        float x;
        memcpy(&x, &a, sizeof x);
        const float magic = 8388608.0f;    /* 2^23: adding it rounds to an integer, ties even */
        return sign | (uint8_t)((x * 512.0f + magic) - magic);     /* 8: the least normal */
    }
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);            /* 3 mantissa bits kept */
    return sign | (uint8_t)((r >> 20) - (120u << 3));              /* exponent bias 127 -> 7 */
}

enum kv_dtype { KV_FLOAT32, KV_BFLOAT16, KV_FP8 };          /* the K/V cache's element type */
static const int64_t kv_elem_size[] = {4, 2, 1};

/* n floats into a cache at element `at`: as they are, or rounded to bfloat16 / fp8 e4m3 */
static inline void kv_store(void *cache, int64_t at, const float *x, int64_t n, int64_t dtype) {
    if (dtype == KV_FLOAT32) {
        memcpy((float *)cache + at, x, sizeof(float) * n);
    } else if (dtype == KV_BFLOAT16) {
        uint16_t *to = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++)
            to[i] = bf16_round(x[i]);
    } else {
        uint8_t *to = (uint8_t *)cache + at;
        for (int64_t i = 0; i < n; i++)
            to[i] = fp8_round(x[i]);
    }
}

/* kv_store's rounding on its own, n floats -> bfloat16 / fp8 bits (tests compare it with
 * torch's) */
void decoder_round_bf16(const float *x, uint16_t *out, int64_t n) {
    kv_store(out, 0, x, n, KV_BFLOAT16);
}

void decoder_round_fp8(const float *x, uint8_t *out, int64_t n) {
    kv_store(out, 0, x, n, KV_FP8);
}

/* rows of a prompt chunk whose MLP runs together: a block's gate/up and activations (12 KB and 6
 * KB a row for the embedded model) stay in the caches, where a 2048-row chunk's whole gate/up
 * (25 MB) went out to memory and back. Each row's result is its own whatever the blocking: the
 * linear and elementwise kernels are row-invariant (linear_i8.c, linear.c). */
#define MLP_ROWS 128

/* layers: the model's; run: the indices of those to run, in order (num_run of them, >= 1);
 * k_cache, v_cache: [num_layers, slots, num_kv_heads, head_dim] of kv_dtype (enum kv_dtype):
 * float32, or bfloat16 / fp8 e4m3 bits (K/V rounded to it on the write, widened exactly by the
 * attention);
 * slots[rows] where each row's K/V go; cos, sin: [RoPE tables, rows, head_dim] (a layer reads
 * table `rope`); requests, tables: as paged_attention_short takes them (every query of the step
 * among them); draft: NULL, or a draft step's compressed pages (VeriCache's drafter: one query
 * row a request, attending its pages and its keys in the cache, `draft_attention`; a
 * sliding-window layer attends its keys in the cache only); seconds: NULL, or [3] to which the
 * time in the linear layers, in attention (with the K/V write) and in the elementwise kernels is
 * added (profiling). Returns 0, or -1 where a kernel could not get scratch memory. */
int decoder_forward(const struct decoder_model *m, const struct decoder_layer *layers,
                    const int64_t *run, int64_t num_run, const struct decoder_buffers *b,
                    int64_t rows, const float *cos, const float *sin, void *k_cache,
                    void *v_cache, int64_t kv_dtype, int64_t cache_slots, const int64_t *slots,
                    const int64_t *requests, const int64_t *tables, int64_t table_width,
                    int64_t num_reqs, const struct draft_pages *draft, double *seconds,
                    int num_threads) {
    const int64_t D = m->head_dim, kv = m->num_kv_heads * D, q_size = m->num_heads * D;
    const int64_t qkv_size = q_size + 2 * kv, heads = m->num_heads + m->num_kv_heads;
    const int64_t layer_elems = cache_slots * kv, elem = kv_elem_size[kv_dtype];
    double mark = seconds ? now() : 0.0;
    for (int64_t i = 0; i < num_run; i++) {
        const struct decoder_layer *l = layers + run[i];
        void *k_layer = (char *)k_cache + run[i] * layer_elems * elem;
        void *v_layer = (char *)v_cache + run[i] * layer_elems * elem;
        const float *delta = i ? b->out : NULL;
        rms_norm_rows(b->x, delta, l->input_norm, delta ? b->x : NULL, b->h, rows, m->hidden,
                      m->eps, num_threads);
        lap(seconds, ELEMENTWISE_S, &mark);
        if (linear_forward(b->h, rows, m->hidden, l->qkv.data, (int)l->qkv.layout, qkv_size,
                           l->qkv.bias, b->qkv, num_threads))
            return -1;
        lap(seconds, LINEAR_S, &mark);
        if (l->q_norm)                      /* each head's q and k normed in place, then roped */
            for (int64_t t = 0; t < rows; t++) {
                float *qt = b->qkv + t * qkv_size;
                rms_norm_rows(qt, NULL, l->q_norm, NULL, qt, m->num_heads, D, m->eps, 1);
                rms_norm_rows(qt + q_size, NULL, l->k_norm, NULL, qt + q_size, m->num_kv_heads, D,
                              m->eps, 1);
            }
        rope_rows(b->qkv, qkv_size, cos + l->rope * rows * D, sin + l->rope * rows * D, b->qk,
                  rows, heads, D);
        if (l->query_scale != 1.0f)         /* the queries only, each product rounded as torch's */
            for (int64_t t = 0; t < rows; t++) {
                float *qt = b->qk + t * heads * D;
                for (int64_t j = 0; j < q_size; j++)
                    qt[j] *= l->query_scale;
            }
        lap(seconds, ELEMENTWISE_S, &mark);
        for (int64_t t = 0; t < rows; t++) {
            kv_store(k_layer, slots[t] * kv, b->qk + (t * heads + m->num_heads) * D, kv,
                     kv_dtype);
            kv_store(v_layer, slots[t] * kv, b->qkv + t * qkv_size + q_size + kv, kv, kv_dtype);
        }
#define ATTEND(form)                                                                        \
    form(b->qk, heads * D, k_layer, v_layer, b->attn, q_size, requests, tables, table_width,  \
         num_reqs, m->num_heads, m->num_kv_heads, D, m->block_size, m->scale, l->window,      \
         m->softcap, num_threads)
        const int failed =
            draft && !l->window
                ? draft_attention(b->qk, heads * D, k_layer, v_layer, kv_dtype == KV_BFLOAT16,
                                  b->attn, q_size, requests, tables, table_width, num_reqs, draft,
                                  run[i] * draft->row_stride, m->num_heads, m->num_kv_heads, D,
                                  m->block_size, m->scale, m->softcap, num_threads)
            : kv_dtype == KV_FP8      ? ATTEND(paged_attention_short_fp8)
            : kv_dtype == KV_BFLOAT16 ? ATTEND(paged_attention_short_bf16)
                                      : ATTEND(paged_attention_short);
#undef ATTEND
        if (failed)
            return -1;
        lap(seconds, ATTENTION_S, &mark);
        if (linear_forward(b->attn, rows, q_size, l->o.data, (int)l->o.layout, m->hidden,
                           l->o.bias, b->out, num_threads))
            return -1;
        lap(seconds, LINEAR_S, &mark);
        if (l->attn_out_norm)
            rms_norm_rows(b->out, NULL, l->attn_out_norm, NULL, b->out, rows, m->hidden, m->eps,
                          num_threads);
        rms_norm_rows(b->x, b->out, l->post_attention_norm, b->x, b->h, rows, m->hidden, m->eps,
                      num_threads);
        lap(seconds, ELEMENTWISE_S, &mark);
        for (int64_t r0 = 0; r0 < rows; r0 += MLP_ROWS) {      /* the MLP, a block at a time */
            const int64_t n = rows - r0 < MLP_ROWS ? rows - r0 : MLP_ROWS;
            if (linear_forward(b->h + r0 * m->hidden, n, m->hidden, l->gate_up.data,
                               (int)l->gate_up.layout, 2 * m->intermediate, l->gate_up.bias,
                               b->gate_up, num_threads))
                return -1;
            lap(seconds, LINEAR_S, &mark);
            glu_rows(b->gate_up, 2 * m->intermediate, b->act, n, m->intermediate, l->activation,
                     num_threads);
            lap(seconds, ELEMENTWISE_S, &mark);
            if (linear_forward(b->act, n, m->intermediate, l->down.data, (int)l->down.layout,
                               m->hidden, l->down.bias, b->out + r0 * m->hidden, num_threads))
                return -1;
            lap(seconds, LINEAR_S, &mark);
        }
        if (l->mlp_out_norm) {
            rms_norm_rows(b->out, NULL, l->mlp_out_norm, NULL, b->out, rows, m->hidden, m->eps,
                          num_threads);
            lap(seconds, ELEMENTWISE_S, &mark);
        }
    }
    rms_norm_rows(b->x, b->out, m->final_norm, b->x, b->h, rows, m->hidden, m->eps, num_threads);
    lap(seconds, ELEMENTWISE_S, &mark);
    return 0;
}

/* Greedy draft steps in one call (VeriCache's drafter, `spec_phases/proposers/lossy_kv.py`) over
 * a drafting cache in which request r's context is lens[r] tokens from slot bases[r] on (its
 * blocks: row r of tables). Step s runs the first rows_at[s] requests (rows_at non-increasing:
 * the longest drafts first), one row each: decoder_forward (request r's K/V written at slot
 * bases[r] + lens[r] + s, its query seeing lens[r] + s + 1 keys, and `draft`'s pages where
 * given), the LM head over head's drafting vocabulary (scored + num_extra >= 1 tokens), and the
 * row's argmax there (the first of equal maxima by token id, as torch's) into tokens[s * R + r],
 * which step s + 1 embeds as the row's input: the Python a draft step cost between two calls is
 * gone. R = rows_at[0]; b->x holds step 0's embedded rows on entry (b sized for R rows); cos,
 * sin: float32 [steps, num_ropes, R, head_dim], each step's positions' tables; logits: scratch
 * [R, scored + num_extra]; step_seconds[s]: step s's time; seconds: NULL, or [steps][3] to
 * which each step's time in decoder_forward's kernels is added (as decoder_forward's). The final
 * soft-cap (Gemma 2) is monotonic: the argmax of the raw logits. Returns 0, or -1 where a kernel
 * found no scratch memory. */
int decoder_draft(const struct decoder_model *m, const struct decoder_layer *layers,
                  const int64_t *run, int64_t num_run, const struct decoder_buffers *b,
                  const int64_t *rows_at, int64_t steps, const float *cos, const float *sin,
                  int64_t num_ropes, void *k_cache, void *v_cache, int64_t kv_dtype,
                  int64_t cache_slots, const int64_t *bases, const int64_t *lens,
                  const int64_t *tables, int64_t table_width, const struct draft_pages *draft,
                  const struct decoder_head *head, int64_t *tokens, float *logits,
                  double *step_seconds, double *seconds, int num_threads) {
    const int64_t R = rows_at[0], D = m->head_dim, H = m->hidden;
    const int64_t N0 = head->scored, NE = head->num_extra;       /* logits: [R, N0 + NE] */
    const size_t rope_bytes = sizeof(float) * (size_t)(num_ropes * R * D);
    int64_t *requests = malloc(sizeof(int64_t) * 3 * R), *slots = malloc(sizeof(int64_t) * R);
    float *step_cos = malloc(rope_bytes), *step_sin = malloc(rope_bytes);
    int failed = !(requests && slots && step_cos && step_sin);
    for (int64_t s = 0; s < steps && !failed; s++) {
        const double start = now();
        const int64_t rows = rows_at[s];
        for (int64_t r = 0; r < rows; r++) {
            requests[3 * r] = r;
            requests[3 * r + 1] = 1;
            requests[3 * r + 2] = lens[r] + s + 1;
            slots[r] = bases[r] + lens[r] + s;
        }
        for (int64_t t = 0; t < num_ropes; t++) {          /* this step's rows of each table */
            const int64_t from = ((s * num_ropes + t) * R) * D;
            memcpy(step_cos + t * rows * D, cos + from, sizeof(float) * (size_t)(rows * D));
            memcpy(step_sin + t * rows * D, sin + from, sizeof(float) * (size_t)(rows * D));
        }
        failed = decoder_forward(m, layers, run, num_run, b, rows, step_cos, step_sin, k_cache,
                                 v_cache, kv_dtype, cache_slots, slots, requests, tables,
                                 table_width, rows, draft, seconds ? seconds + 3 * s : NULL,
                                 num_threads)
                 || linear_forward(b->h, rows, H, head->head.data, (int)head->head.layout, N0,
                                   head->head.bias, logits, num_threads)
                 || (NE && linear_forward(b->h, rows, H, head->extra.data,
                                          (int)head->extra.layout, NE, head->extra.bias,
                                          logits + rows * N0, num_threads));
        for (int64_t r = 0; r < rows && !failed; r++) {   /* the first of equal maxima by id */
            const float *l = logits + r * N0, *le = logits + rows * N0 + r * NE;
            int64_t best = N0 ? 0 : head->extra_ids[0];
            float top = N0 ? l[0] : le[0];
            for (int64_t j = 1; j < N0; j++)
                if (l[j] > top)
                    best = j, top = l[j];
            for (int64_t j = N0 ? 0 : 1; j < NE; j++)
                if (le[j] > top)
                    best = head->extra_ids[j], top = le[j];
            tokens[s * R + r] = best;
        }
        if (!failed && s + 1 < steps) {                    /* the next step's inputs */
            const int64_t next = rows_at[s + 1];
            if (head->embed)
                for (int64_t r = 0; r < next; r++)
                    memcpy(b->x + r * H, head->embed + tokens[s * R + r] * H, sizeof(float) * H);
            else
                linear_rows(head->head.data, (int)head->head.layout, H, tokens + s * R, next,
                            b->x);
            if (head->embed_scale != 1.0f)
                for (int64_t i = 0; i < next * H; i++)
                    b->x[i] *= head->embed_scale;
        }
        step_seconds[s] = now() - start;
    }
    free(requests);
    free(slots);
    free(step_cos);
    free(step_sin);
    return failed ? -1 : 0;
}
