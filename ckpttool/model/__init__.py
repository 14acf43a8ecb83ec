"""The checkpoint model: what a checkpoint holds, read from metadata alone (never imports torch).

Modules: :mod:`.schemas` (key schemas: registered specs, detection), :mod:`.catalog` (model tensors, optimizer state,
param groups, files), :mod:`.discovery` (where the checkpoint is below a directory),
:mod:`.hfconfig` (HF ``config.json``), :mod:`.adapters` (model adapters),
:mod:`.checkpoint` (the opened checkpoint). The EP layout record and its math are
:mod:`ckpttool.layouts`; the optimizer-state schema is :mod:`ckpttool.optim_state.schema`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool._lazy import lazy_attributes

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
}

__all__ = [
    "Catalog",
    "Checkpoint",
    "ExtraState",
    "ParamGroup",
    "ParamState",
    "TensorEntry",
    "build_catalog",
    "open_checkpoint",
]

if TYPE_CHECKING:
    from ckpttool.model.catalog import Catalog, ParamGroup, ParamState, TensorEntry, build_catalog
    from ckpttool.model.checkpoint import Checkpoint, ExtraState, open_checkpoint


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
