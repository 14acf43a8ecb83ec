/* replay-step's reference and comparison of one slab in one pass, in float64 (ckpttool/ops/replay/kernel.py).
 *
 * For elements [0, n) of a slab: widen the saved theta (master, else parameter), moments and the
 * gradient; one AdamW step from the formula, written as ckpttool/optim_state/reference.py's
 * reference_adamw_step writes it (same operations in the same order; this file is compiled with
 * -ffp-contract=off, so nothing contracts into a fused multiply-add):
 *     theta = theta0 * decay                      decay = 1 - lr * weight_decay
 *     m = beta1 * m0 + (1 - beta1) * g
 *     v = beta2 * v0 + ((1 - beta2) * g) * g
 *     m_hat = m / bc1,  v_hat = v / bc2           bc = 1 - beta^t
 *     denom = sqrt(v_hat) + eps
 *     theta1 = theta - (lr * m_hat) / denom
 * the scales |x0| + |x1 - x0|, and the comparison of each replayed field with it as
 * ckpttool/ops/replay/compare.py's compare_field does for one step (d = |actual - ref|,
 * allowed = scale * rtol + atol, bad: !(d <= allowed), maxima of d, d / max(allowed, tiny) and
 * d / |ref| (0 where ref == 0), a NaN maximum reported as NaN); the bitwise counts of the master
 * sync before the step and the write-back after it; the update-size maxima. It shares no code
 * with the optimizers' kernels (adamw.c). It runs in blocks of BLK elements, stage by stage, so that
 * the element-wise loops vectorize (every operation is IEEE-exact element by element; the maxima
 * do not depend on the order in which they are taken).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

/* CKPT_CLONES (half.h): an AVX2 build of the block beside the baseline one (no FMA: AVX2 alone) */
/* the block's helpers are inlined into each build of it */
#define INLINE static inline __attribute__((always_inline))

enum { R_F32 = 1, R_BF16 = 2, R_F16 = 3, R_F64 = 4 };

/* the pointers of ckpt_replay_slab (ptr[] and kind[] index) */
enum { P_THETA, P_SAVED_PARAM, P_M0, P_V0, P_GRAD, P_MASTER, P_M1, P_V1, P_PARAM, P_COUNT };

INLINE double r_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE double r_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {
        double x = ldexp((double)mant, -24); /* zero or subnormal: exact */
        return sign ? -x : x;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* dst[0, n) = elements [off, off + n) of p (of `kind`) widened; zeros where p is NULL */
INLINE void widen(double *restrict dst, const void *p, int kind, int64_t off, int n) {
    if (p == NULL) {
        for (int i = 0; i < n; i++) dst[i] = 0.0;
    } else if (kind == R_F32) {
        const float *x = (const float *)p + off;
        for (int i = 0; i < n; i++) dst[i] = x[i];
    } else if (kind == R_BF16) {
        const uint16_t *x = (const uint16_t *)p + off;
        for (int i = 0; i < n; i++) {
            uint32_t u = (uint32_t)x[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            dst[i] = f;
        }
    } else if (kind == R_F16) {
        const uint16_t *x = (const uint16_t *)p + off;
        for (int i = 0; i < n; i++) dst[i] = r_f16(x[i]);
    } else {
        memcpy(dst, (const double *)p + off, (size_t)n * sizeof(double));
    }
}

/* x rounded to the stored dtype `kind` as torch's Tensor.to does (float64 -> float32 -> bf16/f16,
 * nearest even), as a double; NaN stays NaN */
INLINE double round_to(double x, int kind) {
    if (kind == R_F64) return x;
    float f = (float)x;
    if (kind == R_F32 || f != f) return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    if (kind == R_BF16) return r_bf16((uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16));
    return r_f16(f32_f16_finite(u));
}

/* a maximum as torch's max() reduces: NaN when any element is NaN */
typedef struct {
    double v;
    int nan;
} Max;

/* fold x[0, n) into m (four accumulators; max is order-free on non-NaN values) */
INLINE void fold(Max *m, const double *restrict x, int n) {
    double a0 = m->v, a1 = a0, a2 = a0, a3 = a0;
    int nan = 0, i = 0;
    for (; i + 4 <= n; i += 4) {
        nan |= (x[i] != x[i]) | (x[i + 1] != x[i + 1]) | (x[i + 2] != x[i + 2]) | (x[i + 3] != x[i + 3]);
        a0 = x[i] > a0 ? x[i] : a0;
        a1 = x[i + 1] > a1 ? x[i + 1] : a1;
        a2 = x[i + 2] > a2 ? x[i + 2] : a2;
        a3 = x[i + 3] > a3 ? x[i + 3] : a3;
    }
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        a0 = x[i] > a0 ? x[i] : a0;
    }
    a0 = a1 > a0 ? a1 : a0;
    a2 = a3 > a2 ? a3 : a2;
    m->v = a2 > a0 ? a2 : a0;
    m->nan |= nan;
}

static inline double max_of(const Max *m) { return m->nan ? NAN : m->v; }

typedef struct {
    Max abs, rel, ratio;
    int64_t bad;
} Field;

enum { BLK = 256 };

/* one field of one block: d = |actual - ref|, allowed = scale * rtol + atol, as compare_field */
INLINE void compare(Field *f, const double *restrict actual, const double *restrict ref,
                    const double *restrict scale, double rtol, double atol, int n) {
    const double tiny = 2.2250738585072014e-308; /* DBL_MIN, torch.finfo(float64).tiny */
    double d[BLK], allowed[BLK], q[BLK], rel[BLK];
    int64_t bad = 0;
    for (int i = 0; i < n; i++) {
        d[i] = fabs(actual[i] - ref[i]);
        allowed[i] = scale[i] * rtol + atol;
    }
    for (int i = 0; i < n; i++) bad += !(d[i] <= allowed[i]);
    for (int i = 0; i < n; i++) q[i] = d[i] / (allowed[i] < tiny ? tiny : allowed[i]);
    for (int i = 0; i < n; i++) rel[i] = d[i] / fabs(ref[i]);
    for (int i = 0; i < n; i++) rel[i] = ref[i] == 0.0 ? 0.0 : rel[i]; /* masked where ref == 0 */
    f->bad += bad;
    fold(&f->abs, d, n);
    fold(&f->ratio, q, n);
    fold(&f->rel, rel, n);
}

/* the accumulators of a slab */
typedef struct {
    Field fl[4];
    Max sync, upd, pmax, dir;
    int64_t sync_ne, wb_ne, pvr_ne;
} Acc;

/* bitwise-in-value unequal elements of a (stored as `kind`) and b rounded to `kind` (NaN unequal) */
INLINE int64_t unequal(const double *restrict a, const double *restrict b, int kind, int n) {
    int64_t ne = 0;
    for (int i = 0; i < n; i++) ne += !(a[i] == round_to(b[i], kind));
    return ne;
}

CKPT_CLONES static void block(const void *const *ptr, const int32_t *kind, int64_t off, int n, const double *k, Acc *acc) {
    const double decay = k[0], beta1 = k[1], omb1 = k[2], beta2 = k[3], omb2 = k[4], bc1 = k[5], bc2 = k[6];
    const double lr = k[7], eps = k[8], atol = k[9];
    double th0[BLK], g[BLK], m0[BLK], v0[BLK], th1[BLK], m[BLK], v[BLK], s_th[BLK], s_m[BLK], s_v[BLK];
    double dth[BLK], ath[BLK], dir[BLK], a[BLK];
    widen(th0, ptr[P_THETA], kind[P_THETA], off, n);
    widen(g, ptr[P_GRAD], kind[P_GRAD], off, n);
    widen(m0, ptr[P_M0], kind[P_M0], off, n);
    widen(v0, ptr[P_V0], kind[P_V0], off, n);
    for (int i = 0; i < n; i++) {
        double th = th0[i] * decay;
        double mi = beta1 * m0[i] + omb1 * g[i];
        double vi = beta2 * v0[i] + omb2 * g[i] * g[i];
        double m_hat = mi / bc1, v_hat = vi / bc2;
        double denom = sqrt(v_hat) + eps;
        double t1 = th - lr * m_hat / denom;
        double dt = fabs(t1 - th0[i]);
        th1[i] = t1;
        m[i] = mi;
        v[i] = vi;
        dth[i] = dt;
        ath[i] = fabs(th0[i]);
        s_th[i] = ath[i] + dt;
        s_m[i] = fabs(m0[i]) + fabs(mi - m0[i]);
        s_v[i] = fabs(v0[i]) + fabs(vi - v0[i]);
        dir[i] = fabs(m_hat) / denom;
    }
    if (!(bc1 > 0.0)) /* |m| / bc1 is |m / bc1| only for a positive bc1 */
        for (int i = 0; i < n; i++) dir[i] = fabs(m[i]) / bc1 / (sqrt(v[i] / bc2) + eps);
    fold(&acc->upd, dth, n);
    fold(&acc->pmax, ath, n);
    fold(&acc->dir, dir, n);
    double pa[BLK];
    const int pk = kind[P_PARAM];
    widen(pa, ptr[P_PARAM], pk, off, n);
    if (ptr[P_SAVED_PARAM]) {
        widen(a, ptr[P_SAVED_PARAM], kind[P_SAVED_PARAM], off, n);
        acc->sync_ne += unequal(a, th0, kind[P_SAVED_PARAM], n);
        for (int i = 0; i < n; i++) a[i] = fabs(a[i] - th0[i]);
        fold(&acc->sync, a, n);
    }
    if (ptr[P_MASTER]) {
        widen(a, ptr[P_MASTER], kind[P_MASTER], off, n);
        compare(&acc->fl[0], a, th1, s_th, k[10], atol, n);
        acc->wb_ne += unequal(pa, a, pk, n);
        acc->pvr_ne += unequal(pa, th1, pk, n);
    }
    widen(a, ptr[P_M1], kind[P_M1], off, n);
    compare(&acc->fl[1], a, m, s_m, k[11], atol, n);
    widen(a, ptr[P_V1], kind[P_V1], off, n);
    compare(&acc->fl[2], a, v, s_v, k[12], atol, n);
    compare(&acc->fl[3], pa, th1, s_th, k[13], atol, n);
}

/* One slab of n elements; see the file comment.
 *   ptr[P_COUNT], kind[P_COUNT] (1 f32, 2 bf16, 3 f16, 4 f64): theta (saved master, else saved
 *     parameter), saved_param (NULL: no sync check), m0, v0 (NULL: zeros), grad, master (the
 *     replayed master, NULL for plain AdamW), m1, v1, param (the replayed values);
 *   k: double[14] = {decay, beta1, 1 - beta1, beta2, 1 - beta2, bc1, bc2, lr, eps, atol,
 *                    rtol of master, exp_avg, exp_avg_sq, param (effective)};
 *   out: double[16] = per field (master, exp_avg, exp_avg_sq, param) {max_abs, max_rel, ratio},
 *        then max |saved_param - saved master|, max |theta1 - theta0|, max |theta0|,
 *        max |m_hat| / denom (each NaN when an element is NaN);
 *   counts: int64[7] = bad per field (4), sync unequal, write-back unequal, param vs reference unequal.
 * Returns 0, or -1 for a kind out of range or a missing required pointer. */
int32_t ckpt_replay_slab(const void *const *ptr, const int32_t *kind, int64_t n, const double *k, double *out,
                         int64_t *counts) {
    for (int j = 0; j < P_COUNT; j++)
        if (ptr[j] != NULL && (kind[j] < R_F32 || kind[j] > R_F64)) return -1;
    if (!ptr[P_THETA] || !ptr[P_GRAD] || !ptr[P_M1] || !ptr[P_V1] || !ptr[P_PARAM]) return -1;
    Acc acc;
    memset(&acc, 0, sizeof acc);
    for (int64_t off = 0; off < n; off += BLK) block(ptr, kind, off, (int)(n - off < BLK ? n - off : BLK), k, &acc);
    for (int j = 0; j < 4; j++) {
        out[3 * j] = max_of(&acc.fl[j].abs);
        out[3 * j + 1] = max_of(&acc.fl[j].rel);
        out[3 * j + 2] = max_of(&acc.fl[j].ratio);
        counts[j] = acc.fl[j].bad;
    }
    out[12] = max_of(&acc.sync);
    out[13] = max_of(&acc.upd);
    out[14] = max_of(&acc.pmax);
    out[15] = max_of(&acc.dir);
    counts[4] = acc.sync_ne;
    counts[5] = acc.wb_ne;
    counts[6] = acc.pvr_ne;
    return 0;
}
