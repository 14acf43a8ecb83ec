"""The column-backed storage mapping (:mod:`ckpttool.format.mdstorage`) against a plain dict of the same records."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import pytest

from ckpttool.engine import native
from ckpttool.format import mdcache
from ckpttool.format.mdstorage import (
    DuplicateKeys,
    StorageTable,
    bounds,
    chunk_path_columns,
    chunk_paths,
    compact,
    file_extents,
    int64s,
    key_ids,
    record_end,
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
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setenv("CKPTTOOL_NATIVE", "0")
    native.lib.cache_clear()  # the loaded library is cached: read the setting again
    if request.param == "python":
        assert native.lib() is None
    yield str(request.param)
    monkeypatch.undo()
    native.lib.cache_clear()


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
    # "w" under a second string id, with a record of another chunk: a lookup by "w" would miss one of them
    cols = [array("q", c) for c in zip(*ROWS, (7, 3, 2, 500, 1, 0))]
    with pytest.raises(DuplicateKeys):
        StorageTable([*STRINGS, "w"], TUPLES, DESCRIPTORS, *cols)


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


def _columns(values: list[int]) -> list[Sequence[int]]:
    """``values`` as every kind of column the helpers take: int64 views (contiguous, strided), arrays, a list."""
    flat = memoryview(array("q", values).tobytes()).cast("q")  # read-only, as a cache entry's views
    spread = memoryview(array("q", [v for v in values for _ in range(3)]).tobytes()).cast("q")[1::3]
    cols: list[Sequence[int]] = [flat, spread, array("q", values), list(values)]
    if all(-(2**31) <= v < 2**31 for v in values):
        cols.append(array("i", values))
    return cols


@pytest.mark.parametrize(
    "values",
    [
        [5],
        [3, -1, 7, 0],
        [2**63 - 1, -(2**63), 0],
        [2**31, 2**31 - 1, -(2**31)],
        list(range(1000, -1000, -7)),
        [(i * 7919) % 300007 - 150000 for i in range(200_000)],  # more than one block of the kernels' copies
    ],
)
def test_column_helpers_give_what_the_builtins_give(kernels: str, values: list[int]) -> None:
    for col in _columns(values):
        assert bounds(col) == (min(values), max(values))
        assert int64s(col) == array("q", values) and int64s(col).typecode == "q"
        if all(-(2**31) <= v < 2**31 for v in values):
            assert compact(col) == array("i", values)
        else:
            with pytest.raises(OverflowError):
                compact(col)
    with pytest.raises(ValueError):
        bounds(array("q"))


@pytest.mark.parametrize(
    ("offset", "length", "end"),
    [
        ([], [], 0),
        ([0, 64, 8], [64, 0, 100], 108),
        ([2**62, 5], [2**62 - 1, 1], 2**63 - 1),
        ([0, -1], [4, 4], -1),
        ([0, 4], [4, -4], -1),
        ([i % 1000 for i in range(150_000)], [(i * 31) % 977 for i in range(150_000)], 1974),
        ([0] * 140_000 + [-1], [1] * 140_001, -1),  # in the last block
    ],
)
def test_record_end_is_the_end_of_the_farthest_record(
    kernels: str, offset: list[int], length: list[int], end: int
) -> None:
    for off, n in zip(_columns(offset) if offset else [array("q")], _columns(length) if length else [array("q")]):
        assert record_end(off, n) == end
    with pytest.raises(ValueError):
        record_end(array("q", [1]), array("q"))


def test_path_columns_are_the_chunk_paths_of_each_offsets_tuple(kernels: str) -> None:
    rows = ROWS + BIG
    fqns = ["w", "b", "big", "nope", "opt", "w"]
    offsets = [(0, 0), (4, 0), (0,), (2,), (3,), None, (9, 9)]
    for storage in (_table(rows), _dict(rows)):
        cols = [list(c) for c in chunk_path_columns(storage, fqns, offsets)]
        assert cols == [list(chunk_paths(_dict(rows), fqns, [o] * len(fqns))) for o in offsets]
        assert cols[0] == ["__0_0.distcp", None, "__0_0.distcp", None, None, "__0_0.distcp"]  # big: (0, 0) in BIG
        assert [list(c) for c in chunk_path_columns(storage, [], offsets)] == [[]] * len(offsets)


def test_string_id_hints_find_what_the_strings_find(kernels: str) -> None:
    rows = ROWS + BIG
    table = _table(rows)
    keys = [*_dict(rows), ("w", (8, 0)), ("nope", None)]
    fqns, offsets = [k[0] for k in keys], [k[1] for k in keys]
    plain = list(table.rows(fqns, offsets))
    ids = [STRINGS.index(f) if f in STRINGS else -1 for f in fqns]
    assert list(table.rows(fqns, offsets, ids)) == plain
    # a hint naming an id with no records (a data file's name, -1, out of range: the fqn's string under an id
    # no record uses): looked up by the string
    wrong = [2, -1, len(STRINGS) + 5, 3, 2, 5, -1, 2, 5, -1, 2][: len(fqns)]
    assert list(table.rows(fqns, offsets, wrong)) == plain
    assert [list(c) for c in chunk_path_columns(table, fqns, offsets, wrong)] == [
        list(chunk_paths(table, fqns, [o] * len(fqns))) for o in offsets
    ]
    entries = dict.fromkeys(STRINGS)
    assert key_ids(table, entries) is None and key_ids(_dict(rows), entries) is None
    table.hold_key_ids(entries, array("i", range(len(STRINGS))))
    assert list(key_ids(table, entries) or ()) == list(range(len(STRINGS)))
    assert key_ids(table, dict(entries)) is None  # another dict: not the one the ids are of
