"""``nemo-automodel``: NeMo Automodel's ``Checkpointer`` (``nemo_automodel/components/checkpoint/checkpointing.py``, 0.7).

Its default save (``model_save_format="safetensors"``) writes ``epoch_E_step_S/model/`` with torch's
``HuggingFaceStorageWriter`` (per-rank ``shard-*.safetensors``, no ``.metadata``; beside them
``.hf_metadata/`` with ``config.json`` and, when consolidated, ``consolidated/``) and
``epoch_E_step_S/optim/`` with ``dcp.save`` of its ``OptimizerState``: ``optim.state.<hf fqn>.<field>``,
``optim.param_groups.<hf fqn>.<hyper>`` (flattened) and the LR scheduler under ``sched.``. The
step directory is opened as the ``model``/``optim`` folder pair (safetensors model windows read
raw, the optimizer's ``.distcp`` archives as archives). Model keys are HF names at the top level.
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Detected, Discovery, SchemaSpec

__all__ = ["ITEMS", "SPEC"]

#: The training-state items NeMo Automodel's ``OptimizerState`` saves beside the optimizer.
ITEMS = ("sched",)


def _claims(d: Detected) -> bool:
    return d.optimizer_prefix == "optim." and (d.model_prefix in ("", None)) and "sched" in d.training_state


SPEC = SchemaSpec(
    name="nemo-automodel",
    model_prefix="",
    optimizer_prefix="optim.",
    model_container=(),
    claims=_claims,
    priority=25,
    optimizer_heads=("optim",),
    training_state_items=ITEMS,
    discovery=Discovery(step_words=("step",)),
    doc_model="`<hf fqn>` (top level; `model/` safetensors)",
    doc_optimizer="`optim.state.<hf fqn>.<field>` (flattened; `optim/` DCP)",
    doc_written_by="NeMo Automodel's `Checkpointer` (`epoch_E_step_S/model/` + `optim/`, `sched`)",
)
