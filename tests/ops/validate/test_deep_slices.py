"""The ``--deep`` pass's numpy slice kernels against torch's own conversions and reductions."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ckpttool.ops.validate.deep import _compare_np, _PairCount, _summarise_np


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _masters(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    m = torch.randn(n, generator=g) * 0.05
    bits = m.view(torch.int32)
    bits[::97] = (bits[::97] & ~0xFFFF) | 0x8000  # exact ties between two BF16 neighbours (both parities)
    m[5] = float("nan")
    m[6] = float("inf")
    m[7] = -float("inf")
    m[8] = 3.4e38  # rounds to inf in BF16
    m[9] = -0.0
    bits[10] = 0x7F800001  # NaN with a tiny payload (the bit trick alone would call it inf)
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_pair_comparison_equals_torch(dtype: torch.dtype) -> None:
    m = _masters(1 << 16)
    for damage in (False, True):
        p = m.to(dtype)
        if damage:
            p.view(torch.int16)[100:110] ^= 1  # one ulp off
            p[11] = float("nan")  # NaN parameter, finite master
        want_ne = (p != m.to(dtype)) & ~(torch.isnan(p) & torch.isnan(m.to(dtype)))
        c = _PairCount()
        finite = bool(torch.isfinite(m).all())
        _compare_np(c, "master", _raw(p), str(dtype).removeprefix("torch."), _raw(m), "float32", finite)
        assert c.numel == m.numel()
        assert c.mismatched == int(want_ne.sum()), damage
        if damage:
            d = (p[want_ne].float() - m[want_ne]).abs()
            d = d[~torch.isnan(d)]
            assert c.max_diff == pytest.approx(float(d.max()))


def test_tied_pair_and_finite_fast_path() -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.randn(4096, generator=g).to(torch.bfloat16)
    b = a.clone()
    c = _PairCount()
    _compare_np(c, "tied", _raw(a), "bfloat16", _raw(b), "bfloat16", True)
    assert (c.numel, c.mismatched) == (4096, 0)
    b[17] = b[17] * 2
    _compare_np(c, "tied", _raw(a), "bfloat16", _raw(b), "bfloat16", True)
    assert c.mismatched == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_summary_counts_equal_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(10_000, generator=g) * 0.1).to(dtype)
    st = _summarise_np("k.exp_avg_sq", _raw(t), str(dtype).removeprefix("torch."), True, False)
    assert st is not None and st.nonfinite == 0 and st.negative == int((t < 0).sum())
    assert st.min == pytest.approx(float(t.min()))
    t[3], t[4], t[5] = float("nan"), float("-inf"), -0.0
    st = _summarise_np("k", _raw(t), str(dtype).removeprefix("torch."), False, False)
    assert st is not None and st.nonfinite == 2 and st.negative == 0
    abs_t = t.abs()
    abs_t[5], abs_t[6] = -0.0, -1.0
    st = _summarise_np("k.exp_avg_sq", _raw(abs_t), str(dtype).removeprefix("torch."), True, False)
    assert st is not None and st.negative == 1 and st.min == -1.0  # -0.0 is not negative


def test_short_read_of_a_slice_is_the_chunk_error_it_always_was(tmp_path) -> None:
    from types import SimpleNamespace

    from ckpttool.engine.plan import Lockstep, Window
    from ckpttool.errors import ChunkError
    from ckpttool.ops.validate.deep import _lockstep

    f = tmp_path / "__0_0.distcp"
    f.write_bytes(b"x" * 100)
    loc = SimpleNamespace(where="__0_0.distcp: 'model.w' chunk at (0,)", info=SimpleNamespace(relative_path=f.name))
    loc.key = "model.w"
    seen: list[bytes] = []
    fd = os.open(f, os.O_RDONLY)
    try:
        _lockstep(Lockstep(((Window(fd, 30, 64),),), (1,), lambda s, _: seen.append(bytes(s[0])), 64), loc)
        assert seen == [b"x" * 64]
        with pytest.raises(ChunkError) as ei:
            _lockstep(Lockstep(((Window(fd, 60, 64),),), (1,), lambda s, _: None, 64), loc)
    finally:
        os.close(fd)
    e = ei.value
    assert e.message == f"{loc.where}: short read" and e.fqn == "model.w" and e.path == f.name
    assert e.__cause__ is None


def test_deep_reads_packed_fp4_without_failing(tmp_path: object) -> None:
    # float4_e2m1fn_x2 (two E2M1 values per byte, NVFP4/MXFP4 weights) saved by dcp.save: torch has no
    # conversion of it to float, and E2M1 holds no NaN or infinity, so --deep reads it without value statistics
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    ck = Path(str(tmp_path)) / "ck"
    w = torch.arange(16, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    dcp.save({"model": {"w": w, "norm": torch.ones(4)}}, checkpoint_id=str(ck), no_dist=True)
    res = CliRunner().invoke(app, ["validate", "--deep", "--json", str(ck)])
    assert res.exit_code == 0, res.stderr
    assert "E999" not in res.stderr
