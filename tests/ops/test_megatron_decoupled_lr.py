"""Megatron's ``decoupled_lr`` (Megatron-LM ``--decoupled-lr``/``--decoupled-min-lr``): saves written by megatron-core's
own training and ``dist_checkpointing.save`` (``tests/fixtures/megatron.py``, runs ``dense1_decoupled``, with
Megatron-LM's ``args`` in ``common.pt``, and ``dense1_decoupled_core``, megatron-core alone), 3 steps each.
``common.pt`` holds 3 param groups without their ``params``: the default one, the embedding and output layer's
(``max_lr`` = ``decoupled_lr``) and the ``wd_mult`` 0 one.

References: megatron-core's own optimizer — its param groups at the save (``model.json``'s ``param_groups``: each
parameter by the key of its sharded tensor in the checkpoint, each group's ``lr``), and its ``load_state_dict`` of the saved state (``megatron_optimizer_load``),
which raises on these groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.megatron import megatron_optimizer_load, megatron_run

pytestmark = pytest.mark.slow  # megatron-core's training and save on a gloo rank, ~15 s a run

runner = CliRunner()


def _groups(run: Path) -> list[dict[str, object]]:
    step = next(run.glob("iter_*"))
    r = runner.invoke(app, ["inspect", "--json", str(step)])
    assert r.exit_code == 0, r.output
    groups: list[dict[str, object]] = json.loads(r.stdout)["optimizer"]["param_groups"]
    return groups


def _replayed(run: Path) -> dict[str, tuple[int, float]]:
    """Each parameter's group and the lr replay-step stepped it with."""
    r = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(run)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"], doc
    return {p["fqn"]: (p["group"], p["lr"]) for p in doc["params"]}


@pytest.fixture(scope="module")
def lm_run() -> Path:
    return megatron_run("megatron-decoupled", "dense1_decoupled")


@pytest.fixture(scope="module")
def core_run() -> Path:
    return megatron_run("megatron-decoupled-core", "dense1_decoupled_core")


def test_decoupled_lr_groups_get_megatrons_members(lm_run: Path) -> None:
    """Before: the 3 groups got no parameters; inspect labelled each "no state (never stepped)" (params 0) after 3
    steps and replay-step refused (E514). Now the members are derived from the saved args (decoupled_lr), megatron's
    group order and the parameter names, and equal megatron-core's own groups, parameter by parameter, with their
    lr."""
    ref = json.loads((lm_run / "model.json").read_text())["param_groups"]
    assert len(ref) == 3 and ref[1]["max_lr"] == 4e-3  # the decoupled group is megatron's group 1
    groups = _groups(lm_run)
    assert [g["params"] for g in groups] == [len(set(g["params"])) for g in ref]
    assert all(g["has_state"] and "members_known" not in g for g in groups), groups
    assert [g["lr"] for g in groups] == pytest.approx([g["lr"] for g in ref], rel=1e-12)
    want = {n: (i, g["lr"]) for i, g in enumerate(ref) for n in g["params"]}
    got = _replayed(lm_run)
    assert got.keys() == want.keys()
    assert {f: (g, pytest.approx(lr, rel=1e-12)) for f, (g, lr) in want.items()} == got
    assert {f for f, (g, _) in got.items() if g == 1} == {"embedding.word_embeddings.weight", "output_layer.weight"}


def test_megatron_core_cannot_resume_its_own_decoupled_groups(lm_run: Path, tmp_path: Path) -> None:
    """megatron-core 0.16's load_state_dict matches the saved groups by (wd_mult, lr_mult, is_expert_parallel,
    is_decoupled_lr), equal for the default and the decoupled group: its own resume of this save raises. Before:
    validate --strict --deep said OK with nothing flagged. Now P008 names the two groups (and nothing else is
    flagged: the members are known)."""
    loaded = megatron_optimizer_load(lm_run.parent, lm_run.name, tmp_path)
    assert "doesn't match the size of optimizer's group" in loaded["error"]
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(lm_run)])
    assert r.exit_code == 1, r.output
    found = [(f["code"], f["key"]) for f in json.loads(r.stdout)["findings"]]
    assert found == [("P008", "common.pt:optimizer")], found
    message = json.loads(r.stdout)["findings"][0]["message"]
    assert "param groups 0 and 1 have the same wd_mult 1.0, lr_mult 1.0" in message
    assert "restores group 1 for both (they differ in lr, max_lr, min_lr)" in message


def test_decoupled_groups_without_args_are_not_reported_never_stepped(core_run: Path) -> None:
    """megatron-core alone saves no args: nothing says which group is the decoupled one, so no member is assigned.
    Before: validate OK, inspect "no state (never stepped)" for 3 stepped groups. Now validate finds P007 (and P008),
    inspect says the members are unknown, replay-step refuses with E514 naming the decoupled_lr case."""
    r = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(core_run)])
    assert r.exit_code == 1, r.output
    assert sorted(f["code"] for f in json.loads(r.stdout)["findings"]) == ["P007", "P008"]
    groups = _groups(core_run)
    assert [(g["params"], g["has_state"], g.get("members_known")) for g in groups] == [(0, False, False)] * 3
    step = next(core_run.glob("iter_*"))
    r = runner.invoke(app, ["inspect", str(step)], terminal_width=200)
    assert "never stepped" not in r.stdout and r.stdout.count("members unknown (P007)") == 3, r.stdout
    r = runner.invoke(app, ["replay-step", "--device", "cpu", str(core_run)])
    assert r.exit_code == 2 and r.stdout == "", r.output
    line = r.stderr.splitlines()[0]
    assert line.startswith("error: [E514]") and "a decoupled_lr group without the saved args that name it" in line
