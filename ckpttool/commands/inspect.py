"""``ckpttool inspect DIR``: metadata-only overview."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.ui.options import (
    CheckpointArg,
    EpFsdpSizeOpt,
    EpSizeOpt,
    FilterOpt,
    JsonOpt,
    ModelPrefixOpt,
    NoEpOpt,
    OptimizerDirOpt,
    OptimizerPrefixOpt,
    SchemaOpt,
    SourceLayoutOpt,
    StepOpt,
    TrustPickleOpt,
    declaration,
    examples,
    selection,
)
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.inspect import InspectResult


class SortKey(str, Enum):
    name = "name"
    size = "size"


@command_boundary
def inspect_command(
    checkpoint: CheckpointArg,
    json_output: JsonOpt = False,
    filter_glob: FilterOpt = None,
    depth: Annotated[
        int | None,
        typer.Option("--depth", min=1, help="Group model tensors into a tree by the first N key components."),
    ] = None,
    sort: Annotated[SortKey, typer.Option("--sort", help="Order of tensor rows.")] = SortKey.name,
    trust_pickle: TrustPickleOpt = False,
    source_layout: SourceLayoutOpt = None,
    ep_size: EpSizeOpt = None,
    ep_fsdp_size: EpFsdpSizeOpt = None,
    no_ep: NoEpOpt = False,
    step: StepOpt = None,
    optimizer_dir: OptimizerDirOpt = None,
    schema: SchemaOpt = None,
    model_prefix: ModelPrefixOpt = None,
    optimizer_prefix: OptimizerPrefixOpt = None,
) -> None:
    """Show what a checkpoint holds, from .metadata alone (reads no tensor data)."""
    from ckpttool.format.unpickler import gc_paused
    from ckpttool.ops.inspect import InspectOptions, inspect
    from ckpttool.ui.render import render_overview

    options = InspectOptions(filter_glob=filter_glob, depth=depth, sort=sort.value)
    decl = declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    sel = selection(step, optimizer_dir, schema, model_prefix, optimizer_prefix)
    # One GC pause for reading and printing, and the result freed before it ends: re-enabling the
    # collector runs a full collection over whatever is still alive (10^7 objects at 10^6 entries).
    sink = Output(json_output)
    with gc_paused():
        result = inspect(checkpoint, options, declaration=decl, trust_pickle=trust_pickle, selection=sel)
        if not json_output:
            for line in _file_warnings(result):
                sink.warning(line)
        sink.result(result, render_overview)
        del result


def _file_warnings(ov: InspectResult) -> list[str]:
    """``warning:`` lines for data files that are missing, short or not referenced."""
    what = {"missing": "is missing", "unreferenced": "is not referenced by .metadata"}
    bad = [
        f"data file {f.path} "
        + (what.get(f.status) or f"is shorter than its records need ({f.size} < {f.needed} bytes; truncated?)")
        for f in ov.files
        if f.status != "ok"
    ]
    return [*bad, "run `ckpttool validate --strict` for the full list of problems"] if bad else []


EPILOG = examples(
    "ckpttool inspect ckpt/",
    "ckpttool inspect ckpt/ --filter '*experts*' --sort size",
    "ckpttool inspect ckpt/ --depth 3",
    "ckpttool inspect RUN_ROOT --step latest",
    "ckpttool inspect ckpt/ --json | python -m json.tool",
)


def register(app: typer.Typer) -> None:
    app.command("inspect", epilog=EPILOG)(inspect_command)
