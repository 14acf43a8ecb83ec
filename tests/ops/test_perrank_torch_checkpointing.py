"""torch-checkpointing per-rank checkpoints (tests/fixtures/perrank.py: its own CheckpointManager, 1 and 2 gloo ranks).

Answers are checked against what torch gathers from the live FSDP2 model and optimizer
(``DTensor.full_tensor``).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.model.checkpoint import open_checkpoint
from tests.fixtures.cache import cached_build

runner = CliRunner()


@pytest.fixture(scope="session")
def tc_root(fixture_root: Path) -> Path:
    import importlib.util

    from tests.fixtures import perrank

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed (pip install --no-deps torch-checkpointing==0.1.1)")
    return cached_build(fixture_root, "perrank_torch_checkpointing", perrank.build_torch_checkpointing)


@pytest.mark.parametrize(("name", "world"), [("w1", 1), ("w1plain", 1), ("w2", 2), ("w2st", 2)])
def test_assembled_tensors_equal_torch_gathered(tc_root: Path, name: str, world: int) -> None:
    import torch

    ref = torch.load(tc_root / f"w{world}" / "reference.pt", weights_only=False)
    with open_checkpoint(tc_root / name / "step-2") as ck:
        assert ck.catalog.schema.id == "torch-checkpointing"
        assert set(ck.catalog.model) == {f"model.{k}" for k in ref["model"]}
        for k, t in ref["model"].items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k
        for k in ref["names"]:
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg"), ref["exp_avg"][k]), k
            assert torch.equal(ck.reader.read_tensor(f"optimizer.state.{k}.exp_avg_sq"), ref["exp_avg_sq"][k]), k
            assert float(ck.reader.read_tensor(f"optimizer.state.{k}.step")) == ref["step"][k]
            assert ck.reader.read_object(f"optimizer.param_groups.{k}.lr") == ref["lr"]
        assert ck.reader.read_object("lr_scheduler.last_epoch") == 2  # the scheduler file was read
        assert "lr_scheduler" in ck.located.how and "optimizer" in ck.located.how


@pytest.mark.parametrize("name", ["w2", "w2st"])
def test_equal_to_torch_checkpointings_own_load(tc_root: Path, name: str) -> None:
    import torch

    loaded = torch.load(tc_root / "w2" / f"loaded_{name}.pt", weights_only=False)
    with open_checkpoint(tc_root / name / "step-2") as ck:
        assert set(ck.catalog.model) == {f"model.{k}" for k in loaded}
        for k, t in loaded.items():
            assert torch.equal(ck.reader.read_tensor(f"model.{k}"), t), k


@pytest.mark.parametrize("name", ["w2st", "w1plain"])
def test_validate_strict_deep_ok(tc_root: Path, name: str) -> None:
    res = runner.invoke(app, ["validate", "--strict", "--deep", "--json", str(tc_root / name)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True


def test_safetensors_items_are_not_called_damaged(tc_root: Path) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(tc_root / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output
    assert "torch-checkpointing" in json.loads(res.output)["location"]["how"]


def test_staging_dir_of_an_unfinished_save_is_incomplete(tc_root: Path, tmp_path: Path) -> None:
    tmp = shutil.copytree(tc_root / "w1" / "step-2", tmp_path / "tmp_step-3")
    res = runner.invoke(app, ["validate", str(tmp)])
    assert res.exit_code != 0
    assert "E202" in res.output and "did not finish" in res.output


def test_unknown_metadata_version_is_refused_by_name(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    md = pickle.loads((d / "metadata.pkl").read_bytes())
    md["version"] = "3.7"
    (d / "metadata.pkl").write_bytes(pickle.dumps(md))
    res = runner.invoke(app, ["inspect", str(d)])
    assert res.exit_code != 0
    assert "E281" in res.output and "'3.7'" in res.output


def test_missing_rank_file_is_incomplete(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    (d / "lr_scheduler_1.pt").unlink()
    res = runner.invoke(app, ["validate", str(d)])
    assert res.exit_code != 0 and "E202" in res.output


def test_metadata_shape_disagreeing_with_the_shards_is_refused(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    md = pickle.loads((d / "metadata.pkl").read_bytes())
    entry = md["metadata"]["model"]["nested_path_to_metadata"]['["model.norm.weight"]'][0]
    entry["sharding_metadata"]["data"]["global_shape"] = [17]
    (d / "metadata.pkl").write_bytes(pickle.dumps(md))
    res = runner.invoke(app, ["validate", str(d)])
    assert res.exit_code != 0 and "E280" in res.output


def test_metadata_with_a_global_is_refused(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w1" / "step-2", tmp_path / "step-2")
    (d / "metadata.pkl").write_bytes(pickle.dumps({"version": "2.0", "metadata": {}, "world_size": 1, "p": Path("/")}))
    res = runner.invoke(app, ["inspect", str(d)])
    assert res.exit_code != 0 and "E201" in res.output


def test_replay_step_matches_reference(tc_root: Path) -> None:
    res = runner.invoke(app, ["replay-step", "--device", "cpu", "--json", str(tc_root / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output


def test_found_from_the_run_root(tc_root: Path) -> None:
    res = runner.invoke(app, ["inspect", "--json", str(tc_root / "w2st")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["location"]["model"] == str(tc_root / "w2st" / "step-2")


def test_diff_pt_and_safetensors_saves_of_one_state_are_equal(tc_root: Path) -> None:
    res = runner.invoke(app, ["diff", str(tc_root / "w2" / "step-2"), str(tc_root / "w2st" / "step-2")])
    assert res.exit_code == 0, res.output
    assert "equal" in res.output


def test_manifest_then_validate_names_a_changed_shard(tc_root: Path, tmp_path: Path) -> None:
    d = shutil.copytree(tc_root / "w2" / "step-2", tmp_path / "step-2")
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["manifest", str(d), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert runner.invoke(app, ["validate", "--manifest", str(out), str(d)]).exit_code == 0
    with open_checkpoint(d) as ck:
        meta = ck.metadata.entries["model.model.norm.weight"]
        info = ck.metadata.storage_for("model.model.norm.weight", meta.chunks[1])  # type: ignore[union-attr]
    assert info is not None and info.relative_path == "model_1.pt"
    with open(d / info.relative_path, "r+b") as f:
        f.seek(info.offset + 4)
        b = f.read(1)
        f.seek(info.offset + 4)
        f.write(bytes([b[0] ^ 0x40]))
    res = runner.invoke(app, ["validate", "--manifest", str(out), str(d)])
    assert res.exit_code != 0 and "model.model.norm.weight" in res.output
