/* The statistics slab kernels of the byte engine (ckpttool/engine/stats.py calls them through ctypes).
 *
 * ckpt_stats_slab: one pass over a slab of IEEE bit patterns (bfloat16, float16, float32, float64)
 * computing what the numpy kernel (engine/stats.py add_slab) computes: the non-finite count, the
 * largest finite |x|, whether every value is +-0, the +-0 count, the finite values' sum and sum of
 * squares; then, only where that pass shows them present, the exact counts of negative values (and
 * the smallest), of finite values beyond a bound (and the largest) and of subnormals (the numpy
 * kernel's rule: counted only when every SUBNORMAL_STRIDE-th value from the slab's start shows one).
 * Counts and maxima equal the numpy kernel's exactly. Sums: each value (float32 for bfloat16, float16
 * and float32 slabs: exact) and its square in float64 (exact for a float32 value: no overflow beyond
 * FLT_MAX, no underflow below sqrt(FLT_MIN), no rounding; float64 slabs: rounded in float64), both
 * added in float64 over LANES independent accumulators, combined in a fixed order: the same result on
 * every clone.
 *
 * ckpt_adam_update: the AdamW update size over an exp_avg / exp_avg_sq slab pair, as engine/stats.py
 * adam_update: u = m / (sqrt(max(v, 0)) + eps_r) in the working precision (float32 unless one of
 * them is float64), non-finite m, v read as 0, non-finite u left out; its count, sum of squares
 * (each square in float64, float64 lanes) and largest |u|. Float32 pairs run an AVX-512 body on an AMD CPU that
 * has it (+20-25% values/s on Zen 4, whose AVX-512 divides and square roots outrun two AVX2 ones; the folds
 * gained nothing there: their float64 lane chains bound them, so they keep their AVX2 bodies).
 *
 * ckpt_moment_ratio: max over the slab pair of m * m / v (m * m in m's working precision, divided
 * in the wider one), NaN ignored, -inf when none: validate --deep's moments check.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#define LANES 16
#define BLOCK ((size_t)1 << 24) /* values per main pass (AVX2 lane counters: 32 bits) */

static int has_avx2(void);
static int has_avx512(void);


#include "stats.h"

/* float16 -> float32, exact for every finite pattern (subnormals included): the 15 value bits moved
 * to float32's position and rescaled by 2^112; the sign carried through the multiply. */
static inline float f16_value(uint16_t h) {
    uint32_t u = ((uint32_t)(h & 0x8000u) << 16) | ((uint32_t)(h & 0x7fffu) << 13);
    return float_of(u) * 0x1p112f;
}

/* float16 -> float32 for every pattern (infinities and NaN too). */
static inline float f16_full(uint16_t h) {
    if ((h & 0x7c00u) == 0x7c00u) return (h & 0x3ffu) ? NAN : ((h & 0x8000u) ? -INFINITY : INFINITY);
    return f16_value(h);
}

static const uint64_t SIGN[4] = {0x8000u, 0x8000u, 0x80000000u, 0x8000000000000000ull};
static const uint64_t EXP_ALL[4] = {0x7f80u, 0x7c00u, 0x7f800000u, 0x7ff0000000000000ull};
static const int MANTISSA[4] = {7, 10, 23, 52};
#define EXP_ALL_OF(dt) EXP_ALL[dt]

/* The main pass over a block of at most BLOCK values: finite max magnitude pattern, max pattern, non-finite
 * and +-0 counts, and (sums) the finite values and their squares added into the LANES float64 lanes
 * a1, a2 (value i + j of each group of LANES into lane j; the block's tail into lane 0). The AVX2 and the
 * scalar versions put the same values into the same lanes: their sums are identical. */
typedef struct {
    uint64_t fmax, umax;
    int64_t nonfinite, zeros;
} pass_out;

static inline float decode_f(uint32_t pat, int dt) {
    if (dt == DT_BF16) return bf16_float((uint16_t)pat);
    if (dt == DT_F16) return f16_value((uint16_t)pat);
    return float_of(pat);
}

static void pass32_scalar(const void *p, int dt, size_t n, int sums, double *a1, double *a2, pass_out *o) {
    uint32_t magmask = dt == DT_F32 ? 0x7fffffffu : 0x7fffu, exp_all = (uint32_t)EXP_ALL_OF(dt);
    uint32_t fm = 0, um = 0;
    int64_t nf = 0, zc = 0;
    size_t groups = n - n % LANES;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = dt == DT_F32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i], mag = u & magmask;
        int fin = mag < exp_all;
        if (fin && mag > fm) fm = mag;
        if (u > um) um = u;
        nf += !fin;
        zc += mag == 0;
        if (sums) {
            double x = fin ? (double)decode_f(u, dt) : 0.0;
            int j = i < groups ? (int)(i % LANES) : 0;
            a1[j] += x;
            a2[j] += x * x; /* exact: a float32 value's square fits float64's significand and range */
        }
    }
    o->fmax = fm, o->umax = um, o->nonfinite = nf, o->zeros = zc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

/* 8 values as 32-bit patterns (bfloat16/float16 zero-extended), their magnitudes and finite mask, and the
 * float32 values (non-finite as 0). */
__attribute__((target("avx2"), always_inline)) static inline __m256 lanes8(const void *p, int dt, size_t i, __m256i *pat,
                                                            __m256i *mag, __m256i *fin) {
    if (dt == DT_F32) {
        *pat = _mm256_loadu_si256((const __m256i *)((const uint32_t *)p + i));
        *mag = _mm256_and_si256(*pat, _mm256_set1_epi32(0x7fffffff));
        *fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), *mag);
        return _mm256_castsi256_ps(_mm256_and_si256(*pat, *fin));
    }
    *pat = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    *mag = _mm256_and_si256(*pat, _mm256_set1_epi32(0x7fff));
    if (dt == DT_BF16) {
        *fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f80), *mag);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(*pat, *fin), 16));
    }
    *fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7c00), *mag);
    __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(*pat, _mm256_set1_epi32(0x8000)), 16),
                                   _mm256_slli_epi32(*mag, 13));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(bits, *fin)), _mm256_set1_ps(0x1p112f));
}

/* fast: the values are taken as they are, not masked to their finite ones, and the finite count is not kept (FP32
 * and BF16 only, whose infinities and NaN stay non-finite as float32 values): the caller checks that every lane
 * stayed finite (then no value was non-finite: an infinity or NaN makes its lane's sum of squares non-finite) and
 * runs the block again without fast where one did not. */
__attribute__((target("avx2"), always_inline)) static inline void pass32_body(const void *p, const int dt, size_t n,
                                                                             const int sums, const int neg,
                                                                             const int fast, double *a1, double *a2,
                                                                             pass_out *o) {
    __m256i fm = _mm256_setzero_si256(), um = fm, cfin = fm, cz = fm, zero = fm;
    __m256d s1[4], s2[4];
    for (int k = 0; k < 4; k++) s1[k] = _mm256_loadu_pd(a1 + 4 * k), s2[k] = _mm256_loadu_pd(a2 + 4 * k);
    size_t groups = n - n % LANES;
    for (size_t i = 0; i < groups; i += LANES) {
        for (int h = 0; h < 2; h++) {
            __m256i pat, mag, fin;
            __m256 x;
            if (fast && dt == DT_F32) {
                pat = _mm256_loadu_si256((const __m256i *)((const uint32_t *)p + i + 8 * h));
                mag = _mm256_and_si256(pat, _mm256_set1_epi32(0x7fffffff));
                x = _mm256_castsi256_ps(pat);
            } else if (fast) {
                pat = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i + 8 * h)));
                mag = _mm256_and_si256(pat, _mm256_set1_epi32(0x7fff));
                x = _mm256_castsi256_ps(_mm256_slli_epi32(pat, 16));
            } else {
                x = lanes8(p, dt, i + 8 * h, &pat, &mag, &fin);
                cfin = _mm256_sub_epi32(cfin, fin);
            }
            fm = _mm256_max_epu32(fm, mag); /* non-finite included: redone below where the block has one */
            if (neg) um = _mm256_max_epu32(um, pat);
            cz = _mm256_sub_epi32(cz, _mm256_cmpeq_epi32(mag, zero));
            if (sums) { /* each value widened to float64 and squared there (exact), as the scalar code */
                __m256d lo, hi;
                if (fast && dt == DT_F32) { /* the halves loaded as xmm registers: no lane extraction (-15%) */
                    lo = _mm256_cvtps_pd(_mm_loadu_ps((const float *)p + i + 8 * h));
                    hi = _mm256_cvtps_pd(_mm_loadu_ps((const float *)p + i + 8 * h + 4));
                } else {
                    lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
                    hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
                }
                s1[2 * h] = _mm256_add_pd(s1[2 * h], lo);
                s1[2 * h + 1] = _mm256_add_pd(s1[2 * h + 1], hi);
                s2[2 * h] = _mm256_add_pd(s2[2 * h], _mm256_mul_pd(lo, lo));
                s2[2 * h + 1] = _mm256_add_pd(s2[2 * h + 1], _mm256_mul_pd(hi, hi));
            }
        }
    }
    for (int k = 0; k < 4; k++) _mm256_storeu_pd(a1 + 4 * k, s1[k]), _mm256_storeu_pd(a2 + 4 * k, s2[k]);
    uint32_t f[8], m[8], c[8], z[8];
    _mm256_storeu_si256((__m256i *)f, fm), _mm256_storeu_si256((__m256i *)m, um);
    _mm256_storeu_si256((__m256i *)c, cfin), _mm256_storeu_si256((__m256i *)z, cz);
    pass_out tail;
    pass32_scalar((const char *)p + groups * (dt == DT_F32 ? 4 : 2), dt, n - groups, sums, a1, a2, &tail);
    uint64_t fmax = tail.fmax, umax = tail.umax;
    int64_t finite = 0, zeros = tail.zeros;
    for (int k = 0; k < 8; k++) {
        fmax = f[k] > fmax ? f[k] : fmax;
        umax = m[k] > umax ? m[k] : umax;
        finite += c[k];
        zeros += z[k];
    }
    if (fast) finite = (int64_t)groups; /* checked by the caller */
    if ((int64_t)groups != finite) { /* a non-finite value in the groups: their largest finite magnitude exactly */
        pass_out again;
        pass32_scalar(p, dt, groups, 0, a1, a2, &again);
        fmax = again.fmax > tail.fmax ? again.fmax : tail.fmax;
    }
    o->fmax = fmax, o->umax = umax, o->nonfinite = (int64_t)groups - finite + tail.nonfinite, o->zeros = zeros;
}

/* pass32_body specialised for each format, sums on or off, the largest pattern (neg) kept or not (constants: no
 * branch in the loop). */
#define PASS32_SUMS_NEG(DT)                                                                                             \
    (sums ? (neg ? pass32_body(p, DT, n, 1, 1, 0, a1, a2, o) : pass32_body(p, DT, n, 1, 0, 0, a1, a2, o))               \
          : (neg ? pass32_body(p, DT, n, 0, 1, 0, a1, a2, o) : pass32_body(p, DT, n, 0, 0, 0, a1, a2, o)))
#define PASS32_FAST(DT)                                                                                                 \
    (neg ? pass32_body(p, DT, n, 1, 1, 1, a1, a2, o) : pass32_body(p, DT, n, 1, 0, 1, a1, a2, o))

/* Whether every lane of the sums is finite. */
static int lanes_finite(const double *a1, const double *a2) {
    int ok = 1;
    for (int j = 0; j < LANES; j++) ok &= isfinite(a1[j]) && isfinite(a2[j]);
    return ok;
}

__attribute__((target("avx2"))) static void pass32_avx2(const void *p, int dt, size_t n, int sums, int neg,
                                                        double *a1, double *a2, pass_out *o) {
    if (sums && (dt == DT_F32 || dt == DT_BF16) && lanes_finite(a1, a2)) { /* the fast pass, checked */
        double b1[LANES], b2[LANES];
        memcpy(b1, a1, sizeof b1), memcpy(b2, a2, sizeof b2);
        if (dt == DT_F32)
            PASS32_FAST(DT_F32);
        else
            PASS32_FAST(DT_BF16);
        if (lanes_finite(a1, a2)) return;
        memcpy(a1, b1, sizeof b1), memcpy(a2, b2, sizeof b2); /* a non-finite value */
    }
    if (dt == DT_F32)
        PASS32_SUMS_NEG(DT_F32);
    else if (dt == DT_BF16)
        PASS32_SUMS_NEG(DT_BF16);
    else
        PASS32_SUMS_NEG(DT_F16);
}

#define AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2"
#endif

CKPT_CLONES static void pass64(const uint64_t *p, size_t n, int sums,
                                                                      double *a1, double *a2, pass_out *o) {
    const uint64_t EXP = 0x7ff0000000000000ull, MAG = 0x7fffffffffffffffull;
    uint64_t fm = 0, um = 0;
    int64_t nf = 0, zc = 0;
    for (size_t i = 0; i < n; i++) { /* integer reductions: vectorised by the compiler */
        uint64_t u = p[i], mag = u & MAG;
        uint64_t fmag = mag < EXP ? mag : 0;
        fm = fmag > fm ? fmag : fm;
        um = u > um ? u : um;
        nf += mag >= EXP;
        zc += mag == 0;
    }
    size_t groups = n - n % LANES;
    if (sums) {
        for (size_t i = 0; i < groups; i += LANES) { /* independent lanes: no reassociation needed */
            for (int j = 0; j < LANES; j++) {
                uint64_t u = p[i + j];
                double x = (u & MAG) < EXP ? double_of(u) : 0.0;
                a1[j] += x;
                a2[j] += x * x;
            }
        }
        for (size_t i = groups; i < n; i++) {
            uint64_t u = p[i];
            double x = (u & MAG) < EXP ? double_of(u) : 0.0;
            a1[0] += x;
            a2[0] += x * x;
        }
    }
    o->fmax = fm, o->umax = um, o->nonfinite = nf, o->zeros = zc;
}

/* The main pass; neg: the largest pattern (o->umax) is wanted (else it may be left 0). */
static void pass(const void *p, int dt, size_t n, int sums, int neg, double *a1, double *a2, pass_out *o) {
    if (dt == DT_F64) {
        pass64(p, n, sums, a1, a2, o);
        return;
    }
#ifdef HAVE_AVX2_PATH
    if (has_avx2()) {
        pass32_avx2(p, dt, n, sums, neg, a1, a2, o);
        return;
    }
#endif
    pass32_scalar(p, dt, n, sums, a1, a2, o);
}

/* The value of element i of a slab (finite or not). */
static inline double value_at(const void *p, int dt, size_t i) {
    switch (dt) {
    case DT_BF16: return bf16_float(((const uint16_t *)p)[i]);
    case DT_F16: return f16_full(((const uint16_t *)p)[i]);
    case DT_F32: return float_of(((const uint32_t *)p)[i]);
    default: return double_of(((const uint64_t *)p)[i]);
    }
}

static inline uint64_t pattern_at(const void *p, int dt, size_t i) {
    switch (dt) {
    case DT_BF16:
    case DT_F16: return ((const uint16_t *)p)[i];
    case DT_F32: return ((const uint32_t *)p)[i];
    default: return ((const uint64_t *)p)[i];
    }
}


/* The rare passes: negative values, values beyond the bound pattern `limit`, subnormals. */
static void negatives(ckpt_slab_stats *acc, const void *p, int dt, size_t n) {
    uint64_t sign = SIGN[dt], exp_all = EXP_ALL[dt];
    int64_t k = 0;
    double lo = 0.0;
    for (size_t i = 0; i < n; i++) {
        uint64_t u = pattern_at(p, dt, i), mag = u & (sign - 1);
        if ((u & sign) && mag && mag <= exp_all) { /* -0.0 and NaN are not < 0; -inf is */
            double x = value_at(p, dt, i);
            lo = k == 0 || x < lo ? x : lo;
            k++;
        }
    }
    if (k) {
        acc->negative += k;
        acc->neg_min = acc->has_neg && acc->neg_min < lo ? acc->neg_min : lo;
        acc->has_neg = 1;
    }
}

static void beyond(ckpt_slab_stats *acc, const void *p, int dt, size_t n, uint64_t limit) {
    uint64_t sign = SIGN[dt], exp_all = EXP_ALL[dt], top = 0;
    int64_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t mag = pattern_at(p, dt, i) & (sign - 1);
        if (mag > limit && mag < exp_all) {
            k++;
            top = mag > top ? mag : top;
        }
    }
    if (k) {
        acc->beyond += k;
        double v = fabs(value_at(&top, dt, 0));
        acc->beyond_max = v > acc->beyond_max ? v : acc->beyond_max;
    }
}

static int is_subnormal(uint64_t u, int dt) {
    uint64_t mag = u & (SIGN[dt] - 1);
    return mag != 0 && mag < ((uint64_t)1 << MANTISSA[dt]);
}

static void subnormals(ckpt_slab_stats *acc, const void *p, int dt, size_t n, size_t stride) {
    int seen = 0;
    for (size_t i = 0; i < n && !seen; i += stride) seen = is_subnormal(pattern_at(p, dt, i), dt);
    if (!seen) return;
    int64_t k = 0;
    for (size_t i = 0; i < n; i++) k += is_subnormal(pattern_at(p, dt, i), dt);
    acc->subnormal += k;
}

/* The subnormal rule of ckpt_stats_slab alone (for a caller that folds a slab in pieces without it). */
void ckpt_stats_subnormals(ckpt_slab_stats *acc, const void *p, size_t n, int32_t dt, uint64_t stride) {
    if (dt >= 0 && dt <= 3 && stride) subnormals(acc, p, dt, n, (size_t)stride);
}

/* Fold n values of dtype dt at p into acc; need: NEED_* flags; limit: the bound's magnitude pattern
 * (NEED_BOUND); stride: the subnormal sample's stride (NEED_SUBNORMAL). Returns 0, -1 on a bad dtype. */
int32_t ckpt_stats_slab(ckpt_slab_stats *acc, const void *p, size_t n, int32_t dt, int32_t need, uint64_t limit,
                        uint64_t stride) {
    if (dt < 0 || dt > 3) return -1;
    acc->numel += (int64_t)n;
    if (n == 0) return 0;
    int sums = (need & NEED_SUMS) != 0;
    double a1[LANES] = {0}, a2[LANES] = {0};
    uint64_t fmax = 0, umax = 0;
    int64_t nonfinite = 0, zeros = 0;
    size_t item = dt == DT_F64 ? 8 : (dt == DT_F32 ? 4 : 2);
    for (size_t b = 0; b < n; b += BLOCK) { /* blocks: the AVX2 path's 32-bit lane counters never overflow */
        pass_out o;
        pass((const char *)p + b * item, dt, n - b < BLOCK ? n - b : BLOCK, sums, (need & NEED_NEGATIVE) != 0, a1, a2, &o);
        fmax = o.fmax > fmax ? o.fmax : fmax;
        umax = o.umax > umax ? o.umax : umax;
        nonfinite += o.nonfinite;
        zeros += o.zeros;
    }
    double s1 = 0.0, s2 = 0.0;
    for (int j = 0; j < LANES; j++) s1 += a1[j], s2 += a2[j];
    acc->nonfinite += nonfinite;
    if (fmax || nonfinite) acc->nonzero = 1;
    if (fmax) {
        double v = fabs(value_at(&fmax, dt, 0));
        acc->abs_max = v > acc->abs_max ? v : acc->abs_max;
    }
    if (need & NEED_ZEROS) acc->zeros += zeros;
    if ((need & NEED_NEGATIVE) && umax > SIGN[dt]) negatives(acc, p, dt, n);
    if ((need & NEED_BOUND) && fmax > limit) beyond(acc, p, dt, n, limit);
    if ((need & NEED_SUBNORMAL) && stride) subnormals(acc, p, dt, n, (size_t)stride);
    if (sums) {
        acc->s1 += s1;
        acc->s2 += s2;
    }
    return 0;
}

/* A moment's value as the numpy kernel hands it on: non-finite read as 0. */
static inline float value32(const void *p, int dt, size_t i) {
    if (dt == DT_F32) {
        uint32_t u = ((const uint32_t *)p)[i];
        return (u & 0x7fffffffu) < 0x7f800000u ? float_of(u) : 0.0f;
    }
    uint16_t h = ((const uint16_t *)p)[i];
    if (dt == DT_BF16) return (h & 0x7fffu) < 0x7f80u ? bf16_float(h) : 0.0f;
    return (h & 0x7fffu) < 0x7c00u ? f16_value(h) : 0.0f;
}

static inline double value64(const void *p, int dt, size_t i) {
    if (dt != DT_F64) return value32(p, dt, i);
    uint64_t u = ((const uint64_t *)p)[i];
    return (u & 0x7fffffffffffffffull) < 0x7ff0000000000000ull ? double_of(u) : 0.0;
}

static void update32_scalar(const void *m, int mdt, const void *v, int vdt, size_t n, float eps, int64_t *count,
                            double *a2, float *amax) {
    float top[LANES] = {0};
    int64_t k = 0;
    size_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        uint32_t c[LANES];
        for (int j = 0; j < LANES; j++) {
            float vv = value32(v, vdt, i + j);
            float d = sqrtf(vv > 0.0f ? vv : 0.0f) + eps;
            float u = value32(m, mdt, i + j) / d;
            float au = fabsf(u);
            int fin = au <= 3.40282347e38f; /* false for inf and NaN */
            double du = fin ? (double)u : 0.0;
            a2[j] += du * du; /* exact in float64, as the value sums */
            top[j] = fin && au > top[j] ? au : top[j];
            c[j] = (uint32_t)fin;
        }
        for (int j = 0; j < LANES; j++) k += c[j];
    }
    for (; i < n; i++) {
        float vv = value32(v, vdt, i);
        float d = sqrtf(vv > 0.0f ? vv : 0.0f) + eps;
        float u = value32(m, mdt, i) / d, au = fabsf(u);
        if (au <= 3.40282347e38f) {
            double du = u;
            a2[0] += du * du;
            top[0] = au > top[0] ? au : top[0];
            k++;
        }
    }
    float t = 0.0f;
    for (int j = 0; j < LANES; j++) t = top[j] > t ? top[j] : t;
    *count = k, *amax = t;
}

#ifdef HAVE_AVX2_PATH
/* update32_scalar's lanes with AVX2: the same value in the same lane, the same result. */
__attribute__((target("avx2"), always_inline)) static inline void update32_body(const void *m, const int mdt,
                                                                               const void *v, const int vdt,
                                                                               size_t n, float eps, int64_t *count,
                                                                               double *a2, float *amax) {
    const __m256 e = _mm256_set1_ps(eps), zero = _mm256_setzero_ps(), big = _mm256_set1_ps(3.40282347e38f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256d s[4];
    for (int k = 0; k < 4; k++) s[k] = _mm256_loadu_pd(a2 + 4 * k);
    __m256 top = zero;
    __m256i cnt = _mm256_setzero_si256();
    size_t groups = n - n % LANES;
    for (size_t i = 0; i < groups; i += LANES) {
        for (int h = 0; h < 2; h++) {
            __m256i pat, mag, fin;
            __m256 xm = lanes8(m, mdt, i + 8 * h, &pat, &mag, &fin);
            __m256 xv = lanes8(v, vdt, i + 8 * h, &pat, &mag, &fin);
            __m256 d = _mm256_add_ps(_mm256_sqrt_ps(_mm256_max_ps(xv, zero)), e);
            __m256 u = _mm256_div_ps(xm, d);
            __m256 au = _mm256_and_ps(u, absmask);
            __m256 ok = _mm256_cmp_ps(au, big, _CMP_LE_OQ); /* finite: false for inf and NaN */
            __m256 uf = _mm256_and_ps(u, ok); /* non-finite u as 0 */
            __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(uf)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(uf, 1));
            s[2 * h] = _mm256_add_pd(s[2 * h], _mm256_mul_pd(lo, lo));
            s[2 * h + 1] = _mm256_add_pd(s[2 * h + 1], _mm256_mul_pd(hi, hi));
            top = _mm256_max_ps(top, _mm256_and_ps(au, ok));
            cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(ok));
        }
    }
    for (int k = 0; k < 4; k++) _mm256_storeu_pd(a2 + 4 * k, s[k]);
    float t[8];
    uint32_t c[8];
    _mm256_storeu_ps(t, top), _mm256_storeu_si256((__m256i *)c, cnt);
    int64_t k = 0;
    float tail_max = 0.0f;
    size_t item_m = mdt == DT_F32 ? 4 : 2, item_v = vdt == DT_F32 ? 4 : 2;
    update32_scalar((const char *)m + groups * item_m, mdt, (const char *)v + groups * item_v, vdt, n - groups, eps,
                    &k, a2, &tail_max);
    for (int j = 0; j < 8; j++) {
        k += c[j];
        tail_max = t[j] > tail_max ? t[j] : tail_max;
    }
    *count = k, *amax = tail_max;
}

__attribute__((target("avx2"))) static void update32_avx2(const void *m, int mdt, const void *v, int vdt, size_t n,
                                                          float eps, int64_t *count, double *a2, float *amax) {
    if (mdt == DT_F32 && vdt == DT_F32)
        update32_body(m, DT_F32, v, DT_F32, n, eps, count, a2, amax);
    else if (mdt == DT_BF16 && vdt == DT_BF16)
        update32_body(m, DT_BF16, v, DT_BF16, n, eps, count, a2, amax);
    else
        update32_body(m, mdt, v, vdt, n, eps, count, a2, amax);
}

/* update32_body with AVX-512, float32 pairs: the same value in the same lane (s[0]: lanes 0-7, s[1]: 8-15), the
 * same float32 and float64 operations: the same result. */
__attribute__((target(AVX512_TARGET))) static void update32_avx512(const float *m, const float *v, size_t n, float eps,
                                                                   int64_t *count, double *a2, float *amax) {
    const __m512 e = _mm512_set1_ps(eps), zero = _mm512_setzero_ps(), big = _mm512_set1_ps(3.40282347e38f);
    __m512d s0 = _mm512_loadu_pd(a2), s1 = _mm512_loadu_pd(a2 + 8);
    __m512 top = zero;
    int64_t k = 0;
    size_t groups = n - n % LANES;
    for (size_t i = 0; i < groups; i += LANES) {
        __m512i pm = _mm512_loadu_si512((const void *)(m + i)), pv = _mm512_loadu_si512((const void *)(v + i));
        const __m512i mag = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
        __m512 xm = _mm512_castsi512_ps(_mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(_mm512_and_si512(pm, mag), inf), pm));
        __m512 xv = _mm512_castsi512_ps(_mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(_mm512_and_si512(pv, mag), inf), pv));
        __m512 d = _mm512_add_ps(_mm512_sqrt_ps(_mm512_max_ps(xv, zero)), e);
        __m512 u = _mm512_div_ps(xm, d);
        __m512 au = _mm512_abs_ps(u);
        __mmask16 ok = _mm512_cmp_ps_mask(au, big, _CMP_LE_OQ); /* finite: false for inf and NaN */
        __m512 uf = _mm512_maskz_mov_ps(ok, u);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(uf));
        __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(uf), 1)));
        s0 = _mm512_add_pd(s0, _mm512_mul_pd(lo, lo));
        s1 = _mm512_add_pd(s1, _mm512_mul_pd(hi, hi));
        top = _mm512_max_ps(top, _mm512_maskz_mov_ps(ok, au));
        k += __builtin_popcount((unsigned)ok);
    }
    _mm512_storeu_pd(a2, s0), _mm512_storeu_pd(a2 + 8, s1);
    float tail_max = 0.0f;
    int64_t kt = 0;
    update32_scalar(m + groups, DT_F32, v + groups, DT_F32, n - groups, eps, &kt, a2, &tail_max);
    float t = _mm512_reduce_max_ps(top);
    *count = k + kt, *amax = t > tail_max ? t : tail_max;
}
#endif

/* The widest instruction set the statistics kernels use: 2 AVX-512 (F, BW, DQ, VL) on an AMD CPU, 1 AVX2, 0 none;
 * capped by CKPTTOOL_NATIVE_ISA ("avx2" or "scalar": the narrower paths, which give the same results, for tests
 * and measurements). AVX-512 was measured faster on AMD Zen 4 only: Intel's cores divide and take square roots
 * of 16 floats at half the rate of 8 (no gain to expect), some at a lower clock, and none was measured. */
static int isa_level(void) {
    static int level = -1;
    if (level < 0) { /* a benign race: every thread computes the same value */
        int l = 0;
#ifdef HAVE_AVX2_PATH
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2")) l = 1;
        if (l && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_is("amd"))
            l = 2;
#endif
        const char *cap = getenv("CKPTTOOL_NATIVE_ISA");
        if (cap != NULL && strcmp(cap, "avx2") == 0) l = l < 1 ? l : 1;
        if (cap != NULL && strcmp(cap, "scalar") == 0) l = 0;
        level = l;
    }
    return level;
}

static int has_avx2(void) { return isa_level() >= 1; }
static int has_avx512(void) { return isa_level() >= 2; }

/* isa_level, for tests and the benchmarks. */
int32_t ckpt_stats_isa(void) { return isa_level(); }

/* blocks of BLOCK values: the AVX2 path's 32-bit lane counters never overflow */
static void update32(const void *m, int mdt, const void *v, int vdt, size_t n, float eps, int64_t *count,
                     double *s2, double *amax) {
    double a2[LANES] = {0};
    int64_t k = 0;
    float top = 0.0f;
    size_t im = mdt == DT_F32 ? 4 : 2, iv = vdt == DT_F32 ? 4 : 2;
    for (size_t b = 0; b < n; b += BLOCK) {
        size_t len = n - b < BLOCK ? n - b : BLOCK;
        int64_t kb;
        float tb;
        const void *mb = (const char *)m + b * im, *vb = (const char *)v + b * iv;
#ifdef HAVE_AVX2_PATH
        if (mdt == DT_F32 && vdt == DT_F32 && has_avx512())
            update32_avx512(mb, vb, len, eps, &kb, a2, &tb);
        else if (has_avx2())
            update32_avx2(mb, mdt, vb, vdt, len, eps, &kb, a2, &tb);
        else
#endif
            update32_scalar(mb, mdt, vb, vdt, len, eps, &kb, a2, &tb);
        k += kb;
        top = tb > top ? tb : top;
    }
    double t2 = 0.0;
    for (int j = 0; j < LANES; j++) t2 += a2[j];
    *count = k, *s2 = t2, *amax = top;
}

static void update64(const void *m, int mdt, const void *v, int vdt, size_t n, double eps, int64_t *count,
                     double *s2, double *amax) {
    double a2[LANES] = {0}, top = 0.0;
    int64_t k = 0;
    for (size_t i = 0; i < n; i++) {
        double vv = value64(v, vdt, i);
        double d = sqrt(vv > 0.0 ? vv : 0.0) + eps;
        double u = value64(m, mdt, i) / d, au = fabs(u);
        if (au <= 1.7976931348623157e308) {
            a2[i % LANES] += u * u;
            top = au > top ? au : top;
            k++;
        }
    }
    double t2 = 0.0;
    for (int j = 0; j < LANES; j++) t2 += a2[j];
    *count = k, *s2 = t2, *amax = top;
}

/* The AdamW update sizes u = m / (sqrt(max(v, 0)) + eps_r) of n values (eps_r: eps * sqrt(bias
 * correction 2), rounded to float32 in the float32 path). out: [count, sum of u^2, max |u|]. */
int32_t ckpt_adam_update(const void *m, int32_t mdt, const void *v, int32_t vdt, size_t n, double eps_r,
                         double *out) {
    if (mdt < 0 || mdt > 3 || vdt < 0 || vdt > 3) return -1;
    int64_t count = 0;
    double s2 = 0.0, amax = 0.0;
    if (mdt == DT_F64 || vdt == DT_F64)
        update64(m, mdt, v, vdt, n, eps_r, &count, &s2, &amax); /* the caller pairs float64 with float64 only */
    else
        update32(m, mdt, v, vdt, n, (float)eps_r, &count, &s2, &amax);
    out[0] = (double)count, out[1] = s2, out[2] = amax;
    return 0;
}

/* Raw values (non-finite kept) for the moments check. */
static inline float raw32(const void *p, int dt, size_t i) {
    if (dt == DT_F32) return float_of(((const uint32_t *)p)[i]);
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == DT_BF16 ? bf16_float(h) : f16_full(h);
}

static double ratio32_scalar(const void *m, int mdt, const void *v, int vdt, size_t n) {
    float top[LANES];
    for (int j = 0; j < LANES; j++) top[j] = -INFINITY;
    size_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) {
            float x = raw32(m, mdt, i + j);
            float r = (x * x) / raw32(v, vdt, i + j);
            top[j] = r > top[j] ? r : top[j];
        }
    }
    for (; i < n; i++) {
        float x = raw32(m, mdt, i);
        float r = (x * x) / raw32(v, vdt, i);
        top[0] = r > top[0] ? r : top[0];
    }
    float t = -INFINITY;
    for (int j = 0; j < LANES; j++) t = top[j] > t ? top[j] : t;
    return t;
}

#ifdef HAVE_AVX2_PATH
/* 8 raw float32 values (NaN and infinities kept) of a float32 or bfloat16 slab. */
__attribute__((target("avx2"), always_inline)) static inline __m256 raw8(const void *p, const int dt, size_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* ratio32_scalar for float32 or bfloat16 pairs: the maximum is exact and NaN is skipped alike (maxps
 * returns its second operand, the running maximum, when the quotient is NaN). */
__attribute__((target("avx2"), always_inline)) static inline double ratio32_body(const void *m, const int mdt,
                                                                                const void *v, const int vdt,
                                                                                size_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = raw8(m, mdt, i);
        top = _mm256_max_ps(_mm256_div_ps(_mm256_mul_ps(x, x), raw8(v, vdt, i)), top);
    }
    float t[8];
    _mm256_storeu_ps(t, top);
    size_t im = mdt == DT_F32 ? 4 : 2, iv = vdt == DT_F32 ? 4 : 2;
    double r = ratio32_scalar((const char *)m + i * im, mdt, (const char *)v + i * iv, vdt, n - i);
    for (int j = 0; j < 8; j++) r = t[j] > r ? t[j] : r;
    return r;
}

__attribute__((target("avx2"))) static double ratio32_avx2(const void *m, int mdt, const void *v, int vdt, size_t n) {
    if (mdt == DT_F32 && vdt == DT_F32) return ratio32_body(m, DT_F32, v, DT_F32, n);
    if (mdt == DT_BF16 && vdt == DT_BF16) return ratio32_body(m, DT_BF16, v, DT_BF16, n);
    return ratio32_scalar(m, mdt, v, vdt, n);
}
#endif

static double ratio32(const void *m, int mdt, const void *v, int vdt, size_t n) {
#ifdef HAVE_AVX2_PATH
    if (has_avx2() && mdt != DT_F16 && vdt != DT_F16) return ratio32_avx2(m, mdt, v, vdt, n);
#endif
    return ratio32_scalar(m, mdt, v, vdt, n);
}

static double raw64(const void *p, int dt, size_t i) {
    return dt == DT_F64 ? double_of(((const uint64_t *)p)[i]) : (double)raw32(p, dt, i);
}

/* max over i of m[i] * m[i] / v[i] (the square in m's working precision, float32 unless m is float64,
 * the quotient in the wider of m's and v's), NaN ignored; -inf when every quotient is NaN or n == 0. */
double ckpt_moment_ratio(const void *m, int32_t mdt, const void *v, int32_t vdt, size_t n) {
    if (mdt != DT_F64 && vdt != DT_F64) return ratio32(m, mdt, v, vdt, n);
    double t = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        double sq;
        if (mdt == DT_F64) {
            double x = raw64(m, mdt, i);
            sq = x * x;
        } else {
            float x = raw32(m, mdt, i);
            sq = (double)(x * x);
        }
        double r = sq / raw64(v, vdt, i);
        t = r > t ? r : t;
    }
    return t;
}
