"""A parameter whose name ends like a non-persistent buffer is still a parameter (``M009``, ``D001``).

A ``Linear`` called ``attn`` has an ``attn.bias``: with optimizer state (a trained parameter) or
with one dim (not GPT-2's ``[1, 1, n, n]`` mask) it is not the buffer, and its NaN are ``D001``'s.
Checkpoints written by ``torch.distributed.checkpoint.save`` from a real model and ``AdamW``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _save(out: Path, *, optimizer: bool, edit: Any = None) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(8, 8)
            self.register_buffer("mask", torch.zeros(1))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x: Any) -> Any:
            for b in self.layers:
                x = torch.relu(b.attn(x))
            return x

    m = Model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(2):
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    msd = {k: v for k, v in msd.items() if not k.endswith("mask")}
    if edit is not None:
        edit(msd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd} if optimizer else {"model": msd}, checkpoint_id=str(out))
    return out


def _findings(ck: Path) -> tuple[int, list[tuple[str, str | None]]]:
    res = runner.invoke(app, ["validate", str(ck), "--deep", "--strict", "--json"])
    doc = json.loads(res.stdout)
    return res.exit_code, [(f["code"], f["key"]) for f in doc["findings"]]


def _nan_bias(msd: dict[str, Any]) -> None:
    msd["layers.1.attn.bias"][3] = float("nan")


def test_nan_in_a_trained_attn_bias_is_d001(tmp_path: Path) -> None:
    assert _findings(_save(tmp_path / "clean", optimizer=True)) == (0, [])  # no M009 on parameters
    rc, found = _findings(_save(tmp_path / "nan", optimizer=True, edit=_nan_bias))
    assert (rc, found) == (1, [("D001", "model.layers.1.attn.bias")])


def test_nan_in_a_one_dim_attn_bias_without_optimizer_is_d001(tmp_path: Path) -> None:
    rc, found = _findings(_save(tmp_path / "nan", optimizer=False, edit=_nan_bias))
    assert (rc, found) == (1, [("D001", "model.layers.1.attn.bias")])


def test_gpt2_style_attn_bias_mask_stays_a_buffer(tmp_path: Path) -> None:
    import torch

    def mask(msd: dict[str, Any]) -> None:
        msd["layers.0.attn.bias"] = torch.full((1, 1, 4, 4), float("-inf")).triu(1)  # a causal mask

    rc, found = _findings(_save(tmp_path / "mask", optimizer=False, edit=mask))
    assert (rc, found) == (0, [("M009", "model.layers.0.attn.bias")])


def _mask_model(out: Path, *, fill: float, token: bool = False) -> Path:
    """A model with a persistent additive causal mask (``register_buffer("causal_mask", full(-inf).triu(1))``,
    ``fill`` above the diagonal), trained 2 steps; ``token``: also a learned ``mask_token`` parameter holding -inf."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.q = nn.Linear(8, 8)
            self.register_buffer("causal_mask", torch.full((6, 6), float("-inf")).triu(1))
            self.mask_token = nn.Parameter(torch.zeros(8))

        def forward(self, x: Any) -> Any:
            h = self.emb(x) + self.mask_token
            return ((self.q(h) @ h.transpose(1, 2) + self.causal_mask).softmax(-1) @ h).sum()

    m = Model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(2):
        m(torch.randint(0, 16, (2, 6))).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        m.causal_mask.copy_(torch.full((6, 6), fill).triu(1))
        if token:
            m.mask_token[0] = float("-inf")
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))
    return out


def test_persistent_additive_mask_holding_minus_inf_is_no_divergence(tmp_path: Path) -> None:
    """-inf above the diagonal is what an additive causal mask holds: not D001 (an error saying training diverged).
    NaN or +inf in it, and -inf in a learned parameter named ``mask_token``, still are."""
    assert _findings(_mask_model(tmp_path / "mask", fill=float("-inf"))) == (0, [])
    for fill in (float("nan"), float("inf")):
        assert _findings(_mask_model(tmp_path / f"bad{fill}", fill=fill)) == (1, [("D001", "model.causal_mask")])
    rc, found = _findings(_mask_model(tmp_path / "token", fill=float("-inf"), token=True))
    assert (rc, found) == (1, [("D001", "model.mask_token")])
