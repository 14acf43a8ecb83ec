"""The ``ckpttool`` command line: assembles the Typer app from ``ckpttool.commands``.

Exit codes (DESIGN.md section 4): 0 success; 1 the command ran and found
problems; 2 bad invocation or unreadable/unsafe input; 130 interrupted.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import typer

__all__ = ["app", "main"]

COMMANDS = ("inspect", "validate", "export", "reshard", "stamp", "replay_step", "sample")

app = typer.Typer(
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
) -> None:
    logging.getLogger("ckpttool").setLevel(logging.DEBUG if verbose else logging.WARNING)


def _register() -> None:
    for name in COMMANDS:
        importlib.import_module(f"ckpttool.commands.{name}").register(app)


_register()


def main() -> None:
    """Console-script entry point."""
    handler = logging.StreamHandler(sys.stderr)
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
