"""The CLI's one output sink: results as JSON or human text on stdout, messages on stderr.

Every command hands its result to an :class:`Output`: with ``--json`` the result's
``to_dict()`` is the only thing on stdout; otherwise the command's renderer prints it.
Warnings and errors go to stderr as ``warning: ...`` / ``error: [CODE] ...`` + ``hint: ...``
lines.

Escaping happens here, once, for every byte a command prints: :func:`command_boundary`
replaces ``sys.stdout``/``sys.stderr`` by :class:`SanitizedStream` for the command's run, so
every ``write`` — error, warning and hint lines, ``typer.echo``, log records — has control
characters, bidi controls and line separators escaped (:func:`~ckpttool.cli.render.safe_text`),
and a ``write`` is one line: only its final newline is kept, so a key or file name cannot start
a line of its own ("ALL CHECKS PASSED"). rich consoles (tables, progress bars) write under the
wrapper and escape every segment themselves (``render._SafeConsole``).
:func:`command_boundary` turns every exception into such a line and the documented
exit code (``docs/errors.md``); a library error that names a parameter in backticks
(`` `filter_glob` ``) is shown with the command's flag (``--filter``).
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, Protocol, TextIO, TypeVar

import typer

from ckpttool.cli.render import safe_text
from ckpttool.errors import CkptError

__all__ = ["Output", "SanitizedStream", "command_boundary", "emit_json", "print_error", "flag_names", "sanitized"]

F = TypeVar("F", bound=Callable[..., Any])
_PARAM_RE = re.compile(r"`([a-z][a-z0-9_]*)`")


class SanitizedStream(io.TextIOBase):
    """A text stream that escapes what is written to it (see the module docstring); the sink's one filter.

    Args:
        raw: the stream written to (``raw_stream``: rich consoles write there directly).
    """

    def __init__(self, raw: TextIO) -> None:
        super().__init__()
        self.raw_stream = raw

    def write(self, s: str) -> int:
        body, end = (s[:-1], "\n") if s.endswith("\n") else (s, "")
        self.raw_stream.write(safe_text(body) + end)
        return len(s)

    def flush(self) -> None:
        self.raw_stream.flush()

    def isatty(self) -> bool:
        return self.raw_stream.isatty()

    def fileno(self) -> int:
        return self.raw_stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw_stream, "encoding", "utf-8")


def sanitized(stream: TextIO) -> TextIO:
    """``stream`` behind a :class:`SanitizedStream` (itself when it is one already)."""
    return stream if isinstance(stream, SanitizedStream) else SanitizedStream(stream)  # type: ignore[return-value]


class _HasDict(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def emit_json(obj: Any) -> None:
    """Write ``obj`` as JSON to stdout (the only thing on stdout with ``--json``)."""
    # Compact: the C encoder (indent= falls back to the pure-Python one, ~10x slower on large outputs).
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str, allow_nan=False) + "\n")
    sys.stdout.flush()


def _current_context() -> Any:
    """The running command's click context, or ``None``.

    typer vendors click (``typer._click``) in some releases and uses the ``click`` package in
    others; its public ``typer.Context`` derives from whichever click it runs on.
    """
    import importlib

    base = next(c for c in typer.Context.__mro__ if c.__name__ == "Context" and c is not typer.Context)
    package = sys.modules[base.__module__].__package__ or "click"
    return importlib.import_module(f"{package}.globals").get_current_context(silent=True)


def flag_names() -> dict[str, str]:
    """Python parameter name -> its first option flag, for the command being run (``{}`` outside one)."""
    ctx = _current_context()
    if ctx is None:
        return {}
    out = {}
    for p in ctx.command.params:
        opts = [o for o in getattr(p, "opts", []) if o.startswith("--")]
        if p.name and opts:
            out[p.name] = opts[0]
    return out


def _with_flags(text: str, flags: dict[str, str]) -> str:
    """Replace `` `param` `` by the command's flag for it; other backticked words stay as they are."""
    return _PARAM_RE.sub(lambda m: flags.get(m.group(1), m.group(0)), text)


def print_error(err: CkptError) -> None:
    """Render a :class:`CkptError` as ``error:``/``hint:`` lines on stderr (parameters named by their flags)."""
    flags = flag_names()
    err_stream = sanitized(sys.stderr)
    err_stream.write(f"error: [{err.code}] {_with_flags(err.message, flags)}\n")
    if err.hint:
        err_stream.write(f"hint: {_with_flags(err.hint, flags)}\n")
    err_stream.flush()


class Output:
    """Where a command's result and messages go.

    Args:
        json_output: print results as JSON (``--json``) instead of human text.
    """

    def __init__(self, json_output: bool = False) -> None:
        self.json = json_output

    def result(self, result: _HasDict, render: Callable[[Any], None]) -> None:
        """Print ``result``: its ``to_dict()`` as JSON, or ``render(result)`` as human text."""
        from ckpttool.format.unpickler import gc_paused

        with gc_paused():  # a 10^6-entry report is ~10^7 acyclic objects
            if self.json:
                emit_json(result.to_dict())
            else:
                render(result)

    def warning(self, text: str) -> None:
        """A ``warning: ...`` line on stderr (never changes the exit code)."""
        sanitized(sys.stderr).write(f"warning: {text}\n")
        sys.stderr.flush()

    def error(self, err: CkptError) -> None:
        """``error:``/``hint:`` lines on stderr."""
        print_error(err)


def command_boundary(func: F) -> F:
    """Wrap a command: map errors to one-line messages and documented exit codes.

    A :class:`CkptError` prints ``error: [CODE] message`` and ``hint: ...`` and exits with
    its ``exit_code`` (2 unusable input, 1 findings); Ctrl-C exits 130; anything else is an
    internal error (E999, exit 2) printed as one line unless ``CKPTTOOL_DEBUG=1`` is set.
    No traceback reaches the user.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = sanitized(out), sanitized(err)
        try:
            return _run(*args, **kwargs)
        finally:
            sys.stdout, sys.stderr = out, err

    def _run(*args: Any, **kwargs: Any) -> Any:
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
        except Exception as e:
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
