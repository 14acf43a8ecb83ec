"""A pickle's ``BUILD`` on an allowed global itself (not on an object built from it).

ckpttool's allow-list unpicklers resolve a global to a stand-in of its own (``pathlib.PosixPath`` -> a function,
``torch.distributed.checkpoint.metadata.Metadata`` -> a record class). Pickle's ``BUILD`` on the pushed global with a
``(None, {name: value})`` state would ``setattr`` on that function or class, for the rest of the process: every later
file read by it. Megatron-LM's ``common.pt`` (its ``args`` stand-ins) and ``.metadata`` are refused instead, the
global untouched. torch's own weights-only unpickler refuses the same ``BUILD``; nothing is ever imported or run.
"""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest

from ckpttool.errors import CkptError
from ckpttool.format import unpickler
from ckpttool.format.reader import load_saved_object
from ckpttool.format.unpickler import parse_metadata_bytes, path_stand_in
from ckpttool.model.schemas.megatron import _common_globals, parse_common
from tests.fixtures.hostile import torch_members, zip_bytes


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _set_on_global(module: str, name: str, attr: str, value: object) -> bytes:
    """PROTO 2, GLOBAL, BUILD (None, {attr: value}) on the global itself, POP, EMPTY_DICT, STOP."""
    slot = pickle.dumps({attr: value}, 2)[2:-1]
    return b"\x80\x02" + _global(module, name) + b"N" + slot + b"\x86b0}."


def _common_pt(pkl: bytes) -> bytes:
    """A real ``torch.save`` archive (Megatron's ``common.pt`` is one) whose ``data.pkl`` is ``pkl``."""
    import torch

    buf = io.BytesIO()
    torch.save({"iteration": 1}, buf)
    members = torch_members(buf.getvalue())
    return zip_bytes([dataclasses.replace(m, payload=pkl) if m.name.endswith("/data.pkl") else m for m in members])


def test_common_pt_build_on_path_global_is_refused_and_leaves_it_unchanged() -> None:
    name = path_stand_in.__name__
    with pytest.raises(CkptError) as e:
        parse_common(_common_pt(_set_on_global("pathlib", "PosixPath", "__name__", "changed")), "common.pt")
    assert e.value.code in ("E201", "E301", "E304"), e.value
    assert path_stand_in.__name__ == name
    # a clean common.pt read afterwards still gets its path as a plain string
    clean = (
        b"\x80\x02}X\x04\x00\x00\x00save"
        + _global("pathlib", "PosixPath")
        + b"X\x02\x00\x00\x00/cX\x01\x00\x00\x00k\x86Rs."
    )
    assert load_saved_object(_common_pt(clean), "common.pt", plain_globals=_common_globals()) == {"save": "/c/k"}


def test_metadata_build_on_record_class_is_refused_and_leaves_it_unchanged() -> None:
    pkl = _set_on_global("torch.distributed.checkpoint.metadata", "Metadata", "storage_data", {"x": 1})
    with pytest.raises(CkptError, match="BUILD on a global"):
        parse_metadata_bytes(pkl, ".metadata")
    assert "storage_data" not in vars(unpickler._Metadata)
