"""Runs spread over torch.distributed ranks (``torchrun --nproc-per-node N -m ckpttool export ...``).

:func:`from_env` joins torchrun's process group (``gloo``, CPU only); without its variables (or
``WORLD_SIZE=1``) it is the single-process group, whose collectives are no-ops. Protocol: every
rank builds the same plan from metadata; :meth:`Group.share` assigns work units by size
(:func:`assign`); rank 0 creates the temporary output; :meth:`Group.agree` is the barrier (if
any rank failed, every rank raises the lowest failing rank's error, prefixed ``rank R:``, code
unchanged, and nothing is published); rank 0 writes the index / ``.metadata`` and commits. Only
rank 0 prints. ``docs/design.md`` §5, "Distributed runs".
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckpttool import errors
from ckpttool.errors import CkptError, RankLostError, UsageError

if TYPE_CHECKING:
    from ckpttool.format.writer import DCPWriter

__all__ = [
    "Group",
    "SINGLE",
    "assign",
    "merge_rank_files",
    "from_env",
    "current",
    "set_current",
    "pack_error",
    "unpack_error",
    "agreed",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


def assign(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each work unit: largest first to the least loaded rank (ties: lowest rank).

    Deterministic, so every rank computes the same assignment from the same plan.
    """
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


@dataclass
class Group:
    """This process's place in the run: ``rank`` of ``world`` (``world == 1``: not distributed)."""

    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        """Whether the run is spread over several processes."""
        return self.world > 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def owns(self, owner: int) -> bool:
        return owner == self.rank

    def share(self, sizes: Sequence[int]) -> list[int]:
        """:func:`assign` over this group's ranks."""
        return assign(sizes, self.world)

    # ---------------------------------------------------------------- collectives (no-ops on one process)
    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        import torch.distributed as dist

        box: list[Any] = [value if self.is_root else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as e:
            raise _lost(self.rank, e) from None
        return box[0]  # type: ignore[no-any-return]

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order (on every rank)."""
        if not self.active:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, value)
        except Exception as e:
            raise _lost(self.rank, e) from None
        return out

    def agree(self, error: BaseException | None) -> None:
        """Barrier: raise the first failing rank's error on every rank (see the module docstring).

        Raises:
            CkptError: of the failing rank's code, message prefixed ``rank R:``.
            KeyboardInterrupt: a rank was interrupted, or the collective failed after this
                process got SIGINT/SIGTERM (torchrun stopping the run).
            RankLostError (E150): the collective failed: another rank died mid-run.
        """
        report = None if error is None else _report(error)
        if not self.active:
            if error is not None:
                raise error
            return
        try:
            reports = self.gather(report)
        except RankLostError:
            if isinstance(error, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise
        failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if not failed:
            return
        r, rep = failed[0]
        if rep["kind"] == "interrupt":
            raise KeyboardInterrupt
        exc = _rebuild(r, rep)
        exc._ckpttool_agreed = True  # type: ignore[attr-defined]
        if error is not None and r == self.rank:
            raise exc from error
        raise exc

    def run(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` then :meth:`agree` on its outcome: every rank succeeds or every rank raises the same error."""
        try:
            value = fn()
        except (CkptError, KeyboardInterrupt, Exception) as e:
            self.agree(e)
            raise AssertionError("unreachable") from e
        self.agree(None)
        return value

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def merge_rank_files(group: Group, writer: DCPWriter, mine: Sequence[int] | set[int]) -> bool:
    """The end of a distributed DCP write (reshard, import): whether this rank writes ``.metadata``.

    Under torchrun every rank syncs the data files it wrote (``mine``), :meth:`Group.agree`
    pairs with the ``agree(error)`` of a failing rank (raising its error everywhere), and rank 0
    merges the other ranks' chunk records (offsets in their files) into ``writer``; the other
    ranks return ``False`` and stop there. One process: ``True``, nothing to do.
    """
    if not group.active:
        return True
    for r in sorted(mine):
        writer.sync(r)
    group.agree(None)
    records = group.gather(writer.records())
    if not group.is_root:
        return False
    for r, rec in enumerate(records):
        if r != group.rank:
            writer.merge(rec)
    return True


def _lost(rank: int, e: Exception) -> BaseException:
    """What a failed collective raises: gloo saw a peer's connection close (it died or was stopped).

    After SIGINT/SIGTERM (torchrun stops every rank on Ctrl-C) it is an interrupt (exit 130);
    otherwise :class:`RankLostError` (E150).
    """
    from ckpttool.format.atomic import signal_received

    if signal_received():
        return KeyboardInterrupt()
    return RankLostError(f"rank {rank}: another rank left the run ({type(e).__name__}: {str(e)[:120]})")


def _report(e: BaseException) -> dict[str, Any]:
    if isinstance(e, KeyboardInterrupt):
        return {"kind": "interrupt"}
    if isinstance(e, CkptError):
        return {"kind": "ckpt", "cls": type(e).__name__, "code": e.code, "message": e.message, "hint": e.hint,
                "path": e.path, "fqn": e.fqn}  # fmt: skip
    tb = "".join(traceback.format_exception_only(type(e), e)).strip()
    return {"kind": "other", "message": f"internal error: {tb[:300]}"}


def agreed(e: BaseException) -> bool:
    """Whether ``e`` was raised by :meth:`Group.agree` (every rank knows of it already)."""
    return bool(getattr(e, "_ckpttool_agreed", False))


def pack_error(e: CkptError) -> dict[str, Any]:
    """A picklable view of a :class:`CkptError` (class, code, message, hint, path, fqn)."""
    return _report(e)


def unpack_error(rep: dict[str, Any]) -> CkptError:
    """The error :func:`pack_error` described, rebuilt as its own class (same code and message)."""
    return _rebuild(None, rep)


class _RankError(CkptError):
    """A failure on another rank, carrying that rank's code (``code``/``exit_code`` set per instance)."""


def _rebuild(rank: int | None, rep: dict[str, Any]) -> CkptError:
    msg = rep["message"] if rank is None else f"rank {rank}: {rep['message']}"
    if rep["kind"] == "ckpt":
        cls = getattr(errors, rep["cls"], None)
        if isinstance(cls, type) and issubclass(cls, CkptError) and cls.code == rep["code"]:
            try:
                return cls(msg, hint=rep["hint"] or None, path=rep["path"], fqn=rep["fqn"])
            except TypeError:
                pass
        exc = _RankError(msg, hint=rep["hint"] or None, path=rep["path"], fqn=rep["fqn"])
        exc.code = rep["code"]
        return exc
    exc = _RankError(msg, hint="rerun with CKPTTOOL_DEBUG=1 for a traceback; please report it")
    exc.code = "E999"
    return exc


SINGLE = Group()
_current = SINGLE


def enter_output_dir(
    stack: contextlib.ExitStack, group: Group, out: Any, *, overwrite: bool, source: Any, kind: str = "output"
) -> Path:
    """Rank 0 enters the output's staging directory (:func:`ckpttool.format.outputs.output_dir`)
    on ``stack``; every rank gets its path (a failure on rank 0 is raised on every rank).

    Raises:
        whatever ``output_dir`` raises on rank 0 (``OutputError``: ``out`` exists without ``overwrite``, ...).
    """
    from ckpttool.format.outputs import output_dir

    failure: BaseException | None = None
    tmp0: Path | None = None
    if group.is_root:
        try:
            tmp0 = stack.enter_context(output_dir(out, overwrite=overwrite, source=source, kind=kind))
        except BaseException as e:
            failure = e
    group.agree(failure)
    tmp = group.broadcast(tmp0)
    assert tmp is not None
    return Path(tmp)


def current() -> Group:
    """The group of this process (the single-process group unless :func:`from_env` joined one)."""
    return _current


def set_current(group: Group) -> Group:
    """Make ``group`` the current one; returns the previous."""
    global _current
    previous, _current = _current, group
    return previous


def in_torchrun() -> bool:
    """Whether torchrun (or another launcher) started this process as one of several ranks."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def from_env(timeout_s: float = 1800.0) -> Group:
    """Join the process group described by torchrun's environment (gloo); the single group without one.

    Raises:
        UsageError: the environment is incomplete or the group cannot be joined.
    """
    if not in_torchrun():
        return SINGLE
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise UsageError(f"torchrun environment is incomplete ({e})", hint="start with torchrun") from None
    import datetime

    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise UsageError(
            f"cannot join the torch.distributed group (rank {rank} of {world}): {type(e).__name__}: {str(e)[:160]}",
            hint="start with torchrun (MASTER_ADDR/MASTER_PORT reachable from every rank)",
        ) from e
    log.info("distributed run: rank %d of %d (gloo)", rank, world)
    return Group(rank, world)
