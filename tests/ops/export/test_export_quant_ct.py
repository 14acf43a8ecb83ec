"""Quantized export in the compressed-tensors convention, per-expert MoE and LoRA-merged, against their consumers.

- compressed-tensors' own code: ``quantization_config`` equals what its ``ModelCompressor.update_config``
  writes for llm-compressor's ``FP8_BLOCK`` / ``FP8_DYNAMIC`` presets; transformers'
  ``from_pretrained`` (``CompressedTensorsHfQuantizer`` -> ``ModelCompressor.decompress_model``)
  loads the export with no warning and its decompressed weights equal ``float32(q) * scale``
  of the exported bytes bit for bit; the bytes and scales equal torch's own quantization;
- per-expert Qwen3-MoE: every expert of the fused ``[E, out, in]`` tensors quantized; dequantized by
  torch's ``QuantizedHuggingFaceStorageReader`` (``fp8``) and by compressed-tensors' compressor
  (``compressed-tensors``), loaded into ``Qwen3MoeForCausalLM``: logits close to the BF16 export's;
- LoRA-merged then quantized: within the bound of PEFT's ``merge_and_unload()`` weights;
- usage errors: ``fp8-channel`` with ``--quant-format fp8``, an unknown ``--quant-format``.

Stated logits tolerance (tiny models): FP8 rounding (<= 3.6% of each block's / row's amax per weight)
moves the logits by less than 5% of their largest magnitude.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.export.lora import INFERRED_SCALING
from ckpttool.ops.export.quantize import MAX_BLOCK_REL_ERROR
from tests.fixtures import hf_models
from tests.ops.export.test_export_consumers import lora_ckpt, qwen_ckpt, qwen_legacy_ckpt  # noqa: F401  (session fixtures)
from tests.ops.export.test_export_fp8 import (
    _file_tensors,
    _torch_load,
    _torch_reader_load,
    _torch_reference,
    master_ckpt,  # noqa: F401  (session fixture)
)

pytest.importorskip("compressed_tensors")

runner = CliRunner()


def _export(src: Path, out: Path, *args: str) -> dict[str, Any]:
    res = runner.invoke(
        app, ["export", str(src), str(out), "--model-assets", str(src / "model_assets"), "--json", *args]
    )
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return json.loads(res.stdout)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _warnings_of(fn: Any) -> tuple[Any, list[str]]:
    """``fn()`` and the transformers warnings it logged."""
    from transformers.utils import logging as hf_logging

    h = _Records()
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(h)
    try:
        value = fn()
    finally:
        logger.removeHandler(h)
    return value, [r.getMessage() for r in h.records]


def _ct_reference_config(method: str, block: int, ignore: list[str]) -> dict[str, Any]:
    """What compressed-tensors' ``ModelCompressor.update_config`` writes for llm-compressor's preset."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_BLOCK" if method == "fp8-block" else "FP8_DYNAMIC", ["Linear"])
    if method == "fp8-block":
        scheme.weights.block_structure = [block, block]
        scheme.input_activations.group_size = block
    scheme.format = "float-quantized"
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=ignore,
        format="float-quantized",
        quantization_status=QuantizationStatus.COMPRESSED,
    )
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ModelCompressor(quantization_config=qc).update_config(d)
        doc = json.loads((Path(d) / "config.json").read_text())["quantization_config"]
    doc.pop("version")  # the compressed-tensors release that wrote it: ckpttool writes none
    return doc


def _channel_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 in torch arithmetic: ``scale = amax / 448`` (1 for a zero row), ``q = (w / scale).to(e4m3fn)``."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    return (w / scale).to(torch.float8_e4m3fn), scale


def _masters(src: Path) -> dict[str, torch.Tensor]:
    return {
        k.removeprefix("optimizer.state.").removesuffix(".master_weight"): v
        for k, v in _torch_load(src).items()
        if k.endswith(".master_weight")
    }


@pytest.mark.parametrize("method", ["fp8-block", "fp8-channel"])
def test_compressed_tensors_export_decompressed_by_compressed_tensors(
    master_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    method: str,
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / "ct"
    block = 16
    blocks = ["--quantize-block", str(block)] if method == "fp8-block" else []  # fp8-channel has no blocks
    r = _export(master_ckpt, out, "--quantize", method, "--quant-format", "compressed-tensors", *blocks)
    assert r["quantization"]["block_size"] == (block if method == "fp8-block" else None)
    q = r["quantization"]
    assert q["format"] == "compressed-tensors" and q["method"] == method and q["quantized"] == 14
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == _ct_reference_config(method, block, ["lm_head", "model.embed_tokens"])
    _, warned = _warnings_of(lambda: AutoConfig.from_pretrained(out))
    assert warned == []  # no unknown-key warning from transformers

    files = _file_tensors(out)
    scales = {k.removesuffix("_scale"): v for k, v in files.items() if k.endswith(".weight_scale")}
    assert len(scales) == 14 and not any(k.endswith("_scale_inv") for k in files)
    masters = _masters(master_ckpt)
    for name, scale in scales.items():
        w = files[name]
        assert w.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        ref_q, ref_scale = (
            _torch_reference(masters[name], block) if method == "fp8-block" else _channel_reference(masters[name])
        )
        assert tuple(scale.shape) == tuple(ref_scale.shape), name  # [ceil(out/B), ceil(in/B)] or [out, 1]
        assert torch.equal(scale, ref_scale) and torch.equal(w.view(torch.uint8), ref_q.view(torch.uint8)), name

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(
            out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
        )

    model, warned = _warnings_of(load)
    assert not [m for m in warned if "missing" in m.lower() or "unexpected" in m.lower() or "not used" in m], warned
    sd = model.state_dict()
    for name, scale in scales.items():
        w = files[name].float()
        full = (
            scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
            if method == "fp8-block"
            else scale
        )
        ours = w * full
        assert torch.equal(sd[name].view(torch.int32), ours.view(torch.int32)), (
            name
        )  # compressed-tensors' decompression
        src = masters[name]
        assert (sd[name] - src).abs().max() <= MAX_BLOCK_REL_ERROR * src.abs().max(), name
    if method == "fp8-block":
        _assert_logits_close(model, master_ckpt, tmp_path, ())


def _assert_logits_close(model: torch.nn.Module, src: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    """Logits of ``model`` (dequantized weights) vs the BF16 export's (same source weights, FP32 compute).

    Dense (Llama): max |diff| <= 5% of the largest logit. MoE (Qwen3-MoE, top-2 of 8 random experts): FP8's
    ~2.7% weight error flips some tokens' expert choice (BF16 alone moves these logits by ~4% in L2), so
    the bound is on the whole logits: cosine similarity >= 0.9 and ||diff|| <= 0.5 ||bf16||.
    """
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "bf16"
    _export(src, bf16, "--weights", "auto", "--save-dtype", "bf16", *extra)
    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, want = model.eval()(ids).logits, ref(ids).logits
    if "--experts" in extra:
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        rel = ((got - want).norm() / want.norm()).item()
        assert cos >= 0.9 and 0 < rel <= 0.5, (cos, rel)
    else:
        diff = (got - want).abs().max().item()
        assert 0 < diff <= 0.05 * want.abs().max().item(), diff


def _ct_dequantized(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a compressed-tensors export, the quantized ones dequantized by compressed-tensors' own
    ``FloatQuantizationCompressor.decompress`` with the scheme parsed from ``config.json``."""
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    files = _file_tensors(out)
    sd: dict[str, torch.Tensor] = {}
    for k, v in files.items():
        if k.endswith("_scale"):
            continue
        if k + "_scale" in files:
            sd[k] = FloatQuantizationCompressor.decompress({"weight": v, "weight_scale": files[k + "_scale"]}, scheme)[
                "weight"
            ]
        else:
            sd[k] = v.float()
    return sd


# fp8 per-expert with logits is also covered (non-heavy) by the torchtitan test below: heavy here for CI time
@pytest.mark.parametrize("quant_format", [pytest.param("fp8", marks=pytest.mark.heavy), "compressed-tensors"])
def test_per_expert_moe_quantized_logits(qwen_ckpt: Path, tmp_path: Path, quant_format: str) -> None:  # noqa: F811
    """Fused ``[E, out, in]`` experts split per expert, each expert quantized; dequantized by the consumer's code."""
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    out = tmp_path / "q"
    block = 8
    r = _export(
        qwen_ckpt,
        out,
        "--experts",
        "per-expert",
        "--quantize",
        "fp8-block",
        "--quant-format",
        quant_format,
        "--quantize-block",
        str(block),
    )
    cfg = hf_models.qwen_moe_config()
    n_experts = cfg.num_hidden_layers * cfg.num_experts * 3
    assert r["quantization"]["quantized"] == n_experts + cfg.num_hidden_layers * 4  # experts + q, k, v, o
    # sources: the fused tensors, expert by expert (torch reference bytes)
    src = {k.removeprefix("model."): v for k, v in _torch_load(qwen_ckpt).items() if k.startswith("model.")}
    files = _file_tensors(out)
    suffix = "_scale_inv" if quant_format == "fp8" else "_scale"
    i = cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        fused = f"model.layers.{layer}.mlp.experts."
        for e in range(cfg.num_experts):
            for name, w in (
                ("gate_proj", src[fused + "gate_up_proj"][e, :i]),
                ("up_proj", src[fused + "gate_up_proj"][e, i:]),
                ("down_proj", src[fused + "down_proj"][e]),
            ):
                key = f"{fused}{e}.{name}.weight"
                ref_q, ref_scale = _torch_reference(w, block)
                assert torch.equal(files[key + suffix], ref_scale), key
                assert torch.equal(files[key].view(torch.uint8), ref_q.view(torch.uint8)), key
        assert files[f"model.layers.{layer}.mlp.gate.weight"].dtype == torch.bfloat16  # router kept
    _, warned = _warnings_of(lambda: AutoConfig.from_pretrained(out))
    assert warned == []
    if quant_format == "fp8":
        weights = {k.removesuffix(suffix): files[k.removesuffix(suffix)] for k in files if k.endswith(suffix)}
        deq = _torch_reader_load(out, weights, block)
        sd = {k: v.float() for k, v in files.items() if not k.endswith(suffix) and k not in deq} | deq
    else:
        sd = _ct_dequantized(out)
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dense / "model.safetensors"))
    cfg.save_pretrained(dense)
    model = Qwen3MoeForCausalLM.from_pretrained(dense, dtype=torch.float32)
    _assert_logits_close(model, qwen_ckpt, tmp_path, ("--experts", "per-expert"))


def test_per_expert_from_legacy_ep_shards_equals_single_process(
    qwen_ckpt: Path,  # noqa: F811
    qwen_legacy_ckpt: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same model saved by 4 legacy-EP ranks (expert slabs block-transposed along dim 0, a chunk per rank) and
    by one process: the per-expert FP8 exports are equal tensor for tensor (bands of 5 rows cross experts' chunks)."""
    args = ("--experts", "per-expert", "--quantize", "fp8-block", "--quantize-block", "5")
    legacy = ("--source-layout", "legacy", "--ep-size", str(hf_models.MOE_P), "--ep-fsdp-size", str(hf_models.MOE_F))
    a = _export(qwen_ckpt, tmp_path / "a", *args)
    b = _export(qwen_legacy_ckpt, tmp_path / "b", *args, *legacy)
    assert a["quantization"]["quantized"] == b["quantization"]["quantized"] > 0
    fa, fb = _file_tensors(tmp_path / "a"), _file_tensors(tmp_path / "b")
    assert set(fa) == set(fb)
    for k, v in fa.items():
        assert v.dtype == fb[k].dtype and torch.equal(v.view(torch.uint8), fb[k].view(torch.uint8)), k


def test_per_expert_through_the_torchtitan_adapter(fixture_root: Path, tmp_path: Path) -> None:
    """torchtitan 0.3 grouped experts (``w1_EFD`` / ``w3_EFD`` / ``w2_EFD``) split per expert by the adapter, each
    expert quantized; torch's reader dequantizes; logits vs the HF model the fixture was saved from."""
    pytest.importorskip("torchtitan.models.llama3.state_dict_adapter", reason="torchtitan not installed")
    from transformers import Qwen3MoeForCausalLM

    from tests.fixtures.cache import cached_build

    src = cached_build(fixture_root, "export_titan_named", hf_models.build_titan_named) / "qwen_moe"
    out = tmp_path / "q"
    r = _export(src, out, "--experts", "per-expert", "--quantize", "fp8-block", "--quantize-block", "8")
    cfg = hf_models.qwen_moe_config()
    assert r["model_adapter"] == "torchtitan-qwen3"
    assert r["quantization"]["quantized"] == cfg.num_hidden_layers * (cfg.num_experts * 3 + 4)
    files = _file_tensors(out)
    weights = {k.removesuffix("_scale_inv"): files[k.removesuffix("_scale_inv")] for k in files if k.endswith("_inv")}
    deq = _torch_reader_load(out, weights, 8)
    sd = {k: v.float() for k, v in files.items() if not k.endswith("_scale_inv") and k not in deq} | deq
    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dense / "model.safetensors"))
    cfg.save_pretrained(dense)
    model = Qwen3MoeForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    ref = torch.load(src / "reference.pt", weights_only=True)
    with torch.no_grad():
        got = model(ref["ids"]).logits
    want = ref["logits"]
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert cos >= 0.9 and 0 < rel <= 0.5, (cos, rel)  # the MoE tolerance of _assert_logits_close


def test_lora_merged_then_quantized(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """``--merge-lora --quantize``: W + s * B @ A in FP32, then quantized once; within the bound of PEFT's merge."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from tests.ops.export.test_export_consumers import load_hf

    out = tmp_path / "mq"
    r = _export(lora_ckpt, out, "--merge-lora", "--lora-alpha", str(hf_models.LORA_ALPHA), "--quantize", "fp8-block")
    assert r["quantization"]["quantized"] == 14 and r["warnings"] == [INFERRED_SCALING]  # alpha given, no config
    _export(lora_ckpt, tmp_path / "adapter", "--format", "lora", "--lora-alpha", str(hf_models.LORA_ALPHA))
    base = load_hf(lora_ckpt / "base", LlamaForCausalLM)
    base_q = base.state_dict()["model.layers.0.self_attn.q_proj.weight"].clone()  # merge_and_unload merges in place
    merged = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    want = merged.state_dict()
    files = _file_tensors(out)
    weights = {k.removesuffix("_scale_inv"): files[k.removesuffix("_scale_inv")] for k in files if k.endswith("_inv")}
    assert any("q_proj" in k for k in weights) and any("v_proj" in k for k in weights)
    deq = _torch_reader_load(out, weights, 128)
    for k, v in deq.items():
        ref = want[k].float()
        ref_q, ref_scale = _torch_reference(ref, 128)
        torch.testing.assert_close(files[k + "_scale_inv"], ref_scale, rtol=1e-6, atol=0)  # amax of the merged W
        assert (v - ref).abs().max() <= MAX_BLOCK_REL_ERROR * ref.abs().max(), k
    q0, _ = _torch_reference(base_q, 128)  # the merged weight's FP8 bytes are not the base weight's
    assert not torch.equal(files["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8), q0.view(torch.uint8))


def test_a_lora_merge_that_is_not_finite_is_refused_as_the_unquantized_merge_refuses_it(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An infinite ``lora_B`` element: the plain merge refuses it (E601, the LoRA merge named, the base weight's finite
    value); with ``--quantize`` it was told as the checkpoint's own weight "holds NaN or infinity" (E607, the hint
    ``--quantize-skip``, which the merge then refuses too). The quantized merge refuses it as the plain one does."""
    md = dcp.FileSystemReader(str(lora_ckpt)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if k.startswith("model.")
    }
    dcp.load(sd, checkpoint_id=str(lora_ckpt), no_dist=True)
    (b_key,) = [k for k in sd if "layers.0.self_attn.q_proj.lora_B" in k]
    sd[b_key][3, 0] = float("inf")
    src = tmp_path / "ckpt"
    dcp.save({"model": {k.removeprefix("model."): v for k, v in sd.items()}}, checkpoint_id=str(src), no_dist=True)
    base = b_key.replace("lora_B.default", "base_layer")
    alpha = ("--merge-lora", "--lora-alpha", str(hf_models.LORA_ALPHA))
    for args, target in (
        ((), "as float32"),
        (("--quantize", "fp8-block"), "to quantize"),
        (("--quantize", "fp8-channel", "--quant-format", "compressed-tensors"), "to quantize"),
    ):
        out = tmp_path / f"out{len(args)}"
        res = runner.invoke(app, ["export", str(src), str(out), "--save-dtype", "float32", *alpha, *args])
        assert res.exit_code == 2 and "Traceback" not in res.stderr and "Warning" not in res.stderr, res.stderr
        assert f"[E601] {base}: the LoRA merge W + s * B @ A at [3, 0] is -inf (float32) where W is" in (res.stderr), (
            res.stderr
        )
        assert f"not finite {target}" in res.stderr and not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--quantize", "fp8-channel"), "[E100] --quantize fp8-channel is not written by --quant-format fp8"),
        (("--quantize", "fp8-block", "--quant-format", "nvfp4"), "[E100] --quant-format 'nvfp4' is not one of"),
    ],
)
def test_quant_format_usage_errors(master_ckpt: Path, tmp_path: Path, args: tuple[str, ...], needle: str) -> None:  # noqa: F811
    out = tmp_path / "o"
    res = runner.invoke(app, ["export", str(master_ckpt), str(out), *args])
    assert res.exit_code == 2 and needle in res.stderr, res.stderr
    assert not out.exists()


@pytest.mark.parametrize("method", ["fp8-block", "fp8-channel"])
def test_nan_in_one_expert_refused_nothing_published(tmp_path: Path, method: str) -> None:
    """A NaN in expert 2 of a fused ``[E, out, in]`` tensor: E607 naming that expert's weight; no output."""
    import torch.distributed.checkpoint as dcp

    experts = torch.randn(4, 16, 24)
    experts[2, 9, 3] = float("nan")
    sd = {
        "model.model.layers.0.mlp.experts.down_proj": experts,
        "model.model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 48, 16),
        "model.model.norm.weight": torch.ones(16),
    }
    src = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "out"
    res = runner.invoke(
        app,
        [
            "export",
            str(src),
            str(out),
            "--experts",
            "per-expert",
            "--quantize",
            method,
            "--quant-format",
            "compressed-tensors",
            *(["--quantize-block", "8"] if method == "fp8-block" else []),
        ],
    )
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    where = "block (1, 0)" if method == "fp8-block" else "row 9"
    assert f"layers.0.mlp.experts.2.down_proj.weight: {where} holds NaN" in res.stderr, res.stderr
    assert res.stderr.startswith("error: [E607] ")
    assert not out.exists() and not list(tmp_path.glob("out*"))


def test_channel_refuses_a_block_size(master_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """``--quantize-block 64`` with ``fp8-channel`` was taken silently (it only sized the work units) and ``--json``
    reported ``block_size: 64`` of an export that has one scale per row: now E100, nothing written."""
    args = ["--quantize", "fp8-channel", "--quant-format", "compressed-tensors", "--quantize-block", "64"]
    res = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / "out"), *args])
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith("error: [E100] --quantize-block 64 sets the blocks of fp8-block; fp8-channel"), (
        res.stderr
    )
    assert not (tmp_path / "out").exists()


def test_quant_format_choices_are_the_registry() -> None:
    """``--quant-format``'s metavar and help name every registered convention (``QUANT_FORMATS``)."""
    from ckpttool.ops.export.quantize import QUANT_FORMATS, QUANT_METHODS

    res = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "300"})
    assert res.exit_code == 0
    assert f"<{'|'.join(QUANT_FORMATS)}>" in res.stdout
    assert f"<{'|'.join(QUANT_METHODS)}>" in res.stdout


def test_channel_summary_names_the_row_amax(master_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """The fp8-channel summary said 'max error ... of the block amax': its error is relative to each row's amax
    (--json max_rel_error, docs/export.md); fp8-block keeps 'block'."""
    ct = ["--quant-format", "compressed-tensors"]
    res = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / "ch"), "--quantize", "fp8-channel", *ct])
    assert res.exit_code == 0 and "(per output row)" in res.stdout, res.stderr
    assert "of the row amax (bound" in res.stdout and "block amax" not in res.stdout, res.stdout
    res = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / "blk"), "--quantize", "fp8-block", *ct])
    assert res.exit_code == 0 and "of the block amax (bound" in res.stdout, res.stdout
