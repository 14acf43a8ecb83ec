"""The CLI layer: the Typer app (:mod:`.app`) and shell completion (:mod:`.completion`); the shared options, parsers
and output sink are :mod:`ckpttool.ui`, the commands :mod:`ckpttool.commands`."""

import os
import sys

if "RANK" in os.environ:  # torchrun: a SIGTERM while the CLI loads is answered when the rank joins (E150)
    from ckpttool.ops.distributed import catch_early_stop

    catch_early_stop()

try:
    from ckpttool.cli.app import app, entry, main
except KeyboardInterrupt:  # Ctrl-C while the program loads (``ckpttool`` imports this before ``entry`` runs)
    sys.stderr.write("error: interrupted\n")
    sys.exit(130)

__all__ = ["app", "entry", "main"]
