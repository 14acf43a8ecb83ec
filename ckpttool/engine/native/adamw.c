/* One-pass FP32-master AdamW step of a chunk (ckpttool/optim_state/adamw.py, fused=True on the CPU).
 *
 * Reads the gradient (FP32, BF16 or FP16), the FP32 master and the moments (FP32 or BF16) once,
 * writes master, moments and the parameter (BF16, FP16 or FP32 rounded from the new master) in
 * the same pass. The arithmetic is torch's fused CPU AdamW step (ATen/native/cpu/FusedAdamKernel.cpp,
 * adam_math for float, ADAMW mode, as built for the AVX2 capability) operation for operation,
 * so the master and moments are bitwise those of torch._fused_adamw_ on the same chunk:
 *   - elements [0, n - n % 8) (torch's 8-wide vector loop):
 *       master *= dec (when weight decay is on)
 *       m = fma(coeff, g - m, base)     coeff = w, base = m when |w| < 0.5, else w - 1 and g
 *       v = v * beta2 + (c2 * g) * g
 *       master = master + (-step_size * m) / (sqrt(v) / bc2s + eps)
 *   - the last n % 8 elements (its scalar tail): m = m + w * (g - m) (or g - (g - m) * (1 - w)),
 *     the rest as above;
 * the constants are the float32 roundings of torch's double ones (see adamw.py). The one explicit
 * fused multiply-add is fmaf (exact, so the AVX2 and the portable versions agree); the file is
 * compiled with -ffp-contract=off, so nothing else contracts. The parameter is the new master
 * rounded to nearest even; a NaN master gives BF16 0x7FC0 (torch's scalar conversion; its vector
 * conversion writes 0xFFFF) or FP16's quiet NaN with the payload truncated (F16C's vcvtps2ph).
 */
#include <math.h>
#include <stdint.h>

#include "half.h"
#ifdef CKPT_X86
#include <immintrin.h>
#endif

enum { K_NONE = 0, K_F32 = 1, K_BF16 = 2, K_F16 = 3 };

/* constants of a step, float32 (k[] of ckpt_adamw_step) */
typedef struct {
    float dec, w, beta2, c2, bc2s, eps, neg_step, coeff;
    int decay, small;
} Hyper;

static inline uint16_t f32_bf16(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float16 -> float32, exact (subnormals, infinities, NaN payloads) */
static inline float f16_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        u = sign | ((uint32_t)e << 23) | ((mant & 0x3FFu) << 13);
    }
    return float_of(u);
}

static inline float load_kind(const void *p, int kind, int64_t i) {
    if (kind == K_F32) return ((const float *)p)[i];
    if (kind == K_BF16) return bf16_float(((const uint16_t *)p)[i]);
    return f16_f32(((const uint16_t *)p)[i]);
}

static inline void store_kind(void *p, int kind, int64_t i, float x) {
    if (kind == K_F32)
        ((float *)p)[i] = x;
    else if (kind == K_BF16)
        ((uint16_t *)p)[i] = f32_bf16(x);
    else if (kind == K_F16)
        ((uint16_t *)p)[i] = f32_f16_quiet(bits_of(x));
}

/* elements [a, b) one at a time; vec: torch's vector-loop arithmetic, else its scalar tail's */
static void step_scalar(float *master, const void *grad, int gk, void *m_, void *v_, int mk, void *param, int pk,
                        int64_t a, int64_t b, const Hyper *h, int vec) {
    for (int64_t i = a; i < b; i++) {
        float g = load_kind(grad, gk, i), p = master[i], m = load_kind(m_, mk, i), v = load_kind(v_, mk, i);
        if (h->decay) p = p * h->dec;
        if (vec) {
            m = fmaf(h->coeff, g - m, h->small ? m : g);
            v = fmaf(h->c2 * g, g, v * h->beta2);
        } else {
            m = h->small ? fmaf(h->w, g - m, m) : fmaf(-(g - m), 1.0f - h->w, g);
            v = fmaf(v, h->beta2, h->c2 * g * g);
        }
        float denom = sqrtf(v) / h->bc2s + h->eps;
        p = p + h->neg_step * m / denom;
        master[i] = p;
        store_kind(m_, mk, i, m);
        store_kind(v_, mk, i, v);
        store_kind(param, pk, i, p);
    }
}

#ifdef CKPT_X86
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const void *p, int kind, int64_t i) {
    if (kind == K_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (kind == K_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* 8 floats -> 8 bfloat16, nearest even, NaN -> 0x7FC0 (as f32_bf16) */
__attribute__((target("avx2,fma,f16c"))) static inline __m128i to_bf16x8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

__attribute__((target("avx2,fma,f16c"))) static inline void store8(void *p, int kind, int64_t i, __m256 x) {
    if (kind == K_F32)
        _mm256_storeu_ps((float *)p + i, x);
    else if (kind == K_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16x8(x));
    else if (kind == K_F16)
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("avx2,fma,f16c"))) static void step_avx2(float *master, const void *grad, int gk, void *m_,
                                                                void *v_, int mk, void *param, int pk, int64_t n,
                                                                const Hyper *h) {
    const __m256 dec = _mm256_set1_ps(h->dec), coeff = _mm256_set1_ps(h->coeff), beta2 = _mm256_set1_ps(h->beta2);
    const __m256 c2 = _mm256_set1_ps(h->c2), bc2s = _mm256_set1_ps(h->bc2s), eps = _mm256_set1_ps(h->eps);
    const __m256 neg_step = _mm256_set1_ps(h->neg_step);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 g = load8(grad, gk, i), p = _mm256_loadu_ps(master + i);
        __m256 m = load8(m_, mk, i), v = load8(v_, mk, i);
        if (h->decay) p = _mm256_mul_ps(p, dec);
        m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), h->small ? m : g);
        v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, beta2));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2s), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
        _mm256_storeu_ps(master + i, p);
        store8(m_, mk, i, m);
        store8(v_, mk, i, v);
        store8(param, pk, i, p);
    }
}

#endif

/* One AdamW step of a chunk of n elements, in place; see the file comment.
 *   master: float32[n]; grad: [n] of grad_kind (1 f32, 2 bf16, 3 f16);
 *   exp_avg, exp_avg_sq: [n] of moment_kind (1 f32, 2 bf16);
 *   param: [n] of param_kind (0: none, 1 f32, 2 bf16, 3 f16), receives the new master rounded;
 *   k: float32[9] = {1 - lr*wd, 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^step), eps,
 *                    -lr / (1 - beta1^step), weight decay on (0/1), force portable code (0/1)}.
 * Returns 0, or -1 for a kind out of range. */
int32_t ckpt_adamw_step(float *master, const void *grad, int32_t grad_kind, void *exp_avg, void *exp_avg_sq,
                        int32_t moment_kind, void *param, int32_t param_kind, int64_t n, const float *k) {
    if (grad_kind < K_F32 || grad_kind > K_F16 || moment_kind < K_F32 || moment_kind > K_BF16 ||
        param_kind < K_NONE || param_kind > K_F16)
        return -1;
    Hyper h = {k[0], k[1], k[2], k[3], k[4], k[5], k[6], 0.0f, k[7] != 0.0f, 0};
    h.small = fabsf(h.w) < 0.5f;
    h.coeff = h.small ? h.w : h.w - 1.0f;
    int64_t nv = n - n % 8;
#ifdef CKPT_X86
    if (k[8] == 0.0f && ckpt_have_avx2()) {
        step_avx2(master, grad, grad_kind, exp_avg, exp_avg_sq, moment_kind, param, param_kind, nv, &h);
    } else
#endif
        step_scalar(master, grad, grad_kind, exp_avg, exp_avg_sq, moment_kind, param, param_kind, 0, nv, &h, 1);
    step_scalar(master, grad, grad_kind, exp_avg, exp_avg_sq, moment_kind, param, param_kind, nv, n, &h, 0);
    return 0;
}
