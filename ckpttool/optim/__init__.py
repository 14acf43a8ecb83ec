"""FP32-master AdamW optimizers, CPU offload, multi-optimizer and the reference step (imports torch).

Public API (``docs/optim_state.md``); names load lazily. Which fields and dtypes each
optimizer type saves is the checkpoint model's :mod:`ckpttool.model.optimizer` (torch-free).
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
    from ckpttool.optim import device, reference
    from ckpttool.optim.adamw import FullFP32AdamW, MasterFP32AdamW
    from ckpttool.optim.checkpoint import CheckedLoadPlanner, check_saved_state
    from ckpttool.optim.factory import build_optimizer
    from ckpttool.optim.multi import MultiOptimizer
    from ckpttool.optim.offload import CPUOffloadAdamW


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
