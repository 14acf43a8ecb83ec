"""Passing an options or result object's fields on under the same names (``docs/design.md`` §5)."""

from __future__ import annotations

from typing import Any

__all__ = ["same_named"]


def same_named(source: object, *names: str) -> dict[str, Any]:
    """``{name: getattr(source, name)}`` for each of ``names``, in that order: the keyword arguments of a call
    that takes those fields unchanged (``f(**same_named(opts, "a", "b"))`` is ``f(a=opts.a, b=opts.b)``).

    Raises:
        AttributeError: ``source`` has no such field (a programming error).
    """
    return {name: getattr(source, name) for name in names}
