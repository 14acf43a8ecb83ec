"""Per-rank rules: what a per-rank checkpoint (:mod:`ckpttool.format.perrank`) keeps beside its rank files, and
its frozen parameters (K021, which also lists an adapter setup's frozen base weights in any checkpoint)."""

from __future__ import annotations

from collections.abc import Iterator

from ckpttool.errors import ChecksumError
from ckpttool.format.files import resolve_inside
from ckpttool.model.catalog import adapter_frozen
from ckpttool.ops.validate.base import rule
from ckpttool.ops.validate.context import Context


@rule("D012")
def hf_copy_differs(ctx: Context) -> Iterator[tuple[str, str]]:
    from ckpttool.model.schemas.nemo import hf_copies

    assembled = getattr(ctx.reader, "assembled", None)
    nemo = hf_copies(ctx.reader.path, ctx.ckpt.located.model)  # NeMo's consolidated/
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
                try:
                    ours = ctx.reader.read_tensor(key)
                except ChecksumError:  # damaged shards: S014 names the chunk; nothing to compare the copy with
                    continue
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


@rule("K020")
def perrank_files_not_read(ctx: Context) -> Iterator[tuple[str | None, str]]:
    assembled = getattr(ctx.reader, "assembled", None)
    unread = list(getattr(assembled, "unread", ()))
    if unread:
        more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
        yield None, f"{len(unread)} file(s) not read: {', '.join(unread[:5])}{more}"


@rule("K021")
def frozen_parameters(ctx: Context) -> Iterator[tuple[str | None, str]]:
    frozen = sorted(ctx.cat.frozen)
    if frozen:
        more = f" and {len(frozen) - 4} more" if len(frozen) > 4 else ""
        yield frozen[0], f"{len(frozen)} frozen parameter(s), no optimizer state: {', '.join(frozen[:4])}{more}"
    if not any(g.flavor == "nested" and g.keys.get("params") in ctx.byte_item_errors for g in ctx.cat.param_groups):
        base = adapter_frozen(ctx.cat)  # membership known (else S011 says why)
        if base:
            more = f" and {len(base) - 4} more" if len(base) > 4 else ""
            yield (
                base[0],
                f"{len(base)} frozen base weight(s) of an adapter setup, no optimizer state (in param groups whose "
                f"only parameters with state are LoRA/DoRA adapter parameters): {', '.join(base[:4])}{more}",
            )
