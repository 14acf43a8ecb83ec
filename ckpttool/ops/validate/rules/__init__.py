"""The rules, one module per family; importing this package registers them in :data:`~ckpttool.ops.validate.base.RULES`."""

from ckpttool.ops.validate.rules import data, layout, model, optimizer, quantized, schema, storage

__all__ = ["data", "layout", "model", "optimizer", "quantized", "schema", "storage"]
