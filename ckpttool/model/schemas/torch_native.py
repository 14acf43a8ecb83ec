"""``torch-native``: ``dcp.save({"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, o)})``.

Keys ``model.<fqn>`` and ``optimizer.state.<fqn>.<field>``; written by torch's ``state_dict``
helpers, Accelerate (``pytorch_model_fsdp_N`` + ``optimizer_N`` folders, ``checkpoint-N``) and VeOmni.
"""

from __future__ import annotations

import re

from ckpttool.model.schemas.base import Detected, Discovery, FolderPair, SchemaSpec

__all__ = ["SPEC"]


def _claims(d: Detected) -> bool:
    # an optimizer-only checkpoint under "optimizer." is the optimizer half of a torch-native save,
    # unless loose top-level tensors voted for the top-level reading; torchtitan's CheckpointManager saved its model
    # under "model." before it flattened it to the top level (_flattened_model_states_sd): torchtitan's
    if d.model_prefix == "model." and d.naming == "torchtitan" and "train_state" in d.training_state:
        return False
    return d.model_prefix == "model." or (
        d.model_prefix is None and d.optimizer_prefix == "optimizer." and not d.loose_top_level
    )


SPEC = SchemaSpec(
    name="torch-native",
    scheduler_per_step=False,  # plain dcp.save: the trainer is not known
    claims=_claims,
    priority=10,
    optimizer_heads=("optimizer", "optim", "optimizers"),
    discovery=Discovery(
        step_words=("checkpoint",),
        folder_pairs=(FolderPair(re.compile(r"^pytorch_model_fsdp_(\d+)$"), "optimizer_{0}"),),
        # HF Trainer (transformers 4.36-4.38) saved into tmp-checkpoint-N/ and renamed it to checkpoint-N/ at the end
        staging_prefixes=("tmp-",),
    ),
    import_help="dcp.save({'model': model.state_dict()})",
    import_checks_hf_model=True,  # it writes the HF model's own keys: checked against the config's model class
    doc_model="`model.<fqn>`",
    doc_optimizer="`optimizer.state.<fqn>.<field>`",
    doc_written_by='`get_state_dict` + `dcp.save({"model", "optimizer"})`, Accelerate (one folder each), VeOmni',
)
