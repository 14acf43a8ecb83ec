"""``torch-checkpointing``: torch-checkpointing's per-rank items (``model_{rank}.pt`` / ``.safetensors``, not DCP).

``model_{rank}``, ``optimizer_{rank}``, ``lr_scheduler_{rank}`` files plus ``metadata.pkl``
assembled by :mod:`ckpttool.format.perrank_formats` into torch's flattened keys:
``model.<fqn>``, ``optimizer.state.<fqn>.<field>``, ``lr_scheduler.<field>``. Chosen by the
per-rank format, never by key detection.
"""

from __future__ import annotations

from ckpttool.model.schemas.base import per_rank_spec

__all__ = ["SPEC"]


SPEC = per_rank_spec(
    "torch-checkpointing",
    priority=91,
    doc_optimizer="`optimizer.state.<fqn>.<field>` (assembled)",
    doc_written_by="torch-checkpointing: per-rank `model_{rank}.pt`/`.safetensors`, `optimizer_{rank}.pt`, `metadata.pkl`",
)
