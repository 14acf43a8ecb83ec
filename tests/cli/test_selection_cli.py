"""The selection options every command shares: --step, --optimizer-dir, --schema, --model-prefix, --no-ep.

Errors name the command's flags (the library names parameters in backticks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def fail(*args: str) -> tuple[str, str]:
    res = runner.invoke(app, list(args))
    assert res.exit_code == 2 and res.stdout == "", (res.stdout, res.stderr)
    err, hint = res.stderr.strip().splitlines()[-2:]
    assert err.startswith("error: [") and hint.startswith("hint: ") and "Traceback" not in res.stderr
    return err, hint


@pytest.mark.parametrize("cmd", ["inspect", "validate", "replay-step"])
def test_step_value(cmd: str, dense_ckpt: Path) -> None:
    err, _ = fail(cmd, str(dense_ckpt.parent), "--step", "last")
    assert err.startswith("error: [E100]") and "--step 'last' is not a step number or 'latest'" in err


def test_step_on_a_checkpoint_itself(dense_ckpt: Path) -> None:
    err, hint = fail("inspect", str(dense_ckpt), "--step", "3")
    assert "--step 3 given" in err and "drop --step" in hint


@pytest.mark.parametrize("cmd", ["inspect", "validate", "export"])
def test_model_prefix_needs_a_dot(cmd: str, dense_ckpt: Path, tmp_path: Path) -> None:
    extra = [str(tmp_path / "o")] if cmd == "export" else []
    err, hint = fail(cmd, str(dense_ckpt), *extra, "--model-prefix", "model")
    assert "--model-prefix 'model' must end with '.'" in err and "--model-prefix 'model.'" in hint


def test_model_prefix_matching_nothing(dense_ckpt: Path) -> None:
    err, _ = fail("inspect", str(dense_ckpt), "--model-prefix", "nope.")
    assert err.startswith("error: [E250] model prefix 'nope.' matches no tensor")


def test_no_ep_excludes_sizes(dense_ckpt: Path) -> None:
    err, _ = fail("inspect", str(dense_ckpt), "--no-ep", "--ep-size", "2")
    assert "--no-ep excludes --source-layout/--ep-size/--ep-fsdp-size" in err


def test_schema_override_is_shown(dense_ckpt: Path) -> None:
    res = runner.invoke(app, ["inspect", str(dense_ckpt), "--schema", "torch-native"])
    assert res.exit_code == 0 and "key schema  torch-native (override)" in res.stdout


def test_parent_without_checkpoints_says_what_it_searched(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    err, _ = fail("inspect", str(tmp_path))
    assert err.startswith("error: [E200]") and "no DCP checkpoint in the 3 directory levels below it" in err


@pytest.mark.parametrize("cmd", ["inspect", "validate", "replay-step"])
def test_optimizer_dir_that_is_not_a_checkpoint(cmd: str, dense_ckpt: Path, tmp_path: Path) -> None:
    err, hint = fail(cmd, str(dense_ckpt), "--optimizer-dir", str(tmp_path))
    assert err.startswith(f"error: [E100] --optimizer-dir {tmp_path}: not a DCP checkpoint directory"), err


@pytest.mark.parametrize("cmd", ["inspect", "validate", "replay-step"])
def test_optimizer_dir_that_does_not_exist(cmd: str, dense_ckpt: Path, tmp_path: Path) -> None:
    """A mistyped --optimizer-dir was reported as ``not a DCP checkpoint directory (no .metadata)``, which
    reads as if the folder were there: it says the path does not exist and offers the folder beside it with
    a close name."""
    (tmp_path / "optimizer_0").mkdir()
    err, hint = fail(cmd, str(dense_ckpt), "--optimizer-dir", str(tmp_path / "optimzer_0"))
    assert err == f"error: [E100] --optimizer-dir {tmp_path / 'optimzer_0'}: no such directory", err
    assert hint == f"hint: did you mean {tmp_path / 'optimizer_0'}?", hint


@pytest.mark.parametrize("cmd", ["inspect", "export", "replay-step"])
def test_a_single_value_option_given_twice_is_refused(cmd: str, dense_ckpt: Path, tmp_path: Path) -> None:
    """click keeps the last value of an option given twice: `--filter A --filter B` would run on B alone, silently."""
    out = tmp_path / "o"
    extra = [str(out)] if cmd == "export" else []
    err, hint = fail(cmd, str(dense_ckpt), *extra, "--filter", "*norm*", "--filter=*embed*")
    assert err == "error: [E100] Invalid value for '--filter': given 2 times ('*norm*', '*embed*'); it takes one value"
    assert hint == f"hint: see `ckpttool {cmd} --help`"
    assert not out.exists()


def test_a_value_that_spells_an_option_and_repeatable_options_are_not_counted(dense_ckpt: Path) -> None:
    # --select is repeatable; --color is a display setting (the last wins, as a shell alias expects); a value equal
    # to an option's name is a value
    res = runner.invoke(app, ["validate", str(dense_ckpt), "--select", "S", "--select", "O", "--color", "always"])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, ["inspect", str(dense_ckpt), "--color", "never", "--color", "always", "--filter", "*"])
    assert res.exit_code == 0, res.stderr
    err, _ = fail("inspect", str(dense_ckpt), "--filter", "--filter")
    assert "matches no key" in err, err
