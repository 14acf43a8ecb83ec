"""`ckpttool import` of quantized HF checkpoints, against the readers that define the values.

- block FP8 (DeepSeek-V3 ``weight_scale_inv``): the folder ``export --quantize fp8-block`` writes,
  and one written by hand with ``safetensors.torch.save_file`` per the convention; our DCP,
  loaded by torch's ``dcp.load``, equals what torch's ``QuantizedHuggingFaceStorageReader``
  (+ ``dcp.load``) produces, bit for bit, in BF16 and FP32;
- MXFP4 (gpt-oss ``_blocks`` / ``_scales``): equals transformers' ``convert_moe_packed_tensors``
  bit for bit (torch 2.13's reader is no reference here: through ``dcp.load`` it fills only part
  of an MXFP4 tensor, its metadata fix-up changing the tensor's size but not its chunk's);
- hostile: wrong scale shapes, NaN / zero scales, a scale for a missing weight, F8_E8M0 scales,
  NaN FP8 bytes, an E8M0 0xFF exponent: E612, nothing published.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.format.test_reader import torch_load_all

runner = CliRunner()


_torch_load = torch_load_all


def _reader_load(
    folder: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    block: int,
    dtypes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """torch's QuantizedHuggingFaceStorageReader + dcp.load into tensors of ``shapes`` (``dtypes[k]``, else ``dtype``)."""
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    sd = {k: torch.empty(s, dtype=(dtypes or {}).get(k, dtype)) for k, s in shapes.items()}
    dcp.load(
        sd,
        storage_reader=QuantizedHuggingFaceStorageReader(str(folder), target_dtype=dtype, block_size=block),
        no_dist=True,
    )
    return sd


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _import(src: Path, out: Path, *args: str, code: int = 0) -> Any:
    # the folders hold a few tensors under a whole model's config (its quantization_config): not the model class
    res = runner.invoke(app, ["import", str(src), str(out), "--json", "--allow-mismatch", "missing,shape", *args])
    assert res.exit_code == code, (res.stdout, res.stderr)
    return json.loads(res.stdout) if code == 0 else res.stderr


def _valid_and_equal_to_import(src: Path, imported: Path) -> None:
    """``validate --deep`` passes the quantized folder ``src`` without M020, and ``diff`` finds its 3 tensors
    (dequantized) equal to the float32 DCP ``imported`` from it."""
    res = runner.invoke(app, ["validate", "--deep", str(src)])
    assert res.exit_code == 0 and "M020" not in res.stdout, res.stdout + res.stderr
    res = runner.invoke(app, ["diff", str(imported), str(src), "--json"])
    assert res.exit_code == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)["summary"]
    assert summary["equal"] == summary["tensors"] == 3 and summary["differ"] == 0


def _write_folder(d: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")})
    )
    (d / "config.json").write_text(json.dumps(config))
    return d


def _deepseek_tensors(block: int) -> dict[str, torch.Tensor]:
    """Block-FP8 weights (random e4m3fn bytes, no NaN) with uneven edges, a zero block with scale 0, a BF16 norm."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for name, (r, c) in {"model.layers.0.mlp.up_proj": (70, 45), "model.layers.0.self_attn.q_proj": (32, 64)}.items():
        q = torch.randint(0, 256, (r, c), generator=g, dtype=torch.uint8)
        q[(q & 0x7F) == 0x7F] = 0x10
        nr, nc = -(-r // block), -(-c // block)
        scale = torch.rand(nr, nc, generator=g) * 1e-2 + 1e-4
        q[:block, :block] = 0  # block (0, 0): all zero, scale 0 (some quantizers write 0 there)
        scale[0, 0] = 0.0
        out[f"{name}.weight"] = q.view(torch.float8_e4m3fn)
        out[f"{name}.weight_scale_inv"] = scale
    out["model.norm.weight"] = torch.randn(45, generator=g).to(torch.bfloat16)
    return out


_DS_CONFIG = {
    "model_type": "deepseek_v3",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]},
}


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_folder(tmp_path_factory.mktemp("ds") / "fp8", _deepseek_tensors(16), _DS_CONFIG)


def _check_against_reader(src: Path, out: Path, dtype: torch.dtype, block: int) -> int:
    ours = _torch_load(out)
    shapes = {k.removeprefix("model."): tuple(v.shape) for k, v in ours.items()}
    ref = _reader_load(src, shapes, dtype, block, {k.removeprefix("model."): v.dtype for k, v in ours.items()})
    n = 0
    for k, v in ref.items():
        got = ours["model." + k]
        if k.endswith("_scale_inv"):
            raise AssertionError(f"scale {k} imported as a weight")
        if got.dtype == dtype and k.endswith(".weight") and got.dim() == 2 and "norm" not in k:
            n += 1
        assert got.dtype == v.dtype and torch.equal(_bits(got), _bits(v)), k
    return n


@pytest.mark.parametrize(("dtype", "ranks"), [("bfloat16", "1"), ("float32", "2")])
def test_deepseek_convention_equals_torch_reader(deepseek_dir: Path, tmp_path: Path, dtype: str, ranks: str) -> None:
    """2 ranks: each rank file holds its rows of the dequantized weights (Shard(0) chunks of the staged tensor)."""
    r = _import(deepseek_dir, tmp_path / "dcp", "--dtype", dtype, "--world-size", ranks)
    assert len(r["files"]) == int(ranks) + 1  # rank files and .metadata
    assert r["dequantized"] == {
        "dtype": dtype,
        "kinds": {"fp8-block": 2},
        "tensors": ["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"],
    }
    assert r["tensors"] == 3
    assert _check_against_reader(deepseek_dir, tmp_path / "dcp", getattr(torch, dtype), 16) == 2
    ours = _torch_load(tmp_path / "dcp")
    assert ours["model.model.norm.weight"].dtype == torch.bfloat16  # not quantized: as stored
    assert not any(k.endswith("_scale_inv") for k in ours)


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
def test_block_scales_stored_bf16_equal_torch_reader(tmp_path: Path, scale_dtype: str) -> None:
    """``weight_scale_inv`` stored BF16 / FP16 (not DeepSeek's float32): torch's reader multiplies the float32 weight
    by them (each a float32 value); import refused the folder (E612 "scales are bfloat16, not float32") and
    validate --deep called it M020. Now import equals the reader bit for bit in BF16 and FP32 (2 ranks), validate
    --deep finds nothing, and diff of folder and FP32 import finds every tensor equal."""
    t = _deepseek_tensors(16)
    for k in [k for k in t if k.endswith("_scale_inv")]:
        t[k] = t[k].to(getattr(torch, scale_dtype))
    src = _write_folder(tmp_path / "fp8", t, _DS_CONFIG)
    for dtype, ranks in (("bfloat16", "1"), ("float32", "2")):
        r = _import(src, tmp_path / dtype, "--dtype", dtype, "--world-size", ranks)
        assert r["dequantized"]["kinds"] == {"fp8-block": 2}
        assert _check_against_reader(src, tmp_path / dtype, getattr(torch, dtype), 16) == 2
    _valid_and_equal_to_import(src, tmp_path / "float32")


@pytest.fixture(scope="module")
def fp8_export(fixture_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    master = cached_build(fixture_root, "export_master", hf_models.build_master)
    out = tmp_path_factory.mktemp("exp") / "fp8"
    res = runner.invoke(
        app,
        ["export", str(master), str(out), "--quantize", "fp8-block", "--quantize-block", "16"]
        + ["--model-assets", str(master / "model_assets")],
    )
    assert res.exit_code == 0, res.stderr
    return master, out


def test_own_fp8_export_round_trip(fp8_export: tuple[Path, Path], tmp_path: Path) -> None:
    """import of our export == torch's reader of it (FP32), and within the export's bound of the FP32 masters."""
    from ckpttool.ops.export.quantize import MAX_BLOCK_REL_ERROR

    master, exported = fp8_export
    r = _import(exported, tmp_path / "dcp", "--dtype", "float32")
    assert r["dequantized"]["kinds"]["fp8-block"] >= 4
    assert _check_against_reader(exported, tmp_path / "dcp", torch.float32, 16) >= 4
    ours = _torch_load(tmp_path / "dcp")
    src = _torch_load(master)
    for name in r["dequantized"]["tensors"]:
        m = src["optimizer.state." + name + ".master_weight"]
        assert (ours["model." + name] - m).abs().max() <= MAX_BLOCK_REL_ERROR * m.abs().max(), name


def _mxfp4_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    p = "model.layers.0.mlp.experts."
    return {
        p + "gate_up_proj_blocks": torch.randint(0, 256, (2, 6, 3, 16), generator=g, dtype=torch.uint8),
        p + "gate_up_proj_scales": torch.randint(110, 135, (2, 6, 3), generator=g, dtype=torch.uint8),
        p + "gate_up_proj_bias": torch.randn(2, 6, generator=g),
        "model.norm.weight": torch.randn(96, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp4_equals_transformers(tmp_path: Path, dtype: str) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    t = _mxfp4_tensors()
    src = _write_folder(
        tmp_path / "oss", t, {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    )
    r = _import(src, tmp_path / "dcp", "--dtype", dtype)
    assert r["dequantized"]["kinds"] == {"mxfp4": 1}
    ours = _torch_load(tmp_path / "dcp")
    p = "model.layers.0.mlp.experts."
    tdt = getattr(torch, dtype)
    ref = convert_moe_packed_tensors(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"], dtype=tdt)
    got = ours["model." + p + "gate_up_proj"]
    assert got.shape == ref.shape == (2, 96, 6) and got.dtype == tdt
    assert torch.equal(_bits(got), _bits(ref))
    assert set(ours) == {"model." + p + "gate_up_proj", "model." + p + "gate_up_proj_bias", "model.model.norm.weight"}


def _hostile(name: str) -> tuple[dict[str, torch.Tensor], str]:
    t = _deepseek_tensors(16)
    w = "model.layers.0.mlp.up_proj.weight"
    s = w + "_scale_inv"
    if name == "shape":
        t[s] = t[s][:, :2].contiguous()
        return t, "in 16x16 blocks needs [5, 3]"
    if name == "nan-scale":
        t[s][1, 1] = float("nan")
        return t, "NaN, infinite or negative"
    if name == "zero-scale":
        t[s][1, 1] = 0.0
        return t, "has scale 0 but non-zero values"
    if name == "missing-weight":
        del t[w]
        return t, "a block scale for a missing weight"
    if name == "e8m0":
        t[s] = torch.full(t[s].shape, 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return t, "scales are float8_e8m0fnu, not float32"
    if name == "nan-bytes":
        t[w] = t[w].view(torch.uint8).clone()
        t[w][20, 3] = 0xFF
        t[w] = t[w].view(torch.float8_e4m3fn)
        return t, "NaN byte"
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["shape", "nan-scale", "zero-scale", "missing-weight", "e8m0", "nan-bytes"])
def test_hostile_fp8_refused(tmp_path: Path, name: str) -> None:
    t, why = _hostile(name)
    src = _write_folder(tmp_path / "src", t, _DS_CONFIG)
    before = sorted(p.name for p in tmp_path.iterdir())
    err = _import(src, tmp_path / "dcp", code=2)
    assert "[E612]" in err and why in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing published, no leftovers


def test_hostile_mxfp4_nan_exponent(tmp_path: Path) -> None:
    t = _mxfp4_tensors()
    t["model.layers.0.mlp.experts.gate_up_proj_scales"][1, 2, 0] = 0xFF
    src = _write_folder(tmp_path / "src", t, {"model_type": "gpt_oss"})
    err = _import(src, tmp_path / "dcp", code=2)
    assert "[E612]" in err and "0xFF (NaN)" in err, err
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("wbs", [[24.0, 24.0], [0, 0], [-1, 16], "16", [16], [True, True]])
def test_unreadable_block_size_refused_not_replaced_by_the_default(tmp_path: Path, wbs: Any) -> None:
    """A weight_block_size given but not two positive ints is E612: the default 128x128 grid would dequantize
    a 48-row weight quantized in 24x24 blocks (scales [2, 2] either way for [48, 48]) to other values."""
    t = {"l.weight": torch.randint(0, 0x7E, (48, 48), dtype=torch.uint8).view(torch.float8_e4m3fn)}
    t["l.weight_scale_inv"] = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    src = _write_folder(tmp_path / "src", t, {"quantization_config": {"weight_block_size": wbs}})
    err = _import(src, tmp_path / "dcp", code=2)
    assert "[E612]" in err and "weight_block_size" in err and "not two positive integers" in err, err
    assert not (tmp_path / "dcp").exists()


def test_huge_block_size_is_one_block_not_an_allocation(tmp_path: Path) -> None:
    """weight_block_size [2**40, 2**40]: one block covers the weight (scale [1, 1]); the dequantization repeats
    that scale once per column (it allocated 2**40 floats: E999 MemoryError), in import and in diff."""
    q = torch.randint(0, 0x7E, (8, 8), dtype=torch.uint8).view(torch.float8_e4m3fn)
    t = {"l.weight": q, "l.weight_scale_inv": torch.tensor([[0.5]])}
    src = _write_folder(tmp_path / "src", t, {"quantization_config": {"weight_block_size": [2**40, 2**40]}})
    _import(src, tmp_path / "dcp", "--dtype", "float32")
    assert torch.equal(_torch_load(tmp_path / "dcp")["model.l.weight"], q.float() * 0.5)
    res = runner.invoke(app, ["diff", str(src), str(src)])
    assert res.exit_code == 0, res.stderr


def test_mxfp4_dequantized_name_also_stored_refused(tmp_path: Path) -> None:
    """``x_blocks``/``x_scales`` beside a stored ``x``: one of the two was dropped silently; now E612 naming both."""
    t = _mxfp4_tensors()
    t["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(3)
    src = _write_folder(tmp_path / "src", t, {"model_type": "gpt_oss"})
    err = _import(src, tmp_path / "dcp", code=2)
    assert "[E612]" in err and "dequantize to 'model.layers.0.mlp.experts.gate_up_proj', also stored" in err, err
    assert not (tmp_path / "dcp").exists()


def test_unscaled_float8_and_uint16_tensors_are_imported_as_stored(tmp_path: Path) -> None:
    """float8 tensors no scale convention claims (1-D, fused experts without ``_scale_inv``, e5m2, a per-tensor
    ``weight_scale``) and uint16 are copied as stored, in torch.save's v3 encoding: dcp.load gives the bits."""
    g = torch.Generator().manual_seed(3)
    t = {
        "model.layers.0.mlp.experts.down_proj": torch.randint(0, 0x7E, (2, 4, 4), generator=g, dtype=torch.uint8),
        "model.layers.0.bias8": torch.randint(0, 0x7E, (6,), generator=g, dtype=torch.uint8),
        "model.layers.0.q.weight": torch.randint(0, 0x7E, (4, 8), generator=g, dtype=torch.uint8),
    }
    tensors = {k: v.view(torch.float8_e4m3fn) for k, v in t.items()}
    tensors["model.layers.0.k.weight"] = t["model.layers.0.q.weight"].clone().view(torch.float8_e5m2)
    tensors["model.layers.0.q.weight_scale"] = torch.ones(1)
    tensors["model.ids"] = torch.arange(5, dtype=torch.int32).to(torch.uint16)
    src = _write_folder(tmp_path / "src", tensors, {"model_type": "llama"})
    r = _import(src, tmp_path / "dcp")
    assert r["dequantized"] is None
    sd = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in tensors.items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for k, v in tensors.items():
        assert sd["model"][k].dtype == v.dtype and torch.equal(_bits(sd["model"][k]), _bits(v)), k


def test_dtype_without_quantized_weights_warns(tmp_path: Path) -> None:
    src = _write_folder(tmp_path / "src", {"model.norm.weight": torch.ones(4)}, {"model_type": "llama"})
    r = _import(src, tmp_path / "dcp", "--dtype", "float32")
    assert r["dequantized"] is None and any("applies to quantized weights" in w for w in r["warnings"])
    assert _torch_load(tmp_path / "dcp")["model.model.norm.weight"].dtype == torch.float32


def test_own_fp8_export_to_torchtitan(fp8_export: tuple[Path, Path], tmp_path: Path) -> None:
    """--schema torchtitan: the adapter permutes the dequantized q/k rows; `diff` against the FP8 folder (the
    adapter undone, the FP8 side dequantized) finds every value equal, bitwise."""
    _, exported = fp8_export
    _import(exported, tmp_path / "tt", "--schema", "torchtitan", "--dtype", "float32")
    res = runner.invoke(app, ["diff", str(tmp_path / "tt"), str(exported), "--json"])
    assert res.exit_code == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["summary"]["within_tolerance"] == 0 and doc["summary"]["equal"] == doc["summary"]["tensors"] == 21


def test_fused_experts_named_weight_pair_with_their_3d_scale() -> None:
    """Fused experts stored as ``x.weight`` ``[E, out, in]`` (what export writes for an ``experts`` tensor named
    ``.weight``, e.g. Megatron's ``linear_fc1.weight``) with a 3-D ``x.weight_scale_inv`` are the fused pair, not a
    2-D problem; a 3-D scale of the wrong shape is still E612."""
    from types import SimpleNamespace

    from ckpttool.errors import QuantizedSourceError
    from ckpttool.ops.import_quant import plan_dequantize

    def src(dtype: str, shape: tuple[int, ...]) -> SimpleNamespace:
        return SimpleNamespace(file="model.safetensors", offset=0, dtype=dtype, shape=shape)

    key = "m.experts.linear_fc1.weight"
    sources = {key: src("float8_e4m3fn", (2, 256, 256)), key + "_scale_inv": src("float32", (2, 2, 2))}
    plans, consumed = plan_dequantize(sources, None, "bfloat16")
    assert plans[key].pair.kind == "fp8-experts" and key + "_scale_inv" in consumed
    sources[key + "_scale_inv"] = src("float32", (2, 2, 3))
    with pytest.raises(QuantizedSourceError, match="fused experts"):
        plan_dequantize(sources, None, "bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_fp8_experts_equal_transformers_load_time_dequantization(tmp_path: Path, dtype: str) -> None:
    """Fused block-FP8 experts import as transformers' load-time ``Fp8Dequantize`` (``dequantize=True``) gives them:
    ``float32(q) * scale`` rounded once to ``dtype``; its backward helper ``_dequantize_fp8_weight`` with a BF16
    dtype rounds the scale to BF16 first (an ulp off in many elements), so it is the reference in float32 only."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    g = torch.Generator().manual_seed(5)
    p = "model.layers.0.mlp.experts."
    t: dict[str, torch.Tensor] = {}
    for name, (r, c) in {"gate_up_proj": (32, 48), "down_proj": (48, 16)}.items():
        q = torch.randint(0, 256, (3, r, c), generator=g, dtype=torch.uint8)
        q[(q & 0x7F) == 0x7F] = 0x7E
        t[p + name] = q.view(torch.float8_e4m3fn)
        t[p + name + "_scale_inv"] = torch.rand(3, r // 16, c // 16, generator=g) * 1e-2 + 1e-4
    src = _write_folder(
        tmp_path / "fp8x",
        t,
        {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}},
    )
    r = _import(src, tmp_path / "dcp", "--dtype", dtype)
    assert r["dequantized"]["kinds"] == {"fp8-experts": 2}
    ours = _torch_load(tmp_path / "dcp")
    tdt = getattr(torch, dtype)
    for name in ("gate_up_proj", "down_proj"):
        q, s = t[p + name], t[p + name + "_scale_inv"]
        want = Fp8Dequantize(None)._dequantize_one(q, s, tdt)
        got = ours["model." + p + name]
        assert got.dtype == tdt and torch.equal(_bits(got), _bits(want)), name
        backward = _dequantize_fp8_weight(q.clone(), s.clone(), [16, 16], torch.float32).to(tdt)
        assert torch.equal(_bits(got), _bits(backward)), name


@pytest.mark.parametrize(
    ("case", "dtype"),
    [("fp8-f32", "float32"), ("fp8-bf16", "bfloat16"), ("fp8-bf16-only", "bfloat16"), ("mxfp4", "bfloat16")],
)
def test_finite_pieces_whose_product_overflows_refused(tmp_path: Path, case: str, dtype: str) -> None:
    """Finite scales whose product with the values is beyond ``--dtype`` (a scale of 3e38, an E8M0 exponent 254,
    float32 values near 3.4e38 that round to a BF16 infinity) were imported as infinite weights, exit 0;
    now E612 naming the weight, nothing published."""
    q = torch.full((32, 32), 0x7E, dtype=torch.uint8)  # 448, the largest e4m3fn value
    if case == "mxfp4":
        t = {
            "e.gate_up_proj_blocks": torch.full((1, 2, 1, 16), 0x77, dtype=torch.uint8),  # FP4 6.0
            "e.gate_up_proj_scales": torch.full((1, 2, 1), 254, dtype=torch.uint8),  # 2^127
        }
        key, config = "e.gate_up_proj_blocks", {"model_type": "gpt_oss"}
    else:
        # fp8-bf16-only: 448 * (3.4e38 / 448) is finite in float32 and rounds to infinity in BF16
        scale = 3.4e38 / 448 if case == "fp8-bf16-only" else 3e38
        t = {"l.weight": q.view(torch.float8_e4m3fn), "l.weight_scale_inv": torch.full((2, 2), scale)}
        key, config = "l.weight", _DS_CONFIG
    src = _write_folder(tmp_path / "src", t, config)
    err = _import(src, tmp_path / "dcp", "--dtype", dtype, code=2)
    assert f"[E612] {key}:" in err and f"beyond the {dtype} range (infinity)" in err, err
    assert "Traceback" not in err and "RuntimeWarning" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing published, no leftovers
    if case == "fp8-bf16-only":  # the same folder is finite in float32: imported, values as torch's reader
        _import(src, tmp_path / "f32", "--dtype", "float32")
        got = _torch_load(tmp_path / "f32")["model.l.weight"]
        assert torch.equal(got, q.view(torch.float8_e4m3fn).float() * torch.tensor(3.4e38 / 448))
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("method", ["fp8-block", "fp8-channel"])
def test_compressed_tensors_export_imports_dequantized(fixture_root: Path, tmp_path: Path, method: str) -> None:
    """``export --quant-format compressed-tensors`` then ``import``: the FP8 weights were imported as their raw
    float8 bytes beside ``weight_scale`` tensors (dcp.load into a BF16 model copies them unscaled) with exit 0,
    and ``--dtype`` warned that the checkpoint had no quantized weights. Now they are dequantized,
    ``float32(q) * weight_scale`` bit for bit, and (block) equal to the import of the ``--quant-format fp8`` export."""
    from safetensors import safe_open

    master = cached_build(fixture_root, "export_master", hf_models.build_master)
    base = ["export", str(master), "--quantize", method, *(["--quantize-block", "16"] if method == "fp8-block" else [])]
    base += ["--model-assets", str(master / "model_assets")]
    res = runner.invoke(app, [*base[:2], str(tmp_path / "ct"), *base[2:], "--quant-format", "compressed-tensors"])
    assert res.exit_code == 0, res.stderr
    r = _import(tmp_path / "ct", tmp_path / "dcp", "--dtype", "float32")
    assert r["dequantized"]["kinds"] == {"fp8-compressed-tensors": 14}
    assert not any("applies to quantized weights" in w for w in r["warnings"])
    ours = _torch_load(tmp_path / "dcp")
    assert not any(k.endswith("_scale") for k in ours)
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        for name in r["dequantized"]["tensors"]:
            q, s = f.get_tensor(name).float(), f.get_tensor(name + "_scale")
            if method == "fp8-block":
                s = s.repeat_interleave(16, 0)[: q.shape[0]].repeat_interleave(16, 1)[:, : q.shape[1]]
            got = ours["model." + name]
            assert got.dtype == torch.float32 and torch.equal(_bits(got), _bits(q * s)), name
    if method == "fp8-block":
        res = runner.invoke(app, [*base[:2], str(tmp_path / "fp8"), *base[2:]])
        assert res.exit_code == 0, res.stderr
        _import(tmp_path / "fp8", tmp_path / "dcp8", "--dtype", "float32")
        ref = _torch_load(tmp_path / "dcp8")
        assert set(ref) == set(ours) and all(torch.equal(_bits(ours[k]), _bits(ref[k])) for k in ref)


def _llm_compressor_folder(d: Path, method: str, dtype: torch.dtype) -> tuple[Path, dict[str, torch.Tensor]]:
    """A compressed-tensors FP8 folder as llm-compressor writes one for a ``dtype`` model: scales from
    compressed-tensors' ``calculate_qparams`` (in the weight's dtype: BF16 / FP16 scales), weights from its
    ``FloatQuantizationCompressor.compress``; uneven ``[40, 24]`` and ``[24, 40]`` weights (16x16 blocks)."""
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from tests.ops.export.test_export_quant_ct import _ct_reference_config

    scheme = preset_name_to_scheme("FP8_BLOCK" if method == "fp8-block" else "FP8_DYNAMIC", ["Linear"])
    if method == "fp8-block":
        scheme.weights.block_structure = [16, 16]
    g = torch.Generator().manual_seed(11)
    t: dict[str, torch.Tensor] = {"model.norm.weight": torch.randn(24, generator=g).to(dtype)}
    for name, shape in {"model.layers.0.mlp.down_proj": (40, 24), "model.layers.0.mlp.up_proj": (24, 40)}.items():
        w = torch.randn(*shape, generator=g).to(dtype)
        if method == "fp8-block":  # per 16x16 block, the weight zero-padded to whole blocks (as compress pads it)
            r, c = -(-shape[0] // 16), -(-shape[1] // 16)
            pad = torch.zeros(r * 16, c * 16, dtype=dtype)
            pad[: shape[0], : shape[1]] = w
            blocks = pad.reshape(r, 16, c, 16)
            lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        else:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        zero = torch.zeros((), dtype=dtype)
        scale, _ = calculate_qparams(torch.minimum(lo, zero), torch.maximum(hi, zero), scheme.weights)
        assert scale.dtype == dtype
        q = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)["weight"]
        t[name + ".weight"], t[name + ".weight_scale"] = (
            q.contiguous(),
            scale.contiguous(),
        )  # compress slices padding off
    config = {"model_type": "llama", "quantization_config": _ct_reference_config(method, 16, ["lm_head"])}
    return _write_folder(d, t, config), t


@pytest.mark.parametrize(
    ("method", "dtype"), [("fp8-block", "bfloat16"), ("fp8-channel", "bfloat16"), ("fp8-channel", "float16")]
)
def test_compressed_tensors_scales_in_the_models_dtype_import_as_its_decompression(
    tmp_path: Path, method: str, dtype: str
) -> None:
    """llm-compressor stores a BF16 (FP16) model's ``weight_scale`` in BF16 (FP16): its scales are computed in the
    weight's dtype. import refused such a folder (E612 "bfloat16 [40, 1] ... needs float32") and validate --deep
    called it M020. Now ``--dtype float32`` gives ``float32(q) * float32(scale)`` (exact; transformers' load-time
    ``CompressedTensorsDequantize``), which rounded once to the scale's dtype is compressed-tensors' own decompression
    bit for bit, and ``--dtype bfloat16`` that product rounded once; validate --deep finds nothing; diff of folder
    and import: bitwise equal. A NaN among such scales is still E612 / M021."""
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src, t = _llm_compressor_folder(tmp_path / "ct", method, getattr(torch, dtype))
    scheme = QuantizationConfig.model_validate(json.loads((src / "config.json").read_text())["quantization_config"])
    scheme_0 = scheme.config_groups["group_0"]
    r = _import(src, tmp_path / "bf16", "--dtype", "bfloat16")
    assert r["dequantized"]["kinds"] == {"fp8-compressed-tensors": 2}
    _import(src, tmp_path / "f32", "--dtype", "float32")
    bf16, f32 = _torch_load(tmp_path / "bf16"), _torch_load(tmp_path / "f32")
    for name in r["dequantized"]["tensors"]:
        q, s = t[name], t[name + "_scale"]
        ref = FloatQuantizationCompressor.decompress({"weight": q, "weight_scale": s}, scheme_0)["weight"]
        assert ref.dtype == s.dtype  # compressed-tensors multiplies in the scale's dtype, rounding once
        full = s.float()
        if method == "fp8-block":
            full = full.repeat_interleave(16, 0)[: q.shape[0]].repeat_interleave(16, 1)[:, : q.shape[1]]
        got = f32["model." + name]
        assert torch.equal(_bits(got), _bits(q.float() * full)), name  # exact: no product of these rounds in float32
        assert torch.equal(_bits(got.to(ref.dtype)), _bits(ref)), name
        assert torch.equal(_bits(bf16["model." + name]), _bits(got.to(torch.bfloat16))), name
    _valid_and_equal_to_import(src, tmp_path / "f32")
    t["model.layers.0.mlp.up_proj.weight_scale"][1, 0] = float("nan")
    bad = _write_folder(tmp_path / "bad", t, json.loads((src / "config.json").read_text()))
    err = _import(bad, tmp_path / "nan", code=2)
    assert (
        "[E612] model.layers.0.mlp.up_proj.weight_scale: 1 scale(s) are NaN" in err and not (tmp_path / "nan").exists()
    )
    res = runner.invoke(app, ["validate", "--deep", str(bad)])
    assert res.exit_code == 1 and "M021" in res.stdout, res.stdout + res.stderr


def test_compressed_tensors_weights_it_cannot_dequantize_are_refused(tmp_path: Path) -> None:
    """A compressed-tensors FP8 weight whose scale does not fit the config's scheme, or of a format other than
    float-quantized: E612, never the raw FP8 bytes imported as the weight."""
    q = torch.randint(0, 0x70, (32, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [16, 16]}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": {"weights": scheme}},
    }
    t = {"l.weight": q, "l.weight_scale": torch.ones(2, 3)}
    src = _write_folder(tmp_path / "src", t, {"quantization_config": qc})
    err = _import(src, tmp_path / "dcp", code=2)
    assert (
        "[E612] l.weight_scale: float32 [2, 3], but weight [32, 32] with the config's 16x16 block scheme needs" in err
    )
    src = _write_folder(
        tmp_path / "src2",
        {"l.weight": q, "l.weight_scale": torch.ones(2, 2)},
        {"quantization_config": {**qc, "format": "naive-quantized"}},
    )
    err = _import(src, tmp_path / "dcp", code=2)
    assert (
        "[E612] l.weight_scale: config.json quantization_config is compressed-tensors format 'naive-quantized'" in err
    )
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize(
    "qc",
    [
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {}}}},
        {"quant_method": "fp8"},  # vLLM's per-tensor FP8
        {"quant_method": "fp8", "weight_block_size": [16, 16]},  # block FP8
    ],
)
def test_a_float8_weight_without_its_scale_names_the_scale_its_config_expects(tmp_path: Path, qc: Any) -> None:
    """A float8 weight with no scale under a compressed-tensors or per-tensor ``fp8`` config (whose weights are
    scaled by ``x.weight_scale``) was refused as lacking a block-FP8 ``x.weight_scale_inv``, a tensor those
    conventions never store; the error names ``x.weight_scale`` there (``weight_scale_inv`` under block FP8)."""
    q = torch.randint(0, 0x70, (32, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    src = _write_folder(tmp_path / "src", {"l.weight": q, "n.weight": torch.ones(32)}, {"quantization_config": qc})
    err = _import(src, tmp_path / "dcp", code=2)
    want = "l.weight_scale_inv" if "weight_block_size" in qc else "l.weight_scale"
    assert f"[E612] l.weight: a float8_e4m3fn weight with no '{want}'" in err, err
    assert not (tmp_path / "dcp").exists()


def test_per_tensor_fp8_of_vllms_fp8_convention_is_dequantized(tmp_path: Path) -> None:
    """A per-tensor FP8 folder (``quant_method: fp8`` without ``weight_block_size``: one float32 ``x.weight_scale`` a
    weight, ``x.input_scale`` for the activations, as vLLM's ``Fp8Config`` reads them) was imported with its
    FP8 codes as the weights' values: ``dcp.load`` into a BF16 model copied codes up to 448 in place of weights
    ~0.05. Each weight is now ``float32(q) * scale`` rounded to ``--dtype`` (vLLM's ``Fp8LinearMethod``),
    checked here against torch's own arithmetic on the stored tensors; a scale of another shape is E612."""
    g = torch.Generator().manual_seed(3)
    tensors: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for name, (r, c) in {"model.layers.0.mlp.up_proj": (300, 64), "model.layers.0.self_attn.q_proj": (32, 64)}.items():
        w = torch.randn(r, c, generator=g) * 0.05
        scale = w.abs().max() / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale.reshape(())
        tensors[f"{name}.input_scale"] = torch.tensor(0.02)
        want[f"{name}.weight"] = q.to(torch.float32) * scale
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    cfg = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    src = _write_folder(tmp_path / "src", tensors, cfg)
    for dtype in ("float32", "bfloat16"):
        doc = _import(src, tmp_path / dtype, "--dtype", dtype)
        assert doc["dequantized"]["kinds"] == {"fp8-tensor": 2}, doc["dequantized"]
        got = _torch_load(tmp_path / dtype)
        for k, v in want.items():
            assert torch.equal(got[f"model.{k}"].view(torch.uint8), v.to(getattr(torch, dtype)).view(torch.uint8)), k
        assert f"model.{next(iter(want))}_scale" not in got  # the scale is not imported; input_scale is, as stored
        assert torch.equal(got["model.model.layers.0.mlp.up_proj.input_scale"], torch.tensor(0.02))
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(2)  # not one element: not per-tensor
    bad = _write_folder(tmp_path / "bad", tensors, cfg)
    err = _import(bad, tmp_path / "x", code=2)
    assert "[E612] model.layers.0.mlp.up_proj.weight_scale: float32 [2], but a per-tensor FP8 scale" in err, err


def test_unreadable_own_config_is_named_as_the_folders_not_config_option(deepseek_dir: Path, tmp_path: Path) -> None:
    """An FP8 folder whose own config.json is not JSON: import said ``[E100] --config F/config.json: not valid JSON``
    and diff ``\\`config\\` F/config.json`` though no --config was passed. Now the folder's own config.json is named,
    no option; a --config that is not JSON is still named as --config."""
    import shutil

    src = tmp_path / "fp8"
    shutil.copytree(deepseek_dir, src)
    (src / "config.json").write_text("{nope")
    own = f"{src / 'config.json'} (the folder's own config.json): not valid JSON"
    for args in (["import", str(src), str(tmp_path / "out")], ["diff", str(src), str(src)], ["inspect", str(src)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and "[E100]" in res.stderr and own in res.stderr, res.stderr
        assert "config`" not in res.stderr and "--config" not in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
    bad = tmp_path / "given.json"
    bad.write_text("{nope")
    res = runner.invoke(app, ["import", str(deepseek_dir), str(tmp_path / "out"), "--config", str(bad)])
    assert res.exit_code == 2 and f"--config {bad}: not valid JSON" in res.stderr, res.stderr


def _tiny_moe_fp8_per_expert(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """``export --quantize fp8-block --quantize-block 8`` of the tiny MoE into ``tmp_path / "q"``: the folder and its
    ``model.safetensors`` tensors (per-expert FP8 weights with ``weight_scale_inv``)."""
    from safetensors.torch import load_file

    from tests.ops.export.test_export_quant_experts import _tiny_moe

    src = _tiny_moe(tmp_path / "ckpt")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"hidden_size": 20}))
    q = tmp_path / "q"
    args = ["export", str(src), str(q), "--quantize", "fp8-block", "--quantize-block", "8"]
    assert runner.invoke(app, [*args, "--model-assets", str(assets)]).exit_code == 0
    return q, load_file(str(q / "model.safetensors"))


def test_mixed_per_expert_folder_imports_in_float32(tmp_path: Path) -> None:
    """A per-expert FP8 export with expert 0 kept BF16 (no scales): ``--dtype float32`` failed ``E601 per-expert
    gate_up_proj parts differ in shape or dtype`` (the FP8 experts dequantized to float32, expert 0 bfloat16) while the
    default bfloat16 worked. Now expert 0 is written as float32 (exact) with a warning; the bfloat16 import is the
    float32 one rounded."""
    q, t = _tiny_moe_fp8_per_expert(tmp_path)
    g = torch.Generator().manual_seed(1)
    for k in [k for k in t if ".experts.0." in k]:
        if k.endswith("_scale_inv"):
            del t[k]
        else:
            t[k] = torch.randn(t[k].shape, generator=g).to(torch.bfloat16)
    save_file(t, str(q / "model.safetensors"), {"format": "pt"})
    (q / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(t, "model.safetensors")})
    )
    res = runner.invoke(app, ["import", str(q), str(tmp_path / "f32"), "--dtype", "float32"])
    assert res.exit_code == 0, res.stderr
    assert "stored bfloat16, unquantized, beside dequantized experts" in res.stderr
    assert runner.invoke(app, ["import", str(q), str(tmp_path / "bf16")]).exit_code == 0
    f32, bf16 = _torch_load(tmp_path / "f32"), _torch_load(tmp_path / "bf16")
    p = "model.model.layers.0.mlp.experts."
    gate_up, down = f32[p + "gate_up_proj"], f32[p + "down_proj"]
    assert gate_up.dtype == down.dtype == torch.float32 and gate_up.shape == (4, 12, 20)
    e0 = "model.layers.0.mlp.experts.0."
    want = torch.cat([t[e0 + "gate_proj.weight"], t[e0 + "up_proj.weight"]]).float()
    assert torch.equal(gate_up[0], want) and torch.equal(down[0], t[e0 + "down_proj.weight"].float())
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(_bits(f32[p + name].to(torch.bfloat16)), _bits(bf16[p + name])), name


def _packed(method: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    """A tiny Llama's ``save_pretrained`` tensors with its linear weights packed as ``method`` stores them (the names
    and dtypes of the AutoAWQ / GPTQModel ``QuantLinear`` buffers and of transformers' bitsandbytes quantizers'
    ``serialized_names``; the codes are random), its config with that ``quantization_config``, and the
    first packed weight's key in key order."""
    import transformers

    hf_models._quiet()
    model = transformers.LlamaForCausalLM(hf_models.llama_config())
    g = torch.Generator().manual_seed(11)
    qc: dict[str, Any] = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False},
        "bnb-4bit": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        "bnb-8bit": {"quant_method": "bitsandbytes", "load_in_8bit": True},
        "ct-pack": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        "ct-int8": {"quant_method": "compressed-tensors", "format": "int-quantized"},
    }[method]
    out: dict[str, torch.Tensor] = {}
    packed: list[str] = []
    for k, v in model.state_dict().items():
        if ".layers." not in k or not k.endswith("_proj.weight"):
            out[k] = v.contiguous()
            continue
        p, (rows, cols) = k.removesuffix(".weight"), v.shape
        i32 = {"dtype": torch.int32, "generator": g}
        if method in ("awq", "gptq"):
            out[p + ".qweight"] = torch.randint(
                -(2**31), 2**31 - 1, (cols, rows // 8) if method == "awq" else (cols // 8, rows), **i32
            )
            out[p + ".qzeros"] = torch.randint(-(2**31), 2**31 - 1, (cols // 16, rows // 8), **i32)
            out[p + ".scales"] = torch.rand(cols // 16, rows, generator=g).half()
            if method == "gptq":
                out[p + ".g_idx"] = torch.arange(cols, dtype=torch.int32) // 16
            packed.append(p + ".qweight")
        elif method == "bnb-4bit":
            out[k] = torch.randint(0, 256, (rows * cols // 2, 1), dtype=torch.uint8, generator=g)
            out[k + ".absmax"] = torch.rand(rows * cols // 64, generator=g)
            out[k + ".quant_map"] = torch.rand(16, generator=g)
            out[k + ".quant_state.bitsandbytes__nf4"] = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)
            packed.append(k)
        elif method == "ct-pack":  # compressed-tensors pack-quantized: eight 4-bit codes an int32, row-major
            out[p + ".weight_packed"] = torch.randint(-(2**31), 2**31 - 1, (rows, cols // 8), **i32)
            out[p + ".weight_scale"] = torch.rand(rows, cols // 16, generator=g).half()
            out[p + ".weight_shape"] = torch.tensor([rows, cols])
            packed.append(p + ".weight_packed")
        elif method == "ct-int8":  # compressed-tensors int-quantized (W8A8): int8 codes, a scale a row
            out[k] = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
            out[p + ".weight_scale"] = torch.rand(rows, 1, generator=g)
            packed.append(k)
        else:
            out[k] = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
            out[p + ".SCB"] = torch.rand(rows, generator=g) * 10
            out[p + ".weight_format"] = torch.tensor(0, dtype=torch.uint8)
            packed.append(k)
    config = {**model.config.to_dict(), "quantization_config": qc}
    return out, config, min(packed)


#: How each packed-integer method of :func:`_packed` is named (import's E612, inspect, validate M026, diff's note).
PACKED_NAMES = {
    "awq": "AWQ/GPTQ",
    "gptq": "AWQ/GPTQ",
    "bnb-4bit": "bitsandbytes 4-bit",
    "bnb-8bit": "bitsandbytes 8-bit",
    "ct-pack": "compressed-tensors packed",
    "ct-int8": "compressed-tensors int-quantized",
}

#: Who E612's hint sends each method to (transformers' model.dequantize() exists for bitsandbytes only).
DEQUANTIZERS = {
    "awq": "the library that quantized it (AutoAWQ, GPTQModel)",
    "gptq": "the library that quantized it (AutoAWQ, GPTQModel)",
    "bnb-4bit": "transformers (model.dequantize(), bitsandbytes installed)",
    "bnb-8bit": "transformers (model.dequantize(), bitsandbytes installed)",
    "ct-pack": "compressed-tensors (ModelCompressor.decompress_model)",
    "ct-int8": "compressed-tensors (ModelCompressor.decompress_model)",
}


@pytest.mark.parametrize("config", ["config", "no-config"])
@pytest.mark.parametrize("method", list(PACKED_NAMES))
def test_integer_packed_weights_are_refused_not_imported_as_weights(tmp_path: Path, method: str, config: str) -> None:
    """AWQ / GPTQ ``qweight`` + ``qzeros`` + ``scales``, bitsandbytes 4-bit / 8-bit weights, compressed-tensors
    ``pack-quantized`` / ``int-quantized`` weights: import dequantizes none of them. Without a config (no model check) every packed tensor was imported as stored, exit 0, no word;
    with ``allow_mismatch`` (or bitsandbytes 8-bit, whose int8 ``x.weight`` has the model's shape) the same, with at
    most a warning about keys the model lacks: ``dcp.load`` then cast the int8 codes into the model's weights.
    Now E612 naming the first packed weight and its method (the first in key order), nothing written."""
    tensors, cfg, first = _packed(method)
    src = _write_folder(tmp_path / "src", tensors, cfg)
    if config == "no-config":
        (src / "config.json").unlink()
    before = sorted(p.name for p in tmp_path.iterdir())
    err = _import(src, tmp_path / "dcp", code=2)
    assert "[E612]" in err and first in err and PACKED_NAMES[method] in err and "Traceback" not in err, err
    assert f"hint: dequantize it with {DEQUANTIZERS[method]}" in err, err  # model.dequantize() is bitsandbytes' only
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("weights", ["qint8", "qint4"])
def test_optimum_quanto_weights_are_refused_and_warned(tmp_path: Path, weights: str) -> None:
    """optimum-quanto's own ``quantize(model, weights=qint8 | qint4); freeze(model)`` state dict stores each linear
    weight as ``x.weight._data`` int8 (qint4: ``x.weight._data._data`` uint8, two codes a byte) beside
    ``x.weight._scale``. import wrote those codes as stored (exit 0, no word) and validate --strict said OK: none of
    the packed-integer conventions named quanto's. Now import refuses them (E612, nothing written) and validate
    warns M026 on the DCP save of the same state dict."""
    quanto = pytest.importorskip("optimum.quanto")
    import transformers

    hf_models._quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_models.llama_config())
    quanto.quantize(model.model.layers, weights=getattr(quanto, weights))
    quanto.freeze(model)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    data = ".weight._data" if weights == "qint8" else ".weight._data._data"
    first = min(k for k in sd if k.endswith(data))
    assert sd[first].dtype == (torch.int8 if weights == "qint8" else torch.uint8)
    cfg = {**model.config.to_dict(), "quantization_config": {"quant_method": "quanto", "weights": weights[1:]}}
    src = _write_folder(tmp_path / "src", sd, cfg)
    before = sorted(p.name for p in tmp_path.iterdir())
    err = _import(src, tmp_path / "dcp", code=2)
    assert "[E612]" in err and first in err and "optimum-quanto" in err and "Traceback" not in err, err
    assert "hint: dequantize it with optimum-quanto (each quantized weight's .dequantize())" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    res = runner.invoke(app, ["validate", "--strict", str(tmp_path / "ckpt"), "--json"])
    assert res.exit_code == 1, res.output
    found = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"]]
    assert found == [("M026", first)], found


def test_an_unquantized_float32_expert_beyond_bfloat16_is_refused_not_written_as_infinity(tmp_path: Path) -> None:
    """A per-expert FP8 export with expert 0 kept FP32 (no scales) holding 3.4e38: the default bfloat16 import cast
    that part to bfloat16 infinity with exit 0. Now E612 naming the part and the element, nothing published;
    ``--dtype float32`` (the hint) imports it exactly."""
    q, t = _tiny_moe_fp8_per_expert(tmp_path)
    for k in [k for k in t if ".experts.0." in k]:
        if k.endswith("_scale_inv"):
            del t[k]
        else:
            t[k] = torch.ones(t[k].shape)
    big = "model.layers.0.mlp.experts.0.up_proj.weight"
    t[big][1, 2] = 3.4e38
    save_file(t, str(q / "model.safetensors"), {"format": "pt"})
    (q / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(t, "model.safetensors")})
    )
    res = runner.invoke(app, ["import", str(q), str(tmp_path / "bf16")])
    assert res.exit_code != 0
    assert (
        f"[E612] {big}: 1 finite float32 value(s) beyond bfloat16's range (+-3.39e38) would be written as "
        "infinity, e.g. 3.4e+38 at [1, 2]" in res.stderr
    ), res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "bf16").exists()
    res = runner.invoke(app, ["import", str(q), str(tmp_path / "f32"), "--dtype", "float32"])
    assert res.exit_code == 0, res.stderr
    gate_up = _torch_load(tmp_path / "f32")["model.model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2 * 6, 20]
    assert gate_up.dtype == torch.float32 and gate_up[0, 6 + 1, 2].item() == t[big][1, 2].item()


@pytest.mark.parametrize("kind", ["dangling link", "folder", "fifo"])
def test_an_own_config_json_that_cannot_be_read_is_refused_not_taken_for_none(
    deepseek_dir: Path, tmp_path: Path, kind: str
) -> None:
    """An FP8 folder whose config.json (16x16 blocks) is a dangling link, a folder or a FIFO: it was taken for no
    config, the scales checked against 128x128 blocks and the folder called damaged (E612), inspect exit 0. Now the
    config.json is named as not read, exit 2, nothing written."""
    import os
    import shutil

    src = tmp_path / "fp8"
    shutil.copytree(deepseek_dir, src)
    cfg = src / "config.json"
    cfg.unlink()
    if kind == "dangling link":
        os.symlink("config.json.gone", cfg)
    elif kind == "folder":
        cfg.mkdir()
    else:
        os.mkfifo(cfg)
    for args in (["inspect", str(src)], ["import", str(src), str(tmp_path / "out")], ["diff", str(src), str(src)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and str(cfg) in res.stderr, (args[0], res.exit_code, res.stderr)
        assert "E612" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


_CT_BLOCK_100 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [100, 100]},
        }
    },
}


@pytest.mark.parametrize("quant_method", ["compressed-tensors", "mxfp4"])
def test_block_fp8_scales_under_another_quant_method_are_refused(tmp_path: Path, quant_method: str) -> None:
    """Block-FP8 ``weight_scale_inv`` under a compressed-tensors config whose ``[100, 100]`` blocks give a
    ``[300, 200]`` weight the same ``[3, 2]`` scale grid as the default 128x128 was dequantized on 128x128 blocks, the
    config's grid ignored (and under ``mxfp4``, which gives none): now E612 naming the scale and the config's
    quant_method, a hint, nothing published; ``validate --deep`` reports it (M020)."""
    q = torch.randint(0, 0x7E, (300, 200), dtype=torch.uint8).view(torch.float8_e4m3fn)
    key = "model.layers.0.mlp.up_proj.weight_scale_inv"
    t = {"model.layers.0.mlp.up_proj.weight": q, key: torch.rand(3, 2) + 0.5}
    qc = _CT_BLOCK_100 if quant_method == "compressed-tensors" else {"quant_method": "mxfp4"}
    src = _write_folder(tmp_path / "src", t, {"quantization_config": qc})
    err = _import(src, tmp_path / "dcp", "--dtype", "float32", code=2)
    assert f"[E612] {key}:" in err and f"quant_method is {quant_method!r}, not 'fp8'" in err, err
    assert "hint: pass --config" in err and "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    assert not (tmp_path / "dcp").exists()
    res = runner.invoke(app, ["validate", "--deep", str(src), "--json"])
    found = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"]]
    assert res.exit_code == 1 and ("M020", key) in found, res.stdout


@pytest.mark.parametrize("scaled", [True, False])
def test_a_2d_float8_tensor_not_named_weight_under_a_block_fp8_config_is_refused(tmp_path: Path, scaled: bool) -> None:
    """Under a block-FP8 config, a 2-D float8 ``x.w1`` (with an ``x.w1_scale_inv`` [3, 2] beside it, or none) was
    imported as its raw FP8 codes, which ``dcp.load`` casts into the model's weight as values, the scale a stray
    tensor; ``validate --deep`` passed it. Block FP8 scales only ``x.weight`` and fused experts: now E612 naming the
    tensor, nothing published, and M020."""
    t = _deepseek_tensors(16)
    key = "model.layers.0.mlp.w1"
    t[key] = torch.randint(0, 0x7E, (40, 30), dtype=torch.uint8).view(torch.float8_e4m3fn)
    if scaled:
        t[key + "_scale_inv"] = torch.rand(3, 2) + 0.5
    src = _write_folder(tmp_path / "src", t, _DS_CONFIG)
    err = _import(src, tmp_path / "dcp", code=2)
    assert f"[E612] {key}: a float8_e4m3fn tensor [40, 30]" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2 and not (tmp_path / "dcp").exists()
    res = runner.invoke(app, ["validate", "--deep", str(src), "--json"])
    found = [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"]]
    assert res.exit_code == 1 and ("M020", key) in found, res.stdout


@pytest.mark.parametrize(
    ("weights", "grid"),
    [
        ({"num_bits": 8, "type": "FLOAT", "strategy": "BLOCK", "block_structure": "16x8"}, (16, 8)),
        # num_bits 8 and strategy channel, as compressed-tensors infers them
        ({"type": "float", "group_size": -1}, (1, None)),
    ],
)
def test_compressed_tensors_args_read_as_compressed_tensors_reads_them(
    tmp_path: Path, weights: dict[str, Any], grid: tuple[int, int | None]
) -> None:
    """Weight args compressed-tensors' ``QuantizationArgs`` accepts (``type`` / ``strategy`` in upper case, the older
    ``"16x8"`` string of ``block_structure``, ``num_bits`` left to its default 8, ``strategy`` inferred from
    ``group_size`` -1) were E612 ("config_groups give no one block, channel or tensor FP8 scheme"). Now the import
    equals compressed-tensors' own decompression of the folder, bit for bit."""
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    g = torch.Generator().manual_seed(11)
    q = torch.randint(0, 0x7E, (40, 30), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    rows, cols = -(-40 // grid[0]), 1 if grid[1] is None else -(-30 // grid[1])
    t = {
        "model.layers.0.mlp.up_proj.weight": q,
        "model.layers.0.mlp.up_proj.weight_scale": torch.rand(rows, cols) + 0.1,
    }
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    src = _write_folder(tmp_path / "src", t, {"quantization_config": qc})
    r = _import(src, tmp_path / "dcp", "--dtype", "float32")
    assert r["dequantized"]["kinds"] == {"fp8-compressed-tensors": 1}
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    ref = FloatQuantizationCompressor.decompress(
        {"weight": q, "weight_scale": t["model.layers.0.mlp.up_proj.weight_scale"]}, scheme
    )["weight"]
    got = _torch_load(tmp_path / "dcp")["model.model.layers.0.mlp.up_proj.weight"]
    assert got.dtype == ref.dtype == torch.float32 and torch.equal(_bits(got), _bits(ref))
