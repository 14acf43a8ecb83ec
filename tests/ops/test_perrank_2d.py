"""FSDP2 + tensor parallel on a 2-D mesh, saved by torch-checkpointing on 4 gloo ranks.

tests/fixtures/perrank.py ``build_torch_checkpointing_2d``: a (dp=2, tp=2) mesh, the MLP column
parallel (``(_StridedShard(0, 2), Shard(0))``) and row parallel (``(Shard(0), Shard(1))``), the rest
FSDP ``Shard(0)``; saved as ``.pt`` (DTensors carry their placements) and with the model in
safetensors (local shards placed from ``metadata.pkl``). Every answer is checked against
torch-checkpointing's own load into the plain model and against torch's ``full_tensor`` of the live
model and optimizer. Heavy: the fixture spawns 4 + 1 gloo ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.checkpoint import open_checkpoint
from tests.fixtures.cache import cached_build

runner = CliRunner()
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="session")
def tc2d_root(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed (pip install --no-deps torch-checkpointing==0.1.1)")
    return cached_build(fixture_root, "perrank_torch_checkpointing_2d", perrank.build_torch_checkpointing_2d)


@pytest.mark.parametrize("name", ["pt", "st"])
def test_assembled_equal_to_torch_checkpointings_own_load_and_torch_gathered(tc2d_root: Path, name: str) -> None:
    import torch

    loaded = torch.load(tc2d_root / f"loaded_{name}.pt", weights_only=False)
    ref = torch.load(tc2d_root / "reference.pt", weights_only=False)
    with open_checkpoint(tc2d_root / name / "step-2") as ck:
        assert set(ck.catalog.model) == {f"model.{k}" for k in loaded}
        for k, t in loaded.items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
            assert torch.equal(t, ref["model"][k]), k  # the two references agree
        for k in ref["names"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg_sq"), ref["exp_avg_sq"][k]), k
        chunks = ck.metadata.entries["model.model.layers.0.mlp.up_proj.weight"].chunks  # type: ignore[union-attr]
        # [32, 16] column parallel: tp rank t holds rows [16t, 16t+16), which FSDP's _StridedShard(0, 2)
        # splits over dp: rank (d, t) holds rows [16t + 8d, +8)
        assert sorted((c.offsets, c.sizes) for c in chunks) == [((r, 0), (8, 16)) for r in range(0, 32, 8)]


@pytest.mark.parametrize("name", ["pt", "st"])
def test_inspect_names_the_mesh_and_placements(tc2d_root: Path, name: str) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(tc2d_root / name / "step-2")])
    assert res.exit_code == 0, res.output
    how = json.loads(res.output)["location"]["how"]
    assert "2x2" in how and "(_StridedShard(0, sf=2), Shard(0))" in how and "(Shard(0), Shard(1))" in how
    assert "4 rank(s)" in how


@pytest.mark.parametrize("name", ["pt", "st"])
def test_validate_strict_deep_ok(tc2d_root: Path, name: str) -> None:
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(tc2d_root / name / "step-2")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True


def test_export_equal_to_torch_checkpointings_own_load(tc2d_root: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(tc2d_root / "st" / "step-2"), str(out)])
    assert res.exit_code == 0, res.output
    got = load_file(out / "model.safetensors")
    loaded = torch.load(tc2d_root / "loaded_st.pt", weights_only=False)
    assert set(got) == set(loaded)
    for k, t in loaded.items():
        assert torch.equal(got[k], t), k


def test_diff_pt_and_safetensors_saves_equal(tc2d_root: Path) -> None:
    res = runner.invoke(app, ["diff", "--json", str(tc2d_root / "pt" / "step-2"), str(tc2d_root / "st" / "step-2")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["equal"] is True
