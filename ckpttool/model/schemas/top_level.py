"""``top-level``: a model state dict saved as it is (``dcp.save(model.state_dict())``, ``HuggingFaceStorageWriter``).

Model tensors at the top level (``<fqn>``), optimizer state (if any) under ``optimizer.``, or at the top level
too (``state.<fqn>.<field>`` beside ``param_groups.``: ``dcp.save(get_optimizer_state_dict(...))``, alone or merged
into the model's state dict). The last resort of detection: it claims every checkpoint no other schema claims.
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Detected, SchemaSpec

__all__ = ["SPEC"]


def _claims(d: Detected) -> bool:
    return True


SPEC = SchemaSpec(
    name="top-level",
    scheduler_per_step=False,  # a bare state dict: the trainer is not known
    model_prefix="",
    claims=_claims,
    priority=100,
    doc_model="`<fqn>` (top level)",
    doc_optimizer="as above, if any; or `state.<fqn>.<field>` (top level, beside `param_groups.*`)",
    doc_written_by="`dcp.save(model.state_dict())`, `HuggingFaceStorageWriter`, `dcp.save(get_optimizer_state_dict(...))`",
)
