"""The native lockstep scan: a :class:`~ckpttool.engine.plan.Lockstep` 's reads, CRC-32s, statistics
folds and pair kernels in one C call per window (``engine/native/scan.c``, GIL released).

The C loop reads each slab of every stream in pieces of 128 KiB of the widest stream, straight
from read-only mappings of the file (4 MiB at a time; a file truncated under them is a
:class:`~ckpttool.engine.io.ShortReadError`, caught as ``SIGBUS``) or, where the file is not a
regular file holding the window or ``CKPTTOOL_SCAN_MMAP=0``, with ``pread`` into the slab
buffers; while a piece is in the CPU cache it computes its CRC-32 (ISA-L's ``crc32_gzip_refl``,
the function :data:`~ckpttool.engine.crc.crc32` calls), folds it into the stream's statistics
(``ckpt_stats_slab``, as :func:`~ckpttool.engine.stats.fold_slab`) and runs the pair kernels; the
interpreter runs once per window of :data:`WINDOW_BYTES`, not once per slab. Slabs are cut as
:func:`~ckpttool.engine.execute.run_lockstep` cuts them, so every count, flag and maximum equals
the Python loop's; sums agree within :func:`~ckpttool.engine.stats.fold_slab`'s tolerance.
``docs/performance.md``, "ckpttool stats".
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

from ckpttool.engine import native
from ckpttool.engine.execute import lockstep_buffer
from ckpttool.engine.io import ShortReadError
from ckpttool.engine.plan import Lockstep
from ckpttool.engine.stats import NATIVE_DTYPE, CStats, SlabStats, c_flags, merge_c, native_stats

__all__ = ["WINDOW_BYTES", "PairResult", "ScanResult", "run_scan"]

#: Bytes of the widest stream one C call covers (a multiple of the slab): progress and Ctrl-C granularity.
WINDOW_BYTES = 64 << 20

_KINDS = {"adam": 0, "ratio": 1, "equal": 2, "below": 3}


class _CStream(ctypes.Structure):
    _fields_ = [
        ("offset", ctypes.c_int64),
        ("fd", ctypes.c_int32),
        ("dt", ctypes.c_int32),
        ("fold", ctypes.c_int32),
        ("need", ctypes.c_int32),
        ("crc_on", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("limit", ctypes.c_uint64),
        ("stride", ctypes.c_uint64),
        ("buf", ctypes.c_void_p),
        ("crc", ctypes.c_uint64),
        ("acc", CStats),
    ]


class _CPair(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("kind", "a", "b", "pad")] + [
        (n, ctypes.c_double) for n in ("eps", "count", "s2", "top")
    ]


@dataclass
class PairResult:
    """A pair kernel's result: ``"adam"`` ``count``, ``s2`` (``sum u^2``), ``top`` (``max |u|``); ``"ratio"``
    ``top`` (``max a * a / b`` over the slabs not handed back, ``-inf``: none); ``"equal"`` and ``"below"`` nothing."""

    count: int
    s2: float
    top: float


@dataclass
class ScanResult:
    """:func:`run_scan` 's result: each stream's CRC-32 (``None``: not asked for, :attr:`Scan.crcs`) and
    statistics (``None``: not folded), each pair's result."""

    crcs: tuple[int | None, ...]
    stats: tuple[SlabStats | None, ...]
    pairs: tuple[PairResult, ...]


@functools.cache
def _kernel() -> tuple[Any, int] | None:
    """``(ckpt_scan, the CRC-32 function's address)``, or ``None`` (not built, or no C CRC-32 to call)."""
    from ckpttool.engine.crc import crc32_c_function

    crc = crc32_c_function()
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    fn = native.function(
        "ckpt_scan", i64, ctypes.POINTER(_CStream), ctypes.c_int32, ctypes.POINTER(_CPair), ctypes.c_int32,
        i64, i64, i64, vp, ctypes.POINTER(i64), ctypes.POINTER(i64),
    )  # fmt: skip
    return None if fn is None or crc is None else (fn, crc)


def run_scan(ls: Lockstep) -> ScanResult | None:
    """Run ``ls.scan`` natively over ``ls`` 's streams (``ls.each`` is not called).

    Returns:
        The :class:`ScanResult`, or ``None`` where the native kernels are not in use (not built,
        ``CKPTTOOL_NATIVE=0``, no ``ls.scan``, a stream of several windows or of a window
        other than ``numel`` items): the caller then runs
        :func:`~ckpttool.engine.execute.run_lockstep`, whose ``each`` computes the same in Python.

    Raises:
        ShortReadError: a file ends early. OSError: a read failed. Whatever ``handback`` raises.
    """
    sc = ls.scan
    k = _kernel() if native_stats() else None
    if k is None or sc is None or any(len(ws) != 1 for ws in ls.streams):
        return None
    if any(ws[0].length != ls.numel * item for ws, item in zip(ls.streams, ls.itemsizes)):
        return None  # a window of another length: the Python path reads it exactly (ShortReadError)
    fn, crc = k
    n, ns = ls.numel, len(ls.streams)
    streams = (_CStream * ns)()
    bufs = []
    for i, (ws, item, dtype, need) in enumerate(zip(ls.streams, ls.itemsizes, sc.dtypes, sc.folds)):
        buf = lockstep_buffer(i, min(ls.slab, max(n, 1)) * item)
        bufs.append(buf)
        s = streams[i]
        s.offset, s.fd, s.dt, s.buf = ws[0].offset, ws[0].fd, NATIVE_DTYPE[dtype], buf.ctypes.data
        s.crc_on = sc.crcs is None or sc.crcs[i] or need is None
        if need is not None:
            s.fold = 1
            s.need, s.limit, s.stride = c_flags(need, dtype)
    pairs = (_CPair * max(1, len(sc.pairs)))()
    for p, pk in zip(pairs, sc.pairs):
        p.kind, p.a, p.b, p.eps, p.top = _KINDS[pk.kind], pk.a, pk.b, pk.eps, -float("inf")
    back, err = ctypes.c_int64(), (ctypes.c_int64 * 3)()
    window = max(1, WINDOW_BYTES // max(ls.itemsizes) // ls.slab) * ls.slab
    e = 0
    while e < n:
        end = min(n, e + window)
        got = fn(streams, ns, pairs, len(sc.pairs), e, end, ls.slab, crc, ctypes.byref(back), err)
        if got == -1:
            if err[0] == 0:
                raise ShortReadError(err[1], err[2])
            raise OSError(err[0], os.strerror(err[0]))
        if got < 0:
            raise ValueError(f"ckpt_scan: bad arguments ({got})")
        if got < end:  # a slab handed back: the caller's exact path, then on from the next slab
            m = min(ls.slab, n - got)
            assert sc.handback is not None, "a pair kernel handed back a slab: Scan.handback is required"
            sc.handback([b[: m * item] for b, item in zip(bufs, ls.itemsizes)], got, back.value)
            end = got + m
        e = end
    stats = []
    for s, need in zip(streams, sc.folds):
        acc = None
        if need is not None:
            acc = SlabStats()
            merge_c(acc, s.acc)
        stats.append(acc)
    results = tuple(PairResult(int(p.count), p.s2, p.top) for p, _ in zip(pairs, sc.pairs))
    crcs = tuple(int(s.crc) if s.crc_on else None for s in streams)
    return ScanResult(crcs, tuple(stats), results)
