"""The CLI layer: the Typer app, shared options and parsers, the output sink, one module per command."""

import os

# numpy's OpenBLAS starts its threads spinning 2^28 cycles for work before they sleep: ~0.07 CPU s of every
# command that imports numpy (the CLI's hot paths use no BLAS). Read when OpenBLAS loads; a value set by the
# user is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

if "RANK" in os.environ:  # torchrun: a SIGTERM while the CLI loads is answered when the rank joins (E150)
    from ckpttool.ops.distributed import catch_early_stop

    catch_early_stop()

from ckpttool.cli.app import app, entry, main

__all__ = ["app", "entry", "main"]
