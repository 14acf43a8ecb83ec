"""What the ``--deep`` pass found: per-tensor value statistics and pair comparisons (plain data).

Filled by :func:`ckpttool.ops.validate.deep.run_deep`, read by the ``D`` rules and others
through :attr:`ckpttool.ops.validate.context.Context.deep_result`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckpttool.errors import CkptError

__all__ = ["UNINIT_BOUND", "DeepResult", "PairStats", "TensorStats", "expert_count", "expert_grid", "second_moment"]

#: ``|x|`` beyond which a model value looks uninitialised (``D013``; why this bound: docs/rules.md).
UNINIT_BOUND = 1e4


def second_moment(key: str) -> bool:
    """``key`` is a running mean of squared gradients (``exp_avg_sq``) or amsgrad's running maximum of it
    (``max_exp_avg_sq``): never negative (``D002``)."""
    return key.endswith((".exp_avg_sq", ".max_exp_avg_sq"))


def expert_count(key: str, size: tuple[int, ...]) -> int:
    """Experts along dim 0 of a fused expert tensor (a key with ``experts``, 3 or more dims), else 0."""
    return size[0] if "experts" in key and len(size) >= 3 and size[0] > 1 else 0


def expert_grid(key: str, size: tuple[int, ...], stacked: bool) -> tuple[int, int]:
    """``(layers, experts per layer)`` of a fused expert tensor: ``[E, ...]`` is ``(1, E)``; with every layer stacked
    on dim 0 (``stacked``: Megatron-core's ``decoder.layers.<...>.experts.<...> [L, E, out, in]``) ``(L, E)``, the
    experts on dim 1. ``(0, 0)``: no experts to compare."""
    if not stacked:
        e = expert_count(key, size)
        return (1, e) if e else (0, 0)
    return (size[0], size[1]) if "experts" in key and len(size) >= 4 and size[1] > 1 else (0, 0)


@dataclass
class TensorStats:
    """Summary of one tensor's values.

    Attributes:
        key: checkpoint key; dtype: stored dtype name; numel: values summarised (a complex element: its two parts).
        nonfinite: NaN/inf count (floating dtypes); negative: values < 0 (when asked).
        min, max: over all values (NaN when any is NaN), ``None`` for non-float or empty.
        values: every value, for ``step`` fields (few elements).
        zero: every value is +-0 (floating dtypes; ``None`` when not known).
        beyond: finite values with ``|x| > UNINIT_BOUND`` (model tensors, ``D013``); beyond_max:
            the largest such ``|x|`` (0.0: none); subnormal: subnormal values (model tensors of
            bfloat16/float32/float64).
        digests: ``(flat start, length, CRC-32)`` runs of a model tensor's (or a parameter's master weight's or
            moment's) bytes in global C
            order (a chunk, or for fused expert tensors ``[E, ...]`` the part of a chunk inside
            one expert), when it was streamed; lengths summing to ``numel`` mean complete.
    """

    key: str
    dtype: str
    numel: int = 0
    nonfinite: int = 0
    negative: int = 0
    min: float | None = None
    max: float | None = None
    values: list[float] = field(default_factory=list)
    zero: bool | None = None
    digests: list[tuple[int, int, int]] = field(default_factory=list)
    beyond: int = 0
    beyond_max: float = 0.0
    subnormal: int = 0

    @property
    def parts(self) -> int:
        """Values summarised per element: 2 for a complex dtype (its real and imaginary parts), else 1."""
        return 2 if self.dtype.startswith("complex") else 1

    def covers(self, numel: int) -> bool:
        """Every value of a tensor of ``numel`` elements was summarised (a complex one: both parts of each)."""
        return self.numel == numel * self.parts

    def of_values(self) -> str:
        """``of N values`` for a message, naming the parts of a complex tensor."""
        if self.parts == 1:
            return f"of {self.numel} values"
        return f"of {self.numel} values (real and imaginary parts of {self.numel // 2} {self.dtype})"

    def add(self, other: TensorStats) -> None:
        if other.numel:
            self.zero = (
                other.zero
                if self.numel == 0
                else (None if None in (self.zero, other.zero) else bool(self.zero and other.zero))
            )
        self.numel += other.numel
        self.nonfinite += other.nonfinite
        self.negative += other.negative
        for name, pick in (("min", min), ("max", max)):
            a, b = getattr(self, name), getattr(other, name)
            if b is None:
                continue
            if a is None or math.isnan(b):
                setattr(self, name, b)
            elif not math.isnan(a):
                setattr(self, name, pick(a, b))
        self.values.extend(other.values)
        self.digests.extend(other.digests)
        self.beyond += other.beyond
        self.beyond_max = max(self.beyond_max, other.beyond_max)
        self.subnormal += other.subnormal


@dataclass
class PairStats:
    """Comparison of two tensors that must hold the same values.

    Attributes:
        kind: ``"master"`` (``a`` = BF16/FP16 parameter, ``b`` = its ``master_weight``),
            ``"tied"`` (``a`` = ``lm_head.weight``, ``b`` = the input embedding) or
            ``"moments"`` (``a`` = ``exp_avg``, ``b`` = ``exp_avg_sq`` of one parameter: not
            compared for equality; ``mismatched`` counts elements where ``b`` is 0 and ``a``
            is not, ``max_diff`` is the largest ``|a| / sqrt(b)`` over ``b > 0``) or
            ``"amsgrad"`` (``a`` = amsgrad's ``max_exp_avg_sq``, ``b`` = ``exp_avg_sq`` of one parameter, the same
            dtype: ``mismatched`` counts elements where ``a < b`` (a negative ``a`` left out: ``D002``),
            ``max_diff`` is the largest ``b - a`` of them, in float64, at global index ``worst_at`` with values
            ``worst_a`` and ``worst_b``).
        numel: elements compared; mismatched: elements that differ (after casting ``b`` to
            ``a``'s dtype); max_diff: largest ``|a - b|`` (in float32/64) over them, NaN differences left
            out; nan_mismatched: those of them where one side is NaN and the other a number (infinity
            included), which ``max_diff`` does not measure.
    """

    a: str
    b: str
    kind: str
    numel: int = 0
    mismatched: int = 0
    max_diff: float = 0.0
    compared: bool = False
    nan_mismatched: int = 0
    worst_at: tuple[int, ...] | None = None
    worst_a: float = 0.0
    worst_b: float = 0.0

    def differences(self) -> str:
        """How the differing elements differ, for a finding: ``max |diff| 0.5``, ``1 NaN against a number``
        (every difference a NaN on one side), or both (``max |diff| 0.5; 1 NaN against a number``)."""
        if not self.nan_mismatched:
            return f"max |diff| {self.max_diff:.4g}"
        nan = f"{self.nan_mismatched} NaN against a number"
        return nan if self.nan_mismatched >= self.mismatched else f"max |diff| {self.max_diff:.4g}; {nan}"


@dataclass
class DeepResult:
    """Outcome of :func:`run_deep`.

    Attributes:
        stats: key -> :class:`TensorStats` of every tensor read completely.
        pairs: the pair comparisons.
        read_errors: key -> first error met reading it (corrupt archive, shape mismatch, ...).
        byte_values: byte-item key -> loaded value (``step`` items of old optimizers).
        bytes_read: data bytes read; seconds: wall time; workers: threads used.
    """

    stats: dict[str, TensorStats] = field(default_factory=dict)
    pairs: list[PairStats] = field(default_factory=list)
    read_errors: dict[str, CkptError] = field(default_factory=dict)
    byte_values: dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0
    workers: int = 1
