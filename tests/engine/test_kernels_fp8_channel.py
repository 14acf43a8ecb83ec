"""Per-channel FP8 kernels (compressed-tensors ``channel`` strategy) against torch's own arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from ckpttool.engine import kernels


@pytest.mark.parametrize("rows,cols", [(128, 256), (37, 300), (1, 5)])
def test_fp8_channel_quantize_matches_torch(rows: int, cols: int) -> None:
    """Scale = row amax / 448 (1 for a zero row), q = (w / scale).to(e4m3fn); q * scale dequantizes, as torch."""
    import torch

    rng = np.random.default_rng(rows + cols)
    band = (rng.standard_normal((rows, cols)) * 10 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32)
    if rows > 2:
        band[1] = 0.0  # an all-zero row: scale 1
    q, scale, amax = kernels.fp8_channel_quantize(band)
    w = torch.from_numpy(band)
    ref_amax = w.abs().amax(dim=1, keepdim=True)
    ref_scale = torch.where(ref_amax == 0, torch.ones_like(ref_amax), ref_amax / 448.0)
    assert torch.equal(torch.from_numpy(scale), ref_scale[:, 0])
    ref_q = (w / ref_scale).to(torch.float8_e4m3fn)
    assert np.array_equal(q, ref_q.view(torch.uint8).numpy())
    deq = kernels.fp8_channel_dequantize(q, scale)
    assert np.array_equal(deq.view(np.uint32), (ref_q.to(torch.float32) * ref_scale).numpy().view(np.uint32))
    worst, rel = kernels.fp8_channel_error(band, deq, amax)
    assert 0 < rel <= 16 / 448 * (1 + 1e-6)
    assert worst == float(np.abs(deq - band).max())


def test_fp8_channel_nan_row_has_nan_amax() -> None:
    band = np.ones((3, 7), dtype=np.float32)
    band[2, 4] = np.nan
    _, scale, amax = kernels.fp8_channel_quantize(band)
    assert amax[0] == 1.0 and np.isnan(amax[2]) and np.isnan(scale[2])
