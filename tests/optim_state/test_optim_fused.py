"""``fused=True`` and the default foreach step of every FP32-master variant vs ``torch.optim.AdamW`` with the same setting.

The reference is torch's own AdamW run on FP32 copies of the (possibly BF16) starting
weights with the gradients widened to FP32 (``fused=True`` / ``foreach=True``): an FP32
master is exactly such a parameter. The fused step walks the CPU tensors in chunks of
``FUSED_CHUNK`` elements; the shapes cross several chunks and leave odd tails.
"""

from __future__ import annotations

import pytest
import torch

from ckpttool.errors import UsageError
from ckpttool.optim_state import CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW, build_optimizer
from ckpttool.optim_state.adamw import FUSED_CHUNK

SHAPES = [(FUSED_CHUNK * 2 + 77,), (33, 1000), (5,), (1, 7)]
HYPER = [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.02, "weight_decay": 0.0}]
BETAS, EPS = (0.9, 0.95), 1e-8


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return [(torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype) for p in params]


def _groups(params: list[torch.Tensor], named: bool = False) -> list[dict]:
    items = [(f"l{i}.{'experts' if i % 2 == 0 else 'dense'}", p) for i, p in enumerate(params)]
    if not named:
        items = [p for _, p in items]  # type: ignore[misc]
    return [{"params": items[:2], **HYPER[0]}, {"params": items[2:], **HYPER[1]}]


def _ours(kind: str, params: list[torch.nn.Parameter], impl: dict) -> torch.optim.Optimizer:
    if kind == "full":
        return FullFP32AdamW(_groups(params), betas=BETAS, eps=EPS, **impl)
    if kind == "master_f32":
        return MasterFP32AdamW(_groups(params), betas=BETAS, eps=EPS, moment_dtype=torch.float32, **impl)
    if kind == "offload":  # even-numbered parameters offloaded in 1000-element host chunks
        return CPUOffloadAdamW(
            _groups(params, named=True),
            betas=BETAS,
            eps=EPS,
            cpu_offload_param_patterns=["experts"],
            chunk_size=1000,
            **impl,
        )
    raise AssertionError(kind)


IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}}


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("kind", ["full", "master_f32", "offload"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_adamw_with_the_same_setting_bitwise(impl: str, kind: str, param_dtype: torch.dtype) -> None:
    params = _params(param_dtype)
    opt = _ours(kind, params, IMPLS[impl])
    assert opt.fused is (impl == "fused")  # type: ignore[attr-defined]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ref_opt = torch.optim.AdamW(_groups(ref), betas=BETAS, eps=EPS, **IMPLS[impl])
    for s in range(3):
        for p, r, g in zip(params, ref, _grads(s, params)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        st, rst = opt.state[p], ref_opt.state[r]
        assert torch.equal(st["master_weight"], r.detach()), (impl, kind, p.shape)
        assert torch.equal(st["exp_avg"], rst["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], rst["exp_avg_sq"])
        assert st["step"].item() == 3.0 and st["step"].device.type == "cpu"
        assert torch.equal(p.detach(), st["master_weight"].to(param_dtype))  # one rounding copy


def test_fused_bf16_moments_equal_torch_fused_with_moments_rounded_each_step() -> None:
    params = _params(torch.bfloat16)
    opt = MasterFP32AdamW(_groups(params), betas=BETAS, eps=EPS, fused=True)  # bf16 moments
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ref_opt = torch.optim.AdamW(_groups(ref), betas=BETAS, eps=EPS, fused=True)
    for s in range(3):
        for p, r, g in zip(params, ref, _grads(s, params)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
        for r in ref:  # the BF16 state stores its moments rounded between steps
            rs = ref_opt.state[r]
            rs["exp_avg"].copy_(rs["exp_avg"].bfloat16())
            rs["exp_avg_sq"].copy_(rs["exp_avg_sq"].bfloat16())
    for p, r in zip(params, ref):
        st, rst = opt.state[p], ref_opt.state[r]
        assert st["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(st["master_weight"], r.detach())
        assert torch.equal(st["exp_avg"].float(), rst["exp_avg"]) and torch.equal(
            st["exp_avg_sq"].float(), rst["exp_avg_sq"]
        )


def test_fused_and_foreach_are_exclusive_and_build_optimizer_passes_fused() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(UsageError, match="both"):
        FullFP32AdamW([p], fused=True, foreach=True)
    with pytest.raises(UsageError, match="per-tensor loop"):
        FullFP32AdamW([p], foreach=False)
    assert build_optimizer("master_fp32_adamw", [p], fused=True).fused is True  # type: ignore[attr-defined]
    assert build_optimizer("adamw", [p], fused=True).defaults["fused"] is True


def test_fused_fp32_parameter_is_its_master_and_the_state_dict_holds_a_copy() -> None:
    params = _params(torch.float32)
    opt = FullFP32AdamW(_groups(params), betas=BETAS, eps=EPS, fused=True)
    for s in range(2):
        for p, g in zip(params, _grads(s, params)):
            p.grad = g
        opt.step()
    for p in params:  # one copy in memory, as torch.optim.AdamW keeps
        assert opt.state[p]["master_weight"].data_ptr() == p.data_ptr()
    sd = opt.state_dict()
    for i, p in enumerate(params):
        saved = sd["state"][i]["master_weight"]
        assert torch.equal(saved, p.detach()) and saved.data_ptr() != p.data_ptr()
        saved.add_(1.0)  # a load into the state dict leaves the parameter alone
        assert not torch.equal(saved, p.detach())
    assert all(opt.state[p]["master_weight"].data_ptr() == p.data_ptr() for p in params)


def test_fused_chunks_on_one_thread_equal_the_parallel_split() -> None:
    """The chunked fused step (BF16 parameters) gives the same bits on one intra-op thread and split over two."""
    results = []
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            params = _params(torch.bfloat16)
            opt = MasterFP32AdamW(_groups(params), betas=BETAS, eps=EPS, moment_dtype=torch.float32, fused=True)
            for p, g in zip(params, _grads(0, params)):
                p.grad = g
            opt.step()
            results.append([(p.detach().clone(), opt.state[p]["master_weight"].clone()) for p in params])
    finally:
        torch.set_num_threads(prev)
    assert torch.get_num_threads() == prev
    for (p1, w1), (p2, w2) in zip(*results):
        assert torch.equal(p1, p2) and torch.equal(w1, w2)
