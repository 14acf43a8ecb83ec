"""A param group whose ``lr`` is a tensor (``torch.optim.AdamW(lr=torch.tensor(...))``): ``dcp.save`` stores it
as a tensor entry, not a byte item; every command reads it as the number it is."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.torch_free import run_without_torch

runner = CliRunner()


@pytest.fixture
def tensor_lr_ckpt(tmp_path: Path) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(2e-3), weight_decay=0.0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    assert isinstance(osd["param_groups"][0]["lr"], torch.Tensor)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


@pytest.mark.parametrize("command", [["inspect"], ["stats"], ["validate"], ["replay-step", "--device", "cpu"]])
def test_tensor_lr_is_read_as_a_number(tensor_lr_ckpt: Path, command: list[str]) -> None:
    # was E100 "'optimizer.param_groups.0.lr' is not a byte item of the checkpoint", hint "run the command with --help"
    res = runner.invoke(app, [command[0], str(tensor_lr_ckpt), *command[1:]])
    assert res.exit_code == 0, res.stderr
    assert "error" not in res.stderr


def test_replay_uses_the_tensor_lr(tensor_lr_ckpt: Path) -> None:
    res = runner.invoke(app, ["replay-step", str(tensor_lr_ckpt), "--device", "cpu", "--json", "--reference", "torch"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and [p["lr"] for p in doc["params"]] == pytest.approx([2e-3, 2e-3])
    assert all(p["torch_unequal"] is not None and not any(p["torch_unequal"].values()) for p in doc["params"])


def test_inspect_reads_the_tensor_lr_without_importing_torch(tensor_lr_ckpt: Path) -> None:
    """``inspect`` is torch-free, but a tensor ``lr`` was read with ``read_tensor`` (torch imported, 1-3 s); its
    value is now decoded from the stored bytes of the 0-d tensor (the same number torch reads)."""
    r = run_without_torch("inspect", str(tensor_lr_ckpt), "--json")
    (group,) = json.loads(r.stdout)["optimizer"]["param_groups"]
    assert group["lr"] == pytest.approx(2e-3) and group["lr"] == float(__import__("torch").tensor(2e-3).item())


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        ("float32", 2e-3),
        ("float64", 2e-3),
        ("bfloat16", 2e-3),
        ("float16", 2e-3),
        ("int64", -7),
        ("int32", 7),
        ("bool", True),
        ("float32", float("inf")),
    ],
)
def test_read_scalar_decodes_what_torch_reads(tmp_path: Path, dtype: str, value: float) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.format.reader import CheckpointReader

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    t = torch.tensor(value, dtype=getattr(torch, dtype))
    dcp.save({"x": t, "v": t.reshape(1)}, checkpoint_id=str(tmp_path / "c"))
    with CheckpointReader(tmp_path / "c") as r:
        for key in ("x", "v"):
            got = r.read_scalar(key)
            assert type(got) is type(t.item()) and got == t.item(), (key, got, t.item())
