"""`diff --what optimizer|all` of a diverged run's save (a NaN ``lr``, a NaN in ``betas``) against a byte copy of it said
`DIFFERENT: 4 differences` (`lr: nan in A, nan in B`): hyperparameters were compared with Python's ``==`` and
``torch.equal``, for which a NaN never equals itself, while a tensor's elements compare bitwise (a NaN equals the same
NaN). A NaN hyperparameter now equals a NaN of the same bits; a NaN against a number is still a difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import builders
from tests.fixtures.builders import save_quiet, train_steps
from tests.fixtures.cache import cached_build

runner = CliRunner()


def _diff(a: Path, b: Path, what: str) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["diff", str(a), str(b), "--what", what, "--json"])
    return res.exit_code, json.loads(res.stdout)


def _lr_save(out: Path, lr: Any) -> None:
    """A ``torch.nn.Linear(4, 2)`` after one AdamW step whose group's ``lr`` then became ``lr``, saved by ``dcp.save``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = lr
    save_quiet({"model": msd, "optimizer": osd}, out)


def test_a_diverged_save_equals_its_byte_copy(fixture_root: Path, tmp_path: Path) -> None:
    ckpt = cached_build(fixture_root, "nonfinite_hyperparameters", builders.build_nonfinite_hyperparameters)
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    for what in ("optimizer", "all"):
        rc, doc = _diff(ckpt, copy, what)
        assert [d["message"] for d in doc["differences"]] == [] and doc["equal"] is True and rc == 0, what
        assert doc["summary"]["tensors"] > 0 and doc["counts"]["compared"] > doc["summary"]["tensors"]  # hypers too


def test_nan_tensor_lr_equals_the_same_nan_and_differs_from_a_number(tmp_path: Path) -> None:
    _lr_save(tmp_path / "a", torch.tensor(float("nan")))
    _lr_save(tmp_path / "b", torch.tensor(float("nan")))
    _lr_save(tmp_path / "c", torch.tensor(0.01))
    rc, doc = _diff(tmp_path / "a", tmp_path / "b", "optimizer")
    assert rc == 0 and doc["equal"] is True and doc["differences"] == []
    rc, doc = _diff(tmp_path / "a", tmp_path / "c", "optimizer")  # a NaN against a number
    assert rc == 1 and sorted(d["name"] for d in doc["differences"]) == [
        "optimizer.param_groups.bias.lr",
        "optimizer.param_groups.weight.lr",
    ]


def test_tolerances_are_for_tensor_values_not_hyperparameters(tmp_path: Path) -> None:
    """docs/diff.md: `--rtol/--atol` widen tensor comparisons only; an lr 1e-9 apart is a scheduler state that differs."""
    _lr_save(tmp_path / "a", 0.01)
    _lr_save(tmp_path / "b", 0.01 + 1e-9)
    res = runner.invoke(
        app,
        ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--what", "optimizer", "--json"]
        + ["--atol", "1", "--rtol", "1"],
    )
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and sorted(d["name"] for d in doc["differences"]) == [
        "optimizer.param_groups.bias.lr",
        "optimizer.param_groups.weight.lr",
    ]
    # the state tensors are equal, within any tolerance
    assert doc["tensors"] and all(s["status"] != "differ" for s in doc["tensors"])
