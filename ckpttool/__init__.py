"""ckpttool: inspect, validate, export, reshard and replay PyTorch Distributed Checkpoints.

Public API (names load lazily, so ``import ckpttool`` does not import torch)::

    import ckpttool
    ov = ckpttool.build_overview("ckpt/")                       # inspect
    res = ckpttool.validate("ckpt/", strict=True)               # validate
    out = ckpttool.export_checkpoint("ckpt/", "hf/", ckpttool.ExportOptions())
    with ckpttool.CheckpointReader("ckpt/") as r:
        cat = ckpttool.build_catalog(r)
        w = r.read_tensor("model.lm_head.weight")

See DESIGN.md for the contracts and ``docs/`` for each command.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_WHERE = {
    "CheckpointDir": "ckpttool.dcp",
    "CheckpointReader": "ckpttool.dcp",
    "Catalog": "ckpttool.catalog",
    "build_catalog": "ckpttool.catalog",
    "build_overview": "ckpttool.overview",
    "validate": "ckpttool.checks",
    "ExportOptions": "ckpttool.export",
    "export_checkpoint": "ckpttool.export",
    "LayoutRecord": "ckpttool.layouts",
    "LayoutDeclaration": "ckpttool.layouts",
    "resolve_layout": "ckpttool.layouts",
    "replay_step": "ckpttool.replay",
    "write_sample": "ckpttool.sample",
    "CkptError": "ckpttool.errors",
}

__all__ = sorted(_WHERE) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpttool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
