"""``adam_ratio_bound`` (replay-step's R003 bound, validate's D007) against Adam's own recursion.

The Cauchy-Schwarz bound is attained by the gradients ``g_i = (b1 / b2)^(t-i)``: torch's AdamW fed them
from zero state reaches it. Where ``beta1^2 > beta2`` the bound grows as ``(beta1^2 / beta2)^(t/2)``: past the
float range it is ``inf`` (not an OverflowError), and both commands that use it report it.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.optim_state.bounds import adam_ratio_bound

runner = CliRunner()


@pytest.mark.parametrize(("b1", "b2"), [(0.9, 0.999), (0.9, 0.95), (0.95, 0.9), (0.0, 0.99)])
@pytest.mark.parametrize("t", [1, 2, 3, 10, 50])
def test_bound_is_attained_by_torch_adamw(b1: float, b2: float, t: int) -> None:
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1.0, betas=(b1, b2), eps=0.0, weight_decay=0.0)
    for i in range(1, t + 1):
        p.grad = torch.tensor([(b1 / b2) ** (t - i) if b1 else float(i == t)], dtype=torch.float64)
        opt.step()
    st = opt.state[p]
    m_hat = st["exp_avg"] / (1 - b1**t)
    v_hat = st["exp_avg_sq"] / (1 - b2**t)
    ratio = float((m_hat.abs() / v_hat.sqrt())[0])
    bound = adam_ratio_bound(t, b1, b2)
    assert ratio == pytest.approx(bound, rel=1e-9)


def test_bound_beyond_the_float_range_is_inf() -> None:
    assert adam_ratio_bound(10**6, 0.95, 0.9) == math.inf
    assert adam_ratio_bound(10**6, 0.95, 0.9, bias_corrected=False) == math.inf
    assert math.isfinite(adam_ratio_bound(10**6, 0.9, 0.999))
    assert adam_ratio_bound(100, 0.95, 0.9) == pytest.approx(
        0.05
        / math.sqrt(0.1)
        * math.sqrt(sum((0.95**2 / 0.9) ** k for k in range(100)))
        * math.sqrt(1 - 0.9**100)
        / (1 - 0.95**100)
    )


def test_commands_take_a_step_beyond_the_bounds_range(tmp_path: Path) -> None:
    """betas (0.95, 0.9) at step 10^6 (a long run with beta1^2 > beta2): validate --deep and replay-step report, exit 0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.95, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for st in opt.state.values():
        st["step"] = torch.tensor(1e6)
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    res = runner.invoke(app, ["validate", str(tmp_path / "ck"), "--deep", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["ok"]
    res = runner.invoke(app, ["replay-step", str(tmp_path / "ck"), "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and [p["update"]["direction_bound"] for p in doc["params"]] == ["inf", "inf"]
