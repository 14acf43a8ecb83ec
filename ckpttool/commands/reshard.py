"""``ckpttool reshard SRC DST --to canonical|legacy``: rewrite EP tensors for another layout / mesh."""

from __future__ import annotations

import contextlib
import sys
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.errors import UsageError
from ckpttool.ui import options as opt
from ckpttool.ui.options import declaration, examples, selection
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.reshard import ReshardResult


class TargetLayout(str, Enum):
    canonical = "canonical"
    legacy = "legacy"


ToOpt = Annotated[
    TargetLayout, typer.Option("--to", help="Target EP layout: canonical (version 2) or legacy (version 1).")
]
TargetEpSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--target-ep-size",
        min=1,
        help="EP size of the job that will load the output (with --target-ep-fsdp-size; both or neither, default: the source's).",
    ),
]
TargetEpFsdpSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--target-ep-fsdp-size",
        min=1,
        help="EP-FSDP size of the job that will load the output (with --target-ep-size; both or neither, default: the source's).",
    ),
]
WithOptimizerOpt = Annotated[
    bool,
    typer.Option(
        "--with-optimizer",
        help="Permute the optimizer state (master_weight, exp_avg, exp_avg_sq) of EP parameters with them; required when the checkpoint has such state.",
    ),
]
ManifestOpt = Annotated[
    bool,
    typer.Option(
        "--manifest",
        help="Also write the output's manifest.json, every chunk digested as it is written (no second read); verify with validate --manifest.",
    ),
]


@command_boundary
def reshard_command(
    source: opt.CheckpointArg,
    target: opt.OutputArg,
    to: ToOpt,
    target_ep_size: TargetEpSizeOpt = None,
    target_ep_fsdp_size: TargetEpFsdpSizeOpt = None,
    with_optimizer: WithOptimizerOpt = False,
    source_layout: opt.SourceLayoutOpt = None,
    ep_size: opt.EpSizeOpt = None,
    ep_fsdp_size: opt.EpFsdpSizeOpt = None,
    overwrite: opt.OverwriteOpt = False,
    dry_run: opt.DryRunOpt = False,
    fsync: opt.FsyncOpt = True,
    json_output: opt.JsonOpt = False,
    trust_pickle: opt.TrustPickleOpt = False,
    no_ep: opt.NoEpOpt = False,
    step: opt.StepOpt = None,
    schema: opt.SchemaOpt = None,
    model_prefix: opt.ModelPrefixOpt = None,
    optimizer_prefix: opt.OptimizerPrefixOpt = None,
    verify_crc: opt.VerifyCrcOpt = True,
    manifest: ManifestOpt = False,
    hash_name: opt.OutputHashOpt = "xxh3-128",
) -> None:
    """Write a new DCP checkpoint with expert tensors in the target layout, one data file per target rank.

    Non-EP tensors and byte items are copied unchanged; the output carries a layout record
    naming the source (its .metadata and manifest.json digests). The source is only read; the
    output appears only when complete.
    """
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.entry import run_writing
    from ckpttool.ops.reshard import ReshardOptions, reshard
    from ckpttool.ui.render import PhaseProgress

    if source_layout is None and not no_ep and (ep_size is not None or ep_fsdp_size is not None):
        # the sizes of the saving mesh; --ep-size 2 meant for the output is a target size
        raise UsageError(
            "--ep-size/--ep-fsdp-size given without --source-layout",
            hint="for the mesh of the job that will load the output pass --target-ep-size and --target-ep-fsdp-size; "
            "to declare the mesh an unversioned checkpoint was saved with, add --source-layout legacy|canonical",
        )
    decl = declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    sel = selection(step, None, schema, model_prefix, optimizer_prefix)
    options = ReshardOptions(
        to=to.value,
        target_ep_size=target_ep_size,
        target_ep_fsdp_size=target_ep_fsdp_size,
        with_optimizer=with_optimizer,
        overwrite=overwrite,
        verify_crc=verify_crc,
        fsync=fsync,
        manifest=manifest,
        algorithm=hash_name,
        dry_run=dry_run,
    )
    # phases named on stderr (opening, planning, writing, ...); the byte bar of the writing from its total on
    with PhaseProgress.on_stderr("reshard", not json_output and sys.stderr.isatty()) as shown:
        if shown is not None:
            shown.phase(f"opening {source}")
        res, _ = run_writing(
            reshard,
            source,
            target,
            options,
            opening=OpenOptions(declaration=decl, trust_pickle=trust_pickle, selection=sel),
            progress=lambda: contextlib.nullcontext(shown.progress if shown is not None else None),
            phase=shown.phase if shown is not None else None,
        )
    sink = Output(json_output)
    sink.result(res, _render)
    for w in res.warnings:  # after the summary; they do not change the exit code
        sink.warning(w)


def _render(res: ReshardResult) -> None:
    from ckpttool.ui.render import FILES_SHOWN, fmt_list, fmt_rate, fmt_seconds, human_bytes, plural, stdout_console

    con = stdout_console()
    src_v = {None: "unversioned", 1: "legacy (version 1)", 2: "canonical (version 2)"}[res.from_version]
    to_v = "canonical (version 2)" if res.to_version == 2 else "legacy (version 1)"
    src_sizes = (
        f"ep_size {res.from_ep_size}, ep_fsdp_size {res.from_ep_fsdp_size}" if res.from_ep_size else "sizes unknown"
    )
    n_perm = len(res.permuted)
    con.print(f"source  {res.source}: {src_v} [{res.from_source}], {src_sizes}")
    con.print(
        f"target  {res.target}: {to_v}, ep_size {res.ep_size}, ep_fsdp_size {res.ep_fsdp_size}, "
        f"{plural(len(res.files), 'data file')} (one per target rank)"
    )
    con.print(
        f"tensors {plural(res.ep_tensors, 'EP parameter')}, {plural(res.optimizer_tensors, 'optimizer state tensor')} "
        f"of them, {n_perm} with a new expert order; {plural(res.passthrough_tensors, 'other tensor')} and "
        f"{plural(res.byte_items, 'byte item')} copied unchanged"
    )
    if res.dry_run:  # --dry-run: the plan, nothing written (bytes: tensor data per target rank file)
        per_file = fmt_list((str(f["path"]) + " " + human_bytes(f["bytes"]) for f in res.files), limit=FILES_SHOWN)
        con.print(
            f"plan    {human_bytes(res.bytes_written)} of tensor data ({per_file}); "
            f"{plural(res.chunks_copied, 'chunk')} to copy verbatim, {res.chunks_rewritten} to reassemble"
            + (f"; would also copy {', '.join(res.extra_files)}" if res.extra_files else "")
        )
        con.print(f"dry run: nothing was written (planned in {fmt_seconds(res.seconds)})")
        return
    con.print(  # the rate of the writing alone
        f"wrote   {human_bytes(res.bytes_written)} ({fmt_seconds(res.seconds)} in all; written in "
        f"{fmt_seconds(res.write_seconds)}, {fmt_rate(res.bytes_written, res.write_seconds)}); "
        f"{plural(res.chunks_copied, 'chunk')} copied verbatim, {res.chunks_rewritten} reassembled"
        + (f"; also copied {', '.join(res.extra_files)}" if res.extra_files else "")
    )
    if res.manifest is not None:
        con.print(f"manifest {res.target}/{res.manifest} (storage records digested as written)")


EPILOG = examples(
    "ckpttool reshard ckpt/ out/ --to canonical --with-optimizer",
    "ckpttool reshard ckpt/ out/ --to canonical --with-optimizer --target-ep-size 4 --target-ep-fsdp-size 2",
    "ckpttool reshard old/ new/ --to canonical --with-optimizer --source-layout legacy --ep-size 4 --ep-fsdp-size 2",
    "ckpttool reshard ckpt/ out/ --to canonical --with-optimizer --manifest --hash blake3",
)
