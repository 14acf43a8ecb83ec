"""The CLI layer: the Typer app, shared options and parsers, the output sink, one module per command."""

from ckpttool.cli.app import app, main

__all__ = ["app", "main"]
