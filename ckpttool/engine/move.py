"""One native call per stretch of a stored record: read, CRC-32, cast and write (``engine/native/cast.c``).

:func:`move_runs` moves runs of a record that lies at a file offset into output files: the C loop
``pread`` s the record in 256 KiB pieces, computes each piece's CRC-32 (``ckpt_crc32``: 256-bit
folding where the CPU has VPCLMULQDQ, finished by ISA-L's ``crc32_gzip_refl``, the function
:data:`~ckpttool.engine.crc.crc32` calls) and casts it while it
is in the CPU cache, gathers each run's output and writes it with ``pwrite`` s of up to
:data:`STAGE_BYTES`; the interpreter runs once per call, not once per slab. The bytes are those
of :func:`~ckpttool.engine.kernels.cast` (``ckpt_f32_to_bf16`` / ``ckpt_f32_to_f16``, the same
kernels; bfloat16 to float32 is exact, the pattern shifted into the upper half). ``docs/performance.md``, "Transforming exports: CPU per phase".
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from array import array
from typing import Any

from ckpttool.engine import native
from ckpttool.engine.io import ShortReadError

__all__ = ["MOVE_KINDS", "STAGE_BYTES", "CastOverflow", "available", "move_runs"]

#: ``(stored dtype, written dtype)`` -> the kernel's kind (same dtypes: 0, a copy).
MOVE_KINDS = {("float32", "bfloat16"): 1, ("float32", "float16"): 2, ("bfloat16", "float32"): 3}
_PIECE = 256 << 10  # MOVE_PIECE of cast.c
#: Output bytes gathered before a ``pwrite``.
STAGE_BYTES = 1 << 20


@functools.cache
def _kernel() -> tuple[Any, int | None] | None:
    """``(ckpt_stream_cast, the CRC-32 function's address or None)``, or ``None`` (not built)."""
    fn = native.function(
        "ckpt_stream_cast",
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
    )
    if fn is None:
        return None
    from ckpttool.engine.crc import crc32_c_function

    return fn, crc32_c_function()


def available(src_dtype: str, out_dtype: str, *, crc: bool) -> bool:
    """Whether :func:`move_runs` can move ``src_dtype`` values as ``out_dtype`` here (with a CRC-32 if ``crc``)."""
    k = _kernel()
    if k is None or (crc and k[1] is None):
        return False
    return src_dtype == out_dtype or (src_dtype, out_dtype) in MOVE_KINDS


class CastOverflow(ValueError):
    """A float32 -> float16 / bfloat16 move met a finite value beyond the target's range (float16: +-65504;
    bfloat16: from 3.39618e38), which the cast made infinite.

    Attributes:
        run: the run (index into ``parts``' triples) holding it.
        index: its index among run ``run``'s values.
        bits: its float32 bit pattern.
    """

    def __init__(self, run: int, index: int, bits: int) -> None:
        super().__init__(f"float32 value beyond the cast's range in run {run} at {index}")
        self.run, self.index, self.bits = run, index, bits


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(_PIECE + STAGE_BYTES)
        self.err = (ctypes.c_int64 * 3)()
        self.crc = ctypes.c_uint32()


_scratch = _Scratch()


def move_runs(
    src_fd: int, src_offset: int, parts: array[int], src_dtype: str, out_dtype: str, item: int, crc: int | None
) -> int | None:
    """Move a stretch of a record: ``parts`` (``array('q')`` of triples) are runs in source order from ``src_offset``.

    Run ``j`` is ``parts[3j]`` values of ``item`` bytes, written as ``out_dtype`` at byte ``parts[3j + 2]``
    of descriptor ``parts[3j + 1]`` (``-1``: read for the CRC-32 only, not written).

    Args:
        crc: the running CRC-32 of the record's bytes before this stretch, or ``None`` (not computed).

    Returns:
        The running CRC-32 after it (``None`` if not computed).

    Raises:
        ShortReadError: the source file ends inside the stretch.
        OSError: a read or a write failed (``ENOSPC``, ``EIO``, ...).
        CastOverflow: a float32 -> float16 / bfloat16 move met a finite value the target cannot hold (the
            output of the stretch is then incomplete).
        ValueError: a dtype pair :func:`available` refuses.
    """
    k = _kernel()
    assert k is not None, "move_runs without the native kernels (see available())"
    fn, crc_fn = k
    kind = 0 if src_dtype == out_dtype else MOVE_KINDS.get((src_dtype, out_dtype))
    if kind is None:
        raise ValueError(f"no native move of {src_dtype} as {out_dtype}")
    s = _scratch
    s.crc.value = crc or 0
    address, n = parts.buffer_info()
    rc = fn(
        src_fd,
        src_offset,
        address,
        n // 3,
        kind,
        item,
        crc_fn if crc is not None else None,
        ctypes.addressof(s.crc),
        ctypes.addressof(s.buf),
        len(s.buf),
        ctypes.addressof(s.err),
    )
    if rc == -1:
        if s.err[0] == 0:
            raise ShortReadError(s.err[1], s.err[2])
        raise OSError(s.err[0], os.strerror(s.err[0]))
    if rc == -2:
        raise OSError(s.err[0], os.strerror(s.err[0]))
    if rc == -4:
        raise CastOverflow(int(s.err[0]), int(s.err[1]), int(s.err[2]) & 0xFFFFFFFF)
    if rc != 0:
        raise ValueError(f"ckpt_stream_cast refused its arguments ({rc})")
    return s.crc.value if crc is not None else None
