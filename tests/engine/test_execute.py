"""The executor: its sinks produce the same bytes, CRC-32 and digests as a straight read computed
independently (zlib, hashlib, xxhash); halves and sub-ranges combine to the whole."""

from __future__ import annotations

import hashlib
import os
import random
import zlib
from pathlib import Path

import pytest

from ckpttool.engine import execute as ex
from ckpttool.engine.crc import crc32_combine
from ckpttool.engine.execute import can_split, run_item, run_items, run_split
from ckpttool.engine.io import ShortReadError
from ckpttool.engine.plan import Compare, CompareStream, Crc32, Feed, Item, PairedSlabs, Window, WriteAt

_RNG = random.Random(
    20261202
)  # fixed bytes: with os.urandom, B[1] == A[6000] one run in 256 moved the first difference
A = _RNG.randbytes(300_000)
B = _RNG.randbytes(70_001)
assert B[1] != A[6000]  # the stream differs from file a at its first byte past the first window


@pytest.fixture
def files(tmp_path: Path):
    (tmp_path / "a").write_bytes(A)
    (tmp_path / "b").write_bytes(B)
    (tmp_path / "out").write_bytes(b"\xee" * 10)
    fds = [os.open(tmp_path / n, os.O_RDWR) for n in ("a", "b", "out")]
    yield tmp_path, fds
    for f in fds:
        os.close(f)


SEGS = [(0, 1000, 5000), (1, 1, 70_000), (0, 123_456, 100_001), (1, 0, 0)]


def _item(fds: list[int], *sinks, transform=None) -> tuple[Item, bytes]:
    reads = tuple(Window(fds[i], off, n) for i, off, n in SEGS)
    data = b"".join((A, B)[i][off : off + n] for i, off, n in SEGS)
    return Item(reads, tuple(sinks), transform), data


@pytest.mark.parametrize("bufsize", [1 << 20, 4096, 1000, 7])
def test_sinks_match_a_straight_read(files, bufsize: int) -> None:
    xxhash = pytest.importorskip("xxhash")
    tmp, fds = files
    h1, h2, h3 = hashlib.sha256(), xxhash.xxh3_128(), hashlib.blake2b()
    counted: list[int] = []
    item, data = _item(
        fds,
        Crc32(),
        Feed(h1.update),
        Feed(h2.update),
        Crc32(17, 90_000),
        Feed(h3.update, 4999, 75_002),
        Feed(lambda p: counted.append(len(p))),
        WriteAt(fds[2], 33),
    )
    res = run_item(item, buf=memoryview(bytearray(bufsize)))
    assert item.length == len(data) == 175_001
    assert res[0] == zlib.crc32(data)
    assert res[3] == zlib.crc32(data[17:90_000])
    assert h1.hexdigest() == hashlib.sha256(data).hexdigest()
    assert h2.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert h3.hexdigest() == hashlib.blake2b(data[4999:75_002]).hexdigest()
    assert sum(counted) == len(data) and max(counted) <= bufsize
    assert res[1] is None and res[6] is None
    out = (tmp / "out").read_bytes()
    assert out[:10] == b"\xee" * 10 and out[10:33] == b"\0" * 23 and out[33:] == data


@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (4999, 5001), (5000, 75_000), (1, 175_000), (175_001, 175_001)])
def test_sub_ranges_write_their_bytes_and_crcs_combine(files, lo: int, hi: int) -> None:
    tmp, fds = files
    item, data = _item(fds, Crc32(), WriteAt(fds[2], 0))
    crc_lo = run_item(item, lo=0, hi=lo)[0]
    crc_mid = run_item(item, lo=lo, hi=hi)[0]
    crc_hi = run_item(item, lo=hi)[0]
    assert crc_mid == zlib.crc32(data[lo:hi])
    if crc32_combine is not None:
        whole = crc32_combine(crc32_combine(crc_lo, crc_mid, hi - lo), crc_hi, len(data) - hi)
        assert whole == zlib.crc32(data)
    assert (tmp / "out").read_bytes()[: len(data)] == data


@pytest.mark.parametrize("mid", [1, 4096, 5000, 87_500, 175_000])
def test_run_split_equals_run_item(files, mid: int) -> None:
    if crc32_combine is None:
        pytest.skip("no crc32_combine (zlib fallback)")
    tmp, fds = files
    item, data = _item(fds, Crc32(), WriteAt(fds[2], 5), Compare(fds[0], 1000))
    assert can_split(item)
    crc, _, first_diff = run_split(item, mid)
    assert crc == zlib.crc32(data)
    assert (tmp / "out").read_bytes()[5:] == data
    assert first_diff == 5000  # the stream leaves file a after its first window
    assert not can_split(Item(item.reads, (Feed(print),)))
    spans = [(1, None), (0, 4096), (5000, 87_501), (87_500, 175_001), (174_000, 175_000)]
    halves = run_split(Item(item.reads, tuple(Crc32(a, b) for a, b in spans)), mid)
    assert list(halves) == [zlib.crc32(data[a:b]) for a, b in spans]  # each span's parts combined


@pytest.mark.parametrize("split", [None, 1, 60_000, 174_999])
def test_compare_stream_against_other_windows(files, split: int | None) -> None:
    """The other stream's windows cut the data elsewhere; its first difference is a stream position."""
    tmp, fds = files
    item, data = _item(fds)
    changed = bytearray(data)
    changed[100_003] ^= 0x40
    (tmp / "c").write_bytes(bytes(changed))
    c = os.open(tmp / "c", os.O_RDONLY)
    try:
        cuts = [0, 7, 99_999, 100_004, len(data)]
        other = tuple(Window(c, a, b - a) for a, b in zip(cuts, cuts[1:]))
        compared = Item(item.reads, (CompareStream(other), Crc32(0, 100_000)))
        diff, crc = run_item(compared) if split is None else run_split(compared, split)
        assert (diff, crc) == (100_003, zlib.crc32(data[:100_000]))
        assert run_item(Item(item.reads[:1], (CompareStream(other),))) == (None,)  # the first 5000 bytes: equal
        with pytest.raises(ShortReadError):
            run_item(Item(item.reads, (CompareStream(other[:2]),)))  # the other stream ends first
    finally:
        os.close(c)


@pytest.mark.parametrize("seed", range(4))
def test_many_small_windows_and_record_spans(files, seed: int) -> None:
    """Thousands of small windows on both sides and a CRC-32 span per record of each (as ``diff`` plans a
    tensor stored in many chunks): every span's CRC and the first difference are a straight read's, whole,
    in halves and from any block size (spans are fed only the pieces that reach them; the other side is read
    on from where its last read ended)."""
    tmp, fds = files
    rng = random.Random(seed)
    cuts_a = sorted({0, len(A), *rng.sample(range(1, len(A)), 3000)})
    cuts_b = sorted({0, len(A), *rng.sample(range(1, len(A)), 2000)})
    reads = tuple(Window(fds[0], x, y - x) for x, y in zip(cuts_a, cuts_a[1:]))
    changed = bytearray(A)
    at = rng.randrange(len(A)) if seed % 2 else None
    if at is not None:
        changed[at] ^= 0x01
    (tmp / "c").write_bytes(bytes(changed))
    c = os.open(tmp / "c", os.O_RDONLY)
    try:
        other = tuple(Window(c, x, y - x) for x, y in zip(cuts_b, cuts_b[1:]))
        spans = [(x, y) for cuts in (cuts_a, cuts_b) for x, y in zip(cuts, cuts[1:])]
        item = Item(reads, (CompareStream(other), *(Crc32(x, y) for x, y in spans)))
        want = [at, *(zlib.crc32(A[x:y]) for x, y in spans)]
        assert list(run_item(item, buf=memoryview(bytearray(rng.choice([7, 100, 4096]))))) == want
        if crc32_combine is not None:
            assert list(run_split(item, rng.randrange(1, len(A)))) == want
    finally:
        os.close(c)


def test_transform_is_applied_before_the_sinks(files) -> None:
    tmp, fds = files

    def invert(piece: memoryview) -> memoryview:
        return memoryview(bytes(255 - b for b in piece))

    item, data = _item(fds, Crc32(), WriteAt(fds[2], 0), transform=invert)
    expected = bytes(255 - b for b in data)
    (crc, _) = run_item(item, buf=memoryview(bytearray(50_000)))
    assert crc == zlib.crc32(expected)
    assert (tmp / "out").read_bytes() == expected


def test_compare_finds_the_first_differing_position(files) -> None:
    tmp, fds = files
    changed = bytearray(A)
    changed[123_457] ^= 1
    (tmp / "c").write_bytes(bytes(changed))
    c = os.open(tmp / "c", os.O_RDONLY)
    try:
        assert run_item(Item.of(fds[0], 0, len(A), Compare(c, 0)))[0] == 123_457
        assert run_item(Item.of(fds[0], 0, 100_000, Compare(c, 0)))[0] is None
        assert run_item(Item.of(fds[0], 100_000, 50_000, Compare(c, 100_000)))[0] == 23_457
        with pytest.raises(ShortReadError):
            run_item(Item.of(fds[0], 0, len(A), Compare(c, 1)))  # the compared file ends first
    finally:
        os.close(c)


def test_a_window_past_the_end_is_a_short_read(files) -> None:
    _, fds = files
    with pytest.raises(ShortReadError) as ei:
        run_item(Item.of(fds[1], 70_000, 10, Crc32()))
    assert (ei.value.offset, ei.value.missing) == (70_001, 9)


def test_run_items_keeps_item_order(files) -> None:
    _, fds = files
    items = [Item.of(fds[0], i * 1000, 999 + i, Crc32()) for i in range(40)]
    assert run_items(items, workers=3) == [(zlib.crc32(A[i * 1000 : i * 1000 + 999 + i]),) for i in range(40)]


def test_writeback_is_started_every_interval_and_covers_the_range(files, monkeypatch: pytest.MonkeyPatch) -> None:
    _, fds = files
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(ex, "start_writeback", lambda fd, off, n: calls.append((fd, off, n)))
    run_item(Item.of(fds[0], 0, 10_000, WriteAt(fds[2], 100, 3000)), buf=memoryview(bytearray(1024)))
    assert all(fd == fds[2] for fd, _, _ in calls)
    at = 100
    for _, off, n in calls:
        assert off == at and n >= 3000 or off + n == 10_100
        at = off + n
    assert at == 10_100


def test_lockstep_reads_streams_slab_aligned_with_their_crcs(tmp_path) -> None:
    """A :class:`Lockstep` hands slab ``k`` of every stream together (streams of other item sizes, a stream
    split over two windows, a short last slab) and returns each stream's CRC-32; a stream that ends
    early is a ``ShortReadError``."""
    import numpy as np

    from ckpttool.engine.crc import crc32
    from ckpttool.engine.execute import run_lockstep
    from ckpttool.engine.io import ShortReadError
    from ckpttool.engine.plan import Lockstep, Window

    a = np.arange(1000, dtype=np.float32)
    b = np.arange(1000, dtype=np.float64) * -1
    path = tmp_path / "two.bin"
    path.write_bytes(b"pad" + a.tobytes() + b.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        got: list[tuple[int, np.ndarray, np.ndarray]] = []
        half = 3 + 4000 + 4000  # b's windows: its two halves
        streams = ((Window(fd, 3, 4000),), (Window(fd, 4003, 4000), Window(fd, half, 4000)))
        crcs = run_lockstep(
            Lockstep(
                streams,
                (4, 8),
                lambda s, e0: got.append((e0, s[0].view(np.float32).copy(), s[1].view(np.float64).copy())),
                300,
            )
        )
        assert [g[0] for g in got] == [0, 300, 600, 900]
        assert np.array_equal(np.concatenate([g[1] for g in got]), a)
        assert np.array_equal(np.concatenate([g[2] for g in got]), b)
        assert crcs == (crc32(a.view(np.uint8), 0), crc32(b.view(np.uint8), 0))
        with pytest.raises(ShortReadError):
            run_lockstep(
                Lockstep(((Window(fd, 4003, 8000),), (Window(fd, 8003, 8000),)), (8, 8), lambda s, e0: None, 300)
            )
    finally:
        os.close(fd)


@pytest.mark.parametrize("bufsize", [1 << 20, 4096, 1000])
def test_paired_slabs_cut_at_multiples_and_pair_the_same_elements(tmp_path: Path, bufsize: int) -> None:
    """Slabs of a 2-byte stream (three windows) beside a 4-byte stream (two windows): the same elements,
    cut at multiples of the slab whatever the read sizes; the other stream's span CRC-32s as zlib's."""
    n, slab = 10_001, 1500
    mine, theirs = os.urandom(2 * n), os.urandom(4 * n)
    (tmp_path / "m").write_bytes(mine)
    (tmp_path / "t").write_bytes(b"xx" + theirs)
    fm, ft = os.open(tmp_path / "m", os.O_RDONLY), os.open(tmp_path / "t", os.O_RDONLY)
    try:
        got: list[tuple[int, bytes, bytes]] = []
        spans = ((0, 4 * 3000), (4 * 3000, 4 * n), (7, 12_345))
        sink = PairedSlabs(
            (Window(ft, 2, 4 * 3000), Window(ft, 2 + 4 * 3000, 4 * (n - 3000))),
            2,
            4,
            slab,
            lambda a, b, first: got.append((first, bytes(a), bytes(b))),
            spans,
        )
        reads = (Window(fm, 0, 2 * 777), Window(fm, 2 * 777, 2 * 5000), Window(fm, 2 * 5777, 2 * (n - 5777)))
        item = Item(reads, (sink,))
        assert not can_split(item)
        (crcs,) = run_item(item, buf=memoryview(bytearray(bufsize)))
    finally:
        os.close(fm)
        os.close(ft)
    assert [g[0] for g in got] == list(range(0, n, slab))
    for first, a, b in got:
        k = min(slab, n - first)
        assert a == mine[2 * first : 2 * (first + k)] and b == theirs[4 * first : 4 * (first + k)]
    assert crcs == tuple(zlib.crc32(theirs[x:y]) for x, y in spans)


@pytest.mark.parametrize("seed", range(3))
def test_paired_slabs_and_lockstep_over_many_windows(tmp_path: Path, seed: int) -> None:
    """The other stream of a :class:`PairedSlabs` and each stream of a :class:`Lockstep` cut into thousands of
    small windows, with a span per window: the same elements and CRC-32s as whole reads (the other stream is
    read on from its last window, its spans fed only the slabs that reach them)."""
    from ckpttool.engine.execute import run_lockstep
    from ckpttool.engine.plan import Lockstep

    rng = random.Random(seed)
    n, slab = 20_000, rng.choice([7, 300, 4096])
    mine, theirs = rng.randbytes(2 * n), rng.randbytes(4 * n)
    (tmp_path / "m").write_bytes(mine)
    (tmp_path / "t").write_bytes(theirs)
    cuts = sorted({0, 4 * n, *rng.sample(range(1, 4 * n), 3000)})
    fm, ft = os.open(tmp_path / "m", os.O_RDONLY), os.open(tmp_path / "t", os.O_RDONLY)
    try:
        windows = tuple(Window(ft, x, y - x) for x, y in zip(cuts, cuts[1:]))
        spans = tuple(zip(cuts, cuts[1:]))
        got: list[tuple[int, bytes, bytes]] = []
        sink = PairedSlabs(windows, 2, 4, slab, lambda a, b, first: got.append((first, bytes(a), bytes(b))), spans)
        (crcs,) = run_item(Item((Window(fm, 0, 2 * n),), (sink,)), buf=memoryview(bytearray(1000)))
        assert b"".join(g[1] for g in got) == mine and b"".join(g[2] for g in got) == theirs
        assert crcs == tuple(zlib.crc32(theirs[x:y]) for x, y in spans)
        seen: list[bytes] = []
        both = run_lockstep(
            Lockstep(((Window(fm, 0, 2 * n),), windows), (2, 4), lambda s, e0: seen.append(bytes(s[1])), slab)
        )
        assert b"".join(seen) == theirs and both == (zlib.crc32(mine), zlib.crc32(theirs))
    finally:
        os.close(fm)
        os.close(ft)
