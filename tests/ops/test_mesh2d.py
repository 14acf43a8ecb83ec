"""Every command on DTensor saves of 2-D meshes made by torch's own code (FSDP2 + TP, HSDP, 1x4 vs 2x2).

References are torch's own reader (``dcp_to_torch_save`` of the same directory) and torch's AdamW
formula; the saves are :mod:`tests.fixtures.mesh2d` (one 4-rank gloo run, cached per session).
"""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.cache import cached_build, copy_checkpoint
from tests.fixtures.dcp_equal import assert_same_state
from tests.fixtures.mesh2d import KINDS, build_mesh2d_suite

pytestmark = pytest.mark.heavy  # the suite's one 4-rank build takes ~50 s on 2 cores

runner = CliRunner()
K_PROJ = "model.model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def suite(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "mesh2d", build_mesh2d_suite)


def invoke(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def torch_state(ckpt: Path, tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp / "state.pt")
    return torch.load(tmp / "state.pt", weights_only=False)


@pytest.mark.parametrize("kind", [*KINDS, "hsdp_local", "fsdp_tp_st_local", "hsdp_st_local"])
def test_strict_deep_validate_is_clean(suite: Path, kind: str) -> None:
    res = invoke("validate", suite / kind, "--strict", "--deep", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["findings"] == []


def test_strided_shards_and_the_zero_size_chunk_are_listed_as_torch_saved_them(suite: Path) -> None:
    res = invoke("inspect", suite / "fsdp_tp", "--json")
    assert res.exit_code == 0, res.stderr
    (k,) = [t for t in json.loads(res.stdout)["model"] if t["key"] == K_PROJ]
    # TP Shard(0) 2/1 rows, FSDP over dp inside each: rows 0 | 2 | 1 | none (at offset 3)
    assert k["chunks"] == 4 and k["zero_size_chunks"] == 1 and k["uneven"] is True
    assert sorted(k["chunk_sizes"]) == [[0, 10], [1, 10], [1, 10], [1, 10]]


@pytest.mark.parametrize("kind", ["fsdp_tp", "fsdp_tp_master", "hsdp", "hsdp_tied", "hsdp_local", "fsdp_tp_st_local"])
def test_export_equals_torch_dcp_load_bitwise(suite: Path, kind: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    res = invoke("export", suite / kind, out)
    assert res.exit_code == 0, res.stdout + res.stderr
    # torch's one-process reader of a rank-local save reads __0.metadata alone: the collective save is the reference
    model = torch_state(suite / kind.removesuffix("_local").removesuffix("_st"), tmp_path)["model"]
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    assert sorted(got) == sorted(model)  # every tensor exported (the tied head too: no config says tied)
    for name, want in model.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_the_same_state_on_1x4_and_2x2_meshes_diffs_equal(suite: Path, tmp_path: Path) -> None:
    assert_same_state(suite / "mesh_1x4", suite / "mesh_2x2", tmp_path)  # torch's reader agrees
    res = invoke("diff", suite / "mesh_1x4", suite / "mesh_2x2", "--what", "all", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["equal"] is True and doc["counts"]["compared"] >= 84


def test_stats_match_torch_and_the_adamw_formula(suite: Path, tmp_path: Path) -> None:
    res = invoke("stats", suite / "fsdp_tp", "--json")
    assert res.exit_code == 0, res.stderr
    (c,) = json.loads(res.stdout)["checkpoints"]
    state = torch_state(suite / "fsdp_tp", tmp_path)
    model, opt = state["model"], state["optimizer"]["state"]
    (group,) = state["optimizer"]["param_groups"]
    assert {t["fqn"] for t in c["tensors"]} == set(model)
    for t in c["tensors"]:
        x = (model[t["fqn"]] if t["role"] == "weight" else opt[t["fqn"]][t["role"]]).double()
        assert t["l2"] == pytest.approx(x.norm().item(), rel=1e-12, abs=1e-300), (t["fqn"], t["role"])
        assert t["abs_max"] == x.abs().max().item()
    b1, b2 = group["betas"]
    assert len(c["updates"]) == len(model)
    for u in c["updates"]:
        s = opt[u["fqn"]]
        step = s["step"].item()
        m_hat, v_hat = s["exp_avg"] / (1 - b1**step), s["exp_avg_sq"] / (1 - b2**step)
        upd = group["lr"] * m_hat.abs() / (v_hat.sqrt() + group["eps"])
        assert u["rms"] == pytest.approx(upd.double().pow(2).mean().sqrt().item(), rel=1e-6), u["fqn"]


def test_tied_head_shares_the_embedding_state_without_findings(suite: Path) -> None:
    res = invoke("inspect", suite / "hsdp_tied", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert "model.lm_head.weight" in [t["key"] for t in doc["model"]]
    # torch saves both keys, and the one parameter's state once (under the embedding's fqn)
    assert doc["optimizer"]["params_total"] == doc["optimizer"]["params_with_state"] == 20


def test_manifest_round_trip(suite: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(suite / "fsdp_tp", tmp_path / "ck")
    assert invoke("manifest", ck).exit_code == 0
    res = invoke("validate", ck, "--manifest", ck / "manifest.json")
    assert res.exit_code == 0, res.stdout + res.stderr


def test_export_master_weights_are_the_fp32_masters_torch_loads(suite: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    res = invoke("export", suite / "fsdp_tp_master", out, "--weights", "master")
    assert res.exit_code == 0, res.stdout + res.stderr
    state = torch_state(suite / "fsdp_tp_master", tmp_path)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(state["model"])
    for name, t in got.items():
        want = state["optimizer"]["state"][name]["master_weight"]
        assert t.dtype == torch.float32 and torch.equal(t, want), name


def test_rank_local_saves_of_one_state_diff_equal_with_no_note(suite: Path) -> None:
    """Two ``use_collectives=False`` saves of one state: their ``__R.metadata`` (each with its own ``save_id``)
    are the metadata compared item by item, not files beside the checkpoint that differ."""
    res = invoke("diff", suite / "hsdp_local", suite / "hsdp_local2", "--what", "all", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["equal"] is True and doc["notes"] == []
    # against the collective save: equal, and only the second replica group's data files are named beside
    res = invoke("diff", suite / "hsdp", suite / "hsdp_local", "--what", "all", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    (note,) = json.loads(res.stdout)["notes"]
    assert "only in B (__2_0.distcp, __3_0.distcp)" in note and ".metadata" not in note


def _blob_window(ckpt: Path, rank: int, key: str) -> tuple[Path, int]:
    """File and start of ``key``'s values in rank ``rank``'s safetensors blob, from torch's own ``__R.metadata``
    (plain pickle: our fixture) and the blob's JSON header."""
    md = pickle.loads((ckpt / f"__{rank}.metadata").read_bytes())
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == key]
    path = ckpt / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        (n,) = struct.unpack("<Q", f.read(8))
        begin, _ = json.loads(f.read(n))[key]["data_offsets"]
    return path, info.offset + 8 + n + begin


def test_replicas_of_a_safetensors_serialized_rank_local_save_are_read_from_their_blob(
    suite: Path, tmp_path: Path
) -> None:
    """The tp ranks' two copies of a norm (ranks 0 and 1: dp 0) are each read at its own value window: equal
    copies are no ``D014`` (rank 1's was read at its blob's start, as garbage), and a copy changed on disk is."""
    key = "model.model.norm.weight"
    ck = copy_checkpoint(suite / "fsdp_tp_st_local", tmp_path / "ck")
    res = invoke("validate", ck, "--strict", "--deep", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.stdout[:2000]
    path, start = _blob_window(ck, 1, key)
    data = bytearray(path.read_bytes())
    data[start : start + 4] = struct.pack("<f", 123.0)
    path.write_bytes(bytes(data))
    res = invoke("validate", ck, "--deep", "--json")
    assert res.exit_code == 1
    (d,) = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "D014"]
    assert d["key"] == key and "__1_0.distcp" in d["message"] and "123" in d["message"], d["message"]


def test_a_file_of_copies_only_cut_short_is_s003_in_a_safetensors_serialized_rank_local_save(
    suite: Path, tmp_path: Path
) -> None:
    """HSDP saved rank-locally in torch's safetensors serialization: rank 3 writes only copies (its replica group's
    peer, rank 1, wrote the ones read); its file cut short is the S003 rank 3's resume would fail on."""
    ck = copy_checkpoint(suite / "hsdp_st_local", tmp_path / "ck")
    f = ck / "__3_0.distcp"
    f.write_bytes(f.read_bytes()[:-300])
    res = invoke("validate", ck, "--json")
    assert res.exit_code == 1, res.stdout[:2000]
    (d,) = [x for x in json.loads(res.stdout)["findings"] if x["code"] == "S003"]
    assert d["key"] == "__3_0.distcp"
