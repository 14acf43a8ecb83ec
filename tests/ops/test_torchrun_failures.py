"""A torchrun rank SIGKILLed at several points of a 2-rank ``reshard`` (gloo on 127.0.0.1).

The surviving rank prints the one ``error: [E150] ...`` line naming the lost rank and its phase,
and nothing the run created is left (the temporary output, the parents of OUT it made), while
directories that existed before stay; a rank killed after rank 0 published OUT leaves OUT
complete, and the survivor says so in a ``note:`` line (torchrun itself exits 1).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.ops.test_distributed import files_of, run_torchrun, single

# Run by torchrun in place of `-m ckpttool`: rank KILL_RANK SIGKILLs itself at KILL_AT:
# start (when it would join the run), opened (right after the temporary output was
# made and its path shared), committed (after rank 0 published OUT).
_KILL = """\
import os, runpy, signal, sys, time

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if os.environ["RANK"] == os.environ["KILL_RANK"]:
    point = os.environ["KILL_AT"]
    from ckpttool.ops import distributed

    if point == "start":
        distributed.from_env = lambda *a, **k: die()

    if point == "opened":
        enter = distributed.enter_output_dir
        distributed.enter_output_dir = lambda *a, **k: (enter(*a, **k), die())[0]
    if point == "committed":
        merge = distributed.merge_rank_files

        def _merge(group, *a, **k):
            out = merge(group, *a, **k)
            while distributed._store_get(group.store, "phase/0") != "committed":
                time.sleep(0.01)
            die()

        distributed.merge_rank_files = _merge
sys.argv = ["ckpttool", *sys.argv[1:]]
runpy.run_module("ckpttool", run_name="__main__")
"""

ARGS = ["--to", "canonical", "--with-optimizer", "--target-ep-size", "2", "--target-ep-fsdp-size", "2"]


def _killed_run(
    tmp_path: Path, src: Path, out: Path, rank: int, point: str, n: int = 2
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "kill.py"
    script.write_text(_KILL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_RANK": str(rank), "KILL_AT": point}
    env.pop("CKPTTOOL_DEBUG", None)
    return run_torchrun(
        n,
        [str(script), "reshard", str(src), str(out), *ARGS],
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    """A directory that exists before the run (with a file of the user's) and OUT two levels below it."""
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "keep.txt").write_text("the user's")
    return pre, pre / "new" / "deeper" / "out"


def _leftovers(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if "ckpttool-tmp" in p.name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "point", "phase"),
    [
        (1, "start", "before it joined the run"),
        pytest.param(1, "opened", "while writing its share of the output", marks=pytest.mark.heavy),  # CI time
        pytest.param(0, "opened", "while writing its share of the output", marks=pytest.mark.heavy),
    ],
)
def test_a_lost_rank_gives_e150_on_the_survivor_and_leaves_nothing_the_run_created(
    sample_ckpt: Path, tmp_path: Path, rank: int, point: str, phase: str
) -> None:
    pre, out = _layout(tmp_path)
    r = _killed_run(tmp_path, sample_ckpt, out, rank, point)
    assert r.returncode == 1  # torchrun's own exit status when a rank failed
    assert "exitcode  : -9" in r.stderr and "exitcode  : 2" in r.stderr, r.stderr[-3000:]  # the survivor: E150
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]  # the one survivor printed it, once
    assert errors[0].startswith(f"error: [E150] rank {rank} was lost {phase}"), errors[0]
    assert "nothing was published" in errors[0]
    # nothing of the run is left: OUT, its temporary, the parents it created; the user's directory stays
    assert sorted(p.name for p in pre.iterdir()) == ["keep.txt"], _leftovers(tmp_path)
    assert (pre / "keep.txt").read_text() == "the user's"
    assert not _leftovers(tmp_path)


@pytest.mark.slow
@pytest.mark.heavy  # CI time: a lost rank's E150 stays in CI (the test above)
def test_every_surviving_rank_prints_the_e150_line_and_rank_0s_output_is_removed(
    sample_ckpt: Path, tmp_path: Path
) -> None:
    pre, out = _layout(tmp_path)
    r = _killed_run(tmp_path, sample_ckpt, out, 0, "opened", n=3)
    assert r.returncode == 1
    assert r.stderr.count("exitcode  : 2") == 2 and "exitcode  : -9" in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, r.stderr[-3000:]  # ranks 1 and 2, one line each
    assert all(e.startswith("error: [E150] rank 0 was lost while writing its share of the output") for e in errors)
    assert sorted(p.name for p in pre.iterdir()) == ["keep.txt"], _leftovers(tmp_path)
    assert not _leftovers(tmp_path)


@pytest.mark.slow
@pytest.mark.heavy  # CI time: torchrun of 2 ranks, one killed after the commit
def test_a_rank_lost_after_the_commit_leaves_the_output_complete_and_says_so(sample_ckpt: Path, tmp_path: Path) -> None:
    pre, out = _layout(tmp_path)
    r = _killed_run(tmp_path, sample_ckpt, out, 1, "committed")
    assert r.returncode == 1  # torchrun reports the killed process ...
    assert "exitcode  : -9" in r.stderr and r.stderr.count("exitcode  : ") == 1, r.stderr[-3000:]  # rank 0: exit 0
    assert not [line for line in r.stderr.splitlines() if line.startswith("error:")], r.stderr[-3000:]
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "rank 1 ended after rank 0 published the output, which is complete" in notes[0]
    # ... but OUT is the complete output: the same files as the single-process reshard, and valid
    assert single("reshard", str(sample_ckpt), str(tmp_path / "one"), *ARGS).returncode == 0
    assert sorted(files_of(out)) == sorted(files_of(tmp_path / "one"))
    v = single("validate", str(out), "--deep")
    assert v.returncode == 0, v.stdout + v.stderr
    assert not _leftovers(tmp_path)


def test_a_process_counts_as_lost_once_it_ended_even_before_it_is_reaped() -> None:
    from ckpttool.ops.distributed import _pid_state

    assert _pid_state(os.getpid()) == "alive"
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _pid_state(child.pid) == "alive"
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
        assert _pid_state(child.pid) == "dead"
    finally:
        child.kill()
        child.wait()
    assert _pid_state(child.pid) == "dead"


def test_only_the_empty_parents_the_run_recorded_are_removed(tmp_path: Path) -> None:
    from ckpttool.ops.distributed import _remove_empty

    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (tmp_path / "a" / "theirs.txt").write_text("not ours")
    _remove_empty([deep, deep.parent, deep.parent.parent])  # deepest first, as recorded
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["theirs.txt"]
    _remove_empty([tmp_path / "gone"])  # already removed (another survivor): nothing to do


def test_one_process_has_no_lost_peer() -> None:
    from ckpttool.ops.distributed import Group

    g = Group()
    assert g.lost_peer() is None and g.note is None
    g.finish(0)
