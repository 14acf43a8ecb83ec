/* The statistics accumulator shared by stats.c and scan.c (mirrors engine/stats.py SlabStats). */
#ifndef CKPT_STATS_H
#define CKPT_STATS_H

#include <stddef.h>
#include <stdint.h>

enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2, DT_F64 = 3 };
enum { NEED_ZEROS = 1, NEED_NEGATIVE = 2, NEED_SUMS = 4, NEED_BOUND = 8, NEED_SUBNORMAL = 16 };


/* The accumulator: merged into by every call (the caller zeroes it once). Mirrors SlabStats. */
typedef struct {
    int64_t numel, nonfinite, zeros, negative, beyond, subnormal;
    int64_t nonzero;    /* 1: some value is not +-0 */
    int64_t has_neg;    /* 1: neg_min is set */
    double abs_max, neg_min, beyond_max, s1, s2;
} ckpt_slab_stats;

int32_t ckpt_stats_slab(ckpt_slab_stats *acc, const void *p, size_t n, int32_t dt, int32_t need, uint64_t limit,
                        uint64_t stride);
void ckpt_stats_subnormals(ckpt_slab_stats *acc, const void *p, size_t n, int32_t dt, uint64_t stride);
int32_t ckpt_adam_update(const void *m, int32_t mdt, const void *v, int32_t vdt, size_t n, double eps_r, double *out);
double ckpt_moment_ratio(const void *m, int32_t mdt, const void *v, int32_t vdt, size_t n);

#endif
