"""``torchtitan``: torchtitan's ``CheckpointManager``.

Model tensors at the top level (``<fqn>``, torchtitan naming: ``layers.N.attention.wq.weight``),
``optimizer.state.<fqn>.<field>`` (flattened groups), plus ``lr_scheduler``, ``dataloader``,
``train_state``; step directories ``step-<N>``. Its ``FusedQKVLinear`` steps ``wqkv`` while the
state-dict hook saves ``wq``/``wk``/``wv`` (``torchtitan/models/common/attention.py``).
"""

from __future__ import annotations

import re

from ckpttool.model.schemas.base import Detected, Discovery, SchemaSpec

__all__ = ["ITEMS", "SPEC"]

#: The training-state items torchtitan's ``CheckpointManager`` saves beside model and optimizer.
ITEMS = ("lr_scheduler", "dataloader", "train_state")


def _claims(d: Detected) -> bool:
    # CheckpointManager saves the trainer's TrainState ("train_state") in every save but a model-only one (which
    # holds torchtitan's own names); an lr_scheduler or dataloader item beside top-level tensors is any loop's too.
    # Before it flattened the model to the top level (_flattened_model_states_sd) it saved it under "model.":
    # torchtitan's names and its train_state there
    if d.model_prefix == "model.":
        return d.naming == "torchtitan" and "train_state" in d.training_state
    return d.naming == "torchtitan" or "train_state" in d.training_state


SPEC = SchemaSpec(
    name="torchtitan",
    model_prefix="",
    claims=_claims,
    priority=30,
    training_state_items=ITEMS,
    fused_rules=((re.compile(r"^(?P<p>(?:.*\.)?)wqkv\.(?P<t>weight|bias)$"), ("{p}wq.{t}", "{p}wk.{t}", "{p}wv.{t}")),),
    discovery=Discovery(step_words=("step",)),
    step_dir_is_trainer_step=True,
    import_help="CheckpointManager names via the adapter",
    import_adapters_by_model_type=(("qwen3*", "torchtitan-qwen3"), ("llama", "torchtitan-llama3")),
    doc_model="`<fqn>` (top level)",
    doc_optimizer="`optimizer.state.<fqn>.<field>` (flattened groups)",
    doc_written_by="torchtitan's `CheckpointManager`, plus `lr_scheduler`, `dataloader`, `train_state`",
)
