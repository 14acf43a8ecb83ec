"""The ``--deep`` pass: read every data byte once, files in parallel, and summarise the values.

The pass plans *work items* over tensor chunks and runs them on a thread pool
(``CheckpointReader.read_chunk`` is thread-safe; ``os.preadv`` and torch's
kernels release the GIL). Each chunk is read straight into a per-thread reusable
buffer (no page faults on fresh allocations) and summarised:

- floating tensors: ``torch.aminmax`` (one vectorised pass; NaN and +-inf
  propagate into it), exact counts of non-finite / negative values only when the
  fast pass says there are some;
- ``step`` fields: their values (checked to be non-negative integers);
- *pairs* whose values must agree are read together so that each byte is still
  read once: a BF16/FP16 parameter and its ``master_weight`` (the parameter must
  equal ``master_weight.to(param dtype)``), and with ``tie_word_embeddings``
  ``lm_head.weight`` and the input embedding. Members of a pair group with the
  same chunking are compared chunk by chunk; otherwise the group's tensors are
  read whole.

Chunks whose storage is broken (missing file, escaping path, past EOF, no
storage entry, bad tiling) are skipped: the storage rules report them.
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
from ckpttool.format.metadata import BytesMeta, ChunkMeta, TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.model.hfconfig import config_value
from ckpttool.model.layout_record import LAYOUT_KEY
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
    return key.startswith("optimizer.state.") and key.endswith(".step")


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


def _stream_chunk(ctx: Context, key: str, chunk: ChunkMeta, buf: torch.Tensor) -> tuple[TensorStats, int] | None:
    """Summarise one chunk by reading its raw storage record in cache-sized slices.

    The chunk is located and checked by the chunk locator (dtype, shape, record inside its
    window) exactly as for every other read, and its CRC-32 is computed slice by slice; a chunk whose record is not its plain C-order
    values returns ``None`` so that the caller falls back to ``read_chunk``.

    Returns:
        ``(stats, bytes read)`` or ``None``.

    Raises:
        CkptError: the archive is corrupt or disagrees with the metadata.
    """
    loc = ctx.reader.locate(key, chunk)
    if not loc.raw or loc.nbytes == 0:
        return None
    meta = loc.meta
    item = meta.dtype.itemsize
    nbytes = loc.nbytes
    fd = ctx.reader.fd(loc.info.relative_path)
    dt = meta.dtype.to_torch()
    st = TensorStats(key, meta.dtype.name)
    step = _SLICE - _SLICE % item
    start = loc.data_start
    mv = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy stubs: ndarray.__buffer__ only on Python >= 3.12
    pos = 0
    crc = 0
    while pos < nbytes:
        n = min(step, nbytes - pos)
        got = 0
        while got < n:
            r = os.preadv(fd, [mv[got:n]], start + pos + got)
            if r <= 0:
                raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=key)
            got += r
        crc = crc32(mv[:n], crc)  # the slice is still in the CPU cache
        part = buf[:n].view(dt)
        st.add(_summarise(key, part, meta.dtype.name, key.endswith(".exp_avg_sq"), _is_step(key) and pos == 0))
        pos += n
    loc.check_crc(crc)
    st.dtype = meta.dtype.name
    return st, nbytes


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.bufs: list[torch.Tensor | None] = []
        self.slice: torch.Tensor | None = None

    def slice_buffer(self) -> torch.Tensor:
        import torch

        if self.slice is None:
            self.slice = torch.empty(_SLICE, dtype=torch.uint8)
        return self.slice

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


def _pairs(ctx: Context) -> list[PairStats]:
    out = []
    for fqn, ps in ctx.cat.optimizer_state.items():
        mw = ps.fields.get("master_weight")
        param = ctx.cat.model.get(f"model.{fqn}")
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
    import torch

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
        tensors: dict[str, torch.Tensor] = {}
        if len(it.keys) == 1 and it.chunk is not None:
            k = it.keys[0]
            try:
                streamed = _stream_chunk(ctx, k, it.chunk, bufs.slice_buffer())
            except CkptError as e:
                with lock:
                    res.read_errors.setdefault(k, e)
                    failed.add(k)
                return
            if streamed is not None:
                st, nb = streamed
                with lock:
                    streamed_bytes[0] += nb
                    if k in partial:
                        partial[k].add(st)
                    else:
                        partial[k] = st
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
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallelism comes from the reader threads
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(prev_threads)
    if errors:
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
