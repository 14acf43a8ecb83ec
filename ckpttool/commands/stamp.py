"""``ckpttool stamp DIR --source-layout L --ep-size P --ep-fsdp-size F``: record a declared EP layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.ui import options as opt
from ckpttool.ui.options import declaration, examples, selection
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.stamp import StampResult


@command_boundary
def stamp_command(
    checkpoint: opt.CheckpointArg,
    source_layout: Annotated[
        opt.SourceLayout,
        typer.Option(
            "--source-layout",
            help="EP layout the checkpoint was saved with: legacy (mesh EP-FSDP, EP) or canonical (mesh EP, EP-FSDP).",
        ),
    ],
    ep_size: Annotated[int, typer.Option("--ep-size", min=1, help="EP size P of the saving mesh.")],
    ep_fsdp_size: Annotated[int, typer.Option("--ep-fsdp-size", min=1, help="EP-FSDP size F of the saving mesh.")],
    json_output: opt.JsonOpt = False,
    trust_pickle: opt.TrustPickleOpt = False,
    step: opt.StepOpt = None,
    schema: opt.SchemaOpt = None,
    model_prefix: opt.ModelPrefixOpt = None,
    optimizer_prefix: opt.OptimizerPrefixOpt = None,
) -> None:
    """Write layout.json beside .metadata after checking the declaration against the chunk geometry.

    Adds only that file; refuses to contradict a layout record already in the checkpoint.
    """
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.stamp import StampOptions, stamp

    decl = declaration(source_layout, ep_size, ep_fsdp_size)
    sel = selection(step, None, schema, model_prefix, optimizer_prefix)
    res = stamp(checkpoint, StampOptions(decl), opening=OpenOptions(trust_pickle=trust_pickle, selection=sel))
    out = Output(json_output)
    for w in res.warnings:
        out.warning(w)
    out.result(res, _render)


def _render(res: StampResult) -> None:
    from ckpttool.ui.render import plural, stdout_console

    rec = res.record
    name = "canonical" if rec["version"] == 2 else "legacy"
    if res.written:
        what = f"wrote {res.path}"
    elif res.recorded_in == "embedded":
        what = f"already recorded in the checkpoint's embedded layout item, nothing written: {res.path}"
    else:
        what = f"already recorded in {res.path}, nothing written"
    fsdp = rec["parallel"].get("ep_fsdp_size", 1)
    stdout_console().print(
        f"{what}: layout version {rec['version']} ({name}), ep_size {rec['parallel'].get('ep_size', 1)}, "
        f"ep_fsdp_size {fsdp}, {plural(res.ep_tensors, 'EP tensor')}"
        + (f" ({res.same_dim} with EP and FSDP on the expert dim)" if fsdp != 1 else "")  # no FSDP split at 1
    )


EPILOG = examples(
    "ckpttool stamp ckpt/ --source-layout legacy --ep-size 4 --ep-fsdp-size 2",
    "ckpttool inspect ckpt/   # then shows the recorded layout",
)
