/* A restricted reader of DCP `.metadata` pickles into int columns (ckpttool/format/mdscan.py).
 *
 * It runs the subset of the pickle machine (protocols 2-5) that pickle.dump writes for torch's
 * Metadata dataclasses, with CPython's own stack/mark/memo rules, and resolves only the globals
 * that ckpttool's allow-list unpickler resolves to records (ckpttool/format/unpickler.py). It
 * never builds Python objects: values are 16-byte cells on the stack and in the memo, packed into 8 bytes in the
 * arena and the records' fields (exactly, a value that does not fit kept beside), and the result is a set of
 * int64 columns (entries, chunks, storage items, planner paths, distinct shapes) that name strings
 * by their offset in a pool of the strings' bytes, copied as they are read: the input is read once, front to back,
 * after a first pass that marks the memo slots read again, and with `drop` its pages are released behind the parse. Every read is bounds-checked and every length is checked against
 * what remains, and no read crosses the end of the FRAME it starts in. Anything it does not
 * recognise, or that the unpickler would refuse, returns a non-zero code and no columns: the caller then runs the unpickler, which gives its own result or
 * message. So a stream it accepts is one the unpickler accepts with the same values.
 */
#define _DEFAULT_SOURCE /* madvise */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* T_SHAPE: a tuple of 1 to 64 ints in 0..2^62, interned at TUPLE as a shape id (a: id, b: length), no cells */
enum { T_EMPTY, T_INT, T_STR, T_NONE, T_BOOL, T_TUPLE, T_LIST, T_DICT, T_REC, T_GLOBAL, T_INERT, T_PATH, T_SHAPE, T_SIDE = 15 };
enum { K_MD, K_TSM, K_TP, K_CSM, K_BSM, K_MI, K_SI, K_SM, N_KINDS };
enum { G_SIZE = N_KINDS, G_LAYOUT, G_MEMFMT, G_PATH, G_DTYPE };

typedef struct { int64_t a; uint32_t b; uint32_t t; } val;
typedef struct { int64_t start; int32_t n; int32_t next; } seg;
typedef struct { int32_t head, tail; int64_t count; uint8_t escaped, consumed, frozen, walked, memod; } cont;
/* fstart: the first field cell, in `fields` (wide) or `fields8`; -1 until BUILD */
typedef struct { int32_t fstart; uint8_t kind, built, keyed, wide; } rec;

#define ARR(T) struct { T *p; int64_t n, cap; }
typedef ARR(val) vals;
typedef ARR(int64_t) i64s;

static int grow(void **p, int64_t *cap, int64_t need, size_t sz) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * sz);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}
#define PUSH(arr, v) (grow((void **)&(arr).p, &(arr).cap, (arr).n + 1, sizeof(*(arr).p)) ? -1 : ((arr).p[(arr).n++] = (v), 0))

static const int NFIELDS[N_KINDS] = {5, 3, 1, 2, 0, 2, 4, 2};
static const char *FIELDS[N_KINDS][5] = {
    {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"},
    {"properties", "size", "chunks"},
    {"dtype"},
    {"offsets", "sizes"},
    {0},
    {"fqn", "offset"},
    {"relative_path", "offset", "length", "transform_descriptors"},
    {"checkpoint_id", "save_id"},
};

typedef struct {
    const uint8_t *d;
    int64_t len, pos;
    vals stack, memo, fields;
    ARR(uint64_t) fields8; /* a record's fields where each fits 8 bytes (pack), else 16-byte cells in `fields` */
    ARR(uint64_t) arena;   /* container and tuple items, packed (put/AR): 8 bytes a cell, `side` for what does not fit */
    vals side;
    i64s marks;
    /* the memo: a slot is kept only where a GET names it (pass one marks `ref`); `filled` counts every
     * slot written (MEMOIZE's index), `rank` maps a referenced slot to its cell in `memo` */
    uint64_t *ref, *filled;
    int64_t ref_words, filled_words, arena_pin;
    int32_t *rank;
    ARR(seg) segs;
    ARR(cont) conts;
    ARR(rec) recs;
    const char *dtypes;
    int64_t dtypes_len, memo_len;
    int64_t fend; /* the end of the last FRAME's bytes (0: none yet); see NEED */
    int64_t values_left; /* output values the caller allows (a cap on what shared references can multiply) */
    /* a string's bytes are copied here as it is read (cells name strings by their offset in it), so nothing
     * reads the input behind the opcode being read: with `drop`, its pages are released as the parse passes them */
    ARR(uint8_t) pool;
    int drop;
    int olmo_writer; /* the stream resolved OLMo-core's _StorageInfo global */
    uintptr_t drop_from, drop_to; /* the input's pages in [drop_from, drop_to) are released */
    int64_t drop_next;  /* input offset of the next release */
    /* output */
    i64s shapes, ints, ent, chk, sto, pln, pit, top;
    int64_t *hash, *shash;
    int64_t hcap, scap;
    i64s strs;
} st;

/* The columns handed to Python (ckpttool/format/mdscan.py reads them; ckpt_mdscan_free frees them). */
#define N_COLS 9
typedef struct {
    int64_t *cols[N_COLS];
    int64_t lens[N_COLS];
    uint8_t *pool;   /* the strings' bytes (the strings column's offsets are into it); ckpt_mdscan_free_pool frees it */
    int64_t pool_len;
    int64_t dropped; /* input bytes released (with `drop`), also when the parse is declined */
} mdscan_out;

#define FAIL(code) return (code)
/* a read of n bytes at pos: within the input, and not across the end of the FRAME it starts in (fend). The C
 * unpickler reading a file holds a frame's bytes as its buffer and, for a read across their end, skips their rest;
 * pickle.loads reads on: the unpickler path refuses such a read (ckpttool/format/pickleframes.py), so it is declined */
#define NEED(n) \
    if ((int64_t)(n) < 0 || s->len - s->pos < (int64_t)(n) || (s->pos < s->fend && s->fend - s->pos < (int64_t)(n))) FAIL(2)

static int64_t fence(st *s) { return s->marks.n ? s->marks.p[s->marks.n - 1] : 0; }

static int push(st *s, val v) { return PUSH(s->stack, v) ? 9 : 0; }

static int pop(st *s, val *out) {
    if (s->stack.n <= fence(s)) FAIL(3);
    *out = s->stack.p[--s->stack.n];
    return 0;
}

static uint64_t rd(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* UTF-8 as Python decodes it with "surrogatepass": encoded surrogates allowed, nothing else loose. */
static int utf8_ok(const uint8_t *p, int64_t n) {
    int64_t i = 0;
    while (i < n) {
        uint8_t c = p[i];
        if (c < 0x80) { i++; continue; }
        int k;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) { k = 1; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { k = 2; cp = c & 0x0F; }
        else if (c >= 0xF0 && c <= 0xF4) { k = 3; cp = c & 0x07; }
        else return 0;
        if (n - i <= k) return 0;
        for (int j = 1; j <= k; j++) {
            if ((p[i + j] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (p[i + j] & 0x3F);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
        i += k + 1;
    }
    return 1;
}

static int str_is(st *s, val v, const char *lit) {
    size_t n = strlen(lit);
    return v.t == T_STR && v.b == n && memcmp(s->pool.p + v.a, lit, n) == 0;
}

static int global_id(st *s, val mod, val name) {
    static const char *DCP = "torch.distributed.checkpoint.metadata";
    static const char *SHARD = "torch.distributed._shard.sharded_tensor.metadata";
    if (str_is(s, mod, DCP)) {
        if (str_is(s, name, "Metadata")) return K_MD;
        if (str_is(s, name, "TensorStorageMetadata")) return K_TSM;
        if (str_is(s, name, "TensorProperties")) return K_TP;
        if (str_is(s, name, "ChunkStorageMetadata")) return K_CSM;
        if (str_is(s, name, "BytesStorageMetadata")) return K_BSM;
        if (str_is(s, name, "MetadataIndex")) return K_MI;
        if (str_is(s, name, "StorageMeta")) return K_SM;
        if (str_is(s, name, "_MEM_FORMAT_ENCODING")) return G_MEMFMT;
        return -1;
    }
    if (str_is(s, mod, SHARD)) {
        if (str_is(s, name, "TensorProperties")) return K_TP;
        if (str_is(s, name, "MEM_FORMAT_ENCODING")) return G_MEMFMT;
        return -1;
    }
    if (str_is(s, mod, "torch.distributed.checkpoint.filesystem"))
        return str_is(s, name, "_StorageInfo") ? K_SI : -1;
    if (str_is(s, mod, "olmo_core.distributed.checkpoint.filesystem")) {
        /* OLMo-core's RemoteFileSystemWriter: torch's fields; the writer is reported (top column) */
        if (!str_is(s, name, "_StorageInfo")) return -1;
        s->olmo_writer = 1;
        return K_SI;
    }
    if (str_is(s, mod, "torch.serialization")) return str_is(s, name, "_get_layout") ? G_LAYOUT : -1;
    if (str_is(s, mod, "pathlib"))
        return (str_is(s, name, "PosixPath") || str_is(s, name, "WindowsPath") || str_is(s, name, "PurePosixPath"))
                   ? G_PATH : -1;
    if (str_is(s, mod, "torch")) {
        if (str_is(s, name, "Size")) return G_SIZE;
        /* a dtype of the list the caller passed: names separated by '\n' */
        int64_t i = 0, idx = 0;
        while (i < s->dtypes_len) {
            int64_t j = i;
            while (j < s->dtypes_len && s->dtypes[j] != '\n') j++;
            if (j - i == (int64_t)name.b && memcmp(s->dtypes + i, s->pool.p + name.a, name.b) == 0) return G_DTYPE + (int)idx;
            i = j + 1;
            idx++;
        }
    }
    return -1;
}

/* A cell in 8 bytes where its value fits: the type in bits 0-3, bit 4 the layout, then either `a` as a signed
 * 59-bit int (b == 0) or `a` in 35 bits and `b` in 24 bits. unpack gives back the very cell; a value that does not
 * fit returns 0 (a record keeps its 16-byte cells, an arena cell is kept in `side`). Records' fields and the arena are
 * most of the cells at 10^6 entries (8 fields and ~5 arena cells a chunk). */
static int pack(val v, uint64_t *out) {
    if (v.t > 15) return 0;
    if (v.b == 0) {
        if (v.a < -((int64_t)1 << 58) || v.a >= ((int64_t)1 << 58)) return 0;
        *out = ((uint64_t)v.a << 5) | v.t;
        return 1;
    }
    if (v.a < 0 || v.a >= ((int64_t)1 << 35) || v.b >= (1u << 24)) return 0;
    *out = ((uint64_t)v.a << 29) | ((uint64_t)v.b << 5) | 16u | v.t;
    return 1;
}

static val unpack(uint64_t x) {
    uint32_t t = (uint32_t)(x & 15);
    if (!(x & 16)) return (val){(int64_t)x >> 5, 0, t};
    return (val){(int64_t)(x >> 29), (uint32_t)((x >> 5) & 0xFFFFFF), t};
}

/* the arena cell of v: packed, or (T_SIDE) the index of a copy in `side` */
static int put(st *s, val v, uint64_t *out) {
    if (pack(v, out)) return 0;
    if (PUSH(s->side, v)) FAIL(9);
    return pack((val){s->side.n - 1, 0, T_SIDE}, out) ? 0 : 9;
}

static val AR(const st *s, int64_t i) {
    val v = unpack(s->arena.p[i]);
    return v.t == T_SIDE ? s->side.p[v.a] : v;
}

/* cells stack[x:x+n] appended to the arena */
static int arena_put(st *s, int64_t x, int64_t n) {
    int64_t start = s->arena.n;
    if (grow((void **)&s->arena.p, &s->arena.cap, start + n, sizeof(uint64_t))) FAIL(9);
    for (int64_t i = 0; i < n; i++)
        if (put(s, s->stack.p[x + i], s->arena.p + start + i)) FAIL(9);
    s->arena.n += n;
    return 0;
}

static int new_cont(st *s, uint32_t t) {
    cont c = {-1, -1, 0, 0, 0, 0, 0, 0};
    if (PUSH(s->conts, c)) FAIL(9);
    return push(s, (val){s->conts.n - 1, 0, t});
}

/* append stack[x:] to container v (2 cells per item for a dict), then drop them from the stack */
static int extend(st *s, val v, int64_t x, uint32_t want) {
    if (v.t != want) FAIL(4);
    cont *c = &s->conts.p[v.a];
    if (c->consumed || c->frozen) FAIL(4);
    int64_t n = s->stack.n - x;
    if (want == T_DICT && (n % 2)) FAIL(4);
    for (int64_t i = x; want == T_DICT && i < s->stack.n; i += 2) {
        uint32_t kt = s->stack.p[i].t;
        if (kt != T_STR && kt != T_REC) FAIL(4); /* keys: str or a record (hashed by identity) */
    }
    if (n) {
        if (n > INT32_MAX) FAIL(4);
        int64_t start = s->arena.n;
        if (arena_put(s, x, n)) FAIL(9);
        seg g = {start, (int32_t)n, -1};
        if (PUSH(s->segs, g)) FAIL(9);
        c = &s->conts.p[v.a];
        if (c->tail >= 0) s->segs.p[c->tail].next = (int32_t)(s->segs.n - 1);
        else c->head = (int32_t)(s->segs.n - 1);
        c->tail = (int32_t)(s->segs.n - 1);
        if (s->segs.n > INT32_MAX - 2) FAIL(9);
        c->count += want == T_DICT ? n / 2 : n;
    }
    s->stack.n = x;
    return 0;
}

/* SETITEMS/APPENDS (marked: the items above the last mark) and SETITEM/APPEND (one key-value pair or
 * item): extend the dict (want T_DICT) or list (T_LIST) below the items with them */
static int op_extend(st *s, int marked, uint32_t want) {
    int64_t x;
    if (marked) {
        if (!s->marks.n) FAIL(3);
        x = s->marks.p[--s->marks.n];
    } else {
        x = s->stack.n - (want == T_DICT ? 2 : 1);
    }
    if (x > s->stack.n || x <= fence(s) || x < 1) FAIL(3);
    return extend(s, s->stack.p[x - 1], x, want);
}

static int shape_cells(st *s, const val *a, int64_t n, int64_t *out);

static int op_tuple(st *s, int64_t x) {
    if (x < fence(s) || x > s->stack.n) FAIL(3);
    int64_t n = s->stack.n - x, start = s->arena.n;
    if (n > INT32_MAX) FAIL(4);
    int shape = n >= 1 && n <= 64;
    for (int64_t i = x; shape && i < s->stack.n; i++)
        shape = s->stack.p[i].t == T_INT && s->stack.p[i].a >= 0 && s->stack.p[i].a <= ((int64_t)1 << 62);
    if (shape) { /* a shape (torch.Size's tuple, chunk offsets): one row of the shape table, no cells */
        int64_t id;
        if (shape_cells(s, s->stack.p + x, n, &id)) FAIL(9);
        s->stack.n = x;
        return push(s, (val){id, (uint32_t)n, T_SHAPE});
    }
    if (arena_put(s, x, n)) FAIL(9);
    s->stack.n = x;
    return push(s, (val){n ? start : 0, (uint32_t)n, T_TUPLE});
}

static int op_reduce(st *s) {
    val args, fn;
    int r;
    if ((r = pop(s, &args)) || (r = pop(s, &fn))) return r;
    if (args.t == T_SHAPE && fn.t == T_GLOBAL && fn.a == G_MEMFMT && args.b == 1) return push(s, (val){0, 0, T_INERT});
    if (args.t != T_TUPLE || fn.t != T_GLOBAL) FAIL(5);
    val a0 = args.b ? AR(s, args.a) : (val){0, 0, T_EMPTY};
    switch (fn.a) {
    case G_SIZE: { /* tuple(t) of a tuple is t itself */
        if (args.b != 1 || (a0.t != T_TUPLE && a0.t != T_SHAPE)) FAIL(5);
        val t = a0;
        if (args.a >= s->arena_pin && args.a + 1 == s->arena.n) s->arena.n--; /* the args cell: no memo slot kept it */
        return push(s, t);
    }
    case G_LAYOUT:
        if (args.b != 1 || a0.t != T_STR || a0.b > 64 || a0.b < 6 || memcmp(s->pool.p + a0.a, "torch.", 6)) FAIL(5);
        for (uint32_t i = 0; i < a0.b; i++)
            if (s->pool.p[a0.a + i] >= 0x80) FAIL(5);
        return push(s, (val){0, 0, T_INERT});
    case G_MEMFMT:
        if (args.b > 1 || (args.b == 1 && a0.t != T_INT)) FAIL(5);
        return push(s, (val){0, 0, T_INERT});
    case G_PATH:
        for (uint32_t i = 0; i < args.b; i++)
            if (AR(s, args.a + i).t != T_STR) FAIL(5);
        return push(s, (val){args.a, args.b, T_PATH});
    }
    FAIL(5);
}

static int op_newobj(st *s) {
    val args, cls;
    int r;
    if ((r = pop(s, &args)) || (r = pop(s, &cls))) return r;
    if (args.t != T_TUPLE || args.b != 0 || cls.t != T_GLOBAL || cls.a >= N_KINDS) FAIL(6);
    rec rc = {-1, (uint8_t)cls.a, 0, 0, 0};
    if (PUSH(s->recs, rc)) FAIL(9);
    return push(s, (val){s->recs.n - 1, 0, T_REC});
}

/* the nf fields f of record rc: 8 bytes each where every one fits, else 16-byte cells */
static int store_fields(st *s, rec *rc, const val *f, int nf) {
    uint64_t w[5];
    int narrow = 1;
    for (int i = 0; i < nf && narrow; i++) narrow = pack(f[i], &w[i]);
    if (narrow) {
        int64_t fs = s->fields8.n;
        if (fs > INT32_MAX - 8) FAIL(9);
        if (grow((void **)&s->fields8.p, &s->fields8.cap, fs + (nf ? nf : 1), sizeof(uint64_t))) FAIL(9);
        if (nf) memcpy(s->fields8.p + fs, w, (size_t)nf * sizeof(uint64_t));
        s->fields8.n += nf;
        rc->fstart = (int32_t)fs;
        rc->wide = 0;
        return 0;
    }
    int64_t fs = s->fields.n;
    if (fs > INT32_MAX - 8) FAIL(9);
    if (grow((void **)&s->fields.p, &s->fields.cap, fs + nf, sizeof(val))) FAIL(9);
    memcpy(s->fields.p + fs, f, (size_t)nf * sizeof(val));
    s->fields.n += nf;
    rc->fstart = (int32_t)fs;
    rc->wide = 1;
    return 0;
}

static int op_build(st *s) {
    val state;
    int r;
    if ((r = pop(s, &state))) return r;
    if (s->stack.n <= fence(s)) FAIL(3);
    val inst = s->stack.p[s->stack.n - 1];
    if (inst.t != T_REC) FAIL(7);
    rec *rc = &s->recs.p[inst.a];
    if (rc->built) FAIL(7);
    int nf = NFIELDS[rc->kind];
    val fv[5];
    for (int i = 0; i < nf; i++) fv[i] = (val){0, 0, T_EMPTY};
    rc->built = 1;
    if (rc->kind == K_TP) { /* TensorProperties.__setstate__: a tuple (dtype, layout, ...) */
        if (state.t != T_TUPLE || state.b < 1) FAIL(7);
        fv[0] = AR(s, state.a);
        return store_fields(s, rc, fv, nf);
    }
    if (state.t != T_DICT) FAIL(7);
    cont *c = &s->conts.p[state.a];
    if (c->consumed) FAIL(7);
    for (int32_t g = c->head; g >= 0; g = s->segs.p[g].next) {
        seg *sg = &s->segs.p[g];
        for (int64_t i = 0; i < sg->n; i += 2) {
            val k = AR(s, sg->start + i);
            if (k.t != T_STR) FAIL(7);
            for (int f = 0; f < nf; f++)
                if (str_is(s, k, FIELDS[rc->kind][f])) fv[f] = AR(s, sg->start + i + 1);
        }
    }
    if ((r = store_fields(s, rc, fv, nf))) return r;
    if (c->escaped) {
        c->frozen = 1; /* copied into the record: a later change would not be seen there */
        return 0;
    }
    c->consumed = 1; /* a later reference to it is not followed: its cells are reused */
    if (c->head >= 0 && c->head == c->tail && c->tail == s->segs.n - 1) {
        seg *sg = &s->segs.p[c->tail];
        if (sg->start + sg->n == s->arena.n) {
            s->arena.n = sg->start;
            s->segs.n--;
        }
    }
    /* the last dict made, held by nothing else (no kept memo slot; not escaped): its slot is reused */
    if (state.a == s->conts.n - 1 && !c->memod && (c->head < 0 || c->head >= s->segs.n)) s->conts.n--;
    return 0;
}

static int bit(const uint64_t *w, int64_t words, int64_t i) { return i >= 0 && (i >> 6) < words && ((w[i >> 6] >> (i & 63)) & 1); }

static int set_bit(uint64_t **w, int64_t *words, int64_t i) {
    int64_t need = (i >> 6) + 1;
    if (need > *words) {
        int64_t c = *words ? *words : 64;
        while (c < need) c *= 2;
        uint64_t *q = realloc(*w, (size_t)c * sizeof(uint64_t));
        if (!q) return -1;
        memset(q + *words, 0, (size_t)(c - *words) * sizeof(uint64_t));
        *w = q;
        *words = c;
    }
    (*w)[i >> 6] |= (uint64_t)1 << (i & 63);
    return 0;
}

static int64_t memo_cell(st *s, int64_t i) { /* the cell of referenced slot i */
    uint64_t below = s->ref[i >> 6] & (((uint64_t)1 << (i & 63)) - 1);
    return s->rank[i >> 6] + __builtin_popcountll(below);
}

static int op_get(st *s, int64_t i) {
    if (!bit(s->filled, s->filled_words, i)) FAIL(8);
    val v = s->memo.p[memo_cell(s, i)];
    if (v.t == T_DICT || v.t == T_LIST) {
        cont *c = &s->conts.p[v.a];
        if (c->consumed) FAIL(8);
        c->escaped = 1;
    }
    return push(s, v);
}

static int op_put(st *s, int64_t i) {
    if (s->stack.n <= fence(s)) FAIL(3);
    if (i < 0 || i > s->len) FAIL(8);
    if (!bit(s->filled, s->filled_words, i)) {
        if (set_bit(&s->filled, &s->filled_words, i)) FAIL(9);
        s->memo_len++;
    }
    if (!bit(s->ref, s->ref_words, i)) return 0; /* never read again: not kept */
    val v = s->stack.p[s->stack.n - 1];
    s->memo.p[memo_cell(s, i)] = v;
    if (v.t == T_DICT || v.t == T_LIST) s->conts.p[v.a].memod = 1;
    if ((v.t == T_TUPLE || v.t == T_PATH) && v.a + v.b > s->arena_pin) s->arena_pin = v.a + v.b;
    return 0;
}

/* the n bytes of a string at pos, copied to the pool: the offset of the copy in *at */
static int pool_add(st *s, int64_t n, int64_t *at) {
    if (grow((void **)&s->pool.p, &s->pool.cap, s->pool.n + n, 1)) FAIL(9);
    if (n) memcpy(s->pool.p + s->pool.n, s->d + s->pos, (size_t)n);
    *at = s->pool.n;
    s->pool.n += n;
    return 0;
}

static int op_str(st *s, int64_t n) {
    NEED(n);
    if (n > UINT32_MAX || !utf8_ok(s->d + s->pos, n)) FAIL(2);
    int64_t at;
    if (pool_add(s, n, &at)) FAIL(9);
    int r = push(s, (val){at, (uint32_t)n, T_STR});
    s->pos += n;
    return r;
}

static int op_global_line(st *s, val *out) {
    int64_t i = s->pos;
    while (i < s->len && s->d[i] != '\n') i++;
    if (i >= s->len || (s->pos < s->fend && i >= s->fend)) FAIL(2); /* the line and its '\n' inside the frame */
    if (i - s->pos > 1024 || !utf8_ok(s->d + s->pos, i - s->pos)) FAIL(2);
    int64_t at;
    if (pool_add(s, i - s->pos, &at)) FAIL(9);
    *out = (val){at, (uint32_t)(i - s->pos), T_STR};
    s->pos = i + 1;
    return 0;
}

static int global_push(st *s, val mod, val name) {
    int g = global_id(s, mod, name);
    if (g < 0) FAIL(10);
    return push(s, (val){g, 0, T_GLOBAL});
}

static int step(st *s, uint8_t op) {
    val a, b;
    int r;
    switch (op) {
    case 0x80: NEED(1); if (s->d[s->pos] < 2 || s->d[s->pos] > 5) FAIL(2); s->pos++; return 0; /* PROTO */
    case 0x95: { /* FRAME: its bytes are there; one inside another's bytes ends within them (the C unpickler's
                  * buffer stays the outer frame's), else its bytes are the next buffer */
        NEED(8);
        uint64_t n = rd(s->d + s->pos, 8);
        s->pos += 8;
        if (n > (uint64_t)(s->len - s->pos)) FAIL(2);
        if (s->pos < s->fend) {
            if ((int64_t)n > s->fend - s->pos) FAIL(2);
        } else {
            s->fend = s->pos + (int64_t)n;
        }
        return 0;
    }
    case '(': return PUSH(s->marks, s->stack.n) ? 9 : 0;
    case ')': return push(s, (val){0, 0, T_TUPLE});
    case 0x85: return op_tuple(s, s->stack.n - 1);
    case 0x86: return op_tuple(s, s->stack.n - 2);
    case 0x87: return op_tuple(s, s->stack.n - 3);
    case 't': if (!s->marks.n) FAIL(3); return op_tuple(s, s->marks.p[--s->marks.n]);
    case '}': return new_cont(s, T_DICT);
    case ']': return new_cont(s, T_LIST);
    case 's': return op_extend(s, 0, T_DICT);
    case 'u': return op_extend(s, 1, T_DICT);
    case 'a': return op_extend(s, 0, T_LIST);
    case 'e': return op_extend(s, 1, T_LIST);
    case 'K': NEED(1); r = push(s, (val){s->d[s->pos], 0, T_INT}); s->pos += 1; return r;
    case 'M': NEED(2); r = push(s, (val){(int64_t)rd(s->d + s->pos, 2), 0, T_INT}); s->pos += 2; return r;
    case 'J': NEED(4); r = push(s, (val){(int32_t)(uint32_t)rd(s->d + s->pos, 4), 0, T_INT}); s->pos += 4; return r;
    case 0x8a: { /* LONG1: little-endian two's complement, up to 8 bytes here */
        NEED(1);
        int n = s->d[s->pos++];
        if (n > 8) FAIL(2);
        NEED(n);
        uint64_t u = rd(s->d + s->pos, n);
        if (n && n < 8 && (s->d[s->pos + n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
        s->pos += n;
        return push(s, (val){(int64_t)u, 0, T_INT});
    }
    case 'N': return push(s, (val){0, 0, T_NONE});
    case 0x88: return push(s, (val){1, 0, T_BOOL});
    case 0x89: return push(s, (val){0, 0, T_BOOL});
    case 0x8c: NEED(1); s->pos++; return op_str(s, s->d[s->pos - 1]);
    case 'X': NEED(4); s->pos += 4; return op_str(s, (int64_t)rd(s->d + s->pos - 4, 4));
    case 0x8d: { NEED(8); uint64_t n = rd(s->d + s->pos, 8); s->pos += 8; if (n > (uint64_t)INT64_MAX) FAIL(2); return op_str(s, (int64_t)n); }
    case 0x93:
        if ((r = pop(s, &b)) || (r = pop(s, &a))) return r;
        if (a.t != T_STR || b.t != T_STR) FAIL(10);
        return global_push(s, a, b);
    case 'c':
        if ((r = op_global_line(s, &a)) || (r = op_global_line(s, &b))) return r;
        return global_push(s, a, b);
    case 'R': return op_reduce(s);
    case 0x81: return op_newobj(s);
    case 'b': return op_build(s);
    case 0x94: return op_put(s, s->memo_len);
    case 'q': NEED(1); s->pos++; return op_put(s, s->d[s->pos - 1]);
    case 'r': NEED(4); s->pos += 4; return op_put(s, (int64_t)rd(s->d + s->pos - 4, 4));
    case 'h': NEED(1); s->pos++; return op_get(s, s->d[s->pos - 1]);
    case 'j': NEED(4); s->pos += 4; return op_get(s, (int64_t)rd(s->d + s->pos - 4, 4));
    }
    FAIL(11);
}

/* Pass one: the memo slots a GET names (`ref`), so that pass two keeps only those (pickle memoizes
 * every tuple, record and torch.Size; a fraction is read again). It reads each opcode's argument
 * lengths as `step` does; a stream it cannot follow is refused as `step` would refuse it. */
static int mark_refs(st *s) {
    int64_t p = 0, len = s->len;
    const uint8_t *d = s->d;
#define SKIP(n) do { if ((int64_t)(n) < 0 || len - p < (int64_t)(n)) FAIL(2); p += (int64_t)(n); } while (0)
    while (1) {
        if (p >= len) FAIL(2);
        uint8_t op = d[p++];
        int64_t i;
        switch (op) {
        case '.': goto done;
        case 0x80: case 'K': case 'q': SKIP(1); break;
        case 0x95: SKIP(8); break;
        case 'M': SKIP(2); break;
        case 'J': case 'r': SKIP(4); break;
        case '(': case ')': case 0x85: case 0x86: case 0x87: case 't': case '}': case ']': case 's': case 'u':
        case 'a': case 'e': case 'N': case 0x88: case 0x89: case 0x93: case 'R': case 0x81: case 'b': case 0x94: break;
        case 0x8a: case 0x8c: SKIP(1); SKIP(d[p - 1]); break;
        case 'X': SKIP(4); SKIP(rd(d + p - 4, 4)); break;
        case 0x8d: { SKIP(8); uint64_t n = rd(d + p - 8, 8); if (n > (uint64_t)INT64_MAX) FAIL(2); SKIP(n); break; }
        case 'c':
            for (int line = 0; line < 2; line++) {
                while (p < len && d[p] != '\n') p++;
                SKIP(1);
            }
            break;
        case 'h': SKIP(1); i = d[p - 1]; goto mark;
        case 'j': SKIP(4); i = (int64_t)rd(d + p - 4, 4); goto mark;
        default: FAIL(11);
        }
        continue;
    mark:
        if (i > len) FAIL(8); /* never a filled slot */
        if (set_bit(&s->ref, &s->ref_words, i)) FAIL(9);
    }
#undef SKIP
done:
    s->rank = malloc((size_t)(s->ref_words ? s->ref_words : 1) * sizeof(int32_t));
    if (!s->rank) FAIL(9);
    int64_t n = 0;
    for (int64_t w = 0; w < s->ref_words; w++) {
        if (n > INT32_MAX) FAIL(9);
        s->rank[w] = (int32_t)n;
        n += __builtin_popcountll(s->ref[w]);
    }
    s->memo.p = calloc((size_t)(n ? n : 1), sizeof(val)); /* T_EMPTY cells */
    if (!s->memo.p) FAIL(9);
    s->memo.n = s->memo.cap = n;
    return 0;
}

/* ------------------------------------------------------------------ the walk into columns */

static uint64_t mix(uint64_t h) { /* splitmix64's finaliser: every input bit reaches the low bits */
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ULL;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
    return h ^ (h >> 31);
}

static int shape_id(st *s, val v, int64_t *out) {
    if (v.t == T_SHAPE) {
        *out = v.a;
        return 0;
    }
    if (v.t != T_TUPLE || v.b > 64) FAIL(20);
    val a[64];
    for (uint32_t i = 0; i < v.b; i++) a[i] = AR(s, v.a + i);
    return shape_cells(s, a, v.b, out);
}

/* the id of the shape of the n cells at a (ints in 0..2^62, n <= 64) in the shape table */
static int shape_cells(st *s, const val *a, int64_t n, int64_t *out) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)n;
    for (int64_t i = 0; i < n; i++) {
        if (a[i].t != T_INT || a[i].a < 0 || a[i].a > ((int64_t)1 << 62)) FAIL(20);
        h = (h ^ (uint64_t)a[i].a) * 1099511628211ULL;
    }
    if (s->shapes.n * 2 >= s->hcap) { /* rehash at half full */
        int64_t cap = s->hcap ? s->hcap * 2 : 4096;
        int64_t *t = malloc((size_t)cap * sizeof(int64_t));
        if (!t) FAIL(9);
        for (int64_t i = 0; i < cap; i++) t[i] = -1;
        for (int64_t id = 0; id < s->shapes.n / 2; id++) {
            int64_t st0 = s->shapes.p[2 * id], m = s->shapes.p[2 * id + 1];
            uint64_t hh = 1469598103934665603ULL ^ (uint64_t)m;
            for (int64_t i = 0; i < m; i++) hh = (hh ^ (uint64_t)s->ints.p[st0 + i]) * 1099511628211ULL;
            uint64_t j = mix(hh) & (uint64_t)(cap - 1);
            while (t[j] >= 0) j = (j + 1) & (uint64_t)(cap - 1);
            t[j] = id;
        }
        free(s->hash);
        s->hash = t;
        s->hcap = cap;
    }
    uint64_t j = mix(h) & (uint64_t)(s->hcap - 1);
    for (; s->hash[j] >= 0; j = (j + 1) & (uint64_t)(s->hcap - 1)) {
        int64_t id = s->hash[j], st0 = s->shapes.p[2 * id];
        if (s->shapes.p[2 * id + 1] != n) continue;
        int64_t i = 0;
        while (i < n && s->ints.p[st0 + i] == a[i].a) i++;
        if (i == n) { *out = id; return 0; }
    }
    int64_t id = s->shapes.n / 2;
    if (PUSH(s->shapes, s->ints.n) || PUSH(s->shapes, n)) FAIL(9);
    for (int64_t i = 0; i < n; i++)
        if (PUSH(s->ints, a[i].a)) FAIL(9);
    s->hash[j] = id;
    *out = id;
    return 0;
}

static uint64_t str_hash(st *s, int64_t off, int64_t n) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)n;
    for (int64_t i = 0; i < n; i++) h = (h ^ s->pool.p[off + i]) * 1099511628211ULL;
    return mix(h);
}

/* the id of string v in the string table: one row (offset and length of its first occurrence) per distinct
 * string, so equal strings (a data file's name in every storage record) are decoded once */
static int str_id(st *s, val v, int64_t *out) {
    if (v.t != T_STR) FAIL(20);
    if (s->strs.n >= s->scap) { /* rehash at half full */
        int64_t cap = s->scap ? s->scap * 2 : 4096;
        int64_t *t = malloc((size_t)cap * sizeof(int64_t));
        if (!t) FAIL(9);
        for (int64_t i = 0; i < cap; i++) t[i] = -1;
        for (int64_t id = 0; id < s->strs.n / 2; id++) {
            uint64_t j = str_hash(s, s->strs.p[2 * id], s->strs.p[2 * id + 1]) & (uint64_t)(cap - 1);
            while (t[j] >= 0) j = (j + 1) & (uint64_t)(cap - 1);
            t[j] = id;
        }
        free(s->shash);
        s->shash = t;
        s->scap = cap;
    }
    uint64_t j = str_hash(s, v.a, v.b) & (uint64_t)(s->scap - 1);
    for (; s->shash[j] >= 0; j = (j + 1) & (uint64_t)(s->scap - 1)) {
        int64_t id = s->shash[j], off = s->strs.p[2 * id];
        /* the length first: an empty string's pool offset is the next string's */
        if (s->strs.p[2 * id + 1] == v.b && (off == v.a || memcmp(s->pool.p + off, s->pool.p + v.a, v.b) == 0)) {
            *out = id;
            return 0;
        }
    }
    int64_t id = s->strs.n / 2;
    if (PUSH(s->strs, v.a) || PUSH(s->strs, (int64_t)v.b)) FAIL(9);
    s->shash[j] = id;
    *out = id;
    return 0;
}

#define SID(v, var) if (str_id(s, v, &var)) FAIL(20)

static val field(st *s, val r, int f) {
    const rec *rc = &s->recs.p[r.a];
    return rc->wide ? s->fields.p[rc->fstart + f] : unpack(s->fields8.p[rc->fstart + f]);
}

static int is_rec(st *s, val v, int kind) { return v.t == T_REC && s->recs.p[v.a].kind == kind && s->recs.p[v.a].built; }

#define EMIT(col, x) do { if (--s->values_left < 0) FAIL(28); if (PUSH(s->col, (int64_t)(x))) FAIL(9); } while (0)

/* a chunk (offsets, sizes shape ids) inside its tensor (size shape id): the unpickler's conversion refuses any other */
static int chunk_inside(st *s, int64_t size, int64_t off, int64_t sz) {
    int64_t n = s->shapes.p[2 * size + 1];
    if (s->shapes.p[2 * off + 1] != n || s->shapes.p[2 * sz + 1] != n) return 0;
    const int64_t *d = s->ints.p + s->shapes.p[2 * size], *o = s->ints.p + s->shapes.p[2 * off], *z = s->ints.p + s->shapes.p[2 * sz];
    for (int64_t i = 0; i < n; i++)
        if (z[i] > d[i] || o[i] > d[i] - z[i]) return 0; /* all >= 0: no overflow, even at 2^62 + 2^62 */
    return 1;
}

static int walk_tensor(st *s, val key, val r) {
    int64_t size, id2, chunk0 = s->chk.n / 2;
    val props = field(s, r, 0), chunks = field(s, r, 2);
    if (!is_rec(s, props, K_TP) || chunks.t != T_LIST) FAIL(21);
    val dt = field(s, props, 0);
    if (dt.t != T_GLOBAL || dt.a < G_DTYPE) FAIL(21);
    if (shape_id(s, field(s, r, 1), &size)) FAIL(20);
    cont *c = &s->conts.p[chunks.a];
    if (c->walked) FAIL(22); /* one chunks list shared by two tensors: never torch's, and T x C rows from T + C records */
    c->walked = 1;
    for (int32_t g = c->head; g >= 0; g = s->segs.p[g].next)
        for (int64_t i = 0; i < s->segs.p[g].n; i++) {
            val ch = AR(s, s->segs.p[g].start + i);
            int64_t off;
            if (!is_rec(s, ch, K_CSM) || shape_id(s, field(s, ch, 0), &off) || shape_id(s, field(s, ch, 1), &id2)) FAIL(22);
            if (!chunk_inside(s, size, off, id2)) FAIL(22);
            EMIT(chk, off);
            EMIT(chk, id2);
        }
    int64_t k;
    SID(key, k);
    EMIT(ent, k); EMIT(ent, dt.a - G_DTYPE); EMIT(ent, size); EMIT(ent, chunk0); EMIT(ent, c->count);
    return 0;
}

/* item(s, k, v) for each key-value pair of dict d, in insertion order (the first non-zero result
 * returned); a d that is no dict fails with code, but an absent one (EMPTY, None) where optional */
static int walk_dict(st *s, val d, int optional, int code, int (*item)(st *, val, val)) {
    if (optional && (d.t == T_EMPTY || d.t == T_NONE)) return 0;
    if (d.t != T_DICT) FAIL(code);
    cont *c = &s->conts.p[d.a];
    for (int32_t g = c->head; g >= 0; g = s->segs.p[g].next)
        for (int64_t i = 0; i < s->segs.p[g].n; i += 2) {
            int r = item(s, AR(s, s->segs.p[g].start + i), AR(s, s->segs.p[g].start + i + 1));
            if (r) return r;
        }
    return 0;
}

/* state_dict_metadata: key -> TensorStorageMetadata | BytesStorageMetadata */
static int entry_item(st *s, val k, val v) {
    if (k.t != T_STR) FAIL(23);
    if (is_rec(s, v, K_TSM)) return walk_tensor(s, k, v);
    if (!(v.t == T_REC && s->recs.p[v.a].kind == K_BSM)) FAIL(23);
    int64_t kid;
    SID(k, kid);
    EMIT(ent, kid); EMIT(ent, -1); EMIT(ent, 0); EMIT(ent, 0); EMIT(ent, 0);
    return 0;
}

/* the entries, then whether a key is given twice (equal strings share one id): the unpickled dict keeps one, so
 * the caller's unpickler decides */
static int walk_entries(st *s, val sdm) {
    int r = walk_dict(s, sdm, 0, 23, entry_item);
    if (r) return r;
    uint8_t *seen = calloc((size_t)(s->strs.n / 2 + 1), 1);
    if (!seen) FAIL(9);
    for (int64_t row = 0; row < s->ent.n / 5 && !r; row++) {
        int64_t k = s->ent.p[5 * row];
        if (seen[k]) r = 23;
        seen[k] = 1;
    }
    free(seen);
    return r;
}

/* storage_data: MetadataIndex -> _StorageInfo */
static int storage_item(st *s, val k, val v) {
    if (!is_rec(s, k, K_MI) || !is_rec(s, v, K_SI) || s->recs.p[k.a].keyed) FAIL(24);
    s->recs.p[k.a].keyed = 1; /* the same index object twice is one key of the unpickled dict */
    val fqn = field(s, k, 0), off = field(s, k, 1), rel = field(s, v, 0), o = field(s, v, 1);
    val n = field(s, v, 2), td = field(s, v, 3);
    int64_t oid = -1, fid, rid;
    if (fqn.t != T_STR || rel.t != T_STR || o.t != T_INT || n.t != T_INT) FAIL(24);
    SID(fqn, fid);
    SID(rel, rid);
    if (off.t != T_NONE && off.t != T_EMPTY && shape_id(s, off, &oid)) FAIL(24);
    if (!(td.t == T_EMPTY || td.t == T_NONE || (td.t == T_TUPLE && td.b == 0) ||
          (td.t == T_LIST && s->conts.p[td.a].count == 0)))
        FAIL(24);
    EMIT(sto, fid); EMIT(sto, oid); EMIT(sto, rid); EMIT(sto, o.a); EMIT(sto, n.a);
    return 0;
}

static int walk_path_items(st *s, val key, const val *items, int64_t n) {
    int64_t kid, xid;
    if (n > 64) FAIL(25);
    /* torch writes one planner path per state-dict key: more paths than entries (a shared key and
     * tuple referenced again, 4 bytes for 64 rows) would only multiply the output */
    if (s->pln.n / 3 >= s->ent.n / 5 + 16) FAIL(25);
    SID(key, kid);
    EMIT(pln, kid); EMIT(pln, s->pit.n / 2); EMIT(pln, n);
    for (int64_t i = 0; i < n; i++) {
        val x = items[i];
        if (x.t == T_STR) { SID(x, xid); EMIT(pit, 0); EMIT(pit, xid); }
        else if (x.t == T_INT && x.a != INT64_MIN) { EMIT(pit, 1); EMIT(pit, x.a); }
        else FAIL(25);
    }
    return 0;
}

/* planner_data: key -> tuple, list or (ints only) shape-table row of path items */
static int planner_item(st *s, val k, val v) {
    val items[64];
    if (k.t != T_STR) FAIL(25);
    if (v.t == T_TUPLE) {
        if (v.b > 64) FAIL(25);
        for (uint32_t i = 0; i < v.b; i++) items[i] = AR(s, v.a + i);
        return walk_path_items(s, k, items, v.b);
    }
    if (v.t == T_SHAPE) { /* a path of ints only: its items from the shape table */
        const int64_t *x = s->ints.p + s->shapes.p[2 * v.a];
        if (v.b > 64) FAIL(25);
        for (uint32_t i = 0; i < v.b; i++) items[i] = (val){x[i], 0, T_INT};
        return walk_path_items(s, k, items, v.b);
    }
    if (v.t != T_LIST) FAIL(25);
    cont *l = &s->conts.p[v.a];
    if (l->head != l->tail) FAIL(25); /* one APPENDS: items contiguous */
    if (l->count > 64) FAIL(25);
    for (int64_t i = 0; i < l->count; i++) items[i] = AR(s, s->segs.p[l->head].start + i);
    return walk_path_items(s, k, items, l->count);
}

/* top: version (off, len or -1), checkpoint id (kind 0 none / 1 str / 2 path; off or item start, len),
 * save id (off, len or -1), storage and planner present flags, 1 where OLMo-core's _StorageInfo was named */
static int walk_top(st *s, val root) {
    val ver = field(s, root, 4), sm = field(s, root, 3);
    val cid = {0, 0, T_NONE}, sid = {0, 0, T_NONE};
    if (ver.t != T_STR && ver.t != T_NONE && ver.t != T_EMPTY) FAIL(26);
    if (is_rec(s, sm, K_SM)) {
        cid = field(s, sm, 0);
        sid = field(s, sm, 1);
    } else if (!(sm.t == T_EMPTY || sm.t == T_NONE || (sm.t == T_REC && s->recs.p[sm.a].kind == K_SM))) FAIL(26);
    if (sid.t != T_STR && sid.t != T_NONE && sid.t != T_EMPTY) FAIL(26);
    int64_t id = -1;
    if (ver.t == T_STR) SID(ver, id);
    EMIT(top, id);
    if (cid.t == T_STR) { SID(cid, id); EMIT(top, 1); EMIT(top, id); EMIT(top, 0); }
    else if (cid.t == T_PATH) {
        EMIT(top, 2); EMIT(top, s->pit.n / 2); EMIT(top, cid.b);
        for (uint32_t i = 0; i < cid.b; i++) { SID(AR(s, cid.a + i), id); EMIT(pit, 0); EMIT(pit, id); }
    } else if (cid.t == T_NONE || cid.t == T_EMPTY) { EMIT(top, 0); EMIT(top, 0); EMIT(top, 0); }
    else FAIL(26);
    id = -1;
    if (sid.t == T_STR) SID(sid, id);
    EMIT(top, id);
    EMIT(top, s->olmo_writer);
    return 0;
}

/* With `drop`: release the input's whole pages below offset `end` (never read again: the parse reads on from
 * `end`, the walk reads only the pool). A failed madvise leaves the pages as they are. */
#define DROP_STEP ((int64_t)32 << 20)
static void drop_before(st *s, int64_t end) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t hi = ((uintptr_t)s->d + (uintptr_t)end) & ~(page - 1);
    if (hi > s->drop_to && madvise((void *)s->drop_to, hi - s->drop_to, MADV_DONTNEED) == 0) s->drop_to = hi;
    s->drop_next = end + DROP_STEP;
}

static void release(st *s) {
    free(s->stack.p); free(s->memo.p); free(s->arena.p); free(s->fields.p); free(s->fields8.p); free(s->side.p); free(s->marks.p);
    free(s->segs.p); free(s->conts.p); free(s->recs.p); free(s->hash); free(s->shash);
    free(s->ref); free(s->filled); free(s->rank);
}

static int run(st *s) {
    int r;
    if ((r = mark_refs(s))) return r;
    if (grow((void **)&s->pool.p, &s->pool.cap, 1, 1)) FAIL(9);
    while (1) {
        if (s->pos >= s->len) FAIL(2);
        if (s->drop && s->pos >= s->drop_next) drop_before(s, s->pos);
        uint8_t op = s->d[s->pos++];
        if (op == '.') break;
        if ((r = step(s, op))) return r;
    }
    if (s->stack.n <= fence(s)) FAIL(3);
    val root = s->stack.p[s->stack.n - 1];
    if (!is_rec(s, root, K_MD)) FAIL(27);
    if (s->drop) drop_before(s, s->len);
    /* the memo is the parse's alone: freed before the walk's columns grow */
    free(s->memo.p);
    free(s->rank);
    s->memo.p = NULL;
    s->rank = NULL;
    /* the parse's arenas stay: the walk reads them */
    if ((r = walk_entries(s, field(s, root, 0)))) return r;
    if ((r = walk_dict(s, field(s, root, 2), 1, 24, storage_item))) return r;
    if ((r = walk_dict(s, field(s, root, 1), 1, 25, planner_item))) return r;
    return walk_top(s, root);
}

/* Parse `data` (len bytes; with `drop`, the caller's own writable buffer, whose whole pages are released with
 * madvise(MADV_DONTNEED) as the parse passes them: its content is lost, also when the parse is declined, and
 * out->dropped says how much); `dtypes`: the dtype names ckpttool knows, '\n'-separated (a global
 * torch.<name> is one of them or the stream is refused; at most `max_values` output values of the row
 * columns, else refused: shared references cannot multiply the output). Returns 0 and fills `out` with nine int64
 * columns of fixed-width rows, or a non-zero code and nothing to free:
 *   shapes (start in ints, ndim) per distinct shape; ints; strings (offset in out->pool, byte length)
 *   per distinct string; entries (key string, dtype index or -1 for a byte item, size shape,
 *   first chunk, chunks); chunks (offsets shape, sizes shape); storage (fqn string, offsets shape or
 *   -1, path string, offset, length); planner (key string, first item, items); planner items
 *   (0 string / 1 int, its id or value); top (version string or -1, checkpoint id kind 0 none /
 *   1 string / 2 path, its string or first item, path items, save id string or -1, 1 where the stream named
 *   OLMo-core's _StorageInfo else 0). */
int ckpt_mdscan(const uint8_t *data, int64_t len, const char *dtypes, int64_t dtypes_len, int64_t max_values,
                int drop, mdscan_out *out) {
    st s;
    memset(&s, 0, sizeof s);
    s.d = data;
    s.len = len;
    s.drop = drop;
    if (drop) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        s.drop_from = s.drop_to = ((uintptr_t)data + page - 1) & ~(page - 1);
        s.drop_next = DROP_STEP;
    }
    s.dtypes = dtypes;
    s.dtypes_len = dtypes_len;
    s.values_left = max_values;
    int r = run(&s);
    release(&s);
    i64s *cols[N_COLS] = {&s.shapes, &s.ints, &s.strs, &s.ent, &s.chk, &s.sto, &s.pln, &s.pit, &s.top};
    out->dropped = (int64_t)(s.drop_to - s.drop_from);
    if (r) {
        free(s.pool.p);
        out->pool = NULL;
        out->pool_len = 0;
    } else {
        out->pool = s.pool.p;
        out->pool_len = s.pool.n;
    }
    for (int i = 0; i < N_COLS; i++) {
        if (r) {
            free(cols[i]->p);
            out->cols[i] = NULL;
            out->lens[i] = 0;
        } else {
            out->cols[i] = cols[i]->p;
            out->lens[i] = cols[i]->n;
        }
    }
    return r;
}

void ckpt_mdscan_free_pool(mdscan_out *out) {
    free(out->pool);
    out->pool = NULL;
    out->pool_len = 0;
}

void ckpt_mdscan_free(mdscan_out *out) {
    ckpt_mdscan_free_pool(out);
    for (int i = 0; i < N_COLS; i++) {
        free(out->cols[i]);
        out->cols[i] = NULL;
    }
}
