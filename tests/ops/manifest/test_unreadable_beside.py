"""A file or folder beside a checkpoint's data that this user may not read (chmod 000: another user's job, a
restrictive umask) is named (E300), by ``manifest`` and by ``manifest --verify``.

Before: ``manifest`` of a checkpoint whose ``model_assets/`` could not be listed wrote a manifest without its
files (``sidecars: []``, exit 0: a manifest over files it never read, which later "matched" a folder whose
assets were swapped), ``--verify`` called that folder's files ``missing ... not on disk``, and an unreadable
sidecar or ``extra_state/`` folder was ``E999 internal error: PermissionError``. The permission bits are made to
bind as root by dropping CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (``setpriv``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import xxhash

from tests.fixtures.cache import copy_checkpoint
from tests.fixtures.special_files import run_bound_by_permissions

_run = run_bound_by_permissions


def _tree(d: Path) -> dict[str, str]:
    """sha256 of every file below ``d`` (the source must come out byte-identical)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()}


def _checkpoint(dense_ckpt: Path, tmp_path: Path) -> Path:
    d = copy_checkpoint(dense_ckpt, tmp_path / "c")
    (d / "model_assets").mkdir()
    (d / "model_assets" / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "extra_state").mkdir()
    (d / "extra_state" / "extra_state_rank_0.pt").write_bytes(b"rng state")
    (d / "notes.txt").write_text("run 7\n")
    return d


def _refused(res: subprocess.CompletedProcess[str], named: Path, what: str) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert f"error: [E300] {named}: {what} (Permission denied)" in res.stderr, out
    assert "hint: make it readable by this user" in res.stderr and "Traceback" not in out and "E999" not in out, out


def test_the_readable_checkpoint_verifies_with_sidecar_digests_of_the_bytes(dense_ckpt: Path, tmp_path: Path) -> None:
    d = _checkpoint(dense_ckpt, tmp_path)
    res = _run("manifest", str(d))
    assert res.returncode == 0, res.stderr
    sidecars = {f["file"]: f for f in json.loads((d / "manifest.json").read_text())["sidecars"]}
    assert set(sidecars) == {"extra_state/extra_state_rank_0.pt", "model_assets/tokenizer.json", "notes.txt"}
    for name, f in sidecars.items():
        data = (d / name).read_bytes()
        assert (f["size"], f["digest"]) == (len(data), xxhash.xxh3_128(data).hexdigest())
    res = _run("manifest", str(d), "--verify")
    assert res.returncode == 0 and "matches its manifest" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("locked", ["model_assets", "extra_state"])
def test_a_folder_that_cannot_be_listed_is_named_by_manifest_and_no_manifest_is_written(
    dense_ckpt: Path, tmp_path: Path, locked: str
) -> None:
    d = _checkpoint(dense_ckpt, tmp_path)
    before = _tree(d)
    (d / locked).chmod(0)
    try:
        res = _run("manifest", str(d))
    finally:
        (d / locked).chmod(0o755)
    _refused(res, d / locked, "cannot list the folder")
    assert not (d / "manifest.json").exists()
    assert _tree(d) == before


@pytest.mark.parametrize("locked", ["model_assets", "extra_state"])
def test_a_folder_that_cannot_be_listed_is_named_by_verify_not_called_missing(
    dense_ckpt: Path, tmp_path: Path, locked: str
) -> None:
    d = _checkpoint(dense_ckpt, tmp_path)
    assert _run("manifest", str(d)).returncode == 0
    before = _tree(d)
    (d / locked).chmod(0)
    try:
        res = _run("manifest", str(d), "--verify")
    finally:
        (d / locked).chmod(0o755)
    _refused(res, d / locked, "cannot list the folder")
    assert "not on disk" not in res.stdout + res.stderr
    assert _tree(d) == before


@pytest.mark.parametrize("name", ["notes.txt", "model_assets/tokenizer.json", "extra_state/extra_state_rank_0.pt"])
@pytest.mark.parametrize("verify", [False, True], ids=["manifest", "verify"])
def test_a_file_beside_the_data_that_cannot_be_read_is_named(
    dense_ckpt: Path, tmp_path: Path, name: str, verify: bool
) -> None:
    d = _checkpoint(dense_ckpt, tmp_path)
    if verify:
        assert _run("manifest", str(d)).returncode == 0
    before = _tree(d)
    (d / name).chmod(0)
    try:
        res = _run("manifest", str(d), *(["--verify"] if verify else []))
    finally:
        (d / name).chmod(0o644)
    _refused(res, d / name, "cannot read")
    assert (d / "manifest.json").exists() == verify
    assert _tree(d) == before


def test_a_data_file_that_cannot_be_read_is_no_verdict_not_changed_chunks(fsdp_ckpt: Path, tmp_path: Path) -> None:
    """A rank's data file this user may not read: ``--verify`` listed each of its chunks as ``changed`` (exit 1,
    'differs from its manifest': a checkpoint that was never altered called damaged); now E300 naming the file,
    exit 2, no verdict, and the hint says to make it readable (not 'the checkpoint is incomplete')."""
    d = copy_checkpoint(fsdp_ckpt, tmp_path / "c")
    assert _run("manifest", str(d)).returncode == 0
    before = _tree(d)
    (d / "__1_0.distcp").chmod(0)
    try:
        verify = _run("manifest", str(d), "--verify")
        write = _run("manifest", str(d), "-o", str(tmp_path / "m.json"))
    finally:
        (d / "__1_0.distcp").chmod(0o644)
    for res in (verify, write):
        _refused(res, d / "__1_0.distcp", "cannot open data file")
    assert "changed" not in verify.stdout + verify.stderr and "differs" not in verify.stdout + verify.stderr
    assert not (tmp_path / "m.json").exists() and _tree(d) == before
    assert _run("manifest", str(d), "--verify").returncode == 0


@pytest.mark.parametrize("command", [["manifest", "--verify"], ["inspect"]], ids=["verify", "inspect"])
def test_an_index_that_cannot_be_read_is_named_as_such_not_as_damaged(
    dense_ckpt: Path, tmp_path: Path, command: list[str]
) -> None:
    """A Hugging Face folder's ``model.safetensors.index.json`` this user may not read was 'not a readable index
    (PermissionError)' with the hint that the index is damaged and should be restored or re-downloaded."""
    out = tmp_path / "hf"
    assert _run("export", str(dense_ckpt), str(out), "--shard-size", "4KB", "-q").returncode == 0
    assert _run("manifest", str(out)).returncode == 0
    before = _tree(out)
    index = out / "model.safetensors.index.json"
    index.chmod(0)
    try:
        res = _run(command[0], str(out), *command[1:])
    finally:
        index.chmod(0o644)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"error: [E200] {index}: cannot read (Permission denied)" in res.stderr, res.stderr
    assert "hint: check the file's permissions" in res.stderr and "damaged" not in res.stderr, res.stderr
    assert _tree(out) == before
