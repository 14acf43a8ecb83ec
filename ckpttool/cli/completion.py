"""Shell completion of option values (Typer's ``--install-completion``): choices, dtypes, steps, digests.

Choice options (enums) complete through their type; this adds the options whose value is a
free string parsed later: a metavar ``<a|b|c>`` completes to ``a``, ``b``, ``c``; ``--hash``
to the digest algorithms; ``--as-dtype`` to the float dtypes; a step (``--step N|latest``) to ``latest`` and the
step numbers found under the command's checkpoint argument (``step-100``, ``checkpoint-100``, ...).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["add_completions", "step_values"]

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
