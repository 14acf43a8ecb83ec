/* FP8 (float8_e4m3fn) quantization of bands of rows, checked as it goes (export --quantize).
 *
 * ckpt_fp8_bands computes, for each band of [rows, cols] float32 or bfloat16 values, what the numpy
 * kernels fp8_block_quantize / fp8_channel_quantize, their dequantization and fp8_*_error compute
 * (ckpttool/engine/kernels.py), bit for bit, in one read of the band (per block: of each row, per
 * column, reduced per block once) or of each row (per channel) for the amax, and one pass that
 * quantizes, writes the bytes and measures the error:
 *
 *   amax  = max |w| over the block (row); NaN when it holds a NaN (a max of |w|'s bit patterns)
 *   scale = amax / 448 (float32 division), 1 for an all-zero block (row)
 *   q     = e4m3fn(w / scale): round to nearest even, |x| >= 464 and infinities give +-448
 *           (0x7E), NaN gives 0x7F, sign kept (c10/util/Float8_e4m3fn.h; engine/kernels.f32_to_f8)
 *   err   = max | |q| * scale - |w| | over the block (row): equal to |q * scale - w| (q has w's sign)
 *   rel   = err / amax where amax > 0, else 0
 *
 * Every step is one IEEE float32 operation (built with -ffp-contract=off, no fast-math, FTZ/DAZ off),
 * so each clone below, and the AVX2 kernel, gives the same bits (the AVX2 kernel's division-free quotients
 * included: see quantize_fma32 and quantize_near32). The caller refuses a band whose scale is non-finite
 * or zero for a non-zero block before it uses q or the error figures.
 */
/* no FP exception flags are read: lets the loops below be if-converted and vectorized (values unchanged) */
#pragma GCC optimize("no-trapping-math")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#ifdef CKPT_X86
#include <immintrin.h>
#endif


/* max of |w|'s bit patterns over n elements: NaN > infinity > every finite magnitude */
static inline uint32_t amax_bits(const void *src, int bf16, int64_t at, int64_t n) {
    uint32_t m = 0;
    if (bf16) {
        const uint16_t *p = (const uint16_t *)src + at;
        uint16_t m16 = 0;
        for (int64_t i = 0; i < n; i++) {
            uint16_t a = p[i] & 0x7FFF;
            m16 = a > m16 ? a : m16;
        }
        return (uint32_t)m16 << 16;
    }
    const uint32_t *p = (const uint32_t *)src + at;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = p[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* round float32 bits to float8_e4m3fn, to nearest even, saturating (engine/kernels.f32_to_f8) */
static inline uint32_t to_e4m3fn(uint32_t u) {
    uint32_t mag = u & 0x7FFFFFFFu;
    /* normal results: re-bias the exponent (7 - 127, uint32 wrap as c10), round the mantissa to nearest even */
    uint32_t t = (mag + ((mag >> 20) & 1u) + (uint32_t)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu)) >> 20;
    /* subnormal results: the float32 sum with 2^14 rounds at the e4m3fn subnormal step 2^-9 */
    uint32_t sub = bits_of(float_of(mag) + 16384.0f) - (141u << 23);
    t = mag < (121u << 23) ? sub : t;
    t = mag >= 0x43E80000u ? 0x7Eu : t;
    t = mag > 0x7F800000u ? 0x7Fu : t;
    return t | ((u >> 24) & 0x80u);
}

/* quantize one element w (float32 bits u) with scale into *q; returns | |q| * scale - |w| |'s bits */
static inline uint32_t quantize_one(uint32_t u, float scale, uint8_t *q) {
    const float unbias = 1329227995784915872903807060280344576.0f; /* 2^120 */
    uint32_t b = to_e4m3fn(bits_of(float_of(u) / scale));
    *q = (uint8_t)b;
    /* |q| from its magnitude bits: (b & 0x7F) << 20 is 2^-120 times the e4m3fn value as a float32 */
    float d = float_of((b & 0x7Fu) << 20) * unbias * scale;
    return bits_of(d - float_of(u & 0x7FFFFFFFu)) & 0x7FFFFFFFu; /* abs: the error is >= 0 (or NaN) */
}

/* quantize n elements with one scale into q; returns max | |q| * scale - |w| | (0 for none), a max of
 * the errors' bit patterns (non-negative floats order as their bits) */
static inline float quantize_run(const void *restrict src, int bf16, int64_t at, int64_t n, float scale,
                                 uint8_t *restrict q) {
    uint32_t worst = 0;
    if (bf16) {
        const uint16_t *p = (const uint16_t *)src + at;
        for (int64_t i = 0; i < n; i++) {
            uint32_t e = quantize_one((uint32_t)p[i] << 16, scale, q + i);
            worst = e > worst ? e : worst;
        }
    } else {
        const uint32_t *p = (const uint32_t *)src + at;
        for (int64_t i = 0; i < n; i++) {
            uint32_t e = quantize_one(p[i], scale, q + i);
            worst = e > worst ? e : worst;
        }
    }
    return float_of(worst);
}

/* the largest of v[0..n) (0 for n = 0): a block's maximum of per-column maxima (bit patterns of |x| or errors) */
static inline uint32_t max_u32(const uint32_t *v, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float scale_of(float amax) { return amax == 0.0f ? 1.0f : amax / 448.0f; }

static inline void account(float amax, float err, float *worst, float *rel) {
    float r = amax > 0.0f ? err / amax : 0.0f;
    *worst = err > *worst ? err : *worst;
    *rel = r > *rel ? r : *rel;
}

/* The block path over whole rows (the same figures, bit for bit: max is order-free): the amax and the error are
 * kept per column (one contiguous vectorised pass over each row, no reduction per 128 values) and reduced per
 * block once per band. Returns 0 (nothing done) when its per-column arrays cannot be allocated. */
static inline int block_by_columns(const void *restrict src, int bf16, int64_t rows, int64_t cols, int64_t block,
                                   uint8_t *restrict q, float *restrict scale, float *restrict amax, float *worst,
                                   float *rel) {
    uint32_t *colmax = calloc((size_t)cols, 4), *colerr = calloc((size_t)cols, 4);
    if (colmax == NULL || colerr == NULL) {
        free(colmax);
        free(colerr);
        return 0;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *p = (const uint16_t *)src + r * cols;
            for (int64_t c = 0; c < cols; c++) {
                uint32_t a = (uint32_t)(p[c] & 0x7FFF) << 16;
                colmax[c] = a > colmax[c] ? a : colmax[c];
            }
        } else {
            const uint32_t *p = (const uint32_t *)src + r * cols;
            for (int64_t c = 0; c < cols; c++) {
                uint32_t a = p[c] & 0x7FFFFFFFu;
                colmax[c] = a > colmax[c] ? a : colmax[c];
            }
        }
    }
    for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block, j++) {
        int64_t n = cols - c0 < block ? cols - c0 : block;
        amax[j] = float_of(max_u32(colmax + c0, n));
        scale[j] = scale_of(amax[j]);
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block, j++) {
            int64_t n = cols - c0 < block ? cols - c0 : block;
            float s = scale[j];
            uint32_t *e = colerr + c0;
            uint8_t *qr = q + r * cols + c0;
            if (bf16) {
                const uint16_t *p = (const uint16_t *)src + r * cols + c0;
                for (int64_t i = 0; i < n; i++) {
                    uint32_t x = quantize_one((uint32_t)p[i] << 16, s, qr + i);
                    e[i] = x > e[i] ? x : e[i];
                }
            } else {
                const uint32_t *p = (const uint32_t *)src + r * cols + c0;
                for (int64_t i = 0; i < n; i++) {
                    uint32_t x = quantize_one(p[i], s, qr + i);
                    e[i] = x > e[i] ? x : e[i];
                }
            }
        }
    }
    for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block, j++) {
        int64_t n = cols - c0 < block ? cols - c0 : block;
        account(amax[j], float_of(max_u32(colerr + c0, n)), worst, rel);
    }
    free(colmax);
    free(colerr);
    return 1;
}

#ifdef CKPT_X86
/* The AVX2 band kernel: the scalar code's operations on 8 float32 lanes at a time (each an IEEE float32
 * operation or exact integer arithmetic, so the same bits), 32 elements (one 32-byte store) per step.
 * Differences in form only:
 *   - it divides |w| by the scale and puts w's sign on the code afterwards (IEEE division is
 *     sign-symmetric; the scale is positive); the signs of 32 elements come from one signed pack of w;
 *   - it runs only where the scale is finite and positive (then no lane is NaN: a NaN or an infinity
 *     in the block would have made its amax, hence its scale, non-finite); other blocks (rows) take
 *     the scalar code;
 *   - |q| * scale is v * (scale * 2^120) with v = |q| * 2^-120 (the code's bits shifted into a float32)
 *     when scale * 2^120 is finite (scale < 256): both are the one rounding of the same product;
 *   - the saturation is a min: above 0x43E80000 the normal path gives codes >= 0x7F;
 *   - the error maxima stay per lane in a register across a block's columns, reduced once per band;
 *   - with a scale in [2^-64, 2^64], a group of 32 whose |w| are all at least scale * 2^-6 takes the quotient
 *     |w| / scale without a division (bfloat16: quantize_fma32) or its code (float32: quantize_near32, which
 *     divides the rare groups near a rounding midpoint): the same quotient, or the same code, bit for bit. */
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) static inline

/* e4m3fn magnitude codes (0x08 .. 0x7E) of 8 non-negative, non-NaN float32 lanes of at least 2^-6 (the normal
 * results of to_e4m3fn of a magnitude); sat: saturate (a min). Unneeded for w / scale with a normal scale =
 * amax / 448 rounded: |w| / scale <= 448 / (1 - 2^-24) rounds below 464 (code 0x7E at most); a subnormal scale
 * is not that close to amax / 448 */
AVX2_INLINE __m256i e4m3_normal8(__m256i mag, int sat) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
    const int32_t bias = (int32_t)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu);
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, lsb), _mm256_set1_epi32(bias)), 20);
    return sat ? _mm256_min_epu32(t, _mm256_set1_epi32(0x7E)) : t;
}

/* e4m3fn magnitude codes (0 .. 0x7E) of 8 non-negative, non-NaN float32 lanes (to_e4m3fn of a magnitude) */
AVX2_INLINE __m256i e4m3_mag8(__m256i mag) {
    __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(16384.0f));
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(sum), _mm256_set1_epi32((int32_t)(141u << 23)));
    /* the subnormal codes are <= 8: the saturating min of e4m3_normal8 leaves them as they are */
    return _mm256_blendv_epi8(e4m3_normal8(mag, 1), sub, _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(121u << 23)), mag));
}

/* e4m3_mag8 of 4 x 8 lanes in place, the subnormal path (a float add, a subtract and a blend per 8 lanes) only
 * when one of the 32 lanes needs it: below 2^-6, rare in a block scaled to its amax (~0.4% of 32-lane groups
 * of Gaussian weights); the same codes either way */
AVX2_INLINE void e4m3_mag32(__m256i *x, int sat) {
    const __m256i lim = _mm256_set1_epi32((int32_t)(121u << 23));
    __m256i low = _mm256_or_si256(_mm256_or_si256(_mm256_cmpgt_epi32(lim, x[0]), _mm256_cmpgt_epi32(lim, x[1])),
                                  _mm256_or_si256(_mm256_cmpgt_epi32(lim, x[2]), _mm256_cmpgt_epi32(lim, x[3])));
    if (_mm256_testz_si256(low, low)) {
        for (int j = 0; j < 4; j++) x[j] = e4m3_normal8(x[j], sat);
    } else {
        for (int j = 0; j < 4; j++) x[j] = e4m3_mag8(x[j]);
    }
}

/* the magnitude codes of 8 lanes of |w| (float32 bits) quantized with scale s; *err gets max | |q| * s - |w| |
 * per lane; k: s * 2^120 (one) or 2^120 (not one: then times s) */
/* *err gets max | |q| * s - |w| | per lane of 8 lanes of |w| (float32 bits a) and their magnitude codes t */
AVX2_INLINE void error8(__m256i a, __m256i t, __m256 s, __m256 k, int one, __m256i *err) {
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(t, 20));
    __m256 d = one ? _mm256_mul_ps(v, k) : _mm256_mul_ps(_mm256_mul_ps(v, k), s);
    __m256i e = _mm256_and_si256(_mm256_castps_si256(_mm256_sub_ps(d, _mm256_castsi256_ps(a))),
                                 _mm256_set1_epi32(0x7FFFFFFF));
    *err = _mm256_max_epu32(*err, e);
}

AVX2_INLINE __m256i quantize_mag8(__m256i a, __m256 s, __m256 k, int one, __m256i *err) {
    __m256i t = e4m3_mag8(_mm256_castps_si256(_mm256_div_ps(_mm256_castsi256_ps(a), s)));
    error8(a, t, s, k, one, err);
    return t;
}

/* quantize_mag8 of 4 x 8 lanes of |w| (a[0..3]) into their codes t[0..3] (e4m3_mag32; sat: a subnormal scale) */
AVX2_INLINE void quantize_mag32(const __m256i *a, __m256 s, __m256 k, int one, int sat, __m256i *err, __m256i *t) {
    for (int j = 0; j < 4; j++) t[j] = _mm256_castps_si256(_mm256_div_ps(_mm256_castsi256_ps(a[j]), s));
    e4m3_mag32(t, sat);
    for (int j = 0; j < 4; j++) error8(a[j], t[j], s, k, one, err);
}

/* The codes without a division, for a scale s in [2^-64, 2^64] (then 1 / s, |w| * (1 / s) and the steps below are
 * normal float32 numbers), where every |w| of the 32 is at least thr (bits in each uint16 lane for bfloat16, in each
 * uint32 lane for float32: s * 2^-6, rounded up to a bfloat16): the quotient |w| / s, rounded, is then at least 2^-6
 * and its code is e4m3_normal8's; a group with a lower |w| divides (quantize_mag32). rs = 1 / s, rounded. */
typedef struct {
    __m256 rs;
    __m256i thr;
} fast_t;

/* fast (NULL: none) for scale; *store holds it */
AVX2_INLINE const fast_t *fast_of(float scale, int bf16, fast_t *store) {
    if (!(scale >= 5.42101086e-20f && scale <= 1.84467441e19f)) return NULL; /* 2^-64, 2^64 */
    uint32_t thr = bits_of(scale * 0.015625f);                                 /* exact */
    store->rs = _mm256_set1_ps(1.0f / scale);
    store->thr = bf16 ? _mm256_set1_epi16((int16_t)((thr + 0xFFFFu) >> 16)) : _mm256_set1_epi32((int32_t)thr);
    return store;
}

/* bfloat16 |w| (a[0..3]): q0 = |w| * rs is within an ulp or so of |w| / s, and q0 + (|w| - q0 * s) * rs, each step one
 * fused rounding, is |w| / s rounded, bit for bit (Markstein's correction; checked for every bfloat16 significand
 * against every float32 significand of s: the steps scale exactly by powers of two in the range above) */
AVX2_INLINE void quantize_fma32(const __m256i *a, __m256 s, __m256 k, int one, const fast_t *fast, __m256i *err,
                                __m256i *t) {
    for (int j = 0; j < 4; j++) {
        __m256 w = _mm256_castsi256_ps(a[j]);
        __m256 q0 = _mm256_mul_ps(w, fast->rs);
        __m256 q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, s, w), fast->rs, q0);
        t[j] = e4m3_normal8(_mm256_castps_si256(q), 0);
        error8(a[j], t[j], s, k, one, err);
    }
}

/* float32 |w| (a[0..3]): x = |w| * rs is within 3 ulps of |w| / s rounded (two roundings of at most 2^-24 against one),
 * so where the lowest 20 bits of x lie at least NEAR from 0x80000 (e4m3fn's rounding midpoint) both round to the same
 * code, x half up (no tie arises). Returns 0, having done nothing, when a lane is that close (~1 in 30000 lanes: the
 * caller divides); bfloat16 sources meet exact midpoints far more often (~1 in 150), hence quantize_fma32. */
#define NEAR 8
AVX2_INLINE int quantize_near32(const __m256i *a, __m256 s, __m256 k, int one, const fast_t *fast, __m256i *err,
                                __m256i *t) {
    /* u = x + rebias + 0x80000 + NEAR: the code is u >> 20 where u's lowest 20 bits are 2 * NEAR or more */
    const __m256i add = _mm256_set1_epi32((int32_t)(((uint32_t)(7 - 127) << 23) + 0x80000u + NEAR));
    const __m256i low20 = _mm256_set1_epi32(0xFFFFF);
    __m256i u[4];
    for (int j = 0; j < 4; j++)
        u[j] = _mm256_add_epi32(_mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(a[j]), fast->rs)), add);
    __m256i m = _mm256_min_epi32(_mm256_min_epi32(_mm256_and_si256(u[0], low20), _mm256_and_si256(u[1], low20)),
                                 _mm256_min_epi32(_mm256_and_si256(u[2], low20), _mm256_and_si256(u[3], low20)));
    __m256i near = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * NEAR), m);
    if (!_mm256_testz_si256(near, near)) return 0;
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_srli_epi32(u[j], 20);
        error8(a[j], t[j], s, k, one, err);
    }
    return 1;
}

/* 8 float32 lanes u (bit patterns) to 8 e4m3fn bytes at q (sign from u) */
AVX2_INLINE void quantize8_store(__m256i u, __m256 s, __m256 k, int one, __m256i *err, uint8_t *q) {
    __m256i t = quantize_mag8(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), s, k, one, err);
    t = _mm256_or_si256(t, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packus_epi16(w, w));
}

/* quantize_run's vector part on bfloat16 bits: returns how many of the n were done (a multiple of 8) */
AVX2_INLINE int64_t run_bf16(const uint16_t *restrict p, int64_t n, float scale, int one, int sat, const fast_t *fast,
                             uint8_t *restrict q, __m256i *err) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256 k = _mm256_set1_ps(one ? scale * 1329227995784915872903807060280344576.0f
                                        : 1329227995784915872903807060280344576.0f);
    const __m256i m15 = _mm256_set1_epi16(0x7FFF), z = _mm256_setzero_si256();
    __m256i acc = *err;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        /* unpack puts elements 0-3 and 8-11 in lo, 4-7 and 12-15 in hi (per 128-bit lane); packus undoes it */
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(p + i)), v1 = _mm256_loadu_si256((const __m256i *)(p + i + 16));
        __m256i m0 = _mm256_and_si256(v0, m15), m1 = _mm256_and_si256(v1, m15), t[4];
        const __m256i a[4] = {_mm256_unpacklo_epi16(z, m0), _mm256_unpackhi_epi16(z, m0), _mm256_unpacklo_epi16(z, m1),
                              _mm256_unpackhi_epi16(z, m1)};
        /* a lane below the threshold (as int16: both are below 0x8000) */
        __m256i low = fast == NULL ? z : _mm256_cmpgt_epi16(fast->thr, _mm256_min_epu16(m0, m1));
        if (fast != NULL && _mm256_testz_si256(low, low))
            quantize_fma32(a, s, k, one, fast, &acc, t);
        else
            quantize_mag32(a, s, k, one, sat, &acc, t);
        __m256i codes = _mm256_packus_epi16(_mm256_packus_epi32(t[0], t[1]), _mm256_packus_epi32(t[2], t[3]));
        __m256i signs = _mm256_and_si256(_mm256_packs_epi16(v0, v1), _mm256_set1_epi8((char)0x80));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_or_si256(codes, signs), 0xD8));
    }
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + i))), 16);
        quantize8_store(u, s, k, one, &acc, q + i);
    }
    *err = acc;
    return i;
}

/* quantize_run's vector part on float32 bits: returns how many of the n were done (a multiple of 8) */
AVX2_INLINE int64_t run_f32(const uint32_t *restrict p, int64_t n, float scale, int one, int sat, const fast_t *fast,
                            uint8_t *restrict q, __m256i *err) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256 k = _mm256_set1_ps(one ? scale * 1329227995784915872903807060280344576.0f
                                        : 1329227995784915872903807060280344576.0f);
    const __m256i m31 = _mm256_set1_epi32(0x7FFFFFFF), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i acc = *err;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i u0 = _mm256_loadu_si256((const __m256i *)(p + i)), u1 = _mm256_loadu_si256((const __m256i *)(p + i + 8));
        __m256i u2 = _mm256_loadu_si256((const __m256i *)(p + i + 16)), u3 = _mm256_loadu_si256((const __m256i *)(p + i + 24));
        __m256i t[4];
        const __m256i a[4] = {_mm256_and_si256(u0, m31), _mm256_and_si256(u1, m31), _mm256_and_si256(u2, m31),
                              _mm256_and_si256(u3, m31)};
        __m256i low = fast == NULL ? m31
                                   : _mm256_cmpgt_epi32(fast->thr, _mm256_min_epu32(_mm256_min_epu32(a[0], a[1]),
                                                                                    _mm256_min_epu32(a[2], a[3])));
        if (fast == NULL || !_mm256_testz_si256(low, low) || !quantize_near32(a, s, k, one, fast, &acc, t))
            quantize_mag32(a, s, k, one, sat, &acc, t);
        __m256i codes = _mm256_packus_epi16(_mm256_packus_epi32(t[0], t[1]), _mm256_packus_epi32(t[2], t[3]));
        __m256i signs = _mm256_packs_epi16(_mm256_packs_epi32(u0, u1), _mm256_packs_epi32(u2, u3));
        signs = _mm256_and_si256(signs, _mm256_set1_epi8((char)0x80));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(_mm256_or_si256(codes, signs), order));
    }
    for (; i + 8 <= n; i += 8) quantize8_store(_mm256_loadu_si256((const __m256i *)(p + i)), s, k, one, &acc, q + i);
    *err = acc;
    return i;
}

/* quantize_run's vector part (see the comment above this section); 0 where the scale is not finite and positive;
 * fast: fast_of(scale) */
AVX2 static int64_t run_avx2(const void *restrict src, int bf16, int64_t at, int64_t n, float scale, const fast_t *fast,
                             uint8_t *restrict q, __m256i *err) {
    if (!(scale > 0.0f && scale <= 3.40282347e38f)) return 0;
    int one = scale < 256.0f, sat = scale < 1.17549435e-38f; /* scale * 2^120 is finite; a subnormal scale */
    const uint16_t *h = (const uint16_t *)src + at;
    const uint32_t *f = (const uint32_t *)src + at;
    if (fast != NULL) { /* then not sat */
        if (bf16) return one ? run_bf16(h, n, scale, 1, 0, fast, q, err) : run_bf16(h, n, scale, 0, 0, fast, q, err);
        return one ? run_f32(f, n, scale, 1, 0, fast, q, err) : run_f32(f, n, scale, 0, 0, fast, q, err);
    }
    if (bf16) return sat ? run_bf16(h, n, scale, 1, 1, NULL, q, err) : one ? run_bf16(h, n, scale, 1, 0, NULL, q, err)
                                                                         : run_bf16(h, n, scale, 0, 0, NULL, q, err);
    return sat ? run_f32(f, n, scale, 1, 1, NULL, q, err) : one ? run_f32(f, n, scale, 1, 0, NULL, q, err)
                                                                : run_f32(f, n, scale, 0, 0, NULL, q, err);
}

/* the largest of a vector's 8 uint32 lanes */
AVX2_INLINE uint32_t hmax8(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* quantize elements [i, n) of a run from src + at with scale into q one by one; returns the max of *worst and
 * their errors' bit patterns */
static inline uint32_t run_tail(const void *restrict src, int bf16, int64_t at, int64_t i, int64_t n, float scale,
                                uint8_t *restrict q, uint32_t worst) {
    for (; i < n; i++) {
        uint32_t u = bf16 ? (uint32_t)((const uint16_t *)src)[at + i] << 16 : ((const uint32_t *)src)[at + i];
        uint32_t e = quantize_one(u, scale, q + i);
        worst = e > worst ? e : worst;
    }
    return worst;
}

/* max of |w|'s bit patterns over n elements (amax_bits), 16 (bfloat16) or 8 (float32) lanes at a time */
AVX2 static uint32_t amax_bits_avx2(const void *src, int bf16, int64_t at, int64_t n) {
    int64_t i = 0;
    uint32_t m;
    if (bf16) {
        const uint16_t *p = (const uint16_t *)src + at;
        __m256i acc = _mm256_setzero_si256(), mask = _mm256_set1_epi16(0x7FFF);
        for (; i + 16 <= n; i += 16)
            acc = _mm256_max_epu16(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), mask));
        /* the uint16 lanes' max: of each uint32 lane's upper and lower halves */
        m = hmax8(_mm256_max_epu32(_mm256_srli_epi32(acc, 16), _mm256_and_si256(acc, _mm256_set1_epi32(0xFFFF)))) << 16;
    } else {
        const uint32_t *p = (const uint32_t *)src + at;
        __m256i acc = _mm256_setzero_si256(), mask = _mm256_set1_epi32(0x7FFFFFFF);
        for (; i + 8 <= n; i += 8)
            acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), mask));
        m = hmax8(acc);
    }
    uint32_t tail = amax_bits(src, bf16, at + i, n - i);
    return tail > m ? tail : m;
}

/* max |w| per column of a band into colmax, one instance per element width (bit patterns: uint16 for
 * bfloat16, uint32 for float32; LANES of them per vector, ABS the mask that clears the sign bit) */
#define COLUMN_AMAX_AVX2(NAME, T, LANES, ABS, SET1, MAX)                                                    \
    AVX2 static void NAME(const T *restrict src, int64_t rows, int64_t cols, T *restrict cm) {              \
        memset(cm, 0, (size_t)cols * sizeof(T));                                                            \
        const __m256i mask = SET1(ABS);                                                                     \
        int64_t r = 0;                                                                                      \
        for (; r + 4 <= rows; r += 4) { /* four rows a step: a quarter of the loads and stores of cm */      \
            const T *p = src + r * cols;                                                                    \
            int64_t c = 0;                                                                                  \
            for (; c + LANES <= cols; c += LANES) {                                                         \
                __m256i a = MAX(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + c)), mask),       \
                                _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + cols + c)), mask));\
                __m256i b = MAX(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 2 * cols + c)), mask), \
                                _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 3 * cols + c)), mask)); \
                __m256i *d = (__m256i *)(cm + c);                                                           \
                _mm256_storeu_si256(d, MAX(_mm256_loadu_si256(d), MAX(a, b)));                              \
            }                                                                                               \
            for (; c < cols; c++)                                                                           \
                for (int k = 0; k < 4; k++) {                                                               \
                    T a = p[k * cols + c] & ABS;                                                            \
                    cm[c] = a > cm[c] ? a : cm[c];                                                          \
                }                                                                                           \
        }                                                                                                   \
        for (; r < rows; r++) {                                                                             \
            const T *p = src + r * cols;                                                                    \
            int64_t c = 0;                                                                                  \
            for (; c + LANES <= cols; c += LANES) {                                                         \
                __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + c)), mask);           \
                __m256i *d = (__m256i *)(cm + c);                                                           \
                _mm256_storeu_si256(d, MAX(_mm256_loadu_si256(d), a));                                      \
            }                                                                                               \
            for (; c < cols; c++) {                                                                         \
                T a = p[c] & ABS;                                                                           \
                cm[c] = a > cm[c] ? a : cm[c];                                                              \
            }                                                                                               \
        }                                                                                                   \
    }
COLUMN_AMAX_AVX2(column_amax_bf16_avx2, uint16_t, 16, 0x7FFF, _mm256_set1_epi16, _mm256_max_epu16)
COLUMN_AMAX_AVX2(column_amax_f32_avx2, uint32_t, 8, 0x7FFFFFFF, _mm256_set1_epi32, _mm256_max_epu32)
#undef COLUMN_AMAX_AVX2

/* The band on AVX2 (the figures of one_band): per channel row by row; per block the amax per column in
 * one pass over the rows, then row by row each block's run, its error maxima per lane. Returns 0 when its
 * per-column / per-block arrays cannot be allocated (the caller runs the scalar code). */
AVX2 static int band_avx2(const void *restrict src, int bf16, int64_t rows, int64_t cols, int64_t block,
                          uint8_t *restrict q, float *restrict scale, float *restrict amax, float *worst, float *rel) {
    if (block <= 0) {
        for (int64_t r = 0; r < rows; r++) {
            float m = float_of(amax_bits_avx2(src, bf16, r * cols, cols));
            float s = scale_of(m);
            __m256i acc = _mm256_setzero_si256();
            fast_t f;
            int64_t i = run_avx2(src, bf16, r * cols, cols, s, fast_of(s, bf16, &f), q + r * cols, &acc);
            amax[r] = m;
            scale[r] = s;
            account(m, float_of(run_tail(src, bf16, r * cols, i, cols, s, q + r * cols, hmax8(acc))), worst, rel);
        }
        return 1;
    }
    int64_t nb = (cols + block - 1) / block;
    void *colmax = malloc((size_t)cols * 4);
    __m256i *errs = aligned_alloc(32, (size_t)nb * 32);
    uint32_t *tails = calloc((size_t)nb, 4);
    fast_t *fast = aligned_alloc(32, (size_t)nb * sizeof(fast_t));
    const fast_t **fp = malloc((size_t)nb * sizeof(fast_t *));
    if (colmax == NULL || errs == NULL || tails == NULL || fast == NULL || fp == NULL) {
        free(colmax);
        free(errs);
        free(tails);
        free(fast);
        free(fp);
        return 0;
    }
    if (bf16)
        column_amax_bf16_avx2(src, rows, cols, colmax);
    else
        column_amax_f32_avx2(src, rows, cols, colmax);
    for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block, j++) {
        int64_t n = cols - c0 < block ? cols - c0 : block;
        amax[j] = float_of(bf16 ? amax_bits(colmax, 1, c0, n) : max_u32((const uint32_t *)colmax + c0, n));
        scale[j] = scale_of(amax[j]);
        errs[j] = _mm256_setzero_si256();
        fp[j] = fast_of(scale[j], bf16, fast + j);
    }
    int uniform = 1; /* every block division-free with scale < 256: run_bf16 / run_f32 inlined here, one instance */
    for (int64_t j = 0; j < nb; j++) uniform &= fp[j] != NULL && scale[j] < 256.0f;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block, j++) {
            int64_t n = cols - c0 < block ? cols - c0 : block, at = r * cols + c0, i;
            if (uniform)
                i = bf16 ? run_bf16((const uint16_t *)src + at, n, scale[j], 1, 0, fp[j], q + at, &errs[j])
                         : run_f32((const uint32_t *)src + at, n, scale[j], 1, 0, fp[j], q + at, &errs[j]);
            else
                i = run_avx2(src, bf16, at, n, scale[j], fp[j], q + at, &errs[j]);
            tails[j] = run_tail(src, bf16, at, i, n, scale[j], q + at, tails[j]);
        }
    }
    for (int64_t j = 0; j < nb; j++) {
        uint32_t e = hmax8(errs[j]);
        account(amax[j], float_of(e > tails[j] ? e : tails[j]), worst, rel);
    }
    free(colmax);
    free(errs);
    free(tails);
    free(fast);
    free(fp);
    return 1;
}
#endif

/* One band (ckpt_fp8_bands): figures[0..1] = max |q * scale - w|, the largest per-block (row) err / amax. */
CKPT_CLONES
static void one_band(const void *restrict src, int bf16, int64_t rows, int64_t cols, int64_t block, uint8_t *restrict q,
                     float *restrict scale, float *restrict amax, double *restrict figures) {
    float worst = 0.0f, rel = 0.0f;
#ifdef CKPT_X86
    if (ckpt_have_avx2() && band_avx2(src, bf16, rows, cols, block, q, scale, amax, &worst, &rel)) {
        figures[0] = worst;
        figures[1] = rel;
        return;
    }
#endif
    if (block <= 0) {
        for (int64_t r = 0; r < rows; r++) {
            float m = float_of(amax_bits(src, bf16, r * cols, cols));
            float s = scale_of(m);
            float err = quantize_run(src, bf16, r * cols, cols, s, q + r * cols);
            amax[r] = m;
            scale[r] = s;
            account(m, err, &worst, &rel);
        }
    } else if (!block_by_columns(src, bf16, rows, cols, block, q, scale, amax, &worst, &rel)) {
        for (int64_t c0 = 0, j = 0; c0 < cols; c0 += block, j++) {
            int64_t n = cols - c0 < block ? cols - c0 : block;
            uint32_t mb = 0;
            for (int64_t r = 0; r < rows; r++) {
                uint32_t a = amax_bits(src, bf16, r * cols + c0, n);
                mb = a > mb ? a : mb;
            }
            float m = float_of(mb);
            float s = scale_of(m);
            float err = 0.0f;
            for (int64_t r = 0; r < rows; r++) {
                float e = quantize_run(src, bf16, r * cols + c0, n, s, q + r * cols + c0);
                err = e > err ? e : err;
            }
            amax[j] = m;
            scale[j] = s;
            account(m, err, &worst, &rel);
        }
    }
    figures[0] = worst;
    figures[1] = rel;
}

/* Quantize consecutive bands of rows to float8_e4m3fn and measure each band's dequantization error.
 *
 * src: [rows, cols] C-contiguous, float32 (bf16 = 0) or bfloat16 bits (bf16 = 1); read only.
 * band_rows: rows per band (> 0): bands [k * band_rows, min(rows, (k + 1) * band_rows)), nb = ceil(rows / band_rows).
 * block: B of B x B blocks (band_rows <= B: one scale per column block of a band, ceil(cols / B) of them), or
 *     0 for one scale per row (compressed-tensors "channel").
 * q: [rows, cols] e4m3fn bytes out; scale, amax: float32 out, per band in order: [nb * ceil(cols / B)] or [rows].
 * figures: [nb, 2] out: per band max |q * scale - w|, and its largest per-block (row) err / amax.
 */
void ckpt_fp8_bands(const void *restrict src, int32_t bf16, int64_t rows, int64_t cols, int64_t block,
                    int64_t band_rows, uint8_t *restrict q, float *restrict scale, float *restrict amax,
                    double *restrict figures) {
    int64_t item = bf16 ? 2 : 4, per = block > 0 ? (cols + block - 1) / block : 0;
    for (int64_t r0 = 0, k = 0; r0 < rows; r0 += band_rows, k++) {
        int64_t n = rows - r0 < band_rows ? rows - r0 : band_rows, at = block > 0 ? k * per : r0;
        one_band((const char *)src + r0 * cols * item, bf16, n, cols, block, q + r0 * cols, scale + at, amax + at,
                 figures + 2 * k);
    }
}
