"""Layout record, EP layout versions, chunk geometry and permutation math (DESIGN.md section 3).

Modules: :mod:`.record` (parse/validate/serialise the record), :mod:`.declare`
(resolve record + sidecar + command-line declaration), :mod:`.geometry` (chunk
geometry of EP tensors from metadata), :mod:`.permute` (block permutations).
Names load lazily: ``ckpttool.catalog`` imports :mod:`.record`, and :mod:`.declare`
imports the catalog.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .record import LAYOUT_FORMAT, MAX_LAYOUT_VERSION, SIDECAR_NAME, EPTensorSpec, LayoutRecord, parse_layout_record

__all__ = [
    "LAYOUT_FORMAT",
    "MAX_LAYOUT_VERSION",
    "SIDECAR_NAME",
    "EPTensorSpec",
    "LayoutRecord",
    "parse_layout_record",
    "LayoutDeclaration",
    "ResolvedLayout",
    "resolve_layout",
    "detect_ep_tensors",
    "EPGeometry",
    "ep_geometry",
    "legacy_to_canonical_perm",
    "canonical_to_legacy_perm",
    "invert_permutation",
    "apply_block_permutation",
]

_WHERE = {
    "LayoutDeclaration": "declare",
    "ResolvedLayout": "declare",
    "resolve_layout": "declare",
    "detect_ep_tensors": "declare",
    "EPGeometry": "geometry",
    "ep_geometry": "geometry",
    "legacy_to_canonical_perm": "permute",
    "canonical_to_legacy_perm": "permute",
    "invert_permutation": "permute",
    "apply_block_permutation": "permute",
}

if TYPE_CHECKING:
    from .declare import LayoutDeclaration, ResolvedLayout, detect_ep_tensors, resolve_layout
    from .geometry import EPGeometry, ep_geometry
    from .permute import apply_block_permutation, canonical_to_legacy_perm, invert_permutation, legacy_to_canonical_perm


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
