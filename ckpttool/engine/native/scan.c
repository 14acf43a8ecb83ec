/* The native lockstep scan of the byte engine (ckpttool/engine/scan.py calls it through ctypes).
 *
 * ckpt_scan reads streams of the same number of values together, slab by slab, from their file
 * descriptors (read-only mappings of 4 MiB where the file is regular and holds the values, else
 * pread into the slab buffers), and while each piece of a slab is in the CPU cache: its CRC-32 (ckpt_crc32
 * of crc.c: 256-bit folding where the CPU has VPCLMULQDQ, finished by the caller's function, ISA-L's
 * crc32_gzip_refl), the statistics fold of each stream (ckpt_stats_slab of stats.c, its flags per stream) and the pair kernels (AdamW update sizes, the moments' max m^2/v,
 * bitwise equality of a value and another rounded to its dtype, a running maximum not below its value). One call covers many slabs: the
 * interpreter runs per window, not per slab. A slab that a pair kernel cannot settle (a difference, a
 * non-finite or zero second value) is handed back whole to the caller, which runs its exact path on
 * the slab buffers and calls again from the next slab. Slabs are cut as the Python loop cuts them
 * (the subnormal sample of a slab starts at the slab's first value); the folds run on pieces of a
 * slab (PIECE_BYTES of the widest stream) so that the read, the CRC and the kernels share the cache.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc.h"
#include "half.h"
#include "stats.h"

#define PIECE_BYTES ((size_t)128 << 10)
#define MAP_BYTES ((size_t)4 << 20) /* bytes of the widest stream mapped at once (mapped reads) */
#define MAX_STREAMS 64

/* One stream: its file window, format, whether it is folded and with which flags (NEED_*), slab buffer, CRC and
 * statistics. */
typedef struct {
    int64_t offset; /* file offset of the stream's value 0 */
    int32_t fd, dt, fold, need;
    int32_t crc_on, pad;    /* crc_on: compute the CRC-32 (0: the stream has no stored CRC-32 to check) */
    uint64_t limit, stride; /* the bound's magnitude pattern (NEED_BOUND); the subnormal sample's stride */
    uint8_t *buf;           /* slab values of this stream */
    uint64_t crc;           /* running CRC-32 */
    ckpt_slab_stats acc;
} ckpt_scan_stream;

enum { PAIR_ADAM = 0, PAIR_RATIO = 1, PAIR_EQUAL = 2, PAIR_BELOW = 3 };

/* A pair kernel over streams a and b. ADAM: count, s2 (sum u^2) and top (max |u|) of u = m / (sqrt(max(v, 0))
 * + eps); RATIO: top = max m * m / v over the slabs settled (-inf: none); EQUAL: a equals b rounded to a's
 * dtype, bit for bit, with b finite (count: values settled); BELOW: no a below b (one dtype), a slab where one is
 * handed back. */
typedef struct {
    int32_t kind, a, b, pad;
    double eps, count, s2, top;
} ckpt_scan_pair;

static const size_t ITEM[4] = {2, 2, 4, 8};

/* Fill n bytes at buf from offset of fd. Returns 0, or -1 with err = {errno or 0 (end of file), offset, missing}. */
static int read_full(int fd, uint8_t *buf, size_t n, int64_t offset, int64_t *err) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)(offset + (int64_t)got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            err[0] = r < 0 ? errno : 0, err[1] = offset + (int64_t)got, err[2] = (int64_t)(n - got);
            return -1;
        }
        got += (size_t)r;
    }
    return 0;
}

/* Whether a[i] == round(b[i]) for every i, every b finite (a: bfloat16, float16 or b's dtype; b: float32 when
 * rounded). Integer operations only: the AVX2 clone gives the same answer. */
CKPT_CLONES static int equal_rounded(const void *a, int adt, const void *b, int bdt, size_t n) {
    if (adt == bdt) {
        if (memcmp(a, b, n * ITEM[adt]) != 0) return 0;
        uint64_t exp_all = adt == DT_F64 ? 0x7ff0000000000000ull : (adt == DT_F32 ? 0x7f800000u : (adt == DT_F16 ? 0x7c00u : 0x7f80u));
        for (size_t i = 0; i < n; i++) {
            uint64_t u;
            if (adt == DT_F64) u = ((const uint64_t *)b)[i] & 0x7fffffffffffffffull;
            else if (adt == DT_F32) u = ((const uint32_t *)b)[i] & 0x7fffffffu;
            else u = ((const uint16_t *)b)[i] & 0x7fffu;
            if (u >= exp_all) return 0;
        }
        return 1;
    }
    const uint32_t *fb = (const uint32_t *)b;
    const uint16_t *ha = (const uint16_t *)a;
    uint32_t bad = 0;
    if (adt == DT_BF16) {
        for (size_t i = 0; i < n; i++) { /* round to nearest even (c10::BFloat16); vectorised */
            uint32_t u = fb[i];
            bad |= ((u & 0x7fffffffu) >= 0x7f800000u) | ((uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) != ha[i]);
        }
        return !bad;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t u = fb[i];
        if ((u & 0x7fffffffu) >= 0x7f800000u || f32_f16_finite(u) != ha[i]) return 0;
    }
    return 1;
}

/* Whether some a[i] < b[i] (one dtype) where a is neither negative nor NaN and b is not NaN: amsgrad's running maximum
 * below its exp_avg_sq. Non-negative IEEE values (and -0.0 as 0) order as their magnitude bit patterns; a negative b
 * is below every such a. Integer operations only: the AVX2 clone gives the same answer. */
CKPT_CLONES static int any_below(const void *a, const void *b, int dt, size_t n) {
    uint32_t bad = 0;
    if (dt == DT_F64) {
        const uint64_t *ua = (const uint64_t *)a, *ub = (const uint64_t *)b;
        const uint64_t mag = 0x7fffffffffffffffull, inf = 0x7ff0000000000000ull;
        for (size_t i = 0; i < n; i++) {
            uint64_t ma = ua[i] & mag, mb = ub[i] & mag;
            int a_ok = ma <= inf && (ua[i] == ma || ma == 0), b_pos = mb <= inf && (ub[i] == mb || mb == 0);
            bad |= (uint32_t)(a_ok & b_pos & (ma < mb));
        }
    } else if (dt == DT_F32) {
        const uint32_t *ua = (const uint32_t *)a, *ub = (const uint32_t *)b;
        for (size_t i = 0; i < n; i++) {
            uint32_t ma = ua[i] & 0x7fffffffu, mb = ub[i] & 0x7fffffffu;
            uint32_t a_ok = (ma <= 0x7f800000u) & ((ua[i] == ma) | (ma == 0));
            uint32_t b_pos = (mb <= 0x7f800000u) & ((ub[i] == mb) | (mb == 0));
            bad |= a_ok & b_pos & (ma < mb);
        }
    } else {
        const uint16_t *ua = (const uint16_t *)a, *ub = (const uint16_t *)b;
        const uint32_t inf = dt == DT_F16 ? 0x7c00u : 0x7f80u;
        for (size_t i = 0; i < n; i++) {
            uint32_t ma = ua[i] & 0x7fffu, mb = ub[i] & 0x7fffu;
            uint32_t a_ok = (ma <= inf) & ((ua[i] == ma) | (ma == 0));
            uint32_t b_pos = (mb <= inf) & ((ub[i] == mb) | (mb == 0));
            bad |= a_ok & b_pos & (ma < mb);
        }
    }
    return bad != 0;
}

/* Run the pair kernels over values [lo, lo + n) of the slab buffers; sets bit j of *back for a pair that hands the
 * slab back. */
static void pairs_piece(ckpt_scan_stream *s, ckpt_scan_pair *p, int32_t np, size_t lo, size_t n, int64_t *back) {
    for (int32_t j = 0; j < np; j++) {
        ckpt_scan_pair *q = &p[j];
        ckpt_scan_stream *a = &s[q->a], *b = &s[q->b];
        const uint8_t *pa = a->buf + lo * ITEM[a->dt], *pb = b->buf + lo * ITEM[b->dt];
        if (q->kind == PAIR_ADAM) {
            double out[3];
            ckpt_adam_update(pa, a->dt, pb, b->dt, n, q->eps, out);
            q->count += out[0], q->s2 += out[1], q->top = out[2] > q->top ? out[2] : q->top;
        } else if (q->kind == PAIR_RATIO) {
            double r = ckpt_moment_ratio(pa, a->dt, pb, b->dt, n);
            if (r == INFINITY) *back |= (int64_t)1 << j; /* a zero or overflowing moment: the exact path */
            else if (r > q->top) q->top = r;
        } else if (q->kind == PAIR_BELOW) {
            if (a->dt != b->dt || any_below(pa, pb, a->dt, n)) *back |= (int64_t)1 << j; /* the exact path counts */
        } else if (!equal_rounded(pa, a->dt, pb, b->dt, n)) {
            *back |= (int64_t)1 << j;
        }
    }
}

/* Whether stream t is read through mappings for values [e0, e1): a regular file that holds every byte of them now,
 * and CKPTTOOL_SCAN_MMAP is not "0". Mapped pages are read straight from the page cache (no copy into the slab
 * buffer). A file truncated below them while they are read raises SIGBUS, which guarded_span turns into the short
 * read error the pread path reports. */
static int mappable(const ckpt_scan_stream *t, int64_t e0, int64_t e1) {
    const char *v = getenv("CKPTTOOL_SCAN_MMAP");
    int off = v != NULL && strcmp(v, "0") == 0;
    struct stat st;
    if (off || fstat(t->fd, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    return (int64_t)st.st_size >= t->offset + e1 * (int64_t)ITEM[t->dt] && e1 > e0;
}

/* A read-only mapping of bytes [at, at + n) of fd: *base and *len to unmap; the bytes' address, or NULL. */
static const uint8_t *map_span(int fd, int64_t at, size_t n, void **base, size_t *len) {
    int64_t page = (int64_t)sysconf(_SC_PAGESIZE), start = at - at % page;
    *len = n + (size_t)(at - start);
    *base = mmap(NULL, *len, PROT_READ, MAP_SHARED, fd, (off_t)start);
    if (*base == MAP_FAILED) return NULL;
    madvise(*base, *len, MADV_SEQUENTIAL);
    return (const uint8_t *)*base + (at - start);
}

/* One slab of values [e, e + m) of every stream (src[i]: mapped bytes of stream i at value e, or NULL: read into
 * its buffer), in pieces: read, CRC-32, fold, pair kernels; then the subnormal rule. Returns 0, or -1 (err). */
static int scan_slab(ckpt_scan_stream *s, int32_t ns, ckpt_scan_pair *p, int32_t np, int64_t e, size_t m,
                     size_t piece, const uint8_t **src, ckpt_crc_fn crc, int64_t *hand, int64_t *err) {
    ckpt_scan_stream view[MAX_STREAMS]; /* the pair kernels' view: each stream's slab where it lies */
    for (int32_t i = 0; i < ns; i++) view[i] = s[i], view[i].buf = src[i] ? (uint8_t *)src[i] : s[i].buf;
    for (size_t lo = 0; lo < m; lo += piece) {
        size_t k = m - lo < piece ? m - lo : piece;
        for (int32_t i = 0; i < ns; i++) {
            ckpt_scan_stream *t = &s[i];
            size_t item = ITEM[t->dt];
            uint8_t *at = view[i].buf + lo * item;
            if (!src[i] && read_full(t->fd, at, k * item, t->offset + (e + (int64_t)lo) * (int64_t)item, err)) return -1;
            if (t->crc_on) t->crc = ckpt_crc32(crc, (uint32_t)t->crc, at, k * item);
            if (t->fold) ckpt_stats_slab(&t->acc, at, k, t->dt, t->need & ~NEED_SUBNORMAL, t->limit, 0);
        }
        pairs_piece(view, p, np, lo, k, hand);
    }
    for (int32_t i = 0; i < ns; i++)
        if (s[i].fold && (s[i].need & NEED_SUBNORMAL)) ckpt_stats_subnormals(&s[i].acc, view[i].buf, m, s[i].dt, s[i].stride);
    return 0;
}

/* A span of a call: the values [e, e + f) of every stream, mapped (src, base, len) or read into the buffers; at:
 * the slab being scanned (memory the SIGBUS path reads after its jump). */
typedef struct {
    ckpt_scan_stream *s;
    int32_t ns;
    ckpt_scan_pair *p;
    int32_t np;
    int64_t e, f, slab;
    size_t piece;
    ckpt_crc_fn crc;
    int64_t *back, *err;
    int64_t at;
    const uint8_t *src[MAX_STREAMS];
    void *base[MAX_STREAMS];
    size_t len[MAX_STREAMS];
} span_ctx;

/* The slabs of a span. Returns 0 (done), 1 (c->at handed back, its values copied to the buffers), -1 (a read error). */
static int run_span(span_ctx *c) {
    for (c->at = c->e; c->at < c->e + c->f; c->at += c->slab) {
        size_t m = (size_t)(c->e + c->f - c->at < c->slab ? c->e + c->f - c->at : c->slab);
        const uint8_t *here[MAX_STREAMS];
        int64_t hand = 0;
        for (int32_t i = 0; i < c->ns; i++)
            here[i] = c->src[i] ? c->src[i] + (c->at - c->e) * (int64_t)ITEM[c->s[i].dt] : NULL;
        if (scan_slab(c->s, c->ns, c->p, c->np, c->at, m, c->piece, here, c->crc, &hand, c->err)) return -1;
        if (hand) { /* the caller's exact path reads the slab from the buffers */
            for (int32_t i = 0; i < c->ns; i++)
                if (here[i]) memcpy(c->s[i].buf, here[i], m * ITEM[c->s[i].dt]);
            *c->back = hand;
            return 1;
        }
    }
    return 0;
}

/* SIGBUS from a fault on this thread's current mappings (a mapped file truncated under it): the thread jumps
 * back to guarded_span, which reports a read error. Any other SIGBUS (another mapping's fault, a signal sent by
 * a process: si_code <= 0) goes to the action installed before ours, or ends the process as the default does. */
static __thread sigjmp_buf *bus_jump;
static __thread const span_ctx *bus_span;
static struct sigaction bus_previous;
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;

static int bus_ours(const siginfo_t *info) {
    const span_ctx *c = bus_span;
    if (bus_jump == NULL || c == NULL || info == NULL || info->si_code <= 0) return 0;
    const uint8_t *a = (const uint8_t *)info->si_addr;
    for (int32_t i = 0; i < c->ns; i++)
        if (c->src[i] && a >= (const uint8_t *)c->base[i] && a < (const uint8_t *)c->base[i] + c->len[i]) return 1;
    return 0;
}

static void bus_handler(int sig, siginfo_t *info, void *uc) {
    if (bus_ours(info)) siglongjmp(*bus_jump, 1);
    int sent = info != NULL && info->si_code <= 0; /* kill/sigqueue: not re-raised by returning */
    if ((bus_previous.sa_flags & SA_SIGINFO) && bus_previous.sa_sigaction != NULL) {
        bus_previous.sa_sigaction(sig, info, uc);
    } else if (bus_previous.sa_handler == SIG_IGN) {
        if (!sent) signal(SIGBUS, SIG_DFL); /* a fault cannot be ignored: it runs again and ends the process */
    } else if (bus_previous.sa_handler != SIG_DFL) {
        bus_previous.sa_handler(sig);
    } else { /* the default action: a fault runs again and ends the process; a sent signal is raised again */
        signal(SIGBUS, SIG_DFL);
        if (sent) raise(sig);
    }
}

static void bus_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = bus_handler;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &bus_previous);
}

/* run_span with SIGBUS caught: 2 when a mapped page could not be read. */
static int guarded_span(span_ctx *c) {
    sigjmp_buf jb;
    if (sigsetjmp(jb, 1)) {
        bus_jump = NULL;
        return 2;
    }
    bus_span = c;
    bus_jump = &jb;
    int rc = run_span(c);
    bus_jump = NULL;
    return rc;
}

/* Scan values [e0, e1) of ns streams (each of numel >= e1) in slabs of `slab` values cut at multiples of `slab`
 * from value 0, with np pair kernels. Streams in regular files that hold the values are read through read-only
 * mappings of about MAP_BYTES (mappable), the others with pread into their slab buffers. Returns e1 when done; the
 * first value of a slab handed back (*back: the pairs that handed it back, bits; the slab's values are in the
 * buffers, its folds and CRCs done, the pairs' accumulators without it); -1 on a read error (err: errno or 0 for
 * an early end of file, the file offset, the missing bytes); -2 on bad arguments. */
int64_t ckpt_scan(ckpt_scan_stream *s, int32_t ns, ckpt_scan_pair *p, int32_t np, int64_t e0, int64_t e1,
                  int64_t slab, ckpt_crc_fn crc, int64_t *back, int64_t *err) {
    *back = 0;
    if (ns <= 0 || ns > MAX_STREAMS || np < 0 || np > 62 || slab <= 0 || e0 < 0 || e1 < e0 || e0 % slab) return -2;
    size_t widest = 1;
    for (int32_t i = 0; i < ns; i++) {
        if (s[i].dt < 0 || s[i].dt > 3) return -2;
        widest = ITEM[s[i].dt] > widest ? ITEM[s[i].dt] : widest;
    }
    for (int32_t j = 0; j < np; j++)
        if (p[j].a < 0 || p[j].a >= ns || p[j].b < 0 || p[j].b >= ns || p[j].kind < 0 || p[j].kind > 3) return -2;
    size_t piece = PIECE_BYTES / widest;
    piece -= piece % 16; /* whole lane groups: the folds' lanes as in one call per slab */
    int mapped[MAX_STREAMS], any = 0;
    for (int32_t i = 0; i < ns; i++) any |= mapped[i] = mappable(&s[i], e0, e1);
    if (any) pthread_once(&bus_once, bus_install);
    int64_t span = (int64_t)(MAP_BYTES / widest) / slab * slab;
    span = span > 0 ? span : slab;
    for (int64_t e = e0; e < e1; e += span) {
        span_ctx c = {s, ns, p, np, e, e1 - e < span ? e1 - e : span, slab, piece, crc, back, err, e, {0}, {0}, {0}};
        for (int32_t i = 0; i < ns; i++) {
            size_t item = ITEM[s[i].dt];
            c.src[i] = mapped[i] ? map_span(s[i].fd, s[i].offset + e * (int64_t)item, (size_t)c.f * item, &c.base[i], &c.len[i]) : NULL;
        }
        int rc = guarded_span(&c);
        for (int32_t i = 0; i < ns; i++)
            if (c.src[i]) munmap(c.base[i], c.len[i]);
        if (rc == 2) { /* SIGBUS: a mapped file shrank under the scan, or changed (cut and written again), or its
                        * storage failed a read: reported as the read ending early at the span, unless a file is short */
            err[0] = 0, err[1] = s[0].offset + c.e * (int64_t)ITEM[s[0].dt], err[2] = c.f * (int64_t)ITEM[s[0].dt];
            for (int32_t i = 0; i < ns; i++) {
                struct stat st;
                int64_t end = s[i].offset + e1 * (int64_t)ITEM[s[i].dt];
                if (mapped[i] && fstat(s[i].fd, &st) == 0 && (int64_t)st.st_size < end) {
                    err[0] = 0, err[1] = (int64_t)st.st_size, err[2] = end - (int64_t)st.st_size;
                    break;
                }
            }
            return -1;
        }
        if (rc) return rc < 0 ? -1 : c.at;
    }
    return e1;
}
