"""Expert order of fused MoE tensors for export (docs/design.md §4).

A fused expert tensor ``w_EAB`` ``[E, A, B]`` is stored in true expert order
except in the legacy EP layout with EP and EP-FSDP sharding the same dim, where
the ``B = P*F`` slabs along dim 0 are block-transposed. Export writes experts in
true order, so for each such tensor it needs ``order[j]``: the stored position
of true expert ``j``. Unversioned tensors whose order cannot be known from the
metadata are refused (``E405``) unless ``--source-layout`` declares the layout.
"""

from __future__ import annotations

from ckpttool.errors import ExportError
from ckpttool.layouts.declaration import ResolvedLayout, split_per_expert_vector
from ckpttool.layouts.permute import legacy_to_canonical_perm
from ckpttool.ops.export.plan import Selected

__all__ = ["expert_orders"]


def expert_orders(selected: list[Selected], layout: ResolvedLayout) -> dict[str, tuple[int, ...]]:
    """Stored position of each true expert, for the selected EP tensors that are not in true order.

    Args:
        selected: the tensors to export (their ``model_key`` is looked up in the layout;
            a ``master_weight`` source shares its parameter's layout).
        layout: from :func:`ckpttool.layouts.declaration.resolve_layout`.

    Returns:
        model key -> ``order`` with ``order[j]`` the dim-0 index holding true expert ``j``;
        keys already in true order are absent.

    Raises:
        LayoutError (E405): an unversioned EP tensor sharded on the expert dim by both EP
            and EP-FSDP (legacy and canonical store different bytes) that is not declared.
        LayoutError (E406): the expert count is not a multiple of ``ep_size * ep_fsdp_size``.
        ExportError: the expert dim disagrees with the layout record's ``num_experts``; (E601) a 1-D per-expert
            tensor split along its expert dim that would keep the stored order.
    """
    orders: dict[str, tuple[int, ...]] = {}
    if not layout.ep_tensors:
        return orders  # no EP tensor: spec_for is None for every key
    for s in selected:
        spec = layout.spec_for(s.model_key)
        if spec is None:
            continue
        shape = s.source.shape
        if spec.ep_dim >= len(shape) or shape[spec.ep_dim] != spec.num_experts:
            got = shape[spec.ep_dim] if spec.ep_dim < len(shape) else "no such dim"
            raise ExportError(
                f"{s.source.key}: expert dim {spec.ep_dim} has {got} entries but the layout record says "
                f"num_experts={spec.num_experts} (shape {list(shape)})",
                fqn=s.source.key,
                hint="the layout record does not describe this checkpoint; fix it with `ckpttool stamp` or remove it",
            )
        perm = layout.canonical_perm(s.model_key)  # E405 when ambiguous
        if perm is None:
            continue
        if spec.ep_dim != 0:
            raise ExportError(
                f"{s.source.key}: legacy EP layout on expert dim {spec.ep_dim}; export un-permutes dim 0 only",
                fqn=s.source.key,
                hint="convert the checkpoint with `ckpttool reshard` to the canonical layout first",
            )
        assert layout.ep_size is not None and layout.ep_fsdp_size is not None
        orders[s.model_key] = tuple(legacy_to_canonical_perm(shape[0], layout.ep_size, layout.ep_fsdp_size))
    _refuse_unpermuted_per_expert(selected, orders)
    return orders


def _refuse_unpermuted_per_expert(selected: list[Selected], orders: dict[str, tuple[int, ...]]) -> None:
    """A selected 1-D ``...experts.<name>`` tensor ``[E]`` (a per-expert bias or scale) split over ranks along its
    expert dim beside EP tensors that are un-permuted: EP tensors are fused weights of at least 2 dims, so it would
    be written in the stored (legacy) order while they are written in true order.

    Raises:
        ExportError (E601): naming the first such tensor.
    """
    counts = {len(o) for o in orders.values()}
    if not counts:
        return
    for s in selected:
        shape = s.source.shape
        if s.model_key not in orders and split_per_expert_vector(s.model_key, s.source, counts):
            raise ExportError(
                f"{s.source.key}: a per-expert tensor [{shape[0]}] split over ranks along its expert dim, stored in "
                f"the legacy EP order; the experts of {len(orders)} tensor(s) are written in true order, and this "
                "one would keep the stored order",
                fqn=s.source.key,
                hint="ckpttool re-orders fused expert tensors (2 or more dims) only: select the other tensors with "
                "--filter, or re-save the checkpoint in the canonical layout with the trainer",
            )
