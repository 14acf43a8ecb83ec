"""CRC-32 (the zip polynomial, ``0xEDB88320`` reflected) at memory speed.

zip entries carry the CRC-32 of ISO 3309 / ITU-T V.42. ``zlib.crc32`` computes it without a
folded/SIMD kernel (zlib 1.2.13), slower than reading a checkpoint from the page cache; ``isal``
(Intel ISA-L's PCLMULQDQ/VPCLMULQDQ folding kernels, python-isal bindings) computes the same
function several times faster and is used when installed (``docs/performance.md``). CRC-32C (``crc32c``/``google-crc32c``) is a
different polynomial (Castagnoli) and cannot check zip entries: ``crc32(b"123456789")`` is
``0xCBF43926``, CRC-32C of it ``0xE3069283``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["crc32", "crc32_array", "crc32_c_function", "crc32_combine", "IMPLEMENTATION", "zlib_crc32"]

zlib_crc32: Callable[[Any, int], int] = zlib.crc32

try:
    from isal import isal_zlib as _isal

    crc32: Callable[[Any, int], int] = _isal.crc32
    #: ``crc32_combine(crc_a, crc_b, len_b)``: the CRC-32 of ``a + b`` from the two parts' (``None`` without isal).
    crc32_combine: Callable[[int, int, int], int] | None = _isal.crc32_combine
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - isal ships wheels for every platform torch supports
    crc32 = zlib.crc32
    crc32_combine = None
    IMPLEMENTATION = "zlib"


@cache
def crc32_c_function() -> int | None:
    """The address of ISA-L's ``uint32_t crc32_gzip_refl(uint32_t crc, const unsigned char *buf, uint64_t len)``
    (the function :data:`crc32` calls, exported by python-isal's extension) for the native kernels, or ``None``."""
    if IMPLEMENTATION != "isal":
        return None
    import ctypes

    from isal import isal_zlib

    try:
        fn = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    except (OSError, AttributeError):  # an isal build that does not export it: the Python loop runs
        return None
    address: int | None = ctypes.cast(fn, ctypes.c_void_p).value
    return address


#: Bytes from which :func:`crc32_array` calls the native kernel (below: ctypes' per-call cost outweighs its speed).
NATIVE_MIN_BYTES = 1 << 16


@cache
def _native() -> tuple[Any, int] | None:
    """``ckpt_crc32`` (``engine/native/crc.c``) and ISA-L's ``crc32_gzip_refl`` address, or ``None``."""
    fn = crc32_c_function()
    if fn is None:
        return None
    import ctypes

    from ckpttool.engine import native

    f = native.function(
        "ckpt_crc32", ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64
    )
    return None if f is None else (f, fn)


def crc32_array(data: Any, value: int = 0) -> int:
    """:data:`crc32` of a C-contiguous numpy array's bytes (any dtype, ``data.nbytes`` of them), continuing ``value``.

    Arrays of at least :data:`NATIVE_MIN_BYTES` go through the native ``ckpt_crc32`` (256-bit VPCLMULQDQ folding
    where the CPU has it, ~1.7x ISA-L's 128-bit kernel on AMD Zen; ``docs/performance.md``), the GIL released;
    the same value as :data:`crc32` (``tests/engine/test_crc_native.py``). Smaller arrays, or no native kernels /
    isal: :data:`crc32` itself (which takes only contiguous buffers).
    """
    k = _native()
    if k is None or data.nbytes < NATIVE_MIN_BYTES or not data.flags.c_contiguous:
        return int(crc32(data, value))
    return int(k[0](k[1], value, data.ctypes.data, data.nbytes))
