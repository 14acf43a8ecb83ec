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
    assert d["optimizer"]["flavor"] == "flattened" and d["optimizer"]["params_with_state"] == 15
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
