"""The one-pass native slab kernel (``ops/replay/kernel.py``) against the torch path of ``_SlabContext``.

Both paths run on the same slab (saved values served from memory, the replayed fields beside
them) and must give the same partial results bit for bit: every ``FieldError`` quantity, the
sync / write-back counts and the update-size maxima, on random data with NaN, infinities,
signed zeros and subnormals, BF16 and FP32 parameters, plain and FP32-master AdamW, fresh
state, weight decay on and off.
"""

from __future__ import annotations

import math
import struct
from dataclasses import astuple
from typing import Any

import pytest
import torch

from ckpttool.model.catalog import TensorEntry
from ckpttool.ops.replay.kernel import slab_kernel
from ckpttool.ops.replay.plan import Hyper, ParamPlan
from ckpttool.ops.replay.run import ParamResult, _SlabContext
from ckpttool.optim_state.reference import reference_adamw_step

pytestmark = pytest.mark.skipif(slab_kernel() is None, reason="native kernels not built or CKPTTOOL_NATIVE=0")

N = 4099


class _Memory:
    """Saved values of one tensor served from memory (the ``TensorSlabs.read`` contract)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.reshape(-1)
        self.dtype = str(t.dtype)[6:]

    def read(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.t[a:b])


def _special_values(t: torch.Tensor, g: torch.Generator, subnormal: float, nonfinite: bool) -> torch.Tensor:
    """``t`` with +-0, subnormals and (``nonfinite``) NaN and +-inf at random places."""
    t = t.clone()
    values = (math.nan, math.inf, -math.inf) if nonfinite else ()
    for value in (*values, 0.0, -0.0, subnormal, -subnormal):
        idx = torch.randint(0, t.numel(), (N // 97,), generator=g)
        t[idx] = value
    return t


def _jitter(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``t`` with a few elements moved by relative 1e-3 .. 1e-7 (some beyond tolerance, some not)."""
    t = t.clone()
    idx = torch.randint(0, t.numel(), (N // 13,), generator=g)
    rel = 10.0 ** -torch.randint(3, 8, (idx.numel(),), generator=g).double()
    t[idx] = t[idx] * (1 + rel)
    return t


def _case(pdtype: torch.dtype, master: bool, fresh: bool, wd: float, mdtype: torch.dtype, nonfinite: bool) -> Any:
    g = torch.Generator().manual_seed(int(wd * 10) + 2 * fresh + master)

    def _specials(t: torch.Tensor, g: torch.Generator, subnormal: float) -> torch.Tensor:
        return _special_values(t, g, subnormal, nonfinite)

    sub = 1e-40
    theta = _specials(torch.randn(N, generator=g, dtype=torch.float64) * 0.05, g, sub)
    m0 = _specials(torch.randn(N, generator=g, dtype=torch.float64) * 1e-3, g, sub)
    v0 = _specials(torch.randn(N, generator=g, dtype=torch.float64).square() * 1e-6, g, sub)
    grad = _specials(torch.randn(N, generator=g, dtype=torch.float64) * 1e-3, g, sub).to(pdtype)
    hyper = Hyper(0, 1e-3, 0.9, 0.95, 1e-8, wd)
    step = 0.0 if fresh else 10.0
    saved_master = theta.float()
    saved_param = saved_master.to(pdtype, copy=True)
    saved_param[torch.randint(0, N, (N // 50,), generator=g)] += 1.0  # out of sync before the step
    if fresh:
        m0, v0 = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    m0, v0 = m0.to(mdtype), v0.to(mdtype)
    start = saved_master if master and not fresh else saved_param
    ref = reference_adamw_step(start, grad, m0, v0, step, 1e-3, (0.9, 0.95), 1e-8, wd)
    st: dict[str, torch.Tensor] = {
        "exp_avg": _specials(_jitter(ref[1], g), g, sub).to(mdtype),
        "exp_avg_sq": _specials(_jitter(ref[2], g), g, sub).to(mdtype),
        "step": torch.tensor(step + 1.0),
    }
    new_master = _specials(_jitter(ref[0], g), g, sub).float()
    param = new_master.to(pdtype, copy=True) if master else _specials(_jitter(ref[0], g), g, sub).to(pdtype)
    param[torch.randint(0, N, (N // 40,), generator=g)] *= 2  # write-back differences
    saved = {"model.w": saved_param}
    state: dict[str, TensorEntry] = {}
    if not fresh:
        fields = {"exp_avg": m0, "exp_avg_sq": v0, **({"master_weight": saved_master} if master else {})}
        for f, t in fields.items():
            saved[f"optim.w.{f}"] = t
            state[f] = TensorEntry(f"optim.w.{f}", (N,), str(t.dtype)[6:], N, 0, (), (), ())
    if master:
        st["master_weight"] = new_master
    dname = str(pdtype)[6:]
    plan = ParamPlan(
        "w", "model.w", (N,), dname, N, hyper, "full_fp32_adamw" if master else "adamw", state, fresh=fresh,
        moment_dtype=str(mdtype)[6:],
    )  # fmt: skip
    return plan, saved, st, param, grad


def _bits(x: Any) -> Any:
    """Floats as their bit patterns (-0.0 != 0.0), recursively; a NaN as "nan" (no output shows its payload)."""
    if isinstance(x, float):
        return "nan" if x != x else struct.pack("<d", x)
    if isinstance(x, dict):
        return {k: _bits(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [_bits(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        return _bits(astuple(x))
    return x


@pytest.mark.parametrize(
    ("pdtype", "master", "fresh", "wd", "mdtype"),
    [
        (torch.bfloat16, True, False, 0.1, torch.float32),
        (torch.bfloat16, True, True, 0.0, torch.float32),
        (torch.float32, True, False, 0.0, torch.float32),
        (torch.bfloat16, False, False, 0.1, torch.bfloat16),
        (torch.float32, False, True, 0.1, torch.float32),
        (torch.float16, True, False, 0.1, torch.bfloat16),
    ],
)
@pytest.mark.parametrize(("atol", "nonfinite"), [(1e-8, True), (0.0, True), (1e-8, False)])
def test_native_slab_equals_the_torch_path_bitwise(
    pdtype: torch.dtype, master: bool, fresh: bool, wd: float, mdtype: torch.dtype, atol: float, nonfinite: bool
) -> None:
    plan, saved, st, param, grad = _case(pdtype, master, fresh, wd, mdtype, nonfinite)
    step = 0.0 if fresh else 10.0

    def ctx() -> _SlabContext:
        r = ParamResult("w", (N,), plan.dtype, N, plan.optimizer_type, 0, 1e-3, wd, "loaded", False, step)
        slabs = lambda key, model_key: _Memory(saved[key])  # noqa: E731
        return _SlabContext(plan, r, param, st, [{"w": grad}], slabs, 1, 1e-5, atol, torch.float64)

    native, reference = ctx(), ctx()
    assert native.native is not None
    reference.native = None
    for bounds in ((0, N), (5, 1029), (N - 3, N)):
        got, want = native.run(bounds), reference.run(bounds)
        assert _bits(got) == _bits(want), bounds
    # the fields are not trivially equal: values beyond tolerance, NaN maxima, sync / write-back differences
    whole = native.run((0, N))
    assert whole["fields"]["param"].bad > 0
    assert math.isinf(whole["fields"]["exp_avg"].ratio) == nonfinite
    if not nonfinite:
        e = whole["fields"]["exp_avg"]  # finite maxima compared too (a negative subnormal v0 makes theta NaN)
        assert 0 < e.max_abs < math.inf and 0 < e.ratio < math.inf
    if master and not fresh:
        assert whole["sync_unequal"] > 0 and whole["writeback_unequal"] > 0


def test_native_slab_agrees_on_clean_data() -> None:
    """Without special values every field passes and the two paths still agree bitwise."""
    g = torch.Generator().manual_seed(7)
    master = torch.randn(N, generator=g) * 0.05
    m0, v0 = torch.randn(N, generator=g) * 1e-3, torch.randn(N, generator=g).square() * 1e-6
    grad = (torch.randn(N, generator=g) * 1e-3).bfloat16()
    new_master, m1, v1, _ = reference_adamw_step(master, grad, m0, v0, 3.0, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    saved = {"model.w": master.bfloat16(), "s.m": m0, "s.v": v0, "s.mw": master}
    state = {
        f: TensorEntry(k, (N,), "float32", N, 0, (), (), ()) for f, k in (("exp_avg", "s.m"), ("exp_avg_sq", "s.v"))
    }
    state["master_weight"] = TensorEntry("s.mw", (N,), "float32", N, 0, (), (), ())
    plan = ParamPlan(
        "w", "model.w", (N,), "bfloat16", N, Hyper(0, 1e-3, 0.9, 0.95, 1e-8, 0.1), "full_fp32_adamw", state
    )
    st = {"master_weight": new_master.float(), "exp_avg": m1.float(), "exp_avg_sq": v1.float()}
    param = new_master.float().bfloat16()
    outs = []
    for native in (True, False):
        r = ParamResult("w", (N,), "bfloat16", N, plan.optimizer_type, 0, 1e-3, 0.1, "loaded", False, 3.0)
        c = _SlabContext(
            plan, r, param, st, [{"w": grad}], lambda k, mk: _Memory(saved[k]), 1, 1e-5, 1e-8, torch.float64
        )
        if not native:
            c.native = None
        outs.append(c.run((0, N)))
    assert _bits(outs[0]) == _bits(outs[1])
    assert all(e.bad == 0 for e in outs[0]["fields"].values())
    assert outs[0]["sync_unequal"] == outs[0]["writeback_unequal"] == outs[0]["param_vs_reference_unequal"] == 0
