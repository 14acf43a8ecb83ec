"""The checkpoint model: what a checkpoint holds, read from metadata alone (never imports torch).

Modules: :mod:`.catalog` (model tensors, optimizer state, param groups, files),
:mod:`.optimizer` (which state fields each optimizer type saves), :mod:`.layout_record`
(the ckpttool layout record), :mod:`.declaration` (resolving the EP layout),
:mod:`.geometry` (chunk geometry of EP tensors), :mod:`.permute` (block permutations),
:mod:`.hfconfig` (HF ``config.json``), :mod:`.checkpoint` (the opened checkpoint).
"""

from ckpttool.model.catalog import Catalog, ParamGroup, ParamState, TensorEntry, build_catalog
from ckpttool.model.checkpoint import Checkpoint, ExtraState, open_checkpoint
from ckpttool.model.declaration import LayoutDeclaration, ResolvedLayout

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
