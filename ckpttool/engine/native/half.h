/* What the native kernels share (header only, static inline): IEEE bit-pattern reinterpretation,
 * float32 -> float16 rounding, the AVX2 capability check. */
#ifndef CKPT_HALF_H
#define CKPT_HALF_H

#include <stdint.h>
#include <string.h>

/* float32 <-> its bit pattern, float64 of its bit pattern (memcpy: no aliasing questions, one move) */
static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline double double_of(uint64_t u) {
    double f;
    memcpy(&f, &u, 8);
    return f;
}

/* bfloat16 bits -> float32, exact (bfloat16 is float32's upper half) */
static inline float bf16_float(uint16_t h) { return float_of((uint32_t)h << 16); }

/* float32 bit pattern -> float16 bits, round to nearest even, beyond float16's range to infinity
 * (as torch and numpy); u must not be a NaN. */
static inline uint16_t f32_f16_finite(uint32_t u) {
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to 65520 or beyond: infinity */
    if (a < 0x38800000u) {                                    /* below 2^-14: subnormal or zero */
        if (a <= 0x33000000u) return (uint16_t)sign;          /* at most 2^-25: rounds to zero */
        /* value = mant * 2^(e - 150); the result's unit is 2^-24, so q = mant >> (126 - e) */
        uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23);
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        q += (rem > half) || (rem == half && (q & 1u));
        return (uint16_t)(sign | q);
    }
    uint32_t r = a - 0x38000000u; /* rebias the exponent 127 -> 15 */
    return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
}

/* float16 of a NaN as the F16C instruction (and torch's vectorised copy) writes it: sign, quiet
 * bit, the payload's top 9 bits. */
static inline uint16_t f16_nan_quiet(uint32_t u) {
    return (uint16_t)(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x3FFu));
}

/* float16 of a NaN as numpy's cast writes it: sign, the payload's top 10 bits, 0x7C01 where those
 * are zero (still a NaN). */
static inline uint16_t f16_nan_numpy(uint32_t u) {
    uint32_t payload = (u >> 13) & 0x3FFu;
    return (uint16_t)(((u >> 16) & 0x8000u) | 0x7C00u | (payload ? payload : 1u));
}

static inline int f32_is_nan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

static inline uint16_t f32_f16_quiet(uint32_t u) { return f32_is_nan(u) ? f16_nan_quiet(u) : f32_f16_finite(u); }

#if defined(__x86_64__) || defined(__i386__)
#define CKPT_X86 1
/* whether this CPU runs the kernels' AVX2 code (AVX2, FMA and F16C) */
static inline int ckpt_have_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#endif

/* CKPT_CLONES: an AVX2 build of a function beside the baseline one, picked at load time (GCC's
 * target_clones, x86 ELF only); elsewhere the baseline build alone */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
#define CKPT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CKPT_CLONES
#endif

#endif
