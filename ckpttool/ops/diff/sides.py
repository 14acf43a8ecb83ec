"""Which step of each side ``diff`` opens: a side's own step, else the shared one where the side is a run's root."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpttool.errors import UsageError
from ckpttool.format.directory import checkpoints_below_url
from ckpttool.format.storage import is_url, local_path
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, OpenOptions
from ckpttool.model.discovery import CheckpointSelection, is_checkpoint_dir, step_given_hint
from ckpttool.ops.diff.result import DiffOptions

__all__ = ["side_openings"]


def _is_run_root(path: Path | None) -> bool:
    """A directory that is no checkpoint itself (no ``.metadata``, no safetensors): a step is picked below it
    (``None``: an opened :class:`Checkpoint`, whose step was chosen when it was opened)."""
    return path is not None and path.is_dir() and not is_checkpoint_dir(path)


def _path_of(side: CheckpointOrPath) -> Path | None:
    """The side's local path, ``None`` for an opened :class:`Checkpoint` or a URL (no local look-alike is read)."""
    return None if isinstance(side, Checkpoint) or is_url(side) else Path(local_path(side))


def side_openings(
    a: CheckpointOrPath,
    b: CheckpointOrPath,
    opts: DiffOptions,
    opening_a: OpenOptions,
    opening_b: OpenOptions,
) -> tuple[OpenOptions, OpenOptions]:
    """Each side's :class:`OpenOptions` with its step: ``a_step``/``b_step``, else ``step`` where the side is a run's
    checkpoint root (a checkpoint or an HF directory never gets ``step``); a side with neither keeps its opening.

    Raises:
        UsageError (E100): ``a_step``/``b_step`` given for a side that is a checkpoint itself; ``step`` given but
            neither side is a run's checkpoint root (a URL side named, with the checkpoints below it); a step that
            is neither an integer >= 0 nor ``latest``.
    """
    pa, pb = _path_of(a), _path_of(b)
    for side, given, path, own in (("a", a, pa, opts.a_step), ("b", b, pb, opts.b_step)):
        if own is not None and not isinstance(given, Checkpoint) and is_url(given):
            raise UsageError(
                f"`{side}_step` {own} given, but {given} is a URL: steps are picked below local directories only",
                param=f"{side}_step",
                hint=f"pass the URL of the step's own prefix (the one holding .metadata), or drop `{side}_step`",
            )
        if own is not None and (path is None or (path.is_dir() and not _is_run_root(path))):
            where = "the opened Checkpoint" if path is None else path
            raise UsageError(
                f"`{side}_step` {own} given, but {where} is a checkpoint itself",
                param=f"{side}_step",
                hint=(
                    f"pass the directory that holds the step directories, or drop `{side}_step`"
                    if path is None
                    else step_given_hint(path, f"{side}_step")
                ),
            )
    sa = opts.a_step if opts.a_step is not None else (opts.step if _is_run_root(pa) else None)
    sb = opts.b_step if opts.b_step is not None else (opts.step if _is_run_root(pb) else None)
    if opts.step is not None and opts.a_step is None and opts.b_step is None and sa is None and sb is None:
        for given in (a, b):
            if not isinstance(given, Checkpoint) and is_url(given):  # a remote run root: its steps are named
                raise UsageError(
                    f"`step` {opts.step} given, but {given} is a URL: steps are picked below local directories only",
                    param="step",
                    hint=checkpoints_below_url(given) or "pass the URL of the step's own prefix, or drop `step`",
                )
        raise UsageError(
            f"`step` {opts.step} given, but neither {_shown(a)} nor {_shown(b)} is a directory of several checkpoints",
            param="step",
            hint="drop `step`, or pass a run's checkpoint root (the directory above its step directories)",
        )
    return _with_step(opening_a, sa), _with_step(opening_b, sb)


def _shown(side: CheckpointOrPath) -> str:
    return str(side.path) if isinstance(side, Checkpoint) else str(side)


def _with_step(opening: OpenOptions, step: str | None) -> OpenOptions:
    """``opening`` with ``step`` in its selection (unchanged when ``step`` is ``None``)."""
    if step is None:
        return opening
    sel = opening.selection
    chosen = CheckpointSelection.from_options(
        step, sel.optimizer_dir if sel is not None else None, sel.schema if sel is not None else None
    )
    return replace(opening, selection=chosen)
