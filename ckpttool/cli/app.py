"""The ``ckpttool`` command line: assembles the Typer app from :mod:`ckpttool.commands`.

Exit codes (``docs/errors.md``): 0 success; 1 the command ran and found problems;
2 bad invocation or unreadable/unsafe input; 130 interrupted.

Global options (:data:`GLOBAL_OPTIONS`) are accepted before or after the subcommand
(``ckpttool -v inspect DIR`` = ``ckpttool inspect DIR -v``): ``-v/--verbose`` (repeatable),
``-q/--quiet``, ``--color auto|always|never``, ``--wide``, ``--no-progress``, ``--no-cache``; the
remote-storage options on the commands that take a URL. ``--version``, ``-h``, ``--json`` (the
command's own ``--json``) and the read caps ``--max-metadata-size``/``--max-object-size`` are root options; Typer's
``--install-completion``/``--show-completion`` install shell completion.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
import textwrap
import warnings
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup, TyperOption

from ckpttool.cli.completion import add_completions, install_completion
from ckpttool.errors import CkptError, UsageError
from ckpttool.ui.output import caused_by_interrupt, configure_logging, interrupted, print_error, stdout_write_error
from ckpttool.ui.render import UI

# torch warns once, as a Python warning, that ComplexHalf is experimental when a complex32 tensor is made (a chunk read
# into one): the commands read it exactly, so the line would only interrupt their output
warnings.filterwarnings("ignore", message="ComplexHalf support is experimental", category=UserWarning)

__all__ = ["app", "main", "entry", "version_text", "GLOBAL_OPTIONS"]

#: Command modules not named after their command (``import`` is a Python keyword).
_MODULE_OF = {"import": "import_hf"}
#: Each command's line in ``ckpttool --help``: the first line of its function's docstring (a test holds them
#: equal), here so that the root help imports no command module.
SUMMARIES = {
    "inspect": "Show what a checkpoint holds, from its metadata alone (reads no tensor data).",
    "validate": "Check a checkpoint with rules that have stable codes; exit 1 on findings that fail the run.",
    "export": "Export model weights as Hugging Face safetensors or a LoRA adapter (streaming, bit-exact by default).",
    "reshard": "Write a new DCP checkpoint with expert tensors in the target layout, one data file per target rank.",
    "stamp": "Write layout.json beside .metadata after checking the declaration against the chunk geometry.",
    "replay-step": "Replay the next optimizer step from the saved state on --device and compare with an independent "
    "reference.",
    "sample": "Write a tiny MoE causal LM checkpoint (HF Dots1 names, fused experts, a router buffer, layout record).",
    "rules": "List the rules of `ckpttool validate`: code, severity, what each checks (select them with "
    "--select/--ignore).",
    "schema": "Print the JSON Schema of a command's --json output (shipped in the package).",
    "diff": "Compare two checkpoints tensor by tensor in bounded memory, whatever their sharding or format.",
    "stats": "Streaming statistics of weights, FP32 masters and Adam moments, grouped per layer.",
    "manifest": "Digest every chunk and byte item (each byte read once) into manifest.json beside .metadata.",
    "import": "Import a Hugging Face safetensors model as a DCP checkpoint (streaming, bit-exact, atomic).",
}
#: The commands in ``--help`` order (:data:`SUMMARIES`' order). Each one's module in :mod:`ckpttool.commands`
#: (named after it, ``-`` spelled ``_``, but for :data:`_MODULE_OF`) defines ``<name>_command`` and its
#: ``EPILOG``; the module is imported only when its command runs, shows its help or completes
#: (:class:`_LazyCommands`).
COMMANDS = tuple(SUMMARIES)

# typer vendors click (typer._click); reach its exception classes through public names only
# (both derive from typer.TyperException, which types their exit_code and format_message).
_CLICK_USAGE_ERROR = next(
    c for c in typer.BadParameter.__mro__ if issubclass(c, typer.TyperException) and c.__name__ == "UsageError"
)
_CLICK_EXCEPTION = next(
    c for c in typer.BadParameter.__mro__ if issubclass(c, typer.TyperException) and c.__name__ == "ClickException"
)


class _HelpWrapper(textwrap.TextWrapper):
    """Wraps at spaces; a word longer than the whole column (``torch.load(weights_only=False)`` at 60
    columns) is split after a ``.``, ``/``, ``(`` or ``=`` (else after a ``_``), never inside a name, and never
    so that only punctuation is left at the end of a line (``prefix (`` above ``s3://...``: the word starts
    the next line instead); one with no such place runs past the column."""

    def _handle_long_word(self, reversed_chunks: list[str], cur_line: list[str], cur_len: int, width: int) -> None:
        chunk = reversed_chunks[-1]
        room = max(width - cur_len, 1)
        cut = max(chunk.rfind(c, 0, room) for c in "./(=") + 1 or chunk.rfind("_", 0, room) + 1
        if cut > 0 and not any(ch.isalnum() for ch in chunk[:cut]):  # a lone `(`: the word goes below instead
            cut = 0
        if cut > 0:
            cur_line.append(chunk[:cut])
            reversed_chunks[-1] = chunk[cut:]
        elif not cur_line:
            cur_line.append(reversed_chunks.pop())


#: The narrowest help layout (click's own floor is 50 columns) and the narrowest description column beside an
#: option's name: a narrower one puts each description below its name.
_MIN_HELP_WIDTH = 30
_MIN_DESCRIPTION = 20


_BASE_FORMATTER = typer.Context.formatter_class


class _HelpFormatter(_BASE_FORMATTER):  # type: ignore[misc,valid-type]
    """Help whose option descriptions never split a flag, path or choice name (``--source-layout``,
    ``torch-checkpointing``, ``docs/export.md``) inside a word, as click's wrapping does (at hyphens, and
    mid-word where a word does not fit): see :class:`_HelpWrapper`; a command's description paragraphs
    wrap the same way (click's ``write_text`` parted ``--ep-`` / ``size`` and ``bit-`` / ``exact``).

    A terminal narrower than click's floor of 50 columns gets its own width (every line of click's 50 wrapped
    again on a 40-column terminal), and where an option's description would have under
    :data:`_MIN_DESCRIPTION` columns beside its name it goes on the lines below it instead."""

    def __init__(self, indent_increment: int = 2, width: int | None = None, max_width: int | None = None) -> None:
        super().__init__(indent_increment, width, max_width)
        if width is None and getattr(sys.modules[_BASE_FORMATTER.__module__], "FORCED_WIDTH", None) is None:
            columns = shutil.get_terminal_size().columns  # click: max(min(columns, max_width) - 2, 50)
            self.width: int = min(self.width, max(min(columns, max_width or 80) - 2, _MIN_HELP_WIDTH))

    def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
        start = len(self.buffer)
        super().write_usage(prog, args, prefix)
        # click puts `Usage: ckpttool CMD ` on a line of its own where the arguments do not fit beside it
        self.buffer[start:] = [re.sub(r" +\n", "\n", "".join(self.buffer[start:]))]

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        out = []
        for paragraph in re.split(r"\n[ \t]*\n", text.expandtabs()):
            lines = paragraph.splitlines()
            if not lines:
                continue
            if lines[0].strip() == "\b":  # click's marker: printed as written
                out.append("\n".join(f"{indent}{line}" for line in lines[1:]))
                continue
            extra = " " * (len(lines[0]) - len(lines[0].lstrip()))
            wrapper = _HelpWrapper(
                max(self.width - len(indent) - len(extra), 11),
                replace_whitespace=False,
                break_on_hyphens=False,
            )
            out.append("\n".join(indent + extra + line for line in wrapper.wrap(" ".join(ln.strip() for ln in lines))))
        self.write("\n\n".join(out))
        self.write("\n")

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        for first, second in rows:
            self.write(f"{'':>{self.current_indent}}{first}")
            if not second:
                self.write("\n")
                continue
            width = self.width - first_col - 2
            if width < _MIN_DESCRIPTION:  # a narrow terminal: the description below the name, indented
                first_col, width = (
                    self.indent_increment * 2,
                    self.width - self.current_indent - self.indent_increment * 2,
                )
                self.write("\n" + " " * (first_col + self.current_indent))
            elif len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - len(first)))
            else:
                self.write("\n" + " " * (first_col + self.current_indent))
            lines = [
                line
                for paragraph in second.split("\n\n")
                for line in _HelpWrapper(width, replace_whitespace=False, break_on_hyphens=False).wrap(
                    " ".join(paragraph.splitlines())
                )
            ] or [""]
            self.write(f"{lines[0]}\n")
            for line in lines[1:]:
                self.write(f"{'':>{first_col + self.current_indent}}{line}\n")


class _Context(typer.Context):
    formatter_class = _HelpFormatter


_COLORS = ("auto", "always", "never")


def _set_verbose(ctx: Any, param: Any, value: int) -> None:
    if value:
        UI.verbosity = max(UI.verbosity, 0) + value
        configure_logging(UI.verbosity)


def _set_quiet(ctx: Any, param: Any, value: bool) -> None:
    if value:
        UI.verbosity = -1
        configure_logging(UI.verbosity)


def _set_color(ctx: Any, param: Any, value: str | None) -> None:
    if value is None:
        return
    if value not in _COLORS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(_COLORS)}.", ctx=ctx, param=param)
    UI.color = value


def _set_wide(ctx: Any, param: Any, value: bool) -> None:
    if value:
        UI.wide = True


def _set_json(ctx: Any, param: Any, value: bool) -> None:
    if value:
        UI.json = True


def _set_no_progress(ctx: Any, param: Any, value: bool) -> None:
    if value:
        UI.progress = False


def _set_storage_options(ctx: Any, param: Any, value: tuple[str, ...]) -> None:
    if value:
        from ckpttool.format import storage

        try:
            opts = storage.parse_storage_options(value)
        except CkptError as e:  # click names the option: not its library name again
            raise typer.BadParameter(e.message.removeprefix("`storage_options`: "), ctx=ctx, param=param) from None
        storage.configure(options={**storage.current().options, **opts})


def _set_remote(field: str) -> Any:
    def callback(ctx: Any, param: Any, value: int | None) -> None:
        if value is not None:
            from ckpttool.format import storage

            if value <= 0:
                raise typer.BadParameter(f"{param.opts[0]} {value} must be a positive count", ctx=ctx, param=param)
            storage.configure(**{field: value})

    return callback


def _set_spool_size(ctx: Any, param: Any, value: str | None) -> None:
    if value is not None:
        from ckpttool.format import storage
        from ckpttool.ui.options import parse_size

        try:
            storage.configure(spool_bytes=parse_size(value, "--remote-spool-size"))
        except CkptError as e:  # click names the option: not its library name again
            raise typer.BadParameter(e.message.removeprefix("`storage_options`: "), ctx=ctx, param=param) from None


def _set_no_cache(ctx: Any, param: Any, value: bool) -> None:
    if value:
        from ckpttool.format.cache import set_cache_enabled

        set_cache_enabled(False)


def _global(*decls: str, callback: Any, help: str, **kwargs: Any) -> TyperOption:
    """One global option: eager, handled by ``callback`` and never passed to the command function."""
    return TyperOption(
        param_decls=list(decls), expose_value=False, is_eager=True, callback=callback, help=help, **kwargs
    )


def _flag(*decls: str, callback: Any, help: str) -> TyperOption:
    """One global on/off flag (off by default)."""
    return _global(*decls, is_flag=True, default=False, callback=callback, help=help)


def _global_options() -> list[Any]:
    """The options every command accepts, before or after its name (not passed to command functions)."""
    return [
        _global(
            "-v",
            "--verbose",
            count=True,
            type=int,  # not click's IntRange(min=0): Typer's help would show it as "[x>=0]"
            default=0,
            callback=_set_verbose,
            help="Log decisions (schema, layout, dtype casts) and per-file timings to stderr; -vv: everything.",
        ),
        _flag(
            "-q",
            "--quiet",
            callback=_set_quiet,
            help="Only results, warnings and errors: no notes, no progress bars.",
        ),
        _global(
            "--color",
            default=None,
            metavar="<auto|always|never>",
            callback=_set_color,
            help="Colour severities and verdicts: auto (a terminal, unless NO_COLOR is set), always, never.",
        ),
        _flag(
            "--wide",
            callback=_set_wide,
            help="Never narrow tables to the terminal width (no hidden columns, no folded keys).",
        ),
        _flag(
            "--no-progress",
            callback=_set_no_progress,
            help="No progress bars (notes and results as usual); progress is drawn only on a terminal anyway.",
        ),
        _flag(
            "--no-cache",
            callback=_set_no_cache,
            help="Use neither the parsed-metadata cache nor the model-shape cache of the shape checks "
            "(CKPTTOOL_CACHE_DIR, default ~/.cache/ckpttool; also CKPTTOOL_NO_CACHE=1).",
        ),
    ]


#: The positive-count remote-storage options: flag, metavar, the :func:`ckpttool.format.storage.configure`
#: field it sets, help.
_REMOTE_COUNTS = (
    ("--remote-workers", "N", "workers", "Parallel range requests / uploads for URLs [default: 16]."),
    ("--remote-retries", "N", "retries", "Attempts per storage request on transient errors [default: 5]."),
    (
        "--remote-timeout",
        "SECONDS",
        "timeout_s",
        "Connect and read timeout of each storage request attempt [default: 20].",
    ),
)


def _remote_options() -> list[Any]:
    """The global options of remote storage (fsspec options, workers, retries, spool size): on the root and on
    the commands that read or write a URL (:func:`_takes_urls`)."""
    return [
        _global(
            "--storage-option",
            multiple=True,
            default=(),
            metavar="KEY=VALUE",
            callback=_set_storage_options,
            help="Option for the fsspec filesystem of a URL (repeatable; nested: client_kwargs.endpoint_url=URL). "
            "Never logged. docs/storage.md.",
        ),
        *(
            _global(flag, type=int, default=None, metavar=metavar, callback=_set_remote(field), help=help)
            for flag, metavar, field, help in _REMOTE_COUNTS
        ),
        _global(
            "--remote-spool-size",
            default=None,
            metavar="SIZE",
            callback=_set_spool_size,
            help="Chunk windows of a remote checkpoint an export holds on local disk at a time (4GiB, 500MB, ...) "
            "[default: 4GiB]. docs/storage.md.",
        ),
    ]


def _json_option() -> Any:
    """``ckpttool --json CMD``: the root's spelling of a command's ``--json`` (a command without one refuses it)."""
    return _flag(
        "--json",
        callback=_set_json,
        help="Write the command's result as one JSON document (= CMD --json).",
    )


#: Flags of the global options (accepted by every command; the remote-storage ones by those that take a URL).
GLOBAL_OPTIONS = (
    "-v",
    "--verbose",
    "-q",
    "--quiet",
    "--color",
    "--wide",
    "--no-progress",
    "--storage-option",
    "--remote-workers",
    "--remote-retries",
    "--remote-timeout",
    "--remote-spool-size",
    "--no-cache",
    "-h",
    "--help",
)
#: Old spellings that still work but are not shown in ``--help`` (docs/cli.md, "Deprecated spellings").
HIDDEN_ALIASES = frozenset({"--optimizer"})


def _takes_urls(cmd: Any) -> bool:
    """Whether a command has a CHECKPOINT/OUT argument that may be a URL (parsed by ``options.location`` or
    ``options.output_location``)."""
    from ckpttool.ui.options import location, output_location

    parsers = (location, output_location)
    return any(getattr(p.type, "func", None) in parsers for p in cmd.params if p.param_type_name == "argument")


#: The metavar of a path option: a directory, a file, else ``PATH`` (either).
_PATH_METAVARS = {
    "--optimizer-dir": "DIR",
    "--model-assets": "DIR",
    "--config": "FILE",
    "--junit": "FILE",
    "--grads": "FILE",
    "--rules": "FILE",
    "--adapter-config": "FILE",
    "--output": "FILE",
}


#: The metavar of a number or free-text option without one of its own (click's default is ``<int range>``).
_TYPE_METAVARS = {
    "IntRange": "N",
    "IntParamType": "N",
    "FloatRange": "X",
    "FloatParamType": "X",
    "StringParamType": "TEXT",
}
_TEXT_METAVARS = {
    "--model-prefix": "PREFIX",
    "--optimizer-prefix": "PREFIX",
    "--select": "CODES",
    "--ignore": "CODES",
    "--offload-patterns": "REGEX",
    "--tolerance": "RTOL,ATOL",
}


def _uppercase_metavars(cmd: Any) -> None:
    """Values are named in usage lines, help and errors in one style, uppercase: arguments ``CHECKPOINT``,
    ``HF_DIR``, ``OUT``, ``NAME``; path options ``DIR``, ``FILE`` or ``PATH`` (not ``<path>``)."""
    from ckpttool.ui.options import given_path

    for p in cmd.params:
        if p.metavar is not None or not p.name:
            continue
        if p.param_type_name == "argument":
            p.metavar = p.name.upper()
        elif type(p.type).__name__ == "TyperPath" or getattr(p.type, "func", None) is given_path:
            p.metavar = next((_PATH_METAVARS[o] for o in p.opts if o in _PATH_METAVARS), "PATH")
        elif not getattr(p, "count", False) and type(p.type).__name__ in _TYPE_METAVARS:
            named = next((_TEXT_METAVARS[o] for o in p.opts if o in _TEXT_METAVARS), None)
            p.metavar = named or _TYPE_METAVARS[type(p.type).__name__]


def _plain_usage(cmd: Any) -> None:
    """Usage lines name arguments as POSIX usage does: ``CHECKPOINT``, ``[NAME]``, ``CHECKPOINT...`` (one or
    more); typer writes a required one as ``{CHECKPOINT}`` (read as "one of") and drops the ``...``."""

    def collect_usage_pieces(ctx: Any) -> list[str]:
        pieces = [cmd.options_metavar] if cmd.options_metavar else []
        for p in cmd.get_params(ctx):
            if p.param_type_name != "argument":
                pieces.extend(p.get_usage_pieces(ctx))
                continue
            var = p.metavar or (p.name or "").upper()
            var += "..." if p.nargs != 1 and not var.endswith("...") else ""
            pieces.append(var if p.required or var.startswith("[") else f"[{var}]")
        return pieces

    cmd.collect_usage_pieces = collect_usage_pieces


def _optional_values(cmd: Any) -> None:
    """Options whose metavar is ``[VALUE]`` may be given without a value (``validate --manifest``): then
    the command receives ``""`` (click needs a value; typer has no ``flag_value`` for such options)."""
    flags = {o for p in cmd.params if (p.metavar or "").startswith("[") for o in getattr(p, "opts", ())}
    if not flags:
        return
    parse = cmd.parse_args

    def parse_args(ctx: Any, args: list[str]) -> Any:
        out: list[str] = []
        for i, a in enumerate(args):
            out.append(a)
            if a == "--":
                out.extend(args[i + 1 :])
                break
            if a in flags and (i + 1 == len(args) or args[i + 1].startswith("-")):
                out.append("")
        return parse(ctx, out)

    cmd.parse_args = parse_args


def _single_values(cmd: Any) -> None:
    """A command's option that takes one value, given twice (``--filter A --filter B``), is an error (E100): click
    keeps the last value silently, so the command would run on part of what was asked. Repeatable options, flags,
    counts and the global options (display settings a shell alias may set: the last wins) are left alone."""
    shared = {o for p in _global_options() for o in getattr(p, "opts", ())}
    takes: dict[str, Any] = {}  # every option string that takes a value -> its option
    for p in cmd.params:
        if p.param_type_name == "option" and not (p.is_flag or p.count):
            takes.update((o, p) for o in p.opts)
    single = {o: p for o, p in takes.items() if not p.multiple and not shared.intersection(p.opts)}
    if not single:
        return
    parse = cmd.parse_args

    def parse_args(ctx: Any, args: list[str]) -> Any:
        args, rest = list(args), parse(ctx, args)  # click's parser consumes the list it is given
        given: dict[str, list[str]] = {}
        i, n = 0, args.index("--") if "--" in args else len(args)
        while i < n:
            name, eq, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
            p = takes.get(name)
            if (
                p is not None
                and not eq
                and i + 1 < n
                and not ((p.metavar or "").startswith("[") and args[i + 1][:1] == "-")
            ):
                value, i = (
                    args[i + 1],
                    i + 1,
                )  # its value (click's rule: an option's next word), never read as an option
            if name in single:
                given.setdefault(single[name].name, []).append(value)
            i += 1
        for p in cmd.params:
            if len(given.get(p.name, ())) > 1:
                values = ", ".join(repr(v) for v in given[p.name])
                raise typer.BadParameter(
                    f"given {len(given[p.name])} times ({values}); it takes one value", ctx=ctx, param=p
                )
        return rest

    cmd.parse_args = parse_args


def _summary(cmd: Any) -> None:
    """The command's line in ``ckpttool --help``: its docstring's first line whole (click would cut it with "...")."""
    if cmd.help and not cmd.short_help:
        cmd.short_help = cmd.help.strip().splitlines()[0]


def _hide_aliases(cmd: Any) -> None:
    """Leave :data:`HIDDEN_ALIASES` out of the help, the completions and the error messages of ``cmd``'s options
    (they still parse)."""
    complete = cmd.shell_complete
    cmd.shell_complete = lambda ctx, incomplete: [
        c for c in complete(ctx, incomplete) if getattr(c, "value", c) not in HIDDEN_ALIASES
    ]
    for p in cmd.params:
        opts = getattr(p, "opts", [])
        if len(opts) > 1 and HIDDEN_ALIASES.intersection(opts):
            shown = [o for o in opts if o not in HIDDEN_ALIASES]

            def record(ctx: Any, p: Any = p, shown: list[str] = shown) -> Any:
                opts = p.opts
                p.opts = shown
                try:
                    return type(p).get_help_record(p, ctx)
                finally:
                    p.opts = opts

            p.get_help_record = record
            # errors name the option as the help does: `Invalid value for '--optimizer-type'`
            p.get_error_hint = lambda ctx, shown=shown: " / ".join(f"'{o}'" for o in shown)
    # a hidden alias still parses but is removed in the next release (docs/cli.md): say so, as the
    # deprecated `replay-step --select` and `sample --steps` do (`--optimizer` was taken silently)
    new_name = {
        o: next(x for x in p.opts if x not in HIDDEN_ALIASES)
        for p in cmd.params
        for o in getattr(p, "opts", ())
        if o in HIDDEN_ALIASES and len(p.opts) > 1
    }
    if not new_name:
        return
    parse = cmd.parse_args

    def parse_args(ctx: Any, args: list[str]) -> Any:
        given = args[: args.index("--")] if "--" in args else args
        used = [o for o in new_name if any(a == o or a.startswith(f"{o}=") for a in given)]
        rest = parse(ctx, args)
        from ckpttool.ui.output import deprecated

        for o in used:
            deprecated(f"{cmd.name} {o}", new_name[o])
        return rest

    cmd.parse_args = parse_args


_CHOICES_RE = re.compile(r"<([^<>]*\|[^<>]*)>")


def _fold_long_choices(cmd: Any) -> None:
    """An option whose ``<a|b|...>`` metavar does not fit the terminal (``--schema`` at 60 columns) is shown as
    ``--schema SCHEMA`` with ``One of: a, b, ...`` at the end of its help, which wraps; a terminal it fits keeps
    the choices in place."""
    for p in cmd.params:
        if p.param_type_name != "option":
            continue

        def record(ctx: Any, p: Any = p, shown: Any = p.get_help_record) -> Any:
            rec = shown(ctx)
            if rec is None:
                return rec
            opts, text = rec
            m = _CHOICES_RE.search(opts)
            if m is None or len(opts) + 2 <= (ctx.terminal_width or shutil.get_terminal_size().columns):
                return rec
            name = max(p.opts, key=len).lstrip("-").rsplit("-", 1)[-1].upper()
            main, sep, default = text.partition("  [default: ")  # the choices before click's default note
            choices = f"{main} One of: {', '.join(m.group(1).split('|'))}.".lstrip()
            return opts.replace(m.group(0), name), choices + sep + default

        p.get_help_record = record


def version_text() -> str:
    """``ckpttool 0.1.0 (torch 2.13.0, safetensors 0.8.0, Python 3.11.9)``, from package metadata.

    Read with :mod:`importlib.metadata`: printing versions never imports torch.
    """
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    py = ".".join(map(str, sys.version_info[:3]))
    return f"ckpttool {v('ckpttool')} (torch {v('torch')}, safetensors {v('safetensors')}, Python {py})"


def _load_command(name: str) -> Any:
    """The click command of ``name``: its module imported, its signature converted by Typer, then given the
    global options (and the remote ones where it takes a URL), uppercase metavars, its summary, completions."""
    from typer.main import get_command_from_info
    from typer.models import CommandInfo

    stem = name.replace("-", "_")
    module = importlib.import_module(f"ckpttool.commands.{_MODULE_OF.get(name, stem)}")
    info = CommandInfo(name=name, callback=getattr(module, f"{stem}_command"), epilog=module.EPILOG)
    cmd = get_command_from_info(info, pretty_exceptions_short=app.pretty_exceptions_short, rich_markup_mode=None)
    cmd.context_class = _Context
    cmd.params.extend(_global_options())
    if _takes_urls(cmd):
        cmd.params.extend(_remote_options())
    _hide_aliases(cmd)
    _fold_long_choices(cmd)
    _uppercase_metavars(cmd)
    _plain_usage(cmd)
    _optional_values(cmd)
    _single_values(cmd)
    _summary(cmd)
    _json_schema_help(cmd, name)
    add_completions(cmd)
    return cmd


#: The ``ckpttool schema`` names of a command's ``--json`` documents beyond its own name.
_MORE_SCHEMAS = {"manifest": "; with --verify: `ckpttool schema manifest-check`"}


def _json_schema_help(cmd: Any, name: str) -> None:
    """``--json``'s help names the ``ckpttool schema`` command line of this command's documents (not ``CMD``)."""
    for p in cmd.params:
        if p.name == "json_output" and p.help:
            p.help = p.help.replace("`ckpttool schema CMD`", f"`ckpttool schema {name}`{_MORE_SCHEMAS.get(name, '')}")


class _LazyCommands(MutableMapping[str, Any]):
    """The root group's ``commands``: every name of :data:`COMMANDS` is listed (in that order), a command is
    built (:func:`_load_command`) on first lookup; ``name in commands`` loads nothing."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            if name not in COMMANDS:
                raise KeyError(name)
            self._loaded[name] = _load_command(name)
        return self._loaded[name]

    def __setitem__(self, name: str, cmd: Any) -> None:
        self._loaded[name] = cmd

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in COMMANDS or name in self._loaded

    def __iter__(self) -> Iterator[str]:
        yield from COMMANDS
        yield from (n for n in self._loaded if n not in COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS) + sum(n not in COMMANDS for n in self._loaded)


class _Interrupted(BaseException):
    """Ctrl-C outside a command's own handling (parsing the arguments, importing the command's modules),
    carried past Typer, which turns a ``KeyboardInterrupt`` there into a silent exit 130."""


_TYPE_NAMES = {"int range": "an integer", "int": "an integer", "float range": "a number", "float": "a number"}


def _plain_type_names(message: str) -> str:
    """click names a bounded option's type as it is built: `--world-size 2.5` read "'2.5' is not a valid int
    range.", as if a range (`1-4`) were asked for; the value is an integer (a number for a float)."""
    return re.sub(
        r"is not a valid (int range|float range|int|float)\.", lambda m: f"is not {_TYPE_NAMES[m[1]]}.", message
    )


#: The shells Typer writes a completion script for.
COMPLETION_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _completion_help(cmd: Any) -> None:
    """Typer's help of ``--install-completion`` / ``--show-completion`` names only the shell ckpttool runs in; both
    also take a SHELL (:func:`_named_shell_completion`), which the help names with the shells it takes."""
    shells = ", ".join(COMPLETION_SHELLS)
    helps = {
        "install_completion": f"Install completion for the current shell, or for the SHELL given after the flag "
        f"({shells}).",
        "show_completion": "Show completion for the current shell, or for the SHELL given after the flag, to copy "
        "it or customize the installation.",
    }
    for p in cmd.params:
        if p.name in helps:
            p.help = helps[p.name]


def _named_shell_completion(argv: list[str]) -> str | None:
    """What ``ckpttool --show-completion SHELL`` / ``--install-completion SHELL`` print for the shell named: its
    completion script, or where it was installed (``None``: not such a command line). Typer's flags detect the
    running shell and took a shell named after them for no argument at all: ``--show-completion zsh`` run from
    bash printed bash's script, ``--install-completion zsh`` installed bash's, ``tcsh`` too; with another word
    (``--install-completion zsh -q``) Typer installed the running shell's as well, rewriting ``~/.bashrc``.

    Raises:
        UsageError: a shell Typer writes no script for, or other arguments beside the flag and its SHELL.
    """
    flags = ("--show-completion", "--install-completion")
    at = next((i for i, a in enumerate(argv) if a in flags), None)
    if at is None or any(not a.startswith("-") for a in argv[:at]):  # a command's argument or option: not ours
        return None
    flag, shell = argv[at], argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
    others = argv[:at] + argv[at + 1 + (shell is not None) :]
    if others:  # Typer took `--install-completion zsh -q` as the running shell's install, the name dropped
        raise UsageError(
            f"{flag} takes a SHELL and nothing else: {' '.join(others)!r} given with it",
            hint=f"run `ckpttool {flag} [SHELL]` alone",
        )
    if shell is None and flag == "--show-completion":
        return None  # Typer's: the script of the shell detected
    if shell is None:  # Typer's install of the shell detected rewrote ~/.bashrc: ours appends
        from typer._completion_shared import _get_shell_name

        shell = _get_shell_name()
        if shell is None:
            raise UsageError(
                "--install-completion: the shell ckpttool runs in was not detected",
                hint=f"name it: --install-completion SHELL, one of {', '.join(COMPLETION_SHELLS)}",
            )
    if shell not in COMPLETION_SHELLS:
        raise UsageError(
            f"{flag} {shell}: no completion script for this shell",
            hint=f"name one of {', '.join(COMPLETION_SHELLS)}, or none for the shell ckpttool runs in",
        )
    if flag == "--show-completion":
        from typer._completion_shared import get_completion_script

        return get_completion_script(prog_name="ckpttool", complete_var="_CKPTTOOL_COMPLETE", shell=shell)
    path = install_completion(shell)  # appends to ~/.bashrc / ~/.zshrc, never rewrites them
    return f"{shell} completion installed in {path}\nCompletion will take effect once you restart the terminal"


def _print_help(text: str) -> int:
    """Print ``text`` (the help ``ckpttool`` alone shows) and return the exit code: 0, also when the reader of
    stdout went away; 2 with :func:`~ckpttool.ui.output.stdout_write_error`'s line when stdout could not be written."""
    from ckpttool.ui.output import _silence_stdout

    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    except OSError as e:
        print_error(stdout_write_error(e))
        return 2
    return 0


def _closed_stdout() -> NoReturn:
    """The reader of stdout went away while help or the version was printed: stop quietly with 0, as a
    command's output does (docs/errors.md); click's own handling exits 1."""
    from ckpttool.ui.output import _silence_stdout

    _silence_stdout()
    raise typer.Exit(0)


#: Options of ``ckpttool`` itself that no command takes (docs/cli.md: "before the command name only"), with
#: their value's metavar ("" for a flag).
_ROOT_ONLY = {"--max-metadata-size": " SIZE", "--max-object-size": " SIZE", "-V": "", "--version": ""}


#: Options of ``ckpttool`` itself that print something and exit, given after a command name (no command takes them).
_ROOT_FLAGS = ("--install-completion", "--show-completion")


_AFTER_COMMAND = "ckpttool.after_command"


def _word_for_flag_hint(message: str, ctx: Any) -> str | None:
    """The hint of ``ckpttool version`` / ``ckpttool help [CMD]``, words other CLIs take as commands (click's
    "No such command 'version'." found no near name to suggest): the flag that does it; ``None`` otherwise."""
    m = re.fullmatch(r"No such command '(version|help)'\.", message)
    if m is None:
        return None
    if m[1] == "version":
        return "the versions are printed by `ckpttool --version` (-V)"
    after = list(ctx.meta.get(_AFTER_COMMAND, ())) if ctx is not None else []
    command = after[0] if after and after[0] in COMMANDS else None
    return f"a command's help is `ckpttool {command} --help`" if command else "help is `ckpttool --help` (-h)"


def _usage_error(e: Any, ctx: Any) -> UsageError:
    """Click's usage error ``e`` as ckpttool's E100; a root-only option given after the command name
    (``ckpttool inspect DIR --max-object-size 1GiB``, ``ckpttool validate DIR -V``) is named as such, with where
    it goes."""
    where = ctx.command_path if ctx is not None else "ckpttool"
    option = getattr(e, "option_name", None)
    if type(e).__name__ == "NoSuchOption" and option in _ROOT_ONLY and ctx is not None and ctx.parent is not None:
        return UsageError(
            f"{option} is an option of ckpttool itself, given after the command name",
            hint=f"put it before the command: `ckpttool {option}{_ROOT_ONLY[option]} {ctx.info_name} ...`"
            if _ROOT_ONLY[option]
            else f"put it before the command: `ckpttool {option}` (it prints the versions and exits)",
        )
    if type(e).__name__ == "NoSuchOption" and option in _ROOT_FLAGS and ctx is not None and ctx.parent is not None:
        return UsageError(
            f"{option} is an option of ckpttool itself, given after the command name",
            hint=f"run `ckpttool {option} [SHELL]` alone",
        )
    flag_hint = _word_for_flag_hint(e.format_message(), ctx)
    if flag_hint is not None:
        return UsageError(e.format_message(), hint=flag_hint)
    if type(e).__name__ == "NoSuchOption" and option == "--json" and ctx is not None and ctx.parent is not None:
        # as `ckpttool --json CMD` says it (was click's "No such option: --json")
        return UsageError(f"`{where}` has no JSON output (--json)", hint=f"see `{where} --help`")
    return UsageError(_plain_type_names(e.format_message()), hint=f"see `{where} --help`")


class CkptGroup(TyperGroup):
    """The root command group: usage errors follow ckpttool's error contract.

    Click prints its own ``Usage: ... Error: ...`` block for a bad option; ckpttool
    prints ``error: [E100] <click's message>`` and ``hint: see `ckpttool CMD --help```
    on stderr and exits 2, like every other bad invocation.
    Bare ``ckpttool`` prints the help and exits 0. Every command gets the global options.
    Commands load lazily (:class:`_LazyCommands`): the root ``--help`` lists :data:`SUMMARIES`.
    """

    context_class = _Context

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _LazyCommands()  # the stand-ins Typer built from app.registered_commands are dropped
        self.params.extend([*_global_options(), *_remote_options(), _json_option()])
        add_completions(self)
        _uppercase_metavars(self)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """The ``Commands:`` section of the root help, from :data:`SUMMARIES` (no command module imported)."""
        rows = [(name, SUMMARIES[name]) for name in COMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt as e:
            raise _Interrupted from e
        except BrokenPipeError:
            _closed_stdout()  # `ckpttool --help | ...`, `-V`: the reader went away

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise _Interrupted from e
        except BrokenPipeError:
            _closed_stdout()  # `ckpttool CMD --help | ...` (a command's own output: its command_boundary)
        except _CLICK_USAGE_ERROR as e:
            # click raises some errors of a command's arguments without its context (`Option '--filter'
            # requires an argument.`): the hint then names the command's --help, not the root's
            error: Any = e  # click's UsageError(message, ctx)
            if error.ctx is None and ctx.invoked_subcommand:
                name = ctx.invoked_subcommand
                error.ctx = self.context_class(self.commands[name], info_name=name, parent=ctx)
            raise

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        ctx.meta[_AFTER_COMMAND] = args[1:]  # what follows a word that is no command (`help inspect`)
        name, cmd, rest = super().resolve_command(ctx, args)
        # `schema NAME` prints a JSON Schema anyway
        if UI.json and cmd is not None and name != "schema" and not any(p.name == "json_output" for p in cmd.params):
            usage_error: Any = _CLICK_USAGE_ERROR  # click's UsageError(message, ctx)
            sub_ctx = self.context_class(cmd, info_name=name, parent=ctx)  # the hint names `ckpttool NAME --help`
            raise usage_error(f"`ckpttool {name}` has no JSON output (--json)", ctx=sub_ctx)
        return name, cmd, rest

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        UI.reset()  # one invocation's settings (tests run many in one process)
        storage = sys.modules.get("ckpttool.format.storage")  # not loaded yet: its defaults are in force
        if storage is not None:
            storage.configure(options={}, workers=16, retries=5)
        cache = sys.modules.get("ckpttool.format.cache")  # --no-cache of an earlier invocation is not this one's
        if cache is not None:
            cache.set_cache_enabled(None)
        atomic = sys.modules.get("ckpttool.format.atomic")  # an interrupt names this invocation's outputs only
        if atomic is not None:
            atomic.forget_published()
        configure_logging(0)
        _completion_help(self)  # Typer appends its completion flags after the group is built
        try:
            script = _named_shell_completion(sys.argv[1:] if args is None else list(args))
            rv = (
                _print_help(script)
                if script is not None
                else super().main(
                    args,
                    prog_name,
                    complete_var,
                    standalone_mode=False,
                    windows_expand_args=windows_expand_args,
                    **extra,
                )
            )
            code = rv if isinstance(rv, int) else 0
        except _CLICK_EXCEPTION as e:
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
                code = _print_help(ctx.get_help())
            else:
                print_error(_usage_error(e, ctx))
                code = 2 if isinstance(e, _CLICK_USAGE_ERROR) else e.exit_code
        except CkptError as e:  # a parameter type's own coded refusal (ui.options.location: a URL with a '//' key)
            print_error(e)
            code = e.exit_code
        except typer.Abort:
            sys.stderr.write("error: interrupted\n")
            code = 130
        except OSError as e:
            if e.filename is not None:  # not a write to stdout
                raise
            print_error(stdout_write_error(e))  # help or the version printed to a full stdout (`> /dev/full`)
            code = 2
        except _Interrupted:
            raise KeyboardInterrupt from None  # the caller's Ctrl-C handling (:func:`_run`: its line, exit 130)
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=CkptGroup,
    name="ckpttool",
    help="Inspect, validate, export, reshard and replay PyTorch Distributed Checkpoints (FSDP2 / expert parallel).",
    epilog="\b\nDocs:         https://github.com/ckpttool/ckpttool#readme\n"
    "JSON schemas: ckpttool schema\nRules:        ckpttool rules",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(version_text() + "\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        is_eager=True,
        callback=_show_version,
        help="Print the versions of ckpttool, torch and safetensors and exit.",
    ),
    max_metadata_size: str = typer.Option(
        "1GiB", "--max-metadata-size", metavar="SIZE", help="Largest .metadata file read (docs/security.md, 'Caps')."
    ),
    max_object_size: str = typer.Option(
        "256MiB",
        "--max-object-size",
        metavar="SIZE",
        help="Largest byte item, extra_state file, JSON file or decoded data.pkl read (docs/security.md, 'Caps').",
    ),
) -> None:
    """Inspect, validate, export, reshard and replay PyTorch Distributed Checkpoints (FSDP2 / expert parallel)."""
    from ckpttool.format.limits import set_limits
    from ckpttool.ui.options import parse_size

    try:
        caps = {
            "max_metadata_bytes": parse_size(max_metadata_size, "--max-metadata-size"),
            "max_object_bytes": parse_size(max_object_size, "--max-object-size"),
        }
    except UsageError as e:
        print_error(e)
        raise typer.Exit(e.exit_code) from None
    set_limits(**caps)


def _register() -> None:
    """Register each command with Typer as a stand-in (name and summary; ``app.registered_commands`` lists
    them): :class:`CkptGroup` replaces them with :class:`_LazyCommands`, which imports a command's module
    only when it is used."""
    for name in COMMANDS:

        def stand_in() -> None:
            raise AssertionError("replaced by CkptGroup's lazy commands")

        stand_in.__doc__ = SUMMARIES[name]
        app.command(name)(stand_in)


_register()


def _unraisable(info: Any) -> None:
    """Errors in finalizers (``__del__``) caused by an interrupt are not printed.

    The handler's exception may land in a finalizer, or cut an object's ``__init__`` short
    so that its ``__del__`` fails later (``ZipFile`` without ``_writing``). Either way
    ``AtomicOutputDir`` has seen the signal and acts on it (exit 130, no output).
    """
    output = sys.modules.get("ckpttool.format.atomic")
    if isinstance(info.exc_value, KeyboardInterrupt) or (output is not None and output.signal_received()):
        return
    sys.__unraisablehook__(info)


def _join_distributed() -> Any:
    """Under torchrun (several ranks): join the gloo group; ranks other than 0 print nothing (docs/performance.md)."""
    if "RANK" not in os.environ:  # not started by a launcher (distributed.in_torchrun needs RANK): import nothing
        return None
    from ckpttool.ops import distributed

    if not distributed.in_torchrun():
        return None
    try:
        group = distributed.from_env()
    except CkptError as e:  # UsageError; RankLostError (E150): a rank ended before every rank joined
        print_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    distributed.set_current(group)
    if not group.is_root and not os.environ.get("CKPTTOOL_DEBUG"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        sys.stdout.flush()
        sys.stderr.flush()
        group.stderr_fd = os.dup(2)  # kept for the lines every surviving rank prints (a lost rank: E150)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    return group


def _refuse_removed_cwd() -> None:
    """A shell left in a removed directory (removed from another shell): a relative path names nothing
    there and ``import torch`` aborts the process (oneMKL's ``FATAL ERROR: Cannot load libtorch_cpu.so``,
    exit 2, no code). Every command is refused with one line (E100, exit 2) before it reads anything."""
    try:
        os.getcwd()
    except FileNotFoundError:
        err = UsageError(
            "the current directory no longer exists (it was removed after this shell entered it)",
            hint="cd to an existing directory and run the command again",
        )
        print_error(err)
        sys.exit(err.exit_code)


#: Error handlers of a text stream that raise on a character its encoding cannot hold (``surrogateescape``,
#: Python's for stdout and stderr in the C/POSIX locale, encodes only the surrogates it decoded itself).
_RAISING_ERRORS = ("strict", "surrogateescape")


def _open_closed_streams() -> None:
    """A program started with stdout or stderr closed (``ckpttool ... >&-``; Python sets ``sys.stdout`` to
    ``None``) writes that stream to ``/dev/null``: every print failed (E999, or exit 1 with no line),
    not the verdict's exit code. The descriptor is taken too, so that no file the command opens gets
    descriptor 1 or 2 and a stray write lands in an output. An open stream escapes what its encoding
    cannot hold (``backslashreplace``, as Python's own stderr does)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # kept until the exit
        elif callable(getattr(stream, "reconfigure", None)) and getattr(stream, "errors", None) in _RAISING_ERRORS:
            # a stream that cannot encode every character (PYTHONIOENCODING=ascii, a cp1252 console, LC_ALL=C
            # with PYTHONUTF8=0, whose 'surrogateescape' raises on any other character): a key's 'é' is written
            # as \xe9, not an E999 after half of the output
            stream.reconfigure(errors="backslashreplace")


class _NumpyBeforeTorch:
    """A ``sys.meta_path`` finder that imports numpy just before the first ``import torch``, then leaves.

    torch's extension imports numpy as it loads and drops any exception that import raises (numpy is
    optional to torch): a Ctrl-C landing there was lost, the command ran on and ended with exit 0, or
    with E999 (``cannot load module more than once per process``) where it imported numpy itself. numpy
    imported first gets the interrupt to the command (exit 130); torch imports numpy anyway, so this
    costs nothing, and a command that imports no torch imports no numpy."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                import numpy  # noqa: F401
            except ImportError:  # torch without numpy: its own concern
                pass
        return None


def main() -> None:
    """Console-script entry point (also ``python -m ckpttool``; under torchrun, one rank of a distributed run)."""
    sys.unraisablehook = _unraisable
    if "torch" not in sys.modules and not any(isinstance(f, _NumpyBeforeTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _NumpyBeforeTorch())
    _open_closed_streams()
    _refuse_removed_cwd()
    group = _join_distributed()
    if group is None:
        _run()
        return
    try:
        _run()
        code: Any = 0
    except SystemExit as e:
        code = e.code
    finally:
        group.close()
    # A torchrun rank leaves without the interpreter's teardown of torch (a fixed cost of every run,
    # docs/performance.md): the command has finished (output committed or removed, files closed).
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    # torchrun stops the other ranks (SIGTERM) as soon as one exits non-zero: every rank records its
    # exit in the store and leaves once every other rank did (or is found lost), so that none is
    # stopped before it printed its error and removed what it created
    group.finish(0 if code is None else int(code))
    _say_lost(group)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else int(code))


def entry() -> None:
    """The ``ckpttool`` program (console script, ``python -m ckpttool``): :func:`main`, then the process
    leaves without the interpreter's teardown of its modules and objects (~11% of ``--help``'s
    instructions, ~6% of ``inspect``'s; docs/performance.md, "Start-up").

    It leaves that way only when nothing is left to finish: every other non-daemon thread has ended (the
    pool's, told to end by ``_run``, are joined for up to a second each) and stdout and stderr flush; the
    ``atexit`` handlers (``logging.shutdown``, a library's) run first. Otherwise the exit is the
    interpreter's own (``sys.exit``). A Ctrl-C as the command ends (its pool told to end, those threads joined)
    is answered as one during the command (``error: interrupted``, saying so where the output was already
    written; exit 130), not with a traceback. :func:`main` raises ``SystemExit`` (for callers that go on).

    numpy's OpenBLAS threads spin 2^28 cycles for work before they sleep (~0.07 CPU s of a command that
    imports numpy; only the LoRA merge multiplies matrices): the program sets ``OPENBLAS_THREAD_TIMEOUT``
    before numpy loads, keeping a value the user set. A library caller's environment is left alone.
    """
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        main()
        code: Any = 0
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C as the command ended (while ``_run`` told the pool's threads to end)
        code = interrupted()
    try:
        ended = _threads_ended() and _flushed()
    except KeyboardInterrupt:  # Ctrl-C while a finished command's threads end: its line (once), exit 130
        sys.exit(code if code == 130 else interrupted())
    if not ended:
        sys.exit(code)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed as the interpreter does, status 1
        sys.stderr.write(f"{code}\n")
        code = 1
    import atexit

    atexit._run_exitfuncs()
    if not _flushed():
        sys.exit(code)
    os._exit(code & 0xFF)  # the status the interpreter's exit gives (and no OverflowError past a C int)


def _threads_ended() -> bool:
    """Join the non-daemon threads but the main one, each for up to a second: whether all have ended."""
    threading = sys.modules.get("threading")
    if threading is None:
        return True
    for t in threading.enumerate():
        if not t.daemon and t is not threading.main_thread():
            try:
                t.join(timeout=1.0)
            except RuntimeError:  # its start() was cut short by a signal (SIGINT): not joinable, left to the exit
                return False
            if t.is_alive():
                return False
    return True


def _flushed() -> bool:
    """Whether stdout and stderr flushed without error (a closed pipe is left to the interpreter's exit)."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        return False
    return True


def _say_lost(group: Any) -> None:
    """A torchrun rank whose peer was lost: the E150 line (ranks other than 0, whose stderr is
    silenced; rank 0 printed it already), or the note that the published output is complete."""
    fd = group.stderr_fd
    lines = []
    if group.lost_error is not None and fd is not None:
        lines.append(f"error: [{group.lost_error.code}] {group.lost_error.message}")
    if group.note is not None:
        lines.append(f"note: {group.note}")
    text = "".join(line + "\n" for line in lines)
    if not text:
        return
    if fd is not None:
        os.write(fd, text.encode())
    else:
        sys.stderr.write(text)


def _run() -> None:
    try:
        app(prog_name="ckpttool")
    except KeyboardInterrupt:
        sys.exit(interrupted())
    except Exception as e:
        if not caused_by_interrupt(e):
            raise
        # a Ctrl-C wrapped in a RuntimeError while a module loaded (parsing, a command's import)
        sys.exit(interrupted())
    finally:
        pool = sys.modules.get("ckpttool.engine.pool")  # loaded only by commands that used it
        if pool is not None:
            pool.shutdown()  # no idle worker thread may hold up the interpreter's exit
