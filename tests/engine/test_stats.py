"""The engine's statistics slab kernel against float64 references of torch-converted values."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from ckpttool.engine import kernels
from ckpttool.engine.stats import Need, SlabStats, add_slab

_ALL = Need(zeros=True, negative=True, sums=True, bound=1e4)


def _slab(dtype: str, n: int = 5000) -> tuple[np.ndarray, np.ndarray]:
    """Raw bytes of ``n`` values of ``dtype`` (NaN, ±inf, ±0, a value beyond 1e4, a run of subnormals, in
    the first slab: the kernel's strided sample sees it) and the float64 reference of the stored values."""
    rng = np.random.default_rng(11)
    f = rng.standard_normal(n).astype(np.float32)
    f[::97] = np.nan
    f[::89] = -np.inf
    f[5::101] = np.inf
    f[3::31] = 0.0
    f[4::37] = -0.0
    f[7] = 3.0e4
    f[100:400] = 1e-39 if dtype != "float16" else 1e-6  # a run of subnormals (float16: ordinary small values)
    t = torch.from_numpy(f).to(getattr(torch, dtype))
    return t.view(torch.uint8).numpy(), t.double().numpy()


@pytest.mark.parametrize("dtype", sorted(kernels.IEEE_BITS))
@pytest.mark.parametrize("slabs", [1, 3])
def test_add_slab_against_float64(dtype: str, slabs: int) -> None:
    raw, ref = _slab(dtype)
    item = raw.size // ref.size
    acc = SlabStats()
    bounds = np.linspace(0, ref.size, slabs + 1).astype(int)
    for a, b in zip(bounds, bounds[1:]):
        part = SlabStats()  # slabs summed in separate accumulators, then merged
        out = add_slab(part, raw[a * item : b * item], dtype, _ALL)
        assert out is not None
        w, sq = out
        np.testing.assert_array_equal(w.astype(np.float64), np.where(np.isfinite(ref[a:b]), ref[a:b], 0.0))
        acc.merge(part)
    fin = ref[np.isfinite(ref)]
    assert acc.numel == ref.size and acc.nonfinite == int((~np.isfinite(ref)).sum())
    assert acc.zeros == int((fin == 0).sum())  # -0.0 is a zero
    assert acc.negative == int((ref < 0).sum()) and acc.neg_min == float(ref[ref < 0].min())
    assert acc.abs_max == float(np.abs(fin).max()) and not acc.all_zero
    assert math.isclose(acc.s1, float(fin.sum()), rel_tol=1e-6, abs_tol=1e-6 * float(np.abs(fin).sum()))
    assert math.isclose(acc.s2, float((fin * fin).sum()), rel_tol=1e-6)
    assert acc.beyond == int((np.abs(fin) > 1e4).sum()) and acc.beyond_max == float(np.abs(fin).max())
    tiny = np.finfo(np.float32).tiny if dtype in ("bfloat16", "float32") else np.finfo(np.float64).tiny
    want_sub = int(((fin != 0) & (np.abs(fin) < tiny)).sum()) if dtype != "float16" else 0
    assert acc.subnormal == want_sub


@pytest.mark.parametrize("dtype", sorted(kernels.IEEE_BITS))
def test_add_slab_zeros_and_what_is_not_asked(dtype: str) -> None:
    zeros = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=getattr(torch, dtype)).view(torch.uint8).numpy()
    acc = SlabStats()
    assert add_slab(acc, zeros, dtype, Need(zeros=True)) is None
    assert (acc.numel, acc.zeros, acc.all_zero, acc.abs_max, acc.nonfinite) == (4, 4, True, 0.0, 0)
    raw, ref = _slab(dtype)
    bare = SlabStats()
    add_slab(bare, raw, dtype, Need())  # only the bit-pattern reductions: nothing else counted
    assert (bare.zeros, bare.negative, bare.neg_min, bare.s1, bare.s2, bare.beyond) == (0, 0, None, 0.0, 0.0, 0)
    assert bare.nonfinite == int((~np.isfinite(ref)).sum()) and not bare.all_zero
    empty = SlabStats()
    add_slab(empty, raw[:0], dtype, _ALL)
    assert (empty.numel, empty.all_zero) == (0, True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bufsize", [1 << 20, 1000, 4098])
def test_stats_sink_cuts_the_same_slabs_whatever_the_reads(tmp_path, dtype: str, bufsize: int) -> None:
    """The executor's ``Stats`` sink equals :func:`add_slab` over fixed slabs of the stream, bit for bit,
    with blocks that end inside slabs and values (the carried part); ``each`` sees every slab once."""
    from ckpttool.engine.crc import crc32
    from ckpttool.engine.execute import run_item
    from ckpttool.engine.plan import Crc32, Item, Stats

    rng = np.random.default_rng(5)
    t = torch.from_numpy(rng.standard_normal(10_000).astype(np.float32)).to(getattr(torch, dtype))
    t[17] = float("nan")
    raw = t.view(torch.uint8).numpy()
    path = tmp_path / "values.bin"
    path.write_bytes(b"head" + raw.tobytes())
    need, slab = Need(zeros=True, sums=True), 3000
    ref = SlabStats()
    for a in range(0, t.numel(), slab):
        add_slab(ref, raw[a * t.element_size() : (a + slab) * t.element_size()], dtype, need)
    firsts: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        sink = Stats(dtype, need, slab, lambda v, sq, first: firsts.append(first))
        crc, got = run_item(Item.of(fd, 4, raw.size, Crc32(), sink), buf=memoryview(bytearray(bufsize)))
    finally:
        os.close(fd)
    assert got == ref and crc == crc32(raw, 0)
    assert firsts == list(range(0, t.numel(), slab))
