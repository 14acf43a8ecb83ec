"""The native lockstep scan (``engine/native/scan.c``, :func:`ckpttool.engine.scan.run_scan`) against numpy.

Every stream's CRC-32 equals ``zlib.crc32`` of its bytes; its statistics equal the numpy kernel's
(:func:`~ckpttool.engine.stats.add_slab`, slab by slab) exactly but for the sums (relative 1e-6); the
pair kernels equal numpy's formulas, and hand back exactly the slabs numpy finds a difference,
a non-finite master or a zero second moment in; through mappings of the file and through ``pread`` alike.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from ckpttool.engine import stats
from ckpttool.engine.io import ShortReadError
from ckpttool.engine.kernels import f32_to_bf16
from ckpttool.engine.plan import Lockstep, PairKernel, Scan, Window
from ckpttool.engine.scan import run_scan
from ckpttool.engine.stats import Need, SlabStats, add_slab
from tests.engine.test_stats_native import _EXACT

pytestmark = pytest.mark.skipif(not stats.native_stats(), reason="native kernels not built or CKPTTOOL_NATIVE=0")

N, SLAB = 5003, 512  # several slabs, a short last one
_FOLDS = (Need(negative=True, bound=1e4), Need(zeros=True, sums=True), Need(zeros=True, sums=True), None)


def _streams() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    master = (rng.standard_normal(N) * 0.02).astype(np.float32)
    master[100:140] = 1e-39  # subnormals in slab 0
    param = np.empty(N, np.uint16)
    f32_to_bf16(master.view(np.uint32), param, use_torch=False)
    param[1500] ^= 1  # slab 2: a parameter that is not its master rounded
    master[3000] = np.nan  # slab 5: a non-finite master
    param[4100] = 0x7F00  # slab 8: beyond the bound (a huge parameter)
    m = (rng.standard_normal(N) * 1e-3).astype(np.float32)
    v = (m * m * rng.uniform(0.5, 2.0, N)).astype(np.float32)
    v[2100] = 0.0  # slab 4: a zero second moment under a non-zero first one
    m[4700] = 3e19  # slab 9: a square that overflows float32
    return {"param": param, "master": master, "m": m, "v": v}


def _reference(arrs: list[np.ndarray], dtypes: tuple[str, ...]) -> tuple[list[SlabStats], set[int], set[int], float]:
    """numpy's slab-by-slab statistics, the slabs the ``equal`` and ``ratio`` kernels must hand back, and the
    ratio's maximum over the others."""
    accs = [SlabStats() for _ in arrs]
    equal_back, ratio_back, top = set(), set(), -np.inf
    for k, e0 in enumerate(range(0, N, SLAB)):
        sl = [a[e0 : e0 + SLAB] for a in arrs]
        for acc, a, d, need in zip(accs, sl, dtypes, _FOLDS):
            if need is not None:
                add_slab(acc, a.view(np.uint8), d, need)
        rounded = np.empty(sl[0].size, np.uint16)
        f32_to_bf16(sl[1].view(np.uint32), rounded, canonical_nan=False, use_torch=False)
        if (rounded != sl[0]).any() or not np.isfinite(sl[1]).all():
            equal_back.add(k)
        with np.errstate(all="ignore"):
            r = (sl[2] * sl[2]) / sl[3]
        if np.isinf(np.fmax.reduce(r)):
            ratio_back.add(k)
        else:
            top = max(top, float(np.fmax.reduce(r)))
    return accs, equal_back, ratio_back, top


@pytest.mark.parametrize("mapped", ["1", "0"])
def test_scan_equals_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: str) -> None:
    monkeypatch.setenv("CKPTTOOL_SCAN_MMAP", mapped)  # read-only mappings of the file, or pread into the buffers
    arrs = _streams()
    path = tmp_path / "data"
    raw = [a.tobytes() for a in arrs.values()]
    path.write_bytes(b"x" * 3 + b"".join(raw))  # an odd start
    dtypes = ("bfloat16", "float32", "float32", "float32")
    back: list[tuple[int, int, list[bytes]]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = np.cumsum([3] + [len(r) for r in raw])
        streams = tuple((Window(fd, int(o), len(r)),) for o, r in zip(offsets, raw))
        pairs = (PairKernel("equal", 0, 1), PairKernel("adam", 2, 3, 1e-8), PairKernel("ratio", 2, 3))
        scan = Scan(dtypes, _FOLDS, pairs, lambda s, e0, which: back.append((e0, which, [bytes(x) for x in s])))
        res = run_scan(Lockstep(streams, (2, 4, 4, 4), lambda s, _: None, SLAB, scan))
        # the streams whose CRC-32 is not asked for: the same statistics and pairs, no CRC-32
        part = Scan(dtypes, _FOLDS, pairs, lambda *_: None, (True, False, False, True))
        some = run_scan(Lockstep(streams, (2, 4, 4, 4), lambda s, _: None, SLAB, part))
        with pytest.raises(ShortReadError):
            short = Scan(("bfloat16",), (Need(),))
            run_scan(Lockstep(((Window(fd, len(raw[0]), 100 * N),),), (2,), lambda s, _: None, SLAB, short))
    finally:
        os.close(fd)
    assert res is not None and some is not None
    assert res.crcs == tuple(zlib.crc32(r) for r in raw)
    assert some.crcs == (res.crcs[0], None, None, res.crcs[3])
    assert some.stats == res.stats
    assert some.pairs == res.pairs
    accs, equal_back, ratio_back, top = _reference(list(arrs.values()), dtypes)
    for got, want, need in zip(res.stats, accs, _FOLDS):
        if need is None:
            continue
        assert got is not None
        assert {f: getattr(got, f) for f in _EXACT} == {f: getattr(want, f) for f in _EXACT}
        assert got.s1 == pytest.approx(want.s1, rel=1e-6, abs=1e-12) and got.s2 == pytest.approx(want.s2, rel=1e-6)
    assert res.stats[0] is not None and res.stats[0].subnormal == 40 and res.stats[0].beyond == 1
    assert res.stats[3] is None
    assert {e0 // SLAB for e0, which, _ in back if which & 1} == equal_back == {2, 5, 8}
    assert {e0 // SLAB for e0, which, _ in back if which & 4} == ratio_back == {4, 9}
    assert res.pairs[2].top == top
    for e0, _, slabs in back:  # the handed-back slabs hold the values
        assert slabs == [r[e0 * w : (e0 + SLAB) * w] for r, w in zip(raw, (2, 4, 4, 4))]
    m, v = arrs["m"], arrs["v"]
    with np.errstate(all="ignore"):
        u = m / (np.sqrt(np.maximum(v, 0)) + np.float32(1e-8))
    u = u[np.isfinite(u)]
    assert res.pairs[1].count == u.size and res.pairs[1].top == float(np.abs(u).max())
    # each square in float64, as numpy's adam_update (sum_squares): 3e19 / ~1e-3 squared stays finite
    assert res.pairs[1].s2 == pytest.approx(float(np.sum(np.square(u.astype(np.float64)))), rel=1e-6)


@pytest.mark.parametrize("mapped", ["1", "0"])
def test_scan_hands_back_across_mappings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: str) -> None:
    """Slabs handed back in the first and in a later mapping of a window (4 MiB of FP32: 16 slabs of 64 Ki values)
    come back whole, and the scan goes on after each; CRC-32s and the ratio's maximum as numpy's."""
    monkeypatch.setenv("CKPTTOOL_SCAN_MMAP", mapped)
    slab, n = 1 << 16, 19 * (1 << 16) + 100
    rng = np.random.default_rng(3)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (m * m * rng.uniform(0.5, 2.0, n)).astype(np.float32)
    v[3 * slab + 5] = v[17 * slab + 9] = 0.0  # slabs 3 and 17: zero second moments (the exact path)
    raw = [m.tobytes(), v.tobytes()]
    path = tmp_path / "data"
    path.write_bytes(b"y" + b"".join(raw))
    back: list[tuple[int, list[bytes]]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        streams = ((Window(fd, 1, len(raw[0])),), (Window(fd, 1 + len(raw[0]), len(raw[1])),))
        scan = Scan(("float32", "float32"), (Need(zeros=True, sums=True), None), (PairKernel("ratio", 0, 1),),
                    lambda s, e0, _: back.append((e0, [bytes(x) for x in s])))  # fmt: skip
        res = run_scan(Lockstep(streams, (4, 4), lambda s, _: None, slab, scan))
    finally:
        os.close(fd)
    assert res is not None and res.crcs == tuple(zlib.crc32(r) for r in raw)
    assert [e0 // slab for e0, _ in back] == [3, 17]
    for e0, slabs in back:
        assert slabs == [r[e0 * 4 : (e0 + slab) * 4] for r in raw]
    want = SlabStats()
    for e0 in range(0, n, slab):
        add_slab(want, m[e0 : e0 + slab].view(np.uint8), "float32", Need(zeros=True, sums=True))
    got = res.stats[0]
    assert got is not None and {f: getattr(got, f) for f in _EXACT} == {f: getattr(want, f) for f in _EXACT}
    keep = np.ones(n, bool)
    keep[3 * slab : 4 * slab] = keep[17 * slab : 18 * slab] = False
    with np.errstate(divide="ignore"):
        assert res.pairs[0].top == float(np.fmax.reduce((m * m / v)[keep]))


def test_scan_of_a_file_truncated_under_it(tmp_path: Path) -> None:
    """A file cut short while it is scanned (its mapped pages gone: SIGBUS) gives the short-read error the
    ``pread`` path gives, never a dead process; the scans before the cut and after a restore are whole."""
    n = 1 << 20
    data = np.arange(n, dtype=np.float32).tobytes()
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    stop, cutting = threading.Event(), threading.Event()

    def cut() -> None:
        while not stop.is_set():
            os.ftruncate(fd, 4096)
            cutting.set()
            os.pwrite(fd, data[4096:], 4096)

    def scan() -> int:
        ls = Lockstep(((Window(fd, 0, len(data)),),), (4,), lambda s, _: None, 1 << 15, Scan(("float32",), (Need(),)))
        res = run_scan(ls)
        assert res is not None
        return res.crcs[0]

    try:
        assert scan() == zlib.crc32(data)
        short = 0
        t = threading.Thread(target=cut)
        t.start()
        try:
            assert cutting.wait(60)
            # the scans race the cutter and on a busy machine many fall between its cuts: scan until
            # one is cut short (bounded by a count, not by time)
            for _ in range(20_000):
                try:
                    scan()
                except ShortReadError:
                    short += 1
                    break
        finally:
            stop.set()
            t.join()
        os.pwrite(fd, data, 0)
        assert short > 0 and scan() == zlib.crc32(data)
    finally:
        os.close(fd)


def test_a_sigbus_sent_after_a_mapped_scan_still_ends_the_process(tmp_path: Path) -> None:
    """The scan's SIGBUS handler takes only faults on its own thread's mappings: ``kill -BUS`` after a mapped
    scan ends the process as it would without ckpttool (before, the handler swallowed it)."""
    (tmp_path / "data").write_bytes(np.arange(1 << 20, dtype=np.float32).tobytes())
    script = textwrap.dedent(
        f"""
        import os, signal
        from ckpttool.engine.plan import Lockstep, Scan, Window
        from ckpttool.engine.scan import run_scan
        from ckpttool.engine.stats import Need
        fd = os.open({str(tmp_path / "data")!r}, os.O_RDONLY)
        ls = Lockstep(((Window(fd, 0, 4 << 20),),), (4,), lambda s, _: None, 1 << 15, Scan(("float32",), (Need(),)))
        assert run_scan(ls) is not None
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
        """
    )
    env = {**os.environ, "CKPTTOOL_SCAN_MMAP": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == -signal.SIGBUS, (run.returncode, run.stdout, run.stderr)
    assert "survived" not in run.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_below_hands_back_exactly_the_slabs_with_a_maximum_below_its_value(tmp_path: Path, dtype: str) -> None:
    """``below`` (amsgrad's ``max_exp_avg_sq`` ``a`` beside ``exp_avg_sq`` ``b``, one dtype) hands back the slabs where
    numpy finds ``a < b`` with ``a`` not negative: ``-0.0`` below a positive value and a finite ``a`` below ``+inf``
    are; a negative ``a`` (``D002``'s), a NaN on either side (``D001``'s), a negative ``b`` and an infinite ``a`` are
    not."""
    from ckpttool.engine.kernels import float_values

    rng = np.random.default_rng(11)
    wide = rng.uniform(1e-8, 1e-2, N)
    b64, a64 = wide, wide * rng.uniform(1.0, 2.0, N)
    a64[SLAB * 0 + 7] = b64[SLAB * 0 + 7]  # equal values: not below
    plants = {
        1: (0.5 * b64[SLAB + 3], None),  # below: handed back
        2: (-1e-3, None),  # negative a: D002's
        3: (np.nan, None),  # NaN a
        4: (None, np.nan),  # NaN b
        5: (-0.0, None),  # -0.0 below a positive b: handed back
        6: (None, -1.0),  # negative b
        7: (np.inf, None),  # infinite a
        8: (None, np.inf),  # a finite a below +inf: handed back
    }
    for k, (a_val, b_val) in plants.items():
        i = k * SLAB + 3
        if a_val is not None:
            a64[i] = a_val
        if b_val is not None:
            b64[i] = b_val

    def stored(x: np.ndarray) -> np.ndarray:
        if dtype == "bfloat16":
            out = np.empty(x.size, np.uint16)
            f32_to_bf16(x.astype(np.float32).view(np.uint32), out, canonical_nan=False, use_torch=False)
            return out
        return x.astype(dtype)

    a, b = stored(a64), stored(b64)  # rounding keeps order: a >= b but where planted
    fa, fb = float_values(a.view(np.uint8), dtype), float_values(b.view(np.uint8), dtype)
    want = set()
    with np.errstate(invalid="ignore"):
        for k, e0 in enumerate(range(0, N, SLAB)):
            sa, sb = fa[e0 : e0 + SLAB], fb[e0 : e0 + SLAB]
            if ((sa < sb) & ~(sa < 0)).any():
                want.add(k)
    assert want == {1, 5, 8}
    raw = [a.tobytes(), b.tobytes()]
    path = tmp_path / "data"
    path.write_bytes(b"".join(raw))
    item = a.dtype.itemsize
    back: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        streams = ((Window(fd, 0, len(raw[0])),), (Window(fd, len(raw[0]), len(raw[1])),))
        scan = Scan((dtype, dtype), (None, None), (PairKernel("below", 0, 1),), lambda s, e0, _: back.append(e0))
        res = run_scan(Lockstep(streams, (item, item), lambda s, _: None, SLAB, scan))
    finally:
        os.close(fd)
    assert res is not None and res.crcs == tuple(zlib.crc32(r) for r in raw)
    assert {e0 // SLAB for e0 in back} == want
