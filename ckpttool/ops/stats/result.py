"""What ``ckpttool stats`` measured: per-tensor value statistics, per-layer and per-module sums,
per-expert norms, AdamW update sizes and the change between checkpoints (frozen, plain data).

Every norm is an L2 norm of the stored values (``sqrt(sum x^2)``, slice sums in float32 for
BF16/FP16/FP32 tensors added in float64: relative error ~1e-7); ``std`` is the population
standard deviation; non-finite values are counted and left out of every sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckpttool.format.jsonview import json_fields

__all__ = [
    "CheckpointStats",
    "ExpertNorms",
    "GroupStats",
    "LayerChange",
    "StatsResult",
    "TensorValueStats",
    "UpdateStats",
]

DOCUMENT = "ckpttool.stats/1"


def _num(v: float | None) -> float | None:
    """JSON-safe float (NaN/inf become ``None``)."""
    return v if v is not None and math.isfinite(v) else None


def _json(record: Any, *nums: str, **values: Any) -> dict[str, Any]:
    """``record`` 's fields in order (:func:`~ckpttool.format.jsonview.json_fields`), the floats named in ``nums``
    through :func:`_num`, ``values`` in place of their fields."""
    return json_fields(record, **{n: _num(getattr(record, n)) for n in nums}, **values)


@dataclass(frozen=True)
class TensorValueStats:
    """Statistics of one stored tensor.

    Attributes:
        key: checkpoint key; fqn: the parameter it belongs to; role: ``weight`` (model tensor),
            ``master_weight``, ``exp_avg``, ``exp_avg_sq``, another optimizer field name, or ``other``.
        layer: ``layers.N``-style group (or the first key component); module: the fqn with layer
            indices replaced by ``*`` (``layers.*.attention.wq.weight``).
        dtype, shape: as stored; numel: elements read.
        mean, std, abs_max, l2: over the finite values; zero_fraction: share of values == 0 (NaN for an empty tensor);
        nonfinite: NaN/inf count.
    """

    key: str
    fqn: str
    role: str
    layer: str
    module: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    mean: float
    std: float
    abs_max: float
    l2: float
    zero_fraction: float
    nonfinite: int

    def to_dict(self) -> dict[str, Any]:
        return _json(self, "mean", "std", "abs_max", "l2", "zero_fraction")


@dataclass(frozen=True)
class UpdateStats:
    """The size of the last AdamW update of one parameter (the one that produced the saved weights), from its saved moments.

    ``u = lr * |m_hat| / (sqrt(v_hat) + eps)`` per element, ``m_hat = exp_avg / (1 - beta1^step)``,
    ``v_hat = exp_avg_sq / (1 - beta2^step)`` (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", Algorithm 2; weight decay left out). ``rms``/``max`` over the elements;
    ``relative``: ``rms`` over the parameter's RMS (``None`` when the parameter is not stored).
    """

    fqn: str
    layer: str
    step: float
    lr: float
    numel: int
    rms: float
    max: float
    relative: float | None

    def to_dict(self) -> dict[str, Any]:
        return _json(self, "rms", "max", "relative")


@dataclass(frozen=True)
class GroupStats:
    """Sums over the tensors of one layer (or one module type).

    Attributes:
        name: the layer (``layers.3``) or module (``layers.*.mlp.w1.weight``).
        params: elements of the model tensors; norms: role -> L2 norm over the group's tensors of
            that role (``weight``, ``master_weight``, ``exp_avg``, ``exp_avg_sq``, ...);
        abs_max: largest finite |value| of its model tensors; nonfinite: NaN/inf count over all roles;
        update_rms: RMS of the AdamW update over the group's parameters (``None``: no moments).
    """

    name: str
    params: int
    norms: dict[str, float]
    abs_max: float
    nonfinite: int
    update_rms: float | None

    def to_dict(self) -> dict[str, Any]:
        return _json(self, "abs_max", "update_rms", norms={k: _num(v) for k, v in self.norms.items()})


@dataclass(frozen=True)
class ExpertNorms:
    """Per-expert L2 norms of one expert tensor stored with the experts on dim 0 (``[E, ...]``)."""

    key: str
    layer: str
    module: str
    norms: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return _json(self, norms=[_num(v) for v in self.norms])


@dataclass(frozen=True)
class CheckpointStats:
    """Everything measured on one checkpoint."""

    path: str
    """The checkpoint directory."""
    schema: str
    """Its key schema."""
    step: int | None
    """Its training step when known."""
    tensors: tuple[TensorValueStats, ...]
    """Per tensor, in checkpoint order."""
    layers: tuple[GroupStats, ...]
    """Per-layer sums."""
    modules: tuple[GroupStats, ...]
    """Per-module sums."""
    experts: tuple[ExpertNorms, ...]
    """Per-expert norms of expert tensors."""
    updates: tuple[UpdateStats, ...]
    """AdamW update sizes."""
    notes: tuple[str, ...]
    """What was not measured and why (a parameter's moments without hyperparameters, ...)."""
    bytes_read: int
    """Data bytes read."""
    seconds: float
    """Wall time of the pass (seconds)."""
    warnings: tuple[str, ...] = ()
    """Data files missing, short (truncated) or not referenced, as ``inspect`` warns of them: said whichever
    records the pass read or skipped (a truncated quantized scale it leaves out too)."""

    def to_dict(self) -> dict[str, Any]:
        return _json(
            self,
            tensors=[t.to_dict() for t in self.tensors],
            layers=[g.to_dict() for g in self.layers],
            modules=[g.to_dict() for g in self.modules],
            experts=[e.to_dict() for e in self.experts],
            updates=[u.to_dict() for u in self.updates],
        )


@dataclass(frozen=True)
class LayerChange:
    """Change of one layer's model tensors between two checkpoints of a run (L2 over the layer's tensors present
    in both with equal shapes, float64 sums)."""

    a: str
    b: str
    layer: str
    relative: float | None
    """``||W_b - W_a|| / ||W_a||``; a layer all zero in A: 0 where it stayed zero, ``inf`` where it moved; NaN
    where either side holds a NaN or infinity."""
    tensors: int
    absolute: float | None = None
    """``||W_b - W_a||`` in the weights' own units; NaN where either side holds a NaN or infinity."""

    def to_dict(self) -> dict[str, Any]:
        return _json(self, "relative", "absolute")


@dataclass(frozen=True)
class StatsResult:
    """Outcome of :func:`ckpttool.ops.stats.collect_stats`: one entry per checkpoint, in the order
    given, and the per-layer change between each consecutive pair; ``skipped``: tensors of the
    change left out and why (missing on one side, another shape or dtype)."""

    checkpoints: tuple[CheckpointStats, ...]
    changes: tuple[LayerChange, ...]
    skipped: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": DOCUMENT,
            **_json(
                self, checkpoints=[c.to_dict() for c in self.checkpoints], changes=[c.to_dict() for c in self.changes]
            ),
        }
