"""The optional native kernels: plain C functions in ``ckpttool/engine/native/*.c``, called via ctypes.

Built by ``pip install`` (``setup.py``, an optional extension: no compiler, no build, no error) or
``python setup.py build_ext --inplace`` in a source tree. Each caller keeps its numpy/torch kernel as
the fallback and must produce the same bytes with either. ctypes releases the GIL for every call,
so the engine's pool threads run kernels in parallel. ``CKPTTOOL_NATIVE=0`` turns them off (tests
compare both paths). ``docs/design.md`` §5, "The byte engine".
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import cache
from typing import Any

__all__ = ["ABI", "function", "lib"]

#: the ABI version this Python side expects from ``ckpt_native_abi()``
ABI = 11


@cache
def lib() -> ctypes.CDLL | None:
    """The loaded shared object, or ``None`` when not built, stale, or turned off by ``CKPTTOOL_NATIVE=0``."""
    if os.environ.get("CKPTTOOL_NATIVE", "1") == "0":
        return None
    spec = importlib.util.find_spec("ckpttool.engine._native")
    if spec is None or not spec.origin:
        return None
    try:
        so = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    abi = getattr(so, "ckpt_native_abi", None)
    if abi is None:  # a foreign or older build: the numpy/torch kernels run
        return None
    abi.restype = ctypes.c_int32
    return so if abi() == ABI else None


def function(name: str, restype: Any, *argtypes: Any) -> Any:
    """The C function ``name`` with its ctypes signature, or ``None`` where the kernels are unavailable.

    Pointers are passed as ``ctypes.c_void_p`` (``ndarray.ctypes.data``, ``Tensor.data_ptr()``),
    sizes as ``ctypes.c_size_t``/``c_int64``.
    """
    so = lib()
    if so is None:
        return None
    fn = getattr(so, name, None)
    if fn is None:
        return None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn
