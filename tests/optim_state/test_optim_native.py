"""The native one-pass AdamW chunk kernel vs torch's fused step followed by the rounding copies, bit for bit.

The reference is what the fused CPU step does without the kernel: ``torch._fused_adamw_`` on
FP32 copies of the chunk (gradient widened, BF16 moments widened), then the moments and the
parameter rounded by ``Tensor.copy_``. Sizes leave tails of every length below torch's 8-wide
vector loop; ``beta1 = 0.3`` takes the other branch of torch's ``lerp``.
"""

from __future__ import annotations

import pytest
import torch

from ckpttool.optim_state.adamw import AdamWHyper, FusedScratch, fused_adamw_chunk_
from ckpttool.optim_state.onepass import StepChunk, available, native_call

pytestmark = pytest.mark.skipif(
    not available(),
    reason=f"native AdamW kernel not loaded (torch's CPU capability here: {torch.backends.cpu.get_cpu_capability()}; "
    "the kernel reproduces the bits of its AVX2 build), or native kernels not built / CKPTTOOL_NATIVE=0",
)

B16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [  # (gradient, moments, parameter or None)
    (F32, F32, B16),
    (B16, F32, B16),
    (B16, B16, F16),
    (F16, F32, F32),
    (F32, B16, None),
]
HYPERS = [AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 1e-2), AdamWHyper(0.1, 0.3, 0.95, 1e-3, 0.0)]


def _inputs(n: int, gdt: torch.dtype, mdt: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen) * 3
    grad = (torch.randn(n, generator=gen) * 0.1).to(gdt)
    grad[::5] = 0.0
    m = (torch.randn(n, generator=gen) * 0.01).to(mdt)
    v = (torch.rand(n, generator=gen) * 1e-3).to(mdt)
    return master, grad, m, v


def _reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    pdt: torch.dtype | None,
    hyper: AdamWHyper,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    w, m32, v32 = master.clone(), m.to(F32, copy=True), v.to(F32, copy=True)
    hyper.fused_adamw_([w], [grad.float()], [m32], [v32], [step])
    return w, m32.to(m.dtype), v32.to(v.dtype), None if pdt is None else w.to(pdt)


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize(("gdt", "mdt", "pdt"), DTYPES)
def test_native_chunk_equals_torch_fused_then_rounding_copies(hyper, gdt, mdt, pdt) -> None:  # type: ignore[no-untyped-def]
    for n in (1, 7, 8, 13, 1029):
        master, grad, m, v = _inputs(n, gdt, mdt, seed=n)
        step = torch.tensor(3.0)
        ref = _reference(master, grad, m, v, step, pdt, hyper)
        param = None if pdt is None else torch.empty(n, dtype=pdt)
        call = native_call(StepChunk(master, grad, m, v, step, param), hyper)
        assert call is not None
        call.run(0, 8 * (n // 16))  # two calls: a split at a multiple of 8 gives the bits of one
        call.run(8 * (n // 16), n)
        for got, want in zip((master, m, v, param), ref):
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, gdt, mdt, pdt)


def test_fused_chunk_falls_back_where_the_kernel_does_not_apply() -> None:
    """A float64 gradient, a strided chunk: the torch path runs, with the same arithmetic."""
    hyper = HYPERS[0]
    master, grad, m, v = _inputs(64, F32, F32, seed=7)
    step = torch.tensor(1.0)
    ref = _reference(master, grad, m, v, step, B16, hyper)
    assert native_call(StepChunk(master.clone(), grad.double(), m.clone(), v.clone(), step, None), hyper) is None
    param = torch.empty(128, dtype=B16)[::2]
    assert native_call(StepChunk(master.clone(), grad, m.clone(), v.clone(), step, param), hyper) is None
    fused_adamw_chunk_(StepChunk(master, grad.double(), m, v, step, param), FusedScratch(), hyper)
    assert ref[3] is not None
    assert torch.equal(master, ref[0]) and torch.equal(m, ref[1]) and torch.equal(param, ref[3])
