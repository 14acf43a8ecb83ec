"""Per-rank rules: what a per-rank checkpoint (:mod:`ckpttool.format.perrank`) keeps beside its rank files."""

from __future__ import annotations

from collections.abc import Iterator

from ckpttool.format.files import resolve_inside
from ckpttool.ops.validate.base import Severity, rule
from ckpttool.ops.validate.context import Context


@rule(
    "D012",
    "hf-copy-differs",
    Severity.error,
    "a full HF model saved beside per-rank shards (verl's huggingface/model.safetensors, NeMo Automodel's "
    "model/consolidated/) differs from the tensors the shards assemble",
    "the two were saved from different states (or one is damaged): export from the shards, or re-save the HF copy",
    needs=("deep",),
)
def hf_copy_differs(ctx: Context) -> Iterator[tuple[str, str]]:
    from ckpttool.model.schemas.nemo import hf_copies

    assembled = getattr(ctx.reader, "assembled", None)
    located = ctx.ckpt.located
    nemo = hf_copies(ctx.reader.path, located.model if located is not None else None)  # NeMo's consolidated/
    copies = [*getattr(assembled, "companions", ()), *nemo]
    if not copies:  # the usual case: nothing to compare, torch not imported (~1.5 s of start-up)
        return
    import torch
    from safetensors import safe_open

    for rel in copies:
        path = resolve_inside(ctx.reader.path, rel, what="HF copy")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                key = ctx.cat.model_key(name)
                if key not in ctx.cat.model:
                    yield name, f"{rel}: {name} is not a tensor of the checkpoint"
                    continue
                hf = f.get_tensor(name)
                ours = ctx.reader.read_tensor(key)
                if hf.shape != ours.shape:
                    yield key, f"{rel}: {name} is {list(hf.shape)}, the shards assemble {list(ours.shape)}"
                    continue
                ours = ours.to(hf.dtype)
                bad = ours != hf
                if hf.is_floating_point():
                    bad &= ~(torch.isnan(ours) & torch.isnan(hf))
                n = int(bad.sum())
                if n:
                    diff = float((ours.double() - hf.double()).abs()[bad].max())
                    yield (
                        key,
                        f"{rel}: {name}: {n} of {hf.numel()} elements differ from the shards (max |diff| {diff:.4g})",
                    )


@rule(
    "K020",
    "perrank-files-not-read",
    Severity.error,
    "files in a per-rank checkpoint directory that no item names were not read (torch-checkpointing "
    "records the path of an item saved at a custom LayoutInfo path only when the item declares a resharder)",
    "check those files with the framework's own loader, or move them out of the checkpoint directory "
    "if they are not part of it",
)
def perrank_files_not_read(ctx: Context) -> Iterator[tuple[str | None, str]]:
    assembled = getattr(ctx.reader, "assembled", None)
    unread = list(getattr(assembled, "unread", ()))
    if unread:
        more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
        yield None, f"{len(unread)} file(s) not read: {', '.join(unread[:5])}{more}"


@rule(
    "K021",
    "frozen-parameters",
    Severity.info,
    "parameters in the optimizer's param groups with no optimizer state on any rank of a per-rank save "
    "(verl FSDP): frozen (requires_grad=False), never stepped; not lost state (O009 does not count them)",
    "nothing to fix when they were frozen on purpose; replay-step leaves them out and says so",
)
def frozen_parameters(ctx: Context) -> Iterator[tuple[str | None, str]]:
    frozen = sorted(ctx.cat.frozen)
    if frozen:
        more = f" and {len(frozen) - 4} more" if len(frozen) > 4 else ""
        yield frozen[0], f"{len(frozen)} frozen parameter(s), no optimizer state: {', '.join(frozen[:4])}{more}"
