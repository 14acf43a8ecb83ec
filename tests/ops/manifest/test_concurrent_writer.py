"""A data file written by another process while `manifest`, `manifest --verify` or `diff` reads it.

The writer is the progress hook: it rewrites one byte of a data file in place (as a save over the
same directory, or a copy still running, does) after every byte of the checkpoint was read. The
result built before that write no longer describes the file: no manifest is written, no verdict
given (E300), and the source is otherwise left as it is.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool.errors import ChecksumError, DataFileError
from ckpttool.format import CheckpointReader
from ckpttool.ops.diff import diff_checkpoints
from ckpttool.ops.manifest import ManifestOptions, check_against_manifest, write_manifest

DATA = "__0_0.distcp"


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    state = {"model": {f"layers.{i}.weight": torch.randn(16, 16) for i in range(4)}, "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path / "a"))
    return tmp_path / "a"


def value_byte(ckpt: Path) -> int:
    """The offset in the data file of the first value of ``model.layers.0.weight``."""
    key = "model.layers.0.weight"
    with CheckpointReader(ckpt) as r:
        return int(r.locate(key, r.metadata.entries[key].chunks[0]).data_start)


def writer(ckpt: Path) -> Any:
    """A progress hook that flips a byte of a model value in ``ckpt``'s data file once everything was read."""
    fired = [False]
    path, at = ckpt / DATA, value_byte(ckpt)

    def progress(done: int, total: int) -> None:
        if fired[0] or total == 0 or done < total:
            return
        fired[0] = True
        time.sleep(0.02)  # a later file-system clock tick than the save's own writes
        with path.open("r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))

    return progress, fired


def test_manifest_of_a_file_written_meanwhile_is_not_written(saved: Path) -> None:
    progress, fired = writer(saved)
    with pytest.raises(DataFileError) as err:
        write_manifest(saved, progress=progress)
    assert fired[0]
    assert err.value.code == "E300" and "changed while it was read" in str(err.value)
    assert err.value.path == DATA and err.value.hint
    assert not (saved / "manifest.json").exists()  # no manifest of bytes the file no longer holds
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", DATA]


def test_manifest_verify_of_a_file_written_meanwhile_gives_no_verdict(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    write_manifest(saved, ManifestOptions(out=str(out)))
    progress, fired = writer(saved)
    with pytest.raises(DataFileError) as err:
        check_against_manifest(saved, out, progress=progress)
    assert fired[0] and err.value.code == "E300" and err.value.path == DATA
    # the file as it is now does not match: "matches" would have vouched for bytes it no longer holds
    assert not check_against_manifest(saved, out).ok


def test_diff_with_a_side_written_meanwhile_gives_no_verdict(saved: Path, tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(saved, b)
    progress, fired = writer(b)
    with pytest.raises(DataFileError) as err:
        diff_checkpoints(saved, b, progress=progress)
    assert fired[0] and err.value.code == "E300" and err.value.path == DATA
    with pytest.raises(ChecksumError):  # B as it is now: a value that is not the one saved, never "equal"
        diff_checkpoints(saved, b)


def test_reading_a_checkpoint_left_alone_is_unchanged(saved: Path, tmp_path: Path) -> None:
    res = write_manifest(saved)
    assert res.entries > 0 and check_against_manifest(saved).ok
    assert diff_checkpoints(saved, saved).equal


def test_a_data_file_replaced_by_another_meanwhile_is_named(saved: Path, tmp_path: Path) -> None:
    """A save that writes a new file and renames it over the old name: the bytes read are the old file's."""
    copy = tmp_path / "copy.distcp"
    shutil.copyfile(saved / DATA, copy)

    def progress(done: int, total: int) -> None:
        if total and done == total:
            copy.replace(saved / DATA)

    with pytest.raises(DataFileError) as err:
        write_manifest(saved, progress=progress)
    assert err.value.code == "E300" and "replaced by another file during the run" in str(err.value)
    assert not (saved / "manifest.json").exists()
