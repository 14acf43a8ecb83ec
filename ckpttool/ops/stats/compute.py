"""Streaming value statistics over a checkpoint's chunks (bounded memory, chunks in parallel).

A chunk is read slice by slice (at most :data:`~ckpttool.engine.io.BLOCK_BYTES` of values at a
time) through the chunk locator: plain C-order records with the engine's read helper (the
record's CRC-32 checked as the bytes pass), every other record (deflated, strided, big-endian)
through :meth:`~ckpttool.format.reader.CheckpointReader.read_chunk`. Each slice is reduced in a few
fused, vectorised passes (:meth:`ValueSums.add_slice`): blocks of :data:`SUM_BLOCK` values summed in
its working precision (float32 for BF16/FP16/FP32 values, float64 for FP64 and integers), the block
sums added in float64 (relative error ~1e-7); NaN/inf are counted and left out. Two chunks of the
same geometry can be read in lockstep (AdamW moments for the update size, the same tensor of two
checkpoints for their difference). Performance: docs/performance.md, "ckpttool stats".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpttool.engine.crc import crc32
from ckpttool.engine.io import BLOCK_BYTES, ShortReadError, read_into
from ckpttool.engine.kernels import IEEE_BITS, Scratch, float_values
from ckpttool.errors import ChunkError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, ChunkMeta

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader

__all__ = [
    "AdamHyper",
    "Moments",
    "SLICE_VALUES",
    "ValueSums",
    "adam_update",
    "as_work",
    "block_sum",
    "chunk_slices",
    "expert_sums",
    "read_pair",
    "release_buffers",
    "sum_squares",
    "tensor_values",
]

#: Values per slice: one engine block of float64 working values.
SLICE_VALUES = BLOCK_BYTES // 8


#: Values per float32 partial sum of :func:`block_sum` (a block's relative error is ~1e-7; the
#: partial sums are added in float64).
SUM_BLOCK = 1024


def block_sum(x: np.ndarray) -> float:
    """``sum(x)`` of a 1-D float array: partial sums of :data:`SUM_BLOCK` values in ``x``'s precision
    (``np.einsum``'s vectorised loop, no BLAS: its thread pool would fight the engine's workers), added
    in float64. Relative error ~6e-7 at worst on float32 (1024 equal values), ~1e-9 on typical data."""
    n = x.size
    k = n - n % SUM_BLOCK
    total = 0.0
    if k:
        part = np.einsum("ij->i", x[:k].reshape(-1, SUM_BLOCK))
        total = float(np.add.reduce(part, dtype=np.float64))
    if k < n:
        total += float(np.add.reduce(x[k:], dtype=np.float64))
    return total


def sum_squares(x: np.ndarray) -> float:
    """``sum(x * x)`` of a 1-D float array (squares in a per-thread work array, then :func:`block_sum`)."""
    sq = np.multiply(x, x, out=_work("ss", x.size, x.dtype))
    return block_sum(sq)


def _work(name: str, n: int, dtype: Any = np.float64) -> np.ndarray:
    """This thread's work array ``name`` of ``dtype`` (one slice; :class:`~ckpttool.engine.kernels.Scratch`)."""
    arr: np.ndarray = _scratch.get(name + np.dtype(dtype).char, dtype, n)  # .char: .name is slow Python
    return arr


_scratch = Scratch(SLICE_VALUES)

#: Working dtype -> (its unsigned bit-pattern dtype, ``(exponent all ones) << 1``: the smallest shifted NaN/inf pattern).
_MAGNITUDE = {"f": (np.uint32, 0xFF000000), "d": (np.uint64, 0xFFE0000000000000)}  # by dtype.char


def as_work(x: np.ndarray, slot: int = 0) -> np.ndarray:
    """``x`` in its working precision: float32 and float64 slices as they are, other floats
    (float16, float8) widened to float32 in a per-thread buffer."""
    if x.dtype in (np.float32, np.float64):
        return x
    out = _work(f"v{slot}", x.size, np.float32)
    out[...] = x
    return out


@dataclass
class ValueSums:
    """Float64 running sums of one tensor's values (mergeable)."""

    numel: int = 0
    nonfinite: int = 0
    zeros: int = 0
    s1: float = 0.0
    s2: float = 0.0
    abs_max: float = 0.0
    experts: dict[int, float] = field(default_factory=dict)

    def add_slice(self, x: np.ndarray, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Add a slice of float values (any float dtype).

        Passes over the slice (cache-resident, in :func:`as_work`'s precision): the magnitude bit
        patterns ``bits << 1`` (sign shifted out) into a work array, whose maximum is the largest
        ``|x|`` (and shows NaN/inf) and whose non-zero count the zeros (``-0.0`` included); the
        values' :func:`block_sum`; their squares into a work array and its :func:`block_sum`.
        Non-finite values are counted and set to 0 in a copy first (rare: an extra pass).

        Returns:
            ``(values, squares)``: the slice in its working precision with non-finite values set
            to 0 (positions kept), valid until the next call on this thread with the same ``slot``.
        """
        n = x.size
        self.numel += n
        w = as_work(x, slot)
        if n == 0:
            return w, w
        ubits, shift_inf = _MAGNITUDE[w.dtype.char]
        t = np.left_shift(w.view(ubits), 1, out=_work(f"t{slot}", n, ubits))
        top = int(t.max())
        cleared = 0  # non-finite values set to 0 (not zeros of the tensor)
        if top >= shift_inf:  # NaN or inf
            finite = np.isfinite(w)
            cleared = n - int(np.count_nonzero(finite))
            self.nonfinite += cleared
            cleaned = _work(f"c{slot}", n, w.dtype)
            cleaned.fill(0.0)
            np.copyto(cleaned, w, where=finite)
            w = cleaned
            np.left_shift(w.view(ubits), 1, out=t)
            top = int(t.max())
        self.zeros += n - cleared - int(np.count_nonzero(t))
        self.abs_max = max(self.abs_max, float(np.array(top >> 1, dtype=ubits).view(w.dtype)))
        self.s1 += block_sum(w)
        sq = np.multiply(w, w, out=_work(f"sq{slot}", n, w.dtype))
        self.s2 += block_sum(sq)
        return w, sq

    def merge(self, o: ValueSums) -> None:
        self.numel += o.numel
        self.nonfinite += o.nonfinite
        self.zeros += o.zeros
        self.s1 += o.s1
        self.s2 += o.s2
        self.abs_max = max(self.abs_max, o.abs_max)
        for e, v in o.experts.items():
            self.experts[e] = self.experts.get(e, 0.0) + v

    @property
    def finite(self) -> int:
        return self.numel - self.nonfinite

    @property
    def mean(self) -> float:
        return self.s1 / self.finite if self.finite else math.nan

    @property
    def std(self) -> float:
        if not self.finite:
            return math.nan
        m = self.mean
        return math.sqrt(max(self.s2 / self.finite - m * m, 0.0))


@dataclass
class Moments:
    """Running sums of an AdamW update size ``u`` (``numel``, ``sum u^2``, ``max u``)."""

    numel: int = 0
    s2: float = 0.0
    max: float = 0.0

    def merge(self, o: Moments) -> None:
        self.numel += o.numel
        self.s2 += o.s2
        self.max = max(self.max, o.max)


_raw = Scratch(BLOCK_BYTES)  # per-thread raw slice bytes, one per lockstep member


def release_buffers() -> None:
    """Drop every thread's slice and work buffers (pool threads outlive a run)."""
    global _scratch, _raw
    _scratch, _raw = Scratch(SLICE_VALUES), Scratch(BLOCK_BYTES)


def chunk_slices(reader: CheckpointReader, key: str, chunk: ChunkMeta, *, slot: int = 0) -> Iterator[np.ndarray]:
    """The values of one chunk of ``key`` in C order, slices of :data:`SLICE_VALUES` elements (a float
    dtype: float32 for BF16 records, widened exactly; valid until the next slice of this ``slot``).

    Raises:
        ChunkError / ChecksumError / DataFileError: the chunk's record is damaged or does not
            match the metadata (as every reader of the chunk would report it).
    """
    loc = reader.locate(key, chunk)
    dtype = loc.meta.dtype.name
    n = chunk.numel
    if loc.raw and dtype in IEEE_BITS:
        item = DTYPE_ITEMSIZE[dtype]
        fd = reader.fd(loc.info.relative_path)
        crc = 0
        for e0 in range(0, n, SLICE_VALUES):
            m = min(SLICE_VALUES, n - e0)
            raw = _raw.get(f"raw{slot}", np.uint8, m * item)
            try:
                read_into(fd, raw, loc.data_start + e0 * item)
            except ShortReadError:
                raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=key) from None
            crc = crc32(raw, crc)
            reader.count_read(m * item)
            if dtype == "bfloat16":  # widened exactly into a work array (float_values would allocate)
                wide = _work(f"bf{slot}", m, np.uint32)
                np.left_shift(raw.view(np.uint16), 16, out=wide, dtype=np.uint32)
                yield wide.view(np.float32)
            else:
                yield float_values(raw, dtype)
        loc.check_crc(crc)
        return
    t = reader.read_chunk(key, chunk).reshape(-1)
    import torch

    work = torch.float32 if t.is_floating_point() and t.element_size() <= 4 else torch.float64
    for e0 in range(0, n, SLICE_VALUES):
        yield t[e0 : e0 + SLICE_VALUES].to(work).numpy()


def expert_sums(sums: ValueSums, sq: np.ndarray, e0: int, inner: int, first_expert: int) -> None:
    """Add the squares ``sq`` of a slice starting at chunk element ``e0`` to the per-expert sums
    (``inner`` elements per expert in the chunk, the chunk's first expert ``first_expert``)."""
    if inner <= 0 or sq.size == 0:
        return
    first_cut = (-e0) % inner
    cuts = [0] + list(range(first_cut or inner, sq.size, inner))
    seg = np.add.reduceat(sq, cuts)
    for c, v in zip(cuts, seg.tolist()):
        e = first_expert + (e0 + c) // inner
        sums.experts[e] = sums.experts.get(e, 0.0) + v


@dataclass(frozen=True)
class AdamHyper:
    """What the update size needs: ``lr``, ``beta1``, ``beta2``, ``eps`` and the saved ``step``."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    step: float


def adam_update(m: np.ndarray, v: np.ndarray, h: AdamHyper, acc: Moments) -> None:
    """Add the slice's update sizes ``lr * |m_hat| / (sqrt(v_hat) + eps)`` to ``acc`` (in ``m``'s and ``v``'s precision;
    elements whose size is not finite, e.g. ``eps == 0`` with ``v == 0``, are left out).

    Computed as ``c * m / (sqrt(v) + eps * sqrt(bc2))`` with ``c = lr * sqrt(bc2) / bc1`` (the same
    value, four passes: sqrt, add, divide, and the squares of :func:`sum_squares`; ``c`` applied to
    the maximum and the sum); negative ``v`` (a damaged moment) counts as 0.
    """
    bc1 = 1.0 - h.beta1**h.step if h.step > 0 else 1.0
    bc2 = 1.0 - h.beta2**h.step if h.step > 0 else 1.0
    wide = np.result_type(m.dtype, v.dtype)
    n = m.size
    if n == 0:
        return
    d = _work("d", n, wide)
    src = v
    if float(v.min()) < 0:
        src = np.maximum(v, 0.0, out=d)
    np.sqrt(src, out=d)
    r = math.sqrt(bc2)
    d += h.eps * r
    c = h.lr * r / bc1
    u = _work("u", n, wide)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        np.divide(m, d, out=u)
    hi, lo = float(u.max()), float(u.min())
    if not (math.isfinite(hi) and math.isfinite(lo)):
        u = u[np.isfinite(u)]
        hi, lo = (float(u.max()), float(u.min())) if u.size else (0.0, 0.0)
    acc.numel += u.size
    acc.s2 += sum_squares(u) * c * c
    acc.max = max(acc.max, max(hi, -lo) * c)


def read_pair(
    a: tuple[CheckpointReader, str, ChunkMeta], b: tuple[CheckpointReader, str, ChunkMeta]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Slices of two chunks of the same geometry (``(reader, key, chunk)`` each), in lockstep."""
    yield from zip(chunk_slices(*a, slot=0), chunk_slices(*b, slot=1))


def tensor_values(reader: CheckpointReader, key: str) -> Any:
    """A whole tensor as a flat float64 numpy array (the fallback of differently sharded pairs)."""
    import torch

    return reader.read_tensor(key).reshape(-1).to(torch.float64).numpy().copy()
