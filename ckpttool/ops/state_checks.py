"""Optimizer-state checks that read values, shared by ``validate --deep`` (rule ``D005``, on the deep pass's statistics) and ``replay-step``.

*Synthesized state*: ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (and
torchtitan's ``init_optim_state``) on an optimizer that never stepped first runs a step with
zero gradients and ``lr = 0`` (``_init_optim_state`` in ``torch/distributed/checkpoint/
state_dict.py``) so that the state exists: every parameter then has ``step = 1`` and all-zero
``exp_avg`` / ``exp_avg_sq`` (checked on torch 2.13). A resume continues at step 2 and
bias-corrects as if a real step had run. A genuine first step leaves non-zero moments unless
every gradient was exactly zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpttool.model.catalog import Catalog, TensorEntry

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader

__all__ = ["FLOAT32_COUNT_LIMIT", "MOMENTS", "exp_avg_lost", "is_synthesized", "step_not_count", "synthesized_params"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def is_synthesized(step: float | None, moments_zero: Iterable[bool | None]) -> bool:
    """The one predicate: ``step == 1`` and every moment known to be all zero."""
    zeros = list(moments_zero)
    return step == 1.0 and len(zeros) == len(MOMENTS) and all(z is True for z in zeros)


#: The last whole number a float32 ``step`` reaches by adding 1.0 (``torch.optim``'s counter): 2^24.
FLOAT32_COUNT_LIMIT = 1 << 24


def step_not_count(value: float, float32: bool) -> str | None:
    """Why a saved ``step`` is no count of steps ``torch.optim`` takes (``"is 2.5, not a count ..."``), else ``None``;
    the one check behind ``replay-step``'s ``E511`` and ``validate --deep``'s ``D003``. ``float32``: the step is a
    float32 tensor, or a Python number (``torch.optim.AdamW`` loads it as a float32 tensor, ``Adam.__setstate__``).
    Adam's bias corrections of a negative, infinite or NaN step are complex or NaN; a fractional one (2.5) is no step
    torch takes (its counter adds 1.0 to a whole number); a float32 counter stops at 2^24 (2^24 + 1 rounds back)."""
    if not (math.isfinite(value) and value >= 0.0 and float(value).is_integer()):
        return f"is {value:g}, not a count of steps taken (a finite whole number >= 0)"
    if float32 and value > FLOAT32_COUNT_LIMIT:
        return (
            f"is {value:g}, beyond what a float32 step counter reaches by adding 1.0 ({FLOAT32_COUNT_LIMIT:,}: "
            "2^24 + 1 rounds back to 2^24), so not a count of steps taken"
        )
    return None


def exp_avg_lost(
    step: float | None, beta1: float | None, exp_avg_zero: bool | None, exp_avg_sq_zero: bool | None
) -> bool:
    """The other predicate (``validate --deep``'s ``D015``, ``replay-step``'s note): ``exp_avg`` all zero while
    ``exp_avg_sq`` is not, at a saved ``step`` of 2 or more. AdamW's ``exp_avg`` is zero only where every gradient
    was, and ``exp_avg_sq`` would be too: the first moment was reset or lost. Not with ``beta1`` 0, where ``exp_avg``
    is the last gradient alone (a zero last gradient zeroes it)."""
    return (
        step is not None
        and step >= 2
        and (beta1 is None or beta1 != 0)
        and exp_avg_zero is True
        and exp_avg_sq_zero is False
    )


def synthesized_params(reader: CheckpointReader, cat: Catalog, fqns: Iterable[str]) -> list[str]:
    """Parameters among ``fqns`` whose state is synthesized, reading ``step`` and (only where it is 1) the moments.

    Raises:
        CkptError: a chunk cannot be read.
    """
    out = []
    for fqn in fqns:
        ps = cat.optimizer_state.get(fqn)
        if ps is None:
            continue
        step = ps.fields.get("step")
        moments = [ps.fields.get(m) for m in MOMENTS]
        if not isinstance(step, TensorEntry) or step.numel != 1 or not all(isinstance(m, TensorEntry) for m in moments):
            continue
        if float(reader.read_tensor(step.key).reshape(-1)[0]) != 1.0:
            continue
        zeros = [not bool(reader.read_tensor(m.key).any()) for m in moments if m is not None]
        if is_synthesized(1.0, zeros):
            out.append(fqn)
    return out
