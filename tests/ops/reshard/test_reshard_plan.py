"""Reshard planning math (pure): every target chunk is filled from the right source rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.format.metadata import ChunkMeta
from ckpttool.layouts.geometry import nested_shard_intervals
from ckpttool.layouts.permute import canonical_to_legacy_perm, legacy_to_canonical_perm
from ckpttool.layouts.record import EPTensorSpec
from ckpttool.ops.reshard.plan import _ChunkIndex, _pieces, _target_boxes, row_runs

small = st.integers(min_value=1, max_value=4)


def _stored(true: torch.Tensor, version: int, p: int, f: int) -> torch.Tensor:
    if version == 2 or p == 1 or f == 1:
        return true.clone()
    slabs = true.chunk(p * f)
    return torch.cat([slabs[i] for i in canonical_to_legacy_perm(p * f, p, f)])


@settings(max_examples=150, deadline=None)
@given(
    p=small,
    f=small,
    p2=small,
    f2=small,
    k=st.integers(min_value=1, max_value=2),
    src_v=st.sampled_from([1, 2]),
    dst_v=st.sampled_from([1, 2]),
)
def test_pieces_move_rows_from_any_source_layout_to_any_target(
    p: int, f: int, p2: int, f2: int, k: int, src_v: int, dst_v: int
) -> None:
    e = p * f * p2 * f2 * k  # divisible by everything involved
    true = torch.arange(e * 3, dtype=torch.int64).reshape(e, 3)
    src = _stored(true, src_v, p, f)
    spec = EPTensorSpec(0, 0, e)
    # Source chunks as the saving mesh wrote them.
    mesh = (p, f) if src_v == 2 else (f, p)
    src_chunks = [ChunkMeta((o, 0), (s, 3)) for o, s in nested_shard_intervals(e, mesh) if s]
    permuted_src = src_v == 1 and p > 1 and f > 1
    permuted_dst = dst_v == 1 and p2 > 1 and f2 > 1
    runs = row_runs(
        e,
        p * f if permuted_src else 1,
        legacy_to_canonical_perm(p * f, p, f) if permuted_src else [0],
        p2 * f2 if permuted_dst else 1,
        canonical_to_legacy_perm(p2 * f2, p2, f2) if permuted_dst else [0],
    )
    covered = sorted((t, t + n) for t, _, n in runs)
    assert covered[0][0] == 0 and covered[-1][1] == e and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    out = torch.full_like(true, -1)
    index = _ChunkIndex(src_chunks, 0)
    boxes = _target_boxes(spec, (e, 3), dst_v, p2, f2)
    assert [r for r, _, _ in boxes] == list(range(p2 * f2))  # one chunk per target rank, rank r in file r
    for _, offs, sizes in boxes:
        chunk = torch.full(sizes, -1, dtype=torch.int64)
        for pc in _pieces(offs, sizes, 0, runs, index):
            s0 = pc.src_chunk.offsets[0] + pc.src_start[0]
            chunk[pc.dst_start[0] : pc.dst_start[0] + pc.sizes[0]] = src[s0 : s0 + pc.sizes[0]]
        out[offs[0] : offs[0] + sizes[0]] = chunk
    assert torch.equal(out, _stored(true, dst_v, p2, f2))


def test_target_boxes_of_a_wide_mesh_equal_the_per_rank_reference() -> None:
    """FSDP on another dim than the experts: the boxes of P2*F2 target ranks took the intervals of both dims
    again for every rank (P2*F2*(P2+F2) pieces per EP tensor: a 2 x 300 dry run of the 16 EP tensors of
    the fixture planned for 13 s). Each dim is split once per tensor now; the boxes equal the per-rank reference."""
    from ckpttool.layouts.geometry import shard_interval

    for version in (1, 2):
        for fsdp_dim in (1, None):
            p, f, shape = 4, 600, (8, 5, 4)
            boxes = _target_boxes(EPTensorSpec(0, fsdp_dim, 8), shape, version, p, f)
            want = []
            for r in range(p * f):
                e, ff = divmod(r, f) if version == 2 else divmod(r, p)[::-1]
                if fsdp_dim is None and ff:
                    continue  # replicated over EP-FSDP: one copy
                offs, sizes = [2 * e, 0, 0], [2, 5, 4]
                if fsdp_dim is not None:
                    o, s = shard_interval(5, f, ff)
                    offs[1], sizes[1] = (o, s) if s else (5, 0)
                want.append((r, tuple(offs), tuple(sizes)))
            assert boxes == want
