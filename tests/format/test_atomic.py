"""Output directory targets (docs/design.md §7), through the real CLI and real processes.

- a relative target and the current directory (``.``) as target, with and without ``--overwrite``;
- ``--overwrite`` replaces only a previous output of ckpttool (its ``.ckpttool-output.json``
  agrees with its files), never unrelated content (E606; more in tests/cli/test_outputs_overwrite.py);
- two concurrent runs to the same target: one wins, the loser fails with E600 and leaves nothing;
- an interrupt or a failed rename between the two renames of an ``--overwrite`` commit never
  loses both the old and the new output.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".ckpttool-tmp-" in n or ".ckpttool-old-" in n)


def previous_output(out: Path, files: dict[str, bytes]) -> None:
    """A previous output written by ckpttool itself (through AtomicOutputDir, so it carries the marker)."""
    from ckpttool.format.atomic import AtomicOutputDir

    with AtomicOutputDir(out, kind="export") as tmp:
        for name, data in files.items():
            (tmp / name).write_bytes(data)


MARKER = ".ckpttool-output.json"


def assert_e600(res, *needles: str, code: str = "E600") -> None:  # type: ignore[no-untyped-def]
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines[-2].startswith(f"error: [{code}]"), res.stderr
    assert lines[-1].startswith("hint: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[-2], (n, lines[-2])


def export(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["export", *map(str, args)])


def reshard(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["reshard", *map(str, args), "--to", "canonical", "--with-optimizer"])


# ------------------------------------------------------------------------ relative targets and "."
@pytest.mark.parametrize("name", ["export", "reshard"])
def test_cwd_as_target(name: str, sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OUT ``.`` (the current directory) is refused (E600): the output is written beside it and renamed into
    place, which would leave the shell in a removed directory; nothing is created, the folder keeps its inode."""
    run = export if name == "export" else reshard
    d = tmp_path / "d"
    d.mkdir()
    monkeypatch.chdir(d)
    ino = os.stat(d).st_ino
    for extra in ((), ("--overwrite",)):
        res = run(sample_ckpt, ".", *extra)
        assert_e600(res, "is the current directory")
        assert os.stat(d).st_ino == ino and list(d.iterdir()) == [] and leftovers(tmp_path) == []
    res = run(sample_ckpt, "out")  # a new directory below it, as the hint says
    assert res.exit_code == 0, res.stderr
    assert leftovers(d) == [] and Path(os.getcwd()) == d


def test_relative_target(sample_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    res = export(sample_ckpt, "sub/../out")
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------ --overwrite and unrelated content
def _unrelated_repo(d: Path) -> None:
    (d / "src" / ".git").mkdir(parents=True)
    (d / "src" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "notes.txt").write_text("x\n")


def _notes_only(d: Path) -> None:
    d.mkdir()
    (d / "notes.txt").write_text("my notes\n")


def _output_with_git(d: Path) -> None:
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w")
    (d / ".git").mkdir()
    (d / ".git" / "config").write_text("[core]\n")


@pytest.mark.parametrize("make", [_unrelated_repo, _notes_only, _output_with_git], ids=["repo", "notes", "output+git"])
@pytest.mark.parametrize("name", ["export", "reshard"])
def test_overwrite_refuses_unrelated_directory(name: str, make, sample_ckpt: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "D"
    make(d)
    before = tree(d)
    run = export if name == "export" else reshard
    res = run(sample_ckpt, d, "--overwrite")
    assert_e600(res, str(d), "--overwrite refused", "not an output of ckpttool", code="E606")
    assert "remove this one yourself" in res.stderr.strip().splitlines()[-1]
    assert tree(d) == before and leftovers(tmp_path) == []
    if (d / "src" / ".git").exists():
        assert (d / "src" / ".git" / "HEAD").is_file()


@pytest.mark.parametrize(
    "name", [".metadata", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "adapter_config.json"]
)
def test_overwrite_replaces_only_a_previous_output_of_ckpttool(name: str, sample_ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "D"
    d.mkdir()
    (d / name).write_text("{}")
    (d / "README.md").write_text("old\n")
    before = tree(d)
    assert_e600(export(sample_ckpt, d, "--overwrite"), "--overwrite refused", code="E606")  # no marker: not ours
    assert tree(d) == before and leftovers(tmp_path) == []
    d2 = tmp_path / "D2"
    previous_output(d2, {name: b"{}", "README.md": b"old\n"})
    res = export(sample_ckpt, d2, "--overwrite")
    assert res.exit_code == 0, res.stderr
    assert not (d2 / "README.md").exists() and (d2 / "model.safetensors").is_file()
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------ concurrent runs
GATED = r"""
import os, sys, time
from pathlib import Path
from ckpttool.errors import CkptError
from ckpttool.format.atomic import AtomicOutputDir
target, gate, overwrite = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
try:
    with AtomicOutputDir(target, overwrite=overwrite) as tmp:
        for i in range(3):
            (tmp / f"part-{i}.safetensors").write_text(str(os.getpid()))
        print("READY", flush=True)
        while not gate.exists():
            time.sleep(0.005)
except CkptError as e:
    sys.stderr.write(f"error: {e}\n" + (f"hint: {e.hint}\n" if e.hint else ""))
    sys.exit(e.exit_code)
"""


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_concurrent_runs_leave_one_complete_output(overwrite: bool, tmp_path: Path) -> None:
    out, gate = tmp_path / "out", tmp_path / "gate"
    if overwrite:
        previous_output(out, {"model.safetensors": b"old"})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GATED, str(out), str(gate), "1" if overwrite else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY", p.stderr.read()  # type: ignore[union-attr]
    gate.touch()
    results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(rc for rc, _ in results)
    if not overwrite:
        assert codes == [0, 2], results
        err = next(e for rc, e in results if rc == 2)
        assert err.startswith("error: [E600]") and "not empty" in err and "\nhint: " in err, err
    else:
        assert set(codes) <= {0, 2} and 0 in codes, results
    # One complete output, entirely from one run; no temporary or backup directory left.
    assert leftovers(tmp_path) == [] and sorted(os.listdir(out)) == [MARKER] + [
        f"part-{i}.safetensors" for i in range(3)
    ]
    assert len({(out / n).read_text() for n in os.listdir(out) if n != MARKER}) == 1


# ------------------------------------------------------------------------ interrupted / failed commit
SWAP = r"""
import os, signal, sys
from ckpttool.errors import CkptError
from ckpttool.format.atomic import AtomicOutputDir
target, mode = sys.argv[1], sys.argv[2]
real_rename, calls = os.rename, []
def rename(a, b):
    calls.append((a, b))
    if mode == "fail" and len(calls) == 2:
        raise OSError(28, "No space left on device")
    real_rename(a, b)
    if mode in ("SIGINT", "SIGTERM") and len(calls) == 1:  # between rename(target->backup) and rename(tmp->target)
        os.kill(os.getpid(), getattr(signal, mode))
os.rename = rename
try:
    with AtomicOutputDir(target, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
except CkptError as e:
    sys.stderr.write(f"error: {e}\n" + (f"hint: {e.hint}\n" if e.hint else ""))
    sys.exit(e.exit_code)
except KeyboardInterrupt:
    sys.stderr.write("error: interrupted\n")
    sys.exit(130)
"""


@pytest.mark.parametrize("mode", ["SIGINT", "SIGTERM", "fail"])
def test_overwrite_commit_never_loses_both(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    previous_output(out, {"model.safetensors": b"old", "README.md": b"old"})
    old = tree(out)
    res = subprocess.run(
        [sys.executable, "-c", SWAP, str(out), mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "Traceback" not in res.stderr, res.stderr
    assert leftovers(tmp_path) == [], leftovers(tmp_path)
    if mode == "fail":
        assert res.returncode == 2 and res.stderr.startswith("error: [E600]"), res.stderr
        assert tree(out) == old  # the previous output is restored
    else:
        # The signal waits until the new output is in place, then stops the run.
        assert res.returncode == 130 and "error: interrupted" in res.stderr, (res.returncode, res.stderr)
        assert sorted(os.listdir(out)) == [MARKER, "model.safetensors"]
        assert (out / "model.safetensors").read_text() == "new"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_swallowed_by_a_finalizer_still_stops_the_commit(signum: str, tmp_path: Path) -> None:
    """The handler's exception is lost when it fires inside ``__del__`` (seen with ``ZipFile.__del__``
    during a SIGTERM'd reshard): the output must not be committed all the same."""
    import signal as sig

    from ckpttool.format.atomic import AtomicOutputDir

    class KilledInFinalizer:
        def __del__(self) -> None:
            os.kill(os.getpid(), getattr(sig, signum))
            for _ in range(10_000):  # the handler runs here; Python prints "Exception ignored in ..."
                pass

    before = sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with AtomicOutputDir(tmp_path / "out") as d:
            (d / "model.safetensors").write_bytes(b"x")
            KilledInFinalizer()  # collected at once
            (d / "model.safetensors.index.json").write_text("{}")  # the work went on to the end
    assert os.listdir(tmp_path) == []
    assert (sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGINT)) == before


def test_a_second_signal_during_cleanup_still_removes_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C, then SIGTERM while the temporary directory is being removed: exit path is KeyboardInterrupt
    (exit 130 in the CLI), no temporary directory left, the previous handlers back."""
    import shutil
    import signal as sig

    from ckpttool.format import atomic as output
    from ckpttool.format.atomic import AtomicOutputDir

    real_rmtree = shutil.rmtree

    def rmtree_interrupted(path: object, *args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), sig.SIGTERM)  # arrives while the cleanup runs
        for _ in range(10_000):  # an unblocked handler would run here and cut the cleanup short
            pass
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(output.shutil, "rmtree", rmtree_interrupted)
    before = sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with AtomicOutputDir(tmp_path / "out") as d:
            for i in range(50):
                (d / f"f{i}").write_bytes(b"x")
            raise KeyboardInterrupt  # the first Ctrl-C
    assert os.listdir(tmp_path) == []
    assert (sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGINT)) == before


def test_a_signal_while_the_superseded_output_is_removed_does_not_leak_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--overwrite: SIGINT while the previous output (renamed aside) is deleted. The new output is in place,
    the old copy is gone all the same, and the interruption is still reported (exit 130 in the CLI)."""
    import shutil
    import signal as sig

    from ckpttool.format import atomic as output
    from ckpttool.format.atomic import AtomicOutputDir

    out = tmp_path / "out"
    previous_output(out, {"model.safetensors": b"old"})
    real_rmtree = shutil.rmtree

    def rmtree_interrupted(path: object, *args: object, **kwargs: object) -> None:
        if ".ckpttool-old-" in str(path):
            os.kill(os.getpid(), sig.SIGINT)
            for _ in range(10_000):
                pass
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(output.shutil, "rmtree", rmtree_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with AtomicOutputDir(out, overwrite=True) as d:
            (d / "model.safetensors").write_bytes(b"new")
    assert os.listdir(tmp_path) == ["out"]
    assert (out / "model.safetensors").read_bytes() == b"new"


def test_a_second_signal_while_a_failed_commit_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--overwrite: the first SIGINT lands in the commit's re-check of the old output, the second while the
    temporary directory is removed: the removal still completes, the old output is untouched."""
    import shutil
    import signal as sig

    from ckpttool.format import atomic as output
    from ckpttool.format.atomic import AtomicOutputDir

    out = tmp_path / "out"
    previous_output(out, {"model.safetensors": b"old"})
    real_check, real_rmtree = output.check_output_target, shutil.rmtree

    def check_interrupted(*args: object, **kwargs: object) -> None:
        real_check(*args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("overwrite"):
            os.kill(os.getpid(), sig.SIGINT)  # the first Ctrl-C, during the re-check
            for _ in range(10_000):
                pass

    def rmtree_interrupted(path: object, *args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), sig.SIGINT)  # the second one, during the cleanup
        for _ in range(10_000):
            pass
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    with pytest.raises(KeyboardInterrupt):
        with AtomicOutputDir(out, overwrite=True) as d:
            for i in range(50):
                (d / f"f{i}").write_bytes(b"new")
            monkeypatch.setattr(output, "check_output_target", check_interrupted)
            monkeypatch.setattr(output.shutil, "rmtree", rmtree_interrupted)
    assert os.listdir(tmp_path) == ["out"]
    assert sorted(os.listdir(out)) == [MARKER, "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"old"


def test_a_failed_output_leaves_no_parents_it_created(tmp_path: Path) -> None:
    """Writing ``a/b/c/OUT`` creates ``a/b/c``; a failure removes them again, but never a parent that was there."""
    from ckpttool.format.atomic import AtomicOutputDir

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError), AtomicOutputDir(tmp_path / "a" / "b" / "c" / "OUT") as tmp:
        (tmp / "part.bin").write_bytes(b"x")
        raise RuntimeError("export failed half-way")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["keep.txt"]
    with AtomicOutputDir(tmp_path / "x" / "y" / "OUT") as tmp:
        (tmp / "done.bin").write_bytes(b"x")
    assert (tmp_path / "x" / "y" / "OUT" / "done.bin").is_file()


def test_a_small_file_replaced_keeps_its_permission_bits(sample_ckpt: Path, tmp_path: Path) -> None:
    """`stats --plot "$(mktemp --suffix=.png)"` (an empty 0600 file) left the picture 0644 (world-readable); it
    stays 0600, and a new file is created as before (0644 less the umask)."""
    pytest.importorskip("matplotlib")
    private = tmp_path / "private.png"
    private.touch(mode=0o600)
    res = CliRunner().invoke(app, ["stats", str(sample_ckpt), "--plot", str(private)])
    assert res.exit_code == 0, res.output
    assert private.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (private.stat().st_mode & 0o777) == 0o600
    fresh = tmp_path / "fresh.png"
    res = CliRunner().invoke(app, ["stats", str(sample_ckpt), "--plot", str(fresh)])
    assert res.exit_code == 0, res.output
    umask = os.umask(0)
    os.umask(umask)
    assert (fresh.stat().st_mode & 0o777) == 0o644 & ~umask
