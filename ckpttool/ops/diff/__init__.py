"""``ckpttool diff``: compare two checkpoints (DCP, safetensors, PEFT adapter) by name and value (docs/diff.md)."""

from ckpttool.ops.diff.compare import ValueDiff, compare_tensors
from ckpttool.ops.diff.result import WHAT, Difference, DiffOptions, DiffResult, Excluded, Item
from ckpttool.ops.diff.run import diff_checkpoints

__all__ = [
    "WHAT",
    "DiffOptions",
    "DiffResult",
    "Difference",
    "Excluded",
    "Item",
    "ValueDiff",
    "compare_tensors",
    "diff_checkpoints",
]
