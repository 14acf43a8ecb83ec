"""Wrapper segments: module names that wrappers insert into state-dict keys without being part of the model.

``torch.compile`` (``_orig_mod.``), activation checkpointing
(``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``: ``_checkpoint_wrapped_module.``),
FSDP1 (``_fsdp_wrapped_module.``) and ``DistributedDataParallel`` / ``DataParallel``
(``module.``) each add a path segment, anywhere in the key (a compiled block inside a
checkpointed layer gives ``layers.0._checkpoint_wrapped_module._orig_mod.mlp...``).
Hugging Face and PEFT name modules without them, so an export removes every such
segment (torch's own ``consume_prefix_in_state_dict_if_present`` handles a leading
``module.`` only). Torch-free.
"""

from __future__ import annotations

__all__ = ["WRAPPER_SEGMENTS", "strip_wrapper_segments"]

#: Key segments inserted by wrappers (whole dotted components).
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")


def strip_wrapper_segments(key: str) -> tuple[str, tuple[str, ...]]:
    """``key`` without wrapper segments, and the segments removed (in order).

    The last component (the tensor's own name, e.g. a parameter called ``module``) is never
    removed. Example: ``model.layers.0._checkpoint_wrapped_module.mlp.weight`` ->
    ``(model.layers.0.mlp.weight, ("_checkpoint_wrapped_module",))``.
    """
    if "module" not in key and "_orig_mod" not in key:  # no segment can be a component (10^6 keys: one C scan each)
        return key, ()
    parts = key.split(".")
    kept = [p for p in parts[:-1] if p not in WRAPPER_SEGMENTS]
    if len(kept) == len(parts) - 1:
        return key, ()
    removed = tuple(p for p in parts[:-1] if p in WRAPPER_SEGMENTS)
    return ".".join([*kept, parts[-1]]), removed
