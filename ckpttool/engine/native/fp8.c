/* FP8 (float8_e4m3fn) quantization of one band of rows, checked as it goes (export --quantize).
 *
 * ckpt_fp8_band computes, for a band of [rows, cols] float32 or bfloat16 values, what the numpy
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
 * so each clone below gives the same bits. The caller refuses a band whose scale is non-finite
 * or zero for a non-zero block before it uses q or the error figures.
 */
/* no FP exception flags are read: lets the loops below be if-converted and vectorized (values unchanged) */
#pragma GCC optimize("no-trapping-math")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"


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

/* Quantize one band of rows to float8_e4m3fn and measure its dequantization error.
 *
 * src: [rows, cols] C-contiguous, float32 (bf16 = 0) or bfloat16 bits (bf16 = 1); read only.
 * block: B of B x B blocks (rows <= B: one scale per column block, ceil(cols / B) of them), or 0 for
 *     one scale per row (compressed-tensors "channel").
 * q: [rows, cols] e4m3fn bytes out; scale, amax: float32 [ceil(cols / B)] or [rows] out.
 * figures: [2] out: max |q * scale - w| over the band, and the largest per-block (row) err / amax.
 */
CKPT_CLONES
void ckpt_fp8_band(const void *restrict src, int32_t bf16, int64_t rows, int64_t cols, int64_t block, uint8_t *restrict q,
                   float *restrict scale, float *restrict amax, double *restrict figures) {
    float worst = 0.0f, rel = 0.0f;
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
