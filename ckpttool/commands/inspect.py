"""``ckpttool inspect DIR``: metadata-only overview."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.ui import options as opt
from ckpttool.ui.options import declaration, examples, selection
from ckpttool.ui.output import Output, command_boundary, with_flags

if TYPE_CHECKING:
    from ckpttool.ops.inspect import InspectResult


class SortKey(str, Enum):
    name = "name"
    size = "size"


@command_boundary
def inspect_command(
    checkpoint: opt.CheckpointArg,
    json_output: opt.JsonOpt = False,
    filter_glob: opt.FilterOpt = None,
    depth: Annotated[
        int | None,
        typer.Option("--depth", min=1, help="Group model tensors into a tree by the first N key components."),
    ] = None,
    sort: Annotated[SortKey, typer.Option("--sort", help="Order of tensor rows.")] = SortKey.name,
    trust_pickle: opt.TrustPickleOpt = False,
    source_layout: opt.SourceLayoutOpt = None,
    ep_size: opt.EpSizeOpt = None,
    ep_fsdp_size: opt.EpFsdpSizeOpt = None,
    no_ep: opt.NoEpOpt = False,
    step: opt.StepOpt = None,
    optimizer_dir: opt.OptimizerDirOpt = None,
    schema: opt.SchemaOpt = None,
    model_prefix: opt.ModelPrefixOpt = None,
    optimizer_prefix: opt.OptimizerPrefixOpt = None,
) -> None:
    """Show what a checkpoint holds, from its metadata alone (reads no tensor data)."""
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.entry import data_file_warnings, run_inspect
    from ckpttool.ops.inspect import InspectOptions
    from ckpttool.ui.render import render_overview

    sink = Output(json_output)

    def report(result: InspectResult) -> None:
        for line in data_file_warnings(result):  # on stderr with --json too (files[].status), as stats' warnings
            sink.warning(line)
        sink.result(result, lambda r: render_overview(r, flags=with_flags))

    run_inspect(
        checkpoint,
        InspectOptions(filter_glob=filter_glob, depth=depth, sort=sort.value),
        opening=OpenOptions(
            declaration=declaration(source_layout, ep_size, ep_fsdp_size, no_ep),
            trust_pickle=trust_pickle,
            selection=selection(step, optimizer_dir, schema, model_prefix, optimizer_prefix),
        ),
        report=report,
    )


EPILOG = examples(
    "ckpttool inspect ckpt/",
    "ckpttool inspect ckpt/ --filter '*experts*' --sort size",
    "ckpttool inspect ckpt/ --depth 3",
    "ckpttool inspect RUN_ROOT --step latest",
    "ckpttool inspect ckpt/ --json | python -m json.tool",
)
