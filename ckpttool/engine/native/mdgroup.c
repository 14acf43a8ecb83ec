/* Rows of a .metadata storage table grouped by (fqn string id, offsets tuple id): the index that
 * ckpttool/format/mdstorage.py looks a (fqn, chunk offsets) key up in, built by two stable counting
 * sorts (by tuple id, then by fqn id), O(n + nstr + ntup), no allocation beyond one scratch column. */
#include <stdint.h>
#include <stdlib.h>

/* fqn[i * stride], tup[i * stride] (i < n): ids in [0, nstr) and [-1, ntup) (-1: a byte item).
 * Fills first[nstr + 1] (the rows of fqn id s are order[first[s] .. first[s + 1]]), order[n] (row
 * numbers, within one fqn by ascending tuple id) and tsorted[n] (tup[order[i]]).
 * Returns the number of (fqn, tuple) pairs given more than once, -1 for an id out of range, -2 when
 * out of memory. */
int64_t ckpt_md_group(const int64_t *fqn, const int64_t *tup, int64_t stride, int64_t n, int64_t nstr,
                      int64_t ntup, int64_t *first, int64_t *order, int64_t *tsorted) {
    if (n < 0 || nstr < 0 || ntup < 0 || stride < 1) return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t f = fqn[i * stride], t = tup[i * stride];
        if (f < 0 || f >= nstr || t < -1 || t >= ntup) return -1;
    }
    int64_t *tcount = calloc((size_t)ntup + 2, sizeof(int64_t));
    int64_t *by_tup = malloc(((size_t)n + 1) * sizeof(int64_t));
    if (!tcount || !by_tup) {
        free(tcount);
        free(by_tup);
        return -2;
    }
    for (int64_t i = 0; i < n; i++) tcount[tup[i * stride] + 2]++; /* -1 -> bucket 0 */
    for (int64_t t = 1; t < ntup + 2; t++) tcount[t] += tcount[t - 1];
    for (int64_t i = 0; i < n; i++) by_tup[tcount[tup[i * stride] + 1]++] = i;
    free(tcount);
    for (int64_t s = 0; s <= nstr; s++) first[s] = 0;
    for (int64_t i = 0; i < n; i++) first[fqn[i * stride] + 1]++;
    for (int64_t s = 1; s <= nstr; s++) first[s] += first[s - 1];
    int64_t *cursor = malloc(((size_t)nstr + 1) * sizeof(int64_t));
    if (!cursor) {
        free(by_tup);
        return -2;
    }
    for (int64_t s = 0; s <= nstr; s++) cursor[s] = first[s];
    for (int64_t k = 0; k < n; k++) {
        int64_t i = by_tup[k];
        order[cursor[fqn[i * stride]]++] = i;
    }
    free(cursor);
    free(by_tup);
    int64_t dups = 0;
    for (int64_t k = 0; k < n; k++) tsorted[k] = tup[order[k] * stride];
    for (int64_t s = 0; s < nstr; s++)
        for (int64_t k = first[s] + 1; k < first[s + 1]; k++) dups += tsorted[k] == tsorted[k - 1];
    return dups;
}

/* The record of each query (sid[k], tid[k]) in the index of ckpt_md_group (first[nstr + 1], order,
 * tsorted): rows[k] = the record number, or -1 (no such record; sid -1 or out of range: none).
 * Binary search within the fqn's group. Returns the number of queries not found. */
int64_t ckpt_md_find(const int64_t *first, const int64_t *order, const int64_t *tsorted, int64_t nstr,
                     const int64_t *sid, const int64_t *tid, int64_t nq, int64_t *rows) {
    int64_t missing = 0;
    for (int64_t k = 0; k < nq; k++) {
        int64_t s = sid[k], t = tid[k], r = -1;
        if (s >= 0 && s < nstr) {
            int64_t lo = first[s], hi = first[s + 1];
            while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;
                if (tsorted[mid] < t) lo = mid + 1;
                else hi = mid;
            }
            if (lo < first[s + 1] && tsorted[lo] == t) r = order[lo];
        }
        rows[k] = r;
        missing += r < 0;
    }
    return missing;
}

/* How far each data file must reach: end[p] = the largest offset[i] + length[i] of the records with
 * path[i] == p (0 where none ends past 0), first[p] = the first record ending past 0 (n where none).
 * Ids in [0, npath) (-1 returned otherwise); end[] and first[] hold npath values. */
int64_t ckpt_md_extents(const int64_t *path, const int64_t *offset, const int64_t *length, int64_t n, int64_t npath,
                        int64_t *end, int64_t *first) {
    for (int64_t p = 0; p < npath; p++) {
        end[p] = 0;
        first[p] = n;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t p = path[i];
        if (p < 0 || p >= npath) return -1;
        int64_t e = offset[i] + length[i]; /* both checked >= 0 and their sum within int64 by every builder */
        if (e > end[p]) {
            if (first[p] == n) first[p] = i;
            end[p] = e;
        }
    }
    return 0;
}

/* The columns' checks and conversions of ckpttool/format/mdstorage.py (a parsed-metadata cache entry
 * holds millions of values a column; a Python loop over them makes an int object per value). */

/* out[0] = the smallest, out[1] = the largest of a[0 .. n) (n > 0; nothing written otherwise). */
void ckpt_md_bounds(const int64_t *a, int64_t n, int64_t *out) {
    if (n <= 0) return;
    int64_t lo = a[0], hi = a[0];
    for (int64_t i = 1; i < n; i++) {
        int64_t v = a[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    out[0] = lo;
    out[1] = hi;
}

/* out[i] = a[i] as a 32-bit int (i < n). Returns the number of values outside the 32-bit range
 * (their out[i] are left unspecified). */
int64_t ckpt_md_narrow(const int64_t *a, int64_t n, int32_t *out) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = a[i];
        bad += v < INT32_MIN || v > INT32_MAX;
        out[i] = (int32_t)v;
    }
    return bad;
}

/* out[i] = a[i] (i < n), 32 to 64 bits. */
void ckpt_md_widen(const int32_t *a, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i];
}

/* The largest offset[i] + length[i] (i < n; 0 when n == 0), or -1 when an offset or a length is
 * negative. Both are below 2^63, so their sum fits in 64 unsigned bits; a sum past INT64_MAX is
 * returned as INT64_MAX. */
int64_t ckpt_md_end(const int64_t *offset, const int64_t *length, int64_t n) {
    uint64_t end = 0;
    for (int64_t i = 0; i < n; i++) {
        if (offset[i] < 0 || length[i] < 0) return -1;
        uint64_t e = (uint64_t)offset[i] + (uint64_t)length[i];
        end = e > end ? e : end;
    }
    return end > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)end;
}
