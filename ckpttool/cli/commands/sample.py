"""``ckpttool sample DIR``: write a small real checkpoint to try every command on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.output import command_boundary


@command_boundary
def sample_command(
    directory: Annotated[
        Path,
        typer.Argument(help="Where to write the sample checkpoint (must not exist or be empty; written atomically)."),
    ],
    steps: Annotated[int, typer.Option("--steps", min=0, help="AdamW steps before the save.")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="RNG seed, 0 to 2**63-1.")] = 0,
    optimizer: Annotated[
        str,
        typer.Option(
            "--optimizer",
            help="adamw (torch AdamW, FP32 params) or full_fp32_adamw | master_fp32_adamw | cpu_offload_adamw (BF16 params, FP32 master).",
        ),
    ] = "adamw",
) -> None:
    """Write a tiny MoE causal LM checkpoint (HF Qwen3-MoE names, fused experts, layout record)."""
    from ckpttool.ops.sample import write_sample

    out = write_sample(directory, steps=steps, seed=seed, optimizer=optimizer)
    typer.echo(f"wrote sample checkpoint to {out}", err=True)
    typer.echo(f"try: ckpttool inspect {out}", err=True)


def register(app: typer.Typer) -> None:
    app.command("sample")(sample_command)
