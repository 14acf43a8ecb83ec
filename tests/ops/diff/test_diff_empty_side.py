"""`diff` of a checkpoint against a dcp.save of an empty state dict: no verdict (E611), and a hint about the empty
side, not about a naming mismatch between the two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


@pytest.fixture()
def sides(tmp_path: Path) -> tuple[Path, Path]:
    dcp.save({"w": torch.arange(3.0), "z": torch.zeros(2)}, checkpoint_id=str(tmp_path / "full"))
    dcp.save({}, checkpoint_id=str(tmp_path / "empty"))
    return tmp_path / "full", tmp_path / "empty"


@pytest.mark.parametrize("empty_side", ["A", "B"])
def test_an_empty_side_is_named_in_the_hint(sides: tuple[Path, Path], empty_side: str) -> None:
    full, empty = sides
    args = [empty, full] if empty_side == "A" else [full, empty]
    res = runner.invoke(app, ["diff", *map(str, args), "--color", "never"])
    assert res.exit_code == 2 and res.stdout == ""
    error, hint = res.stderr.splitlines()
    assert error.startswith("error: [E611] nothing compared, so no verdict: no name in common")
    other = "B" if empty_side == "A" else "A"
    assert hint == (
        f"hint: {empty_side} holds no tensor at all, none to pair with {other}'s ('w', 'z'): an empty save, or not "
        f"the checkpoint meant (`ckpttool inspect {empty}` shows what it holds)"
    )
