"""``build_optimizer``: one entry point from an optimizer type name to an optimizer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ckpttool.errors import UsageError
from ckpttool.optim_state.adamw import FullFP32AdamW, MasterFP32AdamW
from ckpttool.optim_state.offload import CPUOffloadAdamW
from ckpttool.optim_state.schema import OPTIMIZER_TYPES

__all__ = ["build_optimizer"]

_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "full_fp32_adamw": FullFP32AdamW,
    "master_fp32_adamw": MasterFP32AdamW,
    "cpu_offload_adamw": CPUOffloadAdamW,
}


def build_optimizer(type_name: str, params_or_groups: Iterable[Any], **cfg: Any) -> torch.optim.Optimizer:
    """Build the optimizer named ``type_name`` over ``params_or_groups``.

    Args:
        type_name: ``adamw`` (``torch.optim.AdamW``) | ``full_fp32_adamw`` |
            ``master_fp32_adamw`` | ``cpu_offload_adamw``.
        params_or_groups: parameters, ``(name, parameter)`` pairs or param-group dicts
            (``cpu_offload_adamw`` needs names).
        **cfg: constructor keywords: ``lr``, ``betas``, ``eps``, ``weight_decay``, plus
            ``moment_dtype`` (master_fp32_adamw) or ``cpu_offload_param_patterns``,
            ``resident_moment_dtype``, ``cpu_moment_dtype``, ``chunk_size``, ``cpu_offload``,
            ``num_staging_slots`` (cpu_offload_adamw).

    Returns:
        The optimizer.

    Raises:
        UsageError: unknown type name or a keyword the type does not take.
    """
    cls = _CLASSES.get(type_name)
    if cls is None:
        raise UsageError(f"unknown optimizer type {type_name!r}", hint=f"use one of {', '.join(OPTIMIZER_TYPES)}")
    try:
        return cls(params_or_groups, **cfg)
    except TypeError as e:
        raise UsageError(
            f"bad configuration for {type_name}: {e}", hint="see docs/optim_state.md for its keywords"
        ) from e
