"""Optimizer state: its schema, the FP32-master / CPU-offload AdamW family, staging, the reference step.

:mod:`.schema` says which fields and dtypes each optimizer type saves, :mod:`.known` which fields the
other optimizers users run save (torch-free: the checkpoint model and ``validate`` read them). The optimizers (:mod:`.adamw`, :mod:`.offload` with its CPU
staging, :mod:`.multi`, :mod:`.factory`), the FP64 reference step (:mod:`.reference`) and the
checked DCP load (:mod:`.checkpoint`) import torch. Public API in ``docs/optim_state.md``;
names load lazily, so importing this package imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool._lazy import lazy_attributes

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
    "FullFP32AdamW": "ckpttool.optim_state.adamw",
    "MasterFP32AdamW": "ckpttool.optim_state.adamw",
    "CPUOffloadAdamW": "ckpttool.optim_state.offload",
    "MultiOptimizer": "ckpttool.optim_state.multi",
    "build_optimizer": "ckpttool.optim_state.factory",
    "expected_state_dtypes": "ckpttool.optim_state.schema",
    "infer_optimizer_type": "ckpttool.optim_state.schema",
    "check_saved_state": "ckpttool.optim_state.checkpoint",
    "CheckedLoadPlanner": "ckpttool.optim_state.checkpoint",
}

if TYPE_CHECKING:
    from ckpttool.optim_state import device, reference
    from ckpttool.optim_state.adamw import FullFP32AdamW, MasterFP32AdamW
    from ckpttool.optim_state.checkpoint import CheckedLoadPlanner, check_saved_state
    from ckpttool.optim_state.factory import build_optimizer
    from ckpttool.optim_state.multi import MultiOptimizer
    from ckpttool.optim_state.offload import CPUOffloadAdamW
    from ckpttool.optim_state.schema import expected_state_dtypes, infer_optimizer_type


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__, submodules=("reference", "device"))
