"""Per-tensor FP8 folders read by `inspect`, `validate --deep`, `diff` and `import`.

Two conventions: vLLM's ``fp8`` (``quant_method: fp8`` without ``weight_block_size``: each 2-D ``x.weight``
``float8_e4m3fn`` with one float32 ``x.weight_scale``, which vLLM's ``Fp8LinearMethod`` multiplies), written by
``safetensors.torch.save_file`` from weights torch quantized itself, the reference being torch's own
``q.to(float32) * scale``; and compressed-tensors' ``strategy: tensor`` (llm-compressor's ``FP8`` preset, the
common FP8 checkpoint on the Hub), written by compressed-tensors' own ``ModelCompressor``, the reference being
its own ``FloatQuantizationCompressor.decompress``. Before, ``inspect`` listed no quantized weights of the
first, ``validate --strict --deep`` passed a NaN scale, ``diff`` against the BF16 weights compared FP8 codes
as a dtype difference, and ``import`` refused the second (E612, "no one block or channel FP8 scheme").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.cli.test_json_schemas import validated

runner = CliRunner()
UP = "model.layers.0.mlp.up_proj"
Q = "model.layers.0.self_attn.q_proj"
CFG = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}


def _write(d: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None) -> Path:
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8t")
    g = torch.Generator().manual_seed(11)
    fp8: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    bf16: dict[str, torch.Tensor] = {}
    for name, (r, c) in {UP: (300, 64), Q: (32, 64)}.items():
        w = torch.randn(r, c, generator=g) * 0.05
        scale = w.abs().max() / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        fp8[f"{name}.weight"], fp8[f"{name}.weight_scale"] = q, scale.reshape(())
        exact[f"{name}.weight"] = q.to(torch.float32) * scale  # vLLM's dequantization, by torch
        bf16[f"{name}.weight"] = w.to(torch.bfloat16)
        for d in (fp8, exact, bf16):
            d[f"{name}.input_scale"] = torch.tensor(0.02)
    for d in (fp8, exact, bf16):
        d["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    return {
        "fp8": _write(root / "fp8", fp8, CFG),
        "exact": _write(root / "exact", exact, {"model_type": "llama"}),
        "bf16": _write(root / "bf16", bf16, {"model_type": "llama"}),
    }


def _json(args: list[str], code: int) -> Any:
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == code, (res.stdout, res.stderr)
    return json.loads(res.stdout)


def test_inspect_lists_the_pairs(folders: dict[str, Path]) -> None:
    q = validated("inspect", ["inspect", str(folders["fp8"]), "--json"])["quantized"]
    assert [(p["kind"], p["weight"], p["scale"]) for p in q["pairs"]] == [
        ("fp8-tensor", f"{UP}.weight", f"{UP}.weight_scale"),
        ("fp8-tensor", f"{Q}.weight", f"{Q}.weight_scale"),
    ]
    assert q["problems"] == []
    res = runner.invoke(app, ["inspect", str(folders["fp8"])], env={"COLUMNS": "200"})
    assert "quantized   2 fp8-tensor weight(s) with scales (one FP8 scale per tensor)" in res.stdout, res.stdout


def test_diff_dequantizes_as_torch_does(folders: dict[str, Path]) -> None:
    doc = _json(["diff", str(folders["fp8"]), str(folders["exact"])], 0)  # bitwise: q.float() * scale
    assert doc["equal"] is True, doc
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows[f"{UP}.weight"]["a_dtype"] == "float32" and rows[f"{UP}.weight"]["status"] == "equal", rows
    assert f"{UP}.weight_scale" not in rows, rows
    doc = _json(["diff", str(folders["fp8"]), str(folders["bf16"])], 0)  # within one e4m3 step of the BF16 source
    assert doc["equal"] is True and any("compared dequantized (2 in A" in n for n in doc["notes"]), doc


def _damaged(folders: dict[str, Path], tmp_path: Path, scale: torch.Tensor) -> Path:
    tensors = load_file(str(folders["fp8"] / "model.safetensors"))
    tensors[f"{UP}.weight_scale"] = scale
    d = _write(tmp_path / "bad", tensors, None)
    shutil.copy(folders["fp8"] / "config.json", d / "config.json")
    return d


@pytest.mark.parametrize(
    ("scale", "code", "want"),
    [
        (torch.tensor(float("nan")), "M021", "1 scale(s) NaN, infinite or negative"),
        (torch.tensor(-1e-3), "M021", "1 scale(s) NaN, infinite or negative"),
        (torch.tensor(0.0), "M021", "1 block(s) have scale 0 but non-zero values"),
        (torch.ones(2), "M020", "float32 [2], but a per-tensor FP8 scale (quant_method fp8) is one float32"),
    ],
)
def test_validate_deep_checks_the_scale(
    folders: dict[str, Path], tmp_path: Path, scale: torch.Tensor, code: str, want: str
) -> None:
    assert _json(["validate", str(folders["fp8"]), "--strict", "--deep"], 0)["findings"] == []
    doc = _json(["validate", str(_damaged(folders, tmp_path, scale)), "--strict", "--deep"], 1)
    got = [(f["code"], f["key"]) for f in doc["findings"] if f["code"].startswith("M02")]
    assert got == [(code, f"{UP}.weight_scale")], doc["findings"]
    assert any(want in f["message"] for f in doc["findings"]), doc["findings"]
    doc = _json(["diff", str(folders["exact"]), str(_damaged(folders, tmp_path / "d", scale))], 1)
    assert doc["equal"] is False, doc


def _compressed_tensors_fp8(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama quantized with llm-compressor's ``FP8`` preset (weights ``strategy: tensor``) and saved compressed
    by compressed-tensors' own ``ModelCompressor``; and the model's unquantized weights."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import LlamaConfig, LlamaForCausalLM

    assert ct.__version__
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    scheme = preset_name_to_scheme("FP8", ["Linear"])
    assert scheme.weights is not None and scheme.weights.strategy == "tensor"
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=["lm_head"],
        format="float-quantized",
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, qc)
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):  # what llm-compressor's min-max observer computes for a static scheme
            w = mod.weight.data
            scale, _ = calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), mod.quantization_scheme.weights)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
            mod.input_scale.data.fill_(0.02)
    mc = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    mc.compress_model(model)
    out = root / "ct"
    model.config.save_pretrained(out)
    mc.update_config(str(out))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out, source


def test_compressed_tensors_per_tensor_preset(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (as .ci/run installs it)")
    import torch.distributed.checkpoint as dcp
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from torch.distributed.checkpoint import FileSystemReader

    src, source = _compressed_tensors_fp8(tmp_path)
    files = load_file(str(src / "model.safetensors"))
    assert files[f"{Q}.weight_scale"].shape == (1,) and files[f"{Q}.weight"].dtype == torch.float8_e4m3fn
    q = validated("inspect", ["inspect", str(src), "--json"])["quantized"]
    assert q["compressed_tensors"] == "tensor" and q["problems"] == [], q
    res = runner.invoke(app, ["inspect", str(src)], env={"COLUMNS": "200"})
    assert "7 fp8-compressed-tensors weight(s) with scales (compressed-tensors one scale per tensor)" in res.stdout
    assert {p["kind"] for p in q["pairs"]} == {"fp8-compressed-tensors"} and len(q["pairs"]) == 7, q
    assert _json(["validate", str(src), "--strict", "--deep"], 0)["findings"] == []
    # import: the values compressed-tensors' own decompression gives, bit for bit
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "dcp"), "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["dequantized"]["kinds"] == {"fp8-compressed-tensors": 7}
    md = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    got = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if k.endswith("proj.weight")}
    dcp.load(got, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    cfg = json.loads((src / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(cfg).config_groups["group_0"]
    for k, v in got.items():
        key = k.removeprefix("model.")
        ref = FloatQuantizationCompressor.decompress(
            {"weight": files[key], "weight_scale": files[key + "_scale"]}, scheme
        )
        assert torch.equal(v.view(torch.int32), ref["weight"].to(torch.float32).view(torch.int32)), k
    assert len(got) == 7
    # diff against the unquantized weights: within one e4m3 step
    ref_dir = _write(tmp_path / "src", {k: v for k, v in source.items() if k != "lm_head.weight"}, None)
    doc = _json(["diff", str(src), str(ref_dir)], 1)  # lm_head only in A
    rows = {t["name"]: t["status"] for t in doc["tensors"]}
    assert rows[f"{Q}.weight"] == "within_tolerance" and sum(s == "within_tolerance" for s in rows.values()) == 7, rows
    # a zero scale over non-zero values is found by validate --deep and refused by import
    files[f"{Q}.weight_scale"] = torch.zeros(1)
    bad = _write(tmp_path / "bad", files, None)
    shutil.copy(src / "config.json", bad / "config.json")
    doc = _json(["validate", str(bad), "--strict", "--deep"], 1)
    assert [(f["code"], f["key"]) for f in doc["findings"]] == [("M021", f"{Q}.weight_scale")], doc["findings"]
    res = runner.invoke(app, ["import", str(bad), str(tmp_path / "x")])
    assert res.exit_code == 2 and f"[E612] {Q}.weight_scale: block (0, 0) has scale 0" in res.stderr, res.stderr
    assert not (tmp_path / "x").exists()
