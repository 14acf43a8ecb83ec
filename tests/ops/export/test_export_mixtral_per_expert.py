"""A Mixtral (transformers' ``MixtralForCausalLM``, fused experts ``gate_up_proj`` ``[E, 2I, H]``) saved by
``dcp.save`` and exported ``--experts per-expert``: with its ``config.json`` the experts take Mixtral's names and
give transformers' logits; without one the split takes the ``gate_proj``/``up_proj`` names Mixtral's loader leaves
unloaded, and a note says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.hf_models import save_tiny_causal_lm

transformers = pytest.importorskip("transformers")
runner = CliRunner()
IDS = [[1, 2, 3, 4, 5, 6]]
NOTE = "a Mixtral (MiniMax, PhiMoE) loader reads block_sparse_moe.experts.N.w1/w3/w2.weight"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("mixtral")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return save_tiny_causal_lm(transformers.MixtralForCausalLM, cfg, root, IDS)


def test_with_config_mixtral_names_give_transformers_logits(
    mixtral: tuple[Path, Path, torch.Tensor], tmp_path: Path
) -> None:
    ckpt, assets, ref = mixtral
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ckpt), str(out), "--model-assets", str(assets), "--experts", "per-expert"])
    assert res.exit_code == 0, res.output
    assert NOTE not in res.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0), (logits - ref).abs().max()


def test_without_config_the_names_are_said_to_be_no_mixtrals(
    mixtral: tuple[Path, Path, torch.Tensor], tmp_path: Path
) -> None:
    """Before: exit 0 and only the note that no config.json was written; Mixtral's loader (config.json copied in
    afterwards) left every expert at random (its per-expert names are w1/w3/w2), logits differing by 0.04."""
    from safetensors import safe_open

    ckpt, _, _ = mixtral
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ckpt), str(out), "--experts", "per-expert"])
    assert res.exit_code == 0, res.output
    assert NOTE in " ".join(res.stderr.split()), res.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in f.keys()
