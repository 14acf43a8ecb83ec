"""Checks of saved optimizer state against the configured optimizer, before DCP reads any data.

``torch.distributed.checkpoint.load`` copies each saved tensor into the tensor of the
state dict it is given (``target.copy_(saved)``), which converts dtypes silently: a
BF16 moment loaded into an FP32 template arrives as FP32, and no later check can see
that it was BF16. The checks here compare the checkpoint's *metadata* (saved dtype and
global size of every ``<prefix>state.<fqn>.<field>`` key) with the load target, whose
tensors carry the optimizer's configured dtypes and shapes (``get_optimizer_state_dict``
on the fresh optimizer, or ``MultiOptimizer.state_dict_template``).

Use :func:`check_saved_state` before ``dcp.load``, or pass
:class:`CheckedLoadPlanner` as ``dcp.load``'s planner (the error then reaches the caller
wrapped in torch's ``CheckpointException``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ckpttool.errors import OptimStateError
from ckpttool.format.metadata import dtype_name

__all__ = ["check_saved_state", "CheckedLoadPlanner", "iter_state_entries"]


def iter_state_entries(optim_sd: Mapping[str, Any]) -> Iterator[tuple[str, str, str, Any]]:
    """Yield ``(key, fqn, field, value)`` for every optimizer state entry of a state dict.

    Args:
        optim_sd: an optimizer state dict in the nested flavor
            (``{"state": {fqn: {field: value}}, "param_groups": [...]}``) or the flattened
            flavor (``{"state.<fqn>.<field>": value, "param_groups.<fqn>.<hyper>": value}``).
            Fields never contain dots, so a flattened key splits at its last dot.

    Yields:
        ``key`` as DCP flattens it below the optimizer prefix (``state.<fqn>.<field>``).
    """
    state = optim_sd.get("state")
    if isinstance(state, Mapping):
        for fqn, fields in state.items():
            if isinstance(fields, Mapping):
                for field, value in fields.items():
                    yield f"state.{fqn}.{field}", str(fqn), str(field), value
        return
    for key, value in optim_sd.items():
        if isinstance(key, str) and key.startswith("state."):
            fqn, _, field = key[len("state.") :].rpartition(".")
            yield key, fqn, field, value


def check_saved_state(saved: Mapping[str, Any], template: Mapping[str, Any], *, prefix: str = "optimizer.") -> None:
    """Check saved dtype and global shape of every optimizer state tensor in ``template``.

    Args:
        saved: the checkpoint's ``Metadata.state_dict_metadata`` (flattened key ->
            ``TensorStorageMetadata`` with ``.size`` and ``.properties.dtype``, or
            ``BytesStorageMetadata``), or any mapping with the same attributes.
        template: the optimizer part of the load target (nested or flattened flavor) whose
            tensors have the configured dtypes and shapes (DTensor shapes are global).
        prefix: the key prefix of the optimizer in the checkpoint. Default ``"optimizer."``.

    Raises:
        OptimStateError: a state entry saved with another dtype or shape, or saved as a
            non-tensor where a tensor is expected; the message names parameter and field.
            Keys absent from the checkpoint are left to ``dcp.load`` (it reports them).
    """
    for key, fqn, field, value in iter_state_entries(template):
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(prefix + key)
        if md is None:
            continue
        props = getattr(md, "properties", None)
        if props is None or not hasattr(md, "size"):
            raise OptimStateError(
                f"optimizer state {fqn}.{field} is saved as a Python object, expected a {dtype_name(value.dtype)} tensor",
                fqn=fqn,
            )
        if props.dtype != value.dtype:
            raise OptimStateError(
                f"optimizer state {fqn}.{field} was saved as {dtype_name(props.dtype)} but the optimizer is "
                f"configured for {dtype_name(value.dtype)}; refusing to convert it",
                fqn=fqn,
                hint="configure the optimizer with the saved moment dtype, or convert the checkpoint explicitly",
            )
        if tuple(md.size) != tuple(value.shape):
            raise OptimStateError(
                f"optimizer state {fqn}.{field} was saved with shape {list(md.size)}, the optimizer needs {list(value.shape)}",
                fqn=fqn,
                hint="the state belongs to a different model configuration",
            )


class CheckedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that runs :func:`check_saved_state` on ``state_dict[optimizer_key]`` first.

    Args:
        optimizer_key: top-level key of the optimizer state in the load target. Default ``"optimizer"``.
        **kwargs: passed to ``DefaultLoadPlanner``.
    """

    def __init__(self, optimizer_key: str = "optimizer", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_key = optimizer_key

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        optim_sd = state_dict.get(self.optimizer_key)
        if metadata is not None and isinstance(optim_sd, Mapping):
            check_saved_state(metadata.state_dict_metadata, optim_sd, prefix=self.optimizer_key + ".")
        super().set_up_planner(state_dict, metadata, is_coordinator)
