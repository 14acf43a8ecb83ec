"""Byte equality at memory speed: libc ``memcmp`` through ``ctypes`` (the GIL released).

``memoryview == memoryview`` compares element by element (~0.2 GB/s); ``memcmp`` runs at
several GB/s (``docs/performance.md``). Used by the engine's comparison sinks and by ``diff``'s
decoded comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["address", "first_difference", "memcmp"]

_memcmp: Callable[[int, int, int], int] | None = None


def memcmp(a: int, b: int, n: int) -> int:
    """libc ``memcmp`` of ``n`` bytes at addresses ``a`` and ``b`` (0: equal)."""
    global _memcmp
    if _memcmp is None:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c")).memcmp
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        _memcmp = fn
    return int(_memcmp(a, b, n))


def address(buf: Any) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers included)."""
    import numpy as np

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def first_difference(a: Any, b: Any) -> int | None:
    """The first position at which two C-contiguous buffers of one length differ; ``None``: equal.

    One ``memcmp`` when equal; a difference is narrowed by halving (``log2(n)`` more calls).
    """
    n = len(memoryview(a).cast("B"))
    assert n == len(memoryview(b).cast("B"))
    pa, pb = (address(a), address(b)) if n else (0, 0)
    if n == 0 or memcmp(pa, pb, n) == 0:
        return None
    lo, hi = 0, n  # the first difference is in [lo, hi)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if memcmp(pa + lo, pb + lo, mid - lo) != 0:
            hi = mid
        else:
            lo = mid
    x, y = memoryview(a).cast("B"), memoryview(b).cast("B")
    return next(i for i in range(lo, hi) if x[i] != y[i])
