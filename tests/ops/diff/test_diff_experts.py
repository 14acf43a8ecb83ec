"""`diff` of two HF folders of one MoE model, one with fused experts and one per expert.

Fixtures: tiny Qwen3-MoE and Mixtral models, each written by transformers' ``save_pretrained`` (per-expert names:
``experts.<j>.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.<j>.w1.weight``) and as the model's own
``state_dict()`` (fused ``experts.gate_up_proj [E, 2I, H]``, which transformers v5 loads as is); the reference is
transformers' own loading of both folders (equal state dicts).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.diff.test_diff import diff_json as _diff

runner = CliRunner()


@pytest.fixture(scope="module")
def forms(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "moe_expert_forms", hf_models.build_moe_expert_forms)


@pytest.mark.parametrize("family", ["qwen_moe", "mixtral"])
def test_fused_and_per_expert_folders_of_one_model_pair_up_and_are_equal(forms: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    fused, per = forms / family / "fused", forms / family / "per_expert"
    # the reference: transformers' own loading (its conversion of the per-expert names) gives one model
    loaded = [AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (fused, per)]
    assert loaded[0].keys() == loaded[1].keys() and all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])
    n_per = len(load_file(per / "model.safetensors"))
    for a, b, cut in ((fused, per, "A"), (per, fused, "B")):
        doc = _diff(a, b, code=0)
        assert doc["equal"] and doc["differences"] == []
        # every tensor of the per-expert folder was paired and its values compared: none only in one side
        assert doc["counts"]["compared"] == n_per == doc["counts"]["equal"]
        assert (
            f"4 fused expert tensor(s) of {cut} compared per expert with {'B' if cut == 'A' else 'A'}" in doc["notes"]
        )


def test_a_changed_expert_element_is_named_by_its_piece_and_fused_index(forms: Path, tmp_path: Path) -> None:
    src = forms / "mixtral" / "fused"
    changed = shutil.copytree(src, tmp_path / "fused")
    sd = load_file(changed / "model.safetensors")
    key = "model.layers.1.mlp.experts.gate_up_proj"
    i = sd[key].shape[1] // 2  # up rows (w3) follow the gate rows (w1)
    sd[key][2, i + 3, 5] += 1
    save_file(sd, str(changed / "model.safetensors"), metadata={"format": "pt"})
    doc = _diff(forms / "mixtral" / "per_expert", changed, code=1)
    (d,) = doc["differences"]
    assert d["name"] == "model.layers.1.block_sparse_moe.experts.2.w3.weight" and d["index"] == [3, 5]
    assert d["stored"] == {"side": "B", "key": key, "index": [2, i + 3, 5]} and d["mismatched"] == 1


@pytest.fixture(scope="module")
def fp8_forms(fixture_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample MoE exported by ``export --quantize fp8-block`` (block 8) with fused and with per-expert experts."""
    src = cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)
    root = tmp_path_factory.mktemp("fp8_forms")
    args = ["--model-assets", str(src / "model_assets"), "--quantize", "fp8-block", "--quantize-block", "8"]
    for name, experts in (("fused", "fused"), ("per", "per-expert")):
        res = runner.invoke(app, ["export", str(src), str(root / name), *args, "--experts", experts])
        assert res.exit_code == 0, res.output
    return root


def test_fp8_fused_experts_are_compared_per_expert_with_per_expert_fp8(fp8_forms: Path, tmp_path: Path) -> None:
    """Fused FP8 experts (``[E, out, in]`` codes, ``weight_scale_inv`` ``[E, out/B, in/B]``) were listed as only in A
    beside a note: now each expert is dequantized on its own scale rows and compared with the per-expert weights."""
    doc = _diff(fp8_forms / "fused", fp8_forms / "per", code=0)
    assert doc["equal"] and not doc["differences"]
    names = {t["name"] for t in doc["tensors"]}
    assert (
        "model.layers.1.mlp.experts.7.up_proj.weight" in names
        and "model.layers.0.mlp.experts.gate_up_proj" not in names
    )
    assert "4 quantized fused expert tensor(s) of A dequantized and compared per expert with B" in " ".join(
        doc["notes"]
    )
    # one FP8 code of expert 2's up rows changed: named by its piece and its fused index
    bad = shutil.copytree(fp8_forms / "fused", tmp_path / "bad")
    sd = load_file(bad / "model.safetensors")
    key = "model.layers.1.mlp.experts.gate_up_proj"
    w = sd[key].view(torch.uint8).clone()
    i = w.shape[1] // 2
    w[2, i + 3, 5] ^= 0x40
    sd[key] = w.view(torch.float8_e4m3fn)
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    doc = _diff(fp8_forms / "per", bad, code=1)
    (d,) = doc["differences"]
    assert d["name"] == "model.layers.1.mlp.experts.2.up_proj.weight" and d["index"] == [3, 5]
    assert d["stored"] == {"side": "B", "key": key, "index": [2, i + 3, 5]} and d["mismatched"] == 1


def test_fp8_fused_experts_against_torch_dequantized_per_expert_values(fp8_forms: Path, tmp_path: Path) -> None:
    """The reference: torch's ``QuantizedHuggingFaceStorageReader`` dequantizes the per-expert FP8 export to float32;
    the fused export's pieces, dequantized per expert, equal those values (a quantized side against an unquantized one:
    mode ``quantization``, each piece with its tolerance)."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    per = fp8_forms / "per"
    stored = load_file(per / "model.safetensors")
    fp8 = {k: v for k, v in stored.items() if v.dtype == torch.float8_e4m3fn}
    sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in fp8.items()}
    dcp.load(
        sd,
        storage_reader=QuantizedHuggingFaceStorageReader(str(per), target_dtype=torch.float32, block_size=8),
        no_dist=True,
    )
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_bytes((per / "config.json").read_bytes())
    plain = {k: v for k, v in stored.items() if k not in fp8 and not k.endswith("_scale_inv")}
    save_file({**plain, **sd}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    doc = _diff(fp8_forms / "fused", ref, code=0)
    pieces = [t for t in doc["tensors"] if ".experts." in t["name"] and t["name"].endswith("_proj.weight")]
    assert len(pieces) == 2 * 8 * 3 and json.dumps(doc["comparison"]).count("quantization") == 1
    for t in pieces:
        assert t["max_abs"] == 0.0 and t["status"] == "equal", t
        assert t["tolerance"]["scheme"] == "fp8-experts" and t["tolerance"]["rtol"] == 0.125


def test_a_config_json_symlinked_out_of_a_folder_is_refused_not_read_for_the_expert_names(
    forms: Path, tmp_path: Path
) -> None:
    """The family's per-expert names come from a folder's own ``config.json``; one that is a symlink out of the folder
    is E101 (``docs/errors.md``), not read: the same refusal as every other reading of a folder's own config."""
    fused = shutil.copytree(forms / "mixtral" / "fused", tmp_path / "fused")
    outside = tmp_path / "elsewhere.json"
    (fused / "config.json").rename(outside)
    (fused / "config.json").symlink_to(outside)
    per = shutil.copytree(forms / "mixtral" / "per_expert", tmp_path / "per", ignore=shutil.ignore_patterns("*.json"))
    res = runner.invoke(app, ["diff", str(fused), str(per), "--json"])
    assert res.exit_code == 2, res.stdout
    assert f"[E101] {fused}: config.json" in res.stderr and res.stdout == ""


def test_a_damaged_config_json_is_not_read_where_no_fused_expert_is_left_to_pair(forms: Path, tmp_path: Path) -> None:
    """Two folders that hold the same names (fused on both sides) have nothing to cut per expert: their
    ``config.json`` is not needed, so a damaged one does not stop the comparison of their tensors."""
    src = forms / "qwen_moe" / "fused"
    other = shutil.copytree(src, tmp_path / "fused")
    (other / "config.json").write_text("{not json")
    doc = _diff(other, src, code=0)
    assert doc["equal"] and doc["counts"]["compared"] == len(load_file(src / "model.safetensors"))


def test_a_folder_holding_both_expert_forms_is_not_cut_onto_its_own_names(forms: Path, tmp_path: Path) -> None:
    """A file that holds each expert both per expert and fused (the fused tensors here differ everywhere) against the
    per-expert folder: its fused tensors are not cut into names it already holds (two tensors of one name, one never
    compared), so they are only in B and the verdict is not equal, whichever side it is."""
    per = forms / "qwen_moe" / "per_expert"
    fused = load_file(forms / "qwen_moe" / "fused" / "model.safetensors")
    both = shutil.copytree(per, tmp_path / "both")
    sd = load_file(both / "model.safetensors")
    extra = {k: v + 1 for k, v in fused.items() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(extra) == 4 and not extra.keys() & sd.keys()
    save_file(sd | extra, str(both / "model.safetensors"), metadata={"format": "pt"})
    for a, b, side in ((per, both, "only_b"), (both, per, "only_a")):
        doc = _diff(a, b, code=1)
        assert not doc["equal"] and not [n for n in doc["notes"] if "compared per expert" in n]
        assert sorted((d["kind"], d["name"]) for d in doc["differences"]) == sorted((side, k) for k in extra)
        assert doc["counts"]["compared"] == doc["counts"]["equal"] == len(sd)


@pytest.mark.parametrize("quantize", [(), ("--quantize", "fp8-block", "--quantize-block", "8")])
def test_a_fused_fp8_tensor_only_in_one_side_is_only_in_that_side_with_no_note(tmp_path: Path, quantize: tuple) -> None:
    """A fused expert tensor one side lacks (and holds no per-expert piece of) is only in the other side. Quantized,
    a note also said it was "not dequantized (their scale does not pair), so not cut per expert" and not compared
    with "A's per-expert tensors": its scale pairs, and A holds none. The FP8 pair now reads as the BF16 pair does."""
    from tests.ops.export.test_export_quant_experts import _tiny_moe

    src = _tiny_moe(tmp_path / "ckpt")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text('{"hidden_size": 20}')  # the export adds the quantization_config: scales pair
    full = tmp_path / "full"
    res = runner.invoke(
        app, ["export", str(src), str(full), "--experts", "fused", "--model-assets", str(assets), *quantize]
    )
    assert res.exit_code == 0, res.stderr
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    gone = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = {k: v for k, v in load_file(str(cut / "model.safetensors")).items() if not k.startswith(gone)}
    save_file(tensors, str(cut / "model.safetensors"), metadata={"format": "pt"})
    (cut / "model.safetensors.index.json").unlink()
    doc = _diff(cut, full, code=1)
    only_b = sorted(d["name"] for d in doc["differences"] if d["kind"] == "only_b")
    assert only_b == [gone], doc["differences"]  # a dequantized weight: its scale is not listed on its own
    assert not [n for n in doc["notes"] if "per expert" in n or "not pair" in n], doc["notes"]
    assert any("compared dequantized (2 in A, 3 in B" in n for n in doc["notes"]) == bool(quantize)  # scales pair
