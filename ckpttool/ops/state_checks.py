"""Optimizer-state checks that read values, shared by ``validate --deep`` (rule ``D005``, on the deep pass's statistics) and ``replay-step``.

*Synthesized state*: ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (and
torchtitan's ``init_optim_state``) on an optimizer that never stepped first runs a step with
zero gradients and ``lr = 0`` (``_init_optim_state`` in ``torch/distributed/checkpoint/
state_dict.py``) so that the state exists: every parameter then has ``step = 1`` and all-zero
``exp_avg`` / ``exp_avg_sq`` (checked on torch 2.13). A resume continues at step 2 and
bias-corrects as if a real step had run. A genuine first step leaves non-zero moments unless
every gradient was exactly zero. torch synthesizes the state of every parameter at once (only an optimizer with
no state at all); a parameter with zero moments at step 1 beside one whose moments are not zero (or whose step is
past 1) got zero gradients in a real step (a ReZero gate or adaLN-Zero modulation at 0 stops every gradient of
its branch in the first step): :func:`synthesized`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpttool.model.catalog import Catalog, TensorEntry

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader

__all__ = [
    "FLOAT32_COUNT_LIMIT",
    "MOMENTS",
    "exp_avg_lost",
    "is_synthesized",
    "step_not_count",
    "synthesized",
    "synthesized_params",
]

MOMENTS = ("exp_avg", "exp_avg_sq")


def is_synthesized(step: float | None, moments_zero: Iterable[bool | None]) -> bool:
    """The one predicate: ``step == 1`` and every moment known to be all zero."""
    zeros = list(moments_zero)
    return step == 1.0 and len(zeros) == len(MOMENTS) and all(z is True for z in zeros)


def synthesized(states: Iterable[tuple[str, float | None, list[bool | None]]]) -> list[str]:
    """The parameters whose state torch synthesized, of ``(fqn, step, [exp_avg all zero, exp_avg_sq all zero])``
    (``None``: not known): those :func:`is_synthesized` holds for, unless another parameter shows a real step (a
    moment known not to be all zero, or a step past 1), as torch synthesizes every parameter's state or none."""
    out, stepped = [], False
    for fqn, step, zeros in states:
        if is_synthesized(step, zeros):
            out.append(fqn)
        elif any(z is False for z in zeros) or (step is not None and step > 1):
            stepped = True
    return [] if stepped else out


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
    states: list[tuple[str, float | None, list[bool | None]]] = []
    for fqn in fqns:
        ps = cat.optimizer_state.get(fqn)
        if ps is None:
            continue
        step = ps.fields.get("step")
        moments = [ps.fields.get(m) for m in MOMENTS]
        if not isinstance(step, TensorEntry) or step.numel != 1 or not all(isinstance(m, TensorEntry) for m in moments):
            continue
        value = float(reader.read_tensor(step.key).reshape(-1)[0])
        zeros: list[bool | None] = [None, None]
        if value == 1.0:
            zeros = [not bool(reader.read_tensor(m.key).any()) for m in moments if m is not None]
        states.append((fqn, value, zeros))
    return synthesized(states)
