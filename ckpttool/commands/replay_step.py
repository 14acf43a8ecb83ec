"""``ckpttool replay-step DIR``: replay the next optimizer step and compare with an FP64 reference."""

from __future__ import annotations

import importlib
import math
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckpttool.errors import ReplayMismatchError, UsageError
from ckpttool.optim_state.schema import OPTIMIZER_TYPES
from ckpttool.ui import options as opt
from ckpttool.ui.options import (
    declaration,
    dtype_aliases_help,
    examples,
    parse_dtype,
    parse_size,
    parse_tolerance,
    selection,
)
from ckpttool.ui.output import Output, command_boundary, deprecated, print_error, with_flags

if TYPE_CHECKING:
    from ckpttool.ops.replay import ReplayOptions, ReplayResult

__all__ = ["render_replay", "replay_step_command"]


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


#: ``--optimizer-type`` choices: ``auto`` and the optimizer-state schema's types
OptimizerChoice = Enum(  # type: ignore[misc]  # built from the registry
    "OptimizerChoice", {"auto": "auto", **{name: name for name in OPTIMIZER_TYPES}}, type=str
)


DeviceOpt = Annotated[
    DeviceChoice,
    typer.Option("--device", help="Where the parameters live: auto (accelerator if any), cpu, cuda, npu."),
]
ReplayFilterOpt = Annotated[
    str | None,
    typer.Option(
        "--filter",
        metavar="GLOB",
        help="Only parameters whose checkpoint key matches this glob, with or without 'model.' "
        "(as inspect/export --filter): '*experts*', 'model.layers.0.*'.",
    ),
]
SelectOpt = Annotated[
    str | None,
    typer.Option("--select", hidden=True, help="Deprecated: a regex (re.search) over fqns; use --filter GLOB."),
]
GradsOpt = Annotated[
    Path | None,
    typer.Option(
        "--grads", help="safetensors file of gradients keyed by parameter fqn (global shape).", parser=opt.given_path
    ),
]
GradSeedOpt = Annotated[
    int | None, typer.Option("--grad-seed", help="Seed of the generated gradients (default 0; see docs/replay.md).")
]
GradScaleOpt = Annotated[
    float | None, typer.Option("--grad-scale", help="Std-dev of the generated gradients (default 1e-3).")
]
OptimizerOpt = Annotated[
    OptimizerChoice,
    typer.Option("--optimizer-type", "--optimizer", help="Optimizer type; auto: layout record, else the state fields."),
]
OffloadPatternsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--offload-patterns",
        help="cpu_offload_adamw: regex of parameters kept on the CPU (repeatable; overrides the record).",
    ),
]
ChunkSizeOpt = Annotated[
    int | None, typer.Option("--chunk-size", min=1, help="cpu_offload_adamw: elements per staged chunk.")
]
StepsOpt = Annotated[
    int,
    typer.Option(
        "--steps",
        min=1,
        help="Optimizer steps to replay from the saved state, each with the saved lr; compared after the last (step = saved + N).",
    ),
]
MaxMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        metavar="SIZE",
        help="Peak memory of one batch of parameters: 8GiB or 8G (2^30), 8GB (10^9), bytes "
        "(default half the available RAM).",
    ),
]
ToleranceOpt = Annotated[
    str | None,
    typer.Option(
        "--tolerance",
        metavar="RTOL,ATOL",
        help="rtol,atol for FP32 values (widened to the dtype's rounding for BF16); default 1e-5,1e-8.",
    ),
]
RtolOpt = Annotated[
    float | None, typer.Option("--rtol", help="Relative tolerance alone (as diff's); the other keeps its default.")
]
AtolOpt = Annotated[
    float | None, typer.Option("--atol", help="Absolute tolerance alone (as diff's); the other keeps its default.")
]
ReferenceDtypeOpt = Annotated[
    str,
    typer.Option(
        "--reference-dtype",
        metavar="<float64|float32>",
        help=f"Dtype of the independent reference step ({dtype_aliases_help(('float64', 'float32'))}).",
    ),
]

ReferenceOpt = Annotated[
    str,
    typer.Option(
        "--reference",
        metavar="<formula|torch>",
        help="torch: also step torch.optim.AdamW with the flags saved in the param groups (fused, foreach, ...) "
        "and require the replay to equal it bitwise.",
    ),
]

HeadDimOpt = Annotated[
    int | None,
    typer.Option(
        "--head-dim",
        min=1,
        help="Attention head dim: assembles fused wqkv state saved beside split wq/wk/wv (torchtitan) when the "
        "checkpoint does not tell it (no q_norm, no config.json saved with it).",
    ),
]


@command_boundary
def replay_step_command(
    checkpoint: opt.CheckpointArg,
    device: DeviceOpt = DeviceChoice.auto,
    filter_glob: ReplayFilterOpt = None,
    select: SelectOpt = None,
    grads: GradsOpt = None,
    grad_seed: GradSeedOpt = None,
    grad_scale: GradScaleOpt = None,
    optimizer: OptimizerOpt = OptimizerChoice["auto"],
    offload_patterns: OffloadPatternsOpt = None,
    chunk_size: ChunkSizeOpt = None,
    steps: StepsOpt = 1,
    max_memory: MaxMemoryOpt = None,
    tolerance: ToleranceOpt = None,
    rtol: RtolOpt = None,
    atol: AtolOpt = None,
    reference_dtype: ReferenceDtypeOpt = "float64",
    reference: ReferenceOpt = "formula",
    head_dim: HeadDimOpt = None,
    json_output: opt.JsonOpt = False,
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
    """Replay the next optimizer step from the saved state on --device and compare with an independent reference.

    Exit 0: every parameter matches with a sane update; 1: a mismatch beyond tolerance, an update beyond its bound or
    a saved lr or eps of 0 (R003), saved moments beyond Adam's bound or a step reset to 0 (O007, D007), a stepped
    parameter that could not be replayed, steps counted with no optimizer state saved, an optimizer step that is not
    the trainer's or the LR scheduler's (R002), or a group lr not the LR scheduler's (R006); 2: unusable input.
    """
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.entry import replay_mismatch, run_replay

    options = _replay_options(
        device=device,
        filter_glob=filter_glob,
        select=select,
        grads=grads,
        grad_seed=grad_seed,
        grad_scale=grad_scale,
        optimizer=optimizer,
        offload_patterns=offload_patterns,
        chunk_size=chunk_size,
        steps=steps,
        max_memory=max_memory,
        tolerance=_tolerance(tolerance, rtol, atol),
        reference_dtype=reference_dtype,
        reference=reference,
        head_dim=head_dim,
    )
    decl = declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    sel = selection(step, optimizer_dir, schema, model_prefix, optimizer_prefix)
    from ckpttool.ui.render import PhaseProgress

    # phases named on stderr (opening, planning, loading, building, replaying); the parameter bar from its total on
    with PhaseProgress.on_stderr("replay-step", not json_output and sys.stderr.isatty(), unit="items") as shown:
        if shown is not None:  # torch's import takes seconds: named, not counted as the open
            shown.phase("loading torch")
            importlib.import_module("torch")
            shown.phase(f"opening {checkpoint}")
        result = run_replay(
            checkpoint,
            options,
            opening=OpenOptions(declaration=decl, trust_pickle=trust_pickle, selection=sel),
            progress=shown.progress if shown is not None else None,
            phase=shown.phase if shown is not None else None,
        )
    Output(json_output).result(result, render_replay)
    mismatch = replay_mismatch(result)
    if mismatch is not None:
        print_error(mismatch)
        raise typer.Exit(ReplayMismatchError.exit_code)


def _tolerance(text: str | None, rtol: float | None, atol: float | None) -> str:
    """The ``rtol,atol`` text of ``--tolerance`` or ``--rtol``/``--atol`` (each defaulting to 1e-5 / 1e-8).

    Raises:
        UsageError: ``--tolerance`` given with ``--rtol`` or ``--atol``.
    """
    if text is not None:
        if rtol is not None or atol is not None:
            raise UsageError(
                "--tolerance and --rtol/--atol are exclusive", hint="give --rtol R --atol A, or --tolerance R,A"
            )
        return text
    for flag, value, example in (("--rtol", rtol, "1e-5"), ("--atol", atol, "1e-8")):
        if value is not None and not (math.isfinite(value) and value >= 0):  # named by the flag given
            raise UsageError(
                f"{flag} {value!r}: must be a finite number >= 0 (an infinite or NaN tolerance accepts any result, "
                "so the check could never fail)",
                hint=f"e.g. {flag} {example} (widen it for a looser check)",
            )
    return f"{1e-5 if rtol is None else rtol!r},{1e-8 if atol is None else atol!r}"


def _replay_options(
    *,
    device: DeviceChoice,
    filter_glob: str | None,
    select: str | None,
    grads: Path | None,
    grad_seed: int | None,
    grad_scale: float | None,
    optimizer: OptimizerChoice,
    offload_patterns: list[str] | None,
    chunk_size: int | None,
    steps: int,
    max_memory: str | None,
    tolerance: str,
    reference_dtype: str,
    reference: str = "formula",
    head_dim: int | None = None,
) -> ReplayOptions:
    """The :class:`~ckpttool.ops.replay.ReplayOptions` of replay-step's options, checked.

    Raises:
        UsageError: exclusive options given together, an unparsable size, tolerance or dtype.
    """
    from ckpttool.ops.replay import ReplayOptions

    if grads is not None and (grad_seed is not None or grad_scale is not None):
        raise UsageError(
            "--grads and --grad-seed/--grad-scale are exclusive", hint="give a gradients file or a seed, not both"
        )
    if select is not None:
        if filter_glob is not None:
            raise UsageError("--select and --filter are exclusive", hint="give one --filter GLOB")
        deprecated("replay-step --select REGEX", "--filter GLOB (a glob over checkpoint keys, as inspect/export)")
    options = ReplayOptions(
        device=device.value,
        select=select,
        filter_glob=filter_glob,
        grads=grads,
        grad_seed=ReplayOptions.grad_seed if grad_seed is None else grad_seed,  # the library's defaults
        grad_scale=ReplayOptions.grad_scale if grad_scale is None else grad_scale,
        optimizer=optimizer.value,
        offload_patterns=offload_patterns or None,
        chunk_size=chunk_size,
        steps=steps,
        max_memory=parse_size(max_memory, "--max-memory") if max_memory is not None else None,
        tolerance=parse_tolerance(tolerance),
        reference_dtype=parse_dtype(reference_dtype, "--reference-dtype", ("float64", "float32")),
        reference=reference.strip().lower(),
        head_dim=head_dim,
    )
    options.check()
    return options


def _err_cell(err: Any) -> str:
    if err is None:
        return "-"
    mark = "" if err.ok else " !"
    return f"{err.max_abs:.1e}/{err.max_rel:.1e}{mark}"


def render_replay(result: ReplayResult, *, max_rows: int = 40) -> None:
    """Print a :class:`~ckpttool.ops.replay.ReplayResult` as a header, a table (worst first) and a verdict."""
    from ckpttool.ui.render import STYLES, plural, stdout_console, styled

    con = stdout_console()
    _print_replay_header(con, result)
    shown = [p for p in result.params if not p.ok] + [p for p in result.params if p.ok][
        : max(0, max_rows - len(result.failed))
    ]
    _print_param_table(con, shown)
    con.print("errors      max abs/max rel vs the reference, per field (! beyond tolerance)")
    if len(shown) < len(result.params):
        con.print(f"... {len(result.params) - len(shown)} more parameter(s) passed (use --json for all)")
    _print_replay_timing(con, result)
    word = "OK" if result.ok else "FAILED"
    con.print(
        styled(
            "result      ",
            (word, STYLES[word]),
            f": {len(result.params) - len(result.failed)} of {plural(len(result.params), 'parameter')} "
            f"{'matches' if len(result.params) == 1 else 'match'} the reference step with a sane update"
            + (
                f"; {len(result.skipped)} stepped parameter(s) not replayed, e.g. {result.skipped[0]}"
                if result.skipped
                else ""
            )
            + (f"; {len(result.frozen)} frozen parameter(s) (no optimizer state) not replayed" if result.frozen else "")
            + (
                f"; the saved state as a whole does not resume the run ({plural(len(result.problems), 'problem')} "
                "below)"
                if result.problems
                else ""
            ),
        ),
    )
    for problem in result.problems:
        con.print(styled("problem     ", (problem, STYLES["FAIL"])))


def _print_replay_header(con: Any, result: ReplayResult) -> None:
    """The checkpoint, device, optimizer, gradients, replay settings and notes of a replay."""
    from ckpttool.ui.render import fmt_value, human_bytes, plural

    con.print(f"checkpoint  {result.path}")
    con.print(f"device      {result.device}")
    cfg = "; ".join(
        f"{t}: "
        + ", ".join(
            f"{k}={fmt_value(v)}" for k, v in c.items() if k != "cpu_offload_param_patterns" or c.get("cpu_offload")
        )
        for t, c in result.optimizer_config.items()
        if c
    )
    con.print(f"optimizer   {result.optimizer_type} (from {result.optimizer_reason})" + (f"; {cfg}" if cfg else ""))
    g = result.grads
    con.print(
        "grads       "
        + (f"file {g['path']}" if g["source"] == "file" else f"seeded (seed {g['seed']}, scale {g['scale']:g})")
    )
    rtol, atol = result.tolerance
    torch_checked = sum(p.torch_unequal is not None for p in result.params)  # --reference torch
    also = (
        f" and torch.optim.AdamW with the saved flags (bitwise, {torch_checked} of "
        f"{plural(len(result.params), 'parameter')})"
        if torch_checked
        else ""
    )
    con.print(
        f"replay      {plural(result.steps, 'step')} vs a {result.reference_dtype} reference{also}; tolerance rtol "
        f"{rtol:g} atol {atol:g} (BF16 values: 2 ulp); {plural(result.batches, 'batch', 'batches')} under "
        f"{human_bytes(result.max_memory)}"
    )
    for n in result.notes:
        con.print(f"note        {with_flags(n)}")


def _print_param_table(con: Any, shown: list[Any]) -> None:
    """The table of the parameters shown, one row each (errors per field, placement, verdict)."""
    from ckpttool.ui.render import STYLES, Col, print_table, styled

    rows = []
    for p in shown:
        step = "-" if p.step_after is None else f"{p.step_before:g}->{p.step_after:g}"
        place = ",".join(sorted({v.split(":")[0] for k, v in p.placement.items() if k != "param"})) or "-"
        rows.append(
            [
                p.fqn,
                p.optimizer_type,
                p.state + (" offload" if p.offloaded else ""),
                f"{p.lr:g}",
                step,
                _err_cell(p.fields.get("master_weight")),
                _err_cell(p.fields.get("exp_avg")),
                _err_cell(p.fields.get("exp_avg_sq")),
                _err_cell(p.fields.get("param")),
                f"{p.placement.get('param', '-').split(':')[0]}/{place}",
                styled(("ok", STYLES["ok"])) if p.ok else styled(("FAIL: " + "; ".join(p.problems), STYLES["FAIL"])),
            ]
        )
    print_table(
        con,
        "parameters (worst first)",
        [
            Col("parameter", "key"),
            Col("optimizer", "code", drop=10),
            Col("state", "code", drop=9),
            Col("lr", "num", drop=7),
            Col("step", "code", drop=8),
            Col("master_weight", "num", drop=4, hide_empty=True),
            Col("exp_avg", "num", drop=5),
            Col("exp_avg_sq", "num", drop=6),
            Col("param", "num"),
            Col("param/state on", "code", drop=11),
            Col("result", "text"),
        ],
        rows,
    )


def _print_replay_timing(con: Any, result: ReplayResult) -> None:
    """The timing line (and the offload transfer line when parameters were offloaded)."""
    from ckpttool.ui.render import fmt_rate, human_bytes, plural

    t = result.timing
    con.print(
        f"timing      optimizer.step {t['step_seconds'] * 1e3:.1f} ms for {plural(result.steps, 'step')}, "
        f"{human_bytes(t['state_bytes'])} of state read+written ({fmt_rate(t['state_bytes'], t['step_seconds'])}); "
        f"load {t['load_seconds']:.2f} s, reference {t['reference_seconds']:.2f} s, total {t['total_seconds']:.2f} s"
    )
    if t["offload_seconds"] > 0:
        con.print(
            f"offload     D2H {human_bytes(t['d2h_bytes'])} ({t['d2h_gbps']:.2f} GB/s), H2D {human_bytes(t['h2d_bytes'])} "
            f"({t['h2d_gbps']:.2f} GB/s) over {t['offload_seconds'] * 1e3:.1f} ms of offloaded steps"
        )


EPILOG = examples(
    "ckpttool replay-step ckpt/",
    "ckpttool replay-step ckpt/ --filter '*experts*' --steps 3",
    "ckpttool replay-step ckpt/ --device cuda --grads grads.safetensors --json",
    "ckpttool replay-step ckpt/ --optimizer-type cpu_offload_adamw --max-memory 8GiB",
)
