"""The CLI's one output sink: results as JSON or human text on stdout, messages on stderr.

With ``--json`` a result's ``to_dict()`` is the only thing on stdout, else its renderer prints
it. ``error: [CODE]``/``hint:``, ``warning:``, ``note:`` (left out with ``-q``) and log records
go to stderr. :func:`command_boundary` wraps stdout/stderr in :class:`SanitizedStream` for the
run, so every write has control characters, bidi controls and line separators escaped
(:func:`~ckpttool.ui.render.safe_text`) and cannot start a line of its own; it turns every
exception into such a line and the documented exit code, showing backticked parameters as the
command's flags. ``docs/design.md`` §8; ``docs/cli.md``.
"""

from __future__ import annotations

import errno
import functools
import io
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TextIO, TypeVar

import typer

from ckpttool.errors import CkptError, OutputError, UsageError
from ckpttool.ui.render import safe_text

__all__ = [
    "Output",
    "SanitizedStream",
    "command_boundary",
    "configure_logging",
    "deprecated",
    "docs_url",
    "emit_json",
    "flag_names",
    "note",
    "print_error",
    "sanitized",
    "stdout_write_error",
    "warn",
    "writing_stdout",
    "with_flags",
]

F = TypeVar("F", bound=Callable[..., Any])
#: A backticked parameter name standing alone (``(`step` latest)``, `` `source_layout`/`ep_size` ``), not inside a
#: word or a file name (``run`step`3``: a path holding backticks).
_PARAM_RE = re.compile(r"(?<![\w.\-])`([a-z][a-z0-9_]*)`(?!\w)")


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


def stdout_write_error(e: OSError) -> OutputError:
    """The ``E600`` of a failed write to stdout (``> /dev/full``, a full disk or quota: ``ENOSPC``, ``EIO``, ...).

    Points stdout at ``/dev/null`` first, so what is still buffered does not fail again at exit.
    """
    _silence_stdout()
    return OutputError(
        f"stdout: write failed ({e.strerror or e}); the command ran but its output was not printed in full",
        hint="free space where stdout is redirected, or redirect it to another file",
    )


@contextmanager
def writing_stdout() -> Iterator[None]:
    """Around a command's printing: a failed write to stdout is :func:`stdout_write_error`, not an internal
    error; a closed stdout (``BrokenPipeError``) passes through (the callers end quietly on it).

    Raises:
        OutputError: ``E600``, stdout could not be written.
    """
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        raise stdout_write_error(e) from None


class _HasDict(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def emit_json(obj: Any) -> None:
    """Write ``obj`` as JSON to stdout (the only thing on stdout with ``--json``)."""
    # Compact: the C encoder (indent= falls back to the much slower pure-Python one).
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), default=str, allow_nan=False) + "\n")
    sys.stdout.flush()


def emit_json_chunks(chunks: Iterable[str]) -> None:
    """Write a JSON document given as pieces of text (a streamed ``to_dict()``) to stdout, then a newline.

    The pieces are ``json.dumps`` text (``ensure_ascii``: C0 controls and every non-ASCII character
    are ``\\u`` escapes); the one character left for :func:`safe_text` is DEL, so a piece without one
    goes to the raw stream unscanned (one ``memchr`` instead of a regex scan of ~250 MB at 10^6 tensors).
    """
    out = sys.stdout
    raw = out.raw_stream if isinstance(out, SanitizedStream) else out
    for piece in chunks:
        (out if "\x7f" in piece or not piece.isascii() else raw).write(piece)
    out.write("\n")
    out.flush()


def _write_json(result: _HasDict) -> None:
    """``result`` as one JSON document on stdout (streamed when it has ``json_chunks``: large reports)."""
    chunks = getattr(result, "json_chunks", None)
    if chunks is not None:
        emit_json_chunks(chunks())
    else:
        emit_json(result.to_dict())


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
    for library, cli in _LIBRARY_NAMES.items():  # the library's name of a parameter the CLI names otherwise
        if cli in out:
            out.setdefault(library, out[cli])
    return out


#: Parameter names of the library (in its messages) -> the CLI parameter that sets them. ``model_assets`` (the
#: model adapters' hints: where the model's config.json comes from) is export's ``--model-assets`` folder and, in a
#: command without it, its ``--config`` file (import, validate); export's ``rules`` is diff's ``--rules`` (``map_rules``).
_LIBRARY_NAMES = {
    "algorithm": "hash_name",
    "storage_options": "storage_option",
    "model_assets": "config",
    "rules": "map_rules",
}


def with_flags(text: str) -> str:
    """``text`` with `` `param` `` named by the running command's flag (``--step``), ``docs/X.md`` by its URL."""
    return _with_flags(text, flag_names())


def _with_flags(text: str, flags: dict[str, str], keep: str | None = None) -> str:
    """Replace `` `param` `` by the command's flag for it, ``docs/X.md`` by its documentation URL; the text of
    ``keep`` (the error's file, whose name may hold backticks) is left as it is."""
    if keep and keep in text:
        return keep.join(_with_flags(part, flags) for part in text.split(keep))
    text = _PARAM_RE.sub(lambda m: flags.get(m.group(1), m.group(0)), text)
    return _DOCS_RE.sub(lambda m: f"{docs_url()}/{m.group(1)}", text) if "docs/" in text else text


_DOCS_RE = re.compile(r"(?<![\w/.])docs/([a-z_]+\.md)\b")


@functools.cache
def docs_url() -> str:
    """The ``Documentation`` project URL (package metadata): where a hint's ``docs/X.md`` is, once installed."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        for entry in metadata("ckpttool").get_all("Project-URL") or []:
            label, _, url = str(entry).partition(",")
            if label.strip() == "Documentation":
                return url.strip().rstrip("/")
    except PackageNotFoundError:
        pass
    return "docs"


_SGR = {
    "error": "\x1b[1;31m",
    "warning": "\x1b[33m",
    "hint": "\x1b[1m",
    "note": "\x1b[36m",
    "info": "\x1b[36m",
    "debug": "\x1b[2m",
}


def _stderr() -> Any:
    """stderr under the output sink's escaping wrapper (for lines :func:`_line` escaped already)."""
    return getattr(sys.stderr, "raw_stream", sys.stderr)


def _write_stderr(*lines: str) -> None:
    """Write ``lines`` to stderr and flush. A stderr that cannot be written (its reader went away: ``2>&1 | head
    -1``; a full disk) is pointed at ``/dev/null`` and the command goes on: what it prints never changes its exit
    code (a ``BrokenPipeError`` here was taken for a closed stdout, exit 0)."""
    stream = _stderr()
    try:
        for line in lines:
            stream.write(line)
        stream.flush()
    except OSError:
        _silence(stream)


def _line(prefix: str, text: str) -> str:
    """``prefix: text`` escaped, the prefix coloured when stderr is a colour terminal; a ``note:`` or
    ``warning:`` line wider than a terminal wrapped at spaces under its text (a pipe keeps it whole)."""
    from ckpttool.ui.render import color_enabled

    body = safe_text(text)
    if prefix in ("note", "warning"):
        body = _wrapped_on_terminal(body, len(prefix) + 2)
    if color_enabled(sys.stderr):
        return f"{_SGR[prefix]}{prefix}:\x1b[0m {body}\n"
    return f"{prefix}: {body}\n"


def _wrapped_on_terminal(body: str, indent: int) -> str:
    """``body`` (after an ``indent``-wide prefix) wrapped at spaces to stderr's terminal width, continuation lines
    indented under it; as it is in a pipe, with ``--wide``, or when it fits. A word longer than the room (a path)
    is never cut (the terminal wraps it), nor a number parted from its unit (``333.6 KiB``)."""
    from ckpttool.ui.render import _isatty, hanging_indent, output_width

    if not _isatty(_stderr()):
        return body
    width = output_width(_stderr())
    if indent + len(body) <= width:
        return body
    return hanging_indent(" " * indent + body, width)[indent:]


def print_error(err: CkptError) -> None:
    """Render a :class:`CkptError` as ``error:``/``hint:`` lines on stderr (parameters named by their flags)."""
    flags = flag_names()
    keep = str(err.path) if err.path else None
    lines = [_line("error", f"[{err.code}] {_with_flags(err.message, flags, keep)}")]
    hint = err.hint
    ctx = _current_context() if hint == UsageError.default_hint else None
    if ctx is not None:  # the library's generic "run the command with --help": name the command, as click's do
        hint = f"see `{ctx.command_path} --help`"
    if hint:
        lines.append(_line("hint", _with_flags(hint, flags)))
    _write_stderr(*lines)


def interrupted() -> int:
    """The exit code of a run stopped by Ctrl-C or by torchrun, its line written on stderr.

    Returns:
        A peer rank's loss (torchrun stopping the run because a rank ended): that error, printed, and its
        exit code; a rank lost after rank 0 published the output: 0, nothing said; else 130 after
        ``error: interrupted``.
    """
    from ckpttool.ops import distributed

    lost = distributed.current().lost_peer()
    if lost is not None:
        print_error(lost)
        return lost.exit_code
    if distributed.current().note is not None:
        return 0
    _write_stderr(_line("error", "interrupted" + _published_note()))
    return 130


def caused_by_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C (``KeyboardInterrupt``) or the interpreter's wrapping of one.

    Python 3.10 and 3.11 wrap an exception raised in a class's ``__set_name__`` in a ``RuntimeError``
    (``Error calling __set_name__ on 'Field' instance ...``, the Ctrl-C its ``__cause__``): a Ctrl-C landing
    while a module defines a dataclass (the commands load their modules lazily) arrives as that
    ``RuntimeError``. It is an interrupt (exit 130, ``error: interrupted``), not an internal error. Any other
    exception raised from a Ctrl-C (a cleanup that failed while handling it) is the internal error it is.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        if not (type(cur) is RuntimeError and str(cur).startswith(_SET_NAME_WRAP)):
            return False
        seen.add(id(cur))
        cur = cur.__cause__
    return False


#: The start of the message of Python's ``RuntimeError`` around an exception raised in ``__set_name__`` (3.10, 3.11).
_SET_NAME_WRAP = "Error calling __set_name__ on "


def _published_note() -> str:
    """`` after OUT was written: it is complete ...`` where the interrupt came once an output was in place (a
    signal deferred through the commit's renames, or one during the printing of the result), else ``""``."""
    atomic = sys.modules.get("ckpttool.format.atomic")  # loaded by every command that writes an output
    done = atomic.published() if atomic is not None else ()
    if not done:
        return ""
    names = ", ".join(str(p) for p in dict.fromkeys(done))
    return f" after {names} was written: it is complete"


def warn(text: str) -> None:
    """A ``warning: ...`` line on stderr (printed with ``-q`` too; never changes the exit code)."""
    _write_stderr(_line("warning", _with_flags(text, flag_names())))


def note(text: str) -> None:
    """A ``note: ...`` line on stderr: a fact worth knowing, not a problem (left out with ``-q``)."""
    from ckpttool.ui.render import UI

    if UI.quiet:
        return
    _write_stderr(_line("note", _with_flags(text, flag_names())))


def deprecated(old: str, new: str, *, removal: str = "the next release") -> None:
    """The warning of an old spelling that still works for one release."""
    warn(f"{old} is deprecated and will be removed in {removal}; use {new}")


class _StderrHandler(logging.Handler):
    """Log records as ``info: [export.execute] ...`` lines on the current ``sys.stderr``, escaped."""

    _SHORT = re.compile(r"^ckpttool\.(?:ops|model|format|optim)\.")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = record.levelname.lower()
            prefix = level if level in ("debug", "info") else "warning" if level == "warning" else "error"
            _write_stderr(_line(prefix, f"[{self._SHORT.sub('', record.name)}] {record.getMessage()}"))
        except Exception:  # a broken stderr must not break the command
            self.handleError(record)


def configure_logging(verbosity: int) -> None:
    """Route the ``ckpttool`` loggers to stderr: ``-q`` errors only, default warnings, ``-v`` info, ``-vv`` debug."""
    logger = logging.getLogger("ckpttool")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.propagate = False
    logger.setLevel(
        logging.ERROR
        if verbosity < 0
        else logging.WARNING
        if verbosity == 0
        else logging.INFO
        if verbosity == 1
        else logging.DEBUG
    )


class Output:
    """Where a command's result and messages go.

    Args:
        json_output: print results as JSON (``--json``) instead of human text.
    """

    def __init__(self, json_output: bool = False) -> None:
        self.json = json_output

    def result(self, result: _HasDict, render: Callable[[Any], None]) -> None:
        """Print ``result``: its ``to_dict()`` as JSON, or ``render(result)`` as human text.

        Handed over through :func:`~ckpttool.ops.entry.deliver`, which owns the GC policy of printing.
        A closed stdout ends the printing quietly; the command still exits with its verdict.
        """
        from ckpttool.ops.entry import deliver

        try:
            with writing_stdout():
                deliver(result, render if not self.json else _write_json)
        except BrokenPipeError:
            # The reader of stdout went away (`| head -1`): the command goes on to its exit code, so
            # a verdict already known (diff: different, manifest --verify: changed) is not lost.
            _silence_stdout()

    def warning(self, text: str) -> None:
        """A ``warning: ...`` line on stderr (never changes the exit code)."""
        warn(text)

    def note(self, text: str) -> None:
        """A ``note: ...`` line on stderr (left out with ``-q``)."""
        note(text)

    def error(self, err: CkptError) -> None:
        """``error:``/``hint:`` lines on stderr."""
        print_error(err)


#: ``pathlib.Path.resolve``'s error for a symlink loop before Python 3.13 (later ones raise ``OSError`` ELOOP).
_SYMLINK_LOOP = re.compile(r"Symlink loop from '(.*)'", re.S)


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
            raise typer.Exit(interrupted()) from None
        except BrokenPipeError:
            # The reader of stdout went away (`| head -1`): stop quietly with 0. Point stdout at
            # /dev/null so the interpreter's final flush does not fail again.
            _silence_stdout()
            raise typer.Exit(0) from None
        except OSError as e:
            if e.errno == errno.ELOOP and e.filename is not None:  # Python 3.13's Path.resolve() of a symlink loop
                return _symlink_loop(str(e.filename))
            if e.errno != errno.ENAMETOOLONG:
                return _internal(e)
            # a path argument with a component over NAME_MAX (255 bytes) or longer than PATH_MAX: the user's to fix
            print_error(
                UsageError(
                    f"{e.filename if e.filename is not None else 'a path'}: {e.strerror}",
                    hint="a name in a path holds at most 255 bytes, a path 4096: give a shorter one",
                )
            )
            raise typer.Exit(2) from None
        except RuntimeError as e:
            loop = _SYMLINK_LOOP.fullmatch(str(e))  # Path.resolve() of a link that leads back to itself (Python < 3.13)
            return _internal(e) if loop is None else _symlink_loop(loop.group(1))
        except Exception as e:
            return _internal(e)

    def _symlink_loop(path: str) -> Any:
        print_error(
            UsageError(
                f"{path}: a symbolic link loop (a link that leads back to itself)",
                hint="point the link at a real file or directory, or give another path",
            )
        )
        raise typer.Exit(2) from None

    def _internal(e: Exception) -> Any:
        if caused_by_interrupt(e):  # a Ctrl-C the interpreter wrapped (a module loading lazily)
            raise typer.Exit(interrupted()) from None
        if os.environ.get("CKPTTOOL_DEBUG"):
            raise e
        msg = " ".join(str(e).split())[:200]
        _write_stderr(
            _line("error", f"[E999] internal error: {type(e).__name__}: {msg}"),
            _line("hint", "rerun with CKPTTOOL_DEBUG=1 for a traceback and report it"),
        )
        raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _silence_stdout() -> None:
    _silence(sys.stdout)


def _silence(stream: Any) -> None:
    """Point ``stream``'s descriptor at ``/dev/null`` (what is still buffered then goes there at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no real fd (a test runner's buffer)
        pass
