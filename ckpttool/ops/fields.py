"""The operations' shared conventions (``docs/design.md`` §5): the progress and phase callbacks and the keyword
arguments that carry them (:class:`Hooks`), the options of every operation that writes a new output
(:class:`OutputOptions`), and passing an options or result object's fields on under the same names."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from ckpttool.errors import UsageError, check_field_types
from ckpttool.format.digest import DEFAULT_ALGORITHM

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # torch requires typing_extensions
    from typing_extensions import Unpack

if TYPE_CHECKING:
    from ckpttool.model.checkpoint import OpenOptions

__all__ = [
    "MAX_OUTPUT_RANKS",
    "Hooks",
    "OutputOptions",
    "PhaseFn",
    "ProgressFn",
    "Unpack",
    "check_output_ranks",
    "hooks_of",
    "options_of",
    "same_named",
]

#: ``progress(done_bytes, total_bytes)``: ``(0, total)`` once planned, then as bytes are written or
#: checked; called from the calling thread.
ProgressFn = Callable[[int, int], None]
#: ``phase(text)``: the step an operation starts (``planning``, ``checking chunks``, ``writing``, ...),
#: called from the calling thread.
PhaseFn = Callable[[str], None]


#: The most target ranks an output that writes one data file per rank (import, reshard) is planned for: more than
#: any training job's mesh, and the plan holds each tensor's piece per rank, so a mistyped size (``--world-size
#: 80000000``) is refused at once instead of planning until the process runs out of memory.
MAX_OUTPUT_RANKS = 1 << 17


def check_output_ranks(ranks: int, sizes: str, param: str) -> None:
    """Refuse an output mesh of more than :data:`MAX_OUTPUT_RANKS` ranks (``sizes``: how ``ranks`` was given).

    Raises:
        UsageError (E100): naming ``param``.
    """
    if ranks > MAX_OUTPUT_RANKS:
        raise UsageError(
            f"{sizes} is {ranks:,} target ranks, more than the {MAX_OUTPUT_RANKS:,} an output is planned for "
            "(one data file per rank)",
            param=param,
            hint="give the sizes of the job that will load the output",
        )


class Hooks(TypedDict, total=False):
    """The keyword arguments an operation that opens a source and reports its progress takes after its options,
    declared once: ``op(source, [out,] options=None, **hooks: Unpack[Hooks])`` (each one optional, ``None``
    the same as left out).

    Keys:
        opening: how a path/URL ``source`` is opened (:class:`~ckpttool.model.checkpoint.OpenOptions`); none
            with an opened ``Checkpoint``.
        progress: ``progress(done_bytes, total_bytes)`` (:data:`ProgressFn`); each operation says when it calls it.
        phase: ``phase(text)`` as each step starts (:data:`PhaseFn`); each operation names its steps.
    """

    opening: OpenOptions | None
    progress: ProgressFn | None
    phase: PhaseFn | None


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """The options of every operation that writes a new output directory (export, reshard, import), declared
    once; each operation's options class adds its own (keyword-only here, so theirs keep their positions).

    Attributes:
        overwrite: replace an existing non-empty output, once the new one is complete, where it is provably
            a ckpttool output (its ``.ckpttool-output.json`` marker agrees with its files); any other
            directory or prefix is refused (``ForeignOutputError``, E606).
        manifest: also write the output's ``manifest.json``, every byte range digested as it is written,
            with the source's identity (``docs/diff.md``).
        algorithm: the digest of the manifest and of the source identity (``xxh3-128``, ``blake3``, ...).
        dry_run: plan and check everything, whether the output may be written included, and return the
            result the run would give (``dry_run`` true; each operation says what its planned sizes are)
            without writing anything.
    """

    overwrite: bool = False
    manifest: bool = False
    algorithm: str = DEFAULT_ALGORITHM
    dry_run: bool = False


def hooks_of(op: str, hooks: Hooks) -> tuple[OpenOptions | None, ProgressFn | None, PhaseFn | None]:
    """``(opening, progress, phase)`` of the ``**hooks`` the operation ``op`` was called with.

    Raises:
        TypeError: a keyword that is not one of :class:`Hooks` (as Python says of a misspelt keyword argument).
    """
    unknown = sorted(hooks.keys() - Hooks.__annotations__.keys())
    if unknown:
        raise TypeError(f"{op}() got an unexpected keyword argument {unknown[0]!r}")
    return hooks.get("opening"), hooks.get("progress"), hooks.get("phase")


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
