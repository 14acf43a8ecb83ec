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
    import torch
    from safetensors import safe_open

    from ckpttool.model.schemas.nemo import hf_copies

    assembled = getattr(ctx.reader, "assembled", None)
    located = ctx.ckpt.located
    nemo = hf_copies(ctx.reader.path, located.model if located is not None else None)  # NeMo's consolidated/
    for rel in [*getattr(assembled, "companions", ()), *nemo]:
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
