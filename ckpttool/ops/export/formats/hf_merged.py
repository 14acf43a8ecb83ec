"""``--format hf-merged`` (``--merge-lora``): a PEFT LoRA checkpoint's adapters merged into its base weights.

Written as ``--format hf`` writes a plain model (same files, index and assets): each base
weight with a LoRA pair becomes ``W + (alpha / r) * B @ A`` in FP32, stored in its dtype
(:class:`~ckpttool.ops.export.merge.LoraMerge`, a slab transform); the factors are read, not written.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ckpttool.errors import ExportError
from ckpttool.model.schemas.base import CANONICAL_MODEL_PREFIX, canonical_model_key
from ckpttool.model.wrappers import strip_wrapper_segments
from ckpttool.ops.export.formats.base import ModelFormat
from ckpttool.ops.export.formats.hf import HFFormat
from ckpttool.ops.export.outputs import PrepareRequest, SelectRequest, register_format

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader
    from ckpttool.model.adapters import ModelAdapter
    from ckpttool.model.catalog import Catalog
    from ckpttool.ops.export.plan import ExportPlan, Selected, SelectResult
    from ckpttool.ops.export.rules import ExportRules
    from ckpttool.ops.export.transform import SlabTransform

__all__ = ["HFMergedFormat", "lora_merges"]

_PEFT_RE = re.compile(
    r"^model\.(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector)\.(?P<adapter>[^.]+)(?:\.weight)?$"
)
_PEFT_BASE = canonical_model_key("base_model.model.")
_LORA_BIAS_RE = re.compile(r"\.lora_B\.[^.]+\.bias$")
_KASA_DIAG_RE = re.compile(r"\.lora_diag\.[^.]+$")  # KaSA's lora_diag ParameterDict: ``<module>.lora_diag.<adapter>``


class HFMergedFormat(HFFormat):
    """Hugging Face safetensors of the base model with its LoRA adapter merged in."""

    name = "hf-merged"
    help = "LoRA merged into the base weights"
    reads_adapter_config = True
    detects_model_adapter = False

    def check_names(self, cat: Catalog, adapter: ModelAdapter | None) -> None:
        """Raises ExportError (E601): no model tensor (the PEFT names are checked by :meth:`select`)."""
        ModelFormat.check_names(self, cat, adapter)

    def select(self, req: SelectRequest) -> SelectResult:
        """Base weights named as the plain model, each with its LoRA pair.

        ``model.base_model.model.<m>.base_layer.weight`` -> ``<m>.weight`` (merged), other
        ``model.base_model.model.<x>`` -> ``<x>``; ``modules_to_save.<adapter>.`` copies replace their
        ``original_module.`` (as ``merge_and_unload``); the LoRA factors are read, not written.

        Raises:
            ExportError: DoRA (``lora_magnitude_vector``), several adapters, a
                ``lora_A`` without its ``lora_B`` / base weight, no LoRA tensor at all, ``weights`` master.
        """
        from ckpttool.ops.export.plan import LoraPair, Selected
        from ckpttool.ops.export.select import skip_other_tensors

        cat, rules, filter_glob = req.cat, req.rules, req.filter_glob
        pairs, adapter_name = _lora_pairs(cat)
        selected: list[Selected] = []
        skipped: dict[str, list[str]] = {}
        used: set[str] = set()
        sub: dict[str, Selected] = {}
        for key, entry in cat.model.items():
            mapped = _merged_key(cat, rules, key, filter_glob, skipped)
            if mapped is None:
                continue
            out, plain, module = mapped
            merge = None
            if module is not None and plain.endswith(".weight"):
                p = pairs.get(module, {})
                if "lora_A" in p and "lora_B" in p:
                    merge = LoraPair(p["lora_A"], p["lora_B"], module, adapter_name)
                    used.add(module)
            sel = Selected(key, out, entry, "params", merge=merge)
            if out in sub:
                raise ExportError(
                    f"{sub[out].model_key} and {key} both map to the output key {out!r}",
                    fqn=key,
                    hint="fix the key rules (`rules`) so every output key is unique",
                )
            sub[out] = sel
            selected.append(sel)
        orphan = sorted(set(pairs) - used)
        if orphan and not filter_glob:
            raise ExportError(
                f"{len(orphan)} LoRA module(s) have no base layer weight (or lack lora_A / lora_B) to merge into: {orphan[0]}",
                fqn=orphan[0],
                hint="an adapter-only checkpoint: export it with `fmt` lora and merge with PEFT over the base model; "
                "LoRA on parameters (LoraConfig target_parameters: a base_layer with no weight): merge with PEFT's "
                "merge_and_unload()",
            )
        if req.weights == "master":
            raise ExportError(
                f"{cat.path}: the merge reads the stored parameters, not FP32 master_weight copies (`weights` master, "
                "or auto on a checkpoint that has them)",
                param="weights",
                hint="export with `weights` params to merge the stored LoRA factors, or write the adapter from the "
                "masters with `fmt` lora `weights` master and merge it with PEFT",
            )
        if orphan:  # (a filter) the factors of a module whose base weight is not exported were merged into nothing
            factors = {k for m in orphan for k in pairs[m].values()}
            merged = skipped.get(_MERGED, [])
            skipped[_MERGED] = [k for k in merged if k not in factors]
            if not skipped[_MERGED]:
                del skipped[_MERGED]
            from ckpttool.ops.export.plan import SKIP_FILTERED

            skipped.setdefault(SKIP_FILTERED, []).extend(k for k in merged if k in factors)
        skip_other_tensors(cat, skipped)
        return selected, [], skipped, {}

    def transforms(self, req: PrepareRequest) -> dict[str, SlabTransform]:
        return lora_merges(req.reader, req.plan, req.given, req.lora_alpha, req.model_config)

    def check_written(self, transforms: dict[str, SlabTransform], plan: ExportPlan) -> None:
        """Refuse a merged export that equals the base weights bitwise while the adapters are non-zero.

        Raises:
            ExportError: no merged weight changed (the delta is below the output dtype's precision, or alpha is 0).
        """
        live = [(k, m) for k, m in transforms.items() if getattr(m, "nonzero", False)]
        if live and not any(getattr(m, "changed", False) for _, m in live):
            raise ExportError(
                f"the merged weights are bitwise equal to the base weights although {len(live)} LoRA pair(s) are "
                f"non-zero (e.g. {live[0][0]}): the delta is below the output dtype's precision or the scale is 0",
                fqn=live[0][0],
                hint="check `lora_alpha`, or write a wider dtype with `save_dtype` float32",
            )
        unchanged = [k for k, m in live if not getattr(m, "changed", False)]
        if unchanged:
            plan.warnings.append(f"{len(unchanged)} merged weight(s) equal their base bitwise: {unchanged[0]}")


_MERGED = "LoRA factor merged into its base weight"
_VARIANT_STATE = "training state of a LoRA variant (VeloRA, MonteCLoRA), no part of the merged model"
#: VeloRA's ``lora_velora_embed.<adapter>`` (its gradient projection) and MonteCLoRA's
#: ``lora_monteclora_sampler.<adapter>.*`` (its sampling priors): PEFT merges both as plain LoRA, without them
_VARIANT_STATE_RE = re.compile(r"\.lora_(?:velora_embed|monteclora_sampler)\.")


def _lora_pairs(cat: Catalog) -> tuple[dict[str, dict[str, str]], str]:
    """Module path -> ``{"lora_A": key, "lora_B": key}``, and the one adapter's name.

    Raises:
        ExportError: DoRA, KaSA's ``lora_diag``, a lora_B bias, trainable tokens, no LoRA tensor, several adapters.
    """
    pairs: dict[str, dict[str, str]] = {}
    names: set[str] = set()
    for key in cat.model:
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        m = _PEFT_RE.match(canonical)
        if m is None:
            if ".token_adapter.trainable_tokens_delta." in canonical:
                raise ExportError(
                    f"{key}: trainable tokens (LoraConfig trainable_token_indices); their merge is not implemented",
                    fqn=key,
                    hint="merge with PEFT's merge_and_unload(), or export the adapter with `fmt` lora and the run's "
                    "adapter_config.json",
                )
            if _KASA_DIAG_RE.search(canonical):
                raise ExportError(
                    f"{key}: KaSA's singular values (LoraConfig kasa_config); its merge is not implemented",
                    fqn=key,
                    hint="export the adapter with `fmt` lora and load it with PEFT over the base model",
                )
            if _LORA_BIAS_RE.search(canonical):
                raise ExportError(
                    f"{key}: a lora_B bias (LoraConfig lora_bias=True); its merge is not implemented",
                    fqn=key,
                    hint="merge with PEFT's merge_and_unload(), or export the adapter with `fmt` lora",
                )
            continue
        part = m["part"]
        if part == "lora_magnitude_vector":
            raise ExportError(
                f"{key}: DoRA (lora_magnitude_vector); the merge of weight-decomposed LoRA is not implemented",
                fqn=key,
                hint="merge with PEFT's merge_and_unload(), or export the adapter with `fmt` lora",
            )
        names.add(m["adapter"])
        # an embedding's lora_embedding_A [r, num] / lora_embedding_B [dim, r]: merged transposed (_conv1d_weights)
        pairs.setdefault(m["module"], {})[part.replace("embedding_", "")] = key
    if not pairs:
        raise ExportError(
            f"{cat.path}: no LoRA tensor (lora_A / lora_B) to merge",
            hint="`fmt` hf-merged merges a PEFT LoRA checkpoint; export a plain model with `fmt` hf",
        )
    if len(names) > 1:
        raise ExportError(
            f"{cat.path}: the checkpoint holds several LoRA adapters {sorted(names)}; which to merge is ambiguous",
            hint="merge one of them with PEFT, or export each with `fmt` lora and `filter_glob`",
        )
    return pairs, next(iter(names))


def _merged_key(
    cat: Catalog, rules: ExportRules, key: str, filter_glob: str | None, skipped: dict[str, list[str]]
) -> tuple[str, str, str | None] | None:
    """``(output key, plain model key, LoRA module or None)`` of model tensor ``key``; ``None``: skipped (recorded)."""
    canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
    if _PEFT_RE.match(canonical):
        skipped.setdefault(_MERGED, []).append(key)
        return None
    if _VARIANT_STATE_RE.search(canonical):
        skipped.setdefault(_VARIANT_STATE, []).append(key)
        return None
    plain = canonical_model_key(canonical[len(_PEFT_BASE) :]) if canonical.startswith(_PEFT_BASE) else canonical
    if ".original_module." in plain:
        skipped.setdefault("replaced by its modules_to_save copy", []).append(key)
        return None
    plain = re.sub(r"\.modules_to_save\.[^.]+\.", ".", plain)
    module = None
    if ".base_layer." in plain:
        module, _, tail = plain.partition(".base_layer.")
        plain = f"{module}.{tail}"
        module = module[len(CANONICAL_MODEL_PREFIX) :]
    from ckpttool.ops.export.plan import SKIP_FILTERED, filtered

    out, matched, _ = rules.map_key(plain)
    if not matched or out is None:
        skipped.setdefault("no key rule matches" if not matched else "skipped by a key rule", []).append(key)
        return None
    if filtered(key, plain, out, filter_glob, cat.schema.model_prefix):
        skipped.setdefault(SKIP_FILTERED, []).append(key)
        return None
    return out, plain, module


def lora_merges(
    reader: CheckpointReader,
    plan: ExportPlan,
    config: dict[str, Any] | None,
    lora_alpha: float | None,
    model_config: dict[str, Any] | None = None,
) -> dict[str, SlabTransform]:
    """Source key -> :class:`~ckpttool.ops.export.merge.LoraMerge` for every base weight with a LoRA pair.

    A base weight stored ``[in, out]`` (GPT-2's ``Conv1D``, which PEFT adapts with ``fan_in_fan_out``) gets the
    transposed delta ``s * (B @ A).T``, as PEFT's ``get_delta_weight`` gives it (:func:`_conv1d_weights`).

    Raises:
        ExportError: unknown alpha, DoRA / rsLoRA, factor shapes that do not fit the weight, a square Conv1D-or-Linear
            weight nothing tells.
    """
    import numpy as np

    from ckpttool.ops.export.execute import _read_whole
    from ckpttool.ops.export.lora import INFERRED_SCALING, verl_alpha_hint
    from ckpttool.ops.export.merge import LoraMerge, lora_scaling

    out: dict[str, SlabTransform] = {}
    if config is None and any(t.selected.merge is not None for t in plan.tasks):
        plan.warnings.append(INFERRED_SCALING)
    read = []
    for t in plan.tasks:
        pair = t.selected.merge
        if pair is not None:
            a = _read_whole(reader, pair.a_key).float().numpy()
            read.append((t, pair, a, _read_whole(reader, pair.b_key).float().numpy()))
    conv = _conv1d_weights(read, config, model_config, plan.warnings)
    hint = verl_alpha_hint(getattr(reader, "path", None)) if lora_alpha is None else None
    for t, pair, a, b in read:
        w = t.selected.source
        fits = len(w.shape) == 2 and a.ndim == 2 and b.ndim == 2 and b.shape[1] == a.shape[0]
        if fits and w.key in conv:
            a, b = np.ascontiguousarray(b.T), np.ascontiguousarray(a.T)  # (B @ A).T = A.T @ B.T
        if not fits or (b.shape[0], a.shape[1]) != w.shape:
            raise ExportError(
                f"{w.key}: LoRA factors B {list(b.shape)} @ A {list(a.shape)} do not give the weight's shape "
                f"{list(w.shape)} (nor its transpose)",
                fqn=w.key,
                hint="the lora_A / lora_B tensors do not belong to this base weight",
            )
        scale = lora_scaling(pair.module, a.shape[0], config, lora_alpha, hint)
        m = LoraMerge(a, b, scale, w.dtype, t.pieces[0].dtype)
        m.nonzero = bool(a.any() and b.any())  # type: ignore[attr-defined]
        out[w.key] = m
    return out


def _conv1d_weights(
    read: list[Any], config: dict[str, Any] | None, model_config: dict[str, Any] | None, warnings: list[str]
) -> set[str]:
    """Source keys of the base weights stored ``[in, out]``, as a ``Conv1D`` stores them (PEFT sets
    ``fan_in_fan_out`` by the module's type, whatever the config says), and of the embeddings (``lora_embedding_A``
    ``[r, num_embeddings]``, ``lora_embedding_B`` ``[embedding_dim, r]``), which take the delta transposed.

    ``read``: ``(task, pair, A, B)``. A non-square weight tells by its shape; a square one by the ``model_config``
    class (its module is no ``nn.Linear``), else by the adapter config's ``fan_in_fan_out``.

    With neither (and no ``[in, out]`` weight beside), square weights merge as ``nn.Linear`` ones, said in ``warnings``.

    Raises:
        ExportError: a square weight beside ``[in, out]`` ones with neither the class nor an adapter config to tell.
    """
    from ckpttool.ops.export.expected import not_linear_weights

    flipped, square, embeddings = set(), [], set()
    for t, pair, a, b in read:
        w, delta = t.selected.source, (b.shape[0], a.shape[1]) if a.ndim == 2 and b.ndim == 2 else None
        if ".lora_embedding_A." in pair.a_key:  # PEFT's Embedding: delta (B @ A).T, whatever the shapes
            embeddings.add(w.key)
            continue
        if delta is None or tuple(w.shape) != delta[::-1]:
            continue
        if tuple(w.shape) != delta:
            flipped.add(w.key)
        else:
            square.append((w.key, t.pieces[0].name))
    if not square:
        return flipped | embeddings
    got = not_linear_weights(model_config, [n for _, n in square]) if model_config else None
    if got is not None:
        return flipped | embeddings | {k for k, n in square if n in got[1]}
    if config is None and flipped:
        raise ExportError(
            f"{square[0][0]}: a square weight beside LoRA-adapted Conv1D ([in, out]) weights such as "
            f"{sorted(flipped)[0]}: whether its delta is transposed (PEFT's fan_in_fan_out) cannot be told",
            fqn=square[0][0],
            hint="pass `model_assets` with the model's config.json, or the run's adapter_config.json",
        )
    if config is None:
        warnings.append(
            f"{len(square)} square LoRA-adapted weight(s) such as {square[0][0]} merged as nn.Linear ([out, in]) "
            "weights: without the model's config.json or the run's adapter_config.json a Conv1D (GPT-2's, [in, out], "
            "PEFT's fan_in_fan_out) cannot be told apart and would be merged wrongly; pass `model_assets` or "
            "`adapter_config`"
        )
    return flipped | embeddings | ({k for k, _ in square} if (config or {}).get("fan_in_fan_out") else set())


register_format(HFMergedFormat())
