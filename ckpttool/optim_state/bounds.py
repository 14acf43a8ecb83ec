"""How large Adam's moment ratio can be: the bound behind ``replay-step``'s ``R003`` and ``validate``'s ``D007``.

Torch-free arithmetic only. With ``m_t = sum_i (1-b1) b1^(t-i) g_i`` and
``v_t = sum_i (1-b2) b2^(t-i) g_i^2`` from zero state (torch's AdamW, ``torch/optim/adamw.py``;
Kingma & Ba 2015, Algorithm 1), Cauchy-Schwarz gives for *any* gradients::

    |m_t| <= (1-b1)/sqrt(1-b2) * sqrt(sum_{k<t} (b1^2/b2)^k) * sqrt(v_t)

and with bias correction ``|m_hat_t| / sqrt(v_hat_t)`` is that times ``sqrt(1-b2^t)/(1-b1^t)``
(exactly 1 at ``t = 1``; about 7.3 for large ``t`` with ``b1 = 0.9, b2 = 0.999``). Moments that
exceed it did not come from this recursion with these betas: a zeroed or stale ``exp_avg_sq``,
a ``step`` reset. ``docs/replay.md``, "Update size"; ``docs/rules.md`` ``D007``.

Where ``b1`` moved within ``[lo, hi]`` during the run (torch's ``OneCycleLR`` and ``CyclicLR`` cycle ``betas[0]``
between a param group's ``base_momentum`` and ``max_momentum``), each weight of ``m_t``,
``(1-b1_i) * prod_{j>i} b1_j``, is at most ``(1-lo) hi^(t-i)``, so the same steps give the bound with
``(1-lo)`` for ``(1-b1)`` and ``hi^2/b2`` for ``b1^2/b2``; the bias correction is the saved ``b1``'s (torch's
``1 - b1^t`` with the ``b1`` of the step).

An FP16 ``exp_avg_sq`` (``model.half()`` with torch's AdamW) holds no value below ``2**-24`` but zero: torch rounds
``v`` to FP16 twice a step (``mul_(beta2)``, ``addcmul_``), each time losing up to half a subnormal ulp, ``2**-25``,
so the stored ``v_t`` is below Adam's by at most :func:`fp16_underflow_margin`; the bound holds for the stored
moments with that margin added to ``v_t`` (``validate``'s ``D007`` allows an underflowed FP16 ``v`` likewise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["FP16_SUBNORMAL", "adam_ratio_bound", "beta1_span", "fp16_step_factor", "fp16_underflow_margin"]

#: The smallest positive FP16 value (its subnormal ulp): an FP16 ``exp_avg_sq`` rounds to a multiple of it below 2**-14.
FP16_SUBNORMAL = 2.0**-24


def beta1_span(group: Mapping[str, object]) -> tuple[float, float] | None:
    """``(lowest, highest)`` ``betas[0]`` an Adam param group (its saved entries, ``group``) took during the run where
    an LR scheduler cycled it: torch's ``OneCycleLR`` and ``CyclicLR`` with ``cycle_momentum`` (their default) save
    ``base_momentum`` and ``max_momentum`` in each group and move ``betas[0]`` between them at every step (inversely to
    the lr). ``None`` where the group saves no such pair of real numbers (``betas`` as constructed)."""
    lo, hi = group.get("base_momentum"), group.get("max_momentum")
    if type(lo) not in (int, float) or type(hi) not in (int, float):
        return None
    a, b = float(lo), float(hi)  # type: ignore[arg-type]
    return (min(a, b), max(a, b)) if math.isfinite(a) and math.isfinite(b) else None


def adam_ratio_bound(
    step: float,
    beta1: float,
    beta2: float,
    *,
    bias_corrected: bool = True,
    span: tuple[float, float] | None = None,
) -> float:
    """The largest ``|m| / sqrt(v)`` (``bias_corrected``: ``|m_hat| / sqrt(v_hat)``) after ``step`` Adam steps.

    Args:
        step: steps taken (``t >= 1``; smaller values count as 1).
        beta1, beta2: the group's betas (as saved: those of the last step).
        bias_corrected: bound the bias-corrected ratio (the update in units of lr) or the raw saved moments.
        span: ``(lo, hi)`` of ``beta1`` over the run where a scheduler moved it (:func:`beta1_span`); ``None``:
            ``beta1`` throughout.

    Returns:
        The bound; ``inf`` for betas outside ``[0, 1)`` (no bound is known), and where it exceeds the float
        range (``beta1^2 > beta2``: the bound grows as ``(beta1^2 / beta2)^(step / 2)``).
    """
    t = max(1, int(step))
    lo, hi = (min(span[0], beta1), max(span[1], beta1)) if span is not None else (beta1, beta1)
    if not (0 <= lo and hi < 1 and 0 <= beta2 < 1):
        return math.inf
    if beta2 == 0:
        return math.inf if hi > 0 else 1.0
    q = hi * hi / beta2
    if q > 1 and t * math.log(q) > 700:  # beyond float range (q**t would raise OverflowError): no finite bound
        return math.inf
    series = float(t) if q == 1 else (1 - q**t) / (1 - q)
    raw = (1 - lo) / math.sqrt(1 - beta2) * math.sqrt(series)
    if not bias_corrected:
        return raw
    return raw * math.sqrt(1 - beta2**t) / (1 - beta1**t)


def fp16_underflow_margin(step: float, beta2: float) -> float:
    """How far below Adam's own ``v_t`` an FP16-stored ``exp_avg_sq`` can be after ``step`` steps from underflow alone.

    Each step rounds ``v`` twice (``2**-25`` at most each below 2**-14: :data:`FP16_SUBNORMAL` a step), and
    ``beta2`` decays what earlier steps lost: ``2**-24 * sum_{k<t} beta2^k``. Above 2**-14 the rounding is relative
    (an FP16 ulp), as BF16's, and is not counted here.

    Args:
        step: steps taken (``t >= 1``; smaller values count as 1).
        beta2: the group's ``betas[1]``.

    Returns:
        The margin (``2**-24 * t`` for ``beta2`` outside ``[0, 1)``).
    """
    t = max(1, int(step))
    if not 0 <= beta2 < 1:
        return FP16_SUBNORMAL * t
    return FP16_SUBNORMAL * (1 - beta2**t) / (1 - beta2)


def fp16_step_factor(beta2: float, eps: float) -> float:
    """How many times ``lr * adam_ratio_bound`` one step can move an element whose ``exp_avg_sq`` is stored in FP16.

    :func:`fp16_underflow_margin` over ``1 - beta2^t`` is at most ``c = 2**-24 / (1 - beta2)`` at every step, so
    ``|m_hat| <= bound * sqrt(v_hat + c)`` with the stored ``v_hat``, and ``|m_hat| / (sqrt(v_hat) + eps)`` is at most
    ``bound * (1 + sqrt(c) / eps)``: about 78 with ``beta2`` 0.999 and ``eps`` 1e-4 (torch's own first step of an
    element whose ``(1 - beta2) * g**2`` underflows moves it by ``lr * |g| / eps``, not ``lr``).

    Returns:
        The factor; ``inf`` for ``beta2`` outside ``[0, 1)`` or ``eps <= 0``.
    """
    if not (0 <= beta2 < 1 and eps > 0):
        return math.inf
    return 1 + math.sqrt(FP16_SUBNORMAL / (1 - beta2)) / eps
