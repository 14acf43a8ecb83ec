"""torch's own ``Muon`` for the hidden matrices beside ``AdamW`` for the rest (the usual Muon recipe), saved by
``get_state_dict(model, [muon, adamw])`` + ``dcp.save``: replay-step replays the AdamW parameters a ``--filter``
selects, and refuses the whole run in one line that says how to select them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _save(out: Path, *, flatten: bool) -> None:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 32)
    )
    hidden = [model[1].weight]
    muon = torch.optim.Muon(hidden, lr=1e-2, weight_decay=0.1)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p is not model[1].weight], lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        muon.zero_grad()
        adamw.zero_grad()
        model(torch.randint(0, 32, (4, 8))).pow(2).mean().backward()
        muon.step()
        adamw.step()
    opts = sd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = sd.get_state_dict(model, [muon, adamw], options=opts)
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_adamw_parameters_beside_muon_replay(tmp_path: Path, flatten: bool) -> None:
    _save(tmp_path / "ckpt", flatten=flatten)

    res = runner.invoke(app, ["replay-step", str(tmp_path / "ckpt"), "--device", "cpu", "--filter", "[023].*"])
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert "OK: 5 of 5 parameters match the reference step" in res.stdout

    res = runner.invoke(app, ["replay-step", str(tmp_path / "ckpt"), "--device", "cpu"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: [E514] param group of 1.weight has no betas")
    assert "--filter" in lines[1]
