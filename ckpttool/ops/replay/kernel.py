"""The one-pass native reference and comparison of a replayed slab (``ckpttool/engine/native/replay.c``).

For one replayed step (K = 1) and the float64 reference, one kernel call per slab reads the
saved values (theta, moments), the gradient and the replayed fields once and returns what
``run._SlabContext`` otherwise computes with a few dozen float64 torch passes: the reference
step of :func:`ckpttool.optim_state.reference.reference_adamw_step` (same operations, same order,
no fused multiply-add), each field's :class:`~ckpttool.ops.replay.compare.FieldError`, the
bitwise sync / write-back counts and the update-size maxima, with the same bits. ctypes releases
the GIL, so the engine's pool threads run slabs in parallel. :func:`slab_kernel` returns ``None``
where the kernels are not built or turned off (``CKPTTOOL_NATIVE=0``): the torch path runs.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache
from typing import TYPE_CHECKING, Any

from ckpttool.engine import native
from ckpttool.ops.replay.compare import FieldError

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "SlabOutput", "slab_kernel", "run_slab"]

#: dtype name -> the kernel's kind code
KINDS = {"float32": 1, "bfloat16": 2, "float16": 3, "float64": 4}
#: field order of the kernel's outputs
FIELDS = ("master_weight", "exp_avg", "exp_avg_sq", "param")
_SLOTS = 9  # theta, saved param, m0, v0, grad, master, m1, v1, param


@cache
def slab_kernel() -> Any:
    """``ckpt_replay_slab``, or ``None`` where the native kernels are unavailable."""
    p = ctypes.c_void_p
    return native.function("ckpt_replay_slab", ctypes.c_int32, p, p, ctypes.c_int64, p, p, p)


def constants(
    hyper: Any,
    step_before: float,
    atol: float,
    rtols: tuple[float, float, float, float],
    lr_dtype: torch.dtype | None = None,
    betas_dtype: torch.dtype | None = None,
) -> ctypes.Array[ctypes.c_double]:
    """The kernel's ``k[14]``: the reference's Python-double constants (as ``reference_adamw_step`` forms them).

    ``hyper``: the parameter's :class:`~ckpttool.ops.replay.plan.Hyper`; ``rtols``: the effective
    relative tolerances of master, ``exp_avg``, ``exp_avg_sq``, parameter; ``lr_dtype``, ``betas_dtype``: as
    :func:`~ckpttool.optim_state.reference.tensor_lr_scalars` takes them.
    """
    from ckpttool.optim_state.reference import tensor_lr_scalars

    beta1, beta2 = float(hyper.beta1), float(hyper.beta2)
    t = float(step_before) + 1.0
    decay, lr, bias_correction1, bias_correction2 = tensor_lr_scalars(
        float(hyper.lr), float(hyper.weight_decay), (beta1, beta2), t, lr_dtype, betas_dtype
    )
    values = (
        decay,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        bias_correction1,
        bias_correction2,
        lr,
        float(hyper.eps),
        float(atol),
        *rtols,
    )
    return (ctypes.c_double * 14)(*values)


class SlabOutput:
    """One slab's results, as the torch path reports them (NaN maxima of fields become ``inf``)."""

    def __init__(self, out: Any, counts: Any, rtols: tuple[float, float, float, float]) -> None:
        self.fields: dict[str, FieldError] = {}
        for j, name in enumerate(FIELDS):
            mx = [out[3 * j + i] for i in range(3)]
            mx = [max(0.0, x if x == x else math.inf) for x in mx]
            self.fields[name] = FieldError(mx[0], mx[1], mx[2], int(counts[j]), rtols[j])
        self.sync_diff = float(out[12])
        u = float(out[15])
        self.update = (float(out[13]), float(out[14]), u if u == u else math.inf)
        self.sync_unequal, self.writeback_unequal, self.param_vs_reference_unequal = (int(c) for c in counts[4:7])


def run_slab(
    tensors: list[torch.Tensor | None], n: int, k: ctypes.Array[ctypes.c_double], rtols: tuple[float, ...]
) -> SlabOutput:
    """Run the kernel over ``n`` elements of the 1-d contiguous CPU tensors ``tensors``.

    Args:
        tensors: theta, saved parameter (``None``: no sync check), m0, v0 (``None``: fresh, zeros),
            gradient, master (``None``: plain AdamW), m1, v1, parameter; dtypes of :data:`KINDS`.
        n: elements (each tensor holds at least ``n``).
        k: :func:`constants`.
        rtols: the effective relative tolerances (master, ``exp_avg``, ``exp_avg_sq``, parameter).

    Raises:
        RuntimeError: the kernel refused its arguments (a dtype out of range: a caller's bug).
    """
    ptrs = (ctypes.c_void_p * _SLOTS)(*(t.data_ptr() if t is not None else None for t in tensors))
    kinds = (ctypes.c_int32 * _SLOTS)(*(KINDS[str(t.dtype)[6:]] if t is not None else 0 for t in tensors))
    out = (ctypes.c_double * 16)()
    counts = (ctypes.c_int64 * 7)()
    if slab_kernel()(ptrs, kinds, n, k, out, counts) != 0:
        raise RuntimeError("ckpt_replay_slab refused its arguments")
    return SlabOutput(out, counts, (rtols[0], rtols[1], rtols[2], rtols[3]))
