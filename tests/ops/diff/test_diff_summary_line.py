"""diff's summary line when what differs has no magnitude (a bool tensor).

Checkpoints are written by torch's own ``dcp.save``. The line said ``max rel L2 0 (model.w); max abs 0 (model.w)``,
naming a tensor that is equal, or ``max rel L2 - (None)`` where no numeric tensor was compared.
"""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.builders import save_quiet

runner = CliRunner()


def _summary(a: Path, b: Path) -> tuple[int, str]:
    res = runner.invoke(app, ["diff", str(a), str(b)])
    assert "Traceback" not in res.stderr, res.stderr
    return res.exit_code, [line for line in res.stdout.splitlines() if line.startswith("compared ")][-1]


def test_differences_without_magnitude_name_no_equal_tensor(tmp_path: Path) -> None:
    mask, w = torch.tensor([True, False, True]), torch.arange(6, dtype=torch.float32)
    save_quiet({"model": {"mask": mask, "w": w}}, tmp_path / "a")
    save_quiet({"model": {"mask": ~mask, "w": w}}, tmp_path / "b")
    code, line = _summary(tmp_path / "a", tmp_path / "b")
    assert code == 1 and "1 differs" in line, line
    assert "model.w" not in line and "None" not in line, line
    assert "no tensor with a magnitude differs" in line, line
    save_quiet({"model": {"mask": mask}}, tmp_path / "c")
    save_quiet({"model": {"mask": ~mask}}, tmp_path / "d")
    code, line = _summary(tmp_path / "c", tmp_path / "d")
    assert code == 1 and "None" not in line and "no tensor with a magnitude differs" in line, line
    z = torch.zeros(4)
    z[2] = -0.0  # a bitwise-only difference with metrics (all 0): they name the tensor that differs
    save_quiet({"model": {"z": torch.zeros(4), "w": w}}, tmp_path / "e")
    save_quiet({"model": {"z": z, "w": w}}, tmp_path / "f")
    code, line = _summary(tmp_path / "e", tmp_path / "f")
    assert code == 1 and "max abs 0 (model.z)" in line and "magnitude" not in line, line


def test_a_value_difference_still_names_its_tensor(tmp_path: Path) -> None:
    w = torch.arange(6, dtype=torch.float32)
    save_quiet({"model": {"mask": torch.tensor([True]), "w": w}}, tmp_path / "a")
    save_quiet({"model": {"mask": torch.tensor([True]), "w": w + 1}}, tmp_path / "b")
    code, line = _summary(tmp_path / "a", tmp_path / "b")
    assert code == 1 and "max abs 1 (model.w)" in line and "magnitude" not in line, line
