"""The JSON view of ckpttool's result records: a frozen dataclass's fields as a ``--json`` object.

Most ``to_dict`` methods are the record's fields in declaration order with tuples as lists;
:func:`json_fields` is that, once, and a record whose JSON differs (renamed keys, nested
records, rounded timings) says only what differs. :func:`json_number` is the one rule for
floats that JSON cannot hold (``inf``, ``nan`` written as the strings ``"inf"``, ``"nan"``).
A document whose keys follow another order than the fields (a schema tag first, timings
beside the sizes they rate) is declared as a :class:`JsonView`: its schema and key order, once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["JsonView", "json_counted", "json_fields", "json_number"]


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


def json_counted(groups: Mapping[str, Sequence[str]]) -> dict[str, dict[str, Any]]:
    """``{name: {"count": len(keys), "keys": keys}}`` of a mapping of named key lists (skipped keys by reason)."""
    return {k: {"count": len(v), "keys": v} for k, v in groups.items()}


@dataclass(frozen=True)
class JsonView:
    """A ``--json`` document declared as data: ``{"schema": schema}``, then ``keys`` in their order.

    Attributes:
        schema: the document's ``schema`` tag (``"ckpttool.export/1"``).
        keys: the keys, separated by white space; each is read from the record's attribute of that name
            (a field or a property), ``name:N`` rounds it to ``N`` decimals (``round``).
    """

    schema: str
    keys: str

    def render(self, record: Any, **values: Any) -> dict[str, Any]:
        """The document of ``record``; ``values`` give the keys that are not plain attributes (renamed, nested)."""
        out: dict[str, Any] = {"schema": self.schema}
        for spec in self.keys.split():
            name, _, digits = spec.partition(":")
            v = values[name] if name in values else getattr(record, name)
            out[name] = round(v, int(digits)) if digits else v
        return out
