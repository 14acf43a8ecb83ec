"""Shell completion of option values (Typer's ``--install-completion``): choices, dtypes, steps, digests.

Choice options (enums) complete through their type; this adds the options whose value is a
free string parsed later: a metavar ``<a|b|c>`` completes to ``a``, ``b``, ``c``; ``--hash``
to the digest algorithms; ``--as-dtype`` to the float dtypes; a step (``--step N|latest``) to ``latest`` and the
step numbers found under the command's checkpoint argument (``step-100``, ``checkpoint-100``, ...).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

__all__ = ["add_completions", "install_completion", "step_values"]

_CHOICES_RE = re.compile(r"^<([^<>|]+(?:\|[^<>|]+)+)>$")
_DTYPES = ("bfloat16", "float16", "float32", "float64")
_HASHES = ("xxh3-128", "blake3", "blake2b-256")


def step_values(root: str | None) -> list[str]:
    """``latest`` and the steps of the checkpoints under ``root`` (a local directory), ascending."""
    if not root:
        return ["latest"]
    from ckpttool.model.discovery import find_checkpoints, step_of

    base = Path(root)
    steps: set[int] = set()
    try:
        found = find_checkpoints(base) if base.is_dir() else []
    except (OSError, ValueError):
        found = []
    for path in found:
        for part in path.relative_to(base).parts:
            n = step_of(part)
            if n is not None:
                steps.add(n)
    return ["latest", *(str(n) for n in sorted(steps))]


def _fixed(values: tuple[str, ...] | list[str]) -> Any:
    def complete(ctx: Any, param: Any, incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]

    return complete


def _steps(ctx: Any, param: Any, incomplete: str) -> list[str]:
    # The checkpoint argument: parsed, or (an option still waiting for its value stops click's parse) the
    # first word that is not an option.
    given = [v for k, v in ctx.params.items() if k in ("checkpoint", "source") and v is not None]
    given += [a for a in ctx.args if not a.startswith("-")]
    return [v for v in step_values(str(given[0]) if given else None) if v.startswith(incomplete)]


def add_completions(cmd: Any) -> None:
    """Give ``cmd``'s free-string options with known values a shell completion (enums have theirs)."""
    for p in cmd.params:
        if p.param_type_name != "option" or getattr(p, "_custom_shell_complete", None) is not None:
            continue
        flags = set(p.opts)
        m = _CHOICES_RE.match(p.metavar or "")
        if m:
            p._custom_shell_complete = _fixed(m.group(1).split("|"))
        elif "--hash" in flags:
            p._custom_shell_complete = _fixed(_HASHES)
        elif flags & {"--as-dtype", "--save-dtype", "--reference-dtype"}:
            p._custom_shell_complete = _fixed(_DTYPES)
        elif "latest" in (p.metavar or ""):  # --step N|latest (and any option of a step)
            p._custom_shell_complete = _steps


#: The lines each shell's startup file needs (Typer's own): ``{script}`` is the installed script's path.
_RC_LINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "bash": (".bashrc", ("source '{script}'",)),
    "zsh": (".zshrc", ("fpath+=~/.zfunc; autoload -Uz compinit; compinit",)),
}
_SCRIPT_PATHS = {
    "bash": ".bash_completions/{prog}.sh",
    "zsh": ".zfunc/_{prog}",
    "fish": ".config/fish/completions/{prog}.fish",
}
_ZSTYLE = "zstyle ':completion:*' menu select"


def install_completion(shell: str, prog: str = "ckpttool") -> Path:
    """Install ``prog``'s completion for ``shell`` (``bash``, ``zsh``, ``fish``; PowerShell through Typer, which
    appends to the profile) in the home directory, as Typer's ``--install-completion`` does, but never rewriting the
    user's startup file: Typer read ``~/.bashrc`` / ``~/.zshrc`` as text and wrote it back (``\\r\\n`` turned into
    ``\\n``, ``.zshrc`` stripped of its leading and trailing blank space, a traceback for bytes not UTF-8). Here the
    lines it lacks are appended to its bytes; the script goes to ckpttool's own file (temp file + rename).

    Returns:
        The path of the installed script.

    Raises:
        NotRegularFileError (E102): the startup file is a FIFO, device, socket or directory (never opened to write).
        UsageError (E100): a file cannot be read or written (permissions, a read-only home).
    """
    from typer._completion_shared import get_completion_script, install

    names = {"prog_name": prog, "complete_var": f"_{prog.replace('-', '_').upper()}_COMPLETE", "shell": shell}
    if shell not in _SCRIPT_PATHS:
        return install(**names)[1]
    home = Path.home()
    script = home / _SCRIPT_PATHS[shell].format(prog=prog)
    try:
        script.parent.mkdir(parents=True, exist_ok=True)
        tmp = script.with_name(f".{script.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(get_completion_script(**names) + ("\n" if shell == "fish" else ""), encoding="utf-8")
            os.replace(tmp, script)
        finally:
            tmp.unlink(missing_ok=True)
        if shell in _RC_LINES:
            rc, lines = _RC_LINES[shell]
            _append_missing(home / rc, [ln.format(script=script) for ln in lines], zstyle=shell == "zsh")
    except OSError as e:
        from ckpttool.errors import UsageError

        where = e.filename or script
        raise UsageError(
            f"{where}: cannot install {shell} completion: {e.strerror or e}",
            path=Path(where),
            hint=f"make the file writable, or add the output of `{prog} --show-completion {shell}` to it yourself",
        ) from None
    return script


def _append_missing(rc: Path, lines: list[str], *, zstyle: bool) -> None:
    """Append to ``rc`` (created if missing) each of ``lines`` its bytes do not hold, and zsh's menu style where it
    sets no ``zstyle`` (as Typer does); its existing bytes are never rewritten."""
    from ckpttool.errors import NotRegularFileError

    fd = os.open(rc, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOCTTY | getattr(os, "O_NONBLOCK", 0), 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(
                f"{rc} is not a regular file: no completion line written to it",
                path=rc,
                hint=f"add the lines of `--show-completion`'s install to the file your shell reads at start: {rc} "
                "is left as it is",
            )
        os.set_blocking(fd, True)
        chunks = []
        while piece := os.read(fd, 1 << 20):
            chunks.append(piece)
        held = b"".join(chunks)
        add = [ln.encode() for ln in lines if ln.encode() not in held]
        if zstyle and b"zstyle" not in held:
            add.append(_ZSTYLE.encode())
        if not add:
            return
        lead = b"\n" if held and not held.endswith(b"\n") else b""
        data = lead + b"".join(b"\n" + ln + b"\n" for ln in add)
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
