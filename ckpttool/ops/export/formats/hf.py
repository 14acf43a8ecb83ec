"""``--format hf``: Hugging Face safetensors, sharded ``model*.safetensors`` + ``model.safetensors.index.json``.

Selection by the YAML key rules, or by a model adapter (given or detected) for torchtitan
names; fused expert tensors as stored or split per expert (``--experts``); files packed in
source order up to ``--shard-size``; every ``--model-assets`` file but ``adapter_*`` copied.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING, Any

from ckpttool.errors import ExportError, ExportNamingError
from ckpttool.ops.export.formats.base import ModelFormat
from ckpttool.ops.export.outputs import PieceContext, PiecesFn, SelectRequest, SourcePieces, register_format

if TYPE_CHECKING:
    from ckpttool.model.adapters import ModelAdapter
    from ckpttool.model.catalog import Catalog
    from ckpttool.ops.export.plan import ExportPlan, Selected, SelectResult

__all__ = ["HFFormat", "INDEX_NAME", "refuse_torchtitan_names"]

INDEX_NAME = "model.safetensors.index.json"


def refuse_torchtitan_names(cat: Catalog, reason: str, hint: str) -> None:
    """Raises ExportNamingError (E603) when the model fqns follow torchtitan's naming: ``reason`` and ``hint`` say why."""
    if cat.schema.naming == "torchtitan":
        fqns = [cat.fqn_of(k) for k in list(cat.model)[:2]]
        raise ExportNamingError(
            f"{cat.path}: the model tensors have torchtitan names (e.g. {', '.join(repr(f) for f in fqns)}); " + reason,
            hint=hint,
        )


class HFFormat(ModelFormat):
    """Hugging Face safetensors: ``model.safetensors`` or ``model-0000K-of-0000N.safetensors`` + index."""

    name = "hf"
    help = "model*.safetensors + index"
    detects_model_adapter = True
    ties_embeddings = True
    checks_model_class = True

    def check_names(self, cat: Catalog, adapter: ModelAdapter | None) -> None:
        """Raises ExportNamingError (E603): torchtitan names and no model adapter; ExportError: no model tensor."""
        from ckpttool.ops.export.plan import require_model_tensors

        require_model_tensors(cat)
        if adapter is None:
            from ckpttool.model.adapters import ADAPTERS

            names = ", ".join(n for n, cls in ADAPTERS.items() if not cls.identity)
            refuse_torchtitan_names(
                cat,
                "no built-in model adapter fits them (the config's model_type names another family)",
                f"choose one with `adapter` ({names}) and pass the model's "
                "config.json with `model_assets`, or save with torchtitan's checkpoint.last_save_in_hf",
            )

    def select(self, req: SelectRequest) -> SelectResult:
        """The key rules' (or a non-identity model adapter's) output keys.

        Raises:
            ExportError: a PEFT LoRA checkpoint (its names load into no HF class), and :func:`select_model`'s.
        """
        from ckpttool.ops.export.select import AdapterKeys, RuleKeys, select_model

        cat, adapter = req.cat, req.adapter
        peft = next((k for k in cat.model if ".lora_A." in k or ".lora_B." in k), None)
        if peft is not None:
            raise ExportError(
                f"{cat.path}: a PEFT LoRA checkpoint ({peft}); `fmt` hf would write base_layer / lora_A.<adapter> "
                "names that no Hugging Face class loads",
                fqn=peft,
                param="fmt",
                hint="export the adapter with `fmt` lora, or the merged model with `fmt` hf-merged (`merge_lora`)",
            )
        keys = (
            AdapterKeys(adapter, req.adapter_config)
            if adapter is not None and not adapter.identity
            else RuleKeys(req.rules, req.model_config)
        )
        return select_model(cat, keys, weights=req.weights, filter_glob=req.filter_glob)

    def pieces_planner(self) -> PiecesFn:
        """An adapter's pieces and runs (RoPE rows, fused halves), else as stored or split by an expert rule;
        per expert, named as the family's ``save_pretrained`` names them (:func:`~ckpttool.ops.export.plan.saved_names`)."""
        from ckpttool.ops.export.plan import Piece, adapter_pieces, saved_names, stored_pieces

        def hf_pieces(s: Selected, dtype: str, ctx: PieceContext) -> SourcePieces:
            return saved_names(as_planned(s, dtype, ctx), ctx) if ctx.per_expert else as_planned(s, dtype, ctx)

        def as_planned(s: Selected, dtype: str, ctx: PieceContext) -> SourcePieces:
            hf = s.hf
            if hf is not None:
                order = ctx.orders.get(s.model_key) if ctx.orders else None
                experts = "per-expert" if ctx.per_expert else "fused"
                pieces, runs = adapter_pieces(s, hf, dtype, experts, order, ctx.num_experts, ctx.rules)
                counted = [p.name for p in pieces if not p.shared or hf.part == 0]  # a fused tensor counts once
                return pieces, runs, None, counted
            # the rule matters for [E, A, B] tensors, and for any shape with per-expert (which refuses other shapes)
            shape = s.source.shape
            if not ctx.per_expert and len(shape) != 3 and not ctx.orders:  # as stored (stored_pieces, inline)
                return (Piece(s.out_key, shape, dtype),), None, None, [s.out_key]
            rule = ctx.rules.expert_rule(s.out_key) if ctx.per_expert or len(shape) == 3 else None
            return stored_pieces(s, dtype, ctx, rule)

        return hf_pieces

    def documents(self, plan: ExportPlan, prepared: dict[str, Any] | None) -> dict[str, bytes]:
        """``model.safetensors.index.json``: ``total_size`` and the sorted ``weight_map`` (for one shard too)."""
        return {INDEX_NAME: index_json(plan.total_bytes, plan.weight_map())}


def index_json(total_size: int, weight_map: dict[str, str]) -> bytes:
    """The index document: ``json.dumps({"metadata": {"total_size": ...}, "weight_map": ...}, indent=2) + "\\n"``.

    The same bytes, joined from one line per key (``json.dumps`` with ``indent`` runs its
    pure-Python encoder: ~10 us a key, seconds for 10^6 keys).
    """
    if not weight_map:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        return (json.dumps(index, indent=2) + "\n").encode("utf-8")
    enc = encode_basestring_ascii
    files = {v: enc(v) for v in dict.fromkeys(weight_map.values())}  # a few file names, each escaped once
    lines = ",\n".join([f"    {enc(k)}: {files[v]}" for k, v in weight_map.items()])
    head = f'{{\n  "metadata": {{\n    "total_size": {int(total_size)}\n  }},\n  "weight_map": {{\n'
    return (head + lines + "\n  }\n}\n").encode("utf-8")


register_format(HFFormat())
