"""``inspect``'s ``model_adapter`` is the adapter ``export`` uses on the same names (no config: by the keys alone)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _torchtune_names(lora: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    m: dict[str, torch.Tensor] = {"tok_embeddings.weight": torch.randn(16, 8, generator=g), "norm.scale": torch.ones(8)}
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj", "output_proj"):
            m[f"layers.{i}.attn.{p}.weight"] = torch.randn(8, 8, generator=g)
        if lora:  # an unmerged LoRA save: keys torchtune-llama refuses (its foreign fragments)
            m[f"layers.{i}.attn.q_proj.lora_a.weight"] = torch.randn(2, 8, generator=g)
            m[f"layers.{i}.attn.q_proj.lora_b.weight"] = torch.randn(8, 2, generator=g)
        m[f"layers.{i}.sa_norm.scale"] = torch.ones(8)
        m[f"layers.{i}.mlp_norm.scale"] = torch.ones(8)
        for p in ("w1", "w2", "w3"):
            m[f"layers.{i}.mlp.{p}.weight"] = torch.randn(8, 8, generator=g)
    m["output.weight"] = torch.randn(16, 8, generator=g)
    return m


def test_inspect_names_the_adapter_export_uses(tmp_path: Path) -> None:
    """A torchtune-named save with LoRA keys: inspect said model_adapter torchtune-llama (it passed the fqns to the
    adapters for torchtitan names only, so torchtune-llama's refusal of `.lora_` keys was never asked) while export
    used none and wrote torchtune's names; both now say none, and a plain torchtune save still gets torchtune-llama
    (whose export asks for the config)."""
    for lora, want in ((True, None), (False, "torchtune-llama")):
        src = tmp_path / f"ck_{lora}"
        dcp.save({"model": _torchtune_names(lora)}, checkpoint_id=str(src))
        res = runner.invoke(app, ["inspect", "--json", str(src)])
        assert res.exit_code == 0, res.stderr
        doc = json.loads(res.stdout)
        assert (doc["key_schema"]["naming"], doc["model_adapter"]) == ("torchtune", want)
        out = runner.invoke(app, ["export", "--json", str(src), str(tmp_path / f"hf_{lora}"), "--format", "hf"])
        if want is None:  # export wrote the names as stored, with no adapter
            assert out.exit_code == 0, out.stderr
            assert json.loads(out.stdout)["model_adapter"] is None
        else:  # export went through torchtune-llama, which asks for the config's head counts
            assert out.exit_code == 2 and "the RoPE row permutation needs" in out.stderr, out.stderr
