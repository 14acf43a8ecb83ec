"""The one read helper: reads that come back short at any position still fill the buffer exactly;
the end of the file is a ShortReadError naming where and how much; block pieces tile the range."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpttool.engine import io as eio
from ckpttool.engine.io import (
    BLOCK_BYTES,
    ShortReadError,
    block_buffer,
    read_blocks,
    read_exact,
    read_into,
    read_upto,
    write_all,
)

DATA = bytes((i * 7 + 3) % 251 for i in range(5000))


@pytest.fixture
def fd(tmp_path: Path):
    p = tmp_path / "data.bin"
    p.write_bytes(DATA)
    f = os.open(p, os.O_RDONLY)
    yield f
    os.close(f)


def _short_once_at(monkeypatch: pytest.MonkeyPatch, cut: int) -> list[int]:
    """Make the first read that spans file offset ``cut`` stop there (a short read at that position)."""
    real = os.preadv
    calls: list[int] = []
    state = {"cut": True}

    def preadv(f: int, bufs: list, offset: int) -> int:
        calls.append(offset)
        want = sum(len(memoryview(b)) for b in bufs)
        if state["cut"] and offset < cut < offset + want:
            state["cut"] = False
            return real(f, [memoryview(bufs[0])[: cut - offset]], offset)
        return real(f, bufs, offset)

    monkeypatch.setattr(eio.os, "preadv", preadv)
    return calls


@pytest.mark.parametrize("cut", [1, 2, 17, 999, 1000, 1001, 2500, 2999])
def test_read_into_fills_the_buffer_across_a_short_read_at_any_position(
    fd: int, monkeypatch: pytest.MonkeyPatch, cut: int
) -> None:
    calls = _short_once_at(monkeypatch, 1000 + cut)
    buf = bytearray(3000)
    assert read_into(fd, buf, 1000) == 3000
    assert bytes(buf) == DATA[1000:4000]
    assert len(calls) == 2  # the short read and the one that finished the buffer


def test_read_into_takes_any_writable_buffer(fd: int) -> None:
    np = pytest.importorskip("numpy")
    a = np.empty(250, dtype=np.uint32)  # 1000 bytes
    read_into(fd, a, 8)
    assert a.tobytes() == DATA[8:1008]


@pytest.mark.parametrize(("offset", "n"), [(4990, 11), (5000, 1), (6000, 4), (0, 5001)])
def test_end_of_file_is_a_short_read_error(fd: int, offset: int, n: int) -> None:
    with pytest.raises(ShortReadError) as ei:
        read_into(fd, bytearray(n), offset)
    have = max(0, len(DATA) - offset)
    assert ei.value.offset == offset + have
    assert ei.value.missing == n - have
    assert isinstance(ei.value, EOFError)
    assert f"{n - have} bytes short" in str(ei.value)
    with pytest.raises(ShortReadError):
        read_exact(fd, n, offset)
    with pytest.raises(ShortReadError):
        list(read_blocks(fd, offset, n, memoryview(bytearray(3))))


def test_read_exact_and_read_upto(fd: int) -> None:
    assert read_exact(fd, 10, 20) == DATA[20:30]
    assert read_exact(fd, 0, 5000) == b""
    assert read_upto(fd, 10, 20) == DATA[20:30]
    assert read_upto(fd, 100, 4950) == DATA[4950:]  # the file ends first: fewer bytes, no error
    assert read_upto(fd, 100, 9000) == b""


@pytest.mark.parametrize("bufsize", [1, 3, 64, 1000, 4096])
@pytest.mark.parametrize(("offset", "length"), [(0, 0), (0, 5000), (7, 1), (7, 4093), (4999, 1)])
def test_read_blocks_pieces_tile_the_range_exactly(fd: int, bufsize: int, offset: int, length: int) -> None:
    buf = memoryview(bytearray(bufsize))
    pieces = [bytes(p) for p in read_blocks(fd, offset, length, buf)]
    assert b"".join(pieces) == DATA[offset : offset + length]
    assert all(0 < len(p) <= bufsize for p in pieces)


@pytest.mark.parametrize("cut", [1, 63, 64, 65, 130])
def test_read_blocks_across_a_short_read(fd: int, monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    _short_once_at(monkeypatch, 100 + cut)
    pieces = [bytes(p) for p in read_blocks(fd, 100, 200, memoryview(bytearray(64)))]
    assert b"".join(pieces) == DATA[100:300]


def test_block_buffer_is_per_thread_and_reused() -> None:
    import threading

    a = block_buffer()
    assert len(a) == BLOCK_BYTES and a is block_buffer()
    other: list[memoryview] = []
    t = threading.Thread(target=lambda: other.append(block_buffer()))
    t.start()
    t.join()
    assert other[0] is not a


def test_write_all_finishes_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite

    def pwrite(f: int, data: object, offset: int) -> int:
        return real(f, memoryview(data)[:7], offset)  # type: ignore[arg-type]

    monkeypatch.setattr(eio.os, "pwrite", pwrite)
    p = tmp_path / "out.bin"
    p.write_bytes(b"\0" * 10)
    f = os.open(p, os.O_RDWR)
    try:
        write_all(f, DATA[:100], 5)
    finally:
        os.close(f)
    assert p.read_bytes() == b"\0" * 5 + DATA[:100]
