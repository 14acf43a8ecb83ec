"""FP8 quantization of bands of rows with torch's CPU kernels: the fallback of the native kernel.

``export --quantize`` uses :mod:`ckpttool.engine.fp8_native` where the extension is built, and
this module otherwise (or with ``CKPTTOOL_NATIVE=0``); both give the same bytes.

:func:`quantize_band` computes, for one band of rows, what :func:`~ckpttool.engine.kernels.fp8_block_quantize`
(or ``fp8_channel_quantize``), the dequantization and ``fp8_block_error`` (``fp8_channel_error``)
compute in numpy, bit for bit, in 40-55% of the CPU time: the rounding to
``float8_e4m3fn`` is torch's vectorised ``Tensor.copy_`` (the numpy bit arithmetic it replaces is
the reference of the tests), the other steps torch's vectorised elementwise and reduction kernels,
into per-thread scratch tensors (no allocation, no page faults per band). Only a quantized export
without the native kernel imports this module (torch takes ~1 s to import).

The error check dequantizes magnitudes: ``| |q| * scale - |w| |`` equals ``|q * scale - w|`` bit for
bit, because ``q`` = round-to-nearest-even(``w / scale``) has the sign of ``w`` (or is zero) and
rounding is symmetric. ``|q|`` comes from the e4m3fn bits: ``(byte & 0x7F) << 20`` is a float32
``2^-120`` times the e4m3fn value (e4m3fn subnormals land on float32 subnormals, so this assumes
torch's default, ``torch.set_flush_denormal(False)``), scaled back by one exact multiplication by ``2^120``.

Torch's intra-op threads are left alone here: the caller runs one band per engine worker
(:func:`torch_threads` sets one torch thread per worker while the export runs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ckpttool.engine.fp8_native import BandResult

__all__ = ["BandResult", "quantize_band", "torch_threads"]

_E4M3FN_MAX = 448.0
_UNBIAS = 2.0**120  # float32 value of the e4m3fn magnitude bits shifted into place, to the e4m3fn value


class _Scratch(threading.local):
    """This thread's scratch tensors, grown to the largest band seen."""

    def __init__(self) -> None:
        self.n = 0
        self.f: list[torch.Tensor] = []
        self.q = torch.empty(0, dtype=torch.float8_e4m3fn)
        self.i = torch.empty(0, dtype=torch.int32)

    def get(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = rows * cols
        if n > self.n:
            self.n = n
            self.f = [torch.empty(n, dtype=torch.float32) for _ in range(2)]
            self.q = torch.empty(n, dtype=torch.float8_e4m3fn)
            self.i = torch.empty(n, dtype=torch.int32)
        a, s = (t[:n].view(rows, cols) for t in self.f)
        return a, s, self.q[:n].view(rows, cols), self.i[:n].view(rows, cols)


_scratch = _Scratch()


def _blocks(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[rows, cols]`` as its whole column blocks ``[rows, n, block]`` and the edge block (``None`` if none)."""
    cols = t.shape[1]
    full = cols // block
    body = t[:, : full * block].view(t.shape[0], full, block)
    return body, (t[:, full * block :] if full * block < cols else None)


def _block_amax(t: torch.Tensor, block: int) -> torch.Tensor:
    """``max`` over each ``rows x block`` column block of ``t`` (the edge block as it is: padding adds zeros only)."""
    body, edge = _blocks(t, block)
    m = body.amax(dim=(0, 2))
    return m if edge is None else torch.cat([m, edge.amax().reshape(1)])


def _per_block(t: torch.Tensor, v: torch.Tensor, block: int | None, op: str, out: torch.Tensor) -> None:
    """``out[:, block j] = t[:, block j] op v[j]`` (``op``: ``mul`` or ``div``; ``block`` ``None``: ``v[row]``)."""
    fn = getattr(torch, op)
    if block is None:
        fn(t, v.view(-1, 1), out=out)
        return
    body, edge = _blocks(t, block)
    obody, oedge = _blocks(out, block)
    nb = body.shape[1]
    fn(body, v[:nb].view(1, nb, 1), out=obody)
    if edge is not None:
        fn(edge, v[nb:], out=oedge)  # a 1-D scale: a 0-D one would not promote a bfloat16 edge to float32


def quantize_band(band: np.ndarray, block: int | None) -> BandResult:
    """Quantize one band (``[rows, cols]``, C-contiguous) to ``float8_e4m3fn`` and measure its error.

    Args:
        band: the source rows (read only): float32, float16, or ``uint16`` bfloat16 bit patterns; the
            kernels widen them to float32 exactly as they read them (no widened copy of the band).
        block: ``B`` of ``B x B`` blocks (the band holds at most ``B`` rows: one scale per column
            block, DeepSeek-V3 ``weight_scale_inv``); ``None``: one scale per row (compressed-tensors
            ``channel``).

    Returns:
        :class:`BandResult`, bitwise equal to the numpy kernels' (``docs/export.md``, "Quantized export").
    """
    rows, cols = band.shape
    w = torch.from_numpy(band)
    a, s, q, i = _scratch.get(rows, cols)
    if band.dtype != np.float32:  # widened exactly, in one vectorised pass
        s.copy_(w.view(torch.bfloat16) if band.dtype == np.uint16 else w)
        w = s
    torch.abs(w, out=a)
    amax = a.amax(dim=1) if block is None else _block_amax(a, block)
    scale = torch.where(amax == 0, 1.0, amax / _E4M3FN_MAX)
    _per_block(w, scale, block, "div", s)
    q.copy_(s)  # round to nearest even, saturating at ±448: c10's float8_e4m3fn conversion
    # |q| * scale - |w|: the magnitude bits as float32, times 2^120 (exact), times the scale
    i.copy_(q.view(torch.uint8))
    i.bitwise_and_(0x7F).bitwise_left_shift_(20)
    d = i.view(torch.float32)
    d.mul_(_UNBIAS)
    _per_block(d, scale, block, "mul", d)
    d.sub_(a).abs_()
    err = d.amax(dim=1) if block is None else _block_amax(d, block)
    rel = torch.where(amax > 0, err / amax, 0.0)
    return BandResult(
        q.view(torch.uint8).numpy(),
        scale.numpy(),
        amax.numpy(),
        float(err.max()) if err.numel() else 0.0,
        float(rel.max()) if rel.numel() else 0.0,
    )


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``n`` (the threads that first run a torch op meanwhile take it), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
