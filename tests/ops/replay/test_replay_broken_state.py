"""``ckpttool replay-step`` on torch.optim.AdamW state saved by ``get_state_dict`` + ``dcp.save`` and then broken the
ways users report, where the replay agrees with the reference bitwise and said OK: a step counter set back (for
every parameter, or for one), and a saved ``eps`` of 0. And sound states at the edge of the checks (the first
step, whose moments sit exactly at Adam's bound), which must stay OK and be torch's own next step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ops.replay.test_replay import (
    _adamw_linear_with,
    assert_no_traceback,
    assert_replay_is_the_runs_next_step,
    run,
)


def _json(ck: Path, grads: Path) -> tuple[int, dict[str, Any]]:
    res = run(ck, "--device", "cpu", "--grads", grads, "--json")
    assert_no_traceback(res)
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.parametrize("which", ["all", "one"])
def test_a_step_set_back_beside_the_runs_moments_fails(tmp_path: Path, which: str) -> None:
    """3 steps saved, then every ``step`` set to 1 (or the weight's to 2, the bias left at 3): the moments of 3 steps
    under the bias correction of fewer. replay-step agreed with the reference and torch.optim.AdamW in every element
    and said OK (exit 0): the direction of the next step (1.03 against the bound 1.0, within its 10% slack) hides it.
    The saved moments are beyond the most Adam's recursion allows at the saved step (max |exp_avg|/sqrt(exp_avg_sq)
    4.84 > 3.16 at step 1): D007, exit 1."""

    def mutate(osd: dict[str, Any]) -> None:
        for fqn, st in osd["state"].items():
            if which == "all" or fqn == "weight":
                st["step"] = torch.tensor(1.0 if which == "all" else 2.0)

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    code, out = _json(ck, grads)
    assert code == 1 and out["ok"] is False
    bad = {p["fqn"]: p["problems"] for p in out["params"] if not p["ok"]}
    assert "weight" in bad and bad["weight"][0].startswith("saved moments beyond Adam's bound [D007]")
    bound = 0.1 / math.sqrt(1 - 0.999) if which == "all" else 0.1 / math.sqrt(0.001) * math.sqrt(1 + 0.81 / 0.999)
    assert f"beyond {bound:.4g}" in bad["weight"][0]
    assert all(f["bad"] == 0 for p in out["params"] for f in p["errors"].values())  # the replay itself agrees


def test_a_saved_eps_of_0_fails(tmp_path: Path) -> None:
    """A param group saved with ``eps`` 0 (1e-8 rounded to 0 in float16, a conversion bug): every element of this
    state has ``exp_avg_sq`` > 0, so the replay agreed and said OK; a resume divides by sqrt(v_hat) alone (0/0 = NaN
    where a gradient was always zero). R003, exit 1, for every parameter of the group."""

    def mutate(osd: dict[str, Any]) -> None:
        osd["param_groups"][0]["eps"] = 0.0

    ck, grads, _, _ = _adamw_linear_with(tmp_path, mutate)
    code, out = _json(ck, grads)
    assert code == 1 and out["params_failed"] == 2
    for p in out["params"]:
        assert any(x.startswith("update size [R003]: the saved eps is 0") for x in p["problems"]), p["problems"]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.5, 0.6), fused=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.0, 0.99), foreach=True),
    ],
    ids=["default", "fused-low-betas", "beta1-0"],
)
@pytest.mark.parametrize("steps", [1, 3])
def test_sound_state_at_adams_bound_is_ok_and_torchs_next_step(tmp_path: Path, make: Any, steps: int) -> None:
    """After one step every moment sits exactly at Adam's bound (|exp_avg|/sqrt(exp_avg_sq) = (1-b1)/sqrt(1-b2)):
    the saved-state check must not flag it (nor a later step's), and the replay is torch.optim.AdamW's own next step,
    bitwise."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet, train_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = make(model.parameters())
    train_steps(model, opt, steps, loss="square")
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    gen = torch.Generator().manual_seed(7)
    grads = tmp_path / "g.safetensors"
    save_file({n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in model.named_parameters()}, str(grads))
    code, out = _json(tmp_path / "ck", grads)
    assert code == 0, [p["problems"] for p in out["params"]]
    assert_replay_is_the_runs_next_step(tmp_path / "ck", grads, model, opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_saved_state_check_leaves_the_loaded_moments_as_saved(tmp_path: Path, dtype: torch.dtype) -> None:
    """The check reads the loaded moments the optimizer then adopts: it must not change them (``.float()`` of a
    float32 tensor and ``.double()`` of a float64 one are the tensor itself, not a copy). A sound state of each
    moment dtype replays as torch's own next step; with every step set back to 1 the parameters fail on D007 first
    (and R003), every replayed field still equal to the reference's."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(dtype).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
        opt.step()
    msd, osd = get_state_dict(model, opt)
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    set_back = {**osd, "state": {f: {**st, "step": torch.tensor(1.0)} for f, st in osd["state"].items()}}
    save_quiet({"model": msd, "optimizer": set_back}, tmp_path / "set_back")  # the live optimizer's state kept
    grads = tmp_path / "g.safetensors"
    save_file(
        {n: (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype) for n, p in model.named_parameters()}, str(grads)
    )
    code, out = _json(tmp_path / "set_back", grads)
    assert code == 1 and out["params_failed"] == 2
    for p in out["params"]:
        assert p["problems"][0].startswith("saved moments beyond Adam's bound [D007]")
        assert not any("beyond tolerance" in x for x in p["problems"]), p["problems"]
        assert all(f["bad"] == 0 for f in p["errors"].values()), p
    code, out = _json(tmp_path / "ck", grads)
    assert code == 0, [p["problems"] for p in out["params"]]
    assert_replay_is_the_runs_next_step(tmp_path / "ck", grads, model, opt)
