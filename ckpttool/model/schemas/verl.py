"""``verl``: verl's FSDP checkpoint manager (per-rank ``torch.save`` files, not DCP).

``global_step_<N>/actor/{model,optim,extra_state}_world_size_W_rank_R.pt`` assembled by
:mod:`ckpttool.format.perrank_formats` into torch's flattened keys: ``model.<fqn>``,
``optimizer.state.<fqn>.<field>`` (verl saves the index-keyed ``optimizer.state_dict()``; index
``i`` is the model's ``i``-th parameter), ``lr_scheduler.<field>``. Chosen by the per-rank
format, never by key detection.
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Discovery, per_rank_spec

__all__ = ["SPEC"]


SPEC = per_rank_spec(
    "verl",
    priority=90,
    discovery=Discovery(step_words=("global_step",)),
    doc_optimizer="`optimizer.state.<fqn>.<field>` (assembled; index -> fqn)",
    doc_written_by="verl's `FSDPCheckpointManager`: per-rank `{model,optim,extra_state}_world_size_W_rank_R.pt`",
)
