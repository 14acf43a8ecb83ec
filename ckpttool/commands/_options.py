"""Shared CLI options (one help string per concept) and the error boundary of every command.

Every command function is wrapped by :func:`command_boundary`: a
:class:`~ckpttool.errors.CkptError` becomes ``error: [CODE] message`` and
``hint: ...`` on stderr and the error's exit code (2 unusable input, 1 findings);
Ctrl-C exits 130; anything else is an internal error (code E999, exit 2) printed
as one line unless ``CKPTTOOL_DEBUG=1`` is set. No traceback reaches the user.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, TypeVar

import typer

from ..errors import CkptError

__all__ = [
    "CheckpointArg",
    "JsonOpt",
    "FilterOpt",
    "TrustPickleOpt",
    "OverwriteOpt",
    "SourceLayoutOpt",
    "EpSizeOpt",
    "EpFsdpSizeOpt",
    "SourceLayout",
    "command_boundary",
    "emit_json",
    "print_error",
]

log = logging.getLogger(__name__)


class SourceLayout(str, Enum):
    """EP layout of the source checkpoint (DESIGN.md section 3)."""

    legacy = "legacy"
    canonical = "canonical"


CheckpointArg = Annotated[
    Path, typer.Argument(help="DCP checkpoint directory (holds .metadata and __R_N.distcp files).", show_default=False)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write machine-readable JSON to stdout (schema in docs/).")]
FilterOpt = Annotated[
    str | None, typer.Option("--filter", help="Only keys matching this glob (with or without the 'model.' prefix).")
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        help="Allow torch.load(weights_only=False) for byte items/extra_state that need it. Runs code from the checkpoint: only for checkpoints you trust.",
    ),
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing non-empty output directory once the new output is complete.")
]
SourceLayoutOpt = Annotated[
    SourceLayout | None,
    typer.Option("--source-layout", help="Declare the EP layout of an unversioned checkpoint: legacy (FSDP-outer/EP-inner) or canonical."),
]
EpSizeOpt = Annotated[int | None, typer.Option("--ep-size", min=1, help="EP size P of the saving mesh (with --source-layout).")]
EpFsdpSizeOpt = Annotated[
    int | None, typer.Option("--ep-fsdp-size", min=1, help="EP-FSDP size F of the saving mesh (with --source-layout).")
]

F = TypeVar("F", bound=Callable[..., Any])


def print_error(err: CkptError) -> None:
    """Render a :class:`CkptError` as ``error:``/``hint:`` lines on stderr."""
    sys.stderr.write(f"error: {err}\n")
    if err.hint:
        sys.stderr.write(f"hint: {err.hint}\n")
    sys.stderr.flush()


def command_boundary(func: F) -> F:
    """Wrap a command: map errors to one-line messages and documented exit codes."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except CkptError as e:
            print_error(e)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            sys.stderr.write("error: interrupted\n")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # The reader of stdout went away (`| head -1`): stop quietly with 0. Point stdout at
            # /dev/null so the interpreter's final flush does not fail again.
            _silence_stdout()
            raise typer.Exit(0) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
            if os.environ.get("CKPTTOOL_DEBUG"):
                raise
            msg = " ".join(str(e).split())[:200]
            sys.stderr.write(f"error: [E999] internal error: {type(e).__name__}: {msg}\n")
            sys.stderr.write("hint: rerun with CKPTTOOL_DEBUG=1 for a traceback and report it\n")
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real fd (e.g. a test runner's buffer)
        pass


def emit_json(obj: Any) -> None:
    """Write ``obj`` as JSON to stdout (the only thing on stdout with ``--json``)."""
    # Compact: the C encoder (indent= falls back to the pure-Python one, ~10x slower on large outputs).
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str, allow_nan=False) + "\n")
    sys.stdout.flush()
