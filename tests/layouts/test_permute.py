"""Permutation math between legacy and canonical EP layouts (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.errors import LayoutError
from ckpttool.layouts.permute import (
    canonical_to_legacy_perm,
    compose_permutations,
    invert_permutation,
    legacy_position_of_true_slab,
    legacy_to_canonical_perm,
)
from ckpttool.ops.tensors import apply_block_permutation

sizes = st.integers(min_value=1, max_value=6)


def test_documented_example_p2_f2() -> None:
    assert legacy_to_canonical_perm(4, 2, 2) == [0, 2, 1, 3]
    assert canonical_to_legacy_perm(4, 2, 2) == [0, 2, 1, 3]


def test_p4_f2_slabs_match_design_formula_by_hand() -> None:
    # legacy stores at f*P+e the true slab e*F+f: position 1 = (f0,e1) holds true slab 2.
    c2l = canonical_to_legacy_perm(8, 4, 2)
    assert c2l == [0, 2, 4, 6, 1, 3, 5, 7]
    assert legacy_to_canonical_perm(8, 4, 2) == [0, 4, 1, 5, 2, 6, 3, 7]


@settings(max_examples=200, deadline=None)
@given(p=sizes, f=sizes, k=st.integers(min_value=1, max_value=4))
def test_round_trip_is_identity(p: int, f: int, k: int) -> None:
    n = p * f * k
    l2c = legacy_to_canonical_perm(n, p, f)
    c2l = canonical_to_legacy_perm(n, p, f)
    assert sorted(l2c) == list(range(n))
    assert compose_permutations(l2c, c2l) == list(range(n))
    assert compose_permutations(c2l, l2c) == list(range(n))
    assert invert_permutation(l2c) == c2l


@settings(max_examples=200, deadline=None)
@given(p=sizes, f=sizes, k=st.integers(min_value=1, max_value=3))
def test_legacy_position_f_times_p_plus_e_holds_true_slab_e_times_f_plus_f(p: int, f: int, k: int) -> None:
    n = p * f * k
    true_blocks = list(range(n))
    legacy = [true_blocks[i] for i in canonical_to_legacy_perm(n, p, f)]
    for e in range(p):
        for ff in range(f):
            stored = legacy[(ff * p + e) * k : (ff * p + e + 1) * k]
            assert stored == list(range((e * f + ff) * k, (e * f + ff + 1) * k))
            assert legacy_position_of_true_slab(e * f + ff, p, f) == ff * p + e


@settings(max_examples=100, deadline=None)
@given(p=sizes, f=sizes, extra=st.integers(min_value=1, max_value=5))
def test_non_divisible_block_counts_are_rejected(p: int, f: int, extra: int) -> None:
    n = p * f + extra
    if n % (p * f) == 0:
        return
    with pytest.raises(LayoutError) as ei:
        legacy_to_canonical_perm(n, p, f)
    assert ei.value.code == "E406" and "multiple of ep_size * ep_fsdp_size" in ei.value.hint
    with pytest.raises(LayoutError):
        canonical_to_legacy_perm(n, p, f)


@pytest.mark.parametrize("bad", [(4, 0, 2), (4, 2, 0), (4, -1, 1)])
def test_nonpositive_sizes_are_rejected(bad: tuple[int, int, int]) -> None:
    with pytest.raises(LayoutError, match="must be an integer >= 1"):
        legacy_to_canonical_perm(*bad)


@settings(max_examples=60, deadline=None)
@given(p=sizes, f=sizes, rows=st.integers(min_value=1, max_value=3), dim=st.integers(min_value=0, max_value=1))
def test_apply_matches_python_gather_and_round_trips(p: int, f: int, rows: int, dim: int) -> None:
    n = p * f
    shape = [n * rows, 3] if dim == 0 else [2, n * rows]
    t = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    perm = canonical_to_legacy_perm(n, p, f)
    out = apply_block_permutation(t, perm, dim)
    blocks = t.split(rows, dim=dim)
    assert torch.equal(out, torch.cat([blocks[i] for i in perm], dim=dim))
    back = apply_block_permutation(out, legacy_to_canonical_perm(n, p, f), dim)
    assert torch.equal(back, t)


def test_apply_rejects_shape_not_divisible() -> None:
    with pytest.raises(LayoutError, match="does not divide into 4 equal blocks"):
        apply_block_permutation(torch.zeros(6, 2), [0, 2, 1, 3])


def test_apply_does_not_modify_input_for_identity() -> None:
    t = torch.arange(4.0)
    out = apply_block_permutation(t, [0, 1])
    out.add_(1)
    assert torch.equal(t, torch.arange(4.0))


def test_invert_rejects_non_permutation() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        invert_permutation([0, 0, 1])
