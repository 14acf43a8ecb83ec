"""The native record mover (``engine/move.py``, ``ckpt_stream_cast`` of ``engine/native/cast.c``).

References: numpy's views of the source bytes, :func:`ckpttool.engine.kernels.cast` (the slab
path's cast), ``zlib.crc32`` of the bytes read. Runs cross the 256 KiB read pieces and the 1 MiB
write stage, skip stretches (read for the CRC-32 only) and land in two files.
"""

from __future__ import annotations

import os
import zlib
from array import array
from pathlib import Path

import numpy as np
import pytest

from ckpttool.engine import kernels, move
from ckpttool.engine.io import ShortReadError

pytestmark = pytest.mark.skipif(
    not move.available("float32", "bfloat16", crc=True), reason="native kernels not built or CKPTTOOL_NATIVE=0"
)

_HEAD = 4096 + 12  # the record starts at an unaligned offset, as inside a zip archive


def _source(tmp_path: Path, n: int, big: float = 3.4e38) -> tuple[int, np.ndarray]:
    rng = np.random.default_rng(5)
    vals = rng.standard_normal(n).astype(np.float32)
    vals[7] = np.nan
    vals[n // 2] = np.float32(big)
    path = tmp_path / "src.bin"
    path.write_bytes(b"\x01" * _HEAD + vals.tobytes() + b"\x02" * 100)
    return os.open(path, os.O_RDONLY), vals


@pytest.mark.parametrize(
    ("src_dtype", "out_dtype"),
    [("float32", "bfloat16"), ("float32", "float16"), ("float32", "float32"), ("bfloat16", "float32")],
)
def test_runs_equal_the_slab_cast_and_crc(tmp_path: Path, src_dtype: str, out_dtype: str) -> None:
    # float16 and bfloat16 hold no 3.4e38 (test_cast_overflow_is_refused): float16's source has an infinity there
    # instead, bfloat16's its largest finite value (float32 0x7F7F7FFF rounds to it)
    big = {"float16": np.inf, "bfloat16": np.uint32(0x7F7F7FFF).view(np.float32)}.get(out_dtype, 3.4e38)
    fd, vals = _source(tmp_path, 700_001, float(big))  # 2.8 MB: many pieces
    item, out_item = (4, 4 if out_dtype == "float32" else 2) if src_dtype == "float32" else (2, 4)
    n = vals.nbytes // item  # bfloat16: the same bytes as twice as many values
    want = np.empty(n * out_item, dtype=np.uint8)
    if out_dtype == src_dtype:
        want[:] = vals.view(np.uint8)
    else:
        kernels.cast(vals.view(np.uint8), want, src_dtype, out_dtype)
    # runs in source order: a skipped stretch, one into file a, one into file b (reversed halves), a tail into a
    cuts = [0, 1000, 300_000, 500_000, 650_000, n]
    fa, fb = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT), os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT)
    parts = array(
        "q",
        [
            *(cuts[1] - cuts[0], -1, 0),
            *(cuts[2] - cuts[1], fa, 16),
            *(cuts[3] - cuts[2], fb, (cuts[4] - cuts[3]) * out_item),
            *(cuts[4] - cuts[3], fb, 0),
            *(cuts[5] - cuts[4], fa, 16 + (cuts[2] - cuts[1]) * out_item),
        ],
    )
    try:
        crc = move.move_runs(fd, _HEAD, parts, src_dtype, out_dtype, item, 0)
        a, b = os.pread(fa, 1 << 24, 16), os.pread(fb, 1 << 24, 0)
    finally:
        for f in (fd, fa, fb):
            os.close(f)
    w = want.tobytes()
    assert crc == zlib.crc32(vals.tobytes())
    o = out_item
    assert a == w[cuts[1] * o : cuts[2] * o] + w[cuts[4] * o :]
    assert b == w[cuts[3] * o : cuts[4] * o] + w[cuts[2] * o : cuts[3] * o]


def test_crc_carries_across_calls_and_none_skips_it(tmp_path: Path) -> None:
    fd, vals = _source(tmp_path, 100_000)
    try:
        c = move.move_runs(fd, _HEAD, array("q", [40_000, -1, 0]), "float32", "float32", 4, 0)
        c = move.move_runs(fd, _HEAD + 160_000, array("q", [60_000, -1, 0]), "float32", "float32", 4, c)
        assert c == zlib.crc32(vals.tobytes())
        assert move.move_runs(fd, _HEAD, array("q", [100, -1, 0]), "float32", "bfloat16", 4, None) is None
    finally:
        os.close(fd)


def test_short_source_and_failed_write_raise(tmp_path: Path) -> None:
    fd, _ = _source(tmp_path, 1000)
    ro = os.open(tmp_path / "src.bin", os.O_RDONLY)  # not writable: the pwrite fails with EBADF
    try:
        with pytest.raises(ShortReadError) as e:
            move.move_runs(fd, _HEAD, array("q", [2000, -1, 0]), "float32", "bfloat16", 4, 0)
        assert (e.value.offset, e.value.missing) == (_HEAD + 4100, 8000 - 4100)
        with pytest.raises(OSError) as err:
            move.move_runs(fd, _HEAD, array("q", [10, ro, 0]), "float32", "bfloat16", 4, 0)
        assert not isinstance(err.value, ShortReadError)
        with pytest.raises(ValueError, match="float16 as float32"):
            move.move_runs(fd, _HEAD, array("q", [10, -1, 0]), "float16", "float32", 2, 0)
    finally:
        os.close(fd)
        os.close(ro)


@pytest.mark.parametrize(("out_dtype", "big"), [("float16", 7e4), ("float16", 3.4e38), ("bfloat16", 3.4e38)])
def test_cast_overflow_is_refused(tmp_path: Path, out_dtype: str, big: float) -> None:
    """A finite float32 value beyond the target's range (float16: +-65504; bfloat16: from 3.39618e38), which the
    cast makes infinite, stops the move, naming its run, its index in the run and its bits; an infinity stored as
    such is cast as it is (the test above)."""
    fd, vals = _source(tmp_path, 700_001, big)
    fa = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT)
    parts = array("q", [1000, -1, 0, 300_000, fa, 0, 399_001, fa, 600_000])
    try:
        with pytest.raises(move.CastOverflow) as info:
            move.move_runs(fd, _HEAD, parts, "float32", out_dtype, 4, 0)
    finally:
        os.close(fd), os.close(fa)
    e = info.value
    assert (e.run, e.index, e.bits) == (2, 350_000 - 301_000, int(vals[350_000:350_001].view(np.uint32)[0]))
