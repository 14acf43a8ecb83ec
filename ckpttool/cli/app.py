"""The ``ckpttool`` command line: assembles the Typer app from :mod:`ckpttool.cli.commands`.

Exit codes (``docs/errors.md``): 0 success; 1 the command ran and found problems;
2 bad invocation or unreadable/unsafe input; 130 interrupted.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

from ckpttool.cli.output import print_error, sanitized
from ckpttool.errors import UsageError

__all__ = ["app", "main"]

COMMANDS = ("inspect", "validate", "export", "reshard", "stamp", "replay_step", "sample")

# typer vendors click (typer._click); reach its exception classes through public names only
# (both derive from typer.TyperException, which types their exit_code and format_message).
_CLICK_USAGE_ERROR = next(
    c for c in typer.BadParameter.__mro__ if issubclass(c, typer.TyperException) and c.__name__ == "UsageError"
)
_CLICK_EXCEPTION = next(
    c for c in typer.BadParameter.__mro__ if issubclass(c, typer.TyperException) and c.__name__ == "ClickException"
)


class CkptGroup(TyperGroup):
    """The root command group: usage errors follow ckpttool's error contract.

    Click prints its own ``Usage: ... Error: ...`` block for a bad option; ckpttool
    prints ``error: [E100] <click's message>`` and ``hint: see `ckpttool CMD --help```
    on stderr and exits 2, like every other bad invocation.
    Bare ``ckpttool`` prints the help and exits 0.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(
                args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra
            )
            code = rv if isinstance(rv, int) else 0
        except _CLICK_EXCEPTION as e:
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
                sys.stdout.write(ctx.get_help() + "\n")
                code = 0
            else:
                where = ctx.command_path if ctx is not None else "ckpttool"
                print_error(UsageError(e.format_message(), hint=f"see `{where} --help`"))
                code = 2 if isinstance(e, _CLICK_USAGE_ERROR) else e.exit_code
        except typer.Abort:
            sys.stderr.write("error: interrupted\n")
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=CkptGroup,
    name="ckpttool",
    help="Inspect, validate, export, reshard and replay PyTorch Distributed Checkpoints (FSDP2 / expert parallel).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details to stderr."),
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
    from ckpttool.cli.options import parse_size
    from ckpttool.format.limits import set_limits

    logging.getLogger("ckpttool").setLevel(logging.DEBUG if verbose else logging.WARNING)
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
    for name in COMMANDS:
        importlib.import_module(f"ckpttool.cli.commands.{name}").register(app)


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


def main() -> None:
    """Console-script entry point."""
    sys.unraisablehook = _unraisable
    handler = logging.StreamHandler(sanitized(sys.stderr))  # log records pass the output sink's escaping
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    logger = logging.getLogger("ckpttool")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    if os.environ.get("NO_COLOR"):
        os.environ.setdefault("TERM", "dumb")
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
