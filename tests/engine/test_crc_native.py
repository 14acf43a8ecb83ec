"""The native CRC-32 (``engine/native/crc.c`` ``ckpt_crc32``: 256-bit VPCLMULQDQ folding, finished by ISA-L's
``crc32_gzip_refl``) against ``zlib.crc32``: every length 0..4096 from several alignments and initial values, and
large buffers at every alignment 0..32 (on a CPU without VPCLMULQDQ it is ISA-L's function alone)."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from ckpttool.engine import native
from ckpttool.engine.crc import crc32_c_function

_FN = native.function("ckpt_crc32", ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64)
_ISAL = crc32_c_function()
pytestmark = pytest.mark.skipif(_FN is None or _ISAL is None, reason="native kernels or isal not available")

_BYTES = np.random.default_rng(32).integers(0, 256, (1 << 21) + 64, dtype=np.uint8)


def _crc(off: int, n: int, crc: int) -> int:
    return int(_FN(_ISAL, crc, _BYTES.ctypes.data + off, n))


@pytest.mark.parametrize("off", [0, 1, 3, 8, 17, 32])
def test_every_length_to_4096(off: int) -> None:
    rng = np.random.default_rng(off)
    for n in range(4097):
        crc = int(rng.integers(0, 1 << 32))
        assert _crc(off, n, crc) == zlib.crc32(_BYTES[off : off + n].tobytes(), crc), (off, n)


@pytest.mark.parametrize("n", [1 << 17, (1 << 20) + 127, (1 << 21) - 1, 1000003])
def test_large_buffers_at_every_alignment(n: int) -> None:
    for off in range(33):
        m = min(n, _BYTES.size - off)
        data = _BYTES[off : off + m].tobytes()
        assert _crc(off, m, 0) == zlib.crc32(data), (n, off)
        assert _crc(off, m, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF), (n, off)


def test_special_bytes() -> None:
    for fill in (0x00, 0xFF):
        buf = np.full(70000, fill, np.uint8)
        for crc in (0, 0xFFFFFFFF):
            assert int(_FN(_ISAL, crc, buf.ctypes.data, buf.size)) == zlib.crc32(buf.tobytes(), crc)


@pytest.mark.parametrize("n", [0, 1, 1000, (1 << 16) - 1, 1 << 16, (1 << 16) + 5, 1 << 21])
def test_crc32_array_equals_zlib(n: int) -> None:
    from ckpttool.engine.crc import crc32_array

    a = _BYTES[3 : 3 + n]
    for value in (0, 0xDEADBEEF):
        assert crc32_array(a, value) == zlib.crc32(a.tobytes(), value), (n, value)
    if n >= 8:  # other dtypes: their bytes
        f = _BYTES[: n - n % 4].view(np.float32)
        assert crc32_array(f, 7) == zlib.crc32(f.tobytes(), 7)
