"""`ckpttool inspect` on checkpoints written by the real trainers: which schema, and why (JSON additions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers

runner = CliRunner()


def inspect_json(*args: str) -> dict:
    res = runner.invoke(app, ["inspect", *args, "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def test_torchtitan(titan_root: Path) -> None:
    d = inspect_json(str(titan_root / "llama3" / "checkpoint"), "--step", "latest")
    assert d["schema"] == "ckpttool.inspect/1"  # the document's schema id; the key schema is `key_schema`
    assert d["key_schema"]["id"] == "torchtitan" and d["key_schema"]["model_prefix"] == ""
    assert d["location"]["step"] == 3 and d["location"]["model"].endswith("step-3")
    assert d["summary"]["model_tensor_count"] == 21 and d["optimizer"]["params_with_state"] == 0
    d = inspect_json(str(titan_root / "llama3" / "checkpoint" / "step-2"))
    assert d["summary"]["model_tensor_count"] == 21
    # 17: the fused wqkv of each layer counted once, as torch's metadata holds its state (15 + 2)
    assert d["optimizer"]["flavor"] == "flattened" and d["optimizer"]["params_with_state"] == 17
    assert set(d["training_state"]) == {"lr_scheduler", "dataloader", "train_state"}
    assert d["uncategorized_tensors"] == [] and d["serialization"] == "torch_save"
    assert any("planner_data" in r for r in d["key_schema"]["reasons"])
    # --filter works on fqns without any prefix
    f = inspect_json(str(titan_root / "llama3" / "checkpoint" / "step-2"), "--filter", "layers.0.feed_forward.*")
    assert [t["key"] for t in f["model"]] == [f"layers.0.feed_forward.w{i}.weight" for i in (1, 2, 3)]


def test_human_output_names_the_schema(acc_root: Path) -> None:
    res = runner.invoke(app, ["inspect", str(acc_root / "accelerate"), "--step", "1"])
    assert res.exit_code == 0, res.stderr
    assert "key schema  torch-native (detected)" in res.stdout
    assert "opened      " in res.stdout and "optimizer_0" in res.stdout


def test_app_state_and_hf_storage(acc_root: Path) -> None:
    d = inspect_json(str(acc_root / "app_state"))
    assert d["key_schema"]["id"] == "app-state" and d["optimizer"]["params_with_state"] == 21
    d = inspect_json(str(acc_root / "hf_sharded"))
    assert d["serialization"] == "safetensors" and d["summary"]["ranks"] == [0, 1]
    assert d["summary"]["model_tensor_count"] == 21


def test_moe4_lists_candidate_meshes(moe4_root: Path) -> None:
    d = inspect_json(str(moe4_root / "moe_fsdp4"))
    lay = d["layout"]
    assert lay["ambiguous"] and all(v == [[2, 2]] for v in lay["candidates"].values())
    d = inspect_json(str(moe4_root / "moe_fsdp4"), "--no-ep")
    assert d["layout"]["ambiguous"] == [] and d["layout"]["source"] == "declared"


@pytest.mark.parametrize("run", ["llama3", "moe"])
def test_torchtitan_fused_qkv_state_counts_as_torch_and_stats_count_it(titan_root: Path, run: str) -> None:
    """torchtitan steps ``wqkv`` fused and stores the model's ``wq``/``wk``/``wv``: inspect's optimizer section counted
    15 of 17 (qwen3 MoE: 21 of 23) parameters with state, its ``exp_avg`` 15 tensors, where torch's own
    ``FileSystemReader.read_metadata()`` holds 17 ``exp_avg`` and ``stats`` 17, and listed ``wq``/``wk``/``wv`` as
    buffers (no param group), which are the stored split of a stepped parameter."""
    from torch.distributed.checkpoint import FileSystemReader

    step = titan_root / run / "checkpoint" / "step-1"  # written by torchtitan's own CheckpointManager
    md = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    ref = {k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in md if k.startswith("optimizer.state.")}
    assert sum(k.endswith(".exp_avg") for k in md) == len(ref) == {"llama3": 17, "moe": 23}[run]
    o = inspect_json(str(step))["optimizer"]
    assert o["params_total"] == o["params_with_state"] == len(ref)
    assert o["fields"] == {f: {"float32": len(ref)} for f in ("exp_avg", "exp_avg_sq", "step")}
    assert not any(".qkv_linear." in b for b in o["buffers"]) and o["orphan_state"] == []
    res = runner.invoke(app, ["stats", str(step), "--json"])
    assert res.exit_code == 0, res.stderr
    stats = json.loads(res.stdout)["checkpoints"][0]["tensors"]
    assert sum(t["role"] == "exp_avg" for t in stats) == len(ref)
    human = runner.invoke(app, ["inspect", str(step)], env={"COLUMNS": "200"}).stdout
    assert f"state for {len(ref)}/{len(ref)} params" in human
