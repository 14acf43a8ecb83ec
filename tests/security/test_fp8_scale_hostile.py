"""Per-tensor FP8 folders damaged as a hostile author would (round 4, class "quantization_config and scales").

Each folder is ``safetensors.torch.save_file`` of weights torch quantized itself (``q = (w / s).to(e4m3fn)``,
one float32 ``x.weight_scale``), under the config vLLM's ``fp8`` convention or llm-compressor's compressed-tensors
``strategy: tensor`` preset carries, then damaged: the config, the scales or the weights. Contract, for
``inspect``, ``validate --strict --deep`` and ``import``: never ``E999`` or a traceback, the damage named by key
(``M020`` / ``E612``), nothing written, the source unchanged; never an FP8 weight imported as its raw codes.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
UP = "model.layers.0.mlp.up_proj"
FP8: dict[str, Any] = {
    "model_type": "llama",
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"},
}
CT: dict[str, Any] = {
    "model_type": "llama",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
            }
        },
    },
}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g) * 0.05
    s = w.abs().max() / 448
    return {
        f"{UP}.weight": (w / s).to(torch.float8_e4m3fn),
        f"{UP}.weight_scale": s.reshape(()),
        "model.norm.weight": torch.ones(32, dtype=torch.bfloat16),
    }


def _folder(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    return d


def _digest(d: Path) -> str:
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(d.iterdir()))).hexdigest()


def _refused(d: Path, tmp_path: Path, key: str, want: str) -> None:
    """inspect names the key as not pairing, validate fails M020 on it, import is E612 on it with nothing written."""
    before = _digest(d)
    doc = json.loads(runner.invoke(app, ["inspect", str(d), "--json"]).stdout)
    assert key in [p["key"] for p in doc["quantized"]["problems"]], doc["quantized"]
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep", "--json"])
    assert res.exit_code == 1 and "Traceback" not in res.stderr, (res.stdout, res.stderr)
    got = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"] if f["code"].startswith("M02")]
    assert ("M020", key) in got, got
    out = tmp_path / "dcp"
    res = runner.invoke(app, ["import", str(d), str(out), "--allow-mismatch", "missing,shape"])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, (res.stdout, res.stderr)
    assert res.stderr.startswith(f"error: [E612] {key}: ") and want in res.stderr, res.stderr
    assert not out.exists() and _digest(d) == before


def _with_qc(base: dict[str, Any], **qc: Any) -> dict[str, Any]:
    c = copy.deepcopy(base)
    c["quantization_config"].update(qc)
    return c


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (_with_qc(FP8, weight_block_size=[128]), "with weight_block_size [128]"),
        (_with_qc(FP8, weight_block_size=[0, 0]), "with weight_block_size [0, 0]"),
        (_with_qc(FP8, weight_block_size=[True, True]), "with weight_block_size [True, True]"),
        (_with_qc(FP8, weight_block_size="128"), "with weight_block_size '128'"),
        (_with_qc(FP8, weight_block_size=[1, 2, 3]), "with weight_block_size [1, 2, 3]"),
        (_with_qc(FP8, quant_method="FP8"), "quant_method is 'FP8'"),
        (_with_qc(FP8, quant_method=["fp8"]), "quant_method is ['fp8']"),
        ({"model_type": "llama", "quantization_config": "fp8"}, "quantization_config is a str, not an object"),
    ],
    ids=["wbs-len1", "wbs-zero", "wbs-bool", "wbs-str", "wbs-len3", "method-upper", "method-list", "qc-str"],
)
def test_per_tensor_scales_under_a_config_no_reader_pairs_are_refused(
    tmp_path: Path, config: dict[str, Any], want: str
) -> None:
    """Before: inspect listed nothing, validate --strict --deep said OK and import wrote the FP8 codes as weights."""
    _refused(_folder(tmp_path, _tensors(), config), tmp_path, f"{UP}.weight_scale", want)


@pytest.mark.parametrize("wbs", [[float("nan"), 1e308], [128], "128x128"], ids=["nan-1e308", "one", "string"])
def test_block_scales_under_an_unreadable_weight_block_size_are_named_by_inspect_too(tmp_path: Path, wbs: Any) -> None:
    """A block-FP8 weight and its ``weight_scale_inv`` under ``weight_block_size`` no quantizer writes: validate
    (M020) and import (E612) refuse the grid, and inspect names the scale as not pairing. Was: inspect listed a
    usable pair on '128x128 blocks', a grid the config does not give, and diff compared it dequantized on that grid
    (equal to the same codes under a config that does give 128x128)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 128, generator=g) * 0.05
    t = {
        f"{UP}.weight": (w / 1e-3).to(torch.float8_e4m3fn),
        f"{UP}.weight_scale_inv": torch.full((2, 1), 1e-3),
        "model.norm.weight": torch.ones(128, dtype=torch.bfloat16),
    }
    d = _folder(tmp_path, t, _with_qc(FP8, weight_block_size=wbs))
    doc = json.loads(runner.invoke(app, ["inspect", str(d), "--json"]).stdout)["quantized"]
    assert doc["pairs"] == [] and doc["block"] is None, doc
    good = tmp_path / "good"
    good.mkdir()
    save_file(t, str(good / "model.safetensors"))
    (good / "config.json").write_text(json.dumps(_with_qc(FP8, weight_block_size=[128, 128])))
    res = runner.invoke(app, ["diff", str(d), str(good), "--json"])
    assert res.exit_code == 1 and "Traceback" not in res.stderr, (res.stdout, res.stderr)
    notes = json.loads(res.stdout)["notes"]
    assert any("do not pair up" in n and "not two positive integers" in n for n in notes), notes
    _refused(d, tmp_path, f"{UP}.weight_scale_inv", "not two positive integers")


def _with_ct_weights(**weights: Any) -> dict[str, Any]:
    c = copy.deepcopy(CT)
    c["quantization_config"]["config_groups"]["group_0"]["weights"] = {"num_bits": 8, "type": "float", **weights}
    return c


@pytest.mark.parametrize(
    "weights",
    [
        {"group_size": [1]},
        {"group_size": {"a": 1}},
        {"strategy": ["tensor"]},
        {"strategy": "block", "block_structure": "9" * 5000 + "x128"},
    ],
    ids=["group_size-list", "group_size-dict", "strategy-list", "block_structure-5000-digits"],
)
def test_compressed_tensors_weight_args_of_wrong_types_are_refused_by_key(
    tmp_path: Path, weights: dict[str, Any]
) -> None:
    """Args compressed-tensors' QuantizationArgs refuses (an unhashable group_size or strategy, a block size of
    more digits than int() reads) are no FP8 scheme: M020/E612 on the scale, not E999."""
    config = _with_ct_weights(**weights)
    _refused(_folder(tmp_path, _tensors(), config), tmp_path, f"{UP}.weight_scale", "give no one block")


@pytest.mark.parametrize("config", [FP8, CT], ids=["fp8", "compressed-tensors"])
@pytest.mark.parametrize("shape", [(), (8,), (2, 3, 4)], ids=["0-d", "1-d", "3-d"])
def test_a_scaled_weight_that_is_not_2d_is_refused(
    tmp_path: Path, config: dict[str, Any], shape: tuple[int, ...]
) -> None:
    """Before: compressed-tensors' 0-d/1-d weight was E999 (not enough values to unpack) in validate and import, its
    3-D one E999 in validate (cannot reshape) and imported; vLLM's were skipped, imported as their raw codes."""
    t = _tensors()
    t["model.layers.0.mlp.z.weight"] = torch.full(shape, 0.5).to(torch.float8_e4m3fn)
    t["model.layers.0.mlp.z.weight_scale"] = torch.tensor([0.25])
    _refused(_folder(tmp_path, t, config), tmp_path, "model.layers.0.mlp.z.weight_scale", f"is {list(shape)}, not 2-D")


@pytest.mark.parametrize("config", [FP8, CT], ids=["fp8", "compressed-tensors"])
def test_an_fp8_weight_of_no_rows_with_its_one_scale(tmp_path: Path, config: dict[str, Any]) -> None:
    """Before: validate --strict --deep was E999 (cannot reshape array of size 1 into shape (0,1)); one scale of an
    empty weight is a grid of one block, as for any weight."""
    t = _tensors()
    t["model.layers.0.mlp.z.weight"] = torch.zeros(0, 32).to(torch.float8_e4m3fn)
    t["model.layers.0.mlp.z.weight_scale"] = torch.tensor(0.25)
    d = _folder(tmp_path, t, config)
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], (res.stdout, res.stderr)
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "dcp"), "--allow-mismatch", "missing,shape"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["diff", str(d), str(tmp_path / "dcp"), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["equal"] is True, (res.stdout, res.stderr)


@pytest.mark.parametrize(
    "text", ['{"quantization_config": {"quant_method": "fp8",', "[1, 2]"], ids=["truncated", "list"]
)
def test_validate_fails_per_tensor_scales_beside_an_unreadable_config(tmp_path: Path, text: str) -> None:
    """Before: validate --strict --deep said OK (the unreadable config.json counted as none, so nothing paired and
    nothing was checked), while inspect and import refused the config (E100)."""
    d = _folder(tmp_path, _tensors(), FP8)
    (d / "config.json").write_text(text)
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep", "--json"])
    assert res.exit_code == 1, (res.stdout, res.stderr)
    found = [(f["code"], f["key"], f["message"]) for f in json.loads(res.stdout)["findings"]]
    assert [(c, k) for c, k, _ in found] == [("M020", f"{UP}.weight_scale"), ("M028", "config.json")], found
    assert "no quantization_config says how: the folder's config.json cannot be read: " in found[0][2], found
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"quantization_config": FP8["quantization_config"]}))
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep", "--config", str(cfg), "--json"])
    codes = [f["code"] for f in json.loads(res.stdout)["findings"]]
    assert "M020" not in codes and "M021" not in codes, codes  # the config given: the pairs read and checked


@pytest.mark.parametrize("config", [FP8, CT], ids=["fp8", "compressed-tensors"])
def test_an_fp8_weight_with_two_scales_is_refused(tmp_path: Path, config: dict[str, Any]) -> None:
    """Before: validate --strict --deep said OK and import dequantized with weight_scale_inv on a 128x128 grid (the
    block FP8 reading), leaving the weight_scale that compressed-tensors and vLLM multiply by as a stray tensor."""
    t = _tensors()
    t[f"{UP}.weight_scale_inv"] = torch.ones(1, 1)
    _refused(_folder(tmp_path, t, config), tmp_path, f"{UP}.weight_scale", "two scales of one FP8 weight")


def test_a_config_symlinked_out_of_the_folder_is_not_read(tmp_path: Path) -> None:
    """Before: import refused it (E101) while inspect, validate and diff read the outside file and took its
    quantization_config (validate --strict --deep said OK); each now says E101 / counts it unreadable."""
    d = _folder(tmp_path, _tensors(), FP8)
    outside = tmp_path / "outside.json"
    (d / "config.json").rename(outside)
    (d / "config.json").symlink_to(outside)
    for args in (["inspect", str(d)], ["diff", str(d), str(d)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and res.stderr.startswith("error: [E101] "), (args, res.stdout, res.stderr)
        assert "'config.json' resolves outside" in res.stderr, res.stderr
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep", "--json"])
    found = [(f["code"], f["key"], f["message"]) for f in json.loads(res.stdout)["findings"]]
    assert res.exit_code == 1 and [(c, k) for c, k, _ in found] == [
        ("M020", f"{UP}.weight_scale"),
        ("M028", "config.json"),
    ], found
    assert "resolves outside" in found[0][2] and "resolves outside" in found[1][2], found


def test_serving_config_drops_a_quantization_config_without_quantized_weights() -> None:
    """A quantized base model's config given as --model-assets: without quantized tensors written (float8, or packed
    integers) its quantization_config goes, whatever the method (vLLM and transformers would read BF16 weights as
    FP8 ones, or as AWQ/bitsandbytes packed ones, and transformers refuses to load without that method's kernels);
    with them it stays; a quantization_config naming no method is left as given."""
    from ckpttool.ops.export.serving import serving_config

    for method in ("fp8", "bitsandbytes", "awq"):
        qc = {"quant_method": method, "weight_block_size": [64, 64]}
        data = json.dumps(
            {"model_type": "llama", "torch_dtype": "bfloat16", "tie_word_embeddings": False, "quantization_config": qc}
        ).encode()
        out, edits = serving_config(
            data, "config.json", dtype="bfloat16", lm_head_written=True, embedding_written=True, quantized_written=False
        )
        assert edits == {"quantization_config": [qc, None]} and "quantization_config" not in json.loads(out)
        kept = serving_config(data, "config.json", dtype="bfloat16", lm_head_written=True, embedding_written=True)
        assert kept == (data, {})
    unnamed = json.dumps({"torch_dtype": "bfloat16", "quantization_config": {"one": "per-tensor"}}).encode()
    edits = serving_config(
        unnamed, "c", dtype="bfloat16", lm_head_written=True, embedding_written=True, quantized_written=False
    )[1]
    assert edits == {"tie_word_embeddings": [None, False]}


def test_an_e5m2_weight_with_a_scale_is_named_by_inspect_and_diff(tmp_path: Path) -> None:
    """Before: validate and import refused it (M020 / E612) while inspect said nothing of quantized weights
    (--json quantized null) and diff compared it as stored without a note (their float8_e4m3fn/uint8 prefilter)."""
    t = {f"{UP}.weight": torch.ones(4, 4).to(torch.float8_e5m2), f"{UP}.weight_scale": torch.tensor(0.5)}
    d = _folder(tmp_path, t, FP8)
    q = json.loads(runner.invoke(app, ["inspect", str(d), "--json"]).stdout)["quantized"]
    assert q is not None and [p["key"] for p in q["problems"]] == [f"{UP}.weight_scale"], q
    res = runner.invoke(app, ["diff", str(d), str(d), "--json"])
    assert any("do not pair up" in n and "float8_e5m2" in n for n in json.loads(res.stdout)["notes"]), res.stdout


def test_import_warns_of_fp8_weights_with_scales_but_no_quantization_config(tmp_path: Path) -> None:
    """Without a quantization_config the FP8 codes are imported as stored (docs/import.md), but before without a
    word: ckpttool's own compressed-tensors export without --model-assets imported to FP8 codes, exit 0, silently."""
    d = _folder(tmp_path, _tensors(), {"model_type": "llama"})
    res = runner.invoke(app, ["import", str(d), str(tmp_path / "dcp"), "--allow-mismatch", "missing,shape", "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["dequantized"] is None
    assert any(w.startswith(f"{UP}.weight: float8 weight(s) beside an x.weight_scale") for w in doc["warnings"]), doc


@pytest.mark.parametrize("config", [None, {"model_type": "llama"}], ids=["no-config", "config-without-qc"])
def test_scaled_fp8_weights_without_a_quantization_config_are_m024(tmp_path: Path, config: Any) -> None:
    """Nothing says how an ``x.weight_scale`` applies without a ``quantization_config``: validate warns (M024, which
    ``--strict`` fails on), naming the scale, instead of an OK over the stored FP8 codes."""
    d = tmp_path / "src"
    d.mkdir()
    save_file(_tensors(), str(d / "model.safetensors"))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    res = runner.invoke(app, ["validate", str(d), "--strict", "--json"])
    assert res.exit_code == 1, (res.stdout, res.stderr)
    found = [f for f in json.loads(res.stdout)["findings"] if f["fails"]]
    assert [(f["code"], f["key"]) for f in found] == [("M024", f"{UP}.weight_scale")], found
    assert "scales a float8 weight, but no quantization_config says how: " in found[0]["message"]
    # under its own quantization_config it is read as the convention says: no M024
    (d / "config.json").write_text(json.dumps(FP8))
    res = runner.invoke(app, ["validate", str(d), "--strict", "--deep", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["findings"] == [], res.stdout
