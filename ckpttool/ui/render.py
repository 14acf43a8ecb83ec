"""Human output: the consoles, the shared formatters and tables that never mislead.

Library code never prints; commands call these with result objects. Every string is escaped
first (:func:`safe_text`): keys and paths come from untrusted checkpoints. One formatter per
kind of value (:func:`fmt_shape`, :func:`human_bytes`, :func:`fmt_rate`, ...; absent is ``-``);
width from ``--wide``, ``COLUMNS``, the terminal, else :data:`PIPE_WIDTH` in a pipe; tables
never wrap numbers and hide low-value columns (named) before keys fold; colour only on a
terminal, never with ``NO_COLOR``. ``docs/cli.md``, "Output".
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:  # rich is slow to import: only commands that print tables pay for it
    from rich.console import Console
    from rich.table import Table

    from ckpttool.layouts.geometry import EPGeometry
    from ckpttool.model.catalog import TensorEntry
    from ckpttool.ops.inspect import GroupRow, InspectResult

__all__ = [
    "ABSENT",
    "FILES_SHOWN",
    "PIPE_WIDTH",
    "PlainConsole",
    "STYLES",
    "UI",
    "Col",
    "Columns",
    "PhaseProgress",
    "byte_progress",
    "color_enabled",
    "fmt_bytes",
    "fmt_count",
    "fmt_dict",
    "fmt_list",
    "fmt_ranks",
    "fmt_rate",
    "fmt_seconds",
    "fmt_shape",
    "fmt_value",
    "human_bytes",
    "key_cell",
    "output_width",
    "plural",
    "print_findings",
    "print_records",
    "print_table",
    "render_overview",
    "safe_text",
    "stderr_console",
    "stdout_console",
    "styled",
    "table",
    "verdict",
]


# What a checkpoint's keys and file names may hold that a terminal would act on or that would
# reorder or fake lines: C0 controls (ESC starts CSI/OSC sequences: colours, cursor moves, screen
# clears, window titles; CR overwrites a line), DEL, C1 controls (0x9b is a one-byte CSI), bidi
# embeddings/overrides/isolates and marks, line and paragraph separators. Each is shown as an
# escape (\x1b, \u202e). Newline and tab are escaped too, except where the sink lays out
# several lines itself (rich's own line breaks; see _SafeConsole).
_UNSAFE_CHARS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_UNSAFE_CHARS.update(
    {c: f"\\u{c:04x}" for c in (0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}
)
_LAYOUT_CHARS = dict(_UNSAFE_CHARS)
del _LAYOUT_CHARS[0x0A], _LAYOUT_CHARS[0x09]
_UNSAFE_RE = re.compile("[\x00-\x1f\x7f]")
_LAYOUT_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f]")


def safe_text(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters, bidi controls and line separators escaped (``\\x1b``, ``\\u202e``).

    Lone surrogates (undecodable bytes of a file name) become ``\\udcff``. With
    ``keep_newlines`` newline and tab stay (text the sink itself lays out in lines).
    """
    if text.isascii() and not (_LAYOUT_RE if keep_newlines else _UNSAFE_RE).search(text):
        return text  # the common case, and JSON documents (ASCII by construction): one C scan
    text = text.translate(_LAYOUT_CHARS if keep_newlines else _UNSAFE_CHARS)
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if not text.isascii() else text


# The value column of a label/value line: ``files       1 data file`` (a label padded to its column),
# ``dcp version 1.0.0`` (a 12-wide label), ``not exported ...`` and ``config.json ...`` (export's 12- and 11-wide ones),
# ``            - reason`` (an indented item), ``hint (P002): ...``.
_LABEL_RE = re.compile(
    r"^(?:[a-z][a-z_ .]{10,11} (?=\S)|[a-z][\w .-]{0,14}?\S {2,}(?=\S)| +(?:- )?(?=\S)|hint \(\w+\): (?=\S))"
)


def hanging_indent(line: str, width: int) -> str:
    """``line`` wrapped at spaces to ``width``, continuation lines indented to its value column.

    A line with no label (no value column) wraps at the left margin; a line that fits is returned
    as it is; a word longer than the room is never cut (the terminal wraps it); a number is never
    parted from its unit, nor a flag from the word after it.
    """
    if len(line) <= width or "\n" in line:
        return line
    m = _LABEL_RE.match(line)
    indent = len(m.group(0)) if m else 0
    if width - indent < 20:
        return line
    import textwrap

    # a number stays with its unit (333.6 KiB), a flag with the word after it (--step 8)
    glued = _FLAG_VALUE_RE.sub("\\1\x00", _NUMBER_UNIT_RE.sub("\\1\x00", line[indent:]))
    body = textwrap.wrap(glued, width - indent, break_long_words=False, break_on_hyphens=False, drop_whitespace=True)
    return line[:indent] + ("\n" + " " * indent).join(b.replace("\x00", " ") for b in body)


def hanging_text(text: Any, width: int) -> Any:
    """A rich ``Text`` (a verdict line: ``result      OK: ...``) wrapped as :func:`hanging_indent` wraps its
    plain text, styles kept; ``None`` when it is left as it is."""
    plain = text.plain
    wrapped = hanging_indent(plain, width)
    if "\n" not in wrapped or "\n" in plain:
        return None
    lines = wrapped.split("\n")
    indent = len(lines[1]) - len(lines[1].lstrip(" "))
    offsets, pos = [], len(lines[0])
    for ln in lines[1:]:
        at = plain.index(ln[indent:], pos)
        offsets.append(at)
        pos = at + len(ln) - indent
    parts = text.divide(offsets)
    out = parts[0]
    out.rstrip()
    for part in parts[1:]:
        part.rstrip()
        out.append("\n" + " " * indent)
        out.append_text(part)
    return out


#: ``<number> <unit>`` (``333.6 KiB``, ``0 B``, ``45 ms``, ``16.2 MB/s``): the space a wrap never breaks.
#: ``--flag value`` (``--step 8``, ``--save-dtype preserve``): a wrap keeps the value on the flag's line.
_FLAG_VALUE_RE = re.compile(r"((?<!\S)--[a-z][a-z0-9-]*) (?=[^\s(-])")
_NUMBER_UNIT_RE = re.compile(r"(\d) (?=(?:[KMGTP]i?B|[kMGTP]B|B|ms|µs|s|min|h)(?:/s)?(?![\w/]))")


@functools.cache
def _safe_console_class() -> type[Console]:
    from rich.console import Console
    from rich.segment import Segment

    class _SafeConsole(Console):
        """A rich Console for untrusted strings, escaped at its one output point.

        Every string handed to it (``print``, table cells) is escaped whole, newlines included,
        so a key cannot start a line of its own; everything it renders (tables, progress bars,
        ``Text``) is escaped again segment by segment just before it is written, keeping only
        the line breaks and the control codes rich itself emits. Markup is off (``[/]`` in a key
        is text).
        """

        def render_str(self, text: str, **kwargs: Any) -> Any:
            return super().render_str(safe_text(text), **kwargs)

        def print(self, *objects: Any, **kwargs: Any) -> None:
            # A label/value line wrapped on a terminal keeps the value's indent (a pipe keeps lines whole); a
            # word longer than the room (a path) is never folded mid-token by rich: the terminal wraps it.
            if len(objects) == 1 and isinstance(objects[0], str) and not self.soft_wrap and "soft_wrap" not in kwargs:
                text = hanging_indent(safe_text(objects[0]), self.width)
                if "\n" in text or len(text) > self.width:  # a word longer than the room: the terminal wraps it
                    from rich.text import Text

                    super().print(Text(text), soft_wrap=True, **kwargs)
                    return
            elif len(objects) == 1 and type(objects[0]).__name__ == "Text" and not self.soft_wrap and not kwargs:
                hung = hanging_text(objects[0], self.width)  # a styled verdict line keeps its value column too
                if hung is not None:
                    super().print(hung, soft_wrap=True)
                    return
            super().print(*objects, **kwargs)

        def _render_buffer(self, buffer: Any) -> str:
            clean = (
                seg if seg.control else Segment(safe_text(seg.text, keep_newlines=True), seg.style) for seg in buffer
            )
            return super()._render_buffer(clean)

        def on_broken_pipe(self) -> None:
            # rich's default raises SystemExit(1) ("findings" in our exit codes); let the command
            # boundary treat a closed pipe (`ckpttool inspect DIR | head -1`) as a normal stop.
            raise BrokenPipeError()

    return _SafeConsole


class UISettings:
    """How this invocation prints (global options, accepted before or after the subcommand).

    Attributes:
        color: ``auto`` (colour on a terminal unless ``NO_COLOR`` is set or ``TERM=dumb``),
            ``always`` or ``never`` (``--color``).
        verbosity: ``-1`` with ``-q`` (errors and warnings only), ``0`` normal, ``1`` with ``-v``
            (decisions and per-file timings), ``2`` with ``-vv`` (everything, per chunk).
        wide: ``--wide``: tables are never narrowed (no column hidden, no key folded).
        json: ``ckpttool --json CMD`` (the command's ``--json`` reads it).
        progress: ``False`` with ``--no-progress``: no progress bars.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.color = "auto"
        self.verbosity = 0
        self.wide = False
        self.json = False
        self.progress = True

    @property
    def quiet(self) -> bool:
        return self.verbosity < 0


#: The settings of the running command (reset by the app at the start of every invocation).
UI = UISettings()

#: Width of output that is not a terminal when ``COLUMNS`` is not set: wide enough for a table of
#: typical LLM keys (``model.model.layers.47.mlp.experts.gate_up_proj``) with its numeric columns.
PIPE_WIDTH = 120
_WIDE = 100_000  # --wide: no line is ever narrowed
_MIN_WIDTH = 20


def color_enabled(stream: Any) -> bool:
    """Whether to colour ``stream``: ``--color always|never``, else only a terminal, never with ``NO_COLOR``.

    ``NO_COLOR`` (https://no-color.org) set to anything non-empty disables colour, as does
    ``TERM=dumb``; an explicit ``--color always`` overrides both.
    """
    if UI.color == "always":
        return True
    if UI.color == "never" or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return _isatty(stream)


def output_width(stream: Any) -> int:
    """Columns to lay out for ``stream``: ``--wide``; else ``COLUMNS``; else the terminal's; else :data:`PIPE_WIDTH`."""
    if UI.wide:
        return _WIDE
    columns = os.environ.get("COLUMNS", "")
    # what int() reads (isdigit() takes superscripts too), and a width a terminal has (not 5,000 digits)
    if columns.strip().isdecimal() and len(columns.strip()) <= 6 and int(columns) > 0:
        return max(_MIN_WIDTH, int(columns))
    try:
        if stream.isatty():
            return max(_MIN_WIDTH, os.get_terminal_size(stream.fileno()).columns)
    except (AttributeError, ValueError, OSError):
        pass
    return PIPE_WIDTH


# a run of spaces is tried from its first one only (the lookbehind): tried from each of them, a run of N spaces that
# no newline follows (a --wide table's padding beside a key of 10^5 characters) took N^2 steps
_TRAILING_WS = re.compile(r"(?<![ \t])[ \t]+((?:\x1b\[[0-9;]*m)*)(?=\n)")


class _NoTrailingWhitespace:
    """A text stream wrapper that drops spaces at the end of every line (rich pads table titles).

    Spaces at the end of one ``write`` are held back until the next one shows whether a
    newline follows; SGR colour codes between the spaces and the newline are kept.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._held = ""

    def write(self, text: str) -> int:
        text = self._held + text
        stripped = text.rstrip(" \t")
        self._held = text[len(stripped) :]
        self._stream.write(_TRAILING_WS.sub(r"\1", stripped))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _terminal(stream: Any) -> Any:
    """The stream under the output sink's escaping wrapper: rich escapes every segment itself and writes its
    own colour codes, which the wrapper would escape."""
    return getattr(stream, "raw_stream", stream)


def _console(stream: Any) -> Console:
    color = color_enabled(stream)
    stream = _terminal(stream)
    file = _NoTrailingWhitespace(stream)
    width = output_width(stream)
    if not color and not _isatty(stream):  # a pipe or a file without colour: no rich for lines and plain tables
        return cast("Console", PlainConsole(file, width))
    return _rich_console(file, width, color=color, tty=_isatty(stream))


def _rich_console(file: _NoTrailingWhitespace, width: int, *, color: bool, tty: bool) -> Console:
    return _safe_console_class()(
        file=cast("IO[str]", file),
        width=width,
        no_color=not color,
        color_system=("auto" if tty else "standard") if color else None,
        force_terminal=color,
        force_interactive=False,
        highlight=False,
        markup=False,
        emoji=False,
        # A terminal gets text wrapped at spaces (the terminal itself would cut numbers anywhere);
        # a pipe gets each line of text whole, for grep. Tables are laid out to the width in both.
        soft_wrap=not tty,
    )


class PlainConsole:
    """The stdout console of output that is neither a terminal nor coloured (a pipe, a file): it writes lines
    of text and tables of plain cells itself, the bytes the rich console writes for them, without importing
    rich; anything else (styled text, tables with folded or multi-line cells, other renderables and
    attributes) goes to that rich console (:attr:`rich`, made on first use, writing to the same stream).

    Attributes:
        file: the stream (trailing spaces of every line dropped, as for the rich console).
        width: the layout width in columns (:func:`output_width`).
    """

    soft_wrap = True  # lines of text are written whole, as rich's console for a pipe does

    def __init__(self, file: _NoTrailingWhitespace, width: int) -> None:
        self.file = file
        self.width = width
        self._rich: Console | None = None

    @property
    def rich(self) -> Console:
        """The rich console of the same stream and width (no colour, soft wrap), made on first use."""
        if self._rich is None:
            self._rich = _rich_console(self.file, self.width, color=False, tty=False)
        return self._rich

    @property
    def unicode_frame(self) -> bool:
        """Whether the stream's encoding holds a table frame's box characters, as rich decides it: else rich
        draws the frame in ASCII (``PYTHONIOENCODING=ascii``, ``LC_ALL=C`` with ``PYTHONUTF8=0``)."""
        return str(getattr(self.file, "encoding", None) or "utf-8").lower().startswith("utf")

    def print(self, *objects: Any, sep: str = " ", end: str = "\n", **kwargs: Any) -> None:
        """Strings: escaped (:func:`safe_text`) and written as one line; anything else: printed by :attr:`rich`."""
        if objects and not kwargs and sep == " " and end == "\n" and all(isinstance(o, str) for o in objects):
            self.write_lines([" ".join(safe_text(o) for o in objects)])
        else:
            self.rich.print(*objects, sep=sep, end=end, **kwargs)

    def write_lines(self, lines: list[str]) -> None:
        """Write ``lines`` (already escaped), each ending in a newline; flushed as rich flushes each print."""
        self.file.write("".join(line + "\n" for line in lines))
        self.file.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rich, name)


def stdout_console() -> Console:
    """The console of a command's human output (stdout): escaped, width and colour per :data:`UI`.

    Without colour and outside a terminal it is a :class:`PlainConsole` (same bytes, no rich import for
    lines of text and plain tables).
    """
    return _console(sys.stdout)


def stderr_console() -> Console:
    """The console of progress bars on stderr."""
    return _safe_console_class()(
        file=_terminal(sys.stderr), no_color=not color_enabled(sys.stderr), highlight=False, markup=False, emoji=False
    )


def styled(*parts: str | tuple[str, str | None]) -> Any:
    """A rich ``Text`` of escaped parts: ``"plain"`` or ``("text", "bold red")`` (style ignored without colour)."""
    from rich.text import Text

    out = Text()
    for part in parts:
        text, style = (part, None) if isinstance(part, str) else part
        out.append(safe_text(text), style=style)
    return out


#: Styles of severities and verdicts (``--color``).
STYLES = {
    "error": "bold red",
    "FAILED": "bold red",
    "FAIL": "red",
    "UNREADABLE": "bold red",
    "warning": "yellow",
    "OK": "bold green",
    "ok": "green",
    "info": "cyan",
    "note": "cyan",
}


def verdict(word: str, rest: str) -> Any:
    """``OK: ...`` / ``FAILED: ...`` with the verdict word coloured."""
    return styled((word, STYLES.get(word)), rest)


# ----------------------------------------------------------------------------- formatters
# One formatter per kind of value, used by every renderer: the same value reads the same everywhere.

ABSENT = "-"


def fmt_shape(shape: Any) -> str:
    """``(8, 32, 32)`` -> ``'8x32x32'``; ``()`` -> ``'scalar'``; ``None`` -> ``'-'``."""
    if shape is None:
        return ABSENT
    dims = list(shape)
    return "x".join(str(d) for d in dims) if dims else "scalar"


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, as ``ls -lh``); ``None`` -> ``'-'``."""
    if n is None:
        return ABSENT
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


fmt_bytes = human_bytes


def fmt_rate(nbytes: int | float, seconds: float) -> str:
    """Throughput in decimal units with 3 significant digits: ``'15.8 MB/s'``, ``'1.23 GB/s'``.

    ``'-'`` when the time is too short to measure (under 1 ms) rather than a meaningless figure.
    """
    if seconds < 1e-3:
        return ABSENT
    rate = nbytes / seconds
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if rate < 999.5 or unit == "GB/s":  # from 999.5 on, 3 significant digits would print 1e+03
            return f"{rate:.3g} {unit}" if rate < 999.5 else f"{rate:,.0f} {unit}"
        rate /= 1000
    return ABSENT  # pragma: no cover


def fmt_seconds(seconds: float) -> str:
    """``0.0123`` -> ``'12 ms'``; ``2.5`` -> ``'2.50 s'``."""
    if seconds < 0.9995:  # from 999.5 ms on, 3 significant digits would print 1e+03 ms
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.2f} s"


def fmt_count(n: int | None) -> str:
    """``4096`` -> ``'4,096'``."""
    return ABSENT if n is None else f"{n:,}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, 'data file')`` -> ``'1 data file'``; ``plural(2, ...)`` -> ``'2 data files'``."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


#: Output data files a dry run's plan line names, then ``... (+N more)`` (``--json`` lists every one): an import
#: or reshard for a 1,000-rank mesh plans 1,000 files.
FILES_SHOWN = 8


def fmt_list(items: Any, limit: int = 0) -> str:
    """``[0, 1, 2]`` -> ``'0, 1, 2'``; empty -> ``'-'``; past ``limit`` items: ``'a, b, ... (+8 more)'``."""
    seq = [fmt_value(x) for x in items]
    if not seq:
        return ABSENT
    if limit and len(seq) > limit:
        return ", ".join(seq[:limit]) + f", ... (+{len(seq) - limit} more)"
    return ", ".join(seq)


def fmt_dict(d: Any) -> str:
    """``{'ep_size': 4, 'tp_size': 1}`` -> ``'ep_size=4, tp_size=1'``; empty -> ``'-'``."""
    if not d:
        return ABSENT
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in d.items())


def fmt_value(v: Any) -> str:
    """Any value of a result, for a human: absent ``'-'``, floats ``%.6g``, ``yes``/``no``, lists, dicts."""
    if v is None:
        return ABSENT
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict):
        return fmt_dict(v)
    if isinstance(v, (list, tuple)):
        return fmt_list(v)
    return str(v)


# ----------------------------------------------------------------------------- tables
class Col:
    """A table column.

    Args:
        name: header.
        kind: ``num`` (numbers, right-aligned) and ``code`` (dtypes, shapes, codes) never wrap;
            ``key`` (checkpoint keys, paths) folds only when nothing else can give way;
            ``text`` (messages) wraps at spaces.
        drop: ``> 0``: a low-value column, hidden when the table does not fit the width;
            the highest ``drop`` goes first. Hidden columns are named below the table.
        hide_empty: leave the column out when no row has a value in it.
    """

    def __init__(
        self, name: str, kind: str = "text", *, drop: int = 0, hide_empty: bool = False, below: bool = False
    ) -> None:
        self.name, self.kind, self.drop, self.hide_empty, self.below = name, kind, drop, hide_empty, below


def _dot_offsets(line: str, width: int) -> list[int]:
    """Where to break ``line`` (a key) to lines of at most ``width`` cells: after a ``.``; a component longer
    than ``width`` (``post_attention_layernorm.`` at 40 columns) after its last ``_`` or ``/`` that fits, and
    only one without either every ``width`` characters."""
    offsets, col, pos = [], 0, 0
    for piece in re.findall(r"[^.]*\.|[^.]+", line):
        if col and col + len(piece) > width:
            offsets.append(pos)
            col = 0
        while col + len(piece) > width:
            cut = max(piece.rfind("_", 0, width - col), piece.rfind("/", 0, width - col)) + 1 or width - col
            pos, piece, col = pos + cut, piece[cut:], 0
            offsets.append(pos)
        pos += len(piece)
        col += len(piece)
    return [o for o in offsets if 0 < o < len(line)]


def _lines_by_line(text: Any, console: Any, options: Any) -> Any:
    """``Text.__rich_console__`` of a folding cell, but each line rendered as its own segments: rich joins the
    wrapped lines into one text, whose one segment of N lines its line splitter then copies N times (quadratic in
    a key of 10^5 parts); the same segments otherwise."""
    from rich.segment import Segment
    from rich.text import DEFAULT_JUSTIFY, DEFAULT_OVERFLOW

    tab_size = console.tab_size if text.tab_size is None else text.tab_size
    lines = text.wrap(
        console,
        options.max_width,
        justify=text.justify or options.justify or DEFAULT_JUSTIFY,
        overflow=text.overflow or options.overflow or DEFAULT_OVERFLOW,
        tab_size=tab_size or 8,
        no_wrap=options.no_wrap if text.no_wrap is None else text.no_wrap,
    )
    for i, line in enumerate(lines):
        if i:
            yield Segment.line()
        yield from line.render(console, end="")
    yield Segment(text.end)


@functools.cache
def _key_text_class() -> type:
    from rich.containers import Lines
    from rich.measure import Measurement
    from rich.text import Text

    class KeyText(Text):
        """A table cell of checkpoint keys (one per line) that folds at ``.`` boundaries, not mid-word."""

        def __rich_console__(self, console: Any, options: Any) -> Any:
            return _lines_by_line(self, console, options)

        def wrap(self, console: Any, width: int, **kwargs: Any) -> Lines:
            lines = Lines()
            for line in self.split("\n", allow_blank=True):
                lines.extend(line.divide(_dot_offsets(line.plain, width)) if line.cell_len > width else [line])
            return lines

        def __rich_measure__(self, console: Any, options: Any) -> Measurement:
            lines = self.plain.split("\n")
            parts = [p for ln in lines for p in re.findall(r"[^.]*\.|[^.]+", ln)]
            longest = max((len(ln) for ln in lines), default=0)
            return Measurement(min(longest, max((len(p) for p in parts), default=0)), longest)

    return KeyText


@functools.cache
def _prose_text_class() -> type:
    from rich.containers import Lines
    from rich.measure import Measurement
    from rich.text import Text

    class ProseText(Text):
        """A table cell of prose that wraps at spaces and folds a word longer than the column (a key in a
        message) at its ``.`` boundaries, as key cells fold, not mid-word."""

        def __rich_console__(self, console: Any, options: Any) -> Any:
            return _lines_by_line(self, console, options)

        def wrap(self, console: Any, width: int, **kwargs: Any) -> Lines:
            words = self.plain.split()
            if all(len(w) <= width for w in words):
                return super().wrap(console, width, **kwargs)
            lines = Lines()
            for line in self.plain.split("\n"):
                cur = ""
                for word in line.split():
                    cuts = [0, *_dot_offsets(word, width), len(word)]
                    for i, piece in enumerate(word[a:b] for a, b in zip(cuts, cuts[1:])):
                        sep = " " if cur and i == 0 else ""
                        if cur and len(cur) + len(sep) + len(piece) > width:
                            lines.append(Text(cur))
                            cur, sep = "", ""
                        cur += sep + piece
                lines.append(Text(cur))
            return lines

        def __rich_measure__(self, console: Any, options: Any) -> Measurement:
            lines = self.plain.split("\n")
            parts = [p for w in self.plain.split() for p in re.findall(r"[^.]*\.|[^.]+", w)]
            longest = max((len(ln) for ln in lines), default=0)
            return Measurement(min(longest, max((len(p) for p in parts), default=0)), longest)

    return ProseText


def key_cell(*keys: str, more: str = "") -> Any:
    """A table cell of ``keys``, one per line (then ``more``), that folds only at ``.`` boundaries."""
    text = "\n".join(safe_text(k) for k in keys) + (f"\n{safe_text(more)}" if more else "")
    return _key_text_class()(text)


_KEY_MIN = 16
_TEXT_MIN = 12
_TEXT_FIT = 32


def _cell(v: Any) -> Any:
    if v is None:
        return ABSENT
    if isinstance(v, str):
        return v
    if hasattr(v, "__rich_console__") or type(v).__name__ == "Text":
        return v
    return fmt_value(v)


def _cell_width(v: Any) -> int:
    text = v if isinstance(v, str) else getattr(v, "plain", str(v))
    lines = text.split("\n")
    if all(line.isascii() and line.isprintable() for line in lines):  # one cell per character
        return max(map(len, lines), default=0)
    from rich.cells import cell_len

    return max((cell_len(line) for line in lines), default=0)


def _table_width(columns: list[Col], widths: list[int], fit: bool) -> int:
    """Cells a table of ``columns`` needs: texts at a comfortable (``fit``) or their least width, keys whole
    (``fit``) or folded."""
    total = 1
    for c, w in zip(columns, widths, strict=True):
        if c.kind == "text":
            w = min(w, _TEXT_FIT if fit else _TEXT_MIN)
        elif c.kind == "key" and not fit:
            w = min(w, max(_KEY_MIN, len(c.name)))
        total += w + 3
    return total


def _rich_table(title: str, columns: list[Col], widths: list[int]) -> Table:
    """An empty rich table of ``columns`` (their content ``widths``): numbers and codes never wrap."""
    from rich.table import Table

    t = Table(title=safe_text(title), title_justify="left", show_lines=False, expand=False, title_style="bold")
    for c, w in zip(columns, widths, strict=True):
        if c.kind in ("num", "code"):
            t.add_column(c.name, no_wrap=True, justify="right" if c.kind == "num" else "left", min_width=w)
        else:
            t.add_column(c.name, overflow="fold", min_width=min(w, _KEY_MIN if c.kind == "key" else _TEXT_MIN))
    return t


def _encodable_table(
    con: Console | PlainConsole, columns: list[Col], cells: list[list[Any]]
) -> tuple[list[Col], list[list[Any]]]:
    """``columns`` and ``cells`` with each character the console's stream cannot encode (``PYTHONIOENCODING=ascii``,
    ``LC_ALL=C``) written as its escape (``\\xe9``) before the table is laid out: escaped by the stream on the way
    out, a cell grew past its column (``caf\\xe9`` in 4 cells) and parted the rows from their frame."""
    encoding = str(getattr(con.file, "encoding", None) or "utf-8")
    if encoding.lower().startswith("utf"):
        return columns, cells

    def escaped(v: Any) -> Any:
        text = v if isinstance(v, str) else getattr(v, "plain", None)
        if not isinstance(text, str) or text.isascii():
            return v
        safe = text.encode(encoding, "backslashreplace").decode(encoding)
        if safe == text or not (isinstance(v, str) or type(v) is _key_text_class()):
            return v  # a styled text keeps its spans: left to the stream's escaping
        return safe if isinstance(v, str) else _key_text_class()(safe)

    heads = [Col(escaped(c.name), c.kind, drop=c.drop, hide_empty=c.hide_empty, below=c.below) for c in columns]
    return heads, [[escaped(v) for v in r] for r in cells]


def print_table(con: Console | PlainConsole, title: str, columns: list[Col], rows: list[list[Any]]) -> list[str]:
    """Print a table that fits ``con``'s width without ever wrapping a number or a code; the hidden columns.

    Columns with no value are left out (``hide_empty``), then low-value columns (``drop``) until
    the natural width fits (named below the table unless ``below``: the caller prints those);
    then texts wrap and keys fold at ``.`` boundaries. A table whose unbreakable cells are
    wider than the terminal is printed wider (the terminal wraps the line) rather than truncated.
    On a :class:`PlainConsole` a table of plain cells that fits is written without rich (:func:`_plain_table`).
    """
    columns, cells = _encodable_table(con, columns, [[_cell(v) for v in r] for r in rows])
    keep = [
        i
        for i, c in enumerate(columns)
        if not (c.hide_empty and all(_cell_width(r[i]) == 0 or r[i] == ABSENT for r in cells))
    ]
    widths = {i: max([len(columns[i].name)] + [_cell_width(r[i]) for r in cells]) for i in range(len(columns))}

    def need(idx: list[int], fit: bool) -> int:
        return _table_width([columns[i] for i in idx], [widths[i] for i in idx], fit)

    width = con.width
    hidden: list[str] = []
    while need(keep, fit=True) > width:
        droppable = [i for i in keep if columns[i].drop > 0]
        if not droppable:
            break
        worst = max(droppable, key=lambda i: (columns[i].drop, i))
        keep.remove(worst)
        hidden.append(columns[worst].name)
    rich_con: Console | None = cast("Console", con)
    if isinstance(con, PlainConsole):  # a pipe without colour: a table of plain cells that fits is written here
        written = _write_plain_table(con, title, [columns[i] for i in keep], [[r[i] for i in keep] for r in cells])
        rich_con = None if written else con.rich
    if rich_con is not None:
        _print_rich_table(rich_con, title, columns, keep, widths, cells, need(keep, fit=False))
    named = [n for n in hidden if not any(c.below and c.name == n for c in columns)]
    if named:
        con.print(f"  (not shown at {width} columns: {', '.join(named)}; see --wide or --json)")
    return hidden


def column_groups(columns: list[Col], rows: list[list[Any]], width: int, fixed: int = 1) -> list[list[int]]:
    """The columns of a table too wide for ``width`` cells, none of which may give way (one per pair of
    checkpoints), as consecutive groups of indices that each fit beside the first ``fixed`` columns (printed in each
    group): one group, every column, where the table fits (or no column fits beside the fixed ones)."""
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(c.name)] + [_cell_width(r[i]) for r in cells]) for i, c in enumerate(columns)]
    head = list(range(fixed))
    groups: list[list[int]] = []
    for i in range(fixed, len(columns)):
        cand = head + groups[-1] + [i] if groups else []
        if cand and _table_width([columns[j] for j in cand], [widths[j] for j in cand], True) <= width:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [head + g for g in groups] or [head]


R = TypeVar("R")
#: A table as data: each column with the cell it takes from a record (:func:`print_records`).
Columns = tuple[tuple[Col, Callable[[R], str]], ...]


def print_records(con: Console | PlainConsole, title: str, columns: Columns[R], records: Iterable[R]) -> list[str]:
    """:func:`print_table` of a row per record, its cells taken by ``columns``; the hidden columns."""
    return print_table(con, title, [c for c, _ in columns], [[cell(r) for _, cell in columns] for r in records])


def _print_rich_table(
    con: Console,
    title: str,
    columns: list[Col],
    keep: list[int],
    widths: dict[int, int],
    cells: list[list[Any]],
    least: int,
) -> None:
    """The ``keep`` columns of ``cells`` as a rich table on ``con``, at least ``least`` cells wide.

    A title wider than the table is printed on its own line above it, whole (rich would wrap it to the
    table's width: a line of text cut in a pipe).
    """
    t = _rich_table(title, [columns[i] for i in keep], [widths[i] for i in keep])
    key_text, prose = _key_text_class(), _prose_text_class()

    def cell(c: Col, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        if c.kind == "key":
            return key_text(safe_text(v))
        return prose(safe_text(v)) if c.kind == "text" and v.isascii() and v.isprintable() else v

    for r in cells:
        t.add_row(*(cell(columns[i], r[i]) for i in keep))
    if title:
        from rich.cells import cell_len
        from rich.measure import Measurement

        shown = min(Measurement.get(con, con.options, t).maximum, max(con.width, least))
        if cell_len(safe_text(title)) > shown:
            t.title = None
            con.print(styled((title, "bold")))
    _print_at_least(con, t, least)


def _plain_cell(v: Any) -> bool:
    """Whether a cell is text that lays out as it is: one line of printable ASCII (rich measures it by ``len``)."""
    return isinstance(v, str) and v.isascii() and v.isprintable()


def _plain_table(title: str, columns: list[Col], rows: list[list[Any]], width: int) -> list[str] | None:
    """The lines rich draws for a table of plain cells (:func:`_plain_cell`) that fits ``width`` whole, or ``None``.

    Such a table is laid out at its cells' natural widths, nothing wrapped or folded: rich's
    ``box.HEAVY_HEAD`` frame, one space of padding, numbers right-aligned, the title on its own line
    (without colour rich draws no styles). Any other table is rich's to lay out.
    """
    if not columns or not _plain_cell(title) or not all(_plain_cell(v) for r in rows for v in r):
        return None
    widths = [max([len(c.name)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    total = sum(widths) + 3 * len(columns) + 1
    if total > width or not all(_plain_cell(c.name) for c in columns):
        return None

    def line(cells: list[str], edge: str, bar: str) -> str:
        parts = [
            (v.rstrip().rjust(w) if c.kind == "num" else v.ljust(w))
            for c, v, w in zip(columns, cells, widths, strict=True)
        ]
        return f"{edge} " + f" {bar} ".join(parts) + f" {edge}"

    def rule(left: str, fill: str, mid: str, right: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    lines = [title.rstrip()] if title else []
    lines += [rule("┏", "━", "┳", "┓"), line([c.name for c in columns], "┃", "┃"), rule("┡", "━", "╇", "┩")]
    lines += [line(r, "│", "│") for r in rows]
    lines.append(rule("└", "─", "┴", "┘"))
    return [ln.rstrip(" ") for ln in lines]


def _write_plain_table(con: PlainConsole, title: str, columns: list[Col], rows: list[list[Any]]) -> bool:
    """Write the table on ``con`` as :func:`_plain_table` lays it out; whether it did (else it is rich's to draw:
    cells that are not plain, a table wider than ``con``, or a stream that cannot encode the frame's box
    characters, which rich draws in ASCII)."""
    lines = _plain_table(title, columns, rows, con.width) if con.unicode_frame else None
    if lines is not None:
        con.write_lines(lines)
    return lines is not None


def _print_at_least(con: Console, t: Table, minimum: int) -> None:
    """Print ``t`` at the console's width, or at ``minimum`` cells where that is wider (the terminal wraps
    the lines): rich clamps a print's width to the terminal's, a table's own width it does not."""
    if minimum > con.width:
        t.width = minimum
    con.print(t, width=minimum if minimum > con.width else None, soft_wrap=False, crop=False)


#: Keys shown in the one row of repeated findings of one code.
GROUP_KEYS = 3


def print_findings(
    con: Console,
    title: str,
    findings: list[Any],
    style: str | None = None,
    flags: Callable[[str], str] = lambda text: text,
) -> None:
    """Print ``validate``'s findings of one severity: a table (code, count, key, message, hint).

    Findings of one code (and hint) are one row: their count, the first :data:`GROUP_KEYS` keys
    and ``+N more``, the first message. When the hint column does not fit the width, each hint
    is printed once per code below the table as ``hint (CODE): ...``: never hidden.
    ``findings``: objects with ``code``, ``error_code``, ``key``, ``message``, ``hint``; ``flags`` names the
    backticked parameters of messages and hints by the command's flags (``--step``).
    """
    groups: dict[tuple[str, str | None, str], list[Any]] = {}
    for f in findings:
        groups.setdefault((f.code, f.error_code, f.hint), []).append(f)
    rows = []
    for (code, error_code, hint), fs in groups.items():
        keys = [f.key or ABSENT for f in fs]
        more = f"+{len(keys) - GROUP_KEYS} more" if len(keys) > GROUP_KEYS else ""
        same = all(f.message == fs[0].message for f in fs)
        message = fs[0].message if same or len(fs) == 1 else f"{fs[0].message} (and {len(fs) - 1} more like it)"
        rows.append(
            [
                styled((code + (f" {error_code}" if error_code else ""), style)),
                fmt_count(len(fs)) if len(fs) > 1 else "",
                key_cell(*keys[:GROUP_KEYS], more=more),
                flags(message),
                flags(hint) if hint else hint,
            ]
        )
    columns = [
        Col("code", "code"),
        Col("count", "num", hide_empty=True),
        Col("key", "key"),
        Col("message", "text"),
        Col("hint", "text", drop=1, below=True),
    ]
    if "hint" in print_table(con, title, columns, rows):
        seen: set[tuple[str, str]] = set()
        for (code, _, hint), _fs in groups.items():
            if hint and (code, hint) not in seen:
                seen.add((code, hint))
                con.print(f"hint ({code}): {flags(hint)}")


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    """A plain rich table of strings (every column may fold); prefer :func:`print_table`."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=False, expand=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*(_cell(v) for v in r))
    return t


#: Below this many columns a progress bar shows no rate and no time left; below :data:`WIDE_PROGRESS` its
#: bar takes the room that is left (at least the line fits), from there on a bar of 40.
NARROW_PROGRESS, WIDE_PROGRESS = 80, 120


class PhaseProgress:
    """What a command is doing, on stderr: each phase by name (a spinner line), then a bar with its total.

    ``phase(text)`` names the step under way (``LABEL: text…``). The bar appears only once its
    total is known (the first ``progress(done, total)`` call), so it never shows ``0/?``; it
    counts bytes (``unit="bytes"``: done/total, speed, time left) or items (``unit="items"``:
    done/total, time left). A phase named after the bar has started replaces its label and
    restarts its rate and time left, so each rate covers one phase only. Enter it with
    :meth:`on_stderr`, which yields ``None`` where nothing may be drawn.
    """

    def __init__(self, console: Any, label: str, *, unit: str = "bytes", bar_text: str | None = None) -> None:
        """``label`` prefixes every line (the command's name); ``bar_text``: the bar's first label (default: the
        last phase named)."""
        self.con = console
        self.label = label
        self.unit = unit
        self._bar_text = bar_text
        self._last = bar_text or ""
        self._status: Any = None
        self._bar: Any = None
        self._task: Any = None
        self._shown = (0, 0)  # (done, total) drawn in this phase: done never goes back within a phase
        self._lock = threading.Lock()  # progress may be called from worker threads

    @classmethod
    @contextlib.contextmanager
    def on_stderr(
        cls, label: str, enabled: bool, *, unit: str = "bytes", bar_text: str | None = None
    ) -> Iterator[PhaseProgress | None]:
        """A :class:`PhaseProgress` on the stderr console, or ``None`` when ``enabled`` is false (``--json``,
        stderr not a terminal), with ``-q`` or with ``--no-progress``: then no bar and no phase line."""
        if not enabled or UI.quiet or not UI.progress:
            yield None
            return
        shown = cls(stderr_console(), label, unit=unit, bar_text=bar_text)
        try:
            yield shown
        finally:
            shown.close()

    def phase(self, text: str) -> None:
        """Name the step under way."""
        with self._lock:
            self._phase(text)

    def _phase(self, text: str) -> None:
        self._last = text
        self._shown = (0, 0)
        if self._bar is not None:  # a new phase: its own rate and time left
            done = self._bar.tasks[0].completed
            self._bar.reset(self._task, completed=done, description=f"{self.label}: {text}")
            self._bar.refresh()
            return
        from rich.spinner import Spinner

        # drawn at once (not at the next tick of the refresh thread): a short phase is named too
        line = Spinner("dots", text=f"{self.label}: {text}" + ("" if text.endswith("…") else "…"))
        if self._status is None:
            from rich.live import Live

            self._status = Live(line, console=self.con, transient=True, refresh_per_second=12.5)
            self._status.start(refresh=True)
        else:
            self._status.update(line, refresh=True)

    def progress(self, done: int, total: int) -> None:
        """``done`` of ``total`` (bytes or items); the first call starts the bar. Calls may come from worker
        threads in any order: a smaller ``done`` of the same ``total`` in the same phase is not drawn."""
        with self._lock:
            self._progress(done, total)

    def _progress(self, done: int, total: int) -> None:
        if total == self._shown[1] and done < self._shown[0]:
            return
        self._shown = (done, total)
        if self._bar is None:
            if total is None:  # no total yet: the phase line stays
                return
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            if self._status is not None:
                self._status.stop()
                self._status = None
            from rich.table import Column

            # on a narrow terminal the bar gives way, then the time left and the rate: one line, never wrapped
            # (a phase name too long for the line ends in "…")
            width = self.con.width
            whole = Column(no_wrap=True)
            amounts: list[Any] = [
                DownloadColumn(binary_units=True, table_column=whole)
                if self.unit == "bytes"
                else MofNCompleteColumn(table_column=whole)
            ]
            if self.unit == "bytes" and width >= NARROW_PROGRESS:
                amounts.append(TransferSpeedColumn(table_column=Column(no_wrap=True)))
            if width >= NARROW_PROGRESS:
                amounts.append(TimeRemainingColumn(table_column=Column(no_wrap=True)))
            room = max(12, width - (31 if self.unit == "bytes" else 24))  # the amounts stay whole, a bar of 10
            self._bar = Progress(
                TextColumn(
                    "{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", max_width=room)
                ),
                BarColumn(bar_width=None if width < WIDE_PROGRESS else 40, table_column=Column(ratio=1)),
                *amounts,
                console=self.con,
                transient=True,
                expand=width < WIDE_PROGRESS,
            )
            self._bar.start()
            first = self._last if self._bar_text is None else self._bar_text
            self._task = self._bar.add_task(f"{self.label}: {first}" if first else self.label, total=total)
            self._bar_text = None
        self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        """Stop drawing (the lines are transient: nothing stays on the terminal)."""
        if self._status is not None:
            self._status.stop()
        if self._bar is not None:
            self._bar.stop()
        self._status = self._bar = None


@contextlib.contextmanager
def byte_progress(label: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on stderr, in bytes (``label``, bar, done/total, speed, time left), drawn from
    its first ``progress(done, total)`` call on (:class:`PhaseProgress`, never ``0/?``).

    Yields the ``(bytes done, bytes total)`` callback that the library functions take as
    ``progress``, or ``None`` when ``enabled`` is false (``--json``, stderr not a terminal).
    """
    with PhaseProgress.on_stderr(label, enabled, bar_text="") as shown:
        yield shown.progress if shown is not None else None


def render_overview(ov: InspectResult, *, max_rows: int = 200, flags: Callable[[str], str] | None = None) -> None:
    """Print ``inspect``'s result: a header, the model tensors, optimizer, layout and extra state.

    ``flags`` names the library parameters in a text (`` `step` ``) by the running command's flags (``--step``).
    """
    con = stdout_console()
    _overview_header(con, ov, flags or (lambda text: text))
    _overview_model(con, ov, max_rows)
    _overview_optimizer(con, ov)
    _overview_layout(con, ov)
    _overview_provenance(con, ov)
    _overview_training(con, ov)
    _overview_byte_items(con, ov, max_rows)
    _overview_leftovers(con, ov)


def _training_keys(ov: InspectResult) -> set[str]:
    return {k for keys in (ov.training_state or {}).values() for k in keys}


def _overview_training(con: Console, ov: InspectResult) -> None:
    """The training-state items (scheduler, train state, data loader) once, with their step counters."""
    values = ov.training_values or {}
    root = ov.schema.state_root if ov.schema is not None else ""  # "app." of an app-state save
    parts = []
    for item, keys in (ov.training_state or {}).items():
        shown = [
            f"{k[len(root if k.startswith(root) else '') + len(item) + 1 :] or 'value'} {fmt_value(values[k])}"
            for k in keys
            if k in values
        ]
        parts.append(f"{item}: {plural(len(keys), 'key')}" + "".join(f", {v}" for v in shown))
    if parts:
        con.print(f"training    {'; '.join(parts)}")
    trainer = [
        f"{t.file}: "
        + (f"not read ({t.error})" if t.error else ", ".join(f"{k} {fmt_value(v)}" for k, v in t.values.items()))
        for t in ov.trainer_state
    ]
    if trainer:
        con.print(f"trainer     {'; '.join(trainer)}")
    if ov.unread_beside:
        con.print(
            f"not read    {', '.join(ov.unread_beside)} (training state beside the checkpoint, "
            "which ckpttool does not read; validate K012)"
        )
    if ov.hf_copies:
        con.print(f"hf copy     {', '.join(ov.hf_copies)} (compared with the checkpoint by validate --deep, D012)")


def _overview_header(con: Console, ov: InspectResult, flags: Callable[[str], str]) -> None:
    """Where the checkpoint was opened, its format, key schema, files, tensors and bytes."""
    s = ov.summary
    con.print(f"checkpoint  {ov.path}")
    loc = ov.location
    if loc is not None and (
        loc.model != loc.given or loc.optimizer is not None or loc.described != "the directory given"
    ):
        pair = f" + optimizer {loc.optimizer}" if loc.optimizer is not None else ""
        con.print(f"opened      {loc.model}{pair} ({flags(loc.described)})")
    con.print(
        f"dcp version {ov.dcp_version or ABSENT}"
        + {"safetensors": "; safetensors storage", "per_rank": "; per-rank files (not DCP)"}.get(ov.serialization, "")
    )
    if ov.schema is not None:
        sch = ov.schema
        mp = ABSENT if sch.model_prefix is None else (repr(sch.model_prefix) if sch.model_prefix else "top level")
        op = (
            ABSENT
            if sch.optimizer_prefix is None
            else (repr(sch.optimizer_prefix) if sch.optimizer_prefix else "top level")
        )
        con.print(
            f"key schema  {sch.id} ({sch.source}): model {mp}, optimizer {op}"
            + (f" by {sch.optimizer_keying}" if sch.optimizer_keying else "")
            + f", {sch.naming} names"
            + (f"; adapter {ov.model_adapter}" if ov.model_adapter else "")
        )
        for why in sch.reasons:
            con.print(f"            - {why}")
        if ov.adapter_choices:
            picks = " or ".join(f"{a} (model_type {t})" for a, t in ov.adapter_choices)
            con.print(
                f"adapter     none from the names alone: export applies {picks} where the config.json of "
                "--model-assets DIR has that model_type, or named with --adapter; without either it writes the "
                "names as stored, which transformers does not load"
            )
    ranks = f" from rank{'s' if len(s.ranks) > 1 else ''} {fmt_ranks(s.ranks)}" if s.ranks else ""
    con.print(f"files       {plural(s.files, 'data file')}{ranks}, {human_bytes(s.bytes_on_disk)} on disk")
    con.print(
        f"tensors     {plural(s.tensor_count, 'tensor')} ({s.model_tensor_count:,} model, "
        f"{s.numel_model:,} model elements), {plural(s.byte_item_count, 'byte item')}"
    )
    by_cat = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.bytes_by_category.items()) or ABSENT
    by_dtype = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.bytes_by_dtype.items()) or ABSENT
    con.print(f"bytes       {by_cat}")
    con.print(f"by dtype    {by_dtype}")


def _tensor_notes(t: TensorEntry) -> str:
    """The ``notes`` cell of a model tensor: ``uneven``, ``N zero-size``."""
    notes = ["uneven"] if t.uneven else []
    if t.zero_size_chunks:
        notes.append(f"{t.zero_size_chunks} zero-size")
    return " ".join(notes)


_TENSOR_TABLE: Columns[TensorEntry] = (
    (Col("key", "key"), lambda t: t.key),
    (Col("shape", "code"), lambda t: fmt_shape(t.shape)),
    (Col("dtype", "code"), lambda t: t.dtype),
    (Col("numel", "num", drop=3), lambda t: fmt_count(t.numel)),
    (Col("chunks", "num", drop=2), lambda t: str(len(t.chunks))),
    (Col("ranks", "code", drop=4), lambda t: fmt_ranks(t.ranks)),
    (Col("notes", "text", drop=1, hide_empty=True), _tensor_notes),
)


def _overview_model(con: Console, ov: InspectResult, max_rows: int) -> None:
    """The model tree (``--depth``) or the first ``max_rows`` model tensors."""
    if ov.tree is not None:
        print_table(
            con,
            "model tree",
            [Col("prefix", "key"), Col("tensors", "num"), Col("numel", "num", drop=1), Col("bytes", "num")],
            [[r.prefix, fmt_count(r.tensors), fmt_count(r.numel), human_bytes(r.nbytes)] for r in ov.tree],
        )
    else:
        print_records(con, "model tensors", _TENSOR_TABLE, ov.model[:max_rows])
        if len(ov.model) > max_rows:
            con.print(f"... {len(ov.model) - max_rows:,} more (use --filter, --depth or --json)")


#: The state column of a group without state: never stepped, or torch's SGD with momentum 0 (which keeps none).
_NO_STATE = {False: "no state (never stepped)", True: "none kept (SGD, momentum 0)"}


def _group_state(g: GroupRow) -> str:
    if not g.members_known:  # saved without its parameters, which ckpttool cannot derive: not "never stepped"
        return "members unknown (P007)"
    return "yes" if g.has_state else _NO_STATE[g.keeps_no_state]


_GROUP_TABLE: Columns[GroupRow] = (
    (Col("group", "key"), lambda g: str(g.id)),
    (Col("params", "num"), lambda g: fmt_count(g.params) if g.members_known else "unknown"),
    (Col("lr", "num"), lambda g: fmt_value(g.values["lr"])),
    (Col("weight_decay", "num", drop=3), lambda g: fmt_value(g.values["weight_decay"])),
    (Col("betas", "code", drop=4), lambda g: fmt_value(g.values["betas"])),
    (Col("eps", "num", drop=5), lambda g: fmt_value(g.values["eps"])),
    (Col("initial_lr", "num", drop=6), lambda g: fmt_value(g.values["initial_lr"])),
    (Col("state", "text"), lambda g: _group_state(g)),
    (Col("missing", "text", hide_empty=True), lambda g: fmt_list(g.missing)),
)


def _overview_optimizer(con: Console, ov: InspectResult) -> None:
    """The optimizer summary, its state fields, param groups and state of fqns not in the model."""
    o = ov.optimizer
    by_index = ov.schema is not None and ov.schema.optimizer_keying == "index"
    if by_index:  # state keyed 0, 1, ...: no parameter of the model is matched, none is an orphan
        con.print(
            f"optimizer   flavor {o.flavor or ABSENT}; state of {plural(len(o.orphan_state), 'parameter')} keyed by "
            "index (a plain optimizer.state_dict()), not by fqn: matched to no model parameter (validate: K003; "
            "re-save with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict)"
        )
    else:
        con.print(
            f"optimizer   flavor {o.flavor or ABSENT}; state for {o.params_with_state}/{o.params_total} params; "
            f"implied type {o.implied_type or ABSENT}; declared type {o.declared_type or ABSENT}"
        )
        if o.saved_by_counts:
            by = (
                ", ".join(f"{k} ({n})" for k, n in o.saved_by_counts.items())
                if len(o.saved_by_counts) > 1
                else o.saved_by
            )
            con.print(f"saved by    {by}")
    if o.fields:
        print_table(
            con,
            "optimizer state fields",
            [Col("field", "code"), Col("dtypes (params)", "text")],
            [[f, ", ".join(f"{d} ({n})" for d, n in c.items())] for f, c in o.fields.items()],
        )
    if o.param_groups:
        print_records(con, "param groups", _GROUP_TABLE, o.param_groups)
    if o.orphan_state and not by_index:
        con.print(f"state for fqns not in the model: {fmt_list(o.orphan_state, limit=10)}")
    if o._stored_split:  # recognised (validate's K005), not orphans
        fqn, keys = next(iter(o._stored_split.items()))
        con.print(
            f"fused state {plural(len(o._stored_split), 'parameter')} stepped fused, stored split "
            f"(e.g. {fqn} as {', '.join(keys)}): recognised, not orphans"
        )


_GEOMETRY_TABLE: Columns[EPGeometry] = (
    (Col("key", "key"), lambda g: g.key),
    (Col("shape", "code"), lambda g: fmt_shape(g.shape)),
    (Col("experts", "num"), lambda g: str(g.num_experts)),
    (Col("ep_dim", "num", drop=3), lambda g: str(g.ep_dim)),
    (Col("fsdp_dim", "num", drop=2), lambda g: fmt_value(g.fsdp_dim)),
    (Col("blocks per dim", "code", drop=4), lambda g: fmt_shape(g.blocks_per_dim)),
    (Col("ranks", "code", drop=5), lambda g: fmt_ranks(g.ranks)),
    (Col("same dim", "code", drop=1), lambda g: fmt_value(g.same_dim)),
    (Col("problems", "text", hide_empty=True), lambda g: "; ".join(g.problems)),
)


def _overview_layout(con: Console, ov: InspectResult) -> None:
    """The EP layout record, its geometry and ambiguity, or why there is none."""
    lay = ov.layout
    if lay is not None:
        version = (
            f"version {lay.version} ({lay.layout}, {lay.source})"
            if lay.version is not None
            else f"unversioned ({lay.source})"
        )
        step = f", global_step {lay.global_step}" if lay.global_step is not None else ""
        con.print(
            f"layout      {version}; parallel {fmt_dict(lay.parallel)}; "
            f"{plural(len(lay.extra_parallel), 'EP tensor')}{step}"
        )
        if lay.geometry:
            print_records(con, "EP geometry", _GEOMETRY_TABLE, lay.geometry)
        if lay.ambiguous:
            pairs = sorted({tuple(pf) for c in (lay.candidates or {}).values() for pf in c})
            fits = ", ".join(f"{p}x{f}" for p, f in pairs[:6])
            con.print(
                f"ambiguous   {plural(len(lay.ambiguous), 'EP tensor')} with their expert dim split into blocks that "
                f"EP and EP-FSDP may both have sharded{f' (ep_size x ep_fsdp_size {fits})' if fits else ''}, and no layout "
                "record: the expert order is unknown; declare it with --source-layout legacy|canonical "
                "--ep-size P --ep-fsdp-size F (or `ckpttool stamp`), or --no-ep for a save without expert parallelism"
            )
    elif ov.layout_error is not None:
        con.print(
            styled("layout      ", ("error:", STYLES["error"]), f" [{ov.layout_error.code}] {ov.layout_error.message}")
        )
    else:
        con.print("layout      none (unversioned)")


def _packed_line(con: Console, packed: list[dict[str, str]]) -> None:
    """Integer-packed quantized weights: how many, by method, the first of each named (inspect's ``quantized.packed``)."""
    first: dict[str, str] = {}
    count: dict[str, int] = {}
    for p in packed:
        first.setdefault(p["method"], p["weight"])
        count[p["method"]] = count.get(p["method"], 0) + 1
    what = "; ".join(f"{count[m]} {m}, e.g. {w}" for m, w in first.items())
    con.print(
        f"packed      {len(packed)} integer-packed quantized weight(s), stored as integer codes, not values "
        f"(ckpttool dequantizes none; import refuses them, validate M026): {what}"
    )


def _overview_provenance(con: Console, ov: InspectResult) -> None:
    """The checkpoint this one was made from, the extra_state files, and quantized weights."""
    q = ov.quantized
    if q is not None and q.get("packed"):
        _packed_line(con, q["packed"])
    if q is not None and (q["pairs"] or q["problems"]):
        kinds: dict[str, int] = {}
        for p in q["pairs"]:
            kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
        what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none usable"
        bad = (
            f"; {len(q['problems'])} not pairing (validate M020/M023): {q['problems'][0]['message']}"
            if q["problems"]
            else ""
        )
        grid = f" ({'; '.join(q['schemes'])})" if q["schemes"] else ""
        con.print(f"quantized   {what} weight(s) with scales{grid}{bad}")
    if ov.derived_from is not None:
        src = ov.derived_from
        con.print(
            f"made from   a checkpoint with .metadata {src.get('algorithm')} {src.get('metadata_digest')}, "
            + (
                f"manifest {src['manifest_digest']}"
                if src.get("manifest_digest")
                else "no manifest (run `ckpttool manifest` on a source to record one)"
            )
        )
    for e in ov.extra_state:
        con.print(
            f"extra state {e.path} ({human_bytes(e.size)}, rank {fmt_value(e.rank)}): {e.status}"
            + (f", keys {', '.join(e.keys)}" if e.keys else "")
        )


def _overview_byte_items(con: Console, ov: InspectResult, max_rows: int) -> None:
    """Param-group byte items as one line, the other byte items as a table."""
    if ov.byte_items:
        from ckpttool.ops.entry import split_param_group_items

        training = _training_keys(ov)
        pg, rest = split_param_group_items(ov.byte_items)
        rest = [(k, n) for k, n in rest if k not in training]  # shown under "training"
        if pg:
            con.print(f"byte items  {plural(len(pg), 'param-group item')} ({human_bytes(sum(n for _, n in pg))})")
        if rest:
            print_table(
                con,
                "other byte items" if pg else "byte items",  # the param-group items: the line above
                [Col("key", "key"), Col("bytes", "num")],
                [[k, human_bytes(n)] for k, n in rest[:max_rows]],
            )


def _overview_leftovers(con: Console, ov: InspectResult) -> None:
    """Keys of no known category, uncategorized tensors (a warning) and saved non-persistent buffers."""
    other = [k for k in ov.other_keys if k not in _training_keys(ov)]  # training state: shown under "training"
    if other:
        con.print(f"other keys  {fmt_list(other, limit=20)}")
    if ov.uncategorized_tensors:
        sys.stderr.write(
            safe_text(
                f"warning: {plural(len(ov.uncategorized_tensors), 'tensor')} belong to no known category (not "
                f"model, optimizer or training state), e.g. {ov.uncategorized_tensors[0]}; see --model-prefix"
            )
            + "\n"
        )
    if ov.non_persistent_buffers:
        con.print(f"non-persistent buffers saved as keys: {fmt_list(ov.non_persistent_buffers, limit=5)}")


def fmt_ranks(ranks: Any) -> str:
    """``(0, 1, 2, 3, 5)`` -> ``'0-3,5'`` (runs of consecutive ranks collapsed); empty -> ``'-'``."""
    rs = sorted(set(ranks))
    if not rs:
        return ABSENT
    out, start, prev = [], rs[0], rs[0]
    for r in [*rs[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}" if prev > start + 1 else f"{start},{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)
