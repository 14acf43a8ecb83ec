"""CRC-32 of zip entries: :mod:`ckpttool.engine.crc` (the engine computes it as bytes pass)."""

from __future__ import annotations

from ckpttool.engine.crc import IMPLEMENTATION, crc32, crc32_combine, zlib_crc32

__all__ = ["crc32", "crc32_combine", "IMPLEMENTATION", "zlib_crc32"]
