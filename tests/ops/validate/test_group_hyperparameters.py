"""Param-group hyperparameters torch cannot step with: ``torch.optim`` checks ``lr``, ``eps``, ``weight_decay`` and
``betas`` when an optimizer is built, not when ``load_state_dict`` restores them, so a group saved with ``lr`` as a
list, ``weight_decay`` as a string or ``betas`` of one number passed ``validate --strict`` and the resume raised on
its first step. ``P006`` names them; the tensor ``lr``/``betas`` torch accepts, and Adafactor's ``eps`` pair, are
numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _save(path: Path, make: Any, edit: Any = None, *, flatten: bool = False) -> None:
    """Step ``make(params)`` twice on a real model, optionally edit its param groups, ``dcp.save(get_state_dict)``."""
    model = _model()
    opt = make(model.parameters())
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    if edit is not None:
        for g in opt.param_groups:
            edit(g)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)


def _p006(path: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", "--strict", "--json", str(path)])
    doc = json.loads(res.stdout)
    return res.exit_code, [f for f in doc["findings"] if f["code"] == "P006"]


@pytest.mark.parametrize(
    ("hyper", "value", "said"),
    [
        ("lr", [1e-3], "lr is [0.001], not a number"),
        ("weight_decay", "0.01", "weight_decay is '0.01', not a number"),
        ("betas", [0.9], "betas is [0.9], not two numbers"),
        ("lr", -1e-3, "lr is -0.001; the optimizer needs lr >= 0"),
        ("betas", (0.9, 1.0), "betas[1] is 1.0; the optimizer needs 0 <= betas[1] < 1"),
        ("eps", float("nan"), "eps is nan; the optimizer needs eps >= 0"),
    ],
)
def test_a_group_torch_cannot_step_with_is_p006(tmp_path: Path, hyper: str, value: Any, said: str) -> None:
    _save(tmp_path / "ck", lambda p: torch.optim.AdamW(p, lr=1e-3), lambda g: g.__setitem__(hyper, value))
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and found, found
    assert [f["message"] for f in found] == [f"param group 0: {said}"]


def test_a_flattened_save_gets_one_finding_for_its_per_parameter_groups(tmp_path: Path) -> None:
    edit = lambda g: g.__setitem__("weight_decay", "0.01")  # noqa: E731
    _save(tmp_path / "ck", lambda p: torch.optim.AdamW(p, lr=1e-3), edit, flatten=True)
    code, found = _p006(tmp_path / "ck")
    assert code == 1 and len(found) == 1, found
    assert found[0]["message"].endswith(" and 3 more: weight_decay is '0.01', not a number"), found


def test_torch_fails_the_first_step_after_resuming_such_a_group(tmp_path: Path) -> None:
    """The independent reference: the saved state loads into a fresh AdamW and its first step raises."""
    _save(tmp_path / "ck", lambda p: torch.optim.AdamW(p, lr=1e-3), lambda g: g.__setitem__("lr", [1e-3]))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(TypeError):
        opt.step()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3)), id="tensor-lr"),
        pytest.param(
            lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.999))), id="tensor-betas"
        ),
        pytest.param(lambda p: torch.optim.Adafactor(p, lr=1e-2), id="adafactor-eps-pair"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0), id="sgd-int-decay"),
    ],
)
def test_values_torch_steps_with_are_no_finding(tmp_path: Path, make: Any) -> None:
    _save(tmp_path / "ck", make)
    code, found = _p006(tmp_path / "ck")
    assert found == []
