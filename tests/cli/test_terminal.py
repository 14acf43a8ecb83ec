"""ckpttool in a real pseudo-terminal: the terminal's width is used, colour only there, NO_COLOR/--color obeyed."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.cli.tables import column, tables
from tests.fixtures import damage
from tests.fixtures.cache import copy_checkpoint

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(argv: list[str], columns: int, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python -m ckpttool ARGV`` with stdin/stdout/stderr on a pty of ``columns`` x 50; its output and exit code."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "TERM")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**base, "TERM": "xterm-256color", **(env or {})},
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError("no output for 120 s")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.parametrize("columns", [60, 100])
def test_tables_fit_the_terminal_width_and_numbers_never_wrap(columns: int, sample_ckpt: Path) -> None:
    rc, out = run_in_pty(["inspect", str(sample_ckpt)], columns)
    assert rc == 0, out
    plain = ANSI.sub("", out)
    lines = plain.splitlines()
    # Every line fits but a label line whose value is one token (the checkpoint's path) wider than the
    # room: that one is printed whole, for the terminal to wrap, never folded mid-token.
    wide = [line for line in lines if len(line) > columns]
    assert all(line.split() == [line.split()[0], str(sample_ckpt)] for line in wide), wide
    assert not [line for line in lines if line != line.rstrip()]
    model = tables(plain)["model tensors"]
    shapes = column(model, "shape")
    assert len(shapes) == 33 and all(re.fullmatch(r"(\d+x)*\d+|scalar", s) for s in shapes), shapes
    assert "8x32x32" in shapes and all(d == "float32" for d in column(model, "dtype"))
    if "numel" in model[0]:
        assert all(re.fullmatch(r"\d{1,3}(,\d{3})*", n) for n in column(model, "numel"))


def test_colour_on_a_terminal_only_and_never_with_no_color(dense_ckpt: Path, tmp_path: Path) -> None:
    ck = copy_checkpoint(dense_ckpt, tmp_path / "ck")
    assert damage.drop_keys(ck, lambda k: k == "optimizer.param_groups.0.eps")  # one error finding (P001)
    rc, out = run_in_pty(["validate", str(ck)], 100)
    assert rc == 1
    assert "\x1b[1;31mFAILED" in out or re.search(r"\x1b\[[0-9;]*1[;m][^\n]*FAILED", out), out
    assert re.search(r"\x1b\[[0-9;]*m\s*P001", out), out  # the finding's code coloured by severity
    for env, argv in (({"NO_COLOR": "1"}, []), ({}, ["--color", "never"]), ({"TERM": "dumb"}, [])):
        rc, out = run_in_pty(["validate", str(ck), *argv], 100, env)
        assert rc == 1 and "\x1b[" not in out and "FAILED: 1 error" in out, (env, argv, out)
    # stderr lines on a terminal: the prefix coloured
    rc, out = run_in_pty(["inspect", str(tmp_path / "missing")], 100)
    assert rc == 2 and "\x1b[1;31merror:\x1b[0m [E100]" in out, out
    rc, out = run_in_pty(["--color", "never", "inspect", str(tmp_path / "missing")], 100)
    assert out.startswith("error: [E100]"), out


def test_color_always_forces_colour_into_a_pipe(dense_ckpt: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    piped = subprocess.run(
        [sys.executable, "-m", "ckpttool", "validate", str(dense_ckpt), "--color", "always"],
        capture_output=True,
        text=True,
        timeout=120,
        env=base,
    )
    assert "\x1b[" in piped.stdout and "OK" in piped.stdout
    plain = subprocess.run(
        [sys.executable, "-m", "ckpttool", "validate", str(dense_ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
        env=base,
    )
    assert "\x1b[" not in plain.stdout and plain.stdout.splitlines()[-1].startswith("OK: 0 errors")
