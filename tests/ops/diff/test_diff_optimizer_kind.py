"""`diff --what optimizer` of two saves of one model stepped by different torch optimizers listed dozens of
`only_a`/`only_b` state fields and hyperparameters without saying why: it names the optimizer of each side
(``inspect``'s ``saved_by``) in a note now, and says nothing where both sides were saved by the same one (a parameter whose ``exp_avg`` is missing is a
difference, not a second optimizer). A flattened save's param groups are counted as the optimizer had them, not one
per parameter, and the group of a model key renamed alone is still found."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.builders import build_linear_stepped, save_quiet, train_steps

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


def _two_group_adamw(
    out: Path, *, flatten: bool = False, drop: str | None = None, rename: str | None = None, sgd: bool = False
) -> None:
    """``Sequential(Linear(4, 3), Linear(3, 2))`` after two ``torch.optim.AdamW`` steps (``sgd``: ``SGD`` with
    momentum 0.9) with two param groups (lr 1e-3 and 1e-2), saved by ``dcp.save`` through ``get_state_dict`` (``flatten``: ``flatten_optimizer_state_dict``);
    ``drop``: that parameter's ``exp_avg`` left out of the saved state; ``rename``: that model key saved as
    ``<rename>.renamed`` (the optimizer's keys untouched)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [{"params": list(m[0].parameters()), "lr": 1e-3}, {"params": list(m[1].parameters()), "lr": 1e-2}]
    opt = torch.optim.SGD(groups, momentum=0.9) if sgd else torch.optim.AdamW(groups)
    train_steps(m, opt, 2)
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    if drop is not None:
        osd["state"][drop] = {k: v for k, v in osd["state"][drop].items() if k != "exp_avg"}
    if rename is not None:
        msd[rename.rsplit(".", 1)[0] + ".renamed"] = msd.pop(rename)
    save_quiet({"model": msd, "optimizer": osd}, out)


def test_a_missing_moment_is_no_second_optimizer(tmp_path: Path) -> None:
    _two_group_adamw(tmp_path / "a")
    _two_group_adamw(tmp_path / "b", drop="1.weight")
    res = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--what", "optimizer", "--json"])
    rc, notes, human = _notes(tmp_path / "a", tmp_path / "b")
    assert rc == 1 and not [n for n in notes if "by design" in n], notes
    assert "by design" not in human
    diffs = json.loads(res.stdout)["differences"]
    assert [(d["kind"], d["name"]) for d in diffs] == [("only_a", "optimizer.state.1.weight.exp_avg")]
    # the stored key is named in parentheses only where it is not the name compared (it repeated it)
    assert "  only_a: optimizer.state.1.weight.exp_avg: only in A" in human.splitlines(), human
    assert diffs[0]["message"] == "optimizer.state.1.weight.exp_avg: only in A"


def test_missing_moment_beside_another_optimizer_is_not_excused(tmp_path: Path) -> None:
    _two_group_adamw(tmp_path / "a", sgd=True)
    _two_group_adamw(tmp_path / "b", drop="1.weight")
    note = (
        "A's optimizer state was saved by torch.optim.SGD, B's by torch.optim.AdamW: their state fields and param "
        "groups differ by design (the state of 1 parameter of B fits no known optimizer: not by design)"
    )
    rc, notes, human = _notes(tmp_path / "a", tmp_path / "b")
    assert rc == 1 and note in notes
    assert f"note: {note}" in " ".join(human.split())


def test_flattened_param_groups_are_counted_as_the_optimizer_had_them(tmp_path: Path) -> None:
    _two_group_adamw(tmp_path / "a", flatten=True)
    _two_group_adamw(tmp_path / "b", flatten=True)
    note = (
        "optimizer state and param groups not compared (A and B each hold 12 state fields in 2 param groups): "
        "--what all compares them"
    )
    args = ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--what", "model"]
    res = runner.invoke(app, [*args, "--json"])
    human = runner.invoke(app, args, env={"COLUMNS": "250"}).stdout
    assert res.exit_code == 0 and json.loads(res.stdout)["notes"] == [note]
    assert f"note: {note}" in " ".join(human.split())


def test_flattened_group_of_a_renamed_model_key_is_still_found(tmp_path: Path) -> None:
    _two_group_adamw(tmp_path / "a", flatten=True)
    _two_group_adamw(tmp_path / "b", flatten=True, rename="1.weight")
    args = ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--what", "optimizer"]
    res = runner.invoke(app, [*args, "--json"])
    human = runner.invoke(app, args, env={"COLUMNS": "250"}).stdout
    out = json.loads(res.stdout)
    assert res.exit_code == 0 and out["equal"] and out["differences"] == [], out["differences"]
    assert "no param group" not in human
    assert "optimizer.param_groups.1.weight.lr" not in human
