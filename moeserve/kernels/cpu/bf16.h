/* bfloat16 <-> float32 for the CPU kernels (decode.c, linear.c), rounding as torch does. */
#ifndef MOESERVE_CPU_BF16_H
#define MOESERVE_CPU_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) { /* round to nearest even, NaN → 0x7FC0 (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
