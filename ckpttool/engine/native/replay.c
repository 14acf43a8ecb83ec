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
 * with the optimizers' kernels (adamw.c).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

enum { R_F32 = 1, R_BF16 = 2, R_F16 = 3, R_F64 = 4 };

/* the pointers of ckpt_replay_slab (ptr[] and kind[] index) */
enum { P_THETA, P_SAVED_PARAM, P_M0, P_V0, P_GRAD, P_MASTER, P_M1, P_V1, P_PARAM, P_COUNT };

static inline double r_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline double r_f16(uint16_t h) {
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

static inline double load(const void *p, int kind, int64_t i) {
    switch (kind) {
    case R_F32: return ((const float *)p)[i];
    case R_BF16: return r_bf16(((const uint16_t *)p)[i]);
    case R_F16: return r_f16(((const uint16_t *)p)[i]);
    default: return ((const double *)p)[i];
    }
}

/* x rounded to the stored dtype `kind` as torch's Tensor.to does (float64 -> float32 -> bf16/f16,
 * nearest even), as a double; NaN stays NaN */
static inline double round_to(double x, int kind) {
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

static inline void upd(Max *m, double x) {
    if (x != x)
        m->nan = 1;
    else if (x > m->v)
        m->v = x;
}

static inline double max_of(const Max *m) { return m->nan ? NAN : m->v; }

typedef struct {
    Max abs, rel, ratio;
    int64_t bad;
} Field;

static inline void compare(Field *f, double actual, double ref, double scale, double rtol, double atol) {
    const double tiny = 2.2250738585072014e-308; /* DBL_MIN, torch.finfo(float64).tiny */
    double d = fabs(actual - ref);
    double allowed = scale * rtol + atol;
    f->bad += !(d <= allowed);
    upd(&f->abs, d);
    upd(&f->ratio, d / (allowed < tiny ? tiny : allowed));
    double r_abs = fabs(ref), rel = d / r_abs;
    upd(&f->rel, r_abs == 0.0 ? 0.0 : rel);
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
    const double decay = k[0], beta1 = k[1], omb1 = k[2], beta2 = k[3], omb2 = k[4], bc1 = k[5], bc2 = k[6];
    const double lr = k[7], eps = k[8], atol = k[9];
    const void *th_p = ptr[P_THETA], *sp_p = ptr[P_SAVED_PARAM], *m0_p = ptr[P_M0], *v0_p = ptr[P_V0];
    const void *g_p = ptr[P_GRAD], *ma_p = ptr[P_MASTER], *m1_p = ptr[P_M1], *v1_p = ptr[P_V1], *pa_p = ptr[P_PARAM];
    const int thk = kind[P_THETA], spk = kind[P_SAVED_PARAM], mk0 = kind[P_M0], vk0 = kind[P_V0];
    const int gk = kind[P_GRAD], mak = kind[P_MASTER], mk1 = kind[P_M1], vk1 = kind[P_V1], pk = kind[P_PARAM];
    Field fl[4];
    memset(fl, 0, sizeof fl);
    Max sync = {0.0, 0}, upd_max = {0.0, 0}, pmax = {0.0, 0}, dir = {0.0, 0};
    int64_t sync_ne = 0, wb_ne = 0, pvr_ne = 0;
    for (int64_t i = 0; i < n; i++) {
        double th0 = load(th_p, thk, i), g = load(g_p, gk, i);
        double m0 = m0_p ? load(m0_p, mk0, i) : 0.0, v0 = v0_p ? load(v0_p, vk0, i) : 0.0;
        double th = th0 * decay;
        double m = beta1 * m0 + omb1 * g;
        double v = beta2 * v0 + omb2 * g * g;
        double m_hat = m / bc1, v_hat = v / bc2;
        double denom = sqrt(v_hat) + eps;
        double th1 = th - lr * m_hat / denom;
        double dth = fabs(th1 - th0);
        double s_th = fabs(th0) + dth, s_m = fabs(m0) + fabs(m - m0), s_v = fabs(v0) + fabs(v - v0);
        upd(&upd_max, dth);
        upd(&pmax, fabs(th0));
        upd(&dir, (bc1 > 0.0 ? fabs(m_hat) : fabs(m) / bc1) / denom);
        double pa = load(pa_p, pk, i);
        if (sp_p) {
            double sp = load(sp_p, spk, i);
            sync_ne += !(sp == round_to(th0, spk));
            upd(&sync, fabs(sp - th0));
        }
        if (ma_p) {
            double ma = load(ma_p, mak, i);
            compare(&fl[0], ma, th1, s_th, k[10], atol);
            wb_ne += !(pa == round_to(ma, pk));
            pvr_ne += !(pa == round_to(th1, pk));
        }
        compare(&fl[1], load(m1_p, mk1, i), m, s_m, k[11], atol);
        compare(&fl[2], load(v1_p, vk1, i), v, s_v, k[12], atol);
        compare(&fl[3], pa, th1, s_th, k[13], atol);
    }
    for (int j = 0; j < 4; j++) {
        out[3 * j] = max_of(&fl[j].abs);
        out[3 * j + 1] = max_of(&fl[j].rel);
        out[3 * j + 2] = max_of(&fl[j].ratio);
        counts[j] = fl[j].bad;
    }
    out[12] = max_of(&sync);
    out[13] = max_of(&upd_max);
    out[14] = max_of(&pmax);
    out[15] = max_of(&dir);
    counts[4] = sync_ne;
    counts[5] = wb_ne;
    counts[6] = pvr_ne;
    return 0;
}
