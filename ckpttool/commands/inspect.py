"""``ckpttool inspect DIR``: metadata-only overview."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from ._options import (
    CheckpointArg,
    EpFsdpSizeOpt,
    EpSizeOpt,
    FilterOpt,
    JsonOpt,
    SourceLayoutOpt,
    TrustPickleOpt,
    command_boundary,
    emit_json,
)


class SortKey(str, Enum):
    name = "name"
    size = "size"


@command_boundary
def inspect_command(
    checkpoint: CheckpointArg,
    json_output: JsonOpt = False,
    filter_glob: FilterOpt = None,
    depth: Annotated[int | None, typer.Option("--depth", min=1, help="Group model tensors into a tree by the first N key components.")] = None,
    sort: Annotated[SortKey, typer.Option("--sort", help="Order of tensor rows.")] = SortKey.name,
    trust_pickle: TrustPickleOpt = False,
    source_layout: SourceLayoutOpt = None,
    ep_size: EpSizeOpt = None,
    ep_fsdp_size: EpFsdpSizeOpt = None,
) -> None:
    """Show what a checkpoint holds, from .metadata alone (reads no tensor data)."""
    from ..layouts.declare import LayoutDeclaration
    from ..overview import build_overview

    decl = LayoutDeclaration.from_options(source_layout, ep_size, ep_fsdp_size)
    ov = build_overview(checkpoint, filter_glob=filter_glob, depth=depth, sort=sort.value, trust_pickle=trust_pickle,
                        declaration=decl)
    if json_output:
        emit_json(ov)
    else:
        from ..render import render_overview

        render_overview(ov)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)
