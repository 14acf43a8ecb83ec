"""The defaults of the built-in output formats: the model tensors named by the key rules, as stored.

:class:`ModelFormat` gives :class:`~ckpttool.ops.export.outputs.OutputFormat` the selection of
the YAML key rules (:class:`~ckpttool.ops.export.select.RuleKeys`), one piece per source as
stored, and HF's shard names (``model.safetensors``, ``model-0000K-of-0000N.safetensors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool.ops.export.outputs import OutputFormat, PieceContext, PiecesFn, SelectRequest, SourcePieces

if TYPE_CHECKING:
    from ckpttool.model.adapters import ModelAdapter
    from ckpttool.model.catalog import Catalog
    from ckpttool.ops.export.plan import Selected, SelectResult

__all__ = ["ModelFormat"]


class ModelFormat(OutputFormat):
    """A safetensors export of the model tensors the key rules name (override what differs)."""

    def check_names(self, cat: Catalog, adapter: ModelAdapter | None) -> None:
        """Raises ExportError (E601): no model tensor."""
        from ckpttool.ops.export.plan import require_model_tensors

        require_model_tensors(cat)

    def select(self, req: SelectRequest) -> SelectResult:
        """The key rules' output keys (:func:`~ckpttool.ops.export.select.select_model`)."""
        from ckpttool.ops.export.select import RuleKeys, select_model

        return select_model(
            req.cat, RuleKeys(req.rules, req.model_config), weights=req.weights, filter_glob=req.filter_glob
        )

    def pieces_planner(self) -> PiecesFn:
        """One piece per source, as stored (:func:`~ckpttool.ops.export.plan.stored_pieces`, no expert rule)."""
        from ckpttool.ops.export.plan import stored_pieces

        def as_stored(s: Selected, dtype: str, ctx: PieceContext) -> SourcePieces:
            return stored_pieces(s, dtype, ctx, None)

        return as_stored

    def file_names(self, n: int) -> list[str]:
        """``model.safetensors``, or ``model-0000K-of-0000N.safetensors`` (HF naming)."""
        from ckpttool.ops.export.plan import shard_file_names

        return shard_file_names(n)
