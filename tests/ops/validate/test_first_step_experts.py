"""`D009` and `D011` on real ``dcp.save`` checkpoints of a MoE whose experts start as copies (sparse upcycling: one MLP
copied into every expert), beside a zero-initialised modulation (DiT's adaLN-Zero), trained with AdamW under a linear
warmup from 0 (transformers' ``get_linear_schedule_with_warmup``), whose first step runs at ``lr`` 0.

Saved after that first step, the experts are still their copies (no step moved them) while each expert's moments
hold its own gradient, and the modulation is still zero beside its first gradient's moments: no finding. One EP
rank's experts (weights and moments) written for another's is one; and after a second step (``lr`` > 0) copied
weights are one whatever their moments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
E, H, F = 4, 8, 16  # experts, hidden, FFN
KEY = "model.layers.0.experts.gate_up_proj"


class _Experts(torch.nn.Module):
    """Fused experts ``[E, 2F, H]`` / ``[E, H, F]`` (HF's and torchtitan's layout), every expert a copy of one MLP."""

    def __init__(self) -> None:
        super().__init__()
        up, down = torch.randn(1, 2 * F, H) * 0.1, torch.randn(1, H, F) * 0.1
        self.gate_up_proj = torch.nn.Parameter(up.repeat(E, 1, 1))
        self.down_proj = torch.nn.Parameter(down.repeat(E, 1, 1))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(E):
            hit = (idx == e).any(-1)
            g, u = (x[hit] @ self.gate_up_proj[e].T).chunk(2, -1)
            gate = (w * (idx == e))[hit].sum(-1, keepdim=True)
            out[hit] += (torch.nn.functional.silu(g) * u) @ self.down_proj[e].T * gate
        return out


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.router(x).softmax(-1).topk(2, -1)
        return x + self.experts(x, idx, w)


def _save(out: Path, steps: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([_Layer()]), "head": torch.nn.Linear(H, 2)})
    model["modulation"] = torch.nn.Linear(H, H)  # DiT's adaLN-Zero: zero at init, moved by the first step at lr > 0
    torch.nn.init.zeros_(model["modulation"].weight)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # transformers' get_linear_schedule_with_warmup over its warmup: lr * step / warmup_steps, 0 at step 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 10))
    for _ in range(steps):
        x = torch.randn(32, H)
        model["head"](model["layers"][0](x) * (1 + model["modulation"](x))).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


def _copy_rank0_experts(src: Path, out: Path, moments: bool) -> None:
    """Re-save ``src`` with experts 2, 3 holding experts 0, 1 (one EP rank's slice written for both ranks)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(src), str(out.with_suffix(".pt")))
    sd = torch.load(out.with_suffix(".pt"), weights_only=False)
    fqn = KEY.removeprefix("model.")
    sd["model"][fqn][2:] = sd["model"][fqn][:2].clone()
    if moments:
        for field in ("exp_avg", "exp_avg_sq"):
            t = sd["optimizer"]["state"][fqn][field]
            t[2:] = t[:2].clone()
    dcp.save(sd, checkpoint_id=str(out))


def _findings(path: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", str(path), "--deep", "--strict", "--json"])
    return res.exit_code, [f for f in json.loads(res.stdout)["findings"] if f["severity"] != "info"]


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("first_step")
    _save(root / "step1", 1)
    _save(root / "step2", 2)
    return root


def test_upcycled_experts_after_a_first_step_at_lr_0_are_silent(saves: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(saves / "step1"), str(saves / "w.pt"))
    saved = torch.load(saves / "w.pt", weights_only=False)
    w, m = saved["model"][KEY.removeprefix("model.")], saved["optimizer"]["state"]["layers.0.experts.gate_up_proj"]
    assert all(torch.equal(w[0], w[e]) for e in range(E))  # the step ran at lr 0: the copies stand
    assert not torch.equal(m["exp_avg"][0], m["exp_avg"][1])  # each expert's own gradient
    mod = saved["model"]["modulation.weight"]
    assert not mod.any() and saved["optimizer"]["state"]["modulation.weight"]["exp_avg"].any()  # D011 before
    assert _findings(saves / "step1") == (0, [])


def test_one_ranks_experts_and_moments_written_for_another_are_d009(saves: Path, tmp_path: Path) -> None:
    for src in ("step1", "step2"):
        _copy_rank0_experts(saves / src, tmp_path / f"{src}-ep", moments=True)
        code, found = _findings(tmp_path / f"{src}-ep")
        assert code == 1
        assert [(f["code"], f["key"]) for f in found] == [("D009", KEY)]
        assert "experts 0, 2; experts 1, 3" in found[0]["message"]


def test_copied_weights_after_a_second_step_are_d009_whatever_the_moments(saves: Path, tmp_path: Path) -> None:
    assert _findings(saves / "step2") == (0, [])
    _copy_rank0_experts(saves / "step2", tmp_path / "w", moments=False)
    code, found = _findings(tmp_path / "w")
    assert code == 1 and [(f["code"], f["key"]) for f in found] == [("D009", KEY)]


def _save_upscaled(out: Path, steps: int, copy_moments: bool = False) -> None:
    """Depth up-scaling (SOLAR-style: layer 1 a copy of layer 0), trained as above; ``copy_moments``: layer 1's moments
    overwritten with layer 0's before the save (a save that wrote one layer for two)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(H, H, bias=False) for _ in range(2)])
    layers[1].load_state_dict(layers[0].state_dict())
    model = torch.nn.ModuleDict({"layers": layers, "head": torch.nn.Linear(H, 2)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 10))
    for _ in range(steps):
        model["head"](layers[1](torch.tanh(layers[0](torch.randn(32, H))))).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    if copy_moments:
        for field in ("exp_avg", "exp_avg_sq"):
            opt.state[layers[1].weight][field].copy_(opt.state[layers[0].weight][field])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


def test_depth_upscaled_layers_after_a_first_step_at_lr_0_are_silent_d010_when_moments_copied(tmp_path: Path) -> None:
    _save_upscaled(tmp_path / "s1", 1)
    assert _findings(tmp_path / "s1") == (0, [])
    _save_upscaled(tmp_path / "copied", 1, copy_moments=True)
    code, found = _findings(tmp_path / "copied")
    assert code == 1 and [(f["code"], f["key"]) for f in found] == [("D010", "model.layers.1")], found
