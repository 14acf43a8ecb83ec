"""Pickle memo bombs and pickles the C unpickler fails on with other exceptions than ``UnpicklingError``.

CPython's C unpickler grows its memo to twice the slot a ``LONG_BINPUT`` names and zeroes it: an
11-byte pickle naming slot 2**27 makes it touch 2 GiB (2**31: 32 GiB) before any check of ours could
run. Every pickle ckpttool reads (``.metadata``, byte items, chunk ``data.pkl``, per-rank files,
torch-checkpointing's ``metadata.pkl``) is refused with its documented code instead. Likewise a pickle
whose ``APPEND`` lands on a set (``AttributeError``), which used to read ``E999``.
"""

from __future__ import annotations

import pickle
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from tests.fixtures.hostile import (
    EXPERT_KEY,
    LR_KEY,
    chunk_archive,
    load_torch_metadata,
    repoint,
    torch_members,
    zip_bytes,
)

runner = CliRunner()

#: PROTO 2, EMPTY_DICT, BINPUT 0, LONG_BINPUT 2**27, STOP: 11 bytes, a 2 GiB memo to the C unpickler
MEMO_BOMB = b"\x80\x02}q\x00r" + struct.pack("<I", 2**27) + b"."
#: PROTO 4, EMPTY_SET, BININT1 1, APPEND, STOP: the C unpickler raises AttributeError ('set' has no 'append')
SET_APPEND = b"\x80\x04\x8fK\x01a."
#: PROTO 5, BYTEARRAY8 of 2**62 bytes, STOP: the C unpickler allocates before it reads (MemoryError) and prints
#: "SystemError: deallocated bytearray object has exported buffers" to stderr (1 in ~400 random 4 KiB .metadata)
BYTEARRAY8_BOMB = b"\x80\x05\x96" + struct.pack("<Q", 2**62) + b"."


def _run(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.stderr


def _assert_refused(code: int, stderr: str, want: str, needle: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert lines[0].startswith(f"error: [{want}]"), stderr
    assert needle in lines[0], stderr
    assert "Traceback" not in stderr and "E999" not in stderr and "SystemError" not in stderr


def _copy(src: Path, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    return ck


def _with_data_pkl(archive: bytes, pkl: bytes) -> bytes:
    members = torch_members(archive)
    for m in members:
        if m.name.endswith("/data.pkl"):
            m.payload, m.size, m.crc = pkl, None, None
    return zip_bytes(members)


@pytest.mark.parametrize(
    "pkl,needle",
    [
        (MEMO_BOMB, "memo index 134217728"),
        (SET_APPEND, "not a readable pickle"),
        (BYTEARRAY8_BOMB, "4611686018427387904 bytes at byte 2"),
    ],
)
def test_metadata(sample_ckpt: Path, tmp_path: Path, pkl: bytes, needle: str) -> None:
    ck = _copy(sample_ckpt, tmp_path)
    (ck / ".metadata").write_bytes(pkl)
    _assert_refused(*_run("--no-cache", "inspect", str(ck)), "E200", needle)


@pytest.mark.parametrize(
    "pkl,needle",
    [
        (MEMO_BOMB, "memo index 134217728"),
        (SET_APPEND, "not a readable pickle"),
        (BYTEARRAY8_BOMB, "4611686018427387904 bytes at byte 2"),
    ],
)
def test_byte_item(sample_ckpt: Path, tmp_path: Path, pkl: bytes, needle: str) -> None:
    ck = _copy(sample_ckpt, tmp_path)
    md = load_torch_metadata(ck)
    info = next(i for k, i in md.storage_data.items() if k.fqn == LR_KEY)
    with open(ck / info.relative_path, "rb") as f:
        f.seek(info.offset)
        archive = f.read(info.length)
    repoint(ck, LR_KEY, None, _with_data_pkl(archive, pkl))
    _assert_refused(*_run("--no-cache", "inspect", str(ck)), "E301", LR_KEY)


@pytest.mark.parametrize(
    "pkl,needle",
    [
        (MEMO_BOMB, "memo index 134217728"),
        (SET_APPEND, "AttributeError"),
        (BYTEARRAY8_BOMB, "4611686018427387904 bytes at byte 2"),
    ],
)
def test_chunk_data_pkl(sample_ckpt: Path, tmp_path: Path, pkl: bytes, needle: str) -> None:
    ck = _copy(sample_ckpt, tmp_path)
    info, archive = chunk_archive(ck, EXPERT_KEY, (0, 0, 0))
    repoint(ck, EXPERT_KEY, (0, 0, 0), _with_data_pkl(archive, pkl))
    code, stderr = _run("--no-cache", "export", str(ck), str(tmp_path / "out"))
    _assert_refused(code, stderr, "E301", EXPERT_KEY)
    assert needle in stderr
    assert not (tmp_path / "out").exists()


def test_the_walk_passes_what_pickle_and_torch_save_write() -> None:
    import io
    import zipfile

    import torch

    from ckpttool.format.pickleframes import check_memo

    obj = {f"k{i}": [i, str(i), (i,)] for i in range(2000)}
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        check_memo(pickle.dumps(obj, protocol=proto))  # PUT lines (0, 1), LONG_BINPUT (2, 3), MEMOIZE (4+)
    bio = io.BytesIO()
    torch.save({f"layers.{i}.w": torch.zeros(2) for i in range(500)}, bio)
    with zipfile.ZipFile(io.BytesIO(bio.getvalue())) as z:
        check_memo(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
    for bomb in (MEMO_BOMB, b"(p99999999\n."):
        with pytest.raises(pickle.UnpicklingError, match="memo index"):
            check_memo(bomb)


@pytest.fixture(scope="module")
def tc_step(fixture_root: Path) -> Path:
    """torch-checkpointing's own 2-rank save (tests/fixtures/perrank.py)."""
    import importlib.util

    from tests.fixtures import perrank
    from tests.fixtures.cache import cached_build

    if importlib.util.find_spec("torch_checkpointing") is None:
        pytest.skip("torch-checkpointing is not installed (pip install --no-deps torch-checkpointing==0.1.1)")
    return cached_build(fixture_root, "perrank_torch_checkpointing", perrank.build_torch_checkpointing) / "w2/step-2"


@pytest.mark.parametrize("pkl,needle", [(MEMO_BOMB, "memo index 134217728"), (SET_APPEND, "not a readable pickle")])
def test_torch_checkpointing_metadata_pkl(tc_step: Path, tmp_path: Path, pkl: bytes, needle: str) -> None:
    d = shutil.copytree(tc_step, tmp_path / "step-2")
    (d / "metadata.pkl").write_bytes(pkl)
    _assert_refused(*_run("inspect", str(d)), "E280", needle)


@pytest.mark.parametrize("pkl,needle", [(MEMO_BOMB, "memo index 134217728"), (SET_APPEND, "not a readable pickle")])
def test_rank_file_data_pkl(tc_step: Path, tmp_path: Path, pkl: bytes, needle: str) -> None:
    d = shutil.copytree(tc_step, tmp_path / "step-2")
    (d / "model_1.pt").write_bytes(_with_data_pkl((d / "model_1.pt").read_bytes(), pkl))
    _assert_refused(*_run("inspect", str(d)), "E280", needle)


def _walk(data: bytes, monkeypatch: pytest.MonkeyPatch, native: bool) -> str:
    """``check_memo(data)`` by the native walk or the Python one: ``ok``, the error, or ``python`` where the native
    walk hands over (a text ``PUT``)."""
    from ckpttool.format import pickleframes as pf

    try:
        if native:
            if not pf.walked(data):
                return "ok"
            return "ok" if pf._native_check(data) else "python"
        with monkeypatch.context() as m:
            m.setattr(pf, "_native_check", lambda d: False)
            pf.check_memo(data)
        return "ok"
    except pf.PickleBombError as e:
        return str(e)


def test_native_memo_walk_agrees_with_the_python_walk(sample_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real pickles (torch.save's data.pkl, .metadata, pickle.dump at protocols 0-5) mutated at random (bytes
    changed, LONG_BINPUTs planted, cuts): the native walk gives the Python walk's verdict and message."""
    import io
    import random
    import zipfile

    import torch

    from ckpttool.engine import native

    if native.function("ckpt_pickle_memo_check", None) is None:
        pytest.skip("native kernels not built")
    buf = io.BytesIO()
    torch.save({"a": torch.zeros(3), "b": [1, 2, {"c": "x" * 300}]}, buf)
    zf = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    data_pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    obj = {"x": list(range(1000)), "y": ["s" * i for i in range(50)], "z": b"q" * 70_000}
    bases = [data_pkl, (sample_ckpt / ".metadata").read_bytes(), *(pickle.dumps(obj, protocol=p) for p in range(6))]
    for bomb in (MEMO_BOMB, BYTEARRAY8_BOMB):
        assert _walk(bomb, monkeypatch, True) == _walk(bomb, monkeypatch, False) != "ok"
    rng = random.Random(20261203)
    verdicts = set()
    for base in bases:
        for _ in range(60):
            d = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                i, c = rng.randrange(len(d)), rng.random()
                if c < 0.4:
                    d[i] = rng.randrange(256)
                elif c < 0.6:
                    d[i : i + 5] = b"r" + struct.pack("<I", rng.choice([2**27, 300, 5000, rng.randrange(2**32)]))
                elif c < 0.8:
                    del d[i : i + rng.randint(1, 8)]
                else:
                    d = d[:i]
            ours = _walk(bytes(d), monkeypatch, True)
            verdicts.add(ours if ours in ("ok", "python") else "refused")
            if ours != "python":
                assert ours == _walk(bytes(d), monkeypatch, False), bytes(d)
    assert verdicts == {"ok", "python", "refused"}
