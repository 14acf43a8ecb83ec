"""A model whose blocks were compiled in place (torchtitan-style ``model.layers[i] = torch.compile(block)``) saved with
``model.state_dict()`` (keys ``layers.0._orig_mod.attn.q.weight``) beside ``get_optimizer_state_dict`` (state keyed by
the clean fqn ``layers.0.attn.q.weight``: torch's ``_get_fqns`` drops the wrapper segments). torch resumes it; so every
command pairs the state with its wrapped model key (``Catalog.wrapped``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def _model() -> Any:
    import torch
    from torch import nn

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp, self.norm = Attn(), nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.mlp(self.attn(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.layers, self.out = nn.Linear(8, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.emb(x)
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    return Model()


@pytest.fixture(scope="module")
def compiled_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 AdamW steps, then each block compiled in place; saved with ``dcp.save({"model", "optimizer"})``."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    out = tmp_path_factory.mktemp("wrapped") / "ckpt"
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, opt, 2, loss="square")
    for i in range(2):
        model.layers[i] = torch.compile(model.layers[i])
    msd, osd = model.state_dict(), get_optimizer_state_dict(model, opt)
    assert "layers.0._orig_mod.attn.q.weight" in msd and "layers.0.attn.q.weight" in osd["state"]
    save_quiet({"model": msd, "optimizer": osd}, out)
    return out


def _resumed(ckpt: Path) -> tuple[Any, Any]:
    """The checkpoint loaded the way torch resumes it: into the same wrapped model, the optimizer through
    ``set_optimizer_state_dict``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # state to load into
    for i in range(2):
        model.layers[i] = torch.compile(model.layers[i])
    sd = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=str(ckpt))
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optimizer"])
    return model, opt


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    res = CliRunner().invoke(app, [*args, "--json"])
    return res.exit_code, json.loads(res.stdout)


def test_pair_wrapped_drops_only_wrapper_segments() -> None:
    from ckpttool.model.wrappers import pair_wrapped

    stored = ["layers.0._orig_mod.attn.w", "module.enc.module.w", "blk.module.x.w", "a.w", "dup._orig_mod.w"]
    orphans = ["layers.0.attn.w", "enc.module.w", "blk.x.w", "dup.w", "nothing.w"]
    assert pair_wrapped([*stored, "dup.module.w"], orphans) == {
        "layers.0.attn.w": "layers.0._orig_mod.attn.w",
        "enc.module.w": "module.enc.module.w",  # the real submodule named module is kept
        "blk.x.w": "blk.module.x.w",  # the optimizer's names prove this module is a wrapper
    }  # dup.w: two model tensors of that name, not paired
    assert pair_wrapped(["enc.module.w"], ["enc.other.w"]) == {}


def test_validate_is_clean_on_a_resumable_compiled_blocks_checkpoint(compiled_blocks: Path) -> None:
    model, opt = _resumed(compiled_blocks)  # torch resumes it: every parameter has its state
    assert len(opt.state) == 20 and all("exp_avg" in opt.state[p] for p in model.parameters())
    rc, doc = _cli("validate", str(compiled_blocks))
    assert rc == 0 and doc["findings"] == [], doc["findings"]


def test_replay_step_replays_every_wrapped_parameter_as_torch_adamw(compiled_blocks: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    model, opt = _resumed(compiled_blocks)
    names = {p: n for n, p in model.named_parameters()}
    torch.manual_seed(2)
    grads = {}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
        grads[names[p].replace("._orig_mod", "")] = p.grad.clone()
    save_file(grads, str(tmp_path / "grads.safetensors"))
    rc, doc = _cli("replay-step", str(compiled_blocks), "--grads", str(tmp_path / "grads.safetensors"))
    assert rc == 0 and doc["ok"] is True, doc
    assert doc["params_total"] == 20 and doc["params_failed"] == 0 and doc["params_skipped"] == [], doc
    rc, doc = _cli(
        "replay-step", str(compiled_blocks), "--grads", str(tmp_path / "grads.safetensors"), "--reference", "torch"
    )
    assert rc == 0 and doc["ok"] is True and doc["params_total"] == 20, doc


def test_stats_update_size_of_the_wrapped_parameters(compiled_blocks: Path) -> None:
    import torch

    model, opt = _resumed(compiled_blocks)
    rc, doc = _cli("stats", str(compiled_blocks))
    updates = {u["fqn"]: u for u in doc["checkpoints"][0]["updates"]}
    assert rc == 0 and len(updates) == 20, sorted(updates)
    tensor = next(t for t in doc["checkpoints"][0]["tensors"] if t["key"] == "model.layers.1._orig_mod.mlp.weight")
    assert tensor["fqn"] == "layers.1.mlp.weight" and tensor["module"] == "layers.*.mlp.weight", tensor
    for name, p in model.named_parameters():
        u = updates[name.replace("._orig_mod", "")]
        assert u["relative"] is not None, u
        assert u["relative"] == pytest.approx(
            u["rms"] * p.numel() ** 0.5 / float(torch.linalg.vector_norm(p)), rel=1e-4
        )


def test_replay_step_reads_gradients_keyed_by_the_compiled_models_own_names(
    compiled_blocks: Path, tmp_path: Path
) -> None:
    """``{n: p.grad for n, p in model.named_parameters()}`` of the compiled model keys the gradients
    ``layers.0._orig_mod.attn.q.weight``; each is the gradient of the parameter the optimizer names
    ``layers.0.attn.q.weight``, as torch.optim.AdamW steps it."""
    import torch
    from safetensors.torch import save_file

    model, _ = _resumed(compiled_blocks)
    torch.manual_seed(3)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    assert "layers.1._orig_mod.norm.weight" in grads
    save_file(grads, str(tmp_path / "grads.safetensors"))
    rc, doc = _cli(
        "replay-step", str(compiled_blocks), "--grads", str(tmp_path / "grads.safetensors"), "--reference", "torch"
    )
    assert rc == 0 and doc["ok"] is True and doc["params_total"] == 20 and doc["params_failed"] == 0, doc


def test_export_weights_master_takes_the_master_weight_of_the_wrapped_parameters(tmp_path: Path) -> None:
    """An FP32 ``master_weight`` in the state of each parameter (keyed by the optimizer's clean fqn) is exported for
    the compiled blocks' parameters too: it took their stored weights ("16 from stored parameters (no master)")."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for i in range(2):
        model.layers[i] = torch.compile(model.layers[i])
    msd, osd = model.state_dict(), get_optimizer_state_dict(model, opt)
    for name, p in model.named_parameters():
        osd["state"][name.replace("._orig_mod", "")]["master_weight"] = p.detach().float() + 1
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ckpt")
    rc, doc = _cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--weights", "master")
    assert rc == 0, doc
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "ref.pt"))
    state = torch.load(tmp_path / "ref.pt", weights_only=True)["optimizer"]["state"]
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(state) and len(out) == 20
    for fqn, t in out.items():
        assert torch.equal(t, state[fqn]["master_weight"]), fqn


def test_inspect_says_the_state_is_paired_with_wrapped_keys(compiled_blocks: Path) -> None:
    rc, doc = _cli("inspect", str(compiled_blocks))
    assert rc == 0 and doc["key_schema"]["reasons"][-1] == (
        "16 optimizer fqn(s) paired with the model key that adds wrapper segments to it (layers.0.attn.q.weight -> "
        "model.layers.0._orig_mod.attn.q.weight: a block compiled or wrapped in place)"
    ), doc["key_schema"]
    opt = doc["optimizer"]
    assert opt["orphan_state"] == [] and opt["params_without_state"] == [] and opt["params_with_state"] == 20, opt
    assert "model.layers.1._orig_mod.norm.bias" in {t["key"] for t in doc["model"]}  # the stored keys, as saved


def test_replay_step_filter_matches_the_stored_wrapped_key(compiled_blocks: Path) -> None:
    """``--filter`` matches checkpoint keys: ``model.layers.0._orig_mod.*`` is the first block's parameters (E100
    "matches none of the 20 parameter(s)" before), as its clean name ``model.layers.0.*`` is."""
    for glob in ("model.layers.0._orig_mod.*", "layers.0.*"):
        rc, doc = _cli("replay-step", str(compiled_blocks), "--filter", glob, "--reference", "torch")
        assert rc == 0 and doc["ok"] is True and doc["params_total"] == 8, (glob, doc)
