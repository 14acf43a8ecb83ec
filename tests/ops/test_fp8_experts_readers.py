"""`validate --deep` and `diff` of fused FP8 experts (transformers' ``FP8Experts``: ``[E, out, in]`` + 3-D scales).

The checkpoint: a tiny Qwen3-MoE-like state dict saved by torch's ``dcp.save``, exported by
``ckpttool export --quantize fp8-block`` (fused experts ``[E, out, in]`` with ``x_scale_inv``
``[E, ceil(out/B), ceil(in/B)]``, blocks of 8 cutting rows and columns unevenly) beside its BF16
export. References: transformers' ``_dequantize_fp8_weight`` (its block dequantization of
``(..., N, K)`` weights) for the dequantized values ``diff`` compares; hostile copies written by
``safetensors.torch.save_file``: a wrong 3-D scale shape (``M020``), NaN and zero scales
(``M021``), NaN bytes (``M022``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
GU = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"
CODES = ("M020", "M021", "M022", "D001")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8x")
    g = torch.Generator().manual_seed(7)
    sd = {
        GU: torch.randn(4, 12, 20, generator=g).to(torch.bfloat16),
        DOWN: torch.randn(4, 20, 6, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(20, 20, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(20, dtype=torch.bfloat16),
    }
    dcp.save(sd, checkpoint_id=str(root / "ckpt"), no_dist=True)
    assets = root / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 20}))
    out = {"ckpt": root / "ckpt"}
    for name, args in (
        ("fp8", ["--quantize", "fp8-block", "--quantize-block", "8", "--experts", "fused"]),
        ("bf16", []),
    ):
        res = runner.invoke(app, ["export", str(root / "ckpt"), str(root / name), "--model-assets", str(assets), *args])
        assert res.exit_code == 0, res.stderr
        out[name] = root / name
    return out


def _findings(path: Path) -> tuple[int, list[str]]:
    cfg = ["--config", str(path / "config.json"), "--select", "M02,D001"]  # the block size; the rules that read FP8
    res = runner.invoke(app, ["validate", str(path), "--deep", "--json", *cfg])
    assert "Traceback" not in res.stderr, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return res.exit_code, sorted(f"{f['code']} {f['message']}" for f in doc["findings"] if f["code"] in CODES)


def _diff(a: Path, b: Path, code: int) -> dict[str, Any]:
    res = runner.invoke(app, ["diff", str(a), str(b), "--json"])
    assert res.exit_code == code and "Traceback" not in res.stderr, res.stderr + res.stdout
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def _hostile(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(f)
    edit(t)
    save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_export_is_clean_and_diffs_dequantized(folders: dict[str, Path]) -> None:
    """validate --deep finds nothing; diff pairs the fused scales: transformers' dequantized values, within FP8
    tolerance of the BF16 export and of the DCP checkpoint itself."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    assert _findings(folders["fp8"]) == (0, [])
    t = load_file(folders["fp8"] / "model.safetensors")
    assert tuple(t[GU + "_scale_inv"].shape) == (4, 2, 3) and t[GU].dtype == torch.float8_e4m3fn
    for other in (folders["bf16"], folders["ckpt"]):
        doc = _diff(folders["fp8"], other, code=0)
        rows = {r["name"]: r for r in doc["tensors"]}
        assert not any(n.endswith("_scale_inv") for n in rows), sorted(rows)
        for key in (GU, DOWN, "model.layers.0.self_attn.o_proj.weight"):
            assert rows[key]["status"] == "within_tolerance" and rows[key]["a_dtype"] == "float32", rows[key]
        assert any("compared dequantized (3 in A" in n for n in doc["notes"]), doc["notes"]
    # the dequantized values diff compares are transformers' ones: equal to a BF16-free FP32 copy of them
    deq = {k: _dequantize_fp8_weight(t[k], t[k + "_scale_inv"], [8, 8], torch.float32) for k in (GU, DOWN)}
    ref = _hostile(folders["bf16"], folders["fp8"].with_name("deq"), lambda x: x.update(deq))
    doc = _diff(folders["fp8"], ref, code=0)
    rows = {r["name"]: r for r in doc["tensors"]}
    assert rows[GU]["max_abs"] == 0.0 and rows[DOWN]["max_abs"] == 0.0, rows


def _set(key: str, at: tuple[int, ...], value: float) -> Any:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[key] = t[key].clone()
        t[key][at] = value

    return edit


def _nan_byte(t: dict[str, torch.Tensor]) -> None:
    q = t[DOWN].view(torch.uint8).clone()
    q[2, 5, 1] = 0x7F
    t[DOWN] = q.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("name", "edit", "want"),
    [
        ("shape", lambda t: t.update({GU + "_scale_inv": t[GU + "_scale_inv"][:, :1].clone()}), "M020 "),
        ("nan-scale", _set(GU + "_scale_inv", (3, 1, 2), float("nan")), "M021 "),
        ("zero-scale", _set(DOWN + "_scale_inv", (1, 2, 0), 0.0), "M021 "),
        ("nan-bytes", _nan_byte, "M022 "),
    ],
)
def test_hostile_fused_scales(folders: dict[str, Path], tmp_path: Path, name: str, edit: Any, want: str) -> None:
    """Each damage a coded finding naming the tensor (and the expert's block); diff does not call it equal."""
    bad = _hostile(folders["fp8"], tmp_path / name, edit)
    rc, found = _findings(bad)
    mine = [f for f in found if f.startswith(want)]
    assert rc == 1 and len(mine) == 1, found
    where = {
        "shape": "need float32 [4, 2, 3]",
        "nan-scale": "e.g. block (3, 1, 2) = nan",
        "zero-scale": "e.g. block (1, 2, 0)",
        "nan-bytes": f"{DOWN}: 1 of 480",
    }[name]
    assert where in mine[0], mine
    doc = _diff(bad, folders["bf16"], code=1)
    if name == "shape":  # the scale does not pair: compared as stored, the FP8 weight against BF16
        assert any("do not pair up" in n for n in doc["notes"]), doc["notes"]
    else:
        assert GU in {d["name"] for d in doc["differences"]} or DOWN in {d["name"] for d in doc["differences"]}


def test_slab_cuts_give_transformers_values() -> None:
    """The engine's slabs cut rows and experts anywhere: each cut decodes to transformers' dequantized values."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from ckpttool.ops.diff.quantized import fp8_decoder
    from ckpttool.ops.diff.result import Item

    g = torch.Generator().manual_seed(3)
    q = (torch.randn(3, 13, 11, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 4, 3, generator=g) + 0.5
    want = _dequantize_fp8_weight(q, scale, [4, 4], torch.float32).reshape(-1)
    item = Item("w", "w", (3, 13, 11), "float32", "model", dequant=("fp8-experts", "w_scale_inv", (4, 4)))
    decode = fp8_decoder(SimpleNamespace(), item, scale.numpy())  # type: ignore[arg-type]
    raw = q.view(torch.uint8).reshape(-1).numpy()
    for cut in (1, 7, 11, 50, 143, raw.size):
        got = torch.cat([decode(raw[i : i + cut].data, i) for i in range(0, raw.size, cut)])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), cut
