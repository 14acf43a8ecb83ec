"""`ckpttool --install-completion [SHELL]` and the user's shell startup files (~/.bashrc, ~/.zshrc).

Typer's installer read the startup file as text and wrote it back: `\\r\\n` became `\\n`, `.zshrc` lost its
leading and trailing blank space, bytes not UTF-8 were a traceback, and a FIFO in its place hung the command.
The user's bytes must stay a prefix of the file: the lines completion needs are appended, once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

USER_RC = b"  \n# mine \xff\xfe (latin-1 bytes)\r\nexport A=1   \r\n\n\n\talias x=y"


def _install(home: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "SHELL": "/bin/bash"}
    return subprocess.run(
        [sys.executable, "-m", "ckpttool", "--install-completion", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("shell", "rc", "line"), [("bash", ".bashrc", b"source '"), ("zsh", ".zshrc", b"fpath+=~/.zfunc")]
)
def test_install_completion_appends_to_the_startup_file_and_keeps_its_bytes(
    tmp_path: Path, shell: str, rc: str, line: bytes
) -> None:
    (tmp_path / rc).write_bytes(USER_RC)
    for _ in range(2):
        res = _install(tmp_path, shell)
        assert res.returncode == 0 and res.stderr == "", res.stderr
    after = (tmp_path / rc).read_bytes()
    assert after.startswith(USER_RC), after[: len(USER_RC) + 20]
    added = after[len(USER_RC) :]
    assert added.startswith(b"\n") and added.count(line) == 1, added  # a line of its own, not added twice
    script = res.stdout.splitlines()[0].rsplit(" ", 1)[1]
    assert "_CKPTTOOL_COMPLETE" in Path(script).read_text()


def test_install_completion_without_a_shell_named_keeps_the_bashrc(tmp_path: Path) -> None:
    (tmp_path / ".bashrc").write_bytes(USER_RC)
    res = _install(tmp_path)
    if res.returncode == 2 and "was not detected" in res.stderr:
        pytest.skip("no shell detected from this process")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / ".bashrc").read_bytes().startswith(USER_RC)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_install_completion_refuses_a_startup_file_that_is_not_a_file(tmp_path: Path, kind: str) -> None:
    rc = tmp_path / ".zshrc"
    if kind == "fifo":
        os.mkfifo(rc)
    elif kind == "dev-zero":
        rc.symlink_to("/dev/zero")
    else:
        rc.mkdir()
    res = _install(tmp_path, "zsh", timeout=60)  # the FIFO must not hang it
    assert res.returncode == 2 and res.stdout == "", res.stdout
    lines = res.stderr.splitlines()
    assert lines[0].startswith(("error: [E102] ", "error: [E100] ")) and str(rc) in lines[0], res.stderr
    assert lines[1].startswith("hint: ") and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv", [["zsh", "-q"], ["zsh", "extra"], ["-q", "--install-completion", "zsh"]])
def test_install_completion_with_other_words_installs_nothing(tmp_path: Path, argv: list[str]) -> None:
    """Typer took `--install-completion zsh -q` (or `zsh extra`) as its flag alone: it installed the running shell's
    completion (bash's, rewriting ~/.bashrc), the shell named dropped. Now E100 and no file is touched."""
    (tmp_path / ".bashrc").write_bytes(USER_RC)
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    full = argv if argv[0] == "-q" else ["--install-completion", *argv]
    res = subprocess.run(
        [sys.executable, "-m", "ckpttool", *full], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.startswith("error: [E100] --install-completion takes a SHELL and nothing else: "), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bashrc"]
    assert (tmp_path / ".bashrc").read_bytes() == USER_RC
