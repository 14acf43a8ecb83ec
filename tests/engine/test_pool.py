"""The one pool: results in item order, each call's worker count honoured, the first error (in item
order) re-raised after the rest are cancelled, nested calls run inline instead of deadlocking."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ckpttool.engine import pool
from ckpttool.engine.pool import Lane, imap_ordered, map_ordered, on_pool_thread, overlap, worker_count


class _Gauge:
    """Counts the items running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.ran: list[int] = []

    def run(self, i: int, delay: float = 0.0) -> int:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.ran.append(i)
        time.sleep(delay)
        with self.lock:
            self.now -= 1
        return i * i


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_results_in_item_order_and_concurrency_bounded(workers: int) -> None:
    g = _Gauge()
    rnd = random.Random(workers)
    delays = [rnd.random() * 0.01 for _ in range(30)]
    out = map_ordered(lambda i: g.run(i, delays[i]), range(30), workers=workers)
    assert out == [i * i for i in range(30)]
    assert 1 <= g.peak <= workers
    assert sorted(g.ran) == list(range(30))


def test_empty_and_worker_count() -> None:
    assert map_ordered(lambda i: i, [], workers=4) == []
    assert list(imap_ordered(lambda i: i, [], workers=4)) == []
    assert worker_count(None, 1) == 1
    assert worker_count(3, 8) == 3
    assert worker_count(16, 2) == 2
    assert worker_count(0, 0) == 1


def test_first_error_in_item_order_cancels_the_rest_and_sets_stop() -> None:
    stop = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    seven_raised = threading.Event()

    # No timing: item 5 raises after item 7 did (7 is later in item order: not the one raised), and the
    # items after 5 hold their worker until the call sets ``stop``, so the 200 items cannot all have
    # started before the error is seen however the threads are scheduled (the waits are hang guards).
    def fn(i: int) -> int:
        with lock:
            started.append(i)
        if i == 5:
            assert seven_raised.wait(60)
            raise ValueError("item 5")
        if i == 7:
            seven_raised.set()
            raise KeyError("item 7")
        if i > 5:
            assert stop.wait(60)
        return i

    with pytest.raises(ValueError, match="item 5"):
        map_ordered(fn, range(200), workers=3, stop=stop)
    assert stop.is_set()
    assert len(started) < 200  # the items not started were cancelled
    n = len(started)
    time.sleep(0.05)
    assert len(started) == n  # and nothing runs after the call returned


def test_finish_all_runs_every_item_then_raises_the_first_error() -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            ran.append(i)
        if i in (3, 9):
            raise RuntimeError(f"item {i}")
        return i

    with pytest.raises(RuntimeError, match="item 3"):
        map_ordered(fn, range(20), workers=4, finish_all=True)
    assert sorted(ran) == list(range(20))


def test_keyboard_interrupt_in_an_item_propagates_after_running_items_end_under_the_guard() -> None:
    entered: list[bool] = []
    running = threading.Event()
    finished: list[int] = []

    @contextmanager
    def guard() -> Iterator[None]:
        entered.append(True)
        yield

    stop = threading.Event()

    # No timing: item 0 is interrupted while item 1 runs, and every later item holds its worker until the
    # call sets ``stop`` (the waits are hang guards), so the 50 cannot all have run whatever the scheduling.
    def fn(i: int) -> int:
        if i == 0:
            assert running.wait(60)
            raise KeyboardInterrupt
        running.set()
        if i == 1:
            time.sleep(0.05)
        else:
            assert stop.wait(60)
        finished.append(i)
        return i

    with pytest.raises(KeyboardInterrupt):
        map_ordered(fn, range(50), workers=2, stop=stop, guard=guard)
    assert entered == [True]
    assert finished and len(finished) < 49  # the running one ended; the rest never started


def test_nested_calls_run_inline_and_never_deadlock() -> None:
    def inner(i: int) -> tuple[int, bool]:
        return i, on_pool_thread()

    def outer(i: int) -> list[tuple[int, bool]]:
        assert on_pool_thread()
        return map_ordered(inner, range(i, i + 3), workers=4)

    n = pool.pool_size() + 5  # more outer items than the pool has threads, each mapping again
    out = map_ordered(outer, range(n), workers=n)
    assert out == [[(i, True), (i + 1, True), (i + 2, True)] for i in range(n)]
    assert not on_pool_thread()


def test_imap_ordered_yields_in_order_and_closing_early_stops() -> None:
    g = _Gauge()
    gate = threading.Event()

    def fn(i: int) -> int:
        if i >= 5:  # held until the iterator is closed (a hang guard): 100 items cannot all run first
            assert gate.wait(60)
        return g.run(i, 0.002)

    it = imap_ordered(fn, range(100), workers=2)
    assert [next(it) for _ in range(3)] == [0, 1, 4]
    run = it.gi_frame.f_locals["run"]  # type: ignore[union-attr]  # the call's state: released once it is closed

    def release() -> None:
        for _ in range(60_000):
            if run.closed:
                break
            time.sleep(0.001)
        gate.set()

    threading.Thread(target=release, daemon=True).start()
    it.close()
    n = len(g.ran)
    time.sleep(0.02)
    assert len(g.ran) == n < 100
    assert list(imap_ordered(lambda i: -i, range(5), workers=3)) == [0, -1, -2, -3, -4]
    with pytest.raises(ZeroDivisionError):
        list(imap_ordered(lambda i: 1 // (i - 2), range(5), workers=2))


def test_lane_bounds_concurrency_and_cancels_the_queue_on_shutdown() -> None:
    g = _Gauge()
    lane = Lane(2)
    futs = [lane.submit(g.run, i, 0.003) for i in range(10)]
    assert [f.result() for f in futs] == [i * i for i in range(10)]
    assert g.peak <= 2
    block = threading.Event()
    lane2 = Lane(1)
    first = lane2.submit(block.wait, 60)
    queued = [lane2.submit(g.run, i) for i in range(5)]
    for _ in range(60_000):  # marked running by its thread, once it runs (shutdown cancels it before that)
        if first.running():
            break
        time.sleep(0.001)

    def release() -> None:  # once shutdown has cancelled the queue (not after a delay: the main thread may lag)
        for _ in range(60_000):
            if all(f.cancelled() for f in queued):
                break
            time.sleep(0.001)
        block.set()

    threading.Thread(target=release, daemon=True).start()
    lane2.shutdown()
    assert first.result() is True
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError):
        lane2.submit(g.run, 1)
    err = Lane(1).submit(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        err.result()


def test_overlap_runs_on_its_own_thread() -> None:
    names = overlap(lambda: (threading.current_thread().name, on_pool_thread())).result()
    assert names[0].startswith("ckpttool-overlap") and names[1]


def test_overlap_called_from_the_overlap_thread_runs_inline() -> None:
    def nested() -> tuple[str, str]:
        inner = overlap(lambda: threading.current_thread().name)
        assert inner.done()  # a wait on the one overlap thread from itself would never end
        return threading.current_thread().name, inner.result()

    outer, inner = overlap(nested).result(timeout=10)
    assert outer == inner and outer.startswith("ckpttool-overlap")


def test_overlap_inline_error_is_the_futures() -> None:
    def nested() -> BaseException | None:
        return overlap(lambda: 1 // 0).exception()

    assert isinstance(overlap(nested).result(timeout=10), ZeroDivisionError)


def test_shutdown_ends_every_idle_worker_and_a_later_call_starts_a_new_pool() -> None:
    import threading

    from ckpttool.engine import pool

    assert pool.map_ordered(lambda x: x * 2, range(8), workers=4) == [0, 2, 4, 6, 8, 10, 12, 14]
    pool.overlap(int, "1").result()
    workers = [t for t in threading.enumerate() if t.name.startswith("ckpttool")]
    assert workers
    pool.shutdown()
    for t in workers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in workers), "an idle pool thread would hold up the interpreter's exit"
    assert pool.map_ordered(lambda x: x + 1, range(3), workers=2) == [1, 2, 3]


class _InterruptAtSubmit:
    """Raise ``KeyboardInterrupt`` in the main thread at the entry of its ``nth`` ``ThreadPoolExecutor.submit``:
    where a signal handler's exception lands when the signal arrives as a task is handed to a thread."""

    def __init__(self, nth: int) -> None:
        import concurrent.futures.thread as cft

        self.code, self.nth, self.seen = cft.ThreadPoolExecutor.submit.__code__, nth, 0
        self.raised = threading.Event()  # set as the interrupt is raised

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is self.code:
            self.seen += 1
            if self.seen == self.nth:
                sys.settrace(None)
                self.raised.set()
                raise KeyboardInterrupt
        return None

    def __enter__(self) -> None:
        sys.settrace(self)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


def test_lane_shutdown_after_an_interrupt_as_a_task_is_handed_over_ends() -> None:
    # The third task was taken from the lane's queue and the signal's exception came before the executor got
    # it: no thread will run it. Shutdown cancelled the queue, then waited for it forever (export hung on SIGTERM).
    gate = threading.Event()
    lane = Lane(4)
    futs: list[Any] = []
    with pytest.raises(KeyboardInterrupt), _InterruptAtSubmit(3):
        for _ in range(10):
            futs.append(lane.submit(gate.wait, 0.2))  # a list, to keep what came before the raise
    assert len(futs) == 2
    done = threading.Thread(target=lane.shutdown, daemon=True)
    done.start()
    done.join(120)  # a hang guard, not a timing
    assert not done.is_alive(), "Lane.shutdown waited for a task no thread will run"
    assert all(f.done() for f in futs)
    with pytest.raises(RuntimeError):
        lane.submit(int)


def test_map_ordered_interrupted_as_it_launches_stops_every_item() -> None:
    # Interrupted while launching its workers: the call raised at once and the items it had launched kept
    # launching the rest behind the caller's back (writing into an output already being removed).
    ran: list[int] = []
    interrupt = _InterruptAtSubmit(3)

    # No timing: a launched item holds its worker until the interrupt is raised (a hang guard), so it cannot end
    # and launch the next item before the main thread's third submit, however late the main thread runs.
    def fn(i: int) -> int:
        ran.append(i)
        assert interrupt.raised.wait(60)
        return i

    with pytest.raises(KeyboardInterrupt), interrupt:
        map_ordered(fn, range(12), workers=4)
    at_return = sorted(ran)
    assert set(at_return) <= {0, 1}  # the two launched items ended (or were cancelled unstarted) before it raised
    time.sleep(0.5)  # room for the launched items to launch others, as they did
    workers = [t for t in threading.enumerate() if t.name.startswith("ckpttool")]
    pool.shutdown()
    for t in workers:
        t.join(timeout=60)
    assert sorted(ran) == at_return
