"""Optimizer state: its schema, the FP32-master / CPU-offload AdamW family, staging, the reference step.

:mod:`.schema` says which fields and dtypes each optimizer type saves (torch-free: the
checkpoint model reads it). The optimizers (:mod:`.adamw`, :mod:`.offload` with its CPU
staging, :mod:`.multi`, :mod:`.factory`), the FP64 reference step (:mod:`.reference`) and the
checked DCP load (:mod:`.checkpoint`) import torch. Public API in ``docs/optim_state.md``;
names load lazily, so importing this package imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "FullFP32AdamW",
    "MasterFP32AdamW",
    "CPUOffloadAdamW",
    "MultiOptimizer",
    "build_optimizer",
    "check_saved_state",
    "CheckedLoadPlanner",
    "reference",
    "device",
]

_WHERE = {
    "FullFP32AdamW": "adamw",
    "MasterFP32AdamW": "adamw",
    "CPUOffloadAdamW": "offload",
    "MultiOptimizer": "multi",
    "build_optimizer": "factory",
    "check_saved_state": "checkpoint",
    "CheckedLoadPlanner": "checkpoint",
}

if TYPE_CHECKING:
    from ckpttool.optim_state import device, reference
    from ckpttool.optim_state.adamw import FullFP32AdamW, MasterFP32AdamW
    from ckpttool.optim_state.checkpoint import CheckedLoadPlanner, check_saved_state
    from ckpttool.optim_state.factory import build_optimizer
    from ckpttool.optim_state.multi import MultiOptimizer
    from ckpttool.optim_state.offload import CPUOffloadAdamW


def __getattr__(name: str) -> Any:
    if name in ("reference", "device"):
        return importlib.import_module(f"{__name__}.{name}")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
