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
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["adam_ratio_bound", "beta1_span"]


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
