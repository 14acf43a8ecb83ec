"""`replay-step` verdicts that tell whether a resume is safe, on torchtitan ``CheckpointManager`` saves.

- update size (``R003``): a zeroed ``exp_avg_sq`` (what a save that wrote a fresh moment does)
  replays in agreement with the reference, yet the update is far beyond what Adam's own moments
  allow: not OK.
- torchtitan steps ``wqkv`` fused while the model stores ``wq``/``wk``/``wv``: the fused
  parameter is assembled and replayed, checked here against ``torch.optim.AdamW`` run on the
  tensors ``dcp.load`` reads.
- a stepped parameter the replay cannot reach makes the result not OK, whatever the others do.
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
from ckpttool.ops.replay import ReplayOptions, replay_step
from ckpttool.ops.replay.grads import seeded_grad
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

pytestmark = pytest.mark.slow  # fixtures written by multi-rank gloo jobs of the real trainers

runner = CliRunner()
W1 = "layers.0.feed_forward.w1.weight"


def replay(*args: Any) -> tuple[int, dict[str, Any], str]:
    res = runner.invoke(app, ["replay-step", *map(str, args), "--device", "cpu", "--json"])
    return res.exit_code, json.loads(res.stdout), res.stderr


def test_clean_save_has_sane_updates(titan_root: Path) -> None:
    rc, doc, _ = replay(titan_root / "llama3" / "checkpoint" / "step-2", "--head-dim", "16")
    assert rc == 0 and doc["ok"]
    for p in doc["params"]:
        u = p["update"]
        assert u["ok"] and 0 < u["direction"] <= u["direction_bound"] and u["rel_to_param"] < 0.1, p["fqn"]


def test_zeroed_exp_avg_sq_is_an_update_size_failure(titan_root: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "ck")
    damage.rewrite_tensor(ck, f"optimizer.state.{W1}.exp_avg_sq", torch.zeros_like)
    rc, doc, err = replay(ck, "--head-dim", "16")
    assert rc == 1 and not doc["ok"] and doc["params_failed"] == 1
    bad = doc["params"][0]
    assert bad["fqn"] == W1
    # the optimizer agrees with the reference on the broken state: only the update size fails
    assert all(e["bad"] == 0 for e in bad["errors"].values())
    assert len(bad["problems"]) == 1 and bad["problems"][0].startswith("update size [R003]")
    u = bad["update"]
    assert not u["ok"] and u["rel_to_param"] > 1 and u["direction"] > 100 * u["direction_bound"]
    assert "R003" in err and W1 in err


def _fused(saved: dict[str, torch.Tensor], fqn: str, head_dim: int = 16) -> torch.Tensor:
    """``wqkv`` from saved ``wq``/``wk``/``wv`` by torchtitan's own load hook (``FusedQKVLinear``, MHA: 1 head per KV)."""
    from types import SimpleNamespace

    from torchtitan.models.common.attention import FusedQKVLinear

    pre = fqn[: -len("wqkv.weight")]
    sd = {f"{pre}{n}.weight": saved[f"{pre}{n}.weight"] for n in ("wq", "wk", "wv")}
    FusedQKVLinear._merge_qkv_on_load(SimpleNamespace(head_dim=head_dim, heads_per_kv=1), sd, pre)
    return sd[fqn]


def _titan_tensors(ck: Path, layer: int) -> dict[str, torch.Tensor]:
    """wq/wk/wv and the fused wqkv's state of one layer, read by torch's own dcp.load."""
    pre = f"layers.{layer}.attention.qkv_linear."
    sd: dict[str, Any] = {f"{pre}{n}.weight": torch.empty(64, 64) for n in ("wq", "wk", "wv")}
    for f in ("exp_avg", "exp_avg_sq"):
        sd[f"optimizer.state.{pre}wqkv.weight.{f}"] = torch.empty(192, 64)
    sd[f"optimizer.state.{pre}wqkv.weight.step"] = torch.empty(())
    for h in ("lr", "betas", "eps", "weight_decay"):
        sd[f"optimizer.param_groups.{pre}wqkv.weight.{h}"] = None
    dcp.load(sd, checkpoint_id=str(ck))
    return sd


def test_fused_wqkv_replays_like_torch_adamw(titan_root: Path) -> None:
    ck = titan_root / "llama3" / "checkpoint" / "step-2"
    got: dict[str, dict[str, torch.Tensor]] = {}
    res = replay_step(
        ck, ReplayOptions(device="cpu", filter_glob="*wqkv*", head_dim=16), on_param=lambda f, t: got.setdefault(f, t)
    )
    assert res.ok and {p.fqn for p in res.params} == {f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)}
    for i in (0, 1):
        fqn = f"layers.{i}.attention.qkv_linear.wqkv.weight"
        sd = _titan_tensors(ck, i)
        opt_pre = f"optimizer.param_groups.{fqn}."
        p = torch.nn.Parameter(_fused(sd, fqn))
        p.grad = seeded_grad(fqn, (192, 64), torch.float32, seed=0, scale=1e-3, step_index=0)
        opt = torch.optim.AdamW(
            [p],
            lr=sd[opt_pre + "lr"],
            betas=tuple(sd[opt_pre + "betas"]),
            eps=sd[opt_pre + "eps"],
            weight_decay=sd[opt_pre + "weight_decay"],
            foreach=False,
        )
        state = {f: sd[f"optimizer.state.{fqn}.{f}"] for f in ("exp_avg", "exp_avg_sq", "step")}
        opt.load_state_dict({"state": {0: state}, "param_groups": [{**opt.param_groups[0], "params": [0]}]})
        opt.step()
        torch.testing.assert_close(got[fqn]["param"], p.detach(), rtol=2e-6, atol=1e-9)
        torch.testing.assert_close(got[fqn]["exp_avg_sq"], opt.state[p]["exp_avg_sq"], rtol=2e-6, atol=0)


def test_a_skipped_stepped_parameter_is_never_ok(titan_root: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(titan_root / "llama3" / "checkpoint" / "step-2", tmp_path / "ck")
    damage.rename_key(ck, "norm.weight", "final_norm.weight")  # its state now names no model tensor
    rc, doc, err = replay(ck, "--head-dim", "16")
    assert rc == 1 and not doc["ok"] and doc["params_failed"] == 0
    assert doc["params_skipped"] == ["norm.weight"] and "not replayed" in err
    rc, doc, _ = replay(ck, "--filter", "layers.*", "--head-dim", "16")  # left out by the selection: not a skip
    assert rc == 0 and doc["ok"] and doc["params_skipped"] == []


def _trainer_grads(step: int) -> dict[str, torch.Tensor]:
    """The gradients torchtitan's loop in tests/fixtures/writers.py gave at ``step`` (its seeded generator, in
    ``model.parameters()`` order of the same model)."""
    from tests.fixtures.writers import _titan_llama

    torch.manual_seed(0)
    names = [(n, tuple(p.shape)) for n, p in _titan_llama().build().named_parameters()]
    g = torch.Generator().manual_seed(1234)
    out: dict[str, torch.Tensor] = {}
    for _ in range(step):
        out = {n: torch.randn(shape, generator=g) for n, shape in names}
    return out


def test_torch_reference_is_the_trainers_own_next_step(titan_root: Path, tmp_path: Path) -> None:
    """Replaying step 2 with the trainer's step-3 gradients gives, bitwise, the weights torchtitan saved at step 3."""
    from safetensors.torch import save_file

    root = titan_root / "llama3" / "checkpoint"
    grads = tmp_path / "g3.safetensors"
    save_file(_trainer_grads(3), str(grads))
    got: dict[str, torch.Tensor] = {}
    res = replay_step(
        root / "step-2",
        ReplayOptions(device="cpu", grads=grads, reference="torch", head_dim=16),
        on_param=lambda f, t: got.setdefault(f, t["param"]),
    )
    assert res.ok and len(res.params) == 17
    assert all(p.torch_unequal == {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "step": 0} for p in res.params)
    # step-3 is torchtitan's model-only save in bfloat16 (export_dtype): the replay rounded must equal it
    saved = {k: damage.read_tensor(root / "step-3", k) for k in damage.load_md(root / "step-3").state_dict_metadata}
    for fqn, param in got.items():
        want = _fused(saved, fqn) if "wqkv" in fqn else saved[fqn]
        assert want.dtype == torch.bfloat16 and torch.equal(param.to(torch.bfloat16), want), fqn
    rc, doc, _ = replay(root / "step-2", "--head-dim", "16")  # the formula reference alone
    assert rc == 0 and all(p["torch_unequal"] is None for p in doc["params"])


def test_fused_parameter_without_head_dim_is_a_skip(titan_root: Path) -> None:
    rc, doc, err = replay(titan_root / "llama3" / "checkpoint" / "step-2")
    wqkv = [f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)]
    assert rc == 1 and not doc["ok"] and doc["params_failed"] == 0 and doc["params_skipped"] == wqkv
    assert any("pass `head_dim`" in n for n in doc["notes"]) and "not replayed" in err


def test_a_step_0_save_of_a_plain_optimizer_state_dict_says_its_groups_list_indices(tmp_path: Path) -> None:
    """`dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()})` before the first step (no state, param
    groups listing parameters 0, 1, ...): replay-step said 'none of the 2 parameter(s) of the param groups is a model
    tensor' and hinted at optimizer state naming other tensors. It now says the groups list indices, which nothing can
    match to the model, and how to save them by fqn."""
    from tests.fixtures.builders import save_quiet

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_quiet({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "s0")
    res = runner.invoke(app, ["replay-step", str(tmp_path / "s0"), "--device", "cpu"])
    assert res.exit_code == 2 and res.output.splitlines() == [
        f"error: [E514] {tmp_path / 's0'}: the param groups list their 2 parameter(s) by index (a plain "
        "optimizer.state_dict()), which no command can match to the model tensors; nothing to replay",
        "hint: re-save the optimizer with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, "
        "optimizer), which names each parameter by its fqn",
    ], res.output
