"""``ckpttool diff A B``: compare two checkpoints by name and value (DCP, safetensors, PEFT adapter)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpttool.model.adapters import adapter_metavar
from ckpttool.ui import options as opt
from ckpttool.ui.options import declaration, examples, location, parse_dtype, selection
from ckpttool.ui.output import Output, command_boundary, with_flags
from ckpttool.ui.render import PhaseProgress

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
    "a PEFT adapter directory, or the URL of a DCP checkpoint's prefix (s3://bucket/run/step-100)."
)
SideA = Annotated[PurePath, typer.Argument(metavar="A", help=_SIDE_HELP, show_default=False, parser=location)]
SideB = Annotated[
    PurePath,
    typer.Argument(metavar="B", help="The other side (same kinds as A).", show_default=False, parser=location),
]


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
        "--rules",
        "--map",
        metavar="FILE",
        help="Export rules YAML mapping DCP keys to safetensors names, as export --rules (docs/export.md).",
        parser=opt.given_path,
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
DiffFilterOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--filter",
        metavar="GLOB",
        help="Compare only names matching GLOB, on both sides (fnmatch: * also matches dots; with or without "
        "the 'model.' prefix; a common name or a side's key). Repeatable.",
        show_default=False,
    ),
]
AStepOpt = Annotated[
    str | None,
    typer.Option("--a-step", metavar="N|latest", help="The step of A (a run's checkpoint root).", show_default=False),
]
BStepOpt = Annotated[
    str | None,
    typer.Option("--b-step", metavar="N|latest", help="The step of B (a run's checkpoint root).", show_default=False),
]
DiffStepOpt = Annotated[
    str | None,
    typer.Option(
        "--step",
        metavar="N|latest",
        help="The step of each side that is a run's checkpoint root (not of a checkpoint or an HF directory); "
        "--a-step/--b-step override it per side.",
        show_default=False,
    ),
]

DiffPlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE",
        help="Also draw the relative difference per layer and the tensors that differ most to FILE "
        "(.png, .svg or a self-contained .html). Needs matplotlib: pip install 'matplotlib>=3.8'.",
        show_default=False,
        parser=opt.given_output_file,
    ),
]


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
    step: DiffStepOpt = None,
    a_step: AStepOpt = None,
    b_step: BStepOpt = None,
    filters: DiffFilterOpt = None,
    schema: opt.SchemaOpt = None,
    model_prefix: opt.ModelPrefixOpt = None,
    optimizer_prefix: opt.OptimizerPrefixOpt = None,
    plot: DiffPlotOpt = None,
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
        filters=tuple(filters or ()),
        step=step,
        a_step=a_step,
        b_step=b_step,
    )
    decl_a = declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    decl_b = _declaration_of_b(b_source_layout, b_ep_size, b_ep_fsdp_size, b_no_ep)
    keys = selection(None, None, schema, model_prefix, optimizer_prefix)
    if plot is not None:
        from ckpttool.ui.plot import check_plot_target

        check_plot_target(plot, tuple(c for c in (a, b) if isinstance(c, Path)))  # a URL holds no local file
    with (
        _side_b_options(),
        PhaseProgress.on_stderr("diff", not json_output and sys.stderr.isatty(), bar_text="comparing") as shown,
    ):
        res = diff_checkpoints(
            a,
            b,
            opts,
            progress=shown.progress if shown else None,
            phase=shown.phase if shown else None,
            opening_a=OpenOptions(declaration=decl_a, trust_pickle=trust_pickle, selection=keys),
            opening_b=OpenOptions(declaration=decl_b, trust_pickle=trust_pickle, selection=keys),
        )
    _unused_mapping(res, map_rules, adapter, weights, json_output)
    if plot is not None:
        from ckpttool.ui.plot import write_diff_plot

        write_diff_plot(res, plot)
    _print_result(res, plot, json_output)
    if not res.equal:
        raise typer.Exit(1)


@contextmanager
def _side_b_options() -> Iterator[None]:
    """A layout error of side B (``param`` ``opening_b``) naming B's options (``--b-source-layout``, ...) where the
    library says that B's declaration is ``opening_b``'s, whose parameters are named as A's options."""
    from ckpttool.errors import LayoutError
    from ckpttool.ops.diff.result import SIDE_B_DECLARED, as_side_b

    try:
        yield
    except LayoutError as e:
        if e.param != "opening_b":
            raise
        hint = as_side_b(e.hint.removeprefix(SIDE_B_DECLARED))
        raise type(e)(as_side_b(e.message), hint=hint, path=e.path, fqn=e.fqn) from None


def _declaration_of_b(source_layout: Any, ep_size: int | None, ep_fsdp_size: int | None, no_ep: bool) -> Any:
    """B's layout declaration; a usage error names B's options (``--b-ep-fsdp-size``), not A's."""
    from ckpttool.errors import UsageError
    from ckpttool.ops.diff.result import as_side_b

    try:
        return declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    except UsageError as e:
        param = f"b_{e.param}" if e.param else None
        raise UsageError(as_side_b(e.message), hint=as_side_b(e.hint), param=param) from None


def _unused_mapping(res: Any, map_rules: Path | None, adapter: str | None, weights: Weights, json_output: bool) -> None:
    """A warning naming ``--rules``, ``--adapter`` and ``--weights master`` between two DCP checkpoints: the export
    mapping of a DCP side to a safetensors side's names, which such a comparison does not use."""
    unused = [n for n, given in (("--rules", map_rules), ("--adapter", adapter)) if given is not None]
    unused += ["--weights master"] if weights is not Weights.params else []
    if unused and res.a.kind == res.b.kind == "dcp":
        Output(json_output).warning(
            f"{', '.join(unused)} {'map' if len(unused) > 1 else 'maps'} a DCP checkpoint to a safetensors side's "
            "names: both sides are DCP checkpoints, compared by their own keys without it"
        )


def _print_result(res: Any, plot: Path | None, json_output: bool) -> None:
    """The result (JSON or text); with ``--json`` a ``--plot`` file is named on stderr (the document has no place)."""
    sink = Output(json_output)
    sink.result(res, lambda r: _render_with_plot(r, plot))
    if json_output and plot is not None:
        sink.note(f"wrote {plot}")


def _render_with_plot(res: Any, plot: Path | None) -> None:
    """The result, then ``wrote FILE`` as its last line, as stats says it (a result: printed with -q too)."""
    render_diff(res)
    if plot is not None:
        from ckpttool.ui.render import stdout_console

        stdout_console().print(f"wrote {plot}")


_ROWS = 40
_DETAILS = 5
_STATUS = {"equal": "equal", "within_tolerance": "within tol", "differ": "DIFFER"}


def fmt_metric(v: float | None, digits: int = 3) -> str:
    """A metric with ``digits`` significant digits (``0``, ``1.23e-05``, ``inf``); ``-`` when not computed."""
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.{digits}g}"


def fmt_cosine(v: float | None) -> str:
    """A cosine with 6 significant digits; one that rounds to 1 without being 1 as ``1-3.2e-07``."""
    if v is None:
        return "-"
    text = f"{v:.6g}"
    if text == "1" and v != 1:
        return f"1-{1 - v:.2g}"
    return text


def render_diff(res: DiffResult, *, max_rows: int = _ROWS) -> None:
    """Header, the tensors table (sorted by difference), other findings, a summary line and the verdict."""
    from ckpttool.ui.render import stdout_console

    con = stdout_console()
    _header(con, res)
    if any(t.status != "equal" for t in res.tensors):
        _tensor_table(con, res, max_rows)
    _findings(con, res, max_rows)
    con.print(_summary_line(res))
    verdict = "equal" if res.equal else f"DIFFERENT: {_plural(res.difference_count, 'difference')}"
    within = sum(t.status == "within_tolerance" for t in res.tensors)
    if res.equal and within:  # not bitwise: "equal" alone would claim more than was found
        verdict = f"equal within tolerance: {_plural(within, 'tensor')} not bitwise equal"
        if res.options.as_dtype and res.options.rtol is None and res.options.atol is None:
            verdict = f"equal as {res.options.as_dtype} ({_plural(within, 'tensor')} not bitwise equal as stored)"
    from ckpttool.ops.diff.result import (
        BESIDE_NOTE,
        MODEL_ONLY_NOTE,
        REMOTE_BESIDE_NOTE,
        SELF_NOTE,
        TRAINING_STATE_NOTE,
        UNPROVEN_NOTE,
    )

    if res.equal and any(n.startswith(BESIDE_NOTE) for n in res.notes):
        verdict += "; files beside the checkpoints differ (note above)"
    elif res.equal and any(n.startswith(REMOTE_BESIDE_NOTE) for n in res.notes):
        verdict += "; files beside the checkpoints not compared (note above)"
    if res.equal and any(n.startswith(UNPROVEN_NOTE) for n in res.notes):
        verdict += "; of the shards present, not known complete (note above)"
    if res.equal and any(n.startswith(SELF_NOTE) for n in res.notes):
        verdict += f" to itself: {SELF_NOTE} (note above)"
    elif res.equal:
        verdict += _left_out(res.notes, MODEL_ONLY_NOTE, TRAINING_STATE_NOTE, res.options.what)
    con.print(f"{verdict} ({res.seconds:.2f} s)")


def _left_out(notes: list[str], optimizer: str, training: str, what: str) -> str:
    """What the verdict adds when the notes say optimizer state (``optimizer``) or training state (``training``)
    were left out: "equal" then holds for the model only (for the optimizer state only with ``what`` optimizer)."""
    opt, train = (any(n.startswith(prefix) for n in notes) for prefix in (optimizer, training))
    if what == "optimizer":
        return "; training state not compared (note above)" if train else ""
    if opt and train:
        return " as models; optimizer and training state not compared (notes above)"
    if opt:
        return " as models; optimizer state not compared (note above)"
    return " as models; training state not compared (note above)" if train else ""


def _plural(n: int, word: str) -> str:
    from ckpttool.ui.render import plural

    return plural(n, word)


def _header(con: Any, res: DiffResult) -> None:
    from ckpttool.ops.diff.result import DEQUANTIZED_NOTE

    o = res.options
    how = "bitwise"
    if o.rtol is not None or o.atol is not None:
        how = f"within rtol {o.rtol or 0:g}, atol {o.atol or 0:g}"
    if o.as_dtype:
        how += f" after casting to {o.as_dtype}"
    quantized = any(n.startswith(DEQUANTIZED_NOTE) for n in res.notes)  # else --as-dtype made them within
    if o.rtol is None and o.atol is None and quantized and any(t.status == "within_tolerance" for t in res.tensors):
        how += "; quantized weights against unquantized ones within their quantization step (note below)"
    for name, side in (("A", res.a), ("B", res.b)):
        opened = f": opened {side.opened}" if side.opened else ""
        what = side.folder or side.kind
        said = [what] if what == side.schema else [what, side.schema]  # a per-rank format named as its schema: once
        con.print(f"{name}: {side.path}{opened} ({', '.join([*said, *([side.layout] if side.layout else [])])})")
    adapter = f", model adapter {res.model_adapter}" if res.model_adapter else ""
    only = f"; --filter {' '.join(o.filters)} left out {res.filtered_out:,} of both sides' keys" if o.filters else ""
    con.print(f"compared {o.what} ({res.naming} names{adapter}), {how}{only}")
    for n in res.notes:  # the library's parameter names (`adapter`) as diff's options (--adapter)
        con.print(f"  note: {with_flags(n)}")
    if res.excluded:
        reasons: dict[str, int] = {}
        for e in res.excluded:
            reasons[f"{e.side}: {e.reason}"] = reasons.get(f"{e.side}: {e.reason}", 0) + 1
        for r, count in reasons.items():
            con.print(f"  not compared: {_plural(count, 'key')} of {r}")


def _tensor_table(con: Any, res: DiffResult, max_rows: int) -> None:
    """The tensors that are not equal, largest relative L2 first; the first differing elements of the top rows."""
    from ckpttool.ui.render import Col, fmt_shape, print_table

    listed = [t for t in res.tensors if t.status != "equal"]
    rows = []
    for t in listed[:max_rows]:
        dtype = t.a_dtype if t.a_dtype == t.b_dtype else f"{t.a_dtype}/{t.b_dtype}"
        rows.append(
            [
                t.name,
                fmt_shape(t.shape),
                dtype,
                fmt_metric(t.max_abs),
                fmt_metric(t.rel_l2),
                fmt_cosine(t.cosine),
                _STATUS[t.status],
            ]
        )
    cols = [
        Col("key", "key"),
        Col("shape", "code", drop=2),
        Col("dtype", "code", drop=1),
        Col("max abs", "num"),
        Col("rel L2", "num"),
        Col("cosine", "num"),
        Col("status", "code"),
    ]
    print_table(con, "tensors, largest difference first (rel L2 = ||A-B||/||B||)", cols, rows)
    n_equal = len(res.tensors) - len(listed)
    if len(listed) > max_rows or n_equal:
        more = f"{len(listed) - max_rows:,} more not equal, " if len(listed) > max_rows else ""
        con.print(f"  ... {more}{_plural(n_equal, 'equal tensor')} not listed (--json lists every tensor)")
    # where only some elements differ, the first of them (an edit, a bad shard); not for all-different run weights
    by_name = {d.name: d for d in res.differences if d.kind == "values" and (d.mismatched or 0) < (d.numel or 0)}
    shown = [by_name[t.name] for t in listed[:max_rows] if t.name in by_name][:_DETAILS]
    for d in shown:
        con.print(f"  {_first_element(d)}")


def _first_element(d: Any) -> str:
    """``name: 1 of 3,072 elements differ, first at [47, 16] (A 0.0113, B 1.01)``, with where it is stored."""
    how = "outside the tolerance" if "outside the tolerance" in d.message else "differ"
    where = f" = {d.stored['side']}'s {d.stored['key']}{d.stored['index']}" if d.stored is not None else ""
    return (
        f"{d.name}: {d.mismatched:,} of {d.numel:,} elements {how}; first at {d.index}{where} "
        f"(A {_value(d.a_value, d.b_value)}, B {_value(d.b_value, d.a_value)})"
    )


def _value(v: Any, other: Any = None) -> str:
    """``v`` with 6 significant digits, or as many more as tell it apart from ``other`` (``A 1, B 1`` would hide
    a difference in the 7th digit)."""
    if not isinstance(v, float):
        return repr(v)
    for digits in (6, 9, 12, 17):
        shown = f"{v:.{digits}g}"
        if not isinstance(other, float) or other == v or shown != f"{other:.{digits}g}":
            return shown
    return repr(v)


def _findings(con: Any, res: DiffResult, max_rows: int) -> None:
    """Differences other than values: names on one side, shapes, objects, hyperparameters; dtypes grouped per pair."""
    dtypes: dict[tuple[str, str], list[str]] = {}
    lines: list[str] = []
    for d in res.differences:
        if d.kind == "values":
            continue
        if d.kind == "dtype":
            dtypes.setdefault((str(d.a_value), str(d.b_value)), []).append(d.name)
            continue
        lines.append(f"{d.kind}: {d.message}")
    for line in lines[:max_rows]:
        con.print(f"  {line}")
    if len(lines) > max_rows:
        con.print(f"  ... and {len(lines) - max_rows:,} more (--json lists them)")
    for (da, db), names in dtypes.items():
        first = ", ".join(names[:3]) + (f", ... (+{len(names) - 3:,} more)" if len(names) > 3 else "")
        con.print(f"  dtype: {da} in A, {db} in B: {_plural(len(names), 'tensor')} ({first})")
    if dtypes:
        con.print("  hint: compare values across dtypes with --as-dtype DTYPE (both sides cast) or --rtol/--atol")
    if res.difference_count > len(res.differences):
        con.print(f"  ({res.difference_count - len(res.differences):,} more differences counted, not listed)")


def _summary_line(res: DiffResult) -> str:
    """``compared 22 tensors / 4,608 values (21 as raw records): 1 differs; max rel L2 3.3e-04 (name), ...``."""
    s = res.summary()
    n_diff = s["differ"] + s["within_tolerance"]
    text = (
        f"compared {_plural(s['tensors'], 'tensor')} / {_plural(res.values, 'value')} "
        f"({res.raw_compared:,} as raw records)"
    )
    if res.compared > s["tensors"]:
        text += f", {res.compared - s['tensors']:,} other (by dtype, shape, stored bytes or hyperparameter)"
    if not s["tensors"]:
        return text
    parts = [f"{s['differ']:,} differ" if s["differ"] != 1 else "1 differs"]
    if s["within_tolerance"]:
        parts.append(f"{s['within_tolerance']:,} within tolerance")
    named = next((t.status for t in res.tensors if t.name == s["max_abs_name"]), "equal")
    if n_diff and named == "equal":  # only tensors without metrics differ (bool): the metrics would name an equal one
        parts.append("no tensor with a magnitude differs (what differs is listed above)")
    elif n_diff:
        parts.append(f"max rel L2 {fmt_metric(_f(s['max_rel_l2']))} ({s['max_rel_l2_name']})")
        parts.append(f"max abs {fmt_metric(_f(s['max_abs']))} ({s['max_abs_name']})")
        parts.append(f"min cosine {fmt_cosine(_f(s['min_cosine']))} ({s['min_cosine_name']})")
    return text + ": " + "; ".join(parts)


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


EPILOG = examples(
    "ckpttool diff ckpt/ resharded/ --what all        # a reshard changed nothing",
    "ckpttool diff ckpt/ hf_export/ --as-dtype bfloat16   # a BF16 export of FP32 weights",
    "ckpttool diff run1/step-100 run2/step-100 --rtol 1e-3 --json",
    "ckpttool diff run/step-200 run/step-100 --plot layers.png   # which layers moved most",
)
