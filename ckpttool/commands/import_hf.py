"""``ckpttool import HF_DIR OUT``: a Hugging Face safetensors model -> a DCP checkpoint (torch-native or torchtitan)."""

from __future__ import annotations

import sys
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.model.adapters import adapter_metavar
from ckpttool.ui.options import (
    IMPORT_SCHEMA_DEFAULT,
    IMPORT_SCHEMA_HELP,
    DryRunOpt,
    FsyncOpt,
    ImportSchemaChoice,
    JsonOpt,
    OutputArg,
    OverwriteOpt,
    examples,
    given_path,
    location,
    parse_dtype,
)
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.import_hf import ImportOptions, ImportResult
    from ckpttool.ui.render import PhaseProgress


HfDirArg = Annotated[
    PurePath,
    typer.Argument(
        help="Hugging Face model directory: model*.safetensors (+ index) and config.json.",
        show_default=False,
        metavar="HF_DIR",
        parser=location,
    ),
]
SchemaOpt = Annotated[ImportSchemaChoice, typer.Option("--schema", help=IMPORT_SCHEMA_HELP)]
AdapterOpt = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        metavar=adapter_metavar(identity=False, importable=True),
        help="Model adapter for --schema torchtitan or megatron (one of that schema's naming) "
        "[default: from config.json model_type].",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="config.json [default: HF_DIR/config.json, or the one saved with the weights: "
        "HF_DIR/.hf_metadata/ (NeMo Automodel), consolidated/, huggingface/].",
        parser=given_path,
    ),
]
WorldSizeOpt = Annotated[
    int,
    typer.Option(
        "--world-size", min=1, help="Pre-shard for N ranks: one file per rank, dim-0 chunks as FSDP2 Shard(0)."
    ),
]
ImportEpSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--ep-size",
        min=1,
        help="Pre-shard MoE expert tensors for EP size P (with --ep-fsdp-size F: P*F files, canonical "
        "EP x EP-FSDP placement, a layout record).",
    ),
]
ImportEpFsdpSizeOpt = Annotated[
    int | None,
    typer.Option("--ep-fsdp-size", min=1, help="EP-FSDP size F of the target mesh (with --ep-size) [default: 1]."),
]
ManifestOpt = Annotated[
    bool,
    typer.Option(
        "--manifest",
        help="Also write OUT/manifest.json, every chunk digested as it is written, naming the source's identity.",
    ),
]
DequantDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        metavar="<bfloat16|float32>",
        help="Dtype of dequantized weights of a quantized checkpoint (block FP8 weight_scale_inv, "
        "compressed-tensors FP8 weight_scale, MXFP4 _blocks/_scales) [default: bfloat16]. Other tensors keep "
        "their stored dtype.",
    ),
]
AllowMismatchOpt = Annotated[
    str | None,
    typer.Option(
        "--allow-mismatch",
        metavar="KINDS",
        help="Import even if the tensors differ from the model class transformers builds from config.json "
        "(--schema torch-native): comma list of missing, shape. Keys the model lacks are a warning.",
    ),
]
HashOpt = Annotated[
    str,
    typer.Option("--hash", metavar="ALGO", help="Digest of the manifest: xxh3-128, blake3 or blake2b-256."),
]


@command_boundary
def import_command(
    hf_dir: HfDirArg,
    out: OutputArg,
    schema: SchemaOpt = IMPORT_SCHEMA_DEFAULT,
    adapter: AdapterOpt = None,
    config: ConfigOpt = None,
    world_size: WorldSizeOpt = 1,
    ep_size: ImportEpSizeOpt = None,
    ep_fsdp_size: ImportEpFsdpSizeOpt = None,
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    fsync: FsyncOpt = True,
    manifest: ManifestOpt = False,
    hash_name: HashOpt = "xxh3-128",
    dtype: DequantDtypeOpt = None,
    allow_mismatch: AllowMismatchOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Import a Hugging Face safetensors model as a DCP checkpoint (streaming, bit-exact, atomic)."""
    from ckpttool.ops.import_hf import ImportOptions
    from ckpttool.ops.import_quant import DEQUANT_DTYPES
    from ckpttool.ui.render import PhaseProgress

    # phases named on stderr (reading headers, planning, writing, ...); the byte bar of the writing from its total on
    with PhaseProgress.on_stderr("import", not json_output and sys.stderr.isatty()) as shown:
        res = _run(
            hf_dir,
            out,
            shown,
            ImportOptions(
                schema=schema.value,
                adapter=adapter,
                config=config,
                world_size=world_size,
                ep_size=ep_size,
                ep_fsdp_size=ep_fsdp_size,
                overwrite=overwrite,
                fsync=fsync,
                manifest=manifest,
                algorithm=hash_name,
                dry_run=dry_run,
                dtype=None if dtype is None else parse_dtype(dtype, "--dtype", DEQUANT_DTYPES),
                allow_mismatch=tuple(k.strip() for k in (allow_mismatch or "").split(",") if k.strip()),
            ),
        )
    sink = Output(json_output)
    for w in res.warnings:
        sink.warning(w)
    sink.result(res, _render)


def _run(hf_dir: PurePath, out: PurePath, shown: PhaseProgress | None, options: ImportOptions) -> ImportResult:
    """``import_hf`` with its phases and bytes shown on ``shown`` (a ``PhaseProgress``, or ``None``)."""
    from ckpttool.ops.import_hf import import_hf

    if shown is None:
        return import_hf(hf_dir, out, options)
    return import_hf(hf_dir, out, options, progress=shown.progress, phase=shown.phase)


def _render(r: ImportResult) -> None:
    from ckpttool.ui.render import FILES_SHOWN, fmt_list, fmt_rate, fmt_seconds, human_bytes, plural, stdout_console

    lines = [
        f"dry run: would import {plural(r.tensors, 'tensor')}, {human_bytes(r.bytes)} to {r.output} in "
        + fmt_list((f"{f['name']} {human_bytes(f['bytes'])}" for f in r.files), limit=FILES_SHOWN)
        + f"; nothing was written (planned in {fmt_seconds(r.seconds)})"
        if r.dry_run
        else f"imported {plural(r.tensors, 'tensor')}, {human_bytes(r.bytes)} to {r.output} "
        f"({fmt_seconds(r.seconds)}, {fmt_rate(r.bytes, r.seconds)})",
        f"key schema  {r.schema}"
        + (f"; adapter {r.adapter}" if r.adapter else "")
        + f"; {plural(r.world_size, 'rank')}",
    ]
    if r.ep_size is not None:
        lines.append(
            f"EP layout   canonical (version 2), ep_size {r.ep_size}, ep_fsdp_size {r.ep_fsdp_size}; "
            f"{plural(r.ep_tensors, 'expert tensor')}"
        )
    if r.dequantized:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r.dequantized["kinds"].items()))
        lines.append(
            f"dequantized {plural(len(r.dequantized['tensors']), 'tensor')} ({kinds}) to {r.dequantized['dtype']}"
        )
    if r.skipped:
        lines.append("not imported " + "; ".join(f"{reason}: {len(keys)}" for reason, keys in r.skipped.items()))
    if r.manifest is not None:
        lines.append(
            f"manifest    {'would write ' if r.dry_run else ''}{r.output}/{r.manifest} (storage records digested as written)"
        )
    if not sys.stdout.isatty():  # a pipe: whole lines, no wrapping; rich (and its start-up) is not needed
        for line in lines:
            typer.echo(line)
        return
    con = stdout_console()
    for line in lines:
        con.print(line)


EPILOG = examples(
    "ckpttool import hf_model/ ckpt/",
    "ckpttool import hf_model/ ckpt/ --world-size 8",
    "ckpttool import qwen3_moe/ ckpt/ --ep-size 4 --ep-fsdp-size 2",
    "ckpttool import hf_model/ s3://bucket/run/step-0",
    "ckpttool import hf_model/ titan/step-0 --schema torchtitan",
    "ckpttool import hf_model/ ckpt/ --world-size 4 --manifest",
    "ckpttool import deepseek_fp8/ ckpt/ --dtype float32",
)
