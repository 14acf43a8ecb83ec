"""``verl``: verl's FSDP checkpoint manager (per-rank ``torch.save`` files, not DCP).

``global_step_<N>/actor/{model,optim,extra_state}_world_size_W_rank_R.pt`` assembled by
:mod:`ckpttool.format.perrank_formats` into torch's flattened keys: ``model.<fqn>``,
``optimizer.state.<fqn>.<field>`` (verl saves the index-keyed ``optimizer.state_dict()``; index
``i`` is the model's ``i``-th parameter), ``lr_scheduler.<field>``. Chosen by the per-rank
format, never by key detection.
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Detected, Discovery, SchemaSpec

__all__ = ["SPEC"]


def _claims(d: Detected) -> bool:
    return False  # the per-rank format names it; DCP keys never do


SPEC = SchemaSpec(
    name="verl",
    model_prefix="model.",
    optimizer_prefix="optimizer.",
    model_container=("model",),
    claims=_claims,
    priority=90,
    optimizer_heads=("optimizer",),
    training_state_items=("lr_scheduler",),
    discovery=Discovery(step_words=("global_step",)),
    doc_model="`model.<fqn>` (assembled)",
    doc_optimizer="`optimizer.state.<fqn>.<field>` (assembled; index -> fqn)",
    doc_written_by="verl's `FSDPCheckpointManager`: per-rank `{model,optim,extra_state}_world_size_W_rank_R.pt`",
)
