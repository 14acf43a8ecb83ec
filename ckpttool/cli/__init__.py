"""The CLI layer: the Typer app, shared options and parsers, the output sink, one module per command."""

import os

if "RANK" in os.environ:  # torchrun: a SIGTERM while the CLI loads is answered when the rank joins (E150)
    from ckpttool.ops.distributed import catch_early_stop

    catch_early_stop()

from ckpttool.cli.app import app, entry, main

__all__ = ["app", "entry", "main"]
