"""The one safetensors module: its dtype table (against the safetensors library), its header reader and writer.

Every safetensors header ckpttool reads (``HuggingFaceStorageWriter`` checkpoints, ``validate
--against`` references, manifest checks) goes through :func:`ckpttool.format.safetensors.read_header`:
one cap, one duplicate-key policy; each caller words the refusal in its own error.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from ckpttool.errors import CkptError, JsonDepthError, MetadataError, UsageError
from ckpttool.format import CheckpointReader
from ckpttool.format.limits import limits
from ckpttool.format.metadata import DTYPE_ITEMSIZE
from ckpttool.format.safetensors import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_TAGS,
    HeaderEntry,
    HeaderError,
    build_header,
    header_cap,
    read_header,
)
from ckpttool.ops.validate.reference import load_reference

#: The safetensors ``Dtype`` tags ckpttool reads and writes (safetensors/src/tensor.rs).
_TAGS = {
    "BOOL",
    "U8",
    "I8",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "C64",
}
#: Tags ``safetensors.torch`` knows that ckpttool does not map (AMD's fnuz float8 formats).
_NOT_MAPPED = {"F8_E4M3FNUZ", "F8_E5M2FNUZ"}


def test_dtype_table_round_trips() -> None:
    assert set(SAFETENSORS_TAGS) == _TAGS
    assert len(SAFETENSORS_TAGS) == len(SAFETENSORS_DTYPES)  # one tag per name, one name per tag
    for name, tag in SAFETENSORS_DTYPES.items():
        assert SAFETENSORS_TAGS[tag] == name and name in DTYPE_ITEMSIZE
    for tag, name in SAFETENSORS_TAGS.items():
        assert SAFETENSORS_DTYPES[name] == tag


def test_dtype_table_matches_safetensors_torch() -> None:
    import safetensors.torch as st

    for tag, dtype in st._TYPES.items():
        if dtype is None:  # a dtype this torch lacks
            continue
        if tag in _NOT_MAPPED:
            assert str(dtype).removeprefix("torch.") not in SAFETENSORS_DTYPES
            continue
        assert SAFETENSORS_TAGS[tag] == str(dtype).removeprefix("torch."), tag
    for name, tag in SAFETENSORS_DTYPES.items():  # what safetensors writes for each dtype (F8_E8M0 too)
        data = st.save({"t": torch.zeros(3, dtype=torch.float32).to(getattr(torch, name))})
        (n,) = struct.unpack("<Q", data[:8])
        assert json.loads(data[8 : 8 + n])["t"]["dtype"] == tag, name


def test_written_header_reads_back(tmp_path: Path) -> None:
    entries = [HeaderEntry(f"t.{name}", name, (2, 3)) for name in SAFETENSORS_DTYPES]
    prefix, placed = build_header(entries, {"format": "pt"})
    path = tmp_path / "x.safetensors"
    path.write_bytes(prefix + b"\0" * placed[-1].end)
    header, data_start = read_header(path)
    assert data_start == len(prefix) and data_start % 8 == 0
    assert header.pop("__metadata__") == {"format": "pt"}
    for e in placed:
        assert header[e.name] == {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": [2, 3],
            "data_offsets": [e.begin, e.end],
        }


# ------------------------------------------------------------------------------------------ the reader's refusals
def _file(path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def _padded(n: int) -> bytes:
    """A valid header of exactly ``n`` bytes (one 4-byte F32 tensor)."""
    h = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    return h + b" " * (n - len(h))


def _hf_error(tmp_path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> CkptError:
    ck = tmp_path / "hf"
    ck.mkdir(exist_ok=True)
    _file(ck / "model-00001-of-00001.safetensors", header, length, data)
    with pytest.raises(CkptError) as ei:
        CheckpointReader(ck)
    return ei.value


def _ref_error(tmp_path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> CkptError:
    path = _file(tmp_path / "ref.safetensors", header, length, data)
    with pytest.raises(CkptError) as ei:
        load_reference(path)
    return ei.value


def test_header_at_the_cap_is_read_one_past_is_refused(tmp_path: Path) -> None:
    with limits(max_object_bytes=96):
        assert header_cap() == 96
        header, start = read_header(_file(tmp_path / "at.safetensors", _padded(96), data=b"\0" * 4))
        assert start == 104 and header["a"]["dtype"] == "F32"
        assert set(load_reference(tmp_path / "at.safetensors").tensors) == {"a"}
        with pytest.raises(HeaderError) as ei:
            read_header(_file(tmp_path / "past.safetensors", _padded(97), data=b"\0" * 4))
        assert (ei.value.kind, ei.value.length, ei.value.cap) == ("too_long", 97, 96)
        hf = _hf_error(tmp_path, _padded(97), data=b"\0" * 4)
        assert (
            isinstance(hf, MetadataError) and "header length 97 exceeds the file (109 bytes) or 96 bytes" in hf.message
        )
        ref = _ref_error(tmp_path, _padded(97), data=b"\0" * 4)
        assert isinstance(ref, UsageError) and "safetensors header of 97 bytes is implausible" in ref.message


def test_max_header_bytes_exactly_is_read_one_past_is_not(tmp_path: Path) -> None:
    assert header_cap() == MAX_HEADER_BYTES == 100_000_000  # safetensors' MAX_HEADER_SIZE, below the object cap
    for n, kind in ((MAX_HEADER_BYTES, "not_json"), (MAX_HEADER_BYTES + 1, "too_long")):
        path = tmp_path / f"{n}.safetensors"
        with path.open("wb") as f:  # sparse: n zero bytes of header, never written
            f.write(struct.pack("<Q", n))
            f.truncate(8 + n)
        with pytest.raises(HeaderError) as ei:
            read_header(path)
        assert ei.value.kind == kind  # at the cap the header is read (and is not JSON); past it, it is not read


def test_duplicate_keys_are_refused_for_every_caller(tmp_path: Path) -> None:
    dup = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1]}}'
    with pytest.raises(HeaderError) as ei:
        read_header(_file(tmp_path / "d.safetensors", dup, data=b"\0" * 4))
    assert ei.value.kind == "not_json" and "duplicate key 'a'" in str(ei.value.cause)
    hf = _hf_error(tmp_path, dup, data=b"\0" * 4)
    assert isinstance(hf, MetadataError) and "header is not JSON: duplicate key 'a'" in hf.message
    ref = _ref_error(tmp_path, dup, data=b"\0" * 4)
    assert isinstance(ref, UsageError) and "safetensors header holds a duplicate key 'a'" in ref.message
    nested = b'{"__metadata__": {"x": "1", "x": "2"}}'  # in any object of the header
    assert "duplicate key 'x'" in _hf_error(tmp_path, nested).message
    assert "duplicate key 'x'" in _ref_error(tmp_path, nested).message


@pytest.mark.parametrize(
    "header,length,hf_says,ref_says",
    [
        (b"", 3, "not a valid safetensors file (", "not a safetensors file (shorter than 8 bytes)"),
        (b"{}", 10**6, "header length 1000000 exceeds the file (10 bytes)", "runs past the end of the file (10 bytes)"),
        (b"\xff\xfe", None, "header is not JSON: 'utf-8' codec", "safetensors header is not JSON"),
        (b'{"a": ', None, "header is not JSON: Expecting value", "safetensors header is not JSON"),
        (b"[1, 2]", None, "header is not a JSON object", "safetensors header is not a JSON object"),
    ],
)
def test_each_caller_words_the_refusal_as_before(
    tmp_path: Path, header: bytes, length: int | None, hf_says: str, ref_says: str
) -> None:
    if length == 3:  # a file shorter than the 8-byte length
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "model-00001-of-00001.safetensors").write_bytes(b"abc")
        (tmp_path / "ref.safetensors").write_bytes(b"abc")
        with pytest.raises(MetadataError, match="3 bytes, shorter than the 8-byte header length"):
            CheckpointReader(tmp_path / "hf")
        with pytest.raises(UsageError, match=r"shorter than 8 bytes"):
            load_reference(tmp_path / "ref.safetensors")
        return
    hf = _hf_error(tmp_path, header, length)
    ref = _ref_error(tmp_path, header, length)
    assert isinstance(hf, MetadataError) and hf_says in hf.message, hf.message
    assert isinstance(ref, UsageError) and ref_says in ref.message, ref.message


def test_nesting_past_the_json_bounds_is_refused_for_every_caller(tmp_path: Path) -> None:
    deep = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": ' + b"[" * 200 + b"]" * 200 + b"}}"
    for err in (_hf_error(tmp_path, deep, data=b"\0" * 4), _ref_error(tmp_path, deep, data=b"\0" * 4)):
        assert isinstance(err, JsonDepthError) and "nested deeper than 100 levels" in err.message


def _header_by_json_dumps(entries: list[HeaderEntry], metadata: dict[str, str] | None) -> bytes:
    """The header as a dict per tensor through ``json.dumps`` (the reference for the joined text)."""
    order = sorted(range(len(entries)), key=lambda i: -DTYPE_ITEMSIZE[entries[i].dtype])
    pos, header = 0, {"__metadata__": dict(metadata or {"format": "pt"})}
    for i in order:
        e = entries[i]
        header[e.name] = {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [pos, pos + e.nbytes],
        }
        pos += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def test_the_joined_header_is_the_bytes_json_dumps_writes() -> None:
    import random

    from ckpttool.ops.export.formats.hf import index_json

    rng = random.Random(1)
    names = ["a", 'q"uote', "é\u2028x", "tab\there", "\U0001f600", "back\\slash", "model.layers.0.w"]
    for _ in range(200):
        entries = [
            HeaderEntry(
                f"{rng.choice(names)}{i}",
                rng.choice(["float32", "bfloat16", "int8", "float64"]),
                tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3))),
            )
            for i in range(rng.randint(0, 20))
        ]
        metadata = rng.choice([None, {"format": "pt", "x": 'ü"y'}, {}])
        assert build_header(entries, metadata)[0] == _header_by_json_dumps(entries, metadata)
        weight_map = dict(sorted((e.name, rng.choice(["model.safetensors", "ü.safetensors"])) for e in entries))
        total = rng.randint(0, 10**12)
        want = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        assert index_json(total, weight_map) == want.encode()
