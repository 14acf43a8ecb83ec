"""Tensor operations on checkpoint layouts (imports torch): block permutations, true expert order.

The integer permutation math lives in :mod:`ckpttool.layouts.permute`; this module applies
it to tensors for the operations that hold whole tensors (``replay-step``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool.errors import LayoutSizeError
from ckpttool.layouts.declaration import ResolvedLayout
from ckpttool.layouts.permute import invert_permutation

if TYPE_CHECKING:
    import torch

__all__ = ["apply_block_permutation", "to_canonical"]


def apply_block_permutation(t: torch.Tensor, perm: list[int], dim: int = 0) -> torch.Tensor:
    """Reorder ``len(perm)`` equal blocks of ``t`` along ``dim``: output block ``i`` = input block ``perm[i]``.

    Args:
        t: any tensor; ``t.shape[dim]`` must be a multiple of ``len(perm)``.
        perm: a gather permutation (:mod:`ckpttool.layouts.permute`).
        dim: the dim to permute (the expert dim, usually 0).

    Returns:
        A new contiguous tensor of ``t``'s shape and dtype (``t`` itself is not modified).

    Raises:
        LayoutSizeError (E406): ``t.shape[dim]`` is not a multiple of ``len(perm)``.
        ValueError: ``perm`` is not a permutation.
    """
    import torch

    invert_permutation(perm)  # validates
    n = len(perm)
    size = t.shape[dim]
    if n == 0:
        if size:
            raise LayoutSizeError(f"cannot cut dim {dim} of size {size} into 0 blocks")
        return t.clone()
    if size % n:
        raise LayoutSizeError(f"dim {dim} of size {size} does not divide into {n} equal blocks")
    k = size // n
    if perm == list(range(n)):
        return t.contiguous().clone() if t.is_contiguous() else t.contiguous()
    index = torch.tensor([p * k + j for p in perm for j in range(k)], dtype=torch.long, device=t.device)
    return torch.index_select(t, dim, index)


def to_canonical(layout: ResolvedLayout, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The stored global tensor of ``key`` in true expert order (``tensor`` itself when already so).

    Args:
        layout: the checkpoint's resolved layout.
        key: model key or optimizer state key of an EP parameter (others pass through).
        tensor: the global tensor as read from the checkpoint (``reader.read_tensor(key)``).

    Raises:
        AmbiguousLayoutError (E405): ``key`` is ambiguous; LayoutSizeError (E406): a shape
            that does not split into ``P*F`` slabs.
    """
    if tensor.dim() == 0:
        return tensor  # a parameter's 0-d `step` is not sharded by expert
    perm = layout.canonical_perm(key)
    if perm is None:
        return tensor
    spec = layout.spec_for(key)
    assert spec is not None
    return apply_block_permutation(tensor, perm, spec.ep_dim)
