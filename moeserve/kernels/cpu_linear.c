/* y = x W^T (+ bias) with W kept in bfloat16 and float32 arithmetic: the linear layers of a
 * bfloat16 model on CPUs without native bf16 (AVX2 + FMA, no AVX512-BF16 / AMX), where torch's
 * bf16 matmul runs at a third of its float32 speed and oneDNN's bf16 prepack is unavailable.
 * Built into the same library as cpu_decode.c (moeserve/kernels/cpu_ops.py).
 *
 * Why it is fast there: weights are read once per call as bf16 (half the bytes of float32, and
 * decode steps are bound by reading them), widened to float32 by a shift, and every widened
 * weight vector feeds up to six tokens' FMAs from registers.
 *
 * Layout: w_packed is W [n, k] as [ceil(n / 16), k, 16] (16 output rows interleaved per input
 * channel, zero rows past n). A 16-output block is two 8-lane float vectors; a tile is up to six
 * tokens x one block (12 accumulators). Blocks are split over `threads` OpenMP threads (when
 * built with -fopenmp; otherwise the pragma is ignored and one thread runs). Accumulation is in
 * float32 over the k channels in order; the output (and bias add) is rounded to dt at the store,
 * as torch's bf16 linear rounds its float32 accumulator.
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

#include "cpu_bf16.h"

/* acc [mt][16] = x[0:mt] (rows ldx floats apart) · the block's 16 columns over k channels. (Also
 * tried: chunks of 256 channels so a block's weights stay in L1 across the tiles: no change.) */
static inline __attribute__((always_inline)) void tile(float (*acc)[BLOCK_N], const float *x,
                                                       int64_t ldx, const uint16_t *wb, int64_t k,
                                                       int mt) {
#ifdef MS_AVX2
    __m256 a0[TILE_M], a1[TILE_M];
    for (int m = 0; m < mt; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c++) {
        const __m128i *p = (const __m128i *)(wb + c * BLOCK_N);
        __m256i u0 = _mm256_cvtepu16_epi32(_mm_loadu_si128(p)); /* bf16 → float32 bits */
        __m256i u1 = _mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1));
        __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));
        __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));
        for (int m = 0; m < mt; m++) {
            __m256 xv = _mm256_broadcast_ss(x + m * ldx + c);
            a0[m] = _mm256_fmadd_ps(w0, xv, a0[m]);
            a1[m] = _mm256_fmadd_ps(w1, xv, a1[m]);
        }
    }
    for (int m = 0; m < mt; m++) {
        _mm256_storeu_ps(acc[m], a0[m]);
        _mm256_storeu_ps(acc[m] + 8, a1[m]);
    }
#else /* any other target: the same order with vector extensions (multiply, then add) */
    typedef float v8f __attribute__((vector_size(32)));
    v8f a0[TILE_M], a1[TILE_M];
    for (int m = 0; m < mt; m++) a0[m] = a1[m] = (v8f){0};
    for (int64_t c = 0; c < k; c++) {
        v8f w0, w1;
        for (int j = 0; j < 8; j++) {
            w0[j] = bf16_load(wb[c * BLOCK_N + j]);
            w1[j] = bf16_load(wb[c * BLOCK_N + 8 + j]);
        }
        for (int m = 0; m < mt; m++) {
            float xs = x[m * ldx + c];
            a0[m] += w0 * xs;
            a1[m] += w1 * xs;
        }
    }
    for (int m = 0; m < mt; m++) {
        memcpy(acc[m], &a0[m], 32);
        memcpy(acc[m] + 8, &a1[m], 32);
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
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[TILE_M][BLOCK_N];
        const uint16_t *wb = w_packed + b * k * BLOCK_N;
        int64_t n0 = b * BLOCK_N, cols = n - n0 < BLOCK_N ? n - n0 : BLOCK_N;
        for (int64_t m0 = 0; m0 < m; m0 += TILE_M) {
            int mt = m - m0 < TILE_M ? (int)(m - m0) : TILE_M;
            const float *xs = xf + m0 * k;
            switch (mt) { /* constant tile heights: the accumulators stay in registers */
            case 1: tile(acc, xs, k, wb, k, 1); break;
            case 2: tile(acc, xs, k, wb, k, 2); break;
            case 3: tile(acc, xs, k, wb, k, 3); break;
            case 4: tile(acc, xs, k, wb, k, 4); break;
            case 5: tile(acc, xs, k, wb, k, 5); break;
            default: tile(acc, xs, k, wb, k, 6); break;
            }
            store_rows((char *)out + m0 * n * (dt ? 2 : 4), n, mt, n0, cols,
                       (const float (*)[BLOCK_N])acc, bias, dt);
        }
    }
    free(conv);
    return 0;
}
