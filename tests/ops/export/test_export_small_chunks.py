"""Export of many small chunks: batched reads of neighbouring archives (``CheckpointReader.read_small_chunks``).

The checkpoint is written by torch's own ``dcp.save`` (one process: every chunk's archive lies
next to the previous one in ``__0_0.distcp``); the export is compared bitwise with ``dcp.load``
of the same checkpoint, and a damaged or truncated archive inside a batch is reported as the
one-by-one path reports it (nothing written).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool.format import CheckpointReader
from tests.ops.export.test_export import assert_clean_failure, bitwise_equal, export_cli, no_leftovers, read_export

N_SMALL = 300


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(7)
    sd = {f"model.layers.{i}.w": torch.randn(4, 16, generator=g).to(torch.bfloat16) for i in range(N_SMALL)}
    sd["model.big.weight"] = torch.randn(256, 1024, generator=g)  # 1 MiB: copied on its own
    sd["model.small32.bias"] = torch.randn(7, generator=g)
    path = tmp_path_factory.mktemp("small") / "ckpt"
    dcp.save({"model": sd}, checkpoint_id=str(path), no_dist=True)
    return path


def _reference(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as r:
        keys = [k for k in r.metadata.entries if k.startswith("model.")]
        metas = {k: r.tensor_meta(k) for k in keys}
    sd = {k: torch.empty(metas[k].size, dtype=metas[k].dtype.to_torch()) for k in keys}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def test_many_small_chunks_export_bitwise_equal_to_dcp_load(small_ckpt: Path, tmp_path: Path) -> None:
    ref = _reference(small_ckpt)
    out = tmp_path / "hf"
    res = export_cli(str(small_ckpt), str(out), "--workers", "2")
    assert res.exit_code == 0, res.stderr
    tensors, _ = read_export(out)
    assert set(tensors) == {k[len("model.") :] for k in ref}
    for k, t in ref.items():
        assert bitwise_equal(tensors[k[len("model.") :]], t), k


def test_read_small_chunks_reads_each_neighbouring_run_once(small_ckpt: Path) -> None:
    with CheckpointReader(small_ckpt) as r:
        items = [(f"model.model.layers.{i}.w", r.tensor_meta(f"model.model.layers.{i}.w").chunks[0]) for i in range(50)]
        reads: list[int] = []
        orig = os.preadv

        def counting(fd, bufs, offset, *a):  # type: ignore[no-untyped-def]
            reads.append(sum(len(b) for b in bufs))
            return orig(fd, bufs, offset, *a)

        os.preadv = counting
        try:
            got = r.read_small_chunks(items)
        finally:
            os.preadv = orig
        ref = _reference(small_ckpt)
    assert len(reads) == 1  # 50 neighbouring archives, one read
    for (key, _), g in zip(items, got):
        assert g is not None
        assert bytes(g) == ref[key].view(torch.uint8).numpy().tobytes()


def _damaged_copy(src: Path, dst: Path, key: str) -> int:
    import shutil

    shutil.copytree(src, dst)
    with CheckpointReader(dst) as r:
        loc = r.locate(key, r.tensor_meta(key).chunks[0])
        return loc.data_start


def test_a_damaged_chunk_inside_a_batch_fails_its_crc_and_nothing_is_written(small_ckpt: Path, tmp_path: Path) -> None:
    key = "model.model.layers.150.w"
    ckpt = tmp_path / "ckpt"
    at = _damaged_copy(small_ckpt, ckpt, key)
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.seek(at + 3)
        b = f.read(1)
        f.seek(at + 3)
        f.write(bytes([b[0] ^ 0x40]))
    res = export_cli(str(ckpt), str(tmp_path / "hf"))
    assert_clean_failure(res, "E308", key)
    assert not (tmp_path / "hf").exists()
    no_leftovers(tmp_path, "hf")


def test_a_truncated_data_file_inside_a_batch_is_named(small_ckpt: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    at = _damaged_copy(small_ckpt, ckpt, "model.model.layers.200.w")
    os.truncate(ckpt / "__0_0.distcp", at)
    res = export_cli(str(ckpt), str(tmp_path / "hf"))
    assert_clean_failure(res, "E300", "__0_0.distcp")
    assert not (tmp_path / "hf").exists()
    no_leftovers(tmp_path, "hf")
