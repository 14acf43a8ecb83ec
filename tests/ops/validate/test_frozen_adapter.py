"""Rule ``O009`` on a DCP save of an adapter setup: the frozen base weights a LoRA recipe passes to its
optimizer never get state (never stepped, not lost state: ``K021``, info); a trainable parameter whose state
was dropped still fails (``O009``, and ``replay-step`` refuses it with ``E513``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()
BASE = [
    "layers.0.wq.weight",
    "layers.0.wv.weight",
    "layers.1.wq.weight",
    "layers.1.wv.weight",
    "norm.bias",
    "norm.weight",
    "output.weight",
    "tok_embeddings.weight",
]


class _LoRALinear(nn.Module):  # torchtune's LoRALinear: a frozen base weight, trainable lora_a / lora_b
    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) * 0.1)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.lora_b(self.lora_a(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.ModuleDict({"wq": _LoRALinear(16), "wv": _LoRALinear(16)}) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 32, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(t)
        for layer in self.layers:
            h = h + layer["wq"](h) + layer["wv"](h)
        return self.output(self.norm(h))


def _save(out: Path, trainable: Any, drop: str | None = None) -> Path:
    """AdamW over *all* parameters (frozen ones included, as torchtune's LoRA recipes build it), one step,
    ``get_state_dict`` + ``dcp.save``; ``drop``: a parameter whose optimizer state is removed before the save."""
    torch.manual_seed(0)
    model = _Model()
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 32, (2, 8))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    if drop is not None:
        del osd["state"][drop]
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))
    return out


def _validate(ck: Path) -> tuple[int, list[dict[str, Any]]]:
    res = runner.invoke(app, ["validate", str(ck), "--strict", "--json"])
    return res.exit_code, json.loads(res.stdout)["findings"]


def test_frozen_base_weights_of_a_lora_setup_are_not_lost_state(tmp_path: Path) -> None:
    """They failed O009 (error): "tok_embeddings.weight and 7 more have no optimizer state, the group stepped"."""
    ck = _save(tmp_path / "lora", lambda name: "lora_" in name)
    rc, findings = _validate(ck)
    assert rc == 0 and [(f["code"], f["severity"], f["key"]) for f in findings] == [
        ("K021", "info", "tok_embeddings.weight")
    ]
    assert findings[0]["message"] == (
        "8 frozen base weight(s) of an adapter setup, no optimizer state (in param groups whose only parameters "
        "with state are LoRA/DoRA adapter parameters): tok_embeddings.weight, layers.0.wq.weight, "
        "layers.0.wv.weight, layers.1.wq.weight and 4 more"
    )
    res = runner.invoke(app, ["replay-step", str(ck), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert sorted(doc["params_frozen"]) == BASE and len(doc["params"]) == 8


def test_a_trainable_parameter_whose_state_was_dropped_still_fails(tmp_path: Path) -> None:
    lost = "layers.1.wv.lora_b.weight"
    ck = _save(tmp_path / "lora", lambda name: "lora_" in name, drop=lost)
    rc, findings = _validate(ck)
    o009 = [f for f in findings if f["code"] == "O009"]
    assert rc == 1 and [(f["key"], f["fails"]) for f in o009] == [(lost, True)], findings
    assert o009[0]["message"] == f"param group 0: {lost} has no optimizer state, the group stepped"
    res = runner.invoke(app, ["replay-step", str(ck), "--device", "cpu"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: [E513] parameter {lost} has no optimizer state")


def test_without_adapter_parameters_a_parameter_without_state_fails(tmp_path: Path) -> None:
    """No adapter names: nothing in the checkpoint tells a frozen parameter from one whose state was dropped."""
    ck = _save(tmp_path / "plain", lambda name: name != "tok_embeddings.weight")
    rc, findings = _validate(ck)
    assert rc == 1 and [(f["code"], f["key"]) for f in findings if f["fails"]] == [("O009", "tok_embeddings.weight")]
