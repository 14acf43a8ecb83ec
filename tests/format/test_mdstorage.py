"""The column-backed storage mapping (:mod:`ckpttool.format.mdstorage`) against a plain dict of the same records."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest

from ckpttool.format import mdcache
from ckpttool.format.mdstorage import (
    DuplicateKeys,
    StorageTable,
    chunk_paths,
    file_extents,
    referenced_paths,
    storage_infos,
)
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta

STRINGS = ["w", "b", "__0_0.distcp", "__1_0.distcp", "opt", "zstd", "big"]
TUPLES = [(0, 0), (4, 0), (0,), (2,)]
# fqn, tuple (-1: a byte item), path, offset, length, descriptors; file order (the fqns interleaved as ranks write)
ROWS = [
    (0, 0, 2, 0, 64, 0),
    (1, 2, 2, 64, 16, 0),
    (0, 1, 3, 0, 64, 1),
    (4, -1, 3, 64, 0, 0),
    (1, 3, 3, 64, 16, 0),
]
# a group larger than the linear search, its rows not in tuple order
BIG = [(6, t, 2, 100 + t, 1, 0) for t in (3, 0, 2, 1)]
DESCRIPTORS = [(), ("zstd",)]


def _table(rows: Sequence[tuple[int, ...]]) -> StorageTable:
    cols = [array("q", c) for c in zip(*rows)]
    return StorageTable(STRINGS, TUPLES, DESCRIPTORS, *cols)


def _dict(rows: Sequence[tuple[int, ...]]) -> dict[tuple[str, tuple[int, ...] | None], StorageInfo]:
    return {
        (STRINGS[f], TUPLES[t] if t >= 0 else None): StorageInfo(STRINGS[p], o, n, DESCRIPTORS[d])
        for f, t, p, o, n, d in rows
    }


@pytest.fixture(params=["native", "python"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setenv("CKPTTOOL_NATIVE", "0")
    return str(request.param)


def test_table_reads_as_the_dict_of_its_records(kernels: str) -> None:
    rows = ROWS + BIG
    table, ref = _table(rows), _dict(rows)
    assert list(table) == list(ref) and list(table.values()) == list(ref.values())
    assert list(table.items()) == list(ref.items()) and len(table) == len(ref)
    assert table == ref and ref == table and dict(table) == ref
    for key, info in ref.items():
        assert table[key] == info and table.get(key) == info and key in table
    for absent in [("w", (0, 1)), ("w", None), ("x", (0, 0)), ("opt", (0,)), ("big", (9,))]:
        assert table.get(absent) is None and absent not in table
        with pytest.raises(KeyError):
            table[absent]
    keys = [*ref, ("w", (8, 0)), ("nope", None)]
    fqns, offsets = [k[0] for k in keys], [k[1] for k in keys]
    assert list(chunk_paths(table, fqns, offsets)) == list(chunk_paths(ref, fqns, offsets))
    assert storage_infos(table, fqns, offsets) == storage_infos(ref, fqns, offsets) == [*ref.values(), None, None]
    present = list(ref)
    assert storage_infos(table, [k[0] for k in present], [k[1] for k in present]) == list(ref.values())
    assert referenced_paths(table) == referenced_paths(ref) == {"__0_0.distcp", "__1_0.distcp"}
    assert list(file_extents(table).items()) == list(file_extents(ref).items())
    assert table.has_transforms()


def test_a_key_given_twice_or_an_id_out_of_range_is_refused(kernels: str) -> None:
    with pytest.raises(DuplicateKeys):
        _table([*ROWS, (0, 1, 2, 500, 64, 0)])
    with pytest.raises(DuplicateKeys):
        _table([*ROWS, (4, -1, 2, 500, 1, 0)])
    for bad in [(7, 0, 2, 0, 1, 0), (0, 4, 2, 0, 1, 0), (0, -2, 2, 0, 1, 0)]:
        with pytest.raises(ValueError):
            _table([*ROWS, bad])


def test_cache_entry_of_a_table_decodes_to_the_same_records(kernels: str) -> None:
    layout = TensorMeta(DType("float32"), (8, 4), (ChunkMeta((0, 0), (4, 4)), ChunkMeta((4, 0), (4, 4))))
    vec = TensorMeta(DType("float32"), (4,), (ChunkMeta((0,), (2,)), ChunkMeta((2,), (2,))))
    entries: dict[str, TensorMeta | BytesMeta] = {
        "w": layout,
        "b": vec,
        "opt": BytesMeta(),
        "big": TensorMeta(DType("int8"), (4,), ()),
    }
    for storage in (_table(ROWS + BIG), _dict(ROWS + BIG)):
        md = CheckpointMetadata(entries=entries, storage=storage, version="1.0.0")
        blob = mdcache.encode(md, "0" * 64, 123)
        back = mdcache.decode(blob, "0" * 64, 123)
        assert isinstance(back.storage, StorageTable)
        assert back == md and list(back.storage.items()) == list(_dict(ROWS + BIG).items())
        assert mdcache.decode(mdcache.encode(back, "0" * 64, 123), "0" * 64, 123) == md
