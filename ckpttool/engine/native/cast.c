/* FP32 -> BF16 / FP16 casts of transforming exports (ckpttool/engine/kernels.py: f32_to_bf16, f32_to_f16).
 *
 * Round to nearest even, the bytes of the numpy path for every input, NaNs included:
 *   bfloat16: (u + 0x7FFF + ((u >> 16) & 1)) >> 16 in uint32 arithmetic; with canonical_nan every
 *             NaN gives 0x7FC0 (c10::BFloat16's scalar conversion);
 *   float16:  beyond float16's range to infinity; a NaN keeps its sign and its payload's top 10
 *             bits, 0x7C01 where those are zero (numpy's npy_floatbits_to_halfbits).
 * One pass, 16 (BF16) or 8 (FP16) elements per AVX2 step where the CPU has it.
 */
#include <stdint.h>

#include "half.h"
#ifdef CKPT_X86
#include <immintrin.h>
#endif

static inline uint16_t bf16_bits(uint32_t u, int canonical_nan) {
    if (canonical_nan && f32_is_nan(u)) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t f16_bits(uint32_t u) { return f32_is_nan(u) ? f16_nan_numpy(u) : f32_f16_finite(u); }

#ifdef CKPT_X86
__attribute__((target("avx2"))) static inline __m256i round_bf16x8(__m256i u, int canonical_nan) {
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    r = _mm256_srli_epi32(r, 16);
    if (canonical_nan) {
        __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
        __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    }
    return r;
}

__attribute__((target("avx2"))) static int64_t bf16_avx2(const uint32_t *src, uint16_t *dst, int64_t n, int canon) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = round_bf16x8(_mm256_loadu_si256((const __m256i *)(src + i)), canon);
        __m256i b = round_bf16x8(_mm256_loadu_si256((const __m256i *)(src + i + 8)), canon);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(dst + i), packed);
    }
    return i;
}

__attribute__((target("avx2,f16c"))) static int64_t f16_avx2(const uint32_t *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps((const float *)(src + i));
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        int nan = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        while (nan) { /* F16C quiets a NaN; numpy keeps the payload */
            int k = __builtin_ctz((unsigned)nan);
            dst[i + k] = f16_nan_numpy(src[i + k]);
            nan &= nan - 1;
        }
    }
    return i;
}
#endif

/* src: float32 bit patterns [n]; dst: bfloat16 bits [n]; canonical_nan: 0/1 (see the file comment) */
void ckpt_f32_to_bf16(const uint32_t *src, uint16_t *dst, int64_t n, int32_t canonical_nan) {
    int64_t i = 0;
#ifdef CKPT_X86
    if (ckpt_have_avx2()) i = bf16_avx2(src, dst, n, canonical_nan != 0);
#endif
    for (; i < n; i++) dst[i] = bf16_bits(src[i], canonical_nan != 0);
}

/* src: float32 bit patterns [n]; dst: float16 bits [n] */
void ckpt_f32_to_f16(const uint32_t *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#ifdef CKPT_X86
    if (ckpt_have_avx2()) i = f16_avx2(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = f16_bits(src[i]);
}

/* the portable loops alone (tests compare them with the AVX2 ones) */
void ckpt_f32_to_bf16_portable(const uint32_t *src, uint16_t *dst, int64_t n, int32_t canonical_nan) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_bits(src[i], canonical_nan != 0);
}

void ckpt_f32_to_f16_portable(const uint32_t *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f16_bits(src[i]);
}
