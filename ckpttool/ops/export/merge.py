"""Merged LoRA export (``--format hf-merged`` / ``--merge-lora``): ``W' = W + (alpha / r) * B @ A``, slab by slab.

The formula is LoRA's (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
eq. 3) with PEFT's scaling ``lora_alpha / r`` (``peft.tuners.lora.layer.LoraLayer.update_layer``)
and PEFT's order ``(B @ A) * scaling`` (``get_delta_weight``). Computed in FP32 for every
slab of ``W`` (``[out, in]``): for the columns ``c0..c1`` of row ``i``,
``W[i, c0:c1] + s * (B[i] @ A[:, c0:c1])``; the result is written in ``W``'s stored dtype (or
``--save-dtype``), rounded once. ``A`` ``[r, in]`` and ``B`` ``[out, r]`` are read once, in FP32.

rsLoRA (``use_rslora``) scales by ``alpha / sqrt(r)``, as PEFT does. A ``Conv1D`` weight (``[in, out]``, PEFT's
``fan_in_fan_out``) is given the factors transposed (``A.T``, ``B.T``): ``W + s * (B @ A).T``.
So is an embedding's ``lora_embedding_A`` / ``lora_embedding_B`` (PEFT's ``Embedding``: ``(B @ A).T``).
Not implemented, refused by name: DoRA (``use_dora``, ``lora_magnitude_vector``), and the LoRA variants whose
model is not ``W + s * B @ A`` (:data:`UNMERGED_VARIANTS`: aLoRA, Arrow, KaSA).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ckpttool.errors import ExportError
from ckpttool.format.metadata import DTYPE_ITEMSIZE
from ckpttool.format.tiling import unravel
from ckpttool.ops.export.lora import pattern_key
from ckpttool.ops.export.transform import Cast, SlabWhere

if TYPE_CHECKING:
    import numpy as np

__all__ = ["LoraMerge", "UNMERGED_VARIANTS", "lora_scaling", "nonfinite_merge"]

#: ``LoraConfig`` fields of the LoRA variants whose trained model is not ``W + s * B @ A`` (PEFT's
#: ``tuners/lora/variants.py``): the field -> why the merge would not be that model.
UNMERGED_VARIANTS = {
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) applies the adapter only from its invocation "
    "tokens on, which no merged weight does (PEFT's merge raises 'aLoRA does not support merging')",
    "arrow_config": "Arrow (arrow_config) routes each token among several adapters (PEFT's merge raises)",
    "kasa_config": "KaSA (kasa_config) scales B @ A by its lora_diag and truncates the base weight",
}


def lora_scaling(
    module: str, r: int, config: dict[str, Any] | None, lora_alpha: float | None, alpha_hint: str | None = None
) -> float:
    """``alpha / r`` for ``module`` (``alpha_pattern`` first, then ``lora_alpha``; ``lora_alpha`` arg overrides);
    ``alpha / sqrt(r)`` when the config sets ``use_rslora`` (rsLoRA, Kalajdzievski 2023, as PEFT scales it).
    ``alpha_hint``: the hint of an unknown alpha (default: pass ``lora_alpha`` or ``adapter_config``).

    Raises:
        ExportError: alpha unknown, DoRA or a variant of :data:`UNMERGED_VARIANTS` in the config, ``r`` / ``rank_pattern`` not the factors' rank.
    """
    cfg = config or {}
    if cfg.get("use_dora"):
        raise ExportError(
            "the adapter config sets use_dora: the DoRA merge is not implemented",
            param="adapter_config",
            hint="merge with PEFT's merge_and_unload(), or export the adapter with `fmt` lora",
        )
    for name, why in UNMERGED_VARIANTS.items():
        if cfg.get(name):
            raise ExportError(
                f"the adapter config sets {name}: {why}; its merge is not implemented",
                param="adapter_config",
                hint="export the adapter with `fmt` lora and load it with PEFT over the base model",
            )
    alpha: Any = lora_alpha
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if alpha is None and (key := pattern_key(alpha_pattern, module)) is not None:
        alpha = alpha_pattern[key]
    if alpha is None:
        alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ExportError(
            f"{module}: lora_alpha is unknown, so the merge scale alpha / r cannot be computed",
            fqn=module,
            hint=alpha_hint
            or "pass `lora_alpha` A (the LoraConfig lora_alpha used in training) or `adapter_config` FILE",
        )
    rank_pattern = cfg.get("rank_pattern") or {}
    key = pattern_key(rank_pattern, module)
    want_r = cfg.get("r") if key is None else rank_pattern[key]
    if isinstance(want_r, int) and want_r != r:
        where = "r" if key is None else f"rank_pattern[{key!r}]"
        raise ExportError(
            f"{module}: the adapter config says {where}={want_r} but lora_A has rank {r}",
            fqn=module,
            hint="pass the adapter_config.json that belongs to this checkpoint",
        )
    return float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)  # PEFT's update_layer


class LoraMerge:
    """The value transform ``W + s * B @ A`` (a :class:`~ckpttool.ops.export.transform.SlabTransform`).

    Args:
        a, b: ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` as FP32 numpy arrays.
        scale: ``alpha / r``.
        src_dtype, out_dtype: the stored and the written dtype of ``W``.

    Attributes:
        changed: whether any written element differs from ``W`` cast to ``out_dtype`` (set by the workers).
    """

    def __init__(self, a: np.ndarray, b: np.ndarray, scale: float, src_dtype: str, out_dtype: str) -> None:
        self.a, self.b, self.scale = a, b, scale
        self.src_dtype, self.out_dtype = src_dtype, out_dtype
        self.to32 = None if src_dtype == "float32" else Cast(src_dtype, "float32")
        self.from32 = None if out_dtype == "float32" else Cast("float32", out_dtype)
        self.changed = False

    def __call__(self, src: np.ndarray, out: np.ndarray, where: SlabWhere) -> None:
        import numpy as np

        n = src.size // DTYPE_ITEMSIZE[self.src_dtype]
        w = np.empty(n, dtype=np.float32)
        if self.to32 is None:
            w[:] = src.view(np.float32)
        else:
            self.to32(src, w.view(np.uint8), where)
        before = w.copy()
        cols = where.shape[-1]
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite merge is refused below, by name
            for off, g, length in where.ranges:
                row, c0 = divmod(g, cols)
                if c0 + length <= cols:
                    delta = (self.b[row] @ self.a[:, c0 : c0 + length]) * np.float32(self.scale)
                else:
                    rows = length // cols
                    delta = ((self.b[row : row + rows] @ self.a) * np.float32(self.scale)).reshape(-1)
                w[off : off + length] += delta
        if self.from32 is None:
            out.view(np.float32)[:] = w
            changed = not np.array_equal(w.view(np.uint32), before.view(np.uint32))
        else:
            self.from32(w.view(np.uint8), out, where)
            base = np.empty_like(out)
            self.from32(before.view(np.uint8), base, where)
            changed = not np.array_equal(out, base)
        self._refuse_nonfinite(w, before, out, where)
        if changed:
            self.changed = True

    def _refuse_nonfinite(self, w: np.ndarray, before: np.ndarray, out: np.ndarray, where: SlabWhere) -> None:
        """Refuse merged values that are infinite or NaN where the base weight's value is finite: ``s * B @ A``
        beyond float32's range (a huge ``lora_alpha``, factors of 1e38), an infinite or NaN factor (a finite float32 sum
        that bfloat16 or float16 rounds to infinity: :class:`~ckpttool.ops.export.transform.Cast` refuses it first).

        Raises:
            ExportError (E601): the tensor, the first such element and the scale; nothing is published.
        """
        import numpy as np

        bad = ~np.isfinite(w)
        if self.out_dtype in ("bfloat16", "float16"):
            exp = 0x7F80 if self.out_dtype == "bfloat16" else 0x7C00
            bad |= (out.view(np.uint16) & exp) == exp
        bad &= np.isfinite(before)
        hit = np.flatnonzero(bad)
        if not hit.size:
            return
        i = int(hit[0])
        flat = next((g + i - off for off, g, n in where.ranges if off <= i < off + n), None)
        at = f" at {[int(x) for x in unravel(flat, where.shape)]}" if flat is not None else ""
        raise nonfinite_merge(
            where.key,
            at,
            float(w[i]),
            float(before[i]),
            f"as {self.out_dtype}",
            f"{hit.size} such value(s) in this slab",
            self.scale,
        )


def nonfinite_merge(key: str, at: str, value: float, base: float, target: str, count: str, scale: float) -> ExportError:
    """The E601 of a LoRA merge ``W + s * B @ A`` that is not finite where ``W`` is (``at``: `` at [row, col]`` or
    empty; ``target``: what it is not finite as, ``as bfloat16`` or ``to quantize``; ``count``: how many, where)."""
    return ExportError(
        f"{key}: the LoRA merge W + s * B @ A{at} is {value!r} (float32) where W is {base!r}, not finite {target} "
        f"({count}; s = {scale:g})",
        fqn=key,
        hint="check the lora_alpha given (`lora_alpha` or the adapter config) and the lora_A / lora_B factors "
        "(`ckpttool stats --filter '*lora_*'`); nothing was written",
    )
