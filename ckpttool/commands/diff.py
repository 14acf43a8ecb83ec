"""``ckpttool diff A B``: compare two checkpoints by name and value (DCP, safetensors, PEFT adapter)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.model.adapters import adapter_metavar
from ckpttool.ui import options as opt
from ckpttool.ui.options import declaration, examples, parse_dtype, selection
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.diff import DiffResult


class What(str, Enum):
    model = "model"
    optimizer = "optimizer"
    all = "all"


class Weights(str, Enum):
    params = "params"
    master = "master"


_SIDE_HELP = (
    "A DCP checkpoint directory (or a directory above one), a safetensors directory or file, "
    "or a PEFT adapter directory."
)
SideA = Annotated[Path, typer.Argument(metavar="A", help=_SIDE_HELP, show_default=False)]
SideB = Annotated[Path, typer.Argument(metavar="B", help="The other side (same kinds as A).", show_default=False)]


WhatOpt = Annotated[
    What,
    typer.Option("--what", help="model tensors; optimizer state and param groups; or all (also training state)."),
]
RtolOpt = Annotated[
    float | None,
    typer.Option("--rtol", min=0.0, help="Relative tolerance (|a-b| <= atol + rtol*|b|); default bitwise."),
]
AtolOpt = Annotated[float | None, typer.Option("--atol", min=0.0, help="Absolute tolerance; default bitwise.")]
AsDtypeOpt = Annotated[
    str | None,
    typer.Option("--as-dtype", metavar="DTYPE", help="Cast both sides to DTYPE first (bfloat16 for a BF16 export)."),
]
MapOpt = Annotated[
    Path | None,
    typer.Option(
        "--map", metavar="RULES", help="Export rules YAML mapping DCP keys to safetensors names (docs/export.md)."
    ),
]
WeightsOpt = Annotated[
    Weights, typer.Option("--weights", help="Against safetensors: compare the parameters or their FP32 masters.")
]
AdapterOpt = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        metavar=adapter_metavar(),
        help="Against safetensors: the model adapter naming the DCP side, as export's "
        "[default: detected from the key names].",
    ),
]
BSourceLayoutOpt = Annotated[
    opt.SourceLayout | None,
    typer.Option("--b-source-layout", help="Declare B's EP layout (as --source-layout declares A's)."),
]
BEpSizeOpt = Annotated[int | None, typer.Option("--b-ep-size", min=1, help="EP size of B's saving mesh.")]
BEpFsdpSizeOpt = Annotated[int | None, typer.Option("--b-ep-fsdp-size", min=1, help="EP-FSDP size of B's saving mesh.")]
BNoEpOpt = Annotated[bool, typer.Option("--b-no-ep", help="B was saved without expert parallelism.")]


@command_boundary
def diff_command(
    a: SideA,
    b: SideB,
    what: WhatOpt = What.model,
    rtol: RtolOpt = None,
    atol: AtolOpt = None,
    as_dtype: AsDtypeOpt = None,
    map_rules: MapOpt = None,
    weights: WeightsOpt = Weights.params,
    adapter: AdapterOpt = None,
    json_output: opt.JsonOpt = False,
    trust_pickle: opt.TrustPickleOpt = False,
    source_layout: opt.SourceLayoutOpt = None,
    ep_size: opt.EpSizeOpt = None,
    ep_fsdp_size: opt.EpFsdpSizeOpt = None,
    no_ep: opt.NoEpOpt = False,
    b_source_layout: BSourceLayoutOpt = None,
    b_ep_size: BEpSizeOpt = None,
    b_ep_fsdp_size: BEpFsdpSizeOpt = None,
    b_no_ep: BNoEpOpt = False,
    step: opt.StepOpt = None,
) -> None:
    """Compare two checkpoints tensor by tensor in bounded memory, whatever their sharding or format.

    Exit 0: equal; 1: different; 2: unusable input. --source-layout/--ep-size/--ep-fsdp-size/--no-ep
    declare an unversioned EP layout of A, the --b-... options B's.
    """
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.diff import DiffOptions, diff_checkpoints

    opts = DiffOptions(
        what=what.value,
        rtol=rtol,
        atol=atol,
        as_dtype=parse_dtype(as_dtype, "--as-dtype", ("bfloat16", "float16", "float32", "float64"))
        if as_dtype is not None
        else None,
        map_rules=map_rules,
        weights=weights.value,
        adapter=adapter,
    )
    decl_a = declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    decl_b = declaration(b_source_layout, b_ep_size, b_ep_fsdp_size, b_no_ep)
    sel = selection(step)
    res = diff_checkpoints(
        a,
        b,
        opts,
        opening_a=OpenOptions(declaration=decl_a, trust_pickle=trust_pickle, selection=sel),
        opening_b=OpenOptions(declaration=decl_b, trust_pickle=trust_pickle, selection=sel),
    )
    Output(json_output).result(res, render_diff)
    if not res.equal:
        raise typer.Exit(1)


def render_diff(res: DiffResult, *, max_rows: int = 40) -> None:
    """Header (what was compared and how), the differences (first ``max_rows``), and a verdict line."""
    from ckpttool.ui.render import plural, stdout_console

    con = stdout_console()
    o = res.options
    how = "bitwise"
    if o.rtol is not None or o.atol is not None:
        how = f"within rtol {o.rtol or 0:g}, atol {o.atol or 0:g}"
    if o.as_dtype:
        how += f" after casting to {o.as_dtype}"
    con.print(f"A: {res.a.path} ({res.a.kind}, {res.a.schema}{', ' + res.a.layout if res.a.layout else ''})")
    con.print(f"B: {res.b.path} ({res.b.kind}, {res.b.schema}{', ' + res.b.layout if res.b.layout else ''})")
    adapter = f", model adapter {res.model_adapter}" if res.model_adapter else ""
    con.print(
        f"compared {o.what} ({res.naming} names{adapter}), {how}: {plural(res.compared, 'value')}, "
        f"{res.raw_compared} as raw records"
    )
    for n in res.notes:
        con.print(f"  note: {n}")
    if res.excluded:
        reasons: dict[str, int] = {}
        for e in res.excluded:
            reasons[f"{e.side}: {e.reason}"] = reasons.get(f"{e.side}: {e.reason}", 0) + 1
        for r, count in reasons.items():
            con.print(f"  not compared: {plural(count, 'key')} of {r}")
    for d in res.differences[:max_rows]:
        con.print(f"  {d.kind}: {d.message}")
    if res.difference_count > max_rows:
        con.print(f"  ... and {res.difference_count - max_rows} more (--json lists them)")
    verdict = "equal" if res.equal else f"DIFFERENT: {plural(res.difference_count, 'difference')}"
    con.print(f"{verdict} ({res.seconds:.2f} s)")


EPILOG = examples(
    "ckpttool diff ckpt/ resharded/ --what all        # a reshard changed nothing",
    "ckpttool diff ckpt/ hf_export/ --as-dtype bfloat16   # a BF16 export of FP32 weights",
    "ckpttool diff run1/step-100 run2/step-100 --rtol 1e-3 --json",
)
