"""``app-state``: torch's DCP tutorial, ``dcp.save({"app": AppState(model, optimizer)})``.

Keys ``<app>.model.<fqn>`` and ``<app>.optim.state.<fqn>.<field>`` (any app name).
"""

from __future__ import annotations

from ckpttool.model.schemas.base import Detected, SchemaSpec

__all__ = ["SPEC"]


#: PEFT's saved adapter names (``base_model.model.<fqn>``), which no AppState writes: NeMo Automodel's PEFT save
PEFT_PREFIX = "base_model.model."


def _claims_prefix(model_prefix: str) -> bool:
    return model_prefix not in ("", PEFT_PREFIX) and model_prefix.endswith(".model.")


def _claims(d: Detected) -> bool:
    return d.model_prefix is not None and _claims_prefix(d.model_prefix)


def _notes(model_prefix: str | None, optimizer_prefix: str | None) -> tuple[str, ...]:
    """The optimizer keys of an app-state save share the model's ``<app>.`` prefix; say when they do not."""
    if optimizer_prefix is None or model_prefix is None or not _claims_prefix(model_prefix):
        return ()
    app = model_prefix[: -len("model.")]
    if optimizer_prefix.startswith(app):
        return ()
    return (f"optimizer keys under {optimizer_prefix!r} do not share the model's {app!r} prefix",)


SPEC = SchemaSpec(
    name="app-state",
    scheduler_per_step=False,  # the tutorial AppState of any training loop
    model_prefix="app.model.",
    optimizer_prefix="app.optim.",
    model_container=(None, "model"),
    claims=_claims,
    priority=20,
    optimizer_heads=("optim", "optimizer"),
    prefix_notes=_notes,
    doc_model="`app.model.<fqn>`",
    doc_optimizer="`app.optim.state.<fqn>.<field>`",
    doc_written_by='torch\'s DCP tutorial `{"app": AppState(model, optimizer)}`',
)
