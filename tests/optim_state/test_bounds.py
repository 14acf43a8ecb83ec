"""``adam_ratio_bound`` (replay-step's R003 bound, validate's D007) against Adam's own recursion.

The Cauchy-Schwarz bound is attained by the gradients ``g_i = (b1 / b2)^(t-i)``: torch's AdamW fed them
from zero state reaches it. Where ``beta1^2 > beta2`` the bound grows as ``(beta1^2 / beta2)^(t/2)``: past the
float range it is ``inf`` (not an OverflowError), and both commands that use it report it. Where an LR scheduler
cycles ``betas[0]`` (torch's ``OneCycleLR``, ``CyclicLR``), the bound takes the range it moved in.
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
from ckpttool.optim_state.bounds import adam_ratio_bound, beta1_span

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


def _cycled(kind: str, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler as users build it, ``cycle_momentum`` left at its default (on)."""
    if kind == "OneCycleLR":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=20)
    return torch.optim.lr_scheduler.CyclicLR(opt, 1e-3, 1e-2, step_size_up=3)


@pytest.mark.parametrize(("kind", "t"), [("OneCycleLR", 14), ("OneCycleLR", 19), ("CyclicLR", 6)])
def test_bound_holds_for_the_betas_a_scheduler_cycles(kind: str, t: int) -> None:
    """OneCycleLR and CyclicLR move betas[0] between the group's base_momentum and max_momentum at every step. The
    gradients that attain the Cauchy-Schwarz bound of that run (g_i = c_i / w_i, c_i the weight of g_i in exp_avg,
    w_i in exp_avg_sq) give torch's AdamW moments beyond the bound of the saved betas alone, within the bound of the
    cycled range."""
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-2, eps=0.0, weight_decay=0.0)
    sched = _cycled(kind, opt)
    b1s = []
    for _ in range(t):  # the beta1 of each step, as the scheduler sets it
        b1s.append(float(opt.param_groups[0]["betas"][0]))
        sched.step()
    b2 = float(opt.param_groups[0]["betas"][1])
    c = [(1 - b1s[i]) * math.prod(b1s[i + 1 :]) for i in range(t)]
    w = [(1 - b2) * b2 ** (t - 1 - i) for i in range(t)]
    p2 = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt2 = torch.optim.AdamW([p2], lr=1e-2, eps=0.0, weight_decay=0.0)
    sched2 = _cycled(kind, opt2)
    for i in range(t):
        p2.grad = torch.tensor([c[i] / w[i]], dtype=torch.float64)
        opt2.step()
        sched2.step()
    st = opt2.state[p2]
    ratio = float((st["exp_avg"].abs() / st["exp_avg_sq"].sqrt())[0])
    assert ratio == pytest.approx(math.sqrt(sum(ci * ci / wi for ci, wi in zip(c, w, strict=True))), rel=1e-9)
    span = beta1_span(opt2.param_groups[0])
    assert span is not None and span[0] <= min(b1s) and max(b1s) <= span[1]
    saved_b1 = float(opt2.param_groups[0]["betas"][0])
    assert ratio > adam_ratio_bound(t, saved_b1, b2, bias_corrected=False)
    assert ratio <= adam_ratio_bound(t, saved_b1, b2, bias_corrected=False, span=span)


@pytest.mark.parametrize(("kind", "t"), [("OneCycleLR", 14), ("CyclicLR", 6)])
def test_a_run_whose_scheduler_cycled_beta1_is_not_beyond_the_bound(tmp_path: Path, kind: str, t: int) -> None:
    """AdamW under OneCycleLR (step 14 of 20, past the lr peak) or CyclicLR (step 6, the lr back at its base), their
    default cycle_momentum on, saved with its scheduler by dcp.save: betas[0] is now higher than it was a few steps
    before, and validate --deep reported D007 on every parameter and replay-step failed them with R003 (exit 1),
    judging moments by the saved beta1 alone. Both pass now; the same run's exp_avg_sq scaled down 100x (stale) is
    still D007, naming the cycled range."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = _cycled(kind, opt)
    x = torch.randn(3, 4)
    for _ in range(t):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": t}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    res = runner.invoke(app, ["validate", str(tmp_path / "ck"), "--strict", "--deep", "--json"])
    found = [f for f in json.loads(res.stdout)["findings"] if f["severity"] != "info"]
    assert res.exit_code == 0 and found == [], found
    res = runner.invoke(app, ["replay-step", str(tmp_path / "ck"), "--device", "cpu", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"], res.stdout
    for st in osd["state"].values():
        st["exp_avg_sq"] = st["exp_avg_sq"] / 100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "stale"), no_dist=True)
    res = runner.invoke(app, ["validate", str(tmp_path / "stale"), "--deep", "--json"])
    d007 = [f["message"] for f in json.loads(res.stdout)["findings"] if f["code"] == "D007"]
    lo, hi = beta1_span(opt.param_groups[0]) or (0, 0)
    assert len(d007) == 2 and all(f"betas[0] cycled within [{lo:g}, {hi:g}]" in m for m in d007), d007


@pytest.mark.parametrize("b2", [0.999, 0.95])
@pytest.mark.parametrize("t", [1, 3, 20])
def test_fp16_underflow_margin_bounds_what_torchs_fp16_exp_avg_sq_loses(b2: float, t: int) -> None:
    """torch.optim.AdamW on an FP16 parameter fed gradients whose (1 - b2) g^2 lies around FP16's subnormals stores an
    exp_avg_sq below Adam's float64 recursion by at most fp16_underflow_margin (subnormal rounding; above it by no
    more than that and an FP16 ulp); and its update is within lr * bound * fp16_step_factor (eps 1e-4), far beyond lr."""
    from ckpttool.optim_state.bounds import fp16_step_factor, fp16_underflow_margin

    gen = torch.Generator().manual_seed(t)
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, b2), eps=1e-4, weight_decay=0.0)
    v64 = torch.zeros(4096, dtype=torch.float64)
    moved = 0.0
    for k in range(1, t + 1):
        g = (torch.randn(4096, generator=gen) * math.sqrt(2.0**-24 / (1 - b2))).half()
        before = p.detach().double().clone()
        p.grad = g
        opt.step()
        moved = max(moved, float((p.detach().double() - before).abs().max()))
        v64 = b2 * v64 + (1 - b2) * g.double() ** 2
        assert moved <= 1e-3 * adam_ratio_bound(k, 0.9, b2) * fp16_step_factor(b2, 1e-4)
        if k == 1:  # underflow happened: some v rounded to 0
            assert bool((opt.state[p]["exp_avg_sq"] == 0).any())
    v16 = opt.state[p]["exp_avg_sq"].double()
    lost = float((v64 - v16).max())
    assert 0 < lost <= fp16_underflow_margin(t, b2)
    assert bool(((v16 - v64).abs() <= fp16_underflow_margin(t, b2) + 2.0**-10 * v64).all())  # rounded either way
    assert moved > 1e-3 * 2  # torch's own update of an underflowed element is beyond lr
