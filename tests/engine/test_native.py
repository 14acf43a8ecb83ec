"""The optional native kernels: built wherever a C compiler is (so CI exercises them), and switchable off."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from ckpttool.engine import native


def test_built_where_a_compiler_is_present() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the extension is optional and the numpy/torch kernels run")
    if os.environ.get("CKPTTOOL_NATIVE", "1") == "0":
        pytest.skip("CKPTTOOL_NATIVE=0")
    assert native.lib() is not None, "ckpttool.engine._native was not built: run `python setup.py build_ext --inplace`"
    abi = native.function("ckpt_native_abi", ctypes.c_int32)
    assert abi() == native.ABI
    assert native.function("no_such_kernel", None) is None


def test_turned_off_by_the_environment() -> None:
    code = "from ckpttool.engine import native; print(native.lib() is None, native.function('ckpt_native_abi', None) is None)"
    env = {**os.environ, "CKPTTOOL_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]
