"""Quantized export of fused expert tensors ``[E, out, in]`` and of fused pieces written by two sources.

- fused experts (``--experts fused``, ``--quant-format fp8``): each expert quantized on its own ``B x B`` grid,
  scales ``[E, ceil(out/B), ceil(in/B)]`` (transformers' ``FP8Experts`` parameters ``gate_up_proj`` /
  ``gate_up_proj_scale_inv``); the bytes equal torch's quantization of each expert, transformers' own
  ``_dequantize_fp8_weight`` (its block dequantization of ``(..., N, K)`` weights) gives our values;
- the torchtitan adapter's ``gate_up_proj`` assembled from ``w1_EFD`` and ``w3_EFD``: quantized after assembly, with
  a block of 24 rows straddling the two sources (``I = 16``); logits of the dequantized export vs the HF model the
  fixture was saved from (the MoE tolerance of ``test_export_quant_ct``);
- refusals: compressed-tensors with fused experts (no fused layout its consumers load), a ``--quantize-skip`` that
  keeps part of an experts module; nothing published.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.export.quantize import MAX_BLOCK_REL_ERROR
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build
from tests.ops.export.test_export_fp8 import _file_tensors, _torch_reader_load, _torch_reference

runner = CliRunner()


def _tf_dequantize() -> Any:
    """transformers' block dequantization of ``(..., N, K)`` FP8 weights (``FP8Linear`` / ``FP8Experts`` backward)."""
    try:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:  # pragma: no cover - another transformers release
        pytest.skip("transformers without finegrained_fp8._dequantize_fp8_weight")
    return _dequantize_fp8_weight


def _export(src: Path, out: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    """A fused quantized export (``--experts fused``: with ``--quantize`` the default is ``per-expert``)."""
    res = runner.invoke(
        app, ["export", str(src), str(out), "--quantize", "fp8-block", "--experts", "fused", "--json", *args]
    )
    return res.exit_code, json.loads(res.stdout) if res.exit_code == 0 else {}, res.stderr


def _assert_experts(files: dict[str, torch.Tensor], name: str, source: torch.Tensor, block: int) -> torch.Tensor:
    """Fused ``name``: per expert, torch's quantization of the assembled source; returns transformers' dequantization."""
    q, scale = files[name], files[name + "_scale_inv"]
    e, rows, cols = source.shape
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (e, rows, cols)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (e, -(-rows // block), -(-cols // block))
    for j in range(e):
        ref_q, ref_scale = _torch_reference(source[j], block)
        assert torch.equal(scale[j], ref_scale), (name, j)
        assert torch.equal(q[j].view(torch.uint8), ref_q.view(torch.uint8)), (name, j)
    deq = _tf_dequantize()(q, scale, [block, block], torch.float32)
    ours = q.float() * scale.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :rows, :cols]
    assert torch.equal(deq.view(torch.int32), ours.view(torch.int32)), name
    assert (deq - source.float()).abs().amax() <= MAX_BLOCK_REL_ERROR * source.float().abs().amax()
    return deq


def test_titan_fused_experts_quantized_after_assembly(fixture_root: Path, tmp_path: Path) -> None:
    """torchtitan's w1 | w3 assembled into gate_up_proj [E, 2I, H] (I = 16), then quantized in blocks of 24 rows:
    block 0 of each expert holds 16 rows of w1 and 8 of w3; down_proj [E, H, I] fused as stored."""
    pytest.importorskip("torchtitan.models.llama3.state_dict_adapter", reason="torchtitan not installed")
    from transformers import Qwen3MoeForCausalLM

    src = cached_build(fixture_root, "export_titan_named", hf_models.build_titan_named) / "qwen_moe"
    block, out = 24, tmp_path / "q"
    rc, r, err = _export(src, out, "--quantize-block", str(block), "--model-assets", str(src / "model_assets"))
    assert rc == 0, err
    cfg = hf_models.qwen_moe_config()
    assert r["model_adapter"] == "torchtitan-qwen3"
    assert r["quantization"]["quantized"] == cfg.num_hidden_layers * (2 + 4)  # gate_up, down + q, k, v, o
    assert r["casts"]["float32->float8_e4m3fn"] == r["quantization"]["quantized"]
    assert any("FP8Experts" in w for w in r["warnings"])
    titan = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _metadata(src).items()}
    dcp.load(titan, checkpoint_id=str(src), no_dist=True)
    files = _file_tensors(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(files)
    plain = {k: v.float() for k, v in files.items() if not k.endswith("_scale_inv") and v.dtype != torch.float8_e4m3fn}
    dense = {k: files[k] for k in files if k + "_scale_inv" in files and k.endswith(".weight")}
    sd = {**plain, **_torch_reader_load(out, dense, block)}
    for layer in range(cfg.num_hidden_layers):
        hf, tt = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.moe.routed_experts.inner_experts."
        gate_up = torch.cat([titan[tt + "w1_EFD"], titan[tt + "w3_EFD"]], dim=1)
        sd[hf + "gate_up_proj"] = _assert_experts(files, hf + "gate_up_proj", gate_up, block)
        sd[hf + "down_proj"] = _assert_experts(files, hf + "down_proj", titan[tt + "w2_EDF"], block)
        assert r["quantization"]["tensors"][hf + "gate_up_proj"]["blocks"] == cfg.num_experts * 2 * 2
    assert not (set(sd) ^ {k for k in files if not k.endswith("_scale_inv")})
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ref = torch.load(src / "reference.pt", weights_only=True)
    with torch.no_grad():
        got = model(ref["ids"]).logits
    want = ref["logits"]
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert cos >= 0.9 and 0 < rel <= 0.5, (cos, rel)  # the MoE tolerance of test_export_quant_ct


def _metadata(src: Path) -> dict[str, Any]:
    md = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    return {k: v for k, v in md.items() if hasattr(v, "size")}


def _tiny_moe(path: Path) -> Path:
    g = torch.Generator().manual_seed(5)
    sd = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 12, 20, generator=g),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 20, 6, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(20, 20, generator=g),
        "model.norm.weight": torch.ones(20),
    }
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def test_fused_experts_hf_names_and_refusals(tmp_path: Path) -> None:
    """HF-named fused experts (key rules), blocks of 8 cutting experts' rows and columns unevenly; compressed-tensors
    and a partial experts skip refused with nothing published."""
    src = _tiny_moe(tmp_path / "ckpt")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"hidden_size": 20}))
    rc, r, err = _export(src, tmp_path / "q", "--quantize-block", "8", "--model-assets", str(assets))
    assert rc == 0, err
    files = _file_tensors(tmp_path / "q")
    loaded = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _metadata(src).items()}
    dcp.load(loaded, checkpoint_id=str(src), no_dist=True)
    deq = {}
    for name in ("gate_up_proj", "down_proj"):
        key = "model.layers.0.mlp.experts." + name
        deq[key] = _assert_experts(files, key, loaded[key], 8)
    assert r["quantization"]["quantized"] == 3
    # import reads the fused layout back: transformers' dequantized values, bit for bit
    res = runner.invoke(app, ["import", str(tmp_path / "q"), str(tmp_path / "imported"), "--dtype", "float32"])
    assert res.exit_code == 0, res.stderr
    back = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _metadata(tmp_path / "imported").items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "imported"), no_dist=True)
    for key, want in deq.items():
        got = next(v for k, v in back.items() if k.endswith(key))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), key
    for args, code, needle in (
        (("--quant-format", "compressed-tensors"), "E601", "--experts per-expert"),
        (("--quantize-skip", "*.down_proj"), "E100", "keeps model.layers.0.mlp.experts.down_proj"),
    ):
        out = tmp_path / f"refused-{code}"
        rc, _, err = _export(src, out, "--quantize-block", "8", *args)
        assert rc == 2 and f"[{code}]" in err and needle in err and "Traceback" not in err, err
        assert not out.exists() and not list(tmp_path.glob(f"refused-{code}?*"))
    rc, r, err = _export(src, tmp_path / "kept", "--quantize-skip", "*.experts.*", "--model-assets", str(assets))
    assert rc == 0, err
    files = _file_tensors(tmp_path / "kept")
    assert files["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert r["quantization"]["quantized"] == 1 and "model.layers.0.mlp.experts.down_proj_scale_inv" not in files
    qc = json.loads((tmp_path / "kept" / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.experts"]  # the experts module, kept whole


@pytest.mark.parametrize(
    ("scale", "needle"),
    [
        (torch.ones(2, 2, 1), "need float32 [2, 1, 1]"),
        (torch.tensor([1.0, float("nan")]).reshape(2, 1, 1), "NaN, infinite or negative, e.g. block (1, 0, 0)"),
    ],
)
def test_import_refuses_fused_fp8_scales_that_do_not_fit(tmp_path: Path, scale: torch.Tensor, needle: str) -> None:
    """Fused FP8 experts with a scale of the wrong shape or a NaN scale: E612, nothing published."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    key = "model.layers.0.mlp.experts.down_proj"
    q = torch.full((2, 8, 8), 0.5).to(torch.float8_e4m3fn)
    save_file({key: q, key + "_scale_inv": scale, "model.norm.weight": torch.ones(8)}, str(src / "model.safetensors"))
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}
    (src / "config.json").write_text(json.dumps({"hidden_size": 8, "quantization_config": qc}))
    res = runner.invoke(app, ["import", str(src), str(tmp_path / "out")])
    assert res.exit_code == 2 and "[E612]" in res.stderr and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "dropped", ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.down_proj_scale_inv"]
)
def test_fused_fp8_experts_missing_their_scale_or_weight_are_refused(tmp_path: Path, dropped: str) -> None:
    """Our fused export (``quant_method: fp8`` with ``weight_block_size``) with one expert tensor's ``x_scale_inv``
    lost: import wrote its FP8 codes as stored beside its dequantized siblings (``dcp.load`` into the model casts codes
    to values: off by the scale) and ``validate --deep`` said OK; a scale without its weight passed too. Both are E612
    (import, nothing written) and M020 (validate), as a 2-D weight with no scale and a scale with no weight are."""
    from safetensors.torch import load_file, save_file

    src = _tiny_moe(tmp_path / "ckpt")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"hidden_size": 20}))
    rc, _, err = _export(src, tmp_path / "q", "--quantize-block", "8", "--model-assets", str(assets))
    assert rc == 0, err
    res = runner.invoke(app, ["import", str(tmp_path / "q"), str(tmp_path / "whole")])
    assert res.exit_code == 0, res.stderr  # the export as written imports
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"), metadata={"format": "pt"})
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    del index["weight_map"][dropped]
    (tmp_path / "q" / "model.safetensors.index.json").write_text(json.dumps(index))
    other = "model.layers.0.mlp.experts.down_proj" + ("" if dropped.endswith("_scale_inv") else "_scale_inv")
    res = runner.invoke(app, ["import", str(tmp_path / "q"), str(tmp_path / "out")])
    assert res.exit_code == 2 and f"[E612] {other}: " in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
    res = runner.invoke(app, ["validate", str(tmp_path / "q"), "--deep", "--json"])
    assert res.exit_code == 1, res.stdout
    assert [(f["code"], f["key"]) for f in json.loads(res.stdout)["findings"]] == [("M020", other)]


def test_quantize_writes_experts_per_expert_by_default(fixture_root: Path, tmp_path: Path) -> None:
    """``--quantize`` without ``--experts``: per-expert FP8 (what vLLM, torch's reader and transformers on any device
    read), not the fused layout transformers' CPU path loads without its scales (weights ~500x off, a load report of
    UNEXPECTED ``*_scale_inv`` keys the only sign); transformers' dequantized experts stay within the FP8 bound."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    src = cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)
    out = tmp_path / "q"
    args = ["export", str(src), str(out), "--quantize", "fp8-block", "--quantize-block", "8", "--json"]
    res = runner.invoke(app, [*args, "--model-assets", str(src / "model_assets")])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["experts"] == "per-expert" and "fused expert tensor(s)" not in res.stderr
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    hf_logging.set_verbosity_error()
    loaded = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _metadata(src).items()}
    dcp.load(loaded, checkpoint_id=str(src), no_dist=True)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
    sd = model.state_dict()
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{name}"
        want = loaded["model." + key].float()
        err = (sd[key].float() - want).abs().amax() / want.abs().amax()
        assert err <= 2 * MAX_BLOCK_REL_ERROR, (key, float(err))
    # --experts fused still writes transformers' FP8Experts layout, with the warning naming who cannot read it
    res = runner.invoke(app, [*args[:2], str(tmp_path / "f"), *args[3:], "--experts", "fused"])
    assert res.exit_code == 0 and json.loads(res.stdout)["experts"] == "fused"
    assert "transformers without a GPU loads their FP8 values without the scales" in res.stderr


def test_splitting_stored_fp8_fused_experts_is_refused(fixture_root: Path, tmp_path: Path) -> None:
    """A fused FP8 export (``x`` [E, out, in] + ``x_scale_inv`` [E, ...]) exported again with ``--experts per-expert``
    (no cast) split the FP8 codes per expert and left the fused scales as they were: 56 weights without a scale
    that import refuses (E612) and validate fails (M020), exit 0. Now E601 naming the tensor and its scale."""
    src = cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)
    fused = tmp_path / "fused"
    rc, _, err = _export(src, fused, "--quantize-block", "16")
    assert rc == 0, err
    out = tmp_path / "split"
    res = runner.invoke(app, ["export", str(fused), str(out), "--experts", "per-expert"])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "error: [E601]" in res.stderr and "'model.layers.0.mlp.experts.gate_up_proj'" in res.stderr, res.stderr
    assert "gate_up_proj_scale_inv" in res.stderr and "--experts per-expert" in res.stderr
    assert not out.exists()
    res = runner.invoke(app, ["export", str(fused), str(tmp_path / "copy")])  # fused, as stored
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize(
    ("glob", "kept", "other"),
    [
        ("*.experts.0.*", "experts.0.gate_proj.weight", "experts.1.gate_proj.weight"),
        ("*.experts.2.up_proj.weight", "experts.2.up_proj.weight", "experts.0.gate_proj.weight"),
    ],
)
def test_per_expert_skip_of_some_experts_is_refused(tmp_path: Path, glob: str, kept: str, other: str) -> None:
    """``--quantize-skip '*.experts.0.*'`` with per-expert output kept every expert of the layer unquantized (each
    fused source is quantized whole or not at all), exit 0 and no word: 1 weight quantized, not 1 + 8 of experts
    1-3. Now E100 naming a tensor the glob keeps and one it does not, nothing published; skipping whole experts
    modules (or whole source tensors: every ``down_proj``) still exports."""
    src = _tiny_moe(tmp_path / "ckpt")
    out = tmp_path / "q"
    args = ["export", str(src), str(out), "--quantize", "fp8-block", "--quantize-block", "8", "--json"]
    res = runner.invoke(app, [*args, "--quantize-skip", glob])
    assert res.exit_code == 2 and "[E100]" in res.stderr and "Traceback" not in res.stderr, res.stderr
    p = "model.layers.0.mlp."
    assert f"keeps {p}{kept} but not {p}{other}" in res.stderr, res.stderr
    assert f"--quantize-skip '{p}experts.*'" in res.stderr
    assert not out.exists() and not list(tmp_path.glob("q?*"))
    res = runner.invoke(app, [*args, "--quantize-skip", "*.experts.*.down_proj.weight"])
    assert res.exit_code == 0, res.stderr
    files = _file_tensors(out)
    assert files[p + "experts.3.down_proj.weight"].dtype == torch.bfloat16
    assert files[p + "experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert json.loads(res.stdout)["quantization"]["quantized"] == 1 + 8


def test_fused_gate_up_in_one_block_is_refused_and_the_hinted_block_loads_into_fp8_experts(
    fixture_root: Path, tmp_path: Path
) -> None:
    """A fused FP8 export whose ``gate_up_proj`` ``[E, 2I, H]`` fits one block (``2I <= B``) wrote a ``[E, 1, ...]``
    scale, exit 0, no warning: transformers' ``FP8Experts`` holds ``[E, 2, ...]`` (one row per half) and its
    ``load_state_dict`` refuses the shape. Now E100 naming the tensor and a block that works, nothing written; the
    hinted block's folder loads, every key and shape, into the FP8 model class transformers' own FineGrainedFP8
    quantizer builds from the written config.json."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    src = cached_build(fixture_root, "export_qwen_moe", hf_models.build_qwen_moe)
    args = ["--model-assets", str(src / "model_assets")]
    out = tmp_path / "b32"
    rc, _, err = _export(src, out, "--quantize-block", "32", *args)  # moe_intermediate_size 16: 2I = 32 rows
    assert rc == 2 and "Traceback" not in err, err
    first, hint = err.splitlines()[-2:]
    assert first.startswith("error: [E100] --quantize-block 32: fused model.layers.0.mlp.experts.gate_up_proj"), err
    assert "--quantize-block 16" in hint and "--experts per-expert" in hint, hint
    assert not out.exists() and not list(tmp_path.glob("b32?*"))
    cfg = AutoConfig.from_pretrained(str(src / "model_assets"))
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    want = hf_models.fp8_meta_model(cfg).state_dict()["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape
    assert list(want) == [8, 2, 1]  # transformers' own allocation: two rows where ceil(32 / 32) is one
    rc, _, err = _export(src, tmp_path / "b16", "--quantize-block", "16", *args)
    assert rc == 0, err
    model = hf_models.fp8_meta_model(AutoConfig.from_pretrained(str(tmp_path / "b16")))
    assert type(model.model.layers[0].mlp.experts).__name__ == "FP8Experts"
    model.load_state_dict(load_file(str(tmp_path / "b16" / "model.safetensors")), strict=True, assign=True)
    assert list(model.model.layers[0].mlp.experts.gate_up_proj_scale_inv.shape) == [8, 2, 2]
