"""The multi-rank helper the writers' fixtures run on (``tests/fixtures/distributed.py``): an abort while
the gloo group is torn down, after every rank's work is done, is not a reason to run the work again (a
writer that refuses its own existing output, as OLMo-core's ``Checkpointer`` does, would then fail)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.fixtures.distributed import run_ranks


def _abort_after_teardown(rank: int, world: int, out: str) -> None:
    import atexit
    import time

    with open(Path(out) / f"ran-{rank}", "a") as f:
        f.write("x")
    if rank == 1:  # SIGABRT as the process ends, after the group's teardown (gloo's std::terminate there)
        atexit.register(lambda: (time.sleep(5), os.abort()))


def test_an_abort_at_teardown_after_the_work_is_done_does_not_run_it_again(tmp_path: Path) -> None:
    run_ranks(2, _abort_after_teardown, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran-0", "ran-1"]
    assert [(tmp_path / f"ran-{r}").read_text() for r in (0, 1)] == ["x", "x"]  # each rank's work ran once
