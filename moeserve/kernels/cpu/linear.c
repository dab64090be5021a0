/* y = x W^T (+ bias) with W kept in bfloat16 and float32 arithmetic: the linear layers of a
 * bfloat16 model on CPUs without native bf16 (AVX2 + FMA, no AVX512-BF16 / AMX), where torch's
 * bf16 matmul runs at a third of its float32 speed and oneDNN's bf16 prepack is unavailable.
 * Built into the same library as decode.c (moeserve/kernels/cpu/build.py).
 *
 * Why it is fast there: weights are read once per call as bf16 (half the bytes of float32, and
 * decode steps are bound by reading them), widened to float32 by a shift, and every widened
 * weight vector feeds up to six tokens' FMAs from registers; tiles of few tokens span several
 * 16-output blocks so that enough independent FMA chains are in flight.
 *
 * Layout: w_packed is W [n, k] as [ceil(n / 16), k, 16] (16 output rows interleaved per input
 * channel, zero rows past n). A 16-output block is two 8-lane float vectors; a tile is t tokens
 * x g blocks (GROUPS: 1 x 6 ... 6 x 1). Each OpenMP thread takes an even, contiguous share of the
 * blocks (when built with -fopenmp; otherwise the pragma is ignored and one thread runs).
 * Accumulation is in float32 over the k channels in order, whatever the tile, so a token's
 * output does not depend on the tokens beside it; the output (and bias add) is rounded to dt at
 * the store, as torch's bf16 linear rounds its float32 accumulator.
 *
 * dt: 0 = float32, 1 = bfloat16, for x, bias and out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MS_AVX2 1
#endif

#define TILE_M 6
#define BLOCK_N 16
#define MAX_ACC 6 /* token x block pairs of a tile: 12 float vectors */
/* blocks per tile by its token count: about 12 accumulators each (measured on a 2-core AVX2 EPYC,
 * SmolLM2's 30 layers of linears from DRAM, against one block per tile: 1 token 10.2 -> 8.3 ms,
 * 2 tokens 10.3 -> 9.1, 3 tokens 10.8 -> 9.8, 4 and 6 unchanged within noise) */
static const int GROUPS[TILE_M + 1] = {0, 6, 3, 2, 1, 1, 1};

#include "bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* acc [g * mt][16] (block-major) = x[0:mt] (rows ldx floats apart) · the 16 columns of g
 * consecutive blocks (wb, wb + k * 16, ...) over k channels. Why g blocks: an FMA's result is
 * ready ~4-5 cycles after it issues and each accumulator chains over the k channels, so a tile
 * needs ~10 independent accumulators to keep both FMA pipes busy; a one-token tile of one block
 * has two. Wider tiles (more columns, never a split of a column's sum) keep every output's
 * float32 sum in the same order for any tile shape: a token's row does not depend on the rows
 * batched with it. (Also tried: chunks of 256 channels so a block's weights stay in L1 across
 * the tiles: no change.) */
static inline __attribute__((always_inline)) void tile(float (*acc)[BLOCK_N], const float *x,
                                                       int64_t ldx, const uint16_t *wb, int64_t k,
                                                       int mt, int g) {
#ifdef MS_AVX2
    __m256 a0[MAX_ACC], a1[MAX_ACC];
    for (int i = 0; i < g * mt; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c++) {
        for (int gi = 0; gi < g; gi++) {
            const __m128i *p = (const __m128i *)(wb + (gi * k + c) * BLOCK_N);
            __m256i u0 = _mm256_cvtepu16_epi32(_mm_loadu_si128(p)); /* bf16 → float32 bits */
            __m256i u1 = _mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1));
            __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));
            __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));
            for (int m = 0; m < mt; m++) {
                __m256 xv = _mm256_broadcast_ss(x + m * ldx + c);
                a0[gi * mt + m] = _mm256_fmadd_ps(w0, xv, a0[gi * mt + m]);
                a1[gi * mt + m] = _mm256_fmadd_ps(w1, xv, a1[gi * mt + m]);
            }
        }
    }
    for (int i = 0; i < g * mt; i++) {
        _mm256_storeu_ps(acc[i], a0[i]);
        _mm256_storeu_ps(acc[i] + 8, a1[i]);
    }
#else /* any other target: the same order with vector extensions (multiply, then add) */
    typedef float v8f __attribute__((vector_size(32)));
    v8f a0[MAX_ACC], a1[MAX_ACC];
    for (int i = 0; i < g * mt; i++) a0[i] = a1[i] = (v8f){0};
    for (int64_t c = 0; c < k; c++) {
        for (int gi = 0; gi < g; gi++) {
            const uint16_t *p = wb + (gi * k + c) * BLOCK_N;
            v8f w0, w1;
            for (int j = 0; j < 8; j++) {
                w0[j] = bf16_load(p[j]);
                w1[j] = bf16_load(p[8 + j]);
            }
            for (int m = 0; m < mt; m++) {
                float xs = x[m * ldx + c];
                a0[gi * mt + m] += w0 * xs;
                a1[gi * mt + m] += w1 * xs;
            }
        }
    }
    for (int i = 0; i < g * mt; i++) {
        memcpy(acc[i], &a0[i], 32);
        memcpy(acc[i] + 8, &a1[i], 32);
    }
#endif
}

static void store_rows(void *out, int64_t n, int64_t rows, int64_t n0, int64_t cols,
                       const float (*acc)[BLOCK_N], const void *bias, int dt) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < cols; j++) {
            float v = acc[m][j];
            if (bias)
                v += dt ? bf16_load(((const uint16_t *)bias)[n0 + j])
                        : ((const float *)bias)[n0 + j];
            if (dt)
                ((uint16_t *)out)[m * n + n0 + j] = bf16_store(v);
            else
                ((float *)out)[m * n + n0 + j] = v;
        }
}

int64_t ms_linear_w16_fma(void) { /* 1: the AVX2 + FMA tile below, 0: generic vectors */
#ifdef MS_AVX2
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] = x [m, k] · W^T (+ bias [n]); x and out contiguous in dt. Returns 0, or -1 where
 * bf16 activations could not be widened (out of memory; out is not written). */
int64_t ms_linear_w16(void *out, const void *x, const uint16_t *w_packed, const void *bias,
                   int64_t m, int64_t n, int64_t k, int64_t threads, int dt) {
    const float *xf = (const float *)x;
    float *conv = NULL;
    if (dt) { /* bf16 activations widened once: every block re-reads them */
        conv = malloc((size_t)(m * k) * sizeof(float));
        if (!conv && m * k) return -1;
        for (int64_t i = 0; i < m * k; i++) conv[i] = bf16_load(((const uint16_t *)x)[i]);
        xf = conv;
    }
    int64_t blocks = (n + BLOCK_N - 1) / BLOCK_N;
    (void)threads;
    /* each thread takes a contiguous range of blocks (an even split), walked in groups of g */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int64_t b_start = blocks * t / nt, b_end = blocks * (t + 1) / nt;
        /* a group of blocks at a time, every token tile over it: past TILE_M rows (a draft
         * tree's verify) the weights are read from DRAM once, the later tiles find the group in
         * L1/L2 */
        int gmax = GROUPS[m < TILE_M ? m : TILE_M];
        for (int64_t b = b_start; b < b_end; b += gmax) {
            int gb = b_end - b < gmax ? (int)(b_end - b) : gmax;
            const uint16_t *wb = w_packed + b * k * BLOCK_N;
            for (int64_t m0 = 0; m0 < m; m0 += TILE_M) {
                int mt = m - m0 < TILE_M ? (int)(m - m0) : TILE_M;
                const float *xs = xf + m0 * k;
                for (int g0 = 0; g0 < gb; g0 += GROUPS[mt]) { /* a short last tile: fewer rows */
                    float acc[MAX_ACC][BLOCK_N];
                    int g = gb - g0 < GROUPS[mt] ? gb - g0 : GROUPS[mt];
                    const uint16_t *wg = wb + (int64_t)g0 * k * BLOCK_N;
                    /* constant tile shapes: the accumulators stay in registers */
#define TILE_CASE(tm, tg) case tm * 8 + tg: tile(acc, xs, k, wg, k, tm, tg); break;
                    switch (mt * 8 + g) {
                        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
                        TILE_CASE(1, 5) TILE_CASE(1, 6) TILE_CASE(2, 1) TILE_CASE(2, 2)
                        TILE_CASE(2, 3) TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1)
                        TILE_CASE(5, 1)
                    default: tile(acc, xs, k, wg, k, 6, 1); break;
                    }
#undef TILE_CASE
                    for (int gi = 0; gi < g; gi++) {
                        int64_t n0 = (b + g0 + gi) * BLOCK_N;
                        int64_t cols = n - n0 < BLOCK_N ? n - n0 : BLOCK_N;
                        store_rows((char *)out + m0 * n * (dt ? 2 : 4), n, mt, n0, cols,
                                   (const float (*)[BLOCK_N])acc + gi * mt, bias, dt);
                    }
                }
            }
        }
    }
    free(conv);
    return 0;
}
