"""The operations' shared conventions (``docs/design.md`` §5): the progress and phase callbacks, and passing
an options or result object's fields on under the same names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ckpttool.errors import UsageError, check_field_types

__all__ = ["PhaseFn", "ProgressFn", "options_of", "same_named"]

#: ``progress(done_bytes, total_bytes)``: ``(0, total)`` once planned, then as bytes are written or
#: checked; called from the calling thread.
ProgressFn = Callable[[int, int], None]
#: ``phase(text)``: the step an operation starts (``planning``, ``checking chunks``, ``writing``, ...),
#: called from the calling thread.
PhaseFn = Callable[[str], None]

Opts = TypeVar("Opts")


def options_of(options: Opts | None, cls: type[Opts]) -> Opts:
    """An operation's ``options``: ``cls()`` for ``None``, else ``options`` itself (a copy holding the plain
    ``bool``/``int`` of a NumPy one a field was given: :func:`~ckpttool.errors.check_field_types`).

    Raises:
        UsageError (E100): ``options`` is not a ``cls`` (a dict, a path given where the options go), or a field
            of it has the wrong type (:func:`~ckpttool.errors.check_field_types`: ``strict="no"``, ``workers="2"``).
    """
    if options is None:
        return cls()
    if not isinstance(options, cls):
        raise UsageError(
            f"`options` must be a {cls.__name__}, got {type(options).__name__} {options!r:.80}",
            param="options",
            hint=f"pass ckpttool.{cls.__name__}(...) (outputs and the source go before it)",
        )
    return check_field_types(options)


def same_named(source: object, *names: str) -> dict[str, Any]:
    """``{name: getattr(source, name)}`` for each of ``names``, in that order: the keyword arguments of a call
    that takes those fields unchanged (``f(**same_named(opts, "a", "b"))`` is ``f(a=opts.a, b=opts.b)``).

    Raises:
        AttributeError: ``source`` has no such field (a programming error).
    """
    return {name: getattr(source, name) for name in names}
