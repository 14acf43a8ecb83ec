"""The native column reader of ``.metadata`` (ckpttool.format.mdscan) against the allow-list unpickler and torch.

The property: whenever the column reader returns metadata, it equals what the unpickler path returns
for the same bytes (which itself equals torch's ``read_metadata``, tests/format/test_metadata_parse.py);
on anything else it returns ``None`` and the unpickler decides (its result or its message).
"""

from __future__ import annotations

import pickle
import pickletools
import random
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest

from ckpttool.engine import native
from ckpttool.errors import CkptError, MetadataError
from ckpttool.format.mdscan import scan_metadata
from ckpttool.format.unpickler import _convert, _unpickle, parse_metadata_bytes

pytestmark = pytest.mark.skipif(native.function("ckpt_mdscan", None) is None, reason="native kernels not built")


def _unpickled(data: bytes) -> Any:
    """The unpickler path's result for ``data``, or the error it raises."""
    try:
        obj, writer = _unpickle(data, ".metadata")
        return _convert(obj, ".metadata", writer)
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


def _kernel_bucket(s: bytes, cap: int = 4096) -> int:
    """The bucket of ``s`` in the kernel's first string table (mdscan.c ``str_hash``: FNV-1a, splitmix64's finaliser)."""
    m = (1 << 64) - 1
    h = 1469598103934665603 ^ len(s)
    for c in s:
        h = ((h ^ c) * 1099511628211) & m
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & m
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & m
    return (h ^ (h >> 31)) & (cap - 1)


def test_empty_string_beside_a_string_in_its_bucket_agrees() -> None:
    """An empty string copied to the pool has the next string's offset: a string after it that falls in its bucket
    is still its own string (a planner path ('', name) was read as ('', ''))."""
    empty = _kernel_bucket(b"")
    names = [n for n in (f"m{i}" for i in range(100_000)) if _kernel_bucket(n.encode()) == empty][:3]
    assert names
    for name in names:
        entries = {"a": _tensor([4], [([0], [4])]), "": _tensor([2], [([0], [2])]), name: _tensor([3], [([0], [3])])}
        assert _agrees(_metadata_pickle(entries, {"a": ("", name), name: (name, "")}))


# --------------------------------------------------------------------------- FRAME boundaries
# A FRAME's bytes are the C unpickler's buffer: a read that starts inside them and ends past them (an argument
# across the frame's end, never written by pickle.dump) is refused on both paths, with CPython's pure-Python
# unpickler as the reference; a frame that ends between reads is read as every reader reads it.

_CROSSING = "pickle exhausted before end of frame"


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(offset of each FRAME opcode, its length) in ``data``."""
    return [(pos, arg) for op, arg, pos in pickletools.genops(data) if op.name == "FRAME"]


_LENGTH_FIELD = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}


def _read_bounds(data: bytes) -> tuple[list[int], list[int]]:
    """Offsets where a read of the pickle machine starts (an opcode, a length field, a payload, a line) and
    offsets strictly inside a read of two bytes or more (from ``pickletools``' opcode table)."""
    starts: list[int] = []
    inside: list[int] = []
    ops = list(pickletools.genops(data))
    for (op, _, pos), nxt in zip(ops, [p for _, _, p in ops[1:]] + [len(data)]):
        fields = [pos, pos + 1]
        n = op.arg.n if op.arg is not None else 0
        if n in _LENGTH_FIELD:
            fields.append(pos + 1 + _LENGTH_FIELD[n])  # the payload's read starts after the length's
        elif n == pickletools.UP_TO_NEWLINE:
            fields += [i + 1 for i in range(pos + 1, nxt - 1) if data[i] == 10]
        end = pos + 9 if op.name == "FRAME" else nxt
        fields.append(end)
        starts += fields[:-1]
        for a, b in zip(fields, fields[1:]):
            inside += range(a + 1, b)
    return starts, inside


def _frame_ending_at(data: bytes, frame: int, end: int) -> bytes:
    """``data`` with the FRAME at ``frame`` made to end at offset ``end`` (its other bytes then follow unframed)."""
    return data[: frame + 1] + (end - frame - 9).to_bytes(8, "little") + data[frame + 9 :]


def _reframed(data: bytes, cuts: list[int]) -> bytes:
    """The opcodes of ``data`` (without PROTO and FRAME) in frames that end at the offsets ``cuts`` of that stream."""
    ops = list(pickletools.genops(data))
    body = b"".join(
        data[pos:nxt]
        for (op, _, pos), nxt in zip(ops, [p for _, _, p in ops[1:]] + [len(data)])
        if op.name not in ("PROTO", "FRAME")
    )
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(body)}), len(body)]
    return data[:2] + b"".join(
        b"\x95" + (b - a).to_bytes(8, "little") + body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a
    )


def _refused_on_both_paths(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel declines ``data``; with and without it the same line: E200, the frame named, a hint; CPython's
    pure-Python unpickler refuses it too."""
    assert scan_metadata(data, ".metadata") is None
    err = _parsed(data)
    assert isinstance(err, MetadataError) and err.code == "E200" and err.hint, err
    assert err.message.startswith(f".metadata is not a readable pickle (UnpicklingError: {_CROSSING} (its end: byte ")
    ref = _parsed_without_kernels(data, monkeypatch)
    assert type(ref) is type(err) and str(ref) == str(err) and ref.hint == err.hint
    with pytest.raises(pickle.UnpicklingError, match=_CROSSING):
        pickle._loads(data)  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", [4, 5])
def test_frame_ending_inside_an_argument_is_refused_by_both_paths(
    protocol: int, fsdp_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's metadata with its FRAME made to end inside a string, an int, a memo index: ``pickle.loads`` reads
    on (the values the kernel used to give), ``pickle.load`` of a BytesIO skips the frame's rest; both paths refuse."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(fsdp_ckpt)).read_metadata()
    data = pickle.dumps(md, protocol=protocol)
    ((frame, n),) = _frames(data)[:1]
    _, inside = _read_bounds(data)
    inside = [i for i in inside if frame + 9 < i < frame + 9 + n]
    for end in random.Random(protocol).sample(inside, 40):
        bad = _frame_ending_at(data, frame, end)
        assert pickle.loads(bad) == md  # the bytes are unchanged: a reader that ignores frames reads the save
        _refused_on_both_paths(bad, monkeypatch)


@pytest.mark.parametrize("protocol", [4, 5])
def test_frame_ending_between_reads_is_read_by_both_paths(protocol: int, fsdp_ckpt: Path) -> None:
    """The FRAME made to end where a read starts (between opcodes, after an opcode byte, between a string's length
    and its bytes): every CPython reader reads the save, and so do both paths, the kernel included."""
    from torch.distributed.checkpoint import FileSystemReader

    data = pickle.dumps(FileSystemReader(str(fsdp_ckpt)).read_metadata(), protocol=protocol)
    ref = _parsed(data)
    ((frame, n),) = _frames(data)[:1]
    starts, _ = _read_bounds(data)
    for end in random.Random(protocol).sample([s for s in starts if frame + 9 < s < frame + 9 + n], 40):
        ok = _frame_ending_at(data, frame, end)
        pickle._loads(ok)  # type: ignore[attr-defined]  # the pure-Python unpickler accepts it
        assert _agrees(ok) and scan_metadata(ok, ".metadata") == ref


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_frames_at_opcode_boundaries_agree_at_every_protocol(protocol: int, fsdp_ckpt: Path) -> None:
    """Well-formed streams, framed and unframed at every protocol from 2 (frames of 1 byte to the whole stream,
    protocols 2-3 given frames, 4-5 stripped of theirs): the kernel takes each, equal to the unpickler path."""
    from torch.distributed.checkpoint import FileSystemReader

    data = pickle.dumps(FileSystemReader(str(fsdp_ckpt)).read_metadata(), protocol=protocol)
    ref = _parsed(data)
    assert _agrees(data)
    ops = [(op.name, pos) for op, _, pos in pickletools.genops(data)]
    sizes = [q - p for (name, p), (_, q) in zip(ops, [*ops[1:], ("", len(data))]) if name not in ("PROTO", "FRAME")]
    offsets = list(accumulate(sizes[:-1], initial=0))  # each opcode's offset in the stream without PROTO and FRAME
    rng = random.Random(protocol)
    for every in (1, 7, 100, len(offsets)):
        framed = _reframed(data, offsets[::every] if every > 1 else offsets)
        assert _agrees(framed) and scan_metadata(framed, ".metadata") == ref
    unframed = _reframed(data, [])[:2] + _reframed(data, [])[11:]  # the one frame's header dropped
    assert not _frames(unframed) and _agrees(unframed) and scan_metadata(unframed, ".metadata") == ref
    randomly = _reframed(data, rng.sample(offsets, 20))
    assert _agrees(randomly) and scan_metadata(randomly, ".metadata") == ref


def test_random_frame_boundaries_agree_with_cpython(fsdp_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames ending at random offsets of torch's metadata: where CPython's pure-Python unpickler finds a read across
    a frame's end, both paths refuse with the same line; elsewhere the kernel's result is the unpickler path's."""
    from torch.distributed.checkpoint import FileSystemReader

    data = pickle.dumps(FileSystemReader(str(fsdp_ckpt)).read_metadata(), protocol=4)
    size = len(_reframed(data, [])) - 11
    rng = random.Random(7)
    crossed = taken = 0
    for _ in range(120):
        framed = _reframed(data, rng.sample(range(1, size), rng.randrange(1, 4)))
        try:
            pickle._loads(framed)  # type: ignore[attr-defined]
            reference = ""
        except Exception as e:  # a cut between an opcode's reads puts the next header in its argument: any error
            reference = str(e)
        if reference == _CROSSING:
            _refused_on_both_paths(framed, monkeypatch)
            crossed += 1
        else:
            assert _CROSSING not in str(_parsed(framed))
            taken += _agrees(framed)
    assert crossed and taken


def test_frame_inside_a_frame(fsdp_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FRAME inside another frame's bytes: within them it is read on (as the C unpickler reads it, by both paths
    alike); one that runs past them is refused by both."""
    from torch.distributed.checkpoint import FileSystemReader

    data = pickle.dumps(FileSystemReader(str(fsdp_ckpt)).read_metadata(), protocol=4)
    ref = _parsed(data)
    ((frame, n),) = _frames(data)[:1]
    body = data[frame + 9 : frame + 9 + n]
    # an opcode's start in the frame's second half (not a read of an argument: what an opcode reads then depends on
    # where the save's bytes happen to put its argument)
    cut = next(pos for _, _, pos in pickletools.genops(data) if pos > frame + 9 + n // 2) - frame - 9
    inner = b"\x95" + (n - cut).to_bytes(8, "little") + body[cut:]
    nested = data[:frame] + b"\x95" + (n + 9).to_bytes(8, "little") + body[:cut] + inner + data[frame + 9 + n :]
    assert _agrees(nested) and scan_metadata(nested, ".metadata") == ref
    over = b"\x95" + (n - cut + 1).to_bytes(8, "little") + body[cut:]
    past = data[:frame] + b"\x95" + (n + 9).to_bytes(8, "little") + body[:cut] + over + data[frame + 9 + n :] + b"."
    assert scan_metadata(past, ".metadata") is None
    err = _parsed(past)
    assert isinstance(err, MetadataError) and f"UnpicklingError: {_CROSSING}" in str(err)
    assert str(_parsed_without_kernels(past, monkeypatch)) == str(err)


@pytest.mark.parametrize("field", ["offset", "length"])
def test_negative_storage_offset_or_length_is_refused_by_both_paths(
    field: str, sample_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own ``.metadata`` with one storage record's offset or length made negative: the kernel declines,
    and both paths refuse with the same E200 line (reading at a negative offset was an internal error)."""
    import dataclasses

    md = pickle.loads((sample_ckpt / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], **{field: -100})
    data = pickle.dumps(md, protocol=4)
    assert scan_metadata(data, ".metadata") is None
    ours, ref = _parsed(data), _parsed_without_kernels(data, monkeypatch)
    assert isinstance(ref, MetadataError) and ref.code == "E200" and str(ours) == str(ref)
    assert f"negative offset {-100 if field == 'offset' else md.storage_data[key].offset}" in str(ref)


# --------------------------------------------------------------------------- the input released behind the parse
# A bytearray the caller gives up (a local .metadata read by CheckpointDir) is released page by page as the parse
# passes it (madvise MADV_DONTNEED: its content reads as zeros after), and where the stream is then declined the
# file is read again for the unpickler: the result or the error is the one the bytes path gives.


def _many_entries(n: int, first_offset: int = 0) -> bytes:
    """torch's own Metadata pickle of ``n`` one-chunk tensors with storage records (~100 bytes an entry); the
    first record at ``first_offset`` (negative: a value the kernel accepts and the columns' check declines)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    entries = {f"model.layers.{i}.mlp.weight": _tensor([4, i + 1], [([0, 0], [4, i + 1])]) for i in range(n)}
    storage = {
        MetadataIndex(k, torch.Size([0, 0])): _StorageInfo(f"__{i % 4}_0.distcp", 64 * i or first_offset, 16 * (i + 1))
        for i, k in enumerate(entries)
    }
    return pickle.dumps(Metadata(state_dict_metadata=entries, storage_data=storage), protocol=4)


def _owned_parse(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, bytearray, list[int]]:
    """``parse_metadata_owned`` of ``data`` as a released bytearray (every size released): its result or error,
    the bytearray after the parse (kept here only to look at it) and how often the file was read again."""
    from ckpttool.format import mdscan
    from ckpttool.format.unpickler import parse_metadata_owned

    monkeypatch.setattr(mdscan, "DROP_MIN_BYTES", 0)
    buf, reads = bytearray(data), [0]

    def reread() -> bytes:
        reads[0] += 1
        return data

    try:
        got: Any = parse_metadata_owned([buf], ".metadata", reread)
    except CkptError as e:
        got = e
    return got, buf, reads


def test_released_input_gives_the_same_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _many_entries(20_000)
    assert len(data) > 1 << 20
    ref = _parsed(data)
    got, buf, reads = _owned_parse(data, monkeypatch)
    assert got == ref and list(got.entries) == list(ref.entries) and list(got.storage) == list(ref.storage)
    assert reads == [0]
    # the pages were given back: all but the partial pages at both ends read as zeros now
    assert buf.count(0) >= len(data) - 2 * 4096 > data.count(0)


def test_released_input_declined_after_the_parse_is_read_again(
    sample_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value the kernel leaves to the columns (a negative storage offset): declined after the parse released
    the pages, the file is read again once; a stream declined in the kernel's first pass (nothing released yet)
    is not read again. The unpickler's error is the bytes path's."""
    import dataclasses

    md = pickle.loads((sample_ckpt / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], offset=-100)
    negative = pickle.dumps(md, protocol=4)
    assert len(negative) > 3 * 4096
    for data, again in ((negative, 1), (_many_entries(2_000)[:-1], 0)):  # the last: no STOP opcode
        ref = _parsed(data)
        got, _, reads = _owned_parse(data, monkeypatch)
        assert isinstance(ref, MetadataError) and str(got) == str(ref)
        assert reads == [again]


@pytest.mark.parametrize("changed", ["more records", "empty"])
def test_file_changed_before_it_is_read_again_is_checked_again(changed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file read again for the unpickler (a declined stream) holds other bytes than the first read: they are
    refused as the bytes path refuses them (the record bound counted on them, the empty file), not unpickled."""
    from ckpttool.format import limits, mdscan
    from ckpttool.format.unpickler import parse_metadata_owned

    first = _many_entries(200, first_offset=-100)  # declined after the parse released its pages
    again = _many_entries(400) if changed == "more records" else b""
    monkeypatch.setattr(mdscan, "DROP_MIN_BYTES", 0)
    cap = first.count(b"\x81") + 8  # the first read within the record bound, the second past it
    with limits.limits(max_metadata_bytes=cap * limits.BYTES_PER_METADATA_RECORD):
        ref = _parsed(again)
        try:
            got: Any = parse_metadata_owned([bytearray(first)], ".metadata", lambda: again)
        except CkptError as e:
            got = e
    assert isinstance(ref, CkptError) and type(got) is type(ref) and str(got) == str(ref)


def test_checkpoint_dir_reads_its_metadata_released(
    fsdp_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through CheckpointDir (the local .metadata read into a bytearray of its own): the bytes path's metadata
    without the parsed-metadata cache, on a cache miss (stored) and on the hit after it; the file unchanged."""
    from ckpttool.format import cache, mdcache, mdscan
    from ckpttool.format.directory import CheckpointDir

    raw = (fsdp_ckpt / ".metadata").read_bytes()
    ref = _parsed(raw)
    monkeypatch.setattr(mdscan, "DROP_MIN_BYTES", 0)
    monkeypatch.setattr(mdcache, "MIN_CACHED_BYTES", 0)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    try:
        for enabled in (False, True, True):
            cache.set_cache_enabled(enabled)
            with CheckpointDir(fsdp_ckpt) as ckpt:
                assert ckpt.metadata == ref
        assert len(list((tmp_path / "cache").rglob("*"))) > 0
    finally:
        cache.set_cache_enabled(None)
    assert (fsdp_ckpt / ".metadata").read_bytes() == raw


def test_without_kernels_an_owned_bytearray_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _many_entries(2_000)
    ref = _parsed(data)
    with monkeypatch.context() as m:
        m.setenv("CKPTTOOL_NATIVE", "0")
        native.lib.cache_clear()
        try:
            got, buf, reads = _owned_parse(data, monkeypatch)
        finally:
            native.lib.cache_clear()
    assert got == ref and reads == [0] and buf == data


def test_storage_key_given_twice_is_declined_to_the_unpickler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``Metadata`` whose ``storage_data`` dict is pickled with one ``MetadataIndex`` twice (two equal
    objects, as a writer that lists two empty chunks at one offset writes it): the column reader raised
    ``DuplicateKeys`` out of every command (E999); it declines it now, and the unpickler path reads what torch's
    ``pickle.load`` does (the later record for the key)."""
    import copy
    import io

    import torch
    import torch.distributed.checkpoint as dcp

    from ckpttool.format import CheckpointReader

    dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=str(tmp_path), no_dist=True)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())

    class Twice(dict):  # type: ignore[type-arg]
        pass

    def save_twice(self: Any, obj: Twice) -> None:
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        items = list(obj.items())
        self._batch_setitems(iter([*items, copy.deepcopy(items[0])]))

    class Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
        dispatch = {**pickle._Pickler.dispatch, Twice: save_twice}  # type: ignore[attr-defined]

    md.storage_data = Twice(md.storage_data)
    buf = io.BytesIO()
    Pickler(buf, protocol=4).dump(md)
    data = buf.getvalue()
    assert len(pickle.loads(data).storage_data) == 1
    assert scan_metadata(data, ".metadata") is None
    assert _parsed(data) == _parsed_without_kernels(data, monkeypatch)
    (tmp_path / ".metadata").write_bytes(data)
    with CheckpointReader(tmp_path) as r:
        assert torch.equal(r.read_tensor("model.w"), torch.arange(6.0))
