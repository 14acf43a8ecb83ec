"""``export --format hf-merged`` (``--merge-lora``) of factors whose merge is not finite.

``W + s * B @ A`` is computed in float32 and written in ``W``'s dtype. A ``lora_alpha`` of 3e38 (an adapter config
or ``--lora-alpha`` typed wrong), a ``lora_B`` of 1e38 values in a hostile checkpoint, or a sum that bfloat16 rounds
past its largest finite value made infinite weights, written with exit 0 (a float16 ``W`` was refused, by the
cast's own check). Each is E601 naming the base weight, with nothing written and the source untouched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
P = "base_model.model.model.layers.0.self_attn.q_proj"


def _ckpt(root: Path, case: str) -> tuple[Path, float]:
    """A PEFT-named LoRA checkpoint saved by ``dcp.save`` and the lora_alpha of ``case`` (r = 4)."""
    g = torch.Generator().manual_seed(0)
    w, a, b = torch.randn(16, 16, generator=g), torch.randn(4, 16, generator=g), torch.randn(16, 4, generator=g)
    alpha, dtype = 16.0, torch.float32
    if case == "alpha-3e38":
        alpha = 3e38
    elif case == "lora-b-1e38":
        b = b * 1e38
    else:  # bf16 W at its largest finite value + 8e35: finite in float32, rounded to infinity in bfloat16
        dtype = torch.bfloat16
        w, a, b, alpha = torch.full((16, 16), torch.finfo(dtype).max), torch.ones(4, 16), torch.full((16, 4), 1e35), 8.0
    sd = {
        f"{P}.base_layer.weight": w.to(dtype),
        f"{P}.lora_A.default.weight": a.to(dtype),
        f"{P}.lora_B.default.weight": b.to(dtype),
        "base_model.model.model.norm.weight": torch.ones(16, dtype=dtype),
    }
    dcp.save({"model": sd}, checkpoint_id=str(root))
    return root, alpha


def _digest(d: Path) -> str:
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(d.iterdir()))).hexdigest()


@pytest.mark.parametrize("case", ["alpha-3e38", "lora-b-1e38", "bf16-rounds-to-inf"])
def test_a_merge_that_is_not_finite_is_refused(tmp_path: Path, case: str) -> None:
    src, alpha = _ckpt(tmp_path / "src", case)
    before = _digest(src)
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": alpha, "target_modules": ["q_proj"]}))
    out = tmp_path / "merged"
    res = runner.invoke(app, ["export", str(src), str(out), "--format", "hf-merged", "--adapter-config", str(cfg)])
    assert res.exit_code == 2, res.output
    first = res.stderr.splitlines()[0]
    if case == "bf16-rounds-to-inf":  # finite in float32: the cast to bfloat16 refuses it, as every such cast
        assert first.startswith(f"error: [E601] model.{P}.base_layer.weight: finite float32 value(s) beyond "), first
        assert "bfloat16's range" in first and "Traceback" not in res.stderr
    else:
        assert first.startswith(f"error: [E601] model.{P}.base_layer.weight: the LoRA merge W + s * B @ A at ["), first
        assert "not finite as" in first and "Traceback" not in res.stderr
    assert not out.exists() and _digest(src) == before

    if case == "alpha-3e38":  # the same factors at a sane lora_alpha merge: the refusal is the overflow's
        res = runner.invoke(
            app, ["export", str(src), str(tmp_path / "ok"), "--format", "hf-merged", "--lora-alpha", "16"]
        )
        assert res.exit_code == 0, res.output
