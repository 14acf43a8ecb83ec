"""``torchtune``: torchtune's ``DistributedCheckpointer`` (``torchtune/training/checkpointing/_checkpointer.py``, 0.6).

The recipes' asynchronous / intermediate save (``CheckpointClient._save_checkpoint_async``)
writes ``<output_dir>/dist_epoch_<N>/`` with ``dcp.save`` / ``dcp.async_save`` of
``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "seed", "epochs_run",
"total_epochs", "max_steps_per_epoch", "dataloader"}``: model keys ``model.<fqn>`` in torchtune's
own module names (``tok_embeddings.weight``, ``layers.N.attn.q_proj.weight``,
``layers.N.sa_norm.scale``, ``layers.N.mlp.w1.weight``, ``norm.scale``, ``output.weight``) and
the optimizer state keyed by parameter *index* (``optimizer.state.<i>.<field>``,
``optimizer.param_groups.<g>.params = [i, ...]``). Index ``i`` is the ``i``-th parameter in the
order ``torch.optim.Optimizer.state_dict()`` numbers them (the groups' ``params`` lists, in
order); torchtune builds its optimizer from ``model.parameters()`` and its models hold no
persistent buffers, so that is the order of the model's state dict (checked when the groups are
read: :func:`ckpttool.model.catalog.load_param_groups`).

With ``optimizer_in_bwd: True`` (the full-finetune recipes' optimizer in the backward pass) the ``optimizer``
item is ``OptimizerInBackwardWrapper.state_dict()`` (``torchtune/training/memory.py``, 0.6.1): ``{fqn:
optimizer.state_dict()}`` of one optimizer per parameter, flattened to ``optimizer.<fqn>.state.0.<field>`` and
``optimizer.<fqn>.param_groups.0.<hyper>`` (each optimizer's one parameter is its index 0); its
``load_state_dict`` gives each parameter's optimizer back its own entry
(:attr:`~ckpttool.model.schemas.base.SchemaSpec.per_parameter_optimizers`).
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Detected, Discovery, SchemaSpec

__all__ = ["ITEMS", "SPEC"]

#: top-level items of torchtune's ``TrainingProgress.state_dict()`` (``training.SEED_KEY`` ...)
ITEMS = ("seed", "epochs_run", "total_epochs", "max_steps_per_epoch", "steps_run", "dataloader")


def _claims(d: Detected) -> bool:
    return d.naming == "torchtune" and d.model_prefix == "model."


SPEC = SchemaSpec(
    name="torchtune",
    claims=_claims,
    priority=4,
    training_state_items=ITEMS,
    index_state_by_param_order=True,  # its optimizer is built from model.parameters(): state i is parameter i
    per_parameter_optimizers="optimizer.",  # optimizer_in_bwd: OptimizerInBackwardWrapper's {fqn: state_dict()}
    # torchtune 0.6.1 CheckpointClient.load_distributed_checkpoint: the wrapper's state_dict() of fresh optimizers
    # (no state) is the load target, so dcp.load fills their param groups only
    per_parameter_resume="torchtune 0.6's own resume (load_distributed_checkpoint with optimizer_in_bwd) loads into the "
    "fresh optimizers' state dicts, which hold no state: it restores the param groups but not exp_avg, exp_avg_sq and "
    "step, so the moments restart from zero",
    discovery=Discovery(step_words=("dist_epoch",)),
    doc_model="`model.<fqn>` (torchtune names: `layers.N.attn.q_proj.weight`, `sa_norm.scale`)",
    doc_optimizer="`optimizer.state.<i>.<field>` (index -> fqn by parameter order), `optimizer.param_groups.<g>.*`; "
    "with `optimizer_in_bwd`: `optimizer.<fqn>.state.0.<field>`, `optimizer.<fqn>.param_groups.0.*` (one optimizer "
    "per parameter)",
    doc_written_by="torchtune's `DistributedCheckpointer` (`dist_epoch_N/`)",
)
