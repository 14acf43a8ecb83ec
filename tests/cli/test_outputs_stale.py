"""Cleanup deletes only ckpttool's own temporaries (docs/security.md, "Ownership of outputs").

A run removes a ``.<OUT>.ckpttool-tmp-<pid>-<token>`` sibling only when the marker inside proves it
was created by a ckpttool run that is gone (same token and pid as its name, this host, the process
dead) and it is not the source being read; anything else of that name is reported and kept. Real
processes, killed with SIGKILL, leave the temporaries; the attack of issue 31 (a checkpoint copied
under a temporary's name, then used as the source) keeps the source intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
MARKER = ".ckpttool-output.json"
KEPT = "looks like a temporary output of ckpttool but is left in place"

# A run of ckpttool's output writer that copies CONTENT (a directory, or nothing) into its temporary
# directory, says READY and waits to be killed.
WRITER = r"""
import shutil, sys, time
from pathlib import Path
from ckpttool.format.atomic import AtomicOutputDir
target, content = sys.argv[1], sys.argv[2]
with AtomicOutputDir(target, kind="export") as tmp:
    if content:
        for p in Path(content).iterdir():
            if p.name != ".ckpttool-output.json":
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp / p.name)
    else:
        (tmp / "part.safetensors").write_bytes(b"x" * 4096)
    print("READY", flush=True)
    time.sleep(300)
"""


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def temps(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".ckpttool-tmp-" in n)


def start_writer(out: Path, content: Path | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out), str(content or "")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY", proc.stderr.read()  # type: ignore[union-attr]
    return proc


def killed_run_temp(out: Path, content: Path | None = None) -> Path:
    """The temporary directory a SIGKILLed ckpttool run left beside ``out``."""
    proc = start_writer(out, content)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    (name,) = temps(out.parent)
    return out.parent / name


def cli(*args: object):  # type: ignore[no-untyped-def]
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def hf_export(sample_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    assert cli("export", sample_ckpt, out).exit_code == 0
    return out


# ------------------------------------------------------------------------------ the attack of issue 31
@pytest.mark.parametrize("name", ["export", "import"])
def test_a_source_named_like_a_temporary_is_never_removed(
    name: str, sample_ckpt: Path, dense_ckpt: Path, hf_export: Path, tmp_path: Path
) -> None:
    """`cp -r S d/.out.ckpttool-tmp-999999-deadbeef; ckpttool export d/.out.ckpttool-tmp-999999-deadbeef d/out`."""
    d = tmp_path / "d"
    d.mkdir()
    src = d / ".out.ckpttool-tmp-999999-deadbeef"
    shutil.copytree(dense_ckpt if name == "export" else hf_export, src)
    before = snapshot(src)
    res = cli(name, src, d / "out")
    assert res.exit_code == 0, res.stderr
    assert snapshot(src) == before  # the source is intact
    assert f"warning: [atomic] {src} {KEPT}" in res.stderr
    assert temps(d) == [src.name] and (d / "out" / MARKER).is_file()


def test_a_copied_output_under_a_temporary_name_is_kept(sample_ckpt: Path, tmp_path: Path) -> None:
    """A complete output of ckpttool (its marker names another token) renamed like a temporary of a dead pid,
    targeted by another run: not the source, but its marker does not prove it is that dead run's: kept."""
    copy = tmp_path / ".out.ckpttool-tmp-999999-deadbeef"
    shutil.copytree(sample_ckpt, copy)
    before = snapshot(copy)
    res = cli("export", sample_ckpt, tmp_path / "out")
    assert res.exit_code == 0, res.stderr
    assert snapshot(copy) == before
    assert f"{KEPT}: its {MARKER} names another run than its name (a copy?)" in res.stderr


# ------------------------------------------------------------------------------ real temporaries
def test_a_killed_runs_temporary_is_removed(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    tmp = killed_run_temp(out)
    doc = json.loads((tmp / MARKER).read_text())
    assert doc["state"] == "writing" and tmp.name.endswith(f"-{doc['pid']}-{doc['token']}")
    res = cli("export", sample_ckpt, out)
    assert res.exit_code == 0, res.stderr
    assert temps(tmp_path) == [] and "warning" not in res.stderr
    assert (out / "model.safetensors").is_file()


def test_a_killed_runs_temporary_used_as_the_source_is_kept(sample_ckpt: Path, tmp_path: Path) -> None:
    """A user salvages the temporary a killed run left (a complete checkpoint inside) by exporting from it."""
    out = tmp_path / "out"
    tmp = killed_run_temp(out, content=sample_ckpt)
    before = snapshot(tmp)
    res = cli("export", tmp, out)
    assert res.exit_code == 0, res.stderr
    assert snapshot(tmp) == before
    assert f"{KEPT}: it is the source checkpoint being read" in res.stderr


def test_a_live_runs_temporary_is_left_alone(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start_writer(out)
    try:
        (live,) = temps(tmp_path)
        res = cli("export", sample_ckpt, tmp_path / "out")
        assert res.exit_code == 0, res.stderr
        assert temps(tmp_path) == [live] and "warning" not in res.stderr  # still being written: not stale
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.mark.parametrize("how", ["no-marker", "other-host", "finished", "symlink", "file"])
def test_unproven_temporaries_are_reported_and_kept(how: str, sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    if how == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir()
        (target / "keep.bin").write_bytes(b"k")
        entry = tmp_path / ".out.ckpttool-tmp-999999-0a0b"
        entry.symlink_to(target)
        why = "it is not a directory ckpttool created"
    elif how == "file":
        entry = tmp_path / ".out.ckpttool-tmp-999999-0a0b"
        entry.write_bytes(b"keep")
        why = "it is not a directory ckpttool created"
    else:
        entry = killed_run_temp(out)
        if how == "no-marker":  # as left by a version of ckpttool without markers
            (entry / MARKER).unlink()
            why = f"it holds no {MARKER} proving ckpttool created it"
        elif how == "finished":  # a complete output renamed to its own run's temporary name
            doc = json.loads((entry / MARKER).read_text())
            doc["state"] = "complete"
            (entry / MARKER).write_text(json.dumps(doc))
            why = f"its {MARKER} says it is a finished output (renamed?), not one being written"
        else:  # on a shared file system, from another node
            doc = json.loads((entry / MARKER).read_text())
            doc["host"] = "node-17"
            (entry / MARKER).write_text(json.dumps(doc))
            why = "it was created on host 'node-17', whose processes cannot be checked here"
    before = sorted(os.listdir(tmp_path))
    res = cli("export", sample_ckpt, out)
    assert res.exit_code == 0, res.stderr
    assert f"warning: [atomic] {entry} {KEPT}: {why}" in res.stderr
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "out"])
    if how == "symlink":
        assert (tmp_path / "elsewhere" / "keep.bin").read_bytes() == b"k"


def test_a_temporary_whose_pid_was_reused_is_removed(sample_ckpt: Path, tmp_path: Path) -> None:
    """The run's pid now belongs to another process (this one, with another start time): the run is gone."""
    from dataclasses import replace

    from ckpttool.format import marker

    run = marker.new_run()
    assert run.pid_start is not None
    dead = replace(run, pid_start=run.pid_start - 1)  # the same pid, started earlier: another process
    tmp = tmp_path / marker.temp_name("out", dead)
    tmp.mkdir()
    marker.write_writing_marker(tmp, dead)
    (tmp / "part.safetensors").write_bytes(b"x")
    res = cli("export", sample_ckpt, tmp_path / "out")
    assert res.exit_code == 0, res.stderr
    assert temps(tmp_path) == [] and "warning" not in res.stderr


def test_a_live_runs_temporary_without_its_marker_yet_is_kept_without_a_warning(tmp_path: Path) -> None:
    """Between ``mkdir`` and the marker's write a concurrent run's temporary has no marker: its pid is alive,
    so it is left alone without a warning (a dead pid's unmarked temporary is still reported, above)."""
    from ckpttool.format.marker import stale_verdict

    entry = tmp_path / f".out.ckpttool-tmp-{os.getpid()}-0a0b"
    entry.mkdir()
    assert stale_verdict(entry, "out", source=None) == (False, "")
    dead = tmp_path / ".out.ckpttool-tmp-999999-0a0b"
    dead.mkdir()
    assert stale_verdict(dead, "out", source=None) == (False, f"it holds no {MARKER} proving ckpttool created it")
