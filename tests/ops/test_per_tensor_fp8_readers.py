"""`inspect`, `validate --deep` and `diff` of per-tensor FP8 folders (vLLM's ``fp8`` convention).

``quant_method: fp8`` without ``weight_block_size``: each 2-D ``x.weight`` ``float8_e4m3fn`` with one float32
``x.weight_scale`` (vLLM's ``Fp8LinearMethod`` multiplies ``q * scale``), ``x.input_scale`` for the
activations. The folder is written by ``safetensors.torch.save_file`` from weights torch quantized itself;
the reference for the dequantized values is torch's own ``q.to(float32) * scale``. Before, ``inspect`` listed
no quantized weights, ``validate --strict --deep`` passed a NaN scale, and ``diff`` against the BF16 weights
compared FP8 codes as a dtype difference.
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
    q = _json(["inspect", str(folders["fp8"])], 0)["quantized"]
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
