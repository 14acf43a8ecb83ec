"""``ckpttool sample DIR``: write a small real checkpoint to try every command on."""

from __future__ import annotations

from enum import Enum
from pathlib import PurePath
from typing import Annotated

import typer

from ckpttool.errors import shell_arg
from ckpttool.optim_state.schema import OPTIMIZER_TYPES
from ckpttool.ui.options import OverwriteOpt, examples, local_output_location
from ckpttool.ui.output import command_boundary, deprecated, note

#: ``SampleOptions.optimizer`` choices: the optimizer-state schema's types (:data:`ckpttool.ops.sample.SAMPLE_OPTIMIZERS`)
SampleOptimizer = Enum("SampleOptimizer", {name: name for name in OPTIMIZER_TYPES}, type=str)  # type: ignore[misc]


@command_boundary
def sample_command(
    directory: Annotated[
        PurePath,  # not Path: typer's Path(value) turned s3://b/k into the local folder s3:/b/k
        typer.Argument(
            help="Local directory to write the sample checkpoint to (must not exist or be empty, unless "
            "--overwrite; written atomically; a URL is refused: export or reshard the sample to it).",
            show_default=False,
            metavar="DIR",
            parser=local_output_location,
        ),
    ],
    train_steps: Annotated[
        int, typer.Option("--train-steps", min=0, help="Training steps (AdamW updates) taken before the save.")
    ] = 3,
    old_steps: Annotated[
        int | None, typer.Option("--steps", min=0, hidden=True, help="Deprecated spelling of --train-steps.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="RNG seed, 0 to 2**63-1.")] = 0,
    optimizer: Annotated[
        SampleOptimizer,
        typer.Option(
            "--optimizer-type",
            "--optimizer",
            help="adamw: torch AdamW on FP32 parameters; full_fp32_adamw, master_fp32_adamw (BF16 moments), "
            "cpu_offload_adamw: BF16 parameters with FP32 master weights.",
        ),
    ] = SampleOptimizer["adamw"],
    overwrite: OverwriteOpt = False,
) -> None:
    """Write a tiny MoE causal LM checkpoint (HF Dots1 names, fused experts, a router buffer, layout record)."""
    from ckpttool.ops.sample import SampleOptions, write_sample

    if old_steps is not None:
        deprecated("sample --steps", "--train-steps (replay-step --steps counts replayed steps)")
        train_steps = old_steps
    out = write_sample(
        directory, SampleOptions(steps=train_steps, seed=seed, optimizer=optimizer.value, overwrite=overwrite)
    ).path
    note(f"wrote sample checkpoint to {out}")
    note(f"try: ckpttool inspect {shell_arg(out)}")  # a command to paste, spaces and all


EPILOG = examples(
    "ckpttool sample /tmp/ckpttool-sample --overwrite",
    "ckpttool sample /tmp/ckpt-masters --optimizer-type master_fp32_adamw --train-steps 5",
)
