"""`ckpttool export --quantize fp8-block` against independent references.

- torch's ``QuantizedHuggingFaceStorageReader`` (``torch.distributed.checkpoint.quantized_hf_storage``)
  reads the export back: its dequantized tensors equal ``q * scale`` of our kernels bit for bit and
  are within the documented bound of the source (``dcp.load``);
- the FP8 bytes and scales equal torch's own ``(w / scale).to(torch.float8_e4m3fn)`` with
  ``scale = amax / 448`` per block (whole tensors, torch arithmetic);
- transformers' ``AutoConfig`` / ``FineGrainedFP8Config`` accept ``config.json``; the tiny Llama's
  logits with the dequantized weights stay close to the BF16 export's;
- hostile: a NaN weight (E607, nothing published), ``--format lora`` (usage error), ``--quantize-skip``.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.engine import kernels
from ckpttool.ops.export.quantize import MAX_BLOCK_REL_ERROR
from tests.fixtures import hf_models
from tests.fixtures.cache import cached_build

runner = CliRunner()


@pytest.fixture(scope="session")
def master_ckpt(fixture_root: Path) -> Path:
    return cached_build(fixture_root, "export_master", hf_models.build_master)


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def _file_tensors(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # safe_open is not a mapping
                got[k] = h.get_tensor(k)
    return got


def _export(src: Path, out: Path, *args: str) -> dict[str, Any]:
    res = runner.invoke(app, ["export", str(src), str(out), "--quantize", "fp8-block", "--json", *args])
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return json.loads(res.stdout)


def _torch_reference(w: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block quantization in torch arithmetic: ``scale = amax / 448`` (1 for a zero block), ``q = (w / scale).to(e4m3fn)``."""
    w = w.float()
    rows, cols = w.shape
    nr, nc = -(-rows // b), -(-cols // b)
    padded = torch.zeros(nr * b, nc * b)
    padded[:rows, :cols] = w.abs()
    amax = padded.reshape(nr, b, nc, b).amax(dim=(1, 3))
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def _torch_reader_load(out: Path, keys: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in keys.items()}
    reader = QuantizedHuggingFaceStorageReader(str(out), target_dtype=torch.float32, block_size=block)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _check_against_sources(out: Path, sources: dict[str, torch.Tensor], block: int, result: dict[str, Any]) -> int:
    """Every ``*_scale_inv`` pair: torch reference bytes, torch reader == our dequantization, error within the bound."""
    files = _file_tensors(out)
    weights = {k[: -len("_scale_inv")]: files[k[: -len("_scale_inv")]] for k in files if k.endswith("_scale_inv")}
    assert weights, "nothing quantized"
    read = _torch_reader_load(out, weights, block)
    for name, q in weights.items():
        assert q.dtype == torch.float8_e4m3fn
        scale = files[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and tuple(scale.shape) == tuple(-(-d // block) for d in q.shape)
        ref_q, ref_scale = _torch_reference(sources[name], block)
        assert torch.equal(scale, ref_scale), name
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), name
        ours = np.concatenate(
            [
                kernels.fp8_block_dequantize(
                    q.view(torch.uint8)[r : r + block].numpy(), scale[r // block].numpy(), block
                )
                for r in range(0, q.shape[0], block)
            ]
        )
        assert np.array_equal(read[name].numpy().view(np.uint32), ours.view(np.uint32)), name
        src = sources[name].float()
        err = (read[name] - src).abs().max().item()
        assert err <= MAX_BLOCK_REL_ERROR * src.abs().max().item(), name
        figures = result["quantization"]["tensors"][name]
        assert figures["max_abs_error"] == pytest.approx(err, rel=1e-6, abs=1e-12)
        assert figures["max_rel_error"] <= MAX_BLOCK_REL_ERROR
    return len(weights)


def test_fp8_block_from_masters_read_by_torch(master_ckpt: Path, tmp_path: Path) -> None:
    """Default source with --quantize: the FP32 masters (auto); blocks of 16 so tensors span several blocks."""
    out = tmp_path / "fp8"
    r = _export(master_ckpt, out, "--quantize-block", "16", "--model-assets", str(master_ckpt / "model_assets"))
    assert r["weights"] == "master" and r["quantization"]["source"] == "master" and r["save_dtype"] == "bfloat16"
    sd = _torch_load(master_ckpt)
    masters = {
        k.removeprefix("optimizer.state.").removesuffix(".master_weight"): v
        for k, v in sd.items()
        if k.endswith(".master_weight")
    }
    n = _check_against_sources(out, masters, 16, r)
    assert n == r["quantization"]["quantized"] == 14  # 2 layers x 7 linear weights
    files = _file_tensors(out)
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert files[kept].dtype == torch.bfloat16 and kept + "_scale_inv" not in files
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(files)
    assert r["casts"]["float32->float8_e4m3fn"] == 14
    assert _validate(out, "--config", str(out / "config.json"))[1] == []  # M020: every scale fits its weight


def test_library_default_weights_follow_quantize(master_ckpt: Path, tmp_path: Path) -> None:
    """The library's default is the CLI's: the FP32 masters with ``quantize`` (auto), the stored parameters without."""
    from ckpttool.ops.export import ExportOptions, export_checkpoint

    q = export_checkpoint(master_ckpt, tmp_path / "q", ExportOptions(quantize="fp8-block", quantize_block=16))
    assert (q.weights, q.quantization is not None and q.quantization["source"]) == ("master", "master")
    plain = export_checkpoint(master_ckpt, tmp_path / "p", ExportOptions())
    assert plain.weights == "params"


def test_fp8_config_accepted_by_transformers_and_logits_close(master_ckpt: Path, tmp_path: Path) -> None:
    """AutoConfig reads quantization_config with no warning; dequantized logits vs the BF16 export's."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    from transformers.utils.quantization_config import FineGrainedFP8Config

    assets = str(master_ckpt / "model_assets")
    out = tmp_path / "fp8"
    _export(master_ckpt, out, "--model-assets", assets)  # default block 128: one block per tiny weight
    bf16 = tmp_path / "bf16"
    res = runner.invoke(
        app,
        [
            "export",
            str(master_ckpt),
            str(bf16),
            "--weights",
            "master",
            "--save-dtype",
            "bf16",
            "--model-assets",
            assets,
        ],
    )
    assert res.exit_code == 0, res.stderr
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    hf_logging.get_logger("transformers").addHandler(handler)
    try:
        cfg = AutoConfig.from_pretrained(str(out))
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    fp8cfg = FineGrainedFP8Config.from_dict(dict(cfg.quantization_config))
    assert fp8cfg.weight_block_size == [128, 128] and fp8cfg.activation_scheme == "dynamic"
    assert fp8cfg.modules_to_not_convert == ["lm_head", "model.embed_tokens"]

    files = _file_tensors(out)
    weights = {k: v for k, v in files.items() if k + "_scale_inv" in files}
    deq = _torch_reader_load(out, weights, 128)
    plain = {k: v.float() for k, v in files.items() if not k.endswith("_scale_inv") and k not in weights}
    ref = {k: v.float() for k, v in _file_tensors(bf16).items()}
    cfg_plain = AutoConfig.from_pretrained(assets)
    ids = torch.randint(0, cfg_plain.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = []
    for sd in ({**plain, **deq}, ref):
        model = LlamaForCausalLM(cfg_plain).float().eval()
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and all("rotary" in k for k in missing)
        with torch.no_grad():
            logits.append(model(ids).logits)
    # stated tolerance: FP8 block rounding (<= 3.6% of each block's amax per weight) moves the tiny
    # model's logits by less than 5% of their range
    diff = (logits[0] - logits[1]).abs().max().item()
    assert diff <= 0.05 * logits[1].abs().max().item(), diff


def test_fp8_bands_across_fsdp_chunks(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """4-rank FSDP chunks (4 rows each) and bands of 3 rows: bands span two stored chunks."""
    out = tmp_path / "fp8"
    r = _export(fsdp_ckpt, out, "--quantize-block", "3", "--weights", "params")
    sources = {k.removeprefix("model."): v for k, v in _torch_load(fsdp_ckpt).items() if k.startswith("model.")}
    n = _check_against_sources(out, sources, 3, r)
    assert n == 2  # model.layers.{0,1}.proj.weight (embed, lm_head kept; `odd` is not a *.weight)


def _tp_rank(rank: int, world: int, out: str) -> None:
    """A row-sharded (uneven, 19/18 rows) and a column-sharded (TP, uneven 19/18 columns) DTensor weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(77)
    rows = torch.randn(37, 40, generator=g).to(torch.bfloat16)
    cols = torch.randn(36, 37, generator=g)
    sd = {
        "model.model.layers.0.mlp.down_proj.weight": distribute_tensor(rows, mesh, [Shard(0)]),
        "model.model.layers.0.self_attn.o_proj.weight": distribute_tensor(cols, mesh, [Shard(1)]),
        "model.model.norm.weight": torch.ones(40),
    }
    dcp.save(sd, checkpoint_id=out)


@pytest.mark.heavy  # CI time
def test_fp8_uneven_row_and_column_shards(fixture_root: Path, tmp_path: Path) -> None:
    """2 gloo ranks: FSDP rows of uneven size (a band of 16 rows spans both) and TP column chunks."""
    from tests.fixtures.distributed import run_ranks

    src = cached_build(fixture_root, "export_fp8_tp", lambda out: run_ranks(2, _tp_rank, str(out)))
    md = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    assert all(len(md[k].chunks) == 2 for k in md if k.endswith("proj.weight"))
    r = _export(src, tmp_path / "fp8", "--quantize-block", "16")
    loaded = _torch_load(src)
    sources = {**{k.removeprefix("model."): v for k, v in loaded.items()}, **loaded}  # whichever keys the rules give
    assert _check_against_sources(tmp_path / "fp8", sources, 16, r) == 2


def test_quantize_skip_and_lm_head_kept(master_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    r = _export(
        master_ckpt,
        out,
        "--quantize-skip",
        "lm_head*",
        "--quantize-skip",
        "*.q_proj.weight",
        "--model-assets",
        str(master_ckpt / "model_assets"),
    )
    files = _file_tensors(out)
    assert files["lm_head.weight"].dtype == torch.bfloat16
    assert files["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in files
    assert files["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert r["quantization"]["quantized"] == 12
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        "model.layers.1.self_attn.q_proj" in qc["modules_to_not_convert"] and "lm_head" in qc["modules_to_not_convert"]
    )
    assert r["warnings"] == []  # both globs match an output tensor


def test_quantize_skip_matching_nothing_warns(master_ckpt: Path, tmp_path: Path) -> None:
    """A skip glob in the checkpoint's spelling ('model.model.layers.0.*') matched no output key and quantized
    every weight it was meant to keep, without a word; now a warning names the glob and an output key."""
    r = _export(master_ckpt, tmp_path / "fp8", "--quantize-skip", "model.model.layers.0.*")
    assert r["quantization"]["quantized"] == 14
    (w,) = r["warnings"]
    assert "`quantize_skip` 'model.model.layers.0.*' matches no output tensor" in w, w
    assert "e.g. 'model.layers.0." in w, w
    res = runner.invoke(
        app, ["export", str(master_ckpt), str(tmp_path / "cli"), "--quantize", "fp8-block", "--quantize-skip", "x*"]
    )
    assert res.exit_code == 0 and "warning: --quantize-skip 'x*' matches no output tensor" in res.stderr, res.stderr


def test_a_quantized_export_that_quantizes_nothing_says_so_and_writes_no_quantization_config(
    master_ckpt: Path, tmp_path: Path
) -> None:
    """--quantize with a --filter that selects only tensors kept unquantized by default (the embedding, lm_head):
    the export said nothing but "quantized 0 weight(s)", and its config.json edits listed a quantization_config
    "-> null" the model assets never had; now a warning says no weight was quantized, and the config is not
    given one. The folder holds no FP8 tensor and transformers loads it as the plain model."""
    assets = master_ckpt / "model_assets"
    for method, fmt in (("fp8-block", "fp8"), ("fp8-channel", "compressed-tensors")):
        out = tmp_path / method
        args = ["--quantize", method, "--quant-format", fmt, "--filter", "model.embed_tokens.*"]
        res = runner.invoke(app, ["export", str(master_ckpt), str(out), "--json", *args, "--model-assets", str(assets)])
        assert res.exit_code == 0, res.stderr
        r = json.loads(res.stdout)
        assert r["quantization"]["quantized"] == 0
        assert any(f"`quantize` {method}: none of the 1 tensor(s) written is quantized" in w for w in r["warnings"])
        assert "quantization_config" not in r["config_edits"], r["config_edits"]
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        assert {t.dtype for t in _file_tensors(out).values()} == {torch.bfloat16}


def test_a_dry_run_does_not_report_a_quantization_error_it_never_measured(master_ckpt: Path, tmp_path: Path) -> None:
    """--dry-run --quantize quantizes nothing, yet its summary said "max error 0 of the block amax" and its --json
    ``max_rel_error`` 0.0: a measured, perfect result for weights never quantized. Now ``max_rel_error`` is null
    and the summary says the error was not measured; the export itself measures it."""
    r = _export(master_ckpt, tmp_path / "dry", "--dry-run")
    assert r["dry_run"] and r["quantization"]["quantized"] == 14
    assert r["quantization"]["max_rel_error"] is None and r["quantization"]["tensors"] == {}
    assert not (tmp_path / "dry").exists()
    res = runner.invoke(
        app, ["export", str(master_ckpt), str(tmp_path / "dry"), "--quantize", "fp8-block", "--dry-run"]
    )
    assert res.exit_code == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("quantized")]
    assert "max error" not in line and "error not measured (dry run)" in line, line
    r = _export(master_ckpt, tmp_path / "done")
    assert 0 < r["quantization"]["max_rel_error"] <= r["quantization"]["max_rel_error_bound"]


def test_weights_from_masters_are_counted_without_their_scales(master_ckpt: Path, tmp_path: Path) -> None:
    """An FP8 export from FP32 masters said "weights 34 from FP32 master_weight" for a model of 21 parameters, 20
    with a master: each quantized weight's scale was counted (and listed in --json ``origins``) as a weight taken
    from a master. Now the origins are the weights: 20 from masters, the frozen norm from its parameter."""
    for method, fmt in (("fp8-block", "fp8"), ("fp8-channel", "compressed-tensors")):
        args = ["--quantize", method, "--quant-format", fmt]
        res = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / method), *args, "--json"])
        assert res.exit_code == 0, res.stderr
        r = json.loads(res.stdout)
        assert r["quantization"]["quantized"] == 14
        assert r["origins"]["master"]["count"] == 20 and r["origins"]["params"]["keys"] == ["model.norm.weight"]
        assert not [k for k in r["origins"]["master"]["keys"] if "scale" in k]
        human = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / f"{method}-h"), *args])
        assert "weights     20 from FP32 master_weight, 1 from stored parameters" in human.stdout, human.stdout


def test_quantize_with_lora_format_is_usage_error(master_ckpt: Path, tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["export", str(master_ckpt), str(tmp_path / "o"), "--format", "lora", "--quantize", "fp8-block"]
    )
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert "quantize" in res.stderr and not (tmp_path / "o").exists()
    res = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / "o"), "--quantize", "int4"])
    assert res.exit_code == 2 and "fp8-block" in res.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--quant-format", "compressed-tensors"], "--quant-format"),
        (["--quantize-block", "64"], "--quantize-block"),
        (["--quantize-skip", "*mlp*"], "--quantize-skip"),
    ],
)
def test_fp8_setting_without_quantize_is_refused(
    master_ckpt: Path, tmp_path: Path, flags: list[str], flag: str
) -> None:
    """An FP8 setting without --quantize was ignored: a full-precision export said 'exported' (exit 0)."""
    res = runner.invoke(app, ["export", str(master_ckpt), str(tmp_path / "o"), *flags])
    assert res.exit_code == 2 and not (tmp_path / "o").exists()
    assert res.stderr.splitlines() == [
        f"error: [E100] {flag} is given without --quantize: nothing would be quantized",
        f"hint: add --quantize fp8-block (or fp8-channel) for FP8 weights, or drop {flag}",
    ]


def test_a_block_size_beyond_32_bits_is_refused(master_ckpt: Path, tmp_path: Path) -> None:
    """A --quantize-block past 2^31 - 1 was written into config.json's weight_block_size, which readers hold in
    32-bit integers: E100 before anything is written."""
    big = str(2**63)
    res = runner.invoke(
        app, ["export", str(master_ckpt), str(tmp_path / "o"), "--quantize", "fp8-block", "--quantize-block", big]
    )
    assert res.exit_code == 2 and not (tmp_path / "o").exists(), res.output
    assert res.stderr.splitlines()[0] == f"error: [E100] --quantize-block {big} is larger than 2147483647 (2^31 - 1)"


def test_nan_weight_refused_nothing_published(tmp_path: Path) -> None:
    w = torch.randn(40, 24)
    w[33, 5] = float("nan")
    sd = {"model.model.layers.0.mlp.down_proj.weight": w, "model.model.norm.weight": torch.ones(24)}
    src = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "out"
    res = runner.invoke(app, ["export", str(src), str(out), "--quantize", "fp8-block", "--quantize-block", "16"])
    assert res.exit_code != 0 and "Traceback" not in res.stderr
    assert "error: [E607]" in res.stderr and "model.layers.0.mlp.down_proj.weight" in res.stderr, res.stderr
    assert "block (2, 0)" in res.stderr
    assert not out.exists() and not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("method", ["fp8-block", "fp8-channel"])
def test_nan_in_an_fp32_master_names_the_master_it_was_read_from(tmp_path: Path, method: str) -> None:
    """A NaN in a parameter's FP32 ``master_weight`` (quantized by default) was told as the parameter's own:
    ``model.layers.0.mlp.down_proj.weight: block (2, 0) holds NaN``, while the stored parameter holds none (torch's
    ``dcp.load`` of it). The error names the master it read and the hint ``--weights params``, which exports."""
    key = "model.layers.0.mlp.down_proj.weight"
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(8))
    master = w.clone()
    master[33, 5] = float("nan")
    state = {"step": torch.tensor(1.0), "master_weight": master, "exp_avg": torch.zeros(40, 24)}
    sd = {
        "model": {key: w.bfloat16(), "model.norm.weight": torch.ones(24)},
        "optimizer": {"state": {key: state}, "param_groups": [{"lr": 0.1, "params": [key]}]},
    }
    src = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    stored = {f"model.{key}": torch.empty(40, 24, dtype=torch.bfloat16)}
    dcp.load(stored, checkpoint_id=str(src), no_dist=True)
    assert not stored[f"model.{key}"].isnan().any()  # the reference: the parameter holds no NaN
    args = ["--quantize", method, *(["--quant-format", "compressed-tensors"] if method == "fp8-channel" else [])]
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "out"), *args])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    where = "row 33" if method == "fp8-channel" else "block (0, 0)"
    assert f"[E607] {key} (read from 'optimizer.state.{key}.master_weight'): {where} holds NaN" in res.stderr
    assert "--weights params" in res.stderr and not (tmp_path / "out").exists()
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "out"), *args, "--weights", "params"])
    assert res.exit_code == 0, res.stderr


def test_fp8_through_the_torchtitan_adapter_rope_rows(fixture_root: Path, tmp_path: Path) -> None:
    """torchtitan names: the RoPE q/k rows are moved while a band is read; bands of 4 rows cut through heads.

    Reference: the plain (unquantized, as stored) export of the same checkpoint, quantized by torch.
    """
    pytest.importorskip("torchtitan.models.llama3.state_dict_adapter", reason="torchtitan not installed")
    src = cached_build(fixture_root, "export_titan_named", hf_models.build_titan_named) / "llama_gqa"
    assets = ["--model-assets", str(src / "model_assets")]
    plain = tmp_path / "plain"
    res = runner.invoke(app, ["export", str(src), str(plain), *assets])
    assert res.exit_code == 0, res.stderr
    r = _export(src, tmp_path / "fp8", "--quantize-block", "4", *assets)
    assert r["model_adapter"] == "torchtitan-llama3"
    sources = _file_tensors(plain)
    n = _check_against_sources(tmp_path / "fp8", sources, 4, r)
    assert (
        n == r["quantization"]["quantized"] and "model.layers.0.self_attn.q_proj.weight" in r["quantization"]["tensors"]
    )


def test_zero_block_gets_scale_one_and_reads_back_as_zeros(tmp_path: Path) -> None:
    """An all-zero block: scale 1 (documented), FP8 zeros, torch's reader gives exact zeros; edge blocks padded."""
    w = torch.randn(40, 24)
    w[16:32, 0:16] = 0.0  # block (1, 0) of 16 x 16 blocks
    src = tmp_path / "ckpt"
    sd = {"model.model.layers.0.mlp.up_proj.weight": w, "model.model.norm.weight": torch.ones(24)}
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    r = _export(src, tmp_path / "out", "--quantize-block", "16")
    (name,) = r["quantization"]["tensors"]  # the output key the default rules give
    assert name.endswith("model.layers.0.mlp.up_proj.weight")
    assert r["quantization"]["tensors"][name]["zero_blocks"] == 1 and r["quantization"]["tensors"][name]["blocks"] == 6
    files = _file_tensors(tmp_path / "out")
    assert files[name + "_scale_inv"][1, 0].item() == 1.0
    assert _check_against_sources(tmp_path / "out", {name: w}, 16, r) == 1
    back = _torch_reader_load(tmp_path / "out", {name: w}, 16)[name]
    assert torch.equal(back[16:32, 0:16], torch.zeros(16, 16))


# ------------------------------------------------------------------------------------------ validate (M020)


def _validate(path: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", str(path), "--json", *args])
    assert "Traceback" not in res.stderr
    return res.exit_code, [f for f in json.loads(res.stdout)["findings"] if f["code"] == "M020"]


def _hf_folder(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_validate_fp8_export_and_hostile_scales(tmp_path: Path) -> None:
    w = torch.randn(40, 24)
    q, scale = _torch_reference(w, 16)
    good = {"model.layers.0.mlp.up_proj.weight": q, "model.layers.0.mlp.up_proj.weight_scale_inv": scale}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}))
    code, found = _validate(_hf_folder(tmp_path / "good", good), "--config", str(cfg))
    assert found == []
    code, found = _validate(tmp_path / "good")  # B = 128 by default: [1, 1] expected
    assert code != 0 and "needs [1, 1]" in found[0]["message"]
    cases = {
        "shape": ({**good, "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(2, 2)}, "needs [3, 2]"),
        "e8m0": (
            {**good, "model.layers.0.mlp.up_proj.weight_scale_inv": scale.to(torch.float8_e8m0fnu)},
            "float8_e8m0fnu, not float32",
        ),
        "orphan": ({**good, "model.layers.1.mlp.up_proj.weight_scale_inv": scale.clone()}, "for a missing weight"),
        "unscaled": ({"model.layers.0.mlp.up_proj.weight": q}, "no 'model.layers.0.mlp.up_proj.weight_scale_inv'"),
    }
    for name, (tensors, needle) in cases.items():
        code, found = _validate(_hf_folder(tmp_path / name, tensors), "--config", str(cfg))
        assert code != 0 and any(needle in f["message"] for f in found), (name, found)


def test_flipped_bit_in_a_quantized_source_is_e308_nothing_published(tmp_path: Path) -> None:
    """Bands read a record in pieces, so its CRC-32 is checked once before its rows are used (as a cast export)."""
    from tests.fixtures.damage import flip_value_bit

    key = "model.model.layers.0.mlp.down_proj.weight"
    sd = {key: torch.randn(40, 24), "model.model.norm.weight": torch.ones(24)}
    src = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    flip_value_bit(src, key)
    out = tmp_path / "out"
    args = ["export", str(src), str(out), "--quantize", "fp8-block", "--quantize-block", "16"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "[E308]" in res.stderr and "down_proj.weight" in res.stderr, res.stderr
    assert not out.exists() and not list(tmp_path.glob("out*"))
    res = runner.invoke(app, [*args, "--no-verify-crc"])
    assert res.exit_code == 0, res.stderr
    got = _file_tensors(out)
    assert got[key].dtype == torch.float8_e4m3fn, sorted(got)


def test_units_of_a_few_bands_check_each_record_from_their_reads(tmp_path: Path, monkeypatch: Any) -> None:
    """Units of two bands read a record in three pieces: the same bytes as one unit; a flipped mantissa bit in the last
    piece is E308 (the pieces' CRC-32 combined), a NaN there too (the record checked whole before the band's E607)."""
    from ckpttool.format.reader import CheckpointReader
    from ckpttool.ops.export import quantize
    from tests.fixtures.damage import flip_value_bit

    key = "model.model.layers.0.mlp.down_proj.weight"
    src = tmp_path / "ckpt"
    dcp.save(
        {key: torch.randn(96, 40), "model.model.norm.weight": torch.ones(24)}, checkpoint_id=str(src), no_dist=True
    )
    args = ["--quantize", "fp8-block", "--quantize-block", "16"]
    assert runner.invoke(app, ["export", str(src), str(tmp_path / "one"), *args]).exit_code == 0
    monkeypatch.setattr(quantize, "UNIT_BYTES", 2 * 16 * 40 * 4)  # 6 bands of 16 rows: 3 units
    res = runner.invoke(app, ["export", str(src), str(tmp_path / "three"), *args])
    assert res.exit_code == 0, res.stderr
    name = "model.safetensors"
    assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes()
    with CheckpointReader(src) as r:
        loc = r.locate(key, r.tensor_meta(key).chunks[0])
        path, nan_at = src / loc.info.relative_path, loc.data_start + 4 * 40 * 90
    original = path.read_bytes()
    flip_value_bit(src, key, at=4 * 40 * 80)  # the third unit's rows
    for damaged in ("bit", "nan"):
        if damaged == "nan":
            data = bytearray(original)
            data[nan_at : nan_at + 4] = np.array([np.nan], dtype=np.float32).tobytes()
            path.write_bytes(bytes(data))
        out = tmp_path / f"out_{damaged}"
        res = runner.invoke(app, ["export", str(src), str(out), *args])
        assert res.exit_code == 2 and "[E308]" in res.stderr and "Traceback" not in res.stderr, (damaged, res.stderr)
        assert not out.exists()


def test_nan_in_two_weights_names_the_first_in_the_plan(tmp_path: Path) -> None:
    """Two weights with a NaN: the error named whichever work unit failed first in time. The large
    first weight's NaN sits in its last 8 MiB unit, the small second weight's in its first row, so the
    second failed first at 2 workers and was named; now the first in the plan is, at every worker count."""
    big = torch.randn(4096, 2048)
    big[4095, 7] = float("nan")
    small = torch.randn(32, 32)
    small[0, 0] = float("nan")
    sd = {"model.model.layers.0.mlp.down_proj.weight": big, "model.model.layers.1.mlp.down_proj.weight": small}
    src = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    for workers in ("2", "1", "2"):
        out = tmp_path / f"out{workers}"
        res = runner.invoke(app, ["export", str(src), str(out), "--quantize", "fp8-block", "--workers", workers])
        assert res.exit_code != 0 and "Traceback" not in res.stderr
        first = res.stderr.splitlines()[0]
        assert first.startswith("error: [E607]") and "model.layers.0.mlp.down_proj.weight" in first, first
        assert "model.layers.1." not in res.stderr
        assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [("--save-dtype", "bfloat16"), ("--save-dtype", "float32"), ("--quantize", "fp8-block", "--quantize-block", "16")],
)
def test_casting_an_already_quantized_source_is_refused(
    master_ckpt: Path, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """An FP8 export exported again with a cast (or ``--quantize``) cast the float8 codes to BF16 without their
    scales ('float8_e4m3fn->bfloat16 x14', 'quantized 0 weight(s)'): every weight ~448x its value, and the
    ``weight_scale_inv`` tensors kept as BF16 strays, exit 0. Now E601 naming the weight and its scale; nothing
    is written. ``preserve`` still copies the folder bit for bit."""
    fp8 = tmp_path / "fp8"
    _export(master_ckpt, fp8, "--quantize-block", "16")
    src_files = {p.name: p.read_bytes() for p in fp8.iterdir() if p.is_file()}
    out = tmp_path / "again"
    res = runner.invoke(app, ["export", str(fp8), str(out), *args])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "error: [E601]" in res.stderr and "'model.layers.0.self_attn.q_proj.weight'" in res.stderr, res.stderr
    assert "q_proj.weight_scale_inv" in res.stderr and "ckpttool import" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".again*"))
    assert {p.name: p.read_bytes() for p in fp8.iterdir() if p.is_file()} == src_files
    res = runner.invoke(app, ["export", str(fp8), str(tmp_path / "copy")])
    assert res.exit_code == 0, res.stderr
    assert _file_tensors(tmp_path / "copy").keys() == _file_tensors(fp8).keys()


def test_an_fp8_folder_exported_as_stored_with_its_config_passes_the_model_check(
    master_ckpt: Path, tmp_path: Path
) -> None:
    """An FP8 folder exported again as stored, with its own config.json (``--model-assets``: the only way to keep
    the ``weight_block_size`` it needs), was E605: its ``weight_scale_inv`` tensors were "unexpected" keys of the
    model class, which only a ``--quantize`` export left out of the check. Now the scales of the float8 weights
    written are left out as well: the copy is the folder's tensors, bit for bit, beside the same config."""
    fp8 = tmp_path / "fp8"
    _export(master_ckpt, fp8, "--quantize-block", "16", "--model-assets", str(master_ckpt / "model_assets"))
    out = tmp_path / "copy"
    res = runner.invoke(app, ["export", str(fp8), str(out), "--model-assets", str(fp8), "--json"])
    assert res.exit_code == 0, res.stderr
    assert "unexpected" not in res.stderr
    assert json.loads(res.stdout)["model_check"]["findings"] == {}
    src, got = _file_tensors(fp8), _file_tensors(out)
    assert got.keys() == src.keys() and sum(k.endswith("_scale_inv") for k in got) == 14
    for k, v in src.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert json.loads((out / "config.json").read_text()) == json.loads((fp8 / "config.json").read_text())


def test_an_mxfp4_folder_exported_as_stored_is_checked_as_the_weights_it_holds(tmp_path: Path) -> None:
    """A gpt-oss MXFP4 folder exported as stored with its config.json was E605: ``x_blocks`` / ``x_scales``
    "unexpected" keys of GptOssForCausalLM. They are now compared as the ``x`` they dequantize to
    (``[E, G*2B, N]``, transformers' ``convert_moe_packed_tensors``): the right shape passes, a wrong one is E605
    naming ``x``."""
    from transformers import GptOssConfig

    from tests.ops.test_import_quantized import _write_folder

    cfg = GptOssConfig(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=128,
    ).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    p = "model.layers.0.mlp.experts."
    g = torch.Generator().manual_seed(1)
    t = {
        p + "gate_up_proj_blocks": torch.randint(0, 256, (2, 64, 2, 16), generator=g, dtype=torch.uint8),
        p + "gate_up_proj_scales": torch.full((2, 64, 2), 127, dtype=torch.uint8),
        p + "down_proj_blocks": torch.randint(0, 256, (2, 64, 1, 16), generator=g, dtype=torch.uint8),
        p + "down_proj_scales": torch.full((2, 64, 1), 127, dtype=torch.uint8),
    }
    src = _write_folder(tmp_path / "oss", t, cfg)
    res = runner.invoke(
        app,
        [
            "export",
            str(src),
            str(tmp_path / "out"),
            "--model-assets",
            str(src),
            "--allow-mismatch",
            "missing",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.stderr
    assert set(json.loads(res.stdout)["model_check"]["findings"]) == {"missing"}
    assert _file_tensors(tmp_path / "out").keys() == t.keys()
    t[p + "down_proj_blocks"] = t[p + "down_proj_blocks"][:, :32].contiguous()
    t[p + "down_proj_scales"] = t[p + "down_proj_scales"][:, :32].contiguous()
    src = _write_folder(tmp_path / "bad", t, cfg)
    res = runner.invoke(
        app, ["export", str(src), str(tmp_path / "o2"), "--model-assets", str(src), "--allow-mismatch", "missing"]
    )
    assert res.exit_code == 2 and "[E605]" in res.stderr and f"{p}down_proj: [2, 32, 32]" in res.stderr, res.stderr
    assert "unexpected" not in res.stderr


def test_fp8_export_notes_no_rounding_of_its_float32_scales(master_ckpt: Path, tmp_path: Path) -> None:
    """Every ``--quantize fp8-block --model-assets`` export noted that ``from_pretrained(dtype="auto")`` rounds its
    float32 ``weight_scale_inv`` tensors to bfloat16 and advised ``dtype=torch.float32``: transformers' FP8Linear
    allocates those scales float32 and its loader keeps a pre-quantized parameter's own dtype, so nothing is rounded.
    The note now leaves them out (a float32 tensor of another name still gets it)."""
    from ckpttool.format.safetensors import HeaderEntry
    from ckpttool.ops.export.serving import rounded_on_load

    r = _export(
        master_ckpt, tmp_path / "fp8", "--quantize-block", "16", "--model-assets", str(master_ckpt / "model_assets")
    )
    assert r["quantization"]["quantized"] == 14
    assert not [n for n in r["notes"] if "config.json names" in n], r["notes"]
    w, s = HeaderEntry("x.weight", "float8_e4m3fn", (4, 4)), HeaderEntry("x.weight_scale_inv", "float32", (1, 1))
    assert rounded_on_load("bfloat16", [w, s, HeaderEntry("n", "bfloat16", (9,))]) is None
    stray = rounded_on_load("bfloat16", [s, HeaderEntry("n", "bfloat16", (9,))])  # no float8 weight beside it
    assert stray is not None and "x.weight_scale_inv" in stray


@pytest.mark.parametrize("quant_format", ["fp8", "compressed-tensors"])
def test_tied_export_keeps_the_omitted_lm_head_out_of_the_conversion(
    fixture_root: Path, tmp_path: Path, quant_format: str
) -> None:
    """A tied model's export omits lm_head.weight, and its quantization_config listed only
    ``model.embed_tokens`` as not converted: transformers (a list given: no default lm_head skip) builds lm_head
    as an FP8Linear whose FP8 weight and scale the folder lacks (compressed-tensors' ``Linear`` target likewise).
    Now ``lm_head`` is listed too; transformers' own FineGrainedFP8 quantizer keeps it a plain Linear."""
    from transformers import AutoConfig

    src = cached_build(fixture_root, "export_llama_tied", hf_models.build_llama_tied)
    out = tmp_path / "q"
    args = ["--quantize-block", "16", "--quant-format", quant_format, "--model-assets", str(src / "model_assets")]
    r = _export(src, out, *args)
    assert r["tied_embeddings"] == "omitted"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert" if quant_format == "fp8" else "ignore"] == ["lm_head", "model.embed_tokens"]
    if quant_format != "fp8":
        return
    model = hf_models.fp8_meta_model(AutoConfig.from_pretrained(str(out)))
    assert type(model.lm_head).__name__ == "Linear"
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "FP8Linear"


def test_fp8_weight_exported_without_its_scale_is_refused(master_ckpt: Path, tmp_path: Path) -> None:
    """``--filter '*q_proj.weight'`` on an FP8 folder wrote the FP8 codes without their ``weight_scale_inv`` (exit 0):
    no reader can scale them. Now E601 naming the weight and the scale left out; a glob taking both exports."""
    fp8 = tmp_path / "fp8"
    _export(master_ckpt, fp8, "--quantize-block", "16")
    res = runner.invoke(app, ["export", str(fp8), str(tmp_path / "q"), "--filter", "*q_proj.weight"])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "error: [E601]" in res.stderr and "'model.layers.0.self_attn.q_proj.weight_scale_inv' is not exported" in (
        res.stderr
    )
    assert not (tmp_path / "q").exists()
    res = runner.invoke(app, ["export", str(fp8), str(tmp_path / "q"), "--filter", "*q_proj.weight*"])
    assert res.exit_code == 0, res.stderr
    assert sorted(_file_tensors(tmp_path / "q")) == [
        f"model.layers.{i}.self_attn.q_proj.weight{x}" for i in (0, 1) for x in ("", "_scale_inv")
    ]


def test_shared_expert_gate_stays_unquantized_by_default(tmp_path: Path) -> None:
    """Qwen2-MoE's ``mlp.shared_expert_gate.weight`` ``[1, H]`` (a gate, as the router) was quantized by default:
    vLLM builds it as a plain, unquantized linear and llm-compressor's MoE recipes ignore it. It is now left in
    BF16, like ``mlp.gate.weight``; the experts and the shared expert are still quantized."""
    import transformers

    from tests.fixtures.builders import save_quiet

    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    save_quiet({"model": model.state_dict()}, tmp_path / "ck")
    assets = tmp_path / "assets"
    cfg.save_pretrained(assets)
    res = runner.invoke(
        app, ["export", str(tmp_path / "ck"), str(tmp_path / "fp8"), "--quantize", "fp8-block", "--model-assets",
              str(assets), "--experts", "per-expert"],
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        gate = f.get_tensor("model.layers.0.mlp.shared_expert_gate.weight")
        shared = f.get_tensor("model.layers.0.mlp.shared_expert.up_proj.weight")
    assert gate.dtype == torch.bfloat16 and "model.layers.0.mlp.shared_expert_gate.weight_scale_inv" not in keys
    assert shared.dtype == torch.float8_e4m3fn and "model.layers.0.mlp.shared_expert.up_proj.weight_scale_inv" in keys
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.shared_expert_gate" in qc["modules_to_not_convert"]


def test_export_drops_an_fp8_quantization_config_it_writes_no_fp8_for(sample_ckpt: Path, tmp_path: Path) -> None:
    """Before: the --model-assets config of an FP8 base model (quant_method fp8, weight_block_size [64, 64]) was
    copied beside the BF16 export, which vLLM and transformers then read as block FP8 weights without scales."""
    import shutil

    assets = tmp_path / "assets"
    shutil.copytree(sample_ckpt / "model_assets", assets)
    cfg = json.loads((assets / "config.json").read_text())
    qc = {"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "dynamic"}
    (assets / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    res = runner.invoke(
        app, ["export", str(sample_ckpt), str(tmp_path / "hf"), "--model-assets", str(assets), "--json"]
    )
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["config_edits"]["quantization_config"] == [qc, None]
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_float64_weights_are_quantized_not_left_silently(tmp_path: Path) -> None:
    """A float64 2-D weight (a float64 training run, or a master copy saved in double) was written as bfloat16 by
    ``--quantize fp8-block`` while the summary counted only the other weights as quantized, and nothing said so.
    It is rounded to float32 and quantized now, as torch's ``(w / scale).to(torch.float8_e4m3fn)`` of it gives:
    torch's reference bytes and scales, torch's own quantized reader, the error bound."""
    g = torch.Generator().manual_seed(3)
    w64 = torch.randn(40, 24, generator=g, dtype=torch.float64)
    w32 = torch.randn(24, 40, generator=g)
    sd = {
        "model.model.layers.0.mlp.down_proj.weight": w64,
        "model.model.layers.0.mlp.up_proj.weight": w32,
        "model.model.norm.weight": torch.ones(24, dtype=torch.float64),
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    r = _export(tmp_path / "ckpt", tmp_path / "out", "--quantize-block", "16")
    names = sorted(r["quantization"]["tensors"])
    assert [n.rsplit(".", 2)[-2] for n in names] == ["down_proj", "up_proj"], names
    sources = {n: sd[n] for n in names}  # a top-level save: the output keys are the keys saved
    assert _check_against_sources(tmp_path / "out", sources, 16, r) == 2
    assert _file_tensors(tmp_path / "out")[names[0]].dtype == torch.float8_e4m3fn


def test_a_float64_value_beyond_float32_is_named_not_called_nan(tmp_path: Path) -> None:
    """A finite float64 value above float32's largest (1e39) rounds to infinity on the way to FP8: the export said
    the checkpoint's block "holds NaN or infinity" (it holds none, as torch reads it) and numpy's overflow warning
    leaked to stderr. The error names the value and the key now; no output is written."""
    w = torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    w[3, 7] = 1e39
    key = "model.model.layers.0.mlp.down_proj.weight"
    dcp.save(
        {key: w, "model.model.layers.0.mlp.up_proj.weight": torch.randn(32, 32)},
        checkpoint_id=str(tmp_path / "c"),
        no_dist=True,
    )
    sd = {key: torch.empty(32, 32, dtype=torch.float64)}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert bool(torch.isfinite(sd[key]).all()) and sd[key][3, 7].item() == 1e39  # the reference: no NaN, no inf
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = runner.invoke(app, ["export", str(tmp_path / "c"), str(tmp_path / "o"), "--quantize", "fp8-block"])
    assert res.exit_code == 2, (res.stdout, res.stderr)
    assert f"[E607] {key}: float64 value 1e+39 is beyond float32's range" in res.stderr
    assert "NaN" not in res.stderr and "Traceback" not in res.stderr and "RuntimeWarning" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_a_source_cut_short_while_it_is_quantized_is_one_coded_line_nothing_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data file cut short and written again once the export has checked the weight's chunk, while its units read
    from it, fails with one coded line naming the file (E300, a short read), exit 2, no traceback and no output
    published; a run the cuts missed writes the bytes of an undisturbed export."""
    import os
    import threading

    from ckpttool.format.reader import CheckpointReader

    key = "model.model.layers.0.mlp.down_proj.weight"
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    src = tmp_path / "ckpt"
    dcp.save({key: w, "model.model.norm.weight": torch.ones(8)}, checkpoint_id=str(src), no_dist=True)
    args = ["--quantize", "fp8-block"]
    assert runner.invoke(app, ["export", str(src), str(tmp_path / "ref"), *args]).exit_code == 0
    ref = (tmp_path / "ref" / "model.safetensors").read_bytes()
    (data_file,) = src.glob("*.distcp")
    data = data_file.read_bytes()
    fd = os.open(data_file, os.O_RDWR)
    stop, cutting, cycle = threading.Event(), threading.Event(), threading.Lock()
    located = CheckpointReader.locate

    def locate(self: CheckpointReader, k: str, c: Any) -> Any:
        loc = located(self, k, c)
        if k == key:
            cutting.set()  # the weight's chunk is checked: cut the file under its units from now on
        return loc

    def cut() -> None:
        while not stop.is_set():
            if cutting.wait(0.01):
                with cycle:
                    os.ftruncate(fd, 4096)
                    os.pwrite(fd, data[4096:], 4096)

    monkeypatch.setattr(CheckpointReader, "locate", locate)
    failed = 0
    t = threading.Thread(target=cut)
    t.start()
    try:
        for i in range(200):  # bounded by a count: until a run is cut short
            out = tmp_path / f"out{i}"
            res = runner.invoke(app, ["export", str(src), str(out), *args])
            cutting.clear()
            with cycle:  # the file whole again before the next run checks it
                pass
            if res.exit_code == 0:
                assert (out / "model.safetensors").read_bytes() == ref
                continue
            assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
            errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
            # E300 (a short read of the weight's rows); E301 where the norm's archive is checked while cut short
            assert len(errors) == 1 and errors[0].startswith(("error: [E300]", "error: [E301]")), res.stderr
            assert f"{data_file}: " in errors[0], res.stderr
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", "ref", *(f"out{j}" for j in range(i))])
            failed += 1
            break
    finally:
        stop.set()
        t.join()
        os.close(fd)
    assert failed
    assert data_file.read_bytes() == data


@pytest.mark.parametrize(
    "qc",
    [
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    ],
    ids=["awq", "bitsandbytes"],
)
def test_export_drops_any_quantization_config_it_writes_no_quantized_weight_for(
    sample_ckpt: Path, tmp_path: Path, qc: dict[str, Any]
) -> None:
    """The config of a quantized base model (AWQ; bitsandbytes, as a QLoRA run's) given as --model-assets was kept
    beside the BF16 export: transformers took the weights for packed AWQ / 4-bit ones and refused to load without
    that method's kernels (vLLM would read them as such). Only FP8 configs were dropped; now any is, where the
    export writes no quantized tensor. The export then loads with from_pretrained."""
    import shutil

    from transformers import AutoModelForCausalLM

    assets = tmp_path / "assets"
    shutil.copytree(sample_ckpt / "model_assets", assets)
    cfg = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(sample_ckpt), str(out), "--model-assets", str(assets), "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["config_edits"]["quantization_config"] == [qc, None]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Dots1ForCausalLM"


def test_an_fp8_folder_exported_without_its_quantization_config_warns_and_import_names_the_block_missing(
    master_ckpt: Path, tmp_path: Path
) -> None:
    """An FP8 folder (or a DCP of FP8 weights + block scales) exported as stored without a ``quantization_config``
    beside it said nothing of the ``weight_block_size`` it lost, and ``import`` of the copy was E612 "the quantized
    checkpoint is damaged". The export now warns (also in ``--json``), naming the block the scales' shapes give, and
    import's E612 says the block size is missing with a hint whose config imports the folder: to torch's own
    ``QuantizedHuggingFaceStorageReader`` values. A ``model_assets`` config.json with a ``quantization_config`` gets
    no warning."""
    from tests.ops.test_import_quantized import _check_against_reader
    from tests.ops.validate.test_validate_quantized import _fp8_dcp

    fp8 = tmp_path / "fp8"
    _export(master_ckpt, fp8, "--quantize-block", "16", "--model-assets", str(master_ckpt / "model_assets"))
    assets = master_ckpt / "model_assets"
    for name, args in (("bare", ()), ("plain", ("--model-assets", str(assets)))):
        res = runner.invoke(app, ["export", str(fp8), str(tmp_path / name), "--json", *args])
        assert res.exit_code == 0, res.stderr
        (w,) = [w for w in json.loads(res.stdout)["warnings"] if "quantization_config" in w]
        assert w.startswith("14 float8 weight(s) written as stored with block scales") and "[16, 16]" in w, w
        assert ("no config.json is written" if name == "bare" else "config.json, copied, has no") in w, w
    src = {p.name: p.read_bytes() for p in (tmp_path / "bare").iterdir()}
    res = runner.invoke(app, ["import", str(tmp_path / "bare"), str(tmp_path / "dcp")])
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    first, hint = res.stderr.splitlines()[:2]
    assert first.startswith("error: [E612]") and "no quantization_config.weight_block_size" in first, first
    assert "damaged" not in res.stderr and '"weight_block_size": [16, 16]' in hint, hint
    cfg = json.loads((assets / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}  # as the hint says
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["--config", str(tmp_path / "config.json"), "--dtype", "float32"]
    res = runner.invoke(app, ["import", str(tmp_path / "bare"), str(tmp_path / "dcp"), *args])
    assert res.exit_code == 0, res.stderr
    assert _check_against_reader(fp8, tmp_path / "dcp", torch.float32, 16) == 14
    assert {p.name: p.read_bytes() for p in (tmp_path / "bare").iterdir()} == src  # the source is never modified
    res = runner.invoke(app, ["export", str(fp8), str(tmp_path / "own"), "--json", "--model-assets", str(fp8)])
    assert res.exit_code == 0 and not [w for w in json.loads(res.stdout)["warnings"] if "quantization_config" in w]
    res = runner.invoke(app, ["export", str(_fp8_dcp(tmp_path / "dcp_fp8")), str(tmp_path / "from_dcp"), "--json"])
    assert res.exit_code == 0, res.stderr
    (w,) = [w for w in json.loads(res.stdout)["warnings"] if "quantization_config" in w]
    assert w.startswith("2 float8 weight(s)") and "weight_block_size [16, 16]" in w, w
