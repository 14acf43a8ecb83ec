"""The native FP8 band kernel (``engine/native/fp8.c``) against the numpy kernels, the torch kernel and torch's own cast.

Bit for bit on random bands with special values: all-zero blocks and rows, edge blocks narrower
than the block, float32 subnormals, exact rounding ties of e4m3fn normals and subnormals, values that
saturate at 448, NaN and infinity (the scale is non-finite: the export refuses the band). And
the export: the same files and ``--json`` with the native kernel (no torch imported) and without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpttool.engine import fp8, fp8_native, kernels
from tests.engine.test_fp8_torch import _band

pytestmark = pytest.mark.skipif(not fp8_native.available(), reason="native kernels not built or CKPTTOOL_NATIVE=0")

#: amax 448 gives scale 1: these are then e4m3fn values and exact ties between two of them
_TIES = [448.0, 1.0625, 1.1875, -2.125, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, -(2.0**-7 + 2.0**-11), 240.0, 0.0]
#: multiples of the smallest float32 subnormal: amax 600 of them gives the smallest subnormal as the
#: scale (600 / 448 rounds to 1), so w / scale is the multiple: 600, 470, 464 and 460 saturate to 448
_SATURATING = [600, -470, 464, 460, 432, 17, 3, 0]


def _special_band(cols: int, block: int | None) -> np.ndarray:
    """Rows of :data:`_TIES` and :data:`_SATURATING` (one per row, or one block of their own per band)."""
    rows = [np.resize(np.float32(_TIES), cols), np.resize(np.float32(_SATURATING) * np.float32(2.0**-149), cols)]
    if block is not None:  # a band shares a scale per column block: one row each, the others zero
        rows = [rows[0], np.zeros(cols, np.float32)]
    return np.stack(rows).astype(np.float32)


def _reference(band: np.ndarray, b: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    if b is None:
        q, scale, amax = kernels.fp8_channel_quantize(band)
        worst, rel = kernels.fp8_channel_error(band, kernels.fp8_channel_dequantize(q, scale), amax)
    else:
        q, scale, amax = kernels.fp8_block_quantize(band, b)
        worst, rel = kernels.fp8_block_error(band, kernels.fp8_block_dequantize(q, scale, b), amax, b)
    return q, scale, amax, worst, rel


def _assert_same(got: fp8_native.BandResult, ref: tuple[np.ndarray, np.ndarray, np.ndarray, float, float]) -> None:
    q, scale, amax, worst, rel = ref
    assert np.array_equal(got.q, q)
    assert np.array_equal(got.scale.view(np.uint32), scale.view(np.uint32))
    assert np.array_equal(got.amax.view(np.uint32), amax.view(np.uint32))
    assert (got.worst, got.rel) == (worst, rel)


def _torch_cast(band: np.ndarray, scale: np.ndarray, block: int | None) -> np.ndarray:
    """torch's own ``(w / scale).to(torch.float8_e4m3fn)`` bytes, the scale per row or per column block."""
    w = torch.from_numpy(band)
    s = torch.from_numpy(scale)
    s = s.view(-1, 1) if block is None else s.repeat_interleave(block)[: band.shape[1]]
    return (w / s).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


@pytest.mark.parametrize(
    "rows,cols,block",
    [(128, 512, 128), (37, 300, 128), (1, 5, 128), (7, 100, 7), (64, 257, None), (128, 131, 128), (3, 1000, None)],
)
def test_native_band_equals_numpy_torch_kernel_and_torch_cast(rows: int, cols: int, block: int | None) -> None:
    band = _band(rows, cols, rows * cols)
    ref = _reference(band, block)
    got = fp8_native.quantize_band(band, block)
    _assert_same(got, ref)
    assert np.array_equal(got.q, _torch_cast(band, got.scale, block))
    t = fp8.quantize_band(band, block)
    _assert_same(got, (t.q, t.scale, t.amax, t.worst, t.rel))


@pytest.mark.parametrize("block", [128, 16, None])
def test_native_band_ties_saturation_and_subnormals(block: int | None) -> None:
    band = _special_band(200, block)
    got = fp8_native.quantize_band(band, block)
    _assert_same(got, _reference(band, block))
    assert np.array_equal(got.q, _torch_cast(band, got.scale, block))
    e4m3 = torch.from_numpy(got.q[0, : len(_TIES)].copy()).view(torch.float8_e4m3fn).float().tolist()
    assert e4m3 == [448.0, 1.0, 1.25, -2.0, 0.0, 2.0**-8, 2.0**-8, -(2.0**-7)] + [240.0, 0.0]
    if block is None:  # the subnormal scale row: saturated at 448, sign kept
        assert got.scale[1] == np.float32(2.0**-149)
        assert got.q[1, :5].tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0x7E]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block", [128, None])
def test_native_band_of_stored_dtype_equals_widened(dtype: str, block: int | None) -> None:
    """A band held in its stored dtype (bfloat16 as uint16 bits) gives what its float32 widening gives, bit for bit."""
    band = _band(100, 300, 7)
    band[band != 0] = np.clip(np.abs(band[band != 0]), 1e-3, 1e3) * np.sign(band[band != 0])  # float16's range
    stored = torch.from_numpy(band).to(getattr(torch, dtype))
    held = stored.view(torch.uint16).numpy() if dtype == "bfloat16" else stored.numpy()
    got = fp8_native.quantize_band(held, block)
    _assert_same(got, _reference(stored.float().numpy(), block))


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("block", [16, None])
def test_native_bands_equal_one_band_at_a_time_and_numpy(stored: str, block: int | None) -> None:
    """``quantize_bands`` (one call for a run of bands, the last one shorter) gives each band what ``quantize_band``
    and the numpy kernels give; the rows of the second half scale by 1e6 (scales >= 256: the dequantization then
    multiplies by 2^120 and by the scale apart)."""
    band = _band(37, 300, 11)
    band[19:] = np.clip(band[19:], -1e30, 1e30) * np.float32(1e6)
    held = band if stored == "float32" else torch.from_numpy(band).to(torch.bfloat16).view(torch.uint16).numpy()
    wide = band if stored == "float32" else torch.from_numpy(held).view(torch.bfloat16).float().numpy()
    got = fp8_native.quantize_bands(held, block, 16)
    q, scale, amax = got.q.copy(), got.scale.copy(), got.amax.copy()
    assert len(got.worst) == len(got.rel) == 3
    per = 300 // 16 + 1
    for i, r0 in enumerate(range(0, 37, 16)):
        ref = _reference(wide[r0 : r0 + 16], block)
        s0, s1 = (r0, r0 + len(ref[0])) if block is None else (i * per, (i + 1) * per)
        _assert_same(
            fp8_native.BandResult(q[r0 : r0 + 16], scale[s0:s1], amax[s0:s1], got.worst[i], got.rel[i]),
            ref,
        )
    assert (scale >= 256).any() and (scale < 256).any()


def _midpoint_band(cols: int, seed: int) -> np.ndarray:
    """Rows whose quotients w / scale meet the kernel's division-free paths at their edges (a row per scale):
    exact e4m3fn midpoints at exact scales (amax 448 * 2^k and 140 * 2^k: bfloat16 meets these often), float32
    values within a few ulps of a midpoint at an inexact scale, values at the subnormal threshold scale * 2^-6
    (a few ulps either side), and scales either side of 2^-64 and 2^64 (beyond them the kernel divides)."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in (-20, 0, 7):  # integers times 2^k with amax 448 * 2^k: scale 2^k, ties at 17, 19, 34, ...
        r = rng.integers(-448, 449, cols).astype(np.float32) * np.float32(2.0**k)
        rows.append(np.concatenate([[np.float32(448 * 2.0**k)], r[1:]]))
    r = (rng.integers(-140 * 16, 140 * 16 + 1, cols) / 16).astype(np.float32) * np.float32(2.0**-9)
    rows.append(np.concatenate([[np.float32(140 * 2.0**-9)], r[1:]]))  # scale 0.3125 * 2^-9, exact
    amax = np.float32(0.0372)
    scale = amax / np.float32(448)
    mids = np.float32([17, 19, 9.5, 0.59375, 232, 0.0185546875])  # e4m3fn midpoints
    near = (mids[:, None] * scale).view(np.uint32).astype(np.int64) + np.arange(-6, 7)
    r = np.resize(near.astype(np.uint32).view(np.float32).ravel() * np.float32(rng.choice([-1, 1])), cols)
    rows.append(np.concatenate([[amax], r[1:]]))
    thr = (scale * np.float32(2.0**-6)).view(np.uint32).astype(np.int64) + np.arange(-40, 41)
    rows.append(np.concatenate([[amax], np.resize(thr.astype(np.uint32).view(np.float32), cols - 1)]))
    for e in (-64, 64):
        for f in (0.999, 1.0, 1.001):
            rows.append(rng.standard_normal(cols).astype(np.float32) * np.float32(448 * 2.0**e * f / 4))
            rows[-1][0] = np.float32(448 * 2.0**e * f)
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("block", [128, None])
def test_native_band_midpoints_thresholds_and_scale_ranges(stored: str, block: int | None) -> None:
    """The division-free codes (bfloat16: Markstein's corrected quotient; float32: a product checked against the
    midpoints) give the numpy kernels' figures and torch's cast, bit for bit, at their edges (:func:`_midpoint_band`);
    with a block, each row is a band of its own (a scale per row's blocks)."""
    band = _midpoint_band(300, 5)
    if stored == "bfloat16":
        held = torch.from_numpy(band).to(torch.bfloat16).view(torch.uint16).numpy()
        band = torch.from_numpy(held).view(torch.bfloat16).float().numpy()
    else:
        held = band
    for i in range(band.shape[0]) if block is not None else [slice(None)]:
        rows, wide = held[i].reshape(-1, 300), band[i].reshape(-1, 300)
        got = fp8_native.quantize_band(rows, block)
        _assert_same(got, _reference(wide, block))
        assert np.array_equal(got.q, _torch_cast(wide, got.scale, block))


@pytest.mark.parametrize("block", [128, None])
def test_native_band_nan_and_infinity_give_non_finite_scales(block: int | None) -> None:
    """A NaN or an infinity makes its block's (row's) amax and scale non-finite, as the torch kernel's (E607);
    the other blocks come out as the numpy kernels'."""
    band = _band(4, 300, 3)
    band[1, 5], band[2, 140] = np.nan, -np.inf
    got = fp8_native.quantize_band(band, block)
    t = fp8.quantize_band(band, block)
    for a, b in ((got.amax, t.amax), (got.scale, t.scale)):
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.isinf(a), np.isinf(b))
    bad = ~np.isfinite(got.scale)
    assert bad.sum() == 2
    with np.errstate(invalid="ignore"):
        ref = _reference(band, block)
    assert np.array_equal(got.scale[~bad], ref[1][~bad])
    if block is None:
        assert np.array_equal(got.q[~bad], ref[0][~bad])
    else:
        assert np.array_equal(got.q[:, 256:], ref[0][:, 256:])


_NO_TORCH = (
    "import os, sys\nfrom ckpttool.cli.app import main\n"
    "sys.argv = ['ckpttool', 'export', *sys.argv[1:]]\n"
    "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
    "assert ('torch' in sys.modules) == (os.environ['CKPTTOOL_NATIVE'] == '0'), 'torch imported or not'\n"
)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(200, 260, generator=g) for i in range(2)}
    sd["model.layers.0.mlp.down_proj.weight"][:, :128] = 0.0
    sd["model.norm.weight"] = torch.ones(260)
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def _export(ckpt: Path, out: Path, native: str) -> dict[str, object]:
    """``export --quantize fp8-channel --quant-format compressed-tensors --json`` in a fresh process."""
    args = [str(ckpt), str(out), "--quantize", "fp8-channel", "--quant-format", "compressed-tensors", "--json"]
    env = {**os.environ, "CKPTTOOL_NATIVE": native}
    run = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    return {k: v for k, v in doc.items() if k not in ("output", "seconds", "write_seconds", "gb_per_s")}


def test_native_export_imports_no_torch_and_equals_the_numpy_kernels(tmp_path: Path) -> None:
    from safetensors import safe_open

    sd = _checkpoint(tmp_path / "c")
    _export(tmp_path / "c", tmp_path / "o", "1")
    got = {}
    for f in sorted((tmp_path / "o").glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            got.update({k: h.get_tensor(k).view(torch.uint8).numpy() for k in h.keys()})
    for i in range(2):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        q, scale, _ = kernels.fp8_channel_quantize(sd[name].float().numpy())
        assert np.array_equal(got[name], q), name
        assert np.array_equal(got[name.replace("weight", "weight_scale")].view(np.float32).reshape(-1), scale), name


@pytest.mark.heavy  # two fresh processes, one importing torch (~5 CPU s)
def test_export_same_bytes_and_json_with_and_without_the_native_kernel(tmp_path: Path) -> None:
    """The same files and ``--json`` (timings aside) with the native kernel (torch never imported) and with the
    torch kernel (``CKPTTOOL_NATIVE=0``)."""
    _checkpoint(tmp_path / "c")
    docs = [_export(tmp_path / "c", tmp_path / on, on) for on in ("1", "0")]
    assert docs[0] == docs[1]
    files = sorted(p.name for p in (tmp_path / "1").iterdir() if p.name != ".ckpttool-output.json")
    assert files and files == sorted(p.name for p in (tmp_path / "0").iterdir() if p.name != ".ckpttool-output.json")
    for f in files:
        assert (tmp_path / "1" / f).read_bytes() == (tmp_path / "0" / f).read_bytes(), f
