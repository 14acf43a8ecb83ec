"""Local shard ranges from mesh and placements, checked against torch's own ``Placement._split_tensor``."""

from __future__ import annotations

import itertools

import pytest

from ckpttool.format.perrank import local_ranges
from ckpttool.format.perrank_pickle import Placement

CASES = [
    ((10,), (Placement("shard", 0),), (3,)),
    ((7, 4), (Placement("shard", 0),), (4,)),
    ((3, 5), (Placement("shard", 1),), (4,)),
    ((10,), (Placement("strided_shard", 0, 2),), (2,)),
    ((12, 3), (Placement("strided_shard", 0, 2), Placement("shard", 0)), (2, 2)),
    ((13, 2), (Placement("strided_shard", 0, 3), Placement("shard", 0)), (2, 3)),
    ((8, 6), (Placement("shard", 0), Placement("shard", 1)), (2, 3)),
    ((8, 6), (Placement("replicate"), Placement("shard", 0)), (2, 2)),
    ((2, 3), (Placement("shard", 0),), (4,)),  # more ranks than rows: empty shards
]


def _torch_local(size, placements, mesh, coord):  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    t = torch.arange(int(torch.tensor(size).prod())).reshape(size)
    for p, n, c in zip(placements, mesh, coord):
        if p.kind == "replicate":
            continue
        tp = Shard(p.dim) if p.kind == "shard" else _StridedShard(p.dim, split_factor=p.split_factor)
        t = tp._split_tensor(t, n, with_padding=False)[0][c]
    _ = Replicate
    return t


@pytest.mark.parametrize(("size", "placements", "mesh"), CASES)
def test_ranges_equal_torch_split(size, placements, mesh) -> None:  # type: ignore[no-untyped-def]
    import torch

    full = torch.arange(int(torch.tensor(size).prod())).reshape(size)
    for coord in itertools.product(*(range(n) for n in mesh)):
        want = _torch_local(size, placements, mesh, coord)
        ranges = local_ranges(size, placements, mesh, coord)
        idx = [torch.tensor([g + i for g, k in r for i in range(k)], dtype=torch.long) for r in ranges]
        got = full
        for d, ix in enumerate(idx):
            got = got.index_select(d, ix)
        assert torch.equal(got, want), (coord, ranges)
