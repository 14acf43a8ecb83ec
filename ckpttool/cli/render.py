"""Human output: rich tables on stdout, readable without colour (``NO_COLOR`` honoured).

Library code never prints; commands call these functions with result objects. Every
string that reaches the terminal is escaped first (:func:`safe_text`): keys and paths
come from untrusted checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich costs ~15 ms to import: only commands that print tables pay for it
    from rich.console import Console
    from rich.table import Table

    from ckpttool.ops.inspect import InspectResult

__all__ = ["safe_text", "stdout_console", "stderr_console", "byte_progress", "human_bytes", "table", "render_overview"]


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


def _terminal(stream: Any) -> Any:
    """The stream under the output sink's escaping wrapper: rich escapes itself and writes its own codes."""
    return getattr(stream, "raw_stream", stream)


def stdout_console() -> Console:
    width = None if sys.stdout.isatty() else 200
    return _safe_console_class()(
        file=_terminal(sys.stdout),
        no_color=bool(os.environ.get("NO_COLOR")),
        highlight=False,
        markup=False,
        width=width,
    )


def stderr_console() -> Console:
    return _safe_console_class()(
        file=_terminal(sys.stderr), no_color=bool(os.environ.get("NO_COLOR")), highlight=False, markup=False
    )


@contextlib.contextmanager
def byte_progress(label: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A transient progress bar on stderr, in bytes (``label``, bar, done/total, speed, time left).

    Yields the ``(bytes done, bytes total)`` callback that the library functions take as
    ``progress``, or ``None`` when ``enabled`` is false (``--json``, stderr not a terminal).
    """
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn(label),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=False, expand=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("-" if v is None else str(v) for v in r))
    return t


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return "-" if v is None else str(v)


def render_overview(ov: InspectResult, *, max_rows: int = 200) -> None:
    """Print ``inspect``'s result as tables."""
    con = stdout_console()
    s = ov.summary
    con.print(f"checkpoint  {ov.path}")
    con.print(f"dcp version {ov.dcp_version or '-'}")
    con.print(
        f"files       {s.files} data files from ranks {list(s.ranks) or '-'}, {human_bytes(s.bytes_on_disk)} on disk"
    )
    bad = [f for f in ov.files if f.status != "ok"]
    if bad:
        for f in bad:
            what = {
                "missing": "is missing",
                "short": f"is shorter than its records need ({f.size} < {f.needed} bytes; truncated?)",
                "unreferenced": "is not referenced by .metadata",
            }[f.status]
            sys.stderr.write(f"warning: data file {f.path} {what}\n")  # escaped by the output sink
        sys.stderr.write("warning: run `ckpttool validate --strict` for the full list of problems\n")
    con.print(
        f"tensors     {s.tensor_count} ({s.model_tensor_count} model, {s.numel_model:,} model elements), "
        f"{s.byte_item_count} byte items"
    )
    by_cat = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.bytes_by_category.items())
    by_dtype = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.bytes_by_dtype.items())
    con.print(f"bytes       {by_cat}")
    con.print(f"by dtype    {by_dtype}")

    if ov.tree is not None:
        con.print(
            table(
                "model tree",
                ["prefix", "tensors", "numel", "bytes"],
                [[r.prefix, r.tensors, f"{r.numel:,}", human_bytes(r.nbytes)] for r in ov.tree],
            )
        )
    else:
        rows = []
        for t in ov.model[:max_rows]:
            notes = []
            if t.uneven:
                notes.append("uneven")
            if t.zero_size_chunks:
                notes.append(f"{t.zero_size_chunks} zero-size")
            rows.append(
                [
                    t.key,
                    "x".join(map(str, t.shape)) or "scalar",
                    t.dtype,
                    f"{t.numel:,}",
                    len(t.chunks),
                    ",".join(map(str, t.ranks)) or "-",
                    " ".join(notes),
                ]
            )
        con.print(table("model tensors", ["key", "shape", "dtype", "numel", "chunks", "ranks", "notes"], rows))
        if len(ov.model) > max_rows:
            con.print(f"... {len(ov.model) - max_rows} more (use --filter, --depth or --json)")

    o = ov.optimizer
    con.print(
        f"optimizer   flavor {o.flavor or '-'}; state for {o.params_with_state}/{o.params_total} params; "
        f"implied type {o.implied_type or '-'}; declared type {o.declared_type or '-'}"
    )
    if o.fields:
        con.print(
            table(
                "optimizer state fields",
                ["field", "dtypes (params)"],
                [[f, ", ".join(f"{d} ({n})" for d, n in c.items())] for f, c in o.fields.items()],
            )
        )
    if o.param_groups:
        rows = []
        for g in o.param_groups:
            v = g.values
            state = "yes" if g.has_state else "no state (never stepped)"
            rows.append(
                [
                    g.id,
                    g.params,
                    _fmt(v["lr"]),
                    _fmt(v["weight_decay"]),
                    _fmt(v["betas"]),
                    _fmt(v["eps"]),
                    _fmt(v["initial_lr"]),
                    state,
                    ",".join(g.missing) or "-",
                ]
            )
        con.print(
            table(
                "param groups",
                ["group", "params", "lr", "weight_decay", "betas", "eps", "initial_lr", "state", "missing"],
                rows,
            )
        )
    if o.orphan_state:
        con.print(f"state for fqns not in the model: {', '.join(o.orphan_state[:10])}")

    lay = ov.layout
    if lay is not None:
        con.print(
            f"layout      version {lay.version} ({lay.layout}, {lay.source}), parallel {dict(lay.parallel)}, "
            f"{len(lay.extra_parallel)} EP tensors, global_step {lay.global_step}"
        )
        if lay.geometry is not None:
            rows_g = [g.to_dict() for g in lay.geometry]
            con.print(
                table("EP geometry", list(rows_g[0].keys()) if rows_g else [], [list(r.values()) for r in rows_g])
            )
        if lay.ambiguous:
            con.print(
                f"ambiguous   {len(lay.ambiguous)} EP tensors have EP and FSDP on the expert dim and no layout "
                "record: the expert order is unknown; declare it with --source-layout legacy|canonical "
                "--ep-size P --ep-fsdp-size F, or record it with `ckpttool stamp`"
            )
    elif ov.layout_error is not None:
        con.print(f"layout      error: [{ov.layout_error.code}] {ov.layout_error.message}")
    else:
        con.print("layout      none (unversioned)")
    for e in ov.extra_state:
        con.print(
            f"extra state {e.path} ({human_bytes(e.size)}, rank {e.rank}): {e.status}"
            + (f", keys {', '.join(e.keys)}" if e.keys else "")
        )
    if ov.byte_items:
        pg = [(k, n) for k, n in ov.byte_items if k.startswith("optimizer.param_groups.")]
        rest = [(k, n) for k, n in ov.byte_items if not k.startswith("optimizer.param_groups.")]
        if pg:
            con.print(f"byte items  {len(pg)} param-group items ({human_bytes(sum(n for _, n in pg))})")
        if rest:
            con.print(table("byte items", ["key", "bytes"], [[k, n] for k, n in rest[:max_rows]]))
    if ov.other_keys:
        con.print(f"other keys  {', '.join(ov.other_keys[:20])}")
