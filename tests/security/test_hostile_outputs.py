"""Outputs under failure (issue 8, item 4): interrupted or failing writes leave nothing that looks complete.

For :class:`ckpttool.format.atomic.AtomicOutputDir` itself and for the commands that
write directories (``export``, ``reshard``), each in a real subprocess:

- SIGTERM / SIGINT part-way (the process is frozen with SIGSTOP while its
  temporary directory exists, so the signal provably lands mid-way): exit 130,
  no OUT, no temporary directory; an existing OUT (``--overwrite``) is intact;
- SIGKILL: the temporary directory stays (nothing can run), OUT does not exist,
  and the next run targeting the same OUT removes it;
- a write error (``RLIMIT_FSIZE``): exit 2 with ``[E600]``, no OUT, no temporary
  directory, an existing OUT intact;
- a read-only target (a read-only bind mount in a private mount namespace when
  running as root, where permission bits do not bind; ``chmod 555`` otherwise):
  exit 2 with ``[E600]``, nothing created;
- an existing non-empty OUT is refused without ``--overwrite`` and replaced only
  once the new output is complete.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TMP_PREFIX = ".{name}.ckpttool-tmp-"
MARKER = ".ckpttool-output.json"  # ckpttool's own marker, written first into every temporary directory

# A library-level writer: AtomicOutputDir around a few files, then waits (mode "wait") or overflows
# RLIMIT_FSIZE (mode "fsize"); errors rendered like the CLI does.
WRITER = r"""
import sys, time
from ckpttool.errors import CkptError
from ckpttool.format.atomic import AtomicOutputDir
mode, target, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    with AtomicOutputDir(target, overwrite=overwrite) as tmp:
        (tmp / "part-1.bin").write_bytes(b"x" * 4096)
        if mode == "fsize":
            with open(tmp / "big.bin", "wb") as f:
                f.write(b"y" * (8 << 20))
        if mode == "wait":
            print("READY", flush=True)
            time.sleep(120)
except CkptError as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(e.exit_code)
except KeyboardInterrupt:
    sys.stderr.write("error: interrupted\n")
    sys.exit(130)
"""


# --------------------------------------------------------------------------- helpers
def tmp_siblings(out: Path) -> list[str]:
    prefix = TMP_PREFIX.format(name=out.name)
    return sorted(n for n in os.listdir(out.parent) if n.startswith(prefix) or ".ckpttool-old-" in n)


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def existing_out(out: Path) -> dict[str, str]:
    """Make ``out`` an existing, non-empty output directory of ckpttool (it carries the marker, so
    --overwrite may replace it); return its digest."""
    from ckpttool.format.atomic import AtomicOutputDir

    with AtomicOutputDir(out) as tmp:
        (tmp / "OLD_OUTPUT.txt").write_text("the previous, complete output\n")
        (tmp / "model.safetensors").write_bytes(b"old weights")
    return tree_digest(out)


def fsize_limit(limit: int):  # type: ignore[no-untyped-def]
    def _set() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return _set


def run_writer(mode: str, out: Path, overwrite: bool = False, **kw) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, mode, str(out), "1" if overwrite else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        **kw,
    )


def signal_midway(
    argv: list[str], out: Path, sig: int, with_old: bool, attempts: int = 3
) -> tuple[subprocess.CompletedProcess[str], dict[str, str] | None]:
    """Run ``argv`` (``with_old``: over an existing output made first, whose digest is returned); once its
    temporary output directory holds a file, freeze it, check that the output is still unfinished, deliver
    ``sig`` and let it continue. Retries, on a new OUT, when the run finished first (a busy machine)."""
    prefix = TMP_PREFIX.format(name=out.name)
    for _ in range(attempts):
        if out.exists():
            shutil.rmtree(out)  # what the attempt before wrote, having finished before it could be interrupted
        for t in tmp_siblings(out):  # and what it left, signalled as it ended (not the attempt checked)
            shutil.rmtree(out.parent / t)
        old = existing_out(out) if with_old else None  # an existing output, again: the run replaced it
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        caught = False
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:  # the temporary directory only: the previous output renamed aside is the final swap, not mid-way
                busy = [
                    t
                    for t in os.listdir(out.parent)
                    if t.startswith(prefix) and any(e.name != MARKER for e in os.scandir(out.parent / t))
                ]
            except FileNotFoundError:  # renamed while we looked
                busy = []
            if busy:
                proc.send_signal(signal.SIGSTOP)
                caught = (out.parent / busy[0]).is_dir()  # frozen before its final rename: mid-way
                proc.send_signal(sig)
                proc.send_signal(signal.SIGCONT)
                break
            time.sleep(0.0005)
        stdout, stderr = proc.communicate(timeout=120)
        if caught:
            return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), old
    pytest.fail(f"could not interrupt {argv[:2]} mid-way in {attempts} attempts")


def assert_interrupted(res: subprocess.CompletedProcess[str], out: Path, old: dict[str, str] | None) -> None:
    assert res.returncode == 130, (res.returncode, res.stderr[-2000:])
    assert "error: interrupted" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert tmp_siblings(out) == [], "the temporary directory was left behind"
    if old is None:
        assert not out.exists(), "an interrupted run left an output directory"
    else:
        assert tree_digest(out) == old, "the existing output was touched by an interrupted run"


def assert_write_failed(res: subprocess.CompletedProcess[str], out: Path, old: dict[str, str] | None) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert lines and lines[0].startswith("error: [E600]"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert ".ckpttool-tmp-" not in res.stderr, "the message names the internal temporary directory"
    assert tmp_siblings(out) == []
    if old is None:
        assert not out.exists()
    else:
        assert tree_digest(out) == old


def readonly_runner(d: Path) -> list[str] | None:
    """Command prefix that runs a command with ``d`` read-only (and restores ``d`` after), or None."""
    if os.geteuid() != 0:
        d.chmod(0o555)
        return []
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    script = f'mount --bind "{d}" "{d}" && mount -o remount,bind,ro "{d}" && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]


# --------------------------------------------------------------------------- AtomicOutputDir
@pytest.mark.parametrize("with_old", [False, True], ids=["new-out", "overwrite-existing"])
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"]
)  # SIGHUP (the terminal closed) killed the run and left the temporary directory
def test_atomic_dir_interrupted(sig: int, with_old: bool, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = existing_out(out) if with_old else None
    # the writer as a terminal starts it: a test run under nohup (SIGHUP ignored, inherited) would leave it alone
    proc = run_writer("wait", out, overwrite=with_old, preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY", proc.stderr.read()  # type: ignore[union-attr]
    assert len(tmp_siblings(out)) == 1  # mid-way: the temporary directory exists
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert_interrupted(subprocess.CompletedProcess([], proc.returncode, stdout, stderr), out, old)


def test_atomic_dir_sigkill_leftover_removed_by_next_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_writer("wait", out)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    proc.kill()
    proc.communicate(timeout=60)
    left = tmp_siblings(out)
    assert len(left) == 1 and not out.exists()  # nothing that looks complete
    ok = run_writer("done", out)
    _, err = ok.communicate(timeout=60)
    assert ok.returncode == 0, err
    assert tmp_siblings(out) == [] and (out / "part-1.bin").is_file()


@pytest.mark.parametrize("with_old", [False, True], ids=["new-out", "overwrite-existing"])
def test_atomic_dir_write_error(with_old: bool, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = existing_out(out) if with_old else None
    proc = run_writer("fsize", out, overwrite=with_old, preexec_fn=fsize_limit(1 << 20))
    stdout, stderr = proc.communicate(timeout=60)
    assert_write_failed(subprocess.CompletedProcess([], proc.returncode, stdout, stderr), out, old)


def test_atomic_dir_read_only_target(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    prefix = readonly_runner(parent)
    if prefix is None:
        pytest.skip("running as root without mount namespaces: no way to make a directory read-only")
    out = parent / "out"
    try:
        res = subprocess.run(
            [*prefix, sys.executable, "-c", WRITER, "done", str(out), "0"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=60,
        )
    finally:
        parent.chmod(0o755)
    assert_write_failed(res, out, None)
    assert list(parent.iterdir()) == []


def test_atomic_dir_existing_out_needs_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = existing_out(out)
    proc = run_writer("done", out)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.startswith("error: [E600]"), err
    assert tree_digest(out) == old and tmp_siblings(out) == []
    proc = run_writer("done", out, overwrite=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(tree_digest(out)) == [MARKER, "part-1.bin"] and tmp_siblings(out) == []


# --------------------------------------------------------------------------- export / reshard
def dcp_saved(path: Path, count: int, side: int, *, expert: bool = False) -> Path:
    """``path``: a real dcp.save (in a subprocess) of ``count`` float32 ``[side, side]`` weights under ``model``, and
    one small expert tensor with ``expert`` (reshard refuses a dense model)."""
    code = (
        "import sys, warnings, torch, torch.distributed.checkpoint as dcp\n"
        "warnings.simplefilter('ignore')\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"sd = {{'model': {{f'model.layers.{{i}}.mlp.down_proj.weight': torch.randn({side}, {side}, generator=g)"
        f" for i in range({count})}}}}\n"
        + (
            "sd['model']['model.layers.0.mlp.experts.down_proj'] = torch.randn(4, 8, 8, generator=g)\n"
            if expert
            else ""
        )
        + "dcp.save(sd, checkpoint_id=sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 x 64 MiB float32 tensors and one small expert tensor: long enough to interrupt an export/reshard mid-way."""
    return dcp_saved(tmp_path_factory.mktemp("big") / "ckpt", 4, 4096, expert=True)


def command(name: str, src: Path, out: Path, *extra: str) -> list[str]:
    exe = shutil.which("ckpttool") or "ckpttool"
    if name == "export":
        return [exe, "export", str(src), str(out), "--shard-size", "32MiB", *extra]
    return [
        exe,
        "reshard",
        str(src),
        str(out),
        "--to",
        "canonical",
        "--source-layout",
        "canonical",
        "--ep-size",
        "1",
        "--ep-fsdp-size",
        "1",
        *extra,
    ]


def _have(name: str) -> None:
    from ckpttool.cli.app import app

    if name not in {c.name for c in app.registered_commands}:
        pytest.skip(f"`ckpttool {name}` is not registered yet")


@pytest.mark.parametrize("with_old", [False, True], ids=["new-out", "overwrite-existing"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("name", ["export", "reshard"])
def test_command_interrupted(name: str, sig: int, with_old: bool, big_ckpt: Path, tmp_path: Path) -> None:
    _have(name)
    src = tree_digest(big_ckpt)
    out = tmp_path / "out"
    res, old = signal_midway(command(name, big_ckpt, out, *(["--overwrite"] if with_old else [])), out, sig, with_old)
    assert_interrupted(res, out, old)
    assert tree_digest(big_ckpt) == src


@pytest.mark.parametrize("with_old", [False, True], ids=["new-out", "overwrite-existing"])
@pytest.mark.parametrize("name", ["export", "reshard"])
def test_command_write_error(name: str, with_old: bool, big_ckpt: Path, tmp_path: Path) -> None:
    _have(name)
    out = tmp_path / "out"
    old = existing_out(out) if with_old else None
    res = subprocess.run(
        command(name, big_ckpt, out, *(["--overwrite"] if with_old else [])),
        capture_output=True,
        text=True,
        preexec_fn=fsize_limit(8 << 20),
        timeout=300,
    )
    assert_write_failed(res, out, old)


@pytest.mark.parametrize("name", ["export", "reshard"])
def test_command_read_only_target(name: str, big_ckpt: Path, tmp_path: Path) -> None:
    _have(name)
    parent = tmp_path / "ro"
    parent.mkdir()
    prefix = readonly_runner(parent)
    if prefix is None:
        pytest.skip("running as root without mount namespaces: no way to make a directory read-only")
    out = parent / "out"
    try:
        res = subprocess.run([*prefix, *command(name, big_ckpt, out)], capture_output=True, text=True, timeout=300)
    finally:
        parent.chmod(0o755)
    assert_write_failed(res, out, None)
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("name", ["export", "reshard"])
def test_command_existing_out_replaced_only_with_overwrite(name: str, big_ckpt: Path, tmp_path: Path) -> None:
    _have(name)
    out = tmp_path / "out"
    old = existing_out(out)
    res = subprocess.run(command(name, big_ckpt, out), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.startswith("error: [E600]"), res.stderr[-2000:]
    assert tree_digest(out) == old and tmp_siblings(out) == []
    res = subprocess.run(command(name, big_ckpt, out, "--overwrite"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (out / "OLD_OUTPUT.txt").exists() and tmp_siblings(out) == []
    assert any(p.suffix in (".safetensors", ".distcp") for p in out.iterdir())


# SIGTERM arriving as export/reshard hands a copy to a worker thread: ckpttool's own handler is called at the entry
# of the main thread's nth ThreadPoolExecutor.submit, where the interpreter runs a signal's handler.
SIGNAL_AT_SUBMIT = r"""
import signal, sys, threading
import concurrent.futures.thread as cft
from ckpttool.cli import entry

nth, seen = int(sys.argv[1]), 0

def trace(frame, event, arg):
    global seen
    if event == "call" and frame.f_code is cft.ThreadPoolExecutor.submit.__code__:
        handler = signal.getsignal(signal.SIGTERM)
        if getattr(handler, "__module__", "") == "ckpttool.format.atomic":  # the output is open
            seen += 1
            if seen == nth:
                sys.settrace(None)
                handler(signal.SIGTERM, frame)
    return None

sys.argv = ["ckpttool", *sys.argv[2:]]
sys.settrace(trace)
entry()
"""


@pytest.mark.parametrize(("name", "nth"), [("export", 1), ("export", 2), ("reshard", 1)])  # reshard: one file, one
def test_command_terminated_as_a_copy_is_handed_to_a_thread(
    name: str, nth: int, big_ckpt: Path, tmp_path: Path
) -> None:
    _have(name)
    out = tmp_path / "out"
    argv = [sys.executable, "-c", SIGNAL_AT_SUBMIT, str(nth), *command(name, big_ckpt, out)[1:]]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=180)  # hung before: waited for the copy
    assert_interrupted(res, out, None)


# A signal arriving in the main thread at the entry (or the return) of the nth call of a chosen function: the handler
# in force then (ckpttool's own once an output is open; for SIGINT before that, Python's, which raises
# KeyboardInterrupt) is called there, as the interpreter would call it between two bytecodes.
SIGNAL_AT_CALL = r"""
import signal, sys, threading
from ckpttool.cli import entry

qualname, when, signame, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
signum, seen = getattr(signal, signame), 0

def land(frame, event, arg):
    global seen
    if event == when and callable(handler := signal.getsignal(signum)):
        seen += 1
        if seen == nth:
            sys.settrace(None)
            frame.f_trace = None
            handler(signum, frame)
    return land if event == "call" else None

def trace(frame, event, arg):
    if frame.f_code.co_qualname == qualname and threading.current_thread() is threading.main_thread():
        return land(frame, event, arg)
    return None

sys.argv = ["ckpttool", *sys.argv[5:]]
sys.settrace(trace)
entry()
"""


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight 1 MiB float32 tensors: exported as several shards in about a second."""
    return dcp_saved(tmp_path_factory.mktemp("small") / "ckpt", 8, 512)


def signal_at_call(
    qualname: str, sig: str, argv: list[str], *, when: str = "call", nth: int = 1, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``ckpttool ARGV`` with ``sig`` arriving at the entry (``when="return"``: the return) of the ``nth`` call
    of ``qualname`` (see above)."""
    cmd = [sys.executable, "-c", SIGNAL_AT_CALL, qualname, when, sig, str(nth), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)  # timeout: a hang guard


def test_overwrite_terminated_as_the_previous_output_is_removed(small_ckpt: Path, tmp_path: Path) -> None:
    """SIGTERM right after the new output took the old one's place: the old copy, renamed aside, was left behind
    for good as `.out.ckpttool-old-*` (no later run removes it); it is removed before the signal is answered, whose
    line says the new output is in place and complete."""
    out = tmp_path / "out"
    existing_out(out)
    argv = ["export", str(small_ckpt), str(out), "--shard-size", "1MiB", "--overwrite"]
    res = signal_at_call("AtomicOutputDir._remove_superseded", "SIGTERM", argv)
    want = f"error: interrupted after {out} was written: it is complete\n"
    assert res.returncode == 130 and res.stderr == want, res.stderr[-2000:]
    assert tmp_siblings(out) == [] and sorted(os.listdir(tmp_path)) == ["out"]
    names = os.listdir(out)  # the new output, complete (the signal came after the swap)
    assert "OLD_OUTPUT.txt" not in names and "model.safetensors.index.json" in names and MARKER in names


def test_interrupted_while_the_output_is_prepared_leaves_no_parent(small_ckpt: Path, tmp_path: Path) -> None:
    """Ctrl-C while export looks for stale temporary outputs beside OUT (after making OUT's missing parents):
    the parents it made were left."""
    out = tmp_path / "a" / "b" / "out"
    res = signal_at_call("AtomicOutputDir._clean_stale", "SIGINT", ["export", str(small_ckpt), str(out)])
    assert res.returncode == 130 and res.stderr == "error: interrupted\n", res.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_remote_export_interrupted_as_its_staging_directory_is_made(
    small_ckpt: Path, s3_server: object, tmp_path: Path
) -> None:
    """Ctrl-C as export to a URL has made its local staging directory (as mkdtemp returns): the directory was left
    in $TMPDIR (the output's cleanup was not armed yet)."""
    from tests.fixtures.s3 import S3Server

    assert isinstance(s3_server, S3Server)
    s3_server.bucket("interrupts")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {**os.environ, **s3_server.env(), "TMPDIR": str(tmpdir)}
    argv = ["export", str(small_ckpt), "s3://interrupts/run/out", *s3_server.cli_options()]
    res = signal_at_call("mkdtemp", "SIGINT", argv, when="return", env=env)
    assert res.returncode == 130 and res.stderr == "error: interrupted\n", res.stderr[-2000:]
    assert os.listdir(tmpdir) == [] and s3_server.keys("interrupts") == []


def test_remote_export_interrupted_while_publishing_a_new_output(
    small_ckpt: Path, s3_server: object, tmp_path: Path
) -> None:
    """Ctrl-C after the data objects were copied to a new output prefix, before its markers: they were left there,
    and the next run was refused (E600 'pass --overwrite', then E606: no marker). The prefix is left empty."""
    from tests.fixtures.s3 import S3Server

    assert isinstance(s3_server, S3Server)
    s3_server.bucket("interrupts")
    env = {**os.environ, **s3_server.env()}
    argv = ["export", str(small_ckpt), "s3://interrupts/publish/out", "--shard-size", "1MiB", *s3_server.cli_options()]
    # RemoteOutputDir's third transfer step: the markers' copies (after the uploads, then the data objects' copies)
    res = signal_at_call("RemoteOutputDir._pool", "SIGINT", argv, nth=3, env=env)
    assert res.returncode == 130 and res.stderr == "error: interrupted\n", res.stderr[-2000:]
    assert s3_server.keys("interrupts", "publish/") == []
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", *argv], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "publish/out/model.safetensors.index.json" in s3_server.keys("interrupts", "publish/")
