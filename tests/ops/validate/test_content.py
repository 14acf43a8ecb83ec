"""`validate --deep` content rules on real saves, damaged the way the real bugs do it.

- ``D009``: one EP rank's expert slice written for every rank (a 4-rank EP DTensor save,
  tests/fixtures/moe_ep.py; torchtitan's qwen3 MoE under FSDP2); silent on the clean saves and
  on an upcycled MoE saved at step 0 (every expert a copy of the dense MLP, optimizer state
  torch synthesized before the first step).
- ``D010``: a layer written as a copy of another (torchtitan llama3 ``CheckpointManager`` save).
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
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs

runner = CliRunner()


def run(*args: Any) -> tuple[int, dict[str, Any]]:
    res = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert res.stdout.strip(), (res.exit_code, res.stderr)
    return res.exit_code, json.loads(res.stdout)


def findings(doc: dict[str, Any], code: str) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["code"] == code]


def _rank0_for_all(key: str, blocks: int) -> Any:
    """Every EP rank's block of experts replaced by rank 0's (the save wrote one rank's slice for all)."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        per = t.shape[0] // blocks
        return torch.cat([t[:per]] * blocks)

    return fn


def test_ep_rank_slice_written_for_all(ep_suite: Path, tmp_path: Path) -> None:
    src = ep_suite / "canonical"  # EP 2 x EP-FSDP 2, experts on dim 0, 8 experts
    rc, doc = run(src, "--deep", "--strict", "--ignore", "L003")
    assert rc == 0 and not findings(doc, "D009"), doc["findings"]
    ck = copy_checkpoint(src, tmp_path / "ck")
    key = "model.model.layers.1.mlp.experts.down_proj"
    for k in [
        k
        for k in damage.load_md(src).state_dict_metadata
        if k.startswith(
            ("model.layers.1.mlp.experts.down_proj", "optimizer.state.model.layers.1.mlp.experts.down_proj.")
        )
        or k == key
    ]:
        if not k.endswith(".step"):  # parameter, master_weight and moments: the rank's whole slice
            damage.rewrite_tensor(ck, k, _rank0_for_all(k, 2))
    rc, doc = run(ck, "--deep", "--ignore", "L003")
    assert rc == 0 and [f["key"] for f in findings(doc, "D009")] == [key]  # a warning
    msg = findings(doc, "D009")[0]["message"]
    assert "8 of 8 expert slices" in msg and "experts 0, 4; experts 1, 5; experts 2, 6 (+1 more groups)" in msg
    assert "upcycling" in findings(doc, "D009")[0]["hint"]
    rc, doc = run(ck, "--deep", "--strict", "--ignore", "L003")
    assert rc == 1


def test_expert_copy_under_ep_fsdp_on_dim_1(ep_suite: Path, tmp_path: Path) -> None:
    """EP-FSDP shards dim 1 ([4, 4, 5] and uneven [4, 3, 4] / [4, 2, 4] chunks): each expert's rows are still compared."""
    src = ep_suite / "legacy_dim1"
    rc, doc = run(src, "--deep", "--strict", "--ignore", "L003")
    assert rc == 0 and not findings(doc, "D009"), doc["findings"]
    ck = copy_checkpoint(src, tmp_path / "ck")

    def copy_1_to_6(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[6] = t[1]
        return t

    for key in ("model.model.layers.0.mlp.experts.gate_up_proj", "model.model.layers.1.mlp.experts.down_proj"):
        damage.rewrite_tensor(ck, key, copy_1_to_6)
    rc, doc = run(ck, "--deep", "--strict", "--ignore", "L003")
    assert rc == 1
    assert [(f["key"], f["message"].split(": ", 1)[1]) for f in findings(doc, "D009")] == [
        (k, "2 of 8 expert slices are bitwise copies of another: experts 1, 6")
        for k in ("model.model.layers.0.mlp.experts.gate_up_proj", "model.model.layers.1.mlp.experts.down_proj")
    ]


def test_ep_rank_moments_written_for_all_while_the_parameter_is_right(ep_suite: Path, tmp_path: Path) -> None:
    """A save that wrote EP rank 0's exp_avg/exp_avg_sq slice for every EP rank (the parameter itself intact): the
    resume would step experts 4..7 with experts 0..3's moments. Experts that never got a gradient (all-zero
    moments, equal to each other) are not copies."""
    src = ep_suite / "legacy_dim1"  # EP-FSDP on dim 1: each expert's rows in two ranks' chunks
    ck = copy_checkpoint(src, tmp_path / "ck")
    base = "optimizer.state.model.layers.0.mlp.experts.down_proj"
    for fld in ("exp_avg", "exp_avg_sq"):
        damage.rewrite_tensor(ck, f"{base}.{fld}", _rank0_for_all(f"{base}.{fld}", 2))

    def dead_experts(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[5:8] = 0
        return t

    dead = "optimizer.state.model.layers.1.mlp.experts.gate_up_proj"
    for fld in ("exp_avg", "exp_avg_sq"):
        damage.rewrite_tensor(ck, f"{dead}.{fld}", dead_experts)
    rc, doc = run(ck, "--deep", "--strict", "--ignore", "L003")
    assert rc == 1
    assert [(f["key"], f["message"].split(": ", 1)[1]) for f in findings(doc, "D009")] == [
        (
            f"{base}.{fld}",
            "8 of 8 expert slices are bitwise copies of another: experts 0, 4; experts 1, 5; experts 2, 6 (+1 more groups)",
        )
        for fld in ("exp_avg", "exp_avg_sq")
    ], doc["findings"]


def test_copies_in_a_legacy_layout_name_the_true_experts(ep_suite: Path, tmp_path: Path) -> None:
    """A legacy (ep_fsdp, ep) save with FSDP on the expert dim stores slab ``f*P + e`` at the place of true slab
    ``e*F + f`` (docs/layouts.md): stored experts 4 and 7 of P=2, F=2 are the model's experts 2 and 7."""
    ck = copy_checkpoint(ep_suite / "legacy", tmp_path / "ck")
    key = "model.model.layers.0.mlp.experts.down_proj"

    def stored_4_to_7(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[7] = t[4]
        return t

    damage.rewrite_tensor(ck, key, stored_4_to_7)
    decl = ["--ep-size", "2", "--ep-fsdp-size", "2"]
    rc, doc = run(ck, "--deep", "--source-layout", "legacy", *decl)
    assert [f["message"].split(": ", 1)[1] for f in findings(doc, "D009")] == [
        "2 of 8 expert slices are bitwise copies of another: experts 2, 7"
    ], doc["findings"]
    rc, doc = run(ck, "--deep", "--source-layout", "canonical", *decl)  # stored in true order: the same places
    assert [f["message"].split(": ", 1)[1] for f in findings(doc, "D009")] == [
        "2 of 8 expert slices are bitwise copies of another: experts 4, 7"
    ], doc["findings"]


def test_torchtitan_moe_expert_copies(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "moe" / "checkpoint" / "step-1"
    ck = copy_checkpoint(src, tmp_path / "ck")
    key = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
    for k in (key, f"optimizer.state.{key}.exp_avg", f"optimizer.state.{key}.exp_avg_sq"):
        damage.rewrite_tensor(ck, k, _rank0_for_all(k, 2))  # the 2 FSDP2 ranks' Shard(0) halves
    rc, doc = run(ck, "--deep", "--strict")
    assert rc == 1 and [f["key"] for f in findings(doc, "D009")] == [key], doc["findings"]
    rc, doc = run(src, "--deep")
    assert not findings(doc, "D013"), doc["findings"]  # a trained MoE (FSDP2, torchtitan)


def test_upcycled_moe_at_step_0_is_silent(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class Moe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            dense_up, dense_down = torch.randn(8, 6) * 0.1, torch.randn(6, 4) * 0.1
            self.gate = torch.nn.Linear(6, 4, bias=False)
            self.gate_up_proj = torch.nn.Parameter(dense_up.expand(4, 8, 6).clone())  # sparse upcycling
            self.down_proj = torch.nn.Parameter(dense_down.expand(4, 6, 4).clone())

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"experts": Moe()})])

    m = Model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    msd, osd = get_state_dict(m, opt)  # before the first step: state torch synthesizes
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "step-0"))
    rc, doc = run(tmp_path / "step-0", "--deep")
    assert not findings(doc, "D009") and not findings(doc, "D013"), doc["findings"]
    assert {f["code"] for f in doc["findings"]} <= {"D005"}


def test_layer_written_as_a_copy_of_another(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "llama3" / "checkpoint" / "step-2"
    ck = copy_checkpoint(src, tmp_path / "ck")
    for key in [k for k in damage.load_md(src).state_dict_metadata if k.startswith("layers.1.")]:
        damage.rewrite_tensor(
            ck, key, lambda _t, key=key: damage.read_tensor(src, key.replace("layers.1.", "layers.0."))
        )
    rc, doc = run(ck, "--deep", "--strict")
    assert rc == 1 and [f["key"] for f in findings(doc, "D010")] == ["layers.1"], doc["findings"]
    assert "identical to layers.0.*" in findings(doc, "D010")[0]["message"]
    rc, doc = run(src, "--deep", "--strict")
    assert not findings(doc, "D010") and not findings(doc, "D009") and not findings(doc, "D013")


def test_all_zero_weight_in_a_trained_save(titan_root: Path, tmp_path: Path) -> None:
    src = titan_root / "llama3" / "checkpoint" / "step-2"
    ck = copy_checkpoint(src, tmp_path / "ck")
    damage.rewrite_tensor(ck, "layers.1.feed_forward.w2.weight", torch.zeros_like)  # never materialised
    rc, doc = run(ck, "--deep", "--strict")
    assert rc == 1 and [f["key"] for f in findings(doc, "D011")] == ["layers.1.feed_forward.w2.weight"]


def test_lora_at_init_is_silent(tmp_path: Path) -> None:
    """PEFT's LoRA initialises lora_B to zero; one real AdamW step later it is not zero, and nothing is reported."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.ModuleDict(
        {
            "base": torch.nn.Linear(8, 8),
            "lora_A": torch.nn.Linear(8, 2, bias=False),
            "lora_B": torch.nn.Linear(2, 8, bias=False),
        }
    )
    torch.nn.init.zeros_(m["lora_B"].weight)
    m["base"].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "init"))
    rc, doc = run(tmp_path / "init", "--deep")
    assert not findings(doc, "D011") and not findings(doc, "D010") and not findings(doc, "D013"), doc["findings"]
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    assert m["lora_B"].weight.abs().max() > 0  # one real step moved lora_B off zero
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "step-1"))
    rc, doc = run(tmp_path / "step-1", "--deep", "--strict")
    assert rc == 0, doc["findings"]


@pytest.mark.parametrize("shared", [True, False])
def test_one_module_used_at_two_depths_is_not_a_copied_layer(tmp_path: Path, shared: bool) -> None:
    """A clean run whose model uses one block at every depth (ALBERT-style sharing: nn.ModuleList([block] * 2))
    failed `validate --deep --strict` with D010 'model.layers.1.*: every tensor is bitwise identical to
    model.layers.0.*': state_dict keeps both names of the one parameter set, named_parameters (so the optimizer
    state) only layers.0. Separate layers, each with its own state, written as copies are still D010."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    blocks = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    model = torch.nn.ModuleDict(
        {"embed": torch.nn.Embedding(16, 8), "layers": torch.nn.ModuleList([blocks[0]] * 2 if shared else blocks)}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        h = model["embed"](torch.randint(0, 16, (4,)))
        for layer in model["layers"]:
            h = layer(h).tanh()
        h.pow(2).sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    assert ("layers.1.weight" in osd["state"]) is not shared
    if not shared:  # a save that wrote layer 0 for layer 1
        msd = {
            k: (msd[k.replace("layers.1.", "layers.0.")] if k.startswith("layers.1.") else v) for k, v in msd.items()
        }
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ck"))
    rc, doc = run(tmp_path / "ck", "--deep", "--strict")
    if shared:
        assert rc == 0 and doc["findings"] == [], doc["findings"]
    else:
        assert rc == 1 and [f["key"] for f in findings(doc, "D010")] == ["model.layers.1"], doc["findings"]


class _Top1Moe(torch.nn.Module):
    """Sparse-upcycled experts (every expert a copy of one dense MLP), top-1 routing: fused ``[E, ...]`` expert
    parameters, or per-expert ``experts.N.weight`` ones."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        dense = torch.randn(6, 6) * 0.3
        self.gate = torch.nn.Linear(6, 4, bias=False)
        with torch.no_grad():
            self.gate.weight[2:] = -5.0  # experts 2 and 3 get no token
        self.fused = fused
        if fused:
            self.experts = torch.nn.Parameter(dense.expand(4, 6, 6).clone())
        else:
            self.experts = torch.nn.ModuleList(torch.nn.Linear(6, 6, bias=False) for _ in range(4))
            for lin in self.experts:
                lin.weight.data.copy_(dense)

    def weight(self, e: int) -> torch.Tensor:
        return self.experts[e] if self.fused else self.experts[e].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        idx = probs.argmax(-1)
        return torch.stack([probs[i, e] * (x[i] @ self.weight(int(e)).T) for i, e in enumerate(idx)])


def _upcycled_moe_after_three_steps(fused: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict`` of an upcycled top-1 MoE after three AdamW steps whose experts 2 and 3 got no token (still
    the step-0 copies, moments all zero) while experts 0 and 1 trained apart."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": _Top1Moe(fused)})])})
    moe = model["layers"][0]["mlp"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        moe(torch.randn(16, 6, generator=gen).abs()).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(moe.weight(2), moe.weight(3)) and not torch.equal(moe.weight(0), moe.weight(1))
    return get_state_dict(model, opt)


@pytest.mark.parametrize("fused", [True, False])
def test_upcycled_moe_whose_unrouted_experts_are_still_copies(tmp_path: Path, fused: bool) -> None:
    """An upcycled MoE a few steps in, two experts never routed to: their weights are still the step-0 copies and
    their moments all zero (no gradient). That is not a bad save; experts copied with their state still are."""
    msd, osd = _upcycled_moe_after_three_steps(fused)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "step-3"))
    rc, doc = run(tmp_path / "step-3", "--deep", "--strict")
    if fused:
        assert rc == 0 and not doc["findings"], doc["findings"]
    else:  # torch gives the unrouted experts no state at all (their grad stays None): O009 says so, D009 not
        assert [f["code"] for f in doc["findings"]] == ["O009"], doc["findings"]
        assert "experts.2.weight and 1 more" in doc["findings"][0]["message"]

    ck = copy_checkpoint(tmp_path / "step-3", tmp_path / "ck" / "step-3")
    if fused:  # expert 0 written over expert 1, state included
        key = "model.layers.0.mlp.experts"
        for k in (key, *(f"optim.state.layers.0.mlp.experts.{m}" for m in ("exp_avg", "exp_avg_sq"))):
            damage.rewrite_tensor(ck, k, lambda t: torch.cat([t[:1], t[:1], t[2:]]))
        want = f"{key}: 2 of 4 expert slices are bitwise copies of another: experts 0, 1"
    else:  # expert 0's weight and state written for expert 1
        state = "optim.state.layers.0.mlp.experts.{}.weight"
        for k in ("model.layers.0.mlp.experts.{}.weight", f"{state}.exp_avg", f"{state}.exp_avg_sq"):
            damage.rewrite_tensor(ck, k.format(1), lambda _t, k=k: damage.read_tensor(ck, k.format(0)))
        want = "model.layers.0.mlp.experts.#.weight: bitwise copies across experts: experts 0, 1"
    rc, doc = run(ck, "--deep")
    assert [f["message"] for f in findings(doc, "D009")] == [want], doc["findings"]


@pytest.mark.parametrize("fused", [True, False])
def test_frozen_upcycled_experts_in_a_trained_save_are_not_copies(tmp_path: Path, fused: bool) -> None:
    """An upcycled MoE whose experts are frozen (only the router trains) a few steps in: the experts are still
    the step-0 copies, with no optimizer state, as torch leaves a parameter without gradient. D009 called them
    copies; it is silent now (experts with state copied: the test above)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": _Top1Moe(fused)})])})
    moe = model["layers"][0]["mlp"]
    moe.experts.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        moe(torch.randn(16, 6, generator=gen).abs()).square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    assert not any("experts" in k for k in osd["state"]) and "layers.0.mlp.gate.weight" in osd["state"]
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "step-3"))
    rc, doc = run(tmp_path / "step-3", "--deep", "--strict")
    assert rc == 0 and not findings(doc, "D009"), doc["findings"]


def test_unused_mask_token_of_a_fine_tuned_dinov2_is_not_an_all_zero_weight(tmp_path: Path) -> None:
    """transformers' DINOv2 always builds ``embeddings.mask_token`` [1, hidden] and zeroes it at init; only masked
    pretraining uses it, so three AdamW steps of a classification fine-tune leave it zero (no gradient). D011 called
    it a tensor never materialised; it is silent now, and still names a weight the save zeroed."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(0)
    cfg = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28, patch_size=14
    )
    model = Dinov2ForImageClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(pixel_values=torch.randn(4, 3, 28, 28), labels=torch.tensor([0, 1, 0, 1])).loss.backward()
        opt.step()
        opt.zero_grad()
    assert model.dinov2.embeddings.mask_token.abs().max() == 0
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "step-3"))  # a model-only save of a trained model
    rc, doc = run(tmp_path / "step-3", "--deep", "--strict")
    assert rc == 0 and not doc["findings"], doc["findings"]
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "full" / "step-3"))
    rc, doc = run(tmp_path / "full" / "step-3", "--deep")
    assert not findings(doc, "D011"), doc["findings"]
    key = "model.dinov2.encoder.layer.1.mlp.fc1.weight"
    damage.rewrite_tensor(tmp_path / "full" / "step-3", key, torch.zeros_like)  # a weight the save left zero
    rc, doc = run(tmp_path / "full" / "step-3", "--deep")
    assert [f["key"] for f in findings(doc, "D011")] == [key], doc["findings"]


def test_frozen_layers_copied_by_depth_up_scaling_are_not_copied_layers(tmp_path: Path) -> None:
    """Depth up-scaling duplicates layers at step 0; a fine-tune that freezes them (the optimizer built over the
    trainable parameters) leaves them bitwise copies, with no optimizer state, while the rest trains. D010 called
    them a layer written for another on a clean save (D009 already leaves frozen experts alone); it is silent now,
    and still reports trained layers that are copies."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_state_dict

    def save(freeze: bool, out: Path) -> None:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        layers = torch.nn.ModuleList([block, copy.deepcopy(block), torch.nn.Sequential(torch.nn.Linear(8, 8))])
        model = torch.nn.ModuleDict({"layers": layers, "head": torch.nn.Linear(8, 4)})
        if freeze:
            layers[:2].requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            h = torch.randn(5, 8, generator=gen)
            for layer in layers:
                h = layer(h)
            model["head"](h).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if not freeze:  # a save that wrote layer 0 for layer 1, optimizer state included
            with torch.no_grad():
                layers[1].load_state_dict(layers[0].state_dict())
            for p0, p1 in zip(layers[0].parameters(), layers[1].parameters()):
                opt.state[p1] = copy.deepcopy(opt.state[p0])
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(out))

    save(True, tmp_path / "frozen" / "step-3")
    rc, doc = run(tmp_path / "frozen" / "step-3", "--deep", "--strict")
    assert rc == 0 and not doc["findings"], doc["findings"]
    save(False, tmp_path / "copied" / "step-3")
    rc, doc = run(tmp_path / "copied" / "step-3", "--deep", "--strict")
    assert [f["key"] for f in findings(doc, "D010")] == ["model.layers.1"], doc["findings"]


def test_upcycled_experts_never_routed_keep_copies_in_their_fp32_masters(tmp_path: Path) -> None:
    """Mixed precision keeps FP32 masters beside BF16 parameters (Megatron's ``fp32_param``, saved as
    ``master_weight``). An upcycled MoE a few steps in whose experts 2 and 3 got no token: their parameter slices and
    moments were left alone, but D009 called their master slices copies on a clean save. Silent now; experts written
    as copies are still reported."""
    msd, osd = _upcycled_moe_after_three_steps(True)
    for fqn, st in osd["state"].items():  # the FP32 masters; the model is saved in BF16, their rounding
        st["master_weight"] = msd[fqn].clone()
    msd = {k: v.to(torch.bfloat16) for k, v in msd.items()}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "step-3"))
    rc, doc = run(tmp_path / "step-3", "--deep", "--strict")
    assert rc == 0 and not doc["findings"], doc["findings"]
    ck = copy_checkpoint(tmp_path / "step-3", tmp_path / "ck" / "step-3")
    key = "optim.state.layers.0.mlp.experts.master_weight"  # expert 0's master written for expert 1
    damage.rewrite_tensor(ck, key, lambda t: torch.cat([t[:1], t[:1], t[2:]]))
    rc, doc = run(ck, "--deep")
    assert [f["message"] for f in findings(doc, "D009")] == [
        f"{key}: 2 of 4 expert slices are bitwise copies of another: experts 0, 1"
    ], doc["findings"]


@pytest.mark.parametrize("form", ["fused", "per_expert"])
def test_hf_step_folder_given_itself_is_trained_by_its_name(fixture_root: Path, tmp_path: Path, form: str) -> None:
    """An HF MoE folder holds no optimizer step: only its step directory's name (``checkpoint-100``) shows training.
    Given the run root, D009 named one EP rank's experts written for all; given the step folder itself (the usual
    call), the name was not read and validate --deep --strict said OK. Both name them now; the clean folder stays
    silent."""
    from safetensors.torch import load_file, save_file

    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    src = cached_build(fixture_root, "moe_expert_forms", hf_models.build_moe_expert_forms) / "mixtral" / form
    clean = copy_checkpoint(src, tmp_path / "clean" / "checkpoint-100")
    rc, doc = run(clean, "--deep", "--strict")
    assert rc == 0 and not findings(doc, "D009"), doc["findings"]
    step = copy_checkpoint(src, tmp_path / "run" / "checkpoint-100")
    sd = load_file(step / "model.safetensors")
    for key in [k for k in sd if k.startswith("model.layers.0.") and ".experts." in k]:
        if form == "fused":  # EP 2 over 4 experts: rank 0's block of 2 experts written for rank 1 too
            sd[key] = torch.cat([sd[key][:2]] * 2)
        elif ".experts.2." in key or ".experts.3." in key:
            sd[key] = sd[key.replace(".experts.2.", ".experts.0.").replace(".experts.3.", ".experts.1.")].clone()
    save_file(sd, str(step / "model.safetensors"), metadata={"format": "pt"})
    for given in (step, step.parent):
        rc, doc = run(given, "--deep", "--strict")
        got = findings(doc, "D009")
        assert rc == 1 and got and all("layers.0." in f["key"] for f in got), (given, doc["findings"])


def test_hf_step_folder_given_as_dot_is_trained_by_its_name(
    fixture_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``validate --deep --strict .`` run inside ``checkpoint-100/`` is the step folder given itself: its name's
    step counts as for the folder's full path (the name of ``.`` is empty), so D009 names one EP rank's experts
    written for all; the clean folder stays silent."""
    from safetensors.torch import load_file, save_file

    from tests.fixtures import hf_models
    from tests.fixtures.cache import cached_build

    src = cached_build(fixture_root, "moe_expert_forms", hf_models.build_moe_expert_forms) / "mixtral" / "fused"
    clean = copy_checkpoint(src, tmp_path / "clean" / "checkpoint-100")
    monkeypatch.chdir(clean)
    rc, doc = run(".", "--deep", "--strict")
    assert rc == 0 and not findings(doc, "D009"), doc["findings"]
    step = copy_checkpoint(src, tmp_path / "run" / "checkpoint-100")
    sd = load_file(step / "model.safetensors")
    for key in [k for k in sd if k.startswith("model.layers.0.") and k.endswith(("gate_up_proj", "down_proj"))]:
        sd[key] = torch.cat([sd[key][:2]] * 2)  # EP 2 over 4 experts: rank 0's block written for rank 1 too
    save_file(sd, str(step / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.chdir(step)
    (step.parent / "latest").symlink_to(step.name)  # a trainer's or a user's link to the newest step
    for given in (".", "./", "../checkpoint-100", "../latest", str(step.parent / "latest")):
        rc, doc = run(given, "--deep", "--strict")
        got = findings(doc, "D009")
        assert rc == 1 and got and all("layers.0." in f["key"] for f in got), (given, doc["findings"])


def _complex_adamw(steps: int) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    """A Linear with a complex64 parameter ``rot`` [3, 2], stepped ``steps`` times by ``torch.optim.AdamW``."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    net.register_parameter("rot", torch.nn.Parameter(torch.randn(3, 2, dtype=torch.complex64)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        (net(torch.randn(2, 4)).sum() + (net.rot.abs() ** 2).sum()).backward()
        opt.step()
    return net, opt


def test_deep_checks_a_complex_parameters_adamw_state_on_its_real_and_imaginary_parts(tmp_path: Path) -> None:
    """torch's Adam/AdamW step a complex parameter as its real view: `exp_avg_sq` is complex, each part a second
    moment. A healthy save passes --deep (no internal error on `exp_avg_sq < 0`); negated moments are D002."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = _complex_adamw(steps=2)
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    code, doc = run(tmp_path / "ok", "--strict", "--deep")
    assert code == 0 and doc["ok"], doc["findings"]
    with torch.no_grad():
        torch.view_as_real(opt.state[net.rot]["exp_avg_sq"]).neg_()
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "neg"), no_dist=True)
    code, doc = run(tmp_path / "neg", "--deep")
    assert code == 1 and [f["key"] for f in findings(doc, "D002")] == ["optimizer.state.rot.exp_avg_sq"], doc


def test_a_complex_tensor_all_zero_is_known_whole_and_its_nan_counted_per_part(tmp_path: Path) -> None:
    """A complex tensor is summarised on its real and imaginary parts (twice its elements): it is still known to
    be all zero as a whole (D008 for a complex parameter's zeroed moments, D011 for a zeroed complex weight, as
    for a real one), and D001 counts its NaN among the parts it names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = _complex_adamw(steps=3)
    with torch.no_grad():
        opt.state[net.rot]["exp_avg"].zero_()
        opt.state[net.rot]["exp_avg_sq"].zero_()
        net.rot.zero_()
        net.rot.imag[0, 0] = float("nan")  # NaN in one imaginary part: the rest is zero
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    code, doc = run(tmp_path / "c", "--deep")
    assert code == 1 and [f["key"] for f in findings(doc, "D008")] == ["rot"], doc["findings"]
    (d001,) = findings(doc, "D001")
    assert d001["message"] == "model.rot: 1 of 12 values (real and imaginary parts of 6 complex64) are NaN or infinite"
    with torch.no_grad():
        net.rot.zero_()
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "z"), no_dist=True)
    code, doc = run(tmp_path / "z", "--deep")
    assert [f["key"] for f in findings(doc, "D011")] == ["model.rot"], doc["findings"]


def _copy_chunk(ckpt: Path, key: str, src: int, dst: int) -> None:
    """Write the stored archive of ``key``'s chunk at row ``src`` over the chunk's at row ``dst``, in place: the
    bytes of another rank's file in a window of the same length (a restore that mixed up rank files)."""
    md = damage.load_md(ckpt)
    infos = {i.offset[0]: md.storage_data[i] for i in md.storage_data if i.fqn == key}
    a, b = infos[src], infos[dst]
    assert a.relative_path != b.relative_path and a.length == b.length, (a, b)
    data = (ckpt / a.relative_path).read_bytes()[a.offset : a.offset + a.length]
    with open(ckpt / b.relative_path, "r+b") as f:
        f.seek(b.offset)
        f.write(data)


def test_a_shard_copied_from_another_ranks_file_is_D017(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """A 4-rank FSDP2 AdamW save (2 steps) whose rank-2 chunk of the embedding holds rank 1's archive (valid, its
    CRC-32 matching, its window of the same length) was "OK" under ``validate --strict --deep``: torch's own
    reader loads it without error, rows 16..23 a copy of rows 8..15. Now D017 names the tensor and both chunks;
    the clean save stays silent."""
    code, doc = run(fsdp_ckpt, "--strict", "--deep")
    assert code == 0 and not findings(doc, "D017"), doc["findings"]
    ckpt = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    key = "model.model.embed_tokens.weight"
    _copy_chunk(ckpt, key, 8, 16)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp_path / "full.pt")  # torch's own reader: no error, the copy loaded
    emb = torch.load(tmp_path / "full.pt", weights_only=True)["model"]["model.embed_tokens.weight"]
    assert torch.equal(emb[16:24], emb[8:16]) and not torch.equal(emb[16:24], damage.read_tensor(fsdp_ckpt, key)[16:24])
    code, doc = run(ckpt, "--strict", "--deep")
    assert code == 1, doc["findings"]
    assert [(f["key"], f["severity"]) for f in findings(doc, "D017")] == [(key, "warning")], doc["findings"]
    assert (
        "chunks at (8, 0) and (16, 0) hold bitwise identical values (128 float32 each)"
        in findings(doc, "D017")[0]["message"]
    )


def _crc_forged(data: bytes) -> bytes:
    """``data`` with its first byte changed and its last 4 bytes chosen so that the CRC-32 stays ``data``'s (CRC-32 is
    affine over GF(2) in those 4 bytes: solved from the 32 unit vectors)."""
    import zlib

    head = bytes([data[0] ^ 1]) + data[1:-4]
    base = zlib.crc32(head)

    def f(x: int) -> int:
        return zlib.crc32(x.to_bytes(4, "little"), base)

    f0, want = f(0), zlib.crc32(data)
    rows = [(f(1 << i) ^ f0, 1 << i) for i in range(32)]  # (image, preimage) pairs of the linear part
    x, target = 0, want ^ f0
    for bit in range(32):  # Gaussian elimination on the images, bit by bit
        pivot = next((j for j in range(bit, 32) if rows[j][0] >> bit & 1), None)
        assert pivot is not None
        rows[bit], rows[pivot] = rows[pivot], rows[bit]
        for j in range(32):
            if j != bit and rows[j][0] >> bit & 1:
                rows[j] = (rows[j][0] ^ rows[bit][0], rows[j][1] ^ rows[bit][1])
    for bit in range(32):  # reduced: row ``bit``'s image is bit ``bit`` alone
        if target >> bit & 1:
            x ^= rows[bit][1]
    out = head + x.to_bytes(4, "little")
    assert zlib.crc32(out) == zlib.crc32(data) and out != data
    return out


def test_equal_crcs_of_different_chunks_are_not_D017(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """D017 groups chunks by their CRC-32 (32 bits: among a thousand ranks' shards of a thousand tensors a coincidence
    is likely). A chunk whose values differ from another's but whose CRC-32 is the same (forged here: rank 2's chunk
    of the embedding is rank 1's with two values changed) was named "bitwise identical"; the bytes are compared now,
    and no D017 is found."""
    import zlib

    ckpt = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    key = "model.model.embed_tokens.weight"
    _copy_chunk(ckpt, key, 8, 16)
    values = damage.read_tensor(ckpt, key)[16:24].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    md = damage.load_md(ckpt)
    info = next(md.storage_data[i] for i in md.storage_data if i.fqn == key and i.offset[0] == 16)
    path = ckpt / info.relative_path
    blob = path.read_bytes()
    at = blob.find(values, info.offset, info.offset + info.length)
    assert at >= 0
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(_crc_forged(values))
    emb = damage.read_tensor(ckpt, key)
    a, b = (emb[r : r + 8].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for r in (8, 16))
    assert a != b and zlib.crc32(a) == zlib.crc32(b)
    code, doc = run(ckpt, "--deep")
    assert not findings(doc, "D017"), doc["findings"]


def test_a_ranks_moments_copied_over_anothers_are_D017(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """Only the optimizer state of a rank copied (an optimizer folder saved apart from the model, as Accelerate's
    ``optimizer_N``): rank 2's ``exp_avg`` and ``exp_avg_sq`` chunks of ``lm_head.weight`` hold rank 1's. The pair
    stays consistent (within Adam's bound: no D007) and every chunk's CRC-32 matches, so the save was "OK"; now each
    moment is a D017 finding, and the untouched weight is not."""
    ckpt = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    keys = [f"optimizer.state.lm_head.weight.{m}" for m in ("exp_avg", "exp_avg_sq")]
    for key in keys:
        _copy_chunk(ckpt, key, 8, 16)
        moment = damage.read_tensor(ckpt, key)
        assert torch.equal(moment[16:24], moment[8:16]), key
    code, doc = run(ckpt, "--strict", "--deep")
    assert code == 1, doc["findings"]
    assert [f["key"] for f in doc["findings"] if f["severity"] != "info"] == keys, doc["findings"]


def _frozen_scale_rank(rank: int, world: int, out: str, how: str) -> None:
    """FSDP2 over ``world`` gloo ranks: two linears and a LayerScale-style ``gamma``, 3 AdamW steps. ``how``:
    ``"frozen"``, ``gamma`` ``1e-5`` everywhere (as ViT's and ConvNeXt's ``init_values * torch.ones(dim)``) with
    ``requires_grad=False``; ``"lr0"``, ``gamma`` all 1.0 in a param group of its own at ``lr`` 0 (stepped, with
    state, never moved)."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(32, 256, bias=False)
            frozen = how == "frozen"
            self.gamma = nn.Parameter(torch.full((256,), 1e-5 if frozen else 1.0), requires_grad=not frozen)
            self.b = nn.Linear(256, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            return self.b(h + h * self.gamma)

    net = Net()
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    rest = [p for n, p in net.named_parameters() if n != "gamma"]
    groups = [{"params": rest}] + ([{"params": [net.gamma], "lr": 0.0}] if how == "lr0" else [])
    opt = torch.optim.AdamW(groups, lr=1e-2)
    gen = torch.Generator().manual_seed(4 + rank)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 32, generator=gen)).pow(2).mean().backward()
        opt.step()
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)


@pytest.mark.parametrize("how", ["frozen", "lr0"])
def test_a_parameter_at_its_constant_initialisation_is_not_D017(tmp_path: Path, how: str) -> None:
    """A LayerScale ``gamma`` sharded over 2 ranks holds two equal chunks by its initialisation, not by a copy:
    frozen (all ``1e-5``; no optimizer state beside the trained parameters' says it never stepped, as D009 leaves
    frozen experts), or all 1.0 in a group stepped at ``lr`` 0. D017 leaves both alone: a healthy save passes
    ``--strict``."""
    from tests.fixtures.distributed import run_ranks

    run_ranks(2, _frozen_scale_rank, str(tmp_path / "c"), how)
    gamma = damage.read_tensor(tmp_path / "c", "model.gamma")
    assert torch.equal(gamma, torch.full((256,), 1e-5 if how == "frozen" else 1.0)), gamma
    code, doc = run(tmp_path / "c", "--strict", "--deep")
    assert code == 0, doc["findings"]


def _forged_at(t: torch.Tensor, start: int, nbytes: int = 16) -> torch.Tensor:
    """``t`` with ``nbytes`` of its bytes from flat byte ``start`` changed so that the CRC-32 of every run holding them
    stays the same (:func:`_crc_forged`: CRC-32 is affine in the bytes, so equal CRC-32s of a piece of equal length
    keep the whole run's)."""
    raw = bytearray(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    raw[start : start + nbytes] = _crc_forged(bytes(raw[start : start + nbytes]))
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).reshape(t.shape).clone()


def test_equal_crcs_of_different_experts_are_not_D009(ep_suite: Path, tmp_path: Path) -> None:
    """D009 groups expert slices by their CRC-32 runs (32 bits each: among the expert pairs of 256 experts in 60
    layers a coincidence is likely). Expert 6 made a copy of expert 1 and then 16 of its bytes changed without
    changing the CRC-32 (forged) was named a bitwise copy; the bytes are compared now. The plain copy still is."""
    key = "model.model.layers.1.mlp.experts.down_proj"

    def copy_1_to_6(forge: bool) -> Any:
        def fn(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            t[6] = t[1]
            return _forged_at(t, 6 * t[0].numel() * t.element_size()) if forge else t

        return fn

    for forge in (False, True):
        ck = copy_checkpoint(ep_suite / "canonical", tmp_path / f"ck{forge}")
        damage.rewrite_tensor(ck, key, copy_1_to_6(forge))
        if forge:
            t = damage.read_tensor(ck, key)
            assert not torch.equal(t[6].view(torch.uint8), t[1].view(torch.uint8))
        rc, doc = run(ck, "--deep", "--ignore", "L003")
        assert [f["key"] for f in findings(doc, "D009")] == ([] if forge else [key]), doc["findings"]


def test_equal_crcs_of_different_layers_are_not_D010(titan_root: Path, tmp_path: Path) -> None:
    """Layer 1 written as a copy of layer 0, then 16 bytes of its ``wq.weight`` changed without changing
    any CRC-32 (forged): no longer a copy, and not named one (D010 compares the bytes of digest-equal layers)."""
    src = titan_root / "llama3" / "checkpoint" / "step-2"
    ck = copy_checkpoint(src, tmp_path / "ck")
    for key in [k for k in damage.load_md(src).state_dict_metadata if k.startswith("layers.1.")]:
        layer0 = damage.read_tensor(src, key.replace("layers.1.", "layers.0."))
        if key.endswith(".wq.weight"):
            layer0 = _forged_at(layer0, 64)
        damage.rewrite_tensor(ck, key, lambda _t, v=layer0: v)
    rc, doc = run(ck, "--deep")
    assert not findings(doc, "D010"), doc["findings"]


def _nan_payload_twin(raw: bytes, at: list[int], item: int, free: int) -> bytes:
    """``raw`` with the payloads of the NaNs at byte offsets ``at`` (values of ``item`` bytes, little-endian) changed
    so that its CRC-32 stays the same: other bytes, the same values (NaN), for a check that calls slices "bitwise"
    copies. The ``free`` lowest mantissa bits of each NaN may change (the quiet bit above them stays set); a change
    whose CRC-32 image is 0 is found by Gaussian elimination over GF(2) (CRC-32 is affine in the bytes)."""
    import zlib

    def apply(delta: int) -> bytes:
        out = bytearray(raw)
        for j, o in enumerate(at):
            word = (delta >> (free * j)) & ((1 << free) - 1)
            out[o : o + item] = (int.from_bytes(raw[o : o + item], "little") ^ word).to_bytes(item, "little")
        return bytes(out)

    base = zlib.crc32(raw)
    done: list[tuple[int, int]] = []  # (CRC-32 change, payload change), each pivot on its image's lowest set bit
    for i in range(free * len(at)):
        img, pre = zlib.crc32(apply(1 << i)) ^ base, 1 << i
        for dimg, dpre in done:
            if img & (dimg & -dimg):
                img, pre = img ^ dimg, pre ^ dpre
        if img == 0:  # a payload change that leaves the CRC-32 as it was
            return apply(pre)
        done = [((d ^ img, p ^ pre) if d & (img & -img) else (d, p)) for d, p in done] + [(img, pre)]
    raise AssertionError("no CRC-preserving payload change: too few NaNs")


def test_experts_equal_in_value_but_not_in_bits_are_not_bitwise_copies(ep_suite: Path, tmp_path: Path) -> None:
    """Expert 6 made a copy of expert 1 whose eight NaNs carry other payloads, chosen so that the CRC-32 is the
    same: equal values, different bytes. D009 says "bitwise copies", so it compares the stored bytes, not values."""
    key = "model.model.layers.1.mlp.experts.down_proj"

    def fn(t: torch.Tensor) -> torch.Tensor:
        assert t.dtype == torch.bfloat16
        t = t.clone()
        t[1].view(-1)[:8] = float("nan")
        t[6] = t[1]
        raw = t[6].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        twin = _nan_payload_twin(raw, list(range(0, 16, 2)), 2, 6)  # BF16: 7 mantissa bits, the top one quiet
        t[6] = torch.frombuffer(bytearray(twin), dtype=torch.bfloat16).reshape(t[6].shape)
        return t

    ck = copy_checkpoint(ep_suite / "canonical", tmp_path / "ck")
    damage.rewrite_tensor(ck, key, fn)
    t = damage.read_tensor(ck, key)
    a, b = (t[i].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for i in (1, 6))
    import zlib

    assert a != b and zlib.crc32(a) == zlib.crc32(b) and torch.equal(t[1].nan_to_num(), t[6].nan_to_num())
    rc, doc = run(ck, "--deep", "--ignore", "L003")
    assert not findings(doc, "D009"), doc["findings"]
