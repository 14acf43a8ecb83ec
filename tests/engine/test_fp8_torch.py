"""The torch band kernel of ``export --quantize`` against the numpy kernels and torch's own ops, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpttool.engine import fp8, kernels


def _band(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    band = (rng.standard_normal((rows, cols)) * 10 ** rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    band[0, 0] = -0.0
    if cols > 130:
        band[:, 1:130] = 0.0  # an all-zero block / most of a row
    band[-1, -3:] = np.float32(3e-43)  # float32 subnormals (e4m3fn subnormals after scaling)
    return band


@pytest.mark.parametrize(
    "rows,cols,block", [(128, 512, 128), (37, 300, 128), (1, 5, 128), (7, 100, 7), (64, 257, None)]
)
def test_quantize_band_equals_numpy_kernels(rows: int, cols: int, block: int | None) -> None:
    band = _band(rows, cols, rows * cols)
    if block is None:
        q, scale, amax = kernels.fp8_channel_quantize(band)
        worst, rel = kernels.fp8_channel_error(band, kernels.fp8_channel_dequantize(q, scale), amax)
    else:
        q, scale, amax = kernels.fp8_block_quantize(band, block)
        worst, rel = kernels.fp8_block_error(band, kernels.fp8_block_dequantize(q, scale, block), amax, block)
    got = fp8.quantize_band(band, block)
    assert np.array_equal(got.q, q)
    assert np.array_equal(got.scale.view(np.uint32), scale.view(np.uint32))
    assert np.array_equal(got.amax.view(np.uint32), amax.view(np.uint32))
    assert (got.worst, got.rel) == (worst, rel)
    # the error from torch's own dequantization: (q.float() * scale - w).abs() per block / row
    w = torch.from_numpy(band)
    deq = torch.from_numpy(got.q.copy()).view(torch.float8_e4m3fn).float()
    deq *= (
        torch.from_numpy(got.scale).view(-1, 1)
        if block is None
        else torch.from_numpy(got.scale).repeat_interleave(block)[:cols]
    )
    assert got.worst == float((deq - w).abs().max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block", [128, None])
def test_quantize_band_of_stored_dtype_equals_widened(dtype: str, block: int | None) -> None:
    """A band held in its stored dtype (bfloat16 as uint16 bits) gives what its float32 widening gives, bit for bit."""
    band = _band(100, 300, 7)
    band[band != 0] = np.clip(np.abs(band[band != 0]), 1e-3, 1e3) * np.sign(band[band != 0])  # float16's range
    stored = torch.from_numpy(band).to(getattr(torch, dtype))
    held = stored.view(torch.uint16).numpy() if dtype == "bfloat16" else stored.numpy()
    widened = stored.float().numpy()
    a = fp8.quantize_band(widened, block)
    ref = (a.q.copy(), a.scale.copy(), a.amax.copy(), a.worst, a.rel)  # the arrays are the thread's scratch
    b = fp8.quantize_band(held, block)
    assert np.array_equal(b.q, ref[0]) and np.array_equal(b.scale, ref[1]) and np.array_equal(b.amax, ref[2])
    assert (b.worst, b.rel) == ref[3:]


def test_torch_threads_restores() -> None:
    before = torch.get_num_threads()
    with fp8.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
