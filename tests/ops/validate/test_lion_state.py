"""Lion's state (OLMo-core's ``olmo_core.optim.Lion``: one moment ``exp_avg``, groups without ``eps``) saved by
torch's own ``get_state_dict`` + ``dcp.save``: a complete save, never "missing eps" (P001), and replay-step names
the optimizer it cannot replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _save_lion(out: Path, *, flatten: bool) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    lion = pytest.importorskip("olmo_core.optim.lion")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    optim = lion.Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(3, 8)).pow(2).mean().backward()
        optim.step()
    opts = sd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = sd.get_state_dict(model, optim, options=opts)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))
    return optim.state_dict()


def _cli(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_lion_groups_are_complete_and_not_replayed_as_adamw(tmp_path: Path, flatten: bool) -> None:
    ckpt = tmp_path / "ckpt"
    ref = _save_lion(ckpt, flatten=flatten)
    group = ref["param_groups"][0]
    assert "eps" not in group and "betas" in group  # what Lion saves, independently of ckpttool
    assert set(ref["state"][0]) == {"exp_avg", "step_factor"}

    code, out, err = _cli("validate", str(ckpt), "--deep", "--json")
    report = json.loads(out)
    codes = {f["code"] for f in report["findings"]}
    assert "P001" not in codes, (out, err)
    assert code == 0, (out, err)

    code, out, _ = _cli("inspect", str(ckpt), "--json")
    groups = json.loads(out)["optimizer"]["param_groups"]
    assert groups and all(g["missing"] == [] for g in groups)

    code, out, err = _cli("replay-step", str(ckpt), "--device", "cpu")
    assert code == 2
    assert "[E514]" in err and "saved by Lion" in err and "no exp_avg_sq" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # one error line and its hint


def test_an_adam_group_that_lost_eps_is_still_named(tmp_path: Path) -> None:
    """An AdamW save whose groups lost ``eps`` keeps both moments: P001 still names it."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    msd, osd = sd.get_state_dict(model, optim)
    for g in osd["param_groups"]:
        del g["eps"]
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    code, out, _ = _cli("validate", str(tmp_path / "ckpt"), "--json")
    assert code == 1
    assert any(f["code"] == "P001" and "missing eps" in f["message"] for f in json.loads(out)["findings"])
