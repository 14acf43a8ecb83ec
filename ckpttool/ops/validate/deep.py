"""The ``--deep`` pass: read every data byte once, files in parallel, and summarise the values.

The pass plans *work items* over tensor chunks and runs them on a thread pool. A chunk is
located and checked by the chunk locator, then its raw storage record is read with
``os.preadv`` in cache-sized slices (:data:`_SLICE`) into per-thread buffers (no page faults
on fresh allocations) and each slice is summarised with numpy over the IEEE bit patterns
(vectorised reductions that release the GIL; torch is not imported):

- floating tensors: two maximum reductions decide whether a slice holds non-finite or
  negative values; exact counts run only on a slice that has some;
- ``step`` fields: their values (checked to be non-negative integers);
- *pairs* whose values must agree are read together, slice by slice, so that each byte is
  still read once and both slices are in the cache when compared: a BF16/FP16 parameter and
  its ``master_weight`` (the parameter must equal ``master_weight.to(param dtype)``, round to
  nearest even, bitwise), and with ``tie_word_embeddings`` ``lm_head.weight`` and the input
  embedding. For BF16 a slice is settled by one bound on the bit-pattern distance
  ``(param << 16) - master`` (strictly within half a BF16 ulp: the rounding must give the
  parameter); only a slice with ties, non-finite masters or mismatches is rounded in full.
  Members of a pair group with different chunking are read whole.

Chunks the locator does not map (stream transforms, torch's newer encoding), float8 and other
dtypes without a bit-pattern path go through torch (``read_chunk``, ``torch.aminmax``).
Chunks whose storage is broken (missing file, escaping path, past EOF, no storage entry, bad
tiling) are skipped: the storage rules report them.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.errors import ChunkError, CkptError
from ckpttool.format.crc import crc32
from ckpttool.format.metadata import DTYPE_ITEMSIZE, BytesMeta, ChunkMeta, TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.layouts.record import LAYOUT_KEY
from ckpttool.model.hfconfig import config_value
from ckpttool.ops import distributed
from ckpttool.ops.validate.stats import DeepResult, PairStats, TensorStats

if TYPE_CHECKING:
    import torch

    from ckpttool.ops.validate.context import Context

__all__ = ["TensorStats", "PairStats", "DeepResult", "run_deep"]

_AMINMAX_DTYPES = {"bfloat16", "float16", "float32", "float64"}


def _bit_tables() -> tuple[dict[str, Any], dict[Any, Any]]:
    import numpy as np
    import torch

    bits = {
        "bfloat16": (torch.int16, 0x7F80, 1 << 15),
        "float16": (torch.int16, 0x7C00, 1 << 15),
        "float32": (torch.int32, 0x7F800000, 1 << 31),
        "float64": (torch.int64, 0x7FF0000000000000, 1 << 63),
    }
    unsigned = {torch.int16: np.uint16, torch.int32: np.uint32, torch.int64: np.uint64}
    return bits, unsigned


class _Lazy(dict):  # type: ignore[type-arg]
    """Tables that need torch/numpy, built on first use (the module imports without torch)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self._index = index

    def _fill(self) -> None:
        if not super().__len__():
            self.update(_bit_tables()[self._index])

    def get(self, key: Any, default: Any = None) -> Any:
        self._fill()
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._fill()
        return super().__getitem__(key)


_BITS = _Lazy(0)
_UNSIGNED = _Lazy(1)


def _is_step(key: str) -> bool:
    # An optimizer state `step` under any schema's prefix (optimizer.state.<fqn>.step, app.optim.state.<fqn>.step).
    return key.endswith(".step") and ".state." in key


def _summarise(key: str, t: torch.Tensor, dtype: str, need_negative: bool, keep_values: bool) -> TensorStats:
    import torch

    st = TensorStats(key, dtype, numel=t.numel())
    if t.numel() == 0:
        return st
    if keep_values:
        st.values = [float(v) for v in t.reshape(-1)[:64].tolist()]
    if not t.is_floating_point():
        if need_negative and t.dtype not in (torch.bool, torch.uint8):
            st.negative = int((t < 0).sum())
        return st
    flat = t.reshape(-1)
    bits = _BITS.get(dtype)
    if bits is not None and flat.is_contiguous():
        # IEEE bit patterns (numpy reductions, vectorised and GIL-free): with the sign bit clear a
        # value is non-finite iff its pattern as a signed int is >= the all-ones exponent; with the
        # sign bit set iff its pattern as an unsigned int is >= sign|exponent; it is negative
        # (not -0.0) iff the unsigned pattern is > sign.
        signed_t, exp_all, sign = bits
        arr = flat.view(signed_t).numpy()
        smax = int(arr.max())
        umax = int(arr.view(_UNSIGNED[signed_t]).max())
        st.zero = smax <= 0 and umax <= sign  # only +0.0 / -0.0 bit patterns
        if smax >= exp_all or umax >= sign | exp_all:
            st.nonfinite = int((~torch.isfinite(flat)).sum())
        if need_negative and umax > sign:
            neg = flat < 0
            st.negative = int(neg.sum())
            if st.negative:
                st.min = float(flat[neg].min())
        return st
    if dtype in _AMINMAX_DTYPES:
        mn, mx = torch.aminmax(flat)
        lo, hi = float(mn), float(mx)
    else:  # float8: no vectorised reductions; widen in slices
        lo, hi = math.inf, -math.inf
        for s in range(0, flat.numel(), 1 << 22):
            mn, mx = torch.aminmax(flat[s : s + (1 << 22)].float())
            a, b = float(mn), float(mx)
            if math.isnan(a) or math.isnan(b):
                lo = hi = math.nan
                break
            lo, hi = min(lo, a), max(hi, b)
    st.min, st.max = lo, hi
    st.zero = lo == 0 and hi == 0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        st.nonfinite = int((~torch.isfinite(flat.float())).sum())
    if need_negative and (math.isnan(lo) or lo < 0):
        st.negative = int((flat < 0).sum())
    return st


def _compare(pair: PairStats, a: torch.Tensor, b: torch.Tensor) -> None:
    import torch

    pair.compared = True
    pair.numel += a.numel()
    if a.numel() == 0:
        return
    bc = b.to(a.dtype) if b.dtype != a.dtype else b
    if torch.equal(a, bc):
        return
    ne = a != bc
    ne &= ~(torch.isnan(a) & torch.isnan(bc))
    n = int(ne.sum())
    if n:
        wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        d = (a[ne].to(wide) - b[ne].to(wide)).abs()
        d = d[~torch.isnan(d)]
        pair.mismatched += n
        if d.numel():
            pair.max_diff = max(pair.max_diff, float(d.max()))


_SLICE = 1 << 20  # bytes summarised per step: stays in the CPU cache like `cat`'s buffer

# dtype name -> (signed int view, unsigned int view, all-ones exponent, sign bit) of the IEEE formats
_NP_BITS = {
    "bfloat16": ("int16", "uint16", 0x7F80, 1 << 15),
    "float16": ("int16", "uint16", 0x7C00, 1 << 15),
    "float32": ("int32", "uint32", 0x7F800000, 1 << 31),
    "float64": ("int64", "uint64", 0x7FF0000000000000, 1 << 63),
}
_NP_INT = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}


def _np_float(raw: Any, dtype: str) -> Any:
    """The values of a float slice as a numpy float array (bfloat16 widened exactly to float32)."""
    import numpy as np

    if dtype == "bfloat16":
        return np.left_shift(raw.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
    return raw.view(dtype)


def _summarise_np(key: str, raw: Any, dtype: str, need_negative: bool, keep_values: bool) -> TensorStats | None:
    """:func:`_summarise` on a slice of raw bytes with numpy; ``None`` for dtypes it has no path for."""
    import numpy as np

    bits = _NP_BITS.get(dtype)
    if bits is None and dtype not in _NP_INT:
        return None
    item = DTYPE_ITEMSIZE[dtype]
    st = TensorStats(key, dtype, numel=raw.size // item)
    if st.numel == 0:
        return st
    if bits is None:
        arr = raw.view(np.bool_ if dtype == "bool" else dtype)
        if keep_values:
            st.values = [float(v) for v in arr[:64].tolist()]
        if need_negative and dtype.startswith("int"):
            st.negative = int(np.count_nonzero(arr < 0))
        return st
    signed, unsigned, exp_all, sign = bits
    if keep_values:
        st.values = [float(v) for v in _np_float(raw[: 64 * item], dtype).tolist()]
    # With the sign bit clear a value is non-finite iff its pattern as a signed int is >= the
    # all-ones exponent; with the sign bit set iff its pattern as an unsigned int is >= sign|exponent;
    # it is negative (not -0.0) iff the unsigned pattern is > sign.
    smax = int(raw.view(signed).max())
    umax = int(raw.view(unsigned).max())
    st.zero = smax <= 0 and umax <= sign  # only +0.0 / -0.0 bit patterns (D005: synthesized state)
    if smax >= exp_all or umax >= sign | exp_all:
        st.nonfinite = int(np.count_nonzero(~np.isfinite(_np_float(raw, dtype))))
    if need_negative and umax > sign:
        vals = _np_float(raw, dtype)
        neg = vals < 0
        st.negative = int(np.count_nonzero(neg))
        if st.negative:
            st.min = float(vals[neg].min())
    return st


class _Scratch(threading.local):
    """Per-thread scratch arrays of slice size (reused: no allocation, no page faults per slice)."""

    def __init__(self) -> None:
        self.arrays: dict[str, Any] = {}

    def get(self, name: str, dtype: Any, n: int) -> Any:
        import numpy as np

        a = self.arrays.get(name)
        if a is None or a.size < n:
            a = self.arrays[name] = np.empty(max(n, _SLICE // 2), dtype=dtype)
        return a[:n]


_scratch = _Scratch()


def _bf16_round_into(master_u32: Any, out_u16: Any) -> None:
    """``float32 -> bfloat16`` round to nearest even on bit patterns (``c10::BFloat16``), NaN not handled."""
    import numpy as np

    t = _scratch.get("round", "uint32", master_u32.size)
    np.right_shift(master_u32, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, master_u32, out=t)
    np.right_shift(t, 16, out=out_u16, casting="unsafe")


class _PairCount:
    """A pair's comparison counts of one work item (merged into the shared :class:`PairStats` once)."""

    __slots__ = ("numel", "mismatched", "max_diff")

    def __init__(self) -> None:
        self.numel = 0
        self.mismatched = 0
        self.max_diff = 0.0


def _compare_np(
    count: _PairCount, kind: str, a_raw: Any, a_dtype: str, b_raw: Any, b_dtype: str, b_finite: bool
) -> None:
    """Compare slice ``a`` with slice ``b`` cast to ``a``'s dtype, bitwise (NaN equals NaN), as :func:`_compare`.

    ``b`` is rounded into a scratch array and xor-ed with ``a``: every step runs in place on
    cache-resident arrays; only a slice with a difference (or non-finite values in ``b``,
    ``b_finite`` false) is examined element by element.
    """
    import numpy as np

    n = a_raw.size // DTYPE_ITEMSIZE[a_dtype]
    count.numel += n
    if n == 0:
        return
    ua = a_raw.view(_NP_BITS[a_dtype][1]) if a_dtype in _NP_BITS else a_raw
    if a_dtype == b_dtype:
        rounded = b_raw.view(ua.dtype)
    elif a_dtype == "bfloat16":
        rounded = _scratch.get("rounded", "uint16", n)
        _bf16_round_into(b_raw.view(np.uint32), rounded)
    else:  # float16 <- float32: numpy's conversion rounds to nearest even, overflows to inf (as torch)
        rounded = _scratch.get("rounded16", "float16", n)
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(rounded, b_raw.view(np.float32), casting="unsafe")
        rounded = rounded.view(np.uint16)
    x = _scratch.get("xor", "uint8", n * ua.dtype.itemsize).view(ua.dtype)
    np.bitwise_xor(ua, rounded, out=x)
    if b_finite and not x.any():
        return
    fa = _np_float(a_raw, a_dtype) if a_dtype in _NP_BITS else ua
    fb = _np_float(b_raw, b_dtype) if b_dtype in _NP_BITS else b_raw.view(ua.dtype)
    ne = x != 0
    if a_dtype in _NP_BITS:
        # a NaN master rounds to some NaN pattern: NaN against NaN is equal, whatever the payload
        both_nan = np.isnan(fa) & np.isnan(fb)
        ne |= np.isnan(fb) & ~np.isnan(fa)
        ne &= ~both_nan
    k = int(np.count_nonzero(ne))
    if k:
        wide = np.float64 if "float64" in (a_dtype, b_dtype) else np.float32
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(fa[ne].astype(wide) - fb[ne].astype(wide))
        d = d[~np.isnan(d)]
        count.mismatched += k
        if d.size:
            count.max_diff = max(count.max_diff, float(d.max()))


_NP_PAIRS = {("bfloat16", "float32"), ("float16", "float32")}


def _np_comparable(a_dtype: str, b_dtype: str) -> bool:
    return (a_dtype, b_dtype) in _NP_PAIRS or (a_dtype == b_dtype and (a_dtype in _NP_BITS or a_dtype in _NP_INT))


class _SliceBuffers(threading.local):
    """Per-thread numpy slice buffers, one per member of a work item."""

    def __init__(self) -> None:
        self.bufs: list[Any] = []

    def get(self, slot: int, nbytes: int) -> Any:
        import numpy as np

        while len(self.bufs) <= slot:
            self.bufs.append(None)
        buf = self.bufs[slot]
        if buf is None or buf.size < nbytes:
            buf = self.bufs[slot] = np.empty(max(nbytes, _SLICE), dtype=np.uint8)
        return buf[:nbytes]


_slice_buffers = _SliceBuffers()


def _stream_item(
    ctx: Context,
    keys: tuple[str, ...],
    chunk: ChunkMeta,
    metas: dict[str, TensorMeta],
    pairs: list[PairStats],
) -> tuple[dict[str, TensorStats], dict[int, _PairCount], int] | None:
    """Summarise one chunk of every key in ``keys`` slice by slice (and compare the pairs among them).

    The chunk of each key is located and checked by the chunk locator (dtype, shape, record
    inside its window) exactly as for every other read, and its CRC-32 is computed slice by
    slice as the bytes pass (``ChecksumError`` on a mismatch).

    Returns:
        ``(stats per key, counts per index into pairs, bytes read)``, or ``None`` when some member
        needs the torch path (a chunk that is not plain C-order values, a dtype without a numpy path).

    Raises:
        CkptError: an archive is corrupt or disagrees with the metadata.
    """
    dtypes = [metas[k].dtype.name for k in keys]
    if any(d not in _NP_BITS and d not in _NP_INT for d in dtypes):
        return None
    if any(not _np_comparable(metas[p.a].dtype.name, metas[p.b].dtype.name) for p in pairs):
        return None
    locs = [ctx.reader.locate(k, chunk) for k in keys]
    if any(not loc.raw for loc in locs):
        return None
    n = chunk.numel
    widest = max(DTYPE_ITEMSIZE[d] for d in dtypes)
    per = max(1, _SLICE // widest)
    fds = [ctx.reader.fd(loc.info.relative_path) for loc in locs]
    slot = {k: i for i, k in enumerate(keys)}
    stats: dict[str, TensorStats] = {k: TensorStats(k, d) for k, d in zip(keys, dtypes)}
    counts = {i: _PairCount() for i in range(len(pairs))}
    crcs = [0] * len(locs)
    read = 0
    for e0 in range(0, n, per):
        m = min(per, n - e0)
        raws = []
        finite = []
        for i, (k, d, loc) in enumerate(zip(keys, dtypes, locs)):
            item = DTYPE_ITEMSIZE[d]
            raw = _slice_buffers.get(i, m * item)
            _pread_exact(fds[i], raw, loc.data_start + e0 * item, loc)
            crcs[i] = crc32(raw, crcs[i])  # the slice is still in the CPU cache
            read += m * item
            st = _summarise_np(k, raw, d, k.endswith(".exp_avg_sq"), _is_step(k) and e0 == 0)
            assert st is not None
            stats[k].add(st)
            raws.append(raw)
            finite.append(st.nonfinite == 0)
        for j, p in enumerate(pairs):
            ia, ib = slot[p.a], slot[p.b]
            _compare_np(counts[j], p.kind, raws[ia], dtypes[ia], raws[ib], dtypes[ib], finite[ib])
    for loc, crc in zip(locs, crcs):
        loc.check_crc(crc)
    return stats, counts, read


def _pread_exact(fd: int, buf: Any, offset: int, loc: Any) -> None:
    mv = memoryview(buf)
    got, n = 0, len(mv)
    while got < n:
        r = os.preadv(fd, [mv[got:]], offset + got)
        if r <= 0:
            raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=loc.key)
        got += r


class _Buffers(threading.local):
    """Per-thread whole-chunk tensors of the torch path."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor | None] = []

    def view(self, slot: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        import torch

        while len(self.bufs) <= slot:
            self.bufs.append(None)
        buf = self.bufs[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[slot] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(shape)


@dataclass
class _Item:
    keys: tuple[str, ...]
    chunk: ChunkMeta | None  # None: read the keys whole
    order: tuple[str, int]
    nbytes: int


def _evict(reader: Any, keys: tuple[str, ...], chunk: ChunkMeta) -> None:
    infos = []
    for k in keys:
        try:
            infos.append(reader.storage_info(k, chunk))
        except CkptError:  # reported by the read already
            pass
    reader.evict(infos)


def _pairs(ctx: Context) -> list[PairStats]:
    out = []
    for fqn, ps in ctx.cat.optimizer_state.items():
        mw = ps.fields.get("master_weight")
        param = ctx.cat.model_entry(fqn)
        if mw is None or param is None or param.dtype not in ("bfloat16", "float16") or mw.shape != param.shape:
            continue
        out.append(PairStats(param.key, mw.key, "master"))
    if ctx.config is not None and bool(config_value(ctx.config, "tie_word_embeddings")):
        head, emb = ctx.cat.tied_keys()
        if head and emb and ctx.cat.model[head].shape == ctx.cat.model[emb].shape:
            out.append(PairStats(head, emb, "tied"))
    return out


def _readable(ctx: Context, key: str, meta: TensorMeta) -> bool:
    if tiling_problem(meta) is not None:
        return False
    try:
        ctx.reader.check_allocation(key, meta)
    except CkptError:
        return False
    return all(ctx.storage_ok(key, c) for c in meta.chunks if c.numel > 0)


def _merge_ranks(
    group: distributed.Group, partial: dict[str, TensorStats], failed: set[str], res: DeepResult, nbytes: int
) -> int:
    """Merge every rank's summaries, pair comparisons and read errors into this rank's (in place).

    Returns:
        The data bytes read by all ranks together.
    """
    pairs = [(p.compared, p.numel, p.mismatched, p.max_diff) for p in res.pairs]
    errs = {k: distributed.pack_error(e) for k, e in res.read_errors.items()}
    parts = group.gather((partial, sorted(failed), pairs, errs, nbytes))
    partial.clear()
    failed.clear()
    res.read_errors.clear()
    for p in res.pairs:
        p.compared, p.numel, p.mismatched, p.max_diff = False, 0, 0, 0.0
    total = 0
    for part, fail, prs, er, n in parts:
        for k, st in part.items():
            if k in partial:
                partial[k].add(st)
            else:
                partial[k] = st
        failed.update(fail)
        for p, (compared, numel, mismatched, max_diff) in zip(res.pairs, prs):
            p.compared = p.compared or compared
            p.numel += numel
            p.mismatched += mismatched
            p.max_diff = max(p.max_diff, max_diff)
        for k, packed in er.items():
            res.read_errors.setdefault(k, distributed.unpack_error(packed))
        total += n
    return total


def run_deep(
    ctx: Context, workers: int | None = None, progress: Callable[[int, int], None] | None = None
) -> DeepResult:
    """Read every tensor chunk (and byte item) of the checkpoint once and summarise it.

    Args:
        ctx: a context with an open reader and catalog.
        workers: threads (default ``min(8, max(2, cpu_count))``).
        progress: called as ``progress(bytes_done, bytes_total)`` after each work item.

    Returns:
        The :class:`DeepResult`.
    """
    reader = ctx.reader
    md = reader.metadata
    t0 = time.perf_counter()
    start_bytes = reader.bytes_read
    res = DeepResult()
    metas = {k: m for k, m in md.entries.items() if isinstance(m, TensorMeta)}
    ok = {k for k, m in metas.items() if _readable(ctx, k, m)}
    res.pairs = [p for p in _pairs(ctx) if p.a in ok and p.b in ok]

    # Union of keys that must be read together.
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.get(k, k) != k:
            k = parent[k]
        return k

    for p in res.pairs:
        ra, rb = find(p.a), find(p.b)
        if ra != rb:
            parent[rb] = ra
    groups: dict[str, list[str]] = {}
    for k in metas:
        if k in ok:
            groups.setdefault(find(k), []).append(k)

    items: list[_Item] = []
    for members in groups.values():
        first = metas[members[0]]
        tiles = [c for c in first.chunks if c.numel > 0]
        same = all(
            sorted((c.offsets, c.sizes) for c in metas[k].chunks if c.numel > 0)
            == sorted((c.offsets, c.sizes) for c in tiles)
            for k in members[1:]
        )
        if same:
            for c in tiles:
                info = md.storage_for(members[0], c)
                assert info is not None
                nb = sum(c.numel * metas[k].dtype.itemsize for k in members)
                items.append(_Item(tuple(members), c, (info.relative_path, info.offset), nb))
            if not tiles:
                for k in members:
                    res.stats[k] = TensorStats(k, metas[k].dtype.name)
        else:
            info = md.storage_for(members[0], tiles[0]) if tiles else None
            order = (info.relative_path, info.offset) if info else ("", 0)
            items.append(_Item(tuple(members), None, order, sum(metas[k].nbytes for k in members)))
    items.sort(key=lambda it: it.order)
    group = distributed.current()  # torchrun: each rank reads (and CRC-checks) its share of the chunks
    if group.active:
        owners = group.share([it.nbytes for it in items])
        items = [it for it, r in zip(items, owners) if group.owns(r)]

    pairs_by_key: dict[str, list[PairStats]] = {}
    for p in res.pairs:
        pairs_by_key.setdefault(p.a, []).append(p)
    lock = threading.Lock()
    bufs = _Buffers()
    partial: dict[str, TensorStats] = {}
    failed: set[str] = set()
    done, total = [0], sum(it.nbytes for it in items)
    streamed_bytes = [0]

    def work(it: _Item) -> None:
        try:
            work_on(it)
        finally:
            if it.chunk is not None:  # a remote checkpoint: the chunk's windows leave the spool once checked
                _evict(reader, it.keys, it.chunk)

    def work_on(it: _Item) -> None:
        tensors: dict[str, torch.Tensor] = {}
        if it.chunk is not None:
            item_pairs = [p for k in it.keys for p in pairs_by_key.get(k, ()) if p.b in it.keys]
            try:
                streamed = _stream_item(ctx, it.keys, it.chunk, metas, item_pairs)
            except CkptError as e:
                with lock:
                    for k in it.keys:
                        res.read_errors.setdefault(k, e)
                        failed.add(k)
                return
            if streamed is not None:
                stats, counts, nb = streamed
                with lock:
                    streamed_bytes[0] += nb
                    for k, st in stats.items():
                        if k in partial:
                            partial[k].add(st)
                        else:
                            partial[k] = st
                    for j, c in counts.items():
                        pr = item_pairs[j]
                        pr.compared = True
                        pr.numel += c.numel
                        pr.mismatched += c.mismatched
                        pr.max_diff = max(pr.max_diff, c.max_diff)
                    if progress is not None:
                        done[0] += it.nbytes
                        progress(done[0], total)
                return
        try:
            for slot, k in enumerate(it.keys):
                meta = metas[k]
                dt = meta.dtype.to_torch()
                if it.chunk is None:
                    tensors[k] = reader.read_tensor(k)
                else:
                    out = bufs.view(slot, it.chunk.numel * meta.dtype.itemsize, dt, it.chunk.sizes)
                    tensors[k] = reader.read_chunk(k, it.chunk, out=out)
        except CkptError as e:
            with lock:
                for k in it.keys:
                    res.read_errors.setdefault(k, e)
                    failed.add(k)
            return
        local = {
            k: _summarise(k, t, metas[k].dtype.name, k.endswith(".exp_avg_sq"), _is_step(k)) for k, t in tensors.items()
        }
        with lock:
            for k, st in local.items():
                if k in partial:
                    partial[k].add(st)
                else:
                    partial[k] = st
        for k in it.keys:
            for p in pairs_by_key.get(k, ()):
                if p.b in tensors:
                    with lock:
                        _compare(p, tensors[p.a], tensors[p.b])
        if progress is not None:
            with lock:
                done[0] += it.nbytes
                progress(done[0], total)

    n = workers or min(8, max(2, os.cpu_count() or 2))
    n = max(1, min(n, len(items))) if items else 1
    res.workers = n
    q: queue.SimpleQueue[_Item] = queue.SimpleQueue()
    for it in items:
        q.put(it)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while True:
                it = q.get_nowait()
                work(it)
        except queue.Empty:
            return
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=loop, name=f"ckpttool-deep-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if group.active:
        group.agree(errors[0] if errors else None)
        merged = _merge_ranks(group, partial, failed, res, reader.bytes_read - start_bytes + streamed_bytes[0])
        streamed_bytes[0] = merged - (reader.bytes_read - start_bytes)
    elif errors:
        raise errors[0]
    for k, st in partial.items():
        if k not in failed:
            res.stats[k] = st
    for p in res.pairs:
        if p.a in failed or p.b in failed:
            p.compared = False

    # Byte items not read yet: loadable safely? (`step` items of old optimizers keep their value.)
    known = set(ctx.byte_item_errors)
    for g in ctx.cat.param_groups:
        known.update(g.keys.values())  # read (or recorded as unreadable) with the param groups
    known.add(LAYOUT_KEY)
    for key, meta in md.entries.items():
        if not isinstance(meta, BytesMeta) or key in known or not ctx.storage_ok(key):
            continue
        try:
            value = reader.read_object(key)
        except CkptError as e:
            ctx.byte_item_errors[key] = e
            continue
        if _is_step(key):
            res.byte_values[key] = value
    res.bytes_read = reader.bytes_read - start_bytes + streamed_bytes[0]
    res.seconds = time.perf_counter() - t0
    return res
