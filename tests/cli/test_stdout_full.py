"""stdout that cannot be written (``> /dev/full``): one ``E600`` line naming stdout, exit 2, no traceback, never E999."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def _run_to_full(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m ckpttool ARGV > /dev/full``: every write to stdout fails with ENOSPC."""
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "ckpttool", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "CKPTTOOL_DEBUG"},
            timeout=600,
        )


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("--help",),
        ("-V",),
        ("inspect", "--help"),
        ("rules",),
        ("rules", "--json"),
        ("schema",),
        ("schema", "inspect"),
        ("validate", "--list-rules"),
        ("inspect", "{ckpt}"),
        ("inspect", "{ckpt}", "--json"),
        ("diff", "{ckpt}", "{ckpt}"),
    ],
    ids=lambda a: " ".join(a) or "(no arguments)",
)
def test_a_full_stdout_is_one_e600_line_and_exit_2(argv: tuple[str, ...], sample_ckpt: Path) -> None:
    proc = _run_to_full(*(a.format(ckpt=sample_ckpt) for a in argv))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert errors == [
        "error: [E600] stdout: write failed (No space left on device); "
        "the command ran but its output was not printed in full"
    ], proc.stderr
    assert "Traceback" not in proc.stderr and "E999" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert any(ln.startswith("hint: ") and "redirect" in ln for ln in lines)


def test_a_full_stdout_leaves_an_export_whole(sample_ckpt: Path, tmp_path: Path) -> None:
    """The export is written before its summary is printed: the summary's failure does not remove it."""
    out = tmp_path / "hf"
    proc = _run_to_full("export", str(sample_ckpt), str(out), "--model-assets", str(sample_ckpt / "model_assets"))
    assert proc.returncode == 2 and "[E600] stdout: write failed" in proc.stderr, proc.stderr
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
