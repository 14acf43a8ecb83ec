"""`diff` with a quantized side: block-FP8 exports (ours) and MXFP4 folders, compared dequantized.

References: ``export --quantize fp8-block`` against the BF16 export of the same checkpoint and
against the checkpoint's FP32 masters; an MXFP4 folder against the BF16 values transformers'
``convert_moe_packed_tensors`` gives; a damaged FP8 byte is found and named.
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
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.diff.test_diff import diff_json as _diff
from tests.ops.test_import_quantized import _mxfp4_tensors, _write_folder

runner = CliRunner()


@pytest.fixture(scope="module")
def exports(fixture_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    master = cached_build(fixture_root, "export_master", hf_models.build_master)
    root = tmp_path_factory.mktemp("dq")
    out = {"master": master}
    assets = ["--model-assets", str(master / "model_assets")]  # config.json: the FP8 block size
    ct = ["--quant-format", "compressed-tensors"]
    for name, args in (
        ("fp8", ["--quantize", "fp8-block", "--quantize-block", "16"]),
        ("bf16", []),
        ("ct-block", ["--quantize", "fp8-block", "--quantize-block", "16", *ct]),
        ("ct-channel", ["--quantize", "fp8-channel", *ct]),
    ):
        res = runner.invoke(app, ["export", str(master), str(root / name), *assets, *args])
        assert res.exit_code == 0, res.stderr
        out[name] = root / name
    return out


def _statuses(doc: dict[str, Any]) -> dict[str, str]:
    return {t["name"]: t["status"] for t in doc["tensors"]}


def test_fp8_export_against_bf16_export(exports: dict[str, Path]) -> None:
    doc = _diff(exports["fp8"], exports["bf16"], code=0)
    st = _statuses(doc)
    assert sum(s == "within_tolerance" for s in st.values()) == 14  # the 2-D projections, dequantized
    assert not any(n.endswith("_scale_inv") for n in st)
    q = next(t for t in doc["tensors"] if t["name"] == "model.layers.0.mlp.up_proj.weight")
    assert q["a_dtype"] == "float32" and q["b_dtype"] == "bfloat16" and q["cosine"] > 0.999
    assert st["model.embed_tokens.weight"] == "equal"  # not quantized: bitwise
    assert any("compared dequantized (14 in A" in n for n in doc["notes"])
    # an explicit tolerance overrides the FP8 defaults
    tight = _diff(exports["fp8"], exports["bf16"], "--atol", "0", "--rtol", "1e-6", code=1)
    assert tight["counts"]["different"] == 14


def test_json_says_which_tensors_were_compared_within_the_quantization_step(exports: dict[str, Path]) -> None:
    """``comparison.mode`` said ``bitwise`` (``rtol``/``atol`` null) though 14 FP8 weights were compared at rtol 2^-3:
    the JSON says the mode and, per tensor, the tolerance each comparison used."""
    doc = _diff(exports["fp8"], exports["bf16"], code=0)
    assert doc["comparison"]["mode"] == "quantization" and doc["comparison"]["quantized_tensors"] == 14
    tol = {t["name"]: t.get("tolerance") for t in doc["tensors"]}
    assert tol["model.embed_tokens.weight"] is None  # compared bitwise
    name = "model.layers.0.mlp.up_proj.weight"
    files = exports["fp8"].glob("*.safetensors")
    scale = max(load_file(f).get(name + "_scale_inv", torch.zeros(1)).max().item() for f in files)
    assert tol[name] == {"source": "quantization", "scheme": "fp8-block", "rtol": 0.125, "atol_max": scale * 2.0**-9}
    assert sum(t is not None for t in tol.values()) == 14
    ct = _diff(exports["ct-channel"], exports["bf16"], code=0)
    assert {t["tolerance"]["scheme"] for t in ct["tensors"] if "tolerance" in t} == {"fp8-compressed-tensors"}
    # given (an atol too: an element FP8 flushes to zero is beyond any rtol), or two quantized sides
    for args, mode in ((("--rtol", "0.2", "--atol", "1e-4"), "tolerance"), ((), "bitwise")):
        other = exports["bf16"] if args else exports["fp8"]
        d = _diff(exports["fp8"], other, *args, code=0)
        assert d["comparison"]["mode"] == mode and "quantized_tensors" not in d["comparison"]
        assert not any("tolerance" in t for t in d["tensors"])


def test_fp8_export_against_its_fp32_masters(exports: dict[str, Path]) -> None:
    """The BF16 tensors equal the masters cast (--as-dtype), the FP8 ones are within the FP8 tolerance."""
    doc = _diff(exports["fp8"], exports["master"], "--weights", "master", "--as-dtype", "bfloat16", code=0)
    st = _statuses(doc)
    assert sum(s == "within_tolerance" for s in st.values()) == 14 and st["lm_head.weight"] == "equal"


def test_fp8_against_fp8_is_bitwise_dequantized(exports: dict[str, Path], tmp_path: Path) -> None:
    doc = _diff(exports["fp8"], exports["fp8"], code=0)
    assert set(_statuses(doc).values()) == {"equal"}
    # one FP8 byte changed: the dequantized values differ, named by the weight
    bad = tmp_path / "bad"
    shutil.copytree(exports["fp8"], bad)
    f = next(p for p in sorted(bad.glob("*.safetensors")) if "model.layers.0.mlp.up_proj.weight" in load_file(p))
    t = load_file(f)
    w = t["model.layers.0.mlp.up_proj.weight"].view(torch.uint8).clone()
    w[3, 5] ^= 0x40  # exponent bits: a large change
    t["model.layers.0.mlp.up_proj.weight"] = w.view(torch.float8_e4m3fn)
    save_file(t, str(f), metadata={"format": "pt"})
    for other in (exports["fp8"], exports["bf16"]):
        doc = _diff(bad, other, code=1)
        d = [x for x in doc["differences"] if x["kind"] == "values"]
        assert [x["name"] for x in d] == ["model.layers.0.mlp.up_proj.weight"] and d[0]["index"] == [3, 5], d


@pytest.mark.parametrize("name", ["ct-block", "ct-channel"])
def test_compressed_tensors_export_is_compared_dequantized(exports: dict[str, Path], name: str, tmp_path: Path) -> None:
    # its `weight_scale` did not pair: the e4m3fn codes were compared as values (max abs 448) and
    # every scale was a name only in the export
    doc = _diff(exports[name], exports["bf16"], code=0)
    st = _statuses(doc)
    assert sum(s == "within_tolerance" for s in st.values()) == 14 and not any("_scale" in n for n in st)
    assert not doc["differences"] and any("compared dequantized (14 in A" in n for n in doc["notes"])
    if name == "ct-block":  # the same codes and scales as the fp8 export, under llm-compressor's names
        assert set(_statuses(_diff(exports[name], exports["fp8"], code=0)).values()) == {"equal"}
    bad = tmp_path / "bad"
    shutil.copytree(exports[name], bad)
    f = next(p for p in sorted(bad.glob("*.safetensors")) if "model.layers.0.mlp.up_proj.weight" in load_file(p))
    t = load_file(f)
    w = t["model.layers.0.mlp.up_proj.weight"].view(torch.uint8).clone()
    w[3, 5] ^= 0x40
    t["model.layers.0.mlp.up_proj.weight"] = w.view(torch.float8_e4m3fn)
    save_file(t, str(f), metadata={"format": "pt"})
    d = [x for x in _diff(bad, exports["bf16"], code=1)["differences"] if x["kind"] == "values"]
    assert [x["name"] for x in d] == ["model.layers.0.mlp.up_proj.weight"] and d[0]["index"] == [3, 5], d


def test_mxfp4_against_transformers_values(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    t = _mxfp4_tensors()
    p = "model.layers.0.mlp.experts."
    src = _write_folder(tmp_path / "oss", t, {"model_type": "gpt_oss"})
    ref = dict(t)
    ref[p + "gate_up_proj"] = convert_moe_packed_tensors(
        t.pop(p + "gate_up_proj_blocks"), t.pop(p + "gate_up_proj_scales")
    )
    for k in (p + "gate_up_proj_blocks", p + "gate_up_proj_scales"):
        ref.pop(k)
    deq = _write_folder(tmp_path / "bf16", ref, {"model_type": "gpt_oss"})
    doc = _diff(src, deq, code=0)
    assert _statuses(doc)[p + "gate_up_proj"] in ("equal", "within_tolerance")
    row = next(x for x in doc["tensors"] if x["name"] == p + "gate_up_proj")
    assert row["max_abs"] == 0.0 and row["shape"] == [2, 96, 6]  # bf16 of exact values: equal
    assert row["tolerance"]["scheme"] == "mxfp4" and row["tolerance"]["rtol"] == 0.5
    assert doc["comparison"]["mode"] == "quantization"


@pytest.mark.parametrize("large", [127 + 40, 0xFF])
def test_one_large_mxfp4_group_scale_does_not_widen_the_other_groups(tmp_path: Path, large: int) -> None:
    """The default MXFP4 atol is half each element's *own* group scale: one group with exponent 167 (2^40) made
    the tensor-wide atol 2^39, and one with exponent 0xFF (NaN) 2^127, and a group whose values differ 50x
    compared "within" (exit 0 for the first). Reference values: transformers' ``convert_moe_packed_tensors``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    p = "model.layers.0.mlp.experts.gate_up_proj"
    g = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (2, 6, 3), generator=g, dtype=torch.uint8)
    scales[1, 5, 2] = large  # expert 1, column 5, rows 64..95
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32).contiguous()  # [2, 96, 6]
    if large == 0xFF:
        ref[1, 64:96, 5] = 0.0
    moved = ref[0, 0:32, 0]  # expert 0, column 0, group 0: scale 2^(scales[0, 0, 0] - 127)
    nonzero = int((moved != 0).sum())
    ref[0, 0:32, 0] = moved * 50
    cfg = {"model_type": "gpt_oss"}
    src = _write_folder(tmp_path / "oss", {p + "_blocks": blocks, p + "_scales": scales}, cfg)
    other = _write_folder(tmp_path / "ref", {p: ref}, cfg)
    doc = _diff(src, other, code=1)
    (row,) = doc["tensors"]
    own = 32 if large == 0xFF else 0  # the 0xFF group dequantizes to infinities and NaN against zeros
    assert row["status"] == "differ" and row["mismatched"] == nonzero + own, row


B = 128  # the block of the two FP8 folders below


def _fp8_folders(zero_first_block: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scales, ref)``: a 256 x 256 weight quantized in 128 x 128 blocks (DeepSeek-V3's recipe), and its
    dequantized values with block (1, 1)'s last 56 x 56 values made 50x (far outside any FP8 tolerance)."""
    torch.manual_seed(0)
    w = torch.randn(256, 256)
    q = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(2, 2)
    for i in range(2):
        for j in range(2):
            blk = w[i * B : (i + 1) * B, j * B : (j + 1) * B]
            s[i, j] = blk.abs().max() / 448.0
            q[i * B : (i + 1) * B, j * B : (j + 1) * B] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    if zero_first_block:
        q[:B, :B] = torch.zeros(B, B).to(torch.float8_e4m3fn)
    ref = q.float() * s.repeat_interleave(B, 0).repeat_interleave(B, 1)
    ref[200:, 200:] *= 50
    return q, s, ref


def _write_pair(tmp_path: Path, q: torch.Tensor, scales: torch.Tensor, ref: torch.Tensor) -> None:
    """``tmp_path/q8`` (the FP8 weight and its ``weight_scale_inv``) and ``tmp_path/ref`` (the values), HF folders."""
    key = "model.layers.0.mlp.down_proj.weight"
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for name, tensors, config in (
        ("q8", {key: q, key + "_scale_inv": scales}, {**cfg, "quantization_config": {"weight_block_size": [B, B]}}),
        ("ref", {key: ref}, cfg),
    ):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps(config))


def test_an_infinite_fp8_scale_does_not_make_the_other_blocks_within(tmp_path: Path) -> None:
    """The default atol is a subnormal step times the largest *finite* scale: an infinite one (damaged) made it
    inf, and every finite value of the other blocks compared "within" (only the inf block was counted)."""
    q, s, ref = _fp8_folders()
    damaged = s.clone()
    damaged[0, 0] = float("inf")  # block (0, 0) dequantizes to +-inf / NaN
    _write_pair(tmp_path, q, damaged, ref)
    doc = _diff(tmp_path / "q8", tmp_path / "ref", code=1)
    (row,) = doc["tensors"]
    assert row["status"] == "differ" and row["mismatched"] == B * B + 56 * 56


def test_one_huge_fp8_scale_does_not_widen_the_other_blocks(tmp_path: Path) -> None:
    """The default atol is a subnormal step of each element's *own* block scale: a zero block with a scale
    of 1e38 (its values dequantize to 0, whatever the scale) made the tensor-wide atol 2e35, and a block that
    differs 50x compared "equal" (exit 0)."""
    q, s, ref = _fp8_folders(zero_first_block=True)
    huge = s.clone()
    huge[0, 0] = 1e38  # a zero block: dequantizes to 0
    _write_pair(tmp_path, q, huge, ref)
    moved = ref[200:, 200:]
    within = int((moved.abs() * (1 - 1 / 50) <= 2.0**-9 * float(s[1, 1]) + 2.0**-3 * moved.abs()).sum())
    doc = _diff(tmp_path / "q8", tmp_path / "ref", code=1)
    (row,) = doc["tensors"]
    assert row["status"] == "differ" and row["mismatched"] == 56 * 56 - within, row
    doc = _diff(tmp_path / "ref", tmp_path / "q8", code=1)  # the quantized side as B: the same per-block atol
    assert doc["tensors"][0]["mismatched"] > 0
    # the note states the tolerance used: each block's own scale, not the tensor's largest
    (said,) = [n for n in doc["notes"] if "compared dequantized" in n]
    assert "each element's block scale (FP8)" in said and "the tensor's largest scale," not in said, said


def test_an_infinite_fp8_scale_over_zero_codes_prints_no_numpy_warning(tmp_path: Path) -> None:
    """``inf * 0`` (a zero FP8 code in a block whose scale is infinite) is NaN, as torch's reader gives: the
    command line printed numpy's ``RuntimeWarning: invalid value encountered in multiply`` and the source line."""
    import subprocess
    import sys

    q, s, ref = _fp8_folders()
    q[0, :4] = torch.zeros(4).to(torch.float8_e4m3fn)
    damaged = s.clone()
    damaged[0, 0] = float("inf")
    _write_pair(tmp_path, q, damaged, ref)
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", "diff", str(tmp_path / "q8"), str(tmp_path / "q8")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr and "kernels.py" not in res.stderr, res.stderr


def test_quantized_weights_with_an_empty_dim_compare_without_an_internal_error(tmp_path: Path) -> None:
    """A block-FP8 weight [0, 45] (scales [0, 3]) and MXFP4 blocks [2, 6, 3, 0]: import takes them; diff
    reshaped their (empty) scale grids with -1 and stopped with E999 ValueError."""
    fp8 = {
        "l.weight": torch.zeros(0, 45, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "l.weight_scale_inv": torch.ones(0, 3),
        "l.bias": torch.ones(3),
    }
    a = _write_folder(
        tmp_path / "fp8", fp8, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    )
    doc = _diff(a, a, code=0)
    assert _statuses(doc)["l.weight"] == "equal"
    mx = _mxfp4_tensors()
    p = "model.layers.0.mlp.experts.gate_up_proj"
    mx[p + "_blocks"] = mx[p + "_blocks"][:, :, :, :0].contiguous()
    b = _write_folder(tmp_path / "mx", mx, {"model_type": "gpt_oss"})
    res = runner.invoke(app, ["diff", str(b), str(b), "--json"])
    assert res.exit_code == 0, res.stderr
    assert "E999" not in res.stderr and _statuses(json.loads(res.stdout))[p] == "equal"


def test_empty_mxfp4_tensor_is_not_called_byte_items(tmp_path: Path) -> None:
    """``diff F F`` of an MXFP4 folder whose only tensor is empty (blocks [2, 6, 3, 0]) said "nothing compared ...
    byte items only" (E611): the folder has no byte item. It still refuses a verdict (no value compared), now naming
    the empty tensor and its shape."""
    p = "model.layers.0.mlp.experts.gate_up_proj"
    t = {p + "_blocks": torch.zeros(2, 6, 3, 0, dtype=torch.uint8), p + "_scales": torch.full((2, 6, 3), 127).byte()}
    src = _write_folder(
        tmp_path / "oss", t, {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    )
    res = runner.invoke(app, ["diff", str(src), str(src)])
    assert res.exit_code == 2 and "[E611]" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert "byte item" not in res.stderr, res.stderr
    assert f"1 of them tensors with no element (e.g. '{p}' [2, 0, 6]" in res.stderr, res.stderr
