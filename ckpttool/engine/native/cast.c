/* FP32 -> BF16 / FP16 casts of transforming exports (ckpttool/engine/kernels.py: f32_to_bf16, f32_to_f16).
 *
 * Round to nearest even, the bytes of the numpy path for every input, NaNs included:
 *   bfloat16: (u + 0x7FFF + ((u >> 16) & 1)) >> 16 in uint32 arithmetic; with canonical_nan every
 *             NaN gives 0x7FC0 (c10::BFloat16's scalar conversion);
 *   float16:  beyond float16's range to infinity; a NaN keeps its sign and its payload's top 10
 *             bits, 0x7C01 where those are zero (numpy's npy_floatbits_to_halfbits).
 * One pass, 16 (BF16) or 8 (FP16) elements per AVX2 step where the CPU has it; the BF16 cast keeps, in the same
 * pass, a running maximum of the magnitudes: its return value flags those that may have rounded to infinity.
 *
 * ckpt_stream_cast moves one stored record of a transforming export in one call: pread pieces of
 * the record into a cache-sized buffer, the CRC-32 of each piece (ckpt_crc32 of crc.c finishing with the
 * caller's function, ISA-L's crc32_gzip_refl) and its cast while it is in the CPU cache, the output gathered per destination
 * run and written with large pwrites (ckpttool/ops/export/transform.py, stream_chunk).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

#include "crc.h"
#include "half.h"
#ifdef CKPT_X86
#include <immintrin.h>
#endif

/* A finite float32 magnitude that rounds to bfloat16 infinity lies in [0x7F7F8000, 0x7F7FFFFF] (3.39618e38 up to
 * float32's largest): its magnitude's bits 15..30 are 0xFEFF (infinity and NaN give 0xFF00 and above).
 * The cast's flag is the cheaper test "a magnitude of 0x7F7F8000 or more" (such a value, an infinity or a NaN):
 * one unsigned maximum per 8 values in the AVX2 loop; bf16_first_overflow then looks for a true one. The same
 * maximum tells the AVX2 loop whether the slab holds a NaN to make canonical. */
#define BF16_OVERFLOW_FROM 0x7F7F8000u
static inline int bf16_overflows(uint32_t u) { return ((u & 0x7FFFFFFFu) >> 15) == 0xFEFFu; }
static inline int bf16_may_overflow(uint32_t u) { return (u & 0x7FFFFFFFu) >= BF16_OVERFLOW_FROM; }

static inline uint16_t bf16_bits(uint32_t u, int canonical_nan) {
    if (canonical_nan && f32_is_nan(u)) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t f16_bits(uint32_t u) { return f32_is_nan(u) ? f16_nan_numpy(u) : f32_f16_finite(u); }

#ifdef CKPT_X86
/* Rounds 8 float32 patterns to bfloat16 (in the low half of each lane), NaNs as the rounding carries them.
 * *top: the running maximum of the magnitudes (one instruction per 8 values). */
__attribute__((target("avx2"))) static inline __m256i round_bf16x8(__m256i u, __m256i *top) {
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    *top = _mm256_max_epu32(*top, _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)));
    return _mm256_srli_epi32(r, 16);
}

/* *overflow: set to 1 when a magnitude reached BF16_OVERFLOW_FROM (the running maximum, tested once). The NaNs
 * (magnitudes above 0x7F800000, which the maximum shows) are made canonical in a second loop over the values done
 * only then: a slab without NaN or infinity is one pass. */
__attribute__((target("avx2"))) static int64_t bf16_avx2(const uint32_t *src, uint16_t *dst, int64_t n, int canon,
                                                         int *overflow) {
    int64_t i = 0;
    __m256i top = _mm256_setzero_si256(), top_b = top; /* two chains: no dependency between the halves */
    for (; i + 16 <= n; i += 16) {
        __m256i a = round_bf16x8(_mm256_loadu_si256((const __m256i *)(src + i)), &top);
        __m256i b = round_bf16x8(_mm256_loadu_si256((const __m256i *)(src + i + 8)), &top_b);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(dst + i), packed);
    }
    top = _mm256_max_epu32(top, top_b);
    __m256i hit = _mm256_cmpgt_epi32(top, _mm256_set1_epi32((int)(BF16_OVERFLOW_FROM - 1)));
    *overflow = !_mm256_testz_si256(hit, hit);
    if (canon && *overflow) {
        __m256i nan = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x7F800000));
        if (!_mm256_testz_si256(nan, nan))
            for (int64_t j = 0; j < i; j++)
                if (f32_is_nan(src[j])) dst[j] = 0x7FC0u;
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

/* src: float32 bit patterns [n]; dst: bfloat16 bits [n]; canonical_nan: 0/1 (see the file comment).
 * Returns 1 when a magnitude of 0x7F7F8000 or more was met (bf16_may_overflow: a finite value rounded to infinity,
 * an infinity or a NaN), else 0: the callers look for a finite one only then. */
int32_t ckpt_f32_to_bf16(const uint32_t *src, uint16_t *dst, int64_t n, int32_t canonical_nan) {
    int64_t i = 0;
    int overflow = 0;
#ifdef CKPT_X86
    if (ckpt_have_avx2()) i = bf16_avx2(src, dst, n, canonical_nan != 0, &overflow);
#endif
    for (; i < n; i++) {
        overflow |= bf16_may_overflow(src[i]);
        dst[i] = bf16_bits(src[i], canonical_nan != 0);
    }
    return overflow;
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
int32_t ckpt_f32_to_bf16_portable(const uint32_t *src, uint16_t *dst, int64_t n, int32_t canonical_nan) {
    int overflow = 0;
    for (int64_t i = 0; i < n; i++) {
        overflow |= bf16_may_overflow(src[i]);
        dst[i] = bf16_bits(src[i], canonical_nan != 0);
    }
    return overflow;
}

void ckpt_f32_to_f16_portable(const uint32_t *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f16_bits(src[i]);
}

enum { MOVE_COPY = 0, MOVE_BF16 = 1, MOVE_F16 = 2, MOVE_WIDEN = 3 };

/* Source bytes per pread (the piece is checked and cast while it is in the CPU cache). */
#define MOVE_PIECE ((int64_t)256 << 10)

/* Index of the first float16 infinity in h[0, n) whose float32 source s[i] is finite (a value beyond +-65504
 * that the cast rounded to infinity), or -1. The first loop is a branch-free test of the whole piece. */
static int64_t f16_first_overflow(const uint32_t *s, const uint16_t *h, int64_t n) {
    int any = 0;
    for (int64_t i = 0; i < n; i++) any |= (h[i] & 0x7FFF) == 0x7C00;
    if (!any) return -1;
    for (int64_t i = 0; i < n; i++)
        if ((h[i] & 0x7FFF) == 0x7C00 && (s[i] & 0x7FFFFFFF) != 0x7F800000) return i;
    return -1;
}

/* Index of the first float32 value of s[0, n) that rounds to bfloat16 infinity from a finite value, or -1
 * (run only on a piece ckpt_f32_to_bf16 flagged: values stored as infinity or NaN also raise its flag). */
static int64_t bf16_first_overflow(const uint32_t *s, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (bf16_overflows(s[i])) return i;
    return -1;
}

static int write_full(int fd, const uint8_t *p, int64_t n, int64_t at, int64_t *err) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, (size_t)n, (off_t)at);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            err[0] = w < 0 ? errno : 28 /* ENOSPC: a write that writes nothing */, err[1] = at, err[2] = n;
            return -1;
        }
        p += w, n -= w, at += w;
    }
    return 0;
}

/* Move `nparts` runs of a stored record that starts at src_off of src_fd, in order: run j is parts[3j] values
 * written at byte parts[3j + 2] of descriptor parts[3j + 1] (-1: not written, read for the CRC-32 only).
 * kind: MOVE_COPY (values of `item` bytes as stored), MOVE_BF16 / MOVE_F16 (float32 in, 16-bit out, as
 * ckpt_f32_to_bf16 with canonical NaNs / ckpt_f32_to_f16), MOVE_WIDEN (bfloat16 in, float32 out: exact). *crc_io: the running CRC-32 of the bytes read
 * (crc NULL: none). buf: buf_bytes >= 3 * MOVE_PIECE of scratch; the output of each run is gathered after
 * the first MOVE_PIECE bytes and written when that stage is full or the run ends.
 * Returns 0; -1 a read failed or ended early (err: errno or 0 for the end of the file, the file offset, the
 * bytes missing); -2 a write failed (err: errno, the file offset, the bytes not written); -3 bad arguments;
 * -4 (MOVE_F16, MOVE_BF16) a finite float32 value beyond the target's range (float16: +-65504; bfloat16: from
 * 3.39618e38), which the cast made infinite (err: the run j,
 * the value's index within run j, its float32 bits); nothing after that piece is written. */
int32_t ckpt_stream_cast(int32_t src_fd, int64_t src_off, const int64_t *parts, int32_t nparts, int32_t kind,
                         int32_t item, ckpt_crc_fn crc, uint32_t *crc_io, uint8_t *buf, int64_t buf_bytes,
                         int64_t *err) {
    if (kind < 0 || kind > 3 || item <= 0 || nparts < 0) return -3;
    if ((kind == MOVE_BF16 || kind == MOVE_F16) && item != 4) return -3;
    if (kind == MOVE_WIDEN && item != 2) return -3;
    int64_t out_item = kind == MOVE_COPY ? item : (kind == MOVE_WIDEN ? 4 : 2);
    int64_t piece = MOVE_PIECE - MOVE_PIECE % item;
    int64_t stage_cap = buf_bytes - piece; /* output gathered before a pwrite */
    stage_cap -= stage_cap % out_item;
    if (stage_cap < piece * 2) return -3;
    uint8_t *in = buf, *stage = buf + piece;
    uint32_t c = crc_io ? *crc_io : 0;
    int64_t pos = src_off; /* next source byte to read */
    for (int32_t j = 0; j < nparts; j++) {
        int64_t left = parts[3 * j] * item, fd = parts[3 * j + 1], at = parts[3 * j + 2];
        if (left < 0) return -3;
        int64_t staged = 0; /* bytes in stage, to be written at `at` */
        while (left > 0) {
            int64_t k = left < piece ? left : piece;
            int64_t run_at = parts[3 * j] - left / item; /* index in run j of the piece's first value */
            int direct = kind == MOVE_COPY && fd >= 0; /* a copy is read straight into the stage */
            int64_t need = fd < 0 ? 0 : k / item * out_item;
            if (staged + need > stage_cap) { /* no room: write what is gathered first */
                if (write_full((int)fd, stage, staged, at, err)) return -2;
                at += staged, staged = 0;
            }
            uint8_t *dst = direct ? stage + staged : in;
            for (int64_t got = 0; got < k;) {
                ssize_t r = pread(src_fd, dst + got, (size_t)(k - got), (off_t)(pos + got));
                if (r < 0 && errno == EINTR) continue;
                if (r <= 0) {
                    err[0] = r < 0 ? errno : 0, err[1] = pos + got, err[2] = k - got;
                    return -1;
                }
                got += r;
            }
            if (crc) c = ckpt_crc32(crc, c, dst, (uint64_t)k);
            pos += k, left -= k;
            if (fd < 0) continue;
            if (kind == MOVE_BF16 || kind == MOVE_F16) {
                int64_t bad = -1;
                if (kind == MOVE_BF16) {
                    if (ckpt_f32_to_bf16((const uint32_t *)dst, (uint16_t *)(stage + staged), k / 4, 1))
                        bad = bf16_first_overflow((const uint32_t *)dst, k / 4);
                } else {
                    ckpt_f32_to_f16((const uint32_t *)dst, (uint16_t *)(stage + staged), k / 4);
                    bad = f16_first_overflow((const uint32_t *)dst, (const uint16_t *)(stage + staged), k / 4);
                }
                if (bad >= 0) {
                    err[0] = j, err[1] = run_at + bad, err[2] = ((const uint32_t *)dst)[bad];
                    return -4;
                }
            }
            else if (kind == MOVE_WIDEN) {
                const uint16_t *h = (const uint16_t *)dst;
                uint32_t *w = (uint32_t *)(stage + staged);
                for (int64_t i = 0; i < k / 2; i++) w[i] = (uint32_t)h[i] << 16;
            }
            staged += need;
            if (left == 0 && staged) {
                if (write_full((int)fd, stage, staged, at, err)) return -2;
            }
        }
    }
    if (crc_io) *crc_io = c;
    return 0;
}
