"""gpt-oss experts (transformers' ``GptOssForCausalLM``: ``gate_up_proj`` ``[E, H, 2I]``, gate and up columns
interleaved, ``down_proj`` ``[E, I, H]``) saved by ``dcp.save``: exported fused they give transformers' own logits;
a per-expert split, whose cut assumes ``[E, 2I, H]`` / ``[E, H, I]``, is refused in one line, with or without a
``config.json``; so is Llama4's (``Llama4TextExperts``: the same layout, gate and up concatenated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.hf_models import llama4_config, save_tiny_causal_lm
from tests.ops.export.test_export_writers import assert_clean_failure

transformers = pytest.importorskip("transformers")
runner = CliRunner()
IDS = [[1, 2, 3, 4, 5, 6]]
TRANSPOSED = (
    "layout a per-expert split cuts (experts stored transposed, [E, H, 2I] / [E, I, H]: gate and up interleaved in "
    "gpt-oss, concatenated in Llama4)"
)


def _assert_transposed_refused(res: Any, out: Path) -> None:
    """E601 naming the gpt-oss experts' shapes and the transposed layout, the hint ``--experts fused``, nothing written."""
    assert_clean_failure(
        res,
        "E601",
        "model.model.layers.0.mlp.experts.gate_up_proj: [4, 32, 48] beside down_proj [4, 24, 32]",
        TRANSPOSED,
        "--experts fused",
    )
    assert not out.exists()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("gpt_oss")
    cfg = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    return save_tiny_causal_lm(transformers.GptOssForCausalLM, cfg, root, IDS)


def test_fused_export_gives_transformers_logits(gpt_oss: tuple[Path, Path, torch.Tensor], tmp_path: Path) -> None:
    ckpt, assets, ref = gpt_oss
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ckpt), str(out), "--model-assets", str(assets), "--experts", "fused"])
    assert res.exit_code == 0, res.output
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0), (logits - ref).abs().max()


def test_default_export_of_transposed_experts_does_not_point_to_a_split_it_refuses(
    gpt_oss: tuple[Path, Path, torch.Tensor], tmp_path: Path
) -> None:
    """Before: exit 0 with `note: 2 fused expert tensor(s) written as stored ... --experts per-expert writes those`,
    the split that is refused (E601) for these experts."""
    ckpt, assets, ref = gpt_oss
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ckpt), str(out), "--model-assets", str(assets)])
    assert res.exit_code == 0, res.output
    assert "per-expert" not in res.stderr, res.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0), (logits - ref).abs().max()


@pytest.mark.parametrize("glob", ["*.gate_up_proj", "*.down_proj"])
def test_a_filtered_export_of_one_transposed_half_does_not_point_to_a_split_it_refuses(
    gpt_oss: tuple[Path, Path, torch.Tensor], tmp_path: Path, glob: str
) -> None:
    """`--filter '*.gate_up_proj'` selects one half of a transposed pair: the note said `1 fused expert tensor(s)
    written as stored ... --experts per-expert writes those`, a split refused (E601) for these experts. The partner
    not selected is looked up in the checkpoint, as the refusal does: no note."""
    ckpt, assets, _ = gpt_oss
    res = runner.invoke(
        app, ["export", str(ckpt), str(tmp_path / "hf"), "--model-assets", str(assets), "--filter", glob]
    )
    assert res.exit_code == 0, res.output
    assert "per-expert" not in res.stderr, res.stderr
    split = runner.invoke(
        app,
        [
            "export",
            str(ckpt),
            str(tmp_path / "hf2"),
            "--model-assets",
            str(assets),
            "--filter",
            glob,
            "--experts",
            "per-expert",
        ],
    )
    # the per-expert split of either half alone is refused: a down_proj [E, I, H] cut per expert was written as
    # `experts.N.down_proj.weight` [I, H], transposed, with exit 0
    assert split.exit_code == 2 and "[E601]" in split.stderr, split.output
    assert not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("with_config", [True, False])
def test_per_expert_split_of_transposed_experts_is_refused(
    gpt_oss: tuple[Path, Path, torch.Tensor], tmp_path: Path, with_config: bool
) -> None:
    """Before: exit 0, ``experts.0.gate_proj.weight`` ``[16, 48]`` (half the hidden rows, gate and up columns
    mixed): a wrong layout written silently."""
    ckpt, assets, _ = gpt_oss
    out = tmp_path / "hf"
    args = ["export", str(ckpt), str(out), "--experts", "per-expert"]
    res = runner.invoke(app, args + (["--model-assets", str(assets)] if with_config else []))
    _assert_transposed_refused(res, out)


def test_per_expert_split_refused_when_filter_leaves_down_proj_out(
    gpt_oss: tuple[Path, Path, torch.Tensor], tmp_path: Path
) -> None:
    """Before: exit 0 with ``--filter '*gate_up_proj'`` (the down_proj it is checked beside not selected): the
    hidden dim cut in halves, wrong gate_proj/up_proj weights written."""
    ckpt, assets, _ = gpt_oss
    out = tmp_path / "hf"
    args = ["export", str(ckpt), str(out), "--experts", "per-expert", "--filter", "*gate_up_proj"]
    res = runner.invoke(app, args + ["--model-assets", str(assets)])
    _assert_transposed_refused(res, out)


def test_per_expert_split_of_llama4_experts_is_refused(tmp_path: Path) -> None:
    """transformers' ``Llama4ForCausalLM`` saved by ``dcp.save``: ``gate_up_proj`` ``[E, H, 2I]`` (gate and up
    concatenated) beside ``down_proj`` ``[E, I, H]``; the refusal describes the layout, not one model."""
    import torch.distributed.checkpoint as dcp

    cfg = llama4_config(layers=1)
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(cfg)
    dcp.save({"model": {k: v.contiguous() for k, v in model.state_dict().items()}}, checkpoint_id=str(tmp_path / "c"))
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(tmp_path / "c"), str(out), "--experts", "per-expert"])
    assert_clean_failure(
        res,
        "E601",
        "model.model.layers.0.feed_forward.experts.gate_up_proj: [4, 32, 48] beside down_proj [4, 24, 32]",
        TRANSPOSED,
        "--experts fused",
    )
    assert not out.exists()


@pytest.mark.parametrize("experts", [["--experts", "fused"], []])
def test_fused_export_of_llama4_experts_gives_transformers_logits(tmp_path: Path, experts: list[str]) -> None:
    """transformers' ``Llama4ForCausalLM`` (a MoE layer, ``gate_up_proj`` ``[E, H, 2I]`` gate and up concatenated,
    beside a dense one) saved by ``dcp.save``: exported fused (asked for or by default) it loads with
    ``from_pretrained`` and gives the source model's logits; no note points to the per-expert split it refuses."""
    cfg = llama4_config(layers=2)
    ckpt, assets, ref = save_tiny_causal_lm(transformers.Llama4ForCausalLM, cfg, tmp_path, IDS)
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ckpt), str(out), "--model-assets", str(assets), *experts])
    assert res.exit_code == 0, res.output
    assert "per-expert" not in res.stderr, res.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model) is transformers.Llama4ForCausalLM
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0), (logits - ref).abs().max()
