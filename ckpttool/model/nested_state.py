"""State dicts saved unflattened: ``dcp.save(..., planner=DefaultSavePlanner(flatten_state_dict=False))``.

Source: ``torch/distributed/checkpoint/default_planner.py``: with ``flatten_state_dict=False``
the planner does not flatten nested containers, so a top-level value that is a dict
(``{"model": {...}, "optimizer": {...}}``) is not a tensor and is written as one byte item: the
whole nested state ``torch.save``'d by the one rank the dedup assigns it to (for a sharded model
that rank's local shards only), with no ``planner_data``. ckpttool reads tensors from DCP tensor
entries; a checkpoint whose state is inside such byte items holds nothing it can check or
export, and says so (rule ``K010``, the key schema's reasons). Torch-free.
"""

from __future__ import annotations

from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, TensorMeta

__all__ = ["describe_nested", "nested_state_items"]


def nested_state_items(md: CheckpointMetadata) -> list[str]:
    """Keys of byte items that hold a whole nested state (see the module docstring), or ``[]``.

    True of a checkpoint without any tensor entry or ``planner_data`` whose byte items sit at
    top-level keys (no ``.``: nothing was flattened into them).
    """
    if md.planner_data or any(isinstance(m, TensorMeta) for m in md.entries.values()):
        return []
    keys = [k for k, m in md.entries.items() if isinstance(m, BytesMeta)]
    return keys if keys and all("." not in k for k in keys) else []


def describe_nested(md: CheckpointMetadata, keys: list[str]) -> str:
    """One line naming the byte items, their sizes and writing files (for reasons and findings)."""
    parts = []
    for k in keys[:4]:
        info = md.storage.get((k, None))
        parts.append(f"{k!r} ({info.length} bytes in {info.relative_path})" if info is not None else repr(k))
    more = f" (+{len(keys) - 4} more)" if len(keys) > 4 else ""
    return (
        f"{', '.join(parts)}{more}: byte items each holding a whole nested state dict, saved with "
        "DefaultSavePlanner(flatten_state_dict=False) (its tensors are pickled inside one rank's byte item, "
        "not DCP tensor entries; of a sharded model only that rank's shards)"
    )
