"""``HuggingFaceStorageWriter`` checkpoints (safetensors files, no ``.metadata``) read through the format layer.

Real writers: torch's ``HuggingFaceStorageWriter`` on 2 gloo ranks, distributed without and with
consolidation (``acc_root``), and torchtitan's ``last_save_in_hf`` (its Llama3 state-dict adapter,
``titan_root``). Every tensor is compared bitwise with torch's own ``HuggingFaceStorageReader``.
Hostile headers are size-checked and validated before anything is allocated.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from ckpttool.errors import ChunkError, DataFileError, MetadataError, PathEscapeError
from ckpttool.format import CheckpointReader
from ckpttool.format.hf_storage import hf_storage_files, load_hf_storage_metadata
from ckpttool.format.safetensors import MAX_HEADER_BYTES


def torch_reads(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor as torch's HuggingFaceStorageReader + dcp.load read it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    md = reader.read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return sd


def hf_dirs(acc_root: Path, titan_root: Path) -> list[Path]:
    return [acc_root / "hf_sharded", acc_root / "hf_consolidated", titan_root / "llama3_hf" / "checkpoint" / "step-1"]


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1, 2], ids=["distributed", "consolidated", "torchtitan-last_save_in_hf"])
def test_every_tensor_equals_torchs_reader(acc_root: Path, titan_root: Path, which: int) -> None:
    path = hf_dirs(acc_root, titan_root)[which]
    want = torch_reads(path)
    with CheckpointReader(path) as r:
        assert r.metadata.serialization == "safetensors"
        assert set(r.metadata.entries) == set(want)
        for key, t in want.items():
            got = r.read_tensor(key)
            assert got.dtype == t.dtype and torch.equal(got, t), key


@pytest.mark.slow
def test_distributed_save_keeps_each_ranks_chunk(acc_root: Path) -> None:
    md = load_hf_storage_metadata(acc_root / "hf_sharded")
    emb = md.entries["model.embed_tokens.weight"]
    # 2 ranks, FSDP2 Shard(0): two chunks from two shard files (shard-00001-..., shard-00002-...)
    assert len(emb.chunks) == 2 and sorted(c.offsets for c in emb.chunks) == [(0, 0), (32, 0)]
    files = {md.storage[("model.embed_tokens.weight", c.offsets)].relative_path for c in emb.chunks}
    assert files == set(hf_storage_files(acc_root / "hf_sharded"))
    with CheckpointReader(acc_root / "hf_sharded") as r:
        loc = r.locate("model.embed_tokens.weight", emb.chunks[0])
        assert loc.raw and loc.nbytes == loc.info.length  # the window is the chunk's raw bytes


@pytest.mark.slow
def test_consolidated_dir_reads_the_consolidated_files_not_sharded(acc_root: Path) -> None:
    names = hf_storage_files(acc_root / "hf_consolidated")
    assert names and all(n.startswith("model-") for n in names)
    assert (acc_root / "hf_consolidated" / "sharded").is_dir()


# ------------------------------------------------------------------------------------------ hostile files
def _write(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    n = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header + data)


@pytest.mark.parametrize(
    "header,data,length,needle",
    [
        (b"{}", b"", MAX_HEADER_BYTES + 1, "header length"),
        (b"{}", b"", 10**6, "header length"),  # past the end of the file
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', b"\0" * 4, None, "duplicate"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        (b"\xff\xfe", b"", None, "not JSON"),
        (b'{"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, None, "unknown"),
        (b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', b"\0" * 4, None, "malformed"),
        (b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 4]}}', b"\0" * 4, None, "do not hold"),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 4, None, "do not hold"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}', b"\0" * 8, None, "do not hold"),
        (
            b'{"__metadata__": {"DCP_SHARDING_INFO": "{\\"a\\": {\\"saved_offsets\\": [0, 0]}}"}, '
            b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
            b"\0" * 4,
            None,
            "offsets",
        ),
        (b'{"__metadata__": {"x": 1}}', b"", None, "string map"),
        (  # two tensors sharing bytes (the safetensors library refuses it: "invalid offset")
            b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            b'"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}',
            b"\0" * 12,
            None,
            "overlap",
        ),
    ],
)
def test_malformed_headers_are_refused_naming_the_file(
    tmp_path: Path, header: bytes, data: bytes, length: int | None, needle: str
) -> None:
    _write(tmp_path / "model-00001-of-00001.safetensors", header, data, length)
    with pytest.raises(MetadataError) as ei:
        CheckpointReader(tmp_path)
    assert ei.value.code == "E200" and needle in ei.value.message and "model-00001-of-00001" in ei.value.message


def test_same_chunk_in_two_files_is_refused(tmp_path: Path) -> None:
    h = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    _write(tmp_path / "model-00001-of-00002.safetensors", h, b"\0" * 4)
    _write(tmp_path / "model-00002-of-00002.safetensors", h, b"\0" * 4)
    with pytest.raises(MetadataError, match="stored in two files"):
        CheckpointReader(tmp_path)


def test_symlink_outside_is_refused_at_open(tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    _write(outside, json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4)
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(outside, ck / "model-00001-of-00001.safetensors")
    with pytest.raises(PathEscapeError, match="resolves outside"):  # its header is not read either
        CheckpointReader(ck)


def test_file_shrunk_after_open_is_a_data_file_error(tmp_path: Path) -> None:
    h = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    p = tmp_path / "model-00001-of-00001.safetensors"
    _write(p, h, b"\0" * 16)
    with CheckpointReader(tmp_path) as r:
        os.truncate(p, p.stat().st_size - 8)
        with pytest.raises(DataFileError):
            r.read_tensor("a")


def test_window_that_disagrees_with_the_chunk_is_a_chunk_error(tmp_path: Path) -> None:
    from ckpttool.format.locator import locate_chunk
    from ckpttool.format.metadata import CheckpointMetadata

    h = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    _write(tmp_path / "model-00001-of-00001.safetensors", h, b"\0" * 16)
    with CheckpointReader(tmp_path) as r:
        md = r.metadata
        key = ("a", (0,))
        forged = CheckpointMetadata(md.entries, {key: md.storage[key]._replace(length=8)}, serialization="safetensors")
        r.metadata = forged
        with pytest.raises(ChunkError, match="needs 16"):
            locate_chunk(r, "a", md.entries["a"].chunks[0])  # type: ignore[union-attr]
