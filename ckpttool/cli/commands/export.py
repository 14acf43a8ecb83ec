"""``ckpttool export DIR OUT``: Hugging Face safetensors (sharded + index) or a PEFT LoRA adapter."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.cli.options import (
    CheckpointArg,
    EpFsdpSizeOpt,
    EpSizeOpt,
    FilterOpt,
    JsonOpt,
    OverwriteOpt,
    SourceLayoutOpt,
    TrustPickleOpt,
    VerifyCrcOpt,
    declaration,
    parse_size,
)
from ckpttool.cli.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.export import ExportResult


class ExportFormat(str, Enum):
    hf = "hf"
    lora = "lora"


class SaveDtype(str, Enum):
    preserve = "preserve"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Weights(str, Enum):
    params = "params"
    master = "master"


class Experts(str, Enum):
    fused = "fused"
    per_expert = "per-expert"


@command_boundary
def export_command(
    checkpoint: CheckpointArg,
    out: Annotated[
        Path,
        typer.Argument(help="Output directory (written beside itself, renamed when complete).", show_default=False),
    ],
    fmt: Annotated[
        ExportFormat, typer.Option("--format", help="hf: model*.safetensors + index; lora: PEFT adapter.")
    ] = ExportFormat.hf,
    save_dtype: Annotated[
        SaveDtype,
        typer.Option(
            "--save-dtype",
            help="preserve: each tensor in its stored dtype, bit-exact; else cast floating tensors only.",
        ),
    ] = SaveDtype.preserve,
    weights: Annotated[
        Weights,
        typer.Option(
            "--weights", help="params: stored parameters; master: FP32 optimizer master_weight where present."
        ),
    ] = Weights.params,
    shard_size: Annotated[
        str, typer.Option("--shard-size", help="Max bytes per file: 5GB (10^9), 2GiB, or bytes.")
    ] = "5GB",
    experts: Annotated[
        Experts,
        typer.Option(
            "--experts",
            help="fused: experts.gate_up_proj [E,2I,H] as stored (transformers v5); per-expert: experts.{j}.*_proj.weight.",
        ),
    ] = Experts.fused,
    rules: Annotated[
        Path | None,
        typer.Option("--rules", help="YAML key/expert rules merged over the packaged defaults (docs/export.md)."),
    ] = None,
    model_assets: Annotated[
        Path | None,
        typer.Option(
            "--model-assets",
            help="Directory with config.json / tokenizer files to copy (config drives tied embeddings and num_experts).",
        ),
    ] = None,
    filter_glob: FilterOpt = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Reader threads [default: min(8, CPUs)].")
    ] = None,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    source_layout: SourceLayoutOpt = None,
    ep_size: EpSizeOpt = None,
    ep_fsdp_size: EpFsdpSizeOpt = None,
    adapter_config: Annotated[
        Path | None,
        typer.Option(
            "--adapter-config", help="LoRA: adapter_config.json to write (default: --model-assets' or inferred)."
        ),
    ] = None,
    lora_alpha: Annotated[
        float | None, typer.Option("--lora-alpha", help="LoRA: lora_alpha when no adapter config is given.")
    ] = None,
    trust_pickle: TrustPickleOpt = False,
    verify_crc: VerifyCrcOpt = True,
) -> None:
    """Export model weights as Hugging Face safetensors or a LoRA adapter (streaming, bit-exact by default)."""
    from ckpttool.model.checkpoint import open_checkpoint
    from ckpttool.ops.export import ExportOptions, export_checkpoint

    decl = declaration(source_layout, ep_size, ep_fsdp_size)
    alpha: float | int | None = lora_alpha
    if alpha is not None and float(alpha).is_integer():
        alpha = int(alpha)
    options = ExportOptions(
        fmt=fmt.value,
        save_dtype=save_dtype.value,
        weights=weights.value,
        shard_size=parse_size(shard_size, "--shard-size"),
        experts=experts.value,
        rules=rules,
        model_assets=model_assets,
        filter_glob=filter_glob,
        workers=workers,
        overwrite=overwrite,
        verify_crc=verify_crc,
        adapter_config=adapter_config,
        lora_alpha=alpha,
    )
    from ckpttool.cli.render import byte_progress

    with (
        open_checkpoint(checkpoint, declaration=decl, trust_pickle=trust_pickle) as ckpt,
        byte_progress("export", not json_output and sys.stderr.isatty()) as update,
    ):
        result = export_checkpoint(ckpt, out, options, progress=update)
    sink = Output(json_output)
    for w in result.warnings:
        sink.warning(w)
    sink.result(result, _render)


def _render(r: ExportResult) -> None:
    """Human summary on stdout (the console escapes control characters and never interprets markup)."""
    from ckpttool.cli.render import human_bytes, stdout_console, table

    con = stdout_console()
    con.print(
        f"exported {r.tensors} tensors, {human_bytes(r.bytes)} in {len(r.files)} file(s) to {r.output} "
        f"({r.seconds:.2f} s, {r.gb_per_s:.2f} GB/s)",
        markup=False,
    )
    con.print(
        table(
            "files", ["file", "tensors", "bytes"], [[f["name"], f["tensors"], human_bytes(f["bytes"])] for f in r.files]
        )
    )
    con.print(
        f"save dtype  {r.save_dtype}" + (f"; casts: {_counts(r.casts)}" if r.casts else "; no casts"), markup=False
    )
    if r.narrowing_casts:
        con.print(f"narrowing casts (precision or range lost): {_counts(r.narrowing_casts)}", markup=False)
    params = r.origins.get("params", [])
    master = r.origins.get("master", [])
    if r.weights == "master":
        con.print(
            f"weights     {len(master)} from FP32 master_weight, {len(params)} from stored parameters (no master)"
            + (f": {', '.join(params[:5])}{' ...' if len(params) > 5 else ''}" if params else ""),
            markup=False,
        )
    if r.experts == "per-expert" or r.layout.get("unpermuted"):
        un = r.layout.get("unpermuted") or []
        con.print(
            f"experts     {r.experts}" + (f"; {len(un)} tensor(s) un-permuted from the legacy EP layout" if un else ""),
            markup=False,
        )
    if r.tied_embeddings:
        msg = {
            "omitted": "tied: lm_head omitted (bitwise equal to the embedding)",
            "absent": "tied: the checkpoint has no lm_head",
            "embedding-not-exported": "tied: embedding not exported, lm_head written",
        }.get(r.tied_embeddings, r.tied_embeddings)
        con.print(f"embeddings  {msg}", markup=False)
    if r.skipped:
        con.print(
            "not exported " + "; ".join(f"{reason}: {len(keys)}" for reason, keys in r.skipped.items()), markup=False
        )
    if r.assets:
        con.print(f"assets      {', '.join(r.assets)}", markup=False)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in d.items())


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
