/* CPU kernels for the decode step: each one replaces a chain of small torch ops.
 *
 * Why: at decode batch sizes the CPU step of a small model is bound by per-op dispatch (a tiny
 * Qwen3-MoE layer ran ~100 aten ops, ~10 us each), not by arithmetic. Called through ctypes
 * (moeserve/kernels/cpu/ops.py), single-threaded, on contiguous rows of float32 or bfloat16.
 *
 * Numerics follow the torch path they replace: float32 arithmetic, rounded to the storage dtype
 * where that path rounds (RMSNorm rounds the normalised row before the weight multiply, as
 * transformers does), without contracting a*b + c*d into an FMA (compiled with
 * -ffp-contract=off). Sums and dot products may associate differently from torch's.
 *
 * dt: 0 = float32, 1 = bfloat16 (both the inputs and the stored outputs of one call).
 *
 * Kernels: ms_rms_norm (+ residual add), ms_qk_norm_rope (per-head q/k RMSNorm and neox rope, in
 * place), ms_decode_attention (stores the new K/V, attends from the pool through the slot table),
 * ms_topk_softmax (router), ms_moe_experts (routed experts of a few tokens), ms_lm_head_argmax
 * (greedy LM head, AVX512-BF16 only).
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline int64_t esize(int dt) { return dt ? 2 : 4; }

static void load_row(float *dst, const void *src, int64_t n, int dt) {
    if (!dt) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_load(h[i]);
}

static void store_row(void *dst, const float *src, int64_t n, int dt) {
    if (!dt) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) h[i] = bf16_store(src[i]);
}

static void round_row(float *x, int64_t n, int dt) { /* x := x as stored in dt */
    if (!dt) return;
    for (int64_t i = 0; i < n; i++) x[i] = bf16_load(bf16_store(x[i]));
}

static inline const char *at(const void *base, int64_t elems, int dt) {
    return (const char *)base + elems * esize(dt);
}

/* x := weight * round(x * rsqrt(mean(x^2) + eps)), then rounded at the store. */
static void rms_row(float *x, const float *weight, int64_t n, float eps, int dt) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv;
    round_row(x, n, dt);
    for (int64_t i = 0; i < n; i++) x[i] = weight[i] * x[i];
}

/* out[r] = RMSNorm(x[r] (+ res[r])) for rows r of n; with res, res_out[r] = x[r] + res[r]
 * (rounded).
 * x rows are x_stride elements apart; res, out and res_out are contiguous [rows, n]. */
void ms_rms_norm(void *out, void *res_out, const void *x, int64_t x_stride, const void *res,
                 const void *weight, int64_t rows, int64_t n, float eps, int dt) {
    float *buf = malloc((size_t)n * 3 * sizeof(float));
    float *w = buf + n, *r = buf + 2 * n;
    load_row(w, weight, n, dt);
    for (int64_t t = 0; t < rows; t++) {
        load_row(buf, at(x, t * x_stride, dt), n, dt);
        if (res) {
            load_row(r, at(res, t * n, dt), n, dt);
            for (int64_t i = 0; i < n; i++) buf[i] = buf[i] + r[i];
            round_row(buf, n, dt);
            store_row((char *)at(res_out, t * n, dt), buf, n, dt);
        }
        rms_row(buf, w, n, eps, dt);
        store_row((char *)at(out, t * n, dt), buf, n, dt);
    }
    free(buf);
}

/* In place on the first `heads` heads (q heads, then k heads) of each token row of a qkv buffer:
 * the per-head RMSNorm (q_weight for the first nq heads, k_weight after; skipped when q_weight is
 * NULL), then neox rope on the first `rot` channels of every head with the row of `table`
 * ([positions, 2 * rot] float32: cos | cos | -sin | sin) at the token's position. Returns 0, or
 * 1 + the first token whose position has no table row (then nothing is written). */
int64_t ms_qk_norm_rope(void *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                        int64_t nq, int64_t d, int64_t rot, const int64_t *pos,
                        const float *table, int64_t num_positions, const void *q_weight,
                        const void *k_weight, float eps, int dt) {
    for (int64_t t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= num_positions) return t + 1; /* nothing written */
    float *buf = malloc((size_t)d * 4 * sizeof(float));
    float *tmp = buf + d, *wq = buf + 2 * d, *wk = buf + 3 * d;
    if (q_weight) {
        load_row(wq, q_weight, d, dt);
        load_row(wk, k_weight, d, dt);
    }
    int64_t half = rot / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = table + pos[t] * 2 * rot;
        for (int64_t h = 0; h < heads; h++) {
            char *p = (char *)at(qkv, t * row_stride + h * d, dt);
            load_row(buf, p, d, dt);
            if (q_weight) {
                rms_row(buf, h < nq ? wq : wk, d, eps, dt);
                round_row(buf, d, dt);
            }
            for (int64_t i = 0; i < rot; i++) {
                int64_t j = i < half ? i + half : i - half;
                tmp[i] = buf[i] * c[i] + buf[j] * c[rot + i];
            }
            memcpy(buf, tmp, (size_t)rot * sizeof(float));
            store_row(p, buf, d, dt);
        }
    }
    free(buf);
    return 0;
}

/* Eight float lanes (GCC vector extensions: AVX2/AVX-512 or SSE pairs, whatever the target has). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f load8(const void *p, int dt) {
    v8f f;
    if (dt) {
        v8h h;
        memcpy(&h, p, 16);
        v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(&f, &u, 32);
    } else {
        memcpy(&f, p, 32);
    }
    return f;
}

/* The eight horizontal sums of a[0..7], as one vector (a transpose-and-add tree: 12 shuffles and 7
 * adds for eight dot products, against ~8 scalar adds each when reduced one by one). */
#ifdef __clang__ /* the same two-vector shuffle: clang takes the lane indices as constants */
#define SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
static inline __attribute__((always_inline)) v8f sum8x8(const v8f a[8]) {
    v8f s[4], t[2];
    for (int i = 0; i < 4; i++)
        s[i] = SHUF8(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               SHUF8(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int i = 0; i < 2; i++)
        t[i] = SHUF8(s[2 * i], s[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUF8(s[2 * i], s[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF8(t[0], t[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUF8(t[0], t[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Eight dot products rows[j][0:n] · x[0:n] (rows in dt, x float32; n a multiple of 8). */
static inline __attribute__((always_inline)) v8f dot8(const void *const rows[8], const float *x,
                                                      int64_t n, int dt) {
    v8f acc[8] = {{0}};
    for (int64_t i = 0; i < n; i += 8) {
        v8f xv;
        memcpy(&xv, x + i, 32);
        for (int j = 0; j < 8; j++) acc[j] += load8(at(rows[j], i, dt), dt) * xv;
    }
    return sum8x8(acc);
}

static inline __attribute__((always_inline)) float elem_at(const void *row, int64_t i, int dt) {
    return dt ? bf16_load(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* exp(x) for x <= 0 (softmax inputs x - max, silu's exp(-|g|)), written on vectors so that it
 * vectorises (libm's expf is a scalar call): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of
 * degree 6; relative error ~2e-7; 0 below -87. n = round(y) = trunc(y - 0.5) for y <= 0, through
 * int conversions. */
static inline __attribute__((always_inline)) v8f exp_neg8(v8f x) {
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    v8i under = x < lo;
    v8f c = (v8f)(((v8i)x & ~under) | ((v8i)lo & under));
    v8f n = __builtin_convertvector(__builtin_convertvector(c * 1.44269504088896341f - 0.5f, v8i),
                                    v8f);
    v8f r = c - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    v8f p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8i scale = (__builtin_convertvector(n, v8i) + 127) << 23;
    return (v8f)((v8i)(p * (v8f)scale) & ~under);
}

static inline float exp_neg(float x) { /* one lane of exp_neg8 */
    v8f v = {x};
    return exp_neg8(v)[0];
}

/* x[0:n] := softmax(x[0:n]) in float32, eight lanes at a time (the max and the sum as v8f
 * reductions: without -ffast-math the compiler keeps float reductions scalar). */
static void softmax_row(float *x, int64_t n) {
    v8f m8 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
              -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, 32);
        v8i gt = v > m8;
        m8 = (v8f)(((v8i)v & gt) | ((v8i)m8 & ~gt));
    }
    float m = -INFINITY;
    for (int j = 0; j < 8; j++) m = m8[j] > m ? m8[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    v8f t8 = {0};
    for (i = 0; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, 32);
        v = exp_neg8(v - m);
        memcpy(x + i, &v, 32);
        t8 += v;
    }
    for (int64_t j = i; j < n; j++) x[j] = exp_neg(x[j] - m);
    float total = 0.0f;
    for (int j = 0; j < 8; j++) total += t8[j];
    for (; i < n; i++) total += x[i];
    float inv = 1.0f / total;
    for (i = 0; i < n; i++) x[i] *= inv;
}

/* dst[s0 .. s0 + 8) (as far as len) := scaling * qh · K rows of positions s0.. (slots[s], KV head
 * kvh); past len the last row repeats and is not stored. */
static inline __attribute__((always_inline)) void score8(
    float *dst, const float *qh, const void *k_buf, const int64_t *slots, int64_t s0, int64_t len,
    int64_t kv_heads, int64_t kvh, int64_t d, float scaling, int dt) {
    const void *rows[8];
    for (int j = 0; j < 8; j++) {
        int64_t s = s0 + j < len ? s0 + j : len - 1;
        rows[j] = at(k_buf, (slots[s] * kv_heads + kvh) * d, dt);
    }
    v8f dots = dot8(rows, qh, d, dt) * scaling;
    if (s0 + 8 <= len)
        memcpy(dst + s0, &dots, 32);
    else
        for (int64_t j = 0; j < len - s0; j++) dst[s0 + j] = dots[j];
}

/* a[0 .. dv/8) += p[s] * V row of position s (slots[s], KV head kvh), s = from .. to - 1, in
 * order (dv a multiple of 8, at most 128). */
static inline __attribute__((always_inline)) void add_v_rows(
    v8f *a, const float *p, const void *v_buf, const int64_t *slots, int64_t from, int64_t to,
    int64_t kv_heads, int64_t kvh, int64_t dv, int dt) {
    for (int64_t s = from; s < to; s++) {
        const void *vr = at(v_buf, (slots[s] * kv_heads + kvh) * dv, dt);
        v8f pv = {p[s], p[s], p[s], p[s], p[s], p[s], p[s], p[s]};
        for (int64_t c = 0; c < dv / 8; c++) a[c] += pv * load8(at(vr, 8 * c, dt), dt);
    }
}

/* One request: its query heads qf [heads, d] (float32) attend over `len` positions (slots[s]);
 * acc [heads, dv] receives the normalised weighted sum of V; scores: [heads, len] scratch. Query
 * head h reads KV head h / group; a group's heads re-read its K/V rows, from L1. Always inlined
 * into calls with constant d, dv and dt, so the inner loops have known trip counts and
 * vectorise. */
static inline __attribute__((always_inline)) void attend_request(
    float *acc, float *scores, const float *qf, const void *k_buf, const void *v_buf,
    const int64_t *slots, int64_t len, int64_t heads, int64_t kv_heads, int64_t kv_head0,
    int64_t group, int64_t d, int64_t dv, float scaling, int dt) {
    int64_t s0 = 0;
    if (d % 8 == 0) /* eight positions at a time */
        for (; s0 < len; s0 += 8)
            for (int64_t h = 0; h < heads; h++)
                score8(scores + h * len, qf + h * d, k_buf, slots, s0, len, kv_heads,
                       kv_head0 + h / group, d, scaling, dt);
    for (int64_t s = s0; s < len; s++) {
        const void *kr = at(k_buf, slots[s] * kv_heads * d, dt);
        for (int64_t h = 0; h < heads; h++) {
            const float *qh = qf + h * d;
            int64_t off = (kv_head0 + h / group) * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++) dot += qh[i] * elem_at(kr, off + i, dt);
            scores[h * len + s] = dot * scaling;
        }
    }
    for (int64_t h = 0; h < heads; h++) softmax_row(scores + h * len, len);
    if (dv % 8 == 0 && dv <= 128) { /* each head's sum kept in registers, V rows from L1 */
        for (int64_t h = 0; h < heads; h++) {
            v8f a[16] = {{0}};
            add_v_rows(a, scores + h * len, v_buf, slots, 0, len, kv_heads, kv_head0 + h / group,
                       dv, dt);
            memcpy(acc + h * dv, a, (size_t)dv * sizeof(float));
        }
        return;
    }
    memset(acc, 0, (size_t)(heads * dv) * sizeof(float));
    for (int64_t s = 0; s < len; s++) {
        const void *vr = at(v_buf, slots[s] * kv_heads * dv, dt);
        for (int64_t h = 0; h < heads; h++) {
            float p = scores[h * len + s], *ah = acc + h * dv;
            int64_t off = (kv_head0 + h / group) * dv;
            for (int64_t i = 0; i < dv; i++) ah[i] += p * elem_at(vr, off + i, dt);
        }
    }
}

#define SHARE_BLOCK 64 /* positions of V widened at a time (64 x 128 floats: 32 KiB) */

/* Query head h of `g` rows that share their first `p` positions (the slots of row 0, `slots[0]`):
 * the rows of one request in a speculative verify pass. The shared positions' K and V rows are
 * widened to float32 once (into `kv`, [SHARE_BLOCK, max(d, dv)]) and serve every row's query;
 * each row's own positions [p8, len) are read as in attend_request (p8: p rounded down to the
 * 8-position block). Every score and every partial sum is computed by the same operations in
 * the same order as attend_request, so the output equals its bit for bit. qf [g, d] (float32),
 * acc [g, dv], scores [g, ld]. Needs d and dv multiples of 8, dv <= 128. */
static inline __attribute__((always_inline)) void attend_shared(
    float *acc, float *scores, int64_t ld, const float *qf, float *kv, const void *k_buf,
    const void *v_buf, const int64_t *const *slots, const int64_t *lens, int64_t g, int64_t p,
    int64_t kv_heads, int64_t kvh, int64_t d, int64_t dv, float scaling, int dt) {
    int64_t p8 = p / 8 * 8;
    for (int64_t s0 = 0; s0 < p8; s0 += 8) {
        const void *rows[8];
        for (int j = 0; j < 8; j++) {
            load_row(kv + j * d, at(k_buf, (slots[0][s0 + j] * kv_heads + kvh) * d, dt), d, dt);
            rows[j] = kv + j * d;
        }
        for (int64_t r = 0; r < g; r++) {
            v8f dots = dot8(rows, qf + r * d, d, 0) * scaling;
            memcpy(scores + r * ld + s0, &dots, 32);
        }
    }
    for (int64_t r = 0; r < g; r++) {
        for (int64_t s0 = p8; s0 < lens[r]; s0 += 8)
            score8(scores + r * ld, qf + r * d, k_buf, slots[r], s0, lens[r], kv_heads, kvh, d,
                   scaling, dt);
        softmax_row(scores + r * ld, lens[r]);
    }
    memset(acc, 0, (size_t)(g * dv) * sizeof(float));
    for (int64_t s0 = 0; s0 < p; s0 += SHARE_BLOCK) {
        int64_t n = p - s0 < SHARE_BLOCK ? p - s0 : SHARE_BLOCK;
        for (int64_t s = 0; s < n; s++)
            load_row(kv + s * dv, at(v_buf, (slots[0][s0 + s] * kv_heads + kvh) * dv, dt), dv, dt);
        for (int64_t r = 0; r < g; r++) {
            v8f a[16];
            memcpy(a, acc + r * dv, (size_t)dv * sizeof(float));
            const float *ph = scores + r * ld + s0;
            for (int64_t s = 0; s < n; s++) {
                v8f pv = {ph[s], ph[s], ph[s], ph[s], ph[s], ph[s], ph[s], ph[s]};
                for (int64_t c = 0; c < dv / 8; c++) a[c] += pv * load8(kv + s * dv + 8 * c, 0);
            }
            memcpy(acc + r * dv, a, (size_t)dv * sizeof(float));
        }
    }
    for (int64_t r = 0; r < g; r++) {
        v8f a[16];
        memcpy(a, acc + r * dv, (size_t)dv * sizeof(float));
        add_v_rows(a, scores + r * ld, v_buf, slots[r], p, lens[r], kv_heads, kvh, dv, dt);
        memcpy(acc + r * dv, a, (size_t)dv * sizeof(float));
    }
}

/* The batch in runs of rows sharing a prefix (share[b] > 0: row b's first share[b] positions
 * are the slots of its run's first row), work items (run, query head) over the threads. */
static void attend_runs(void *out, const void *q, int64_t q_stride, const void *k_buf,
                        const void *v_buf, const int64_t *table, int64_t table_stride,
                        const int64_t *rows, const int64_t *seq_lens, const int64_t *share,
                        int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, int64_t dv,
                        float scaling, int64_t threads, int dt) {
    int64_t *first = malloc((size_t)(batch + 1) * sizeof(int64_t)), runs = 0, widest = 1;
    int64_t max_len = 1;
    for (int64_t b = 0; b < batch; b++) {
        if (b == 0 || share[b] <= 0) first[runs++] = b;
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    first[runs] = batch;
    for (int64_t r = 0; r < runs; r++)
        if (first[r + 1] - first[r] > widest) widest = first[r + 1] - first[r];
    int64_t group = heads / kv_heads, items = runs * heads, wide = d > dv ? d : dv;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        size_t floats = (size_t)(widest * (max_len + d + dv) + SHARE_BLOCK * wide);
        float *scores = malloc(floats * sizeof(float));
        float *qf = scores + widest * max_len, *acc = qf + widest * d, *kv = acc + widest * dv;
        const int64_t **slots = malloc((size_t)widest * sizeof(int64_t *));
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            int64_t r = it / heads, h = it % heads, b0 = first[r], g = first[r + 1] - b0;
            int64_t p = seq_lens[b0];
            for (int64_t i = 0; i < g; i++) {
                slots[i] = table + rows[b0 + i] * table_stride;
                if (i && share[b0 + i] < p) p = share[b0 + i];
                if (seq_lens[b0 + i] < p) p = seq_lens[b0 + i];
                load_row(qf + i * d, at(q, (b0 + i) * q_stride + h * d, dt), d, dt);
            }
#define SHARED(D, DT) attend_shared(acc, scores, max_len, qf, kv, k_buf, v_buf, slots, \
                                    seq_lens + b0, g, p, kv_heads, h / group, D, D, scaling, DT)
            if (d == dv && d == 64 && dt) SHARED(64, 1);
            else if (d == dv && d == 128 && dt) SHARED(128, 1);
            else if (d == dv && d == 64 && !dt) SHARED(64, 0);
            else if (d == dv && d == 128 && !dt) SHARED(128, 0);
            else attend_shared(acc, scores, max_len, qf, kv, k_buf, v_buf, slots, seq_lens + b0,
                               g, p, kv_heads, h / group, d, dv, scaling, dt);
#undef SHARED
            for (int64_t i = 0; i < g; i++)
                store_row((char *)at(out, ((b0 + i) * heads + h) * dv, dt), acc + i * dv, dv, dt);
        }
        free(slots);
        free(scores);
    }
    free(first);
}

/* Decode attention over the token-slot KV pool, one query token per request.
 *
 * First stores each token's new K and V rows (k_new/v_new: token rows k_stride/v_stride elements
 * apart, kv_heads * d and kv_heads * dv contiguous values) at slot loc[b] of k_buf/v_buf
 * ([slots, kv_heads, d] and [slots, kv_heads, dv], contiguous). Then request b attends over
 * positions [0, seq_lens[b]) whose slots are table[rows[b] * table_stride + position]; query head
 * h (of q: token rows q_stride elements apart, heads contiguous) uses KV head h / (heads /
 * kv_heads). Scores, softmax and the weighted sum in float32; out is contiguous [batch, heads, dv].
 * Requests and heads are shared out over `threads` OpenMP threads (one without OpenMP).
 * share (NULL: none): per row, how many leading positions it shares with the first row of its run
 * (0 starts a run), e.g. a verify pass's rows of one request: those positions are read once for
 * the run (attend_runs), with the same result.
 */
void ms_decode_attention(void *out, const void *q, int64_t q_stride, const void *k_new,
                         int64_t k_stride, const void *v_new, int64_t v_stride, const int64_t *loc,
                         void *k_buf, void *v_buf, const int64_t *table, int64_t table_stride,
                         const int64_t *rows, const int64_t *seq_lens, int64_t batch,
                         int64_t heads, int64_t kv_heads, int64_t d, int64_t dv, float scaling,
                         const int64_t *share, int64_t threads, int dt) {
    int64_t es = esize(dt), max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        memcpy((char *)k_buf + loc[b] * kv_heads * d * es, at(k_new, b * k_stride, dt),
               (size_t)(kv_heads * d * es));
        memcpy((char *)v_buf + loc[b] * kv_heads * dv * es, at(v_new, b * v_stride, dt),
               (size_t)(kv_heads * dv * es));
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    if (share && d % 8 == 0 && dv % 8 == 0 && dv <= 128) {
        attend_runs(out, q, q_stride, k_buf, v_buf, table, table_stride, rows, seq_lens, share,
                    batch, heads, kv_heads, d, dv, scaling, threads, dt);
        return;
    }
    /* Work items: one request's query heads [h0, h0 + span): a KV head's whole group when
     * there are enough of those to share out, else single heads (a batch-1 decode step of a
     * 3-KV-head model still splits over every thread). */
    int64_t group = heads / kv_heads;
    int64_t span = batch * kv_heads >= 4 * threads ? group : 1;
    int64_t per_req = heads / span, items = batch * per_req;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *scores = malloc((size_t)(span * (max_len + d + dv)) * sizeof(float));
        float *qf = scores + span * max_len, *acc = qf + span * d;
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            int64_t b = it / per_req, h0 = (it % per_req) * span, kv0 = h0 / group;
            const int64_t *slots = table + rows[b] * table_stride;
            int64_t len = seq_lens[b], grp = span == 1 ? 1 : group;
            load_row(qf, at(q, b * q_stride + h0 * d, dt), span * d, dt);
#define ATTEND(D, DT) attend_request(acc, scores, qf, k_buf, v_buf, slots, len, span, kv_heads, \
                                     kv0, grp, D, D, scaling, DT)
            if (d == dv && d == 32 && dt) ATTEND(32, 1);
            else if (d == dv && d == 64 && dt) ATTEND(64, 1);
            else if (d == dv && d == 128 && dt) ATTEND(128, 1);
            else if (d == dv && d == 32 && !dt) ATTEND(32, 0);
            else if (d == dv && d == 64 && !dt) ATTEND(64, 0);
            else if (d == dv && d == 128 && !dt) ATTEND(128, 0);
            else attend_request(acc, scores, qf, k_buf, v_buf, slots, len, span, kv_heads, kv0,
                                grp, d, dv, scaling, dt);
#undef ATTEND
            store_row((char *)at(out, (b * heads + h0) * dv, dt), acc, span * dv, dt);
        }
        free(scores);
    }
}

/* y[r] = rows[r] · x for r < n_rows (rows: n_rows x n in dt, row-major; x: n floats). */
static void matvec(float *y, const void *rows, const float *x, int64_t n_rows, int64_t n, int dt) {
    int64_t r = 0;
    if (n % 8 == 0)
        for (; r + 8 <= n_rows; r += 8) {
            const void *rp[8];
            for (int j = 0; j < 8; j++) rp[j] = at(rows, (r + j) * n, dt);
            v8f v = dot8(rp, x, n, dt);
            memcpy(y + r, &v, 32);
        }
    for (; r < n_rows; r++) {
        const void *row = at(rows, r * n, dt);
        float dot = 0.0f;
        for (int64_t i = 0; i < n; i++) dot += elem_at(row, i, dt) * x[i];
        y[r] = dot;
    }
}

static inline float silu(float g) { /* g * sigmoid(g), exp of a non-positive argument only */
    float e = exp_neg(g >= 0.0f ? -g : g);
    return g * (g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

/* Routed experts for a few tokens: out[t] = sum_j weights[t, j] * expert_e(x[t]) over the local
 * experts e = ids[t, j] - first (ids outside [first, first + num_local) contribute nothing), with
 * expert_e(x) = W2_e (silu(gate) * up), [gate | up] = W13_e x. w13: [num_local, 2 * inter, hidden],
 * w2: [num_local, hidden, inter]; x and out: [tokens, hidden]. Rounded to dt where the torch path
 * rounds (each matmul output and each activation op); the weighted sum in float32. */
void ms_moe_experts(void *out, const void *x, const int64_t *ids, const float *weights,
                    const void *w13, const void *w2, int64_t tokens, int64_t k, int64_t hidden,
                    int64_t inter, int64_t first, int64_t num_local, int dt) {
    float *xf = malloc((size_t)(3 * hidden + 3 * inter) * sizeof(float));
    float *acc = xf + hidden, *y = acc + hidden, *gu = y + hidden, *act = gu + 2 * inter;
    for (int64_t t = 0; t < tokens; t++) {
        load_row(xf, at(x, t * hidden, dt), hidden, dt);
        memset(acc, 0, (size_t)hidden * sizeof(float));
        for (int64_t j = 0; j < k; j++) {
            int64_t e = ids[t * k + j] - first;
            if (e < 0 || e >= num_local) continue;
            matvec(gu, at(w13, e * 2 * inter * hidden, dt), xf, 2 * inter, hidden, dt);
            round_row(gu, 2 * inter, dt);
            for (int64_t i = 0; i < inter; i++) act[i] = silu(gu[i]);
            round_row(act, inter, dt);
            for (int64_t i = 0; i < inter; i++) act[i] = act[i] * gu[inter + i];
            round_row(act, inter, dt);
            matvec(y, at(w2, e * hidden * inter, dt), act, hidden, inter, dt);
            round_row(y, hidden, dt);
            float w = weights[t * k + j];
            for (int64_t i = 0; i < hidden; i++) acc[i] += w * y[i];
        }
        store_row((char *)at(out, t * hidden, dt), acc, hidden, dt);
    }
    free(xf);
}

/* Router: softmax over each row of logits [tokens, experts] (float32 arithmetic), the k largest
 * probabilities (ties: lower expert id first) in descending order, optionally renormalised to sum
 * to 1. Writes weights [tokens, k] float32 and ids [tokens, k] int64. */
void ms_topk_softmax(float *weights, int64_t *ids, const void *logits, int64_t tokens,
                     int64_t experts, int64_t k, int renormalize, int dt) {
    float *p = malloc((size_t)experts * sizeof(float));
    for (int64_t t = 0; t < tokens; t++) {
        load_row(p, at(logits, t * experts, dt), experts, dt);
        float m = -INFINITY, total = 0.0f;
        for (int64_t e = 0; e < experts; e++) m = p[e] > m ? p[e] : m;
        for (int64_t e = 0; e < experts; e++) {
            p[e] = exp_neg(p[e] - m);
            total += p[e];
        }
        float *w = weights + t * k, chosen = 0.0f;
        int64_t *id = ids + t * k;
        for (int64_t j = 0; j < k; j++) { /* k is small: repeated argmax over the unchosen */
            int64_t best = -1;
            for (int64_t e = 0; e < experts; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            w[j] = p[best] / total;
            chosen += w[j];
        }
        if (renormalize)
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / chosen;
    }
    free(p);
}

/* Greedy LM head for bfloat16: argmax over the vocabulary of x[t] · W[v] for each token, without
 * writing the logits (a [16, 129k] bf16 tensor and a separate argmax pass: ~0.4 ms of a ~4 ms
 * tiny-MoE decode step). w_packed is W [vocab, hidden] as [ceil(vocab / 16), hidden / 2, 16, 2]:
 * 16 vocabulary rows by pairs of hidden channels, the operand layout of AVX512-BF16's dot product.
 * Each logit is rounded to bf16 before it is compared (the argmax of the bf16 logits the LM head
 * would return), ties go to the lower id (torch.argmax). Returns 0; 1 when some logit is NaN
 * (out is then incomplete: the caller takes the unfused path, whose argmax ranks NaN first); -1
 * when this build has no AVX512-BF16. */
int64_t ms_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
static inline __m512 round_bf16_ps(__m512 v) { /* to the nearest bf16, kept as float32 */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

#define LMH_TOKENS 16
/* `tokens` is a compile-time constant at each call (always inlined): the accumulators then live in
 * registers and the token loop unrolls. */
static inline __attribute__((always_inline)) int64_t lm_head_argmax_group(
    int64_t *out, const uint16_t *x, const uint16_t *w_packed, int64_t vocab, int64_t hidden,
    int64_t tokens) {
    int64_t pairs = hidden / 2, blocks = (vocab + 15) / 16;
    const uint32_t *xp = (const uint32_t *)x; /* [tokens, pairs] bf16 pairs */
    __m512 best[LMH_TOKENS];
    __m512i best_id[LMH_TOKENS];
    __mmask16 nan = 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t = 0; t < tokens; t++) {
        best[t] = _mm512_set1_ps(-INFINITY);
        best_id[t] = _mm512_setzero_si512();
    }
    for (int64_t b = 0; b < blocks; b++) {
        __m512 acc[LMH_TOKENS];
        for (int64_t t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
        const uint16_t *wb = w_packed + b * pairs * 32;
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + p * 32);
            for (int64_t t = 0; t < tokens; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], wv,
                                          (__m512bh)_mm512_set1_epi32((int)xp[t * pairs + p]));
        }
        __m512i ids = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(b * 16)));
        __mmask16 valid = _mm512_cmplt_epi32_mask(ids, _mm512_set1_epi32((int)vocab));
        for (int64_t t = 0; t < tokens; t++) {
            nan |= _mm512_mask_cmp_ps_mask(valid, acc[t], acc[t], _CMP_UNORD_Q);
            __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, round_bf16_ps(acc[t]), best[t],
                                                   _CMP_GT_OQ);
            best[t] = _mm512_mask_blend_ps(gt, best[t], round_bf16_ps(acc[t]));
            best_id[t] = _mm512_mask_blend_epi32(gt, best_id[t], ids);
        }
    }
    if (nan) return 1;
    for (int64_t t = 0; t < tokens; t++) {
        float m = _mm512_reduce_max_ps(best[t]);
        __mmask16 at_max = _mm512_cmp_ps_mask(best[t], _mm512_set1_ps(m), _CMP_EQ_OQ);
        out[t] = _mm512_mask_reduce_min_epi32(at_max, best_id[t]);
    }
    return 0;
}
#endif

int64_t ms_lm_head_argmax(int64_t *out, const uint16_t *x, const uint16_t *w_packed,
                          int64_t vocab, int64_t hidden, int64_t tokens) {
#ifdef __AVX512BF16__
    uint16_t *pad = NULL;
    int64_t status = 0;
    for (int64_t t0 = 0; t0 < tokens && !status; t0 += LMH_TOKENS) {
        int64_t n = tokens - t0 < LMH_TOKENS ? tokens - t0 : LMH_TOKENS;
        int64_t cap = n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : n <= 8 ? 8 : 16;
        const uint16_t *xs = x + t0 * hidden;
        if (cap != n) { /* zero rows up to a specialised group size; their ids are dropped */
            if (!pad) pad = calloc((size_t)(LMH_TOKENS * hidden), sizeof(uint16_t));
            memset(pad, 0, (size_t)(cap * hidden) * sizeof(uint16_t));
            memcpy(pad, xs, (size_t)(n * hidden) * sizeof(uint16_t));
            xs = pad;
        }
        int64_t ids[LMH_TOKENS];
        switch (cap) {
        case 1: status = lm_head_argmax_group(ids, xs, w_packed, vocab, hidden, 1); break;
        case 2: status = lm_head_argmax_group(ids, xs, w_packed, vocab, hidden, 2); break;
        case 4: status = lm_head_argmax_group(ids, xs, w_packed, vocab, hidden, 4); break;
        case 8: status = lm_head_argmax_group(ids, xs, w_packed, vocab, hidden, 8); break;
        default: status = lm_head_argmax_group(ids, xs, w_packed, vocab, hidden, 16); break;
        }
        memcpy(out + t0, ids, (size_t)n * sizeof(int64_t));
    }
    free(pad);
    return status;
#else
    (void)out, (void)x, (void)w_packed, (void)vocab, (void)hidden, (void)tokens;
    return -1;
#endif
}
