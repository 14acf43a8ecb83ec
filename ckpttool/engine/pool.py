"""The one thread pool of the process: byte moves, digests, uploads and fetches run on it.

Reads (``preadv``), writes, CRC-32, digests and object-store requests release the GIL, so
threads overlap them. One lazily created ``ThreadPoolExecutor`` serves every caller;
:func:`map_ordered` bounds each call's concurrency to its own ``workers`` and returns results
in item order. A call made from a pool thread (a task that maps again) runs inline, so nested
work never waits for a thread held by its own caller. :func:`overlap` is a separate one-thread
executor for a task that overlaps the caller's own work (the second half of a record copy); its
tasks never submit further work.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import Any, TypeVar

__all__ = [
    "Lane",
    "imap_ordered",
    "map_ordered",
    "on_pool_thread",
    "overlap",
    "pool_size",
    "shutdown",
    "wait_exception",
    "worker_count",
]

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_local = threading.local()
_executor: ThreadPoolExecutor | None = None
_size = 0
_overlap: ThreadPoolExecutor | None = None
_created: list[ThreadPoolExecutor] = []  # every shared executor made (a replaced one may still have threads)


def _mark_pool_thread() -> None:
    _local.on_pool = True


def _mark_overlap_thread() -> None:
    _local.on_pool = _local.on_overlap = True


def _reset_after_fork() -> None:  # a forked child has none of the parent's threads
    global _executor, _size, _overlap, _lock
    _executor, _size, _overlap = None, 0, None
    _created.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def on_pool_thread() -> bool:
    """Whether the calling thread is one of the pool's (or the :func:`overlap` thread)."""
    return bool(getattr(_local, "on_pool", False))


def pool_size() -> int:
    """Threads the shared pool may start: ``max(32, 4 * CPU count)`` (started on demand, kept idle)."""
    return max(32, 4 * (os.cpu_count() or 1))


def worker_count(requested: int | None, limit: int) -> int:
    """The workers of one call: ``requested`` (default: the CPU count), at most ``limit``, at least 1."""
    return max(1, min(requested or os.cpu_count() or 1, limit))


def _shared(min_threads: int) -> ThreadPoolExecutor:
    """The shared executor, replaced by a larger one when a call needs more threads than it has.

    A replaced executor is not shut down: calls still running on it keep submitting to it
    (:func:`shutdown` ends them all).
    """
    global _executor, _size
    with _lock:
        if _executor is None or _size < min_threads:
            _size = max(min_threads, pool_size())
            _executor = ThreadPoolExecutor(_size, thread_name_prefix="ckpttool", initializer=_mark_pool_thread)
            _created.append(_executor)
        return _executor


def shutdown() -> None:
    """Tell every idle thread of the pool (and of the overlap thread) to end, without waiting.

    The CLI calls it when a command ends, however it ends: the pool's threads are not daemons, so
    the interpreter's exit joins them, and a signal that cuts short ``concurrent.futures``' own exit
    hook (a SIGTERM arriving as the command returns) must not leave an idle worker blocking the exit.
    A later call starts a new pool.
    """
    global _executor, _size, _overlap
    with _lock:
        executors = [*_created, *([_overlap] if _overlap is not None else [])]
        _created.clear()
        _executor, _size, _overlap = None, 0, None
    for ex in executors:
        ex.shutdown(wait=False, cancel_futures=True)


def overlap(fn: Callable[..., R], *args: Any) -> Future[R]:
    """Run ``fn(*args)`` on the process's one overlap thread (a task that must not submit work itself).

    Called from the overlap thread itself, ``fn`` runs inline (its future is done on return).
    """
    global _overlap
    if getattr(_local, "on_overlap", False):
        done: Future[R] = Future()
        done.set_running_or_notify_cancel()
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)
        return done
    with _lock:
        if _overlap is None:
            _overlap = ThreadPoolExecutor(1, thread_name_prefix="ckpttool-overlap", initializer=_mark_overlap_thread)
        ex = _overlap
    return ex.submit(fn, *args)


class _Run:
    """One :func:`map_ordered` call: at most ``workers`` items running, the next launched as one ends.

    A slot is marked running by the worker that runs it, never by the thread that submits it: a
    signal's exception raised in the main thread between the two (at the entry of
    ``ThreadPoolExecutor.submit``) then leaves a pending slot that :meth:`close` cancels, not a
    running one that no thread will ever finish.
    """

    def __init__(self, fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> None:
        self.fn, self.items, self.workers = fn, items, workers
        self.slots: list[Future[Any]] = [Future() for _ in items]
        self.next = 0
        self.closed = False
        self.lock = threading.Lock()
        self.executor = _shared(workers)

    def start(self) -> None:
        """Launch the first ``workers`` items (called inside the caller's ``try``: an interruption here
        is cleaned up like one while waiting)."""
        for _ in range(self.workers):
            self._launch()

    def _launch(self) -> None:
        with self.lock:
            if self.closed or self.next >= len(self.items):
                return
            i = self.next
            self.next += 1
        try:
            self.executor.submit(self._task, i)
        except RuntimeError as e:  # the interpreter is shutting down: the item fails instead of hanging
            if self.slots[i].set_running_or_notify_cancel():
                self.slots[i].set_exception(e)

    def _task(self, i: int) -> None:
        slot = self.slots[i]
        if not slot.set_running_or_notify_cancel():
            return  # cancelled by close() before it started
        try:
            result = self.fn(self.items[i])
        except BaseException as e:
            slot.set_exception(e)
        else:
            slot.set_result(result)
        finally:
            self._launch()

    def close(self) -> list[Future[Any]]:
        """Launch nothing more; cancel the items not running yet; return the running (or finished) ones."""
        with self.lock:
            self.closed = True
            launched = self.next
        for slot in self.slots[launched:]:
            slot.cancel()
        return [slot for slot in self.slots[:launched] if not slot.cancel()]


_POLL_S = 0.05


def _result(slot: Future[R]) -> R:
    """``slot.result()``, waking every :data:`_POLL_S`: a signal delivered to a worker thread (the kernel
    picks any thread for ``kill``) is then handled by the main thread at once, not when the slot ends."""
    while True:
        try:
            return slot.result(timeout=_POLL_S)
        except FutureTimeout:
            continue


def wait_exception(slot: Future[Any]) -> BaseException | None:
    """``slot.exception()`` (waits for a running slot), waking like :func:`_result`: Ctrl-C is handled at once."""
    while True:
        try:
            return slot.exception(timeout=_POLL_S)
        except FutureTimeout:
            continue


def _inline(fn: Callable[[T], R], items: Sequence[T], finish_all: bool) -> list[R]:
    results: list[R] = []
    first: Exception | None = None
    for it in items:
        try:
            results.append(fn(it))
        except Exception as e:  # collected: every item still runs, the first error is raised at the end
            if not finish_all:
                raise
            first = first or e
    if first is not None:
        raise first
    return results


def map_ordered(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    workers: int,
    stop: threading.Event | None = None,
    guard: Callable[[], AbstractContextManager[Any]] | None = None,
    finish_all: bool = False,
) -> list[R]:
    """``[fn(x) for x in items]`` on the shared pool, at most ``workers`` at a time, results in item order.

    Args:
        workers: the most items running at once (the call's worker count).
        stop: set when the call fails or is interrupted, before waiting for the running items
            (the items poll it to return early).
        guard: a context manager factory held while waiting for running items after a failure
            (``signals_deferred``: a second Ctrl-C must not close files under a running item).
        finish_all: every item runs even after one fails; the first error in item order is raised
            when all are done. Default: the first error in item order is raised once the items
            already running have ended; the items not started are cancelled.

    Called from a pool thread, the items run inline, in order (nested calls never deadlock).

    Raises:
        the first error of an item, in item order; ``KeyboardInterrupt`` (or another signal's
        exception) while waiting, after the items not started are cancelled and the running ones ended.
    """
    seq = list(items)
    if not seq:
        return []
    if on_pool_thread():
        return _inline(fn, seq, finish_all)
    run = _Run(fn, seq, max(1, min(workers, len(seq))))
    try:
        run.start()
        if finish_all:
            errors = [wait_exception(slot) for slot in run.slots]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        return [_result(slot) for slot in run.slots]
    except BaseException:
        if stop is not None:
            stop.set()
        started = run.close()
        with guard() if guard is not None else contextlib.nullcontext():
            for slot in started:
                wait_exception(slot)  # waits; its own error, if any, is not the one raised
        raise


def imap_ordered(fn: Callable[[T], R], items: Iterable[T], *, workers: int) -> Iterator[R]:
    """:func:`map_ordered` yielding each result as soon as it and those before it are done.

    Every item is started whether or not the results are consumed; closing the iterator early
    (or an error) cancels the items not started and waits for the running ones.

    Raises:
        the first error of an item, in item order.
    """
    seq = list(items)
    if not seq:
        return
    if on_pool_thread():
        for it in seq:
            yield fn(it)
        return
    run = _Run(fn, seq, max(1, min(workers, len(seq))))
    try:
        run.start()
        for slot in run.slots:
            yield _result(slot)
    except BaseException:
        for slot in run.close():
            slot.exception()
        raise


class Lane:
    """A bounded share of the pool for open-ended submission: at most ``workers`` of its tasks run at once.

    The rest wait in the lane's own queue (first in, first out); :meth:`submit` returns a plain
    ``concurrent.futures.Future`` (``wait``, ``cancel`` and ``result`` work as usual: a task handed to
    a thread but not started yet can still be cancelled). A task submitted from a pool thread runs
    inline (nested work never deadlocks). As in :func:`map_ordered`, a future is marked running by the
    thread that runs it: a signal's exception raised in the submitting thread before the hand-over
    leaves a pending future, which :meth:`shutdown` cancels instead of waiting for it forever.
    """

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._handed: set[Future[Any]] = set()  # taken from the queue for a thread, and not ended
        self._running = 0
        self._closed = False
        self._lock = threading.Lock()
        self._executor = _shared(self.workers)

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Queue ``fn(*args)``; it starts when fewer than ``workers`` of the lane's tasks run.

        Raises:
            RuntimeError: the lane was shut down.
        """
        fut: Future[Any] = Future()
        if on_pool_thread():
            fut.set_running_or_notify_cancel()
            self._run(fut, fn, args)
            return fut
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a lane that was shut down")
            self._queue.append((fut, fn, args))
        self._pump()
        return fut

    def _pump(self) -> None:
        while True:
            with self._lock:
                if self._running >= self.workers or not self._queue:
                    return
                fut, fn, args = self._queue.popleft()
                if fut.cancelled():
                    continue  # cancelled while queued
                self._running += 1
                self._handed.add(fut)
            try:
                self._executor.submit(self._task, fut, fn, args)
            except RuntimeError as e:  # the interpreter is shutting down
                self._done(fut)
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(e)

    @staticmethod
    def _run(fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            result = fn(*args)
        except BaseException as e:
            fut.set_exception(e)
        else:
            fut.set_result(result)

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            if fut in self._handed:
                self._running -= 1
                self._handed.discard(fut)

    def _task(self, fut: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            if fut.set_running_or_notify_cancel():  # False: cancelled before it started
                self._run(fut, fn, args)
        finally:
            self._done(fut)
            self._pump()

    def shutdown(self) -> None:
        """Accept no more tasks; cancel the queued ones and those not started; wait for the running ones."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
        for fut, _, _ in queued:
            fut.cancel()
        while True:
            with self._lock:
                live = [f for f in self._handed if not f.done()]
            if not live:
                return
            for fut in live:
                if not fut.cancel():  # a pending one (not started, or never handed over) ends here
                    fut.exception()
            time.sleep(0.001)  # a task ended and its successor is being started: look again
