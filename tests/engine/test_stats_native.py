"""The native statistics kernels (``engine/native/stats.c``) against the numpy kernel and torch.

Counts, flags and maxima must equal the numpy kernel's exactly; sums agree to a relative 1e-6 (the
native kernel adds in float64, numpy in float32 blocks of 1024) and both to torch's float64 sums.
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpttool.engine import stats
from ckpttool.engine.kernels import float_values
from ckpttool.engine.stats import Need, SlabStats, add_slab, fold_slab, moment_ratio

pytestmark = pytest.mark.skipif(not stats.native_stats(), reason="native kernels not built or CKPTTOOL_NATIVE=0")

_DTYPES = ("bfloat16", "float16", "float32", "float64")
_NEEDS = (
    Need(zeros=True, negative=True, sums=True, bound=1e4),
    Need(),
    Need(zeros=True, sums=True),
    Need(negative=True, bound=1e4),
)
_EXACT = (
    "numel",
    "nonfinite",
    "all_zero",
    "abs_max",
    "zeros",
    "negative",
    "neg_min",
    "beyond",
    "beyond_max",
    "subnormal",
)


def _values(kind: str, n: int, dtype: str) -> torch.Tensor:
    rng = np.random.default_rng(n)
    f = rng.standard_normal(n) * 3.0
    if kind == "special":
        f[::97], f[::89], f[5::101] = np.nan, -np.inf, np.inf
        f[3::31], f[4::37] = 0.0, -0.0
        f[7 % n] = 3.0e4 if dtype != "float16" else 2.0e4
        f[100:400] = 1e-39 if dtype in ("bfloat16", "float32") else (1e-310 if dtype == "float64" else 1e-6)
    elif kind == "zeros":
        f[:] = 0.0
        f[1::2] = -0.0
    elif kind == "negative":
        f = -np.abs(f) - 1e-3
    elif kind == "huge":  # squares beyond float32's range (finite in float64, where the kernels square)
        f[::3] = 3e19
    return torch.from_numpy(f).to(getattr(torch, dtype))


def _same(a: SlabStats, b: SlabStats, fin: np.ndarray) -> None:
    for name in _EXACT:
        assert getattr(a, name) == getattr(b, name), name
    scale = float(np.abs(fin).sum()) if fin.size else 0.0
    assert math.isclose(a.s1, b.s1, rel_tol=1e-6, abs_tol=1e-6 * scale + 1e-300)
    assert a.s2 == b.s2 or math.isclose(a.s2, b.s2, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("kind", ["random", "special", "zeros", "negative", "huge"])
@pytest.mark.parametrize("n", [17, 5003])
def test_fold_slab_equals_the_numpy_kernel_and_torch(dtype: str, kind: str, n: int) -> None:
    t = _values(kind, n, dtype)
    raw = t.view(torch.uint8).numpy()
    ref = t.double().numpy()
    fin = ref[np.isfinite(ref)]
    for need in _NEEDS:
        a, b = SlabStats(), SlabStats()
        add_slab(a, raw, dtype, need)
        fold_slab(b, raw, dtype, need)
        _same(a, b, fin)
    b = SlabStats()
    fold_slab(b, raw, dtype, _NEEDS[0])
    # an independent reference: torch's own float64 values
    assert b.nonfinite == int((~torch.isfinite(t)).sum()) and b.zeros == int((fin == 0).sum())
    assert b.abs_max == (float(np.abs(fin).max()) if fin.size else 0.0)
    assert b.negative == int((ref < 0).sum())
    assert math.isclose(b.s1, float(fin.sum()), rel_tol=1e-9, abs_tol=1e-9 * float(np.abs(fin).sum()) + 1e-300)
    finite = t.double()[torch.isfinite(t)]  # squares in float64: exact for float32 values (no overflow, no underflow)
    assert math.isclose(b.s2, float((finite * finite).sum()), rel_tol=1e-9)


def _moment_pair(dtype: str, n: int, damaged: bool) -> tuple[np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(n)
    m = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    v = torch.rand(n, generator=g, dtype=torch.float64) * 1e-6
    if damaged:
        m[::7], v[::11], v[3::13], m[5::17] = float("nan"), -1e-7, 0.0, float("inf")
    m, v = m.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    return m.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("damaged", [False, True])
@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_adam_sizes_equal_numpy_and_torch(dtype: str, damaged: bool, eps: float) -> None:
    from ckpttool.ops.stats.compute import AdamHyper, Moments, ValueSums, add_moments

    m_raw, v_raw = _moment_pair(dtype, 4099, damaged)
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=eps, step=7.0)
    ref_upd, ref_m, ref_v = Moments(), ValueSums(), ValueSums()
    stats.use_native(False)
    try:
        add_moments(ref_m, ref_v, h, ref_upd, (m_raw, dtype), (v_raw, dtype))
    finally:
        stats.use_native(True)
    upd, ms, vs = Moments(), ValueSums(), ValueSums()
    add_moments(ms, vs, h, upd, (m_raw, dtype), (v_raw, dtype))
    assert (upd.numel, upd.max) == (ref_upd.numel, ref_upd.max)
    assert math.isclose(upd.s2, ref_upd.s2, rel_tol=1e-6)
    for a, b in ((ms, ref_m), (vs, ref_v)):
        _same(a.acc, b.acc, np.zeros(0))
    # torch, in float64 from the stored values: the same update sizes to float32 rounding
    work = torch.float64 if dtype == "float64" else torch.float32
    mt = torch.from_numpy(m_raw.copy()).view(getattr(torch, dtype)).to(work)
    vt = torch.from_numpy(v_raw.copy()).view(getattr(torch, dtype)).to(work)
    mt, vt = (
        torch.nan_to_num(mt, nan=0.0, posinf=0.0, neginf=0.0),
        torch.nan_to_num(vt, nan=0.0, posinf=0.0, neginf=0.0),
    )
    bc1, bc2 = 1 - 0.9**7, 1 - 0.999**7
    u = (1e-3 / bc1) * mt.double() / (vt.clamp(min=0).double().sqrt() / math.sqrt(bc2) + eps)
    u = u[torch.isfinite(u)]
    assert upd.numel == u.numel()
    assert math.isclose(upd.max, float(u.abs().max()), rel_tol=1e-5)
    assert math.isclose(upd.s2, float((u * u).sum()), rel_tol=1e-4)


@pytest.mark.parametrize(
    "dtypes", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "float64"), ("float64", "float64")]
)
@pytest.mark.parametrize("damaged", [False, True])
def test_moment_ratio_equals_numpy(dtypes: tuple[str, str], damaged: bool) -> None:
    from ckpttool.ops.validate.deep import _moments_np, _PairCount

    m_raw, _ = _moment_pair(dtypes[0], 3001, damaged)
    _, v_raw = _moment_pair(dtypes[1], 3001, damaged)
    top = moment_ratio(m_raw, dtypes[0], v_raw, dtypes[1])
    assert top is not None
    ref = _PairCount()
    _moments_np(ref, float_values(m_raw, dtypes[0]), float_values(v_raw, dtypes[1]))
    if top == math.inf:  # the caller's exact numpy path
        assert damaged
    else:
        assert ref.max_diff == (math.sqrt(top) if top > 0 else 0.0)
    assert moment_ratio(m_raw[:0], dtypes[0], v_raw[:0], dtypes[1]) == -math.inf


def test_numpy_kernel_everywhere_when_turned_off() -> None:
    """``CKPTTOOL_NATIVE=0``: every statistics kernel is numpy's (in a fresh process)."""
    code = (
        "from ckpttool.engine import stats; import numpy as np;"
        "r = np.zeros(8, np.uint8);"
        "print(stats.native_stats(), stats.adam_sizes(r, 'float32', r, 'float32', 1e-8), stats.moment_ratio(r, 'float32', r, 'float32'))"
    )
    env = {**os.environ, "CKPTTOOL_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None", "None"]


def _lane_sums(x: np.ndarray) -> tuple[float, float]:
    """The native fold's documented sums, bit for bit, computed sequentially in float64: value ``i + j`` of each
    group of 16 into lane ``j`` (the tail after the groups into lane 0), non-finite read as 0, each square taken
    in float64 (exact for a float32 value: finite beyond FLT_MAX), the lanes added in order."""
    fin = np.where(np.isfinite(x), x, 0).astype(x.dtype)
    v = fin.astype(np.float64)
    sq = v * v
    g = v.size - v.size % 16
    out = []
    for w in (v, sq):
        lanes = [float(np.cumsum(w[j:g:16])[-1]) if g else 0.0 for j in range(16)]
        for t in w[g:]:
            lanes[0] += float(t)
        s = 0.0
        for a in lanes:
            s += a
        out.append(s)
    return out[0], out[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["random", "special", "huge", "inf-late"])
def test_fold_sums_are_the_documented_lane_sums_bit_for_bit(dtype: str, kind: str) -> None:
    """The AVX2 fold's fast pass (values unmasked, checked by the lanes staying finite) and its masked pass give
    the same lane sums: bit-equal to the sequential reference with non-finite values and values whose squares are
    beyond FLT_MAX."""
    n = 70001
    t = _values("random" if kind == "inf-late" else kind, n, dtype)
    if kind == "inf-late":
        t[n - 40] = float("inf")  # the last piece's groups only
    x = t.float().numpy()
    b = SlabStats()
    fold_slab(b, t.view(torch.uint8).numpy(), dtype, Need(zeros=True, sums=True))
    s1, s2 = _lane_sums(x)
    assert (b.s1, b.s2) == (s1, s2)


def _update_lane_sums(m: np.ndarray, v: np.ndarray, eps: float) -> tuple[int, float, float]:
    """The native AdamW update size's documented result, computed by numpy: ``u = m / (sqrt(max(v, 0)) + eps)``
    in float32 (non-finite moments read as 0, non-finite ``u`` left out), each ``u * u`` in float64 added into
    lane ``i % 16`` (the tail after the groups into lane 0), the lanes added in order; the count and ``max |u|``."""
    m = np.where(np.isfinite(m), m, 0).astype(np.float32)
    v = np.where(np.isfinite(v), v, 0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        u = m / (np.sqrt(np.maximum(v, np.float32(0))) + np.float32(eps))
    fin = np.isfinite(u)
    sq = np.where(fin, u, 0).astype(np.float64) ** 2
    g = sq.size - sq.size % 16
    lanes = [float(np.cumsum(sq[j:g:16])[-1]) if g else 0.0 for j in range(16)]
    for t in sq[g:]:
        lanes[0] += float(t)
    s = 0.0
    for a in lanes:
        s += a
    return int(fin.sum()), s, float(np.abs(u[fin]).max())


_ISA_CODE = """
import ctypes, sys
import numpy as np
from ckpttool.engine import native, stats
from ckpttool.engine.stats import Need, SlabStats
raw = np.load(sys.argv[1])
out = [native.function("ckpt_stats_isa", ctypes.c_int32)()]
for damaged in ("clean", "damaged"):
    got = stats.adam_sizes(raw["m_" + damaged], "float32", raw["v_" + damaged], "float32", 1e-8)
    out.append([float(x).hex() for x in got])
for dtype in ("bfloat16", "float16", "float32"):
    acc = SlabStats()
    stats.fold_slab(acc, raw[dtype], dtype, Need(zeros=True, sums=True))
    out.append([acc.nonfinite, acc.zeros, acc.abs_max.hex(), acc.s1.hex(), acc.s2.hex()])
print(repr(out))
"""


def test_update_sizes_the_same_bits_on_every_instruction_set(tmp_path: Path) -> None:
    """The AdamW update size of float32 moments runs an AVX-512 kernel on an AMD CPU that has it, AVX2 or plain C
    elsewhere (``CKPTTOOL_NATIVE_ISA=avx2`` / ``scalar`` pick them): each gives numpy's update sizes in the
    documented lanes bit for bit, and the statistics folds agree bit for bit too."""
    raw: dict[str, np.ndarray] = {}
    expected = []
    for damaged in (False, True):
        m_raw, v_raw = _moment_pair("float32", 70001, damaged)
        name = "damaged" if damaged else "clean"
        raw["m_" + name], raw["v_" + name] = m_raw, v_raw
        ref = _update_lane_sums(m_raw.view(np.float32), v_raw.view(np.float32), 1e-8)
        got = stats.adam_sizes(m_raw, "float32", v_raw, "float32", 1e-8)
        assert got is not None
        assert (int(got[0]), got[1], got[2]) == ref
        expected.append([float(x).hex() for x in got])
    for dtype in ("bfloat16", "float16", "float32"):
        raw[dtype] = _values("special", 70001, dtype).view(torch.uint8).numpy()
    np.savez(tmp_path / "raw.npz", **raw)
    runs = {}
    for isa in ("", "avx2", "scalar"):
        env = {**os.environ, "CKPTTOOL_NATIVE_ISA": isa}
        argv = [sys.executable, "-c", _ISA_CODE, str(tmp_path / "raw.npz")]
        runs[isa] = ast.literal_eval(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout)
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "AuthenticAMD"} <= flags  # measured on AMD Zen 4 only
    widest = 2 if avx512 else (1 if "avx2" in flags else 0)
    assert {isa: out[0] for isa, out in runs.items()} == {"": widest, "avx2": min(widest, 1), "scalar": 0}
    assert runs[""][1:] == runs["avx2"][1:] == runs["scalar"][1:]
    assert runs[""][1:3] == expected
