"""Runs spread over torch.distributed ranks (``torchrun --nproc-per-node N -m ckpttool export ...``).

:func:`from_env` joins torchrun's process group (``gloo``, CPU only); without its variables (or
``WORLD_SIZE=1``) it is the single-process group, whose collectives are no-ops. Protocol: every
rank builds the same plan from metadata; :meth:`Group.share` assigns work units by size
(:func:`assign`); rank 0 creates the temporary output; :meth:`Group.agree` is the barrier (if
any rank failed, every rank raises the lowest failing rank's error, prefixed ``rank R:``, code
unchanged, and nothing is published); rank 0 writes the index / ``.metadata`` and commits. Only
rank 0 prints. A rank lost mid-run (its process ended without a result): every survivor finds
it through torchrun's store (:meth:`Group.lost_peer`: each rank's pid, phase and exit recorded
there), prints one E150 line naming it and its phase, and what the run created is removed;
every rank leaves only once the others recorded their exit (:meth:`Group.finish`).
``docs/design.md`` §5, "Distributed runs"; ``docs/storage.md``, "A rank lost under torchrun".
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    # torchrun: the rendezvous store (a prefixed TCPStore client) holding each rank's pid, phase and
    # exit status, the output's target and the parents of it that rank 0 created (``None``: one process)
    store: Any = field(default=None, repr=False, compare=False)
    phase: str = field(default="starting", compare=False)
    lost_error: RankLostError | None = field(default=None, repr=False, compare=False)
    note: str | None = field(default=None, compare=False)
    stderr_fd: int | None = field(default=None, repr=False, compare=False)  # a silenced rank's own stderr
    # rank 0, when the output was not published: its staging directory and the parents of OUT this run made,
    # removed again by :meth:`finish` once every rank ended (a peer may have written there after rank 0 removed it)
    unpublished: Path | None = field(default=None, repr=False, compare=False)
    unpublished_parents: list[Path] = field(default_factory=list, repr=False, compare=False)

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

        from ckpttool.format.atomic import signals_deferred

        box: list[Any] = [value if self.is_root else None]
        try:
            with signals_deferred():  # see gather
                dist.broadcast_object_list(box, src=0)
        except Exception as e:
            raise self._lost(e) from None
        return box[0]  # type: ignore[no-any-return]

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order (on every rank)."""
        if not self.active:
            return [value]
        import torch.distributed as dist

        from ckpttool.format.atomic import signals_deferred

        out: list[Any] = [None] * self.world
        try:
            # Two collectives (the sizes, then the bytes): a SIGINT/SIGTERM between them, raised here, would
            # leave the peers in the second one for good (torchrun's Ctrl-C reaches every rank, each at its own
            # point); it is raised once both are done, when every rank has had its say
            with signals_deferred():
                dist.all_gather_object(out, value)
        except Exception as e:
            raise self._lost(e) from None
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
            if self.phase == "writing":
                self.mark("written")
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

    # ---------------------------------------------------------------- lost ranks (the store-based handshake)
    def mark(self, phase: str) -> None:
        """Record this rank's phase (``starting``, ``writing``, ``written``, ``committed``) in the store."""
        self.phase = phase
        _store_set(self.store, f"phase/{self.rank}", phase)

    def _lost(self, e: Exception) -> BaseException:
        """What a failed collective raises: gloo saw a peer's connection close (it died or was stopped).

        A peer found lost (:meth:`lost_peer`) gives its E150; after SIGINT/SIGTERM with every peer
        alive (torchrun stopping the run on Ctrl-C) an interrupt (exit 130); otherwise an E150
        naming no rank.
        """
        from ckpttool.format.atomic import signal_received

        lost = self.lost_peer()
        if lost is not None:
            return lost
        if signal_received():
            return KeyboardInterrupt()
        return RankLostError(f"rank {self.rank}: another rank left the run ({type(e).__name__}: {str(e)[:120]})")

    def lost_peer(self, wait_s: float = 2.0) -> RankLostError | None:
        """The E150 naming the ranks whose process ended without a result, or ``None``.

        The handshake: this rank checks in (``seen/R``); a peer counts as alive when it finished
        (``exit/R``), checked in, or its process (same host: pid and ``/proc`` state, a zombie is
        dead) still runs; a peer that joined on this host is decided at once, any other within
        ``wait_s``. A lost rank 0: the survivors remove its temporary output (proven by its marker)
        and the parents of OUT it recorded before creating them. A peer lost after rank 0 committed
        is no error: ``None``, and :attr:`note` says OUT is published and complete.
        """
        if not self.active or self.store is None:
            return None
        if self.lost_error is not None:
            return self.lost_error
        lost = _find_lost(self, wait_s)
        if not lost:
            return None
        phases = {r: _store_get(self.store, f"phase/{r}") for r in lost}
        if _store_get(self.store, "phase/0") == "committed":
            ranks = ", ".join(str(r) for r in lost)
            self.note = (
                f"rank {ranks} ended after rank 0 published the output, which is complete; "
                "torchrun's exit status 1 reports the lost process, not the output"
            )
            return None
        left = "what this run created was removed"
        if 0 in lost:
            _clean_after_lost_root(self.store)
            remote = _store_get(self.store, "remote_out")
            if remote is not None:
                left = f"rank 0's temporary objects beside {remote} stay (.<name>.ckpttool-tmp-*)"
        what = "; ".join(f"rank {r} was lost {_PHASES.get(phases[r] or '', 'before it joined the run')}" for r in lost)
        self.lost_error = RankLostError(
            f"{what} (its process ended without a result); nothing was published and {left}"
        )
        return self.lost_error

    def finish(self, code: int, wait_s: float | None = None) -> None:
        """The end of this rank's run: record ``code`` (``exit/R``) and wait until every other rank
        has recorded its own or is found lost (bounded by ``wait_s``; default 120 s for a failing
        rank, whose exit makes torchrun stop the others, 10 s otherwise), so that no rank's exit
        stops another mid-way (its cleanup, its ``error:`` line). SIGTERM is ignored from here:
        the command is over. A peer found lost sets :attr:`lost_error` or :attr:`note`.
        """
        if not self.active or self.store is None:
            return
        import signal
        import time

        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _store_set(self.store, f"exit/{self.rank}", str(code))
        deadline = time.monotonic() + (wait_s if wait_s is not None else 120.0 if code else 10.0)
        pending = [r for r in range(self.world) if r != self.rank]
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if _store_get(self.store, f"exit/{r}") is None]
            if pending and all(_peer_state(self.store, r) == "dead" for r in pending):
                break
            if pending:
                time.sleep(0.02)
        if pending and self.lost_error is None and self.note is None:
            self.lost_peer(wait_s=0.5)
        if self.unpublished is not None:
            _remove_unpublished(self.unpublished, self.unpublished_parents)

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def merge_rank_files(
    group: Group, writer: DCPWriter, mine: Sequence[int] | set[int], counts: dict[str, int] | None = None
) -> bool:
    """The end of a distributed DCP write (reshard, import): whether this rank writes ``.metadata``.

    Under torchrun every rank syncs the data files it wrote (``mine``), :meth:`Group.agree`
    pairs with the ``agree(error)`` of a failing rank (raising its error everywhere), and rank 0
    merges the other ranks' chunk records (offsets in their files) into ``writer`` and adds their
    ``counts`` (chunks copied, rewritten: in the same gather, one collective) into its own; the other
    ranks return ``False`` and stop there. One process: ``True``, nothing to do.
    """
    if not group.active:
        return True
    for r in sorted(mine):
        writer.sync(r)
    group.agree(None)
    gathered = group.gather((writer.records(), dict(counts or {})))
    if not group.is_root:
        return False
    for r, (rec, theirs) in enumerate(gathered):
        if r != group.rank:
            writer.merge(rec)
            if counts is not None:
                for k, v in theirs.items():
                    counts[k] = counts.get(k, 0) + v
    return True


# ---------------------------------------------------------------- the run's record in the store
_PHASES = {
    "starting": "while starting (before the output was opened)",
    "writing": "while writing its share of the output",
    "written": "after writing its share, before the output was published",
    "committed": "after the output was published",
}
_STORE_ERRORS = (RuntimeError, OSError, ValueError)


def _store_set(store: Any, key: str, value: str) -> None:
    if store is not None:
        with contextlib.suppress(*_STORE_ERRORS):
            store.set(key, value)


def _store_get(store: Any, key: str) -> str | None:
    """The value of ``key``, ``None`` when absent (or the store is gone: its host agent ended)."""
    if store is None:
        return None
    try:
        if not store.check([key]):
            return None
        return bytes(store.get(key)).decode()
    except _STORE_ERRORS:
        return None


def _pid_state(pid: int) -> str:
    """``alive`` or ``dead`` (no such process, or a zombie its launcher has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]
        return "dead" if state in (b"Z", b"X") else "alive"
    except FileNotFoundError:
        return "dead"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:
            return "alive"
        return "alive"


def _peer_state(store: Any, r: int) -> str:
    """Rank ``r``: ``finished`` (recorded its exit), ``alive``/``dead`` (its pid on this host), ``unknown``."""
    import socket

    if _store_get(store, f"exit/{r}") is not None:
        return "finished"
    who = _store_get(store, f"pid/{r}")
    if who is None:
        return "unknown"
    host, _, pid = who.rpartition(":")
    if host != socket.gethostname() or not pid.isdecimal():
        return "unknown"
    return _pid_state(int(pid))


def _find_lost(group: Group, wait_s: float) -> list[int]:
    """The other ranks whose process ended without recording an exit (see :meth:`Group.lost_peer`)."""
    import time

    _store_set(group.store, f"seen/{group.rank}", "1")
    deadline = time.monotonic() + wait_s
    while True:
        states = {r: _peer_state(group.store, r) for r in range(group.world) if r != group.rank}
        unknown = [r for r, s in states.items() if s == "unknown" and _store_get(group.store, f"seen/{r}") is None]
        if not unknown or time.monotonic() >= deadline:
            return sorted(r for r, s in states.items() if s == "dead" or r in unknown)
        time.sleep(0.02)


def _clean_after_lost_root(store: Any) -> None:
    """Remove what a lost rank 0 created: its temporary output (only when its marker proves it, its
    process gone) and the parents of OUT it recorded as missing before creating them (empty ones)."""
    import json
    import time

    from ckpttool.format import marker
    from ckpttool.format.atomic import _remove_marked

    out = _store_get(store, "out")
    if out is None:
        return
    who = _store_get(store, "pid/0") or ""
    pid = who.rpartition(":")[2]
    deadline = time.monotonic() + 5.0
    while pid.isdecimal() and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)  # its launcher reaps it: then its marker's pid is provably gone
    target = Path(out)
    source = _store_get(store, "source")
    with contextlib.suppress(OSError):
        for p in sorted(target.parent.iterdir()) if target.parent.is_dir() else []:
            if ".ckpttool-tmp-" in p.name:
                remove, _ = marker.stale_verdict(p, target.name, source=Path(source) if source else None)
                if remove:
                    _remove_marked(p)
    _remove_empty([Path(a) for a in json.loads(_store_get(store, "created") or "[]")])


def _remove_unpublished(staging: Path, parents: list[Path]) -> None:
    """Rank 0, at the end of a run that published nothing: its ``staging`` directory again (made by this process,
    under this run's own name; what a peer wrote there after rank 0 removed it: the removal's last ``rmdir`` fails
    when a file appears during it), then the ``parents`` of OUT the run made, when empty."""
    import shutil

    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging, ignore_errors=True)
    _remove_empty(parents)


def _remove_empty(dirs: Sequence[Path]) -> None:
    """``rmdir`` each of ``dirs`` (deepest first) until one is not empty (someone else's files) or gone."""
    for a in dirs:
        try:
            os.rmdir(a)
        except FileNotFoundError:
            continue
        except OSError:
            break


@contextlib.contextmanager
def _published(group: Group, cm: Any) -> Any:
    """``cm`` (the output directory), then this rank's phase ``committed`` once it published (and
    SIGTERM ignored: the rest of the run only reports)."""
    import signal

    tmp = None
    try:
        with cm as tmp:
            yield tmp
    except BaseException:
        if isinstance(tmp, Path):  # removed by cm; a peer still writing its share may have made a file there since
            group.unpublished = tmp
        raise
    group.mark("committed")
    # published: torchrun's SIGTERM (a peer lost from here on) must not cut the report short
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _record_output(stack: contextlib.ExitStack, group: Group, out: Any, source: Any) -> None:
    """Rank 0, before the output directory is made: record OUT, the source and the parents of OUT
    that do not exist yet (this run will create them) in the store, and remove those parents again
    (empty ones, deepest first) when the output is not published."""
    import json

    if "://" in str(out):
        _store_set(group.store, "remote_out", str(out))
        return
    from ckpttool.format.atomic import absolute_path

    target = absolute_path(out)
    missing = []
    for a in target.parents:
        if a.exists() or a.is_symlink():
            break
        missing.append(a)
    _store_set(group.store, "out", str(target))
    if source is not None and "://" not in str(source):
        _store_set(group.store, "source", str(absolute_path(source)))
    _store_set(group.store, "created", json.dumps([str(a) for a in missing]))
    stack.callback(lambda: None if group.phase == "committed" else _remove_empty(missing))
    stack.callback(lambda: None if group.phase == "committed" else group.unpublished_parents.extend(missing))


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
    from ckpttool.format.atomic import signals_deferred
    from ckpttool.format.outputs import output_dir

    failure: BaseException | None = None
    tmp0: Path | None = None
    if group.is_root:
        try:
            if group.active:
                _record_output(stack, group, out, source)
            # a signal while the directory is made is raised once it is on the stack (which removes it)
            with signals_deferred():
                cm = output_dir(out, overwrite=overwrite, source=source, kind=kind)
                tmp0 = stack.enter_context(_published(group, cm) if group.active else cm)
        except BaseException as e:
            failure = e
    group.agree(failure)
    tmp = group.broadcast(tmp0)
    assert tmp is not None
    if group.active:
        group.mark("writing")
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


_early_stop = False  # SIGTERM arrived while the CLI was loading (see catch_early_stop)


def catch_early_stop() -> None:
    """Under torchrun, before the CLI loads: remember a SIGTERM (torchrun stopping the run because
    another rank ended) instead of dying of it silently; :func:`from_env` answers it (E150)."""
    import signal

    if not in_torchrun():
        return

    def remember(signum: int, frame: Any) -> None:
        global _early_stop
        _early_stop = True

    with contextlib.suppress(ValueError):  # not the main thread
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, remember)


def from_env(timeout_s: float = 1800.0) -> Group:
    """Join the process group described by torchrun's environment (gloo); the single group without one.

    From here SIGTERM (torchrun stopping the run) raises ``Terminated`` in this process. Each rank
    records its host and pid in torchrun's store (``pid/R``) and waits there (in Python, so that a
    signal is handled) for every rank before the gloo group is made.

    Raises:
        UsageError: the environment is incomplete or the group cannot be joined.
        RankLostError (E150): another rank ended before every rank joined.
        KeyboardInterrupt: the run was stopped (Ctrl-C) before every rank joined.
    """
    if not in_torchrun():
        return SINGLE
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        raise UsageError(f"torchrun environment is incomplete ({e})", hint="start with torchrun") from None
    import datetime

    import torch.distributed as dist

    from ckpttool.format.atomic import stop_signals

    stop_signals()
    group = Group(rank, world, store=_agent_store())
    try:
        _rendezvous(group, timeout_s)
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except KeyboardInterrupt:
        lost = group.lost_peer()
        if lost is not None:
            raise lost from None
        raise
    except Exception as e:
        raise UsageError(
            f"cannot join the torch.distributed group (rank {rank} of {world}): {type(e).__name__}: {str(e)[:160]}",
            hint="start with torchrun (MASTER_ADDR/MASTER_PORT reachable from every rank)",
        ) from e
    if group.store is None:  # a launcher without torchrun's agent store: the group's own, once made
        group.store = dist.PrefixStore("ckpttool/", dist.distributed_c10d._get_default_store())  # type: ignore[attr-defined]
        _rendezvous(group, timeout_s)
    log.info("distributed run: rank %d of %d (gloo)", rank, world)
    return group


def _agent_store() -> Any:
    """A client of the store torchrun's agent hosts (it outlives every rank), or ``None`` without one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )
    except (KeyError, *_STORE_ERRORS):
        return None
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"ckpttool/{run}/", store)  # type: ignore[attr-defined]


def _rendezvous(group: Group, timeout_s: float) -> None:
    """Record this rank's host and pid (``pid/R``), then wait until every rank did (polling: signals are handled)."""
    import socket
    import time

    if group.store is None:
        return
    from ckpttool.format.atomic import Terminated

    _store_set(group.store, f"pid/{group.rank}", f"{socket.gethostname()}:{os.getpid()}")
    group.mark("starting")
    if _early_stop:
        raise Terminated()
    deadline = time.monotonic() + timeout_s
    pending = list(range(group.world))
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if _store_get(group.store, f"pid/{r}") is None]
        if pending:
            time.sleep(0.02)
