"""Entry points of the operations for a front end: open, run, hand the result to a printer.

Each function is one call for a command: it opens the checkpoint where the operation takes an
opened one, owns the cyclic-GC policy of the run, and decides what about the result is worth a
warning or an error. Printing stays with the caller (``report``): this module never prints.

The GC: a 10^6-entry ``.metadata`` and the reports built from it are ~10^7 acyclic objects, and
every re-enable of the collector runs a full collection over whatever is still alive. So the
collector stays paused from the open until the result is printed (:func:`run_inspect`,
:func:`run_validate`, :func:`deliver`), and inspect's result is dropped before it resumes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, TypeVar

from ckpttool.model.checkpoint import gc_held, open_source
from ckpttool.ops.fields import PhaseFn

if TYPE_CHECKING:
    from ckpttool.errors import CkptError, ReplayMismatchError
    from ckpttool.model.checkpoint import Checkpoint, OpenOptions
    from ckpttool.ops.inspect import InspectOptions, InspectResult
    from ckpttool.ops.replay import ReplayOptions, ReplayResult
    from ckpttool.ops.validate import ValidateOptions, ValidationResult

__all__ = [
    "data_file_warnings",
    "deliver",
    "replay_mismatch",
    "run_inspect",
    "run_replay",
    "run_validate",
    "run_writing",
    "split_param_group_items",
    "validation_error",
]

R = TypeVar("R")
Progress = Callable[[int, int], None] | None


def deliver(result: R, consume: Callable[[R], None]) -> None:
    """``consume(result)`` (write it as JSON or text) with the cyclic GC paused: a 10^6-entry report
    is ~10^7 acyclic objects."""
    with gc_held():
        consume(result)


def run_inspect(
    path: str | os.PathLike[str],
    options: InspectOptions,
    *,
    opening: OpenOptions,
    report: Callable[[InspectResult], None],
) -> None:
    """:func:`~ckpttool.ops.inspect.inspect` the checkpoint and ``report`` the result, under one GC pause.

    The result is freed before the pause ends (the collection at the re-enable then scans little).

    Raises:
        as :func:`~ckpttool.ops.inspect.inspect`.
    """
    from ckpttool.ops.inspect import inspect

    with gc_held():
        result = inspect(path, options, opening=opening)
        report(result)
        del result


def data_file_warnings(result: InspectResult) -> list[str]:
    """Warning texts for ``result``'s data files that are missing, short or not referenced (``[]``: none;
    :func:`~ckpttool.ops.inspect.file_warnings`), and why a per-rank shard folder cannot be known complete
    (:attr:`~ckpttool.ops.inspect.InspectResult.unproven_shards`)."""
    from ckpttool.ops.inspect import file_warnings

    return [*file_warnings(result.files), *filter(None, [result.unproven_shards])]


def split_param_group_items(
    byte_items: Sequence[tuple[str, int]],
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(key, bytes)`` byte items split into the param-group items (a ``param_groups`` component
    that is not the key's last) and the rest, each in the given order."""
    pg = [(k, n) for k, n in byte_items if ".param_groups." in f".{k}"]
    rest = [(k, n) for k, n in byte_items if ".param_groups." not in f".{k}"]
    return pg, rest


def run_validate(
    path: str | os.PathLike[str],
    options: ValidateOptions,
    *,
    opening: OpenOptions,
    progress: Progress,
    report: Callable[[ValidationResult], None],
    phase: PhaseFn | None = None,
) -> ValidationResult:
    """:func:`~ckpttool.ops.validate.validate` the checkpoint and ``report`` the result, under one GC pause
    (``phase``: as for :func:`~ckpttool.ops.validate.validate`).

    Raises:
        as :func:`~ckpttool.ops.validate.validate`, and what ``report`` raises.
    """
    from ckpttool.ops.validate import validate

    with gc_held():  # one pause for reading and printing (each re-enable: a full collection)
        res = validate(path, options, progress=progress, opening=opening, phase=phase)
        report(res)
    return res


def validation_error(res: ValidationResult) -> CkptError | None:
    """The error of the finding that made the run unusable (exit 2), ``None`` without one."""
    from ckpttool.errors import error_class

    fatal = res.fatal
    if fatal is None:
        return None
    message = f"{fatal.key}: {fatal.message}" if fatal.key and fatal.key not in fatal.message else fatal.message
    return error_class(fatal.error_code or "")(message, hint=fatal.hint)


def run_replay(
    path: str | os.PathLike[str],
    options: ReplayOptions,
    *,
    opening: OpenOptions,
    progress: Progress,
    phase: PhaseFn | None = None,
) -> ReplayResult:
    """Open the checkpoint and :func:`~ckpttool.ops.replay.replay_step` it.

    Raises:
        as :func:`~ckpttool.model.checkpoint.open_checkpoint` and :func:`~ckpttool.ops.replay.replay_step`.
    """
    from ckpttool.ops.replay import replay_step

    return replay_step(path, options, progress=progress, opening=opening, phase=phase)


def replay_mismatch(result: ReplayResult) -> ReplayMismatchError | None:
    """The error naming the worst parameter when some do not reproduce the reference step (``None``: all do)."""
    from ckpttool.errors import ReplayMismatchError, short_key

    if result.ok:
        return None
    if not result.failed and result.problems and not result.skipped:  # the saved state as a whole
        return ReplayMismatchError(
            result.problems[0],
            hint="resume from a checkpoint whose optimizer state was saved with its moments at the trainer's "
            "step, or check the trainer's save of the optimizer state",
        )
    if not result.failed:  # every replayed parameter passed, but stepped parameters were left out
        return ReplayMismatchError(
            f"{len(result.skipped)} parameter(s) with saved optimizer state were not replayed "
            f"(e.g. {short_key(result.skipped[0])}); {len(result.params)} replayed parameter(s) match",
            fqn=result.skipped[0],
            hint="not a mismatch: the notes say why they were left out and what replays them"
            + (" (a fused q/k/v: `head_dim` N)" if any("qkv" in f for f in result.skipped) else "")
            + "; or leave them out of the run with `filter_glob`",
        )
    worst = result.failed[0]
    return ReplayMismatchError(
        f"{len(result.failed)} of {len(result.params)} parameter(s) do not reproduce the reference step; "
        f"worst {short_key(worst.fqn)}: {worst.problems[0]}",
        fqn=worst.fqn,
    )


def run_writing(
    op: Callable[..., R],
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: object,
    *,
    opening: OpenOptions,
    progress: Callable[[], AbstractContextManager[Progress]],
    phase: PhaseFn | None = None,
    note: Callable[[Checkpoint, R], str | None] | None = None,
    hold_gc: bool = False,
) -> tuple[R, str | None]:
    """Open ``source`` and run the writing operation ``op`` on it into ``out``:
    ``op(ckpt, out, options, progress=..., phase=phase)`` (:func:`~ckpttool.ops.export.export_checkpoint`,
    :func:`~ckpttool.ops.reshard.reshard`); ``(result, note(ckpt, result))`` (``None`` without ``note``).

    ``hold_gc`` (export): the whole run under one GC hold (the open's objects are frozen with the plan's
    before the writes).

    Args:
        progress: a context-manager factory yielding the ``(bytes done, bytes total)`` callback (or
            ``None``), entered once the checkpoint is open.
        phase: ``phase(text)`` as each step of the operation starts (``planning``, ..., ``writing``).

    Raises:
        as :func:`~ckpttool.model.checkpoint.open_checkpoint` and ``op``.
    """
    with gc_held() if hold_gc else nullcontext(), open_source(source, opening) as ckpt:
        with progress() as update:
            result = op(ckpt, out, options, progress=update, phase=phase)
            return result, note(ckpt, result) if note is not None else None
