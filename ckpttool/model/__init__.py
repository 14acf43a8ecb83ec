"""The checkpoint model: what a checkpoint holds, read from metadata alone (never imports torch).

Modules: :mod:`.catalog` (model tensors, optimizer state, param groups, files),
:mod:`.optimizer` (which state fields each optimizer type saves), :mod:`.layout_record`
(the ckpttool layout record), :mod:`.declaration` (resolving the EP layout),
:mod:`.geometry` (chunk geometry of EP tensors), :mod:`.permute` (block permutations),
:mod:`.hfconfig` (HF ``config.json``), :mod:`.checkpoint` (the opened checkpoint).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names load lazily: the CLI imports only what a command needs (start-up time).
_WHERE = {
    "Catalog": "ckpttool.model.catalog",
    "ParamGroup": "ckpttool.model.catalog",
    "ParamState": "ckpttool.model.catalog",
    "TensorEntry": "ckpttool.model.catalog",
    "build_catalog": "ckpttool.model.catalog",
    "Checkpoint": "ckpttool.model.checkpoint",
    "ExtraState": "ckpttool.model.checkpoint",
    "open_checkpoint": "ckpttool.model.checkpoint",
    "LayoutDeclaration": "ckpttool.model.declaration",
    "ResolvedLayout": "ckpttool.model.declaration",
}

__all__ = [
    "Catalog",
    "Checkpoint",
    "ExtraState",
    "LayoutDeclaration",
    "ParamGroup",
    "ParamState",
    "ResolvedLayout",
    "TensorEntry",
    "build_catalog",
    "open_checkpoint",
]

if TYPE_CHECKING:
    from ckpttool.model.catalog import Catalog, ParamGroup, ParamState, TensorEntry, build_catalog
    from ckpttool.model.checkpoint import Checkpoint, ExtraState, open_checkpoint
    from ckpttool.model.declaration import LayoutDeclaration, ResolvedLayout


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
