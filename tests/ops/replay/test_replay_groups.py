"""``ckpttool replay-step`` on param groups saved with switches: torch.optim.AdamW's own (``differentiable``), ones
AdamW has not (``nesterov``), and another Adam-like optimizer's group (Adamax), against torch's own steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ops.replay.test_replay import (
    _adamw_linear_with,
    assert_no_traceback,
    assert_replay_is_the_runs_next_step,
    replay_collect,
    run,
)


def _manual_run(tmp_path: Path, **flags: Any) -> tuple[Path, Path, Any, Any]:
    """A ``torch.nn.Linear(8, 4)`` whose parameters ``torch.optim.AdamW(..., **flags)`` stepped 3 times with given
    gradients (no autograd: ``differentiable=True`` steps leaves that do not require grad), saved by ``dcp.save``
    through ``get_state_dict``; the next step's gradients in ``g.safetensors``. Returns (checkpoint, gradients file,
    model, optimizer) before that step."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), **{"lr": 1e-2, "weight_decay": 0.1, **flags})
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
        opt.step()
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    save_file({n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in model.named_parameters()}, str(tmp_path / "g"))
    return tmp_path / "ck", tmp_path / "g", model, opt


def test_a_differentiable_groups_replay_is_torchs_own_next_step(tmp_path: Path) -> None:
    """torch.optim.AdamW(differentiable=True) takes the step of its capturable arithmetic (bias corrections and step
    size as tensors): 1 ulp away from the plain for-loop step in most elements. replay-step dropped the saved switch,
    and --reference torch built its AdamW without it too: 'OK', torch_unequal 0, while torch's own next step differed
    in 45 of 48 elements of a 3-layer MLP. Both now keep it: the replay is the run's next step, bitwise."""
    ck, grads, model, opt = _manual_run(tmp_path, differentiable=True)
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)
    assert run(ck, "--device", "cpu", "--grads", grads, "--steps", "2").exit_code == 0


@pytest.mark.parametrize(
    "scalars",
    [
        {"lr": torch.tensor(1e-2, dtype=torch.bfloat16)},
        {"lr": torch.tensor(1e-2, dtype=torch.float16)},
        {"betas": (torch.tensor(0.9, dtype=torch.bfloat16), torch.tensor(0.95, dtype=torch.bfloat16))},
    ],
    ids=["bf16-lr", "fp16-lr", "bf16-betas"],
)
def test_a_differentiable_groups_half_precision_scalars_match_the_reference(tmp_path: Path, scalars: dict) -> None:
    """differentiable=True beside a BF16/FP16 tensor lr or BF16 tensor betas: torch forms the bias corrections and the
    step size as FP32 tensors (the step's dtype), not in the lr's or betas' dtype as its plain for-loop step does. The
    replay (keeping the switch) was torch's own step, but the formula reference rounded the step size as the for-loop
    step does and failed a sound state: 'param: 28 element(s) beyond tolerance (max abs 1.75e-05, max rel 0.0574)'.
    One step (native), three steps and the torch reference pass; the replay is the run's next step, bitwise."""
    from safetensors.torch import load_file

    ck, grads, model, opt = _manual_run(tmp_path, differentiable=True, **scalars)
    for extra in ([], ["--steps", "3"], ["--reference", "torch"]):
        res = run(ck, "--device", "cpu", "--grads", grads, *extra)
        assert res.exit_code == 0, (extra, res.output)
    g = load_file(str(grads))
    for n, p in model.named_parameters():
        p.grad = g[n].clone()
    opt.step()
    _, got = replay_collect(ck, grads=str(grads))
    assert all(torch.equal(got[n]["param"], p.detach()) for n, p in model.named_parameters())


def test_a_switch_adamw_has_not_is_refused_by_name(tmp_path: Path) -> None:
    """An Adam-family group saved with nesterov=True (a subclass's or another optimizer's switch over AdamW's keys and
    state) replayed as plain AdamW and said OK (exit 0): torch.optim.AdamW ignores the key, so its step is no proof of
    the step the run took. It is E514 naming the switch; group tags Megatron and DeepSpeed set (is_expert_parallel=True,
    moe=True) and a switch set False still replay."""

    def nesterov(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["nesterov"] = True

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "nesterov", nesterov)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(
        "error: [E514] param group of weight was saved with nesterov=True, which torch.optim.AdamW has not; "
    ), res.stderr
    assert_no_traceback(res)

    def uncorrected(osd: dict[str, Any]) -> None:  # apex's FusedAdam(bias_correction=False)
        osd["param_groups"][0]["bias_correction"] = False

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "uncorrected", uncorrected)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and "was saved with bias_correction=False, which" in res.stderr, res.stderr

    def tagged(osd: dict[str, Any]) -> None:
        osd["param_groups"][0].update(
            is_expert_parallel=True, default_config=True, nesterov=False, moe=True, bias_correction=True
        )

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "tagged", tagged)
    res = run(ck, "--device", "cpu", "--grads", grads, "--reference", "torch")
    assert res.exit_code == 0, res.output


def test_an_adamax_checkpoint_is_refused_by_its_name(tmp_path: Path) -> None:
    """torch.optim.Adamax saves betas, eps and weight_decay as Adam does and exp_inf for exp_avg_sq: replay-step said
    'E510 ... unknown optimizer state field(s) exp_inf' with a hint to pass --optimizer-type, which no type fixes. It
    names the optimizer, as it does SGD's or RMSprop's (E514, exit 2)."""
    ck, grads, _, _ = _adamw_linear_with(tmp_path, lambda osd: None, lambda p: torch.optim.Adamax(p, lr=1e-2))
    res = run(ck, "--device", "cpu", "--grads", grads, "--json")
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: [E514] param group of weight (keys betas, ") and (
        "and its state exp_avg, exp_inf, step: it was saved by torch.optim.Adamax, not Adam/AdamW" in res.stderr
    ), res.stderr
    assert "--optimizer-type" not in res.stderr and "`ckpttool validate` checks the torch.optim.Adamax" in res.stderr
    assert not res.stdout.strip() or json.loads(res.stdout)["ok"] is False
    assert_no_traceback(res)


def test_a_capturable_group_replayed_on_the_cpu_says_it_is_not_the_runs_arithmetic(tmp_path: Path) -> None:
    """A group saved with capturable=True (a CUDA-graph run's AdamW; torch refuses it for CPU tensors) replayed on the
    CPU with --reference torch said 'torch.optim.AdamW with the saved flags (bitwise ...)' and OK, with no word that
    both dropped the switch: the run's own next step takes the capturable arithmetic on its accelerator. A note says
    so and names the device to replay on; the verdict (the formula reference's) is unchanged."""

    def captured(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["capturable"] = True

    ck, grads, _, _ = _adamw_linear_with(tmp_path, captured)
    res = run(ck, "--device", "cpu", "--grads", grads, "--reference", "torch", "--json")
    assert res.exit_code == 0, res.output
    notes = json.loads(res.stdout)["notes"]
    assert any(
        n.startswith("2 parameter(s) saved with capturable=True (an accelerator run's step), e.g. ")
        and "replay on the run's device" in n
        for n in notes
    ), notes
    ck, grads, _, _ = _adamw_linear_with(tmp_path / "plain", lambda osd: None)
    notes = json.loads(run(ck, "--device", "cpu", "--grads", grads, "--json").stdout)["notes"]
    assert not any("capturable" in n for n in notes), notes


def test_state_no_adamw_variant_saves_is_not_sent_to_a_declared_type(tmp_path: Path) -> None:
    """Muon-like state (momentum_buffer alone) under an Adam-keyed group was E510 with the hint 'pass --optimizer-type
    to declare the type', which no type fixes: every type replays AdamW's fields. The hint names the optimizers that
    save such state and the commands that read it; a missing field keeps the declared-type hint."""

    def muon_like(osd: dict[str, Any]) -> None:
        for st in osd["state"].values():
            st["momentum_buffer"] = st.pop("exp_avg")
            del st["exp_avg_sq"], st["step"]

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "muon", muon_like)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(
        "error: [E510] optimizer state of weight: unknown optimizer state field(s) momentum_buffer; "
    ), res.stderr
    assert "hint: state no AdamW variant saves (saved by torch.optim.SGD or torch.optim.Muon): " in res.stderr
    assert "--optimizer-type" not in res.stderr
    assert_no_traceback(res)

    def lost(osd: dict[str, Any]) -> None:
        for st in osd["state"].values():
            del st["exp_avg_sq"]

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "lost", lost)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and "pass --optimizer-type to declare the type" in res.stderr, res.stderr


def test_param_groups_that_do_not_list_the_stepped_parameters_are_named_as_such(tmp_path: Path) -> None:
    """Param groups whose params lists name none of the parameters the state holds (emptied, or renamed by a bad
    conversion) while the state keeps the model's fqns: E514 said 'the optimizer state does not name this
    checkpoint's model tensors', which it does. It says the groups list none of them, names one (P004) and keeps E514
    (exit 2); state that names no model tensor keeps the old message."""
    for name, listed in (("empty", []), ("renamed", ["module.weight", "module.bias"])):

        def regroup(osd: dict[str, Any], listed: list[str] = listed) -> None:
            osd["param_groups"][0]["params"] = listed

        ck, grads, _, _ = _adamw_linear_with(tmp_path / name, regroup)
        res = run(ck, "--device", "cpu", "--grads", grads)
        assert res.exit_code == 2, res.output
        assert (
            f"none of the {len(listed)} parameter(s) of the param groups is a model tensor of the checkpoint, while 2 "
            "model tensor(s) with optimizer state are in no param group (e.g. weight; validate: P004)"
        ) in res.stderr, res.stderr
        assert "does not name this checkpoint's model tensors" not in res.stderr
        assert_no_traceback(res)

    def rename_all(osd: dict[str, Any]) -> None:
        osd["state"] = {f"module.{k}": v for k, v in osd["state"].items()}
        osd["param_groups"][0]["params"] = [f"module.{k}" for k in osd["param_groups"][0]["params"]]

    ck, grads, _, _ = _adamw_linear_with(tmp_path / "all", rename_all)
    res = run(ck, "--device", "cpu", "--grads", grads)
    assert res.exit_code == 2 and "does not name this checkpoint's model tensors" in res.stderr, res.stderr


@pytest.mark.parametrize("flags", [{}, {"foreach": True}], ids=["for-loop", "foreach"])
def test_a_half_precision_tensor_weight_decay_is_refused_where_torch_rounds_the_decay(
    tmp_path: Path, flags: dict[str, bool]
) -> None:
    """AdamW(weight_decay=torch.tensor(0.1, dtype=torch.bfloat16)): torch forms 1 - lr * weight_decay in BF16
    (1 - 0.01 * 0.1 is 1.0: no decay), so its next step is not the replay's, which takes the number. replay-step said OK and, with
    --reference torch, 'bitwise' (its torch.optim.AdamW built from the number too) while the run's own next step
    differs in all 36 elements. It is refused (E514, exit 2) naming the dtype."""
    ck, grads, _, _ = _manual_run(tmp_path, weight_decay=torch.tensor(0.1, dtype=torch.bfloat16), **flags)
    res = run(ck, "--device", "cpu", "--grads", grads, "--reference", "torch")
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(
        "error: [E514] param group of weight: weight_decay is saved as a bfloat16 tensor; torch forms the decay factor"
    ), res.stderr
    assert_no_traceback(res)


def test_a_half_precision_tensor_weight_decay_of_a_fused_group_replays_bitwise(tmp_path: Path) -> None:
    """The fused kernel reads weight_decay as a double: a BF16 tensor weight_decay replays as torch's own fused step."""
    ck, grads, model, opt = _manual_run(tmp_path, weight_decay=torch.tensor(0.1, dtype=torch.bfloat16), fused=True)
    assert_replay_is_the_runs_next_step(ck, grads, model, opt)
