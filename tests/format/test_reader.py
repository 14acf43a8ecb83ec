"""The safe reader against torch's own `dcp.load` on real checkpoints."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.engine.io import BLOCK_BYTES
from ckpttool.errors import (
    AllocationError,
    ChunkError,
    DataFileError,
    MetadataError,
    TransformError,
    UnsafePickleError,
)
from ckpttool.format import CheckpointDir, CheckpointReader, parse_metadata_bytes, tiling_problem
from ckpttool.format.copy import copy_range
from ckpttool.format.metadata import ChunkMeta, DType, TensorMeta


def torch_load_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, loaded by torch's own reader (the reference)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


@pytest.mark.parametrize("name", ["dense_ckpt", "multi_optim_ckpt", "fsdp_ckpt", "sample_ckpt"])
def test_every_tensor_equals_torch_dcp_load(name: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(name)
    expected = torch_load_all(path)
    with CheckpointReader(path) as r:
        for key, ref in expected.items():
            got = r.read_tensor(key)
            assert got.dtype == ref.dtype and got.shape == ref.shape, key
            assert torch.equal(
                got.view(torch.uint8) if got.dim() else got, ref.view(torch.uint8) if ref.dim() else ref
            ), key


def test_read_chunk_of_fsdp_shard(fsdp_ckpt: Path) -> None:
    expected = torch_load_all(fsdp_ckpt)["model.model.layers.0.odd"]
    with CheckpointReader(fsdp_ckpt) as r:
        meta = r.tensor_meta("model.model.layers.0.odd")
        for chunk in meta.chunks:
            got = r.read_chunk("model.model.layers.0.odd", chunk)
            assert tuple(got.shape) == chunk.sizes
            assert torch.equal(got, expected[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]])


def test_each_chunk_read_once(fsdp_ckpt: Path) -> None:
    with CheckpointReader(fsdp_ckpt) as r:
        meta = r.tensor_meta("model.model.embed_tokens.weight")
        r.read_tensor("model.model.embed_tokens.weight")
        assert r.bytes_read == meta.nbytes  # raw storage bytes only, no intermediate copies


def test_byte_items_are_plain_values(dense_ckpt: Path) -> None:
    with CheckpointReader(dense_ckpt) as r:
        assert r.read_object("optimizer.param_groups.0.lr") == pytest.approx(1e-3)
        assert r.read_object("optimizer.param_groups.0.betas") == (0.9, 0.95)
        params = r.read_object("optimizer.param_groups.0.params")
        assert "model.embed_tokens.weight" in params


def test_metadata_parsing_does_not_import_torch(sample_ckpt: Path) -> None:
    import subprocess

    code = (
        "import sys; from ckpttool.model.catalog import build_catalog, load_param_groups;"
        f"from ckpttool.format import CheckpointReader; r = CheckpointReader({str(sample_ckpt)!r});"
        "c = build_catalog(r); load_param_groups(c, r); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_zstd_transform_is_decoded(tmp_path: Path) -> None:
    zstd = pytest.importorskip("zstandard")
    del zstd
    from torch.distributed.checkpoint._extension import ZStandard

    sd = {"model": {"w": torch.randn(64, 8), "b": torch.arange(5)}}
    writer = dcp.FileSystemWriter(str(tmp_path / "z"), _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=writer)
    with CheckpointReader(tmp_path / "z") as r:
        info = r.storage_info("model.w", r.tensor_meta("model.w").chunks[0])
        assert info.transform_descriptors
        assert torch.equal(r.read_tensor("model.w"), sd["model"]["w"])
        assert torch.equal(r.read_tensor("model.b"), sd["model"]["b"])


def test_zstd_beside_safetensors_serialization_is_refused_naming_the_transform(tmp_path: Path) -> None:
    """``FileSystemWriter(serialization_format=SAFETENSORS, _extensions=[ZStandard()])``: torch writes an empty zstd
    stream per tensor, then the safetensors blob untransformed, and records the transform on every chunk; no torch
    reader loads it. Refused with one line naming the transform (E302), not read as a damaged blob (E200)."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from typer.testing import CliRunner

    from ckpttool.cli.app import app

    for name, sd in (("one", {"w": torch.randn(8, 4)}), ("two", {"w": torch.randn(8, 4), "b": torch.arange(3)})):
        ck = tmp_path / name
        fmt = SerializationFormat.SAFETENSORS
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ck), serialization_format=fmt, _extensions=[ZStandard()]))
        with pytest.raises(TransformError, match=r"stream\.zstd/1"):
            CheckpointReader(ck)
        for cmd in ("inspect", "validate"):
            res = CliRunner().invoke(app, [cmd, str(ck)])
            assert res.exit_code == 2, res.stderr
            lines = res.stderr.splitlines()
            assert lines[0].startswith("error: [E302]") and "__0_0.distcp" in lines[0] and "stream.zstd/1" in lines[0]
            assert lines[1].startswith("hint:") and len(lines) == 2 and res.stdout == ""


def _rewrite_metadata(path: Path, mutate) -> None:  # type: ignore[no-untyped-def]
    md = dcp.FileSystemReader(str(path)).read_metadata()
    mutate(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_unknown_transform_is_refused(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    key = "model.model.norm.weight"

    def mutate(md) -> None:  # type: ignore[no-untyped-def]
        for idx, info in md.storage_data.items():
            if idx.fqn == key:
                info.transform_descriptors = ["stream.rot13/1"]

    _rewrite_metadata(ck, mutate)
    with CheckpointReader(ck) as r, pytest.raises(TransformError, match="stream.rot13"):
        r.read_tensor(key)


def test_truncated_file_is_refused_before_reading(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    data = ck / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with CheckpointReader(ck) as r:
        last = max(r.metadata.storage.items(), key=lambda kv: kv[1].offset)
        fqn = last[0][0]
        with pytest.raises(DataFileError, match="truncated"):
            if last[0][1] is None:
                r.read_object(fqn)
            else:
                r.read_tensor(fqn)


def test_missing_data_file(tmp_path: Path, fsdp_ckpt: Path) -> None:
    ck = shutil.copytree(fsdp_ckpt, tmp_path / "ck")
    (ck / "__2_0.distcp").unlink()
    with CheckpointReader(ck) as r, pytest.raises(DataFileError, match="__2_0.distcp"):
        r.read_tensor("model.model.embed_tokens.weight")


def test_corrupt_archive_and_wrong_shape(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    key = "model.model.norm.weight"
    with CheckpointReader(ck) as r:
        info = r.storage_info(key, r.tensor_meta(key).chunks[0])
    with open(ck / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * 64)
    with CheckpointReader(ck) as r, pytest.raises(ChunkError, match="corrupt"):
        r.read_tensor(key)

    ck2 = shutil.copytree(dense_ckpt, tmp_path / "ck2")

    def mutate(md) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        meta = md.state_dict_metadata[key]
        n = meta.size[0]
        meta.size = torch.Size([n * 2])
        meta.chunks = [
            ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([n])),
            ChunkStorageMetadata(offsets=torch.Size([n]), sizes=torch.Size([n])),
        ]
        info = next(v for k, v in md.storage_data.items() if k.fqn == key)
        md.storage_data[type(next(iter(md.storage_data)))(key, torch.Size([n]))] = info

    _rewrite_metadata(ck2, mutate)
    with CheckpointReader(ck2) as r:
        r.read_tensor(key)  # two chunks pointing at the same (valid) archive: readable
        meta = r.tensor_meta(key)
    # now make a chunk claim a shape the archive does not hold
    ck3 = shutil.copytree(dense_ckpt, tmp_path / "ck3")

    def mutate3(md) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        meta = md.state_dict_metadata[key]
        meta.chunks = [
            ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([meta.size[0] - 1])),
            ChunkStorageMetadata(offsets=torch.Size([meta.size[0] - 1]), sizes=torch.Size([1])),
        ]
        info = next(v for k, v in md.storage_data.items() if k.fqn == key)
        idx_t = type(next(iter(md.storage_data)))
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
        md.storage_data[idx_t(key, torch.Size([0]))] = info
        md.storage_data[idx_t(key, torch.Size([meta.size[0] - 1]))] = info

    _rewrite_metadata(ck3, mutate3)
    with CheckpointReader(ck3) as r, pytest.raises(ChunkError, match="metadata says"):
        r.read_tensor(key)
    del meta


def test_huge_declared_size_refused_before_allocation(tmp_path: Path, dense_ckpt: Path) -> None:
    ck = shutil.copytree(dense_ckpt, tmp_path / "ck")
    key = "model.model.norm.weight"

    def mutate(md) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        meta = md.state_dict_metadata[key]
        meta.size = torch.Size([10**15])
        meta.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([10**15]))]
        info = next(v for k, v in md.storage_data.items() if k.fqn == key)
        idx_t = type(next(iter(md.storage_data)))
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
        md.storage_data[idx_t(key, torch.Size([0]))] = info

    _rewrite_metadata(ck, mutate)
    with CheckpointReader(ck) as r, pytest.raises(AllocationError, match="claims"):
        r.read_tensor(key)


def test_tiling_problems() -> None:
    f32 = DType("float32")
    ok = TensorMeta(f32, (4, 2), (ChunkMeta((0, 0), (2, 2)), ChunkMeta((2, 0), (2, 2)), ChunkMeta((4, 0), (0, 2))))
    assert tiling_problem(ok) is None
    gap = TensorMeta(f32, (4, 2), (ChunkMeta((0, 0), (2, 2)), ChunkMeta((3, 0), (1, 2))))
    assert tiling_problem(gap).startswith("gap")
    overlap = TensorMeta(f32, (4, 2), (ChunkMeta((0, 0), (3, 2)), ChunkMeta((2, 0), (2, 2))))
    assert tiling_problem(overlap).startswith("overlap")
    grid = TensorMeta(f32, (4, 4), tuple(ChunkMeta((i, j), (2, 2)) for i in (0, 2) for j in (0, 2)))
    assert tiling_problem(grid) is None
    grid_gap = TensorMeta(f32, (4, 4), grid.chunks[:3])
    assert tiling_problem(grid_gap).startswith("gap")


def test_allow_list_refuses_foreign_global_and_names_it(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("pwned",))

    with pytest.raises(UnsafePickleError, match="builtins.print"):
        parse_metadata_bytes(pickle.dumps(Evil()))
    with pytest.raises(MetadataError, match="not a DCP Metadata"):
        parse_metadata_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(MetadataError, match="empty"):
        parse_metadata_bytes(b"")


def test_checkpoint_dir_is_torch_free_view(dense_ckpt: Path) -> None:
    cd = CheckpointDir(dense_ckpt)
    assert cd.data_files() == ["__0_0.distcp"]
    assert cd.metadata.version == "1.0.0"


@settings(max_examples=40, deadline=None)
@given(
    src_offset=st.integers(0, 5000),
    dst_offset=st.integers(0, 5000),
    length=st.sampled_from([0, 1, 4095, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 2 * BLOCK_BYTES + 777]),
)
def test_copy_range_equals_slicing(
    tmp_path_factory: pytest.TempPathFactory, src_offset: int, dst_offset: int, length: int
) -> None:
    """Any offsets and lengths across bounce-buffer boundaries; neither file position moves."""
    d = tmp_path_factory.mktemp("copy")
    data = os.urandom(src_offset + length + 13)
    (d / "src").write_bytes(data)
    (d / "dst").write_bytes(b"\xee" * 100)
    with open(d / "src", "rb") as src, open(d / "dst", "r+b") as dst:
        copy_range(src.fileno(), dst.fileno(), src_offset, dst_offset, length)
        assert src.tell() == 0 and dst.tell() == 0
    out = (d / "dst").read_bytes()
    assert out[dst_offset : dst_offset + length] == data[src_offset : src_offset + length]
    assert out[: min(dst_offset, 100)] == b"\xee" * min(dst_offset, 100)  # bytes before the range untouched


def test_copy_range_short_source_raises_eof(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * 10)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        with pytest.raises(EOFError, match="10 bytes short"):
            copy_range(src.fileno(), dst.fileno(), 0, 0, 20)


def test_copy_chunk_of_a_file_truncated_while_open_is_refused(tmp_path: Path, fsdp_ckpt: Path) -> None:
    """The size check passed at open; the file shrank afterwards (another job rewrote it): E300/E301, not a crash."""
    ck = tmp_path / "ck"
    shutil.copytree(fsdp_ckpt, ck)
    key = "model.model.layers.0.odd"
    with CheckpointReader(ck) as r, open(tmp_path / "out", "wb") as out:
        chunk = next(c for c in r.tensor_meta(key).chunks if c.numel)
        info = r.storage_info(key, chunk)
        assert r.copy_chunk_to_file(key, chunk, out.fileno(), 0)
        os.truncate(ck / info.relative_path, info.offset + info.length - 8)
        with pytest.raises((DataFileError, ChunkError), match="__0_0.distcp"):
            r.copy_chunk_to_file(key, chunk, out.fileno(), 0)


def test_saved_tensors_are_described_without_torch(tmp_path: Path) -> None:
    """``tensors="describe"``: RNG-state tensors beside plain values load as (dtype, shape), torch-free."""
    import subprocess

    from ckpttool.format.reader import SavedTensor, load_saved_object

    obj = {"global_step": 7, "torch_rng_state": torch.get_rng_state(), "w": torch.zeros(2, 3, dtype=torch.bfloat16)}
    torch.save(obj, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    got = load_saved_object(data, "x.pt", tensors="describe")
    assert got["global_step"] == 7
    assert got["torch_rng_state"] == SavedTensor("uint8", tuple(obj["torch_rng_state"].shape))
    assert got["w"] == SavedTensor("bfloat16", (2, 3))
    assert torch.equal(load_saved_object(data, "x.pt")["w"], obj["w"])  # default: loaded
    code = (
        "import sys; from ckpttool.format.reader import load_saved_object;"
        f"o = load_saved_object(open({str(tmp_path / 'x.pt')!r}, 'rb').read(), 'x', tensors='describe');"
        "print(o['global_step'], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "False"]


def test_describe_falls_back_to_torch_for_other_globals(tmp_path: Path) -> None:
    from ckpttool.errors import TrustRequiredError
    from ckpttool.format.reader import load_saved_object

    torch.save({"step": 1, "when": __import__("datetime").date(2024, 1, 1)}, tmp_path / "d.pt")
    with pytest.raises(TrustRequiredError):
        load_saved_object((tmp_path / "d.pt").read_bytes(), "d.pt", tensors="describe")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
def test_a_checkpoint_dropped_without_close_gives_its_data_files_back(fsdp_ckpt: Path) -> None:
    """A notebook's ``ck = ckpttool.open_checkpoint(p); ck.reader.read_tensor(k)``, run again and again without
    ``close()``: each dropped handle kept its data file descriptors open for the life of the process (Python's own
    file objects close when collected); a handle no longer referenced closes them."""
    import gc

    import ckpttool

    data = {str((fsdp_ckpt / n).resolve()) for n in os.listdir(fsdp_ckpt) if n.endswith(".distcp")}

    def open_data_files() -> list[str]:
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target in data:
                held.append(target)
        return held

    assert open_data_files() == []
    for _ in range(3):
        ck = ckpttool.open_checkpoint(fsdp_ckpt)
        key = next(iter(ck.catalog.model))
        ck.reader.read_tensor(key)
        assert open_data_files() != []
        del ck
        gc.collect()
        assert open_data_files() == []
    with ckpttool.open_checkpoint(fsdp_ckpt) as ck:  # closed by its block, as before
        ck.reader.read_tensor(key)
    assert ck.closed and open_data_files() == []


def test_a_destination_of_another_shape_or_dtype_is_refused_naming_it(fsdp_ckpt: Path) -> None:
    """``read_tensor(key, out=...)`` filled ``out``'s bytes as they were: an int32 ``out`` came back holding the
    float32 bit patterns, a 64x64 one the 128x32 values, and a smaller or wider one failed the CRC-32 as "the bytes
    changed after they were saved" (E308) on an intact checkpoint. A destination of another shape or dtype is
    ``UsageError`` (E100) naming ``out``; one that fits is filled with torch's values."""
    from ckpttool.errors import UsageError

    ref = torch_load_all(fsdp_ckpt)
    reader = CheckpointReader(fsdp_ckpt)
    try:
        key = next(k for k, v in ref.items() if v.dim() == 2 and v.dtype == torch.float32 and v.numel() > 4)
        meta = reader.tensor_meta(key)
        rows, cols = meta.size
        chunk = next(c for c in meta.chunks if c.numel)
        for bad in (
            torch.empty(rows, cols, dtype=torch.int32),
            torch.empty(rows, cols, dtype=torch.float64),
            torch.empty(cols, rows),
            torch.empty(3),
        ):
            with pytest.raises(UsageError, match=r"`out` is .*, but .* is ") as e:
                reader.read_tensor(key, out=bad)
            assert e.value.code == "E100" and e.value.hint
            with pytest.raises(UsageError, match=r"`out` is .* chunk at "):
                reader.read_chunk(key, chunk, out=bad)
        # no storage (meta) or elements sharing memory (expand): RuntimeError / TypeError tracebacks before
        for bad in (torch.empty(rows, cols, device="meta"), torch.empty(1, cols).expand(rows, cols)):
            with pytest.raises(UsageError, match=r"`out` for .* is (on the meta device|an expanded view)"):
                reader.read_tensor(key, out=bad)
            with pytest.raises(UsageError, match=r"`out` for .* is (on the meta device|an expanded view)"):
                reader.read_chunk(key, chunk, out=bad[: chunk.sizes[0], : chunk.sizes[1]])
        t = torch.empty(cols, rows).t()  # a transposed view of the stored shape: filled in place
        assert reader.read_tensor(key, out=t) is t and torch.equal(t, ref[key])
        out = torch.empty(rows, cols)
        assert reader.read_tensor(key, out=out) is out and torch.equal(out, ref[key])
        part = torch.empty(chunk.sizes)
        assert reader.read_chunk(key, chunk, out=part) is part
        r0, c0 = chunk.offsets
        assert torch.equal(part, ref[key][r0 : r0 + chunk.sizes[0], c0 : c0 + chunk.sizes[1]])
    finally:
        reader.close()
