"""`ckpttool export` of checkpoints written by the real trainers, bitwise against torch's own reading.

The reference for every exported tensor is torch reading the same checkpoint: ``dcp.load``
(``FileSystemReader``) or ``HuggingFaceStorageReader``; the expected output key is the key
without the writer's model prefix (``model.``, ``app.model.``, none).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.ops.export.test_export import export_cli, read_export, torch_load

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers


def assert_clean_failure(res, code: str, *needles: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 2, nothing on stdout, an `error: [CODE]` line and a `hint:` line holding the needles."""
    assert res.exit_code == 2 and res.stdout == "", (res.stdout, res.stderr)
    err, hint = res.stderr.strip().splitlines()[-2:]
    assert err.startswith(f"error: [{code}]") and hint.startswith("hint: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def torch_hf_load(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    md = HuggingFaceStorageReader(str(path)).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return sd


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> None:
    expected = {k[len(prefix) :]: v for k, v in want.items() if k.startswith(prefix)}
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))[:5]
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def export_json(src: Path, out: Path, *extra: str) -> dict:
    res = export_cli(str(src), str(out), "--json", *extra)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize(
    "where,prefix",
    [("app_state", "app.model."), ("moe_fsdp2", "model.")],
)
def test_dcp_writers_export_bitwise(acc_root: Path, tmp_path: Path, where: str, prefix: str) -> None:
    doc = export_json(acc_root / where, tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    model_keys = [k for k in torch_load(acc_root / where) if k.startswith(prefix)]
    assert_bitwise(got, torch_load(acc_root / where, model_keys), prefix)
    assert "lm_head.weight" in got and doc["skipped"] == {}


def test_accelerate_pair_exports_the_model_folder(acc_root: Path, tmp_path: Path) -> None:
    # Given the checkpoint-N folder: the model folder is found and paired with optimizer_0.
    export_json(acc_root / "accelerate" / "checkpoint-1", tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    assert_bitwise(got, torch_load(acc_root / "accelerate" / "checkpoint-1" / "pytorch_model_fsdp_0"), "model.")


def test_accelerate_master_weights_are_absent(acc_root: Path, tmp_path: Path) -> None:
    res = export_cli(str(acc_root / "accelerate"), str(tmp_path / "o"), "--step", "1", "--weights", "master")
    assert_clean_failure(res, "E601", "master_weight")


@pytest.mark.parametrize("where", ["hf_sharded", "hf_consolidated"])
def test_hf_storage_writer_exports_bitwise(acc_root: Path, tmp_path: Path, where: str) -> None:
    doc = export_json(acc_root / where, tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    assert_bitwise(got, torch_hf_load(acc_root / where), "")
    assert doc["bytes_read"] == doc["bytes"]  # copied verbatim: each stored byte read once


def test_torchtitan_last_save_in_hf_exports_bitwise(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "llama3_hf" / "checkpoint" / "step-1"
    export_json(src, tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    assert_bitwise(got, torch_hf_load(src), "")
    assert "model.layers.0.self_attn.q_proj.weight" in got  # torchtitan's adapter wrote HF names


def test_flat_state_dict_keeps_lm_head(plain_root: Path, tmp_path: Path) -> None:
    doc = export_json(plain_root / "flat_hf", tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    assert_bitwise(got, torch_load(plain_root / "flat_hf"), "")
    assert "lm_head.weight" in got and "model.embed_tokens.weight" in got and doc["warnings"] == []


def test_plain_optimizer_checkpoint_still_exports_its_model(plain_root: Path, tmp_path: Path) -> None:
    export_json(plain_root / "plain_optimizer", tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    src = plain_root / "plain_optimizer"
    assert_bitwise(got, torch_load(src, [k for k in torch_load(src) if k.startswith("model.")]), "model.")


@pytest.mark.parametrize("step", [2, 3])
def test_torchtitan_llama_without_config_is_refused_naming_the_cause(
    titan_root: Path, tmp_path: Path, step: int
) -> None:
    res = export_cli(str(titan_root / "llama3" / "checkpoint"), str(tmp_path / "o"), "--step", str(step))
    assert_clean_failure(res, "E601", "RoPE row permutation", "num_attention_heads", "--model-assets")
    assert not (tmp_path / "o").exists()


def test_torchtitan_names_with_no_fitting_adapter_are_refused(titan_root: Path, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"model_type": "mistral"}')
    src = str(titan_root / "moe" / "checkpoint")
    res = export_cli(src, str(tmp_path / "o"), "--model-assets", str(tmp_path / "a"))
    assert_clean_failure(res, "E603", "torchtitan names", "tok_embeddings.weight", "adapter")
    res = export_cli(src, str(tmp_path / "o"), "--format", "lora")
    assert_clean_failure(res, "E603", "torchtitan names", "LoRA")
    assert not (tmp_path / "o").exists()


def test_plain_fsdp2_moe_on_4_ranks_needs_a_declaration(moe4_root: Path, tmp_path: Path) -> None:
    src = moe4_root / "moe_fsdp4"
    res = export_cli(str(src), str(tmp_path / "o"))
    assert_clean_failure(res, "E405", "ep_size 2 x ep_fsdp_size 2", "--no-ep", "--source-layout")
    export_json(src, tmp_path / "out", "--no-ep")
    got, _ = read_export(tmp_path / "out")
    assert_bitwise(got, torch_load(src), "model.")


def test_nothing_recognised_is_refused(tmp_path: Path) -> None:
    dcp.save({"ema": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "ck"))
    res = export_cli(str(tmp_path / "ck"), str(tmp_path / "o"))
    assert_clean_failure(res, "E601", "no model tensors")


def test_tensors_outside_the_schema_are_listed_not_dropped(tmp_path: Path) -> None:
    dcp.save(
        {"model": {"w": torch.ones(2, 2)}, "ema": {"w": torch.zeros(2, 2)}, "lr_scheduler": {"t": torch.ones(1)}},
        checkpoint_id=str(tmp_path / "ck"),
    )
    doc = export_json(tmp_path / "ck", tmp_path / "out")
    assert doc["skipped"]["outside the key schema (not model weights)"]["keys"] == ["ema.w"]
    assert doc["skipped"]["training state (scheduler, data loader, step), not weights"]["keys"] == ["lr_scheduler.t"]
    assert any("ema.w" in w for w in doc["warnings"])
