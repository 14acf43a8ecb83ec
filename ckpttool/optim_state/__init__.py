"""FP32-master AdamW optimizers, CPU offload, multi-optimizer, state schema and reference step.

Public API (``docs/optim_state.md``). Names load lazily, so ``import
ckpttool.optim_state.schema`` (torch-free ``infer_optimizer_type``) does not import torch.
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
    "expected_state_dtypes",
    "infer_optimizer_type",
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
    "expected_state_dtypes": "schema",
    "infer_optimizer_type": "schema",
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
    from ckpttool.optim_state.schema import expected_state_dtypes, infer_optimizer_type


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
