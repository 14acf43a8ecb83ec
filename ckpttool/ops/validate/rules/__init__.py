"""The rules, one module per family; importing this package registers them in :data:`~ckpttool.ops.validate.base.RULES`."""

from ckpttool.ops.validate.rules import (
    content,
    data,
    layout,
    model,
    optimizer,
    perrank,
    quantized,
    resume,
    schema,
    storage,
)

__all__ = ["content", "data", "layout", "model", "optimizer", "perrank", "quantized", "resume", "schema", "storage"]
