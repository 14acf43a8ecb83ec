"""The column-wise paths of the catalog and the schema give what the per-key definitions give."""

from __future__ import annotations

import random

import pytest

from ckpttool.format import mdcache
from ckpttool.format.mdstorage import StorageTable, key_ids
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta
from ckpttool.model.catalog import TensorEntry, _EntryBuilder, _fqns_of
from ckpttool.model.schemas.detect import planner_paths
from ckpttool.model.schemas.keyschema import KeySchema, model_head

_LAYOUTS = (
    TensorMeta(DType("bfloat16"), (4, 16), (ChunkMeta((0, 0), (4, 16)),)),
    TensorMeta(DType("float32"), (8,), (ChunkMeta((0,), (4,)), ChunkMeta((4,), (4,)))),
    TensorMeta(DType("int64"), (0,), ()),
    TensorMeta(DType("float32"), (6,), (ChunkMeta((0,), (2,)), ChunkMeta((2,), (2,)), ChunkMeta((4,), (2,)))),
)


def _expected_entry(
    key: str, meta: TensorMeta, storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo]
) -> tuple:
    """The fields of a TensorEntry, from their definitions (TensorEntry's docstring)."""
    chunk_files = tuple(i.relative_path if (i := storage.get((key, c.offsets))) else None for c in meta.chunks)
    files = tuple(sorted({f for f in chunk_files if f is not None}))
    ranks = tuple(sorted({int(f.split("_")[2]) for f in files}))
    numel = 1
    for d in meta.size:
        numel *= d
    itemsize = {"bfloat16": 2, "float32": 4, "int64": 8}[meta.dtype.name]
    return (key, meta.size, meta.dtype.name, numel, numel * itemsize, meta.chunks, ranks, files, chunk_files)


@pytest.mark.parametrize("seed", range(40))
def test_entries_built_by_columns_are_the_defined_ones(seed: int) -> None:
    rng = random.Random(seed)
    keys = [f"model.layers.{i}.w" for i in range(rng.randint(0, 300))]
    shared = rng.random() < 0.8  # shared layout objects (the cache's decode) or one object per tensor (the unpickler)
    metas = [rng.choice(_LAYOUTS[: rng.randint(1, 4)]) for _ in keys]
    if not shared:
        metas = [TensorMeta(m.dtype, m.size, m.chunks) for m in metas]
    storage = {
        (k, c.offsets): StorageInfo(f"__{rng.randint(0, 3)}_0.distcp", 0, 1)
        for k, m in zip(keys, metas)
        for c in m.chunks
        if rng.random() < 0.9  # some chunks have no record: None in chunk_files
    }
    built = _EntryBuilder(storage).many(keys, metas)
    assert list(built) == keys
    for (key, entry), meta in zip(built.items(), metas):
        assert type(entry) is TensorEntry
        assert tuple(entry) == _expected_entry(key, meta, storage)
        assert entry == _EntryBuilder(storage)(key, meta)  # the one-by-one path
    # a cache hit: the storage as a table, the keys found by their string ids (key_ids) instead of by the strings
    md = CheckpointMetadata(entries=dict(zip(keys, metas)), storage=storage, version="1.0.0")
    back = mdcache.decode(mdcache.encode(md, "0" * 64, 1), "0" * 64, 1)
    ids = key_ids(back.storage, back.entries)
    assert (ids is not None) == isinstance(back.storage, StorageTable) == bool(storage)
    hinted = _EntryBuilder(back.storage).many(list(back.entries), list(back.entries.values()), ids)  # type: ignore[arg-type]
    assert list(hinted.items()) == list(built.items())


@pytest.mark.parametrize("seed", range(20))
def test_model_mask_is_the_model_test(seed: int) -> None:
    rng = random.Random(seed)
    words = ["model", "app", "optimizer", "optim", "layers", "0", "w", "state", "lr_scheduler", ""]
    entries: dict[str, object] = {}
    paths: dict[str, tuple] = {}
    for _ in range(200):
        path = tuple(rng.choice(words + [0, 1]) for _ in range(rng.randint(1, 4)))
        key = ".".join(map(str, path)) if rng.random() < 0.9 else rng.choice(["model.", "model", "app.model."])
        entries[key] = None
        if rng.random() < 0.7:
            paths[key] = path if rng.random() < 0.9 else ("x", key)
    for prefix in (None, "", "model.", "app.model.", "optimizer.", "model.model."):
        for opt in (None, "", "optimizer.", "model.", "app.optim."):
            for use_paths in (True, False):
                sch = KeySchema("x", prefix, opt, _model_head=model_head(prefix or ""), _use_paths=use_paths)
                test = sch.model_test()
                assert list(sch.model_mask(entries, paths)) == [test(k, paths.get(k)) for k in entries]


def test_planner_paths_keeps_exactly_the_paths_that_join_to_their_key() -> None:
    rng = random.Random(0)
    items = ["a", "b", "a.b", 0, 7, (1, 2)]
    planner: dict[str, tuple] = {}
    for i in range(3000):
        path = tuple(rng.choice(items) for _ in range(rng.randint(0, 4)))
        key = ".".join(map(str, path)) if rng.random() < 0.7 else f"k{i}"
        planner[key] = path
    md = CheckpointMetadata({k: BytesMeta() for k in planner}, {}, planner)
    kept = planner_paths(md)
    assert kept == {k: p for k, p in planner.items() if ".".join(map(str, p)) == k}
    assert list(kept) == [k for k in planner if k in kept]


def test_param_fqns_from_planner_paths_are_the_cut_keys() -> None:
    keys = {f"model.layers.{i}.w": None for i in range(50)}
    paths = {k: ("model", k[len("model.") :]) for k in keys}
    assert _fqns_of(keys, "model.", paths) == [k[len("model.") :] for k in keys]
    paths["model.layers.3.w"] = ("model", "layers", "3", "w")  # joins to its key, but not (model, fqn): cut
    assert _fqns_of(keys, "model.", paths) == [k[len("model.") :] for k in keys]
    assert _fqns_of(keys, "", paths) == list(keys)
    app = {f"app.model.{k}": None for k in ("a", "b.c")}
    assert _fqns_of(
        app, "app.model.", {"app.model.a": ("app", "model", "a"), "app.model.b.c": ("app", "model", "b.c")}
    ) == ["a", "b.c"]
