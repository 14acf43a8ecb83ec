"""A parameter whose fqn is huge (10^5 dot-separated parts, written by torch's own ``dcp.save`` with the state of
torch's own ``AdamW``): ``replay-step``'s error names it by its start and end (``errors.short_key``), one line, and
its table folds the key by lines rendered one at a time (rich's own rendering copies a one-segment cell once per
line: quadratic in the key)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

FQN = ".".join(["a"] * 100_000) + ".weight"


@pytest.fixture(scope="module")
def long_key_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One AdamW-stepped parameter under :data:`FQN`, its ``exp_avg_sq`` made negative (a replay mismatch)."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(4, 4)
    opt.step()
    saved = opt.state_dict()
    st = dict(saved["state"][0])
    st["exp_avg_sq"] = -st["exp_avg_sq"].abs() - 1
    group = {**saved["param_groups"][0], "params": [FQN]}
    state = {"model": {FQN: p.detach().clone()}, "optimizer": {"state": {FQN: st}, "param_groups": [group]}}
    out = tmp_path_factory.mktemp("long") / "ck"
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out


def test_replay_mismatch_names_a_huge_key_by_its_ends(long_key_ckpt: Path) -> None:
    res = CliRunner().invoke(app, ["replay-step", str(long_key_ckpt), "--device", "cpu"])
    assert res.exit_code == 1
    error, hint = res.stderr.splitlines()
    assert error.startswith("error: [E700] 1 of 1 parameter(s) do not reproduce the reference step; worst a.a.a.")
    assert "a.a....a.a." in error  # its first 120 characters, then its last 60
    assert f"a.a.weight ({len(FQN):,} characters): saved exp_avg_sq holds negative values [D002]" in error
    assert len(error) < 1000 and hint.startswith("hint: ")
    assert res.stdout.count("a.") == 100_000  # the table shows the whole key, folded at its dots


def test_a_folded_key_cell_renders_as_rich_renders_it_one_line_a_segment() -> None:
    from rich.console import Console
    from rich.text import Text

    from ckpttool.ui.render import key_cell

    cell = key_cell(FQN)
    console = Console(file=io.StringIO(), width=60)
    options = console.options.update_width(40)
    ours = list(cell.__rich_console__(console, options))
    rich_own = list(Text.__rich_console__(cell, console, options))  # rich's: the wrapped lines joined in one text
    assert "".join(s.text for s in ours) == "".join(s.text for s in rich_own)
    assert max(s.text.count("\n") for s in ours) == 1  # no segment of many lines for rich to split again and again
