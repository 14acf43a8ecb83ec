"""`ckpttool reshard` of checkpoints written by real trainers: plain FSDP2 MoE declared with --no-ep.

The output must load with plain ``dcp.load`` and hold the source's values in true expert order
(torch's own reading of source and output compared bitwise), optimizer state included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.ops.export.test_export import torch_load

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers

runner = CliRunner()


def test_plain_fsdp2_moe_to_ep_2x2(moe4_root: Path, tmp_path: Path) -> None:
    src, dst = moe4_root / "moe_fsdp4", tmp_path / "out"
    args = ["reshard", str(src), str(dst), "--to", "canonical", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "error: [E405]" in res.stderr and "--no-ep" in res.stderr
    res = runner.invoke(app, [*args, "--no-ep"])
    assert res.exit_code == 0, res.stderr
    a, b = torch_load(src), torch_load(dst)
    assert set(a) <= set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_torchtitan_moe_with_optimizer_to_legacy(titan_root: Path, tmp_path: Path) -> None:
    src, dst = titan_root / "moe" / "checkpoint" / "step-1", tmp_path / "out"
    res = runner.invoke(
        app,
        ["reshard", str(src), str(dst), "--to", "legacy", "--no-ep", "--target-ep-size", "2"]
        + ["--target-ep-fsdp-size", "2", "--with-optimizer"],
    )
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["validate", str(dst), "--strict", "--deep"])
    assert res.exit_code == 0, res.stdout
    # Back to canonical through the record the reshard wrote: the values are the source's, bitwise.
    back = tmp_path / "back"
    res = runner.invoke(app, ["reshard", str(dst), str(back), "--to", "canonical", "--with-optimizer"])
    assert res.exit_code == 0, res.stderr
    a, b = torch_load(src), torch_load(back)
    experts = [k for k in a if ".inner_experts." in k]
    assert experts and any(k.startswith("optimizer.state.") for k in experts)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hf_storage_and_pairs_are_refused(acc_root: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["reshard", str(acc_root / "hf_sharded"), str(tmp_path / "o"), "--to", "canonical"])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E602]") and "HuggingFaceStorageWriter" in res.stderr
    res = runner.invoke(
        app, ["reshard", str(acc_root / "accelerate" / "checkpoint-1"), str(tmp_path / "o"), "--to", "canonical"]
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: [E602]") and "separate checkpoints" in res.stderr
