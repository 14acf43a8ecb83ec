"""`ckpttool diff` of torchtitan checkpoints against their HF export (model adapters), `--map` and `--weights master`.

Inputs: real torchtitan ``CheckpointManager`` saves (``titan_root``, 2 gloo ranks), HF models
saved under torchtitan names (``hf_models.build_titan_named``, GQA), the ``ckpttool sample``
checkpoint with FP32 master weights. The expected positions of the RoPE q/k rows come from
the ``view/transpose`` permutation of transformers' ``convert_llama_weights_to_hf.py``, not
from the adapter under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.model.checkpoint import OpenOptions
from ckpttool.ops.diff import DiffOptions, diff_checkpoints
from ckpttool.ops.export import ExportOptions
from ckpttool.ops.export.execute import export_checkpoint
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.diff.test_diff import diff_json

pytest.importorskip("torchtitan.models.llama3.state_dict_adapter", reason="torchtitan not installed")


@pytest.fixture(scope="session")
def titan_named(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_titan_named", hf_models.build_titan_named)


def _assets(tmp: Path, cfg: dict[str, Any]) -> Path:
    d = tmp / "assets"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _llama_assets(tmp: Path, src: Path) -> Path:
    from ckpttool.format import CheckpointReader
    from tests.fixtures.writers import LLAMA_CFG as c

    with CheckpointReader(src) as r:
        w1 = next(m for k, m in r.metadata.entries.items() if k.endswith("layers.0.feed_forward.w1.weight"))
    return _assets(
        tmp,
        {
            "model_type": "llama",
            "hidden_size": c["dim"],
            "num_attention_heads": c["heads"],
            "num_key_value_heads": c["heads"],
            "vocab_size": c["vocab"],
            "num_hidden_layers": c["layers"],
            "intermediate_size": w1.size[0],
            "tie_word_embeddings": False,
        },
    )


def _moe_assets(tmp: Path) -> Path:
    from tests.fixtures.writers import MOE_CFG as c

    return _assets(
        tmp,
        {
            "model_type": "qwen3_moe",
            "hidden_size": c["dim"],
            "num_attention_heads": c["heads"],
            "num_key_value_heads": c["kv_heads"],
            "head_dim": c["head_dim"],
            "num_experts": c["experts"],
            "moe_intermediate_size": c["hidden"],
            "vocab_size": c["vocab"],
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
        },
    )


def _edit(hf: Path, key: str, idx: tuple[int, ...], delta: float = 1.0) -> None:
    """Add ``delta`` to one element of ``key`` in the (one-file) export, in place."""
    f = hf / "model.safetensors"
    sd = load_file(f)
    sd[key][idx] += delta
    save_file(sd, f, metadata={"format": "pt"})


def _titan_row(hf_row: int, heads: int, hd: int) -> int:
    """The torchtitan (interleaved) row HF row ``hf_row`` holds: the inverse of view(n, hd/2, 2).transpose(1, 2)."""
    rows = torch.arange(heads * hd).view(heads, hd // 2, 2).transpose(1, 2).reshape(-1)
    return int(rows[hf_row])


@pytest.mark.slow
def test_torchtitan_llama3_save_equals_its_export_and_names_a_changed_q_row(titan_root: Path, tmp_path: Path) -> None:
    from tests.fixtures.writers import LLAMA_CFG as c

    src = titan_root / "llama3_fresh" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(model_assets=_llama_assets(tmp_path, src)))
    doc = diff_json(src, hf, code=0)
    assert doc["model_adapter"] == "torchtitan-llama3" and doc["naming"] == "export"
    q = "model.layers.1.self_attn.q_proj.weight"
    assert doc["counts"]["compared"] == doc["b"]["tensors"]
    # the q/k values are compared in HF order: a rules-only export (rows as stored) is different
    hd = c["dim"] // c["heads"]
    row, col = 2 * hd + 1, 5  # head 2, first half, pair 1: stored row 2*hd + 2
    _edit(hf, q, (row, col))
    doc = diff_json(src, hf, code=1)
    (d,) = doc["differences"]
    wq = "layers.1.attention.qkv_linear.wq.weight"
    assert d["name"] == q and d["kind"] == "values" and d["index"] == [row, col] and d["mismatched"] == 1
    assert d["stored"]["side"] == "A" and d["stored"]["key"].endswith(wq)
    assert d["stored"]["index"] == [_titan_row(row, c["heads"], hd), col] == [2 * hd + 2, col]
    assert f"A's {d['stored']['key']}[{2 * hd + 2}, {col}]" in d["message"]


def test_torchtitan_hf_save_without_config_names_where_diff_reads_it(titan_root: Path, tmp_path: Path) -> None:
    """torchtitan's own ``last_save_in_hf`` save (no config.json) against the DCP save of the same step: the RoPE
    rows need the head counts. The hint named export's ``model_assets``, an option diff does not have; it names
    where diff reads the config.json, and the pair compares equal once it is there."""
    import shutil

    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    dcp_step = titan_root / "llama3" / "checkpoint" / "step-1"
    hf = shutil.copytree(titan_root / "llama3_hf" / "checkpoint" / "step-1", tmp_path / "hf")
    res = CliRunner().invoke(app, ["diff", str(dcp_step), str(hf)])
    assert res.exit_code == 2 and res.stdout == "", res.output
    err = res.stderr.splitlines()
    assert err[0].startswith("error: [E601] layers.0.attention.qkv_linear.wq.weight: the RoPE row permutation needs")
    assert err[1:] == ["hint: put the model's config.json in the safetensors folder"]
    shutil.copy(_llama_assets(tmp_path, dcp_step) / "config.json", hf / "config.json")
    doc = diff_json(dcp_step, hf, code=0)
    assert doc["model_adapter"] == "torchtitan-llama3" and doc["counts"]["compared"] == doc["b"]["tensors"] == 21


def test_gqa_k_rows_compared_with_kv_heads_and_the_adapter_given(titan_named: Path, tmp_path: Path) -> None:
    src = titan_named / "llama_gqa"
    cfg = json.loads((src / "model_assets" / "config.json").read_text())
    kv, hd = cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert kv < cfg["num_attention_heads"]
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(model_assets=src / "model_assets"))
    k = "model.layers.0.self_attn.k_proj.weight"
    row = (kv - 1) * hd + hd // 2  # last kv head, second half, pair 0
    _edit(hf, k, (row, 0), -0.5)
    doc = diff_json(hf, src, "--adapter", "torchtitan-llama3", code=1)  # HF as A: the stored index is B's
    (d,) = doc["differences"]
    assert d["name"] == k and d["index"] == [row, 0] and d["a_value"] == pytest.approx(d["b_value"] - 0.5)
    assert d["stored"]["side"] == "B" and d["stored"]["index"] == [_titan_row(row, kv, hd), 0] == [(kv - 1) * hd + 1, 0]
    # the identity adapter keeps torchtitan names (the key rules): they miss the HF names
    res = diff_checkpoints(src, hf, DiffOptions(adapter="hf"))
    assert res.model_adapter is None and res.compared < res.b.tensors
    assert {"only_a", "only_b"} <= {x.kind for x in res.differences}
    # between two DCP checkpoints the adapter has no part: torch-native keys, and a note says so
    same = diff_checkpoints(src, src, DiffOptions(adapter="torchtitan-llama3"))
    assert same.equal and same.naming == "torch-native" and any("`adapter`" in n for n in same.notes)


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_torchtitan_qwen3_moe_save_equals_its_export(titan_root: Path, tmp_path: Path, experts: str) -> None:
    from tests.fixtures.writers import MOE_CFG as c

    src = titan_root / "moe" / "checkpoint" / "step-1"
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(model_assets=_moe_assets(tmp_path), experts=experts))
    doc = diff_json(src, hf, "--what", "all", code=0)
    assert doc["model_adapter"] == "torchtitan-qwen3" and doc["counts"]["compared"] == doc["b"]["tensors"]
    assert any("expert_bias" in e["key"] for e in doc["excluded"])
    assert any(n.startswith("optimizer state and param groups not compared (A holds ") for n in doc["notes"])
    j, r, col = c["experts"] - 1, 3, 7
    if experts == "fused":  # the up half of gate_up_proj [E, 2I, H] is w3 [E, I, H]
        key, idx, stored = "model.layers.1.mlp.experts.gate_up_proj", (j, c["hidden"] + r, col), [j, r, col]
    else:
        key, idx, stored = f"model.layers.1.mlp.experts.{j}.up_proj.weight", (r, col), [j, r, col]
    _edit(hf, key, idx)
    doc = diff_json(src, hf, code=1)
    (d,) = doc["differences"]
    assert d["name"] == key and d["index"] == list(idx)
    assert (
        d["stored"]["side"] == "A"
        and d["stored"]["key"].endswith(".w3_EFD")
        and ".layers.1." in "." + d["stored"]["key"]
    )
    assert d["stored"]["index"] == stored


def test_torchtitan_names_without_a_fitting_adapter_are_refused(titan_named: Path, tmp_path: Path) -> None:
    from tests.ops.diff.test_diff import cli

    src = titan_named / "llama_gqa"
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(model_assets=src / "model_assets"))
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    res = cli(src, hf)
    assert res.exit_code == 2 and "E603" in res.stderr and "Traceback" not in res.stderr
    res = cli(src, hf, "--adapter", "nope")
    assert res.exit_code == 2 and "torchtitan-llama3" in res.stderr


# ------------------------------------------------------------------------------------------ --map, --weights master


def test_map_rules_name_an_export_written_with_them(fixture_root: Path, tmp_path: Path) -> None:
    llama = cached_build(fixture_root, "export_llama", hf_models.build_llama)
    rules = tmp_path / "rules.yaml"
    rules.write_text("keys:\n  - {match: '^model\\.model\\.layers\\.(\\d+)\\.mlp\\.(.+)$', to: 'blocks.\\1.ffn.\\2'}\n")
    hf = tmp_path / "hf"
    export_checkpoint(llama, hf, ExportOptions(rules=rules))
    assert any(k.startswith("blocks.0.ffn.") for k in load_file(hf / "model.safetensors"))
    plain = diff_json(llama, hf, code=1)
    assert {d["kind"] for d in plain["differences"]} == {"only_a", "only_b"}
    doc = diff_json(llama, hf, "--map", rules, code=0)
    assert (
        doc["counts"]["compared"]
        == doc["b"]["tensors"]
        == plain["counts"]["compared"] + len([d for d in plain["differences"] if d["kind"] == "only_b"])
    )
    from tests.ops.diff.test_diff import cli

    bad = cli(llama, hf, "--map", tmp_path / "missing.yaml")
    assert bad.exit_code == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_master_weights_against_a_weights_master_export(tmp_path: Path) -> None:
    from ckpttool.ops.sample import SampleOptions, write_sample

    src = tmp_path / "s"
    write_sample(src, SampleOptions(optimizer="master_fp32_adamw"))
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(weights="master"))
    exported = load_file(hf / "model.safetensors")
    masters = [k for k, v in exported.items() if v.dtype == torch.float32]
    assert len(masters) > len(exported) // 2  # buffers without a master stay BF16
    # the parameters are BF16: against the FP32 masters those tensors are dtype differences
    doc = diff_json(src, hf, code=1)
    assert {d["kind"] for d in doc["differences"]} == {"dtype"} and len(doc["differences"]) == len(masters)
    doc = diff_json(src, hf, "--weights", "master", code=0)
    assert doc["counts"]["compared"] == len(exported) and doc["counts"]["raw"] == doc["counts"]["compared"]
    # one master element changed in the export is found
    key = next(k for k in masters if k.endswith(("down_proj.weight", "down_proj")))
    idx = (0,) * exported[key].dim()
    _edit(hf, key, idx, 0.25)
    doc = diff_json(src, hf, "--weights", "master", code=1)
    (d,) = doc["differences"]
    assert d["name"] == key and d["index"] == list(idx) and d["a_key"].endswith(".master_weight")
    # `--weights master` on a checkpoint without masters is refused
    plain = tmp_path / "p"
    write_sample(plain)
    from tests.ops.diff.test_diff import cli

    res = cli(plain, hf, "--weights", "master")
    assert res.exit_code == 2 and "master_weight" in res.stderr


# ------------------------------------------------------------------------------------------ stored index


@pytest.mark.parametrize("experts", ["fused", "per-expert"])
def test_legacy_ep_difference_names_the_stored_expert_row(fixture_root: Path, tmp_path: Path, experts: str) -> None:
    """The compared index is HF's (true expert order); ``stored`` is where A keeps that element, read back here."""
    from ckpttool.format import CheckpointReader
    from ckpttool.layouts.declaration import LayoutDeclaration

    src = cached_build(fixture_root, "export_qwen_moe_legacy", hf_models.build_qwen_moe_legacy)
    decl = LayoutDeclaration("legacy", hf_models.MOE_P, hf_models.MOE_F)
    hf = tmp_path / "hf"
    export_checkpoint(src, hf, ExportOptions(experts=experts), opening=OpenOptions(declaration=decl))
    j = hf_models.MOE_EXPERTS - 2
    names = sorted(load_file(hf / "model.safetensors"))
    key = next(
        n for n in names if n.endswith("experts.gate_up_proj" if experts == "fused" else f"experts.{j}.up_proj.weight")
    )
    idx = (j, 1, 2) if experts == "fused" else (1, 2)
    _edit(hf, key, idx)
    layout = ["--source-layout", "legacy", "--ep-size", hf_models.MOE_P, "--ep-fsdp-size", hf_models.MOE_F]
    doc = diff_json(src, hf, *layout, code=1)
    (d,) = doc["differences"]
    assert d["name"] == key and d["index"] == list(idx) and d["stored"]["side"] == "A"
    with CheckpointReader(src) as r:
        stored = r.read_tensor(d["stored"]["key"])
    assert float(stored[tuple(d["stored"]["index"])]) == d["a_value"]
    assert float(load_file(hf / "model.safetensors")[key][idx]) == d["b_value"]
