"""`diff --what optimizer` of two saves of one model stepped by different torch optimizers listed dozens of
`only_a`/`only_b` state fields and hyperparameters without saying why: it names the optimizer of each side
(``inspect``'s ``saved_by``) in a note now, and says nothing where both sides were saved by the same one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.builders import build_linear_stepped

runner = CliRunner()


def _notes(a: Path, b: Path) -> tuple[int, list[str], str]:
    res = runner.invoke(app, ["diff", str(a), str(b), "--what", "optimizer", "--json"])
    human = runner.invoke(app, ["diff", str(a), str(b), "--what", "optimizer"], env={"COLUMNS": "250"})
    return res.exit_code, json.loads(res.stdout)["notes"], human.stdout


def test_saves_of_two_optimizers_are_named_in_a_note(tmp_path: Path) -> None:
    made: list[torch.optim.Optimizer] = []
    build_linear_stepped(tmp_path / "a", lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)
    build_linear_stepped(tmp_path / "b", lambda p: made.append(torch.optim.RMSprop(p, lr=1e-2)) or made[0], steps=2)
    note = (
        f"A's optimizer state was saved by torch.optim.AdamW, B's by torch.optim.{type(made[0]).__name__}: their "
        "state fields and param groups differ by design"
    )
    rc, notes, human = _notes(tmp_path / "a", tmp_path / "b")
    assert rc == 1 and note in notes
    assert f"note: {note}" in " ".join(human.split())


def test_saves_of_one_optimizer_get_no_such_note(tmp_path: Path) -> None:
    build_linear_stepped(tmp_path / "a", lambda p: torch.optim.RMSprop(p, lr=1e-2), steps=2)
    build_linear_stepped(tmp_path / "b", lambda p: torch.optim.RMSprop(p, lr=1e-2), steps=3)
    rc, notes, _ = _notes(tmp_path / "a", tmp_path / "b")
    assert rc == 1 and not [n for n in notes if "saved by" in n], notes
