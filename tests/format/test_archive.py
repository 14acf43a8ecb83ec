"""The strict ``torch.save`` archive parser, the object-graph walk and the tiling check, on real and damaged inputs.

Archives come from ``torch.save`` itself (v2 and v3 tensor encodings, byte items) and are then
damaged one field at a time; each damage must be refused, and each refusal must be one torch's
reader shares or that would let two readers disagree.
"""

from __future__ import annotations

import io
import itertools
import random
import struct
import zipfile
import zlib

import pytest

from ckpttool.errors import IntegerRangeError, ObjectGraphError, SizeLimitError, StorageTupleError
from ckpttool.format import limits
from ckpttool.format.archive import (
    ArchiveChecksumError,
    ArchiveError,
    BytesWindow,
    Member,
    inflate_into,
    parse_archive,
    parse_tensor_archive,
    read_archive_pickle,
)
from ckpttool.format.metadata import ChunkMeta, DType, TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.format.unpickler import check_object_graph
from tests.fixtures.hostile import ZipMember, deflate_bomb, nested_dag, torch_members, zip_bytes


def _save(obj: object) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool", "float8_e4m3fn", "uint16"])
def test_real_archives_parse_to_their_record(dtype: str) -> None:
    import torch

    t = torch.arange(24).reshape(2, 3, 4).to(getattr(torch, dtype))
    data = _save(t)
    rec = parse_tensor_archive(BytesWindow(data))
    assert (rec.dtype, rec.size, rec.stride, rec.storage_numel) == (dtype, (2, 3, 4), (12, 4, 1), 24)
    raw = data[rec.data_offset : rec.data_offset + 24 * t.element_size()]
    assert zlib.crc32(raw) == rec.crc32
    assert raw == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_a_view_of_a_larger_storage_keeps_its_offset_and_strides() -> None:
    import torch

    base = torch.arange(40, dtype=torch.float32)
    rec = parse_tensor_archive(BytesWindow(_save(base[5:25].view(4, 5).t())))
    assert (rec.storage_offset, rec.size, rec.stride, rec.storage_numel) == (5, (5, 4), (1, 5), 40)


def _members(obj: object = None) -> list[ZipMember]:
    import torch

    return torch_members(_save(torch.ones(4) if obj is None else obj))


def _damaged(kind: str) -> bytes:
    ms = _members()
    rec = next(m for m in ms if m.name.endswith("data/0"))
    if kind == "prepended":
        return b"\0" * 64 + zip_bytes(ms)
    if kind == "appended":
        return zip_bytes(ms) + b"\0" * 64
    if kind == "decoy":
        rec.name = rec.name.replace("data/0", "xdata/0")
    elif kind == "duplicate":
        ms.append(ZipMember(rec.name, rec.payload))
    elif kind == "case_duplicate":
        ms.append(ZipMember(rec.name.replace("data/0", "DATA/0"), rec.payload))
    elif kind == "unknown_member":
        ms.append(ZipMember(ms[0].name.split("/")[0] + "/code/evil.py", b"x"))
    elif kind == "other_prefix":
        rec.name = "other/data/0"
    elif kind == "local_name":
        rec.local_name = rec.name.replace("data/0", "data/1")
    elif kind == "crc_claim":
        rec.crc = 0
    elif kind == "size_claim":
        rec.size = len(rec.payload) + 4
    elif kind == "bzip2":
        ms[0].method = 12
    elif kind == "no_version":
        ms = [m for m in ms if not m.name.endswith("/version")]
    elif kind == "bad_version":
        next(m for m in ms if m.name.endswith("/version")).payload = b"99\n"
    else:
        raise ValueError(kind)
    return zip_bytes(ms)


@pytest.mark.parametrize(
    "kind",
    [
        "prepended",
        "appended",
        "decoy",
        "duplicate",
        "case_duplicate",
        "unknown_member",
        "other_prefix",
        "local_name",
        "size_claim",
        "bzip2",
        "no_version",
        "bad_version",
    ],
)
def test_structural_damage_is_refused(kind: str) -> None:
    with pytest.raises(ArchiveError):
        parse_tensor_archive(BytesWindow(_damaged(kind)))


def test_the_hand_written_zip_of_a_real_archive_is_accepted() -> None:
    """The damage above is the only difference: the same members, undamaged, parse."""
    assert parse_tensor_archive(BytesWindow(zip_bytes(_members()))).size == (4,)


def test_crc_of_a_small_member_is_checked() -> None:
    ms = _members()
    next(m for m in ms if m.name.endswith("data.pkl")).crc = 1
    with pytest.raises(ArchiveChecksumError):
        parse_tensor_archive(BytesWindow(zip_bytes(ms)))


def test_record_crc_is_reported_not_checked_by_the_parser() -> None:
    """The record's CRC-32 is checked as its bytes are read (the reader), never read twice by the parser."""
    assert parse_tensor_archive(BytesWindow(_damaged("crc_claim"))).crc32 == 0


def test_a_local_header_that_moves_the_data_out_of_the_window_is_refused() -> None:
    data = bytearray(_save(__import__("torch").ones(4)))
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("archive/data/0")
    n = struct.unpack_from("<H", data, info.header_offset + 26)[0]
    struct.pack_into("<H", data, info.header_offset + 28, len(data) - (info.header_offset + 30 + n))
    with pytest.raises(ArchiveError):
        parse_tensor_archive(BytesWindow(bytes(data) + b"\0" * 16))


def test_storage_tuple_with_wrong_types_has_its_own_error() -> None:
    ms = _members()
    pkl = next(m for m in ms if m.name.endswith("data.pkl"))
    pkl.payload = pkl.payload.replace(b"K\x04t", b"G" + struct.pack(">d", 4.0) + b"t", 1)
    with pytest.raises(StorageTupleError):
        parse_tensor_archive(BytesWindow(zip_bytes(ms)))


def test_inflation_stops_at_the_declared_size() -> None:
    stream = deflate_bomb(64 << 20)
    m = Member("data.pkl", 8, 0, len(stream), 100, 0, 0)
    out = bytearray(100)
    with pytest.raises(ArchiveError, match="inflates past"):
        inflate_into(BytesWindow(stream), m, memoryview(out))


def test_declared_sizes_are_capped_before_inflating() -> None:
    ms = _members({"lr": 0.1})
    pkl = next(m for m in ms if m.name.endswith("data.pkl"))
    pkl.payload, pkl.method, pkl.size, pkl.crc = deflate_bomb(16 << 20), 8, 5 << 30, 0
    with pytest.raises(SizeLimitError):
        read_archive_pickle(BytesWindow(zip_bytes(ms)))
    with limits.limits(max_tensor_pickle_bytes=1024), pytest.raises(ArchiveError):
        parse_archive(BytesWindow(zip_bytes(ms)), max_members=3)


def test_deflated_members_within_the_caps_are_read() -> None:
    ms = _members({"lr": 0.1})
    pkl = next(m for m in ms if m.name.endswith("data.pkl"))
    co = zlib.compressobj(6, zlib.DEFLATED, -15)
    raw = pkl.payload
    pkl.payload, pkl.method, pkl.size, pkl.crc = co.compress(raw) + co.flush(), 8, len(raw), zlib.crc32(raw)
    assert read_archive_pickle(BytesWindow(zip_bytes(ms))) == raw


# --------------------------------------------------------------------------- object graphs
def test_dag_bomb_is_refused_in_time_linear_in_its_size() -> None:
    with pytest.raises(ObjectGraphError, match="unfolds"):
        check_object_graph(nested_dag(40), "betas")


def test_deep_nesting_cycles_and_huge_ints_are_refused() -> None:
    deep: list[object] = []
    cur = deep
    for _ in range(200):
        cur.append([])
        cur = cur[0]  # type: ignore[assignment]
    with pytest.raises(ObjectGraphError, match="deeper"):
        check_object_graph(deep, "x")
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ObjectGraphError, match="itself"):
        check_object_graph({"a": loop}, "x")
    with pytest.raises(IntegerRangeError):
        check_object_graph({"lr": [2**20000]}, "x")


def test_ordinary_values_pass_the_walk() -> None:
    shared = [0.9, 0.999]
    value = {"betas": shared, "groups": [{"betas": shared, "params": [f"p{i}" for i in range(1000)]}] * 10}
    assert check_object_graph(value, "x") is value
    assert check_object_graph(2**127, "x") == 2**127  # a 128-bit RNG state


# --------------------------------------------------------------------------- tiling
def _brute(meta: TensorMeta) -> bool:
    import numpy as np

    cnt = np.zeros(meta.size, dtype=int)
    for c in meta.chunks:
        cnt[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
    return bool((cnt == 1).all())


def test_tiling_check_agrees_with_counting_every_element() -> None:
    rng = random.Random(13)
    for _ in range(400):
        shape = (rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 3))
        if rng.random() < 0.4:  # a real tiling: a random grid
            cuts = [sorted({0, s, *rng.sample(range(1, s + 1), min(s, 2))}) for s in shape]
            boxes = itertools.product(*[list(zip(c, c[1:])) for c in cuts])
            chunks = [ChunkMeta(tuple(a for a, _ in b), tuple(z - a for a, z in b)) for b in boxes]
            if rng.random() < 0.5 and len(chunks) > 1:  # swap one box for a shifted copy of another
                chunks[0] = chunks[-1]
        else:
            chunks = []
            for _ in range(rng.randint(1, 8)):
                o = tuple(rng.randrange(s) for s in shape)
                chunks.append(ChunkMeta(o, tuple(rng.randint(1, s - oo) for oo, s in zip(o, shape))))
        meta = TensorMeta(DType("float32"), shape, tuple(chunks))
        assert (tiling_problem(meta) is None) == _brute(meta), meta


def test_a_pinwheel_tiling_is_a_tiling() -> None:
    chunks = (
        ChunkMeta((0, 0), (2, 1)),
        ChunkMeta((0, 1), (1, 2)),
        ChunkMeta((1, 2), (2, 1)),
        ChunkMeta((2, 0), (1, 2)),
        ChunkMeta((1, 1), (1, 1)),
    )
    assert tiling_problem(TensorMeta(DType("float32"), (3, 3), chunks)) is None


def test_many_small_chunks_use_the_vectorised_check() -> None:
    n = 60
    chunks = tuple(ChunkMeta((i, j), (1, 1)) for i in range(n) for j in range(n))
    assert tiling_problem(TensorMeta(DType("float32"), (n, n), chunks)) is None
    bad = chunks[:-1] + (chunks[0],)
    problem = tiling_problem(TensorMeta(DType("float32"), (n, n), bad))
    assert problem is not None and problem.startswith("overlap")


# --------------------------------------------------------------------------- fuzz: parser vs torch.load
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.format.test_fuzz_metadata import EXAMPLES, RANDOM  # noqa: E402

_BASE = None


def _base_archive() -> bytes:
    global _BASE
    if _BASE is None:
        import torch

        _BASE = _save(torch.arange(64, dtype=torch.float32).reshape(4, 16))
    return _BASE


@settings(
    max_examples=EXAMPLES,
    derandomize=not RANDOM,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 4000)),
)
def test_damaged_archives_are_refused_or_read_as_torch_reads_them(
    edits: list[tuple[int, int]], cut: int | None
) -> None:
    """Byte edits anywhere in a real archive: ckpttool refuses, or its record is exactly torch's tensor."""
    import torch

    data = bytearray(_base_archive())
    for at, value in edits:
        data[at % len(data)] = value
    if cut is not None:
        data = data[: max(22, cut % len(data))]
    window = BytesWindow(bytes(data))
    try:
        rec = parse_tensor_archive(window)
    except (ArchiveError, StorageTupleError, SizeLimitError, __import__("ckpttool").errors.UnsafePickleError):
        return
    assert rec.member is not None
    raw = bytearray(rec.member.size)
    inflate_into(window, rec.member, memoryview(raw))
    try:
        theirs = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    except Exception as e:  # torch refuses: ckpttool must have found something wrong too (its CRC-32)
        assert zlib.crc32(raw) != rec.crc32, f"torch refuses ({type(e).__name__}: {e}) what ckpttool parsed"
        return
    if zlib.crc32(raw) != rec.crc32:
        return  # a flipped record byte: the reader's CRC-32 check refuses it (torch loads it silently)
    ours = torch.frombuffer(raw, dtype=torch.float32).as_strided(rec.size, rec.stride, rec.storage_offset)
    assert theirs.dtype == torch.float32 and torch.equal(ours, theirs)


@settings(
    max_examples=EXAMPLES,
    derandomize=not RANDOM,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), min_size=1, max_size=4))
def test_damaged_byte_items_are_refused_or_read_as_torch_reads_them(edits: list[tuple[int, int]]) -> None:
    """A byte item (param-group values, a tensor inside): refused, or equal to ``torch.load(weights_only=True)``."""
    import torch

    from ckpttool.errors import CkptError
    from ckpttool.format.reader import load_saved_object

    data = bytearray(_save({"lr": 0.1, "betas": (0.9, 0.999), "step": torch.tensor(3.0)}))
    for at, value in edits:
        data[at % len(data)] = value
    try:
        ours = load_saved_object(bytes(data), "item")
    except CkptError:
        return
    theirs = torch.load(io.BytesIO(bytes(data)), weights_only=True)  # must not raise: ckpttool accepted it
    assert ours.keys() == theirs.keys()
    for k in ours:
        a, b = ours[k], theirs[k]
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("variant", ["deflated", "big_endian", "deflated_oversized"])
def test_unusual_records_read_as_torch_reads_them(variant: str, sample_ckpt: object, tmp_path: object) -> None:
    """A deflate-compressed record and a big-endian archive (both valid for torch) read to torch's values."""
    import shutil
    from pathlib import Path

    import numpy as np
    import torch

    from ckpttool.errors import ChunkError
    from ckpttool.format.reader import CheckpointReader
    from tests.fixtures.hostile import EXPERT_KEY, chunk_archive, repoint

    ck = Path(shutil.copytree(sample_ckpt, Path(str(tmp_path)) / "ck"))  # type: ignore[arg-type]
    _, archive = chunk_archive(ck, EXPERT_KEY, (0, 0, 0))
    original = torch.load(io.BytesIO(archive), weights_only=True)
    ms = torch_members(archive)
    for m in ms:
        if m.name.endswith("data/0"):
            raw = m.payload
            if variant == "big_endian":
                raw = np.frombuffer(raw, dtype="<f4").astype(">f4").tobytes()
                m.payload, m.crc = raw, None
            else:
                if variant == "deflated_oversized":
                    raw = raw * 2  # declares a storage twice the chunk
                co = zlib.compressobj(6, zlib.DEFLATED, -15)
                m.payload, m.method, m.size, m.crc = co.compress(raw) + co.flush(), 8, len(raw), zlib.crc32(raw)
        if variant == "big_endian" and m.name.endswith("/byteorder"):
            m.payload, m.crc = b"big", None
        if variant == "deflated_oversized" and m.name.endswith("data.pkl"):
            m.payload = m.payload.replace(b"M\x00\x10t", b"M\x00\x20t", 1)
    data = zip_bytes(ms)
    repoint(ck, EXPERT_KEY, (0, 0, 0), data)
    with CheckpointReader(ck) as r:
        if variant == "deflated_oversized":
            with pytest.raises(ChunkError, match="compressed storage record declares"):
                r.read_tensor(EXPERT_KEY)
            return
        chunk = r.tensor_meta(EXPERT_KEY).chunks[0]
        ours = r.read_chunk(EXPERT_KEY, chunk)
        if variant == "deflated":
            # the stored-bytes invariant: a tensor whose values need more bytes than its records
            # occupy is refused before allocation (torch's writer never compresses records)
            from ckpttool.errors import AllocationError

            with pytest.raises(AllocationError):
                r.read_tensor(EXPERT_KEY)
        else:
            assert torch.equal(r.read_tensor(EXPERT_KEY), ours)
    theirs = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(ours, theirs) and torch.equal(ours, original)


def test_storage_tuple_key_of_non_decimal_digits_is_refused() -> None:
    """A key of digits ``int()`` does not read (a superscript ``²``: ``str.isdigit`` holds, ``int`` raises) is the
    storage tuple's own error, not an internal one."""
    ms = _members()
    pkl = next(m for m in ms if m.name.endswith("data.pkl"))
    assert b"X\x01\x00\x00\x000" in pkl.payload
    pkl.payload = pkl.payload.replace(b"X\x01\x00\x00\x000", b"X\x02\x00\x00\x00" + "²".encode(), 1)
    with pytest.raises(StorageTupleError, match="not a decimal string"):
        parse_tensor_archive(BytesWindow(zip_bytes(ms)))
