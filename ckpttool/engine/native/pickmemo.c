/* The memo-index check of a pickle before any unpickler runs (ckpttool/format/pickleframes.py, check_memo).
 *
 * CPython's C unpickler grows its memo to twice the index a PUT names and zeroes it, so a LONG_BINPUT of slot
 * 2**31 (an 11-byte pickle) touches 32 GiB. This walks the opcodes once as check_memo's Python walk does, with
 * the argument reads of each opcode from a table the caller builds from pickletools (3 bytes an opcode: the
 * count of reads, then each read: 0 a text line, > 0 that many bytes, < 0 a little-endian length field of that
 * many bytes and then that many bytes; count -1: not an opcode). A read past the end uses the bytes there are. */
#include <stdint.h>
#include <string.h>

static uint64_t le(const uint8_t *p, int64_t avail, int w) {
    uint64_t v = 0;
    for (int i = (int)(avail < w ? avail : w) - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Returns -1: no index beyond `puts + slack` (or the walk stopped where the stream does not parse: an unknown
 * opcode, STOP, a line without its end, a negative length); -2: a text PUT (the caller's walk decides); -3: an
 * 8-byte length (BINUNICODE8, BINBYTES8, BYTEARRAY8) past the stream's end, with *bad the length and *puts_before
 * the position of its opcode (CPython's unpickler allocates that much before it reads); else the position after the
 * first index beyond the bound, with *bad its value and *puts_before the memo writes before it. */
int64_t ckpt_pickle_memo_check(const uint8_t *d, int64_t n, const int8_t *table, int64_t slack, int64_t *bad,
                               int64_t *puts_before) {
    int64_t x = 0, puts = 0;
    while (x < n) {
        uint8_t op = d[x++];
        if (op == 0x72 || op == 0x71 || op == 0x94) { /* LONG_BINPUT, BINPUT, MEMOIZE */
            int64_t idx = puts;
            if (op == 0x72) {
                idx = (int64_t)le(d + x, n - x, 4);
                x += 4;
            } else if (op == 0x71) {
                x += 1;
            }
            if (idx > puts + slack) {
                *bad = idx;
                *puts_before = puts;
                return x;
            }
            puts++;
            continue;
        }
        if (op == 0x70) return -2; /* PUT with a decimal line */
        const int8_t *t = table + 3 * op;
        if (t[0] < 0 || op == 0x2E) return -1; /* not an opcode, STOP */
        for (int k = 0; k < t[0]; k++) {
            int r = t[1 + k];
            if (r == 0) {
                const uint8_t *nl = x < n ? memchr(d + x, '\n', (size_t)(n - x)) : NULL;
                if (!nl) return -1;
                x = nl - d + 1;
            } else if (r > 0) {
                x += r;
            } else {
                int w = -r;
                uint64_t size = le(d + x, n - x, w);
                if (w == 4 && (op == 0x54 || op == 0x8B) && (size & 0x80000000u) && n - x >= 4) return -1;
                if (w == 8 && n - x >= 8 && size > (uint64_t)(n - x - 8)) {
                    *bad = size > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)size;
                    *puts_before = x - 1;
                    return -3;
                }
                if (size > (uint64_t)(n - x)) return -1; /* past the end: the walk ends there */
                x += w + (int64_t)size;
            }
        }
    }
    return -1;
}
