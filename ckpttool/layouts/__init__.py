"""Layout record and expert-parallel (EP) layout versions (DESIGN.md section 3)."""

from .record import LAYOUT_FORMAT, MAX_LAYOUT_VERSION, SIDECAR_NAME, EPTensorSpec, LayoutRecord, parse_layout_record

__all__ = [
    "LAYOUT_FORMAT",
    "MAX_LAYOUT_VERSION",
    "SIDECAR_NAME",
    "EPTensorSpec",
    "LayoutRecord",
    "parse_layout_record",
]
