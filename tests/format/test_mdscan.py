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


def _op_str(x: str) -> bytes:
    b = x.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


_DCP = "torch.distributed.checkpoint.metadata"


def _shared_chunks_list(tensors: int, chunks: int) -> bytes:
    """A protocol-2 ``Metadata`` whose ``tensors`` entries all reference one memoized list of ``chunks`` references
    to one chunk record: ~2 bytes per chunk and ~30 per tensor for ``tensors x chunks`` chunk rows."""
    p = b"\x80\x02" + _op_global(_DCP, "ChunkStorageMetadata") + b"q\x00"
    p += _op_global(_DCP, "TensorStorageMetadata") + b"q\x02" + _op_global(_DCP, "TensorProperties") + b"q\x03"
    p += b"h\x03)\x81" + _op_global("torch", "float32") + b"\x85bq\x04"  # TensorProperties(float32), memo 4
    p += b"K\x01\x85q\x06K\x00\x85q\x07"  # (1,) memo 6, (0,) memo 7
    p += _op_global(_DCP, "Metadata") + b")\x81}(" + _op_str("state_dict_metadata") + b"}("
    chunk = b"h\x00)\x81}(" + _op_str("offsets") + b"h\x07" + _op_str("sizes") + b"h\x06ubq\x01"
    for i in range(tensors):
        p += _op_str(f"k{i}") + b"h\x02)\x81}(" + _op_str("properties") + b"h\x04" + _op_str("size") + b"h\x06"
        p += _op_str("chunks") + ((b"]q\x05(" + chunk + b"h\x01" * (chunks - 1) + b"e") if i == 0 else b"h\x05") + b"ub"
    return p + b"uub."


def _shared_planner_paths(keys: int) -> bytes:
    """A ``Metadata`` with no entries whose ``planner_data`` references one key and one 64-item tuple ``keys`` times."""
    p = b"\x80\x02" + _op_global(_DCP, "Metadata") + b")\x81}(" + _op_str("state_dict_metadata") + b"}"
    p += _op_str("planner_data") + b"}(" + _op_str("k") + b"q\x00(" + b"K\x01" * 64 + b"tq\x01"
    return p + b"h\x00h\x01" * (keys - 1) + b"uub."


def test_shared_references_that_multiply_rows_are_declined(monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunks list shared by many tensors, one planner key and tuple referenced again and again: a few bytes
    that would be millions of column rows are declined, and the unpickler path decides (the same result)."""
    small = _shared_chunks_list(3, 4)
    assert scan_metadata(small, ".metadata") is None
    assert _parsed(small) == _parsed_without_kernels(small, monkeypatch)
    assert len(_parsed(small).entries) == 3
    many = _shared_chunks_list(200, 5000)  # 1,000,000 chunk rows from ~11 KB
    assert len(many) < 20_000 and scan_metadata(many, ".metadata") is None
    planner = _shared_planner_paths(20_000)  # 1,280,000 path-item rows from 80 KB
    assert scan_metadata(planner, ".metadata") is None
    assert _parsed(planner) == _parsed_without_kernels(planner, monkeypatch)


def _metadata_pickle(entries: dict[str, Any], planner: dict[str, Any] | None = None) -> bytes:
    from torch.distributed.checkpoint.metadata import Metadata

    return pickle.dumps(Metadata(state_dict_metadata=entries, planner_data=planner or {}), protocol=4)


def _tensor(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
    )


def test_repeated_key_and_chunk_outside_its_tensor_are_declined(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key given twice (equal bytes, two string objects) and a chunk past its tensor's end: the kernel declines
    both, and the unpickler path decides (the later value for the key; the message for the chunk)."""
    data = _metadata_pickle({"k0": _tensor([4], [([0], [4])]), "k1": _tensor([2, 2], [([0, 0], [2, 2])])})
    twice = data.replace(_op_str("k1"), _op_str("k0"), 1)
    assert twice != data and scan_metadata(twice, ".metadata") is None
    assert _parsed(twice) == _parsed_without_kernels(twice, monkeypatch)
    assert list(_parsed(twice).entries) == ["k0"]
    outside = _metadata_pickle({"k0": _tensor([4, 2], [([0, 0], [4, 2]), ([2, 0], [4, 2])])})
    assert scan_metadata(outside, ".metadata") is None
    ref = _parsed_without_kernels(outside, monkeypatch)
    assert isinstance(ref, CkptError) and str(_parsed(outside)) == str(ref)
    big = 2**62  # offset + size = 2^63: past int64, still outside the tensor
    wrapped = _metadata_pickle({"k0": _tensor([4], [([big], [big])])})
    assert scan_metadata(wrapped, ".metadata") is None
    ref = _parsed_without_kernels(wrapped, monkeypatch)
    assert isinstance(ref, CkptError) and str(_parsed(wrapped)) == str(ref)


def test_values_past_the_packed_cells_agree() -> None:
    """Values the kernel cannot pack into 8-byte cells (ints past 2^58 in a record's fields and in a path tuple,
    negative ints beside strings) are kept exactly: the unpickler path's values, not a decline."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    entries = {"k0": _tensor([4], [([0], [4])]), "k1": _tensor([2], [([0], [2])])}
    storage = {
        MetadataIndex("k0", torch.Size([0])): _StorageInfo("__0_0.distcp", 2**62, 16),
        MetadataIndex("k1", torch.Size([0])): _StorageInfo("__1_0.distcp", 2**58 - 1, 2**60),
    }
    planner = {"k0": ("m", 2**62, -(2**61)), "k1": ("n", -1, 2**58)}
    data = pickle.dumps(Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage), protocol=4)
    assert _agrees(data)


def test_shapes_of_every_rank_and_int_paths_agree() -> None:
    """Shapes interned by the kernel (0-d, 1-d, up to 64 dims, shared and repeated objects), planner paths of ints
    only and of mixed items: the unpickler path's values."""
    size = [1] * 64
    entries = {
        "scalar": _tensor([], [([], [])]),
        "vec": _tensor([6], [([0], [3]), ([3], [3])]),
        "deep": _tensor(size, [([0] * 64, size)]),
        "empty": _tensor([0, 5], [([0, 0], [0, 5])]),
    }
    planner = {"scalar": (0, 1), "vec": ("m", 0, "w"), "deep": (2**62,), "empty": ("e",)}
    assert _agrees(_metadata_pickle(entries, planner))
