"""The JSON view of ckpttool's result records: a frozen dataclass's fields as a ``--json`` object.

Most ``to_dict`` methods are the record's fields in declaration order with tuples as lists;
:func:`json_fields` is that, once, and a record whose JSON differs (renamed keys, nested
records, rounded timings) says only what differs. :func:`json_number` is the one rule for
floats that JSON cannot hold (``inf``, ``nan`` written as the strings ``"inf"``, ``"nan"``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["json_fields", "json_number"]


def json_fields(record: Any, **values: Any) -> dict[str, Any]:
    """The public fields of the dataclass instance ``record`` (not ``_private``), in declaration order, tuples as lists.

    Args:
        record: a dataclass instance (not a class).
        values: JSON values that replace the fields of these names (same place in the order).

    Returns:
        A new dict (shallow: only top-level tuples become lists).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if f.name.startswith("_"):
            continue
        v = values[f.name] if f.name in values else getattr(record, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def json_number(v: Any) -> Any:
    """``v``, or ``str(v)`` for a non-finite float (``"inf"``, ``"-inf"``, ``"nan"``), which JSON cannot hold."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
