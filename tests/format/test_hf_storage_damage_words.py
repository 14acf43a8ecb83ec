"""A checkpoint without ``.metadata`` (a Hugging Face folder written by ``safetensors``, ``HuggingFaceStorageWriter``
output) with a damaged file: every command names that file and what is wrong with it, with its error code and a
fix for it. ``validate`` skipped its other rules as ``.metadata is unusable``, an unreadable index hinted ``restore
.metadata from a good copy``, and chunks whose ``DCP_SHARDING_INFO`` overlap were ``E301`` on the folder with the
hint ``the data file ... does not belong to this .metadata``: a file the folder does not have."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app

runner = CliRunner()


def _hf_folder(out: Path) -> None:
    """``model.safetensors`` as transformers' ``save_pretrained`` writes it (safetensors' ``save_file``)."""
    from safetensors.torch import save_file

    out.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(16, 8, generator=g), "lm_head.weight": torch.randn(16, 8)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _torch_writer(out: Path) -> None:
    """torch's ``HuggingFaceStorageWriter`` (``model-00001-of-00001.safetensors`` + index), one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = {"model.embed_tokens.weight": torch.randn(16, 8), "lm_head.weight": torch.randn(16, 8)}
    with warnings.catch_warnings():  # torch: no process group, saving in one process
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(out)))


def _damage_length(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[:8] = struct.pack("<Q", 10**12)  # the 8-byte header length, past the file
    p.write_bytes(bytes(b))


def _damage_json(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[9] = ord("#")  # the header's first key: no longer JSON
    p.write_bytes(bytes(b))


def _digest(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))}


def _refused(args: list[str], file: Path, words: str, hint: str) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, (args, res.stdout, res.stderr)
    assert res.stderr.splitlines()[-2:] == [f"error: [E200] {file}: {words}", f"hint: {hint}"], res.stderr
    assert ".metadata" not in res.stderr, res.stderr


HEADER_HINT = "the file is damaged or was not written by safetensors / HuggingFaceStorageWriter"


@pytest.mark.parametrize("writer", ["safetensors", "HuggingFaceStorageWriter"])
@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (
            _damage_length,
            "not a valid safetensors file (header length 1000000000000 exceeds the file ({size} bytes) or 100000000 "
            "bytes)",
        ),
        (
            _damage_json,
            "not a valid safetensors file (header is not JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1))",
        ),
    ],
    ids=["length", "json"],
)
def test_a_damaged_safetensors_header_is_named_not_metadata(
    tmp_path: Path, writer: str, damage: object, words: str
) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    (_hf_folder if writer == "safetensors" else _torch_writer)(good)
    shutil.copytree(good, bad)
    name = "model.safetensors" if writer == "safetensors" else "model-00001-of-00001.safetensors"
    damage(bad / name)  # type: ignore[operator]
    words = words.format(size=(bad / name).stat().st_size)
    before = _digest(bad)

    res = runner.invoke(app, ["validate", str(bad), "--json"])
    doc = json.loads(res.stdout)
    assert res.exit_code == 2 and [(f["code"], f["key"], f["error_code"], f["message"]) for f in doc["findings"]] == [
        ("S001", name, "E200", f"{bad / name}: {words}")
    ]
    assert {r["reason"] for r in doc["rules"] if r["status"] == "skipped"} == {f"{name} is unusable"}
    assert ".metadata" not in res.stdout + res.stderr
    text = runner.invoke(app, ["validate", str(bad)], env={"COLUMNS": "300"})
    assert f"skipped ({name} is unusable)" in text.stdout and ".metadata" not in text.stdout + text.stderr

    for args in (["inspect", str(bad)], ["stats", str(bad)], ["diff", str(good), str(bad)]):
        _refused(args, bad / name, words, HEADER_HINT)
    _refused(["export", str(bad), str(tmp_path / "out")], bad / name, words, HEADER_HINT)
    assert not (tmp_path / "out").exists() and _digest(bad) == before


@pytest.mark.parametrize(
    ("index", "words"),
    [
        ("{not json", "not a readable index (JSONDecodeError)"),
        ('{"metadata": {}}', "no weight_map of tensor name -> file name"),
    ],
    ids=["not-json", "no-weight-map"],
)
def test_a_damaged_index_hints_the_index_not_metadata(tmp_path: Path, index: str, words: str) -> None:
    _torch_writer(tmp_path / "ck")
    idx = tmp_path / "ck" / "model.safetensors.index.json"
    idx.write_text(index)
    hint = "the index is damaged: restore model.safetensors.index.json from a good copy (or re-download or re-save the model)"
    for args in (["inspect", str(tmp_path / "ck")], ["stats", str(tmp_path / "ck")]):
        _refused(args, idx, words, hint)
    res = runner.invoke(app, ["validate", str(tmp_path / "ck"), "--json"])
    doc = json.loads(res.stdout)
    assert [(f["code"], f["key"], f["hint"]) for f in doc["findings"]] == [("S001", idx.name, hint)]
    assert {r["reason"] for r in doc["rules"] if r["status"] == "skipped"} == {f"{idx.name} is unusable"}


def test_overlapping_shards_of_torchs_writer_name_the_files_not_metadata(tmp_path: Path, acc_root: Path) -> None:
    """``HuggingFaceStorageWriter(save_distributed=True)`` on 2 FSDP2 ranks, then rank 1's ``DCP_SHARDING_INFO`` of
    the embedding moved one row up (the header rewritten at its length): its two pieces overlap."""
    ck = tmp_path / "ovl"
    shutil.copytree(acc_root / "hf_sharded", ck)
    p = ck / "shard-00002-model-00001-of-00001.safetensors"
    b = p.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info["model.embed_tokens.weight"]["saved_offsets"][0] -= 1
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    p.write_bytes(b[:8] + raw.ljust(n) + b[8 + n :])

    files = "shard-00001-model-00001-of-00001.safetensors, shard-00002-model-00001-of-00001.safetensors"
    for args in (["stats", str(ck)], ["export", str(ck), str(tmp_path / "out")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and res.stderr.splitlines() == [
            f"error: [E301] {ck}: chunks of 'model.embed_tokens.weight' in its safetensors files ({files}) do not "
            "tile the tensor (overlap: chunks overlap at index 31 of dim 0)",
            "hint: the files place the tensor's pieces with a gap or an overlap (a file damaged, or from another "
            "save): copy the checkpoint again or use an earlier one",
        ], res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_a_valid_file_of_a_dtype_ckpttool_does_not_read_is_not_called_damaged(tmp_path: Path, dtype: str) -> None:
    """safetensors' own ``save_file`` writes AMD's FNUZ FP8 (tags ``F8_E4M3FNUZ`` / ``F8_E5M2FNUZ``; ``safe_open``
    reads it back). Every command called the file "not a valid safetensors file" with the hint "the file is damaged or
    was not written by safetensors": now E200 names the tensor and the dtype ckpttool does not read, the file valid."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tmp_path / "fnuz"
    src.mkdir()
    w = torch.arange(12, dtype=torch.uint8).reshape(3, 4).view(getattr(torch, dtype))
    save_file({"l.weight": w, "l.weight_scale_inv": torch.ones(1, 1)}, str(src / "model.safetensors"))
    with safe_open(str(src / "model.safetensors"), "pt") as h:  # the writer's own reader takes it
        assert torch.equal(h.get_tensor("l.weight").view(torch.uint8), w.view(torch.uint8))
    for args in (["inspect", str(src)], ["import", str(src), str(tmp_path / "out")], ["validate", str(src)]):
        res = runner.invoke(app, args, terminal_width=400)
        text = res.stdout + res.stderr
        assert res.exit_code in (1, 2) and "Traceback" not in text, text
        assert "'l.weight' has safetensors dtype F8_E" in text and f"({dtype}), which ckpttool does not read" in text
        assert "damaged" not in text and "not a valid safetensors file" not in text, text
    assert not (tmp_path / "out").exists()
