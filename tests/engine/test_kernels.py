"""The byte engine's numeric kernels against independent references: torch's ``Tensor.to`` and numpy indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpttool.engine import kernels

# low halves of a float32 pattern: exact, just above/below and on the rounding tie, odd payloads
_LOW_HALVES = np.array(
    [0x0000, 0x0001, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFE, 0xFFFF, 0x1234, 0xA5A5],
    dtype=np.uint32,
)


def _all_upper_halves() -> np.ndarray:
    """Every upper 16-bit pattern (all bfloat16 values: ±0, subnormals, ±inf, NaN payloads, max finite) × the low halves."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    return (hi[:, None] | _LOW_HALVES[None, :]).reshape(-1)


def _torch_bits(x: torch.Tensor, int_dtype: torch.dtype) -> np.ndarray:
    return x.view(int_dtype).numpy()


def test_f32_to_bf16_matches_torch_on_every_upper_half():
    u = _all_upper_halves()
    f = u.view(np.float32)
    out = np.empty(u.size, dtype=np.uint16)
    kernels.f32_to_bf16(u, out)
    ref = _torch_bits(torch.from_numpy(f.copy()).to(torch.bfloat16), torch.int16).view(np.uint16)
    nan = np.isnan(f)
    assert nan.any() and np.isinf(f).any()
    np.testing.assert_array_equal(out[~nan], ref[~nan])
    # NaN: the canonical quiet NaN of c10::BFloat16's scalar conversion, whatever the payload and sign
    assert np.all(out[nan] == kernels.BF16_NAN)
    assert torch.isnan(torch.from_numpy(ref[nan].view(np.int16)).view(torch.bfloat16)).all()


def test_bf16_overflow_at_is_every_finite_value_torch_makes_infinite():
    """The indices import's float32 -> bfloat16 cast names (E612): exactly the finite float32 values torch's
    ``to(bfloat16)`` makes infinite, over every upper half; :func:`bf16_overflows` says whether there is one."""
    u = _all_upper_halves()
    f = u.view(np.float32)
    ref = torch.isinf(torch.from_numpy(f.copy()).to(torch.bfloat16)).numpy() & np.isfinite(f)
    assert ref.any()
    np.testing.assert_array_equal(kernels.bf16_overflow_at(u), np.flatnonzero(ref))
    assert kernels.bf16_overflows(u) and not kernels.bf16_overflows(u[~ref])
    assert kernels.bf16_overflow_at(u[~ref]).size == 0


def test_f32_to_bf16_without_canonical_nan_rounds_the_payload():
    u = np.array([0x7FFFFFFF, 0x7F800001, 0xFF8FFFFF, 0x3F808000], dtype=np.uint32)
    out = np.empty(4, dtype=np.uint16)
    kernels.f32_to_bf16(u, out, canonical_nan=False)
    expect = [((int(x) + 0x7FFF + ((int(x) >> 16) & 1)) >> 16) & 0xFFFF for x in u]
    assert out.tolist() == expect


def test_ties_round_to_even():
    # 1 + 2^-8 is halfway between bfloat16 1.0 and 1 + 2^-7: to the even 1.0; 1 + 3*2^-8 up to 1 + 2^-6
    f = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=np.float32)
    out = np.empty(3, dtype=np.uint16)
    kernels.f32_to_bf16(f.view(np.uint32), out)
    assert out.tolist() == [0x3F80, 0x3F82, 0xBF80]


def test_f32_to_f16_matches_torch_on_every_upper_half():
    u = _all_upper_halves()
    f = u.view(np.float32)
    out = np.empty(u.size, dtype=np.float16)
    kernels.f32_to_f16(f, out)
    ref = torch.from_numpy(f.copy()).to(torch.float16).numpy()
    nan = np.isnan(f)
    np.testing.assert_array_equal(out.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])
    assert np.isnan(out[nan]).all()
    assert np.isinf(out[np.abs(f) > 65520]).all()  # beyond float16's range: infinity


def test_bf16_to_f32_is_exact():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, dtype=np.uint32)
    kernels.bf16_to_f32(bits, out)
    ref = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    nan = np.isnan(ref)
    np.testing.assert_array_equal(out.view(np.float32)[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(out.view(np.float32)[nan]).all()


@pytest.mark.parametrize("pair", sorted(kernels.FAST_CASTS))
def test_cast_matches_torch(pair):
    src_dtype, out_dtype = pair
    rng = np.random.default_rng(7)
    f = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-8, 6, 20000),
            np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 3.0e38, 1e-8, -6e-8, 1e-40], dtype=np.float32),
        ]
    )
    src_t = torch.from_numpy(f).to(getattr(torch, src_dtype))
    src = src_t.view(torch.uint8).numpy()
    item = torch.empty(0, dtype=getattr(torch, out_dtype)).element_size()
    out = np.empty(f.size * item, dtype=np.uint8)
    kernels.cast(src, out, src_dtype, out_dtype)
    ref = src_t.to(getattr(torch, out_dtype)).view(torch.uint8).numpy()
    np.testing.assert_array_equal(out, ref)


def test_cast_rejects_other_pairs():
    with pytest.raises(KeyError):
        kernels.cast(np.zeros(8, np.uint8), np.zeros(8, np.uint8), "float64", "bfloat16")


def _f8_inputs() -> np.ndarray:
    rng = np.random.default_rng(3)
    scaled = [
        rng.standard_normal(1 << 16).astype(np.float32) * s for s in (1e-9, 1e-6, 1e-3, 0.1, 1, 30, 300, 1e4, 1e5)
    ]
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, 449, 463.9, 464, 464.1, 480, 1e30, -1e30]
        + [57344, 57345, 61439, 61440, 61441, 65536, -65536, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-10, 2**-14]
        + [2**-16, 2**-17, 3 * 2**-17, 2**-18, 1e-40, -1e-45],
        dtype=np.float32,
    )
    patterns = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint32).view(np.float32)  # NaN payloads, everything
    return np.concatenate([*scaled, special, patterns])


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_f32_to_f8_matches_torch(dtype):
    f = _f8_inputs()
    out = np.empty(f.size, dtype=np.uint8)
    kernels.f32_to_f8(f.view(np.uint32), out, dtype)
    ref = torch.from_numpy(f).to(getattr(torch, dtype)).view(torch.uint8).numpy()
    np.testing.assert_array_equal(out, ref)


def test_f8_overflow_rules():
    f = np.array([1e6, -np.inf, np.nan, -np.nan], dtype=np.float32)
    out = np.empty(4, dtype=np.uint8)
    kernels.f32_to_f8(f.view(np.uint32), out, "float8_e4m3fn")
    assert out.tolist() == [0x7E, 0xFE, 0x7F, 0xFF]  # saturated to ±448; NaN
    kernels.f32_to_f8(f.view(np.uint32), out, "float8_e5m2")
    assert out.tolist() == [0x7C, 0xFC, 0x7F, 0xFF]  # infinity; NaN


def _reference_placement(src, out_size, runs):
    out = np.zeros(out_size, dtype=src.dtype)
    dst_idx = np.concatenate([np.arange(d, d + n) for s, n, d in runs]) if runs else np.zeros(0, np.int64)
    src_idx = np.concatenate([np.arange(s, s + n) for s, n, d in runs]) if runs else np.zeros(0, np.int64)
    out[dst_idx] = src[src_idx]
    return out


@pytest.mark.parametrize(
    "case",
    ["identity", "row_permutation", "row_subset", "ragged", "into_larger", "halves_swapped", "empty"],
)
def test_place_runs_against_fancy_indexing(case):
    rng = np.random.default_rng(5)
    rows, width = 24, 16
    src = rng.integers(0, 1 << 16, rows * width, dtype=np.uint64).astype(np.uint16)
    out_size = rows * width
    if case == "identity":
        runs = [(0, rows * width, 0)]
    elif case == "row_permutation":
        perm = rng.permutation(rows)
        runs = [(i * width, width, int(perm[i]) * width) for i in range(rows)]
    elif case == "row_subset":
        pick = rng.choice(rows, 7, replace=False)
        dst = rng.choice(rows, 7, replace=False)
        runs = [(int(p) * width, width, int(d) * width) for p, d in zip(pick, dst)]
    elif case == "ragged":
        runs = [(0, 5, 100), (5, 11, 7), (40, 60, 200), (300, 3, 0)]
    elif case == "into_larger":
        out_size = 3 * rows * width
        perm = rng.permutation(3 * rows)[:rows]
        runs = [(i * width, width, int(perm[i]) * width) for i in range(rows)]
    elif case == "halves_swapped":
        half = rows * width // 2
        runs = [(0, half, half), (half, half, 0)]
    else:
        runs = []
    out = np.zeros(out_size, dtype=np.uint16)
    kernels.place_runs(src, out, runs)
    np.testing.assert_array_equal(out, _reference_placement(src, out_size, runs))


def test_scatter_rows_permutation_and_partial():
    rng = np.random.default_rng(9)
    src = rng.integers(0, 255, (10, 6), dtype=np.uint8)
    perm = rng.permutation(10)
    out = np.empty_like(src)
    kernels.scatter_rows(src, perm, out)
    ref = np.empty_like(src)
    ref[perm] = src
    np.testing.assert_array_equal(out, ref)
    big = np.zeros((25, 6), dtype=np.uint8)
    dst = rng.choice(25, 10, replace=False)
    kernels.scatter_rows(src, dst, big)
    ref = np.zeros_like(big)
    ref[dst] = src
    np.testing.assert_array_equal(big, ref)


# ---------------------------------------------------------------------------------------------- block FP8


def test_e4m3fn_values_match_torch() -> None:
    import torch

    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    got = kernels.E4M3FN_VALUES
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(got[ok].view(np.uint32), ref[ok].view(np.uint32))


@pytest.mark.parametrize("rows,cols", [(128, 256), (37, 300), (1, 5)])
def test_fp8_block_quantize_matches_torch(rows: int, cols: int) -> None:
    """Scales are amax/448 per 128x128 block (edge blocks padded), q = (w / scale).to(e4m3fn), as torch computes it."""
    import torch

    rng = np.random.default_rng(rows * cols)
    band = (rng.standard_normal((rows, cols)) * 10 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32)
    if cols >= 256:
        band[:, 128:256] = 0.0  # an all-zero block: scale 1
    q, scale, amax = kernels.fp8_block_quantize(band, 128)
    w = torch.from_numpy(band)
    nb = -(-cols // 128)
    ref_amax = torch.stack([w[:, j * 128 : (j + 1) * 128].abs().amax() for j in range(nb)])
    ref_scale = torch.where(ref_amax == 0, torch.ones_like(ref_amax), ref_amax / 448.0)
    assert torch.equal(torch.from_numpy(scale), ref_scale)
    ref_q = (w / ref_scale.repeat_interleave(128)[:cols]).to(torch.float8_e4m3fn)
    assert np.array_equal(q, ref_q.view(torch.uint8).numpy())
    deq = kernels.fp8_block_dequantize(q, scale, 128)
    ref_deq = ref_q.to(torch.float32) * ref_scale.repeat_interleave(128)[:cols]
    assert np.array_equal(deq.view(np.uint32), ref_deq.numpy().view(np.uint32))
    worst, rel = kernels.fp8_block_error(band, deq, amax, 128)
    assert 0 < rel <= 16 / 448 * (1 + 1e-6)  # half an e4m3 ulp of the top binade, relative to the block amax
    assert worst == float(np.abs(deq - band).max())


def test_fp8_block_quantize_nan_block_has_nan_amax() -> None:
    band = np.ones((4, 130), dtype=np.float32)
    band[0, 129] = np.nan
    _, scale, amax = kernels.fp8_block_quantize(band, 128)
    assert amax[0] == 1.0 and np.isnan(amax[1]) and np.isnan(scale[1])


def test_to_f32_exact() -> None:
    import torch

    t = torch.randn(64, dtype=torch.float32)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        raw = t.to(dt).view(torch.uint8).numpy()
        got = kernels.to_f32(raw, str(dt).removeprefix("torch."))
        assert np.array_equal(got, t.to(dt).to(torch.float32).numpy())
