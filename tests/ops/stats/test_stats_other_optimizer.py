"""`stats` computes the update size of AdamW state only. Of torch's RMSprop, SGD, Adafactor it said nothing of why
no update was shown, and of Lion's lone ``exp_avg`` (its group: ``betas``, no ``eps``) it said "moments stored with
different chunks", which they were not: it names the optimizer that saved the state now (``inspect``'s
``saved_by``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.builders import build_linear_stepped

runner = CliRunner()


def _notes(path: Path) -> list[str]:
    res = runner.invoke(app, ["stats", str(path), "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)["checkpoints"][0]["notes"]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.RMSprop(p, lr=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adafactor(p, lr=0.01),
    ],
    ids=["RMSprop", "SGD", "Adafactor"],
)
def test_state_of_another_optimizer_is_named_in_a_note(tmp_path: Path, make: Any) -> None:
    made: list[torch.optim.Optimizer] = []
    ref = build_linear_stepped(tmp_path / "ck", lambda p: made.append(make(p)) or made[0], steps=2)
    want = f"torch.optim.{type(made[0]).__name__}"
    assert _notes(tmp_path / "ck") == [
        f"optimizer state of {want}, whose step is not AdamW's: {len(ref['state'])} parameter(s), e.g. weight"
    ]


def test_lions_lone_moment_is_not_called_moments_of_different_chunks(tmp_path: Path) -> None:
    """Lion's state form (one moment ``exp_avg``, a group with ``betas`` and no ``eps``), made from torch's AdamW
    save by dropping what Lion does not keep."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    for st in osd["state"].values():
        del st["exp_avg_sq"], st["step"]
    del osd["param_groups"][0]["eps"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    assert _notes(tmp_path / "ck") == [
        "optimizer state of Lion, whose step is not AdamW's: 2 parameter(s), e.g. weight"
    ]
