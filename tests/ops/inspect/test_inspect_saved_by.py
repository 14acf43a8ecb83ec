"""`inspect` names the optimizer that saved the state (``optimizer.saved_by``), checked against the class torch
itself stepped: it showed only ckpttool's own type, ``implied type unknown``, for torch's SGD, RMSprop, Adafactor
and every other optimizer but AdamW."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.builders import build_linear_stepped

runner = CliRunner()

MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True),
    "Adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-3),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-3),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-3),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "RMSprop-centered": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01),
    "Muon": lambda p: torch.optim.Muon([q for q in p if q.dim() == 2], lr=0.01),  # 2-D parameters only
}


def _inspect(path: Path) -> tuple[dict[str, Any], str]:
    res = runner.invoke(app, ["inspect", "--json", str(path)])
    assert res.exit_code == 0, res.stderr
    human = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "200"})
    assert human.exit_code == 0, human.stderr
    return json.loads(res.stdout)["optimizer"], human.stdout


@pytest.mark.parametrize("name", list(MAKERS))
def test_saved_by_names_the_torch_optimizer_that_stepped(tmp_path: Path, name: str) -> None:
    made: list[torch.optim.Optimizer] = []
    ref = build_linear_stepped(tmp_path / "ck", lambda p: made.append(MAKERS[name](p)) or made[0], steps=2)
    want = f"torch.optim.{type(made[0]).__name__}"
    opt, human = _inspect(tmp_path / "ck")
    assert (opt["saved_by"], opt["saved_by_counts"]) == (want, {want: len(ref["state"])})
    assert f"saved by    {want}\n" in human


def test_sparse_adam_is_named_by_its_group(tmp_path: Path) -> None:
    """SparseAdam saves AdamW's fields; its param group (``betas``, ``maximize``, no ``weight_decay``) tells it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.01)
    model(torch.randint(0, 10, (3,))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    opt_json, _ = _inspect(tmp_path / "ck")
    assert opt_json["saved_by"] == "torch.optim.SparseAdam"


@pytest.mark.parametrize(
    ("name", "drop", "want"),
    [
        # torch before 2.7 saved Adam's and AdamW's groups alike (no decoupled_weight_decay): either stepped
        ("Adam", "decoupled_weight_decay", "ambiguous: torch.optim.AdamW or torch.optim.Adam"),
        # a momentum_buffer in a group of neither SGD's keys (dampening) nor Muon's (ns_steps)
        ("SGD-momentum", "dampening", "ambiguous: torch.optim.SGD or torch.optim.Muon"),
    ],
)
def test_fields_several_optimizers_save_are_ambiguous_unless_the_group_tells(
    tmp_path: Path, name: str, drop: str, want: str
) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = MAKERS[name](model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    del osd["param_groups"][0][drop]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    opt_json, human = _inspect(tmp_path / "ck")
    assert (opt_json["saved_by"], opt_json["saved_by_counts"]) == (want, {want: 2})
    assert f"saved by    {want}\n" in human


def test_state_no_known_optimizer_saves_is_unknown_and_no_state_is_null(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    build_linear_stepped(tmp_path / "sgd0", lambda p: torch.optim.SGD(p, lr=0.1), steps=2)  # momentum 0: no state
    opt_json, human = _inspect(tmp_path / "sgd0")
    assert (opt_json["saved_by"], opt_json["saved_by_counts"]) == (None, {})
    assert "saved by" not in human

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    osd["state"]["weight"]["ghost"] = torch.zeros(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    opt_json, human = _inspect(tmp_path / "ck")
    assert opt_json["saved_by_counts"] == {"torch.optim.Adagrad": 1, "unknown": 1}
    assert "saved by    torch.optim.Adagrad (1), unknown (1)\n" in human
