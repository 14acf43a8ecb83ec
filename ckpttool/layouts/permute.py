"""Block permutations between the legacy and canonical EP layouts (pure integer functions).

A permutation ``perm`` is a gather: output block ``i`` is input block ``perm[i]``
(:func:`invert_permutation` gives the other direction). With EP size ``P`` and EP-FSDP size
``F`` the expert dim is ``B = P*F`` slabs; true slab ``e*F + f`` is stored at position
``e*F + f`` by the canonical mesh and ``f*P + e`` by the legacy one, e.g.
``legacy_to_canonical_perm(4, 2, 2) == [0, 2, 1, 3]``. With ``k*P*F`` blocks each slab is ``k``
consecutive blocks, so the same functions give expert-level permutations.
``docs/layouts.md``; ``docs/design.md`` §4.
"""

from __future__ import annotations

from ckpttool.errors import LayoutSizeError

__all__ = [
    "legacy_to_canonical_perm",
    "canonical_to_legacy_perm",
    "invert_permutation",
    "compose_permutations",
    "legacy_position_of_true_slab",
]


def _check_sizes(num_blocks_total: int, ep_size: int, ep_fsdp_size: int) -> int:
    """Validate the sizes; return ``k`` = blocks per slab."""
    for name, v in (("ep_size", ep_size), ("ep_fsdp_size", ep_fsdp_size)):
        if type(v) is not int or v < 1:
            raise LayoutSizeError(f"{name} must be an integer >= 1, got {v!r}", hint="pass positive mesh sizes")
    if type(num_blocks_total) is not int or num_blocks_total < 0:
        raise LayoutSizeError(f"block count must be an integer >= 0, got {num_blocks_total!r}")
    slabs = ep_size * ep_fsdp_size
    if num_blocks_total % slabs:
        raise LayoutSizeError(
            f"{num_blocks_total} blocks along the expert dim do not divide into ep_size*ep_fsdp_size = "
            f"{ep_size}*{ep_fsdp_size} = {slabs} equal slabs",
        )
    return num_blocks_total // slabs


def legacy_position_of_true_slab(true_slab: int, ep_size: int, ep_fsdp_size: int) -> int:
    """Stored position (legacy layout) of true slab ``e*F + f``: ``f*P + e``."""
    e, f = divmod(true_slab, ep_fsdp_size)
    return f * ep_size + e


def legacy_to_canonical_perm(num_blocks_total: int, ep_size: int, ep_fsdp_size: int) -> list[int]:
    """Gather permutation that turns legacy-ordered blocks into true (canonical) order.

    ``canonical[i] = legacy[perm[i]]``; at slab level ``perm[e*F + f] = f*P + e``.

    Args:
        num_blocks_total: blocks along the expert dim, a multiple of ``ep_size * ep_fsdp_size``.
        ep_size: EP size ``P`` of the saving mesh.
        ep_fsdp_size: EP-FSDP size ``F`` of the saving mesh.

    Returns:
        A permutation of ``range(num_blocks_total)``.

    Raises:
        LayoutSizeError (E406): sizes < 1 or ``num_blocks_total`` not a multiple of ``P*F``.
    """
    k = _check_sizes(num_blocks_total, ep_size, ep_fsdp_size)
    perm: list[int] = []
    for t in range(ep_size * ep_fsdp_size):
        src = legacy_position_of_true_slab(t, ep_size, ep_fsdp_size)
        perm.extend(range(src * k, src * k + k))
    return perm


def canonical_to_legacy_perm(num_blocks_total: int, ep_size: int, ep_fsdp_size: int) -> list[int]:
    """Gather permutation that turns true-ordered blocks into the legacy order of mesh ``(P, F)``.

    ``legacy[j] = canonical[perm[j]]``; at slab level ``perm[f*P + e] = e*F + f``. It is
    the inverse of :func:`legacy_to_canonical_perm` for the same arguments.

    Raises:
        LayoutSizeError (E406): as :func:`legacy_to_canonical_perm`.
    """
    return invert_permutation(legacy_to_canonical_perm(num_blocks_total, ep_size, ep_fsdp_size))


def invert_permutation(perm: list[int]) -> list[int]:
    """Inverse of a gather permutation: ``inv[perm[i]] = i``.

    Raises:
        ValueError: ``perm`` is not a permutation of ``range(len(perm))``.
    """
    inv = [-1] * len(perm)
    for i, p in enumerate(perm):
        if not 0 <= p < len(perm) or inv[p] != -1:
            raise ValueError(f"not a permutation: index {p} at position {i}")
        inv[p] = i
    return inv


def compose_permutations(first: list[int], then: list[int]) -> list[int]:
    """The gather permutation of applying ``first`` and then ``then``: ``out[i] = in[first[then[i]]]``.

    Raises:
        ValueError: the two have different lengths.
    """
    if len(first) != len(then):
        raise ValueError(f"permutations of different lengths ({len(first)} and {len(then)})")
    return [first[j] for j in then]
