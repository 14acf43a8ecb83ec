"""``ckpttool stats CKPT [CKPT ...]``: per-layer statistics of weights, optimizer state and update size."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpttool.errors import shell_arg
from ckpttool.ui import options as opt
from ckpttool.ui.options import examples, location, selection
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from rich.console import Console

    from ckpttool.ops.stats import CheckpointStats, StatsResult


class StatsView(str, Enum):
    layer = "layer"
    module = "module"
    tensor = "tensor"


StatsFilterOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--filter",
        metavar="GLOB",
        help="Only tensors whose fqn or key matches this glob (repeatable).",
        show_default=False,
    ),
]
StatsPlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE",
        help="Also draw per-layer norms (weights, moments, update size; experts as a heat map) to FILE "
        "(.png, .svg or a self-contained .html). Needs matplotlib: pip install 'matplotlib>=3.8'.",
        show_default=False,
        parser=opt.given_output_file,
    ),
]


@command_boundary
def stats_command(
    checkpoints: Annotated[
        list[PurePath],
        typer.Argument(
            help="One or more checkpoints (directories, run roots with --step, or URLs), in run order: "
            "with two or more, the per-layer relative change between consecutive ones is shown too.",
            show_default=False,
            parser=location,
            metavar="CHECKPOINT",
        ),
    ],
    by: Annotated[StatsView, typer.Option("--by", help="Rows of the table: per layer, module type or tensor.")] = (
        StatsView.layer
    ),
    filters: StatsFilterOpt = None,
    no_optimizer: Annotated[
        bool, typer.Option("--no-optimizer", help="Measure the model tensors only (no moments, no update size).")
    ] = False,
    plot: StatsPlotOpt = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Chunks read at once (default: CPU count).")
    ] = None,
    json_output: opt.JsonOpt = False,
    trust_pickle: opt.TrustPickleOpt = False,
    step: opt.StepOpt = None,
    schema: opt.SchemaOpt = None,
    model_prefix: opt.ModelPrefixOpt = None,
    optimizer_prefix: opt.OptimizerPrefixOpt = None,
) -> None:
    """Streaming statistics of weights, FP32 masters and Adam moments, grouped per layer.

    Per tensor: numel, mean, std, abs max, L2 norm, zero fraction, NaN/Inf count; for AdamW the
    size of the last update (lr * |m_hat| / (sqrt(v_hat) + eps), from the saved moments). Reads every chunk once, in bounded memory.
    """
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.entry import deliver
    from ckpttool.ops.stats import StatsOptions, collect_stats
    from ckpttool.ops.stats.run import note_line
    from ckpttool.ui.render import PhaseProgress

    if plot is not None:
        from ckpttool.ui.plot import check_plot_target

        check_plot_target(plot, tuple(c for c in checkpoints if isinstance(c, Path)))
    options = StatsOptions(filters=tuple(filters or ()), workers=workers, optimizer=not no_optimizer)
    # phases named on stderr (measuring CKPT i/n, comparing steps); each checkpoint's byte bar from its total on
    with PhaseProgress.on_stderr("stats", not json_output and sys.stderr.isatty()) as shown, _run_hint():
        res = collect_stats(
            [str(c) for c in checkpoints],
            options,
            progress=shown.progress if shown is not None else None,
            opening=OpenOptions(
                trust_pickle=trust_pickle, selection=selection(step, None, schema, model_prefix, optimizer_prefix)
            ),
            phase=shown.phase if shown is not None else None,
        )
    if plot is not None:
        from ckpttool.ui.plot import write_stats_plot

        write_stats_plot(res, plot, optimizer=not no_optimizer)
    sink = Output(json_output)
    disorder = _step_disorder(res)
    if disorder is not None:
        sink.warning(disorder)
    for c in res.checkpoints:  # on stderr either way, as inspect's
        for w in c.warnings:
            sink.warning(f"{c.path}: {w}" if len(res.checkpoints) > 1 else w)
    if not json_output:  # --json: the notes are in the document
        for c in res.checkpoints:
            for n in c.notes:
                sink.note(f"{c.path}: {note_line(n)}")
    deliver(res, lambda r: sink.result(r, lambda x: _render(x, by, plot)))
    if json_output and plot is not None:  # the document has no place for it: stderr says where the picture went
        sink.note(f"wrote {plot}")


@contextmanager
def _run_hint() -> Iterator[None]:
    """A run's root given without ``--step`` (E204): its hint also names the steps' directories in run order, as
    one ``ckpttool stats`` command line (following the run step by step is what stats of several is for)."""
    from ckpttool.errors import AmbiguousCheckpointError

    try:
        yield
    except AmbiguousCheckpointError as e:
        if len(e.steps) > 1:
            dirs = [shell_arg(d) for _, d in e.steps]
            shown = dirs if len(dirs) <= 6 else [*dirs[:3], "...", dirs[-1]]
            e.hint += f"; or follow the run, its steps in run order: ckpttool stats {' '.join(shown)}"
        raise


def _step_disorder(res: StatsResult) -> str | None:
    """A warning when a checkpoint's known step is below the one given before it (a shell glob's ``step-1 step-10
    step-2``): the changes are between neighbours as given, a jump of several steps read as one step's change."""
    steps = [c.step for c in res.checkpoints]
    known = [s for s in steps if s is not None]
    if len(known) < 2 or len(known) < len(steps) or all(a <= b for a, b in zip(known, known[1:])):
        return None
    return (
        f"the checkpoints are not in step order (steps {', '.join(map(str, steps))}, as given): each change is between "
        "neighbours as given; give them in run order (a shell glob puts step-10 before step-2: ls -v, sort -V)"
    )


def _g(v: float | None) -> str | None:
    return None if v is None else f"{v:.4g}"


def _render(res: StatsResult, by: StatsView, plot: Path | None) -> None:
    from ckpttool.ui.render import human_bytes, stdout_console

    con = stdout_console()
    for c in res.checkpoints:
        step = f", step {c.step}" if c.step is not None else ""
        con.print(
            f"checkpoint  {c.path} ({c.schema}{step}): {len(c.tensors)} tensors, {human_bytes(c.bytes_read)} read"
        )
        _table(con, c, by)
    if res.changes:
        _changes(con, res)
    for s in res.skipped:
        con.print(f"not compared: {s}")
    if plot is not None:
        con.print(f"wrote {plot}")


def _table(con: Console, c: CheckpointStats, by: StatsView) -> None:
    from ckpttool.ui.render import Col, fmt_count, print_table

    if by is StatsView.tensor:
        # narrow terminals: zeros, mean, dtype, numel, then std give way (named below); key, role, abs max, L2 stay
        cols = [
            Col("key", "key"),
            Col("role", "code"),
            Col("dtype", "code", drop=3),
            Col("numel", "num", drop=2),
            Col("mean", "num", drop=4),
            Col("std", "num", drop=1),
            Col("abs max", "num"),
            Col("L2", "num"),
            Col("zeros", "num", drop=5),
            Col("NaN/Inf", "num", hide_empty=True),
        ]
        rows: list[list[Any]] = [
            [
                t.key,
                t.role,
                t.dtype,
                fmt_count(t.numel),
                # a tensor of no element has no value to measure: '-', as its zeros (`nan` is for NaN/Inf values)
                *((_g(t.mean), _g(t.std), _g(t.abs_max)) if t.numel else (None, None, None)),
                _g(t.l2),
                f"{t.zero_fraction:.1%}" if t.numel else "-",
                t.nonfinite or None,
            ]
            for t in c.tensors
        ]
        print_table(con, "tensors", cols, rows)
        return
    groups = c.layers if by is StatsView.layer else c.modules
    roles = [r for r in ("weight", "master_weight", "exp_avg", "exp_avg_sq") if any(r in g.norms for g in groups)]
    # narrow terminals: abs max and the norms of the second moments and of the masters give way, then the
    # parameter count, then ‖exp_avg‖ (named below); the layer, ‖weight‖ and the update size stay
    cols = [Col(by.value, "key"), Col("params", "num", drop=2)]
    cols += [Col(f"‖{r}‖", "num", drop={"master_weight": 4, "exp_avg_sq": 4, "exp_avg": 1}.get(r, 0)) for r in roles]
    cols += [
        Col("abs max", "num", drop=4, hide_empty=True),
        Col("update rms", "num", hide_empty=True),
        Col("NaN/Inf", "num", hide_empty=True),
    ]
    rows = [
        [g.name, fmt_count(g.params)]
        + [_g(g.norms.get(r)) for r in roles]
        + [_g(g.abs_max) if g.params else None, _g(g.update_rms), g.nonfinite or None]  # no model tensor: blank
        for g in groups
    ]
    print_table(con, f"per {by.value}", cols, rows)


def _changes(con: Console, res: StatsResult) -> None:
    from ckpttool.ui.render import Col, column_groups, print_table

    given = [(a.path, b.path) for a, b in zip(res.checkpoints, res.checkpoints[1:])]  # pair i: i and i + 1
    rel: dict[tuple[int, str], float | None] = {}  # (pair index, layer): a pair given twice is two columns
    at = 0
    for ch in res.changes:  # in pair order, each layer once per pair
        while at < len(given) and (given[at] != (ch.a, ch.b) or (at, ch.layer) in rel):
            at += 1
        rel[(at, ch.layer)] = ch.relative
    pairs = list(dict.fromkeys(i for i, _ in rel))
    layers = list(dict.fromkeys(ch.layer for ch in res.changes))
    steps = [c.step for c in res.checkpoints]
    known = len(pairs) == len(steps) - 1 and None not in steps and len(set(steps)) == len(steps)
    names = [str(s) for s in steps] if known else [f"#{i + 1}" for i in range(len(steps))]
    cols = [Col("layer", "key")] + [Col(f"Δ{names[i]}→{names[i + 1]}", "num") for i in pairs]
    rows: list[list[Any]] = [[layer, *(_g(rel.get((i, layer))) for i in pairs)] for layer in layers]
    by = "steps" if known else "#N: the Nth checkpoint given"
    title = f"relative change ‖W_b − W_a‖ / ‖W_a‖ between consecutive checkpoints ({by})"
    groups = column_groups(cols, rows, con.width)  # no Δ column may give way: a table per group that fits
    for n, group in enumerate(groups):
        more = f", {n + 1} of {len(groups)}" if len(groups) > 1 else ""
        print_table(con, title[:-1] + more + ")", [cols[j] for j in group], [[r[j] for j in group] for r in rows])


EPILOG = examples(
    "ckpttool stats ckpt/",
    "ckpttool stats ckpt/ --by module --filter '*experts*'",
    "ckpttool stats run/step-100 run/step-200 run/step-300 --plot norms.png",
    "ckpttool stats ckpt/ --json | jq '.checkpoints[0].layers'",
)
