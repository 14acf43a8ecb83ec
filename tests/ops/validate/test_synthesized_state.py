"""`D005` (and `replay-step`'s note) on real ``dcp.save`` checkpoints: state torch synthesized before the first step,
against a real first step in which some parameters got zero gradients (a ReZero gate at 0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


class _ReZero(torch.nn.Module):
    """``x + alpha * tanh(mlp(x))`` with ``alpha`` 0 at init (Bachlechner et al. 2020): the first step's gradients of
    ``mlp`` are exactly zero, ``alpha``'s are not."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Linear(8, 8)
        self.alpha = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * torch.tanh(self.mlp(x))


def _save(out: Path, steps: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "inp": torch.nn.Linear(4, 8),
            "layers": torch.nn.ModuleList([_ReZero(), _ReZero()]),
            "head": torch.nn.Linear(8, 2),
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        h = model["inp"](torch.randn(6, 4))
        for layer in model["layers"]:
            h = layer(h)
        model["head"](h).square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)  # before any step: torch makes the state up (step 1, zero moments)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


def _validate(path: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", str(path), "--deep", "--strict", "--json"])
    return res.exit_code, json.loads(res.stdout)["findings"]


def _stats_notes(path: Path) -> list[str]:
    res = runner.invoke(app, ["stats", str(path), "--json"])
    assert res.exit_code == 0, res.stderr
    notes: list[str] = json.loads(res.stdout)["checkpoints"][0]["notes"]
    return notes


def test_zero_gradients_in_a_real_first_step_are_not_synthesized_state(tmp_path: Path) -> None:
    """A ReZero model saved after its first AdamW step: its branches' moments are all zero at step 1, the gates' and
    the other layers' are not. D005 called it state made up for an optimizer that never stepped (replay-step warned
    the same, stats said its update size was of no training step); the save is clean. Saved before the first step, every parameter is made up and D005 says so."""
    _save(tmp_path / "step-1", 1)
    rc, found = _validate(tmp_path / "step-1")
    assert rc == 0 and found == [], found
    res = runner.invoke(app, ["replay-step", str(tmp_path / "step-1"), "--json"])
    assert not [n for n in json.loads(res.stdout)["notes"] if "synthesized" in n], res.stdout
    assert not [n for n in _stats_notes(tmp_path / "step-1") if "no training step" in n]
    _save(tmp_path / "init", 0)
    rc, found = _validate(tmp_path / "init")
    assert [(f["code"], f["message"]) for f in found] == [
        ("D005", "inp.weight and 9 more: step 1 with all-zero exp_avg and exp_avg_sq (10 parameter(s))")
    ], found
    assert [n for n in _stats_notes(tmp_path / "init") if "no training step" in n and "10 parameter(s)" in n]
