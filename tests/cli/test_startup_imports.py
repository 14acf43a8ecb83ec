"""Start-up: what a command imports (docs/performance.md, "Start-up").

The root help lists the commands without importing a command module; a command's help imports its own
module but no torch, numpy or ``ckpttool.ops`` module; ``inspect`` of a checkpoint never imports torch.
Each case is a fresh process whose ``sys.modules`` is read at exit.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from ckpttool.cli.app import COMMANDS, SUMMARIES, app

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import atexit, sys\n"
    "listing = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(listing, 'w').write('\\n'.join(sorted(sys.modules))))\n"
    "from ckpttool.cli import main\n"
    "sys.argv[0] = 'ckpttool'\n"
    "main()\n"
)


def modules_after(tmp_path: Path, *argv: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules a fresh ``ckpttool ARGV`` process has imported when it exits, and the process."""
    listing = tmp_path / "modules.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(listing), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    return set(listing.read_text().split()), proc


def heavy(modules: set[str]) -> list[str]:
    tops = ("torch", "numpy", "ckpttool.ops")
    return sorted(m for m in modules if any(m == t or m.startswith(t + ".") for t in tops))


def test_root_help_imports_no_command_module_nor_torch_numpy_ops(tmp_path: Path) -> None:
    modules, proc = modules_after(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Commands:" in proc.stdout and all(f"  {name} " in proc.stdout for name in COMMANDS)
    assert heavy(modules) == []
    assert sorted(m for m in modules if m.startswith("ckpttool.commands.")) == []
    assert not any(m == "rich" or m.startswith("rich.") for m in modules)


def test_a_command_help_imports_only_its_own_module(tmp_path: Path) -> None:
    modules, proc = modules_after(tmp_path, "inspect", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: ckpttool inspect [OPTIONS]")
    assert heavy(modules) == []
    assert sorted(m for m in modules if m.startswith("ckpttool.commands.")) == ["ckpttool.commands.inspect"]


def test_inspect_of_the_sample_imports_no_torch(tmp_path: Path) -> None:
    sample = tmp_path / "sample"
    _, made = modules_after(tmp_path, "sample", str(sample))
    assert made.returncode == 0, made.stderr
    for argv in (("inspect", str(sample)), ("inspect", str(sample), "--json")):
        modules, proc = modules_after(tmp_path, *argv)
        assert proc.returncode == 0, proc.stderr
        assert "model.embed_tokens.weight" in proc.stdout
        assert not any(m == "torch" or m.startswith("torch.") for m in modules), argv


def test_an_export_of_the_sample_imports_no_yaml_numpy_nor_quantizer(tmp_path: Path, sample_ckpt: Path) -> None:
    # the packaged rules are read as JSON (yaml only for --rules); the FP8 quantizer only for --quantize
    modules, proc = modules_after(tmp_path, "export", str(sample_ckpt), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    tops = ("yaml", "numpy", "torch", "rich", "ckpttool.ops.export.quantize")
    assert sorted(m for m in modules if any(m == t or m.startswith(t + ".") for t in tops)) == []


@pytest.mark.parametrize("name", COMMANDS)
def test_the_root_help_summary_is_the_first_line_of_the_command_docstring(name: str) -> None:
    cmd = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    assert SUMMARIES[name] == inspect.cleandoc(cmd.help).splitlines()[0]


def test_the_commands_load_when_looked_up_and_are_listed_in_order() -> None:
    group = typer.main.get_command(app)
    assert list(group.commands) == list(COMMANDS)  # type: ignore[attr-defined]
    assert group.list_commands(typer.Context(group)) == list(COMMANDS)  # type: ignore[attr-defined]
    assert "nope" not in group.commands and group.get_command(typer.Context(group), "nope") is None  # type: ignore[attr-defined]
    assert {c.name for c in app.registered_commands} == set(COMMANDS)


def test_the_program_leaves_as_main_does_without_the_teardown(tmp_path: Path, sample_ckpt: Path) -> None:
    # `ckpttool` / `python -m ckpttool` run cli.entry: main, the atexit handlers, then os._exit (no interpreter
    # teardown); what it prints, its exit status and its atexit handlers are main's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    probe = (
        "import atexit, sys\n"
        "mark = sys.argv.pop(1)\n"
        "atexit.register(lambda: open(mark, 'w').write('ran'))\n"
        "from ckpttool.cli import {}\n"
        "sys.argv[0] = 'ckpttool'\n"
        "{}()\n"
    )
    cases = (["inspect", str(sample_ckpt), "--json"], ["export", "--bogus"])
    for argv in cases:
        got = []
        for name in ("main", "entry"):
            mark = tmp_path / f"atexit-{name}"
            proc = subprocess.run(
                [sys.executable, "-c", probe.format(name, name), str(mark), *argv],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp_path,
                timeout=120,
            )
            got.append((proc.returncode, proc.stdout, proc.stderr, mark.read_text()))
        assert got[0] == got[1], argv
    assert [c[0] for c in got] == [2, 2]


@pytest.mark.parametrize("preset", [None, "20"])
def test_the_cli_shortens_openblas_spinning_and_keeps_a_users_value(preset: str | None) -> None:
    """The program sets ``OPENBLAS_THREAD_TIMEOUT=4`` before numpy loads (OpenBLAS reads it then), unless the
    user set it; importing ``ckpttool.cli`` as a library leaves the environment alone."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    code = (
        "import atexit, os, sys, ckpttool.cli\n"
        "print('numpy' in sys.modules, os.environ.get('OPENBLAS_THREAD_TIMEOUT', '-'))\n"
        "atexit.register(lambda: print(os.environ.get('OPENBLAS_THREAD_TIMEOUT', '-'), flush=True))\n"
        "sys.argv = ['ckpttool', 'manifest', '--help']\n"
        "ckpttool.cli.entry()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["False", preset or "-"]
    assert lines[-1] == (preset or "4")
