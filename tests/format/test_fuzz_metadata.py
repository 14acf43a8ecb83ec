"""Property-based fuzzing of the safe reader (issue 8, item 3).

Real metadata objects (torch's own ``Metadata`` of the ``sample`` fixture) are
mutated — chunks dropped or duplicated, offsets/sizes/dtypes/paths/lengths
perturbed, types swapped — and pickled again; raw ``.metadata`` and data-file
bytes are flipped, truncated and spliced. Each mutant checkpoint goes through
everything a command does with a checkpoint: open, catalog, the ``inspect``
overview, every tensor read (the export path), every byte item, and the CLI's
``inspect``. The property: nothing but :class:`~ckpttool.errors.CkptError`
escapes, and the CLI answers 0 or 2 with one ``error: [E...]`` line, never E999.

CI runs a small, derandomized budget. A long local fuzz::

    CKPTTOOL_FUZZ_EXAMPLES=5000 CKPTTOOL_FUZZ_SEED=random \\
        python -m pytest tests/test_fuzz_metadata.py -p no:cacheprovider -q

(``CKPTTOOL_FUZZ_SEED=random`` drops ``derandomize`` so every run explores new
inputs; a failure prints the minimal mutant to reproduce it with ``@example``.)
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import CkptError
from ckpttool.format import BytesMeta, CheckpointReader, TensorMeta
from ckpttool.model.catalog import build_catalog
from ckpttool.ops.inspect import inspect
from tests.fixtures import hostile

EXAMPLES = int(os.environ.get("CKPTTOOL_FUZZ_EXAMPLES", "40"))
RANDOM = os.environ.get("CKPTTOOL_FUZZ_SEED") == "random"
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,  # no .hypothesis/ directory in the repository
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
runner = CliRunner()
ERROR_RE = re.compile(r"^error: \[(E\d{3})\] \S")


# --------------------------------------------------------------------------- the property
def exercise(ck: Path) -> None:
    """Do with ``ck`` what the commands do; only :class:`CkptError` may escape any step."""
    try:
        reader = CheckpointReader(ck)
    except CkptError:
        return
    with reader:
        for step in (lambda: build_catalog(reader), lambda: inspect(ck)):
            try:
                step()
            except CkptError:
                pass
        for key, meta in list(reader.metadata.entries.items()):
            try:
                if isinstance(meta, TensorMeta):
                    reader.read_tensor(key)
                elif isinstance(meta, BytesMeta):
                    reader.read_object(key)
            except CkptError:
                pass
    res = runner.invoke(app, ["inspect", str(ck), "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code in (0, 2), (res.exit_code, res.stderr)
    if res.exit_code == 2:
        lines = res.stderr.splitlines()
        m = ERROR_RE.match(lines[0]) if lines else None
        assert m and m.group(1) != "E999" and len(lines) <= 2, res.stderr
    assert "Traceback" not in res.stderr


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, sample_ckpt: Path) -> dict[str, Any]:
    """The sample checkpoint, its torch Metadata and raw bytes (read once)."""
    return {
        "ckpt": sample_ckpt,
        "md": hostile.load_torch_metadata(sample_ckpt),
        "metadata": (sample_ckpt / ".metadata").read_bytes(),
        "data": (sample_ckpt / hostile.DATA_FILE).read_bytes(),
    }


def mutant_dir(
    tmp_path_factory: pytest.TempPathFactory, base: dict[str, Any], metadata: bytes, data: bytes | None = None
) -> Path:
    """A checkpoint directory with the given ``.metadata`` (and data file; default: a hard link of the real one)."""
    ck = tmp_path_factory.mktemp("mutant")
    (ck / ".metadata").write_bytes(metadata)
    if data is None:
        try:
            os.link(base["ckpt"] / hostile.DATA_FILE, ck / hostile.DATA_FILE)
        except OSError:
            shutil.copyfile(base["ckpt"] / hostile.DATA_FILE, ck / hostile.DATA_FILE)
    else:
        (ck / hostile.DATA_FILE).write_bytes(data)
    return ck


# --------------------------------------------------------------------------- structured mutations
INTS = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**63), -1, 2**31, 2**62, 2**63, 10**15]))
ODD_VALUES = st.sampled_from([None, "float32", 1.5, True, (), [], {}, b"x", (1, "a"), [0, 0], {"a": 1}])
PATHS = st.sampled_from(
    [
        "",
        "../outside.distcp",
        "/etc/passwd",
        "__9_9.distcp",
        "a\x00b",
        ".",
        "..",
        "extra_state",
        "__0_0.distcp/..",
        "./__0_0.distcp",
        "\udcff.distcp",
    ]
)


def _size_like(draw: Any, n: int) -> Any:
    import torch

    dims = draw(
        st.lists(
            st.one_of(INTS, st.sampled_from([1.0, 0.0, True, False, "1", None])), min_size=max(0, n - 1), max_size=n + 1
        )
    )
    if all(type(d) is int and d >= 0 for d in dims):
        return torch.Size(dims)
    return tuple(dims)  # what a foreign writer could pickle where torch writes a torch.Size


@st.composite
def metadata_mutation(draw: Any) -> list[tuple[str, Any]]:
    """1-3 edits, each ``(kind, parameters)``, applied by :func:`apply_mutation`."""
    kinds = [
        "drop_chunk",
        "dup_chunk",
        "chunk_offsets",
        "chunk_sizes",
        "size",
        "dtype",
        "storage_offset",
        "storage_length",
        "relative_path",
        "transform",
        "swap_entry",
        "swap_chunks",
        "drop_storage",
        "nonstr_key",
        "swap_storage",
        "planner",
        "drop_entry",
    ]
    return draw(st.lists(st.tuples(st.sampled_from(kinds), st.integers(0, 10**6), st.data()), min_size=1, max_size=3))


def apply_mutation(md: Any, edits: list[tuple[str, int, Any]]) -> Any:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    md = copy.deepcopy(md)
    keys = list(md.state_dict_metadata)
    tensors = [k for k in keys if hasattr(md.state_dict_metadata[k], "chunks")]
    for kind, pick, data in edits:
        key = tensors[pick % len(tensors)]
        tsm = md.state_dict_metadata.get(key)
        tsm = tsm if isinstance(tsm, TensorStorageMetadata) else None  # an earlier edit may have swapped it
        chunks = getattr(tsm, "chunks", None)
        idx = [i for i in md.storage_data if i.fqn == key] or list(md.storage_data)
        sidx = idx[pick % len(idx)]
        info = md.storage_data.get(sidx)
        info = info if isinstance(info, _StorageInfo) else None
        if kind == "drop_chunk" and isinstance(chunks, list) and chunks:
            chunks.pop(pick % len(chunks))
        elif kind == "dup_chunk" and isinstance(chunks, list) and chunks:
            chunks.append(copy.deepcopy(chunks[pick % len(chunks)]))
        elif kind in ("chunk_offsets", "chunk_sizes") and isinstance(chunks, list) and chunks:
            c = chunks[pick % len(chunks)]
            if not hasattr(c, "offsets"):
                continue
            setattr(c, "offsets" if kind == "chunk_offsets" else "sizes", _size_like(data.draw, len(tsm.size)))
        elif kind == "size" and tsm is not None:
            tsm.size = _size_like(data.draw, len(tsm.size))
        elif kind == "dtype" and tsm is not None:
            choice = data.draw(
                st.one_of(
                    st.sampled_from(
                        [torch.float16, torch.int8, torch.bool, torch.float64, torch.complex64, torch.uint8]
                    ),
                    ODD_VALUES,
                )
            )
            tsm.properties.dtype = choice
        elif kind == "storage_offset" and info is not None:
            info.offset = data.draw(INTS)
        elif kind == "storage_length" and info is not None:
            info.length = data.draw(INTS)
        elif kind == "relative_path" and info is not None:
            info.relative_path = data.draw(PATHS)
        elif kind == "transform" and info is not None:
            info.transform_descriptors = data.draw(
                st.one_of(ODD_VALUES, st.lists(st.sampled_from(["", "zstd", "rot13-unknown", "\x00"]), max_size=2))
            )
        elif kind == "swap_entry":
            md.state_dict_metadata[key] = data.draw(st.one_of(ODD_VALUES, st.just(BytesStorageMetadata())))
        elif kind == "swap_chunks" and tsm is not None:
            tsm.chunks = data.draw(st.one_of(ODD_VALUES, st.just(tuple(chunks) if isinstance(chunks, list) else ())))
        elif kind == "drop_storage":
            md.storage_data.pop(sidx, None)
        elif kind == "nonstr_key":
            md.state_dict_metadata[data.draw(st.sampled_from([1, (1,), None, 2.5, b"k"]))] = tsm
        elif kind == "swap_storage":
            md.storage_data[sidx] = data.draw(ODD_VALUES)
        elif kind == "planner":
            md.planner_data = data.draw(st.one_of(ODD_VALUES, st.just({key: ("optimizer", "state", 1, 2)})))
        elif kind == "drop_entry":
            md.state_dict_metadata.pop(key, None)
    return md


@FUZZ
@given(edits=metadata_mutation())
def test_mutated_metadata_objects(
    edits: list[tuple[str, int, Any]], base: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    md = apply_mutation(base["md"], edits)
    exercise(mutant_dir(tmp_path_factory, base, pickle.dumps(md)))


# --------------------------------------------------------------------------- byte streams
@st.composite
def byte_edits(draw: Any, length: int) -> list[tuple[str, int, bytes]]:
    ops = st.tuples(
        st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]),
        st.integers(0, max(0, length - 1)),
        st.binary(min_size=1, max_size=16),
    )
    return draw(st.lists(ops, min_size=1, max_size=4))


def apply_bytes(data: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    b = bytearray(data)
    for op, pos, blob in edits:
        pos = min(pos, max(0, len(b) - 1))
        if op == "flip" and b:
            b[pos] ^= blob[0] or 0xFF
        elif op == "truncate":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = blob
        elif op == "delete":
            del b[pos : pos + len(blob)]
        elif op == "overwrite":
            b[pos : pos + len(blob)] = blob
    return bytes(b)


@FUZZ
@given(data=st.data())
def test_mutated_metadata_bytes(
    data: st.DataObject, base: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    raw = base["metadata"]
    exercise(mutant_dir(tmp_path_factory, base, apply_bytes(raw, data.draw(byte_edits(len(raw))))))


@FUZZ
@given(data=st.data())
def test_mutated_data_file_bytes(
    data: st.DataObject, base: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Aim at the archives of a few tensors (zip headers, data.pkl, records) as well as anywhere.
    md = base["md"]
    spans = [
        (i.offset, i.length)
        for k, i in md.storage_data.items()
        if k.fqn in (hostile.EXPERT_KEY, hostile.NORM_KEY, hostile.LR_KEY)
    ]
    raw = base["data"]
    start, length = data.draw(st.sampled_from([*spans, (0, len(raw))]))
    edits = [(op, start + pos % max(1, length), blob) for op, pos, blob in data.draw(byte_edits(length))]
    exercise(mutant_dir(tmp_path_factory, base, base["metadata"], apply_bytes(raw, edits)))


@pytest.mark.parametrize("dims", [(32.0,), (True,), (32,), ("32",)], ids=["float", "bool", "int-control", "str"])
def test_shape_dims_must_be_ints_even_after_a_cache_hit(dims: tuple[Any, ...], base: dict[str, Any]) -> None:
    """(32.0,) == (32,) with equal hashes: a shape cache keyed by value must not let floats/bools through."""
    from ckpttool.errors import MetadataError
    from ckpttool.format import parse_metadata_bytes

    parse_metadata_bytes(base["metadata"])  # the real shapes, (32,) among them, are now known-valid
    md = copy.deepcopy(base["md"])
    tsm = md.state_dict_metadata[hostile.NORM_KEY]
    tsm.size = dims if dims[0] is not True else (1,)
    tsm.chunks[0].sizes = dims
    if all(type(d) is int for d in dims):  # not `dims == (32,)`: (32.0,) == (32,) is exactly the trap
        assert parse_metadata_bytes(pickle.dumps(md)).entries[hostile.NORM_KEY].size == (32,)
        return
    with pytest.raises(MetadataError, match="not a size"):
        parse_metadata_bytes(pickle.dumps(md))
