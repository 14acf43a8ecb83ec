"""`stats` figures against exact float64 references where float32 squares and sums fail.

Squares of float32 values beyond ``sqrt(FLT_MAX)`` ~1.8e19 overflow float32 and below ``sqrt(FLT_MIN)``
~1e-19 underflow (an ``exp_avg_sq`` of 1e-20 is common): a finite L2 came out ``null`` or 0. A mean far
from 0 (a norm weight near 1 with small deviations) lost the standard deviation's digits to float32
sums, and still loses them to ``sum x^2 / n - mean^2`` in float64 when the spread is an ulp or two of
the mean (such a tensor is read again: the squares about the mean). The reference is ``math.fsum`` of
the exact float64 squares; both the native kernel and numpy's (``CKPTTOOL_NATIVE=0``) are checked, per
tensor, per expert and for the optimizer moments.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.engine import stats as engine_stats

runner = CliRunner()


def _values(g: torch.Generator) -> dict[str, torch.Tensor]:
    n = 5003
    return {
        "huge.weight": torch.randn(n, generator=g) * 1e25,  # float32 squares overflow
        "huge_bf16.weight": (torch.randn(n, generator=g) * 1e25).to(torch.bfloat16),
        "tiny.weight": torch.randn(n, generator=g) * 1e-25,  # float32 squares underflow
        "norm.weight": 1.0 + torch.randn(n, generator=g) * 1e-4,  # mean 1, std 1e-4
        "offset.weight": 1e4 + torch.randn(n, generator=g),
        # spreads of an ulp or two: sum x^2 / n - mean^2 cancels to 0 (std 0 reported) or to a wrong figure;
        # the std is taken about the mean in a second read
        "ulp.weight": 1.0 + (torch.rand(n, generator=g) < 0.5) * 2.0**-23,  # mean 1, std 6e-8
        "far.weight": 100.0 + torch.randint(0, 3, (n,), generator=g) * 2.0**-17,  # mean 100, std 6e-6
        "max.weight": torch.full((4096,), 3.0e38),  # float32 sums of 1024 of them overflow
        "mlp.experts.down_proj": torch.randn(3, 7, 11, generator=g) * torch.tensor([1e25, 1e-25, 1.0]).view(3, 1, 1),
    }


def _l2(x: torch.Tensor) -> float:
    return math.sqrt(math.fsum(v * v for v in x.double().flatten().tolist()))


def _std(x: torch.Tensor) -> float:
    v = x.double().flatten().tolist()
    mean = math.fsum(v) / len(v)
    return math.sqrt(math.fsum((a - mean) ** 2 for a in v) / len(v))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    weights = _values(g)
    model = torch.nn.Module()
    for k, v in weights.items():
        *path, name = k.split(".")
        mod = model
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        mod.register_parameter(name, torch.nn.Parameter(v.clone(), requires_grad=False))
    # the optimizer state of one parameter: moments of a typical magnitude (exp_avg_sq ~1e-20)
    p = model.get_parameter("norm.weight")
    state = {
        "step": torch.tensor(10.0),
        "exp_avg": torch.randn(p.shape, generator=g) * 1e-10,
        "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-20,
    }
    osd = {
        "state": {"norm.weight": state},
        "param_groups": [
            {"params": ["norm.weight"], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        ],
    }
    out = tmp_path_factory.mktemp("stats_range") / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": dict(model.state_dict()), "optimizer": osd}, checkpoint_id=str(out), no_dist=True)
    return out, {**weights, **{f"norm.weight.{k}": v for k, v in state.items() if k != "step"}}


@pytest.fixture(params=["native", "numpy"])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "native" and not engine_stats.native_stats():
        pytest.skip("native kernels not built")
    engine_stats.use_native(request.param == "native")
    try:
        yield request.param
    finally:
        engine_stats.use_native(True)


def _doc(path: Path) -> Any:
    res = runner.invoke(app, ["stats", str(path), "--by", "tensor", "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)["checkpoints"][0]


def test_l2_std_and_expert_norms_equal_exact_references(
    ckpt: tuple[Path, dict[str, torch.Tensor]], kernel: str
) -> None:
    path, values = ckpt
    doc = _doc(path)
    rows = {(r["fqn"], r["role"]): r for r in doc["tensors"]}
    for key, x in values.items():
        fqn, role = (key, "weight") if key in _values(torch.Generator()) else key.rsplit(".", 1)
        r = rows[(fqn, role)]
        assert r["nonfinite"] == 0, key
        assert r["l2"] == pytest.approx(_l2(x), rel=1e-12), key
        assert r["mean"] == pytest.approx(math.fsum(x.double().flatten().tolist()) / x.numel(), rel=1e-12), key
        assert r["std"] == pytest.approx(_std(x), rel=1e-6, abs=1e-12 * float(x.double().abs().max())), key
    (experts,) = doc["experts"]
    e = values["mlp.experts.down_proj"]
    assert experts["norms"] == pytest.approx([_l2(e[i]) for i in range(3)], rel=1e-12)
    assert experts["norms"][1] > 0  # 1e-25 values: float32 squares were 0


@pytest.mark.parametrize("native", [True, False])
def test_update_rms_of_sizes_beyond_sqrt_flt_max(native: bool) -> None:
    """``u = m / (sqrt(v) + eps)`` beyond 1.8e19 (a moment ``v`` of 1e-44 with ``eps`` 0): its float32 square overflowed
    in the native kernel (RMS inf, numpy's finite): both now square in float64, as the float64 reference."""
    from ckpttool.ops.stats.compute import AdamHyper, Moments, ValueSums, add_moments

    if native and not engine_stats.native_stats():
        pytest.skip("native kernels not built")
    g = torch.Generator().manual_seed(1)
    n = 4099
    m = torch.randn(n, generator=g)
    v = torch.full((n,), 1e-44)  # a float32 subnormal: sqrt(v) ~1e-22, u ~1e22
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=0.0, step=7.0)
    upd = Moments()
    engine_stats.use_native(native)
    try:
        add_moments(
            ValueSums(),
            ValueSums(),
            h,
            upd,
            (m.view(torch.uint8).numpy(), "float32"),
            (v.view(torch.uint8).numpy(), "float32"),
        )
    finally:
        engine_stats.use_native(True)
    bc1, bc2 = 1 - 0.9**7, 1 - 0.999**7
    u = [float(x) for x in (m / v.sqrt())]  # float32 u, as the kernels compute it (eps 0)
    c = 1e-3 * math.sqrt(bc2) / bc1
    assert upd.numel == n
    assert upd.s2 == pytest.approx(math.fsum(x * x for x in u) * c * c, rel=1e-12)
