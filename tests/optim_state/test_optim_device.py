"""Optimizers on an accelerator (cuda / npu); every test skips without one.

Run with ``python -m pytest tests/device/test_optim_device.py -q``. Checks: BF16 parameter and
gradient on the device with ``CPUOffloadAdamW(cpu_offload=True)`` in several chunks plus a
tail, three updates against the FP32 reference; master and both moments stay on the CPU,
the parameter on the device; pinned, bounded staging; stream ordering with a real backward.
"""

from __future__ import annotations

import pytest
import torch

from ckpttool.optim_state import CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW
from ckpttool.optim_state.device import accelerator_type
from ckpttool.optim_state.reference import reference_adamw_step

DEVICE_TYPE = accelerator_type()
pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(DEVICE_TYPE is None, reason="needs an accelerator (cuda/npu)"),
]

NUMEL, CHUNK = 1000, 96  # 10 full chunks and a 40-element tail
HYPER = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _device() -> torch.device:
    return torch.device(DEVICE_TYPE, torch.accelerator.current_device_index())


def _grads(step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + step)).to(torch.bfloat16)


def test_offload_bf16_on_device_three_updates_match_fp32_reference():
    dev = _device()
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    p = torch.nn.Parameter(start.to(dev))
    resident = torch.nn.Parameter(torch.randn(33, 3).to(torch.bfloat16).to(dev))
    opt = CPUOffloadAdamW(
        [("layers.0.experts.w", p), ("layers.0.dense.w", resident)],
        cpu_offload=True,
        cpu_offload_param_patterns=["experts"],
        chunk_size=CHUNK,
        **HYPER,
    )
    ref_w = start.float()
    ref_m = torch.zeros(NUMEL, dtype=torch.float64)
    ref_v = torch.zeros(NUMEL, dtype=torch.float64)
    cpu_p = torch.nn.Parameter(start.clone())
    cpu_opt = FullFP32AdamW([cpu_p], **HYPER)  # the same arithmetic on the CPU: must agree bitwise
    for s in range(3):
        g = _grads(s, NUMEL)
        p.grad = g.to(dev)
        resident.grad = torch.randn(33, 3, device=dev).to(torch.bfloat16)
        cpu_p.grad = g.clone()
        opt.step()
        cpu_opt.step()
        ref_w, ref_m, ref_v, _ = reference_adamw_step(
            ref_w, g, ref_m, ref_v, s, HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
        )
    st = opt.state[p]
    assert p.device == dev and p.dtype == torch.bfloat16
    for field in ("master_weight", "exp_avg", "exp_avg_sq", "step"):
        assert st[field].device.type == "cpu", field
    assert st["master_weight"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    assert st["step"].item() == 3.0
    torch.testing.assert_close(st["master_weight"].double(), ref_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st["exp_avg"].double(), ref_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st["exp_avg_sq"].double(), ref_v, rtol=1e-6, atol=1e-7)
    assert torch.equal(st["master_weight"], cpu_opt.state[cpu_p]["master_weight"])
    assert torch.equal(p.detach().cpu(), st["master_weight"].to(torch.bfloat16))
    # the resident parameter keeps its state on the device
    assert opt.state[resident]["master_weight"].device == dev
    assert opt.state[resident]["exp_avg"].device == dev
    assert torch.equal(resident.detach(), opt.state[resident]["master_weight"].to(torch.bfloat16))
    # staging is pinned and bounded: 2 slots x 2 directions x one fp32 chunk
    assert 0 < opt.staging_nbytes <= 2 * 2 * CHUNK * 4
    for kind in ("d2h", "h2d"):
        for buf in opt._staging._bufs[kind]:
            assert buf is None or buf.is_pinned()


def test_offload_after_real_backward_orders_streams():
    dev = _device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).to(torch.bfloat16)
    model.to(dev)
    opt = CPUOffloadAdamW(model.named_parameters(), cpu_offload_param_patterns=[r"^0\."], chunk_size=1000, **HYPER)
    for s in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
        loss = model(x.to(dev)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = model(x.to(dev))  # forward right after the step must see the updated weights
    assert torch.isfinite(out.float()).all()
    for name, p in model.named_parameters():
        st = opt.state[p]
        expect_cpu = name.startswith("0.")
        assert (st["master_weight"].device.type == "cpu") == expect_cpu, name
        assert torch.equal(p.detach().cpu(), st["master_weight"].cpu().to(torch.bfloat16)), name


@pytest.mark.parametrize(
    "cls, tol",
    # BF16 moments: a 1-ulp FP32 difference between device and CPU kernels can flip one BF16 rounding
    [(FullFP32AdamW, {"rtol": 1e-6, "atol": 1e-7}), (MasterFP32AdamW, {"rtol": 1e-5, "atol": 1e-4})],
)
def test_resident_variants_on_device_match_cpu(cls, tol):
    dev = _device()
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    p = torch.nn.Parameter(start.to(dev))
    q = torch.nn.Parameter(start.clone())
    opt, ref = cls([p], **HYPER), cls([q], **HYPER)
    for s in range(3):
        g = _grads(s, NUMEL)
        p.grad, q.grad = g.to(dev), g.clone()
        opt.step()
        ref.step()
    assert opt.state[p]["master_weight"].device == dev
    torch.testing.assert_close(opt.state[p]["master_weight"].cpu(), ref.state[q]["master_weight"], **tol)
    assert torch.equal(p.detach(), opt.state[p]["master_weight"].to(torch.bfloat16))


@pytest.mark.parametrize("cls", ["full", "master_bf16", "offload"])
def test_fused_on_device_matches_torch_fused_on_fp32_copies(cls):
    """``fused=True`` on the device: the same kernel as ``torch.optim.AdamW(fused=True)`` over the FP32 masters.

    BF16 parameters and gradients; offloaded parameters run the fused kernel on host chunks.
    """
    dev = _device()
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    p = torch.nn.Parameter(start.to(dev))
    if cls == "full":
        opt = FullFP32AdamW([p], fused=True, **HYPER)
    elif cls == "master_bf16":
        opt = MasterFP32AdamW([p], fused=True, moment_dtype=torch.bfloat16, **HYPER)
    else:
        opt = CPUOffloadAdamW(
            [("experts.w", p)], cpu_offload_param_patterns=["experts"], chunk_size=CHUNK, fused=True, **HYPER
        )
    ref_dev = torch.device("cpu") if cls == "offload" else dev
    ref = torch.nn.Parameter(start.float().to(ref_dev))
    ref_opt = torch.optim.AdamW([ref], fused=True, **HYPER)
    for s in range(3):
        g = _grads(s, NUMEL)
        p.grad = g.to(dev)
        ref.grad = g.float().to(ref_dev)
        opt.step()
        ref_opt.step()
        if cls == "master_bf16":
            rs = ref_opt.state[ref]
            rs["exp_avg"].copy_(rs["exp_avg"].bfloat16())
            rs["exp_avg_sq"].copy_(rs["exp_avg_sq"].bfloat16())
    st = opt.state[p]
    assert st["step"].device.type == "cpu" and st["step"].item() == 3.0
    assert torch.equal(st["master_weight"].cpu(), ref.detach().cpu())
    assert torch.equal(p.detach().cpu(), st["master_weight"].cpu().to(torch.bfloat16))
    assert torch.equal(st["exp_avg_sq"].float().cpu(), ref_opt.state[ref]["exp_avg_sq"].cpu())
