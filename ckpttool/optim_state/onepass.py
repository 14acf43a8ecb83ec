"""The native one-pass AdamW step (``ckpttool/engine/native/adamw.c``) behind the fused CPU step.

One kernel call reads a range of the gradient, FP32 master and moments once and writes master,
moments and the rounded parameter in the same pass, with the bits of ``torch._fused_adamw_``
over the same elements followed by the rounding ``Tensor.copy_`` calls (``docs/design.md``,
"Optimizer kernels"). It applies to contiguous CPU tensors with an FP32/BF16/FP16 gradient,
FP32/BF16 moments and an FP32/BF16/FP16 parameter (or none), where torch runs its AVX2 kernels
(``torch.backends.cpu.get_cpu_capability()``: the kernel reproduces that build's bits);
:func:`native_call` returns ``None`` elsewhere, and where the native kernels are not built or
turned off (``CKPTTOOL_NATIVE=0``), and the caller runs torch's kernel.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ckpttool.engine import native

if TYPE_CHECKING:
    from ckpttool.optim_state.adamw import AdamWHyper

__all__ = ["NativeCall", "PIECE", "StepChunk", "native_call", "run_native"]

#: dtype -> the kernel's kind code
_KIND = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}

#: Elements per piece of a parallel step (a multiple of torch's 8-wide vector loop, so splitting
#: a tensor into pieces leaves the same scalar tail as one call over it).
PIECE = 1 << 20


class StepChunk(NamedTuple):
    """One parameter's 1-d CPU tensors ``[n]`` for one AdamW update (``step`` already incremented)."""

    master: torch.Tensor  # float32, updated in place
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # 0-d float32
    param: torch.Tensor | None  # receives the rounded master, or ``None``


@cache
def _kernel() -> Any:
    """``ckpt_adamw_step``, or ``None`` where the native kernels are unavailable."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return None  # the kernel reproduces the bits of torch's AVX2 build; elsewhere torch's own kernel runs
    p, i32 = ctypes.c_void_p, ctypes.c_int32
    return native.function("ckpt_adamw_step", i32, p, p, i32, p, p, i32, p, i32, ctypes.c_int64, p)


def available() -> bool:
    """Whether the native kernel is loaded."""
    return _kernel() is not None


@lru_cache(maxsize=64)
def _constants(hyper: AdamWHyper, step: float) -> ctypes.Array[ctypes.c_float]:
    """The kernel's float32 constants for one step: torch's double values, rounded to float32.

    As ``ATen/native/cpu/FusedAdamKernel.cpp`` computes them: ``1 - lr*wd``, ``1 - beta1``,
    ``beta2``, ``1 - beta2``, ``sqrt(1 - beta2**step)``, ``eps``, ``-lr / (1 - beta1**step)``; then
    the weight-decay flag and 0 (the kernel picks its AVX2 code where the CPU has it).
    """
    lr, b1, b2 = hyper.lr, hyper.beta1, hyper.beta2
    values = (1 - lr * hyper.weight_decay, 1 - b1, b2, 1 - b2, math.sqrt(1 - b2**step), hyper.eps)
    return (ctypes.c_float * 9)(*values, -(lr / (1 - b1**step)), float(hyper.weight_decay != 0), 0.0)


@dataclass(frozen=True)
class NativeCall:
    """The kernel's arguments for one parameter's 1-d tensors; :meth:`run` updates a range of them."""

    tensors: tuple[torch.Tensor, ...]  # master, grad, exp_avg, exp_avg_sq[, param]: kept alive for the pointers
    kinds: tuple[int, int, int]  # gradient, moments, parameter (0: none)
    constants: ctypes.Array[ctypes.c_float]
    n: int

    def run(self, a: int, b: int) -> None:
        """Update elements ``[a, b)`` (``a`` a multiple of 8, or 0)."""
        ptr = [t.data_ptr() + a * t.element_size() for t in self.tensors]
        param = ptr[4] if len(ptr) > 4 else None
        gk, mk, pk = self.kinds
        rc = _kernel()(ptr[0], ptr[1], gk, ptr[2], ptr[3], mk, param, pk, b - a, self.constants)
        if rc != 0:  # unreachable: native_call admits only the kinds the kernel takes
            raise RuntimeError(f"ckpt_adamw_step refused kinds {self.kinds}")


def native_call(chunk: StepChunk, hyper: AdamWHyper) -> NativeCall | None:
    """The kernel call for one parameter's 1-d tensors ``[n]`` (``step`` already incremented), or ``None``.

    ``None`` where the kernel is unavailable or does not apply: a tensor off the CPU or not
    contiguous, a master other than FP32, a gradient or parameter other than FP32/BF16/FP16,
    moments other than FP32/BF16 or of two dtypes.
    """
    if _kernel() is None:
        return None
    master, grad, exp_avg, exp_avg_sq, step, param = chunk
    tensors = (master, grad, exp_avg, exp_avg_sq) if param is None else (master, grad, exp_avg, exp_avg_sq, param)
    n = master.numel()
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n for t in tensors):
        return None  # the kernel runs over n elements of every tensor
    gk, mk = _KIND.get(grad.dtype, 0), _KIND.get(exp_avg.dtype, 0)
    pk = 0 if param is None else _KIND.get(param.dtype, 0)
    if master.dtype != torch.float32 or not gk or mk not in (1, 2) or exp_avg_sq.dtype != exp_avg.dtype:
        return None
    if param is not None and not pk:
        return None
    return NativeCall(tensors, (gk, mk, pk), _constants(hyper, step.item()), n)


def run_native(calls: Sequence[NativeCall], threads: int) -> None:
    """Run ``calls`` over all their elements in pieces of :data:`PIECE`, split over ``threads`` pool threads.

    The pieces are independent elementwise updates, so the result does not depend on the split;
    ctypes releases the GIL for each kernel call.
    """
    pieces = [(c, a, min(c.n, a + PIECE)) for c in calls for a in range(0, c.n, PIECE)]
    threads = min(threads, len(pieces))
    if threads <= 1:
        for c, a, b in pieces:
            c.run(a, b)
        return
    from ckpttool.engine.pool import map_ordered

    per = -(-len(pieces) // threads)

    def work(k: int) -> None:
        for c, a, b in pieces[k * per : (k + 1) * per]:
            c.run(a, b)

    map_ordered(work, range(-(-len(pieces) // per)), workers=threads)
