"""``replay-step`` on pure-FP16 AdamW saves (``model.half()``): torch's own FP16 moments, underflow included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckpttool.ops.replay import ReplayOptions, replay_step


def _fp16_run(
    tmp_path: Path, steps: int, eps: float, mutate: Any = None, fused: bool = False
) -> tuple[Path, Path, Any, Any]:
    """A model in FP16 stepped ``steps`` times by ``torch.optim.AdamW(lr=1e-3, eps=eps)`` and saved by ``dcp.save`` of
    ``get_state_dict`` (``fused``: torch's fused kernel; ``mutate(state)`` first changes a copy of the optimizer
    state's ``state`` entries); the next step's gradients
    in ``g.safetensors``. Returns (checkpoint, gradients file, model, optimizer) before that step.

    With ``eps`` 1e-4 an embedding, a LayerNorm and two Linears whose gradients are small: many ``exp_avg_sq``
    elements underflow FP16 (subnormal or zero), as torch stores them. With ``eps`` 1e-8 FP16 underflow to zero would
    make torch's own step infinite (``0 + 1e-8`` is 0 in FP16), so two Linears with a loss scaled by 1e4: after one
    step some second moments are FP16 subnormals, after more steps none."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.fixtures.builders import save_quiet

    torch.manual_seed(0)
    if eps >= 1e-4:
        model: Any = torch.nn.Sequential(
            torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)
        ).half()
        batch, scale, loss_scale = (lambda: torch.randint(0, 64, (4, 8))), 1e-3, 1.0
    else:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).half()
        batch, scale, loss_scale = (lambda: torch.randn(4, 16).half()), 1e-3, 1e4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps, **({"fused": True} if fused else {}))
    for _ in range(steps):
        opt.zero_grad()
        (model(batch()).float().pow(2).mean() * loss_scale).backward()
        opt.step()
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    msd, osd = get_state_dict(model, opt)
    if mutate is not None:  # a copy: the live optimizer keeps its own state
        osd = {**osd, "state": {k: dict(v) for k, v in osd["state"].items()}}
        mutate(osd["state"])
    save_quiet({"model": msd, "optimizer": osd}, tmp_path / "ck")
    gen = torch.Generator().manual_seed(7)
    grads = {n: torch.randn(p.shape, generator=gen) * scale for n, p in model.named_parameters()}
    save_file(grads, str(tmp_path / "g.safetensors"))
    return tmp_path / "ck", tmp_path / "g.safetensors", model, opt


def _replay(ck: Path, grads: Path, **kw: Any) -> tuple[Any, dict[str, dict[str, torch.Tensor]]]:
    got: dict[str, dict[str, torch.Tensor]] = {}
    res = replay_step(
        ck, ReplayOptions(device="cpu", grads=str(grads), **kw), on_param=lambda fqn, t: got.__setitem__(fqn, t)
    )
    return res, got


@pytest.mark.parametrize(
    ("eps", "fused"), [(1e-8, False), (1e-4, False), (1e-4, True)], ids=["eps1e-8", "eps1e-4", "eps1e-4-fused"]
)
@pytest.mark.parametrize("steps", [1, 4, 10])
def test_a_healthy_fp16_adamw_save_replays_ok_and_equals_torchs_next_step(
    tmp_path: Path, steps: int, eps: float, fused: bool
) -> None:
    """A pure-FP16 AdamW save (model.half(), a few real steps) FAILED (E700) although the replay was torch's own
    next step bitwise: '3.weight: update size [R003]: max |m_hat|/(sqrt(v_hat)+eps) 31.3 (update/lr) beyond 1.01'
    (torch's FP16 exp_avg_sq underflows to subnormals and 0) and 'exp_avg_sq: 4 element(s) beyond tolerance (max abs
    1.66e-08 ...); param: 943 element(s) beyond tolerance' (the float64 reference kept values FP16 cannot hold, e.g.
    1.7e-8 where 0 is stored, and took another update). The reference now rounds FP16 moments as torch does
    before the parameter update (the fused kernel updates from the unrounded ones: not rounded there), allows an
    FP16 subnormal ulp in the moments, and R003 allows what underflow took from v: OK, with the formula reference,
    one step and two, with replay-step's own seeded gradients too, and the replayed values equal
    torch.optim.AdamW's next step bitwise."""
    ck, grads, model, opt = _fp16_run(tmp_path, steps, eps, fused=fused)
    sq = torch.cat([s["exp_avg_sq"].reshape(-1) for s in opt.state.values()])
    # the saved state holds FP16 subnormals or zeros (what the fix is about); eps 1e-8's later steps no longer do
    assert bool((sq < 2.0**-14).any()) == (eps == 1e-4 or steps == 1)
    res, got = _replay(ck, grads)
    assert res.ok, [(r.fqn, r.problems) for r in res.failed]
    assert all(r.update is not None and r.update.direction <= r.update.direction_bound for r in res.params)
    res2, _ = _replay(ck, grads, steps=2)
    assert res2.ok, [(r.fqn, r.problems) for r in res2.failed]
    seeded = replay_step(ck, ReplayOptions(device="cpu"))  # generated gradients (scale 1e-3), as the CLI's default
    assert seeded.ok, [(r.fqn, r.problems) for r in seeded.failed]
    from safetensors.torch import load_file

    g = load_file(str(grads))
    for n, p in model.named_parameters():
        p.grad = g[n].to(p.dtype)
    opt.step()  # the run's own next step, with the same gradients
    for n, p in model.named_parameters():
        assert torch.equal(got[n]["param"], p.detach()), n
        assert torch.equal(got[n]["exp_avg"], opt.state[p]["exp_avg"]), n
        assert torch.equal(got[n]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), n


def test_a_zeroed_fp16_exp_avg_sq_still_fails(tmp_path: Path) -> None:
    """The FP16 underflow allowance does not excuse a zeroed FP16 exp_avg_sq beside a trained exp_avg: the update of
    1.weight is beyond Adam's bound even with what underflow can take from v (R003, E700)."""

    def zero(state: dict[str, Any]) -> None:
        state["1.weight"]["exp_avg_sq"] = torch.zeros_like(state["1.weight"]["exp_avg_sq"])

    ck, grads, _, _ = _fp16_run(tmp_path, 4, 1e-4, mutate=zero)
    res, _ = _replay(ck, grads)
    assert not res.ok
    assert [r.fqn for r in res.failed] == ["1.weight"]
    (bad,) = res.failed
    assert bad.problems[0].startswith("update size [R003]: max |m_hat|/(sqrt(v_hat)+eps) ")
    assert bad.update.direction > 1.5 * bad.update.direction_bound


def test_a_reset_step_on_an_fp16_save_still_fails(tmp_path: Path) -> None:
    """Ten steps of FP16 AdamW saved with every step reset to 1 (a resume that kept the moments, not the counter):
    the bias correction of step 2 makes the update beyond Adam's bound (R003), the underflow allowance
    notwithstanding."""

    def reset(state: dict[str, Any]) -> None:
        for entry in state.values():
            entry["step"] = torch.tensor(1.0)

    ck, grads, _, _ = _fp16_run(tmp_path, 10, 1e-4, mutate=reset)
    res, _ = _replay(ck, grads)
    assert not res.ok
    assert res.failed and all(r.update is not None for r in res.failed)
    assert any(r.update.direction > r.update.direction_bound * 1.1 for r in res.failed)
