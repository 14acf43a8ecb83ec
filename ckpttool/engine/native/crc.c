/* CRC-32 (the zip polynomial, reflected) folded 256 bits at a time with VPCLMULQDQ on ymm registers.
 *
 * ckpt_crc32(fn, crc, buf, len) equals fn(crc, buf, len) for fn any CRC-32 of zip's convention (ISA-L's
 * crc32_gzip_refl, zlib's crc32: the state inverted on entry and exit). Where the CPU has AVX2 and VPCLMULQDQ
 * (e.g. AMD Zen 3, which has no AVX-512, so ISA-L runs its 128-bit folding) and len >= 256, the whole 128-byte
 * blocks are folded in four ymm accumulators (eight 128-bit lanes, each carried 1024 bits forward per block:
 * the constants x^(1024+32) and x^(1024-32) mod P, bit-reflected and shifted left by one, as the 128-bit
 * kernels' k1/k2 are for 512 bits). The folded 128 bytes have the same CRC state as the blocks they stand for
 * (folding preserves the remainder mod P), so fn finishes: the state of the 128 bytes from a zero state, then
 * the tail. The loop prefetches PF bytes ahead: the scan's pieces are first touched here, straight from page-cache
 * pages of a mapping, where the hardware prefetcher stops at each 4 KiB page (-8% of `stats`' CPU with it; four
 * accumulators or eight cost the same: VPCLMULQDQ's throughput bounds the loop). Elsewhere fn runs alone: on
 * CPUs with AVX-512 (F, VL, BW, DQ) and VPCLMULQDQ ISA-L dispatches to its own 512-bit kernel, and compilers
 * older than GCC 8 / clang 7 know neither the vpclmulqdq target nor its CPU feature name.
 */
#include <stddef.h>
#include <stdint.h>

#include "crc.h"

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 7 : (defined(__GNUC__) && __GNUC__ >= 8))
#define CKPT_FOLD256 1
#include <immintrin.h>

#define PF 2048 /* bytes ahead prefetched (1024 to 4096: the same) */

static int have_vpclmul(void) {
    static int cached = -1;
    if (cached < 0) { /* a benign race: every thread computes the same value */
        __builtin_cpu_init();
        int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                     __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
                 __builtin_cpu_supports("pclmul") && !avx512;
    }
    return cached;
}

__attribute__((target("avx2,vpclmulqdq,pclmul"), always_inline)) static inline __m256i fold(__m256i y, __m256i k,
                                                                                            const uint8_t *p) {
    __m256i lo = _mm256_clmulepi64_epi128(y, k, 0x00), hi = _mm256_clmulepi64_epi128(y, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(lo, hi), _mm256_loadu_si256((const __m256i *)p));
}

__attribute__((target("avx2,vpclmulqdq,pclmul"))) static uint32_t fold256(ckpt_crc_fn fn, uint32_t crc,
                                                                          const uint8_t *buf, uint64_t len) {
    const __m256i k = _mm256_setr_epi64x(0x1e88ef372LL, 0x14a7fe880LL, 0x1e88ef372LL, 0x14a7fe880LL);
    __m256i y0 = _mm256_loadu_si256((const __m256i *)buf), y1 = _mm256_loadu_si256((const __m256i *)(buf + 32));
    __m256i y2 = _mm256_loadu_si256((const __m256i *)(buf + 64)), y3 = _mm256_loadu_si256((const __m256i *)(buf + 96));
    y0 = _mm256_xor_si256(y0, _mm256_setr_epi32((int)~crc, 0, 0, 0, 0, 0, 0, 0)); /* the state, inverted */
    uint64_t n = len - len % 128;
    for (uint64_t i = 128; i < n; i += 128) {
        _mm_prefetch((const char *)buf + i + PF, _MM_HINT_T0);
        _mm_prefetch((const char *)buf + i + PF + 64, _MM_HINT_T0);
        y0 = fold(y0, k, buf + i);
        y1 = fold(y1, k, buf + i + 32);
        y2 = fold(y2, k, buf + i + 64);
        y3 = fold(y3, k, buf + i + 96);
    }
    uint8_t a[128];
    _mm256_storeu_si256((__m256i *)a, y0), _mm256_storeu_si256((__m256i *)(a + 32), y1);
    _mm256_storeu_si256((__m256i *)(a + 64), y2), _mm256_storeu_si256((__m256i *)(a + 96), y3);
    uint32_t c = fn(0xffffffffu, a, 128); /* from a zero state: fn inverts on entry */
    return len > n ? fn(c, buf + n, len - n) : c;
}
#endif

uint32_t ckpt_crc32(ckpt_crc_fn fn, uint32_t crc, const uint8_t *buf, uint64_t len) {
#ifdef CKPT_FOLD256
    if (len >= 256 && have_vpclmul()) return fold256(fn, crc, buf, len);
#endif
    return fn(crc, buf, len);
}
