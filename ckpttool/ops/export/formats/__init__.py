"""The built-in output formats of ``ckpttool export``, one module each, registered on import.

In ``--format`` order: ``hf`` (:mod:`.hf`), ``lora`` (:mod:`.lora`), ``hf-merged``
(:mod:`.hf_merged`). Each builds its :class:`~ckpttool.ops.export.outputs.OutputFormat` and
registers it (:func:`~ckpttool.ops.export.outputs.register_format`); :mod:`.base` holds the
defaults they share (:class:`~.base.ModelFormat`). ``ckpttool.ops.export`` imports this package.
"""

from __future__ import annotations

# registered in the order ``--format`` lists them
from ckpttool.ops.export.formats import hf, lora, hf_merged  # noqa: F401  # isort: skip
from ckpttool.ops.export.formats.base import ModelFormat

__all__ = ["ModelFormat"]
