"""``olmo-core``: OLMo-core's trainer ``Checkpointer`` (``olmo_core/train/checkpoint.py``, 3.x).

``stepN/model_and_optim/`` is a DCP checkpoint written by ``save_model_and_optim_state`` /
``save_state_dict`` through OLMo-core's ``RemoteFileSystemWriter`` (its ``.metadata`` pickles
``olmo_core.distributed.checkpoint.filesystem._StorageInfo``, read as torch's by field by the
allow-list unpickler, never imported): ``{"model": get_model_state_dict(m), "optim":
get_optimizer_state_dict(m, o, flatten_optimizer_state_dict=True)}``, so keys ``model.<fqn>``,
``optim.state.<fqn>.<field>`` and ``optim.param_groups.<fqn>.<hyper>``. Beside it:
``stepN/train/rank{R}.pt`` (``torch.save`` of the trainer state per rank) and
``stepN/.metadata.json`` (the trainer state read by :mod:`ckpttool.model.beside`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckpttool.model.schemas.base import Detected, Discovery, SchemaSpec

if TYPE_CHECKING:
    from ckpttool.model.catalog import ParamGroup

__all__ = ["SPEC"]


def _claims(d: Detected) -> bool:
    # the keys alone are a plain dcp.save({"model": ..., "optim": ...}) of any loop: the .metadata must name
    # OLMo-core's own _StorageInfo, which its RemoteFileSystemWriter (every OLMo-core save) pickles; a model-only
    # save (save_model_and_optim_state without an optimizer: its HF conversion scripts, a train module without one)
    # is OLMo-core's too
    return d.writer == "olmo-core" and d.model_prefix == "model." and d.optimizer_prefix in ("optim.", None)


def _skip_step_groups(groups: Sequence[ParamGroup]) -> bool:
    """Adam groups without ``amsgrad``, which every ``torch.optim.Adam``/``AdamW`` group saves: OLMo-core's own
    ``SkipStepAdamW`` (``SkipStepAdamWConfig``) or ``OLMoDDPOptimizer``, whose defaults are ``lr``, ``betas``,
    ``eps``, ``weight_decay`` alone and whose ``step`` adds the step factor, 0 on a skipped step (``adamw_step``)."""
    adam = [g for g in groups if "betas" in g.keys and "eps" in g.keys]
    return bool(adam) and all("amsgrad" not in g.keys for g in adam)


SPEC = SchemaSpec(
    name="olmo-core",
    optimizer_prefix="optim.",
    claims=_claims,
    priority=5,
    optimizer_heads=("optim",),
    # Checkpointer.save writes train/ first, then model_and_optim/ (async: in the background), then
    # .metadata.json when both are done; its find_checkpoints skips a step directory without it. A local
    # save is written into stepN-tmp/ (Checkpointer._temporary_wd), renamed to stepN/ after a barrier.
    discovery=Discovery(
        step_words=("step",),
        publish_markers=((".metadata.json", ("model_and_optim", "train")),),
        staging_suffixes=("-tmp",),
        step_folders=(("model_and_optim", ("train",)),),
    ),
    step_dir_is_trainer_step=True,
    # TransformerTrainModule.optim_step: scheduler.set_lr(group, trainer) for every group, then optim.step(); the
    # Scheduler is config (its initial_lr kept in the group), the trainer's global_step counts the step in progress
    lr_set_before_step=(
        "OLMo-core's train module sets each param group's lr from its scheduler at the trainer's global_step right "
        "before the optimizer step (the scheduler is config, not saved)"
    ),
    # SkipStepAdamW's step counts the steps it took; the trainer's global_step the skipped ones too
    skip_step_groups=_skip_step_groups,
    skip_step_saved_by="olmo_core.optim.SkipStepAdamW",
    # Checkpointer.load reads train/rank{R}.pt (else rank0.pt): without it no trainer state is restored
    restores_trainer_state_beside=True,
    own_names_warning=(
        "no model adapter: {count} model tensor(s) were written under OLMo-core's own names, "
        "not HF's ({shown}): transformers and vLLM do not load them; export again with "
        "`model_assets` DIR holding the model's HF config.json (model_type llama picks adapter "
        "olmo-core-llama, olmo2 or olmo3 picks olmo-core-olmo2), or `adapter` olmo-core-llama|olmo-core-olmo2"
    ),
    publish_note="OLMo-core's Checkpointer writes .metadata.json last; its latest_checkpoint skips this directory",
    doc_model="`model.<fqn>`",
    doc_optimizer="`optim.state.<fqn>.<field>`, `optim.param_groups.<fqn>.<hyper>` (flattened)",
    doc_written_by="OLMo-core's `Checkpointer` (`stepN/model_and_optim/`, beside `train/rankR.pt`)",
)
