"""The CLI layer: the Typer app, shared options and parsers, the output sink, one module per command."""

from ckpttool.ops.distributed import catch_early_stop

catch_early_stop()  # torchrun: a SIGTERM while the CLI loads is answered when the rank joins (E150)

from ckpttool.cli.app import app, main  # noqa: E402

__all__ = ["app", "main"]
