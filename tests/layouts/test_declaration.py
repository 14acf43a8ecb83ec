"""LayoutDeclaration parsing and pure geometry helpers (no checkpoint needed)."""

from __future__ import annotations

import pytest

from ckpttool.errors import UsageError
from ckpttool.layouts.declaration import EP_NAME_RE, LayoutDeclaration
from ckpttool.layouts.geometry import nested_shard_intervals, shard_interval
from ckpttool.ui.options import SourceLayout


def test_nothing_declared_is_none() -> None:
    assert LayoutDeclaration.from_options(None, None, None) is None


@pytest.mark.parametrize("layout,version", [("legacy", 1), ("canonical", 2), (SourceLayout.legacy, 1)])
def test_full_declaration(layout: object, version: int) -> None:
    d = LayoutDeclaration.from_options(layout, 2, 4)
    assert d is not None and d.version == version and (d.ep_size, d.ep_fsdp_size) == (2, 4)


@pytest.mark.parametrize(
    "args,needle",
    [
        (("legacy", None, None), "needs `ep_size` and `ep_fsdp_size`"),
        (("canonical", 2, None), "needs `ep_fsdp_size`"),
        ((None, 2, 2), "without `source_layout`"),
        ((None, None, 2), "without `source_layout`"),
        (("sideways", 2, 2), "must be legacy or canonical"),
        (("legacy", 0, 2), "`ep_size` must be an integer >= 1"),
    ],
)
def test_incomplete_or_bad_declarations_are_usage_errors(args: tuple, needle: str) -> None:
    with pytest.raises(UsageError) as ei:
        LayoutDeclaration.from_options(*args)
    assert needle in ei.value.message and ei.value.exit_code == 2


@pytest.mark.parametrize(
    "key,hit",
    [
        ("model.model.layers.0.mlp.experts.gate_up_proj", True),
        ("model.model.layers.3.mlp.experts.down_proj", True),
        ("model.model.layers.3.mlp.experts.gate_up_proj_bias", True),
        ("model.model.layers.3.mlp.experts.0.down_proj.weight", False),
        ("model.model.layers.3.mlp.shared_experts.down_proj.weight", False),
        ("model.model.layers.3.mlp.gate.weight", False),
    ],
)
def test_fused_expert_names(key: str, hit: bool) -> None:
    assert bool(EP_NAME_RE.search(key)) is hit


@pytest.mark.parametrize(
    "n,k,expected",
    [
        (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
        (3, 4, [(0, 1), (1, 1), (2, 1), (3, 0)]),  # torch.chunk: last piece empty, offset n
        (5, 2, [(0, 3), (3, 2)]),
        (1, 2, [(0, 1), (1, 0)]),
    ],
)
def test_shard_interval_follows_torch_chunk(n: int, k: int, expected: list) -> None:
    import torch

    assert [shard_interval(n, k, i) for i in range(k)] == expected
    pieces = torch.arange(n).chunk(k)
    for (off, size), piece in zip(expected, pieces):
        assert size == piece.numel() and (size == 0 or off == int(piece[0]))


def test_nested_intervals_left_to_right() -> None:
    assert nested_shard_intervals(8, (2, 2)) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert nested_shard_intervals(6, (2, 2)) == [(0, 2), (2, 1), (3, 2), (5, 1)]
    assert nested_shard_intervals(2, (2, 2)) == [(0, 1), (2, 0), (1, 1), (2, 0)]


@pytest.mark.parametrize("n", [1, 2, 3, 6, 8, 9])
@pytest.mark.parametrize("mesh", [(2, 2), (4, 1), (1, 4), (2, 3)])
def test_nested_intervals_match_dtensor(n: int, mesh: tuple[int, int]) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    ours = nested_shard_intervals(n, mesh)
    coords = [(a, b) for a in range(mesh[0]) for b in range(mesh[1])]
    for (off, size), coord in zip(ours, coords):
        shape, offset = _compute_local_shape_and_global_offset((n, 3), mesh, list(coord), [Shard(0), Shard(0)])
        assert (offset[0], shape[0]) == (off, size)
