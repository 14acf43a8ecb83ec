"""Expert-parallel (EP) layouts: the layout record, its resolution, chunk geometry, permutations.

Metadata only, never imports torch (``docs/design.md`` §4, ``docs/layouts.md``):
:mod:`.record` (the ``ckpttool.layout`` JSON record and its sidecar), :mod:`.declaration`
(resolving a checkpoint's layout from record, sidecar and command-line declaration),
:mod:`.geometry` (chunk intervals of EP tensors per DTensor's ``Shard`` rule),
:mod:`.permute` (the legacy <-> canonical block permutation as integer math).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool._lazy import lazy_attributes

_WHERE = {
    "LayoutRecord": "ckpttool.layouts.record",
    "EPTensorSpec": "ckpttool.layouts.record",
    "parse_layout_record": "ckpttool.layouts.record",
    "LayoutDeclaration": "ckpttool.layouts.declaration",
    "ResolvedLayout": "ckpttool.layouts.declaration",
    "resolve_layout": "ckpttool.layouts.declaration",
}

__all__ = [
    "EPTensorSpec",
    "LayoutDeclaration",
    "LayoutRecord",
    "ResolvedLayout",
    "parse_layout_record",
    "resolve_layout",
]

if TYPE_CHECKING:
    from ckpttool.layouts.declaration import LayoutDeclaration, ResolvedLayout, resolve_layout
    from ckpttool.layouts.record import EPTensorSpec, LayoutRecord, parse_layout_record


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
