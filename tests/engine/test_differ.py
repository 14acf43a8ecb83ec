"""``differing_values`` against torch's own element-wise comparison of the same tensors, read from files in slabs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.engine.differ import differing_values
from ckpttool.engine.plan import Window

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def _window(path: Path, t: torch.Tensor, pad: int) -> Window:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    path.write_bytes(b"\x01" * pad + raw + b"\x02" * 3)
    return Window(os.open(path, os.O_RDONLY), pad, len(raw))


def _reference(a: torch.Tensor, b: torch.Tensor) -> int:
    """torch's count of differing elements: values compared in complex128 / float64, integers exactly, NaN alike."""
    if not (a.is_floating_point() or a.is_complex()):
        return int((a != b).sum())
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    a, b = a.to(wide), b.to(wide)
    return int(((a != b) & ~(torch.isnan(a) & torch.isnan(b))).sum())


def _tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(0, 4, (n,), generator=g).to(dtype) * (2**60 if dtype == torch.int64 else 1)
    base = torch.randn(n, generator=g, dtype=torch.complex64 if dtype.is_complex else torch.float32)
    return base.to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 700),
    changes=st.lists(st.integers(0, 699), max_size=12),
    nans=st.lists(st.integers(0, 699), max_size=4),
    slab=st.sampled_from([1, 7, 64, 1 << 20]),
    pads=st.tuples(st.integers(0, 9), st.integers(0, 9)),
)
def test_counts_as_torch_compares(
    tmp_path_factory: pytest.TempPathFactory,
    dtype: torch.dtype,
    n: int,
    changes: list[int],
    nans: list[int],
    slab: int,
    pads: tuple[int, int],
) -> None:
    """Random tensors of every dtype kind, a few elements changed (an int64 by 1 above 2**53, a complex value in its
    imaginary part only), NaN on both sides at some others, compared in slabs as small as one byte: the count is
    torch's, the first index and ``max_abs`` those of the changed elements."""
    a = _tensor(dtype, n, 0)
    b = a.clone()
    for i in (i for i in changes if i < n):
        if dtype == torch.bool:
            b[i] = ~b[i]
        elif dtype.is_complex:
            b[i] = b[i] + 0.5j
        elif dtype.is_floating_point:
            b[i] = (b[i].float() + 1).to(dtype)
        else:
            b[i] = b[i] + 1
    if dtype.is_floating_point or dtype.is_complex:
        for i in (i for i in nans if i < n):
            a[i] = b[i] = float("nan")
    d = tmp_path_factory.mktemp("differ")
    wa, wb = _window(d / "a", a, pads[0]), _window(d / "b", b, pads[1])
    try:
        got = differing_values(wa, dtype, wb, dtype, slab_bytes=slab)
    finally:
        os.close(wa.fd), os.close(wb.fd)
    want = _reference(a, b)
    assert got.numel == n and got.count == want
    if want:
        wide = torch.complex128 if dtype.is_complex else torch.float64
        ne = (a.to(wide) != b.to(wide)) & ~(torch.isnan(a.to(wide)) & torch.isnan(b.to(wide)))
        if not (dtype.is_floating_point or dtype.is_complex):
            ne = a != b
        assert got.first == int(torch.nonzero(ne)[0])
        assert got.max_abs > 0
    else:
        assert got.first is None and got.max_abs == 0.0


def test_two_dtypes_compare_as_values(tmp_path: Path) -> None:
    """A float32 head beside a bfloat16 embedding: equal where the float32 holds the bfloat16 value exactly."""
    emb = torch.randn(300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    head = emb.to(torch.float32)
    head[[4, 200]] += 1
    wa, wb = _window(tmp_path / "a", head, 0), _window(tmp_path / "b", emb, 5)
    try:
        got = differing_values(wa, torch.float32, wb, torch.bfloat16, slab_bytes=64)
    finally:
        os.close(wa.fd), os.close(wb.fd)
    assert (got.count, got.first, got.max_abs) == (2, 4, pytest.approx(1.0, abs=1e-2))
    assert got.to_dict()["first_values"] == [float(head[4]), float(emb[4])]
    with pytest.raises(ValueError):
        differing_values(wa, torch.float32, Window(wb.fd, 0, 2), torch.bfloat16)
