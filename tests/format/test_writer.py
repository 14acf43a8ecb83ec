"""The torch-free DCP writer: archives and `.metadata` that torch itself reads back identically."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckpttool.format import CheckpointReader, ChunkMeta, DType
from ckpttool.format.reader import load_saved_object
from ckpttool.format.writer import DCPWriter, can_stream, tensor_data_pkl, torch_save_bytes, write_tensor_archive
from ckpttool.ops.reshard import ReshardOptions
from ckpttool.ops.reshard.plan import row_runs


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.bool,
        # torch.save's v3 encoding (UntypedStorage sized in bytes, the dtype last)
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e8m0fnu,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    ],
)
@pytest.mark.parametrize("shape", [(4, 3, 2), (7,), (0, 5), ()])
def test_data_pkl_is_byte_identical_to_torch_save(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    buf = io.BytesIO()
    torch.save(torch.zeros(shape, dtype=dtype), buf)
    want = zipfile.ZipFile(buf).read("archive/data.pkl")
    assert tensor_data_pkl(DType.from_torch(dtype), shape) == want


def test_v3_dtypes_stream_and_others_are_left_to_torch_save() -> None:
    assert can_stream(DType("bfloat16")) and can_stream(DType("float8_e4m3fn")) and can_stream(DType("uint16"))
    assert not can_stream(DType("qint8")) and not can_stream(DType("float4_e2m1fn_x2"))


def test_streamed_float8_archive_loads_in_torch(tmp_path: Path) -> None:
    """A float8 chunk streamed from a source file is a torch.save archive ``torch.load`` reads (weights_only)."""
    w = (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8).to(torch.float8_e4m3fn)
    src = tmp_path / "src.bin"
    src.write_bytes(w.view(torch.uint8).numpy().tobytes())
    out = tmp_path / "a.pt"
    fd = os.open(src, os.O_RDONLY)
    try:
        with open(out, "wb") as f:
            write_tensor_archive(f, DType("float8_e4m3fn"), (4, 6), [(fd, 0, 24)], memoryview(bytearray(1 << 16)))
    finally:
        os.close(fd)
    got = torch.load(out, weights_only=True)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), w.view(torch.uint8))


def test_float8_chunks_are_resharded_through_torch(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckpttool.ops.reshard.execute import reshard

    w = (torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) / 8).to(torch.float8_e4m3fn)
    dcp.save(
        {"model": {"layers.0.mlp.experts.down_proj": w, "n": torch.ones(3, dtype=torch.uint16)}},
        checkpoint_id=str(tmp_path / "src"),
        no_dist=True,
    )
    res = reshard(
        tmp_path / "src", tmp_path / "out", ReshardOptions(to="canonical", target_ep_size=2, target_ep_fsdp_size=1)
    )
    assert res.chunks_rewritten == 2 and res.ep_tensors == 1  # one expert tensor split over 2 EP ranks
    with CheckpointReader(tmp_path / "out") as r:
        got = r.read_tensor("model.layers.0.mlp.experts.down_proj")
        assert torch.equal(got.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(r.read_tensor("model.n"), torch.ones(3, dtype=torch.uint16))


def test_streamed_archive_loads_in_torch_and_is_aligned(tmp_path: Path) -> None:
    t = (torch.arange(5 * 3 * 7, dtype=torch.float32).reshape(5, 3, 7) / 7).to(torch.bfloat16)
    raw = t.view(torch.uint8).numpy().tobytes()
    src = tmp_path / "src.bin"
    src.write_bytes(b"xyz" + raw)
    fd = os.open(src, os.O_RDONLY)
    try:
        out = io.BytesIO(b"prefix")
        out.seek(6)
        half = len(raw) // 2
        write_tensor_archive(
            out,
            DType("bfloat16"),
            (5, 3, 7),
            [(fd, 3, half), (fd, 3 + half, len(raw) - half)],
            memoryview(bytearray(16)),
        )
    finally:
        os.close(fd)
    data = out.getvalue()[6:]
    for weights_only in (True, False):
        assert torch.equal(torch.load(io.BytesIO(data), weights_only=weights_only), t)
    zf = zipfile.ZipFile(io.BytesIO(data))
    assert zf.testzip() is None  # CRC-32 of every record is right
    assert [i.filename for i in zf.infolist()] == [
        "archive/data.pkl",
        "archive/.format_version",
        "archive/.storage_alignment",
        "archive/byteorder",
        "archive/data/0",
        "archive/version",
        "archive/.data/serialization_id",
    ]
    rec = zf.getinfo("archive/data/0")
    hdr = data[rec.header_offset : rec.header_offset + 30]
    start = rec.header_offset + 30 + int.from_bytes(hdr[26:28], "little") + int.from_bytes(hdr[28:30], "little")
    assert start % 64 == 0


@pytest.mark.parametrize("zip64", [False, True])
@pytest.mark.parametrize(("split", "behind"), [(False, False), (True, False), (True, True), (False, True)])
def test_streamed_archive_in_a_real_file_by_pwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zip64: bool, split: bool, behind: bool
) -> None:
    """The data record written by pread/pwrite into a real file after other bytes, CRC by isal; the
    zip64 local header (tensors over 4 GiB) exercised by lowering zipfile's limit: torch's miniz
    reader and zipfile's CRC check read both. ``split``: the record copied in two halves by two
    threads (the path of records of 8 MiB and more), the halves' CRCs combined; the halves meet
    inside a segment. ``behind``: the disk write-back started as the record is written (a writer
    that fsyncs), every 64 bytes here."""
    if zip64:
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)
    if split:
        import ckpttool.format.writer as writer

        monkeypatch.setattr(writer, "_SPLIT_BYTES", 64)
    if behind:
        import ckpttool.format.writer as writer

        monkeypatch.setattr(writer, "WRITEBACK_BYTES", 64)
    t = torch.randn(33, 17, generator=torch.Generator().manual_seed(1))
    raw = t.numpy().tobytes()
    src = tmp_path / "src.bin"
    src.write_bytes(b"12345" + raw)
    fd = os.open(src, os.O_RDONLY)
    out = tmp_path / "out.bin"
    try:
        with open(out, "wb") as f:
            f.write(b"lead")
            write_tensor_archive(f, DType("float32"), (33, 17), [(fd, 5, 1000), (fd, 1005, len(raw) - 1000)],
                                 memoryview(bytearray(256)), behind=behind)  # fmt: skip
            end = f.tell()
            f.write(b"tail")
    finally:
        os.close(fd)
    data = out.read_bytes()
    assert data[:4] == b"lead" and data[end:] == b"tail"
    arc = data[4:end]
    assert torch.equal(torch.load(io.BytesIO(arc), weights_only=True), t)
    zf = zipfile.ZipFile(io.BytesIO(arc))
    assert zf.testzip() is None
    rec = zf.getinfo("archive/data/0")
    hdr = arc[rec.header_offset : rec.header_offset + 30]
    assert (int.from_bytes(hdr[18:22], "little") == 0xFFFFFFFF) is zip64  # sizes in the zip64 extra field
    start = rec.header_offset + 30 + int.from_bytes(hdr[26:28], "little") + int.from_bytes(hdr[28:30], "little")
    assert start % 64 == 0 and arc[start : start + len(raw)] == raw


def test_plain_object_archive(tmp_path: Path) -> None:
    value = json.dumps({"format": "ckpttool.layout", "version": 2})
    data = torch_save_bytes(value)
    assert torch.load(io.BytesIO(data), weights_only=True) == value
    assert load_saved_object(data, "x") == value
    with pytest.raises(TypeError):
        torch_save_bytes({"t": torch.zeros(1)})


def test_metadata_written_without_torch_equals_torch_objects(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    w = DCPWriter(tmp_path, tmp_path)
    t = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    w.declare_tensor("model.w", DType("float32"), (4, 3), ("model", "w"))
    w.write_chunk("model.w", ChunkMeta((2, 0), (2, 3)), 1, t[2:].clone())
    w.write_chunk("model.w", ChunkMeta((0, 0), (2, 3)), 0, t[:2].clone())
    w.write_object("layout", 0, "{}", ("layout",))
    w.finish()
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()  # torch's own plain pickle.load
    tsm = md.state_dict_metadata["model.w"]
    assert tsm.properties.dtype == torch.float32 and tsm.size == torch.Size([4, 3])
    assert [tuple(c.offsets) for c in tsm.chunks] == [(0, 0), (2, 0)]
    assert type(md.state_dict_metadata["layout"]).__name__ == "BytesStorageMetadata"
    assert md.planner_data == {"model.w": ("model", "w"), "layout": ("layout",)} and md.version == "1.0.0"
    infos = {(k.fqn, tuple(k.offset) if k.offset is not None else None): v for k, v in md.storage_data.items()}
    assert infos[("model.w", (2, 0))].relative_path == "__1_0.distcp"
    # A single-process dcp.load reads it back.
    sd = {"model": {"w": torch.zeros(4, 3)}}
    dcp.load(sd, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(sd["model"]["w"], t)
    # Same bytes as pickling torch's real dataclasses? Same objects after unpickling, at least.
    assert pickle.loads(pickle.dumps(md)).state_dict_metadata == md.state_dict_metadata
    with CheckpointReader(tmp_path) as r:  # and ckpttool's allow-list unpickler accepts it
        assert torch.equal(r.read_tensor("model.w"), t)


def test_row_runs_legacy_to_canonical_slabs() -> None:
    # 8 rows, source legacy P=2 F=2 (slabs of 2), target canonical: true slab i is at stored i*? (perm [0,2,1,3]).
    runs = row_runs(8, 4, [0, 2, 1, 3], 1, [0])
    assert runs == [(0, 0, 2), (2, 4, 2), (4, 2, 2), (6, 6, 2)]
    assert row_runs(8, 1, [0], 1, [0]) == [(0, 0, 8)]


def test_verbatim_reshard_never_imports_torch(tmp_path: Path) -> None:
    # The copy path must stay torch-free: `import torch` costs more than copying gigabytes.
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "moe"  # one expert tensor, whole in one chunk: a 1 x 1 target copies every chunk verbatim
    experts = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    dcp.save(
        {"model": {"layers.0.mlp.experts.down_proj": experts, "norm": torch.ones(6)}},
        checkpoint_id=str(src),
        no_dist=True,
    )
    code = (
        "import sys; from ckpttool.ops.reshard import ReshardOptions, reshard; "
        f"r = reshard({str(src)!r}, {str(tmp_path / 'out')!r}, ReshardOptions(to='canonical', target_ep_size=1, "
        "target_ep_fsdp_size=1, with_optimizer=True)); "
        "assert r.chunks_rewritten == 0, r; print('torch' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("into", ["file", "memory"])
@pytest.mark.parametrize(
    ("dtype", "sizes"),
    [("float32", (33, 17)), ("bfloat16", (5, 3, 7)), ("float8_e4m3fn", (4, 6)), ("int64", ()), ("uint16", (0, 4))],
)
def test_direct_archives_are_the_bytes_zipfile_writes(tmp_path: Path, into: str, dtype: str, sizes: tuple) -> None:
    """The archive assembled directly (one write before the storage record, one after) is byte for byte the one
    Python's ``zipfile`` writes for the same members (the writer for records that need zip64), whatever the
    archive's place in the file (its padding), and ``torch.load`` reads it."""
    from ckpttool.format.writer import _archive_members, _RecordSource, _write_archive_direct, _write_archive_zipfile

    dt = DType(dtype)
    n = math.prod(sizes) * dt.itemsize
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * (n // 256 + 1))
    members = _archive_members(dt, sizes, b"0123456789" * 4)
    got = []
    fd = os.open(src, os.O_RDONLY)
    try:
        for write in (_write_archive_zipfile, _write_archive_direct):
            segments = [(fd, 7, n // 2), (fd, 7 + n // 2, n - n // 2)] if n else []
            if into == "file":
                with open(tmp_path / "out", "wb") as f:
                    f.write(b"x" * 13)  # an archive after another one: not at offset 0
                    crc = write(f, members, n, _RecordSource(segments, memoryview(bytearray(64)), None, False))
                data = (tmp_path / "out").read_bytes()[13:]
            else:
                out = io.BytesIO(b"x" * 13)
                out.seek(13)
                crc = write(out, members, n, _RecordSource(segments, memoryview(bytearray(64)), None, False))
                data = out.getvalue()[13:]
            got.append((crc, data))
    finally:
        os.close(fd)
    assert got[0] == got[1]
    want = torch.frombuffer(bytearray(src.read_bytes()[7 : 7 + n]), dtype=torch.uint8) if n else torch.empty(0)
    loaded = torch.load(io.BytesIO(got[1][1]), weights_only=True)
    assert tuple(loaded.shape) == sizes and torch.equal(loaded.reshape(-1).view(torch.uint8), want.view(torch.uint8))
