"""The caps of docs/security.md ("Caps"): defaults, the flags that change them, and what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import SizeLimitError
from ckpttool.format import limits
from ckpttool.format.reader import CheckpointReader

runner = CliRunner()


def test_flags_lower_and_raise_the_caps(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["--max-object-size", "1KiB", "inspect", str(sample_ckpt)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E307] "), res.stderr
    assert "--max-object-size" in res.stderr  # the hint names the flag
    res = runner.invoke(app, ["--max-metadata-size", "4KiB", "inspect", str(sample_ckpt)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E307] ") and ".metadata" in res.stderr
    res = runner.invoke(app, ["inspect", str(sample_ckpt)])  # every invocation starts from the defaults
    assert res.exit_code == 0, res.stderr
    assert limits.current() == limits.Limits()


def test_a_bad_cap_is_a_usage_error(sample_ckpt: Path) -> None:
    res = runner.invoke(app, ["--max-object-size", "lots", "inspect", str(sample_ckpt)])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E100] ") and "--max-object-size" in res.stderr


@pytest.mark.parametrize("flag", ["--max-object-size", "--max-metadata-size"])
def test_a_cap_beyond_floats_range_is_a_usage_error(sample_ckpt: Path, tmp_path: Path, flag: str) -> None:
    """A size of 400 digits (or 2 x 10^308 bytes: float infinity) printed a raw OverflowError traceback for the
    global caps ('cannot convert float infinity to integer') and was E999 for ``export --shard-size``."""
    for size in ("9" * 400, "2" + "0" * 308 + "GiB"):
        res = runner.invoke(app, [flag, size, "inspect", str(sample_ckpt)])
        assert res.exit_code == 2 and res.stderr.startswith("error: [E100] ") and flag in res.stderr, res.output
        assert "Traceback" not in res.output and len(res.stderr.splitlines()) == 2
    res = runner.invoke(app, ["export", str(sample_ckpt), str(tmp_path / "o"), "--shard-size", "9" * 400])
    assert res.exit_code == 2 and res.stderr.startswith("error: [E100] ") and "--shard-size" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()


def test_library_caps_are_scoped(sample_ckpt: Path) -> None:
    with CheckpointReader(sample_ckpt) as r:
        with limits.limits(max_object_bytes=100), pytest.raises(SizeLimitError):
            r.read_object("layout")
        assert isinstance(r.read_object("layout"), str)
    with pytest.raises(ValueError):
        limits.set_limits(max_object_bytes=0)
