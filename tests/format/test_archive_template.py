"""Archives checked against a template (``format/archive.py``: ``archive_template``, ``match_template``).

The template check accepts an archive only where the full parser (``parse_tensor_archive``) accepts
it with the template's record and (``verify_crc``) its values pass their CRC-32: checked here for
every single-byte change of a real ``torch.save`` archive (each byte flipped two ways), for CRC
fields rewritten consistently, and for archives of another layout. Archives come from
``torch.save`` itself, so their serialization ids differ as in a real ``dcp.save``.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch

from ckpttool.errors import CkptError
from ckpttool.format.archive import (
    ArchiveError,
    BytesWindow,
    archive_template,
    match_template,
    parse_tensor_archive,
)


def _save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _slow_accepts(data: bytes, want: object, verify_crc: bool) -> bool:
    """What the full parser says: the template's record (but its CRC), and the values matching their CRC-32."""
    try:
        rec = parse_tensor_archive(BytesWindow(data))
    except (ArchiveError, CkptError):
        return False
    fields = ("dtype", "size", "stride", "storage_offset", "storage_numel", "data_offset", "compressed_size")
    if any(getattr(rec, f) != getattr(want, f) for f in fields) or rec.deflated or rec.big_endian:
        return False
    values = data[rec.data_offset : rec.data_offset + rec.compressed_size]
    return not verify_crc or zlib.crc32(values) == rec.crc32


@pytest.fixture(scope="module")
def archives() -> list[bytes]:
    g = torch.Generator().manual_seed(3)
    return [_save(torch.randn(4, 16, generator=g).to(torch.bfloat16)) for _ in range(6)]


def _rows(blobs: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(len(blobs), -1)


def test_archives_of_one_layout_match_their_template(archives: list[bytes]) -> None:
    tmpl = archive_template(archives[0], parse_tensor_archive(BytesWindow(archives[0])))
    assert tmpl is not None and tmpl.ident is not None  # torch writes a serialization id
    assert len({a[tmpl.ident.start : tmpl.ident.start + tmpl.ident.size] for a in archives}) > 1
    assert match_template(tmpl, _rows(archives), verify_crc=True).all()


@pytest.mark.parametrize("verify_crc", [True, False])
def test_every_single_byte_change_is_accepted_only_where_the_parser_accepts_it(
    archives: list[bytes], verify_crc: bool
) -> None:
    record = parse_tensor_archive(BytesWindow(archives[0]))
    tmpl = archive_template(archives[0], record)
    assert tmpl is not None
    base = archives[1]
    changed = []
    for pos in range(len(base)):
        for flip in (0x01, 0x80):
            b = bytearray(base)
            b[pos] ^= flip
            changed.append(bytes(b))
    fast = match_template(tmpl, _rows(changed), verify_crc=verify_crc)
    for data, ok in zip(changed, fast.tolist()):
        if ok:
            assert _slow_accepts(data, record, verify_crc)
    # a changed value or serialization-id byte fails its CRC-32; a changed structure byte differs from the template
    assert not fast[: 2 * tmpl.values.start].any()
    assert fast.sum() == (0 if verify_crc else 2 * tmpl.values.size)


def _with_crc(data: bytes, v: object, new: bytes) -> bytes:
    """``data`` with member ``v``'s bytes replaced by ``new`` and every CRC-32 field of it rewritten to match."""
    b = bytearray(data)
    b[v.start : v.start + v.size] = new  # type: ignore[attr-defined]
    for at in v.crcs:  # type: ignore[attr-defined]
        struct.pack_into("<I", b, at, zlib.crc32(new))
    return bytes(b)


def test_consistent_crc_fields_are_accepted_and_inconsistent_ones_refused(archives: list[bytes]) -> None:
    record = parse_tensor_archive(BytesWindow(archives[0]))
    tmpl = archive_template(archives[0], record)
    assert tmpl is not None and tmpl.ident is not None
    ident = tmpl.ident
    good = _with_crc(archives[2], ident, b"9" * ident.size)
    non_ascii = _with_crc(archives[2], ident, "é".encode() + b"1" * (ident.size - 2))  # UTF-8: the parser takes it
    one_field = bytearray(good)
    struct.pack_into("<I", one_field, ident.crcs[-1], 0)
    got = match_template(tmpl, _rows([good, non_ascii, bytes(one_field)]), verify_crc=True).tolist()
    assert got == [True, False, False]  # the non-ASCII id goes to the parser, which accepts it
    assert _slow_accepts(good, record, True) and _slow_accepts(non_ascii, record, True)
    assert not _slow_accepts(bytes(one_field), record, True)


def test_an_archive_of_another_layout_does_not_match(archives: list[bytes]) -> None:
    tmpl = archive_template(archives[0], parse_tensor_archive(BytesWindow(archives[0])))
    assert tmpl is not None
    other = _save(torch.zeros(16, 4, dtype=torch.bfloat16))  # same length, another shape
    assert len(other) == len(archives[0])
    assert not match_template(tmpl, _rows([other]), verify_crc=True).any()
