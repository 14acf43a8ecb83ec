"""The allow-list parse of ``.metadata`` (ckpttool.format.unpickler) against torch's own reader."""

from __future__ import annotations

import io
import pickle
import pickletools
import random
from collections import OrderedDict
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest

from ckpttool.format import parse_metadata_bytes
from ckpttool.format.metadata import CheckpointMetadata, TensorMeta
from ckpttool.format.pickleframes import CROSSING, FramedInput, pickle_input
from ckpttool.format.unpickler import parse_metadata_owned


def _torch_view(ckpt: Path) -> tuple[list[tuple[str, Any]], list[tuple[Any, Any]]]:
    """Entries and storage items as torch's ``FileSystemReader.read_metadata()`` gives them (plain values)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    entries = [
        (
            k,
            (
                str(v.properties.dtype).removeprefix("torch."),
                tuple(v.size),
                [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks],
            )
            if isinstance(v, TensorStorageMetadata)
            else None,
        )
        for k, v in md.state_dict_metadata.items()
    ]
    storage = [
        ((i.fqn, None if i.offset is None else tuple(i.offset)), (s.relative_path, s.offset, s.length))
        for i, s in md.storage_data.items()
    ]
    return entries, storage


def _our_view(md: CheckpointMetadata) -> tuple[list[tuple[str, Any]], list[tuple[Any, Any]]]:
    entries = [
        (k, (v.dtype.name, v.size, [(c.offsets, c.sizes) for c in v.chunks]) if isinstance(v, TensorMeta) else None)
        for k, v in md.entries.items()
    ]
    storage = [(k, (s.relative_path, s.offset, s.length)) for k, s in md.storage.items()]
    return entries, storage


@pytest.mark.parametrize("fixture", ["fsdp_ckpt", "multi_optim_ckpt"])
def test_parse_equals_torch_read_metadata(fixture: str, request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(fixture)
    data = (ckpt / ".metadata").read_bytes()
    holder = [data]
    md = parse_metadata_owned(holder)
    assert holder == []  # handed over: the parser holds the only reference it keeps
    assert _our_view(md) == _torch_view(ckpt)  # values and file order
    assert parse_metadata_bytes(data) == md


def test_equal_values_are_built_once(fsdp_ckpt: Path) -> None:
    """Entries of one layout share one frozen TensorMeta; equal chunks and relative paths are one object each."""
    md = parse_metadata_bytes((fsdp_ckpt / ".metadata").read_bytes())
    tensors = [v for v in md.entries.values() if isinstance(v, TensorMeta)]
    assert len({id(v) for v in tensors}) == len(set(tensors)) < len(tensors)
    chunks = [c for v in tensors for c in v.chunks]
    assert len({id(c) for c in chunks}) == len(set(chunks))
    paths = [s.relative_path for s in md.storage.values()]
    assert len({id(p) for p in paths}) == len(set(paths))


def test_a_shape_holding_a_list_is_named_not_a_crash() -> None:
    """``torch.Size(([1],))`` where a shape belongs: the entry and the value are named (E200), never a TypeError."""
    from ckpttool.errors import MetadataError
    from ckpttool.format.unpickler import _shape

    with pytest.raises(MetadataError) as e:
        _shape(([1],), ".metadata", "w", "chunk sizes")
    assert e.value.message == ".metadata: entry 'w': chunk sizes <tuple of 1 items> holds [1], not a size >= 0"


def _plain_value(rng: random.Random) -> Any:
    """Nested plain values with shared objects (memo), big ints, text with 0x95 bytes, and a 70 KB string that
    pickle.dump writes outside any frame."""
    shared = ("x" * 40, 2**70, -5)
    return {
        "ints": [rng.randrange(-(2**40), 2**40) for _ in range(300)],
        "text": ["é\u0155ŕ" * rng.randrange(1, 9) for _ in range(50)],
        "shared": [shared, shared, {"k": shared}],
        "od": OrderedDict(a=1, b=[1.5, None, True]),
        "big": "w" * 70_000,
        "bytes": bytes(range(256)) * 3,
    }


def _outcome(load: Any, data: bytes) -> Any:
    try:
        return load(data)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle_input_reads_frames_as_cpython_reference(protocol: int) -> None:
    """The unpickler's input (``pickle_input``) against CPython's pure-Python unpickler (``pickle._loads``), which
    refuses a read across a frame's end: frames at random offsets (opcodes, text lines, a string outside any
    frame, frames given to protocols 2-3): the same values, or both refuse with its words."""
    rng = random.Random(protocol)
    data = pickle.dumps(_plain_value(rng), protocol=protocol)
    ours = lambda d: pickle.Unpickler(pickle_input(d)).load()  # noqa: E731
    assert ours(data) == pickle.loads(data)
    ops = [(op.name, pos) for op, _, pos in pickletools.genops(data)]
    kept = [(p, q) for (n, p), (_, q) in zip(ops, [*ops[1:], ("", len(data))]) if n not in ("PROTO", "FRAME")]
    body = b"".join(data[p:q] for p, q in kept)
    starts = list(accumulate((q - p for p, q in kept[:-1]), initial=0))  # each opcode's offset in body
    crossed = same = 0
    for _ in range(150):
        cuts = {
            rng.choice(starts) if rng.random() < 0.6 else rng.randrange(1, len(body))
            for _ in range(rng.randrange(1, 6))
        }
        bounds = [0, *sorted(cuts - {0}), len(body)]
        framed = data[:2] + b"".join(
            b"\x95" + (b - a).to_bytes(8, "little") + body[a:b] for a, b in zip(bounds, bounds[1:])
        )
        ref = _outcome(pickle._loads, framed)  # type: ignore[attr-defined]
        got = _outcome(ours, framed)
        if isinstance(ref, str) and "before end of frame" in ref:
            assert isinstance(got, str) and got.startswith(f"UnpicklingError: {CROSSING} (its end: byte "), got
            crossed += 1
        elif not isinstance(ref, str):
            assert got == ref
            same += 1
        else:  # the next header read as an argument: garbage to every reader
            assert not isinstance(got, str) or CROSSING not in got
    assert crossed and same


def test_pickle_input_is_bytesio_where_no_frame_can_be_read() -> None:
    """Protocols 2-3 (0x95 bytes in ints and text, no FRAME): read through ``io.BytesIO``, no Python call per opcode;
    a 0x95 byte followed by a length that fits, or a stream of 0x95 bytes, gets the frame checks."""
    value = {"ints": [0x95 * 257**i for i in range(8)], "text": ["\u0155" * 9]}
    for protocol in (2, 3):
        data = pickle.dumps(value, protocol=protocol)
        assert data.count(b"\x95") > 8 and isinstance(pickle_input(data), io.BytesIO)
    assert isinstance(pickle_input(pickle.dumps(value, protocol=4)), FramedInput)
    assert isinstance(pickle_input(b"\x80\x02\x95" + (2).to_bytes(8, "little") + b"N."), FramedInput)
    assert isinstance(pickle_input(b"\x95" * 5000), FramedInput)
