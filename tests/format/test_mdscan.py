"""The native column reader of ``.metadata`` (ckpttool.format.mdscan) against the allow-list unpickler and torch.

The property: whenever the column reader returns metadata, it equals what the unpickler path returns
for the same bytes (which itself equals torch's ``read_metadata``, tests/format/test_metadata_parse.py);
on anything else it returns ``None`` and the unpickler decides (its result or its message).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from ckpttool.engine import native
from ckpttool.errors import CkptError
from ckpttool.format.mdscan import scan_metadata
from ckpttool.format.unpickler import _convert, _unpickle, parse_metadata_bytes

pytestmark = pytest.mark.skipif(native.function("ckpt_mdscan", None) is None, reason="native kernels not built")


def _unpickled(data: bytes) -> Any:
    """The unpickler path's result for ``data``, or the error it raises."""
    try:
        return _convert(_unpickle(data, ".metadata"), ".metadata")
    except CkptError as e:
        return e


def _parsed(data: bytes) -> Any:
    """``parse_metadata_bytes(data)``: its result, or the error it raises."""
    try:
        return parse_metadata_bytes(data)
    except CkptError as e:
        return e


def _parsed_without_kernels(data: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    """:func:`_parsed` with ``CKPTTOOL_NATIVE=0`` (no column reader: the unpickler path only)."""
    with monkeypatch.context() as m:
        m.setenv("CKPTTOOL_NATIVE", "0")
        native.lib.cache_clear()
        try:
            return _parsed(data)
        finally:
            native.lib.cache_clear()


def _agrees(data: bytes) -> bool:
    """The column reader declines ``data`` or gives the unpickler path's result; True when it took it."""
    ours = scan_metadata(data, ".metadata")
    if ours is None:
        return False
    ref = _unpickled(data)
    assert not isinstance(ref, Exception), f"column reader accepted what the unpickler refuses: {ref}"
    assert ours == ref
    assert list(ours.entries) == list(ref.entries) and list(ours.storage) == list(ref.storage)
    return True


@pytest.mark.parametrize("fixture", ["fsdp_ckpt", "multi_optim_ckpt", "sample_ckpt", "ep_suite"])
def test_real_saves_are_read_by_columns(fixture: str, request: pytest.FixtureRequest) -> None:
    root: Path = request.getfixturevalue(fixture)
    files = sorted(root.rglob(".metadata"))
    assert files
    for f in files:
        assert _agrees(f.read_bytes()), f  # torch's own saves: the column reader takes every one


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_protocol_from_2(protocol: int, fsdp_ckpt: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(fsdp_ckpt)).read_metadata()
    assert _agrees(pickle.dumps(md, protocol=protocol))


def test_byte_flips_truncations_and_splices_agree(fsdp_ckpt: Path) -> None:
    """Damaged streams: declined, or read exactly as the unpickler reads them (never accepted where it refuses)."""
    base = (fsdp_ckpt / ".metadata").read_bytes()
    rng = random.Random(30)
    taken = 0
    for _ in range(400):
        data = bytearray(base)
        kind = rng.randrange(4)
        if kind == 0:
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            del data[rng.randrange(len(data)) :]
        elif kind == 2:
            i, j = sorted(rng.sample(range(len(data)), 2))
            data[i:i] = data[i:j]
        else:
            i = rng.randrange(len(data))
            data[i] = rng.choice(b"hjqr\x94\x85\x86\x87tue(a)\x81bR.N\x88}]")
        taken += _agrees(bytes(data))
    assert taken  # some damaged streams are still well-formed metadata


def test_record_class_called_or_unknown_global_falls_back() -> None:
    """Streams the unpickler refuses by name are declined, so its message is the one shown."""
    from torch.distributed.checkpoint.metadata import Metadata

    good = pickle.dumps(Metadata(state_dict_metadata={}), protocol=4)
    assert _agrees(good)
    evil = good.replace(b"Metadata\x94", b"Metadatb\x94", 1)
    assert scan_metadata(evil, ".metadata") is None
    with pytest.raises(CkptError, match="not on the allow-list"):
        parse_metadata_bytes(evil)
