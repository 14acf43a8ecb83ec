"""Fused MoE experts against per-expert ones between two safetensors sides (``docs/diff.md``, "Name matching").

transformers v5 models and ``export --experts fused`` store routed experts fused (``<p>.experts.gate_up_proj``
``[E, 2I, H]``, gate rows first, ``<p>.experts.down_proj`` ``[E, H, I]``); ``save_pretrained`` and
``export --experts per-expert`` store them per expert (``<p>.experts.<j>.gate_proj.weight`` ``[I, H]``, or a
family's own form: Mixtral's ``block_sparse_moe.experts.<j>.w1.weight``). A side's fused tensor that the other
side holds per expert is cut into those pieces by the export's own split (the export rules' expert rules,
:func:`~ckpttool.ops.export.plan.per_expert_pieces`, and the family form's ``save_pretrained`` names), so both
sides pair up name by name and their values are compared. Torch-free (names and shapes only).
"""

from __future__ import annotations

from typing import Any

from ckpttool.ops.diff.result import Item

__all__ = ["fused_unpaired", "split_dequantized_experts", "split_fused_experts"]

#: Stored dtypes of quantized weights: a fused quantized expert tensor is compared through its scale
#: (``ops/diff/quantized.py``) as a whole, never cut into pieces of codes.
_QUANTIZED = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint8", "int8"})


def split_fused_experts(items: list[Item], other: set[str], model_type: str | None) -> tuple[list[Item], int]:
    """``items`` of one safetensors side with each fused expert tensor the other side holds per expert cut into its
    per-expert pieces, named as the other side names them.

    Args:
        items: the side's stored tensors (:attr:`Item.direct`), named as stored.
        other: the other side's tensor names.
        model_type: the ``config.json`` ``model_type`` of either side: a family with its own per-expert form
            (Mixtral's ``w1`` / ``w3`` / ``w2`` under ``block_sparse_moe``, :mod:`ckpttool.model.hf_forms`) is
            named by it; ``None``: the generic ``gate_proj`` / ``up_proj`` / ``down_proj`` form only.

    Returns:
        ``(items, fused tensors cut)``. A piece is an :class:`Item` with ``piece`` ``(expert, part, nparts)``
        (``[j, part*A/n:(part+1)*A/n]`` of the stored ``[E, A, B]``); where the family's form renames the model's
        other keys too (Mixtral's router ``mlp.gate.weight`` -> ``block_sparse_moe.gate.weight``), a tensor the
        other side holds only under that name is named so. Items the other side holds by their own name are kept
        as they are, and so is a tensor whose other name (a piece's, the router's) this side holds already (a file
        with both forms of one expert: cutting it would give two tensors one name, one of them never compared); so
        are quantized fused experts (FP8 codes, cut only once dequantized: :func:`split_dequantized_experts`).
    """
    from ckpttool.ops.export.rules import load_rules

    rules = load_rules(None, model_type)
    if not any(rules.expert_rule(i.name) for i in items if i.name not in other):
        return items, 0
    own = {i.name for i in items}
    out: list[Item] = []
    n_split = 0
    for item in items:
        quantized = item.dtype in _QUANTIZED  # cut once dequantized (split_dequantized_experts)
        pieces = None if item.name in other or quantized else _pieces(item, other, own, rules)
        if pieces is not None:
            out.extend(pieces)
            own.update(p.name for p in pieces)
            n_split += 1
            continue
        saved = rules.saved_name(item.name) if rules.saved_name is not None and item.name not in other else None
        if saved is not None and saved in other and saved not in own:
            own.add(saved)
            item = Item(saved, item.key, item.shape, item.dtype, item.category, entry=item.entry)
        out.append(item)
    return out, n_split


def split_dequantized_experts(
    items: list[Item], other: set[str], model_type: str | None
) -> tuple[list[Item], int, list[str]]:
    """``items`` with each dequantized fused FP8 expert tensor (kind ``fp8-experts``,
    :func:`~ckpttool.ops.diff.quantized.dequantize_items`) that ``other`` holds per expert cut into its per-expert
    pieces, each dequantized with its own expert's scale rows (``weight_scale_inv`` ``[E, ceil(out/B0), ceil(in/B1)]``,
    DeepSeek-V3's and transformers' ``FP8Experts`` grid: one per expert, as ``export --quantize fp8-block`` writes it).

    Returns ``(items, tensors cut, names of quantized fused expert tensors whose pieces the other side holds that
    could not be cut)`` (their scale did not pair): those are not compared. A fused tensor the other side holds no
    piece of is only in its side, as an unquantized one is (no name returned).
    """
    from ckpttool.ops.export.rules import load_rules

    rules = load_rules(None, model_type)
    own = {i.name for i in items}
    out: list[Item] = []
    n_split = 0
    uncut: list[str] = []
    for item in items:
        fused = item.name not in other and rules.expert_rule(item.name) is not None
        quantized = item.dtype in _QUANTIZED or (item.dequant is not None and item.dequant[0] == "fp8-experts")
        if not (fused and quantized):
            out.append(item)
            continue
        pieces = _pieces(item, other, own, rules) if item.dequant is not None else None
        if pieces is None:
            if item.dequant is None and _held_per_expert(item, other, rules):
                uncut.append(item.name)  # its scale did not pair: the other side's pieces stay unmatched
            out.append(item)  # else the other side holds no piece of it (or its own side does): only in one side
            continue
        out.extend(pieces)
        own.update(p.name for p in pieces)
        n_split += 1
    return out, n_split, uncut


def fused_unpaired(items: list[Item], other: set[str]) -> bool:
    """Whether ``items`` hold a tensor named as a fused expert tensor (``<p>.experts.gate_up_proj`` /
    ``<p>.experts.down_proj``, the export rules' expert rules; every family form's fused names are these) that the
    other side, with tensor names ``other``, does not hold by that name: only then can :func:`split_fused_experts`
    cut anything, and only then is a ``config.json``'s ``model_type`` needed."""
    from ckpttool.ops.export.rules import load_rules

    rules = load_rules(None, None)
    return any(rules.expert_rule(i.name) for i in items if i.name not in other)


def _held_per_expert(item: Item, other: set[str], rules: Any) -> bool:
    """Whether ``other`` holds a per-expert piece of fused ``item`` ``[E, out, in]`` (by the export rules' names,
    as :func:`_pieces` cuts it), whatever its dtype."""
    from ckpttool.ops.export.plan import Selected, per_expert_pieces

    if item.entry is None or len(item.shape) != 3 or not item.shape[0]:
        return False
    names = [n for n in (lambda n: n, rules.saved_name) if n is not None]
    for rule in rules.experts:
        if not rule.pattern.fullmatch(item.name) or item.shape[1] % len(rule.parts):
            continue
        cut = per_expert_pieces(Selected(item.key, item.name, item.entry, "params"), rule, item.dtype)
        if any(name(p.name) in other for name in names for p in cut):
            return True
    return False


def _pieces(item: Item, other: set[str], own: set[str], rules: Any) -> list[Item] | None:
    """The per-expert pieces of fused ``item`` named as ``other`` holds them, or ``None`` (not fused, not held so, or
    a piece's name is one of the side's ``own`` tensors)."""
    from ckpttool.ops.export.plan import Selected, per_expert_pieces

    shape = item.shape
    dequantized = item.dequant is not None and item.dequant[0] == "fp8-experts" and item.piece is None
    if not (item.direct or dequantized) or item.entry is None or len(shape) != 3 or not shape[0]:
        return None
    for rule in rules.experts:
        if not rule.pattern.fullmatch(item.name) or shape[1] % len(rule.parts):
            continue
        cut = per_expert_pieces(Selected(item.key, item.name, item.entry, "params"), rule, item.dtype)
        for name in (lambda n: n, rules.saved_name):
            if name is None or not any(name(p.name) in other for p in cut):
                continue
            if any(name(p.name) in own for p in cut):
                return None
            return [
                Item(
                    name(p.name),
                    item.key,
                    p.shape,
                    item.dtype,
                    item.category,
                    None,
                    (p.expert or 0, p.part, p.nparts),  # per_expert_pieces numbers every piece's expert
                    item.entry,
                    dequant=item.dequant,  # a dequantized fused FP8 tensor: each piece on its expert's scale rows
                )
                for p in cut
            ]
    return None
