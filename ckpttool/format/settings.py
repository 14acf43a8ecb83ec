"""A process-wide setting: one frozen dataclass value in force, replaced field by field.

Serves the reading caps (:mod:`ckpttool.format.limits`) and the object-storage configuration
(:mod:`ckpttool.format.storage`): ``current()``, a replacement for the rest of the process
that returns the previous value, and a replacement for a ``with`` body only (not
thread-local: set it before starting workers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, cast

__all__ = ["ProcessSetting"]

T = TypeVar("T")


class ProcessSetting(Generic[T]):
    """The value in force of a frozen dataclass ``T``.

    Args:
        default: the value at start.
        positive_ints: the fields that must be a positive ``int`` when replaced (``None``: all).
    """

    def __init__(self, default: T, positive_ints: Iterable[str] | None = None) -> None:
        self.value = default
        self._positive = None if positive_ints is None else frozenset(positive_ints)

    def replace(self, **changes: Any) -> T:
        """Replace some fields for the rest of the process; returns the previous value.

        Raises:
            ValueError: a field of ``positive_ints`` that is not a positive int.
            TypeError: an unknown field.
        """
        for name, value in changes.items():
            if (self._positive is None or name in self._positive) and (type(value) is not int or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        previous = self.value
        self.value = cast(T, dataclasses.replace(cast(Any, previous), **changes))
        return previous

    @contextmanager
    def scoped(self, **changes: Any) -> Iterator[T]:
        """The fields replaced for the ``with`` body only; yields the value in force there."""
        previous = self.replace(**changes)
        try:
            yield self.value
        finally:
            self.value = previous
