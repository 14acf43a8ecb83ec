"""The native FP32 -> BF16 / FP16 casts vs the numpy path and torch's ``Tensor.to``, bit for bit.

Inputs: every float32 upper half with low halves at the rounding edges, the float16 subnormal
and overflow boundaries, random patterns, both signs; odd lengths leave tails after the AVX2
loops. NaNs must come out as the numpy path writes them (BF16 with and without
``canonical_nan``); torch agrees on every other value. The portable C loops give the same bytes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from ckpttool.engine import kernels, native

pytestmark = pytest.mark.skipif(
    native.function("ckpt_f32_to_bf16", None) is None, reason="native kernels not built or CKPTTOOL_NATIVE=0"
)

_LOW = np.array([0, 0x0FFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)


def _patterns() -> np.ndarray:
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    edges = (hi[:, None] | _LOW[None, :]).reshape(-1)
    subnormal = np.arange(0x33000000 - 64, 0x38800000 + 64, 4099, dtype=np.uint32)  # float16 subnormals
    overflow = np.arange(0x477FE000, 0x47801000, 3, dtype=np.uint32)  # around 65504 / 65520
    rand = np.random.default_rng(3).integers(0, 2**32, 100_003, dtype=np.uint64).astype(np.uint32)
    u = np.concatenate([edges, subnormal, overflow, rand])
    return np.concatenate([u, u | np.uint32(0x80000000)])[:-3]  # odd length: a tail after the vector loops


def _c(name: str, *extra: Any) -> Any:
    return native.function(name, None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, *extra)


@pytest.mark.parametrize("canonical_nan", [True, False])
def test_bf16_native_equals_numpy_and_torch(canonical_nan: bool) -> None:
    u = _patterns()
    got, numpy_out, portable = (np.empty(u.size, np.uint16) for _ in range(3))
    kernels.f32_to_bf16(u, got, canonical_nan=canonical_nan)  # native where built
    kernels.f32_to_bf16(u, numpy_out, canonical_nan=canonical_nan, use_torch=False)
    _c("ckpt_f32_to_bf16_portable", ctypes.c_int32)(u.ctypes.data, portable.ctypes.data, u.size, int(canonical_nan))
    np.testing.assert_array_equal(got, numpy_out)
    np.testing.assert_array_equal(portable, numpy_out)
    f = u.view(np.float32)
    ref = torch.from_numpy(f.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    ok = ~np.isnan(f)
    np.testing.assert_array_equal(got[ok], ref[ok])


def test_f16_native_equals_numpy_and_torch() -> None:
    u = _patterns()
    f = u.view(np.float32)
    got, numpy_out, portable = (np.empty(u.size, np.float16) for _ in range(3))
    kernels.f32_to_f16(f, got)  # native where built
    kernels.f32_to_f16(f, numpy_out, use_native=False)
    _c("ckpt_f32_to_f16_portable")(u.ctypes.data, portable.ctypes.data, u.size)
    np.testing.assert_array_equal(got.view(np.uint16), numpy_out.view(np.uint16))
    np.testing.assert_array_equal(portable.view(np.uint16), numpy_out.view(np.uint16))
    ref = torch.from_numpy(f.copy()).to(torch.float16).numpy().view(np.uint16)
    ok = ~np.isnan(f)
    np.testing.assert_array_equal(got.view(np.uint16)[ok], ref[ok])
    assert np.isnan(got[~ok]).all()


def test_strided_slabs_take_the_numpy_path() -> None:
    u = _patterns()[: 2 * 1001]
    strided = u[::2]
    out, ref = np.empty(strided.size, np.uint16), np.empty(strided.size, np.uint16)
    kernels.f32_to_bf16(strided, out)
    kernels.f32_to_bf16(np.ascontiguousarray(strided), ref, use_torch=False)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("path", ["native", "portable", "numpy", "torch"])
def test_bf16_overflow_flag_is_raised_where_torch_makes_a_finite_value_infinite(path: str) -> None:
    """The FP32 -> BF16 cast's flag is raised whenever torch's ``to`` turns a finite value into infinity: each
    overflowing pattern (0x7F7F8000..0x7F7FFFFF, both signs) alone, at every lane of two 16-wide AVX2 steps and in
    the scalar tail; never where every value stays finite (float32 0x7F7F7FFF rounds to bfloat16's largest). The
    native flag (a running maximum) is also raised by a stored infinity or NaN, the exact paths are not; the
    bytes are the cast's either way."""
    finite = np.array([0x7F7F7FFF, 0xFF7F7FFF, 0, 0x80000000, 0x3F800000, 0x00000001, 0x7F000000] * 6, np.uint32)[:37]

    def flag(u: np.ndarray) -> bool:
        out = np.empty(u.size, np.uint16)
        if path == "portable":
            fn = native.function(
                "ckpt_f32_to_bf16_portable", ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64
            )
            got = bool(fn(u.ctypes.data, out.ctypes.data, u.size, 1))
        else:
            got = kernels.f32_to_bf16(u, out, use_torch={"native": None, "numpy": False, "torch": True}[path])
        want = torch.from_numpy(u.view(np.float32).copy()).to(torch.bfloat16).view(torch.int16).numpy()
        ok = ~np.isnan(u.view(np.float32))
        np.testing.assert_array_equal(out[ok], want.view(np.uint16)[ok])
        return got

    def torchs(u: np.ndarray) -> bool:
        f = torch.from_numpy(u.view(np.float32).copy())
        return bool((torch.isfinite(f) & torch.isinf(f.to(torch.bfloat16))).any())

    assert not flag(finite) and not torchs(finite)
    for stored in (0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001):
        u = finite.copy()
        u[3] = stored
        assert flag(u) == (path in ("native", "portable")) and not torchs(u), hex(stored)
    for bits in (0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0xFF7FC000):
        for at in range(finite.size):
            u = finite.copy()
            u[at] = bits
            assert flag(u) and torchs(u), (hex(bits), at)
